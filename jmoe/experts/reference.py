"""Dense float32 reference experts: every token through every expert, then pick the slots.

O(T·E) work: for tests and small CPU benchmarks only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.experts._common import (check_weights_for_activation, dense_operands,
                                  requantize_intermediate, xla_quant_support)
from jmoe.modular import ActivationFormat, Contiguous, Experts, local_expert_ids

_HI = jax.lax.Precision.HIGHEST


class ReferenceExperts(Experts):
  name = "reference"
  activation_formats = (ActivationFormat.Standard, ActivationFormat.Standard)

  def finalize_weight_and_reduce_impl(self):
    return Contiguous()

  def quant_support(self, quant):
    return xla_quant_support(quant)

  def apply(self, inp, weights, *, activation, expert_map, out_dtype):
    check_weights_for_activation(weights, activation)
    quantized = weights
    a, weights = dense_operands(inp.a, inp.a_scale, weights, jnp.float32)
    e = weights.num_experts
    local = local_expert_ids(inp.topk_ids, e, expert_map)  # [T, k]
    valid = local < e
    # rows without a local slot are zeros: an EP receive buffer leaves them unwritten (NaN
    # possible), and the dense weight gradient below would multiply them by 0
    x = jnp.where(jnp.any(valid, axis=1)[:, None], a.astype(jnp.float32), 0.0)
    h = jnp.einsum("th,ehn->ten", x, weights.w13.astype(jnp.float32), precision=_HI)
    if weights.w13_bias is not None:
      h = h + weights.w13_bias.astype(jnp.float32)[None]
    act = requantize_intermediate(activation(h), quantized)
    y = jnp.einsum("ten,enh->teh", act, weights.w2.astype(jnp.float32), precision=_HI)
    if weights.w2_bias is not None:
      y = y + weights.w2_bias.astype(jnp.float32)[None]
    per_slot = jnp.take_along_axis(y, jnp.clip(local, 0, e - 1)[..., None], axis=1)
    return jnp.where(valid[..., None], per_slot, 0.0)  # [T, k, H] f32
