"""Shared experts: a separate dense MLP, or fused into the routed experts as extra top-k slots.

The separate path computes `act(x @ w13_s) @ w2_s`, optionally scaled by a per-token sigmoid
gate (Qwen2-MoE). The fused path (vLLM's shared-expert fusion) appends the shared experts to
the routed weights as experts E..E+S-1 and to every token's top-k as always-chosen slots, so
they run inside the routed grouped GEMM: one launch fewer, same math.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jmoe.kernels.activations import Activation

_HI = jax.lax.Precision.HIGHEST


def shared_expert_mlp(x: jax.Array, w13: jax.Array, w2: jax.Array, activation: Activation, *,
                      gate: Optional[jax.Array] = None) -> jax.Array:
  """x [T, H], w13 [H, 2Ns] (gate | up), w2 [Ns, H], gate [H] or [H, 1] -> [T, H] (x.dtype)."""
  cdt = jnp.result_type(x.dtype, w13.dtype)
  h = jnp.dot(x.astype(cdt), w13.astype(cdt), preferred_element_type=jnp.float32)
  y = jnp.dot(activation(h).astype(cdt), w2.astype(cdt), preferred_element_type=jnp.float32)
  if gate is not None:
    g = jnp.dot(x.astype(jnp.float32), gate.reshape(-1, 1).astype(jnp.float32), precision=_HI)
    y = jax.nn.sigmoid(g) * y
  return y.astype(x.dtype)


def split_shared_weights(w13: jax.Array, w2: jax.Array, num_shared: int, n: int,
                         gated: bool = True) -> tuple[jax.Array, jax.Array]:
  """A shared MLP of width S·N -> S experts of width N: [H, 2SN], [SN, H] -> [S, H, 2N], [S, N, H].

  Exact: an MLP's output is the sum over its intermediate units, so splitting them into
  S groups of N and summing the S expert outputs (weight 1 each) gives the same result.
  """
  h = w13.shape[0]
  if w2.shape[0] != num_shared * n:
    raise ValueError(f"shared w2 has {w2.shape[0]} rows, expected num_shared*N = {num_shared * n}")
  if gated:
    gate = w13[:, : num_shared * n].reshape(h, num_shared, n)
    up = w13[:, num_shared * n:].reshape(h, num_shared, n)
    w13_s = jnp.concatenate([gate, up], axis=-1).transpose(1, 0, 2)
  else:
    w13_s = w13.reshape(h, num_shared, n).transpose(1, 0, 2)
  return w13_s, w2.reshape(num_shared, n, -1)


def fuse_shared_slots(topk_weights: jax.Array, topk_ids: jax.Array, num_routed_experts: int,
                      num_shared: int, routed_scaling_factor: float = 1.0, *,
                      weights_include_scaling: bool = True) -> tuple[jax.Array, jax.Array]:
  """Append `num_shared` always-chosen slots (ids E..E+S-1) to each token's top-k.

  The seed's convention (routed weights *without* the routed scaling factor, the MoE output
  multiplied by it afterwards) needs shared slot weights of 1/routed_scaling_factor; jmoe's
  `select_experts` already folds the factor into the weights, so there the slot weight is 1.
  """
  t = topk_ids.shape[0]
  w = 1.0 if weights_include_scaling else 1.0 / routed_scaling_factor
  ids = jnp.broadcast_to(num_routed_experts + jnp.arange(num_shared, dtype=topk_ids.dtype),
                         (t, num_shared))
  ws = jnp.full((t, num_shared), w, topk_weights.dtype)
  return (jnp.concatenate([topk_weights, ws], axis=1),
          jnp.concatenate([topk_ids, ids], axis=1))
