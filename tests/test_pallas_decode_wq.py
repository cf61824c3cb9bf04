"""The weight-only decode kernel (jmoe.kernels.decode_wq: int4 / int8 codes dequantized in
registers, bf16 tokens) in Mosaic GPU interpret mode with race detection, against a float64
oracle on the NumPy unpacking of the stored bytes; the weight-only path of the Pallas experts
(the kernel, and the dequantized fallback) through the public API; its GPU lowering at
qwen3-30b-a3b's full size."""
import dataclasses
import re
import types

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
import ml_dtypes
import numpy as np
import pytest

import jmoe
import oracle_np as onp
from jmoe.kernels import _compat
from jmoe.kernels import decode_wq, decode_wq_shared
from jmoe.kernels import moe as pmoe
from jmoe.kernels.activations import as_activation
from jmoe.quant import (QuantizedWeights, prepare_for_kernels, quantize_activations,
                        quantize_weights)
from kernel_run import EXHAUSTIVE, run_interpreted
from test_quant_formats import np_dequant

pytestmark = pytest.mark.skipif(
    not _compat.interpret_available(),
    reason="Mosaic GPU interpret mode (private jax API) unavailable in this jax version")

TOL = 2e-2
S = jax.ShapeDtypeStruct
# id -> QuantConfig fields
SCHEMES = {
    "w4a16-zp": dict(format="w4a16", zero_point=True),
    "w4a16": dict(format="w4a16"),
    "w8a16": dict(format="w8a16"),
    "w8a16-g128-zp": dict(format="w8a16", weight_scale="group", group_size=128,
                          zero_point=True),
    "mxfp4": dict(format="mxfp4"),  # e2m1 codes, e8m0 scales per 32
    "nvfp4": dict(format="nvfp4"),  # e4m3 scales per 16 and a global scale
    "w4a16-g32": dict(format="w4a16", group_size=32),
    # mxfp8's weights as the weight-only kernels see them (its tokens enter as bf16)
    "mxfp8-codes": dict(format="custom", weight_dtype="float8_e4m3fn", weight_scale="group",
                        group_size=32, scale_dtype="float8_e8m0fnu"),
    "mxfp8": dict(format="mxfp8"),
    # 4-bit codes with fp8 tokens (the 8-bit MMA form)
    "mxfp4_fp8": dict(format="mxfp4_fp8"),
    "nvfp4_fp8": dict(format="nvfp4_fp8"),
    "w4afp8": dict(format="w4afp8"),
    "w4afp8-zp": dict(format="w4afp8", zero_point=True),
}


def _problem(rng, sid, t, h, n, e, k, bias=False):
  quant = jmoe.QuantConfig(**SCHEMES[sid])
  w13 = rng.standard_normal((e, h, 2 * n)) / np.sqrt(h)
  w13.reshape(-1)[rng.choice(w13.size, 3, replace=False)] *= 30  # outliers the scales follow
  q13 = quantize_weights(jnp.asarray(w13, jnp.float32), quant)
  q2 = quantize_weights(jnp.asarray(rng.standard_normal((e, n, h)) / np.sqrt(n), jnp.float32),
                        quant)
  x = jnp.asarray(2 * rng.standard_normal((t, h)), jnp.bfloat16)
  tw, ids = onp.random_topk(rng, t, e, k)
  b13 = jnp.asarray(0.1 * rng.standard_normal((e, 2 * n)), jnp.float32) if bias else None
  b2 = jnp.asarray(0.1 * rng.standard_normal((e, h)), jnp.float32) if bias else None
  return x, q13, q2, tw, ids, b13, b2


def _oracle(x, q13, q2, tw, ids, b13=None, b2=None, activation="silu"):
  """float64 on the NumPy unpacking of the stored bytes; the activation rounded to bf16 as
  GEMM2's operand is."""
  kw = {}
  if b13 is not None:
    kw = dict(w13_bias=np.asarray(b13, np.float64), w2_bias=np.asarray(b2, np.float64))
  bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)  # noqa: E731
  return onp.fused_moe(np.asarray(x, np.float64), np_dequant(q13), np_dequant(q2), tw, ids,
                       activation=activation, requant=bf16, **kw)


def _run(x, q13, q2, tw, ids, **kw):
  return np.asarray(run_interpreted(decode_wq.fused_experts_decode_wq, x, q13, q2,
                                    jnp.asarray(tw), jnp.asarray(ids), out_dtype=jnp.float32,
                                    **kw))


@pytest.mark.parametrize("sid,h,bias,activation", [
    # (lean: w4a16 through the API below, mxfp4 in the gpt-oss-sized tails test)
    pytest.param("w4a16", 1024, True, "silu", marks=pytest.mark.slow),
    pytest.param("w8a16", 1024, False, "swigluoai", marks=pytest.mark.slow),
    pytest.param("w4a16-zp", 2048, True, "silu", marks=pytest.mark.slow),
    pytest.param("w8a16-g128-zp", 2048, True, "silu", marks=EXHAUSTIVE),  # (as w4a16-zp)
    pytest.param("mxfp4", 512, True, "swigluoai", marks=pytest.mark.slow),
    pytest.param("nvfp4", 256, False, "silu",  # e4m3 scale bytes as stored (N / 16 = 16 a row)
                 marks=pytest.mark.slow),
    pytest.param("w4a16-g32", 512, False, "silu", marks=pytest.mark.slow),
    pytest.param("mxfp8-codes", 512, True, "silu",  # e4m3 codes -> bf16 in registers, e8m0
                 marks=pytest.mark.slow),  # per 32 (lean: test_mxfp8_through_the_api)
])
def test_decode_wq_matches_oracle(sid, h, bias, activation, rng):
  """Two items per slot (N = 256), an empty slot (-1), an expert no slot uses, T = 3; two
  windows of 8 groups at H = 2048."""
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, sid, 3, h, 256, 4, 2, bias=bias)
  ids[1, 1] = -1
  ids[:, :] = np.where(ids == 3, 2, ids)
  out = _run(x, q13, q2, tw, ids, w13_bias=b13, w2_bias=b2, activation=activation)
  assert out.shape == (3, h) and np.isfinite(out).all()
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids, b13, b2, activation), TOL,
                       f"{sid} decode_wq vs oracle")


@pytest.mark.parametrize("sid,sync,wide,ctas,n,t", [
    # wide slots: two steps each (H a multiple of 512; through the API below, lean)
    pytest.param("w4a16", True, True, 1, 384, 2, marks=EXHAUSTIVE),
    pytest.param("w4a16", True, False, 1, 384, 3, marks=EXHAUSTIVE),  # a slot a step
    pytest.param("w4a16", False, False, 1, 384, 1, marks=EXHAUSTIVE),  # wgmma
    # e2m1 codes, e4m3 scales per 16 (a window a step: windows split the wide slots) and a
    # global scale, e8m0 scales per 32, both read as bytes (nvfp4: w2's rows padded to 16
    # bytes, every expert's; mxfp4: the stored rows); then two CTAs sharing the items (no
    # two wide slots fit: a slot a step), with a per-call padded copy of each slot's rows
    pytest.param("nvfp4", True, True, 1, 384, 2, marks=pytest.mark.slow),
    # (mxfp4 on wide slots with byte scales: lean in test_prepared_operands' 320 case, and
    # at 512 through the API below)
    pytest.param("mxfp4", True, True, 1, 512, 2, marks=EXHAUSTIVE),
    pytest.param("nvfp4", True, False, 2, 384, 2, marks=EXHAUSTIVE),  # (two CTAs: tried, lost)
])
def test_decode_wq_4bit_forms_match_oracle(sid, sync, wide, ctas, n, t, rng, monkeypatch):
  """4-bit codes with bf16 tokens: the mma.sync form (words, logical K order, fragment-ordered
  token tiles; the default) on wide slots and on one step a slot, and the wgmma form it
  replaced (SYNC_4BIT off) on one problem (H = 1024; N = 384: three items a slot; GEMM1
  windows of 8 groups: one at 128, eight at 16). The flags are read when the kernel is
  traced: each case of a format has its own token count (T), so no trace is reused."""
  monkeypatch.setattr(decode_wq, "SYNC_4BIT", sync)
  monkeypatch.setattr(decode_wq, "WIDE_ROWS", wide or ctas > 1)
  if ctas > 1:
    monkeypatch.setattr(decode_wq, "PAD_ALL_BYTES", 0)
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, sid, t, 1024, n, 4, 2, bias=True)
  ids[0, 1] = -1
  plan = decode_wq.kernel_plan(decode_wq._plan(q13, q2, True), 1024, n, ctas)
  assert (plan.sync, plan.wide, plan.scale_bytes) == (sync, wide, sync and sid != "w4a16")
  out = _run(x, q13, q2, tw, ids, w13_bias=b13, w2_bias=b2,
             config=decode_wq.DecodeWQConfig(ctas_per_sm=ctas))
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids, b13, b2), TOL,
                       f"{sid} decode_wq sync={sync} wide={wide} vs oracle")


@pytest.mark.parametrize("sid,h,n,padded", [
    # gpt-oss-like, 2.5 GEMM1 steps and 2.5 items: on mma.sync the sizes padded (H to 512, N
    # to 384) on wide slots with byte scales, the steps / items past them reading TMA's fill
    # (lean: test_prepared_operands' 320 case runs this kernel on prepared scales)
    pytest.param("mxfp4", 320, 320, True, marks=pytest.mark.slow),
    pytest.param("mxfp4", 320, 320, False, marks=EXHAUSTIVE),  # PAD_TAILS off: shifted
    pytest.param("w8a16", 448, 192, False, marks=pytest.mark.slow),  # wgmma, per channel
    pytest.param("nvfp4", 384, 192, True, marks=pytest.mark.slow),  # 128 divides H, not N
])
def test_decode_wq_sizes_128_does_not_divide(sid, h, n, padded, rng, monkeypatch):
  """H or N not a multiple of 128 (gpt-oss: 2880): 4-bit codes on mma.sync run padded sizes
  (`padded_sizes`: the rows and columns past the weights read TMA's zero fill -- in the
  interpreter its uninitialized values, which the zero token columns, the masked activations
  and the dropped part rows must keep out of the output); elsewhere the last item and the last
  GEMM1 / GEMM2 steps are shifted back inside the arrays, their overlap masked (GEMM1 by the
  token tiles, the item by its activations) or written twice (GEMM2's output rows)."""
  monkeypatch.setattr(decode_wq, "PAD_TAILS", padded)
  monkeypatch.setattr(decode_wq, "PAD_ALL_BYTES", 0)  # (the byte scales: per-call copies of
  # each slot's rows, padded; every expert's and prepared ones are tested elsewhere)
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, sid, 3 if padded else 2, h, n, 4, 2, bias=True)
  ids[2 if padded else 1, 0] = -1
  plan = decode_wq.kernel_plan(decode_wq._plan(q13, q2, True), h, n)
  assert (decode_wq.padded_sizes(plan, h, n) != (h, n)) == padded
  if padded:  # (traced once per case: T differs where a format has two, as flags are read
    assert plan.wide and plan.scale_bytes  # when tracing)
  out = _run(x, q13, q2, tw, ids, w13_bias=b13, w2_bias=b2, activation="swigluoai")
  assert out.shape == (x.shape[0], h) and np.isfinite(out).all()
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids, b13, b2, "swigluoai"), TOL,
                       f"{sid} H={h} N={n} decode_wq vs oracle")
  w = lambda rows, kk: jax.eval_shape(  # noqa: E731
      lambda: quantize_weights(jnp.zeros((4, rows, kk), jnp.float32), q13.scheme))
  assert "multiples of 64" in decode_wq.unsupported(1, 2, h + 32, n, "silu",
                                                    w(h + 32, 2 * n), w(n, h + 32))


def _fp8_per_block(a: np.ndarray, block: int = 128) -> np.ndarray:
  """The fp8 kernels' intermediate: e4m3 with one scale (amax / 448) per 128 columns."""
  out = np.empty_like(a)
  for c in range(0, a.shape[-1], block):
    blk = a[..., c:c + block]
    s = np.abs(blk).max() / 448.0 or 1.0
    out[..., c:c + block] = (blk / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s
  return out


@pytest.mark.parametrize("sid,h,n,bias,activation", [
    pytest.param("mxfp4_fp8", 512, 256, True, "swigluoai", marks=EXHAUSTIVE),
    # (the 8-bit form runs only when asked, layout="decode_fp8"; lean: the API test)
    pytest.param("w4afp8", 1024, 256, False, "silu", marks=pytest.mark.slow),
    pytest.param("w4afp8-zp", 2048, 256, True, "silu", marks=EXHAUSTIVE),
    pytest.param("nvfp4_fp8", 320, 320, False, "silu", marks=pytest.mark.slow),  # tails
])
def test_decode_wq_fp8_tokens_match_oracle(sid, h, n, bias, activation, rng):
  """4-bit codes with prepare's fp8 tokens (codes -> e4m3, 8-bit wgmma): the oracle on the
  tokens' fp8 values times their scales, the intermediate quantized per 128 columns as the
  kernel does; T = 3 with an empty slot."""
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, sid, 3, h, n, 4, 2, bias=bias)
  ids[1, 1] = -1
  xq, xs = quantize_activations(x, q13.scheme)
  assert xq.dtype == jnp.float8_e4m3fn and xs.shape == (3, 1)
  out = _run(xq, q13, q2, tw, ids, w13_bias=b13, w2_bias=b2, activation=activation,
             x_scale=xs)
  assert out.shape == (3, h) and np.isfinite(out).all()
  kw = {} if b13 is None else dict(w13_bias=np.asarray(b13, np.float64),
                                   w2_bias=np.asarray(b2, np.float64))
  x_hat = np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(xs, np.float64)
  want = onp.fused_moe(x_hat, np_dequant(q13), np_dequant(q2), tw, ids, activation=activation,
                       requant=_fp8_per_block, **kw)
  onp.assert_rel_close(out, want, TOL, f"{sid} decode_wq (fp8 tokens) vs oracle")


@pytest.mark.parametrize("sid,t", [pytest.param("nvfp4_fp8", 1, marks=pytest.mark.slow),
                                   pytest.param("w4afp8", 80, marks=pytest.mark.slow)])
def test_fp8_token_schemes_through_the_api(sid, t, rng, monkeypatch):
  """fused_moe with runner_backend='pallas_mosaic': the tokens' values in bf16 into the
  bf16-token kernels, the intermediate bf16 -- one token the decode kernel, 160 slots (past
  its 128) the weight-only prefill GEMMs -- against the oracle of that path, and XLA's
  per-token requantizing one within two fp8 roundings."""
  monkeypatch.setenv("JMOE_PALLAS_INTERPRET", "1")
  x, q13, q2, tw, ids, _, _ = _problem(rng, sid, t, 512, 256, 4, 2)
  out = np.asarray(jmoe.fused_moe(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                                  runner_backend="pallas_mosaic"), np.float32)
  assert not _compat.races_found()
  xla = np.asarray(jmoe.fused_moe(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                                  runner_backend="xla"), np.float32)
  assert out.shape == (t, 512) and np.isfinite(out).all()
  onp.assert_rel_close(out, xla, 2.5 * TOL, f"{sid} T={t}: pallas vs xla")
  xq, xs = quantize_activations(x, q13.scheme)
  x_hat = np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(xs, np.float64)
  bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)  # noqa: E731
  want = onp.fused_moe(x_hat, np_dequant(q13), np_dequant(q2), tw, ids,
                       requant=bf16)
  onp.assert_rel_close(out, want, TOL, f"{sid} T={t}: pallas vs the oracle of its scheme")


# (prefill: the GEMM's own mxfp8 cases in test_pallas_prefill_wq)
@pytest.mark.parametrize("t,want", [(1, "decode"), pytest.param(6, "prefill", marks=EXHAUSTIVE)])
def test_mxfp8_through_the_api(t, want, rng, monkeypatch):
  """mxfp8 with runner_backend='pallas_mosaic': prepare's e4m3 tokens (e8m0 scales per 32)
  enter the weight-only kernels as bf16 -- exactly -- and the e4m3 codes convert to bf16 in
  registers: one token on decode_wq, six on 4 experts (slots share experts; the shared kernel
  refuses groups of 32) on the prefill GEMMs. Against the oracle of that path (the tokens'
  mxfp8 values, a bf16 intermediate) and XLA's experts (which also quantize the intermediate
  per 32: within two fp8 roundings)."""
  monkeypatch.setenv("JMOE_PALLAS_INTERPRET", "1")
  x, q13, q2, tw, ids, _, _ = _problem(rng, "mxfp8", t, 512, 256, 4, 2)
  assert pmoe.weight_only_layout(t, 2, 512, 256, as_activation("silu"), q13, q2) == want
  out = np.asarray(jmoe.fused_moe(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                                  runner_backend="pallas_mosaic"), np.float32)
  assert not _compat.races_found()
  assert out.shape == (t, 512) and np.isfinite(out).all()
  xq, xs = quantize_activations(x, q13.scheme)
  assert xq.dtype == jnp.float8_e4m3fn and xs.shape == (t, 512 // 32)
  x_hat = np.asarray(xq.astype(jnp.float32), np.float64) * np.repeat(
      np.asarray(xs.astype(jnp.float32), np.float64), 32, axis=1)
  bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)  # noqa: E731
  want_out = onp.fused_moe(x_hat, np_dequant(q13), np_dequant(q2), tw, ids, requant=bf16)
  onp.assert_rel_close(out, want_out, TOL, f"mxfp8 T={t}: pallas vs the oracle of its path")
  xla = np.asarray(jmoe.fused_moe(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                                  runner_backend="xla"), np.float32)
  onp.assert_rel_close(out, xla, 2.5 * TOL, f"mxfp8 T={t}: pallas vs xla")


def test_decode_wq_fp8_tokens_say_what_they_need(rng):
  """fp8 tokens only for 4-bit codes, with their scales; the other weight-only kernels
  refuse the schemes by name, so the layout is the decode kernel or the fallback."""
  x, q13, q2, tw, ids, _, _ = _problem(rng, "mxfp4_fp8", 1, 512, 256, 4, 2)
  xq, xs = quantize_activations(x, q13.scheme)
  silu = as_activation("silu")
  with pytest.raises(ValueError, match="x_scale: mxfp4_fp8 needs"):
    decode_wq.fused_experts_decode_wq(xq, q13, q2, jnp.asarray(tw), jnp.asarray(ids))
  with pytest.raises(ValueError, match="float8_e4m3fn tokens"):
    decode_wq.fused_experts_decode_wq(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                                      x_scale=xs)
  with pytest.raises(ValueError, match="per-token"):
    decode_wq.fused_experts_decode_wq(xq, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                                      x_scale=jnp.ones((1, 4)))
  assert "bf16 tokens, not float8_e4m3fn" in decode_wq_shared.unsupported(
      1, 2, 512, 256, silu, q13, q2)
  # one token: the tokens' values in bf16 into the bf16-token decode kernel; its 8-bit form
  # only when asked
  assert pmoe.weight_only_layout(1, 2, 512, 256, silu, q13, q2) == "decode"
  assert pmoe.weight_only_layout(1, 2, 512, 256, silu, q13, q2,
                                 layout="decode_fp8") == "decode_fp8"
  # where slots share experts, or past 128 slots: mxfp4's fp8-token prefill GEMMs
  # (test_pallas_w4a8.py; the other formats the bf16-token kernels' rule on the tokens'
  # values); an explicit decode layout stays
  assert pmoe.weight_only_layout(8, 2, 512, 256, silu, q13, q2) == "prefill_fp8"
  assert pmoe.weight_only_layout(80, 2, 512, 256, silu, q13, q2) == "prefill_fp8"
  assert pmoe.weight_only_layout(80, 2, 512, 256, silu, q13, q2, layout="prefill") == "prefill"
  assert pmoe.weight_only_layout(8, 2, 512, 256, silu, q13, q2, layout="decode") == "decode"
  with pytest.raises(ValueError, match="decode_fp8.*160 slots"):
    pmoe.weight_only_layout(80, 2, 512, 256, silu, q13, q2, layout="decode_fp8")
  w4 = [quantize_weights(jnp.ones(s, jnp.float32), jmoe.QuantConfig("w4a16"))
        for s in ((4, 512, 512), (4, 256, 512))]
  with pytest.raises(ValueError, match="decode_fp8.*not w4a16"):
    pmoe.weight_only_layout(1, 2, 512, 256, silu, *w4, layout="decode_fp8")
  with pytest.raises(ValueError, match="float8_e4m3fn tokens"):
    pmoe.fused_experts_weight_only(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids))
  g = jmoe.QuantConfig("w4afp8", act_scale="dynamic_group", act_group_size=128)
  wg = quantize_weights(jnp.ones((4, 512, 512), jnp.float32), g)
  assert "one fp8 scale per token" in decode_wq.unsupported(1, 2, 512, 256, silu, wg,
                                                            quantize_weights(
                                                                jnp.ones((4, 256, 512)), g))


@pytest.mark.parametrize("sid,t,h,n,want", [
    ("w4a16", 1, 1024, 128, "decode"),
    pytest.param("w4a16", 6, 1024, 128, "prefill_ws",  # slots sharing experts: the
                 marks=pytest.mark.slow),  # warp-specialized GEMMs (the shared kernel: below)
    pytest.param("w4a16", 5, 256, 128, "prefill_ws", marks=EXHAUSTIVE),  # (6 slots: the same)
    pytest.param("mxfp4", 1, 512, 256, "decode", marks=pytest.mark.slow)])
def test_weight_only_pallas_experts_match_xla(sid, t, h, n, want, rng, monkeypatch):
  """The public API with runner_backend='pallas_mosaic': one token (the decode kernel), six
  tokens on 4 experts (slots sharing experts: the warp-specialized GEMMs), a problem neither
  takes (H = 256: the warp-specialized weight-only prefill GEMMs) and mxfp4 at one token (the decode kernel's
  e2m1 path), each against the XLA experts and the oracle."""
  monkeypatch.setenv("JMOE_PALLAS_INTERPRET", "1")
  x, q13, q2, tw, ids, _, _ = _problem(rng, sid, t, h, n, 4, 2)
  layout = pmoe.weight_only_layout(t, 2, h, n, as_activation("silu"), q13, q2)
  assert layout == want
  out = np.asarray(jmoe.fused_moe(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                                  runner_backend="pallas_mosaic"), np.float32)
  assert not _compat.races_found()
  xla = np.asarray(jmoe.fused_moe(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                                  runner_backend="xla"), np.float32)
  onp.assert_rel_close(out, xla, TOL, f"T={t} {layout}: pallas vs xla")
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids), TOL, f"T={t} {layout} vs oracle")


@pytest.mark.parametrize("fmt,h,n,want", [
    ("mxfp4", 2880, 2880, (3072, 2944)),  # gpt-oss: mma.sync, padded
    ("nvfp4", 2880, 2880, (3072, 2944)),
    ("w4a16", 2880, 2880, (3072, 2944)),  # (per channel here: groups of 128 need 1024 | H)
    ("mxfp4", 2048, 768, (2048, 768)),  # 128 divides both: as they are
    ("mxfp4", 2304, 768, (2304, 768)),  # H not a multiple of 512 but of 128: narrow slots
    ("w8a16", 2880, 2880, (2880, 2880)),  # int8 codes: the wgmma form shifts its tails
    ("mxfp4_fp8", 2880, 2880, (2880, 2880)),  # fp8 tokens: likewise
])
def test_padded_sizes_rule(fmt, h, n, want, monkeypatch):
  """`padded_sizes`: where 128 does not divide H or N and the codes run on mma.sync, H rounds
  up to 512 and N to 128 (and the plan then takes wide slots, and byte scales for e2m1);
  else the sizes stay (PAD_TAILS off too)."""
  quant = (jmoe.QuantConfig(format="custom", weight_dtype="int4", weight_scale="channel")
           if fmt == "w4a16" else jmoe.QuantConfig(fmt))
  w = lambda rows, kk: jax.eval_shape(  # noqa: E731
      lambda: quantize_weights(jnp.zeros((2, rows, kk), jnp.float32), quant))
  plan = decode_wq._plan(w(h, 2 * n), w(n, h), False)
  assert decode_wq.padded_sizes(plan, h, n) == want
  kplan = decode_wq.kernel_plan(plan, h, n)
  if want != (h, n):
    assert kplan.sync and kplan.wide and kplan.scale_bytes == (fmt != "w4a16")
  monkeypatch.setattr(decode_wq, "PAD_TAILS", False)
  assert decode_wq.padded_sizes(plan, h, n) == (h, n)


def test_decode_wq_says_what_it_does_not_take(rng):
  """unsupported() names the first reason; the kernel raises it; an explicit decode layout
  that cannot run raises before tracing a kernel."""
  silu = as_activation("silu")
  w = lambda scheme, e, k, n, **kw: quantize_weights(  # noqa: E731
      jnp.ones((e, k, n), jnp.float32), jmoe.QuantConfig(scheme, **kw))
  q13, q2 = w("w4a16", 2, 1024, 256), w("w4a16", 2, 128, 1024)
  assert decode_wq.unsupported(1, 2, 1024, 128, silu, q13, q2) is None
  assert "129 slots" in decode_wq.unsupported(129, 1, 1024, 128, silu, q13, q2)
  assert "gated" in decode_wq.unsupported(1, 2, 1024, 128, "gelu_no_mul", q13, q2)
  g32 = w("w4a16", 2, 1024, 256, group_size=32, zero_point=True)
  assert "zero points need scales per 128" in decode_wq.unsupported(1, 2, 1024, 128, silu,
                                                                     g32, g32)
  mx = w("mxfp4", 2, 1024, 256)  # small groups and e2m1: decode_wq's, not the shared kernel's
  assert decode_wq.unsupported(1, 2, 1024, 256, silu, mx, mx) is None
  assert "shared kernel takes" in decode_wq_shared.unsupported(1, 2, 1024, 256, silu, mx, mx)
  assert "H >= 256" in decode_wq.unsupported(1, 2, 128, 128, silu, mx, mx)
  assert "N >= 256" in decode_wq.unsupported(1, 2, 1024, 128, silu, mx, mx)
  # e2m1: decode_wq while slots rarely share experts, the prefill GEMMs where they do (4-bit
  # codes), else the dequantized weights
  assert pmoe.weight_only_layout(1, 2, 1024, 256, silu, mx, mx) == "decode"
  assert pmoe.weight_only_layout(4, 2, 1024, 256, silu, mx, mx) == "prefill_ws"
  w8g32 = w("w8a16", 2, 1024, 256, weight_scale="group", group_size=32)  # (int8: prefill_ws)
  assert pmoe.weight_only_layout(4, 2, 1024, 256, silu, w8g32, w8g32) == "prefill_ws"
  f8 = w("mxfp8", 2, 1024, 256)  # e4m3 codes past the decode kernels: grouped_gemm_wq
  assert pmoe.weight_only_layout(4, 2, 1024, 256, silu, f8, f8) == "prefill"
  assert "groups of 16, 32, 128" in decode_wq.unsupported(
      1, 2, 1024, 128, silu, *(2 * [w("w4a16", 2, 1024, 256, group_size=64)]))
  # zero points at H / 128 = 8 (no 16-byte rows): small, so converted to bf16 per call
  zp13, zp2 = w("w4a16", 2, 1024, 256, zero_point=True), w("w4a16", 2, 128, 1024,
                                                           zero_point=True)
  assert decode_wq.unsupported(1, 2, 1024, 128, silu, zp13, zp2) is None
  assert pmoe.weight_only_layout(1, 2, 1024, 128, silu, zp13, zp2) == "decode"
  # deepseek-v3's (59 MB of zero bytes): only prepared
  big13, big2 = _zp_shapes(256, 7168, 2048, prepared=False)
  assert "need their bf16 copy prepared" in decode_wq.unsupported(1, 8, 7168, 2048, silu,
                                                                  big13, big2)
  with pytest.raises(ValueError, match="need their bf16 copy prepared"):
    jax.eval_shape(lambda: decode_wq.fused_experts_decode_wq(
        jnp.ones((1, 7168), jnp.bfloat16), big13, big2, jnp.ones((1, 8)),
        jnp.zeros((1, 8), jnp.int32)))
  # the shared kernel's transposed zero blocks need neither
  assert decode_wq_shared.unsupported(1, 8, 7168, 2048, silu, big13, big2) is None
  assert pmoe.weight_only_layout(1, 8, 7168, 2048, silu, big13, big2) == "decode_shared"
  assert decode_wq.unsupported(1, 8, 7168, 2048, silu,
                               *_zp_shapes(256, 7168, 2048, prepared=True)) is None
  for name in ("decode", "decode_shared"):
    with pytest.raises(ValueError, match=f"layout='{name}'"):
      pmoe.weight_only_layout(1, 2, 1024, 128, silu, g32, g32, layout=name)
  with pytest.raises(ValueError, match="stages=1"):
    decode_wq.DecodeWQConfig(stages=1)
  with pytest.raises(ValueError, match="ctas_per_sm=5"):
    decode_wq.DecodeWQConfig(ctas_per_sm=5)
  with pytest.raises(ValueError, match="ctas_per_sm=4"):  # a quarter of SMEM: 8 stages no
    decode_wq.fused_experts_decode_wq(jnp.ones((1, 1024), jnp.bfloat16), q13, q2,
                                      jnp.ones((1, 2)), jnp.zeros((1, 2), jnp.int32),
                                      config=decode_wq.DecodeWQConfig(stages=8, ctas_per_sm=4))
  with pytest.raises(ValueError, match="does not fit shared memory"):
    decode_wq.fused_experts_decode_wq(jnp.ones((1, 1024), jnp.bfloat16), q13, q2,
                                      jnp.ones((1, 2)), jnp.zeros((1, 2), jnp.int32),
                                      config=decode_wq.DecodeWQConfig(stages=9))


@pytest.mark.parametrize("t,layout,kernels", [
    (1, "auto", {"jmoe_moe_decode_wq"}),
    (4096, "prefill", {"jmoe_gg_wq_gated", "jmoe_gg_wq"})])
def test_mxfp8_lowers_for_gpu(t, layout, kernels, monkeypatch):
  """mixtral-8x7b's block in mxfp8 (the e4m3 codes' conversion: Hopper's e4m3 -> f16 pairs)
  at one token (decode_wq) and 4096 (the weight-only prefill GEMMs)."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET", raising=False)
  quant = jmoe.QuantConfig("mxfp8")
  e, k, h, n = 8, 2, 4096, 14336
  w13, w2 = (jax.eval_shape(lambda s=shape: quantize_weights(jnp.zeros(s, jnp.bfloat16), quant))
             for shape in ((e, h, 2 * n), (e, n, h)))
  text = jax.jit(lambda x, xs, w13, w2, tw, ti: pmoe.fused_experts_weight_only(
      x, w13, w2, tw, ti, x_scale=xs, layout=layout)).trace(
          S((t, h), jnp.float8_e4m3fn), S((t, h // 32), jnp.float32), w13, w2,
          S((t, k), jnp.float32), S((t, k), jnp.int32)).lower(
              lowering_platforms=("cuda",)).as_text()
  assert kernels <= set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text))


def _zp_shapes(e: int, h: int, n: int, prepared: bool):
  """w4a16-with-zero-points weights' shapes (w13 [E, 2N, H], w2 [E, H, N] stored), w13 with
  its bf16 zero rows (`decode_wq.W13_ZERO_16`) prepared or not."""
  quant = jmoe.QuantConfig("w4a16", zero_point=True)

  def qw(rows, kk, prep):
    z = S((e, rows, kk // 128), jnp.uint8)
    kept = {decode_wq.W13_ZERO_16.key: S(z.shape, jnp.bfloat16)} if prep else None
    return QuantizedWeights(values=S((e, rows, kk // 2), jnp.uint8),
                            scale=S(z.shape, jnp.float32), zero=z, scheme=quant, prepared=kept)

  return qw(2 * n, h, prepared), qw(h, n, False)


@pytest.mark.parametrize("prepared,h", [
    (True, 1024),  # one window of 8 groups
    pytest.param(False, 3072, marks=pytest.mark.slow)])  # three; small zeros made per call
def test_decode_wq_zero_points_as_bf16_rows(prepared, h, rng):
  """H / 128 = 8 or 24, no multiple of 16 (deepseek-v3's 56 likewise): w13's zero points
  reach the kernel as bf16 rows and their terms are summed a window of 8 groups at a time.
  prepared: `prepare_for_kernels` keeps the bf16 copy and the stored zeros are poisoned."""
  x, q13, q2, tw, ids, _, _ = _problem(rng, "w4a16-zp", 2, h, 128, 4, 2)
  ids[1, 0] = -1
  w13, w2 = q13, q2
  if prepared:
    w13, w2 = prepare_for_kernels(q13, q2)
    assert decode_wq.W13_ZERO_16.key in w13.prepared
    w13 = dataclasses.replace(w13, zero=jnp.full_like(w13.zero, 3))
  assert pmoe.weight_only_layout(2, 2, h, 128, as_activation("silu"), w13, w2) == "decode"
  out = _run(x, w13, w2, tw, ids)
  assert out.shape == (2, h) and np.isfinite(out).all()
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids), TOL, "zero points as bf16 rows")


def test_decode_wq_zero_points_as_bf16_rows_lower_for_gpu(monkeypatch):
  """deepseek-v3's block at 1 token, w4a16 with zero points prepared (H / 128 = 56): auto
  takes decode_wq (the shared kernel without the bf16 rows), which lowers."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET", raising=False)
  e, k, h, n, t = 256, 8, 7168, 2048, 1
  w13, w2 = _zp_shapes(e, h, n, prepared=True)
  text = jax.jit(lambda x, w13, w2, tw, ti: pmoe.fused_experts_weight_only(
      x, w13, w2, tw, ti)).trace(
          S((t, h), jnp.bfloat16), w13, w2, S((t, k), jnp.float32),
          S((t, k), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text)) == {"jmoe_moe_decode_wq"}


def test_decode_wq_lowers_for_gpu(monkeypatch):
  """qwen3-30b-a3b's block at 1 token, w4a16 with zero points, through the weight-only entry:
  one decode kernel."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET", raising=False)
  quant = jmoe.QuantConfig("w4a16", zero_point=True)
  e, k, h, n, t = 128, 8, 2048, 768, 1

  def qw(rows, kk):
    return QuantizedWeights(values=S((e, rows, kk // 2), jnp.uint8),
                            scale=S((e, rows, kk // 128), jnp.float32),
                            zero=S((e, rows, kk // 128), jnp.uint8), scheme=quant)

  text = jax.jit(lambda x, w13, w2, tw, ti: pmoe.fused_experts_weight_only(
      x, w13, w2, tw, ti)).trace(
          S((t, h), jnp.bfloat16), qw(2 * n, h), qw(h, n), S((t, k), jnp.float32),
          S((t, k), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text)) == {"jmoe_moe_decode_wq"}


def test_ring_union_members_alias():
  """The wide slots' two views of one ring are a RefUnion's members: this jax lays both out
  from byte 0 (checked when the kernel is traced; a member elsewhere raises)."""
  seen = {}

  def body(out_ref, ring):
    wide, steps = ring
    seen["offsets"] = [r.transforms[0].offset for r in ring]
    _compat.check_union_aliases(wide, steps)

  kern = _compat.kernel(body, out_type=S((8,), jnp.float32), scratch_types=[plgpu.RefUnion(
      plgpu.SMEM((2, 2, 128, 32), jnp.int32), plgpu.SMEM((2, 4, 128, 16), jnp.int32))])
  jax.jit(kern).trace().lower(lowering_platforms=("cuda",))
  assert seen["offsets"] == [0, 0]
  moved = types.SimpleNamespace(transforms=(types.SimpleNamespace(offset=1024),))
  with pytest.raises(NotImplementedError, match="byte 1024"):
    _compat.check_union_aliases(moved)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,e,k,h,n,chains", [
    pytest.param("nvfp4", 8, 2, 4096, 14336, 2, marks=pytest.mark.exhaustive),  # mixtral
    pytest.param("mxfp4", 256, 8, 7168, 2048, 2, marks=pytest.mark.exhaustive),  # deepseek-v3
    ("mxfp4", 128, 4, 2880, 2880, 2),  # gpt-oss-120b
    # int4_mma.CHAINS (timed on an H100: 2 won)
    pytest.param("mxfp4", 128, 4, 2880, 2880, 8, marks=pytest.mark.exhaustive),
    pytest.param("mxfp4", 128, 4, 2880, 2880, 4, marks=pytest.mark.exhaustive)])
def test_decode_wq_small_groups_lower_for_gpu(fmt, e, k, h, n, chains, monkeypatch):
  """The e2m1 / small-group kernel at full sizes (a window's scales at a time in SMEM: rings
  of 6 stages; the codes as words on mma.sync), through the weight-only entry; with 2, 4 or 8
  accumulator chains a block (interpret mode computes the products in jnp: lowering is where
  those forms are built)."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET", raising=False)
  monkeypatch.setattr(decode_wq.int4_mma, "CHAINS", chains)
  quant = jmoe.QuantConfig(fmt)

  def qw(rows, kk):
    gs = S((e, 1), jnp.float32) if fmt == "nvfp4" else None
    return QuantizedWeights(values=S((e, rows, kk // 2), jnp.uint8),
                            scale=S((e, rows, kk // quant.group_size), jnp.dtype(quant.scale_dtype)),
                            global_scale=gs, scheme=quant)

  w13, w2 = qw(2 * n, h), qw(h, n)
  assert decode_wq.max_stages(decode_wq._plan(w13, w2, False), h) == 6
  text = jax.jit(lambda x, w13, w2, tw, ti: pmoe.fused_experts_weight_only(
      x, w13, w2, tw, ti)).trace(
          S((1, h), jnp.bfloat16), w13, w2, S((1, k), jnp.float32),
          S((1, k), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text)) == {"jmoe_moe_decode_wq"}
  assert "mma.sync" in text and "shl.b32" in text  # e2m1 words on mma.sync (int4 needs no shl)


# --------------------------------------------------------------------------------------------
# slots sharing experts: decode_wq_shared (up to 8 tokens per item)


def test_slot_groups_cut_each_experts_run_into_eights():
  ids = jnp.asarray([3, 0, 3, -1, 3, 0, 7] + [3] * 8, jnp.int32)  # expert 3: 11 slots
  ge, gs, sg = (np.asarray(a) for a in decode_wq_shared.slot_groups(ids, 4))
  assert list(ge[:3]) == [0, 3, 3] and (ge[3:] == -1).all()  # 7 >= E: empty
  assert list(gs[0][:2]) == [1, 5] and (gs[0][2:] == -1).all()
  assert list(gs[1]) == [0, 2, 4, 7, 8, 9, 10, 11] and list(gs[2][:3]) == [12, 13, 14]
  for slot in range(len(ids)):
    g, p = sg[slot]
    if 0 <= ids[slot] < 4:
      assert gs[g, p] == slot


@pytest.mark.parametrize("sid,bias,sync,prepared,e", [
    pytest.param("w4a16", True, True, False, 16, marks=pytest.mark.slow),  # (zero points: lean)
    ("w4a16-zp", False, True, True, 3),  # int4 on mma.sync: scales (and zeros) on each step's sums
    pytest.param("w4a16-zp", True, False, False, 16, marks=pytest.mark.slow),  # the wgmma form
    pytest.param("w8a16", False, False, False, 3, marks=pytest.mark.slow),
    pytest.param("w8a16-g128-zp", True, False, False, 3, marks=pytest.mark.slow),
])
def test_decode_wq_shared_matches_oracle(sid, bias, sync, prepared, e, rng, monkeypatch):
  """T = 7, k = 2 on 2 experts of e (14 slots: an expert with more than 8 takes two groups),
  an empty slot; int4 codes on mma.sync (the default) and on the wgmma form with the scales in
  the A tile (SYNC_SHARED off; read when tracing: the two w4a16-zp cases differ in their
  biases). e = 16: more experts than the 14 slots, so w13's scale (and zero) blocks are made
  per call for the groups' experts only. prepared: on `prepare_for_kernels`' operands (w2's scales in the
  reduction's layout), w2's stored scales poisoned (NaN)."""
  monkeypatch.setattr(decode_wq_shared, "SYNC_SHARED", sync)
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, sid, 7, 1024, 256, e, 2, bias=bias)
  ids[:, :] = np.where(ids < e // 2, 0, e - 1)  # experts 0 and e - 1 (a token may meet one twice)
  ids[2, 1] = -1
  w13, w2 = q13, q2
  if prepared:
    w13, w2 = prepare_for_kernels(q13, q2)
    assert decode_wq.W2_SCALE_T.key in w2.prepared
    w2 = dataclasses.replace(w2, scale=jnp.full_like(w2.scale, jnp.nan))
  out = np.asarray(run_interpreted(decode_wq_shared.fused_experts_decode_wq_shared, x, w13, w2,
                                   jnp.asarray(tw), jnp.asarray(ids), w13_bias=b13,
                                   w2_bias=b2, out_dtype=jnp.float32))
  assert out.shape == (7, 1024) and np.isfinite(out).all()
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids, b13, b2), TOL,
                       f"{sid} decode_wq_shared vs oracle")


def test_decode_wq_shared_lowers_for_gpu(monkeypatch):
  """mixtral-8x7b's block at 16 tokens (32 slots on 8 experts), w4a16, through the
  weight-only entry with layout='decode_shared' (auto takes the warp-specialized GEMMs
  there): one shared decode kernel."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET", raising=False)
  quant = jmoe.QuantConfig("w4a16")
  e, k, h, n, t = 8, 2, 4096, 14336, 16

  def qw(rows, kk):
    return QuantizedWeights(values=S((e, rows, kk // 2), jnp.uint8),
                            scale=S((e, rows, kk // 128), jnp.float32), scheme=quant)

  text = jax.jit(lambda x, w13, w2, tw, ti: pmoe.fused_experts_weight_only(
      x, w13, w2, tw, ti, layout="decode_shared")).trace(
          S((t, h), jnp.bfloat16), qw(2 * n, h), qw(h, n), S((t, k), jnp.float32),
          S((t, k), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text)) == {
      "jmoe_moe_decode_wq_shared"}
  assert "mma.sync" in text  # int4 codes as words on mma.sync
  assert pmoe.weight_only_layout(t, k, h, n, as_activation("silu"), qw(2 * n, h),
                                 qw(h, n)) == "prefill_ws"


@pytest.mark.parametrize("seed", range(3))
def test_slot_groups_random_routings(seed):
  """Every valid slot lands in exactly one group of <= 8 slots of its own expert, groups are
  numbered densely, and slot_group inverts group_slots."""
  r = np.random.default_rng(seed)
  e, m = int(r.integers(1, 9)), int(r.integers(1, 129))
  ids = r.integers(-2, e + 2, m).astype(np.int32)  # -2, -1 and >= E: empty slots
  ge, gs, sg = (np.asarray(a) for a in decode_wq_shared.slot_groups(jnp.asarray(ids), e))
  valid = (ids >= 0) & (ids < e)
  used = ge >= 0
  assert used.sum() == sum(-(-np.sum(ids == x) // 8) for x in range(e))
  assert used[:used.sum()].all()  # the groups come first
  seen = gs[used][gs[used] >= 0]
  assert sorted(seen) == sorted(np.flatnonzero(valid))
  assert gs.shape == (m, 8)  # at most 8 slots a group
  for g in np.flatnonzero(used):
    members = gs[g][gs[g] >= 0]
    assert len(members) >= 1, (g, members)  # no empty group
    assert (gs[g][:len(members)] >= 0).all(), (g, gs[g])  # members first, then -1
    np.testing.assert_array_equal(ids[members], ge[g])
  assert (gs[~used] == -1).all()
  for s in np.flatnonzero(valid):
    assert gs[sg[s, 0], sg[s, 1]] == s
