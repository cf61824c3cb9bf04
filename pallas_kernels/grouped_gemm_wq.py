"""The weight-only grouped GEMMs for prefill (w4a16 / w8a16: int4 or int8 codes; mxfp4 /
nvfp4: e2m1 codes; bf16 tokens), the codes dequantized in registers: the packed weights are
the only weight bytes read, and no dequantized copy of the experts is made.

Hopper's wgmma takes its A operand from registers, so the kernels compute the transposed
products ("swap AB"): the weight tile, converted to bf16 in registers after its TMA load, is
A, and a task's 128 token rows are B (wgmma's N = 128):

    GEMM1  a_t[task, j-block, :] = act(dq(w13[e])[:, gate rows]^T x_t (+ b), the same for up)
           [64 intermediate columns, 128 tokens] per item (task, j)
    GEMM2  y_t[task, h-block, :] = dq(w2[e])[h rows, :] a_t[task]        [128 rows of H, 128]

A task is a tile of `grouped_gemm.tile_metadata` (block_m = 128: an expert's rows from an
8-row boundary; rows of the neighbouring experts in a tile are computed and never read). The
activations stay transposed and task-major ([tasks, N, 128]: GEMM2's B tile is a plain box of
them) and so does GEMM2's output; the final gather-sum reads each slot's column.

Scales multiply the register A tile before the MMA: a 128-deep step brings its scale rows
([128 / g, rows], by TMA from a transposed float32 [E, K / g, rows] copy; e2m1's e8m0 / e4m3
scales converted per call) and, for groups below 64 (wgmma's narrowest K in Mosaic), a 64-deep
sub-step picks each column's scale with selects. Zero points (groups of 128) are subtracted
the same way; per-channel scales multiply the accumulator rows once per item. One warpgroup
per CTA, two CTAs per SM (`PrefillWQConfig`): a step converts the gate tile, issues its MMA,
converts the up tile while that runs and waits for both; the other CTA's MMAs fill the gaps.

Sizes 128 does not divide (H and N multiples of 64: gpt-oss' 2880): a contraction's last
128-deep step is shifted back inside K (`decode_wq.block_start`) with its overlap zeroed in the A tile, and
GEMM2's last block of H rows is shifted back inside H (its overlap written twice, equal); the
code tiles are then 64 columns wide (TMA's source dimensions must be whole SMEM tiles).

Launches (besides the routing): GEMM1, GEMM2 and the gather-sum.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jmoe.kernels import _compat
from jmoe.kernels.activations import Activation, as_activation
from jmoe.kernels.decode import ring_step
from jmoe.kernels.decode_wq import (_codes, _plan, _Plan, block_group, block_start,
                                    code_values, scale_values, unsupported_format)
from jmoe.kernels.e2m1 import E2M1_UNIT
from jmoe.kernels.grouped_gemm import kernel_activation
from jmoe.kernels.prepared import Operand, operand

BM = 128  # token rows per task: wgmma's N
BF = 64  # GEMM1: gate / up rows (intermediate columns) per item, one m64 A tile each
BK = 128  # the contraction step = the scale group
BH = 128  # GEMM2: rows of H per item (one [128, 128] A tile)
GROUP = 128
GROUPS = (16, 32, 64, 128)  # scale groups along K
SUB = 64  # the narrowest wgmma K Mosaic takes: groups below it share a sub-step (selects)
BAND = 16  # tasks per band: a band's tasks sweep the weight blocks together (L2 reuse)
_SMEM_BYTES = 232448 - 8 * 1024  # sm_90 max dynamic SMEM, less each buffer's 1 KiB alignment
_MAX_STAGES = 6


@dataclasses.dataclass(frozen=True)
class PrefillWQConfig:
  """stages1 / stages2: ring slots of GEMM1 / GEMM2 (None: as many as shared memory holds, up
  to 6); ctas_per_sm: 1 or 2 (two CTAs share an SM's shared memory, 2-slot rings each: one
  converts while the other's MMAs run; H200, 4096 tokens w4a16: mixtral 6,457 -> 5,474 µs,
  qwen3 1,141 -> 989). A step always waits for its MMAs: leaving one in flight while the next
  tile converts (measured 17-19 % faster on the H200) gave NaNs at qwen3, since wgmma reads
  its register A operand asynchronously and nothing stops the compiler from reusing those
  registers (docs/kernels.md)."""
  stages1: int | None = None
  stages2: int | None = None
  ctas_per_sm: int | None = None  # None: 2 where 2-slot rings fit a CTA's half (4-bit codes)

  def __post_init__(self):
    for name in ("stages1", "stages2"):
      v = getattr(self, name)
      if v is not None and v < 2:
        raise ValueError(f"{name}={v} must be >= 2")
    if self.ctas_per_sm not in (None, 1, 2):
      raise ValueError(f"ctas_per_sm={self.ctas_per_sm} must be 1 or 2")


def _code_bytes(plan: _Plan, rows: int) -> int:
  return rows * BK // 2 if plan.int4 else rows * BK


def _stage_bytes(plan: _Plan, gemm: int) -> int:
  """One ring slot: the code tiles, the token (GEMM1) or activation (GEMM2) tile, the scale
  (and zero) rows."""
  ng = BK // plan.group if plan.grouped else 0  # scale rows a step
  if gemm == 1:
    vec = 2 * ng * BF * 4 + (2 * BF if plan.zero13 else 0)
    return 2 * _code_bytes(plan, BF) + BM * BK * 2 + vec
  vec = ng * BH * 4 + (BH if plan.zero2 else 0)
  return _code_bytes(plan, BH) + BK * BM * 2 + vec


def max_stages(plan: _Plan, gemm: int, ctas_per_sm: int = 1) -> int:
  """The deepest ring that fits (a CTA's share of) shared memory beside the output tile and
  item vectors."""
  out_tile = (BF if gemm == 1 else BH // 2) * BM * 2
  fixed = out_tile + 2 * 4 * max(BF, BH) * 4
  budget = _SMEM_BYTES // ctas_per_sm - (1024 if ctas_per_sm > 1 else 0)
  return min(_MAX_STAGES, (budget - fixed) // _stage_bytes(plan, gemm))


def unsupported(m: int, h: int, n: int, act: Activation | str, w13, w2) -> str | None:
  """Why prefill_wq cannot take this problem (None: it can): the weight-only kernels' format
  rules (`decode_wq.unsupported_format`, scale groups of 16 / 32 / 64 / 128), H and N
  multiples of 64 and at least 128 (128 where there are zero points)."""
  why = unsupported_format(w13, w2, act, groups=GROUPS, kernel="the prefill kernels")
  if why is not None:
    return why
  step = BK if w13.scheme.zero_point else 64
  if h % step or n % step or h < BK or n < BK:
    return f"H={h} and N={n} must be multiples of {step}, at least {BK}"
  return None


def _item(meta_ref, lin, num_tasks, nj: int, rows: int):
  """Work item lin -> (expert, task, block j, first token row): items run band by band
  (BAND tasks), within a band block-major, so the band's tasks share each weight block in
  L2 and each task's token rows stay there while the blocks sweep by."""
  band_items = jnp.int32(BAND * nj)
  band = lax.div(lin, band_items)
  local = lin - band * band_items
  width = jnp.maximum(jnp.minimum(jnp.int32(BAND), num_tasks - band * BAND), 1)
  jb = lax.div(local, width)
  # (past the CTA's last item -- the look-ahead -- clamped inside the task list)
  task = jnp.minimum(band * BAND + lax.rem(local, width), meta_ref.shape[1] - 1)
  ex = meta_ref[0, task]
  # a tile reaching past the rows is shifted back inside them (its columns follow)
  row = pl.multiple_of(jnp.minimum(meta_ref[1, task], rows - BM), 8)
  return ex, task, jb, row


def steps(kdim: int) -> int:
  """128-deep steps along a contraction of kdim (the last shifted back where 128 does not
  divide it: `decode_wq.block_start`)."""
  return -(-kdim // BK)


def _a_tiles(codes, s, z, *, plan: _Plan, zero: bool, xdt, cast, interpret: bool,
             skip=None, scale8: str | None = None) -> list:
  """A code tile (SMEM, [rows, 128]) -> the bf16 register A tiles of its 128 / g scale
  groups, each [rows, g]: (code - zero) * scale with the step's scale rows s (SMEM
  [128 / g, rows]; and zero row z) per row; s None: per-channel (applied to the
  accumulator). skip: its first `skip` columns zeroed (a shifted last step). scale8
  ("e8m0" / "e4m3"): s holds the stored 8-bit scales' bits, widened here (the factors they
  lack -- E2M1_UNIT, nvfp4's global scale -- are then the caller's, on the accumulator)."""
  a = code_values(codes[...], plan, xdt, interpret=interpret)  # (e2m1: the scales carry
  # E2M1_UNIT)
  if skip is not None:  # a shifted last step: its first columns are the previous step's
    col = cast(lax.broadcasted_iota(jnp.int32, a.shape, 1), plgpu.Layout.WGMMA)
    a = jnp.where(col >= skip, a, jnp.zeros((), xdt))
  if s is None:
    return [a]
  rows, row = a.shape[0], plgpu.Layout.WGMMA.reduce(1)
  g = plan.group
  width = max(g, SUB)  # a sub-step's K: one group, or SUB // g of them
  tiles = [a] if width == BK else [a[:, j * width:(j + 1) * width] for j in range(BK // width)]
  per = width // g
  col = None
  if per > 1:  # which group a column of a sub-step belongs to
    col = cast(lax.broadcasted_iota(jnp.int32, (rows, width), 1), plgpu.Layout.WGMMA)
  out = []
  for j, t in enumerate(tiles):
    def srow(u):
      v = cast(s.at[j * per + u][...], row)
      if scale8 is not None:  # the stored e8m0 / e4m3 bits
        v = scale_values(v, scale8)
      return lax.broadcast_in_dim(v.astype(xdt), t.shape, [0])

    sc = srow(0)
    for u in range(1, per):
      sc = jnp.where(col >= u * g, srow(u), sc)
    t = t * sc
    if zero:  # (zero points: groups of 128 only, one sub-step)
      sv = cast(s.at[0][...], row)
      zv = cast(z[...], row).astype(jnp.float32)
      if plan.int4:
        zv = zv - 8.0  # the codes are u - 8: so is the zero
      t = t - lax.broadcast_in_dim((zv * sv).astype(xdt), t.shape, [0])
    out.append(t)
  return out


def _kernel(num_sms: int, interpret, name: str, body, out_type, scratch):
  return _compat.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(num_sms,), grid_names=("sm",),
      compiler_params=_compat.compiler_params(approx_math=True), interpret=interpret,
      name=name)


def _code_transforms(plan: _Plan, kdim: int):
  """The code tiles' SMEM transforms; 64-column tiles where 128 does not divide the
  contraction (TMA's source dimensions must be whole tiles)."""
  return _compat.code_transforms(kdim, 4 if plan.int4 else 8, BK)


def _build_gemm1(*, h, n, rows, tasks, xdt, act: Activation, plan: _Plan, stages: int,
                 num_sms, interpret):
  nj, k1 = n // BF, steps(h)
  stages = min(stages, k1 + 1)  # the prologue's steps all belong to item 0
  _cast = _compat.layout_cast(interpret)
  emulate = interpret is not None  # the interpreter's wgmma takes refs only, not transposed
  use_vec = plan.has_bias or not plan.grouped
  ng = BK // plan.group if plan.grouped else 1
  sub = max(plan.group, SUB) if plan.grouped else BK  # a sub-step's K
  # the token tile's K sub-steps are slices of its SMEM tiles
  tf_w, tf_x = _code_transforms(plan, h), _compat.smem_transforms(min(BK, sub), 2)
  n_copies = 3 + (2 if plan.grouped else 0) + (2 if plan.zero13 else 0)
  n_vec = (0 if plan.grouped else 2) + (2 if plan.has_bias else 0)

  def body(*refs):
    refs = list(refs)
    meta_ref, nt_ref, x_ref, w_ref = refs[:4]
    del refs[:4]
    s_ref = refs.pop(0) if plan.grouped else None
    c_ref = refs.pop(0) if not plan.grouped else None
    z_ref = refs.pop(0) if plan.zero13 else None
    b_ref = refs.pop(0) if plan.has_bias else None
    out_ref = refs.pop(0)
    ring, xring, o_smem, vec = refs[:4]
    del refs[:4]
    sring = refs.pop(0) if plan.grouped else None
    zring = refs.pop(0) if plan.zero13 else None
    bars, vbar = refs[:2]
    t_a, t_b = refs[2:4] if emulate else (None, None)
    sm = lax.axis_index("sm")
    num_tasks = nt_ref[0]
    num_items = num_tasks * nj
    my_items = jnp.maximum(lax.div(num_items - sm + num_sms - 1, num_sms), 0)
    total = my_items * k1

    def info(i):
      return _item(meta_ref, sm + i * num_sms, num_tasks, nj, rows)

    def load_vectors(i, it_info):
      """Item i's per-channel scales and biases (gate, up) into vec[i % 2]."""
      ex, _, jb, _ = it_info
      vb = lax.rem(i, 2)
      for c, col in enumerate((jb * BF, n + jb * BF)):
        if not plan.grouped:
          plgpu.copy_gmem_to_smem(c_ref.at[ex, pl.ds(col, BF)], vec.at[vb, c], vbar.at[vb])
        if plan.has_bias:
          plgpu.copy_gmem_to_smem(b_ref.at[ex, pl.ds(col, BF)], vec.at[vb, 2 + c],
                                  vbar.at[vb])

    def fetch(g, i, cur, nxt):
      @pl.when(g < total)
      def _fetch():
        _, r, it_info, slot = ring_step(g, i, cur, nxt, spi=k1, stages=stages)
        ex, _, jb, row = it_info
        row = pl.multiple_of(row, 8)  # (the select between items hides it from Mosaic)
        bar, ks = bars.at[slot], pl.ds(block_start(r, h, BK), BK)
        for c, col in enumerate((jb * BF, n + jb * BF)):
          plgpu.copy_gmem_to_smem(w_ref.at[ex, pl.ds(col, BF), ks], ring.at[slot, c], bar)
          if plan.grouped:
            plgpu.copy_gmem_to_smem(
                s_ref.at[ex, pl.ds(block_group(r, h, BK, plan.group), ng), pl.ds(col, BF)],
                sring.at[slot, c], bar)
          if plan.zero13:
            plgpu.copy_gmem_to_smem(z_ref.at[ex, r, pl.ds(col, BF)], zring.at[slot, c], bar)
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(row, BM), ks], xring.at[slot], bar)

    info0 = info(jnp.int32(0))

    @pl.when(my_items > 0)
    def _prologue():
      if use_vec:
        load_vectors(jnp.int32(0), info0)
      for g in range(stages - 1):  # the ring ahead of the first step
        fetch(jnp.int32(g), jnp.int32(0), info0, info0)

    def operand_a(a, which):
      if emulate:
        dst = t_a.at[which, :, pl.ds(0, a.shape[1])]
        dst[...] = a
        return dst
      return a

    def operand_b(tile, q):
      """Sub-step q's B: K columns [q sub, (q + 1) sub) of the token tile, as [sub, 128]."""
      if sub < BK:
        tile = tile.at[:, pl.ds(q * sub, sub)]
      if emulate:
        t_b.at[pl.ds(0, tile.shape[1])][...] = tile[...].T
        return t_b.at[pl.ds(0, tile.shape[1])]
      return plgpu.transpose_ref(tile, (1, 0))  # [128 tokens, K] K-major -> [K, 128]

    def one_item(i, cur):
      nxt = info(i + 1)
      _, task, jb, _ = cur
      vb = lax.rem(i, 2)
      if use_vec:
        plgpu.barrier_wait(vbar.at[vb])

        @pl.when(i + 1 < my_items)
        def _next_vectors():  # vec[1 - vb] was item i - 1's, whose epilogue has run
          load_vectors(i + 1, nxt)

      def gemm(acc_g, acc_u):
        @pl.loop(0, k1)
        def _step(r):
          g = i * k1 + r
          slot = lax.rem(g, jnp.int32(stages))
          plgpu.barrier_wait(bars.at[slot])
          for c, acc in enumerate((acc_g, acc_u)):
            s = sring.at[slot, c] if plan.grouped else None
            z = zring.at[slot, c] if plan.zero13 else None
            tiles = _a_tiles(ring.at[slot, c], s, z, plan=plan, zero=plan.zero13, xdt=xdt,
                             cast=_cast, interpret=emulate,
                             skip=r * BK - block_start(r, h, BK) if h % BK else None)
            for q, a in enumerate(tiles):
              plgpu.wgmma(acc, operand_a(a, c), operand_b(xring.at[slot], q))
          plgpu.wgmma_wait(0)  # the slot's tiles (and the register A tiles) are read
          fetch(g + stages - 1, i, cur, nxt)

        vals = []
        row = plgpu.Layout.WGMMA.reduce(1)
        for c, acc in enumerate((acc_g, acc_u)):
          v = acc[...]
          if not plan.grouped:
            v = v * lax.broadcast_in_dim(_cast(vec.at[vb, c][...], row), (BF, BM), [0])
          if plan.has_bias:
            v = v + lax.broadcast_in_dim(_cast(vec.at[vb, 2 + c][...], row), (BF, BM), [0])
          vals.append(v)
        a = kernel_activation(act, *vals)  # [64 intermediate columns, 128 tokens]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store read it
        o_smem[...] = a.astype(xdt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[task, pl.ds(jb * BF, BF)])

      pl.run_scoped(gemm, plgpu.ACC((BF, BM), jnp.float32), plgpu.ACC((BF, BM), jnp.float32))
      return nxt

    lax.fori_loop(0, my_items, one_item, info0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [plgpu.SMEM((stages, 2, BF, BK), plan.code, transforms=tf_w),
             plgpu.SMEM((stages, BM, BK), xdt, transforms=tf_x),
             plgpu.SMEM((BF, BM), xdt, transforms=_compat.smem_transforms(BM, 2)),
             plgpu.SMEM((2, 4, BF), jnp.float32)]
  if plan.grouped:
    scratch.append(plgpu.SMEM((stages, 2, ng, BF), jnp.float32))
  if plan.zero13:
    scratch.append(plgpu.SMEM((stages, 2, BF), jnp.dtype(jnp.uint8) if plan.int4 else
                              plan.code))
  scratch += [plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
              plgpu.Barrier(num_arrivals=max(n_vec, 1), num_barriers=2)]
  if emulate:
    scratch += [plgpu.SMEM((2, BF, BK), xdt), plgpu.SMEM((BK, BM), xdt)]
  out_type = jax.ShapeDtypeStruct((tasks, n, BM), xdt)
  return _kernel(num_sms, interpret, "jmoe_gg_wq_gated", body, out_type, scratch)


def _build_gemm2(*, h, n, tasks, xdt, plan: _Plan, stages: int, num_sms, interpret):
  nj, k2 = -(-h // BH), steps(n)
  stages = min(stages, k2 + 1)  # the prologue's steps all belong to item 0
  _cast = _compat.layout_cast(interpret)
  emulate = interpret is not None
  ng = BK // plan.group if plan.grouped else 1
  tf_w, tf_a = _code_transforms(plan, n), _compat.smem_transforms(BM, 2)
  n_copies = 2 + (1 if plan.grouped else 0) + (1 if plan.zero2 else 0)

  def body(*refs):
    refs = list(refs)
    meta_ref, nt_ref, a_ref, w_ref = refs[:4]
    del refs[:4]
    s_ref = refs.pop(0) if plan.grouped else None
    c_ref = refs.pop(0) if not plan.grouped else None
    z_ref = refs.pop(0) if plan.zero2 else None
    out_ref = refs.pop(0)
    ring, aring, o_smem, vec = refs[:4]
    del refs[:4]
    sring = refs.pop(0) if plan.grouped else None
    zring = refs.pop(0) if plan.zero2 else None
    bars, vbar = refs[:2]
    t_a = refs[2] if emulate else None
    sm = lax.axis_index("sm")
    num_tasks = nt_ref[0]
    num_items = num_tasks * nj
    my_items = jnp.maximum(lax.div(num_items - sm + num_sms - 1, num_sms), 0)
    total = my_items * k2

    def info(i):
      ex, task, jb, _ = _item(meta_ref, sm + i * num_sms, num_tasks, nj, BM)
      return ex, task, jb

    def load_vectors(i, it_info):
      ex, _, jb = it_info
      plgpu.copy_gmem_to_smem(c_ref.at[ex, pl.ds(block_start(jb, h, BH), BH)],
                              vec.at[lax.rem(i, 2)],
                              vbar.at[lax.rem(i, 2)])

    def fetch(g, i, cur, nxt):
      @pl.when(g < total)
      def _fetch():
        _, r, it_info, slot = ring_step(g, i, cur, nxt, spi=k2, stages=stages)
        ex, task, jb = it_info
        bar, hs = bars.at[slot], pl.ds(block_start(jb, h, BH), BH)
        ks = pl.ds(block_start(r, n, BK), BK)
        plgpu.copy_gmem_to_smem(w_ref.at[ex, hs, ks], ring.at[slot], bar)
        if plan.grouped:
          plgpu.copy_gmem_to_smem(
              s_ref.at[ex, pl.ds(block_group(r, n, BK, plan.group), ng), hs], sring.at[slot], bar)
        if plan.zero2:
          plgpu.copy_gmem_to_smem(z_ref.at[ex, r, hs], zring.at[slot], bar)
        plgpu.copy_gmem_to_smem(a_ref.at[task, ks], aring.at[slot], bar)

    info0 = info(jnp.int32(0))

    @pl.when(my_items > 0)
    def _prologue():
      if not plan.grouped:
        load_vectors(jnp.int32(0), info0)
      for g in range(stages - 1):
        fetch(jnp.int32(g), jnp.int32(0), info0, info0)

    def one_item(i, cur):
      nxt = info(i + 1)
      _, task, jb = cur
      vb = lax.rem(i, 2)
      if not plan.grouped:
        plgpu.barrier_wait(vbar.at[vb])

        @pl.when(i + 1 < my_items)
        def _next_vectors():
          load_vectors(i + 1, nxt)

      def gemm(acc):
        @pl.loop(0, k2)
        def _step(r):
          g = i * k2 + r
          slot = lax.rem(g, jnp.int32(stages))
          plgpu.barrier_wait(bars.at[slot])
          tiles = _a_tiles(ring.at[slot], sring.at[slot] if plan.grouped else None,
                           zring.at[slot] if plan.zero2 else None, plan=plan,
                           zero=plan.zero2, xdt=xdt, cast=_cast, interpret=emulate,
                           skip=r * BK - block_start(r, n, BK) if n % BK else None)
          for q, a in enumerate(tiles):
            width = a.shape[1]
            if emulate:
              t_a.at[:, pl.ds(0, width)][...] = a
              a = t_a.at[:, pl.ds(0, width)]
            plgpu.wgmma(acc, a, aring.at[slot, pl.ds(q * width, width)])
          plgpu.wgmma_wait(0)
          fetch(g + stages - 1, i, cur, nxt)

        v = acc[...]
        if not plan.grouped:
          sv = _cast(vec.at[vb][...], plgpu.Layout.WGMMA.reduce(1))
          v = v * lax.broadcast_in_dim(sv, (BH, BM), [0])
        y = v.astype(xdt)
        for half in range(2):  # through a half tile: two CTAs' rings fit beside it
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          o_smem[...] = y[half * (BH // 2):(half + 1) * (BH // 2)]
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
              o_smem, out_ref.at[task, pl.ds(block_start(jb, h, BH) + half * (BH // 2), BH // 2)])

      pl.run_scoped(gemm, plgpu.ACC((BH, BM), jnp.float32))
      return nxt

    lax.fori_loop(0, my_items, one_item, info0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [plgpu.SMEM((stages, BH, BK), plan.code, transforms=tf_w),
             plgpu.SMEM((stages, BK, BM), xdt, transforms=tf_a),
             plgpu.SMEM((BH // 2, BM), xdt, transforms=tf_a),
             plgpu.SMEM((2, BH), jnp.float32)]
  if plan.grouped:
    scratch.append(plgpu.SMEM((stages, ng, BH), jnp.float32))
  if plan.zero2:
    scratch.append(plgpu.SMEM((stages, BH), jnp.dtype(jnp.uint8) if plan.int4 else
                              plan.code))
  scratch += [plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
              plgpu.Barrier(num_arrivals=1, num_barriers=2)]
  if emulate:
    scratch.append(plgpu.SMEM((BH, BK), xdt))
  out_type = jax.ShapeDtypeStruct((tasks, h, BM), xdt)
  return _kernel(num_sms, interpret, "jmoe_gg_wq", body, out_type, scratch)


def _group_major_scales(w, plan: _Plan) -> jax.Array:
  """Grouped scales as float32 [E, K / g, rows] (`_group_major`; e2m1: the e8m0 / e4m3 scales
  times the global scale and E2M1_UNIT, the factor the converted codes lack). The 8-bit
  scales are transposed as bytes before they widen: fused into the conversion, XLA's
  transposing loop took 410 µs for gpt-oss' w13 at 0.65 TB/s (H200)."""
  s = w.scale
  if jnp.dtype(s.dtype).itemsize == 1:
    raw = lax.optimization_barrier(_group_major(lax.bitcast_convert_type(s, jnp.uint8)))
    s = lax.bitcast_convert_type(raw, s.dtype)
  else:
    s = _group_major(s)
  s = s.astype(jnp.float32)
  if not plan.e2m1:
    return s
  if w.global_scale is not None:  # [E, S] along the rows (now the last axis)
    g = w.global_scale.astype(jnp.float32)
    s = s * jnp.repeat(g, s.shape[2] // g.shape[1], axis=1)[:, None, :]
  return s * E2M1_UNIT


def _group_major(w) -> jax.Array:
  """Scales (or zero points) [E, rows, K / 128] -> [E, K / 128, rows]: a step's row of them
  contiguous, one TMA box."""
  return jnp.swapaxes(w, 1, 2)


def slot_columns(inv: jax.Array, meta: jax.Array, num_tasks: jax.Array, rows: int) -> jax.Array:
  """The flat column (task * 128 + column) of each slot's sorted row inv [T, k] (-1: empty)
  in the kernels' task-major outputs; -1 for an empty slot."""
  his = jnp.where(jnp.arange(meta.shape[1]) < num_tasks[0], meta[3], jnp.iinfo(jnp.int32).max)
  task = jnp.searchsorted(his, inv, side="right").astype(jnp.int32)
  task = jnp.minimum(task, meta.shape[1] - 1)
  first = jnp.minimum(meta[1][task], rows - BM)
  return jnp.where(inv >= 0, task * BM + inv - first, -1)


def prefill_wq(xs: jax.Array, meta: jax.Array, num_tasks: jax.Array, w13, w2, *,
               activation: Activation | str = "silu", w13_bias: jax.Array | None = None,
               config: PrefillWQConfig | None = None, interpret: Any = False) -> jax.Array:
  """The expert MLP on sorted token rows: y_t [tasks, H, 128] (column c of task t: the row
  tile + c of xs through act(x @ dq(w13[e]) + b13[e]) @ dq(w2[e]), e the task's expert).

  xs [R, H] bf16 / f16 (R >= 128, a multiple of 8; the rows sorted by expert); meta / num_tasks
  grouped_gemm.tile_metadata(group_sizes, R, 128); w13 / w2 QuantizedWeights (logical
  [E, H, 2N] / [E, N, H], K-major int4 / int8 / e2m1 codes, see `unsupported`); w13_bias f32
  [E, 2N]. config: PrefillWQConfig (None: its defaults).
  slot_columns maps a sorted row to its column of y_t.reshape(tasks * 128, H) after a swap of
  the last two axes."""
  act = as_activation(activation)
  rows, h = xs.shape
  e, _, n2 = w13.shape
  n = n2 // 2
  why = unsupported(rows, h, n, act, w13, w2)
  if why is not None:
    raise ValueError(f"prefill_wq: {why}")
  if rows < BM or rows % 8:
    raise ValueError(f"xs has {rows} rows: prefill_wq needs >= {BM}, a multiple of 8")
  if w13_bias is not None and w13_bias.shape != (e, n2):
    raise ValueError(f"w13_bias must have shape ({e}, {n2}), got {w13_bias.shape}")
  plan = _plan(w13, w2, w13_bias is not None)
  cfg = config or PrefillWQConfig()
  ctas = cfg.ctas_per_sm or (2 if min(max_stages(plan, g, 2) for g in (1, 2)) >= 2 else 1)
  caps = [max_stages(plan, gemm, ctas) for gemm in (1, 2)]
  st1, st2 = cfg.stages1 or caps[0], cfg.stages2 or caps[1]
  for name, st, cap in (("stages1", st1, caps[0]), ("stages2", st2, caps[1])):
    if st > cap or st < 2:
      raise ValueError(f"{name}={st}: shared memory holds 2 to {cap} ring slots "
                       f"(ctas_per_sm={ctas})")
  tasks = meta.shape[1]
  interp, nsm = _compat.launch_params(interpret)
  nctas = nsm * (ctas if interp is None else 1)
  k1 = _build_gemm1(h=h, n=n, rows=rows, tasks=tasks, xdt=xs.dtype, act=act, plan=plan,
                    stages=st1, num_sms=nctas, interpret=interp)
  k2 = _build_gemm2(h=h, n=n, tasks=tasks, xdt=xs.dtype, plan=plan, stages=st2,
                    num_sms=nctas, interpret=interp)
  meta = meta.astype(jnp.int32)
  num_tasks = num_tasks.astype(jnp.int32)
  args = [meta, num_tasks, xs, _codes(w13, plan.code)]
  args += [operand(w13, op) for op in operands(w13)]
  if plan.has_bias:
    args.append(w13_bias.astype(jnp.float32))
  a_t = k1(*args)
  args = [meta, num_tasks, a_t, _codes(w2, plan.code)]
  args += [operand(w2, op) for op in operands(w2)]
  return k2(*args)


def operands(w) -> tuple[Operand, ...]:
  """prefill_wq's weight-derived operands for one GEMM's weights w, in its argument order
  (`jmoe.kernels.prepared`: kept on w where prepared, else made per call): the scales as
  float32, group-major (`_group_major_scales`) or per channel [E, rows], and the zero points
  group-major."""
  grouped = w.scheme.weight_scale == "group"
  ops = [Operand("wq.scale", (lambda w: _group_major_scales(w, _plan(w, w, False))) if grouped
                 else (lambda w: w.scale[:, :, 0].astype(jnp.float32)))]
  if w.zero is not None:
    ops.append(Operand("wq.zero", lambda w: _group_major(w.zero)))
  return tuple(ops)


def combine_columns(y_t: jax.Array, cols: jax.Array, topk_weights: jax.Array, w2_bias, *,
                    topk_ids: jax.Array, num_experts: int, out_dtype) -> jax.Array:
  """y_t [tasks, H, 128] and each slot's column cols [T, k] (-1: empty) -> out [T, H]:
  sum_j topk_weights[t, j] * (y[col(t, j)] + b2[e(t, j)]), in float32."""
  tasks, h, _ = y_t.shape
  y = jnp.swapaxes(y_t, 1, 2).reshape(tasks * BM, h)
  valid = cols >= 0
  rows = jnp.take(y, jnp.maximum(cols, 0), axis=0).astype(jnp.float32)  # [T, k, H]
  if w2_bias is not None:
    ids = jnp.clip(topk_ids, 0, num_experts - 1)
    rows = rows + w2_bias.astype(jnp.float32)[ids]
  w = jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)[:, :, None]
  return jnp.sum(jnp.where(valid[:, :, None], rows, 0.0) * w, axis=1).astype(out_dtype)


