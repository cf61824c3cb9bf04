"""The weight-only decode MoE block (w4a16 / w8a16: int4 or int8 weights, bf16 tokens) as one
Mosaic GPU kernel: decode_q8.py's design with the weights dequantized in registers.

Per valid slot s (token t = s // k, expert e = topk_ids[s]) and block j of 128 intermediate
columns, one work item:

    a             = act(x[t] @ dq(w13[e])[:, gate cols of j] (+ b), the same for up)    [128]
    part[j, s, :] = a @ q2[e][rows of j, :]                     [1, H] f32 (unscaled codes)

The weights stay as QuantizedWeights store them (K-major [E, N, K] codes, int4 packed two a
byte): TMA brings 128 x 128 code tiles into SMEM, each is loaded into registers and
converted to bf16, and that register tile is wgmma's A operand; the token is the 8-column B operand. So 4-bit weights are
the only large bytes read from HBM. (int4 is stored signed, u - 8, which the conversion reads
as is: flipping the bit in registers cost 15-18 % of the kernel on the H200.)

Scales per group of 128 along K (w4a16 / grouped w8a16) are applied after the MMA, without a
second accumulator per group: column j of the B tile holds the token masked to the groups
g with g % 8 == j (the wrapper builds it, 8 x H values per token), so over 8 consecutive
steps (a window) the accumulator's column j is group (8w + j)'s partial sum, and the window's
[128, 8] scale tile (one TMA per item brings the item's [128, H / 128] scale rows) multiplies
it before the sum over columns. Zero points subtract sum_g (z - 8) * s * sum(x over g) once
per item, from the item's whole zero / scale rows (the token's group sums come with it).
Per-channel scales (w8a16) multiply once per item.

GEMM2's scales (per output row, per group of 128 intermediate columns = one item) are applied
by the final reduction (XLA), which reads them for the touched experts in their stored layout:
a per-item row scale has no TMA box (4 bytes a row), and it multiplies a whole part row. With
w2 zero points the kernel also writes each item's activation sum, which that reduction needs.

fp8 tokens (schemes with act_dtype float8_e4m3fn over 4-bit codes: mxfp4_fp8, nvfp4_fp8,
w4afp8): the codes convert to e4m3 instead (exactly: every int4 and e2m1 value is an e4m3
number), the token tiles are prepare's fp8 rows, and the MMAs are 8-bit wgmma m64n8k32 --
half the instructions of bf16's m64n8k16, which is what bounds a step. The token's scale
multiplies the item's dot products; the intermediate is quantized per item (128 columns of a
slot, like decode_q8) and its scale multiplies the item's GEMM2 partial rows.

4-bit codes with bf16 / f16 tokens (int4: w4a16, e2m1: mxfp4 / nvfp4) run the same items on
mma.sync instead of wgmma (`jmoe.kernels.int4_mma`, `sync_eligible`): each warp reads its
share of the code tile as int32 words (8 codes a word), converts them with a few shifts, lop3s
and packed fmas straight into m16n8k16 A fragments, and the token tile comes fragment-ordered
from the wrapper. wgmma's register-A form needed a converted 64-row tile per instruction and
its issue bounded the step; mma.sync's fragments are what the conversion yields (H200: 485
against ~860 ns per 128-column step). The contraction runs in a permuted K order inside each
step, which the token tile mirrors, so the groups' masks and scales are the wgmma form's.
Where H is a multiple of 512 a ring slot holds two steps (`wide_eligible`): GEMM1's gate and
up arrive as [128, 32]-word boxes (128-byte rows: the H200's TMA streams 64-byte rows at ~3.2
TB/s and 128-byte ones at ~4.5), GEMM2's two steps' tiles share the slot (a RefUnion view).
e2m1's e8m0 / e4m3 scales per 16 / 32 are read there as bytes (`scale_bytes_eligible`:
two windows' [128, 16] a box, GEMM2's 16-byte box around s2_start) and widened in registers,
nvfp4's global scale multiplying the item's dot products and GEMM2 rows -- no float32 copy
of the scales per call (it cost a quarter of the block at one token). Sizes 128 does not
divide (gpt-oss' 2880) run there padded (`padded_sizes`: the steps, items and rows past the
weights read TMA's zero fill); the wgmma form shifts its last step and item back instead.

Launches: the token-tile fusion, this kernel and the reduction.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jmoe.kernels import _compat, int4_mma
from jmoe.kernels.activations import Activation, as_activation
from jmoe.kernels.decode import (MAX_SLOTS, combine_parts, cta_items, pair_columns,
                                 ring_step, store_part_row, token_operand)
from jmoe.kernels.e2m1 import E2M1_UNIT, e2m1_tile, e4m3_tile, fp8_codes_tile
from jmoe.kernels.grouped_gemm import kernel_activation
from jmoe.kernels.grouped_gemm_q8 import FP8_MAX
from jmoe.kernels.prepared import Operand, operand
from jmoe.quant.activations import ROW_SCALES
from jmoe.quant.packing import view_4bit
from jmoe.quant.weights import check_quantized

_N = 8  # wgmma's N: the token's (masked) rows, and the window length in steps
BN = 128  # intermediate columns per item (GEMM1's M per gate / up, GEMM2's K)
BK = 128  # GEMM1's contraction step = the scale group
BH = 256  # GEMM2's output columns per step (two 128-row A tiles)
GROUP = 128  # int4 / int8 scale groups per 128 (a step is one group); zero points need it
GROUPS = (16, 32, 128)  # the group sizes the kernel takes (a window is 8 groups; 64 would
# need a GEMM2 scale box 8-byte aligned, which TMA refuses)
ROWS_A = 64  # GEMM2's B tile: a WGMMA-layout broadcast needs 64 rows (B: its first 8)
_MAX_STAGES = 8
WIDE_ROW_BYTES = 2 * BK // 2  # a wide slot's code row: two steps' 128 codes of 4 bits
WIDE_H = 4 * BK  # H a multiple of this: wide slots (two steps) and whole window pairs
FP8 = jnp.dtype(jnp.float8_e4m3fn)
# the codes' dtype in the kernel per weight_dtype (e2m1 codes are read as signed int4; e4m3
# codes, mxfp8's weights, as themselves)
_CODE_DTYPES = {"int4": jnp.dtype(jnp.int4), "int8": jnp.dtype(jnp.int8),
                "float4_e2m1fn": jnp.dtype(jnp.int4), "float8_e4m3fn": FP8}


@dataclasses.dataclass(frozen=True)
class DecodeWQConfig:
  """stages: ring slots (int4: 18 KiB, int8: 34 KiB; 4-bit codes on mma.sync with H a
  multiple of 512: slots of two steps, 36 KiB; None: as many as shared memory holds, up to
  8 steps). ctas_per_sm: CTAs resident on each SM (the persistent grid is that many times the
  SMs; they share its shared memory, so each ring is shallower)."""
  stages: int | None = None
  ctas_per_sm: int = 1

  def __post_init__(self):
    if self.stages is not None and self.stages < 2:
      raise ValueError(f"stages={self.stages} must be >= 2")
    if self.ctas_per_sm not in (1, 2, 3, 4):
      raise ValueError(f"ctas_per_sm={self.ctas_per_sm} must be 1, 2, 3 or 4")


def smem_budget(ctas_per_sm: int = 1) -> int:
  """Dynamic shared memory one CTA may use with `ctas_per_sm` of them on an SM (sm_90: 228
  KiB an SM, 1 KiB of it reserved per CTA), less each buffer's 1 KiB alignment."""
  return (228 * 1024) // ctas_per_sm - 1024 - 14 * 1024


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What one build of the kernel reads: static facts of the weights."""
  code: Any  # jnp.int4 / jnp.int8 / float8_e4m3fn (the codes' dtype in the kernel)
  grouped: bool  # w13 scales per `group` along K (else per channel)
  zero13: bool
  zero2: bool
  has_bias: bool
  e2m1: bool = False  # the int4 codes are e2m1 (mxfp4 / nvfp4): converted in registers
  group: int = GROUP
  act8: bool = False  # fp8 tokens and intermediate: codes -> e4m3, 8-bit wgmma (xdt: fp8)
  sync: bool = False  # 4-bit codes as int32 words on mma.sync (jmoe.kernels.int4_mma)
  wide: bool = False  # sync, a ring slot two steps: GEMM1's code boxes 128-byte rows
  scale8: str | None = None  # the stored scales' 8-bit format ("e8m0" / "e4m3"), if any
  global13: int = 0  # w13 / w2's global scales along the rows (nvfp4: S of [E, S]), if any
  global2: int = 0
  scale_bytes: bool = False  # small groups' 8-bit scales read as bytes in the kernel

  @property
  def int4(self) -> bool:
    return self.code == jnp.dtype(jnp.int4)

  @property
  def fp8(self) -> bool:
    """e4m3 codes (mxfp8 weights): converted to bf16 in registers like int8 ones."""
    return self.code == FP8

  @property
  def small_groups(self) -> bool:
    """Groups shorter than an item's 128 intermediate columns: GEMM2's scales are applied
    in the kernel (column t of its B tile: group t's activations), read in their stored
    [E, H, N / g] layout (8-bit scales: as bytes on mma.sync, `scale_bytes`; else float32
    copies of each slot's expert's)."""
    return self.grouped and self.group < BN


def _stage_bytes(plan: _Plan) -> int:
  code_bytes = BN * BK // 2 if plan.int4 else BN * BK
  s2_bytes = 2 * (BH // 2) * s2_width(plan) * (1 if plan.scale_bytes else 4) \
      if plan.small_groups else 0  # GEMM2's scale tiles
  step = 2 * code_bytes + _N * BK * (1 if plan.act8 else 2) + s2_bytes
  return 2 * step if plan.wide else step


def _fixed_bytes(plan: _Plan, h: int) -> int:
  g1 = h // plan.group
  fixed = ROWS_A * BN * 2 + BN * 4 + 2 * BN * 4 + BH * 4 + 2 * 4 * BN * 4 + 64 * 4
  if plan.act8:  # the item's intermediate scale
    fixed += 64 * 4
  if plan.small_groups:  # a window's scales at a time (bytes: two), double-buffered
    fixed += 2 * 2 * BN * (2 * _N if plan.scale_bytes else _N * 4)
  elif plan.grouped:
    fixed += 2 * BN * g1 * 4
    if plan.zero13:  # (two warpgroups: a copy of the token sums each)
      fixed += 2 * BN * g1 * (2 if wide_zeros(h) else 1) \
          + g1 * 4 * (2 if two_warpgroups(plan) else 1)
  return fixed


def max_stages(plan: _Plan, h: int, ctas_per_sm: int = 1) -> int:
  """The deepest ring that fits a CTA's shared memory beside the per-item buffers (wide:
  slots of two steps)."""
  return min(_MAX_STAGES // 2 if plan.wide else _MAX_STAGES,
             (smem_budget(ctas_per_sm) - _fixed_bytes(plan, h)) // _stage_bytes(plan))


def store_b_tile(tile, a_smem, asum_smem, asum_dst, row_scale=None) -> None:
  """GEMM2's B tile (the activations, xdt or fp8) into a_smem; with w2 zero points (asum_dst,
  the item's [8] row of the sums output) also each B row's sum (times row_scale [rows], fp8's
  scale), for the zero points' term."""
  a_smem[...] = tile
  if asum_dst is not None:
    sums = jnp.sum(tile.astype(jnp.float32), axis=1)
    asum_smem[...] = sums if row_scale is None else sums * row_scale
  plgpu.commit_smem()
  if asum_dst is not None:
    plgpu.copy_smem_to_gmem(asum_smem.at[pl.ds(0, _N)], asum_dst)


def block_start(i, size: int, block: int):
  """Block i's first index along a dimension of `size` cut into blocks of `block`: i * block,
  the last block shifted back inside `size` where `block` does not divide it (gpt-oss: 2880;
  the callers mask its overlap with the previous block, or write it twice with equal
  values). The weight-only kernels' items, K steps and output steps."""
  if size % block == 0:
    return i * block
  return pl.multiple_of(jnp.minimum(i * block, size - block), 64)


def block_group(i, size: int, block: int, group: int):
  """block_start(i, size, block) / group, said with products and a minimum (which keep the
  start's known divisibility, as the scale boxes' TMA copies need)."""
  per = block // group
  if size % block == 0:
    return i * per
  last = (size - block) // group
  return pl.multiple_of(jnp.minimum(i * per, last), math.gcd(per, last))


def s2_start(jb, n: int, plan: _Plan):
  """The first of the 8 GEMM2 scale columns item jb reads (its groups are 128 / g of them
  from block_group). TMA faults on a box whose start is not 16-byte aligned (H200, gpt-oss'
  N / 32 = 90 columns): with 128 dividing N the box never passes the array's N / g columns
  (multiples of 4); else the start is rounded down to 4 columns in a copy padded past them
  (`s2_columns`)."""
  if n % BN == 0:  # (byte scales: a multiple of 8, so 8 past s2_box's start at most; the
    # scale array's columns are N / g rounded up to 16, which holds the 8-rounded bound)
    first = block_group(jb, n, BN, plan.group)
    cols = -(-(n // plan.group) // 8) * 8 if plan.scale_bytes else n // plan.group
    return jnp.minimum(first // 8 * 8 if plan.scale_bytes else first, cols - _N)
  return pl.multiple_of(block_group(jb, n, BN, plan.group) // 4 * 4, 4)


def s2_columns(n: int, plan: _Plan) -> int:
  """The GEMM2 scale copy's columns where 128 does not divide N: N / g rounded up to 4, and 4
  more (the last box's start rounded down by up to 3, its 8 columns past the item's)."""
  return -(-(n // plan.group) // 4) * 4 + 4


def s2_width(plan: _Plan) -> int:
  """Columns of a GEMM2 scale tile: 8 float32 (from s2_start), or as bytes the 16-byte-aligned
  box holding them (s2_box; 16-byte rows: Mosaic finds no conflict-free load of 32-byte
  ones)."""
  return 16 if plan.scale_bytes else _N


def s2_box(jb, n: int, plan: _Plan, cols: int):
  """Byte scales: where item jb's GEMM2 scale box starts in a scale array of `cols` columns
  (a multiple of 16 at least s2_width): s2_start rounded down to 16 bytes (TMA faults on an
  unaligned start), kept inside the array."""
  start = jnp.minimum(s2_start(jb, n, plan) // 16 * 16, cols - s2_width(plan))
  return pl.multiple_of(start, 16)


def scale_values(b: jax.Array, kind: str) -> jax.Array:
  """8-bit scales (uint8 bits) -> float32: e8m0 2^(b - 127) by a shift into the exponent (b =
  0, 2^-127, reads 0); e4m3 by its bits moved into float32's (normal) or its mantissa times
  2^-9 (subnormal: no float32 subnormal, which the kernel's approximate math would flush)."""
  i = b.astype(jnp.int32)
  if kind == "e8m0":
    return lax.bitcast_convert_type(i << 23, jnp.float32)
  mag = i & 0x7F
  normal = lax.bitcast_convert_type((mag << 20) + (120 << 23), jnp.float32)
  v = jnp.where(mag >= 8, normal, (mag & 7).astype(jnp.float32) * (2.0 ** -9))
  return jnp.where(i >= 128, -v, v)


def step_fetcher(*, refs: dict, plan: _Plan, n: int, k1: int, spi: int, stages: int, total,
                 use_vec: bool, h: int, interpret: bool = False, n_rows: int | None = None):
  """The weight-only decode kernels' load stream: fetch(g, i, cur, nxt) loads the CTA's step
  g (item i's, `cur`, or item i + 1's, `nxt`: (slot, expert, block, token tile)) into ring
  slot g % stages: a GEMM1 step a gate, an up and a token tile (bars1), a GEMM2 step two w2
  tiles (bars2); an item's first step also its per-channel scales and biases (vbar).
  k1: GEMM1 ring slots an item (wide plans: two steps a slot, gate / up one [128, 32]-word
  box each on the GPU, `ring_w`). n_rows: where w13's up rows start (N; `n` is the items'
  geometry, N rounded up where `padded_sizes` pads it)."""
  n_rows = n if n_rows is None else n_rows
  ring, xring, vec, vbar = refs["ring"], refs["xring"], refs["vec"], refs["vbar"]
  w13_ref, w2_ref, x_ref = refs["w13"], refs["w2"], refs["x"]
  s2_ref, s2ring, sid_ref = refs.get("s2"), refs.get("s2ring"), refs.get("sid")

  def kcols(start, size: int):
    """Code columns [start, start + size) (sync: the int32 words that hold them)."""
    return pl.ds(start // 8, size // 8) if plan.sync else pl.ds(start, size)

  def fetch(g, i, cur, nxt):
    @pl.when(g < total)
    def _fetch():
      it, r, info, slot = ring_step(g, i, cur, nxt, spi=spi, stages=stages)
      _, ex, jb, tok = info
      dst = ring.at[slot]

      if use_vec:
        @pl.when(r == 0)
        def _vectors():
          vb = lax.rem(it, 2)
          for c, col in enumerate((block_start(jb, n, BN), n_rows + block_start(jb, n, BN))):
            if not plan.grouped:
              plgpu.copy_gmem_to_smem(refs["c13"].at[ex, pl.ds(col, BN)], vec.at[vb, c],
                                      vbar.at[vb])
            if plan.has_bias:
              plgpu.copy_gmem_to_smem(refs["b13"].at[ex, pl.ds(col, BN)], vec.at[vb, 2 + c],
                                      vbar.at[vb])

      @pl.when(r < k1)
      def _w13():
        bar, col0 = refs["bars1"].at[slot], block_start(jb, n, BN)
        if plan.wide:  # steps 2r, 2r + 1 (no tails: H a multiple of 512)
          for c, row in enumerate((col0, n_rows + col0)):
            rows = pl.ds(row, BN)
            if interpret:  # (no RefUnion there: one box a step)
              for s in range(2):
                plgpu.copy_gmem_to_smem(w13_ref.at[ex, rows, kcols((2 * r + s) * BK, BK)],
                                        dst.at[2 * c + s], bar)
            else:  # gate / up's [128, 32] tile of two steps: 128-byte rows
              plgpu.copy_gmem_to_smem(w13_ref.at[ex, rows, kcols(2 * r * BK, 2 * BK)],
                                      refs["ring_w"].at[slot, c], bar)
          for s in range(2):
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tok * _N, _N), pl.ds((2 * r + s) * BK, BK)],
                                    xring.at[slot, s], bar)
          return
        cols = kcols(block_start(r, h, BK), BK)
        plgpu.copy_gmem_to_smem(w13_ref.at[ex, pl.ds(col0, BN), cols], dst.at[0], bar)
        plgpu.copy_gmem_to_smem(w13_ref.at[ex, pl.ds(n_rows + col0, BN), cols], dst.at[1], bar)
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tok * _N, _N), pl.ds(r * BK, BK)],
                                xring.at[slot], bar)

      @pl.when(r >= k1)
      def _w2():
        bar = refs["bars2"].at[slot]
        for s in range(2 if plan.wide else 1):  # wide: GEMM2 steps 2c, 2c + 1
          c = (r - k1) * (2 if plan.wide else 1) + s
          for half in range(2):
            rows = pl.ds(block_start(c, h, BH) + half * (BH // 2), BH // 2)
            plgpu.copy_gmem_to_smem(w2_ref.at[ex, rows, kcols(block_start(jb, n, BN), BN)],
                                    dst.at[2 * s + half], bar)
            if plan.small_groups:  # the rows' scales of block j's groups (and the next's)
              cols = (pl.ds(s2_box(jb, n, plan, s2_ref.shape[-1]), s2_width(plan))
                      if plan.scale_bytes else pl.ds(s2_start(jb, n, plan), _N))
              plgpu.copy_gmem_to_smem(s2_ref.at[sid_ref[info[0]], rows, cols],
                                      s2ring.at[slot, 2 * s + half], bar)

  return fetch


def wide_half(slot_ref, c: int, half, interpret: bool):
  """GEMM1's code tile of step `half` (0 / 1, traced) of a wide slot, for `int4_mma.mma`:
  on the GPU the [128, 32] tile's half (a ref starting at its first word; rows 128 bytes
  apart), in the interpreter the step's own [128, 16] box."""
  if interpret:
    return slot_ref.at[2 * c + half]
  return slot_ref.at[2 * c, half]  # row `half` of the [128, 16] view: 64 bytes in


def wide_eligible(plan: _Plan, h: int, n: int) -> bool:
  """Wide slots (two steps, 128-byte GEMM1 rows) where no tail shifts a step: H a multiple
  of 512 (GEMM1's steps and GEMM2's pair up), N of 128."""
  return WIDE_ROWS and plan.sync and h % WIDE_H == 0 and n % BN == 0


def window_steps(plan: _Plan) -> int:
  """GEMM1 steps whose partials share an accumulator (grouped: 8 groups, column j group
  8w + j; per channel: every step)."""
  return max(_N * plan.group // BK, 1) if plan.grouped else 0


def k1_steps(h: int, plan: _Plan) -> int:
  """GEMM1 steps an item: ceil(H / 128), grouped rounded up to whole windows (the extra
  steps' token tiles are zeros)."""
  k1, w = -(-h // BK), window_steps(plan)
  return -(-k1 // w) * w if w else k1


def ring_slots(h: int, plan: _Plan) -> int:
  """Ring slots an item takes: its GEMM1 and GEMM2 steps (wide plans: two a slot)."""
  steps = k1_steps(h, plan) + -(-h // BH)
  return steps // 2 if plan.wide else steps


def geometry(h: int, n: int, plan: _Plan, stages: int):
  """(blocks of N, GEMM1 steps, GEMM2 steps, ring slots per item (steps; wide: pairs), scale
  groups along H, the code tiles' SMEM transforms, the token tiles') of a weight-only decode
  kernel; checks stages."""
  nb, k1, k2 = -(-n // BN), k1_steps(h, plan), -(-h // BH)
  spi = ring_slots(h, plan)
  if stages - 1 >= spi:
    raise ValueError(f"stages={stages} must be at most {spi} (steps per item)")
  if plan.sync:  # words and fragment-ordered token tiles: plain rows, no swizzle
    return nb, k1, k2, spi, k1 * BK // plan.group, (), ()
  bits = 4 if plan.int4 else 8
  # sizes 128 does not divide: 64-column tiles (TMA's source must be whole tiles; 64 divides)
  swz = plgpu.find_swizzle((BK if h % BK == 0 and n % BN == 0 else 64) * bits)
  tf_w = (plgpu.TilingTransform((8, swz * 8 // bits)), plgpu.SwizzleTransform(swz))
  tf_x = _compat.smem_transforms(BK, 1 if plan.act8 else 2)
  return nb, k1, k2, spi, k1 * BK // plan.group, tf_w, tf_x


def _build(*, h, n, m, k, e, xdt, act: Activation, plan: _Plan, stages: int, num_sms,
           interpret, sizes: tuple[int, int] | None = None):
  """h, n: the kernel's geometry; sizes: the weights' own (H, N) where `padded_sizes` rounded
  them up (the steps and items past them read TMA's zeros; the items' columns past N are
  masked, the part rows past H dropped by the wrapper)."""
  h_rows, n_rows = sizes or (h, n)
  nb, k1, k2, spi, g1, tf_w, tf_x = geometry(h, n, plan, stages)
  two = two_warpgroups(plan)  # gate / up (GEMM2: its two tiles) on a warpgroup each
  n_sbar = 2 if plan.small_groups else 1  # scale-block buffers (per warpgroup where two)
  _cast = _compat.layout_cast(interpret)
  emulate = interpret is not None  # the interpreter's wgmma takes refs only, not transposed
  use_vec = plan.has_bias or not plan.grouped
  # steps whose partials share one accumulator: a window is 8 groups (column j: group 8w + j)
  window = window_steps(plan) or k1
  n_windows = k1 // window
  k1u = k1 // 2 if plan.wide else k1  # GEMM1's ring slots an item

  def ring_pos(first_slot, step):
    """(the ring counter of an item's step -- its slot is that mod stages --, the step's place
    in the slot: 0 / 1 traced on wide slots, 0 else)."""
    if plan.wide:
      return first_slot + lax.div(step, 2), lax.rem(step, 2)
    return first_slot + step, 0

  def at_slot_edge(s, edge: int, fn) -> None:
    """fn() at the slot's first (edge 0: wait for it) or last step (edge 1: refill it)."""
    if plan.wide:
      pl.when(s == edge)(fn)
    else:
      fn()

  def body(*refs):
    refs = list(refs)
    ids_ref = refs.pop(0)
    sid_ref = refs.pop(0) if plan.small_groups else None
    xsc_ref = refs.pop(0) if plan.act8 else None  # fp8 tokens: their scales [T]
    x_ref, w13_ref, w2_ref = refs[:3]
    del refs[:3]
    s13_ref = refs.pop(0) if plan.grouped else None
    c13_ref = refs.pop(0) if not plan.grouped else None
    z13_ref, xs_ref = (refs.pop(0), refs.pop(0)) if plan.zero13 else (None, None)
    b13_ref = refs.pop(0) if plan.has_bias else None
    s2_ref = refs.pop(0) if plan.small_groups else None
    g13_ref = refs.pop(0) if plan.scale_bytes and plan.global13 else None  # [E, S] float32
    g2_ref = refs.pop(0) if plan.scale_bytes and plan.global2 else None
    part_ref = refs.pop(0)
    asum_ref = refs.pop(0) if plan.zero2 else None
    ring, xring, a_smem, a_vec, gvec, o_row, asum_smem, vec = refs[:8]
    del refs[:8]
    ring_w = None
    if plan.wide and not emulate:  # one ring, two views: GEMM1's [.., 2, 128, 32] boxes
      ring_w, ring = ring
      _compat.check_union_aliases(ring_w, ring)

    sblk = refs.pop(0) if plan.grouped else None
    zblk, xsblk = (refs.pop(0), refs.pop(0)) if plan.zero13 else (None, None)
    s2ring = refs.pop(0) if plan.small_groups else None
    sa_smem = refs.pop(0) if plan.act8 else None  # the item's intermediate scale (every entry)
    bars1, bars2, vbar, sbar = refs[:4]
    t_a, t_b = refs[4:6] if emulate else (None, None)
    consumed, meet = refs[-2:] if two else (None, None)
    sm = lax.axis_index("sm")
    wgi = lax.axis_index("wg") if two else None
    # the operands this warpgroup computes: gate and up, or (two) its own
    ops = (wgi,) if two else (0, 1)

    def sbar_at(buf):
      return sbar.at[wgi * n_sbar + buf] if two else sbar.at[buf]

    def lead(fn) -> None:
      """fn on the first warpgroup only (where two): the ring's TMA, the activation."""
      if two:
        pl.when(wgi == 0)(fn)
      else:
        fn()

    def meet_all(j: int) -> None:
      """Both warpgroups reach point j (0: gate / up sums stored, 1: GEMM2's B stored)."""
      if two:
        plgpu.barrier_arrive(meet.at[j])
        plgpu.barrier_wait(meet.at[j])

    def dequantized(tile, which):
      """A code tile [128, 128] in SMEM -> the register tile wgmma takes as A (bf16, or the
      codes' values in e4m3 with fp8 tokens)."""
      if plan.act8:
        a = e4m3_tile(tile[...], e2m1=plan.e2m1, interpret=emulate)
      else:
        a = code_values(tile[...], plan, xdt, interpret=emulate)
      if emulate:
        t_a.at[which][...] = a
        return t_a.at[which]
      return a

    rhs = functools.partial(token_operand, t_b=t_b)
    item, info0, my_items = cta_items(ids_ref, sm, num_sms, m=m, k=k, e=e, nb=nb)
    total = my_items * spi

    fetch = step_fetcher(
        refs=dict(ring=ring, ring_w=ring_w, xring=xring, w13=w13_ref, w2=w2_ref, x=x_ref,
                  c13=c13_ref, b13=b13_ref, vec=vec, vbar=vbar, bars1=bars1, bars2=bars2,
                  s2=s2_ref, s2ring=s2ring, sid=sid_ref),
        plan=plan, n=n, k1=k1u, spi=spi, stages=stages, total=total, use_vec=use_vec, h=h,
        interpret=emulate, n_rows=n_rows)

    def load_window(info, w, buf):
      """Small groups: window w's scales [128, 8] for gate and up into buffer buf (from the
      scale array's row sid[slot]: a per-call copy's row for e2m1) -- as bytes windows
      w, w + 1's [128, 16] (a TMA box's rows are 16 bytes at least)."""
      slot_id, _, jb, _ = info
      cols = pl.ds(w * _N, 2 * _N if plan.scale_bytes else _N)
      for c in ops:
        row = c * n_rows + block_start(jb, n, BN)
        plgpu.copy_gmem_to_smem(s13_ref.at[sid_ref[slot_id], pl.ds(row, BN), cols],
                                sblk.at[buf, c], sbar_at(buf))

    def load_blocks(info):
      """The item's scale rows [128, H / group] for gate and up (and zero rows, token
      sums)."""
      slot_id, ex, jb, tok = info
      for c in ops:
        row = c * n_rows + jb * BN
        plgpu.copy_gmem_to_smem(s13_ref.at[ex, pl.ds(row, BN)], sblk.at[c], sbar_at(0))
        if plan.zero13:
          plgpu.copy_gmem_to_smem(z13_ref.at[ex, pl.ds(row, BN)], zblk.at[c], sbar_at(0))
      if plan.zero13:
        plgpu.copy_gmem_to_smem(xs_ref.at[tok], xs_block(), sbar_at(0))

    def xs_block():
      """The token's group sums in SMEM (a copy per warpgroup where two)."""
      return xsblk.at[wgi] if two else xsblk

    if plan.grouped:
      @pl.when(my_items > 0)
      def _first_blocks():
        if plan.small_groups:
          load_window(info0, 0, 0)
        else:
          load_blocks(info0)

    @lead
    def _first_steps():  # the first stages - 1 steps all belong to item 0
      for g in range(stages - 1):
        fetch(jnp.int32(g), jnp.int32(0), info0, info0)

    def slot_read(g, i, cur, nxt) -> None:
      """Ring slot g (a ring counter) is read: it may be refilled (the step stages - 1 on
      goes into slot g - 1's place, read a step ago: where two, once both warpgroups have
      arrived there)."""
      plgpu.commit_smem()  # every warp has read the slot (no wgmma syncs them)
      if not two:
        fetch(g + stages - 1, i, cur, nxt)
        return
      plgpu.barrier_arrive(consumed.at[lax.rem(g, jnp.int32(stages))])

      @lead
      def _refill():
        @pl.when(g > 0)
        def _previous_read():
          plgpu.barrier_wait(consumed.at[lax.rem(g - 1, jnp.int32(stages))])
        fetch(g + stages - 1, i, cur, nxt)

    def window_partials(c, v, w, vb, buf):
      """Window w's accumulator value [128, 8] (column j: group 8w + j) -> its scaled row
      sums."""
      if not plan.grouped:  # one window: column 0 holds the whole dot product
        sc = _cast(vec.at[vb, c][...], plgpu.Layout.WGMMA.reduce(1))
        return jnp.sum(v, axis=1) * sc
      if plan.scale_bytes:  # the pair's first or second 8 bytes a row
        b = _cast(sblk.at[buf, c, :, pl.ds(lax.rem(w, 2) * _N, _N)][...], plgpu.Layout.WGMMA)
        return jnp.sum(v * scale_values(b, plan.scale8), axis=1)
      if plan.small_groups:
        return jnp.sum(v * sblk.at[buf, c][...], axis=1)
      return jnp.sum(v * sblk.at[c, :, pl.ds(w * _N, _N)][...], axis=1)

    def zero_terms():
      """gvec -= sum over groups g of (zero - 8) * scale * sum(x over g), per row: the zero
      points' part of every group at once (whole [128, H / 128] blocks: a window's 8 bytes a
      row have no conflict-free SMEM load) -- or, with bf16 zero rows (`wide_zeros`), a
      window's 8 groups (16 bytes a row) at a time, as window_partials reads the scales."""
      spans = [(j * _N, _N) for j in range(g1 // _N)] if wide_zeros(h) else [(0, g1)]
      for c in ops:
        total = None
        for start, size in spans:
          cols = pl.ds(start, size)
          xsum = lax.broadcast_in_dim(
              _cast(xs_block().at[cols][...], plgpu.Layout.WGMMA.reduce(0)), (BN, size), [1])
          z = zblk.at[c, :, cols][...].astype(jnp.float32)
          if plan.int4:
            z = z - 8.0  # the codes are u - 8: so is the zero
          part = jnp.sum(z * sblk.at[c, :, cols][...] * xsum, axis=1)
          total = part if total is None else total + part
        gvec.at[c][...] = gvec.at[c][...] - total
      plgpu.commit_smem()

    def one_item(i, cur):
      _, nxt = item(i + 1)
      slot_id, _, jb, _ = cur
      vb = lax.rem(i, 2)
      base = i * spi  # the item's first ring slot
      if use_vec:
        plgpu.barrier_wait(vbar.at[vb])
      if plan.grouped and not plan.small_groups:
        plgpu.barrier_wait(sbar_at(0))

      def run_window(w, accumulate: bool):
        # the CTA's windows (bytes: pairs of windows) alternate the two buffers
        per = 2 if plan.scale_bytes else 1
        buf = lax.rem(i * (n_windows // per) + lax.div(w, per), 2)

        def arrived_and_refill():
          plgpu.barrier_wait(sbar_at(buf))
          # the other buffer's windows were summed (and committed) before these: refill it
          @pl.when(w + per < n_windows)
          def _next_window():
            load_window(cur, w + per, 1 - buf)

          @pl.when((w + per >= n_windows) & (i + 1 < my_items))
          def _next_items_window():
            load_window(nxt, 0, 1 - buf)

        if plan.scale_bytes:
          pl.when(lax.rem(w, 2) == 0)(arrived_and_refill)
        elif plan.small_groups:
          arrived_and_refill()

        def mma(acc_g, acc_u):
          @pl.loop(0, window)
          def _step(r8):
            g = base + w * window + r8
            slot = lax.rem(g, jnp.int32(stages))
            plgpu.barrier_wait(bars1.at[slot])
            x_t = rhs(xring.at[slot])
            plgpu.wgmma(acc_g, dequantized(ring.at[slot, 0], 0), x_t)
            plgpu.wgmma(acc_u, dequantized(ring.at[slot, 1], 1), x_t)
            # the register tiles are read: the slot takes a new step (waiting for one step
            # fewer measured the same on the H200: the MMAs' issue is what bounds a step)
            plgpu.wgmma_wait(0)
            fetch(g + stages - 1, i, cur, nxt)

          store_partials(acc_g[...], acc_u[...])

        def store_partials(*vs):
          for c, v in zip(ops, vs):
            p = window_partials(c, v, w, vb, buf)
            gvec.at[c][...] = gvec.at[c][...] + p if accumulate else p
          plgpu.commit_smem()

        def sync_mma():
          def step(r8, accs):
            g, s = ring_pos(base, w * window + r8)  # (a wide slot may span two windows)
            slot = lax.rem(g, jnp.int32(stages))
            at_slot_edge(s, 0, lambda: plgpu.barrier_wait(bars1.at[slot]))
            if plan.wide:
              b = int4_mma.b_tile(xring.at[slot, s], xdt, interpret=emulate)
              tiles = [wide_half(ring.at[slot], c, s, emulate) for c in ops]
              kw = dict(row_bytes=WIDE_ROW_BYTES)
            else:
              b = int4_mma.b_tile(xring.at[slot], xdt, interpret=emulate)
              tiles, kw = [ring.at[slot, c] for c in ops], {}
            accs = tuple(int4_mma.mma(a, t, b, xdt, e2m1=plan.e2m1, interpret=emulate, **kw)
                         for t, a in zip(tiles, accs))
            at_slot_edge(s, 1, lambda: slot_read(g, i, cur, nxt))
            return accs
          zero = _cast(jnp.zeros((BN, _N), jnp.float32), plgpu.Layout.WGMMA)
          store_partials(*lax.fori_loop(0, window, step, (zero,) * len(ops)))

        if plan.sync:
          sync_mma()
        else:
          pl.run_scoped(mma, plgpu.ACC((BN, _N), jnp.float32),
                        plgpu.ACC((BN, _N), jnp.float32))

      run_window(jnp.int32(0), accumulate=False)  # stores, so gvec needs no zeroing
      if n_windows > 1:
        @pl.loop(1, n_windows)
        def _window(w):
          run_window(w, accumulate=True)

      if plan.zero13:
        zero_terms()
      if plan.grouped and not plan.small_groups:  # the scale rows are read: the next item's
        @pl.when(i + 1 < my_items)
        def _next_blocks():
          load_blocks(nxt)

      def gemm2_b_tile():
        """The item's activations from both operands' sums -> GEMM2's B tile in a_smem."""
        vals = []
        for c in range(2):
          v = _cast(gvec.at[c][...], plgpu.Layout.WGMMA.reduce(1))
          if plan.act8:  # the dot products of the token's fp8 values: times its scale
            v = v * xsc_ref[cur[3]]
          if g13_ref is not None:  # nvfp4's global scale of the rows (one per 2N / S rows)
            s_cols = g13_ref.shape[1]
            row = lax.div(c * n_rows + block_start(jb, n, BN), 2 * n_rows // s_cols)
            v = v * g13_ref[cur[1], jnp.minimum(row, s_cols - 1)]  # (padded items: past 2N)
          if plan.has_bias:
            v = v + _cast(vec.at[vb, 2 + c][...], plgpu.Layout.WGMMA.reduce(1))
          vals.append(lax.broadcast_in_dim(v, (BN, _N), [0]))
        a_vec[...] = jnp.max(kernel_activation(act, *vals), axis=1)
        plgpu.commit_smem()
        a = _cast(a_vec[...], plgpu.Layout.WGMMA.reduce(0))
        tile = lax.broadcast_in_dim(a, (ROWS_A, BN), [1])  # f32: masked before the cast
        if plan.small_groups or n % BN or n_rows != n:
          grp = _cast(lax.broadcasted_iota(jnp.int32, (ROWS_A, BN), 1), plgpu.Layout.WGMMA)
        if n % BN:  # a shifted last item: its first rows are the previous item's
          tile = jnp.where(grp >= jb * BN - block_start(jb, n, BN), tile, 0.0)
        if n_rows != n:  # a padded last item: its columns past N are other rows' or TMA's
          tile = jnp.where(grp < n_rows - jb * BN, tile, 0.0)  # zeros (the interpreter's NaN)
        sa = None
        if plan.act8:  # one scale for the item's columns: every row holds them, so a per-row
          amax = jnp.max(jnp.abs(tile), axis=1)  # max is the amax
          sa = jnp.where(amax > 0.0, amax / FP8_MAX, 1.0)
          sa_smem[...] = sa
          tile = jnp.clip(tile / lax.broadcast_in_dim(sa, (ROWS_A, BN), [0]), -FP8_MAX, FP8_MAX)
        if plan.small_groups:  # B column t: the activations of scale column s2_start + t
          row = _cast(lax.broadcasted_iota(jnp.int32, (ROWS_A, BN), 0), plgpu.Layout.WGMMA)
          off = s2_start(jb, n, plan) - block_group(jb, n, BN, plan.group)  # <= 0 at the last items
          tile = jnp.where(grp // plan.group == row + off, tile, 0.0)
        store_b_tile(tile.astype(xdt), a_smem, asum_smem,
                     asum_ref.at[jb, slot_id] if plan.zero2 else None, row_scale=sa)

      meet_all(0)  # (two: both operands' sums are in gvec)
      lead(gemm2_b_tile)
      meet_all(1)  # (two: GEMM2's B tile is in a_smem; gvec was read)
      b2 = int4_mma.b_rows(a_smem, xdt, interpret=emulate) if plan.sync else None

      halves = (wgi,) if two else (0, 1)  # GEMM2's 128-row tiles this warpgroup computes

      def sync_pair(slot, s=0):
        """GEMM2's tiles `halves` (wide: of the slot's step s) on mma.sync -> their rows as
        pair_columns gives them."""
        zero = _cast(jnp.zeros((BH // 2, _N), jnp.float32), plgpu.Layout.WGMMA)
        ys = [int4_mma.mma(zero, ring.at[slot, 2 * s + j], b2, xdt, e2m1=plan.e2m1,
                           interpret=emulate) for j in halves]
        if plan.scale_bytes:  # B column t: scale column s2_start + t, in the box from s2_box
          off = s2_start(jb, n, plan) - s2_box(jb, n, plan, s2_ref.shape[-1])
          out = []
          for j, y in zip(halves, ys):
            b = _cast(s2ring.at[slot, 2 * s + j, :, pl.ds(off, _N)][...], plgpu.Layout.WGMMA)
            out.append(jnp.sum(y * scale_values(b, plan.scale8), axis=1))
          return out
        if plan.small_groups:
          return [jnp.sum(y * s2ring.at[slot, 2 * s + j][...], axis=1)
                  for j, y in zip(halves, ys)]
        return [jnp.max(y, axis=1) for y in ys]  # B's 8 columns are equal

      @pl.loop(0, k2)
      def _gemm2(c):
        g, s = ring_pos(base + k1u, c)
        slot = lax.rem(g, jnp.int32(stages))
        at_slot_edge(s, 0, lambda: plgpu.barrier_wait(bars2.at[slot]))
        if plan.sync:
          ys = sync_pair(slot, s)
          if g2_ref is not None:  # nvfp4's global scale of the rows (one per H / S rows)
            r0, s_cols = block_start(c, h, BH), g2_ref.shape[1]
            ys = [y * g2_ref[cur[1], jnp.minimum(lax.div(r0 + j * (BH // 2),
                                                         h_rows // s_cols), s_cols - 1)]
                  for j, y in zip(halves, ys)]
          at_slot_edge(s, 1, lambda: slot_read(g, i, cur, nxt))
          if two:  # this warpgroup's half of the output row
            half = pl.ds(wgi * (BH // 2), BH // 2)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_row.at[0, half][...] = ys[0]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_row.at[:, half], part_ref.at[
                jb, pl.ds(slot_id, 1), pl.ds(block_start(c, h, BH) + wgi * (BH // 2), BH // 2)])
            return
          store_part_row(o_row, ys, part_ref.at[jb, pl.ds(slot_id, 1),
                                                pl.ds(block_start(c, h, BH), BH)])
          return

        # small groups: B's column t holds group t's activations, weighted by its scales
        ys = pair_columns(lambda: dequantized(ring.at[slot, 0], 0),
                          lambda: dequantized(ring.at[slot, 1], 1), rhs(a_smem), BH // 2,
                          scales=s2ring.at[slot] if plan.small_groups else None)
        fetch(g + stages - 1, i, cur, nxt)
        if plan.act8:  # the intermediate's fp8 values: times the item's scale
          ys = [y * sa_smem[0] for y in ys]
        store_part_row(o_row, ys, part_ref.at[jb, pl.ds(slot_id, 1), pl.ds(block_start(c, h, BH), BH)])

      return nxt

    lax.fori_loop(0, my_items, one_item, info0)
    if two:  # the last slot's reads (every earlier slot's were waited for by its next step)
      @pl.when((wgi == 0) & (total > 0))
      def _last_read():
        plgpu.barrier_wait(consumed.at[lax.rem(total - 1, jnp.int32(stages))])
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [  # after finish's rings and GEMM2's B tile
      plgpu.SMEM((BN,), jnp.float32),  # the activation vector
      plgpu.SMEM((2, BN), jnp.float32),  # gate / up dot products, summed over windows
      plgpu.SMEM((1, BH), jnp.float32),  # a GEMM2 step's output row
      plgpu.SMEM((64,), jnp.float32),  # the activation's sum (every entry)
      plgpu.SMEM((2, 4, BN), jnp.float32),  # per item: channel scales, biases
  ]
  if plan.scale_bytes:  # [buffer, gate / up, rows, two windows' 16 groups] as bytes
    scratch.append(plgpu.SMEM((2, 2, BN, 2 * _N), jnp.uint8))
  elif plan.small_groups:  # [buffer, gate / up, rows, the window's 8 groups]
    scratch.append(plgpu.SMEM((2, 2, BN, _N), jnp.float32))
  elif plan.grouped:
    scratch.append(plgpu.SMEM((2, BN, g1), jnp.float32))
  if plan.zero13:
    zdt = jnp.bfloat16 if wide_zeros(h) else jnp.uint8 if plan.int4 else plan.code
    scratch += [plgpu.SMEM((2, BN, g1), zdt),
                plgpu.SMEM((2, g1) if two else (g1,), jnp.float32)]
  if plan.small_groups:  # GEMM2 steps' scale tiles [(step,) half, 128 rows, 8 groups]
    scratch.append(plgpu.SMEM((stages, 4 if plan.wide else 2, BH // 2, s2_width(plan)),
                              jnp.uint8 if plan.scale_bytes else jnp.float32))
  if plan.act8:
    scratch.append(plgpu.SMEM((ROWS_A,), jnp.float32))
  # scale-block copies a barrier: gate's and up's (and their zero rows, the token sums), or
  # where two each warpgroup its operand's on barriers of its own
  n_blk = (1 + (2 if plan.zero13 else 0)) if two else 2 + (3 if plan.zero13 else 0)
  return finish(body, scratch, plan=plan, stages=stages, tf=(tf_w, tf_x), n_blk=n_blk, xdt=xdt,
                part=(nb, m, h), asum_rows=m, emulate=emulate, num_sms=num_sms,
                interpret=interpret, name="jmoe_moe_decode_wq", two=two)


def finish(body, scratch: list, *, plan: _Plan, stages: int, tf: tuple, n_blk: int, xdt,
           part: tuple, asum_rows: int, emulate: bool, num_sms: int, interpret, name: str,
           two: bool = False):
  """A weight-only decode kernel from its body and its own buffers: puts the buffers both
  kernels share first (the code ring, the token-tile ring, GEMM2's B tile; tf: the code and
  token tiles' SMEM transforms) and adds the barriers (GEMM1 and GEMM2 ring steps, the item
  vectors' two, the scale blocks') and the interpreter's operand buffers; outputs part
  [NB, m, H] f32 (and the activation sums [NB, asum_rows, 8] with w2 zero points)."""
  tf_w, tf_x = tf
  n_vec = (0 if plan.grouped else 2) + (2 if plan.has_bias else 0)  # item vectors' copies
  steps = 2 if plan.wide else 1  # steps a slot
  ring = (plgpu.SMEM((stages, 2 * steps, BN, BK // 8), jnp.int32) if plan.sync else
          plgpu.SMEM((stages, 2, BN, BK), plan.code, transforms=tf_w))
  if plan.wide and not emulate:
    # GEMM1's boxes of two steps [128, 32] (128-byte rows: TMA streams 64-byte rows at ~3.2
    # TB/s, 128-byte ones at ~4.5 on the H200; docs/kernels.md) and GEMM2's [128, 16] tiles
    # in the same slots: a union's members all start at its first byte (Mosaic GPU lays each
    # group out from offset 0; a slot is 32 KiB in both, so slot s is the same bytes)
    ring = plgpu.RefUnion(plgpu.SMEM((stages, 2, BN, 2 * BK // 8), jnp.int32), ring)
  xring = plgpu.SMEM((stages, 2, _N, BK) if plan.wide else (stages, _N, BK), xdt,
                     transforms=tf_x)
  scratch = [ring,  # the code ring
             xring,  # GEMM1 steps' token tiles
             plgpu.SMEM((ROWS_A, BN), xdt, transforms=tf_x),  # the activations: GEMM2's B
             *scratch]
  # TMA copies a slot: GEMM1 gate, up (wide: one 2-step box each, the interpreter's one a
  # step) and token tiles; GEMM2 two tiles a step (and their scale tiles)
  gemm1 = (6 if emulate else 4) if plan.wide else 3
  n_sbar = (2 if plan.small_groups else 1) * (2 if two else 1)
  scratch = scratch + [plgpu.Barrier(num_arrivals=gemm1, num_barriers=stages),
                       plgpu.Barrier(num_arrivals=steps * (4 if plan.small_groups else 2),
                                     num_barriers=stages),
                       plgpu.Barrier(num_arrivals=max(n_vec, 1), num_barriers=2),
                       plgpu.Barrier(num_arrivals=n_blk, num_barriers=n_sbar)]
  if emulate:
    scratch += [plgpu.SMEM((2, BN, BK), xdt), plgpu.SMEM((BK, _N), xdt)]
  if two:  # both warpgroups have read a ring slot; both reached a point of the item
    scratch += [plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=2)]
  out_type = [jax.ShapeDtypeStruct(part, jnp.float32)]
  if plan.zero2:
    out_type.append(jax.ShapeDtypeStruct((part[0], asum_rows, _N), jnp.float32))
  threads = dict(num_threads=2, thread_name="wg") if two else {}
  return _compat.kernel(
      body, out_type=tuple(out_type), scratch_types=scratch, grid=(num_sms,),
      grid_names=("sm",), compiler_params=_compat.compiler_params(approx_math=True),
      interpret=interpret, name=name, **threads)


def unsupported(t: int, k: int, h: int, n: int, act: Activation | str, w13, w2) -> str | None:
  """Why fused_experts_decode_wq cannot take this problem (None: it can): a gated
  activation, <= 128 slots, weight-only int4 / int8 codes with float32 scales per channel or
  per 16 / 32 / 128 along K, no act-order permutation, H a multiple of 1024 (groups of 128)
  and N of 128 -- or, per channel and with groups of 16 / 32 without zero points, H and N
  multiples of 64 (gpt-oss' 2880: padded on mma.sync, `padded_sizes`; else the last item and
  steps shifted back inside them) --, and scale / zero rows whose bytes a TMA copy can move."""
  why = unsupported_codes(t, k, h, n, act, w13, w2, tails=True, act8=True)
  if why is not None:
    return why
  if w13.scheme.zero_point and wide_zeros(h) and not zeros_16bit_ready(w13):
    return (f"zero points at H / 128 = {h // GROUP} (not a multiple of 16: their byte rows "
            "are no TMA box) need their bf16 copy prepared (jmoe.quant.prepare_for_kernels)")
  if max_stages(_plan(w13, w2, False), h) < 2:
    return f"H={h}: the item's scale rows leave shared memory no 2-slot ring"
  return None


def unsupported_format(w13, w2, act: Activation | str, *, groups: tuple,
                       kernel: str = "the decode kernel", act8: bool = False) -> str | None:
  """The weight-only kernels' rules on the format (None: `kernel` takes it): int4 / int8 /
  e2m1 / e4m3 codes with bf16 tokens (act8: also 4-bit codes with fp8 tokens, per-token or
  per-tensor scales), one scheme for w13 and w2, float32 scales (e2m1: its own; e4m3: also
  e8m0) per channel or per one of `groups` along K, zero points with integer codes and groups
  of 128, no act-order permutation, a global scale only for e2m1 (nvfp4), K-major values, a
  gated activation."""
  q = w13.scheme
  if q is None or q.weight_dtype not in _CODE_DTYPES:
    return f"{q}: {kernel} takes int4 / int8 / e2m1 / e4m3 weights"
  if q.act_dtype is not None:
    if not act8:
      return f"{q.name}: {kernel} takes bf16 tokens, not {q.act_dtype} activations"
    if q.act_dtype != "float8_e4m3fn" or q.weight_dtype not in ("int4", "float4_e2m1fn"):
      return (f"{q.name}: {q.act_dtype} activations with {q.weight_dtype} weights ({kernel} "
              "takes fp8 tokens with 4-bit codes, whose values e4m3 holds)")
    if q.act_scale not in ROW_SCALES:
      return (f"{q.name}: act_scale={q.act_scale!r} ({kernel} takes one fp8 scale per token "
              "or per tensor)")
  if w2.scheme != q:
    return "w13 and w2 must share one scheme"
  fp4 = q.weight_dtype == "float4_e2m1fn"
  e8m0 = q.weight_dtype == "float8_e4m3fn" and q.scale_dtype == "float8_e8m0fnu"
  if q.scale_dtype != "float32" and not (fp4 or e8m0):
    return f"{q.name}: {q.scale_dtype} scales ({kernel} takes float32)"
  grouped = q.weight_scale == "group"
  if not (q.weight_scale == "channel" and not fp4 or (grouped and q.group_size in groups)):
    return (f"{q.name}: scales per {q.weight_scale} {q.group_size or ''} ({kernel} takes "
            f"per-channel, or groups of {', '.join(map(str, groups))})")
  if q.zero_point and not (grouped and q.group_size == GROUP and "int" in q.weight_dtype):
    return f"{q.name}: zero points need scales per {GROUP} and integer codes"
  if w13.perm is not None or w2.perm is not None:
    return f"act-order (perm): {kernel} reads K in stored order"
  if (w13.global_scale is not None or w2.global_scale is not None) and not fp4:
    return "a global scale"
  if not (w13.k_major and w2.k_major):
    return "values must be K-major"
  if not as_activation(act).is_gated:
    return f"{as_activation(act).name}: {kernel} takes gated activations"
  return None


def unsupported_codes(t: int, k: int, h: int, n: int, act: Activation | str, w13,
                      w2, *, tails: bool = False, act8: bool = False) -> str | None:
  """`unsupported`'s rules on the format and the sizes, without its shared-memory ones (tails:
  decode_wq's shifted last item and steps, for sizes 128 does not divide; act8: its fp8
  tokens)."""
  why = unsupported_format(w13, w2, act, groups=GROUPS, act8=act8)
  if why is not None:
    return why
  q = w13.scheme
  grouped = q.weight_scale == "group"
  if t * k > MAX_SLOTS:
    return f"{t * k} slots (the decode kernel takes at most {MAX_SLOTS})"
  if tails and not q.zero_point and (not grouped or q.group_size < BN):
    if h % 64 or n % 64 or h < BH or n < BN:
      return f"H={h} and N={n} must be multiples of 64, H >= {BH} and N >= {BN}"
  else:
    step = max(q.group_size * _N, BH) if grouped else BH  # a window of 8 groups; GEMM2's step
    if n % BN or h % step:
      return f"H={h} must be a multiple of {step} and N={n} of {BN}"
  if grouped and q.group_size < BN and n < _N * q.group_size:
    return f"N={n}: groups of {q.group_size} need N >= {_N * q.group_size} (GEMM2's 8 scales)"
  return None


def code_values(codes: jax.Array, plan: _Plan, xdt, *, interpret: bool = False) -> jax.Array:
  """A register tile of codes -> the MMA dtype xdt: e2m1 values / E2M1_UNIT (the scales carry
  the factor), e4m3 values exactly, int4 / int8 as the integers (int4: the stored signed
  nibbles are u - 8)."""
  if plan.e2m1:
    return e2m1_tile(codes, xdt, interpret=interpret)
  if plan.fp8:
    return fp8_codes_tile(codes, xdt)
  return codes.astype(xdt)


SYNC_4BIT = True  # 4-bit codes with 16-bit tokens on mma.sync (benchmarks may switch it off)
WIDE_ROWS = True  # mma.sync plans on wide slots where sizes allow (benchmarks may switch it off)
SCALE_BYTES = True  # 8-bit small-group scales read as bytes in the kernel (likewise)
PAD_TAILS = True  # mma.sync plans pad sizes 128 does not divide (`padded_sizes`; likewise)
TWO_WG = True  # mma.sync plans on two compute warpgroups (`two_warpgroups`; likewise)


def two_warpgroups(plan: _Plan) -> bool:
  """decode_wq's mma.sync form runs each item on two warpgroups: GEMM1's gate on one and up
  on the other (each its own accumulator, scale windows and barriers), GEMM2's two 128-row
  tiles one each, the first also issuing the ring's TMA (once both have read a slot: a
  barrier of two arrivals per slot) and computing the activation between two meeting points.
  A step's conversion and 32 mma.sync were one warpgroup's 4 warps' work; split, the decode
  kernel runs 8-12 % faster for mxfp4 and 2-5 % for w4a16 (H100, 2026-12-07)."""
  return TWO_WG and plan.sync
PAD_ALL_BYTES = 32 << 20  # byte scales: pad every expert's w2 rows per call up to this size


def sync_eligible(plan: _Plan) -> bool:
  """decode_wq runs 4-bit codes (int4, e2m1) with bf16 / f16 tokens on `int4_mma` (mma.sync,
  the codes as int32 words; shifted tails as the wgmma form's, by whole words)."""
  return SYNC_4BIT and plan.int4 and not plan.act8


def padded_sizes(plan: _Plan, h: int, n: int) -> tuple[int, int]:
  """The kernel's geometry (H, N) for weights of sizes (h, n). Where 128 does not divide them
  (gpt-oss: 2880) and the codes run on mma.sync (`sync_eligible`) without zero points, H
  rounded up to 512 and N to 128: the steps, items and output rows past the weights read
  TMA's zero fill for codes (the token tiles and scale copies are padded with zeros, the
  items' columns past N masked, the part rows past H dropped), so the wide slots and byte
  scales take them -- instead of a last step and item shifted back inside the arrays, on one
  step a slot with float32 scale copies (the wgmma form keeps that). Else (h, n)."""
  if not (PAD_TAILS and sync_eligible(plan) and (h % BK or n % BN)):
    return h, n
  if plan.zero13 or plan.zero2 or (plan.grouped and not plan.small_groups):
    return h, n
  return padded_h(h), -(-n // BN) * BN


def padded_h(h: int) -> int:
  """H as `padded_sizes` pads it: rounded up to 512 (whole wide slots)."""
  return -(-h // WIDE_H) * WIDE_H


def kernel_plan(plan: _Plan, h: int, n: int, ctas_per_sm: int = 1) -> _Plan:
  """decode_wq's form of `plan` (`_plan`'s facts of the weights) for weights of sizes H, N:
  4-bit codes with 16-bit tokens on mma.sync (`sync_eligible`), on wide slots where
  `wide_eligible` at the kernel's sizes (`padded_sizes`) and two of them fit a CTA's shared
  memory."""
  if not sync_eligible(plan):
    return plan
  hk, nk = padded_sizes(plan, h, n)
  plan = dataclasses.replace(plan, sync=True)
  if scale_bytes_eligible(plan, hk, nk, sizes=(h, n)):
    plan = dataclasses.replace(plan, scale_bytes=True)
  wide = dataclasses.replace(plan, wide=True)
  return wide if wide_eligible(plan, hk, nk) and max_stages(wide, hk, ctas_per_sm) >= 2 else plan


def scale_bytes_eligible(plan: _Plan, h: int, n: int,
                         sizes: tuple[int, int] | None = None) -> bool:
  """Small groups' e8m0 / e4m3 scales read as bytes by the mma.sync kernel instead of float32
  copies made per call: at the kernel's sizes h, n (`padded_sizes`; `sizes`: the weights')
  no tails (128 dividing H and N), whole pairs of windows (H a multiple of 16 groups), and,
  for global scales, one per 128-row block."""
  h_rows, n_rows = sizes or (h, n)
  one_per_block = ((plan.global13 <= 1 or (2 * n_rows // plan.global13) % BN == 0)
                   and (plan.global2 <= 1 or (h_rows // plan.global2) % BN == 0))
  return (SCALE_BYTES and plan.sync and plan.small_groups and plan.scale8 is not None
          and h % BK == 0 and n % BN == 0 and (h // plan.group) % 16 == 0 and one_per_block)


def byte_scales(w) -> bool:
  """The stored scales are 8-bit floats (e8m0 / e4m3: mxfp4, nvfp4, mxfp8), which the kernels
  read as bytes, or as float32 copies made per call (`slot_rows`)."""
  return jnp.dtype(w.scale.dtype).itemsize == 1


def _plan(w13, w2, has_bias: bool) -> _Plan:
  q = w13.scheme
  grouped = q.weight_scale == "group"
  scale8 = None
  if byte_scales(w13):  # the scheme's scale format (the bytes are read as its bits)
    kind = jnp.dtype(q.scale_dtype)
    if kind not in (jnp.dtype(jnp.float8_e8m0fnu), jnp.dtype(jnp.float8_e4m3fn)):
      raise ValueError(f"{q.name}: 8-bit scales must be e8m0 or e4m3, not {kind}")
    scale8 = "e8m0" if kind == jnp.dtype(jnp.float8_e8m0fnu) else "e4m3"
  return _Plan(code=_CODE_DTYPES[q.weight_dtype], grouped=grouped,
               zero13=w13.zero is not None, zero2=w2.zero is not None, has_bias=has_bias,
               e2m1=q.weight_dtype == "float4_e2m1fn",
               group=q.group_size if grouped else GROUP,
               act8=q.act_dtype == "float8_e4m3fn", scale8=scale8,
               global13=0 if w13.global_scale is None else w13.global_scale.shape[1],
               global2=0 if w2.global_scale is None else w2.global_scale.shape[1])


def _codes(w, code) -> jax.Array:
  """values as the kernel's code array [E, N, K] (int4: the packed bytes viewed as nibbles,
  low nibble first, as jmoe.quant.packing stores them)."""
  if code == jnp.dtype(jnp.int4):
    e, r, half = w.values.shape
    return view_4bit(w.values).reshape(e, r, 2 * half)
  return w.values


def _token_tiles(x: jax.Array, grouped: bool, group: int = GROUP,
                 k1: int | None = None, shifted: bool = True) -> jax.Array:
  """x [T, H] -> the B rows [T * 8, k1 * 128] of GEMM1's k1 steps: row j of a token keeps the
  columns of the groups g with g % 8 == j (grouped), or row 0 keeps all (per channel). Where
  128 does not divide H and the last step is `shifted`, the last real step's tile ends with
  H's last H % 128 columns and starts with zeros (its codes are H's last 128: `block_start`);
  steps past it (all steps past H where not shifted: `padded_sizes`) are zeros."""
  t, h = x.shape
  j = jnp.arange(_N)[:, None]
  keep = (jnp.arange(h)[None, :] // group) % _N == j if grouped else jnp.broadcast_to(
      j == 0, (_N, h))
  tiles = jnp.where(keep[None], x[:, None, :], 0).reshape(t * _N, h)
  width = (k1 or -(-h // BK)) * BK
  if width == h:
    return tiles
  if not shifted:
    return _padded_last(tiles, width)
  full = h // BK * BK
  zeros = lambda c: jnp.zeros((t * _N, c), x.dtype)  # noqa: E731
  parts = [tiles[:, :full]] + ([zeros(BK - (h - full)), tiles[:, full:]] if h > full else [])
  used = full + (BK if h > full else 0)
  return jnp.concatenate(parts + ([zeros(width - used)] if width > used else []), axis=1)


def slot_rows(ids: jax.Array, e: int) -> tuple[jax.Array, jax.Array]:
  """(the experts whose rows a per-call scale copy gathers, the copy's row of each slot): one
  row per slot (an empty slot's: expert 0's, unread). decode_wq's slots rarely share an
  expert, and this is one gather fusion where the distinct experts' (`touched_experts`: a
  sort, a search and their gathers) were ~10 launches, 27 µs of gpt-oss' one-token block on
  an H100."""
  return jnp.clip(ids, 0, e - 1), jnp.arange(ids.shape[0], dtype=jnp.int32)


def float_scales(w, experts: jax.Array) -> jax.Array:
  """The scales of w's `experts` (any scale dtype) as float32 in their stored layout
  [len(experts), rows, K / group], times the global scale (nvfp4: per row)."""
  s = w.scale[experts].astype(jnp.float32)
  if w.global_scale is not None:  # [E, S] along the rows (storage axis 1)
    g = w.global_scale[experts].astype(jnp.float32)
    s = s * jnp.repeat(g, s.shape[1] // g.shape[1], axis=1)[:, :, None]
  return s


def padded_byte_columns(cols: int) -> int:
  """Byte-scale columns padded to TMA's 16-byte row pitch."""
  return -(-cols // 16) * 16


# w2's byte scales with their rows padded (jmoe.kernels.prepared: kept where prepared)
def _byte_scale_operand(key: str, columns) -> Operand:
  """The stored 8-bit scales as bytes, their rows zero-padded to columns(w)."""
  return Operand(key, lambda w: _padded_last(lax.bitcast_convert_type(w.scale, jnp.uint8),
                                             columns(w)))


W2_SCALE_BYTES = _byte_scale_operand(
    "decode_wq.w2_scale_bytes", lambda w: padded_byte_columns(w.scale.shape[-1]))
# w13's: to the padded H's windows (gpt-oss: 2880 -> 3072), a multiple of 16 bytes by
# scale_bytes_eligible
W13_SCALE_BYTES = _byte_scale_operand(
    "decode_wq.w13_scale_bytes",
    lambda w: padded_byte_columns(padded_h(w.shape[1]) // w.scheme.group_size))


def wide_zeros(h: int) -> bool:
  """w13's zero points cross as bf16 (`W13_ZERO_16`): their H / 128 bytes a row are not a
  multiple of TMA's 16 (deepseek-v3: 56); as bf16 they are (H is a multiple of 1024)."""
  return (h // GROUP) % 16 != 0


# w13's zero points as bf16 [E, 2N, H / 128] (the integers exactly): where `wide_zeros`
W13_ZERO_16 = Operand("decode_wq.w13_zero_bf16", lambda w: w.zero.astype(jnp.bfloat16))


def zeros_16bit_ready(w13) -> bool:
  """decode_wq may take these zero points as bf16 rows: prepared, or small enough to convert
  every expert's per call (deepseek-v3's 59 MB are not: 176 MB moved a call)."""
  return (W13_ZERO_16.key in (w13.prepared or {})
          or w13.zero is not None and 2 * w13.zero.size <= PAD_ALL_BYTES)


def _padded_last(a: jax.Array, size: int) -> jax.Array:
  """a with its last axis zero-padded to size."""
  return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, size - a.shape[-1])])


# w2's scales per 128 along N as [E, N / 128, H] float32: the reduction multiplies part row
# (j, s) by expert e's scales of group j over H, so this layout reads them contiguously. The
# stored [E, H, N / 128] has a stride of N / 128 values there: on an H200 that fusion took 6.6
# us at mixtral one token against 2.5 for parts already scaled. Made only by
# prepare_for_kernels (per call it would transpose every expert's scales).
W2_SCALE_T = Operand("decode_wq.w2_scale_t",
                     lambda w: jnp.swapaxes(w.scale, 1, 2).astype(jnp.float32))


def reduction_scales(w2) -> bool:
  """Whether the reduction after the kernel applies w2's scales per group (groups of 128
  along N: one item's columns; smaller groups are the kernel's, per-channel ones one row)."""
  q = w2.scheme
  return q.weight_scale == "group" and q.group_size >= BN


def _w2_scaled(part, asum, ids, w2, plan: _Plan, e: int) -> jax.Array:
  """part [NB, m, H] (unscaled w2 codes' dot products) -> scaled by w2's scales (and its zero
  points' term), read for each slot's expert: from the prepared [E, N / 128, H] copy
  (`W2_SCALE_T`) where w2 carries it, else in their stored [E, H, N / 128] layout."""
  safe = jnp.where((ids >= 0) & (ids < e), ids, 0)
  if plan.grouped and W2_SCALE_T.key in (w2.prepared or {}):
    s2 = jnp.moveaxis(operand(w2, W2_SCALE_T)[safe], 1, 0)  # [G2, m, H]
  else:
    s2 = jnp.moveaxis(w2.scale[safe].astype(jnp.float32), 2, 0)  # [G2, m, H]
  if not plan.grouped:
    return part * s2  # [1, m, H] broadcast over the blocks
  if plan.zero2:
    z = jnp.moveaxis(w2.zero[safe].astype(jnp.float32), 2, 0)
    if plan.int4:
      z = z - 8.0
    part = part - z * asum[:, :, :1]
  return part * s2


def checked_call(x, w13, w2, topk_weights, topk_ids, act: Activation, w13_bias, w2_bias,
                 config: DecodeWQConfig | None, *, kernel: str, why, stage_cap):
  """A weight-only decode kernel's arguments checked (shapes, dtypes, `why`'s rules, the
  biases, the quantized weights) -> (T, k, E, N, H, plan, ring stages, CTAs per SM), raising
  ValueError that names the argument or the rule."""
  t, k = topk_ids.shape
  e, n2, h = w13.shape[0], w13.shape[2], w13.shape[1]
  n = n2 // 2
  if x.shape != (t, h) or tuple(w2.shape) != (e, n, h):
    raise ValueError(f"shapes: x {x.shape} (want ({t}, {h})), w2 {tuple(w2.shape)} "
                     f"(want ({e}, {n}, {h}))")
  if topk_weights.shape != (t, k):
    raise ValueError(f"topk_weights must have shape ({t}, {k}) like topk_ids, got "
                     f"{topk_weights.shape}")
  reason = why(t, k, h, n, act, w13, w2)
  if reason is not None:
    raise ValueError(f"{kernel}: {reason}")
  if w13.scheme.act_dtype is not None:
    if jnp.dtype(x.dtype) != FP8:
      raise ValueError(f"x dtype {x.dtype}: {w13.scheme.name} takes prepare's float8_e4m3fn "
                       "tokens (jmoe.quant.quantize_activations)")
  elif jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"x dtype {x.dtype}: bfloat16 or float16")
  if w13_bias is not None and w13_bias.shape != (e, n2):
    raise ValueError(f"w13_bias must have shape ({e}, {n2}), got {w13_bias.shape}")
  if w2_bias is not None and w2_bias.shape != (e, h):
    raise ValueError(f"w2_bias must have shape ({e}, {h}), got {w2_bias.shape}")
  for name, w in (("w13", w13), ("w2", w2)):
    check_quantized(w, argname=name)
  plan = _plan(w13, w2, w13_bias is not None)
  config = config or DecodeWQConfig()
  hk = h
  if kernel == "fused_experts_decode_wq":
    plan = kernel_plan(plan, h, n, config.ctas_per_sm)
    hk = padded_sizes(plan, h, n)[0]
  cap = stage_cap(plan, hk, config.ctas_per_sm)
  stages = config.stages or min(cap, ring_slots(hk, plan))
  if stages > cap or stages < 2:
    raise ValueError(f"stages={stages} does not fit shared memory at H={h} with "
                     f"ctas_per_sm={config.ctas_per_sm} (at most {cap})")
  return t, k, e, n, h, plan, stages, config.ctas_per_sm


@functools.partial(jax.jit, static_argnames=("activation", "config", "out_dtype", "interpret"))
def fused_experts_decode_wq(x: jax.Array, w13, w2, topk_weights: jax.Array,
                            topk_ids: jax.Array, *, activation: Activation | str = "silu",
                            w13_bias: jax.Array | None = None,
                            w2_bias: jax.Array | None = None, out_dtype=None,
                            config: DecodeWQConfig | None = None,
                            interpret: Any = False,
                            x_scale: jax.Array | None = None) -> jax.Array:
  """The weight-only decode block: out[t] = sum_j topk_weights[t, j] * (act(x[t] @ dq(w13[e])
  + b13[e]) @ dq(w2[e]) + b2[e]), e = topk_ids[t, j], dq = jmoe.quant.dequantize.

  x [T, H] bf16 / f16; w13 / w2 jmoe.quant.QuantizedWeights of one weight-only int4 / int8 /
  e2m1 scheme (w4a16, w8a16, mxfp4, nvfp4; K-major values [E, 2N, H] / [E, H, N], 4-bit
  packed [E, 2N, H/2] / [E, H, N/2]; scales per channel or per 16 / 32 / 128 along K; zero
  points with groups of 128) -- or, for 4-bit codes with fp8 tokens (mxfp4_fp8, nvfp4_fp8,
  w4afp8), x [T, H] float8_e4m3fn and x_scale [T, 1] / [1, 1] f32 (prepare's
  jmoe.quant.quantize_activations), the intermediate quantized per item of 128 columns;
  topk_weights / topk_ids [T, k] (-1 or >= E: empty slot), T * k <= 128; biases f32
  [E, 2N] / [E, H]. `unsupported` says which sizes. Returns [T, H] (out_dtype, default
  x.dtype; bf16 for fp8 tokens).
  """
  act = as_activation(activation)
  t, k, e, n, h, plan, stages, ctas = checked_call(
      x, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias, config,
      kernel="fused_experts_decode_wq", why=unsupported, stage_cap=max_stages)
  if plan.act8 != (x_scale is not None):
    raise ValueError(f"x_scale: {w13.scheme.name} " + (
        "needs the fp8 tokens' scales [T, 1] or [1, 1]" if plan.act8 else
        "has bf16 tokens; x_scale is for fp8 ones"))
  if plan.act8 and x_scale.shape not in ((t, 1), (1, 1)):
    raise ValueError(f"x_scale must be per-token [{t}, 1] or per-tensor [1, 1], got "
                     f"{x_scale.shape}")
  m = t * k
  ids = topk_ids.reshape(m).astype(jnp.int32)
  interp, nsm = _compat.launch_params(interpret)
  hk, nk = padded_sizes(plan, h, n)
  kern = _build(h=hk, n=nk, m=m, k=k, e=e, xdt=x.dtype, act=act, plan=plan, stages=stages,
                num_sms=nsm * ctas, interpret=interp,
                sizes=None if (hk, nk) == (h, n) else (h, n))
  k1 = k1_steps(hk, plan)
  if plan.scale_bytes:  # the stored bytes, by expert, where their row pitch is a multiple of
    # 16 bytes and the kernel's windows end with them; else padded (w2: qwen3 mxfp4's 24
    # bytes a row; w13 and w2: gpt-oss' 90): prepared, or every expert's in one pad fusion
    # each where those copies are small, else each slot's expert's (`slot_rows`)
    stored = [lax.bitcast_convert_type(w.scale, jnp.uint8) for w in (w13, w2)]
    cols = (hk // plan.group, max(padded_byte_columns(stored[1].shape[-1]), s2_width(plan)))
    ops = (W13_SCALE_BYTES, W2_SCALE_BYTES)
    pads = [c != a.shape[-1] for a, c in zip(stored, cols)]
    by_expert = all(not pad or op.key in (w.prepared or {})
                    or a.size // a.shape[-1] * c <= PAD_ALL_BYTES
                    for pad, op, w, a, c in zip(pads, ops, (w13, w2), stored, cols))
    sid = jnp.clip(ids, 0, e - 1)
    if by_expert:
      s13, s2 = (operand(w, op) if pad else a
                 for pad, op, w, a in zip(pads, ops, (w13, w2), stored))
    else:
      rows, sid = slot_rows(ids, e)
      s13, s2 = (_padded_last(a[rows], c) for a, c in zip(stored, cols))
    args = [ids, sid]
  elif plan.small_groups and (byte_scales(w13) or h % BK or n % BN):  # float32 scales per
    rows, sid = slot_rows(ids, e)  # call: each slot's expert's (padded: windows past H get
    # zero scales; w2's, s2_columns; e4m3 tiles and mma.sync's hold the e2m1 values)
    unit = E2M1_UNIT if plan.e2m1 and not (plan.act8 or plan.sync) else 1.0
    s13 = _padded_last(float_scales(w13, rows) * unit, k1 * BK // plan.group)
    s2 = float_scales(w2, rows) * unit
    s2 = _padded_last(s2, s2_columns(n, plan)) if n % BN else s2  # (padded N: s2_start's
    # columns end by N / g rounded up to 4, plus 4)
    args = [ids, sid]
  elif plan.small_groups:  # float32 already: the stored arrays, by expert
    s13, s2 = w13.scale, w2.scale
    args = [ids, jnp.clip(ids, 0, e - 1)]
  else:
    args = [ids]
  if plan.act8:
    args.append(jnp.broadcast_to(x_scale.astype(jnp.float32).reshape(-1), (t,)))
  shifted = (hk, nk) == (h, n)
  if plan.sync:
    args += [int4_mma.fragment_tiles(_token_tiles(x, plan.grouped, plan.group, k1, shifted)),
             int4_mma.code_words(w13.values), int4_mma.code_words(w2.values)]
  else:
    args += [_token_tiles(x, plan.grouped, plan.group, k1), _codes(w13, plan.code),
             _codes(w2, plan.code)]
  if plan.small_groups:
    args.append(s13)
  elif plan.grouped:
    args.append(w13.scale.astype(jnp.float32))
  else:
    args.append(w13.scale[:, :, 0].astype(jnp.float32))
  if plan.zero13:
    xg = x.astype(jnp.float32).reshape(t, h // GROUP, GROUP).sum(-1)  # [T, H / 128]
    args += [operand(w13, W13_ZERO_16) if wide_zeros(h) else w13.zero, xg]
  if plan.has_bias:
    args.append(w13_bias.astype(jnp.float32))
  if plan.small_groups:
    args.append(s2)
  if plan.scale_bytes:  # nvfp4's global scales, applied by the kernel per item
    args += [w.global_scale.astype(jnp.float32) for w in (w13, w2) if w.global_scale is not None]
  outs = kern(*args)
  part, asum = (outs[0], outs[1]) if plan.zero2 else (outs[0], None)
  part = part[:, :, :h]  # (padded_sizes: the rows past H read TMA's zeros)
  if not plan.small_groups:  # small groups: scaled in the kernel
    part = _w2_scaled(part, asum, ids, w2, plan, e)
  return combine_parts(part, ids, topk_weights, w2_bias, num_experts=e,
                       out_dtype=out_dtype or (jnp.bfloat16 if plan.act8 else x.dtype))
