"""The fp8-token prefill GEMMs over mxfp4 codes (jmoe.kernels.grouped_gemm_w4a8: e2m1 codes
converted to e4m3 in registers with the e8m0 group scales folded into the bytes, 8-bit
wgmma with the weights as A) in Mosaic GPU interpret mode with race detection, against the
float64 oracle on the NumPy unpacking of the stored bytes; the PTX conversion program run
instruction by instruction on every code and shift; the layout and tile rules and their
refusals; the GPU lowering at qwen3- and mixtral-sized experts."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmoe
import oracle_np as onp
from jmoe.kernels import _compat
from jmoe.kernels import e2m1
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import grouped_gemm_w4a8 as w4a8
from jmoe.kernels import moe as pmoe
from jmoe.kernels.activations import as_activation
from jmoe.quant import quantize_activations, quantize_weights
from kernel_run import run_interpreted
from test_pallas_decode_wq import _problem
from test_pallas_wq_ws import grouped_oracle
from test_quant_formats import np_dequant

TOL = 2e-2
S = jax.ShapeDtypeStruct
needs_interpreter = pytest.mark.skipif(
    not _compat.interpret_available(),
    reason="Mosaic GPU interpret mode (private jax API) unavailable in this jax version")


def _fp8_per_row(a: np.ndarray) -> np.ndarray:
  """GEMM2's operand: GEMM1's bf16 output, then e4m3 with one power-of-two scale per token
  row (mxfp4_fp8's activations: 2^ceil(log2(amax / 448)), as its e8m0 weight scales)."""
  bf16 = np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
  amax = np.abs(bf16).max()
  s = 2.0 ** np.ceil(np.log2(amax / 448.0)) if amax > 0 else 1.0
  return (bf16 / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s


# ------------------------------------------------------------------ the conversion program

def _run_ptx(asm: str, regs: dict) -> int:
  """The straight-line b32 PTX of e2m1's conversion (and / or / shr / add / prmt / lop3 on
  registers and immediates), executed on Python ints."""
  def val(tok):
    tok = tok.strip()
    return regs[tok] if tok in regs else int(tok, 0)

  def prmt(a, b, sel):  # a selector's top bit: the selected byte's sign, replicated
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    byte = lambda s: (0xFF if pool[s & 7] & 0x80 else 0) if s & 8 else pool[s & 7]  # noqa: E731
    return sum(byte((sel >> 4 * i) & 0xF) << 8 * i for i in range(4))

  def lop3(a, b, c, lut):  # bit i of the result: lut's bit (a_i << 2 | b_i << 1 | c_i)
    return sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i
               for i in range(32))

  ops = {"and": lambda a, b: a & b, "or": lambda a, b: a | b, "shr": lambda a, b: a >> b,
         "add": lambda a, b: (a + b) & 0xFFFFFFFF, "prmt": prmt, "lop3": lop3}
  for line in asm.splitlines():
    line = line.strip().rstrip(";")
    m = re.match(r"(\w+)\.\S+\s+(.*)", line)
    if not m or m.group(1) == "reg":
      continue
    op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
    dst, srcs = args[0], [val(a) for a in args[1:]]
    regs[dst] = ops[op](*srcs)
  return regs["$0"]


def test_shifted_conversion_program_gives_the_shifted_values():
  """Every 4-code word at every shift the scales can give (the row's largest group +6 down to
  past the flush): the PTX program's bytes are e4m3_shifted_values' e4m3 numbers, bit for bit
  (up to the sign of zero)."""
  asm = e2m1._shifted_asm()
  rng = np.random.default_rng(0)
  words = [rng.integers(0, 16, 4) for _ in range(64)] + [np.arange(4) + 4 * i for i in range(4)]
  for shift in range(e2m1.MIN_SHIFT - 3, e2m1.SHIFT_BIAS + 1):
    w = int(np.asarray(e2m1.e4m3_shift_bytes(jnp.int32(shift))))
    for codes in words:
      c4 = int(sum(int(c) << 4 * i for i, c in enumerate(codes)))
      out = _run_ptx(asm, {"$1": c4, "$2": w})
      got = np.array([(out >> 8 * i) & 0xFF for i in range(4)], np.uint8)
      got = got.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
      signed = jnp.asarray(np.where(codes >= 8, codes - 16, codes), jnp.int4)
      want = np.asarray(e2m1.e4m3_shifted_values(signed, jnp.full(4, shift)), np.float64)
      np.testing.assert_array_equal(got, want, err_msg=f"shift {shift}, codes {codes}")
      assert np.array_equal(want.astype(ml_dtypes.float8_e4m3fn).astype(np.float64), want)


def test_folded_scales_are_the_mxfp4_weights():
  """fp8_codes' e4m3 values times the row scale are the dequantized mxfp4 weights (float64
  NumPy unpacking) exactly while a row's group exponents span 12; a group 13 below its row's
  largest flushes to zero, one 12 below loses only its +-0.5 codes."""
  rng = np.random.default_rng(1)
  q = quantize_weights(jnp.asarray(rng.standard_normal((2, 256, 64)), jnp.float32),
                       jmoe.QuantConfig("mxfp4_fp8"))
  vals, w_scale = w4a8.fp8_codes(q.values, q.scale)
  np.testing.assert_array_equal(np.asarray(vals * w_scale[..., None], np.float64),
                                np.swapaxes(np_dequant(q), 1, 2))
  e8 = np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8)).copy()  # [E, N, K/32]
  ref = e8[0, 5].max()
  e8[0, 5, 0], e8[0, 5, 1] = ref - 13, ref - 12
  spread = type(q)(values=q.values, scale=jax.lax.bitcast_convert_type(jnp.asarray(e8),
                                                                        q.scale.dtype),
                   scheme=q.scheme)
  vals, w_scale = w4a8.fp8_codes(spread.values, spread.scale)
  got = np.asarray(vals * w_scale[..., None], np.float64)[0, 5]
  want = np.swapaxes(np_dequant(spread), 1, 2)[0, 5]
  np.testing.assert_array_equal(got[:32], 0.0)
  half = np.abs(want[32:64]) == 0.5 * 2.0 ** (int(ref) - 12 - 127)
  np.testing.assert_array_equal(got[32:64], np.where(half, 0.0, want[32:64]))
  np.testing.assert_array_equal(got[64:], want[64:])


# ------------------------------------------------------------------ the kernels

def _fp8_tokens(rng, m, k):
  x = jnp.asarray(2 * rng.standard_normal((m, k)), jnp.float32)
  return quantize_activations(x, jmoe.QuantConfig("mxfp4_fp8"))


SPLIT = w4a8.W4A8Config(block_m=256, block_n=64, split_gate_up=True)
TALL = w4a8.W4A8Config(block_m=256, block_n=128)


@needs_interpreter
@pytest.mark.parametrize("gated,config,sizes", [
    pytest.param(True, None, (70, 0, 61), marks=pytest.mark.slow),
    pytest.param(False, None, (70, 0, 61), marks=pytest.mark.slow),
    pytest.param(True, SPLIT, (170, 0, 300), marks=pytest.mark.slow),  # (lean: the block's test)
    pytest.param(False, TALL, (170, 0, 300), marks=pytest.mark.slow)])
def test_w4a8_gemm_matches_oracle(gated, config, sizes, rng):
  """grouped_gemm_w4a8 alone: 3 experts, one empty, tiles starting inside another expert's
  rows and the last tile shifted back (131 rows on 128-row tiles, 470 on 256-row ones), K =
  256 (2 steps); gated silu with biases, or ungated with a row scale; the default tiles, and
  256-token tiles (gated: gate and up on the two warpgroups, the up half crossing through
  shared memory, 2 column tiles an item each); against the float64 oracle on the tokens' fp8
  values and the NumPy unpacking of the codes."""
  e, k, n = 3, 256, 256 if config is None else 128
  n_total = 2 * n if gated else n
  q = quantize_weights(jnp.asarray(rng.standard_normal((e, k, n_total)) / 16, jnp.float32),
                       jmoe.QuantConfig("mxfp4_fp8"))
  sizes = np.array(sizes)
  xq, xs = _fp8_tokens(rng, int(sizes.sum()), k)
  bias = jnp.asarray(0.1 * rng.standard_normal((e, n_total)), jnp.float32) if gated else None
  rs = None if gated else jnp.asarray(rng.uniform(0.5, 1.5, int(sizes.sum())), jnp.float32)
  out = np.asarray(run_interpreted(
      lambda *a, interpret: w4a8.grouped_gemm_w4a8(
          *a, activation="silu" if gated else None, bias=bias, row_scale=rs,
          out_dtype=jnp.float32, config=config, interpret=interpret),
      xq, q, jnp.asarray(sizes, jnp.int32), xs))
  x = np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(xs, np.float64)
  want = grouped_oracle(x, np_dequant(q), sizes, gated, n, bias, rs)
  assert out.shape == (int(sizes.sum()), n) and np.isfinite(out).all()
  onp.assert_rel_close(out, want, 1e-5, f"w4a8 gated={gated} vs oracle")


def test_w4a8_configs_rule_and_refusals():
  """default_config takes 256-token tiles from SPLIT_ROWS rows per expert (gated: gate and up
  split over the warpgroups); configs whose accumulators would spill, a split without a
  gate, or a split tile other than 64 columns are refused naming the field."""
  big = w4a8.SPLIT_ROWS
  assert w4a8.default_config(14336, True, big) == dataclasses.replace(
      SPLIT, num_stages=w4a8.default_config(14336, True, big).num_stages)
  assert w4a8.default_config(4096, False, big).block_m == 256
  assert w4a8.default_config(768, True, big - 1).block_m == 128
  assert w4a8.default_config(2048, False, 1).block_n == 256
  for cfg, gated in ((SPLIT, True), (TALL, False), (w4a8.W4A8Config(), True)):
    assert w4a8.acc_registers(cfg, gated) <= 128
  with pytest.raises(ValueError, match="split_gate_up takes block_n=64"):
    w4a8.W4A8Config(block_n=128, split_gate_up=True)
  with pytest.raises(ValueError, match="block_n=64 must be 128 or 256"):
    w4a8.W4A8Config(block_n=64)
  q = jax.eval_shape(lambda: quantize_weights(jnp.zeros((2, 256, 512), jnp.float32),
                                              jmoe.QuantConfig("mxfp4_fp8")))
  x, xs = S((256, 256), jnp.float8_e4m3fn), S((256,), jnp.float32)
  meta = gg.tile_metadata(jnp.array([256, 0]), 256, 128)
  for cfg, gated, match in ((w4a8.W4A8Config(block_n=256), True, "256 registers"),
                            (SPLIT, False, "split_gate_up needs a gated activation")):
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(lambda a, b, c=cfg, g=gated: w4a8.w4a8_run(
          a, q, b, meta=meta, act=as_activation("silu") if g else None, gated=g,
          config=c), x, xs)


@needs_interpreter
def test_mxfp4_fp8_prefill_matches_oracle(rng):
  """fused_experts_weight_only's prefill_fp8 layout (both GEMMs, the intermediate re-quantized
  per token): 40 tokens, k = 2 on 4 experts (expert 3 empty), an empty slot, swigluoai with
  biases, H = N = 256; against the oracle on the tokens' fp8 values with the intermediate
  rounded to bf16 and then to fp8 per token, as the path does."""
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, "mxfp4_fp8", 40, 256, 256, 4, 2, bias=True)
  ids[3, 1] = -1
  ids[:, :] = np.where(ids == 3, 2, ids)
  xq, xs = quantize_activations(x, q13.scheme)
  out = np.asarray(run_interpreted(
      lambda *a, interpret: pmoe.fused_experts_weight_only(
          *a, w13_bias=b13, w2_bias=b2, activation="swigluoai", out_dtype=jnp.float32,
          interpret=interpret, layout="prefill_fp8", x_scale=xs),
      xq, q13, q2, jnp.asarray(tw), jnp.asarray(ids)))
  x_hat = np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(xs, np.float64)
  want = onp.fused_moe(x_hat, np_dequant(q13), np_dequant(q2), tw, ids,
                       activation="swigluoai", w13_bias=np.asarray(b13, np.float64),
                       w2_bias=np.asarray(b2, np.float64), requant=_fp8_per_row)
  assert out.shape == (40, 256) and np.isfinite(out).all()
  onp.assert_rel_close(out, want, TOL, "mxfp4_fp8 prefill_fp8 vs oracle")


def test_prefill_fp8_layout_rule_and_refusals():
  """auto takes the fp8-token GEMMs for mxfp4_fp8 past the decode kernel (slots sharing
  experts, more than 128 slots) and keeps the decode kernel (on bf16 tokens) below; other
  4-bit formats with fp8 tokens keep the bf16-token kernels; a forced layout that cannot run
  says why."""
  silu = as_activation("silu")

  def weights(fmt, e, h, n):
    quant = jmoe.QuantConfig(fmt)
    return [jax.eval_shape(lambda s=s: quantize_weights(jnp.zeros(s, jnp.float32), quant))
            for s in ((e, h, 2 * n), (e, n, h))]

  mx = weights("mxfp4_fp8", 8, 1024, 512)
  assert pmoe.weight_only_layout(1, 2, 1024, 512, silu, *mx) == "decode"
  assert pmoe.weight_only_layout(16, 2, 1024, 512, silu, *mx) == "prefill_fp8"
  assert pmoe.weight_only_layout(4096, 2, 1024, 512, silu, *mx) == "prefill_fp8"
  w4 = weights("w4afp8", 8, 1024, 512)
  assert pmoe.weight_only_layout(4096, 2, 1024, 512, silu, *w4) != "prefill_fp8"
  with pytest.raises(ValueError, match="prefill_fp8.*mxfp4 codes"):
    pmoe.weight_only_layout(4096, 2, 1024, 512, silu, *w4, layout="prefill_fp8")
  odd = weights("mxfp4_fp8", 8, 1024, 320)
  with pytest.raises(ValueError, match="prefill_fp8.*multiple of 128"):
    pmoe.weight_only_layout(4096, 2, 1024, 320, silu, *odd, layout="prefill_fp8")
  with pytest.raises(ValueError, match="lhs must be float8_e4m3fn"):
    w4a8.grouped_gemm_w4a8(jnp.zeros((8, 1024), jnp.bfloat16), mx[0],
                           jnp.zeros(8, jnp.int32), jnp.ones((8, 1)), activation="silu")


@pytest.mark.parametrize("h,n,t", [pytest.param(2048, 768, 4096, marks=pytest.mark.slow),
                                   (4096, 14336, 2048)])
def test_prefill_fp8_lowers_for_the_gpu(h, n, t):
  """The whole fp8-token prefill block lowers for the GPU at qwen3- and mixtral-sized experts
  (the Mosaic GPU lowering of the inline PTX, the shared-memory plan at full K)."""
  e, k = (128, 8) if n == 768 else (8, 2)
  w13, w2 = (jax.eval_shape(lambda s=s: quantize_weights(jnp.zeros(s, jnp.float32),
                                                         jmoe.QuantConfig("mxfp4_fp8")))
             for s in ((e, h, 2 * n), (e, n, h)))
  fn = lambda x, xs, a, b, tw, ti: pmoe.fused_experts_weight_only(  # noqa: E731
      x, a, b, tw, ti, layout="prefill_fp8", x_scale=xs)
  text = jax.jit(fn).trace(S((t, h), jnp.float8_e4m3fn), S((t, 1), jnp.float32), w13, w2,
                           S((t, k), jnp.float32), S((t, k), jnp.int32)).lower(
                               lowering_platforms=("cuda",)).as_text()
  assert {"jmoe_gg_w4a8_gated", "jmoe_gg_w4a8"} <= set(
      re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text))
