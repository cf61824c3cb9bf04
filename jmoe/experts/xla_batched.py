"""Batched-format experts: einsums over `[E, C, H]`, rows past `expert_num_tokens` masked."""
from __future__ import annotations

import jax.numpy as jnp

from jmoe.experts._common import (check_weights_for_activation, dense_operands,
                                  requantize_intermediate, xla_quant_support)
from jmoe.modular import BatchedExperts


class XlaBatchedExperts(BatchedExperts):
  name = "xla_batched"

  def quant_support(self, quant):
    return xla_quant_support(quant)

  def apply(self, inp, weights, *, activation, expert_map, out_dtype):
    check_weights_for_activation(weights, activation)
    quantized = weights
    a, weights = dense_operands(inp.a, inp.a_scale, weights, out_dtype)
    cdt = jnp.result_type(a.dtype, weights.w13.dtype)
    h = jnp.einsum("ech,ehn->ecn", a.astype(cdt), weights.w13.astype(cdt),
                   preferred_element_type=jnp.float32)
    if weights.w13_bias is not None:
      h = h + weights.w13_bias.astype(jnp.float32)[:, None, :]
    act = requantize_intermediate(activation(h), quantized).astype(cdt)
    y = jnp.einsum("ecn,enh->ech", act, weights.w2.astype(cdt),
                   preferred_element_type=jnp.float32)
    if weights.w2_bias is not None:
      y = y + weights.w2_bias.astype(jnp.float32)[:, None, :]
    rows = jnp.arange(inp.a.shape[1])
    live = rows[None, :] < inp.expert_num_tokens[:, None]
    return jnp.where(live[..., None], y, 0.0).astype(out_dtype)
