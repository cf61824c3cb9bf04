"""The fp8 expert-parallel dispatch wire format (`ParallelConfig.dispatch_dtype="fp8"`).

Token rows travel as float8_e4m3fn with one f32 scale per 128 channels (as DeepEP's fp8
dispatch) and are dequantized on arrival, so bf16 experts run unchanged; the combine stays in
the activation dtype. Experts that take fp8 activations of their own scheme skip this and
receive their own quantized rows instead (`sharding.prepare_finalize`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DISPATCH_DTYPE = jnp.float8_e4m3fn
FP8_DISPATCH_BLOCK = 128  # channels per scale (DeepEP's fp8 dispatch granularity)


def _dispatch_block(h: int) -> int:
  return FP8_DISPATCH_BLOCK if h % FP8_DISPATCH_BLOCK == 0 else h


@jax.custom_vjp
def quantize_rows_fp8(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """a [..., H] -> (q [..., H] float8_e4m3fn, scale [..., H / 128] f32), one scale per 128
  channels (per row when H is not a multiple of 128): scale = max |a| / 448, so every block
  uses e4m3's full range; an all-zero block gets scale 1. a ~= q * scale.

  Forward only: differentiating with respect to `a` raises at trace time (the transposed
  dispatch would carry the gradient in fp8 without scales, and the packed wire is bytes). The
  check sits in the forward rule, which JAX runs only when `a` is being differentiated: the
  dispatch packs q into uint8 rows, whose zero cotangent would never reach a backward rule."""
  return _quantize_rows_fp8(a)


def _quantize_rows_fp8(a):
  h = a.shape[-1]
  b = _dispatch_block(h)
  blocks = a.astype(jnp.float32).reshape(a.shape[:-1] + (h // b, b))
  amax = jnp.max(jnp.abs(blocks), axis=-1)
  fmax = float(jnp.finfo(FP8_DISPATCH_DTYPE).max)
  scale = jnp.where(amax > 0, amax / fmax, 1.0)
  q = jnp.clip(blocks / scale[..., None], -fmax, fmax).astype(FP8_DISPATCH_DTYPE)
  return q.reshape(a.shape), scale


def _quantize_rows_fp8_fwd(a):
  raise ValueError("dispatch_dtype='fp8' (ParallelConfig) is a forward-only dispatch format: "
                   "train with dispatch_dtype=None")


def _quantize_rows_fp8_bwd(_, __):  # pragma: no cover (the forward rule raises first)
  raise AssertionError("unreachable")


quantize_rows_fp8.defvjp(_quantize_rows_fp8_fwd, _quantize_rows_fp8_bwd)


def dequantize_rows_fp8(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """The inverse of `quantize_rows_fp8`: q [..., H], scale [..., H / block] -> [..., H]."""
  h = q.shape[-1]
  nb = scale.shape[-1]
  if h % nb:
    raise ValueError(f"scale has {nb} blocks, which do not divide H={h}")
  blocks = q.astype(jnp.float32).reshape(q.shape[:-1] + (nb, h // nb)) * scale[..., None]
  return blocks.reshape(q.shape).astype(dtype)
