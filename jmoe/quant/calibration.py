"""Static activation scales from calibration data (schemes with act_scale="static_tensor").

A static scheme quantizes each GEMM's input with one scale fixed before the call, as vLLM's fp8
checkpoints with `activation_scheme: "static"` do (their per-expert `input_scale`s, reduced to
one per GEMM by the max). Checkpoints bring the scales (`jmoe.interop.hf`); for weights you
quantize yourself, `calibrate_input_scales` observes the largest |value| entering each GEMM on
sample tokens routed as in use (the unquantized block, as calibration tools run it; GEMM1 in
the weights' dtype with float32 accumulation), and maps it onto the activation type's largest
finite value:

    s13, s2 = jmoe.quant.calibrate_input_scales(x, w13, w2, topk_ids, "fp8_tensor_static")
    w13q = jmoe.quant.quantize_weights(w13, "fp8_tensor_static", input_scale=s13)
    w2q = jmoe.quant.quantize_weights(w2, "fp8_tensor_static", input_scale=s2)

Values past the calibrated range saturate (e4m3: +-448; int8: +-127), never NaN.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jmoe.config import QuantConfig
from jmoe.kernels.activations import Activation, as_activation
from jmoe.quant.weights import QMAX, QuantizedWeights, dequantize


def calibrate_input_scales(x: jax.Array, w13, w2, topk_ids: jax.Array,
                           scheme: "QuantConfig | str", *,
                           activation: "Activation | str" = "silu",
                           w13_bias: Optional[jax.Array] = None,
                           margin: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """The static input scales of GEMM1 and GEMM2 on calibration tokens.

  x [T, H] calibration tokens; w13 [E, H, 2N] (gated) / [E, H, N] and w2 [E, N, H], dense or
  QuantizedWeights (w13 dequantized to bf16 here: the scales then see the stored weights; w2
  only fixes the shapes); topk_ids [T, k] the experts each token goes to (-1: none); margin
  >= 1 widens the observed range (headroom for tokens beyond the sample). Returns (s13, s2), float32 [1] each: max |x| over
  the routed tokens, and max |act(x @ w13[e] + b)| over the routed slots, each times margin /
  the largest finite value of the scheme's activation type.
  """
  if isinstance(scheme, str):
    scheme = QuantConfig(scheme)
  if not isinstance(scheme, QuantConfig) or scheme.act_dtype is None:
    raise ValueError(f"scheme must quantize activations to calibrate their scales, got "
                     f"{scheme!r}")
  if getattr(x, "ndim", None) != 2 or getattr(topk_ids, "ndim", None) != 2 \
      or topk_ids.shape[0] != x.shape[0]:
    raise ValueError(f"x must be [T, H] and topk_ids [T, k] with the same T, got shapes "
                     f"{getattr(x, 'shape', None)} and {getattr(topk_ids, 'shape', None)}")
  if not margin >= 1.0:
    raise ValueError(f"margin must be >= 1 (headroom over the observed range), got {margin}")
  act = as_activation(activation)
  if w13.shape[1] != x.shape[1] or w2.shape[0] != w13.shape[0]:
    raise ValueError(f"w13 {w13.shape} / w2 {w2.shape} do not fit x {x.shape} ([E, H, *] and "
                     "[E, N, H])")
  # GEMM1 in the weights' own dtype (bf16 weights stay bf16: an amax needs no f32 copy of a
  # large model's experts), accumulated in f32; quantized weights dequantized to bf16
  d13 = dequantize(w13, jnp.bfloat16) if isinstance(w13, QuantizedWeights) else jnp.asarray(w13)
  amax1, amax2 = _observed_ranges(x, d13, w13_bias, topk_ids.astype(jnp.int32), act)
  qmax = QMAX[scheme.act_dtype]
  to_scale = lambda a: (jnp.where(a > 0, a, 1.0) * margin / qmax).reshape(1)  # noqa: E731
  return to_scale(amax1), to_scale(amax2)


@jax.jit(static_argnums=(4,))
def _observed_ranges(x, w13, b13, topk_ids, act):
  """(max |x| over routed tokens, max |act(GEMM1)| over routed slots), float32 scalars.

  One expert at a time over every token, masked to its routed ones (lax.map: memory of one
  [T, 2N] product; XLA's GPU ragged_dot would expand densely over all experts at once)."""
  e = w13.shape[0]
  routed = jnp.any(topk_ids[:, :, None] == jnp.arange(e, dtype=topk_ids.dtype), axis=1)  # [T, E]
  xf = x.astype(jnp.float32)
  amax1 = jnp.max(jnp.where(jnp.any(routed, axis=1, keepdims=True), jnp.abs(xf), 0.0))
  bias = jnp.zeros((e, w13.shape[2]), jnp.float32) if b13 is None else b13.astype(jnp.float32)
  xw = x.astype(w13.dtype)

  def expert_amax(args):
    w, b, mask = args
    h = act(jnp.dot(xw, w, preferred_element_type=jnp.float32) + b)
    return jnp.max(jnp.where(mask[:, None], jnp.abs(h), 0.0))

  amax2 = jnp.max(jax.lax.map(expert_amax, (w13, bias, routed.T)))
  return amax1, amax2
