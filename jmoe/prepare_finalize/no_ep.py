"""No expert parallelism: every expert this call computes lives on this device."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jmoe.config import QuantConfig
from jmoe.modular import (ActivationFormat, Contiguous, ExpertsInput, NaiveBatched,
                          PrepareFinalize, local_expert_ids)
from jmoe.quant import quantize_activations
from jmoe.kernels.permute import inverse_permutation


def apply_weight_on_input(x: jax.Array, topk_weights: jax.Array, enabled: bool
                          ) -> tuple[jax.Array, jax.Array]:
  """Llama-4 style: scale the input by its (single) router weight; the experts then see
  weights of one. Only valid with top_k == 1 (checked by the caller)."""
  if not enabled:
    return x, topk_weights
  x = (x.astype(jnp.float32) * topk_weights[:, :1].astype(jnp.float32)).astype(x.dtype)
  return x, jnp.ones_like(topk_weights)


class NoEP(PrepareFinalize):
  """Standard format: the tokens stay where they are; only the input hook runs."""

  name = "no_ep"
  activation_format = ActivationFormat.Standard
  default_weight_and_reduce = Contiguous()
  supports_residual = True  # finalize adds it inside the reduce (PrepareFinalize.finalize)

  def prepare(self, x, topk_weights, topk_ids, *, num_local_experts, expert_map,
              apply_router_weight_on_input, quant, a1_scale=None):
    x, topk_weights = apply_weight_on_input(x, topk_weights, apply_router_weight_on_input)
    a1q, a1_scale = quantize_activations(x, quant, static_scale=a1_scale)
    return ExpertsInput(a=a1q, a_scale=a1_scale, topk_weights=topk_weights,
                        topk_ids=topk_ids.astype(self.topk_indices_dtype),
                        format=ActivationFormat.Standard)


def batched_layout(local_ids: jax.Array, num_local_experts: int, capacity: int):
  """Place token slots into per-expert rows.

  Args:
    local_ids: [T, k] local expert ids, `num_local_experts` for slots not computed here.
    capacity: rows per expert C.

  Returns:
    src_slot [E, C] (flat slot index t*k+j feeding each row, -1 = empty row),
    expert_num_tokens [E] (rows used, <= C), slot_pos [T, k] (row of each slot in its
    expert, -1 = not computed here or dropped), dropped (scalar int32: slots over capacity).
  """
  t, k = local_ids.shape
  e = num_local_experts
  flat = local_ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  counts = jnp.bincount(flat, length=e + 1)[:e].astype(jnp.int32)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)[:-1]])
  expert_num_tokens = jnp.minimum(counts, capacity)
  rows = jnp.arange(capacity, dtype=jnp.int32)
  sorted_pos = starts[:, None] + rows[None, :]  # [E, C]
  row_valid = rows[None, :] < expert_num_tokens[:, None]
  src_slot = jnp.where(row_valid, order[jnp.clip(sorted_pos, 0, t * k - 1)], -1)
  inv = inverse_permutation(order)  # sorted position of each slot
  safe_ids = jnp.clip(flat, 0, e - 1)
  pos = inv - starts[safe_ids]
  keep = (flat < e) & (pos < capacity)
  slot_pos = jnp.where(keep, pos, -1).reshape(t, k)
  dropped = jnp.sum(jnp.maximum(counts - capacity, 0)).astype(jnp.int32)
  return src_slot.astype(jnp.int32), expert_num_tokens, slot_pos, dropped


class NoEPBatched(PrepareFinalize):
  """Batched format `[E_local, C, H]` with `expert_num_tokens`.

  The default capacity C is T: dropless, since a token's top-k ids are distinct (every router
  guarantees it and `fused_moe` checks concrete ids). A smaller `max_tokens_per_expert` drops
  the overflow; the count is reported in `ExpertsInput.dropped`, never silently.
  """

  name = "no_ep_batched"
  activation_format = ActivationFormat.Batched
  default_weight_and_reduce = NaiveBatched()
  supports_residual = True

  def __init__(self, max_tokens_per_expert: Optional[int] = None):
    if max_tokens_per_expert is not None and max_tokens_per_expert <= 0:
      raise ValueError(f"max_tokens_per_expert must be positive, got {max_tokens_per_expert}")
    self.max_tokens_per_expert = max_tokens_per_expert

  def max_num_tokens_per_rank(self):
    return self.max_tokens_per_expert

  def prepare(self, x, topk_weights, topk_ids, *, num_local_experts, expert_map,
              apply_router_weight_on_input, quant, a1_scale=None):
    t, k = topk_ids.shape
    x, topk_weights = apply_weight_on_input(x, topk_weights, apply_router_weight_on_input)
    capacity = self.max_tokens_per_expert or t
    local = local_expert_ids(topk_ids, num_local_experts, expert_map)
    src_slot, num_tokens, slot_pos, dropped = batched_layout(local, num_local_experts, capacity)
    tok = jnp.where(src_slot >= 0, src_slot // k, 0)
    a = jnp.where((src_slot >= 0)[..., None], x[tok], jnp.zeros((), x.dtype))
    a1q, a1_scale = quantize_activations(a, quant, static_scale=a1_scale)
    return ExpertsInput(a=a1q, a_scale=a1_scale, topk_weights=topk_weights,
                        topk_ids=topk_ids.astype(self.topk_indices_dtype),
                        expert_num_tokens=num_tokens,
                        slot_expert=jnp.clip(local, 0, num_local_experts - 1), slot_pos=slot_pos,
                        dropped=dropped, format=ActivationFormat.Batched)
