"""Grouped-GEMM experts in plain XLA: sort token slots by expert, `jax.lax.ragged_dot` for
both GEMMs, the activation fused by XLA, then unpermute + weight + reduce as a gather-sum
(no scatter-add, so the backward pass is a gather too)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.experts._common import add_bias, check_weights_for_activation, sort_slots_by_expert
from jmoe.modular import ActivationFormat, Experts, NoOp, local_expert_ids


def expert_mlp_sorted(xs, weights, group_sizes, expert_of_row, activation, compute_dtype):
  """Expert MLP on rows sorted by expert: xs [M, H] -> [M, H] f32.

  Rows past sum(group_sizes) come out of ragged_dot as zeros (the caller masks them)."""
  h = jax.lax.ragged_dot(xs.astype(compute_dtype), weights.w13.astype(compute_dtype),
                         group_sizes, preferred_element_type=jnp.float32)
  h = add_bias(h, weights.w13_bias, expert_of_row)
  act = activation(h).astype(compute_dtype)
  y = jax.lax.ragged_dot(act, weights.w2.astype(compute_dtype), group_sizes,
                         preferred_element_type=jnp.float32)
  return add_bias(y, weights.w2_bias, expert_of_row)


class XlaExperts(Experts):
  name = "xla"
  activation_formats = (ActivationFormat.Standard, ActivationFormat.Standard)

  def finalize_weight_and_reduce_impl(self):
    return NoOp()

  def apply(self, inp, weights, *, activation, expert_map, out_dtype):
    check_weights_for_activation(weights, activation)
    t, k = inp.topk_ids.shape
    e = weights.num_experts
    local = local_expert_ids(inp.topk_ids, e, expert_map)
    order, inv, group_sizes = sort_slots_by_expert(local, e)
    expert_of_row = local.reshape(-1)[order]
    # empty slots' rows are zeros: an EP receive buffer's rows that no slot uses are
    # unwritten (NaN possible), and ragged_dot's weight gradient would multiply them by 0
    xs = jnp.where((expert_of_row < e)[:, None], inp.a[order // k], 0)  # [T*k, H]
    y = expert_mlp_sorted(xs, weights, group_sizes, expert_of_row, activation,
                          jnp.result_type(inp.a.dtype, weights.w13.dtype))
    per_slot = y[inv].reshape(t, k, y.shape[-1])
    w = jnp.where(local < e, inp.topk_weights.astype(jnp.float32), 0.0)
    return jnp.einsum("tk,tkh->th", w, per_slot).astype(out_dtype)
