"""The contiguous MoE expert block on the Pallas kernels (a convenience for jmoe's Experts and the
benchmarks): route (sort by expert + token gather) -> GEMM1 + activation -> GEMM2 (+ bias) ->
gather-sum x router weight.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jmoe.kernels import _compat
from jmoe.kernels import decode as _decode
from jmoe.kernels import decode_q8 as _decode_q8
from jmoe.kernels import decode_wq as _decode_wq
from jmoe.kernels import decode_wq_shared as _decode_wq_shared
from jmoe.kernels import grouped_gemm_w4a8 as _w4a8
from jmoe.kernels import grouped_gemm_wq_ws as _wq_ws
from jmoe.kernels import grouped_gemm_wq as _gg_wq
from jmoe.kernels import permute as _perm
from jmoe.kernels import quant_rows as _quant_rows
from jmoe.kernels import route as _route
from jmoe.kernels.activations import Activation, as_activation
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels.grouped_gemm import GroupedGemmConfig
from jmoe.config import QuantConfig
from jmoe.quant.activations import ROW_SCALES, dequantize_activations


log = logging.getLogger(__name__)

_PALLAS_GATHER_MIN_SLOTS = 1024


def _pallas_copy_pays(m: int, hdim: int) -> bool:
  """Whether a Pallas TMA row copy (gather_rows / scatter_rows) beats XLA's gather for m slots
  of width hdim: from 1024 slots (H200: 8192 x 2048 11.6 vs 21.0 µs), not below (1 token: 2.1
  vs 2.6 µs), and only where a TMA box chunking of hdim exists."""
  return m >= _PALLAS_GATHER_MIN_SLOTS and _perm.gather_rows_supports(hdim)


def _auto_gather_impl(m: int, hdim: int) -> str:
  """The sorted-order token gather for m slots of width hdim: "pallas" or "xla"."""
  return "pallas" if _pallas_copy_pays(m, hdim) else "xla"


@functools.partial(jax.jit, static_argnames=("activation", "config1", "config2", "interpret",
                                             "permute_impl", "layout", "route_impl"))
def fused_experts(x: jax.Array, w13: jax.Array, w2: jax.Array, topk_weights: jax.Array,
                  topk_ids: jax.Array, *, activation: Activation | str = "silu",
                  w13_bias: jax.Array | None = None, w2_bias: jax.Array | None = None,
                  config1: GroupedGemmConfig | None = None,
                  config2: GroupedGemmConfig | None = None, interpret: Any = False,
                  permute_impl: str = "auto", layout: str = "auto",
                  route_impl: str = "auto") -> jax.Array:
  """out[t] = sum_j topk_weights[t, j] * (act(x[t] @ w13[e] + b13[e]) @ w2[e] + b2[e]), e = ids[t, j].

  x [T, H] bf16/f16; w13 [E, H, 2N] (gated) or [E, H, N] (``*_no_mul``); w2 [E, N, H];
  topk_weights [T, k] (f32), topk_ids [T, k] int (-1 = empty slot, contributes 0).
  permute_impl: "xla" (jnp.take), "pallas" (permute.gather_rows, a TMA row-copy kernel in
    sorted order), "scatter" (permute.scatter_rows, the same in token order: each token row
    loaded once, stored k times; the jnp routing path only) or
    "auto": scatter from 1024 slots (H200, r15b: 131072 rows x 2048 174.6 µs, gather 244.1,
    xla 371.5; 131072 x 7168 582.6 / 932.4 / 1289.0), xla below (1 token: 2.1 vs 2.6 µs).
  layout: "sorted" (moe_align + grouped tiles: each expert's weights stream once),
    "per_slot" (decode: no sort; one task per (slot, column tile) reading slot s's row of
    x[s // k] and its expert's weights, then a sum over k: 4 kernels instead of ~15; an
    expert streams once per slot routed to it), "fused_decode" (jmoe.kernels.decode: GEMM1,
    activation and GEMM2 in one kernel whose weight loads run as one TMA ring, plus one
    reduction; gated activations and <= 128 slots, else per_slot) or "auto": when 4 * T * k
    <= E (slots rarely share an expert) fused_decode up to FUSED_DECODE_MAX_BYTES of streamed
    weights, per_slot above; else sorted. H200 (tuned tables): qwen3 1 token 22.3 µs fused
    (per_slot 27.4, sorted 43.7), 4 tokens per_slot 77.0 (sorted 99.4); deepseek-v3 1 / 4
    tokens per_slot 167 / 631; mixtral 1 token per_slot 172; at 16 tokens per_slot loses
    (qwen3 277 vs 201, mixtral 2509 vs 653).
  route_impl (sorted layout): "kernels" (jmoe.kernels.route: moe_align, both GEMMs' tile
    lists and the token gather in two kernels, one up to 128 slots), "xla" (moe_align +
    tile_metadata in jnp, ~16 small XLA kernels, then permute_impl's gather) or "auto":
    "kernels" where route.supports the shape (<= 8192 slots, <= 256 experts) and the Triton
    lowering imports, else "xla" (also in interpret mode inside shard_map, where the
    interpreter's vma check rejects the kernels' gathers). H200 (2026-11-29): qwen3 1024
    tokens 348.5 vs 363.6 µs (routing 17.9 vs ~35 µs of kernels), 64 tokens 289.1 vs 299.5;
    mixtral 64 tokens 665.7 vs 679.5.
  The router weights are applied in the final gather-sum (the sorted layout) or reduction
  (per_slot), in f32, not in GEMM2's epilogue: no sorted copy of the weights is needed.
  """
  act = as_activation(activation)
  t, k = topk_ids.shape
  e, hdim, n13 = w13.shape
  n = n13 // 2 if act.is_gated else n13
  m = t * k
  if config1 is None:
    config1 = gg.get_config("grouped_gemm_gated" if act.is_gated else "grouped_gemm", m, n, hdim,
                            e, x.dtype, gated=act.is_gated)
  if config2 is None:
    config2 = gg.get_config("grouped_gemm", m, hdim, n, e, x.dtype)
  if layout == "auto":
    layout = _auto_layout(t, k, e, hdim, n, act, x.dtype)
  if layout == "fused_decode":
    if _decode.supports(t, k, hdim, n, act):
      return _decode.fused_experts_decode(x, w13, w2, topk_weights, topk_ids, activation=act,
                                          w13_bias=w13_bias, w2_bias=w2_bias,
                                          interpret=interpret)
    layout = "per_slot"  # the one-kernel decode path takes gated activations, <= 128 slots
  if layout == "per_slot":
    return _per_slot(x, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias, config1,
                     config2, interpret)
  if layout != "sorted":
    raise ValueError(f"layout={layout!r} must be 'auto', 'sorted', 'per_slot' or "
                     "'fused_decode'")
  # Allocate at least one row tile so the kernels never need padding or slicing copies; the
  # extra rows (and rows past sum(group_sizes)) are garbage that gather_sum never reads.
  m_alloc = gg.row_alloc(m, config1.block_m, config2.block_m)
  bms = (config1.block_m,) if config2.block_m == config1.block_m else (
      config1.block_m, config2.block_m)
  xs, inv, group_sizes, metas = _sorted_rows(x, topk_ids, e, m_alloc, bms, route_impl,
                                             permute_impl, interpret)
  meta1, meta2 = metas[0], metas[-1]
  gg._validate(xs, w13, group_sizes, None, w13_bias, n13, gated=act.is_gated)
  h = gg._run(xs, w13, group_sizes, None, w13_bias, None, config1, interpret, act.is_gated, act,
              "", meta=meta1)
  gg._validate(h, w2, group_sizes, None, w2_bias, w2.shape[2])
  y = gg._run(h, w2, group_sizes, None, w2_bias, None, config2, interpret, False, None, "",
              meta=meta2)
  # the router weights are applied in the reduction (no sorted copy of them, no row scale)
  return _perm.gather_sum(y, inv, topk_weights, out_dtype=x.dtype)


# The one-kernel decode block wins where the per_slot GEMMs are short and their launches show.
# H200 (2026-11-30, r12d, same run): qwen3 1 token (75 MB of weights streamed) 22.3 vs 27.4 µs,
# 2 tokens (151 MB) 45.3 vs 47.4, 4 tokens (302 MB) 76.6-78.3 vs 78.2 (a tie); deepseek-v3 1
# token (705 MB) 172.0 vs 169.4, mixtral 1 token (705 MB) 187.6 vs 178.7.
FUSED_DECODE_MAX_BYTES = 160e6


def _auto_layout(t: int, k: int, e: int, hdim: int, n: int, act: Activation, dtype) -> str:
  """layout "auto": sorted unless slots rarely share an expert (4 T k <= E); then the
  one-kernel decode where the slots stream at most FUSED_DECODE_MAX_BYTES of weights, else
  per_slot."""
  m = t * k
  if 4 * m > e:
    return "sorted"
  streamed = m * 3 * hdim * n * jnp.dtype(dtype).itemsize
  if _decode.supports(t, k, hdim, n, act) and streamed <= FUSED_DECODE_MAX_BYTES:
    return "fused_decode"
  return "per_slot"


def _route_kernels_run(x, topk_ids, interpret) -> bool:
  """Whether jmoe.kernels.route's (Triton) kernels can run here: the lowering imports, and
  not in interpret mode inside shard_map(check_vma=True), where the interpreter's gathers mix
  varying refs and invarying indices (the GPU lowering has no such check)."""
  in_shard_map = bool(_compat.varying_axes(topk_ids) | _compat.varying_axes(x))
  return _route.available() and not (interpret and in_shard_map)


def _pick_route_impl(route_impl: str, x, topk_ids, num_experts: int, interpret) -> str:
  """route_impl "auto" -> "kernels" where jmoe.kernels.route takes the shape and its Triton
  lowering imports, else "xla"; checks the name."""
  if route_impl == "auto":
    m, hdim = topk_ids.size, x.shape[1]
    route_impl = "kernels" if (_route_kernels_run(x, topk_ids, interpret)
                               and _route.supports(m, hdim, num_experts)) else "xla"
    log.debug("route_impl=%s (%d slots, H=%d, triton lowering %s)", route_impl, m, hdim,
              "available" if _route.available() else "unavailable")
  if route_impl not in ("kernels", "xla"):
    raise ValueError(f"route_impl={route_impl!r} must be 'auto', 'kernels' or 'xla'")
  return route_impl


def _sorted_rows(x, topk_ids, num_experts: int, m_alloc: int, block_ms, route_impl: str,
                 permute_impl: str, interpret):
  """The sorted layout's routing by route_impl ("auto" resolved here): jmoe.kernels.route's
  kernels or route_xla. Returns (xs, inv, group_sizes, [(meta, num_tasks) per block_m])."""
  if _pick_route_impl(route_impl, x, topk_ids, num_experts, interpret) == "kernels":
    return _route.route(x, topk_ids, num_experts, m_alloc, block_ms, interpret=interpret)
  return route_xla(x, topk_ids, num_experts, m_alloc, block_ms, permute_impl=permute_impl,
                   interpret=interpret)


def route_xla(x: jax.Array, topk_ids: jax.Array, num_experts: int, m_alloc: int,
              block_ms, *, permute_impl: str = "auto", interpret: Any = False):
  """jmoe.kernels.route.route's results from the jnp path: moe_align, the token gather
  (permute_impl: "xla", "pallas", "scatter" or "auto", see fused_experts) and tile_metadata
  per block_m. The scatter copy needs no sort order: the slots' positions come from
  route.slot_positions (route's block-count kernel and a few XLA ops) where the Triton
  lowering runs, else from moe_align.
  Returns (xs [m_alloc, H], inv [T, k], group_sizes [E], [(meta, num_tasks) per block_m]); xs
  rows past sum(group_sizes) (empty slots sort last) are unwritten with the Pallas copies and
  repeat token 0 with XLA's; no kernel reads them."""
  t, k = topk_ids.shape
  m = t * k
  if permute_impl == "auto":
    # H200 (r15b), µs: qwen3 16384 tokens scatter 174.6 / gather 244.1 / XLA 371.5,
    # deepseek-v3 582.6 / 932.4 / 1289.0, mixtral 108.4 / 139.6 / 190.9
    permute_impl = "scatter" if _pallas_copy_pays(m, x.shape[1]) else "xla"
  if permute_impl == "scatter":  # token order: every token row loaded once; no sort order
    if _route_kernels_run(x, topk_ids, interpret) and num_experts <= _route._MAX_EXPERTS:
      inv, group_sizes = _route.slot_positions(topk_ids, num_experts, interpret=interpret)
    else:
      _, group_sizes, inv = _perm.moe_align(topk_ids, num_experts)
    xs = _perm.scatter_rows(x, inv, m_alloc, jnp.sum(group_sizes), interpret=interpret)
  else:
    sort_order, group_sizes, inv = _perm.moe_align(topk_ids, num_experts)
    order = sort_order if m_alloc == m else jnp.pad(sort_order, (0, m_alloc - m))
    xs = _perm.permute_rows(x, order, k, impl=permute_impl, interpret=interpret,
                            num_rows=jnp.sum(group_sizes))
  metas = [gg.tile_metadata(group_sizes, m_alloc, bm) for bm in block_ms]
  return xs, inv, group_sizes, metas


def _per_slot(x, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias, config1, config2,
              interpret):
  """fused_experts without the sort: row s of the slot-major [T*k, ...] arrays is slot s.
  Four launches: the token gather, GEMM1, GEMM2 (f32 rows) and one reduction that applies the
  router weights and sums over k. The kernels take the slot ids as their task list (one task
  per slot; an empty or EP-remote slot, id outside [0, E), is skipped and streams nothing)."""
  t, k = topk_ids.shape
  e = w13.shape[0]
  m = t * k
  ids = topk_ids.reshape(m).astype(jnp.int32)
  valid = (ids >= 0) & (ids < e)
  m_alloc = gg.row_alloc(m, config1.block_m, config2.block_m)
  tok = jnp.minimum(jnp.arange(m_alloc, dtype=jnp.int32) // k, t - 1)
  xs = jnp.take(x, tok, axis=0)
  no_groups = jnp.zeros((e,), jnp.int32)  # the tasks come from the metadata alone
  gg._validate(xs, w13, no_groups, None, w13_bias, w13.shape[2], gated=act.is_gated)
  h = gg._run(xs, w13, no_groups, None, w13_bias, None, config1, interpret, act.is_gated, act,
              "", slot_experts=ids)
  gg._validate(h, w2, no_groups, None, w2_bias, w2.shape[2])
  # f32 rows, weighted in the reduction: the router weight needs no padded scale vector
  y = gg._run(h, w2, no_groups, None, w2_bias, jnp.float32, config2, interpret, False, None, "",
              slot_experts=ids)
  w = topk_weights.reshape(m, 1).astype(jnp.float32)
  y = jnp.where(valid[:, None], y[:m] * w, 0.0)  # empty slots: rows unwritten
  return jnp.sum(y.reshape(t, k, -1), axis=1).astype(x.dtype)


def fused_experts_reference(x, w13, w2, topk_weights, topk_ids, *, activation="silu",
                            w13_bias=None, w2_bias=None):
  """Per-slot f32 reference (reads one expert per slot; for small T)."""
  act = as_activation(activation)
  t, k = topk_ids.shape
  e = w13.shape[0]
  ids = topk_ids.reshape(-1)
  valid = (ids >= 0) & (ids < e)
  idc = jnp.where(valid, ids, 0)
  tok = jnp.repeat(jnp.arange(t), k)
  hp = jax.lax.Precision.HIGHEST

  def one(args):
    ti, ei = args
    h = jnp.dot(x[ti].astype(jnp.float32), w13[ei].astype(jnp.float32), precision=hp)
    if w13_bias is not None:
      h = h + w13_bias[ei].astype(jnp.float32)
    a = act(h)
    y = jnp.dot(a, w2[ei].astype(jnp.float32), precision=hp)
    if w2_bias is not None:
      y = y + w2_bias[ei].astype(jnp.float32)
    return y

  ys = jax.lax.map(one, (tok, idc))
  ys = ys * (topk_weights.reshape(-1).astype(jnp.float32) * valid)[:, None]
  return ys.reshape(t, k, -1).sum(axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def routed_rows(x: jax.Array, topk_ids: jax.Array, num_experts: int, m_alloc: int,
                block_ms: tuple[int, ...], route_impl: str, interpret: Any = False):
  """Routing for training, differentiable in x, in route_for_training's layout (every expert's
  rows start on a multiple of 8; padding and tail rows are zero):
  (xs [m_alloc, H], inv [T, k], group_sizes [E] (padded counts), [(meta, num_tasks) per
  block_m] (the tail rows in the last expert's tiles), order [m_alloc] (slot of each row, -1 on
  padding and tail)). m_alloc >= T * k + 7 * min(E, T * k). route_impl "kernels"
  (jmoe.kernels.route.route_for_training, two kernels) or "xla" (permute.moe_align_training,
  the rows copied by permute.scatter_rows from 1024 slots, else XLA's gather, tile_metadata).
  VJP: d x = gather_sum(d xs, inv)."""
  return _routed_rows_fwd(x, topk_ids, num_experts, m_alloc, block_ms, route_impl,
                          interpret)[0]


def _routed_rows_fwd(x, topk_ids, num_experts, m_alloc, block_ms, route_impl, interpret):
  if route_impl == "kernels":
    out = _route.route_for_training(x, topk_ids, num_experts, m_alloc, block_ms,
                                    interpret=interpret)
  else:
    k = topk_ids.shape[1]
    order, inv, asize, pad = _perm.moe_align_training(topk_ids, num_experts, m_alloc,
                                                      with_padding_rows=True)
    if _pallas_copy_pays(topk_ids.size, x.shape[1]):
      # token order, each row loaded once; the padding and tail rows zeroed in the same kernel
      xs = _perm.scatter_rows(x, inv, m_alloc, zero_rows=pad, zero_from=jnp.sum(asize),
                              interpret=interpret)
    else:
      tok = jnp.where(order >= 0, order // k, x.shape[0])  # past the end: zero rows
      xs = jnp.take(x, tok, axis=0, mode="fill", fill_value=0)
    gs_tail = asize.at[-1].add(m_alloc - jnp.sum(asize))
    metas = [gg.tile_metadata(gs_tail, m_alloc, bm) for bm in block_ms]
    out = (xs, inv, asize, metas, order)
  return out, out[1]


def _routed_rows_bwd(num_experts, m_alloc, block_ms, route_impl, interpret, inv, cts):
  return _perm.gather_sum(cts[0], inv, out_dtype=cts[0].dtype), None


routed_rows.defvjp(_routed_rows_fwd, _routed_rows_bwd)


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "route_impl", "preact",
                                             "fuse_act_grad"))
def fused_experts_train(x: jax.Array, w13: jax.Array, w2: jax.Array, topk_weights: jax.Array,
                        topk_ids: jax.Array, *, activation: Activation | str = "silu",
                        w13_bias: jax.Array | None = None, w2_bias: jax.Array | None = None,
                        interpret: Any = False, route_impl: str = "auto",
                        preact: bool = False, fuse_act_grad: bool = False) -> jax.Array:
  """Differentiable MoE expert block (same math as fused_experts) on the Pallas kernels.

  Gradients flow to x, w13, w2, topk_weights and the biases. Routing (differentiable in x):
  routed_rows (route_impl as in fused_experts); the experts' MLP: expert_mlp (GEMM1 keeping the
  activation's input, GEMM2; backward: the d a and d x GEMMs on transposed weights and two
  tgmm); the weighted gather-sum: permute.gather_sum_diff (its VJP writes d y once in the GEMM's
  dtype, and d topk_weights). preact (gated activations) / fuse_act_grad: expert_mlp's fused
  epilogues, opt-in (slower on an H200, see jmoe.kernels.expert_mlp).
  """
  from jmoe.kernels import expert_mlp as _mlp  # noqa: PLC0415
  act = as_activation(activation)
  t, k = topk_ids.shape
  e, hdim, n13 = w13.shape
  n = n13 // 2 if act.is_gated else n13
  m = t * k
  if preact and not act.is_gated:
    raise ValueError(f"preact=True needs a gated activation, got {act.name!r}")
  configs = _mlp.plan_configs(gg.row_alloc(m, 128), hdim, n, e, x.dtype, act, preact,
                              fuse_act_grad)
  block_ms = tuple(sorted({c.block_m for c in configs}))
  m_alloc = gg.row_alloc(m + 7 * min(e, m), *block_ms)  # room for the 8-row expert padding
  route_impl = _pick_route_impl(route_impl, x, topk_ids, e, interpret)
  xs, inv, group_sizes, metas, order = routed_rows(x, topk_ids, e, m_alloc, block_ms, route_impl,
                                              interpret)
  plan = _mlp.MlpPlan(act, configs, preact, fuse_act_grad, interpret)
  y = _mlp.expert_mlp(plan, xs, w13, w2, w13_bias, w2_bias, group_sizes,
                      tuple(metas[block_ms.index(c.block_m)] for c in configs))
  # the router weights are applied in the gather-sum (its VJP writes d y once, in y's dtype)
  return _perm.gather_sum_diff(y, topk_weights, inv, order, k, x.dtype,
                               _auto_gather_impl(m, hdim), interpret)


# ============================================================================ quantized (W8A8)


def _sorted_act_scale(a_scale: jax.Array, inv: jax.Array, m_alloc: int, *,
                      transposed: bool = False) -> jax.Array:
  """The token rows' activation scales in sorted-slot order: per-token [T, 1] / per-group
  [T, G] rows scattered to their slots' rows (inv [T, k], -1 = empty slot); a per-tensor
  [1, 1] scale broadcast. -> [m_alloc, G] f32 (rows no slot lands on: 0, never read), or
  [G, m_alloc] with transposed (the fp8_block kernel's layout, scattered there directly)."""
  t, k = inv.shape
  s = a_scale.astype(jnp.float32)
  g = s.shape[1]
  if s.shape[0] == 1 and t != 1:
    return jnp.broadcast_to(s.reshape(g, 1) if transposed else s,
                            (g, m_alloc) if transposed else (m_alloc, g))
  dst = jnp.where(inv >= 0, inv, m_alloc).reshape(t * k)   # empty slots: out of bounds, dropped
  src = jnp.broadcast_to(s[:, None, :], (t, k, g)).reshape(t * k, g)
  if transposed:
    return jnp.zeros((g, m_alloc), jnp.float32).at[:, dst].set(src.T, mode="drop")
  return jnp.zeros((m_alloc, g), jnp.float32).at[dst].set(src, mode="drop")


def _as_words(a_q: jax.Array) -> jax.Array:
  """8-bit [R, H] -> uint32 [R, H / 4] (the same bytes)."""
  r, h = a_q.shape
  return lax.bitcast_convert_type(a_q.reshape(r, h // 4, 4), jnp.uint32)


def _from_words(words: jax.Array, dtype) -> jax.Array:
  return lax.bitcast_convert_type(words, dtype).reshape(words.shape[0], -1)


def _sorted_8bit_rows(a_q, a_scale, topk_ids, e: int, m_alloc: int, block_ms, interpret, *,
                      transposed_scales: bool = False):
  """The 8-bit GEMMs' operands in sorted-slot order, routed as the bf16 rows are
  (_sorted_rows: jmoe.kernels.route's kernels up to 8192 slots, above them its slot positions
  and the Pallas row scatter; the jnp path where those do not run), the rows moved as 4-byte
  words (one uint32 per 4 bytes: the copies' kernels take 32-bit rows; H % 4 != 0 falls back
  to XLA's gather of the bytes) and their scales scattered by the slots' positions.
  Returns (rows [m_alloc, H], scales [m_alloc, G] f32 ([G, m_alloc] with transposed_scales),
  group_sizes [E], inv [T, k], [(meta, num_tasks) per block_m])."""
  if a_q.shape[1] % 4:
    xs, inv, group_sizes, metas = route_xla(a_q, topk_ids, e, m_alloc, block_ms,
                                            permute_impl="xla", interpret=interpret)
  else:
    words, inv, group_sizes, metas = _sorted_rows(_as_words(a_q), topk_ids, e, m_alloc,
                                                  block_ms, "auto", "auto", interpret)
    xs = _from_words(words, a_q.dtype)
  scales = _sorted_act_scale(a_scale, inv, m_alloc, transposed=transposed_scales)
  return xs, scales, group_sizes, inv, metas


# _requant_rows' per-token form on jmoe.kernels.quant_rows (False: XLA's reduce + convert;
# benchmarks/bench_quant.py --requant xla)
REQUANT_KERNEL = True


def _requant_rows(h: jax.Array, live: jax.Array, quant, interpret):
  """GEMM1's bf16 output quantized per the scheme's (per-token / per-tensor) activation
  format: a row's scale spans all N column tiles, which no one epilogue tile sees. Per token,
  by jmoe.kernels.quant_rows (one pass over the rows; every row, the unwritten ones past
  sum(group_sizes) too, which no task of GEMM2 reads) where its Triton lowering runs; else in
  XLA, the dead rows zeroed first so that a per-tensor amax ignores them."""
  from jmoe.quant.activations import quantize_activations  # noqa: PLC0415
  if (REQUANT_KERNEL and quant.act_scale == "dynamic_token"
      and _quant_rows.scheme_supports(*h.shape, quant)
      and _route_kernels_run(h, live, interpret)):
    return _quant_rows.quantize_scheme(h, quant, interpret=interpret)
  h = jnp.where(live[:, None], h.astype(jnp.float32), 0.0)
  return quantize_activations(h, quant)


def quantized_layout(t: int, k: int, e: int, hdim: int, n: int, act: Activation, quant,
                     layout: str = "auto") -> str:
  """"decode" (jmoe.kernels.decode_q8: one kernel, no sort) or "sorted" (the grouped GEMMs).
  auto: decode where its scheme and sizes are supported and the slots rarely share an expert
  (4 T k <= E, as the bf16 block's decode rule: each slot streams its expert's weights)."""
  if layout not in ("auto", "sorted", "decode"):
    raise ValueError(f"layout={layout!r}: 'auto', 'sorted' or 'decode'")
  ok = _decode_q8.supports(t, k, hdim, n, act, quant)
  if layout == "decode" and not ok:
    raise ValueError(f"layout='decode': the 8-bit decode kernel does not take {quant} at "
                     f"T={t}, k={k}, H={hdim}, N={n}, {act.name} (decode_q8.supports)")
  if layout == "auto":
    return "decode" if ok and 4 * t * k <= e else "sorted"
  return layout


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "interpret", "config1",
                                             "config2", "layout"))
def fused_experts_quantized(a_q: jax.Array, a_scale: jax.Array, w13, w2,
                            topk_weights: jax.Array, topk_ids: jax.Array, *,
                            activation: Activation | str = "silu",
                            w13_bias: jax.Array | None = None, w2_bias: jax.Array | None = None,
                            out_dtype=jnp.bfloat16, interpret: Any = False,
                            config1=None, config2=None, layout: str = "auto") -> jax.Array:
  """fused_experts for 8-bit W8A8 weights (jmoe.quant.QuantizedWeights, K-major): the scheme's
  semantics of jmoe.experts.xla.quantized_expert_mlp_sorted on the 8-bit kernels.

  a_q [T, H] 8-bit (prepare's quantized tokens), a_scale per-token [T, 1], per-tensor [1, 1]
  or per-group [T, H/128] (fp8_block); w13 values [E, 2N, H] (gated) / [E, N, H], w2 values
  [E, H, N]. Schemes: fp8_tensor / fp8_channel / int8 (grouped_gemm_q8 for both GEMMs, GEMM1's
  bf16 output re-quantized per token in XLA), their static forms (a_scale [1, 1], w13's
  input_scale; GEMM1's epilogue scales by 1 / w2.input_scale and writes GEMM2's 8-bit input
  itself) and fp8_block (grouped_gemm_q8's block kernel;
  GEMM1's epilogue writes GEMM2's fp8 input and its per-128-column scales: no bf16
  intermediate). Routing: moe_align + an XLA row gather of the 8-bit rows and their scales;
  the router weights are applied in the final gather-sum (f32), as in fused_experts.
  config1 / config2: the GEMMs' configs (GroupedGemmConfig for the per-token schemes,
  grouped_gemm_q8.BlockQ8Config for fp8_block, where GEMM2 takes GEMM1's block_m: it reads
  GEMM1's per-task scales); None: the defaults. layout: quantized_layout's ("decode": the
  one-kernel W8A8 decode block, whose intermediate scale is per 128 columns of a slot).
  Returns [T, H] out_dtype.
  """
  from jmoe.kernels import grouped_gemm_q8 as q8  # noqa: PLC0415
  act = as_activation(activation)
  quant = w13.scheme
  t, k = topk_ids.shape
  e, n13, hdim = w13.values.shape
  n = n13 // 2 if act.is_gated else n13
  m = t * k
  if quantized_layout(t, k, e, hdim, n, act, quant, layout) == "decode":
    return _decode_q8.fused_experts_decode_q8(
        a_q, a_scale, w13, w2, topk_weights, topk_ids, activation=act, w13_bias=w13_bias,
        w2_bias=w2_bias, out_dtype=out_dtype, interpret=interpret)
  block = quant.weight_scale == "block"
  if block:
    cfg1, cfg2 = _fp8_block_configs(m, n, hdim, e, act, config1, config2)
  else:
    dt = w13.values.dtype
    cfg1 = config1 or q8.q8_config(m, n, hdim, e, gated=act.is_gated, dtype=dt)
    cfg2 = config2 or q8.q8_config(m, hdim, n, e, gated=False, dtype=dt)
  bms = sorted({cfg1.block_m, cfg2.block_m})
  m_alloc = gg.row_alloc(m, *bms)
  # (fp8_block's scales [H / 128, m_alloc], the block kernel's layout; else [m_alloc, 1])
  xs, xs_scale, group_sizes, inv, meta_list = _sorted_8bit_rows(
      a_q, a_scale, topk_ids, e, m_alloc, bms, interpret, transposed_scales=block)
  metas = dict(zip(bms, meta_list))
  if block:
    y = _fp8_block_mlp(xs, xs_scale, w13, w2, metas[cfg1.block_m], act=act, w13_bias=w13_bias,
                       w2_bias=w2_bias, out_dtype=out_dtype, config1=cfg1, config2=cfg2,
                       interpret=interpret)
  else:
    live = jnp.arange(m_alloc) < jnp.sum(group_sizes)
    y = _factored_q8_mlp(xs, xs_scale[:, 0], w13, w2, group_sizes, metas[cfg1.block_m],
                         metas[cfg2.block_m], live, act=act, w13_bias=w13_bias,
                         w2_bias=w2_bias, out_dtype=out_dtype, config1=cfg1, config2=cfg2,
                         interpret=interpret)
  return _perm.gather_sum(y, inv, topk_weights, out_dtype=out_dtype)


def _factored_q8_mlp(xs, xs_scale, w13, w2, group_sizes, meta1, meta2, live, *, act,
                     w13_bias, w2_bias, out_dtype, config1, config2, interpret):
  """GEMM1 -> the intermediate in 8 bits -> GEMM2 on grouped_gemm_q8, for the schemes whose
  scales factor out of K (fp8_tensor / fp8_channel / int8 and their static forms). xs [R, H]
  8-bit kernel rows, xs_scale [R] f32, meta1 / meta2 the two GEMMs' task lists over those rows,
  live [R] the rows a task computes. Returns all R rows of GEMM2's output (rows no task
  computes unwritten)."""
  from jmoe.kernels import grouped_gemm_q8 as q8  # noqa: PLC0415
  quant = w13.scheme
  r = xs.shape[0]
  e, n13, hdim = w13.values.shape
  w13_cols = q8.column_scale_matrix(w13.scale, e, n13, argname="w13.scale")
  if quant.static_activations:
    # GEMM2's input scale is known before the call (w2.input_scale): GEMM1's epilogue
    # multiplies by its inverse and writes the 8-bit rows (saturating), no bf16 round trip
    s2 = w2.input_scale.astype(jnp.float32).reshape(())
    hq = q8.q8_run(xs, w13.values, group_sizes, xs_scale, w13_cols, act=act,
                   gated=act.is_gated, bias=w13_bias, row_scale=jnp.full((r,), 1 / s2),
                   out_dtype=w2.values.dtype, config=config1, interpret=interpret,
                   meta=meta1, keep_rows=True)[:r]
    hs = s2
  else:
    h = q8.q8_run(xs, w13.values, group_sizes, xs_scale, w13_cols, act=act,
                  gated=act.is_gated, bias=w13_bias, out_dtype=jnp.bfloat16, config=config1,
                  interpret=interpret, meta=meta1, keep_rows=True)[:r]
    hq, hs = _requant_rows(h, live, quant, interpret)
  return q8.q8_run(hq, w2.values, group_sizes, q8.row_scale_vector(hs, r),
                   q8.column_scale_matrix(w2.scale, e, hdim, argname="w2.scale"), act=None,
                   gated=False, bias=w2_bias, out_dtype=out_dtype, config=config2,
                   interpret=interpret, meta=meta2, keep_rows=True)[:r]


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "interpret", "config1",
                                             "config2"))
def fused_experts_quantized_batched(a_q: jax.Array, a_scale: jax.Array,
                                    expert_num_tokens: jax.Array, w13, w2, *,
                                    activation: Activation | str = "silu",
                                    w13_bias: jax.Array | None = None,
                                    w2_bias: jax.Array | None = None, out_dtype=jnp.bfloat16,
                                    interpret: Any = False, config1=None,
                                    config2=None) -> jax.Array:
  """The batched (masked) format of fused_experts_quantized: each expert's own rows.

  a_q [E, C, H] 8-bit (prepare's quantized rows, expert e's first expert_num_tokens[e] rows
  live), a_scale per row [E, C, 1] or per tensor [1, 1] (dynamic or static) f32 -- fp8_block:
  per 1 x 128 group [E, C, H / 128]; w13 / w2 K-major QuantizedWeights of a scheme whose scales
  factor out of K (fp8_tensor, fp8_channel, int8 and their static forms) or fp8_block. Both
  GEMMs run on grouped_gemm_q8 (fp8_block: its block kernel, GEMM1's epilogue writing GEMM2's
  fp8 rows and their per-128 scales, as in fused_experts_quantized) over task lists aligned to
  each expert's rows: row tiles past an expert's count are never scheduled (an empty expert
  reads no weights); the intermediate is quantized as in fused_experts_quantized (static: in
  GEMM1's epilogue). Returns [E, C, H] out_dtype, rows past the counts zero (the batched
  finalize weights and gathers the live ones).
  """
  from jmoe.kernels import grouped_gemm_q8 as q8  # noqa: PLC0415
  act = as_activation(activation)
  quant = w13.scheme
  block = quant.weight_scale == "block"
  if (quant.weight_scale not in ("tensor", "channel", "block")) or quant.act_dtype is None:
    raise ValueError(f"fused_experts_quantized_batched takes per-tensor / per-channel W8A8 "
                     f"weights (fp8_tensor, fp8_channel, int8, their static forms) or "
                     f"fp8_block, got {quant}")
  if a_q.ndim != 3 or expert_num_tokens.shape != (a_q.shape[0],):
    raise ValueError(f"a_q must be [E, C, H] and expert_num_tokens [E], got {a_q.shape} and "
                     f"{expert_num_tokens.shape}")
  e, cap, hdim = a_q.shape
  n13 = w13.values.shape[1]
  n = n13 // 2 if act.is_gated else n13
  m = e * cap
  counts = jnp.clip(expert_num_tokens.astype(jnp.int32), 0, cap)
  starts = jnp.arange(e, dtype=jnp.int32) * cap
  live = (jnp.arange(cap)[None, :] < counts[:, None]).reshape(m)
  if block:
    y = _batched_fp8_block(a_q.reshape(m, hdim), a_scale.reshape(m, -1), w13, w2, starts,
                           counts, cap, act=act, w13_bias=w13_bias, w2_bias=w2_bias,
                           out_dtype=out_dtype, config1=config1, config2=config2,
                           interpret=interpret)
    return jnp.where(live[:, None], y, jnp.zeros((), y.dtype)).reshape(e, cap, hdim)
  dt = w13.values.dtype
  cfg1 = config1 or q8.q8_config(m, n, hdim, e, gated=act.is_gated, dtype=dt)
  cfg2 = config2 or q8.q8_config(m, hdim, n, e, gated=False, dtype=dt)
  metas = {bm: gg.tile_metadata_from_bounds(starts, starts + counts, bm, e * -(-cap // bm))
           for bm in {cfg1.block_m, cfg2.block_m}}
  xs_scale = a_scale.reshape(-1, 1) if a_scale.size != 1 else a_scale
  y = _factored_q8_mlp(a_q.reshape(m, hdim), q8.row_scale_vector(xs_scale, m), w13, w2, counts,
                       metas[cfg1.block_m], metas[cfg2.block_m], live, act=act,
                       w13_bias=w13_bias, w2_bias=w2_bias, out_dtype=out_dtype, config1=cfg1,
                       config2=cfg2, interpret=interpret)
  return jnp.where(live[:, None], y, jnp.zeros((), y.dtype)).reshape(e, cap, hdim)


def _fp8_block_configs(m: int, n: int, hdim: int, e: int, act: Activation, config1, config2):
  """fp8_block's (GEMM1, GEMM2) BlockQ8Configs for m rows: GEMM1 quantizes its output per 128
  columns (so its tiles are 128 wide), GEMM2 reads GEMM1's per-task scales (the same task
  list, so the same block_m); stages fitted to shared memory."""
  from jmoe.kernels import grouped_gemm_q8 as q8  # noqa: PLC0415
  cfg1 = config1 or q8.block_config(m, n, hdim, e, gated=act.is_gated, quantize_output=True)
  cfg1 = q8.fit_block_stages(cfg1, 2 if act.is_gated else 1, hdim)
  if cfg1.block_n != 128:
    raise ValueError(f"config1.block_n={cfg1.block_n}: GEMM1 quantizes its output per 128 "
                     "columns, so its tiles are 128 wide")
  cfg2 = config2 or q8.gemm2_block_config(cfg1, hdim)
  return cfg1, q8.fit_block_stages(dataclasses.replace(cfg2, block_m=cfg1.block_m), 1, n)


def _fp8_block_mlp(xs, xs_scale_t, w13, w2, meta, *, act, w13_bias, w2_bias, out_dtype,
                   config1, config2, interpret):
  """fp8_block's GEMM1 (its epilogue writing GEMM2's fp8 rows and per-task scales) and GEMM2
  on kernel rows xs [m_pad, H] (their scales transposed, [H / 128, m_pad]) over the task list
  meta. -> [m_pad, H] (rows no task covers unwritten)."""
  from jmoe.kernels import grouped_gemm_q8 as q8  # noqa: PLC0415
  hq, h_tiles = q8.block_run(xs, w13.values, w13.scale, xs_scale_t, a_layout="rows", meta=meta,
                             act=act, gated=act.is_gated, bias=w13_bias, quantize_output=True,
                             config=config1, interpret=interpret)
  return q8.block_run(hq, w2.values, w2.scale, h_tiles, a_layout="tasks", meta=meta, act=None,
                      gated=False, bias=w2_bias, out_dtype=out_dtype, config=config2,
                      interpret=interpret)


def _batched_fp8_block(xs, xs_scale, w13, w2, starts, counts, cap: int, *, act, w13_bias,
                       w2_bias, out_dtype, config1, config2, interpret):
  """fp8_block over the batched rows xs [E * C, H] (scales [E * C, H / 128]), one task list
  aligned to each expert's live rows [starts, starts + counts). -> [E * C, H] out_dtype, rows
  past the counts unwritten."""
  m, hdim = xs.shape
  e = counts.shape[0]
  n13 = w13.values.shape[1]
  cfg1, cfg2 = _fp8_block_configs(m, n13 // 2 if act.is_gated else n13, hdim, e, act, config1,
                                  config2)
  bm = cfg1.block_m
  m_pad = gg.row_alloc(m, bm)  # (a tile past the rows' end is shifted back inside m_pad)
  if m_pad != m:
    xs = jnp.pad(xs, ((0, m_pad - m), (0, 0)))
    xs_scale = jnp.pad(xs_scale, ((0, m_pad - m), (0, 0)), constant_values=1.0)
  meta = gg.tile_metadata_from_bounds(starts, starts + counts, bm, e * -(-cap // bm))
  return _fp8_block_mlp(xs, xs_scale.T, w13, w2, meta, act=act, w13_bias=w13_bias,
                        w2_bias=w2_bias, out_dtype=out_dtype, config1=cfg1, config2=cfg2,
                        interpret=interpret)[:m]


# grouped_gemm_wq (one warpgroup; what sizes 128 does not divide and e4m3 codes run) beats
# dequantizing every expert per call while the experts get few rows each (the dequantize's
# cost is the weights', the in-register conversion's grows with the rows). H200, 4096 tokens
# (2026-12-02): qwen3 (256 rows an expert) w4a16 989 vs 1,084 µs, mxfp4 1,252 vs 1,337;
# mixtral (1,024 rows an expert) w4a16 5,474 vs 5,167, mxfp4 7,055 vs 5,551.
PREFILL_MAX_ROWS_PER_EXPERT = 512
LAYOUTS = ("auto", "decode", "decode_fp8", "decode_shared", "prefill", "prefill_ws",
           "prefill_fp8", "dequantize")


def weight_only_layout(t: int, k: int, h: int, n: int, act: Activation, w13, w2,
                       layout: str = "auto") -> str:
  """"decode" (jmoe.kernels.decode_wq: the packed codes are the only weight bytes read, an
  expert streamed once per slot), "decode_shared" (jmoe.kernels.decode_wq_shared: the same
  with up to 8 slots of one expert per work item, so an expert streams once per 8 of its
  slots; the group scales cost a multiply per weight element), "prefill_ws"
  (jmoe.kernels.grouped_gemm_wq_ws: warp-specialized grouped GEMMs on 4-bit or int8 codes
  converted in registers, H and N multiples of 64), "prefill" (jmoe.kernels.grouped_gemm_wq: the
  single-warpgroup form, which also takes e4m3 codes) or
  "dequantize" (the weights dequantized in the graph per call, then the bf16 kernels).
  auto: where slots share experts on average (T * k >= 2 E) prefill_ws where it takes the
  call, else decode_shared (also where decode_wq refuses only what decode_wq_shared takes:
  zero points at H / 128 not a multiple of 16); decode where it takes the problem and slots
  do not share experts; past those (prefill, more than 128 slots, or slots sharing experts in
  a format decode_wq_shared refuses: e2m1, groups of 16 / 32) prefill_ws where it takes the
  call (H200, 4096 tokens: w4a16 0.92-1.11 x
  bf16's time against grouped_gemm_wq's 1.13-1.42 x), else prefill for 4-bit and e4m3 codes
  while the experts average at most PREFILL_MAX_ROWS_PER_EXPERT rows, else dequantize
  (docs/kernels.md, "Slots that share experts", "e2m1 and small groups", "Weight-only
  prefill"). 4-bit codes with fp8 tokens (mxfp4_fp8, nvfp4_fp8, w4afp8): "decode_fp8"
  (decode_wq's 8-bit MMAs on the fp8 tokens, the intermediate quantized per 128 columns)
  only when asked -- the bf16-token decode kernel on mma.sync is faster (BENCHMARKS.md, "fp8
  tokens over 4-bit codes"); "prefill_fp8" (grouped_gemm_w4a8) where it takes the call and
  the bf16-token rule would not pick "decode"; elsewhere the tokens are dequantized to bf16
  and the weight-only rule picks (`weight_only_view`). mxfp8's tokens are dequantized always
  (`fp8_token_kernels`)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r}: one of {', '.join(map(repr, LAYOUTS))}")
  if w13.scheme.act_dtype is not None:
    view13, view2 = weight_only_view(w13), weight_only_view(w2)
    if not fp8_token_kernels(w13.scheme) or layout not in ("auto", "decode_fp8",
                                                            "prefill_fp8"):
      return weight_only_layout(t, k, h, n, act, view13, view2, layout)
    if layout == "decode_fp8":
      why = _decode_wq.unsupported(t, k, h, n, act, w13, w2)
      if why is not None:
        raise ValueError(f"layout='decode_fp8': the fp8-token decode kernel does not take "
                         f"this call: {why}")
      return layout
    why8 = _w4a8_unsupported(h, n, act, w13, w2)
    if layout == "prefill_fp8":
      if why8 is not None:
        raise ValueError(f"layout='prefill_fp8': the fp8-token prefill GEMMs do not take this "
                         f"call: {why8}")
      return layout
    bf16_rule = weight_only_layout(t, k, h, n, act, view13, view2, layout)
    return "prefill_fp8" if why8 is None and bf16_rule != "decode" else bf16_rule
  if layout in ("decode_fp8", "prefill_fp8"):
    raise ValueError(f"layout={layout!r} takes fp8 tokens over 4-bit codes (mxfp4_fp8, "
                     f"nvfp4_fp8, w4afp8), not {w13.scheme.name}")
  why = _decode_wq.unsupported(t, k, h, n, act, w13, w2)
  e = w13.shape[0]
  sharing = t * k >= 2 * e  # slots share experts on average
  why_shared = _decode_wq_shared.unsupported(t, k, h, n, act, w13, w2)
  why_prefill = _gg_wq.unsupported(t * k, h, n, act, w13, w2)
  why_ws = _wq_ws_unsupported(h, n, act, w13, w2)
  for name, reason in (("decode", why), ("decode_shared", why_shared),
                       ("prefill", why_prefill), ("prefill_ws", why_ws)):
    if layout == name and reason is not None:
      raise ValueError(f"layout={name!r}: the weight-only {name} kernel does not take this "
                       f"call: {reason}")
  if layout == "auto":
    # where slots share experts the warp-specialized GEMMs beat the shared decode kernel
    # (H100, mixtral, 2026-12-07: 16 tokens w4a16 575.7 against 645.8 us, w8a16 615.6 / 719.4;
    # 64 tokens 583.0 / 1,610.8 and 631.5 / 1,647.6)
    if sharing and why_ws is None:
      return "prefill_ws"
    if why_shared is None and (why is not None or sharing):
      return "decode_shared"
    if why is None and not sharing:
      return "decode"
    # past the decode kernels, or where slots share experts and the shared kernel refuses the
    # format (e2m1, small groups: decode_wq streams an expert per slot), the prefill GEMMs
    # stream each expert once, for 4-bit codes (measured; H200, mixtral mxfp4 at 16 tokens:
    # 888 us against 2,414 decode_wq, 2,333 dequantized; docs/kernels.md)
    # (and for e4m3 codes: mxfp8's groups of 32, which the shared kernel refuses; H200 qwen3
    # 4096 tokens: 1,170 us against 1,394 dequantized)
    if why_ws is None:  # (H200 mixtral mxfp4 16 tokens: 721 us against 888 on the above)
      return "prefill_ws"
    fp8_codes = w13.scheme.weight_dtype == "float8_e4m3fn"
    if (why_prefill is None and (w13.packed or fp8_codes)
        and t * k <= PREFILL_MAX_ROWS_PER_EXPERT * e):
      return "prefill"
    return "dequantize"
  return layout


def _wq_ws_unsupported(h: int, n: int, act: Activation, w13, w2) -> str | None:
  """Why the warp-specialized weight-only GEMMs (jmoe.kernels.grouped_gemm_wq_ws) cannot take
  the experts (None: they can): a gated activation, one scheme, each GEMM's codes and sizes."""
  if not act.is_gated:
    return f"{act.name}: a gated activation"
  if w2.scheme != w13.scheme:
    return "w13 and w2 must share one scheme"
  return _wq_ws.unsupported(h, n, w13) or _wq_ws.unsupported(n, h, w2)


def _ws_prefill(x, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias, out_dtype,
                interpret):
  """The sorted layout on the warp-specialized weight-only GEMMs: the routing, GEMM1 (gated,
  the intermediate in the tokens' dtype), GEMM2 (its bias per row), the router-weighted
  gather-sum; 256-token tiles where the experts average SPLIT_ROWS rows."""
  t, k = topk_ids.shape
  e = w13.shape[0]
  h_dim, n = w2.shape[2], w2.shape[1]
  cfg1 = _wq_ws.default_config(w13, n, True, x.dtype, t * k)
  cfg2 = _wq_ws.default_config(w2, h_dim, False, x.dtype, t * k, out_dtype)
  block_ms = tuple(sorted({cfg1.block_m, cfg2.block_m}))
  m_alloc = gg.row_alloc(t * k, *block_ms)
  xs, inv, _, metas = _sorted_rows(x, topk_ids, e, m_alloc, block_ms, "auto", "auto",
                                   interpret)
  meta = dict(zip(block_ms, metas))
  h = _wq_ws.wq_ws_run(xs, w13, meta=meta[cfg1.block_m], act=act, gated=True, bias=w13_bias,
                       out_dtype=x.dtype, config=cfg1, interpret=interpret)
  y = _wq_ws.wq_ws_run(h, w2, meta=meta[cfg2.block_m], act=None, gated=False, bias=w2_bias,
                       out_dtype=out_dtype, config=cfg2, interpret=interpret)
  return _perm.gather_sum(y, inv, topk_weights, out_dtype=out_dtype)


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "interpret"))
def fused_experts_weight_only_batched(x: jax.Array, expert_num_tokens: jax.Array, w13, w2, *,
                                      activation: Activation | str = "silu",
                                      w13_bias: jax.Array | None = None,
                                      w2_bias: jax.Array | None = None,
                                      out_dtype=jnp.bfloat16, interpret: Any = False,
                                      x_scale: jax.Array | None = None) -> jax.Array:
  """The batched (masked) format of fused_experts_weight_only: each expert's own rows.

  x [E, C, H] bf16 / f16 (expert e's first expert_num_tokens[e] rows live), or the 8-bit rows
  of a scheme with quantized tokens with their x_scale ([E, C, 1] per row, [1, 1] per tensor,
  or per group), dequantized here into bf16 (the bf16-token kernels run them); w13 / w2
  weight-only QuantizedWeights (logical [E, H, 2N] / [E, N, H]). Where the warp-specialized
  weight-only GEMMs take the experts (grouped_gemm_wq_ws: a gated activation, 4-bit or int8
  codes, H and N multiples of 64), both GEMMs run there over task lists aligned to each expert's
  rows (tiles past an expert's count are never scheduled: an empty expert reads no codes);
  elsewhere the weights are dequantized in the graph into the bf16 batched kernels.
  Returns [E, C, H] out_dtype, rows past the counts zero.
  """
  act = as_activation(activation)
  if x.ndim != 3 or expert_num_tokens.shape != (x.shape[0],):
    raise ValueError(f"x must be [E, C, H] and expert_num_tokens [E], got {x.shape} and "
                     f"{expert_num_tokens.shape}")
  e, cap, hdim = x.shape
  if x_scale is not None:  # 8-bit tokens: their values times their scales, in bf16
    s = x_scale.reshape(1, 1) if x_scale.size == 1 else x_scale.reshape(e * cap, -1)
    x = dequantize_activations(x.reshape(e * cap, hdim), s, jnp.bfloat16).reshape(e, cap, hdim)
  elif jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"x must be bf16 / f16 (or 8-bit with x_scale), got {x.dtype}")
  w13, w2 = weight_only_view(w13), weight_only_view(w2)
  n = w2.shape[1]
  counts = jnp.clip(expert_num_tokens.astype(jnp.int32), 0, cap)
  live = jnp.arange(cap)[None, :] < counts[:, None]
  if _wq_ws_unsupported(hdim, n, act, w13, w2) is None:
    m = e * cap
    cfg1 = _wq_ws.default_config(w13, n, True, x.dtype, m)
    cfg2 = _wq_ws.default_config(w2, hdim, False, x.dtype, m, out_dtype)
    m_pad = max(m, cfg1.block_m, cfg2.block_m)  # (the kernels' rows: at least one tile)
    starts = jnp.arange(e, dtype=jnp.int32) * cap
    metas = {bm: gg.tile_metadata_from_bounds(starts, starts + counts, bm, e * -(-cap // bm))
             for bm in {cfg1.block_m, cfg2.block_m}}
    xs = jnp.pad(x.reshape(m, hdim), ((0, m_pad - m), (0, 0)))
    h = _wq_ws.wq_ws_run(xs, w13, meta=metas[cfg1.block_m], act=act, gated=True,
                         bias=w13_bias, out_dtype=x.dtype, config=cfg1, interpret=interpret)
    y = _wq_ws.wq_ws_run(h, w2, meta=metas[cfg2.block_m], act=None, gated=False, bias=w2_bias,
                         out_dtype=out_dtype, config=cfg2, interpret=interpret)
    y = y[:m].reshape(e, cap, hdim)
  else:
    d13, d2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)
    gemm1 = gg.batched_grouped_gemm_gated if act.is_gated else gg.batched_grouped_gemm
    h = gemm1(x, d13, counts, activation=act, bias=w13_bias, interpret=interpret)
    y = gg.batched_grouped_gemm(h, d2, counts, bias=w2_bias, out_dtype=out_dtype,
                                interpret=interpret)
  return jnp.where(live[..., None], y, jnp.zeros((), y.dtype)).astype(out_dtype)


def fp8_token_kernels(q) -> bool:
  """Whether the weight-only path takes scheme q's quantized tokens as they are: 4-bit codes
  with fp8 tokens scaled per token or per tensor (decode_wq's 8-bit MMAs, grouped_gemm_w4a8).
  Other quantized tokens over weight-only codes (mxfp8: e4m3 weights, tokens in groups of 32
  with e8m0 scales, which Hopper's MMAs cannot apply per 32 along K) are dequantized into bf16
  first -- exactly: every such value is a bf16 number -- and run the bf16-token kernels."""
  return (q.act_dtype == "float8_e4m3fn" and q.act_scale in ROW_SCALES
          and q.weight_dtype in ("int4", "float4_e2m1fn"))


def _w4a8_unsupported(h: int, n: int, act: Activation, w13, w2) -> str | None:
  """Why the fp8-token prefill GEMMs (jmoe.kernels.grouped_gemm_w4a8) cannot take the
  experts (None: they can): mxfp4 codes with fp8 tokens per token or per tensor, a gated
  activation, GEMM1's and GEMM2's sizes."""
  q = w13.scheme
  if q.act_dtype != "float8_e4m3fn" or q.act_scale not in ROW_SCALES:
    return f"{q.name}: fp8 tokens with one scale per token or per tensor"
  if w2.scheme != q:
    return "w13 and w2 must share one scheme"
  if not act.is_gated:
    return f"{act.name}: a gated activation"
  return _w4a8.unsupported(h, n, w13) or _w4a8.unsupported(n, h, w2)


def _w4a8_prefill(x_q, x_scale, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias,
                  out_dtype, interpret):
  """The sorted layout on the fp8-token GEMMs over mxfp4 codes: moe_align, the fp8 token rows
  and their scales gathered, GEMM1 (gated, bf16 out), its output re-quantized per the scheme
  (fused_experts_quantized's per-token step), GEMM2, the router-weighted gather-sum."""
  from jmoe.kernels.grouped_gemm_q8 import row_scale_vector  # noqa: PLC0415
  t, k = topk_ids.shape
  e = w13.shape[0]
  h_dim, n = w2.shape[2], w2.shape[1]
  cfg1 = _w4a8.default_config(n, True, t * k / e)
  cfg2 = _w4a8.default_config(h_dim, False, t * k / e)
  m_alloc = gg.row_alloc(t * k, cfg1.block_m, cfg2.block_m)
  bms = (cfg1.block_m,) if cfg2.block_m == cfg1.block_m else (cfg1.block_m, cfg2.block_m)
  xs, xs_scale, group_sizes, inv, metas = _sorted_8bit_rows(x_q, x_scale, topk_ids, e, m_alloc,
                                                            bms, interpret)
  num_rows = jnp.sum(group_sizes)
  meta1, meta2 = metas[0], metas[-1]
  h = _w4a8.w4a8_run(xs, w13, xs_scale[:, 0], meta=meta1, act=act, gated=True, bias=w13_bias,
                     out_dtype=jnp.bfloat16, config=cfg1, interpret=interpret)
  hq, hs = _requant_rows(h, jnp.arange(m_alloc) < num_rows, w13.scheme, interpret)
  y = _w4a8.w4a8_run(hq, w2, row_scale_vector(hs, m_alloc), meta=meta2, act=None, gated=False,
                     bias=w2_bias, out_dtype=out_dtype, config=cfg2, interpret=interpret)
  return _perm.gather_sum(y, inv, topk_weights, out_dtype=out_dtype)


def weight_only_view(w):
  """QuantizedWeights of a 4-bit scheme with fp8 tokens as the same codes and scales under
  the weight-only scheme (bf16 tokens): what the bf16-token kernels take."""
  q = w.scheme
  if q.act_dtype is None:
    return w
  fields = ("weight_dtype", "weight_scale", "block_shape", "group_size", "zero_point",
            "scale_dtype")  # (a named scheme would refill the activation fields)
  bf16_tokens = QuantConfig("custom", **{f: getattr(q, f) for f in fields})
  return dataclasses.replace(w, scheme=bf16_tokens)


def _weight_only_prefill(x, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias, out_dtype,
                         interpret, config=None):
  """The sorted layout on the weight-only grouped GEMMs (jmoe.kernels.grouped_gemm_wq): the
  routing (128-row tiles), GEMM1 and GEMM2 on the packed codes, the gather-sum of each slot's
  column."""
  t, k = topk_ids.shape
  e = w13.shape[0]
  m_alloc = gg.row_alloc(t * k, _gg_wq.BM)
  xs, inv, _, metas = _sorted_rows(x, topk_ids, e, m_alloc, (_gg_wq.BM,), "auto", "auto",
                                   interpret)
  meta, num_tasks = metas[0]
  y_t = _gg_wq.prefill_wq(xs, meta, num_tasks, w13, w2, activation=act, w13_bias=w13_bias,
                          config=config, interpret=interpret)
  cols = _gg_wq.slot_columns(inv, meta, num_tasks, m_alloc)
  return _gg_wq.combine_columns(y_t, cols, topk_weights, w2_bias, topk_ids=topk_ids,
                                num_experts=e, out_dtype=out_dtype)


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "interpret", "layout"))
def fused_experts_weight_only(x: jax.Array, w13, w2, topk_weights: jax.Array,
                              topk_ids: jax.Array, *, activation: Activation | str = "silu",
                              w13_bias: jax.Array | None = None,
                              w2_bias: jax.Array | None = None, out_dtype=jnp.bfloat16,
                              interpret: Any = False, layout: str = "auto",
                              x_scale: jax.Array | None = None) -> jax.Array:
  """fused_experts for weight-only quantized experts (w4a16, w8a16, mxfp4, nvfp4 with bf16
  tokens): x [T, H] bf16 / f16, w13 / w2 jmoe.quant.QuantizedWeights (logical [E, H, 2N] /
  [E, N, H]), topk_weights / topk_ids [T, k]; layout: weight_only_layout's. 4-bit codes with
  fp8 tokens (mxfp4_fp8, nvfp4_fp8, w4afp8): x float8_e4m3fn and x_scale [T, 1] / [1, 1]
  (decode: decode_wq's 8-bit MMAs; prefill_fp8, mxfp4: grouped_gemm_w4a8's; elsewhere the
  tokens dequantized into the bf16-token kernels). mxfp8 (e4m3 codes, e8m0 scales per 32;
  tokens e4m3 with x_scale [T, H / 32]): the tokens dequantized into bf16 exactly, the codes
  into bf16 in registers (`fp8_token_kernels`). Returns [T, H] out_dtype."""
  act = as_activation(activation)
  t, k = topk_ids.shape
  _, h, n13 = w13.shape
  n = n13 // 2 if act.is_gated else n13
  chosen = weight_only_layout(t, k, h, n, act, w13, w2, layout)
  if w13.scheme.act_dtype is not None:
    if (x_scale is None) or jnp.dtype(x.dtype) != jnp.dtype(jnp.float8_e4m3fn):
      raise ValueError(f"x / x_scale: {w13.scheme.name} takes prepare's float8_e4m3fn tokens "
                       f"and their scales, got {x.dtype} and x_scale={x_scale is not None}")
    if chosen == "prefill_fp8":
      return _w4a8_prefill(x, x_scale, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias,
                           out_dtype, interpret)
    if chosen != "decode_fp8":
      # the bf16-token kernels on the tokens' values (the barrier keeps XLA from folding
      # prepare's f32 -> fp8 -> bf16 round trip into no rounding at all, which it did on the
      # H200: the tokens came out unquantized)
      x = dequantize_activations(lax.optimization_barrier(x), x_scale, jnp.bfloat16)
      w13, w2, x_scale = weight_only_view(w13), weight_only_view(w2), None
  if chosen == "prefill_ws":
    return _ws_prefill(x, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias, out_dtype,
                       interpret)
  if chosen == "prefill":
    return _weight_only_prefill(x, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias,
                                out_dtype, interpret)
  if chosen in ("decode", "decode_fp8", "decode_shared"):
    run = (_decode_wq.fused_experts_decode_wq if chosen != "decode_shared" else
           _decode_wq_shared.fused_experts_decode_wq_shared)
    kw = dict(x_scale=x_scale) if x_scale is not None else {}
    return run(x, w13, w2, topk_weights, topk_ids, activation=act, w13_bias=w13_bias,
               w2_bias=w2_bias, out_dtype=out_dtype, interpret=interpret, **kw)
  out = fused_experts(x, w13.dequantize(x.dtype), w2.dequantize(x.dtype), topk_weights,
                      topk_ids, activation=act, w13_bias=w13_bias, w2_bias=w2_bias,
                      interpret=interpret)
  return out.astype(out_dtype)


def prepare_weight_only(w13, w2, *, activation: Activation | str = "silu",
                        token_dtype=jnp.bfloat16) -> tuple[Any, Any]:
  """w13 / w2 (weight-only QuantizedWeights, logical [E, H, 2N] / [E, N, H]) with the operands
  the layouts `weight_only_layout` picks for them (auto, from one slot to the most it sends to
  a prefill kernel) would otherwise make on every call kept on them (`jmoe.kernels.prepared`):
  prefill_ws's group-major scales (in token_dtype, the dtype of the tokens they will meet;
  fp8-token schemes meet bf16), prefill's float32 ones, prefill_fp8's exponent shifts, and
  decode's byte scales padded to 16-byte rows where they are not (qwen3 mxfp4's w2; gpt-oss'
  w13 and w2, w13's also to the padded windows of `decode_wq.padded_sizes`), w2's scales per
  128 in the layout of the decode kernels' reduction (`decode_wq.W2_SCALE_T`), and w13's zero
  points as bf16 where H / 128 bytes are no TMA row (`decode_wq.W13_ZERO_16`: without it
  decode_wq refuses them there); the decode kernels otherwise read the stored scales. Made
  once, after loading; the stored arrays are unchanged."""
  from jmoe.kernels.prepared import with_prepared  # noqa: PLC0415
  act = as_activation(activation)
  e, h, n = w13.shape[0], w2.shape[2], w2.shape[1]
  slots = (1, _decode.MAX_SLOTS + 1, PREFILL_MAX_ROWS_PER_EXPERT * e)  # (one token a slot)
  layouts = {weight_only_layout(t, 1, h, n, act, w13, w2) for t in slots}
  v13, v2 = weight_only_view(w13), weight_only_view(w2)
  if w13.scheme.act_dtype is not None:
    token_dtype = jnp.bfloat16  # (the bf16-token kernels get the tokens dequantized)
  ops13, ops2 = [], []
  if "prefill_fp8" in layouts:
    ops13 += _w4a8.OPERANDS
    ops2 += _w4a8.OPERANDS
  if "prefill_ws" in layouts:
    ops13 += _wq_ws.operands(v13, token_dtype)
    ops2 += _wq_ws.operands(v2, token_dtype)
  if "prefill" in layouts:
    ops13 += _gg_wq.operands(v13)
    ops2 += _gg_wq.operands(v2)
  if "decode" in layouts and _decode_wq.byte_scales(v2):  # byte rows to TMA's 16-byte pitch
    plan = _decode_wq.kernel_plan(_decode_wq._plan(v13, v2, False), h, n)
    if plan.scale_bytes and _decode_wq.padded_sizes(plan, h, n)[0] != h:
      ops13.append(_decode_wq.W13_SCALE_BYTES)  # (and to the padded windows: gpt-oss)
    if plan.scale_bytes and v2.scale.shape[-1] % 16:
      ops2.append(_decode_wq.W2_SCALE_BYTES)
  # (decode_shared's transposed w13 scales are made per call for the groups' experts: kept,
  # they would double w13's scale bytes, 294 MB a layer at deepseek-v3 w4a16 with zero points)
  if layouts & {"decode", "decode_shared"} and _decode_wq.reduction_scales(v2):  # the
    ops2.append(_decode_wq.W2_SCALE_T)  # reduction's w2 scales
  if (layouts & {"decode", "decode_shared"} and v13.zero is not None
      and _decode_wq.wide_zeros(h)):  # zero rows no TMA box holds as bytes (deepseek-v3):
    ops13.append(_decode_wq.W13_ZERO_16)  # as bf16, which lets decode take them
  return with_prepared(w13, ops13), with_prepared(w2, ops2)
