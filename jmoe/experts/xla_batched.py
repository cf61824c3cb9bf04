"""Batched-format experts: einsums over `[E, C, H]`, rows past `expert_num_tokens` masked."""
from __future__ import annotations

import jax.numpy as jnp

from jmoe.experts._common import check_weights_for_activation
from jmoe.modular import BatchedExperts


class XlaBatchedExperts(BatchedExperts):
  name = "xla_batched"

  def apply(self, inp, weights, *, activation, expert_map, out_dtype):
    check_weights_for_activation(weights, activation)
    cdt = jnp.result_type(inp.a.dtype, weights.w13.dtype)
    h = jnp.einsum("ech,ehn->ecn", inp.a.astype(cdt), weights.w13.astype(cdt),
                   preferred_element_type=jnp.float32)
    if weights.w13_bias is not None:
      h = h + weights.w13_bias.astype(jnp.float32)[:, None, :]
    act = activation(h).astype(cdt)
    y = jnp.einsum("ecn,enh->ech", act, weights.w2.astype(cdt),
                   preferred_element_type=jnp.float32)
    if weights.w2_bias is not None:
      y = y + weights.w2_bias.astype(jnp.float32)[:, None, :]
    rows = jnp.arange(inp.a.shape[1])
    live = rows[None, :] < inp.expert_num_tokens[:, None]
    return jnp.where(live[..., None], y, 0.0).astype(out_dtype)
