"""Pieces the expert implementations share."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jmoe.config import QuantConfig
from jmoe.kernels.activations import Activation
from jmoe.kernels.permute import inverse_permutation, touched_experts
from jmoe.modular import ExpertWeights
from jmoe.quant.activations import dequantize_activations, fake_quantize
from jmoe.quant.weights import QuantizedWeights, dequantize


def weights_quant(weights: ExpertWeights) -> Optional[QuantConfig]:
  """The scheme of quantized weights (fused_moe checked w13 and w2 agree), else None."""
  return weights.w13.scheme if isinstance(weights.w13, QuantizedWeights) else None


def xla_quant_support(quant: Optional[QuantConfig]) -> Optional[str]:
  """Why the XLA-family experts cannot run `quant` (None: they can). They compute the scheme's
  exact values (dequantized operands, f32 accumulation): every scheme, the packed 4-bit and
  microscaling ones (w4a16, mxfp4, nvfp4, mxfp8) by dequantizing the weights inside the graph
  on every call (portable, not fast)."""
  return None


def dense_operands(a: jax.Array, a_scale: Optional[jax.Array], weights: ExpertWeights,
                   dtype) -> tuple[jax.Array, ExpertWeights]:
  """(a, weights) with quantized activations and weights dequantized to `dtype`: the
  reference semantics of every scheme (a dense copy of the weights: not a fast path)."""
  if not isinstance(weights.w13, QuantizedWeights):
    return a, weights
  dense = dataclasses.replace(weights, w13=dequantize(weights.w13, dtype),
                              w2=dequantize(weights.w2, dtype))
  return dequantize_activations(a, a_scale, dtype), dense


def narrow_to_touched(weights: ExpertWeights, local_ids: jax.Array
                      ) -> tuple[ExpertWeights, jax.Array]:
  """(weights, local_ids) cut down to the experts the slots touch, where there are fewer slots
  than experts: for the paths that dequantize quantized weights in the graph per call, so
  they dequantize (and read) only those experts, not all E (qwen3's 8 of 128 at one token).

  local_ids [T, k] in [0, E], E the skip sentinel. Returns the weights of U = T*k + 1 experts
  (the touched ones in ascending order, then unused fillers) and the ids renumbered into them
  (skip -> U); unchanged where T*k >= E or the weights are dense."""
  e = weights.num_experts
  if not isinstance(weights.w13, QuantizedWeights) or local_ids.size >= e:
    return weights, local_ids
  idx, renumbered = touched_experts(local_ids, e)
  take = lambda b: None if b is None else jnp.take(b, idx, axis=0)  # noqa: E731
  narrowed = ExpertWeights(weights.w13.take_experts(idx), weights.w2.take_experts(idx),
                           take(weights.w13_bias), take(weights.w2_bias))
  return narrowed, renumbered


def requantize_intermediate(act: jax.Array, weights: ExpertWeights) -> jax.Array:
  """GEMM2's input as a quantized GEMM2 sees it: the activation's output quantized to the
  scheme's activation format and back (f32); unchanged for dense or weight-only weights."""
  quant = weights_quant(weights)
  if quant is None or quant.act_dtype is None:
    return act
  return fake_quantize(act, quant, static_scale=weights.w2.input_scale)


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
