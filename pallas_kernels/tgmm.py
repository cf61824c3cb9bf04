"""Transposed grouped GEMM (the weight gradient) and a differentiable grouped GEMM.

    tgmm(lhs [M, K], dout [M, N], group_sizes [E]) -> [E, K, N],  out[g] = lhs[rows_g]^T @ dout[rows_g]

(rows sorted by group, as in grouped_gemm; experts with no rows get zeros; rows past
sum(group_sizes) are ignored). Mosaic GPU: a persistent grid over (expert, K tile, N tile); the
contraction runs over the expert's own rows only, in blocks that start at its first row
rounded down to 8 (pipelined TMA, wgmma with a transposed lhs tile); a block's rows outside the
expert are zeroed in SMEM. Four schedules (TgmmConfig): a pipeline per output tile (one or two
CTAs per SM); the same, warp specialized (a TMA warpgroup, two compute warpgroups sharing the
dout tiles); one pipeline across all of a CTA's tiles with hand-issued TMA (cross_tile); or
that, warp specialized, with hand-written producer / consumer barriers (both flags). Tiles are
walked N-fastest or K-fastest (k_fastest) within an expert.

``gmm(lhs, rhs, group_sizes)`` is grouped_gemm with a ``jax.custom_vjp``: d lhs = gmm(dout, rhs^T)
(the forward kernel on transposed weights) and d rhs = tgmm(lhs, dout), so ``jax.grad`` runs on
the Pallas kernels. (The MoE block's training path, ``jmoe.kernels.expert_mlp``, calls the
GEMMs and tgmm itself, on the routing kernels' tile lists.)
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

from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm as gg


@dataclasses.dataclass(frozen=True)
class TgmmConfig:
  """block_k: output rows (K) per warpgroup (64/128); block_n: output cols per tile (multiple of
  64); block_r: contraction rows per pipeline step (64/128); num_stages: pipeline depth."""
  block_k: int = 128
  block_n: int = 128
  block_r: int = 64
  num_stages: int = 4
  # True: wgmma reads lhs tiles transposed from SMEM (MN-major A operand; needs no extra pass,
  # but GPU interpret mode cannot simulate it). False: lhs is transposed by XLA first ([K, M],
  # one extra pass over lhs) and the kernel reads K-major tiles. None: True on the GPU, False
  # in interpret mode (H200, mixtral-sized tgmm: 155 vs 169 µs).
  transpose_in_kernel: bool | None = None
  # CTAs resident per SM (1 or 2). An expert's contraction is short at training sizes (mixtral,
  # 1024 tokens: 256 rows = 4 pipeline steps per output tile), so a lone CTA waits on its first
  # loads and its epilogue store every few steps; a second CTA (shared memory halved: stages
  # are refitted) computes meanwhile.
  ctas_per_sm: int = 1
  # True: one TMA warpgroup feeds two compute warpgroups that share each row block's dout
  # tile, each computing block_k output rows: a CTA tile is (2 * block_k) x block_n, so dout is
  # read from L2 half as often per output element. The TMA warpgroup issues the next tile's
  # loads while the compute warpgroups store the current one. H200, 1024 tokens (2026-11-30):
  # mixtral's winner (dW13 1397 -> 1279 µs at 128x128 per warpgroup, dW2 624 -> 561 at
  # 64x256); no gain on qwen3.
  warp_specialized: bool = False
  # True: one software pipeline over all of a CTA's (output tile, row block) steps, its TMA
  # loads issued by hand num_stages - 1 steps ahead, across tile boundaries: the next tile's
  # first blocks load while this one computes and stores, and no pipeline fills or drains per
  # tile (qwen3 at 1024 tokens: 1-2 row blocks per tile). Expert bounds are staged in SMEM
  # (the step -> tile arithmetic reads them every step; global loads there made the
  # emit_pipeline version of this schedule 29-42 % slower than per-tile, 2026-11-29).
  # H200, qwen3 at 1024 tokens (2026-11-30): dW13 338 -> 286 µs (64x256, 4 stages), dW2
  # 171 -> 153 (128x128, 2 CTAs / SM); on mixtral the warp-specialized form stays ahead.
  cross_tile: bool = False
  # The order a CTA walks its output tiles within an expert. False: N tiles fastest (one lhs
  # column block is shared by consecutive tiles). True: K tiles fastest (one dout column block
  # is shared, and the expert's whole lhs slab is re-read per N tile): when dout is wide
  # (mixtral dW13: 28672 columns, 14.7 MB per expert at 1024 tokens), N-fastest order sweeps
  # the expert's dout once per K tile and the stored gradient tiles stream through L2 between
  # two sweeps.
  k_fastest: bool = False
  # SMEM output tiles per warpgroup (1 or 2). A tile's epilogue first waits until the TMA store
  # of the tile before has read its SMEM tile. With one buffer that wait, then the write of
  # the new tile, sit between two stores, and the store stream idles meanwhile; with two the
  # wait is for the store two tiles back. For short experts (deepseek-v3 at 1024 tokens, one
  # row block per tile) the gradient's stores are the work: dW13 ran at 3.5 TB/s of writes
  # against 4.39 for TMA stores alone (benchmarks/probe_write_bw.py, H200, 2026-11-30). The
  # second buffer costs SMEM: stages are refitted (2 for the WS 64x256 form). H200: dW13 4361
  # -> 3800 µs (WS cross-tile, 3.96 TB/s of writes), dW2 2271 -> 1890; 25-50 % slower wherever
  # a tile has a K loop (qwen3 / mixtral 1024, deepseek-v3 4096), whose 2 stages then show.
  out_buffers: int = 1
  # Column chunks each tile is stored in (1, 2 or 4; at least 64 columns each, else fewer):
  # the output buffers hold chunks, not tiles, so two buffers of half tiles cost the SMEM of
  # one whole tile and keep the stages, yet one chunk's store is always in flight while the
  # next chunk is written. H200 (2026-11-30), with two buffers: quarters took deepseek-v3's
  # dW13 at 4096 tokens 5230 -> 4646 µs (4 stages kept), halves mixtral's dW13 957 -> 917.
  store_parts: int = 1

  def __post_init__(self):
    if self.block_k not in (64, 128):
      raise ValueError(f"block_k={self.block_k} must be 64 or 128")
    if self.block_n % 64 or self.block_n <= 0:
      raise ValueError(f"block_n={self.block_n} must be a positive multiple of 64")
    if self.block_r not in (64, 128):
      raise ValueError(f"block_r={self.block_r} must be 64 or 128")
    if self.num_stages < 2:
      raise ValueError("num_stages must be >= 2")
    if self.ctas_per_sm not in (1, 2):
      raise ValueError(f"ctas_per_sm={self.ctas_per_sm} must be 1 or 2")
    if self.warp_specialized and self.ctas_per_sm != 1:
      raise ValueError("warp_specialized=True needs ctas_per_sm=1 (registers)")
    if self.out_buffers not in (1, 2):
      raise ValueError(f"out_buffers={self.out_buffers} must be 1 or 2")
    if self.store_parts not in (1, 2, 4):
      raise ValueError(f"store_parts={self.store_parts} must be 1, 2 or 4")

  @property
  def tile_k(self) -> int:
    """Output rows of one CTA tile."""
    return self.block_k * (2 if self.warp_specialized else 1)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


_SMEM_LIMIT = 227 * 1024  # Hopper: shared memory one block may use
_SMEM_PER_SM = 228 * 1024  # Hopper: shared memory of one SM (1 KiB of it reserved per block)


def _smem_limit(ctas_per_sm: int) -> int:
  return min(_SMEM_LIMIT, _SMEM_PER_SM // ctas_per_sm - 1024)


def _smem_bytes(tk, bn, br, stages, itemsize, out_itemsize, num_groups=0, out_buffers=1,
                store_parts=1):
  """A CTA's shared memory: the pipeline's lhs and dout tiles, the output buffers (each a
  1 / store_parts column chunk of a tile) and for the cross-tile pipeline the experts' row
  bounds, padded."""
  return (stages * (br * tk + br * bn) * itemsize
          + out_buffers * tk * (bn // store_parts) * out_itemsize
          + 2 * _pad_groups(num_groups) * 4)


def _pad_groups(e: int) -> int:
  """Expert count padded so that a row of int32 bounds is a whole number of 16-byte TMA units."""
  return -(-e // 4) * 4


# The default when no tuned entry matches (benchmarks may swap it for a sweep's best): the H200
# sweep's winner on all three training shapes (2026-11-29, jax 0.11.2, device µs, 1 CTA / SM
# 4 stages -> 2 CTAs / SM 2 stages): mixtral dW13 1708 -> 1406, dW2 778 -> 654, qwen3 dW13
# 511 -> 351.
DEFAULT_CONFIG = TgmmConfig(block_k=128, block_n=128, block_r=64, num_stages=2, ctas_per_sm=2)


def get_tgmm_config(m: int, k: int, n: int, num_groups: int, dtype) -> TgmmConfig:
  """Tuned config from jmoe.kernels/configs/tgmm.json (keyed like the grouped GEMMs': E, N,
  K, dtype, device kind, jax minor version, M bucket; `python -m jmoe tune` writes it; past
  4096 rows a bucket without an entry takes its nearest tuned neighbour's), else
  DEFAULT_CONFIG."""
  return (gg.tuned_config("tgmm", TgmmConfig, m, n, k, num_groups, dtype, nearest=True)
          or DEFAULT_CONFIG)


class _Tile:
  """One output tile (expert g, K tile ki, N tile ni) and its row blocks.

  Block j covers rows [base + j * block_r, + block_r), base = the expert's first row rounded
  down to a multiple of `align` (TMA offsets into a tiled SMEM layout must be multiples of the
  tile: 8 rows when rows are the major dimension): an expert of s rows is about cdiv(s,
  block_r) steps, wherever it starts. Rows of a loaded block that are not the block's own rows
  of the expert are zeroed in lhs (_mask_lhs); rows past the array read as zeros (TMA fills
  them; in interpret mode the wrapper pads the arrays with block_r zero rows)."""

  def __init__(self, lin, starts_ref, ends_ref, *, k_tiles, n_tiles, block_r, align,
               k_fastest=False):
    self.g = lax.div(lin, jnp.int32(k_tiles * n_tiles))
    rem = lax.rem(lin, jnp.int32(k_tiles * n_tiles))
    if k_fastest:
      self.ni, self.ki = lax.div(rem, jnp.int32(k_tiles)), lax.rem(rem, jnp.int32(k_tiles))
    else:
      self.ki, self.ni = lax.div(rem, jnp.int32(n_tiles)), lax.rem(rem, jnp.int32(n_tiles))
    self.start = starts_ref[self.g]
    self.end = ends_ref[self.g]
    self._base = lax.div(self.start, jnp.int32(align)) * align
    self.num_blocks = jnp.where(
        self.end > self.start,
        lax.div(self.end - self._base + (block_r - 1), jnp.int32(block_r)), 0)
    self._br, self._align = block_r, align

  def rows(self, j):
    """(first own row of block j, the row block j is loaded from: a multiple of align)."""
    r0 = pl.multiple_of(self._base + j * self._br, self._align)
    return jnp.maximum(r0, self.start), r0


def _launch(body, out_shape, out_dtype, scratch, num_ctas, interpret, name, **extra):
  """A tgmm kernel on a persistent grid of num_ctas CTAs (axis "sm")."""
  return _compat.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
      scratch_types=scratch,
      grid=(num_ctas,),
      grid_names=("sm",),
      compiler_params=_compat.compiler_params(),
      interpret=interpret,
      name=name,
      **extra,
  )


def _row_align(tik, interpret) -> int:
  """Row-block offsets: multiples of the SMEM tile (8 rows; 64 elements when rows are lhs's
  minor dimension, XLA having transposed it). The interpreter has no tiles; it runs the GPU
  default's arithmetic."""
  return 8 if tik or interpret is not None else 64


def _mask_lhs(x_smem, r0, lo, end, *, br, tik, cast):
  """Zero the lhs rows of a loaded row block (first row r0) outside [lo, end). Their products
  then vanish for any finite dout row (dout rows past every expert must be finite: jmoe's
  callers pass zeros there)."""
  @pl.when((r0 < lo) | (r0 + br > end))
  def _mask():
    shape = x_smem.shape
    rows = cast(lax.broadcasted_iota(jnp.int32, shape, 0 if tik else 1), plgpu.Layout.WGMMA)
    ok = (rows + r0 >= lo) & (rows + r0 < end)
    x_smem[...] = jnp.where(ok, x_smem[...], jnp.zeros_like(x_smem[...]))
    plgpu.commit_smem()


def _build_tgmm(*, m, k, n, e, dtype, out_dtype, cfg: TgmmConfig, num_ctas, interpret):
  """The kernel for rows sorted by expert: operands (starts [E], ends [E], lhs [m, K] (or
  [K, m] when not transpose_in_kernel), dout [m, N]) -> [E, K, N]. A persistent grid walks the
  output tiles; each runs a pipeline over its expert's row blocks."""
  if cfg.cross_tile:
    return _build_tgmm_cross_tile(m=m, k=k, n=n, e=e, dtype=dtype, out_dtype=out_dtype, cfg=cfg,
                                  num_ctas=num_ctas, interpret=interpret)
  bk, bn, br, tk = cfg.block_k, cfg.block_n, cfg.block_r, cfg.tile_k
  k_tiles, n_tiles = k // tk, n // bn
  itemsize = jnp.dtype(dtype).itemsize
  tik = cfg.transpose_in_kernel
  ws = cfg.warp_specialized
  nwg = 2 if ws else 1
  _cast = _compat.layout_cast(interpret)

  def tf(minor, isz=itemsize):
    return _compat.smem_transforms(minor, isz)

  align = _row_align(tik, interpret)

  def tile_of(lin, starts_ref, ends_ref):
    return _Tile(lin, starts_ref, ends_ref, k_tiles=k_tiles, n_tiles=n_tiles, block_r=br,
                 align=align, k_fastest=cfg.k_fastest)

  def in_specs(row, ki, ni, **kw):
    """BlockSpecs of the lhs and dout tiles: step j loads rows [row(j), row(j) + block_r)."""
    x_spec = (plgpu.BlockSpec((pl.Element(br), tk), lambda j: (row(j), ki), transforms=tf(tk),
                              **kw) if tik else
              plgpu.BlockSpec((tk, pl.Element(br)), lambda j: (ki, row(j)), transforms=tf(br),
                              **kw))
    dy_spec = plgpu.BlockSpec((pl.Element(br), bn), lambda j: (row(j), ni), transforms=tf(bn),
                              **kw)
    return [x_spec, dy_spec]

  def tile_specs(t: _Tile, **kw):
    return in_specs(lambda j: t.rows(j)[1], t.ki, t.ni, **kw)

  def mma(t: _Tile, j, acc_ref, x_smem, dy_smem, wg):
    """acc += (this warpgroup's lhs columns of block j)^T @ dout block j."""
    lo, r0 = t.rows(j)
    xw = x_smem
    if ws:
      xw = x_smem.at[:, pl.ds(wg * bk, bk)] if tik else x_smem.at[pl.ds(wg * bk, bk), :]
    _mask_lhs(xw, r0, lo, t.end, br=br, tik=tik, cast=_cast)
    plgpu.wgmma(acc_ref, plgpu.transpose_ref(xw, (1, 0)) if tik else xw, dy_smem)

  def store(t: _Tile, acc, ring, i, out_ref, wg):
    _store_tile(acc, ring, i, out_ref, t.g, t.ki * tk + wg * bk, t.ni * bn, out_dtype,
                cfg.store_parts)

  def body(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, o_smem, *allocs):
    @plgpu.nd_loop((e * k_tiles * n_tiles,), collective_axes="sm")
    def _loop(info):
      (lin,) = info.index
      t = tile_of(lin, starts_ref, ends_ref)
      # this CTA's tile count so far (nd_loop deals tiles round-robin): its output buffers
      i = lax.div(lin, jnp.int32(num_ctas))

      if ws:
        def mma_body(idx, x_smem, dy_smem, acc_ref):
          mma(t, idx[0], acc_ref, x_smem, dy_smem, lax.axis_index("wg"))
          plgpu.wgmma_wait(0)
          return acc_ref

        def compute_context(eval_pipeline):
          def scope(acc_ref):
            acc = eval_pipeline(acc_ref)
            wg = lax.axis_index("wg")
            store(t, acc[...], o_smem.at[wg], i, out_ref, wg)
          pl.run_scoped(scope, plgpu.ACC((bk, bn), jnp.float32))

        plgpu.emit_pipeline_warp_specialized(
            mma_body, grid=(t.num_blocks,), memory_registers=40, in_specs=tile_specs(t),
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=cfg.num_stages,
            compute_context=compute_context)(lhs_ref, dout_ref, allocations=allocs[0])
        return

      def acc_scope(acc_ref):
        def step(idx, x_smem, dy_smem):
          mma(t, idx[0], acc_ref, x_smem, dy_smem, 0)
          # one wgmma stays in flight; delay_release keeps its SMEM slots until the next step
          plgpu.wgmma_wait(1)

        plgpu.emit_pipeline(step, grid=(t.num_blocks,), in_specs=tile_specs(t, delay_release=1),
                            max_concurrent_steps=cfg.num_stages)(lhs_ref, dout_ref)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

      store(t, pl.run_scoped(acc_scope, plgpu.ACC((bk, bn), jnp.float32)), o_smem, i,
            out_ref, 0)

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [_out_ring(cfg, nwg, bn, out_dtype, tf)]
  extra = {}
  if ws:
    # the allocations depend on the block shapes and stages only (a static grid of `stages`
    # steps keeps the pipeline from shrinking its buffers)
    ignore = lambda *_, **__: None
    pipe = plgpu.emit_pipeline_warp_specialized(
        ignore, grid=(cfg.num_stages,), memory_registers=40, in_specs=in_specs(lambda j: j * br, 0, 0),
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=cfg.num_stages,
        compute_context=ignore)
    lhs_shape = (m, k) if tik else (k, m)
    scratch.append(pipe.get_allocations(jax.ShapeDtypeStruct(lhs_shape, dtype),
                                        jax.ShapeDtypeStruct((m, n), dtype)))
    extra = dict(num_threads=3, thread_name="wg")
  return _launch(body, (e, k, n), out_dtype, scratch, num_ctas, interpret,
                 "jmoe_tgmm" + ("_ws" if ws else "") + ("_2cta" if cfg.ctas_per_sm == 2 else ""),
                 **extra)


class _CtaWalk:
  """The (output tile, row block) steps of one CTA of a cross-tile kernel: CTA c owns the tiles
  lin = c, c + num_ctas, ...; tile i has max(1, row blocks) steps (an empty expert's tile is one
  fully masked step, so its zeros get written). Expert bounds are read from SMEM."""

  def __init__(self, cta, bounds_smem, *, num_ctas, num_tiles, k_tiles, n_tiles, block_r,
               align, k_fastest):
    self._cta, self._bounds = cta, bounds_smem
    self._num_ctas, self._num_tiles = num_ctas, num_tiles
    self._kw = dict(k_tiles=k_tiles, n_tiles=n_tiles, block_r=block_r, align=align,
                    k_fastest=k_fastest)
    self.my_tiles = lax.div(num_tiles - cta + num_ctas - 1, num_ctas)

  def tile(self, i):
    """(tile i of this CTA, its steps). A fetch cursor may run past the CTA's last tile at the
    end; such tiles are clamped to the last one (never loaded, never stored) so that the
    bounds reads stay inside bounds_smem."""
    lin = jnp.minimum(self._cta + i * self._num_ctas, self._num_tiles - 1)
    t = _Tile(lin, self._bounds.at[0], self._bounds.at[1], **self._kw)
    return t, jnp.maximum(t.num_blocks, 1)

  @staticmethod
  def advance(i, j, steps):
    """The step after (tile i, block j) of a tile of `steps` steps."""
    last = j + 1 >= steps
    return jnp.where(last, i + 1, i), jnp.where(last, 0, j + 1)

  def total(self):
    return lax.fori_loop(0, self.my_tiles, lambda i, acc: acc + self.tile(i)[1], jnp.int32(0))


def _cross_tile_common(*, k, n, e, dtype, out_dtype, cfg: TgmmConfig, num_ctas, interpret):
  """What both cross-tile kernels share: (walk(cta, bounds_smem) -> _CtaWalk, fetch(lhs_ref,
  dout_ref, t, j, x_dst, dy_dst, barrier) loading block j of tile t (lhs columns of a whole
  CTA tile), scratch of the SMEM ring, output tile(s), bounds and their barriers)."""
  tk, bn, br, st = cfg.tile_k, cfg.block_n, cfg.block_r, cfg.num_stages
  nwg = 2 if cfg.warp_specialized else 1
  k_tiles, n_tiles = k // tk, n // bn
  tik = cfg.transpose_in_kernel
  align = _row_align(tik, interpret)
  itemsize = jnp.dtype(dtype).itemsize

  def walk(cta, bounds_smem):
    return _CtaWalk(cta, bounds_smem, num_ctas=num_ctas, num_tiles=e * k_tiles * n_tiles,
                    k_tiles=k_tiles, n_tiles=n_tiles, block_r=br, align=align,
                    k_fastest=cfg.k_fastest)

  def fetch(lhs_ref, dout_ref, t, j, x_dst, dy_dst, barrier):
    r0 = t.rows(j)[1]
    x_src = (lhs_ref.at[pl.ds(r0, br), pl.ds(t.ki * tk, tk)] if tik else
             lhs_ref.at[pl.ds(t.ki * tk, tk), pl.ds(r0, br)])
    plgpu.copy_gmem_to_smem(x_src, x_dst, barrier)
    plgpu.copy_gmem_to_smem(dout_ref.at[pl.ds(r0, br), pl.ds(t.ni * bn, bn)], dy_dst, barrier)

  x_block = (br, tk) if tik else (tk, br)
  tf = lambda minor, isz=itemsize: _compat.smem_transforms(minor, isz)
  scratch = [
      plgpu.SMEM((st, *x_block), dtype, transforms=tf(x_block[1])),
      plgpu.SMEM((st, br, bn), dtype, transforms=tf(bn)),
      _out_ring(cfg, nwg, bn, out_dtype, tf),
      plgpu.SMEM((2, _pad_groups(e)), jnp.int32),
      plgpu.Barrier(num_arrivals=2, num_barriers=st),  # a slot's two TMA loads landed
      plgpu.Barrier(num_arrivals=1, num_barriers=1),  # the bounds landed
  ]
  return walk, fetch, scratch


def _out_ring(cfg: TgmmConfig, nwg: int, bn: int, out_dtype, tf):
  """SMEM of the output buffers: [nwg,] out_buffers x (block_k, bn / store_parts), a ring per
  compute warpgroup."""
  w = bn // cfg.store_parts
  shape = (cfg.out_buffers, cfg.block_k, w)
  return plgpu.SMEM((nwg, *shape) if nwg > 1 else shape, out_dtype,
                    transforms=tf(w, jnp.dtype(out_dtype).itemsize))


def _store_tile(acc, ring, i, out_ref, g, row0, col0, out_dtype, parts=1):
  """acc [rows, parts * w] -> out_ref[g, row0:, col0:] in `parts` column chunks, each through
  the next buffer of `ring` [out_buffers, rows, w] (TMA stores, left in flight). i: the
  calling thread's tile count, so its q-th chunk store (q = i * parts + p) takes buffer
  q % out_buffers."""
  nb, rows, w = ring.shape
  for p in range(parts):
    # The last store to read this buffer was issued nb stores ago; the nb - 1 since may still
    # be reading theirs. (GPU interpret mode's stores read SMEM at once, so its race
    # detector cannot check this.)
    plgpu.wait_smem_to_gmem(nb - 1, wait_read_only=True)
    buf = ring.at[0] if nb == 1 else ring.at[lax.rem(i * parts + p, jnp.int32(nb))]
    buf[...] = (acc if parts == 1 else acc[:, p * w:(p + 1) * w]).astype(out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf, out_ref.at[g, pl.ds(row0, rows), pl.ds(col0 + p * w, w)])


def _build_tgmm_cross_tile(*, m, k, n, e, dtype, out_dtype, cfg: TgmmConfig, num_ctas,
                           interpret):
  """The cross-tile pipeline: operands (bounds [2, E padded] = starts / ends, lhs, dout).

  Step s waits for its slot, masks, issues its wgmma, waits for step s - 1's (one stays in
  flight), then loads step s + stages - 1 into the slot step s - 1 read; the tile's last step
  stores it.
  """
  if cfg.warp_specialized:
    return _build_tgmm_ws_cross_tile(m=m, k=k, n=n, e=e, dtype=dtype, out_dtype=out_dtype,
                                      cfg=cfg, num_ctas=num_ctas, interpret=interpret)
  bk, bn, br, st = cfg.block_k, cfg.block_n, cfg.block_r, cfg.num_stages
  tik = cfg.transpose_in_kernel
  _cast = _compat.layout_cast(interpret)
  # GPU interpret mode cannot store into a wgmma accumulator (as in grouped_gemm's cross-item
  # pipeline): there a tile's starting value is kept in SMEM and subtracted.
  emulate_reset = interpret is not None
  walk, fetch_block, scratch = _cross_tile_common(
      k=k, n=n, e=e, dtype=dtype, out_dtype=out_dtype, cfg=cfg, num_ctas=num_ctas,
      interpret=interpret)

  def body(bounds_ref, lhs_ref, dout_ref, out_ref, x_buf, dy_buf, o_smem, bounds_smem, bars,
           bounds_bar, *bases):
    plgpu.copy_gmem_to_smem(bounds_ref, bounds_smem, bounds_bar.at[0])
    plgpu.barrier_wait(bounds_bar.at[0])
    w = walk(lax.axis_index("sm"), bounds_smem)
    total = w.total()

    def fetch(s, t, j):
      """Loads block j of tile t as step s (if the CTA has a step s)."""
      @pl.when(s < total)
      def _fetch():
        slot = lax.rem(s, st)
        fetch_block(lhs_ref, dout_ref, t, j, x_buf.at[slot], dy_buf.at[slot], bars.at[slot])

    def prologue(s, ij):
      i, j = ij
      t, steps = w.tile(i)
      fetch(s, t, j)
      return w.advance(i, j, steps)

    fetch_at = lax.fori_loop(0, st - 1, prologue, (jnp.int32(0), jnp.int32(0)))

    def scope(acc_ref):
      def step(s, carry):
        i, j, fi, fj = carry
        slot = lax.rem(s, st)
        plgpu.barrier_wait(bars.at[slot])
        t, steps = w.tile(i)

        @pl.when(j == 0)
        def _reset():
          if emulate_reset:
            bases[0][...] = acc_ref[...]
          else:
            acc_ref[...] = jnp.zeros((bk, bn), jnp.float32)

        lo, r0 = t.rows(j)
        x_smem = x_buf.at[slot]
        _mask_lhs(x_smem, r0, lo, t.end, br=br, tik=tik, cast=_cast)
        plgpu.wgmma(acc_ref, plgpu.transpose_ref(x_smem, (1, 0)) if tik else x_smem,
                    dy_buf.at[slot])
        plgpu.wgmma_wait(1)  # step s - 1's wgmma is done: its slot takes step s + st - 1
        ft, fsteps = w.tile(fi)
        fetch(s + st - 1, ft, fj)

        @pl.when(j == steps - 1)
        def _store():
          plgpu.wgmma_wait(0)
          acc = acc_ref[...]
          if emulate_reset:
            acc = acc - bases[0][...]
          _store_tile(acc, o_smem, i, out_ref, t.g, t.ki * bk, t.ni * bn, out_dtype,
                      cfg.store_parts)

        return (*w.advance(i, j, steps), *w.advance(fi, fj, fsteps))

      lax.fori_loop(0, total, step, (jnp.int32(0), jnp.int32(0), *fetch_at))
      plgpu.wgmma_wait(0)

    pl.run_scoped(scope, plgpu.ACC((bk, bn), jnp.float32))
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  if emulate_reset:
    scratch.append(plgpu.SMEM((bk, bn), jnp.float32))
  return _launch(body, (e, k, n), out_dtype, scratch, num_ctas, interpret,
                 "jmoe_tgmm_xt" + ("_2cta" if cfg.ctas_per_sm == 2 else ""))


_PRODUCER_REGISTERS = 40  # the TMA warpgroup's registers per thread (the rest go to compute)


def _build_tgmm_ws_cross_tile(*, m, k, n, e, dtype, out_dtype, cfg: TgmmConfig, num_ctas,
                              interpret):
  """The cross-tile pipeline, warp specialized: operands as _build_tgmm_cross_tile's.

  Warpgroup 2 walks all of the CTA's steps and loads each into the ring as soon as both
  compute warpgroups released the slot's previous step, so the next tile's first blocks land
  while this tile finishes and stores (Pallas' warp-specialized pipeline waits for every slot
  at the end of each tile). Warpgroups 0 and 1 each compute block_k rows of a (2 block_k) x
  block_n tile from the shared dout block, one wgmma in flight; a step's slot is released
  once the next step's wgmma is issued and the step's own has completed.
  """
  bk, bn, br, st = cfg.block_k, cfg.block_n, cfg.block_r, cfg.num_stages
  tk = cfg.tile_k
  tik = cfg.transpose_in_kernel
  _cast = _compat.layout_cast(interpret)
  walk, fetch_block, scratch = _cross_tile_common(
      k=k, n=n, e=e, dtype=dtype, out_dtype=out_dtype, cfg=cfg, num_ctas=num_ctas,
      interpret=interpret)
  compute_registers = min(232, (512 - _PRODUCER_REGISTERS) // 2 // 8 * 8)

  def body(bounds_ref, lhs_ref, dout_ref, out_ref, x_buf, dy_buf, o_smem, bounds_smem, full,
           bounds_bar, free):
    wg = lax.axis_index("wg")

    @pl.when(wg == 2)
    def _issue_bounds():
      plgpu.copy_gmem_to_smem(bounds_ref, bounds_smem, bounds_bar.at[0])

    plgpu.barrier_wait(bounds_bar.at[0])
    w = walk(lax.axis_index("sm"), bounds_smem)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

      def one_tile(i, s):  # the same tile / block loops as the compute warpgroups', s counted
        t, steps = w.tile(i)

        def block(j, s):
          slot = lax.rem(s, st)

          @pl.when(s >= st)
          def _wait_free():  # both compute warpgroups are done with step s - st
            plgpu.barrier_wait(free.at[slot])

          fetch_block(lhs_ref, dout_ref, t, j, x_buf.at[slot], dy_buf.at[slot], full.at[slot])
          return s + 1

        return lax.fori_loop(0, steps, block, s)

      total = lax.fori_loop(0, w.my_tiles, one_tile, jnp.int32(0))

      # the last releases (kept in phase: every release is awaited once)
      @pl.loop(jnp.maximum(total - st, 0), total)
      def _quiesce(s):
        plgpu.barrier_wait(free.at[lax.rem(s, st)])

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(compute_registers, action="increase")

      def one_tile(i, s):
        t, steps = w.tile(i)

        def scope(acc_ref):
          def block(j, s):
            slot = lax.rem(s, st)
            plgpu.barrier_wait(full.at[slot])
            lo, r0 = t.rows(j)
            x_smem = x_buf.at[slot]
            x_smem = (x_smem.at[:, pl.ds(wg * bk, bk)] if tik else
                      x_smem.at[pl.ds(wg * bk, bk), :])
            _mask_lhs(x_smem, r0, lo, t.end, br=br, tik=tik, cast=_cast)
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(x_smem, (1, 0)) if tik else x_smem,
                        dy_buf.at[slot])
            plgpu.wgmma_wait(1)  # step s - 1's wgmma is done: release its slot

            @pl.when(s > 0)
            def _release():
              plgpu.barrier_arrive(free.at[lax.rem(s - 1, st)])

            return s + 1

          s_next = lax.fori_loop(0, steps, block, s)
          plgpu.wgmma_wait(0)
          return acc_ref[...], s_next

        acc, s = pl.run_scoped(scope, plgpu.ACC((bk, bn), jnp.float32))
        _store_tile(acc, o_smem.at[wg], i, out_ref, t.g, t.ki * tk + wg * bk, t.ni * bn,
                    out_dtype, cfg.store_parts)
        return s

      s = lax.fori_loop(0, w.my_tiles, one_tile, jnp.int32(0))

      @pl.when(s > 0)
      def _release_last():
        plgpu.barrier_arrive(free.at[lax.rem(s - 1, st)])

      plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch.append(plgpu.Barrier(num_arrivals=2, num_barriers=st))  # both compute WGs released
  return _launch(body, (e, k, n), out_dtype, scratch, num_ctas, interpret, "jmoe_tgmm_ws_xt",
                 num_threads=3, thread_name="wg")


@functools.partial(jax.jit, static_argnames=("num_groups", "out_dtype", "config", "interpret"))
def tgmm(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, num_groups: int | None = None,
         out_dtype=None, config: TgmmConfig | None = None, interpret: Any = False) -> jax.Array:
  """out[g] = lhs[rows_g]^T @ dout[rows_g] -> [E, K, N] (f32 accumulation; zeros for empty g).

  lhs [M, K], dout [M, N] bf16/f16 (same dtype), rows sorted by group; K and N multiples of 64.
  lhs rows outside every group may hold anything; dout rows there must be finite (they meet
  zeroed lhs rows).
  """
  if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0]:
    raise ValueError(f"lhs must be [M, K] and dout [M, N]; got {lhs.shape}, {dout.shape}")
  gg._check_dtype("lhs", lhs)
  gg._check_dtype("dout", dout)
  if lhs.dtype != dout.dtype:
    raise ValueError(f"lhs dtype {lhs.dtype} != dout dtype {dout.dtype}")
  m, k = lhs.shape
  n = dout.shape[1]
  e = group_sizes.shape[0] if num_groups is None else num_groups
  if group_sizes.shape != (e,):
    raise ValueError(f"group_sizes must have shape ({e},), got {group_sizes.shape}")
  if k % 64 or n % 64:
    raise ValueError(f"K={k} and N={n} must be multiples of 64")
  cfg = config or get_tgmm_config(m, k, n, e, lhs.dtype)
  if k % cfg.tile_k:  # K = 64 * odd: 64-row warpgroup tiles, one warpgroup if need be
    cfg = dataclasses.replace(cfg, block_k=64)
    if k % cfg.tile_k:
      cfg = dataclasses.replace(cfg, warp_specialized=False)
  bn = cfg.block_n
  while n % bn:
    bn //= 2
  bn = max(bn, 64)
  parts = min(cfg.store_parts, bn // 64)  # chunks of >= 64 columns (one swizzled TMA box)
  tik = (not interpret) if cfg.transpose_in_kernel is None else cfg.transpose_in_kernel
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  stages = cfg.num_stages  # fitted to shared memory
  while stages > 2 and _smem_bytes(cfg.tile_k, bn, cfg.block_r, stages, lhs.dtype.itemsize,
                                   out_dtype.itemsize, e if cfg.cross_tile else 0,
                                   cfg.out_buffers, parts) > _smem_limit(cfg.ctas_per_sm):
    stages -= 1
  cfg = dataclasses.replace(cfg, block_n=bn, num_stages=stages, transpose_in_kernel=tik,
                            store_parts=parts)
  # Pad rows: a TMA box must fit in the array (tiny M); the interpreter reads past-the-end
  # rows as NaN where the GPU's TMA fills zeros (row blocks may reach past M).
  pad = cfg.block_r if interpret else max(cfg.block_r - m, 0)
  if pad:
    lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
    dout = jnp.pad(dout, ((0, pad), (0, 0)))
  gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(gs), m).astype(jnp.int32)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  interp, nsm = _compat.launch_params(interpret)
  num_ctas = nsm * (1 if interpret else cfg.ctas_per_sm)
  kern = _build_tgmm(m=lhs.shape[0], k=k, n=n, e=e, dtype=lhs.dtype, out_dtype=out_dtype,
                     cfg=cfg, num_ctas=num_ctas, interpret=interp)
  operands = (lhs if cfg.transpose_in_kernel else lhs.T, dout)
  if cfg.cross_tile:
    bounds = jnp.pad(jnp.stack([starts, ends]), ((0, 0), (0, _pad_groups(e) - e)))
    return kern(bounds, *operands)
  return kern(starts, ends, *operands)


def tgmm_reference(lhs, dout, group_sizes):
  e = group_sizes.shape[0]
  m = lhs.shape[0]
  ends = jnp.cumsum(group_sizes)
  gid = jnp.searchsorted(ends, jnp.arange(m), side="right")
  onehot = (gid[:, None] == jnp.arange(e)[None, :]).astype(jnp.float32)
  return jnp.einsum("me,mk,mn->ekn", onehot, lhs.astype(jnp.float32), dout.astype(jnp.float32),
                    precision=lax.Precision.HIGHEST)


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, config=None, interpret=False,
        mask_tail: bool = True):
  """grouped_gemm(lhs, rhs, group_sizes) (no epilogue) with a Pallas backward.

  Rows of the result past sum(group_sizes) are zero here (so that gradients through them are
  well defined): the forward masks them after the kernel, the backward masks dout and d lhs.
  mask_tail=False skips those three passes over [M, N]-sized arrays; only for callers whose
  group sizes sum to M (every row computed: fused_experts_train gives the tail rows to the last
  group, where their zero cotangents contribute nothing).
  """
  return _gmm_fwd_value(lhs, rhs, group_sizes, config, interpret, mask_tail)


def _row_mask(group_sizes, m):
  total = jnp.sum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
  return (jnp.arange(m) < total)[:, None]


def _mask(x, group_sizes, mask_tail):
  if not mask_tail:
    return x
  return jnp.where(_row_mask(group_sizes, x.shape[0]), x, jnp.zeros((), x.dtype))


def _gmm_fwd_value(lhs, rhs, group_sizes, config, interpret, mask_tail):
  out = gg.grouped_gemm(lhs, rhs, group_sizes, config=config, interpret=interpret)
  return _mask(out, group_sizes, mask_tail)


def _gmm_fwd(lhs, rhs, group_sizes, config, interpret, mask_tail):
  out = _gmm_fwd_value(lhs, rhs, group_sizes, config, interpret, mask_tail)
  return out, (lhs, rhs, group_sizes)


def _gmm_bwd(config, interpret, mask_tail, res, dout):
  lhs, rhs, group_sizes = res
  dout = _mask(dout.astype(lhs.dtype), group_sizes, mask_tail)
  # d lhs = dout @ rhs^T: the kernel reads rhs [E, K, N] as transposed tiles (no weight copy)
  dlhs = gg.grouped_gemm(dout, rhs, group_sizes, interpret=interpret, transpose_rhs=True)
  dlhs = _mask(dlhs, group_sizes, mask_tail)
  drhs = tgmm(lhs, dout, group_sizes, out_dtype=rhs.dtype, interpret=interpret)
  return dlhs.astype(lhs.dtype), drhs, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)
