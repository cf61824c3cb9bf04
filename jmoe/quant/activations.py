"""Activation quantization: the input of GEMM1 (in `prepare`) and of GEMM2 (the activation's
output, between the GEMMs).

Scales are float32, laid out as the GEMMs read them, row-major beside the rows:
  dynamic_token   a [M, H] -> scale [M, 1]
  dynamic_group   a [M, H] -> scale [M, H / g]   (g = act_group_size, 128 for fp8_block)
  dynamic_tensor  a [M, H] -> scale [1, 1]       (max |a| over the whole call)
  static_tensor   a [M, H] -> scale [1, 1]       (the checkpoint's calibrated input_scale)
so `a ~= q * broadcast(scale)` and a row's scales travel with the row (gathers, dispatch).
The microscaling schemes (scale_dtype float8_e8m0fnu: mxfp8) scale activations by powers of
two, as OCP MX does (the smallest 2^e with max |a| / 2^e <= the type's max; float32 values).
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from jmoe.config import QuantConfig, pallas_interpret_from_env
from jmoe.quant.weights import QMAX, e8m0_scale

# dynamic scales constant along K (one per row, or one per call): a GEMM applies them once,
# after its contraction -- what the Pallas 8-bit decode kernels take
ROW_SCALES = ("dynamic_token", "dynamic_tensor")
# ... and with the static per-tensor scale: every activation scale a W8A8 GEMM applies after
# its contraction (the 8-bit grouped GEMMs and decode_q8 take these)
K_CONSTANT_SCALES = (*ROW_SCALES, "static_tensor")


def act_scale_shape(quant: QuantConfig, rows_shape: tuple[int, ...], h: int) -> tuple[int, ...]:
  """The scale's shape for rows [..., H] under `quant`."""
  if quant.act_scale == "dynamic_token":
    return (*rows_shape, 1)
  if quant.act_scale == "dynamic_group":
    return (*rows_shape, h // quant.act_group_size)
  return (1,) * (len(rows_shape) + 1)


def check_act_groups(quant: QuantConfig, h: int, *, argname: str) -> None:
  if quant.act_scale == "dynamic_group" and h % quant.act_group_size:
    raise ValueError(f"{argname}: {quant.name} quantizes activations in groups of "
                     f"{quant.act_group_size} channels, which do not divide its width {h}")


def quantize_activations(a: jax.Array, quant: Optional[QuantConfig], *,
                         static_scale: Optional[jax.Array] = None
                         ) -> tuple[jax.Array, Optional[jax.Array]]:
  """a [..., H] -> (q [..., H] in quant.act_dtype, scale f32 (see the module docstring)).

  The identity (scale None) when unquantized or weight-only. Values are clamped to the type's
  range (|x| > 448 saturates in e4m3, never NaN); an all-zero row or group gets scale 1.
  """
  if quant is None or not quant.is_quantized or quant.act_dtype is None:
    return a, None
  h = a.shape[-1]
  check_act_groups(quant, h, argname="activations")
  if _rows_kernel_applies(a, quant):
    return _quantize_by_kernel(a, quant)
  qmax = QMAX[quant.act_dtype]
  x = a.astype(jnp.float32)
  if quant.static_activations:
    if static_scale is None:
      raise ValueError(f"{quant.name} with act_scale='static_tensor' needs the calibrated "
                       "input_scale (QuantizedWeights.input_scale)")
    scale = jnp.reshape(static_scale.astype(jnp.float32), (1,) * a.ndim)
  else:
    if quant.act_scale == "dynamic_group":
      g = quant.act_group_size
      amax = jnp.max(jnp.abs(x.reshape(*x.shape[:-1], h // g, g)), axis=-1)
    elif quant.act_scale == "dynamic_token":
      amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    else:  # dynamic_tensor
      amax = jnp.max(jnp.abs(x)).reshape((1,) * a.ndim)
    if quant.scale_dtype == "float8_e8m0fnu":  # MX: power-of-two scales, as the weights'
      scale = e8m0_scale(amax, qmax)
    else:
      scale = jnp.where(amax > 0, amax / qmax, 1.0)
  q = x / broadcast_act_scale(scale, h)
  if quant.act_dtype == "int8":
    q = jnp.round(q)
  q = jnp.clip(q, -qmax, qmax).astype(jnp.dtype(quant.act_dtype))
  return q, scale


# Dynamic per-row / per-group scales on a GPU run as one kernel (jmoe.kernels.quant_rows:
# XLA reads the rows twice, a reduction then the convert). False: always the jnp form below.
ROWS_KERNEL = True


def _rows_kernel_applies(a: jax.Array, quant: QuantConfig) -> bool:
  """Whether quant_rows quantizes a: dynamic per-token or per-group scales, the default
  device an NVIDIA GPU of compute capability 8.9 or more (Triton's e4m3 casts; an A100 keeps
  the jnp form) or the kernels interpreted (JMOE_PALLAS_INTERPRET=1, CPU tests), its Triton
  lowering importable and the shape taken."""
  if not ROWS_KERNEL or quant.act_scale not in ("dynamic_token", "dynamic_group"):
    return False
  if not pallas_interpret_from_env():
    from jmoe.oracle import platform_info  # noqa: PLC0415
    platform, cc, _ = platform_info()
    if platform != "gpu" or cc is None or cc < (8, 9):
      return False
  from jmoe.kernels import quant_rows  # noqa: PLC0415  (kernels import this package)
  return quant_rows.available() and quant_rows.scheme_supports(
      math.prod(a.shape[:-1]), a.shape[-1], quant)


def _quantize_by_kernel(a: jax.Array, quant: QuantConfig) -> tuple[jax.Array, jax.Array]:
  from jmoe.kernels import quant_rows  # noqa: PLC0415
  lead, h = a.shape[:-1], a.shape[-1]
  q, scale = quant_rows.quantize_scheme(a.reshape(-1, h), quant,
                                        interpret=pallas_interpret_from_env())
  return q.reshape(*lead, h), scale.reshape(*lead, scale.shape[-1])


def broadcast_act_scale(scale: jax.Array, h: int) -> jax.Array:
  """scale [..., G] -> [..., H] (each group's scale over its channels)."""
  g = scale.shape[-1]
  return scale if g in (1, h) else jnp.repeat(scale, h // g, axis=-1)


def dequantize_activations(q: jax.Array, scale: Optional[jax.Array], dtype=jnp.float32
                           ) -> jax.Array:
  """The inverse of `quantize_activations`: q [..., H] * scale -> [..., H] in `dtype`."""
  if scale is None:
    return q.astype(dtype)
  return (q.astype(jnp.float32) * broadcast_act_scale(scale.astype(jnp.float32),
                                                      q.shape[-1])).astype(dtype)


def fake_quantize(a: jax.Array, quant: Optional[QuantConfig], *,
                  static_scale: Optional[jax.Array] = None) -> jax.Array:
  """quantize then dequantize (f32): the values a quantized GEMM sees, for the references."""
  q, scale = quantize_activations(a, quant, static_scale=static_scale)
  return dequantize_activations(q, scale, jnp.float32) if scale is not None else a
