"""jmoe.kernels.int4_mma (4-bit codes on mma.sync for decode_wq): the word conversions' PTX
(int4 and e2m1, run here by a small interpreter of their opcodes) against every code, the logical K order and the
token fragment order it relies on, and the interpret-mode products against float64 NumPy."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jmoe.kernels import int4_mma


def _lop3(a: int, b: int, c: int, lut: int) -> int:
  """PTX lop3.b32: bit i of the result is bit (a_i << 2 | b_i << 1 | c_i) of lut."""
  out = 0
  for i in range(32):
    idx = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
    out |= ((lut >> idx) & 1) << i
  return out


def _fma_x2(a: int, b: int, c: int, np_dt) -> int:
  """fma.rn.{bf16x2, f16x2} on two 16-bit halves (in float64, rounded once to the dtype)."""
  out = 0
  for half in range(2):
    vals = [np.asarray([(v >> (16 * half)) & 0xFFFF], np.uint16).view(np_dt).astype(np.float64)
            for v in (a, b, c)]
    r = (vals[0] * vals[1] + vals[2]).astype(np_dt).view(np.uint16)[0]
    out |= int(r) << (16 * half)
  return out


def _run_convert(asm: str, word: int, np_dt) -> list[int]:
  regs = {"$4": word}
  val = lambda tok: regs[tok] if tok in regs else int(tok, 0)  # noqa: E731
  for line in asm.splitlines():
    m = re.match(r"\s*([a-z0-9.]+)\s+(.*);", line)
    if not m or m.group(1) == ".reg":
      continue
    op, args = m.group(1), [t.strip() for t in m.group(2).split(",")]
    if op == "mov.b32":
      regs[args[0]] = val(args[1])
    elif op == "shr.u32":
      regs[args[0]] = val(args[1]) >> val(args[2])
    elif op == "shl.b32":
      regs[args[0]] = (val(args[1]) << val(args[2])) & 0xFFFFFFFF
    elif op == "and.b32":
      regs[args[0]] = val(args[1]) & val(args[2])
    elif op == "lop3.b32":
      regs[args[0]] = _lop3(*(val(a) for a in args[1:4]), val(args[4]))
    elif op.startswith("fma.rn."):
      regs[args[0]] = _fma_x2(*(val(a) for a in args[1:4]), np_dt)
    else:
      raise AssertionError(f"unexpected opcode {op}")
  return [regs[o] for o in ("$0", "$1", "$2", "$3")]


def _e2m1_np(nibbles: np.ndarray) -> np.ndarray:
  """An independent e2m1 decoding (ml_dtypes' float4_e2m1fn) of nibbles 0..15."""
  return nibbles.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


@pytest.mark.parametrize("e2m1", [False, True], ids=["int4", "e2m1"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_convert_asm_decodes_every_code(dtype, e2m1):
  """Every code at every nibble: output pair j holds codes (j, j + 4) of the word, as the
  signed values the stored nibbles (two's complement) mean -- or, e2m1, as ml_dtypes'
  float4_e2m1fn reads them (signed zeros included)."""
  np_dt = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16
  asm = int4_mma.convert_asm(dtype, e2m1=e2m1)
  rng = np.random.default_rng(0)
  words = [sum(v << (4 * i) for i in range(8)) for v in range(16)]
  words += [sum(((v + i) % 16) << (4 * i) for i in range(8)) for v in range(16)]
  words += [int(w) for w in rng.integers(0, 1 << 32, 256, dtype=np.uint64)]
  for word in words:
    nib = (word >> (4 * np.arange(8))) & 0xF
    codes = _e2m1_np(nib) if e2m1 else np.where(nib >= 8, nib - 16, nib)
    np.testing.assert_array_equal(
        int4_mma._codes_np(np.asarray([word], np.uint32).view(np.int32), e2m1), codes)
    outs = _run_convert(asm, word, np_dt)
    for j, out in enumerate(outs):
      got = np.asarray([out & 0xFFFF, out >> 16], np.uint16).view(np_dt).astype(np.float64)
      np.testing.assert_array_equal(got, codes[[j, j + 4]], err_msg=f"word {word:#010x}")
      if e2m1:  # -0 stays -0
        np.testing.assert_array_equal(np.signbit(got), nib[[j, j + 4]] >= 8)


def test_logical_order_and_fragment_order():
  """PERM is a bijection of a step's 128 columns; fragment_tiles puts block entry f at
  FRAGMENT_SOURCE[f] (the transposes equal the documented gather); b_tile's interpret form
  undoes it."""
  assert sorted(int4_mma.PERM.tolist()) == list(range(128))
  assert sorted(int4_mma.FRAGMENT_SOURCE.tolist()) == list(range(1024))
  rng = np.random.default_rng(1)
  x = rng.standard_normal((16, 256)).astype(np.float32)  # 2 tokens, 2 steps
  frag = np.asarray(int4_mma.fragment_tiles(jnp.asarray(x)))
  for t in range(2):
    for s in range(2):
      blk = x[8 * t:8 * t + 8, 128 * s:128 * s + 128].reshape(-1)
      got = frag[8 * t:8 * t + 8, 128 * s:128 * s + 128].reshape(-1)
      np.testing.assert_array_equal(got, blk[int4_mma.FRAGMENT_SOURCE])
      back = np.asarray(int4_mma.b_tile(jnp.asarray(got.reshape(8, 128)), jnp.bfloat16,
                                        interpret=True))
      np.testing.assert_array_equal(back, blk.reshape(8, 128).T)
  with pytest.raises(ValueError, match="multiple of 8"):
    int4_mma.fragment_tiles(jnp.zeros((12, 128)))


@pytest.mark.parametrize("e2m1", [False, True], ids=["int4", "e2m1"])
def test_interpret_products_match_float64(e2m1):
  """mma's interpret form: the stored words' codes (physical K) @ B, accumulated; e2m1's
  reference decoded by ml_dtypes."""
  rng = np.random.default_rng(2)
  words = rng.integers(-2 ** 31, 2 ** 31, (128, 16)).astype(np.int32)
  b = rng.standard_normal((128, 8)).astype(np.float32)
  acc = rng.standard_normal((128, 8)).astype(np.float32)
  got = np.asarray(int4_mma.mma(jnp.asarray(acc), jnp.asarray(words), jnp.asarray(b),
                                jnp.bfloat16, e2m1=e2m1, interpret=True))
  want = acc + int4_mma.reference_products(words, b, e2m1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  if not e2m1:
    return
  w = words.view(np.uint32).astype(np.int64)
  nib = ((w[..., None] >> (4 * np.arange(8))) & 0xF).reshape(128, 128)
  np.testing.assert_allclose(got, acc + _e2m1_np(nib) @ b.astype(np.float64), rtol=1e-5,
                             atol=1e-4)
  packed = rng.integers(0, 256, (3, 5, 64)).astype(np.uint8)  # [E, rows, K / 2]
  w = np.asarray(int4_mma.code_words(jnp.asarray(packed)))
  assert w.shape == (3, 5, 16)
  lo, hi = packed & 0xF, packed >> 4
  nib = np.stack([lo, hi], -1).reshape(3, 5, 128).astype(np.int64)
  np.testing.assert_array_equal(int4_mma._codes_np(w), np.where(nib >= 8, nib - 16, nib))
  with pytest.raises(ValueError, match="bf16 / f16"):
    int4_mma.mma(jnp.asarray(acc), jnp.asarray(words), jnp.asarray(b), jnp.float32)
  assert jax.eval_shape(lambda: int4_mma.code_words(jnp.zeros((2, 8), jnp.uint8))).shape == (2, 2)
