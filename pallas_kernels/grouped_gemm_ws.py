"""Warp-specialized grouped GEMMs over weight codes converted in registers: the prefill GEMM
family of the formats whose codes Hopper's MMAs cannot read as stored (4-bit integers, e2m1).

    out[r] = act(acc[r] * a_scale[r] * w_scale[e, :] + bias[e]) * row_scale[r]
    acc[r] = sum_k x[r, k] * A[e, :, k]      (e: row r's expert; f32 accumulation)

x: token rows sorted by expert as in grouped_gemm (tiles of `tile_metadata`); A: the codes
of expert e converted by a `Conversion` (which also says which of a_scale / w_scale exist).

Hopper's wgmma reads A from registers, so the products run transposed ("swap AB"): a memory
warpgroup brings each 128-deep K step's token tile, code tiles and the step's side rows (the
format's scale rows, shift bytes or zero points) by TMA; each of two compute warpgroups owns
half of the tile's weight columns (or, `WSConfig.split_gate_up`, GEMM1's gate or up columns),
converts its codes from shared memory into registers, and that register tile is the wgmma's A
operand, the token tile (K-major) its B: out^T = A @ x^T per tile, so the converted weights
never touch shared memory. One warpgroup's MMAs run while the other converts. Each weight
element is converted once per token tile, so experts with the rows take 256-token tiles.
The accumulator [weight columns, tokens] goes out transposed (a register transpose, then
untiled stores into the output tile).

A warpgroup waits for its step's wgmma before the next step's conversion overwrites the A
registers: leaving it running read garbage on the H200 (nothing orders wgmma's asynchronous
register reads against the compiler's reuse of those registers).

Users: grouped_gemm_w4a8 (fp8 tokens over mxfp4: codes -> e4m3 with the group exponents
folded in, 8-bit wgmma) and `bf16_conversion` (bf16 / f16 tokens over int4 / e2m1 codes:
codes -> bf16 times their group scales, 16-bit wgmma; the weight-only prefill GEMMs of
`moe.weight_only_layout`'s "prefill_ws"). Sizes: any the users' TMA boxes take, the output
columns a multiple of a warpgroup's (64 or 128); where the K step (128) or the column tile
does not divide them, the last step / tile reads past the arrays (zeros: TMA's fill, the
interpreter's with `_compat.zero_filled`) and its warpgroup columns past N are not stored.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels.activations import Activation

BK = 128  # the K step


@dataclasses.dataclass(frozen=True)
class WSConfig:
  """block_m: token rows per tile (wgmma's N: the tokens are the B operand; 256 halves the
  conversions per FLOP where experts have the rows); block_n: weight columns per tile (gated:
  output columns, each with its gate and up); num_stages: the TMA ring's slots;
  split_gate_up (gated only, block_n 64): one compute warpgroup computes the tile's gate
  columns, the other its up columns, and the up half crosses to the first through shared
  memory for the activation -- so each warpgroup holds one [64, block_m] accumulator, which
  lets block_m be 256. Otherwise each compute warpgroup owns half the tile's columns (gate
  and up) and holds one accumulator per operand."""
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

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @property
  def wg_rows(self) -> int:
    """Weight rows of one operand a compute warpgroup converts per step (its wgmma's M)."""
    return self.block_n if self.split_gate_up else self.block_n // 2


@dataclasses.dataclass(frozen=True)
class Conversion:
  """How a format's code tiles become the wgmma's A operand.

  name: the kernel name's stem; token_dtype: the tokens' (B's) dtype, the MMA's; side: per
  side array (beside each operand's codes, [E, K / 128 * rows, N_total]) the rows a K step
  takes and their dtype (a step's block: [rows, block_n]); sub: the K of one MMA, the width
  of the A sub-tiles; convert(codes, sides, emulate): a code ref [R, 128] (int4) and its side
  refs [rows_i, R] -> the A register tiles [R, sub], K order; per_token / per_column: the
  epilogue multiplies by a float32 vector per token row (the tokens' scales) / per weight
  column; code_dtype: the codes' dtype in the kernel (int4, or int8 for 8-bit integer codes:
  a code tile's rows are then 128 bytes)."""
  name: str
  token_dtype: Any
  side: tuple
  sub: int
  convert: Callable
  per_token: bool
  per_column: bool
  code_dtype: Any = jnp.int4

  @property
  def code_bits(self) -> int:
    return jnp.iinfo(self.code_dtype).bits


SPLIT_ROWS = 512  # rows per expert from which default_config takes 256-token tiles


def default_config(n_out: int, gated: bool, conv: Conversion, rows_per_expert: float = 0,
                   out_bytes: int = 2) -> WSConfig:
  """Experts with >= SPLIT_ROWS rows on average: 256-token tiles (gated: gate and up split
  over the warpgroups); else 128 columns gated (two [64, 128] accumulators a warpgroup), 256
  ungated where they divide N (one [128, 128]); the first of those that shared memory holds
  with a 2-slot ring (else 128-token, 128-column tiles), its ring as deep as it holds."""
  n_rhs = 2 if gated else 1
  tiles = []
  if rows_per_expert >= SPLIT_ROWS:
    tiles.append(WSConfig(block_m=256, block_n=64, split_gate_up=True) if gated else
                 WSConfig(block_m=256, block_n=128))
  if not gated and n_out % 256 == 0:
    tiles.append(WSConfig(block_n=256))
  tiles.append(WSConfig(block_n=128))
  cfg = next(c for c in tiles if fits(c, conv, n_rhs, out_bytes) or c is tiles[-1])
  return fit_stages(cfg, conv, n_rhs, out_bytes)


def _stage_bytes(cfg: WSConfig, conv: Conversion, n_rhs: int) -> int:
  side = sum(rows * jnp.dtype(dt).itemsize for rows, dt in conv.side) * cfg.block_n
  tokens = cfg.block_m * BK * jnp.dtype(conv.token_dtype).itemsize
  return tokens + n_rhs * (cfg.block_n * BK * conv.code_bits // 8 + side)


def _vec_len(cfg: WSConfig) -> int:
  return max(cfg.block_m, cfg.wg_rows)


def _fixed_bytes(cfg: WSConfig, out_bytes: int) -> int:
  tile = cfg.block_m * cfg.wg_rows * out_bytes
  epi = tile if cfg.split_gate_up else 2 * tile  # the output tiles (split: one warpgroup's)
  swap = tile if cfg.split_gate_up else 0  # the up half crossing warpgroups
  return epi + swap + 2 * 6 * _vec_len(cfg) * 4 + 4096


def acc_registers(cfg: WSConfig, gated: bool) -> int:
  """f32 accumulator registers a compute thread holds ([wg_rows, block_m] per operand)."""
  n_acc = 2 if gated and not cfg.split_gate_up else 1
  return n_acc * cfg.wg_rows * cfg.block_m // 128


def fits(cfg: WSConfig, conv: Conversion, n_rhs: int, out_bytes: int = 2,
         stages: int = 2) -> bool:
  """Whether shared memory holds cfg's fixed buffers and a ring of `stages` slots (an upper
  estimate: 3,936 bytes above what Mosaic GPU allocated for mixtral nvfp4's split tiles at 2
  and 3 slots -- its lowering checks the real count, on the CPU too)."""
  need = _fixed_bytes(cfg, out_bytes) + stages * _stage_bytes(cfg, conv, n_rhs)
  return need <= gg._SMEM_BYTES


def fit_stages(cfg: WSConfig, conv: Conversion, n_rhs: int, out_bytes: int = 2) -> WSConfig:
  """cfg with the ring lowered until shared memory holds it (at least 2 slots)."""
  budget = gg._SMEM_BYTES - _fixed_bytes(cfg, out_bytes)
  st = max(2, min(cfg.num_stages, budget // _stage_bytes(cfg, conv, n_rhs)))
  return dataclasses.replace(cfg, num_stages=st)


def candidates(gated: bool) -> tuple[WSConfig, ...]:
  """The tuning sweep (`python -m jmoe tune --quant`): 128-token tiles (gated 128 columns;
  ungated 128 or 256) and 256-token ones (gated: split gate / up), 2-4 ring slots; those a
  problem's operands do not fit fail there and drop out."""
  tiles = ([WSConfig(block_n=128), WSConfig(block_m=256, block_n=64, split_gate_up=True)]
           if gated else [WSConfig(block_n=128), WSConfig(block_n=256),
                          WSConfig(block_m=256, block_n=128)])
  return tuple(dataclasses.replace(c, num_stages=st) for c in tiles for st in (2, 3, 4))


def usable(cfg: WSConfig, conv: Conversion, *, gated: bool, n_out: int,
           out_bytes: int = 2) -> bool:
  """Whether cfg runs this problem (a tuned entry read for another output dtype may not)."""
  return (n_out % cfg.wg_rows == 0 and (gated or not cfg.split_gate_up)
          and acc_registers(cfg, gated) <= 128
          and fits(cfg, conv, 2 if gated else 1, out_bytes, cfg.num_stages))


def check_config(cfg: WSConfig, conv: Conversion, *, gated: bool, n_out: int, m_pad: int,
                 out_bytes: int = 2) -> None:
  """Raise, naming the config, where it does not fit the call."""
  if not fits(cfg, conv, 2 if gated else 1, out_bytes, cfg.num_stages):
    raise ValueError(f"config {cfg}: its {cfg.num_stages}-slot ring and output tiles do not "
                     f"fit shared memory with {conv.name}'s operands")
  if n_out % cfg.wg_rows:  # (a tile past N: each warpgroup's columns all inside or all past)
    raise ValueError(f"N={n_out} is not a multiple of a warpgroup's {cfg.wg_rows} columns "
                     f"(config {cfg})")
  if cfg.split_gate_up and not gated:
    raise ValueError("config.split_gate_up needs a gated activation")
  if acc_registers(cfg, gated) > 128:  # more spills (gated 256 columns ran 2.5 x slower)
    raise ValueError(f"config {cfg}: the accumulators would take "
                     f"{acc_registers(cfg, gated)} registers a thread (at most 128)")
  if m_pad < cfg.block_m:
    raise ValueError(f"lhs has {m_pad} rows, fewer than config.block_m={cfg.block_m}")


def grouped_call(run, lhs: jax.Array, w, group_sizes: jax.Array, *, activation,
                 bias: jax.Array | None, row_scale: jax.Array | None, config: WSConfig | None,
                 default: Callable, row_args: tuple = ()) -> jax.Array:
  """The grouped entry points' common part: lhs [M, K] sorted by group, w QuantizedWeights
  (K-major values [E, N_total, K], 4-bit ones packed [E, N_total, K/2]), group_sizes [E]
  checked naming the argument; the rows padded to
  the tile, the tile metadata built, run(lhs, w, *row_args, meta=, act=, gated=, bias=,
  row_scale=, config=) called (row_args: per-row arrays [M, ...], padded like lhs), the rows
  past M dropped. default(n_out, gated, rows_per_expert) gives the config where config
  is None."""
  from jmoe.kernels.grouped_gemm_q8 import _check_epilogue, _gate  # noqa: PLC0415
  m, k = lhs.shape
  e, n_total, cols = w.values.shape
  k_w = 2 * cols if w.packed else cols
  if k_w != k:
    raise ValueError(f"w: K={k_w} (values {w.values.shape}) does not match lhs K={k}")
  if group_sizes.shape != (e,):
    raise ValueError(f"group_sizes must have shape ({e},), got {group_sizes.shape}")
  act, gated, n_out = _gate(activation, n_total, argname="w")
  _check_epilogue(m, e, n_total, n_out, bias, row_scale)
  cfg = config or default(n_out, gated, m / e)
  m_pad = gg.row_alloc(m, cfg.block_m)
  pad = lambda x: x if m_pad == m else jnp.pad(x, ((0, m_pad - m),) + ((0, 0),) * (x.ndim - 1))
  rs = None if row_scale is None else pad(row_scale.astype(jnp.float32))
  out = run(pad(lhs), w, *[pad(a) for a in row_args],
            meta=gg.tile_metadata(group_sizes, m, cfg.block_m), act=act, gated=gated,
            bias=bias, row_scale=rs, config=cfg)
  return out[:m]


def call_kernel(conv: Conversion, cfg: WSConfig, *, lhs: jax.Array, n_total: int, gated: bool,
                act: Activation | None, out_dtype, has_bias: bool, has_scale: bool,
                interpret):
  """The kernel for one call on lhs [m_pad, K]: cfg fitted to shared memory (its ring lowered
  to what fits), checked against the call (naming what does not fit), built."""
  m_pad, k = lhs.shape
  n_out = n_total // 2 if gated else n_total
  out_bytes = jnp.dtype(out_dtype).itemsize
  cfg = fit_stages(cfg, conv, 2 if gated else 1, out_bytes)
  check_config(cfg, conv, gated=gated, n_out=n_out, m_pad=m_pad, out_bytes=out_bytes)
  interp, nsm = _compat.launch_params(interpret)
  tails = bool(k % BK or n_out % cfg.block_n)
  if interp is not None and tails:  # reads past the arrays as TMA's: zeros, not poison
    interp = _compat.zero_filled(interp)
  return build(m_pad=m_pad, k=k, n_out=n_out, n_total=n_total, out_dtype=jnp.dtype(out_dtype),
               cfg=cfg, conv=conv, gated=gated, act=act, has_bias=has_bias,
               has_scale=has_scale, num_sms=nsm, interpret=interp)


def task_args(meta, lhs: jax.Array, codes: jax.Array) -> list:
  """The kernel's leading operands as `build` orders them: the task list, lhs, the codes."""
  meta_arr, ntasks = meta
  return [meta_arr.astype(jnp.int32), ntasks.astype(jnp.int32), lhs, codes]


def epilogue_args(row_scale: jax.Array | None, bias: jax.Array | None) -> list:
  """The kernel's trailing operands as `build` orders them: [row_scale f32] [bias f32]."""
  return ([] if row_scale is None else [row_scale.astype(jnp.float32)]) + (
      [] if bias is None else [bias.astype(jnp.float32)])


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


def build(*, m_pad, k, n_out, n_total, out_dtype, cfg: WSConfig, conv: Conversion,
          gated: bool, act: Activation | None, has_bias: bool, has_scale: bool, num_sms: int,
          interpret):
  """The kernel: (meta, num_tasks, lhs [m_pad, K], codes [E, N_total, K] (conv.code_dtype),
  *side arrays,
  [a_scale [m_pad] f32], [w_scale [E, N_total] f32], [row_scale [m_pad]], [bias [E, N_total]])
  -> [m_pad, n_out] out_dtype."""
  bm, bn = cfg.block_m, cfg.block_n
  split = cfg.split_gate_up
  tn = cfg.wg_rows  # weight rows per compute warpgroup and operand: its wgmma's M
  # sizes the tiles do not divide (gpt-oss' 2880): the last K step and column tile reach past
  # the arrays, where TMA reads zeros (the interpreter: `_compat.zero_filled`); a warpgroup's
  # columns past N are not stored (N a multiple of its columns: no partial store)
  k_iters = pl.cdiv(k, BK)
  n_tiles = pl.cdiv(n_out, bn)
  n_rhs = 2 if gated else 1
  n_acc = 1 if split else n_rhs  # accumulators per compute warpgroup
  n_side = len(conv.side)
  sub, xdt = conv.sub, jnp.dtype(conv.token_dtype)
  emulate = interpret is not None  # the interpreter: no transposed views, no inline PTX
  _cast = _compat.layout_cast(interpret)
  tf_x = _compat.smem_transforms(min(BK, sub), xdt.itemsize)
  bits = conv.code_bits
  tf_c = _compat.code_transforms(k, bits, BK)  # (64-code tiles where 128 does not divide K)
  ladder = gg.row_ladder(bm, m_pad)
  shape = (tn, bm)  # an accumulator: weight columns x token rows
  nbar = 6  # per warpgroup: bias gate / up, row scale, a_scale, w_scale gate / up

  def in_specs():
    specs = ([plgpu.BlockSpec((bm, BK), lambda kk: (0, kk), transforms=tf_x)]
             + [plgpu.BlockSpec((bn, BK), lambda kk: (0, kk), transforms=tf_c)] * n_rhs)
    for rows, _ in conv.side:
      specs += [plgpu.BlockSpec((rows, bn), lambda kk: (kk, 0))] * n_rhs
    return specs

  def body(meta_ref, ntask_ref, lhs_ref, codes_ref, *rest):
    rest = list(rest)
    side_refs = [rest.pop(0) for _ in range(n_side)]
    as_ref = rest.pop(0) if conv.per_token else None
    ws_ref = rest.pop(0) if conv.per_column else None
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

      def _store():
        gg.store_task_rows(epi, out_ref, tile_row=row, lo=lo, hi=hi, tile_m=bm,
                           ladder=ladder, cols=pl.ds(c0, tn))

      if n_out % bn:  # a last tile's half past N: its columns are not stored at all
        pl.when(c0 < n_out)(_store)
      else:
        _store()

    def epilogue(accs, wg, e, row, lo, hi, ni):
      """accs: this warpgroup's f32 [tn, bm] accumulators (weight columns x the tile's token
      rows): split, the gate (warpgroup 0) or up (1) of columns ni * bn; else gate and up of
      columns ni * bn + wg * tn. Stored transposed (tokens x columns) through SMEM."""
      c0 = ni * bn + (0 if split else wg * tn)
      # the weight-column offsets of the accumulators (gate: j * n_out + c0)
      offs = [wg * n_out + c0] if split else [j * n_out + c0 for j in range(n_rhs)]
      vec = vec_smem.at[wg]
      if conv.per_token:
        plgpu.copy_gmem_to_smem(as_ref.at[pl.ds(row, bm)], vec.at[3, :bm], bar(wg, 3))
      for j, off in enumerate(offs):
        if conv.per_column:
          plgpu.copy_gmem_to_smem(ws_ref.at[e, pl.ds(off, tn)], vec.at[4 + j, :tn],
                                  bar(wg, 4 + j))
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

      if conv.per_token:
        plgpu.barrier_wait(bar(wg, 3))
        sa = per_token(3)
      vals = []
      for j, a in enumerate(accs):
        if conv.per_token:
          a = a * sa
        if conv.per_column:
          plgpu.barrier_wait(bar(wg, 4 + j))
          a = a * per_column(4 + j)
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
      """One K step: this warpgroup's code rows -> registers (wgmma's A, `conv`), against the
      token tile (B: [BK, bm], K-major). The first operand's MMA runs while the second
      converts; the other warpgroup's MMAs run while this one converts."""
      del idx
      code_smems = refs[:n_rhs]
      side_smems = [refs[n_rhs * (1 + i):n_rhs * (2 + i)] for i in range(n_side)]
      accs = refs[n_rhs * (1 + n_side)]
      wg = lax.axis_index("wg")
      if emulate:
        t_b.at[wg][...] = x_smem[...].T

      def operand_b(q):
        """K columns [q sub, (q + 1) sub) of the token tile, as [sub, bm]."""
        if emulate:
          return t_b.at[wg] if sub == BK else t_b.at[wg, pl.ds(q * sub, sub)]
        tile = x_smem if sub == BK else x_smem.at[:, pl.ds(q * sub, sub)]
        return plgpu.transpose_ref(tile, (1, 0))

      def mma(acc, codes, sides, j):
        for q, a in enumerate(conv.convert(codes, sides, emulate)):
          if emulate:
            dst = t_a.at[wg, j] if sub == BK else t_a.at[wg, j, :, pl.ds(q * sub, sub)]
            dst[...] = a
            a = dst
          plgpu.wgmma(acc, a, operand_b(q))

      if split:  # warpgroup j: operand j's rows
        for j in range(n_rhs):
          @pl.when(wg == j)
          def _operand():
            mma(accs[0], code_smems[j], [s[j] for s in side_smems], 0)
      else:  # operand j's rows of this warpgroup's half
        cols = pl.ds(wg * tn, tn)
        for j, acc in enumerate(accs):
          mma(acc, code_smems[j].at[cols], [s[j].at[:, cols] for s in side_smems], j)
      plgpu.wgmma_wait(0)  # the A registers and the ring slot are read
      return accs

    def compute_item(e, task, row, lo, hi, ni):
      del task  # (the rows are in the sorted layout: the tile's row says where)
      c = ni * bn
      gmem = [lhs_ref.at[pl.ds(row, bm), :],
              *[codes_ref.at[e, pl.ds(j * n_out + c, bn), :] for j in range(n_rhs)]]
      for s_ref in side_refs:
        gmem += [s_ref.at[e, :, pl.ds(j * n_out + c, bn)] for j in range(n_rhs)]

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

    gg.task_item_loop(meta_ref, num_items, n_tiles, m_pad, bm, compute_item)

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  pipe = plgpu.emit_pipeline_warp_specialized(
      lambda *_: None, grid=(k_iters,), memory_registers=40, in_specs=in_specs(),
      wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=cfg.num_stages,
      compute_context=lambda *_: None)
  side_shapes = [jax.ShapeDtypeStruct((k_iters * rows, bn), dt)
                 for rows, dt in conv.side for _ in range(n_rhs)]
  allocs = pipe.get_allocations(
      jax.ShapeDtypeStruct((bm, k_iters * BK), xdt),
      *[jax.ShapeDtypeStruct((bn, k_iters * BK), conv.code_dtype)] * n_rhs, *side_shapes)
  scratch = [plgpu.SMEM((1 if split else 2, bm, tn), out_dtype),
             plgpu.SMEM((2, 6, _vec_len(cfg)), jnp.float32),
             plgpu.Barrier(num_arrivals=1, num_barriers=nbar * 2), allocs]
  if split:  # the up half [tn, bm] and its two barriers (in the buffer / read)
    scratch += [plgpu.SMEM(shape, out_dtype), plgpu.Barrier(num_arrivals=1, num_barriers=2)]
  if emulate:  # the interpreter's wgmma operands: A as a ref, B untransposed
    scratch += [plgpu.SMEM((2, n_acc, tn, BK), xdt), plgpu.SMEM((2, BK, bm), xdt)]
  return _compat.kernel(
      body, out_type=jax.ShapeDtypeStruct((m_pad, n_out), out_dtype), scratch_types=scratch,
      grid=(num_sms,), grid_names=("sm",),
      compiler_params=_compat.compiler_params(approx_math=True), interpret=interpret,
      name=f"jmoe_gg_{conv.name}" + ("_gated" if gated else ""), num_threads=3,
      thread_name="wg")
