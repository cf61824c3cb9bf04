"""A whole MoE block as a function: router -> routed experts -> shared experts.

`MoEParams` holds the parameters in jmoe's layout; `moe_block(x, params, config)` is what the
Flax layer, the converters from Hugging Face models and the benchmarks call.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmoe._validate import check_floating
from jmoe.api import fused_moe
from jmoe.config import MoEConfig
from jmoe.modular import _pytree_dataclass
from jmoe.router import select_experts
from jmoe.shared import fuse_shared_slots, shared_expert_mlp, split_shared_weights

_HI = jax.lax.Precision.HIGHEST


@_pytree_dataclass
class MoEParams:
  """router_w [H, E], router_b [E]; correction_bias [E] (DeepSeek); w13 [E, H, 2N], w2 [E, N, H],
  w13_bias [E, 2N], w2_bias [E, H]; shared_w13 [H, 2Ns], shared_w2 [Ns, H], shared_gate [H]."""

  router_w: jax.Array
  w13: jax.Array
  w2: jax.Array
  router_b: Optional[jax.Array] = None
  correction_bias: Optional[jax.Array] = None
  w13_bias: Optional[jax.Array] = None
  w2_bias: Optional[jax.Array] = None
  shared_w13: Optional[jax.Array] = None
  shared_w2: Optional[jax.Array] = None
  shared_gate: Optional[jax.Array] = None


def init_params(config: MoEConfig, key: jax.Array, dtype=jnp.float32, scale: float = 1.0
                ) -> MoEParams:
  """Random parameters for `config` (normal, std = scale / sqrt(fan_in))."""
  c = config
  ks = jax.random.split(key, 10)

  def normal(k, shape, fan_in):
    return (jax.random.normal(k, shape, jnp.float32) * (scale / np.sqrt(fan_in))).astype(dtype)

  e, h, n = c.num_experts, c.hidden_size, c.intermediate_size
  p = dict(router_w=normal(ks[0], (h, e), h), w13=normal(ks[1], (e, h, c.w13_out), h),
           w2=normal(ks[2], (e, n, h), n))
  if c.router_bias:
    p["router_b"] = normal(ks[3], (e,), 1)
  if c.use_correction_bias:
    p["correction_bias"] = jax.random.uniform(ks[4], (e,), jnp.float32, 0.0, 0.1)
  if c.expert_bias:
    p["w13_bias"] = normal(ks[5], (e, c.w13_out), 1) * 0.1
    p["w2_bias"] = normal(ks[6], (e, h), 1) * 0.1
  if c.num_shared_experts:
    ns = c.shared_size
    p["shared_w13"] = normal(ks[7], (h, 2 * ns if c.act.is_gated else ns), h)
    p["shared_w2"] = normal(ks[8], (ns, h), ns)
    if c.shared_expert_gate:
      p["shared_gate"] = normal(ks[9], (h,), h)
  return MoEParams(**p)


def fuse_shared_params(params: MoEParams, config: MoEConfig) -> MoEParams:
  """Append the shared experts to the routed weights once (at load time), for
  `MoEConfig(fuse_shared_experts=True)`: w13 [E+S, H, 2N], w2 [E+S, N, H], shared_* = None.

  `moe_block` accepts both forms; passing fused params saves copying every expert's weights
  on each forward.
  """
  c = config
  if not (c.num_shared_experts and c.fuse_shared_experts):
    raise ValueError("fuse_shared_params needs MoEConfig(num_shared_experts > 0, "
                     "fuse_shared_experts=True)")
  if params.shared_w13 is None or params.shared_w2 is None:
    raise ValueError("params hold no shared_w13/shared_w2 to fuse (already fused?)")
  s13, s2 = split_shared_weights(params.shared_w13, params.shared_w2, c.num_shared_experts,
                                 c.intermediate_size, c.act.is_gated)

  def pad_bias(b):  # shared experts carry no bias
    if b is None:
      return None
    return jnp.concatenate([b, jnp.zeros((c.num_shared_experts,) + b.shape[1:], b.dtype)])

  return dataclasses.replace(
      params, w13=jnp.concatenate([params.w13, s13.astype(params.w13.dtype)]),
      w2=jnp.concatenate([params.w2, s2.astype(params.w2.dtype)]),
      w13_bias=pad_bias(params.w13_bias), w2_bias=pad_bias(params.w2_bias),
      shared_w13=None, shared_w2=None)


def router_logits(x: jax.Array, params: MoEParams) -> jax.Array:
  """x [T, H] (floating) -> router logits [T, E] f32 (x @ router_w + router_b)."""
  check_floating("x", x)
  check_floating("params.router_w", params.router_w)
  if x.shape[-1] != params.router_w.shape[0]:
    raise ValueError(f"x has H={x.shape[-1]} but params.router_w is [H, E] = "
                     f"{tuple(params.router_w.shape)}")
  logits = jnp.dot(x.astype(jnp.float32), params.router_w.astype(jnp.float32), precision=_HI)
  if params.router_b is not None:
    logits = logits + params.router_b.astype(jnp.float32)
  return logits


def moe_block(x: jax.Array, params: MoEParams, config: MoEConfig, *,
              runner_backend: Optional[str] = None, residual: Optional[jax.Array] = None,
              **fused_kwargs) -> jax.Array:
  """x [T, H] -> [T, H]: route, run the routed experts, add the shared experts.

  residual [T, H] (the residual stream h, x = norm(h) typically): returns h + moe(x) with the
  add inside the routed experts' final weighted gather-sum (seed 003: the combine writes into
  the residual stream) instead of a separate [T, H] add; under `jax.jit` XLA writes the result
  in h's buffer when h is dead afterwards or donated (`donate_argnums`), so give it x's dtype.
  Gradients flow to h as through `h + moe_block(x)`. fused_kwargs go to `fused_moe`.
  """
  c = config
  logits = router_logits(x, params)
  weights, ids = select_experts(
      x, logits, c.top_k, scoring_func=c.scoring_func, renormalize=c.renormalize,
      num_expert_group=c.num_expert_group, topk_group=c.topk_group,
      e_score_correction_bias=params.correction_bias,
      routed_scaling_factor=c.routed_scaling_factor)
  w13, w2 = params.w13, params.w2
  w13_bias, w2_bias = params.w13_bias, params.w2_bias
  shared = None
  if c.num_shared_experts and c.fuse_shared_experts:
    if params.shared_w13 is not None:  # not fused at load time: fuse now (copies the weights)
      params = fuse_shared_params(params, c)
    w13, w2 = params.w13, params.w2
    w13_bias, w2_bias = params.w13_bias, params.w2_bias
    weights, ids = fuse_shared_slots(weights, ids, c.num_experts, c.num_shared_experts,
                                     c.routed_scaling_factor)
  elif c.num_shared_experts:
    shared = shared_expert_mlp(x, params.shared_w13, params.shared_w2, c.act,
                               gate=params.shared_gate)
  out = fused_moe(x, w13, w2, weights, ids, activation=c.act, w13_bias=w13_bias, w2_bias=w2_bias,
                  apply_router_weight_on_input=c.apply_router_weight_on_input,
                  runner_backend=runner_backend or c.runner_backend, residual=residual,
                  **fused_kwargs)
  if shared is not None:
    out = (out.astype(jnp.float32) + shared.astype(jnp.float32)).astype(x.dtype)
  return out
