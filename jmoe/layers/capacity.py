"""Capacity factor with token dropping on the batched path (Switch / GShard style).

Each expert gets C = ceil(capacity_factor * T * k / E) rows of `NoEPBatched`'s `[E, C, H]`
layout; a (token, slot) copy past its expert's C-th is dropped (contributes 0). Copies are
kept in token order (the first C that reach an expert win), and the count of dropped ones is
returned, never silently lost.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from jmoe import registry
from jmoe.config import QuantConfig
from jmoe.kernels.activations import Activation
from jmoe.modular import ActivationFormat, ExpertWeights, ModularKernel
from jmoe.prepare_finalize import NoEPBatched


def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
  """Rows per expert: ceil(capacity_factor * T * k / E), at least 1."""
  if not (isinstance(capacity_factor, (int, float)) and not isinstance(capacity_factor, bool)
          and math.isfinite(capacity_factor) and capacity_factor > 0):
    raise ValueError(f"capacity_factor must be a finite number > 0, got {capacity_factor!r}")
  return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def capacity_dropped(load: jax.Array, capacity: int) -> jax.Array:
  """load [E] copies per expert -> int32 scalar: copies over `capacity` (what the layout drops)."""
  return jnp.sum(jnp.maximum(load.astype(jnp.int32) - capacity, 0)).astype(jnp.int32)


def batched_experts_with_capacity(
    x: jax.Array, weights: ExpertWeights, topk_weights: jax.Array, topk_ids: jax.Array, *,
    capacity: int, activation: Activation, runner_backend: Optional[str],
    quant: Optional[QuantConfig], apply_router_weight_on_input: bool = False,
    residual: Optional[jax.Array] = None) -> jax.Array:
  """x [T, H], topk [T, k] -> [T, H] through NoEPBatched(max_tokens_per_expert=capacity)
  (residual [T, H]: residual + that, added inside the finalize's gather-sum)."""
  runner = "xla_batched" if runner_backend in (None, "auto") else runner_backend
  cls = registry.RUNNERS.get(runner, {}).get(ActivationFormat.Batched)
  if cls is None:
    batched = sorted(r for r, f in registry.RUNNERS.items() if ActivationFormat.Batched in f)
    raise ValueError(f"capacity_factor needs a batched-format runner; runner_backend={runner!r} "
                     f"has none (batched runners: {', '.join(batched)})")
  ok, why = cls.is_available()
  if not ok:
    raise ValueError(f"runner_backend={runner!r} cannot run here: {why}")
  kernel = ModularKernel(NoEPBatched(max_tokens_per_expert=capacity), cls(), quant)
  return kernel(x, weights, topk_weights, topk_ids, activation=activation,
                apply_router_weight_on_input=apply_router_weight_on_input, residual=residual)
