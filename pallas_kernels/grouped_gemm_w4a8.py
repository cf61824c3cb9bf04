"""The fp8-token grouped GEMM over mxfp4 codes for prefill (mxfp4_fp8): e2m1 codes converted
to e4m3 in the kernel, 8-bit wgmma (twice bf16's rate), no dequantized copy of the experts.

    out[r] = act(acc[r] * a_scale[r] * w_scale[e, :] + bias[e]) * row_scale[r]
    acc[r] = sum_k x_q[r, k] * c[e, :, k]      (e: row r's expert; f32 accumulation)

x_q: prepare's fp8 token rows (one scale a_scale per row), sorted by expert as in
grouped_gemm; c: the codes' values with their e8m0 group scales folded in exactly
(`jmoe.kernels.e2m1.e4m3_shifted_tile`): per weight row (output column n) ref = its largest
scale exponent, a group of exponent e converts to value * 2^(e - ref + 6), and w_scale[e, n] =
2^(ref - 127 - 6) multiplies the accumulator column. Every e2m1 value times a power of two
within the row's 12 exponents is an e4m3 number, so only groups 2^12 below their row's
largest lose bits (their +-0.5 codes flush at 2^-12, the whole group below): the GEMM is the
mxfp4 x fp8 product, without the per-K-step promotion (second accumulator) DeepGEMM's
block scales need.

The kernel is grouped_gemm_ws' warp-specialized family with this module's `CONVERSION`: each
compute warpgroup loads its codes from shared memory into registers and converts them there
(`e4m3_shifted_tile`: one table permute chain per 4 codes, the group's exponent added to the
bytes), and that register tile is the 8-bit wgmma's A operand, the token tile (K-major) its B,
so the converted weights never touch shared memory (a first form stored them there as B and
re-read them: mixtral GEMM2 455 TFLOP/s against this form's 770-800 on the H200); a_scale
(per token) and w_scale (per weight column) multiply the accumulator. Experts with the rows
take 256-token tiles (GEMM1 then splits gate and up over the two warpgroups:
`W4A8Config.split_gate_up`).

GEMM1 (gated, every activation, biases) and GEMM2 (router weight as row_scale, or applied by
the caller's gather-sum) are the same kernel. Sizes: K a multiple of 128 and of the group (32),
the output columns a multiple of the tile's (128 gated, 128 or 256 ungated).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jmoe.kernels import grouped_gemm_ws as ws
from jmoe.kernels.activations import Activation
from jmoe.kernels.decode_wq import _codes
from jmoe.kernels.e2m1 import (SHIFT_BIAS, e4m3_shift_bytes, e4m3_shifted_tile,
                               e4m3_shifted_values)
from jmoe.kernels.grouped_gemm_q8 import row_scale_vector
from jmoe.kernels.prepared import Operand, operand
from jmoe.quant.packing import view_4bit

BK = ws.BK  # the K step: one 128-byte swizzle row of fp8 tokens
GROUP = 32  # mxfp4's scale group along K
FP8 = jnp.dtype(jnp.float8_e4m3fn)
_E8M0_BIAS = 127


def _e4m3_tiles(codes, sides, emulate: bool) -> list:
  """A code ref [R, 128] and its shift bytes [4, R] -> the one e4m3 A tile [R, 128]."""
  (shifts,) = sides
  return [e4m3_shifted_tile(codes[...], shifts, group=GROUP, interpret=emulate)]


CONVERSION = ws.Conversion("w4a8", FP8, ((BK // GROUP, jnp.uint8),), BK, _e4m3_tiles,
                           per_token=True, per_column=True)
W4A8Config = ws.WSConfig  # (the family's config: block_m, block_n, num_stages, split_gate_up)
SPLIT_ROWS = ws.SPLIT_ROWS
acc_registers = ws.acc_registers


def default_config(n_out: int, gated: bool, rows_per_expert: float = 0) -> W4A8Config:
  """`grouped_gemm_ws.default_config` for this conversion."""
  return ws.default_config(n_out, gated, CONVERSION, rows_per_expert)


def fit_stages(cfg: W4A8Config, n_rhs: int, out_bytes: int = 2) -> W4A8Config:
  """cfg with the ring lowered until shared memory holds it (at least 2 slots)."""
  return ws.fit_stages(cfg, CONVERSION, n_rhs, out_bytes)


def _mx_shifts(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """mxfp4 scales float8_e8m0fnu [E, N, K/32] -> (each group's shift e - ref + SHIFT_BIAS
  int32 [E, N, K/32], w_scale float32 [E, N] = 2^(ref - 127 - SHIFT_BIAS)), ref each row's
  largest exponent."""
  ex = lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32)
  ref = jnp.max(ex, axis=2)
  w_scale = jnp.exp2((ref - _E8M0_BIAS - SHIFT_BIAS).astype(jnp.float32))
  return ex - ref[:, :, None] + SHIFT_BIAS, w_scale


def mx_shift_bytes(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """mxfp4 scales [E, N, K/32] -> (the kernel's shift bytes uint8 [E, K/32, N], a step's
  bytes one TMA box; w_scale float32 [E, N]): `_mx_shifts`' through `e4m3_shift_bytes`,
  computed on the scale bytes transposed first (the byte transpose, then one elementwise
  pass, rather than int32 shifts transposed)."""
  ex = jnp.swapaxes(lax.bitcast_convert_type(scale, jnp.uint8), 1, 2).astype(jnp.int32)
  ref = jnp.max(ex, axis=1)  # [E, N]
  w_scale = jnp.exp2((ref - _E8M0_BIAS - SHIFT_BIAS).astype(jnp.float32))
  return e4m3_shift_bytes(ex - ref[:, None, :] + SHIFT_BIAS), w_scale


# the kernel's weight-derived operands (jmoe.kernels.prepared: kept where prepared)
# (both from one mx_shift_bytes; XLA computes it once where both are made in one call)
OPERANDS = (Operand("w4a8.shifts", lambda w: mx_shift_bytes(w.scale)[0]),
            Operand("w4a8.w_scale", lambda w: mx_shift_bytes(w.scale)[1]))


def fp8_codes(values: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The kernel's operands in jnp (the reference): packed e2m1 codes uint8 [E, N, K/2] and
  their e8m0 scales [E, N, K/32] -> (the e4m3 values the kernel multiplies [E, N, K] float32,
  w_scale [E, N]); values * w_scale[..., None] is mxfp4's dequantization up to the flushed
  groups."""
  e, n, half = values.shape
  codes = view_4bit(values).reshape(e, n, 2 * half)
  shift, w_scale = _mx_shifts(scale)
  return e4m3_shifted_values(codes, jnp.repeat(shift, GROUP, axis=2)), w_scale


def unsupported(k: int, n_out: int, w) -> str | None:
  """Why the kernel cannot take weights w (QuantizedWeights, logical [E, K, N_total]) with
  n_out output columns (None: it can): mxfp4 codes (e8m0 scales per 32), K-major, K a
  multiple of 128 and N_out of 128."""
  q = w.scheme
  if q is None or q.weight_dtype != "float4_e2m1fn" or q.scale_dtype != "float8_e8m0fnu":
    return f"{q}: the fp8-token prefill GEMM takes mxfp4 codes (e8m0 scales)"
  if q.group_size != GROUP or not w.k_major or w.perm is not None:
    return f"{q.name}: groups of {GROUP} along K, K-major values, no act-order"
  if k % BK or n_out % 128:
    return f"K={k} must be a multiple of {BK} and N={n_out} of 128"
  return None


def w4a8_run(lhs: jax.Array, w, a_scale: jax.Array, *, meta, act: Activation | None,
             gated: bool, bias: jax.Array | None = None, row_scale: jax.Array | None = None,
             out_dtype=jnp.bfloat16, config: W4A8Config | None = None,
             interpret: Any = False) -> jax.Array:
  """The kernel on sorted rows: lhs [m_pad, K] fp8 (the rows `meta` = tile_metadata(..,
  config.block_m) was built for; m_pad >= block_m), w mxfp4 QuantizedWeights (values
  [E, N_total, K/2]), a_scale [m_pad] f32 (the rows' token scales), bias [E, N_total] f32,
  row_scale [m_pad]. -> [m_pad, N_out] out_dtype (rows outside the tasks unwritten)."""
  k = lhs.shape[1]
  n_total = w.values.shape[1]
  n_out = n_total // 2 if gated else n_total
  why = unsupported(k, n_out, w)
  if why is not None:
    raise ValueError(f"w4a8_run: {why}")
  kern = ws.call_kernel(CONVERSION, config or default_config(n_out, gated), lhs=lhs,
                        n_total=n_total, gated=gated, act=act, out_dtype=out_dtype,
                        has_bias=bias is not None, has_scale=row_scale is not None,
                        interpret=interpret)
  codes = _codes(w, jnp.dtype(jnp.int4))
  shifts, w_scale = (operand(w, op) for op in OPERANDS)
  args = ws.task_args(meta, lhs, codes) + [shifts, a_scale.astype(jnp.float32), w_scale]
  return kern(*args, *ws.epilogue_args(row_scale, bias))


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "config", "interpret"))
def grouped_gemm_w4a8(lhs: jax.Array, w, group_sizes: jax.Array, a_scale: jax.Array, *,
                      activation: Activation | str | None = None,
                      bias: jax.Array | None = None, row_scale: jax.Array | None = None,
                      out_dtype=jnp.bfloat16, config: W4A8Config | None = None,
                      interpret: Any = False) -> jax.Array:
  """fp8 tokens x mxfp4 experts, grouped: out[r] = act((x_q[r] @ dq(w[g(r)])) * a_scale[r] +
  bias[g(r)]) * row_scale[r]. lhs [M, K] float8_e4m3fn sorted by group, w mxfp4
  QuantizedWeights (logical [E, K, N_total], K-major), group_sizes [E], a_scale [M, 1] / [M]
  / [1, 1] f32, bias [E, N_total], row_scale [M]. -> [M, N_out] out_dtype (N_out = N_total / 2
  with a gated activation). Rows past sum(group_sizes) are unwritten."""
  if lhs.ndim != 2 or jnp.dtype(lhs.dtype) != FP8:
    raise ValueError(f"lhs must be float8_e4m3fn [M, K], got {lhs.dtype} {lhs.shape}")
  run = functools.partial(w4a8_run, out_dtype=out_dtype, interpret=interpret)
  return ws.grouped_call(run, lhs, w, group_sizes, activation=activation, bias=bias,
                         row_scale=row_scale, config=config, default=default_config,
                         row_args=(row_scale_vector(a_scale, lhs.shape[0]),))
