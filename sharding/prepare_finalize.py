"""Expert-parallel PrepareFinalize implementations. They run inside `shard_map`.

Each object is built from a `ParallelConfig` (its axis names and sizes) and used by the
`ModularKernel` that `sharding.ep_fused_moe` applies inside the `shard_map` body, so `prepare`
sees this rank's tokens `x [T, H]` (T = tokens per (data, expert) shard) and `finalize` returns
this rank's `[T, H]`. Collectives run over the expert axis; the tensor axis (intermediate dim
split) costs one `psum` at the end of `finalize`.

* `AllGather` / `AllGatherBatched` — all-gather tokens and top-k ids/weights over the expert
  axis, compute the local experts with `expert_map`, reduce-scatter the partial outputs.
* `RaggedA2A` — count slots per (destination, local expert), exchange the counts, send exactly
  the routed copies with a ragged all-to-all, local experts in Standard format, reverse.
* `PaddedA2A` — fixed capacity per (destination rank, local expert): static shapes, one
  `all_to_all` each way, Batched experts; overflow over the capacity is dropped and counted.

`prepare_async` issues the dispatch collective and returns the receiver, which does the local
post-processing; work placed between them (shared experts) has no data dependence on the
collective, so XLA's scheduler is free to overlap them.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from jmoe.config import ParallelConfig
from jmoe.modular import (ActivationFormat, Contiguous, Delegate, ExpertsInput, NaiveBatched,
                          PrepareFinalize, TopKWeightAndReduce, local_expert_ids,
                          weighted_row_sum)
from jmoe.prepare_finalize.no_ep import apply_weight_on_input, batched_layout
from jmoe.kernels.permute import inverse_permutation
from jmoe.quant import dequantize_rows_fp8, quantize_activations, quantize_rows_fp8
from jmoe.sharding import collectives
from jmoe.sharding.mesh import ExpertPlacement, axis_sizes, expert_placement


class EPPrepareFinalize(PrepareFinalize):
  """Common state of the EP variants: axis names/sizes, placement, capacity."""

  needs_expert_axis: bool = True

  def __init__(self, parallel: ParallelConfig, *,
               placement: Union[str, ExpertPlacement, None] = None,
               capacity: Optional[int] = None, ragged_impl: Optional[str] = None):
    if parallel is None or parallel.mesh is None:
      raise ValueError(f"{type(self).__name__} needs parallel=ParallelConfig(mesh=...)")
    if self.needs_expert_axis and parallel.expert_axis is None:
      raise ValueError(f"{type(self).__name__} needs ParallelConfig.expert_axis")
    self.parallel = parallel
    self.expert_axis = parallel.expert_axis
    self.tensor_axis = parallel.tensor_axis
    self.data_axis = parallel.data_axis
    s = axis_sizes(parallel)
    self.ep, self.tp, self.dp = s.ep, s.tp, s.dp
    self.placement_spec = placement if placement is not None else parallel.expert_placement
    self.capacity = capacity if capacity is not None else parallel.dispatch_capacity
    if self.capacity is not None and self.capacity <= 0:
      raise ValueError(f"capacity must be positive, got {self.capacity}")
    self.ragged_impl = ragged_impl or collectives.ragged_impl_for(
        collectives.mesh_platform(parallel.mesh))
    self.dispatch_dtype = parallel.dispatch_dtype
    self.last_dropped = None  # set by prepare (a traced scalar) for the stats side output

  def __repr__(self):
    return (f"{type(self).__name__}(ep={self.ep}, tp={self.tp}, dp={self.dp}, "
            f"placement={getattr(self.placement_spec, 'kind', self.placement_spec)})")

  # ---- helpers usable only inside shard_map

  def placement(self, num_local_experts: int) -> ExpertPlacement:
    return expert_placement(num_local_experts * self.ep, self.ep, self.placement_spec)

  def rank(self) -> jax.Array:
    if self.expert_axis is None:
      return jnp.int32(0)
    return jax.lax.axis_index(self.expert_axis)

  def kernel_expert_map(self, num_local_experts: int) -> Optional[jax.Array]:
    """The `expert_map` the experts get (None: prepare already made ids local)."""
    return None

  def num_dispatchers(self) -> int:
    return self.ep

  def _tensor_psum(self, y: jax.Array) -> jax.Array:
    if self.tensor_axis is not None:  # size 1 too: makes the value tensor-invariant
      y = jax.lax.psum(y, self.tensor_axis)
    return y

  def _count_dropped(self, dropped: jax.Array) -> jax.Array:
    axes = tuple(a for a in (self.data_axis, self.expert_axis) if a is not None)
    return jax.lax.psum(dropped, axes) if axes else dropped

  def prepare(self, *args, **kwargs) -> ExpertsInput:
    return self.prepare_async(*args, **kwargs)()

  def quant_support(self, quant):
    """Quantized rows travel with their own scales, so the scale must belong to the row."""
    why = super().quant_support(quant)
    if why is None and quant is not None and quant.act_scale == "dynamic_tensor":
      return ("a per-tensor dynamic activation scale spans every rank's tokens; the dispatch "
              "carries per-row scales (act_scale='dynamic_token' or 'dynamic_group')")
    return why

  def _fp8_wire(self, quant) -> bool:
    """fp8 dispatch applies: asked for, rows actually leave the rank, and the experts do not
    take quantized activations of their own format."""
    return (self.dispatch_dtype == "fp8" and self.ep > 1
            and (quant is None or not quant.is_quantized))

  def _quantize_for_send(self, a, quant, a1_scale=None):
    """(rows to send, their scales or None): the experts' own activation quantization, else
    the fp8 wire format, else the rows as they are. A static scale does not travel: every
    rank holds it (`_arrived` puts it back)."""
    if self._fp8_wire(quant):
      return quantize_rows_fp8(a)
    q, scale = quantize_activations(a, quant, static_scale=a1_scale)
    return (q, None) if (quant is not None and quant.static_activations) else (q, scale)

  def _arrived(self, a, scale, quant, dtype, a1_scale=None):
    """(activations, scales) for the experts from what arrived: fp8 wire rows dequantized,
    a static scale as [1, 1]."""
    if self._fp8_wire(quant):
      return dequantize_rows_fp8(a, scale, dtype), None
    if quant is not None and quant.static_activations:
      return a, jnp.reshape(a1_scale.astype(jnp.float32), (1, 1))
    return a, scale

  def _routed_slots(self, x, topk_weights, topk_ids, num_local_experts,
                    apply_router_weight_on_input, quant, a1_scale=None):
    """The dispatch's common start: the router-weight hook, activation quantization, and the
    [T, k] slots' validity, destination rank and index among that rank's experts (ep for
    destination and -1 for local index where the slot is empty)."""
    x, topk_weights = apply_weight_on_input(x, topk_weights, apply_router_weight_on_input)
    a1q, send_scale = self._quantize_for_send(x, quant, a1_scale)
    e = num_local_experts * self.ep
    pl = self.placement(num_local_experts)
    ids = topk_ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < e)
    safe = jnp.clip(ids, 0, e - 1)
    dest = jnp.where(valid, jnp.asarray(pl.owner)[safe], self.ep)
    lidx = jnp.where(valid, jnp.asarray(pl.local_index)[safe], -1)
    return a1q, send_scale, topk_weights, valid, dest, lidx


def _resolve(wr: TopKWeightAndReduce, default: TopKWeightAndReduce) -> TopKWeightAndReduce:
  return default if isinstance(wr, Delegate) else wr


# --------------------------------------------------------------------------------------------
# all-gather / reduce-scatter (hybrid EP x TP)


class AllGather(EPPrepareFinalize):
  """All-gather tokens + top-k over the expert axis; local experts; reduce-scatter back."""

  name = "allgather"
  activation_format = ActivationFormat.Standard
  default_weight_and_reduce = Contiguous()
  needs_expert_axis = False

  def kernel_expert_map(self, num_local_experts):
    if self.ep == 1:
      return None
    maps = jnp.asarray(self.placement(num_local_experts).expert_maps)
    return maps[self.rank()]

  def _gather(self, v):
    if v is None or self.ep == 1:
      return v
    return jax.lax.all_gather(v, self.expert_axis, tiled=True)

  def prepare_async(self, x, topk_weights, topk_ids, *, num_local_experts, expert_map,
                    apply_router_weight_on_input, quant, a1_scale=None):
    x, topk_weights = apply_weight_on_input(x, topk_weights, apply_router_weight_on_input)
    a1q, send_scale = self._quantize_for_send(x, quant, a1_scale)  # quantize before sending
    a, scale = self._gather(a1q), self._gather(send_scale)
    w, ids = self._gather(topk_weights), self._gather(topk_ids.astype(jnp.int32))
    self.last_dropped = jnp.int32(0)

    def receive():
      a_, scale_ = self._arrived(a, scale, quant, x.dtype, a1_scale)
      return ExpertsInput(a=a_, a_scale=scale_, topk_weights=w, topk_ids=ids,
                          format=ActivationFormat.Standard)
    return receive

  def _combine(self, y: jax.Array, out_dtype) -> jax.Array:
    """y [ep*T, H] f32 partial sums -> [T, H]: one reduce-scatter over (expert, tensor)."""
    m = y.shape[0]
    t = m // self.ep
    ea, ta = self.expert_axis, self.tensor_axis
    if self.ep > 1 and self.tp > 1 and t % self.tp == 0:
      # reduce over both axes while scattering rows over ep*tp, then re-replicate over tp
      y = jax.lax.psum_scatter(y, (ea, ta), scatter_dimension=0, tiled=True)
      y = jax.lax.all_gather(y, ta, tiled=True, to="invarying")
    else:
      y = self._tensor_psum(y)
      if self.ep > 1:
        y = jax.lax.psum_scatter(y, ea, scatter_dimension=0, tiled=True)
    return y.astype(out_dtype)

  def finalize(self, fused_out, inp, weight_and_reduce, out_dtype):
    wr = _resolve(weight_and_reduce, self.default_weight_and_reduce)
    y = wr.apply(fused_out, inp, jnp.float32)
    return self._combine(y, out_dtype)


class AllGatherBatched(AllGather):
  """All-gather, then the Batched layout of the local experts (capacity: all gathered tokens)."""

  name = "allgather_batched"
  activation_format = ActivationFormat.Batched
  default_weight_and_reduce = NaiveBatched()

  def kernel_expert_map(self, num_local_experts):
    return None  # prepare maps ids to local experts itself

  def max_num_tokens_per_rank(self):
    return self.capacity

  def prepare_async(self, x, topk_weights, topk_ids, *, num_local_experts, expert_map,
                    apply_router_weight_on_input, quant, a1_scale=None):
    inner = AllGather.prepare_async(
        self, x, topk_weights, topk_ids, num_local_experts=num_local_experts, expert_map=None,
        apply_router_weight_on_input=apply_router_weight_on_input, quant=None)
    emap = AllGather.kernel_expert_map(self, num_local_experts)

    def receive():
      g = inner()
      m, k = g.topk_ids.shape
      cap = min(self.capacity * self.ep if self.capacity else m, m)  # C per source rank
      local = local_expert_ids(g.topk_ids, num_local_experts, emap)
      src_slot, num_tokens, slot_pos, dropped = batched_layout(local, num_local_experts, cap)
      tok = jnp.where(src_slot >= 0, src_slot // k, 0)
      a = jnp.where((src_slot >= 0)[..., None], g.a[tok], jnp.zeros((), g.a.dtype))
      a1q, a1_scale_ = quantize_activations(a, quant, static_scale=a1_scale)
      self.last_dropped = self._count_dropped(dropped)
      return ExpertsInput(a=a1q, a_scale=a1_scale_, topk_weights=g.topk_weights,
                          topk_ids=g.topk_ids, expert_num_tokens=num_tokens,
                          slot_expert=jnp.clip(local, 0, num_local_experts - 1),
                          slot_pos=slot_pos, dropped=self.last_dropped,
                          format=ActivationFormat.Batched)
    return receive


# --------------------------------------------------------------------------------------------
# ragged all-to-all (high throughput, contiguous)


class RaggedA2A(EPPrepareFinalize):
  """Send exactly the routed token copies with a ragged all-to-all; Standard experts.

  Dispatch: slots sorted by (destination rank, local expert); per-(rank, expert) counts are
  all-gathered (E ints per rank) so every rank knows every offset; one ragged all-to-all of the
  rows; the receiver labels rows with their local expert from the counts. Combine: the
  reverse ragged all-to-all with the roles swapped, un-sort, weight and sum over k on the
  sender (f32), then one psum over the tensor axis.

  Capacity C (`dispatch_capacity`, default T: dropless for distinct top-k ids) bounds the rows
  one source sends to one (rank, local expert); copies past it are dropped and counted. The
  receive buffer is the worst case under that bound, ep * min(E_local * C, T * k) rows.
  """

  name = "ragged_a2a"
  activation_format = ActivationFormat.Standard
  default_weight_and_reduce = Contiguous()

  def capacity_for(self, t: int, k: int) -> int:
    return min(self.capacity or t, t * k)

  def recv_rows(self, t: int, k: int, num_local_experts: int) -> int:
    return self.ep * min(num_local_experts * self.capacity_for(t, k), t * k)

  def prepare_async(self, x, topk_weights, topk_ids, *, num_local_experts, expert_map,
                    apply_router_weight_on_input, quant, a1_scale=None):
    t, k = topk_ids.shape
    el, ep = num_local_experts, self.ep
    nkeys = ep * el
    a1q, send_scale, topk_weights, valid, dest, lidx = self._routed_slots(
        x, topk_weights, topk_ids, el, apply_router_weight_on_input, quant, a1_scale)
    valid, dest = valid.reshape(-1), dest.reshape(-1)
    raw_key = dest * el + jnp.maximum(lidx.reshape(-1), 0)  # nkeys for slots that go nowhere
    # position of each slot within its (destination, local expert) group; past C: dropped
    order0 = jnp.argsort(raw_key, stable=True)
    counts0 = jnp.bincount(raw_key, length=nkeys + 1)
    pos = inverse_permutation(order0) - (jnp.cumsum(counts0) - counts0)[raw_key]
    cap = self.capacity_for(t, k)
    kept = valid & (pos < cap)
    # the send order: order0 with the dropped copies moved to the end (a stable partition in
    # O(n), not a second sort; only the kept prefix is ever sent)
    kept_sorted = kept[order0].astype(jnp.int32)
    kept_before = jnp.cumsum(kept_sorted) - kept_sorted
    slot = jnp.arange(t * k, dtype=jnp.int32)
    send_pos = jnp.where(kept_sorted > 0, kept_before,
                         jnp.sum(kept_sorted) + slot - kept_before)
    order = jnp.zeros((t * k,), jnp.int32).at[send_pos].set(order0.astype(jnp.int32),
                                                             unique_indices=True)
    # a group keeps its first C slots: its kept count is min(count, C)
    counts = jnp.minimum(counts0[:nkeys], cap).reshape(ep, el).astype(jnp.int32)
    src = order // k  # [T*k] token of each send row, grouped by destination then local expert
    counts_all = jax.lax.all_gather(counts, self.expert_axis)  # [src, dst, el]
    cnt = counts_all.sum(-1)  # [src, dst]
    in_off = collectives.exclusive_cumsum(cnt, axis=1)  # offset in the sender's buffer
    out_off = collectives.exclusive_cumsum(cnt, axis=0)  # offset in the receiver's buffer
    me = self.rank()
    r = self.recv_rows(t, k, el)

    def send(v):
      # rows past the received total are labelled expert -1 from the counts: never computed
      return collectives.ragged_all_to_all(
          v, collectives.receive_buffer((r,) + v.shape[1:], v.dtype), in_off[me], cnt[me],
          out_off[me], cnt[:, me], axis_name=self.expert_axis, impl=self.ragged_impl)

    if send_scale is None:
      recv, scale = send(a1q[src]), None
    else:  # per-token scales (fp8 dispatch) ride in the same rows: one collective
      wire, layout = collectives.pack_rows(a1q[src], send_scale[src])
      recv, scale = collectives.unpack_rows(send(wire), layout)
    self.last_dropped = self._count_dropped(jnp.sum(valid & ~kept).astype(jnp.int32))
    dropped = self.last_dropped

    def receive():
      # received rows: src-major, each source's block sorted by local expert
      seg = counts_all[:, me, :].reshape(-1)  # [ep*el] in (src, local expert) order
      ends = jnp.cumsum(seg)
      seg_id = jnp.searchsorted(ends, jnp.arange(r, dtype=ends.dtype), side="right")
      rle = jnp.where(seg_id < ep * el, seg_id % el, -1).astype(jnp.int32)
      plan = dict(order=order, cnt=cnt, in_off=in_off, out_off=out_off, ids=topk_ids,
                  weights=topk_weights, kept=kept.reshape(t, k))
      a, a_scale = self._arrived(recv, scale, quant, x.dtype, a1_scale)
      return ExpertsInput(a=a, a_scale=a_scale, topk_weights=jnp.ones((r, 1), jnp.float32),
                          topk_ids=rle[:, None], dropped=dropped, extra=plan,
                          format=ActivationFormat.Standard)
    return receive

  def finalize(self, fused_out, inp, weight_and_reduce, out_dtype):
    wr = _resolve(weight_and_reduce, self.default_weight_and_reduce)
    y = wr.apply(fused_out, inp, out_dtype)  # [R, H]: rows travel back in activation dtype
    plan = inp.extra
    t, k = plan["ids"].shape
    me = self.rank()
    cnt, in_off, out_off = plan["cnt"], plan["in_off"], plan["out_off"]
    # every kept slot's row comes back; the others (empty, dropped) are not read
    back = collectives.ragged_all_to_all(
        y, collectives.receive_buffer((t * k,) + y.shape[1:], y.dtype), out_off[:, me],
        cnt[:, me], in_off[:, me], cnt[me], axis_name=self.expert_axis, impl=self.ragged_impl)
    inv = inverse_permutation(plan["order"]).reshape(t, k)
    out = weighted_row_sum(back, jnp.where(plan["kept"], inv, -1), plan["weights"],
                           jnp.float32)
    return self._tensor_psum(out).astype(out_dtype)


# RaggedDedupA2A's default row source (see its docstring): None = direct for rows of at least
# DEDUP_DIRECT_MIN_ROW_BYTES. On 2 H200s (BENCHMARKS.md, eleventh round) direct rows made the
# deepseek-v3 dispatch (14 KB rows) 392 -> 304 µs and its layer 7504 -> 7442 µs, but the qwen3
# layer (4 KB rows) 1019 -> 1071 µs: per-row pieces cost more than the gather for small rows.
DEDUP_DIRECT_ROWS: Optional[bool] = None
DEDUP_DIRECT_MIN_ROW_BYTES = 12 * 1024


class RaggedDedupA2A(EPPrepareFinalize):
  """Ragged all-to-all with one copy of a token per destination rank (DeepEP normal mode).

  A token whose k experts sit on r distinct ranks is sent r times, not k: with its row go its
  k local expert ids on that rank (-1 for slots owned elsewhere) and its k router weights. The
  receiver's experts weight and sum the slots they own into one row per received token, which
  travels back; the sender adds its r partial rows (f32) and psums over the tensor axis.
  Dropless, with a receive buffer of ep * T rows (a token visits a rank at most once); the
  `capacity` setting bounds nothing here.

  `direct_rows` (default `DEDUP_DIRECT_ROWS`; None: rows of at least
  `DEDUP_DIRECT_MIN_ROW_BYTES` bytes go direct where XLA runs the collective as its one-process
  kernel): the collective takes the rows straight from the token array, one piece per
  (destination, token) of 1 row or none, so no packed send buffer is gathered first (on 2 H200s
  at deepseek-v3 / 4096 tokens that gather took 82 µs of a 380 µs dispatch). The receivers
  learn each piece's size from the all-gathered hit mask, which travels with the per-rank
  counts. False: rows packed per destination first, one slice each.
  The weights and ids travel in one collective (f32 pairs).
  """

  name = "ragged_dedup"
  activation_format = ActivationFormat.Standard
  default_weight_and_reduce = Contiguous()

  def __init__(self, parallel: ParallelConfig, *, direct_rows: Optional[bool] = None, **kw):
    super().__init__(parallel, **kw)
    self.direct_rows = DEDUP_DIRECT_ROWS if direct_rows is None else bool(direct_rows)

  def _direct(self, rows: jax.Array) -> bool:
    if self.direct_rows is not None:
      return self.direct_rows
    # per-token pieces are for XLA's in-process one-shot kernel; its NCCL path (several
    # processes) would issue a send and a receive per piece
    if self.ragged_impl == "native" and not collectives.one_shot_kernel_applies(self.ep):
      return False
    row_bytes = math.prod(rows.shape[1:]) * jnp.dtype(rows.dtype).itemsize
    return row_bytes >= DEDUP_DIRECT_MIN_ROW_BYTES

  def prepare_async(self, x, topk_weights, topk_ids, *, num_local_experts, expert_map,
                    apply_router_weight_on_input, quant, a1_scale=None):
    t, k = topk_ids.shape
    ep = self.ep
    n = ep * t
    a1q, send_scale, topk_weights, _, dest, lidx = self._routed_slots(
        x, topk_weights, topk_ids, num_local_experts, apply_router_weight_on_input, quant,
        a1_scale)
    hit = jnp.any(dest[:, None, :] == jnp.arange(ep, dtype=jnp.int32)[None, :, None], axis=-1)
    # (rank, token) pairs in rank-major order; the send buffer packs the hit ones in that order
    hit_rt = hit.T.reshape(-1).astype(jnp.int32)  # [ep * t]
    incl = jnp.cumsum(hit_rt)
    pos = incl - hit_rt  # send row of each hit pair
    # hit pairs per destination rank, read off the running count at each rank's last pair:
    # jnp.sum(hit, axis=0), a column reduction, fused with pos into one XLA kernel that took
    # 70 µs of the 440 µs dispatch (deepseek-v3, 4096 tokens, 2 H200s)
    ends = incl[t - 1::t] if t else jnp.zeros((ep,), jnp.int32)
    sent = ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    fp8 = send_scale is not None
    if fp8:  # fp8 dispatch: each row travels with its scales
      rows, layout = collectives.pack_rows(a1q, send_scale)
    else:
      rows, layout = a1q, None
    direct = self._direct(rows)
    # one all-gather: the counts, and the hit mask when rows go as per-token pieces
    shared = jax.lax.all_gather(jnp.concatenate([sent, hit_rt]) if direct else sent,
                                self.expert_axis)
    cnt = shared[:, :ep]  # [src, dst]
    in_off = collectives.exclusive_cumsum(cnt, axis=1)  # [src, dst]: offset in the sender
    out_off = collectives.exclusive_cumsum(cnt, axis=0)  # offset in the receiver
    me = self.rank()
    pair = jnp.zeros((n,), jnp.int32).at[jnp.where(hit_rt > 0, pos, n)].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop")  # send row -> pair (rows past the total: 0)
    tok = pair % t
    rank_of_row = pair // t
    ids_send = jnp.where(dest[tok] == rank_of_row[:, None], lidx[tok], -1)  # [n, k] local ids
    w_send = topk_weights.astype(jnp.float32)[tok]

    def send_packed(v, out):  # v [n, ...] in send-row order: one slice per destination
      return collectives.ragged_all_to_all(
          v, out, in_off[me], cnt[me], out_off[me], cnt[:, me], axis_name=self.expert_axis,
          impl=self.ragged_impl)

    def send_tokens(v, out):  # v [t, ...] per token: one piece of 0 or 1 row per (dst, token)
      size = hit_rt.reshape(ep, t)
      land = jnp.where(size > 0, pos.reshape(ep, t) - in_off[me][:, None]
                       + out_off[me][:, None], 0)  # the row's place at the destination
      starts = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (ep, t))
      recv_sizes = shared[:, ep:].reshape(ep, ep, t)[:, me]  # [src, token]
      return collectives.ragged_all_to_all(v, out, starts, size, land, recv_sizes,
                                           axis_name=self.expert_axis, impl=self.ragged_impl)

    send = send_tokens if direct else send_packed
    # rows nobody sends have ids -1 (below): no expert computes them, nothing reads them
    recv = send(rows if direct else rows[tok],
                collectives.receive_buffer((n,) + rows.shape[1:], rows.dtype))
    scale = None
    if fp8:
      recv, scale = collectives.unpack_rows(recv, layout)
    # ids as f32 (exact below 2^24) next to the weights, so the weights stay differentiable
    meta = jnp.concatenate([w_send, ids_send.astype(jnp.float32)], 1)
    fill = jnp.concatenate([jnp.zeros((1, k), jnp.float32), jnp.full((1, k), -1.0)], 1)
    got = send_packed(meta, jnp.broadcast_to(fill, (n, 2 * k)))
    recv_w = got[:, :k]
    recv_ids = got[:, k:].astype(jnp.int32)  # rows nobody sent keep -1: no expert computes them
    self.last_dropped = self._count_dropped(jnp.int32(0))
    dropped = self.last_dropped

    def receive():
      plan = dict(cnt=cnt, in_off=in_off, out_off=out_off, hit=hit, pos=pos)
      a, a_scale = self._arrived(recv, scale, quant, x.dtype, a1_scale)
      return ExpertsInput(a=a, a_scale=a_scale, topk_weights=recv_w, topk_ids=recv_ids,
                          dropped=dropped, extra=plan, format=ActivationFormat.Standard)
    return receive

  def finalize(self, fused_out, inp, weight_and_reduce, out_dtype):
    wr = _resolve(weight_and_reduce, self.default_weight_and_reduce)
    y = wr.apply(fused_out, inp, out_dtype)  # [ep*T, H]: one weighted partial row per token
    plan = inp.extra
    hit, pos, cnt = plan["hit"], plan["pos"], plan["cnt"]
    t, ep = hit.shape
    me = self.rank()
    # only the rows of hit (token, rank) pairs are read below, and each of them comes back
    back = collectives.ragged_all_to_all(
        y, collectives.receive_buffer((ep * t,) + y.shape[1:], y.dtype), plan["out_off"][:, me],
        cnt[:, me], plan["in_off"][:, me], cnt[me], axis_name=self.expert_axis,
        impl=self.ragged_impl)
    idx = jnp.where(hit, pos.reshape(ep, t).T, -1)  # [t, ep]: send row of (token, rank)
    out = weighted_row_sum(back, idx, jnp.ones(idx.shape, jnp.float32), jnp.float32)
    return self._tensor_psum(out).astype(out_dtype)


# --------------------------------------------------------------------------------------------
# padded all-to-all (low latency, batched, static shapes)


class PaddedA2A(EPPrepareFinalize):
  """Fixed capacity C per (destination rank, local expert); Batched experts.

  Every source packs `[ep, E_local, C, H]` (rows past the count are zero), one all_to_all
  sends it, the receiver compacts each expert's rows from all sources to the front of
  `[E_local, ep*C, H]` with `expert_num_tokens`. Combine is the exact reverse. C defaults to
  T (dropless: a token sends at most one copy per expert); a smaller C drops the overflow and
  the number of dropped token copies is reported (`ExpertsInput.dropped`, the stats output).
  """

  name = "padded_a2a"
  activation_format = ActivationFormat.Batched
  default_weight_and_reduce = NaiveBatched()

  def max_num_tokens_per_rank(self):
    return self.capacity

  def _a2a(self, v):
    return jax.lax.all_to_all(v, self.expert_axis, 0, 0, tiled=True)

  def prepare_async(self, x, topk_weights, topk_ids, *, num_local_experts, expert_map,
                    apply_router_weight_on_input, quant, a1_scale=None):
    x, topk_weights = apply_weight_on_input(x, topk_weights, apply_router_weight_on_input)
    t, k = topk_ids.shape
    el, ep = num_local_experts, self.ep
    e = el * ep
    cap = min(self.capacity or t, t)
    pl = self.placement(el)
    ids = topk_ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < e)
    phys = jnp.where(valid, jnp.asarray(pl.log_to_phys, jnp.int32)[jnp.clip(ids, 0, e - 1)], e)
    src_slot, num_tokens, slot_pos, dropped = batched_layout(phys, e, cap)
    tok = jnp.where(src_slot >= 0, src_slot // k, 0)
    send = jnp.where((src_slot >= 0)[..., None], x[tok], jnp.zeros((), x.dtype))  # [E, C, H]
    a1q, send_scale = self._quantize_for_send(send, quant, a1_scale)
    recv = self._a2a(a1q.reshape((ep, el, cap) + a1q.shape[2:]))  # [src, el, C, H]
    scale = None
    if send_scale is not None:
      scale = self._a2a(send_scale.reshape((ep, el, cap) + send_scale.shape[2:]))
    recv_counts = self._a2a(num_tokens.reshape(ep, el))  # [src, el]
    self.last_dropped = self._count_dropped(dropped)

    def receive():
      cnt = recv_counts.T  # [el, src]
      ends = jnp.cumsum(cnt, axis=1)
      starts = ends - cnt
      m = ep * cap
      p = jnp.arange(m, dtype=cnt.dtype)
      src = jnp.sum(ends[:, None, :] <= p[None, :, None], axis=-1)  # [el, m]
      live = src < ep
      srcc = jnp.clip(src, 0, ep - 1)
      row = jnp.clip(p[None, :] - jnp.take_along_axis(starts, srcc, axis=1), 0, cap - 1)
      lidx = jnp.broadcast_to(jnp.arange(el)[:, None], (el, m))

      def compact(v):
        g = v[srcc, lidx, row]
        return jnp.where(live.reshape(live.shape + (1,) * (g.ndim - 2)), g,
                         jnp.zeros((), v.dtype))
      plan = dict(recv_counts=recv_counts, starts=starts)
      a, a_scale = self._arrived(compact(recv), None if scale is None else compact(scale),
                                 quant, x.dtype, a1_scale)
      return ExpertsInput(
          a=a, a_scale=a_scale,
          topk_weights=topk_weights, topk_ids=topk_ids,
          expert_num_tokens=ends[:, -1].astype(jnp.int32),
          slot_expert=jnp.clip(phys, 0, e - 1), slot_pos=slot_pos, dropped=self.last_dropped,
          extra=plan, format=ActivationFormat.Batched)
    return receive

  def finalize(self, fused_out, inp, weight_and_reduce, out_dtype):
    wr = _resolve(weight_and_reduce, self.default_weight_and_reduce)
    if not isinstance(wr, NaiveBatched):
      raise ValueError(f"{self!r} combines batched expert outputs itself and needs experts "
                       f"whose weight-and-reduce is NaiveBatched, got {wr!r}")
    el, m, h = fused_out.shape
    ep = self.ep
    cap = m // ep
    plan = inp.extra
    cnt = plan["recv_counts"]  # [src, el]
    starts = plan["starts"]  # [el, src]
    row = jnp.arange(cap)
    pos = starts.T[:, :, None] + row[None, None, :]  # [src, el, C]
    ok = row[None, None, :] < cnt[:, :, None]
    lidx = jnp.broadcast_to(jnp.arange(el)[None, :, None], pos.shape)
    back_send = jnp.where(ok[..., None], fused_out[lidx, jnp.clip(pos, 0, m - 1)],
                          jnp.zeros((), fused_out.dtype))
    back = self._a2a(back_send).reshape(ep * el, cap, h)  # my own [E, C, H] layout again
    out = NaiveBatched().apply(back, inp, jnp.float32)
    return self._tensor_psum(out).astype(out_dtype)


def factory(cls) -> Callable[[ParallelConfig], PrepareFinalize]:
  return lambda parallel, **kw: cls(parallel, **kw)
