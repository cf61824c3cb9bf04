"""4-bit code tiles (int4, or e2m1: mxfp4 / nvfp4 values) x a 16-bit B operand on the
warp-level MMA (PTX `mma.sync` m16n8k16), for the weight-only decode kernel (`decode_wq`'s
4-bit forms with bf16 / f16 tokens).

Why not Mosaic's wgmma with a register A tile: N = 8 register-A wgmma m64n8k16 cost ~10 ns a
warpgroup on the H200 against ~6 ns for the same work as four mma.sync, and Mosaic's int4 ->
bf16 upcast of an SMEM tile loaded in the WGMMA layout adds ~17 ns per 1024 codes (one-off
probe, 2026-12-03: docs/kernels.md, "Weight-only decode"), so a step ran at a third of the
packed-weight floor. Here each thread loads its codes as 32-bit words (one 16-byte load per
row and step) and converts a word of 8 codes with 3 shifts, 4 `lop3` and 4 packed `fma`
(the magic-number trick: code bits ORed into the mantissa of 128.0, then 136 subtracted; the
XOR with 8 that reads the stored signed nibbles u - 8 is folded into the lop3). e2m1 codes take
7 shifts, 4 ands, 4 lop3 and 4 packed multiplies a word: each code's exponent-mantissa bits
move to the 16-bit type's lowest exponent bits and top mantissa bit, its sign to bit 15 --
the number value x 2^-126 (bf16) or 2^-14 (f16), e2m1's subnormal 0.5 on the type's own
subnormals -- and a multiply by 2^126 / 2^14 makes it the value (exactly; e2m1 has no code the
16-bit types lack).

The words are not in the MMA's fragment order, so the contraction runs in a *logical* order
of K inside every 128-column step: a thread's word j of a row is its part of logical columns
32j..32j+31 (`PERM[logical] = physical`), a bijection within the step -- scale groups of 16 /
32 / 128 stay whole when B carries them (decode_wq masks the token per group in B's columns).
B is therefore given by physical K: `fragment_tiles` reorders the token tiles (XLA, before the
kernel) so that each thread's 16 B registers are 64 contiguous bytes (four conflict-free
16-byte loads, `b_tile`), and `b_rows` gathers GEMM2's activations from an SMEM row per
column once per item.

Layouts (GPU): the accumulator is Mosaic's WGMMA layout [128, 8] f32 (warp w, lane 4g + q:
rows 64 mi + 16 w + g (+ 8), columns 2q, 2q + 1 -- mma.sync's C fragment); a code tile is an
SMEM [128, 16] int32 tile with no swizzle (64-byte rows; a warp's 16-byte loads of two rows
per quarter fill one 128-byte wavefront); B travels between the calls as a carrier array
[64, 64] of the 16-bit dtype in the WGMMA layout whose 16 registers a thread are its B
fragments, not those elements. Interpret mode (no inline PTX) computes the same products
with jnp on B by physical K [128, 8] f32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from jmoe.kernels.e2m1 import E2M1_VALUES

BLOCK = 128  # K of a code tile (a step)
WORDS = BLOCK // 8  # int32 words of 8 codes in a tile row
ROWS = 128  # rows of a code tile (the accumulator's)
_N = 8  # B's columns
_CARRIER = (64, 64)  # the B carrier's shape: 16 registers of 2 values a thread
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 " \
       "{{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, {{$8,$9}}, {{$10,$11,$12,$13}};"
# per 16-bit dtype: the magic word (128.0 or 1024.0 with the XOR-8 bit), one, -(magic + 8)
_MAGIC = {"bf16": (0x43084308, 0x3F803F80, 0xC308C308),
          "f16": (0x64086408, 0x3C003C00, 0xE408E408)}
# e2m1 per 16-bit dtype: (where a code's 3 exponent-mantissa bits go: its lowest bit's
# position, the mask of both halves; the multiplier 2^126 / 2^14 in both halves)
_E2M1 = {"bf16": (6, 0x01C001C0, 0x7E807E80), "f16": (9, 0x0E000E00, 0x74007400)}
_E2M1_VALUES = np.asarray(E2M1_VALUES)  # by a code's 3 low bits
# accumulators (dependency chains) per 16-row block in `mma`: 2, 4 or 8 (a power of two)
CHAINS = 2


def _perm() -> np.ndarray:
  """PERM[logical k] = physical k within a step: thread q's word j, nibble i (physical 32q +
  8j + i) is logical 32j + 8 (i % 4) + 2q + i // 4 (the pairs (i, i + 4) of a lop3 make one
  fragment register)."""
  p = np.empty(BLOCK, np.int32)
  for q in range(4):
    for j in range(4):
      for i in range(8):
        p[32 * j + 8 * (i % 4) + 2 * q + i // 4] = 32 * q + 8 * j + i
  return p


PERM = _perm()


def _fragment_source() -> np.ndarray:
  """Flat position f of a fragment-ordered [8, 128] token block -> its source n * 128 +
  physical k: f = 256 c + 8 lane + 2 w + e holds lane 4n + q's register r = 4c + w (k16 block
  r // 2, half r % 2: logical k = 16 (r // 2) + 8 (r % 2) + 2q + e)."""
  f = np.arange(_N * BLOCK)
  c, lane, w, e = f // 256, (f // 8) % 32, (f // 2) % 4, f % 2
  n, q = lane // 4, lane % 4
  r = 4 * c + w
  klog = 16 * (r // 2) + 8 * (r % 2) + 2 * q + e
  return (n * BLOCK + PERM[klog]).astype(np.int32)


FRAGMENT_SOURCE = _fragment_source()
# In those terms the source is physical k = 32q + 8c + 4e + w: the fragment order is the
# transpose of a block [n, q, c, e, w] to [c, n, q, w, e] (a permutation, no gather).
_PHYS_AXES = (8, 4, 4, 2, 4)  # a physical [8, 128] block as [n, q, c, e, w]
_TO_FRAGMENT = (2, 0, 1, 4, 3)  # -> [c, n, q, w, e]
_FROM_FRAGMENT = (1, 2, 0, 4, 3)  # [c, n, q, w, e] -> [n, q, c, e, w]


def fragment_tiles(tiles: jax.Array) -> jax.Array:
  """Token rows [R, K] (8 rows = B's columns per token, K a multiple of 128) -> the same shape,
  each [8, 128] block (a TMA box of one step) in the order `b_tile` reads."""
  r, kk = tiles.shape
  if r % _N or kk % BLOCK:
    raise ValueError(f"tiles {tiles.shape}: rows a multiple of {_N}, columns of {BLOCK}")
  t, s = r // _N, kk // BLOCK
  blk = tiles.reshape(t, _N, s, BLOCK).transpose(0, 2, 1, 3).reshape(t, s, *_PHYS_AXES)
  blk = blk.transpose(0, 1, *(2 + a for a in _TO_FRAGMENT))
  return blk.reshape(t, s, _N, BLOCK).transpose(0, 2, 1, 3).reshape(r, kk)


def code_words(values: jax.Array) -> jax.Array:
  """Packed int4 values [..., K / 2] uint8 (low nibble first) -> [..., K / 8] int32 words
  (code 8c + i at bits 4i of word c): a bitcast."""
  *lead, half = values.shape
  if half % 4:
    raise ValueError(f"packed int4 values {values.shape}: K / 2 must be a multiple of 4")
  return jax.lax.bitcast_convert_type(values.reshape(*lead, half // 4, 4), jnp.int32)


def _dtype_key(xdt) -> str:
  dt = jnp.dtype(xdt)
  if dt == jnp.dtype(jnp.bfloat16):
    return "bf16"
  if dt == jnp.dtype(jnp.float16):
    return "f16"
  raise ValueError(f"int4 mma.sync takes bf16 / f16 operands, not {dt}")


def _convert_asm(key: str) -> str:
  """$4: a word of 8 codes (signed nibbles) -> $0..$3: 16-bit pairs of codes (0, 4), (1, 5),
  (2, 6), (3, 7). lop3 0x6A = b ? a ^ c : c with b the nibble mask and c the magic word (its
  bit 3 of each half flips the nibble's sign bit: u - 8 + 8 = u)."""
  magic, one, sub = _MAGIC[key]
  t = key + "x2"
  lines = ["{", ".reg .b32 s1, s2, s3, one, sub;", f"mov.b32 one, {one};",
           f"mov.b32 sub, {sub};", "shr.u32 s1, $4, 4;", "shr.u32 s2, $4, 8;",
           "shr.u32 s3, $4, 12;"]
  for out, src in zip(("$0", "$1", "$2", "$3"), ("$4", "s1", "s2", "s3")):
    lines.append(f"lop3.b32 {out}, {src}, 0x000f000f, {magic}, 0x6a;")
  for out in ("$0", "$1", "$2", "$3"):
    lines.append(f"fma.rn.{t} {out}, {out}, one, sub;")
  lines.append("}")
  return "\n".join(lines)


def _shift(dst: str, src: str, left: int) -> str:
  if left == 0:
    return f"mov.b32 {dst}, {src};"
  return f"shl.b32 {dst}, {src}, {left};" if left > 0 else f"shr.u32 {dst}, {src}, {-left};"


def _e2m1_asm(key: str) -> str:
  """$4: a word of 8 e2m1 codes -> $0..$3: 16-bit pairs of the values of codes (0, 4), (1, 5),
  (2, 6), (3, 7). Pair i: the magnitude bits 4i..4i+2 (and 4i+16..) shifted to the type's
  `low` bit and masked, the sign bit 4i+3 (4i+19) shifted to 15 (31) and merged by a lop3
  (0xEA = a & b | c), then the multiply by 2^126 / 2^14 (adding -0: exact, signs kept)."""
  low, mask, mult = _E2M1[key]
  t = key + "x2"
  lines = ["{", ".reg .b32 m0, m1, m2, m3, s0, s1, s2, s3, mul, neg0;",
           f"mov.b32 mul, {mult};", "mov.b32 neg0, 0x80008000;"]
  for i in range(4):
    lines += [_shift(f"m{i}", "$4", low - 4 * i), _shift(f"s{i}", "$4", 12 - 4 * i),
              f"and.b32 m{i}, m{i}, {mask:#010x};"]
  for i in range(4):
    lines.append(f"lop3.b32 ${i}, s{i}, 0x80008000, m{i}, 0xea;")
  for i in range(4):
    lines.append(f"fma.rn.{t} ${i}, ${i}, mul, neg0;")
  lines.append("}")
  return "\n".join(lines)


def convert_asm(xdt, *, e2m1: bool = False) -> str:
  """The PTX that converts one word of 8 int4 (e2m1) codes (for tests' emulator)."""
  key = _dtype_key(xdt)
  return _e2m1_asm(key) if e2m1 else _convert_asm(key)


def _codes_np(words: np.ndarray, e2m1: bool = False) -> np.ndarray:
  """[..., W] int32 words -> [..., 8 W] code values by physical k (float64 for e2m1)."""
  w = words.astype(np.int64) & 0xFFFFFFFF
  nib = ((w[..., None] >> (4 * np.arange(8))) & 0xF).reshape(*words.shape[:-1], -1)
  if e2m1:
    return np.where(nib >= 8, -1.0, 1.0) * _E2M1_VALUES[nib & 7]
  return np.where(nib >= 8, nib - 16, nib)


def _codes_jnp(words: jax.Array, e2m1: bool = False) -> jax.Array:
  nib = jnp.stack([(words >> (4 * i)) & 0xF for i in range(8)], axis=-1)  # code 8c + i
  nib = nib.reshape(*words.shape[:-1], words.shape[-1] * 8)
  if e2m1:  # from the bits (a table would be a constant the kernel body captures)
    ex, man = (nib >> 1) & 3, (nib & 1).astype(jnp.float32)
    mag = jnp.where(ex == 0, 0.5 * man,
                    (1.0 + 0.5 * man) * (jnp.left_shift(1, ex).astype(jnp.float32) * 0.5))
    return jnp.where(nib >= 8, -mag, mag)
  return jnp.where(nib >= 8, nib - 16, nib).astype(jnp.float32)


# ----------------------------------------------------------------------------- GPU helpers

def _ir():
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils
  return ir, arith, llvm, mgpu, utils


def _lane_ids():
  """(warp in the warpgroup, g = lane // 4, q = lane % 4) as i32 values."""
  ir, arith, _, _, utils = _ir()
  i32 = ir.IntegerType.get_signless(32)
  tid = utils.thread_idx()
  lane = arith.remui(tid, utils.c(32, i32))
  warp = arith.remui(arith.divui(tid, utils.c(32, i32)), utils.c(4, i32))
  return warp, arith.divui(lane, utils.c(4, i32)), arith.remui(lane, utils.c(4, i32)), lane


def _load_v4(ptr, byte_offset):
  """Four i32 at ptr + byte_offset (16-byte aligned, shared memory)."""
  ir, arith, llvm, _, utils = _ir()
  i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
  addr = utils.getelementptr(ptr, [byte_offset], i8)
  v = llvm.load(ir.VectorType.get((4,), i32), addr, alignment=16)
  return [llvm.extractelement(v, arith.constant(i32, j)) for j in range(4)]


def _carrier(regs32: list, xdt):
  """16 i32 registers a thread -> the B carrier (a WGMMA-layout [64, 64] xdt array)."""
  ir, _, _, mgpu, utils = _ir()
  layout = plgpu.Layout.WGMMA.to_mgpu()
  shape = layout.registers_shape(_CARRIER)
  if int(np.prod(shape)) != len(regs32):
    raise NotImplementedError(f"B carrier: {np.prod(shape)} registers, want {len(regs32)}")
  pair = ir.VectorType.get((2,), utils.dtype_to_ir_type(jnp.dtype(xdt)))
  new = np.empty(shape, dtype=object)
  for idx, r in zip(np.ndindex(shape), regs32):
    new[idx] = utils.bitcast(r, pair)
  return mgpu.FragmentedArray(_registers=new, _layout=layout, _is_signed=None)


def _carrier_regs(arr) -> list:
  ir, _, _, _, utils = _ir()
  i32 = ir.IntegerType.get_signless(32)
  return [utils.bitcast(r, i32) for r in arr.registers.flat]


def _carrier_type(xdt):
  return plgpu.ShapeDtypeStruct(_CARRIER, jnp.dtype(xdt), layout=plgpu.Layout.WGMMA)


# ------------------------------------------------------------------------------- operands

def b_tile(ref, xdt, *, interpret: bool = False):
  """ref: an SMEM [8, 128] xdt token block in `fragment_tiles` order (no swizzle) -> GEMM1's B
  operand for `mma` (interpret: B [128 physical k, 8] f32)."""
  if interpret:
    frag = ref[...].astype(jnp.float32).reshape(4, _N, 4, 4, 2)  # [c, n, q, w, e]
    return frag.transpose(_FROM_FRAGMENT).reshape(_N, BLOCK).T

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=_carrier_type(xdt))
  def load(_ctx, tile):
    ir, arith, _, _, utils = _ir()
    i32 = ir.IntegerType.get_signless(32)
    _, _, _, lane = _lane_ids()
    ptr = utils.memref_ptr(tile)
    base = arith.muli(lane, utils.c(16, i32))
    regs = []
    for c in range(4):
      regs += _load_v4(ptr, arith.addi(base, utils.c(512 * c, i32)))
    return _carrier(regs, xdt)

  return load(ref)


def b_rows(ref, xdt, *, interpret: bool = False):
  """ref: an SMEM [R >= 8, 128] xdt tile whose row n is B's column n by physical k (no
  swizzle; rows past 8 unread) -> B for `mma` (GEMM2's activations: built once per item)."""
  if interpret:
    return ref[...][:_N].astype(jnp.float32).T

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=_carrier_type(xdt))
  def load(_ctx, tile):
    ir, arith, llvm, _, utils = _ir()
    from jax._src.lib.mlir.dialects import memref
    index, i32 = ir.IndexType.get(), ir.IntegerType.get_signless(32)
    el = utils.dtype_to_ir_type(jnp.dtype(xdt))
    _, g, q, _ = _lane_ids()
    row = arith.index_cast(index, g)
    col0 = arith.muli(q, utils.c(32, i32))
    pair = ir.VectorType.get((2,), el)
    regs = []
    for r in range(16):
      b, hh = r // 2, r % 2
      v = llvm.mlir_undef(pair)
      for e in range(2):  # logical 16b + 8hh + 2q + e = physical 32q + 8(b // 2) + 4e + ...
        off = 8 * (b // 2) + 4 * e + 2 * (b % 2) + hh
        col = arith.index_cast(index, arith.addi(col0, utils.c(off, i32)))
        v = llvm.insertelement(v, memref.load(tile, [row, col]), arith.constant(i32, e))
      regs.append(utils.bitcast(v, i32))
    return _carrier(regs, xdt)

  return load(ref)


def mma(acc, codes_ref, b, xdt, *, e2m1: bool = False, interpret: bool = False,
        row_bytes: int = 4 * WORDS):
  """acc [128, 8] f32 (WGMMA layout) + codes @ B: codes_ref an SMEM [128, 16] int32 tile
  (8 signed int4 codes a word -- or e2m1 codes, their values -- physical k), b from `b_tile` /
  `b_rows` -> the new acc. row_bytes (GPU): the tile's row pitch -- 128 for one half of a
  [128, 32] tile of two steps, codes_ref then starting at that half's first word."""
  if interpret:
    a = _codes_jnp(codes_ref[...], e2m1)
    return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)
  if CHAINS not in (2, 4, 8):  # (the tree of adds pairs them)
    raise ValueError(f"int4_mma.CHAINS={CHAINS}: 2, 4 or 8")
  layout = plgpu.Layout.WGMMA
  conv, mma_asm = convert_asm(xdt, e2m1=e2m1), _MMA.format(t=_dtype_key(xdt))

  @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(), layout),
                     return_type=plgpu.ShapeDtypeStruct((ROWS, _N), jnp.float32,
                                                        layout=layout))
  def run(_ctx, accf, tile, bf):
    ir, arith, llvm, mgpu, utils = _ir()
    f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
    cr = accf.registers
    if cr.shape != (2, 1, 1, 1, 2, 1, 1, 1, 1):
      raise NotImplementedError(f"int4 mma: accumulator registers {cr.shape}")
    breg = _carrier_regs(bf)
    warp, g, q, _ = _lane_ids()
    ptr = utils.memref_ptr(tile)
    idx = lambda j: arith.constant(i32, j)  # noqa: E731
    st4 = llvm.StructType.get_literal([f32] * 4)
    st4i = llvm.StructType.get_literal([i32] * 4)

    def convert(word):
      res = llvm.inline_asm(st4i, [word], conv, "=r,=r,=r,=r,r")
      return [llvm.extractvalue(i32, res, [j]) for j in range(4)]

    def step(c, a_regs, b_regs):
      res = llvm.inline_asm(st4, a_regs + b_regs + c, mma_asm,
                            "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3")
      return [llvm.extractvalue(f32, res, [j]) for j in range(4)]

    new = np.empty_like(cr)
    v2 = ir.VectorType.get((2,), f32)
    for mi in range(2):
      c_in = []
      for half in range(2):
        v = cr[mi, 0, 0, 0, half, 0, 0, 0, 0]
        c_in += [llvm.extractelement(v, idx(0)), llvm.extractelement(v, idx(1))]
      zero = arith.constant(f32, 0.0)
      # CHAINS accumulators a block of rows (the first carries acc in), summed at the end:
      # the 8 MMAs of a step split into that many dependency chains
      chains = [c_in] + [[zero] * 4 for _ in range(CHAINS - 1)]
      words = []
      for hh in range(2):  # rows g and g + 8 of the warp's 16 in block mi
        row = arith.addi(arith.addi(arith.muli(warp, utils.c(16, i32)), g),
                         utils.c(64 * mi + 8 * hh, i32))
        off = arith.addi(arith.muli(row, utils.c(row_bytes, i32)),
                         arith.muli(q, utils.c(16, i32)))
        words.append(_load_v4(ptr, off))
      for j in range(4):
        lo, hi = convert(words[0][j]), convert(words[1][j])
        blk = 2 * j
        for u in range(2):  # MMA u of word j: chain (j + 4u) % CHAINS (2: by j's parity)
          ch = (j + 4 * u) % CHAINS
          chains[ch] = step(chains[ch], [lo[2 * u], hi[2 * u], lo[2 * u + 1], hi[2 * u + 1]],
                            breg[2 * blk + 2 * u:2 * blk + 2 * u + 2])
      while len(chains) > 1:  # a tree of adds
        chains = [[arith.addf(x, y) for x, y in zip(a, b)]
                  for a, b in zip(chains[0::2], chains[1::2])]
      c = chains[0]
      for half in range(2):
        v = llvm.mlir_undef(v2)
        v = llvm.insertelement(v, c[2 * half], idx(0))
        v = llvm.insertelement(v, c[2 * half + 1], idx(1))
        new[mi, 0, 0, 0, half, 0, 0, 0, 0] = v
    return mgpu.FragmentedArray(_registers=new, _layout=accf.layout, _is_signed=None)

  return run(acc, codes_ref, b)


def reference_products(words: np.ndarray, b_phys: np.ndarray, e2m1: bool = False) -> np.ndarray:
  """float64 NumPy: words [R, 16] int32 (a code tile) @ b_phys [128, N] -> [R, N]."""
  return _codes_np(words, e2m1).astype(np.float64) @ np.asarray(b_phys, np.float64)
