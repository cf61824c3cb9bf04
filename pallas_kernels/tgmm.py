"""Transposed grouped GEMM (the weight gradient) and a differentiable grouped GEMM.

    tgmm(lhs [M, K], dout [M, N], group_sizes [E]) -> [E, K, N],  out[g] = lhs[rows_g]^T @ dout[rows_g]

(rows sorted by group, as in grouped_gemm; experts with no rows get zeros; rows past
sum(group_sizes) are ignored). Mosaic GPU: a persistent grid over (expert, K tile, N tile); the
contraction runs over the expert's own row blocks only (pipelined TMA, wgmma with a transposed
lhs tile); the first/last row block of an expert has its foreign rows zeroed in SMEM.

``gmm(lhs, rhs, group_sizes)`` is grouped_gemm with a ``jax.custom_vjp``: d lhs = gmm(dout, rhs^T)
(the forward kernel on transposed weights) and d rhs = tgmm(lhs, dout), so ``jax.grad`` runs on
the Pallas kernels. (The fused epilogues of grouped_gemm / grouped_gemm_gated are forward-only;
``pallas_kernels.moe.fused_experts_train`` composes gmm with jnp epilogues for training.)
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

from pallas_kernels import _compat
from pallas_kernels import grouped_gemm as gg


@dataclasses.dataclass(frozen=True)
class TgmmConfig:
  """block_k: output rows (K) per tile (64/128); block_n: output cols per tile (multiple of 64);
  block_r: contraction rows per pipeline step (64); num_stages: pipeline depth."""
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
  # True: a CTA's output tiles run as one pipeline over their (tile, row block) steps (a step
  # list built on device), so the next tile's first blocks load while the current one finishes
  # and no pipeline fills per tile (at qwen3 / 1024 tokens a tile has 1-3 row blocks). Correct
  # (bit-identical to per-tile) but slower on an H200 (2026-11-29, 1024 tokens, µs, same
  # config: qwen3 dW13 348.7 -> 448.9, dW2 183.7 -> 259.0; mixtral dW13 1425.8 -> 1918.7, dW2
  # 656.9 -> 903.4; benchmarks/check_cross_tile.py), so no table uses it. Each step's index
  # maps chain four dependent global-memory loads (step -> tile -> expert -> row range), which
  # the per-tile kernel does once per tile; staging the step list in shared memory is the next
  # thing to try.
  cross_tile: bool = False

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

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


_SMEM_LIMIT = 227 * 1024  # Hopper: shared memory one block may use
_SMEM_PER_SM = 228 * 1024  # Hopper: shared memory of one SM (1 KiB of it reserved per block)


def _smem_limit(ctas_per_sm: int) -> int:
  return min(_SMEM_LIMIT, _SMEM_PER_SM // ctas_per_sm - 1024)


def _smem_bytes(bk, bn, br, stages, itemsize, out_itemsize):
  return stages * (br * bk + br * bn) * itemsize + bk * bn * out_itemsize


# The default when no tuned entry matches (benchmarks may swap it for a sweep's best): the H200
# sweep's winner on all three training shapes (2026-11-29, jax 0.11.2, device µs, 1 CTA / SM
# 4 stages -> 2 CTAs / SM 2 stages): mixtral dW13 1708 -> 1406, dW2 778 -> 654, qwen3 dW13
# 511 -> 351.
DEFAULT_CONFIG = TgmmConfig(block_k=128, block_n=128, block_r=64, num_stages=2, ctas_per_sm=2)


def get_tgmm_config(m: int, k: int, n: int, num_groups: int, dtype) -> TgmmConfig:
  """Tuned config from pallas_kernels/configs/tgmm.json (keyed like the grouped GEMMs': E, N,
  K, dtype, device kind, jax minor version, M bucket; `python -m jmoe tune` writes it), else
  DEFAULT_CONFIG."""
  return gg.tuned_config("tgmm", TgmmConfig, m, n, k, num_groups, dtype) or DEFAULT_CONFIG


def _build_tgmm(*, m, k, n, e, dtype, out_dtype, cfg: TgmmConfig, num_ctas, interpret):
  if cfg.cross_tile:
    return _build_tgmm_cross_tile(m=m, k=k, n=n, e=e, dtype=dtype, out_dtype=out_dtype, cfg=cfg,
                                  num_ctas=num_ctas, interpret=interpret)
  bk, bn, br = cfg.block_k, cfg.block_n, cfg.block_r
  k_tiles, n_tiles = k // bk, n // bn
  itemsize = jnp.dtype(dtype).itemsize

  def tf(minor, isz=itemsize):
    return _compat.smem_transforms(minor, isz)

  _cast = _compat.layout_cast(interpret)

  tik = cfg.transpose_in_kernel

  def body(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, o_smem):
    @plgpu.nd_loop((e * k_tiles * n_tiles,), collective_axes="sm")
    def _loop(info):
      (lin,) = info.index
      g = lax.div(lin, jnp.int32(k_tiles * n_tiles))
      rem = lax.rem(lin, jnp.int32(k_tiles * n_tiles))
      ki = lax.div(rem, jnp.int32(n_tiles))
      ni = lax.rem(rem, jnp.int32(n_tiles))
      start = starts_ref[g]
      end = ends_ref[g]
      first_blk = lax.div(start, jnp.int32(br))
      nblk = jnp.where(end > start, lax.div(end - 1, jnp.int32(br)) - first_blk + 1, 0)

      def acc_scope(acc_ref):
        def step(idx, x_smem, dy_smem):
          (j,) = idx
          r0 = (first_blk + j) * br

          _block_masks(x_smem, dy_smem, r0, start, end, m, br, bk, bn, tik, _cast)
          a = plgpu.transpose_ref(x_smem, (1, 0)) if tik else x_smem
          plgpu.wgmma(acc_ref, a, dy_smem)
          # one wgmma stays in flight; delay_release keeps its SMEM slots until the next step
          plgpu.wgmma_wait(1)

        plgpu.emit_pipeline(
            step, grid=(nblk,),
            in_specs=[
                (plgpu.BlockSpec((br, bk), lambda j: (first_blk + j, ki), transforms=tf(bk),
                                 delay_release=1)
                 if tik else
                 plgpu.BlockSpec((bk, br), lambda j: (ki, first_blk + j), transforms=tf(br),
                                 delay_release=1)),
                plgpu.BlockSpec((br, bn), lambda j: (first_blk + j, ni), transforms=tf(bn),
                                delay_release=1),
            ],
            max_concurrent_steps=cfg.num_stages,
        )(lhs_ref, dout_ref)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bk, bn), jnp.float32))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      o_smem[...] = acc.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, out_ref.at[g, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)])

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  return _compat.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((e, k, n), out_dtype),
      scratch_types=[plgpu.SMEM((bk, bn), out_dtype,
                                transforms=tf(bn, jnp.dtype(out_dtype).itemsize))],
      grid=(num_ctas,),
      grid_names=("sm",),
      compiler_params=_compat.compiler_params(),
      interpret=interpret,
      name="jmoe_tgmm" + ("_2cta" if cfg.ctas_per_sm == 2 else ""),
  )


def _block_masks(x_smem, dy_smem, r0, start, end, m, br, bk, bn, tik, cast):
  """Zero the lhs rows of a row block that belong to a neighbouring expert (first/last block:
  their products vanish whatever dy holds there) and, for the array's last block reaching past
  M, the dy rows there (TMA fills them with zeros on the GPU, the interpreter with NaN)."""
  @pl.when((r0 < start) | (r0 + br > end))
  def _mask():
    xshape, xdim = ((br, bk), 0) if tik else ((bk, br), 1)
    rows_x = cast(lax.broadcasted_iota(jnp.int32, xshape, xdim), plgpu.Layout.WGMMA)
    ok_x = (rows_x + r0 >= start) & (rows_x + r0 < end)
    x_smem[...] = jnp.where(ok_x, x_smem[...], jnp.zeros_like(x_smem[...]))
    plgpu.commit_smem()

  @pl.when(r0 + br > m)
  def _mask_tail():
    rows_y = cast(lax.broadcasted_iota(jnp.int32, (br, bn), 0), plgpu.Layout.WGMMA)
    dy_smem[...] = jnp.where(rows_y + r0 < m, dy_smem[...], jnp.zeros_like(dy_smem[...]))
    plgpu.commit_smem()


def _build_tgmm_cross_tile(*, m, k, n, e, dtype, out_dtype, cfg: TgmmConfig, num_ctas,
                           interpret):
  """tgmm with one pipeline per CTA over its steps (see step_list): operands
  (starts, ends, cta_first_step, cta_num_steps, step_item, step_block, lhs, dout)."""
  bk, bn, br = cfg.block_k, cfg.block_n, cfg.block_r
  k_tiles, n_tiles = k // bk, n // bn
  last_blk = pl.cdiv(m, br) - 1
  tik = cfg.transpose_in_kernel
  _cast = _compat.layout_cast(interpret)
  # GPU interpret mode cannot store into a wgmma accumulator (as in grouped_gemm's cross-item
  # pipeline): there a tile's starting value is kept in SMEM and subtracted.
  emulate_reset = interpret is not None

  def tf(minor, isz=jnp.dtype(dtype).itemsize):
    return _compat.smem_transforms(minor, isz)

  def body(starts_ref, ends_ref, first_ref, count_ref, item_ref, blk_ref, lhs_ref, dout_ref,
           out_ref, o_smem, *bases):
    cta = lax.axis_index("sm")
    s0 = first_ref[cta]
    num_steps = count_ref[cta]

    def info(s):
      lin = item_ref[s0 + s]
      g = lax.div(lin, jnp.int32(k_tiles * n_tiles))
      rem = lax.rem(lin, jnp.int32(k_tiles * n_tiles))
      start, end = starts_ref[g], ends_ref[g]
      nblk = jnp.where(end > start, lax.div(end - 1, jnp.int32(br)) - lax.div(start, jnp.int32(br))
                       + 1, 0)
      # an expert without rows still has one (fully masked) step: its tile is written as zeros
      blk = jnp.minimum(lax.div(start, jnp.int32(br)) + blk_ref[s0 + s], last_blk)
      return (g, lax.div(rem, jnp.int32(n_tiles)), lax.rem(rem, jnp.int32(n_tiles)), start, end,
              blk, blk_ref[s0 + s], jnp.maximum(nblk, 1))

    def x_index(s):
      _, ki, _, _, _, blk, _, _ = info(s)
      return (blk, ki) if tik else (ki, blk)

    def dy_index(s):
      _, _, ni, _, _, blk, _, _ = info(s)
      return blk, ni

    def acc_scope(acc_ref):
      def step(idx, x_smem, dy_smem):
        (s,) = idx
        g, ki, ni, start, end, blk, j, steps = info(s)

        @pl.when(j == 0)
        def _reset():
          if emulate_reset:
            bases[0][...] = acc_ref[...]
          else:
            acc_ref[...] = jnp.zeros((bk, bn), jnp.float32)

        _block_masks(x_smem, dy_smem, blk * br, start, end, m, br, bk, bn, tik, _cast)
        a = plgpu.transpose_ref(x_smem, (1, 0)) if tik else x_smem
        plgpu.wgmma(acc_ref, a, dy_smem)
        plgpu.wgmma_wait(1)

        @pl.when(j == steps - 1)
        def _store():
          plgpu.wgmma_wait(0)
          acc = acc_ref[...]
          if emulate_reset:
            acc = acc - bases[0][...]
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store read it
          o_smem[...] = acc.astype(out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem, out_ref.at[g, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)])

      plgpu.emit_pipeline(
          step, grid=(num_steps,),
          in_specs=[
              plgpu.BlockSpec((br, bk) if tik else (bk, br), x_index,
                              transforms=tf(bk if tik else br), delay_release=1),
              plgpu.BlockSpec((br, bn), dy_index, transforms=tf(bn), delay_release=1),
          ],
          max_concurrent_steps=cfg.num_stages,
      )(lhs_ref, dout_ref)
      plgpu.wgmma_wait(0)

    @pl.when(num_steps > 0)
    def _run():
      pl.run_scoped(acc_scope, plgpu.ACC((bk, bn), jnp.float32))

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [plgpu.SMEM((bk, bn), out_dtype, transforms=tf(bn, jnp.dtype(out_dtype).itemsize))]
  if emulate_reset:
    scratch.append(plgpu.SMEM((bk, bn), jnp.float32))
  return _compat.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((e, k, n), out_dtype),
      scratch_types=scratch,
      grid=(num_ctas,),
      grid_names=("sm",),
      compiler_params=_compat.compiler_params(),
      interpret=interpret,
      name="jmoe_tgmm_xt" + ("_2cta" if cfg.ctas_per_sm == 2 else ""),
  )


def step_list(starts, ends, *, m: int, k_tiles: int, n_tiles: int, block_r: int,
              num_ctas: int):
  """The cross-tile tgmm's work split, built on device (no host sync).

  Output tiles (items) lin = (g * k_tiles + ki) * n_tiles + ni go round-robin to the CTAs (CTA c
  takes lin = c, c + num_ctas, ...); item lin has max(1, row blocks of expert g) steps. Returns
  (cta_first_step [C], cta_num_steps [C], step_item [S], step_block [S]) with the steps of CTA c
  at [cta_first_step[c], + cta_num_steps[c]) of the step arrays, in item order, step_block the
  row block index within the expert. S = k_tiles * n_tiles * (cdiv(m, block_r) + E), a static
  bound (an expert's rows span at most one block more than their count).
  """
  e = starts.shape[0]
  nblk = jnp.where(ends > starts, (ends - 1) // block_r - starts // block_r + 1, 0)
  steps_g = jnp.maximum(nblk, 1).astype(jnp.int32)
  num_items = e * k_tiles * n_tiles
  per_cta = -(-num_items // num_ctas)
  slot = jnp.arange(num_ctas * per_cta, dtype=jnp.int32)     # CTA-major: c * per_cta + i
  lin = (slot % per_cta) * num_ctas + slot // per_cta
  valid = lin < num_items
  steps = jnp.where(valid, steps_g[jnp.minimum(lin, num_items - 1) // (k_tiles * n_tiles)], 0)
  ends_incl = jnp.cumsum(steps)
  first = ends_incl - steps
  cta_first = first.reshape(num_ctas, per_cta)[:, 0]
  cta_steps = jnp.sum(steps.reshape(num_ctas, per_cta), axis=1, dtype=jnp.int32)
  s_max = k_tiles * n_tiles * (-(-m // block_r) + e)
  s = jnp.arange(s_max, dtype=jnp.int32)
  owner = jnp.minimum(jnp.searchsorted(ends_incl, s, side="right"), num_ctas * per_cta - 1)
  return (cta_first.astype(jnp.int32), cta_steps, lin[owner].astype(jnp.int32),
          (s - first[owner]).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("num_groups", "out_dtype", "config", "interpret"))
def tgmm(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, num_groups: int | None = None,
         out_dtype=None, config: TgmmConfig | None = None, interpret: Any = False) -> jax.Array:
  """out[g] = lhs[rows_g]^T @ dout[rows_g] -> [E, K, N] (f32 accumulation; zeros for empty g).

  lhs [M, K], dout [M, N] bf16/f16 (same dtype), rows sorted by group; K and N multiples of 64.
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
  bk = cfg.block_k if k % cfg.block_k == 0 else 64
  bn = cfg.block_n
  while n % bn:
    bn //= 2
  bn = max(bn, 64)
  tik = (not interpret) if cfg.transpose_in_kernel is None else cfg.transpose_in_kernel
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  stages = cfg.num_stages  # fitted to shared memory
  while stages > 2 and _smem_bytes(bk, bn, cfg.block_r, stages, lhs.dtype.itemsize,
                                   out_dtype.itemsize) > _smem_limit(cfg.ctas_per_sm):
    stages -= 1
  cfg = dataclasses.replace(cfg, block_k=bk, block_n=bn, num_stages=stages,
                            transpose_in_kernel=tik)
  if m < cfg.block_r:  # tiny M: pad rows so that one row block fits in the arrays
    lhs = jnp.pad(lhs, ((0, cfg.block_r - m), (0, 0)))
    dout = jnp.pad(dout, ((0, cfg.block_r - m), (0, 0)))
  gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(gs), m).astype(jnp.int32)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  interp, nsm = _compat.launch_params(interpret)
  num_ctas = nsm * (1 if interpret else cfg.ctas_per_sm)
  mp = lhs.shape[0]
  kern = _build_tgmm(m=mp, k=k, n=n, e=e, dtype=lhs.dtype, out_dtype=out_dtype, cfg=cfg,
                     num_ctas=num_ctas, interpret=interp)
  operands = (lhs if cfg.transpose_in_kernel else lhs.T, dout)
  if cfg.cross_tile:
    steps = step_list(starts, ends, m=mp, k_tiles=k // bk, n_tiles=n // bn, block_r=cfg.block_r,
                      num_ctas=num_ctas)
    return kern(starts, ends, *steps, *operands)
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
