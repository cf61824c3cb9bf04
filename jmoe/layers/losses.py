"""Router training signals: load-balancing loss, z-loss, expert load, the DeepSeek bias update.

All take the router's outputs as arrays, so they work on any block (the layer, `moe_block`
callers, a converted Hugging Face model) and under any mesh (plain jnp on global arrays).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_load(topk_ids: jax.Array, num_experts: int) -> jax.Array:
  """topk_ids [T, k] int (-1 = empty slot) -> [E] int32: routed (token, slot) copies per expert."""
  flat = topk_ids.reshape(-1).astype(jnp.int32)
  flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
  return jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)


def router_probs(logits: jax.Array, scoring_func: str = "softmax") -> jax.Array:
  """logits [T, E] -> per-token probabilities over all experts [T, E] f32 (rows sum to 1).

  softmax scoring: softmax(logits). sigmoid scoring (DeepSeek-V3): sigmoid scores normalized
  per token, the form DeepSeek-V3's sequence-wise balance loss uses.
  """
  logits = logits.astype(jnp.float32)
  if scoring_func == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  s = jax.nn.sigmoid(logits)
  return s / jnp.sum(s, axis=-1, keepdims=True)


def load_balancing_loss(logits: jax.Array, topk_ids: jax.Array, *,
                        scoring_func: str = "softmax") -> jax.Array:
  """The Switch / Mixtral auxiliary loss, as Hugging Face's `load_balancing_loss_func`:

      E * sum_e f_e * P_e,   f_e = (copies routed to e) / T,   P_e = mean_t probs[t, e]

  logits [T, E], topk_ids [T, k] -> f32 scalar. Equals top_k when routing is perfectly
  uniform (1 for Switch's top-1). Gradients flow through P only (f is a count).
  """
  t, e = logits.shape
  f = expert_load(topk_ids, e).astype(jnp.float32) / jnp.float32(max(t, 1))
  p = jnp.mean(router_probs(logits, scoring_func), axis=0)
  return jnp.float32(e) * jnp.sum(f * p)


def router_z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE's router z-loss: mean_t logsumexp(logits[t])^2. logits [T, E] -> f32 scalar."""
  z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return jnp.mean(z * z)


def correction_bias_update(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's auxiliary-loss-free balancing step: bias + rate * sign(mean(load) - load).

  bias [E] f32, load [E] (copies per expert over a batch, `expert_load`) -> new bias [E].
  Overloaded experts are pushed down, idle ones up; apply it outside the gradient (after the
  optimizer step), e.g. with `MoE.update_correction_bias`.
  """
  if bias.shape != load.shape or bias.ndim != 1:
    raise ValueError(f"bias and load must both be [E], got bias {tuple(bias.shape)} and load "
                     f"{tuple(load.shape)}")
  load = jax.lax.stop_gradient(load.astype(jnp.float32))
  step = jnp.float32(rate) * jnp.sign(jnp.mean(load) - load)
  return (bias.astype(jnp.float32) + step).astype(bias.dtype)


def load_balance(load: jax.Array) -> jax.Array:
  """max / mean of an expert load [E] (1.0 = perfectly balanced) as f32."""
  load = load.astype(jnp.float32)
  return jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)
