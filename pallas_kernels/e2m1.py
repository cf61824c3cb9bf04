"""e2m1 codes (mxfp4 / nvfp4 values, read as int4 register tiles) -> 16-bit register tiles;
e2m1 or int4 codes -> fp8 e4m3 register tiles (the fp8-token kernels: both hold exactly);
e4m3 codes (mxfp8 weights) -> 16-bit register tiles (`fp8_codes_tile`).

Hopper has no e2m1 conversion. Two forms, the same values bit for bit:
- `lut` (the GPU kernels): per 4 codes, PTX byte permutes (`prmt`) pick each value's low and
  high byte from 8-entry tables (the high byte's table chosen by the code's sign), then two
  more interleave them into 16-bit pairs; ~2.5 instructions a value, close to Mosaic's own
  int4 -> bf16 upcast (CUTLASS's trick).
- `bits` (interpret mode, which has no inline PTX; and the GPU form before the table): the
  codes go to int16 and the sign and the 3 exponent-mantissa bits move to f16's bits 15 and
  11..9 -- the f16 number 2^-14 x the value, e2m1's subnormal 0.5 on f16's subnormal 2^-15 --
  then to the MMA dtype.
Both give the values / E2M1_UNIT; the kernels fold the factor into the scales.

To e4m3 (`e4m3_tile`, for the 8-bit wgmma): every e2m1 value and every int4 value (-8..7) is
an e4m3 number, so one `prmt` per 4 codes picks each byte from a 16-entry table (codes 0-7
and 8-15 in two 8-byte tables, the code's top bit choosing), ~1.75 instructions a value; the
interpreter's form converts through float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

E2M1_UNIT = 2.0 ** 14  # the converted tiles hold value / E2M1_UNIT (f16's exponent offset)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # by the code's 3 magnitude bits
FORMS = ("lut", "bits")
_FORM = "lut"  # the GPU kernels' form (benchmarks may switch it, with a fresh jit)


def _word(bytes4) -> int:
  return int(sum(int(b) << (8 * i) for i, b in enumerate(bytes4)))


def lut_words(dtype) -> dict[str, tuple[int, int]]:
  """The prmt tables for a 16-bit dtype: per code magnitude m (0..7), the low byte ("lo",
  sign-independent), the high byte of +value ("hi_pos") and of -value ("hi_neg") of
  dtype(value(m) / E2M1_UNIT), each 8 bytes as two little-endian 32-bit words."""
  np_dt = ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.float16
  vals = np.asarray(E2M1_VALUES, np.float32) / np.float32(E2M1_UNIT)
  out = {}
  for name, v in (("lo", vals), ("hi_pos", vals), ("hi_neg", -vals)):
    bits = v.astype(np_dt).view(np.uint16)
    part = bits & 0xFF if name == "lo" else bits >> 8
    out[name] = (_word(part[:4]), _word(part[4:]))
  return out


def e2m1_tile(codes: jax.Array, xdt, *, interpret: bool = False) -> jax.Array:
  """codes: an int4 register tile (the e2m1 bytes as stored) -> xdt (bf16 / f16) values /
  E2M1_UNIT, the same shape. The GPU form needs codes in the WGMMA layout."""
  if interpret or _FORM == "bits":
    return _bits_form(codes, xdt)
  return _lut_form(codes, xdt)


def _bits_form(codes: jax.Array, xdt) -> jax.Array:
  s = codes.astype(jnp.int16)  # sign-extended: bit 15 is the code's sign
  bits = ((s << 9) & jnp.int16(0x0E00)) | (s & jnp.int16(-32768))
  return lax.bitcast_convert_type(bits, jnp.float16).astype(xdt)


def _lut_asm(dtype) -> str:
  """4 codes in $2's low 16 bits -> two 32-bit words of 16-bit values ($0: codes 0, 1; $1:
  codes 2, 3). prmt(a, b, sel) picks byte sel_i (of a's 4 then b's 4) for output byte i;
  the magnitudes index the tables, sign_i picks hi_neg's byte over hi_pos's."""
  t = lut_words(dtype)
  return f"""
  {{
  .reg .b32 sel, sgn, lo, hp, hn, hi;
  and.b32 sel, $2, 0x7777;
  and.b32 sgn, $2, 0x8888;
  shr.u32 sgn, sgn, 1;
  or.b32 sgn, sgn, 0x3210;
  prmt.b32 lo, {t["lo"][0]}, {t["lo"][1]}, sel;
  prmt.b32 hp, {t["hi_pos"][0]}, {t["hi_pos"][1]}, sel;
  prmt.b32 hn, {t["hi_neg"][0]}, {t["hi_neg"][1]}, sel;
  prmt.b32 hi, hp, hn, sgn;
  prmt.b32 $0, lo, hi, 0x5140;
  prmt.b32 $1, lo, hi, 0x7362;
  }}
  """


def _lut_form(codes: jax.Array, xdt) -> jax.Array:
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(layout,),
                     return_type=plgpu.ShapeDtypeStruct(codes.shape, xdt, layout=layout))
  def convert(_ctx, arr):
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils

    i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
    out_el = utils.dtype_to_ir_type(jnp.dtype(xdt))
    asm = _lut_asm(xdt)
    regs = arr.registers
    flat = list(regs.flat)
    vec_len = ir.VectorType(flat[0].type).shape[0]

    def four(word16):  # an i16 of 4 codes -> two vector<2 x xdt>
      pair = llvm.inline_asm(llvm.StructType.get_literal([i32, i32]), [arith.extui(i32, word16)],
                             asm, "=r,=r,r")
      two = ir.VectorType.get((2,), out_el)
      return [utils.bitcast(llvm.extractvalue(i32, pair, (j,)), two) for j in range(2)]

    out = []
    if vec_len == 2:  # pairs of registers: 4 codes a call
      if len(flat) % 2:
        raise NotImplementedError("e2m1 LUT: an odd register count")
      for r0, r1 in zip(flat[0::2], flat[1::2]):
        out += four(utils.bitcast(utils.vector_concat([r0, r1]), i16))
    elif vec_len % 4 == 0:
      for r in flat:
        word = utils.bitcast(r, ir.IntegerType.get_signless(4 * vec_len))
        parts = []
        for c in range(vec_len // 4):
          piece = arith.shrui(word, utils.c(16 * c, word.type)) if c else word
          parts += four(arith.trunci(i16, piece) if vec_len > 4 else piece)
        out.append(utils.vector_concat(parts))
    else:
      raise NotImplementedError(f"e2m1 LUT: vector length {vec_len}")
    new = np.empty_like(regs)
    for idx, v in zip(np.ndindex(regs.shape), out):
      new[idx] = v
    return mgpu.FragmentedArray(_registers=new, _layout=arr.layout, _is_signed=None)

  return convert(codes)


def fp8_codes_tile(codes: jax.Array, xdt) -> jax.Array:
  """codes: a float8_e4m3fn register tile -> xdt (bf16 / f16), exactly (every e4m3 number is
  a bf16 and an f16 one): Hopper converts e4m3 pairs to f16 in one instruction (cvt
  .f16x2.e4m3x2) and f32 pairs to bf16 in one; f16 -> bf16 goes through f32. ~2 instructions
  a value; the weight-only kernels apply the e8m0 group scales after it as for int8 codes."""
  a = codes.astype(jnp.float16)
  if jnp.dtype(xdt) == jnp.dtype(jnp.float16):
    return a
  return a.astype(jnp.float32).astype(xdt)


def e4m3_words(e2m1: bool) -> tuple[tuple[int, int], tuple[int, int]]:
  """The prmt tables of `e4m3_tile`: the e4m3 byte of each 4-bit code's value (e2m1: sign and
  magnitude; else int4, two's complement), codes 0-7 and codes 8-15, each 8 bytes as two
  little-endian 32-bit words."""
  codes = np.arange(16)
  if e2m1:
    vals = np.where(codes >= 8, -1.0, 1.0) * np.asarray(E2M1_VALUES * 2)
  else:
    vals = np.where(codes >= 8, codes - 16, codes).astype(np.float64)
  b = vals.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  return (_word(b[0:4]), _word(b[4:8])), (_word(b[8:12]), _word(b[12:16]))


def _e4m3_asm(e2m1: bool) -> str:
  """4 codes in $1's low 16 bits -> $0: their 4 e4m3 bytes in order. The low 3 bits index
  both tables; the top bit picks the second table's byte (prmt's selector 4 + i)."""
  lo, hi = e4m3_words(e2m1)
  return f"""
  {{
  .reg .b32 sel, top, p, q;
  and.b32 sel, $1, 0x7777;
  and.b32 top, $1, 0x8888;
  shr.u32 top, top, 1;
  or.b32 top, top, 0x3210;
  prmt.b32 p, {lo[0]}, {lo[1]}, sel;
  prmt.b32 q, {hi[0]}, {hi[1]}, sel;
  prmt.b32 $0, p, q, top;
  }}
  """


def e4m3_tile(codes: jax.Array, *, e2m1: bool, interpret: bool = False) -> jax.Array:
  """codes: an int4 register tile (e2m1 codes as stored, or signed int4 codes) -> their values
  as float8_e4m3fn, exactly, the same shape. The GPU form needs codes in the WGMMA_8BIT
  layout (wgmma's 8-bit register A operand)."""
  if interpret:
    v = _bits_form(codes, jnp.float32) * E2M1_UNIT if e2m1 else codes.astype(jnp.float32)
    return v.astype(jnp.float8_e4m3fn)
  layout = plgpu.Layout.WGMMA_8BIT

  @plgpu.inline_mgpu(arg_types=(layout,), return_type=plgpu.ShapeDtypeStruct(
      codes.shape, jnp.float8_e4m3fn, layout=layout))
  def convert(_ctx, arr):
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils

    i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
    asm = _e4m3_asm(e2m1)
    regs = arr.registers
    vec_len = ir.VectorType(regs.flat[0].type).shape[0]
    if vec_len % 4:
      raise NotImplementedError(f"e4m3 LUT: vector length {vec_len}")
    four_ty = ir.VectorType.get((4,), utils.dtype_to_ir_type(jnp.dtype(jnp.float8_e4m3fn)))

    def four(word16):  # an i16 of 4 codes -> vector<4 x f8e4m3fn>
      out = llvm.inline_asm(i32, [arith.extui(i32, word16)], asm, "=r,r")
      return utils.bitcast(out, four_ty)

    new = np.empty_like(regs)
    for idx in np.ndindex(regs.shape):
      word = utils.bitcast(regs[idx], ir.IntegerType.get_signless(4 * vec_len))
      parts = []
      for c in range(vec_len // 4):
        piece = arith.shrui(word, utils.c(16 * c, word.type)) if c else word
        parts.append(four(arith.trunci(i16, piece) if vec_len > 4 else piece))
      new[idx] = utils.vector_concat(parts) if len(parts) > 1 else parts[0]
    return mgpu.FragmentedArray(_registers=new, _layout=arr.layout, _is_signed=None)

  return convert(codes)


# ---------------------------------------------------------------- e2m1 x 2^shift -> e4m3
# The fp8-token prefill GEMM (jmoe.kernels.grouped_gemm_w4a8) folds mxfp4's e8m0 group scales
# into the conversion: per weight row, ref = its largest scale exponent; a group with exponent
# e converts to value * 2^(e - ref + SHIFT_BIAS) in e4m3 (exact while e >= ref - 11; at ref - 12
# the +-0.5 codes, 2^-7, flush to 0; below, the group is 0: its largest value is 2^-12 of the
# row's), and 2^(ref - SHIFT_BIAS) multiplies the row's accumulator. e4m3's exponent field is
# bits 3..6, so the shift is one add per byte on tables whose nonzero magnitudes are biased
# down by 6 exponents (no byte leaves [0, 0x7c]: no carries between the packed bytes).
SHIFT_BIAS = 6  # the largest group's 6.0 -> 384 (e4m3 max 448)
MIN_SHIFT = -SHIFT_BIAS  # e - ref + SHIFT_BIAS below this: the group is flushed
FLUSH = 0x80  # a shift byte's flag: the group converts to zeros


def e4m3_shift_bytes(shift: jax.Array) -> jax.Array:
  """Per (row, group) shifts e - ref + SHIFT_BIAS (int, <= SHIFT_BIAS) -> the conversion's
  uint8 bytes: the exponent-field add 8 * (shift - MIN_SHIFT) (0..96), or FLUSH below
  MIN_SHIFT. One byte a group (the kernel's per-call array is a quarter of 32-bit words')."""
  s = shift.astype(jnp.int32)
  return jnp.where(s >= MIN_SHIFT, 8 * (s - MIN_SHIFT), FLUSH).astype(jnp.uint8)


def e4m3_shifted_values(codes: jax.Array, shift: jax.Array) -> jax.Array:
  """The conversion's values in float32, as jnp: e2m1 codes (int4 tile, any shape [..., K])
  with per-element shifts (int, broadcast to codes) -> value * 2^shift, 0 where shift <
  MIN_SHIFT and +-0.5 -> 0 at shift == MIN_SHIFT (2^-7 is below e4m3's normals: the table's
  add cannot make it). Every result is an e4m3 number."""
  v = _bits_form(codes, jnp.float32) * E2M1_UNIT
  s = shift.astype(jnp.int32)
  out = v * jnp.exp2(s.astype(jnp.float32))
  out = jnp.where((s == MIN_SHIFT) & (jnp.abs(v) == 0.5), 0.0, out)
  return jnp.where(s < MIN_SHIFT, 0.0, out)


def _biased_words() -> tuple[tuple[int, int], tuple[int, int]]:
  """The magnitude table (e4m3 byte of each e2m1 magnitude 1..7 less 6 exponents; 0 -> 0)
  and the nonzero mask table, each 8 bytes as two 32-bit words."""
  vals = np.asarray(E2M1_VALUES, np.float32)
  b = vals.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.int64)
  mag = np.where(vals > 0, b - 8 * SHIFT_BIAS, 0)
  nz = np.where(vals > 0, 0xFF, 0)
  return (_word(mag[:4]), _word(mag[4:])), (_word(nz[:4]), _word(nz[4:]))


def _shifted_asm() -> str:
  """$1: 4 codes (low 16 bits), $2: the group's shift byte (zero-extended) -> $0: the 4 e4m3
  bytes. The byte replicated is the add (FLUSH's bit is masked off by the zero codes' nz);
  prmt's sign-replicate selectors (0x8) turn FLUSH into an all-ones mask that clears the
  selectors (every code reads entry 0: zero); lop3 0x20 = a & ~b & c, 0xEA = (a & b) | c."""
  (m0, m1), (z0, z1) = _biased_words()
  return f"""
  {{
  .reg .b32 sel, mag, nz, sh, fl, top, neg;
  prmt.b32 sh, $2, 0, 0x0000;
  prmt.b32 fl, $2, 0, 0x8888;
  lop3.b32 sel, $1, fl, 0x7777, 0x20;
  prmt.b32 mag, {m0}, {m1}, sel;
  prmt.b32 nz, {z0}, {z1}, sel;
  and.b32 sh, sh, nz;
  add.u32 mag, mag, sh;
  shr.u32 top, $1, 1;
  lop3.b32 top, top, 0x4444, 0x3210, 0xEA;
  or.b32 neg, mag, 0x80808080;
  prmt.b32 $0, mag, neg, top;
  }}
  """


def e4m3_shifted_tile(codes: jax.Array, words, *, group: int,
                      interpret: bool = False) -> jax.Array:
  """codes: an int4 register tile [R, C] of e2m1 codes (R rows of a weight, C along K);
  words: an SMEM ref [C / group, R] uint8 (`e4m3_shift_bytes` of each row's group shifts) ->
  float8_e4m3fn [R, C], `e4m3_shifted_values` bit for bit. GPU: codes in the WGMMA_8BIT
  layout, whose 4-code registers each lie in one row and one group (group >= 16)."""
  if group % 16:
    raise ValueError(f"group={group}: the shifted e4m3 conversion needs groups of 16k")
  if interpret:
    w = words[...].astype(jnp.int32)
    shift = jnp.where((w & FLUSH) != 0, MIN_SHIFT - 1, w // 8 + MIN_SHIFT)  # [C / group, R]
    shift = jnp.repeat(shift.T, group, axis=1)
    return e4m3_shifted_values(codes, shift).astype(jnp.float8_e4m3fn)
  layout = plgpu.Layout.WGMMA_8BIT

  @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType()), return_type=plgpu.ShapeDtypeStruct(
      codes.shape, jnp.float8_e4m3fn, layout=layout))
  def convert(_ctx, arr, wref):
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils

    i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    asm = _shifted_asm()
    regs = arr.registers
    vec_len = ir.VectorType(regs.flat[0].type).shape[0]
    if vec_len != 4:
      raise NotImplementedError(f"shifted e4m3: vector length {vec_len}")
    four_ty = ir.VectorType.get((4,), utils.dtype_to_ir_type(jnp.dtype(jnp.float8_e4m3fn)))
    new = np.empty_like(regs)
    for idx, (row, col) in zip(np.ndindex(regs.shape), arr.layout.thread_idxs(arr.shape)):
      grp = arith.divui(col, arith.constant(index, group))
      w = arith.extui(i32, memref.load(wref, [grp, row]))  # the shift byte
      code = arith.extui(i32, utils.bitcast(regs[idx], i16))
      out = llvm.inline_asm(i32, [code, w], asm, "=r,r,r")
      new[idx] = utils.bitcast(out, four_ty)
    return mgpu.FragmentedArray(_registers=new, _layout=arr.layout, _is_signed=None)

  return convert(codes, words)
