"""The fp8-token grouped GEMM over mxfp4 codes for prefill (mxfp4_fp8): e2m1 codes converted
to e4m3 in the kernel, 8-bit wgmma (twice bf16's rate), no dequantized copy of the experts.

    out[r] = act(acc[r] * a_scale[r] * w_scale[e, :] + bias[e]) * row_scale[r]
    acc[r] = sum_k x_q[r, k] * c[e, :, k]      (e: row r's expert; f32 accumulation)

x_q: prepare's fp8 token rows (one scale a_scale per row), sorted by expert as in
grouped_gemm; c: the codes' values with their e8m0 group scales folded in exactly
(`jmoe.kernels.e2m1.e4m3_shifted_tile`): per weight row (output column n) ref = its largest
scale exponent, a group of exponent e converts to value * 2^(e - ref + 6), and w_scale[e, n] =
2^(ref - 127 - 6) multiplies the accumulator column. Every e2m1 value times a power of two
within the row's 12 exponents is an e4m3 number, so only groups 2^12 below their row's
largest lose bits (their +-0.5 codes flush at 2^-12, the whole group below): the GEMM is the
mxfp4 x fp8 product, without the per-K-step promotion (second accumulator) DeepGEMM's
block scales need.

Warp specialized: a memory warpgroup brings each 128-deep K step's token tile, code tiles
and per-(row, group) shift bytes by TMA; each of two compute warpgroups owns half of the
tile's weight columns, loads its codes from shared memory into registers and converts them
there (`e4m3_shifted_tile`: one table permute chain per 4 codes, the group's exponent added
to the bytes), and that register tile is the 8-bit wgmma's A operand, the token tile (K-major)
its B: out^T = c @ x_q^T per tile, so the converted weights never touch shared memory (a
first form stored them there as B and re-read them: mixtral GEMM2 455 TFLOP/s against this
form's 770-800 on the H200). The accumulator [weight columns, tokens] goes out transposed
(a register transpose, then untiled stores into the output tile). The other warpgroup's MMA
runs while one converts. Each weight element is converted once per token tile, so experts
with the rows take 256-token tiles (GEMM1 then splits gate and up over the two warpgroups,
the up half crossing through shared memory for the activation: `W4A8Config.split_gate_up`).

GEMM1 (gated, every activation, biases) and GEMM2 (router weight as row_scale, or applied by
the caller's gather-sum) are the same kernel. Sizes: K a multiple of 128 and of the group (32),
the output columns a multiple of the tile's (128 gated, 128 or 256 ungated).
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
from jmoe.kernels.activations import Activation
from jmoe.kernels.decode_wq import _codes
from jmoe.kernels.e2m1 import (SHIFT_BIAS, e4m3_shift_bytes, e4m3_shifted_tile,
                               e4m3_shifted_values)
from jmoe.kernels.grouped_gemm_q8 import _check_epilogue, _gate, row_scale_vector

BK = 128  # the K step: one 128-byte swizzle row of fp8 tokens
GROUP = 32  # mxfp4's scale group along K
FP8 = jnp.dtype(jnp.float8_e4m3fn)
_E8M0_BIAS = 127


@dataclasses.dataclass(frozen=True)
class W4A8Config:
  """block_m: token rows per tile (wgmma's N: the tokens are the B operand; 256 halves the
  conversions per FLOP where experts have the rows); block_n: weight columns per tile (gated:
  output columns, each with its gate and up); num_stages: the TMA ring's slots;
  split_gate_up (gated only, block_n 64): one compute warpgroup computes the tile's gate
  columns, the other its up columns, and the up half crosses to the first through shared
  memory for the activation -- so each warpgroup holds one [64, block_m] accumulator, which
  lets block_m be 256. Otherwise each compute warpgroup owns half the tile's columns (gate
  and up) and holds one accumulator per operand. A warpgroup waits for its step's wgmma
  before the next step's conversion overwrites the A registers (leaving it running read
  garbage on the H200: nothing orders the asynchronous register reads), so the other
  warpgroup's MMAs are what run during a conversion."""
  block_m: int = 128
  block_n: int = 128
  num_stages: int = 4
  split_gate_up: bool = False

  def __post_init__(self):
    if self.block_m not in (128, 256):
      raise ValueError(f"block_m={self.block_m} must be 128 or 256")
    if self.split_gate_up and self.block_n != 64:
      raise ValueError(f"split_gate_up takes block_n=64 (one wgmma M), got {self.block_n}")
    if not self.split_gate_up and self.block_n not in (128, 256):
      raise ValueError(f"block_n={self.block_n} must be 128 or 256 (64 with split_gate_up)")
    if self.num_stages < 2:
      raise ValueError(f"num_stages={self.num_stages} must be >= 2")

  @property
  def wg_rows(self) -> int:
    """Weight rows of one operand a compute warpgroup converts per step (its wgmma's M)."""
    return self.block_n if self.split_gate_up else self.block_n // 2


SPLIT_ROWS = 512  # rows per expert from which default_config takes 256-token tiles


def default_config(n_out: int, gated: bool, rows_per_expert: float = 0) -> W4A8Config:
  """Experts with >= SPLIT_ROWS rows on average: 256-token tiles (gated: gate and up split
  over the warpgroups); else 128 columns gated (two [64, 128] accumulators a warpgroup), 256
  ungated where they divide N (one [128, 128]). The deepest ring shared memory holds."""
  if rows_per_expert >= SPLIT_ROWS:
    cfg = (W4A8Config(block_m=256, block_n=64, split_gate_up=True) if gated else
           W4A8Config(block_m=256, block_n=128))
  else:
    cfg = W4A8Config(block_n=256 if not gated and n_out % 256 == 0 else 128)
  return fit_stages(cfg, 2 if gated else 1)


def _stage_bytes(cfg: W4A8Config, n_rhs: int) -> int:
  return cfg.block_m * BK + n_rhs * (cfg.block_n * BK // 2 + (BK // GROUP) * cfg.block_n)


def _vec_len(cfg: W4A8Config) -> int:
  return max(cfg.block_m, cfg.wg_rows)


def _fixed_bytes(cfg: W4A8Config, out_bytes: int) -> int:
  tile = cfg.block_m * cfg.wg_rows * out_bytes
  epi = tile if cfg.split_gate_up else 2 * tile  # the output tiles (split: one warpgroup's)
  swap = tile if cfg.split_gate_up else 0  # the up half crossing warpgroups
  return epi + swap + 2 * 6 * _vec_len(cfg) * 4 + 4096


def acc_registers(cfg: W4A8Config, gated: bool) -> int:
  """f32 accumulator registers a compute thread holds ([wg_rows, block_m] per operand)."""
  n_acc = 2 if gated and not cfg.split_gate_up else 1
  return n_acc * cfg.wg_rows * cfg.block_m // 128


def fit_stages(cfg: W4A8Config, n_rhs: int, out_bytes: int = 2) -> W4A8Config:
  """cfg with the ring lowered until shared memory holds it (at least 2 slots)."""
  budget = gg._SMEM_BYTES - _fixed_bytes(cfg, out_bytes)
  st = max(2, min(cfg.num_stages, budget // _stage_bytes(cfg, n_rhs)))
  return dataclasses.replace(cfg, num_stages=st)


def _mx_shifts(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """mxfp4 scales float8_e8m0fnu [E, N, K/32] -> (each group's shift e - ref + SHIFT_BIAS
  int32 [E, N, K/32], w_scale float32 [E, N] = 2^(ref - 127 - SHIFT_BIAS)), ref each row's
  largest exponent."""
  ex = lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32)
  ref = jnp.max(ex, axis=2)
  w_scale = jnp.exp2((ref - _E8M0_BIAS - SHIFT_BIAS).astype(jnp.float32))
  return ex - ref[:, :, None] + SHIFT_BIAS, w_scale


def mx_shift_bytes(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """mxfp4 scales [E, N, K/32] -> (the kernel's shift bytes uint8 [E, K/32, N], a step's
  bytes one TMA box; w_scale float32 [E, N]): `_mx_shifts`' through `e4m3_shift_bytes`,
  computed on the scale bytes transposed first (the byte transpose, then one elementwise
  pass, rather than int32 shifts transposed)."""
  ex = jnp.swapaxes(lax.bitcast_convert_type(scale, jnp.uint8), 1, 2).astype(jnp.int32)
  ref = jnp.max(ex, axis=1)  # [E, N]
  w_scale = jnp.exp2((ref - _E8M0_BIAS - SHIFT_BIAS).astype(jnp.float32))
  return e4m3_shift_bytes(ex - ref[:, None, :] + SHIFT_BIAS), w_scale


def fp8_codes(values: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The kernel's operands in jnp (the reference): packed e2m1 codes uint8 [E, N, K/2] and
  their e8m0 scales [E, N, K/32] -> (the e4m3 values the kernel multiplies [E, N, K] float32,
  w_scale [E, N]); values * w_scale[..., None] is mxfp4's dequantization up to the flushed
  groups."""
  e, n, half = values.shape
  codes = lax.bitcast_convert_type(values, jnp.int4).reshape(e, n, 2 * half)
  shift, w_scale = _mx_shifts(scale)
  return e4m3_shifted_values(codes, jnp.repeat(shift, GROUP, axis=2)), w_scale


def store_transposed(y: jax.Array, ref) -> None:
  """ref[...] = y.T: y a [R, C] register array in the WGMMA layout (16 or 32 bits), ref a
  plain (untransformed) SMEM [C, R]. The registers change to the transposed layout (lane
  shuffles), then go out as untiled stores through the transposed view (Pallas' own store
  infers no layout for a transposed untiled ref)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def store(_ctx, arr, smem):
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils
    arr.to_layout(mgpu.WGMMA_TRANSPOSED_LAYOUT).store_untiled(
        utils.memref_transpose(smem, (1, 0)), optimized=False)

  store(y, ref)


def _build(*, m_pad, k, n_out, n_total, out_dtype, cfg: W4A8Config, gated: bool,
           act: Activation | None, has_bias: bool, has_scale: bool, num_sms: int, interpret):
  bm, bn = cfg.block_m, cfg.block_n
  split = cfg.split_gate_up
  tn = cfg.wg_rows  # weight rows per compute warpgroup and operand: its wgmma's M
  k_iters = k // BK
  n_tiles = n_out // bn
  n_rhs = 2 if gated else 1
  n_acc = 1 if split else n_rhs  # accumulators per compute warpgroup
  ng = BK // GROUP
  emulate = interpret is not None  # the interpreter: no transposed views, no inline PTX
  _cast = _compat.layout_cast(interpret)
  tf_x = _compat.smem_transforms(BK, 1)
  swz = plgpu.find_swizzle(BK * 4)
  tf_c = (plgpu.TilingTransform((8, swz * 2)), plgpu.SwizzleTransform(swz))
  ladder = gg.row_ladder(bm, m_pad)
  shape = (tn, bm)  # an accumulator: weight columns x token rows
  nbar = 6  # per warpgroup: bias gate / up, row scale, a_scale, w_scale gate / up

  def in_specs():
    return ([plgpu.BlockSpec((bm, BK), lambda kk: (0, kk), transforms=tf_x)]
            + [plgpu.BlockSpec((bn, BK), lambda kk: (0, kk), transforms=tf_c)] * n_rhs
            + [plgpu.BlockSpec((ng, bn), lambda kk: (kk, 0))] * n_rhs)

  def body(meta_ref, ntask_ref, lhs_ref, codes_ref, shift_ref, as_ref, ws_ref, *rest):
    rest = list(rest)
    scale_ref = rest.pop(0) if has_scale else None
    bias_ref = rest.pop(0) if has_bias else None
    out_ref = rest.pop(0)
    epi_smem, vec_smem, bars, pipeline_allocs = rest[:4]
    del rest[:4]
    swap, swap_bars = (rest.pop(0), rest.pop(0)) if split else (None, None)
    t_a, t_b = rest[:2] if emulate else (None, None)
    num_items = ntask_ref[0] * n_tiles

    def bar(wg, j):
      return bars.at[wg * nbar + j]

    def store_tile(y, epi, row, lo, hi, c0):
      """y f32 [tn, bm] (columns c0.. x the tile's rows) -> out, the task's rows only."""
      y = y.astype(out_dtype)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores read SMEM
      if emulate:
        epi[...] = y.T
      else:  # a register transpose (lane shuffles), then a transposed store
        store_transposed(y, epi)
      plgpu.commit_smem()
      gg.store_task_rows(epi, out_ref, tile_row=row, lo=lo, hi=hi, tile_m=bm, ladder=ladder,
                         cols=pl.ds(c0, tn))

    def epilogue(accs, wg, e, row, lo, hi, ni):
      """accs: this warpgroup's f32 [tn, bm] accumulators (weight columns x the tile's token
      rows): split, the gate (warpgroup 0) or up (1) of columns ni * bn; else gate and up of
      columns ni * bn + wg * tn. Stored transposed (tokens x columns) through SMEM."""
      c0 = ni * bn + (0 if split else wg * tn)
      # the weight-column offsets of the accumulators (gate: j * n_out + c0)
      offs = [wg * n_out + c0] if split else [j * n_out + c0 for j in range(n_rhs)]
      vec = vec_smem.at[wg]
      plgpu.copy_gmem_to_smem(as_ref.at[pl.ds(row, bm)], vec.at[3, :bm], bar(wg, 3))
      for j, off in enumerate(offs):
        plgpu.copy_gmem_to_smem(ws_ref.at[e, pl.ds(off, tn)], vec.at[4 + j, :tn], bar(wg, 4 + j))
        if has_bias:
          plgpu.copy_gmem_to_smem(bias_ref.at[e, pl.ds(off, tn)], vec.at[j, :tn], bar(wg, j))
      if has_scale:
        plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(row, bm)], vec.at[2, :bm], bar(wg, 2))

      def per_token(i):
        v = _cast(vec.at[i, :bm][...], plgpu.Layout.WGMMA.reduce(0))
        return lax.broadcast_in_dim(v, shape, [1])

      def per_column(i):
        v = _cast(vec.at[i, :tn][...], plgpu.Layout.WGMMA.reduce(1))
        return lax.broadcast_in_dim(v, shape, [0])

      plgpu.barrier_wait(bar(wg, 3))
      sa = per_token(3)
      vals = []
      for j, a in enumerate(accs):
        plgpu.barrier_wait(bar(wg, 4 + j))
        a = a * sa * per_column(4 + j)
        if has_bias:
          plgpu.barrier_wait(bar(wg, j))
          a = a + per_column(j)
        vals.append(a)

      def finish(vals, epi):
        y = gg.kernel_activation(act, *vals) if act is not None else vals[0]
        if has_scale:
          plgpu.barrier_wait(bar(wg, 2))
          y = y * per_token(2)
        store_tile(y, epi, row, lo, hi, c0)

      if not split:
        finish(vals, epi_smem.at[wg])
        return

      @pl.when(wg == 1)
      def _give_up_half():  # (swap_bars: 0 = the up half is in the buffer, 1 = it was read)
        swap[...] = vals[0].astype(swap.dtype)
        plgpu.barrier_arrive(swap_bars.at[0])
        # the buffer is free once read (waiting here, not before the next item's store, keeps
        # every phase observed: the interpreter checks it)
        plgpu.barrier_wait(swap_bars.at[1])

      @pl.when(wg == 0)
      def _activation():
        plgpu.barrier_wait(swap_bars.at[0])
        up = _cast(swap[...], plgpu.Layout.WGMMA).astype(jnp.float32)
        plgpu.barrier_arrive(swap_bars.at[1])
        finish([vals[0], up], epi_smem.at[0])

    def step(idx, x_smem, *refs):
      """One K step: this warpgroup's code rows -> e4m3 registers (wgmma's A), against the
      token tile (B: [BK, bm], K-major as 8-bit wgmma needs). The first operand's MMA runs
      while the second converts; the other warpgroup's MMAs run while this one converts."""
      del idx
      code_smems, shift_smems, accs = refs[:n_rhs], refs[n_rhs:2 * n_rhs], refs[2 * n_rhs]
      wg = lax.axis_index("wg")
      if emulate:
        t_b.at[wg][...] = x_smem[...].T
        b = t_b.at[wg]
      else:
        b = plgpu.transpose_ref(x_smem, (1, 0))

      def mma(acc, codes, shifts, j):
        a = e4m3_shifted_tile(codes[...], shifts, group=GROUP, interpret=emulate)
        if emulate:
          t_a.at[wg, j][...] = a
          a = t_a.at[wg, j]
        plgpu.wgmma(acc, a, b)

      if split:  # warpgroup j: operand j's rows
        for j in range(n_rhs):
          @pl.when(wg == j)
          def _operand():
            mma(accs[0], code_smems[j], shift_smems[j], 0)
      else:  # operand j's rows of this warpgroup's half
        cols = pl.ds(wg * tn, tn)
        for j, acc in enumerate(accs):
          mma(acc, code_smems[j].at[cols], shift_smems[j].at[:, cols], j)
      plgpu.wgmma_wait(0)  # the A registers and the ring slot are read
      return accs

    def compute_item(e, row, lo, hi, ni):
      c = ni * bn
      gmem = (lhs_ref.at[pl.ds(row, bm), :],
              *[codes_ref.at[e, pl.ds(j * n_out + c, bn), :] for j in range(n_rhs)],
              *[shift_ref.at[e, :, pl.ds(j * n_out + c, bn)] for j in range(n_rhs)])

      def compute_context(eval_pipeline):
        def scope(*acc_refs):
          wg = lax.axis_index("wg")
          accs = eval_pipeline(tuple(acc_refs))
          epilogue([a[...] for a in accs], wg, e, row, lo, hi, ni)
        pl.run_scoped(scope, *[plgpu.ACC(shape, jnp.float32) for _ in range(n_acc)])

      plgpu.emit_pipeline_warp_specialized(
          step, grid=(k_iters,), memory_registers=40, in_specs=in_specs(), wg_axis="wg",
          num_compute_wgs=2, max_concurrent_steps=cfg.num_stages,
          compute_context=compute_context)(*gmem, allocations=pipeline_allocs)

    @plgpu.nd_loop((num_items,), collective_axes="sm")
    def _loop(info):
      (lin,) = info.index
      task, ni = lax.div(lin, jnp.int32(n_tiles)), lax.rem(lin, jnp.int32(n_tiles))
      e = meta_ref[0, task]
      row = pl.multiple_of(jnp.minimum(meta_ref[1, task], m_pad - bm), 8)
      compute_item(e, row, meta_ref[2, task], meta_ref[3, task], ni)

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  pipe = plgpu.emit_pipeline_warp_specialized(
      lambda *_: None, grid=(k_iters,), memory_registers=40, in_specs=in_specs(),
      wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=cfg.num_stages,
      compute_context=lambda *_: None)
  allocs = pipe.get_allocations(
      jax.ShapeDtypeStruct((bm, k), FP8),
      *[jax.ShapeDtypeStruct((bn, k), jnp.int4)] * n_rhs,
      *[jax.ShapeDtypeStruct((k // GROUP, bn), jnp.uint8)] * n_rhs)
  scratch = [plgpu.SMEM((1 if split else 2, bm, tn), out_dtype),
             plgpu.SMEM((2, 6, _vec_len(cfg)), jnp.float32),
             plgpu.Barrier(num_arrivals=1, num_barriers=nbar * 2), allocs]
  if split:  # the up half [tn, bm] and its two barriers (in the buffer / read)
    scratch += [plgpu.SMEM(shape, out_dtype), plgpu.Barrier(num_arrivals=1, num_barriers=2)]
  if emulate:  # the interpreter's wgmma operands: A as a ref, B untransposed
    scratch += [plgpu.SMEM((2, n_acc, tn, BK), FP8), plgpu.SMEM((2, BK, bm), FP8)]
  return _compat.kernel(
      body, out_type=jax.ShapeDtypeStruct((m_pad, n_out), out_dtype), scratch_types=scratch,
      grid=(num_sms,), grid_names=("sm",),
      compiler_params=_compat.compiler_params(approx_math=True), interpret=interpret,
      name="jmoe_gg_w4a8" + ("_gated" if gated else ""), num_threads=3, thread_name="wg")


def unsupported(k: int, n_out: int, w) -> str | None:
  """Why the kernel cannot take weights w (QuantizedWeights, logical [E, K, N_total]) with
  n_out output columns (None: it can): mxfp4 codes (e8m0 scales per 32), K-major, K a
  multiple of 128 and N_out of 128."""
  q = w.scheme
  if q is None or q.weight_dtype != "float4_e2m1fn" or q.scale_dtype != "float8_e8m0fnu":
    return f"{q}: the fp8-token prefill GEMM takes mxfp4 codes (e8m0 scales)"
  if q.group_size != GROUP or not w.k_major or w.perm is not None:
    return f"{q.name}: groups of {GROUP} along K, K-major values, no act-order"
  if k % BK or n_out % 128:
    return f"K={k} must be a multiple of {BK} and N={n_out} of 128"
  return None


def w4a8_run(lhs: jax.Array, w, a_scale: jax.Array, *, meta, act: Activation | None,
             gated: bool, bias: jax.Array | None = None, row_scale: jax.Array | None = None,
             out_dtype=jnp.bfloat16, config: W4A8Config | None = None,
             interpret: Any = False) -> jax.Array:
  """The kernel on sorted rows: lhs [m_pad, K] fp8 (the rows `meta` = tile_metadata(..,
  config.block_m) was built for; m_pad >= block_m), w mxfp4 QuantizedWeights (values
  [E, N_total, K/2]), a_scale [m_pad] f32 (the rows' token scales), bias [E, N_total] f32,
  row_scale [m_pad]. -> [m_pad, N_out] out_dtype (rows outside the tasks unwritten)."""
  m_pad, k = lhs.shape
  e, n_total, _ = w.values.shape
  n_out = n_total // 2 if gated else n_total
  why = unsupported(k, n_out, w)
  if why is not None:
    raise ValueError(f"w4a8_run: {why}")
  cfg = fit_stages(config or default_config(n_out, gated), 2 if gated else 1,
                   jnp.dtype(out_dtype).itemsize)
  if n_out % cfg.block_n:
    raise ValueError(f"N={n_out} is not a multiple of config.block_n={cfg.block_n}")
  if cfg.split_gate_up and not gated:
    raise ValueError("config.split_gate_up needs a gated activation")
  if acc_registers(cfg, gated) > 128:  # more spills (gated 256 columns ran 2.5 x slower)
    raise ValueError(f"config {cfg}: the accumulators would take "
                     f"{acc_registers(cfg, gated)} registers a thread (at most 128)")
  if m_pad < cfg.block_m:
    raise ValueError(f"lhs has {m_pad} rows, fewer than config.block_m={cfg.block_m}")
  interp, nsm = _compat.launch_params(interpret)
  kern = _build(m_pad=m_pad, k=k, n_out=n_out, n_total=n_total,
                out_dtype=jnp.dtype(out_dtype), cfg=cfg, gated=gated, act=act,
                has_bias=bias is not None, has_scale=row_scale is not None, num_sms=nsm,
                interpret=interp)
  codes = _codes(w, jnp.dtype(jnp.int4))
  shifts, w_scale = mx_shift_bytes(w.scale)
  meta_arr, ntasks = meta
  args = [meta_arr.astype(jnp.int32), ntasks.astype(jnp.int32), lhs, codes, shifts,
          a_scale.astype(jnp.float32), w_scale]
  if row_scale is not None:
    args.append(row_scale.astype(jnp.float32))
  if bias is not None:
    args.append(bias.astype(jnp.float32))
  return kern(*args)


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "config", "interpret"))
def grouped_gemm_w4a8(lhs: jax.Array, w, group_sizes: jax.Array, a_scale: jax.Array, *,
                      activation: Activation | str | None = None,
                      bias: jax.Array | None = None, row_scale: jax.Array | None = None,
                      out_dtype=jnp.bfloat16, config: W4A8Config | None = None,
                      interpret: Any = False) -> jax.Array:
  """fp8 tokens x mxfp4 experts, grouped: out[r] = act((x_q[r] @ dq(w[g(r)])) * a_scale[r] +
  bias[g(r)]) * row_scale[r]. lhs [M, K] float8_e4m3fn sorted by group, w mxfp4
  QuantizedWeights (logical [E, K, N_total], K-major), group_sizes [E], a_scale [M, 1] / [M]
  / [1, 1] f32, bias [E, N_total], row_scale [M]. -> [M, N_out] out_dtype (N_out = N_total / 2
  with a gated activation). Rows past sum(group_sizes) are unwritten."""
  if lhs.ndim != 2 or jnp.dtype(lhs.dtype) != FP8:
    raise ValueError(f"lhs must be float8_e4m3fn [M, K], got {lhs.dtype} {lhs.shape}")
  m, k = lhs.shape
  e, n_total, half = w.values.shape
  if 2 * half != k:
    raise ValueError(f"w: K={2 * half} (values {w.values.shape}) does not match lhs K={k}")
  if group_sizes.shape != (e,):
    raise ValueError(f"group_sizes must have shape ({e},), got {group_sizes.shape}")
  act, gated, n_out = _gate(activation, n_total, argname="w")
  _check_epilogue(m, e, n_total, n_out, bias, row_scale)
  cfg = config or default_config(n_out, gated, m / e)
  bm = cfg.block_m
  m_pad = gg.row_alloc(m, bm)
  pad = lambda x: x if m_pad == m else jnp.pad(x, ((0, m_pad - m),) + ((0, 0),) * (x.ndim - 1))
  meta = gg.tile_metadata(group_sizes, m, bm)
  rs = None if row_scale is None else pad(row_scale.astype(jnp.float32))
  out = w4a8_run(pad(lhs), w, pad(row_scale_vector(a_scale, m)), meta=meta, act=act,
                 gated=gated, bias=bias, row_scale=rs, out_dtype=out_dtype, config=cfg,
                 interpret=interpret)
  return out[:m]
