"""Pieces the expert implementations share."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jmoe.modular import ExpertWeights
from jmoe.kernels.permute import inverse_permutation
from jmoe.kernels.activations import Activation


def check_weights_for_activation(weights: ExpertWeights, activation: Activation) -> None:
  n = weights.intermediate_size
  want = 2 * n if activation.is_gated else n
  if weights.w13.shape[2] != want:
    raise ValueError(f"w13 last dim must be {want} for activation {activation.name!r} "
                     f"(w2 gives N={n}), got w13 shape {weights.w13.shape}")


def add_bias(h: jax.Array, bias: Optional[jax.Array], expert_of_row: jax.Array) -> jax.Array:
  """h [..., D] f32 + bias[expert_of_row] (expert ids clipped; masked rows are ignored later)."""
  if bias is None:
    return h
  idx = jnp.clip(expert_of_row, 0, bias.shape[0] - 1)
  return h + bias.astype(jnp.float32)[idx]


def sort_slots_by_expert(local_ids: jax.Array, num_local_experts: int):
  """The permute step: order token slots by local expert.

  Args:
    local_ids: [T, k] local ids; `num_local_experts` marks slots not computed here.

  Returns:
    order [T*k] (flat slot index at each sorted position; uncomputed slots last),
    inv [T*k] (sorted position of each slot), group_sizes [E_local] int32.
  """
  flat = local_ids.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  inv = inverse_permutation(order)
  group_sizes = jnp.bincount(flat, length=num_local_experts + 1)[:num_local_experts]
  return order, inv, group_sizes.astype(jnp.int32)
