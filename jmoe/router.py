"""Top-k routing with the exact semantics of vLLM / Hugging Face MoE models.

All math runs in float32. `select_experts` returns `(topk_weights f32 [T, k], topk_ids i32 [T, k])`;
the weights already include `routed_scaling_factor`.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmoe._validate import is_concrete
from jmoe.config import SCORING_FUNCS, check_choice

RoutingFn = Callable[[jax.Array, jax.Array, int, bool], "tuple[jax.Array, jax.Array]"]


def _scores(logits: jax.Array, scoring_func: str) -> jax.Array:
  if scoring_func == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  return jax.nn.sigmoid(logits)


def _group_mask(selection_scores: jax.Array, num_expert_group: int, topk_group: int,
                has_bias: bool) -> jax.Array:
  """Boolean [T, E] mask of experts in the `topk_group` best groups (DeepSeek grouped top-k).

  A group's score is the sum of its two best (biased) scores when a correction bias is used,
  else its best score.
  """
  t, e = selection_scores.shape
  grouped = selection_scores.reshape(t, num_expert_group, e // num_expert_group)
  if has_bias:
    group_scores = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)
  else:
    group_scores = grouped.max(-1)
  _, group_idx = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
  group_mask = jnp.zeros((t, num_expert_group), jnp.bool_)
  group_mask = group_mask.at[jnp.arange(t)[:, None], group_idx].set(True)
  return jnp.repeat(group_mask, e // num_expert_group, axis=1)


def _check_routing_args(hidden_states, router_logits, top_k, scoring_func, num_expert_group,
                        topk_group, e_score_correction_bias, routed_scaling_factor):
  if router_logits.ndim != 2:
    raise ValueError(f"router_logits must be [T, E], got shape {router_logits.shape}")
  t, e = router_logits.shape
  if hidden_states is not None and (hidden_states.ndim != 2 or hidden_states.shape[0] != t):
    raise ValueError(f"hidden_states must be [T, H] with T={t} (router_logits' T), "
                     f"got shape {hidden_states.shape}")
  if not jnp.issubdtype(router_logits.dtype, jnp.floating):
    raise TypeError(f"router_logits must be floating point, got {router_logits.dtype}")
  if not isinstance(top_k, (int, np.integer)) or top_k <= 0:
    raise ValueError(f"top_k must be a positive int, got {top_k!r}")
  if top_k > e:
    raise ValueError(f"top_k={top_k} exceeds the number of experts E={e} (router_logits.shape[1])")
  check_choice("scoring_func", scoring_func, SCORING_FUNCS)
  if (num_expert_group is None) != (topk_group is None):
    raise ValueError("num_expert_group and topk_group must be given together")
  if num_expert_group is not None:
    if num_expert_group <= 0 or e % num_expert_group:
      raise ValueError(f"num_expert_group={num_expert_group} does not divide the number of "
                       f"experts E={e}")
    if not 0 < topk_group <= num_expert_group:
      raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group="
                       f"{num_expert_group}]")
    if top_k > topk_group * (e // num_expert_group):
      raise ValueError(f"top_k={top_k} exceeds the experts left in topk_group={topk_group} "
                       f"groups of {e // num_expert_group}")
  if e_score_correction_bias is not None and e_score_correction_bias.shape != (e,):
    raise ValueError(f"e_score_correction_bias must have shape ({e},), got "
                     f"{e_score_correction_bias.shape}")
  if not (isinstance(routed_scaling_factor, numbers.Real)
          and not isinstance(routed_scaling_factor, bool)
          and math.isfinite(routed_scaling_factor) and routed_scaling_factor > 0):
    raise ValueError(f"routed_scaling_factor must be a finite number > 0, got "
                     f"{routed_scaling_factor!r}")
  if is_concrete(router_logits) and not bool(jnp.all(jnp.isfinite(router_logits))):
    raise ValueError("router_logits contains NaN or inf")


def select_experts(
    hidden_states: Optional[jax.Array],
    router_logits: jax.Array,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = True,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    e_score_correction_bias: Optional[jax.Array] = None,
    routed_scaling_factor: float = 1.0,
    custom_routing_function: Optional[RoutingFn] = None,
) -> tuple[jax.Array, jax.Array]:
  """Pick `top_k` experts per token.

  Args:
    hidden_states: [T, H], passed to `custom_routing_function` (may be None otherwise).
    router_logits: [T, E] gate outputs.
    top_k: experts per token.
    scoring_func: "softmax" or "sigmoid".
    renormalize: divide the chosen weights by their sum.
    num_expert_group, topk_group: DeepSeek grouped top-k: keep the `topk_group` best of
      `num_expert_group` groups, then pick experts inside them.
    e_score_correction_bias: [E] added to the scores for *selection* only; the weights come
      from the unbiased scores.
    routed_scaling_factor: multiplies the final weights.
    custom_routing_function: `fn(hidden_states, router_logits, top_k, renormalize) ->
      (weights, ids)`, replacing everything above.

  Returns:
    topk_weights float32 [T, k], topk_ids int32 [T, k].
  """
  _check_routing_args(hidden_states, router_logits, top_k, scoring_func, num_expert_group,
                      topk_group, e_score_correction_bias, routed_scaling_factor)
  t = router_logits.shape[0]
  if custom_routing_function is not None:
    weights, ids = custom_routing_function(hidden_states, router_logits, top_k, renormalize)
    weights, ids = jnp.asarray(weights), jnp.asarray(ids)
    if weights.shape != (t, top_k) or ids.shape != (t, top_k):
      raise ValueError(f"custom_routing_function must return weights and ids of shape "
                       f"({t}, {top_k}), got {weights.shape} and {ids.shape}")
    weights = weights.astype(jnp.float32)
  else:
    scores = _scores(router_logits.astype(jnp.float32), scoring_func)
    has_bias = e_score_correction_bias is not None
    selection = scores + e_score_correction_bias.astype(jnp.float32) if has_bias else scores
    if num_expert_group is not None and num_expert_group > 1:
      mask = _group_mask(selection, num_expert_group, topk_group, has_bias)
      selection = jnp.where(mask, selection, -jnp.inf)
    _, ids = jax.lax.top_k(selection, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  if routed_scaling_factor != 1.0:
    weights = weights * jnp.float32(routed_scaling_factor)
  return weights, ids.astype(jnp.int32)
