"""Grouped-GEMM experts in plain XLA: sort token slots by expert, `jax.lax.ragged_dot` for
both GEMMs, the activation fused by XLA, then unpermute + weight + reduce as a gather-sum
(no scatter-add, so the backward pass is a gather too)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.experts._common import (add_bias, check_weights_for_activation, narrow_to_touched,
                                  sort_slots_by_expert, weights_quant, xla_quant_support)
from jmoe.modular import ActivationFormat, Experts, NoOp, local_expert_ids
from jmoe.quant.activations import dequantize_activations, quantize_activations
from jmoe.quant.weights import QuantizedWeights, dequantize


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


def _scales_constant_along_k(x_scale, w: QuantizedWeights) -> bool:
  """Whether x_scale[m] * w_scale[n] factors out of the K sum (no scale varies along K) and
  the values are 8-bit numbers XLA's dot takes as they are (not packed, not permuted)."""
  k_tile = w.tile()[1] if w.k_major else w.tile()[0]
  k = w.shape[1]
  return (w.zero is None and k_tile == k and not w.packed and w.perm is None
          and w.global_scale is None and (x_scale is None or x_scale.shape[-1] == 1))


def quantized_gemm(x, x_scale, w: QuantizedWeights, group_sizes, expert_of_row, compute_dtype):
  """x [M, K] (8-bit values with scales x_scale, or dense) @ w (the expert of each row) ->
  [M, N] f32.

  Where no scale varies along K (per-tensor / per-channel weights, per-token / per-tensor
  activations) the 8-bit values go to XLA's 8-bit ragged dot and both scales multiply its f32
  (int32 for int8) result; otherwise both operands are dequantized to `compute_dtype` first,
  inside the graph, on every call: group scales, zero points, and the packed 4-bit and
  microscaling formats (w4a16, mxfp4, nvfp4, mxfp8) take this path (a dense copy of the
  weights per call: the portable path, not the fast one)."""
  if _scales_constant_along_k(x_scale, w):
    if x_scale is None:  # weight-only: x stays dense, the 8-bit values are cast exactly
      x = x.astype(compute_dtype)
      values = w.values.astype(compute_dtype)
      acc_type = jnp.float32
    else:
      values = w.values
      acc_type = jnp.int32 if jnp.issubdtype(values.dtype, jnp.integer) else jnp.float32
    contract = 2 if w.k_major else 1
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [contract]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    acc = jax.lax.ragged_dot_general(x, values, group_sizes, dn,
                                     preferred_element_type=acc_type).astype(jnp.float32)
    ws = w.scale[:, :, 0] if w.k_major else w.scale[:, 0, :]  # [E, N / tile_n]
    n = w.shape[2]
    if ws.shape[1] not in (1, n):  # block scales one K block deep: repeat over their columns
      ws = jnp.repeat(ws, n // ws.shape[1], axis=1)
    out = acc * ws.astype(jnp.float32)[jnp.clip(expert_of_row, 0, ws.shape[0] - 1)]
    return out if x_scale is None else out * x_scale.astype(jnp.float32)
  xd = dequantize_activations(x, x_scale, compute_dtype)
  return jax.lax.ragged_dot(xd, dequantize(w, compute_dtype), group_sizes,
                            preferred_element_type=jnp.float32)


def quantized_expert_mlp_sorted(xs, xs_scale, weights, group_sizes, expert_of_row, activation,
                                compute_dtype):
  """`expert_mlp_sorted` for quantized weights: GEMM1 on the prepared (quantized) rows, the
  activation's output quantized to the scheme's activation format, GEMM2."""
  quant = weights_quant(weights)
  h = quantized_gemm(xs, xs_scale, weights.w13, group_sizes, expert_of_row, compute_dtype)
  h = add_bias(h, weights.w13_bias, expert_of_row)
  act = activation(h)
  if quant.act_dtype is None:
    aq, a_scale = act.astype(compute_dtype), None
  else:
    aq, a_scale = quantize_activations(act, quant, static_scale=weights.w2.input_scale)
  y = quantized_gemm(aq, a_scale, weights.w2, group_sizes, expert_of_row, compute_dtype)
  return add_bias(y, weights.w2_bias, expert_of_row)


class XlaExperts(Experts):
  name = "xla"
  activation_formats = (ActivationFormat.Standard, ActivationFormat.Standard)
  supports_residual = True  # apply(..., residual=): the add inside the final gather-sum

  def finalize_weight_and_reduce_impl(self):
    return NoOp()

  def quant_support(self, quant):
    return xla_quant_support(quant)

  def apply(self, inp, weights, *, activation, expert_map, out_dtype, residual=None):
    check_weights_for_activation(weights, activation)
    t, k = inp.topk_ids.shape
    local = local_expert_ids(inp.topk_ids, weights.num_experts, expert_map)
    if isinstance(weights.w13, QuantizedWeights) and not _scales_constant_along_k(
        inp.a_scale, weights.w13):  # dequantized per call: only the experts the slots touch
      weights, local = narrow_to_touched(weights, local)
    e = weights.num_experts
    order, inv, group_sizes = sort_slots_by_expert(local, e)
    expert_of_row = local.reshape(-1)[order]
    # empty slots' rows are zeros: an EP receive buffer's rows that no slot uses are
    # unwritten (NaN possible), and ragged_dot's weight gradient would multiply them by 0
    live = (expert_of_row < e)[:, None]
    xs = jnp.where(live, inp.a[order // k], 0)  # [T*k, H]
    if weights_quant(weights) is None:
      y = expert_mlp_sorted(xs, weights, group_sizes, expert_of_row, activation,
                            jnp.result_type(inp.a.dtype, weights.w13.dtype))
    else:
      scale = inp.a_scale
      if scale is not None and scale.shape[0] == inp.a.shape[0] and inp.a.shape[0] > 1:
        scale = jnp.where(live, scale[order // k], 0.0)  # per-row scales follow their rows
      y = quantized_expert_mlp_sorted(xs, scale, weights, group_sizes, expert_of_row,
                                      activation, out_dtype)
    w = jnp.where(local < e, inp.topk_weights.astype(jnp.float32), 0.0)
    if residual is not None:  # seed 003: residual + the weighted gather-sum, one fusion
      from jmoe.kernels.permute import gather_sum  # noqa: PLC0415
      return gather_sum(y, jnp.where(local < e, inv.reshape(t, k), -1), w, out_dtype=out_dtype,
                        residual=residual)
    per_slot = y[inv].reshape(t, k, y.shape[-1])
    return jnp.einsum("tk,tkh->th", w, per_slot).astype(out_dtype)
