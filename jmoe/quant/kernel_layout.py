"""`prepare_for_kernels`: quantized weights with the Pallas kernels' derived operands made
once, after loading (vLLM's `process_weights_after_loading`), instead of on every call.

The weight-only prefill GEMMs read scales in another layout or dtype than checkpoints store
them (group-major for one TMA box a K step; int4's and nvfp4's as copies in the token dtype,
nvfp4's global scale folded in; mxfp4 with fp8 tokens as exponent shifts). Without this, each
jitted call makes them again from the stored arrays: on deepseek-v3 at 4096 tokens about
1.1 ms a call for nvfp4 and 0.2-0.3 ms for mxfp4 (H200). The prepared arrays
(`QuantizedWeights.prepared`) sit beside the stored ones, which stay as loaded (the decode
kernels read those), and cost their own memory: for nvfp4 a bf16 copy of the scales (a
quarter of the codes' bytes), for mxfp4 and int4 the scales' size again.
"""
from __future__ import annotations

import jax.numpy as jnp

from jmoe.quant.weights import QuantizedWeights, check_quantized


def prepare_for_kernels(w13: QuantizedWeights, w2: QuantizedWeights, *,
                        activation: str = "silu",
                        dtype=jnp.bfloat16) -> tuple[QuantizedWeights, QuantizedWeights]:
  """w13 / w2 (QuantizedWeights of one scheme, logical [E, H, 2N] / [E, N, H]) with the
  operands the Pallas kernels would make from them on every call kept on them
  (`.prepared`), for an MoE of this activation whose tokens are of `dtype`. Schemes whose
  kernels read the stored arrays as they are (the W8A8 schemes) come back unchanged. Call it
  once after loading, and again after changing values or scales (a kernel refuses prepared
  operands whose shapes no longer match; it cannot see changed contents). Works on sharded
  weights (the operands shard over the expert axis like the values)."""
  from jmoe.experts.pallas import runs_weight_only  # noqa: PLC0415
  from jmoe.kernels.moe import prepare_weight_only  # noqa: PLC0415
  for name, w in (("w13", w13), ("w2", w2)):
    if not isinstance(w, QuantizedWeights):
      raise TypeError(f"{name} must be jmoe.quant.QuantizedWeights, got {type(w).__name__}")
    check_quantized(w, argname=name)
  if w13.scheme != w2.scheme:
    raise ValueError(f"w13 and w2 must share one scheme, got {w13.scheme.name} and "
                     f"{w2.scheme.name}")
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"dtype: the tokens' dtype, bfloat16 or float16, got {jnp.dtype(dtype)}")
  if not runs_weight_only(w13.scheme):
    return w13, w2
  return prepare_weight_only(w13, w2, activation=activation, token_dtype=dtype)
