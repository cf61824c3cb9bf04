"""The 4-bit code conversions of the weight-only kernels (e2m1 -> bf16 / f16; e2m1 and int4 ->
e4m3): the GPU forms' PTX (run here by a small interpreter of its four opcodes) and the
interpret-mode forms, against ml_dtypes' e2m1 and e4m3."""
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jmoe.kernels import e2m1


def _prmt(a: int, b: int, sel: int) -> int:
  """PTX prmt.b32 (default mode): output byte i is byte sel_i & 7 of (a, b); sel_i & 8
  replicates that byte's sign bit."""
  src = [(a >> (8 * j)) & 0xFF for j in range(4)] + [(b >> (8 * j)) & 0xFF for j in range(4)]
  out = 0
  for i in range(4):
    nib = (sel >> (4 * i)) & 0xF
    byte = src[nib & 7]
    if nib & 8:
      byte = 0xFF if byte & 0x80 else 0
    out |= byte << (8 * i)
  return out


def _run_asm(asm: str, arg: int, inp: str = "$2", outs=("$0", "$1")) -> tuple[int, ...]:
  """The asm's instructions on 32-bit registers; `inp` in, `outs` out."""
  regs = {inp: arg}
  val = lambda tok: regs[tok] if tok in regs else int(tok, 0)  # noqa: E731
  ops = {"and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b,
         "shr.u32": lambda a, b: a >> b}
  for line in asm.splitlines():
    m = re.match(r"\s*([a-z0-9.]+)\s+(.*);", line)
    if not m or m.group(1) == ".reg":
      continue
    op, args = m.group(1), [t.strip() for t in m.group(2).split(",")]
    if op == "prmt.b32":
      regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
    else:
      regs[args[0]] = ops[op](val(args[1]), val(args[2])) & 0xFFFFFFFF
  return tuple(regs[o] for o in outs)


def _want(codes: np.ndarray, dtype) -> np.ndarray:
  """The codes' values / E2M1_UNIT as dtype's bits (ml_dtypes' float4_e2m1fn decoding)."""
  vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  np_dt = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16
  return (vals / np.float32(e2m1.E2M1_UNIT)).astype(np_dt).view(np.uint16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_lut_asm_decodes_every_code(dtype):
  """All 16^4 words of 4 codes (the selector and sign of each position), upper bits set."""
  asm = e2m1._lut_asm(dtype)
  rng = np.random.default_rng(0)
  words = np.concatenate([np.arange(16, dtype=np.int64) * 0x1111,
                          rng.integers(0, 1 << 16, 512)])
  for word in words:
    got0, got1 = _run_asm(asm, int(word) | 0xABCD0000)  # (bits above 16 are ignored)
    codes = np.array([(int(word) >> (4 * i)) & 0xF for i in range(4)])
    got = np.array([got0 & 0xFFFF, got0 >> 16, got1 & 0xFFFF, got1 >> 16], np.uint16)
    np.testing.assert_array_equal(got, _want(codes, dtype), err_msg=f"word {int(word):#06x}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_bits_form_decodes_every_code(dtype):
  codes = jnp.arange(-8, 8, dtype=jnp.int8).astype(jnp.int4)  # as the kernels read the bytes
  got = np.asarray(e2m1._bits_form(codes, dtype)).view(np.uint16)
  np.testing.assert_array_equal(got, _want(np.arange(-8, 8) & 0xF, dtype))


_WORDS = np.concatenate([np.arange(16, dtype=np.int64) * 0x1111,
                         np.random.default_rng(1).integers(0, 1 << 16, 512)])


def _code_values(codes: np.ndarray, e2m1_codes: bool) -> np.ndarray:
  if e2m1_codes:
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  return np.where(codes >= 8, codes - 16, codes).astype(np.float32)  # int4, two's complement


@pytest.mark.parametrize("e2m1_codes", [True, False], ids=["e2m1", "int4"])
def test_e4m3_asm_decodes_every_code(e2m1_codes):
  """Each code in each of the 4 positions (and random words, upper bits set) -> the e4m3 byte
  of its value, exactly."""
  asm = e2m1._e4m3_asm(e2m1_codes)
  for word in _WORDS:
    (got,) = _run_asm(asm, int(word) | 0xABCD0000, inp="$1", outs=("$0",))
    codes = np.array([(int(word) >> (4 * i)) & 0xF for i in range(4)])
    want = _code_values(codes, e2m1_codes).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got_b = np.array([(got >> (8 * i)) & 0xFF for i in range(4)], np.uint8)
    np.testing.assert_array_equal(got_b, want, err_msg=f"word {int(word):#06x}")


@pytest.mark.parametrize("e2m1_codes", [True, False], ids=["e2m1", "int4"])
def test_e4m3_interpret_form_decodes_every_code(e2m1_codes):
  codes = jnp.arange(-8, 8, dtype=jnp.int8).astype(jnp.int4)  # as the kernels read the bytes
  got = np.asarray(e2m1.e4m3_tile(codes, e2m1=e2m1_codes, interpret=True)).astype(np.float32)
  np.testing.assert_array_equal(got, _code_values(np.arange(-8, 8) & 0xF, e2m1_codes))
