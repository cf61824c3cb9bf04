"""The weight-only decode block for slots that share experts (w4a16 / w8a16, bf16 tokens):
decode_wq.py's kernel with up to 8 tokens per work item, so each expert's codes stream once
per 8 of its slots instead of once per slot.

The wrapper sorts the slots by expert and cuts each expert's run into groups of <= 8. A work
item is (group g, block j of 128 intermediate columns):

    a[:, t]              = act(dq(w13[e])[:, gate cols of j]^T x[tok(g, t)] (+ b), same for up)
    part[j, slot(g, t)]  = a[:, t] @ q2[e][rows of j, :]        [1, H] f32 (unscaled codes)

The 8 columns of wgmma's B operand are the group's 8 tokens (zero rows for a short group), so
decode_wq's trick of one masked token copy per B column (the group scales applied after the
MMA) is not available: here the group scales (and zero points) multiply the register A tile
before the MMA, one scale row per 128-deep step (the step is one group). The scale and zero
blocks come transposed, [E, H / 128, 2N], so a step's row is contiguous in SMEM (made per
call: only the groups' experts' where there are fewer groups than experts). GEMM2's
scales are applied by the final reduction as in decode_wq (per output row and item).

Launches: the grouping and token-tile gather (XLA), this kernel, the reduction.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jmoe.kernels import _compat, int4_mma
from jmoe.kernels.activations import Activation, as_activation
from jmoe.kernels.decode import combine_parts, cta_items, token_operand
from jmoe.kernels.decode_wq import (BH, BK, BN, GROUP, ROWS_A, DecodeWQConfig, _codes, _Plan,
                                    _plan, _w2_scaled, byte_scales, checked_call, code_values,
                                    finish, geometry, smem_budget, step_fetcher,
                                    store_b_tile, sync_eligible, unsupported_codes)
from jmoe.kernels.grouped_gemm import kernel_activation

_N = 8  # tokens per group = wgmma's N
_MAX_STAGES = 8
SYNC_SHARED = True  # int4 codes with 16-bit tokens on mma.sync (benchmarks may switch it off)
assert BH // 2 == BN  # GEMM2's half-step accumulators have GEMM1's [128, 8] shape


def _stage_bytes(plan: _Plan) -> int:
  code_bytes = BN * BK // 2 if plan.int4 else BN * BK
  return 2 * code_bytes + _N * BK * 2


def _fixed_bytes(plan: _Plan, h: int) -> int:
  g1 = h // GROUP
  fixed = (ROWS_A * BN * 2 + _N * BN * 4 + _N * BH * 4 + ROWS_A * 4 + 2 * 4 * BN * 4)
  if plan.grouped:  # (zero points: and mma.sync's token sums per step)
    fixed += 2 * g1 * BN * 4 + (2 * g1 * BN + g1 * _N * 4 if plan.zero13 else 0)
  return fixed


def max_stages(plan: _Plan, h: int, ctas_per_sm: int = 1) -> int:
  """The deepest ring that fits a CTA's shared memory beside the per-item buffers (two more
  buffers' alignment than decode_wq's)."""
  free = smem_budget(ctas_per_sm) - 2 * 1024 - _fixed_bytes(plan, h)
  return min(_MAX_STAGES, free // _stage_bytes(plan))


def unsupported(t: int, k: int, h: int, n: int, act: Activation | str, w13, w2) -> str | None:
  """Why fused_experts_decode_wq_shared cannot take this problem (None: it can): decode_wq's
  rules on the format and sizes (`decode_wq.unsupported_codes`), and a 2-slot ring in shared
  memory beside the item's scale blocks. (The transposed zero blocks need no H / 128
  multiple of 16.)"""
  why = unsupported_codes(t, k, h, n, act, w13, w2)
  if why is None:
    plan = _plan(w13, w2, False)
    if plan.e2m1 or plan.group != GROUP or byte_scales(w13):
      why = (f"{w13.scheme.name}: the shared kernel takes int4 / int8 / e4m3 codes with "
             f"float32 scales per channel or per {GROUP}")
  if why is None and max_stages(_plan(w13, w2, False), h) < 2:
    why = f"H={h}: the item's scale blocks leave shared memory no 2-slot ring"
  return why


def _build(*, h, n, m, groups, e, xdt, act: Activation, plan: _Plan, stages: int, num_sms,
           interpret, rows_by_group: bool = False):
  """rows_by_group: w13's transposed scale (and zero) blocks come one per group ([groups,
  H / 128, 2N], the group's expert's), not one per expert ([E, ...])."""
  nb, k1, k2, spi, g1, tf_w, tf_x = geometry(h, n, plan, stages)
  _cast = _compat.layout_cast(interpret)
  emulate = interpret is not None  # the interpreter's wgmma takes refs only, not transposed
  use_vec = plan.has_bias or not plan.grouped
  wg, row, col = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

  def body(*refs):
    refs = list(refs)
    ids_ref, slots_ref, x_ref, w13_ref, w2_ref = refs[:5]
    del refs[:5]
    s13_ref = refs.pop(0) if plan.grouped else None
    c13_ref = refs.pop(0) if not plan.grouped else None
    z13_ref = refs.pop(0) if plan.zero13 else None
    xs_ref = refs.pop(0) if plan.zero13 and plan.sync else None  # [groups, H / 128, 8]
    b13_ref = refs.pop(0) if plan.has_bias else None
    part_ref = refs.pop(0)
    asum_ref = refs.pop(0) if plan.zero2 else None
    ring, xring, a_smem, a_cols, o_rows, asum_smem, vec = refs[:7]
    del refs[:7]
    sblk = refs.pop(0) if plan.grouped else None
    zblk = refs.pop(0) if plan.zero13 else None
    xsblk = refs.pop(0) if xs_ref is not None else None
    bars1, bars2, vbar, sbar = refs[:4]
    t_a, t_b = refs[4:6] if emulate else (None, None)
    sm = lax.axis_index("sm")
    tok_col = _cast(lax.broadcasted_iota(jnp.int32, (BN, _N), 1), wg)  # token of a column
    tok_row = _cast(lax.broadcasted_iota(jnp.int32, (ROWS_A, BN), 0), wg)  # of a B row

    def stage_a(a, which):
      if emulate:
        t_a.at[which][...] = a
        return t_a.at[which]
      return a

    def dequantized13(tile, which, r, c):
      """A GEMM1 code tile [128, 128] -> its bf16 register A tile, with step r's group
      scale (and zero point) of each row: (code - zero) * scale."""
      a = code_values(tile[...], plan, xdt)
      if plan.grouped:
        s = _cast(sblk.at[c, r][...], row)
        a = a * lax.broadcast_in_dim(s.astype(xdt), (BN, BK), [0])
        if plan.zero13:
          z = _cast(zblk.at[c, r][...], row).astype(jnp.float32)
          if plan.int4:
            z = z - 8.0  # the codes are u - 8: so is the zero
          a = a - lax.broadcast_in_dim((z * s).astype(xdt), (BN, BK), [0])
      return stage_a(a, which)

    rhs = functools.partial(token_operand, t_b=t_b)
    item, info0, my_items = cta_items(ids_ref, sm, num_sms, m=groups, k=1, e=e, nb=nb)
    total = my_items * spi

    fetch = step_fetcher(
        refs=dict(ring=ring, xring=xring, w13=w13_ref, w2=w2_ref, x=x_ref, c13=c13_ref,
                  b13=b13_ref, vec=vec, vbar=vbar, bars1=bars1, bars2=bars2),
        plan=plan, n=n, k1=k1, spi=spi, stages=stages, total=total, use_vec=use_vec, h=h)

    def load_blocks(info):
      """The item's transposed scale (and zero) blocks [H / 128, 128] for gate and up (on
      mma.sync with zero points also the group's token sums per step [H / 128, 8])."""
      grp, ex, jb, _ = info
      at = grp if rows_by_group else ex
      for c, cl in enumerate((jb * BN, n + jb * BN)):
        plgpu.copy_gmem_to_smem(s13_ref.at[at, :, pl.ds(cl, BN)], sblk.at[c], sbar.at[0])
        if plan.zero13:
          plgpu.copy_gmem_to_smem(z13_ref.at[at, :, pl.ds(cl, BN)], zblk.at[c], sbar.at[0])
      if xsblk is not None:
        plgpu.copy_gmem_to_smem(xs_ref.at[grp], xsblk, sbar.at[0])

    if plan.grouped:
      @pl.when(my_items > 0)
      def _first_blocks():
        load_blocks(info0)

    for g in range(stages - 1):  # the first stages - 1 steps all belong to item 0
      fetch(jnp.int32(g), jnp.int32(0), info0, info0)

    def column(v, t):
      """Column t of a [128, 8] WGMMA-layout array, as a row-indexed vector."""
      return jnp.sum(jnp.where(tok_col == t, v, 0.0), axis=1)

    def one_item(i, cur):
      _, nxt = item(i + 1)
      grp, _, jb, _ = cur
      vb = lax.rem(i, 2)
      base = i * spi
      if use_vec:
        plgpu.barrier_wait(vbar.at[vb])
      if plan.grouped:
        plgpu.barrier_wait(sbar.at[0])

      def gemm1(acc_g, acc_u):
        @pl.loop(0, k1)
        def _step(r):
          g = base + r
          slot = lax.rem(g, jnp.int32(stages))
          plgpu.barrier_wait(bars1.at[slot])
          x_t = rhs(xring.at[slot])
          plgpu.wgmma(acc_g, dequantized13(ring.at[slot, 0], 0, r, 0), x_t)
          plgpu.wgmma(acc_u, dequantized13(ring.at[slot, 1], 1, r, 1), x_t)
          plgpu.wgmma_wait(0)  # the register tiles are read: the slot takes a new step
          fetch(g + stages - 1, i, cur, nxt)

        finish_gemm1(acc_g[...], acc_u[...])

      def finish_gemm1(*accs):
        """The gate / up dot products [128, 8] -> the activations, a row per token."""
        vals = []
        for c, v in enumerate(accs):
          if not plan.grouped:
            v = v * lax.broadcast_in_dim(_cast(vec.at[vb, c][...], row), (BN, _N), [0])
          if plan.has_bias:
            v = v + lax.broadcast_in_dim(_cast(vec.at[vb, 2 + c][...], row), (BN, _N), [0])
          vals.append(v)
        a = kernel_activation(act, *vals)  # [128 columns of block j, 8 tokens]
        for t in range(_N):
          a_cols.at[t][...] = column(a, t)

      def gemm1_sync():
        """mma.sync: each step's products into a fresh accumulator, added to the running one
        times the rows' group scales (zero points: minus zero x scale x the tokens' sums of
        the step) -- the scales cannot go in B (its columns are tokens), and per row of the
        accumulator they cost 16 FMAs a thread and step where the A tile's would be 128."""
        zero = _cast(jnp.zeros((BN, _N), jnp.float32), wg)

        def step(r, accs):
          g = base + r
          slot = lax.rem(g, jnp.int32(stages))
          plgpu.barrier_wait(bars1.at[slot])
          b = int4_mma.b_tile(xring.at[slot], xdt, interpret=emulate)
          new = []
          for c, acc in enumerate(accs):
            p = int4_mma.mma(zero, ring.at[slot, c], b, xdt, interpret=emulate)
            if plan.grouped:
              s_r = _cast(sblk.at[c, r][...], row)
              if plan.zero13:  # sum_k (q - z) s x = s (p - z sum_k x)
                z = _cast(zblk.at[c, r][...], row).astype(jnp.float32)
                if plan.int4:
                  z = z - 8.0  # the codes are u - 8: so is the zero
                xs = lax.broadcast_in_dim(_cast(xsblk.at[r][...], col), (BN, _N), [1])
                p = p - lax.broadcast_in_dim(z, (BN, _N), [0]) * xs
              p = p * lax.broadcast_in_dim(s_r, (BN, _N), [0])
            new.append(acc + p)
          plgpu.commit_smem()  # every warp has read the slot (no wgmma syncs them)
          fetch(g + stages - 1, i, cur, nxt)
          return tuple(new)

        finish_gemm1(*lax.fori_loop(0, k1, step, (zero, zero)))

      if plan.sync:
        gemm1_sync()
      else:
        pl.run_scoped(gemm1, plgpu.ACC((BN, _N), jnp.float32),
                      plgpu.ACC((BN, _N), jnp.float32))
      if plan.grouped:  # the scale blocks are read: the next item's may land
        @pl.when(i + 1 < my_items)
        def _next_blocks():
          load_blocks(nxt)
      plgpu.commit_smem()
      tile = None  # GEMM2's B: row t = token t's activation row
      for t in range(_N):
        r_t = lax.broadcast_in_dim(_cast(a_cols.at[t][...], col), (ROWS_A, BN), [1])
        tile = jnp.where(tok_row == t, r_t, 0.0 if tile is None else tile)
      store_b_tile(tile.astype(xdt), a_smem, asum_smem,
                   asum_ref.at[jb, grp] if plan.zero2 else None)
      b2 = int4_mma.b_rows(a_smem, xdt, interpret=emulate) if plan.sync else None

      @pl.loop(0, k2)
      def _gemm2(c):
        g = base + k1 + c
        slot = lax.rem(g, jnp.int32(stages))
        plgpu.barrier_wait(bars2.at[slot])

        def mma(acc_a, acc_b):
          b = rhs(a_smem)
          plgpu.wgmma(acc_a, stage_a(code_values(ring.at[slot, 0][...], plan, xdt), 0), b)
          plgpu.wgmma(acc_b, stage_a(code_values(ring.at[slot, 1][...], plan, xdt), 1), b)
          plgpu.wgmma_wait(0)
          return acc_a[...], acc_b[...]

        if plan.sync:
          zero = _cast(jnp.zeros((BH // 2, _N), jnp.float32), wg)
          ys = [int4_mma.mma(zero, ring.at[slot, j], b2, xdt, interpret=emulate)
                for j in range(2)]
          plgpu.commit_smem()  # every warp has read the slot
        else:
          ys = pl.run_scoped(mma, plgpu.ACC((BH // 2, _N), jnp.float32),
                             plgpu.ACC((BH // 2, _N), jnp.float32))
        fetch(g + stages - 1, i, cur, nxt)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous step's rows are read
        for t in range(_N):
          for half, y in enumerate(ys):
            o_rows.at[t, pl.ds(half * (BH // 2), BH // 2)][...] = column(y, t)
        plgpu.commit_smem()
        for t in range(_N):
          s_t = slots_ref[grp * _N + t]

          @pl.when(s_t >= 0)
          def _store():
            plgpu.copy_smem_to_gmem(o_rows.at[pl.ds(t, 1)],
                                    part_ref.at[jb, pl.ds(s_t, 1), pl.ds(c * BH, BH)])

      return nxt

    lax.fori_loop(0, my_items, one_item, info0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [  # after finish's rings and GEMM2's B tile
      plgpu.SMEM((_N, BN), jnp.float32),  # the activations, a row per token
      plgpu.SMEM((_N, BH), jnp.float32),  # a GEMM2 step's output rows, one per token
      plgpu.SMEM((ROWS_A,), jnp.float32),  # the activations' sums per token
      plgpu.SMEM((2, 4, BN), jnp.float32),  # per item: channel scales, biases
  ]
  if plan.grouped:
    scratch.append(plgpu.SMEM((2, g1, BN), jnp.float32))
  if plan.zero13:
    scratch.append(plgpu.SMEM((2, g1, BN), jnp.dtype(jnp.uint8) if plan.int4 else plan.code))
  if plan.zero13 and plan.sync:  # the group's token sums per step
    scratch.append(plgpu.SMEM((g1, _N), jnp.float32))
  return finish(body, scratch, plan=plan, stages=stages, tf=(tf_w, tf_x),
                n_blk=2 + (2 if plan.zero13 else 0) + (1 if plan.zero13 and plan.sync else 0),
                xdt=xdt, part=(nb, m, h),
                asum_rows=groups, emulate=emulate, num_sms=num_sms, interpret=interpret,
                name="jmoe_moe_decode_wq_shared")


def _transposed(a: jax.Array) -> jax.Array:
  """w13's scales or zero points per 128 [X, 2N, H / 128] -> [X, H / 128, 2N] (a step's row
  contiguous; scales as float32)."""
  if jnp.issubdtype(a.dtype, jnp.floating):
    a = a.astype(jnp.float32)
  return jnp.swapaxes(a, 1, 2)


def slot_groups(ids: jax.Array, e: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """ids [m] (outside [0, E): empty) -> (group_expert [m] (-1: no group), group_slots [m, 8]
  (-1: none), slot_group [m, 2] (group, position; m for an empty slot)): each expert's slots,
  in slot order, cut into groups of up to 8, the groups numbered expert by expert."""
  m = ids.shape[0]
  valid = (ids >= 0) & (ids < e)
  key = jnp.where(valid, ids, e).astype(jnp.int32)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  skey = key[order]
  rank = jnp.arange(m, dtype=jnp.int32) - jnp.searchsorted(skey, skey, side="left").astype(
      jnp.int32)
  counts = jnp.zeros((e + 1,), jnp.int32).at[key].add(1)[:e]
  ngroups = (counts + _N - 1) // _N
  first = jnp.cumsum(ngroups) - ngroups
  ok = skey < e
  gid = jnp.where(ok, first[jnp.minimum(skey, e - 1)] + rank // _N, m)
  pos = rank % _N
  group_expert = jnp.full((m + 1,), -1, jnp.int32).at[gid].set(jnp.where(ok, skey, -1))[:m]
  group_slots = jnp.full((m + 1, _N), -1, jnp.int32).at[gid, pos].set(order)[:m]
  slot_group = jnp.zeros((m, 2), jnp.int32).at[order].set(jnp.stack([gid, pos], axis=1))
  return group_expert, group_slots, slot_group


@functools.partial(jax.jit, static_argnames=("activation", "config", "out_dtype", "interpret"))
def fused_experts_decode_wq_shared(x: jax.Array, w13, w2, topk_weights: jax.Array,
                                   topk_ids: jax.Array, *,
                                   activation: Activation | str = "silu",
                                   w13_bias: jax.Array | None = None,
                                   w2_bias: jax.Array | None = None, out_dtype=None,
                                   config: DecodeWQConfig | None = None,
                                   interpret: Any = False) -> jax.Array:
  """`decode_wq.fused_experts_decode_wq`'s block (same arguments, same `unsupported` rules)
  with the slots grouped by expert, up to 8 a work item: x [T, H] bf16 / f16, w13 / w2
  QuantizedWeights (int4 / int8 codes, K-major), topk_weights / topk_ids [T, k], T * k <= 128.
  Returns [T, H] (out_dtype, default x.dtype)."""
  act = as_activation(activation)
  t, k, e, n, h, plan, stages, ctas = checked_call(
      x, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias, config,
      kernel="fused_experts_decode_wq_shared", why=unsupported, stage_cap=max_stages)
  if SYNC_SHARED and sync_eligible(plan):  # int4 codes with 16-bit tokens: on mma.sync
    plan = dataclasses.replace(plan, sync=True)
  m = t * k
  ids = topk_ids.reshape(m).astype(jnp.int32)
  group_expert, group_slots, slot_group = slot_groups(ids, e)
  tok = jnp.maximum(group_slots, 0) // k
  xg = jnp.where((group_slots >= 0)[:, :, None], x[tok], 0).reshape(m * _N, h)
  interp, nsm = _compat.launch_params(interpret)
  # w13's transposed blocks, made per call: each group's expert's where there are fewer
  # groups than experts (deepseek-v3 w4a16 with zero points at one token: 8 experts' ~9 MB
  # instead of all 256 experts' 294 MB), else every expert's
  by_group = plan.grouped and m < e
  kern = _build(h=h, n=n, m=m, groups=m, e=e, xdt=x.dtype, act=act, plan=plan, stages=stages,
                num_sms=nsm * ctas, interpret=interp, rows_by_group=by_group)
  if plan.sync:  # fragment-ordered token tiles, the codes as int32 words
    args = [group_expert, group_slots.reshape(m * _N), int4_mma.fragment_tiles(xg),
            int4_mma.code_words(w13.values), int4_mma.code_words(w2.values)]
  else:
    args = [group_expert, group_slots.reshape(m * _N), xg, _codes(w13, plan.code),
            _codes(w2, plan.code)]
  if plan.grouped:  # [m or E, H / 128, 2N] (-1, a group that is no item: expert 0's)
    rows = jnp.clip(group_expert, 0, e - 1) if by_group else slice(None)
    args.append(_transposed(w13.scale[rows]))
    if plan.zero13:
      args.append(_transposed(w13.zero[rows]))
  else:
    args.append(w13.scale[:, :, 0].astype(jnp.float32))
  if plan.zero13 and plan.sync:  # each group's token sums per step [groups, H / 128, 8]
    sums = xg.astype(jnp.float32).reshape(m, _N, h // GROUP, GROUP).sum(-1)
    args.append(jnp.swapaxes(sums, 1, 2))
  if plan.has_bias:
    args.append(w13_bias.astype(jnp.float32))
  outs = kern(*args)
  part, asum = (outs[0], outs[1]) if plan.zero2 else (outs[0], None)
  if asum is not None:  # [NB, groups, 8] -> each slot's [NB, m, 1]
    g, p = jnp.minimum(slot_group[:, 0], m - 1), slot_group[:, 1]
    asum = asum[:, g, p][:, :, None]
  part = _w2_scaled(part, asum, ids, w2, plan, e)
  return combine_parts(part, ids, topk_weights, w2_bias, num_experts=e,
                       out_dtype=out_dtype or x.dtype)
