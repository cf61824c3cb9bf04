"""The 8-bit (fp8 e4m3 / int8) Pallas grouped GEMMs and the quantized Pallas experts, in Mosaic
GPU interpret mode with race detection (as tests/test_pallas_grouped_gemm.py), against the XLA
quantized path (jmoe.experts.xla.quantized_gemm) and a float64 NumPy oracle on the dequantized
operands; and their GPU lowering on CPU (as tests/test_gpu_lowering.py).

Interpreted output buffers start as NaN: rows < sum(group_sizes) must be finite and match,
rows past it must still be NaN (the kernels leave them unwritten). Shapes are tiny.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
import oracle_np as onp
from jmoe.experts.pallas import PallasExperts, pallas_quant_support
from jmoe.experts.xla import quantized_gemm
from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import grouped_gemm_q8 as q8
from jmoe.kernels.activations import as_activation
from jmoe.quant import quantize_activations, quantize_weights
from kernel_run import EXHAUSTIVE, run_interpreted

pytestmark = pytest.mark.skipif(
    not _compat.interpret_available(),
    reason="Mosaic GPU interpret mode (private jax API) unavailable in this jax version")

TOL = 2e-2
FACTORED = ("fp8_tensor", "fp8_channel", "int8")


_call = run_interpreted


def _problem(rng, scheme, m, k, n_total, gs):
  """Quantized rows (sorted by group), quantized K-major weights and the expert of each row."""
  quant = jmoe.QuantConfig(scheme)
  x = jnp.asarray(2 * rng.standard_normal((m, k)), jnp.float32)
  w = rng.standard_normal((len(gs), k, n_total)) / np.sqrt(k)
  w.reshape(-1)[rng.choice(w.size, 3, replace=False)] *= 30  # outliers the scales must follow
  qw = quantize_weights(jnp.asarray(w, jnp.float32), quant)
  xq, xs = quantize_activations(x, quant)
  gs = jnp.asarray(gs, jnp.int32)
  eor = jnp.repeat(jnp.arange(len(gs)), gs, total_repeat_length=m)
  return quant, xq, xs, qw, gs, eor


def _oracle(xq, xs, qw, eor, tot, act=None, bias=None, row_scale=None):
  """float64: act(dequant(x) @ dequant(w)[g] + bias[g]) * row_scale on rows < tot."""
  xd = np.asarray(xq, np.float64) * np.repeat(np.asarray(xs, np.float64),
                                              xq.shape[1] // xs.shape[1], axis=1)
  wd = np.asarray(qw.dequantize(jnp.float32), np.float64)  # [E, K, N]
  g = np.asarray(eor)[:tot]
  h = np.einsum("mk,mkn->mn", xd[:tot], wd[g])
  if bias is not None:
    h = h + np.asarray(bias, np.float64)[g]
  if act is not None:
    h = onp.activation(h, act.name)
  if row_scale is not None:
    h = h * np.asarray(row_scale, np.float64)[:tot, None]
  return h


def _check_rows(out, ref, tot, what):
  out = np.asarray(out, np.float32)
  assert np.isfinite(out[:tot]).all(), f"{what}: written rows hold NaN / inf"
  assert np.isnan(out[tot:]).all(), f"{what}: rows past sum(group_sizes) were written"
  onp.assert_rel_close(out[:tot], ref, TOL, what)


# M=37 (no row tile divides it), an empty expert, one over two row tiles
RAGGED = [(37, (13, 0, 20)), (1, (0, 1, 0)), (70, (0, 66, 0))]


@pytest.mark.parametrize("scheme,case", [  # int8 takes every ragged case, fp8 the first lean
    pytest.param(s, c, marks=[pytest.mark.slow] if s == "fp8_channel" and c else [])
    for s in ("fp8_channel", "int8") for c in range(len(RAGGED))] + [("fp8_tensor", 0)])
def test_q8_gemm_matches_xla_and_oracle(scheme, case, rng):
  m, gs = RAGGED[case]
  k, n = 256, 192  # N: no 128-column tile divides it (the kernel takes 64)
  quant, xq, xs, qw, gs, eor = _problem(rng, scheme, m, k, n, gs)
  tot = int(gs.sum())
  bias = jnp.asarray(0.1 * rng.standard_normal((3, n)), jnp.float32)
  rs = jnp.asarray(rng.uniform(0.5, 1.0, m), jnp.float32)
  out = _call(q8.grouped_gemm_q8, xq, qw.values, gs, xs, qw.scale, bias=bias, row_scale=rs)
  _check_rows(out, _oracle(xq, xs, qw, eor, tot, bias=bias, row_scale=rs), tot,
              f"{scheme} vs oracle")
  xla = (quantized_gemm(xq, xs, qw, gs, eor, jnp.float32) + bias[eor]) * rs[:, None]
  onp.assert_rel_close(np.asarray(out, np.float32)[:tot], np.asarray(xla)[:tot], TOL,
                       f"{scheme} vs XLA")


@pytest.mark.parametrize("scheme,act", [("fp8_channel", "silu"), ("int8", "swigluoai"),
                                        ("fp8_tensor", "gelu_no_mul")])
def test_q8_gemm_fused_activation(scheme, act, rng):
  act = as_activation(act)
  m, gs, k, n = 40, (25, 0, 15), 128, 128
  n_total = 2 * n if act.is_gated else n
  quant, xq, xs, qw, gs, eor = _problem(rng, scheme, m, k, n_total, gs)
  bias = jnp.asarray(0.1 * rng.standard_normal((3, n_total)), jnp.float32)
  out = _call(q8.grouped_gemm_q8, xq, qw.values, gs, xs, qw.scale, activation=act, bias=bias)
  _check_rows(out, _oracle(xq, xs, qw, eor, 40, act=act, bias=bias), 40, f"{scheme}/{act.name}")


def test_q8_gemm_warp_specialized_tiles(rng):
  """The warp-specialized schedule (split n) of the 8-bit mode, gated."""
  m, gs, k, n = 64, (30, 34), 128, 128
  quant, xq, xs, qw, gs, eor = _problem(rng, "fp8_channel", m, k, 2 * n, gs)
  cfg = gg.GroupedGemmConfig(block_m=64, block_n=128, block_k=128, num_stages=2, wg_split="n")
  out = _call(q8.grouped_gemm_q8, xq, qw.values, gs, xs, qw.scale, activation="silu", config=cfg)
  _check_rows(out, _oracle(xq, xs, qw, eor, 64, act=as_activation("silu")), 64, "ws")


@pytest.mark.parametrize("case", range(len(RAGGED)))
def test_fp8_block_gemm_matches_xla_and_oracle(case, rng):
  m, gs = RAGGED[case]
  k, n = 384, 256
  quant, xq, xs, qw, gs, eor = _problem(rng, "fp8_block", m, k, n, gs)
  tot = int(gs.sum())
  bias = jnp.asarray(0.1 * rng.standard_normal((3, n)), jnp.float32)
  rs = jnp.asarray(rng.uniform(0.5, 1.0, m), jnp.float32)
  out = _call(q8.grouped_gemm_fp8_block, xq, qw.values, gs, xs, qw.scale, bias=bias,
              row_scale=rs, config=q8.BlockQ8Config(num_stages=2))  # one CTA: interpreter time
  _check_rows(out, _oracle(xq, xs, qw, eor, tot, bias=bias, row_scale=rs), tot, "fp8_block")
  xla = (quantized_gemm(xq, xs, qw, gs, eor, jnp.float32) + bias[eor]) * rs[:, None]
  onp.assert_rel_close(np.asarray(out, np.float32)[:tot], np.asarray(xla)[:tot], TOL,
                       "fp8_block vs XLA")


@pytest.mark.parametrize("cfg", [None, q8.BlockQ8Config(block_m=128, block_n=64, num_stages=2),
                                 q8.BlockQ8Config(num_stages=2, ctas_per_sm=2)])
def test_fp8_block_gated_quantized_output(cfg, rng):
  """GEMM1's epilogue writes GEMM2's input: fp8 values + per-row-per-128 scales, as
  quantize_activations would make them from the f32 activation output."""
  m, gs, k, n = 45, (20, 0, 25), 256, 128
  quant, xq, xs, qw, gs, eor = _problem(rng, "fp8_block", m, k, 2 * n, gs)
  act = as_activation("silu")
  ref = _oracle(xq, xs, qw, eor, 45, act=act)
  if cfg is not None and cfg.block_n == 64:  # plain (bf16) output, 128-row tiles of 64 columns
    out = _call(q8.grouped_gemm_fp8_block, xq, qw.values, gs, xs, qw.scale, activation=act,
                config=cfg)
    _check_rows(out, ref, 45, "fp8_block gated 128x64")
    return
  q, s = _call(q8.grouped_gemm_fp8_block, xq, qw.values, gs, xs, qw.scale, activation=act,
               quantize_output=True, config=cfg)
  assert q.dtype == jnp.float8_e4m3fn and s.shape == (m, n // 128)
  deq = np.asarray(q, np.float32) * np.repeat(np.asarray(s), 128, axis=1)
  ref_q = onp.quantize_rows(ref, "float8_e4m3fn", 128)
  onp.assert_rel_close(deq, ref_q, TOL, "quantized output vs quantize_rows(oracle)")
  _, ref_s = quantize_activations(jnp.asarray(ref, jnp.float32), quant)
  np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), rtol=1e-2)


def test_task_scales_to_rows_is_the_row_layout():
  """Per-task scale slots -> rows: every covered row reads its own task's slot."""
  gs = jnp.asarray([5, 0, 11], jnp.int32)
  m, bm = 16, 8
  meta = gg.tile_metadata(gs, m, bm)
  t_max = meta[0].shape[1]
  rows_of = np.asarray(jnp.minimum(meta[0][1], m - bm))
  tiles = np.zeros((t_max, 2, bm), np.float32)
  for t in range(t_max):
    tiles[t, :, :] = rows_of[t] + np.arange(bm) + 100 * np.arange(2)[:, None]
  out = np.asarray(q8.task_scales_to_rows(jnp.asarray(tiles), meta, m, m, bm))
  np.testing.assert_array_equal(out[:, 0], np.arange(m))
  np.testing.assert_array_equal(out[:, 1], np.arange(m) + 100)


# ---------------------------------------------------------------------------------------------
# the quantized Pallas experts


def _block_problem(rng, quant, t, h, n, e, k):
  """bf16 tokens, both expert weights quantized to `quant`, a random top-k routing."""
  x = jnp.asarray(2 * rng.standard_normal((t, h)), jnp.bfloat16)
  q13 = quantize_weights(jnp.asarray(rng.standard_normal((e, h, 2 * n)) / np.sqrt(h),
                                     jnp.float32), quant)
  q2 = quantize_weights(jnp.asarray(rng.standard_normal((e, n, h)) / np.sqrt(n), jnp.float32),
                        quant)
  tw, ids = onp.random_topk(rng, t, e, k)
  return x, q13, q2, tw, ids


def _block_oracle(x, q13, q2, tw, ids, quant, activation="silu"):
  w13, w2 = (np.asarray(w.dequantize(jnp.float32), np.float64) for w in (q13, q2))
  group = quant.act_group_size if quant.act_scale == "dynamic_group" else None
  if quant.static_activations:
    s13, s2 = (float(w.input_scale[0]) for w in (q13, q2))
    requant = lambda a: onp.quantize_static(a, quant.act_dtype, s2)  # noqa: E731
    xq = onp.quantize_static(np.asarray(x, np.float32), quant.act_dtype, s13)
  else:
    requant = lambda a: onp.quantize_rows(a, quant.act_dtype, group)  # noqa: E731
    xq = onp.quantize_rows(np.asarray(x, np.float32), quant.act_dtype, group)
  return onp.fused_moe(xq, w13, w2, tw, ids, activation=activation, requant=requant)


def _ragged_block_problem(rng, quant, squeeze: float = 1.0, size: int = 128):
  """9 bf16 tokens, 4 experts, top 2, H = N = size: every third token's second slot empty,
  expert 3 given no slot; the weights quantized to `quant` (a static scheme's scales
  calibrated, GEMM2's narrowed by `squeeze`). -> x, q13, q2, tw, ids."""
  t, h, n, e, k = 9, size, size, 4, 2
  x = jnp.asarray(2 * rng.standard_normal((t, h)), jnp.bfloat16)
  w13 = rng.standard_normal((e, h, 2 * n)) / np.sqrt(h)
  w2 = rng.standard_normal((e, n, h)) / np.sqrt(n)
  tw, ids = onp.random_topk(rng, t, e, k)
  ids[::3, 1] = -1  # empty slots
  ids[:, :] = np.where(ids == 3, -1, ids)  # an empty expert
  s13 = s2 = None
  if quant.static_activations:
    s13, s2 = _static_scales(x, w13, w2, ids, quant, squeeze)
  q13 = quantize_weights(jnp.asarray(w13, jnp.float32), quant, input_scale=s13)
  q2 = quantize_weights(jnp.asarray(w2, jnp.float32), quant, input_scale=s2)
  return x, q13, q2, tw, ids


def _static_scales(x, w13, w2, ids, quant, squeeze: float = 1.0):
  """Calibrated static input scales; squeeze < 1 narrows GEMM2's so its largest inputs
  saturate (the epilogue must clamp them as the scheme does, never NaN)."""
  from jmoe.quant import calibrate_input_scales
  s13, s2 = calibrate_input_scales(x, jnp.asarray(w13, jnp.float32),
                                   jnp.asarray(w2, jnp.float32), jnp.asarray(ids), quant)
  return s13, s2 * squeeze


@pytest.mark.parametrize("scheme", (pytest.param("fp8_block", marks=pytest.mark.slow), "int8",
                                    "int8_static", "fp8_tensor_static",
                                    pytest.param("fp8_channel_static", marks=pytest.mark.slow)))
def test_pallas_experts_match_oracle(scheme, rng):  # fp8_channel: int8's path, fp8 dtype
  """The static schemes' GEMM1 writes GEMM2's 8-bit input itself (scaled by 1 / w2's
  input_scale, rounded and clamped in the epilogue); fp8_tensor_static's scale is narrowed
  so a part of the intermediate saturates."""
  quant = jmoe.QuantConfig(scheme)
  x, q13, q2, tw, ids = _ragged_block_problem(rng, quant, 0.25 if scheme == "fp8_tensor_static"
                                              else 1.0)
  t, h = x.shape
  assert PallasExperts().quant_support(quant) is None
  out = jmoe.fused_moe(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                       runner_backend="pallas_mosaic")
  assert not _compat.races_found()
  out = np.asarray(out, np.float32)
  assert out.shape == (t, h) and np.isfinite(out).all()
  onp.assert_rel_close(out, _block_oracle(x, q13, q2, tw, ids, quant), TOL,
                       f"{scheme} pallas vs oracle")
  xla = jmoe.fused_moe(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids), runner_backend="xla")
  onp.assert_rel_close(out, np.asarray(xla, np.float32), TOL, f"{scheme} pallas vs xla")


@pytest.mark.parametrize("scheme", ("int8", "fp8_channel_static", "fp8_block",
                                    pytest.param("fp8_tensor", marks=pytest.mark.slow)))
def test_pallas_batched_experts_match_oracle(scheme, rng):
  """The batched format's quantized experts (fused_experts_quantized_batched; fp8_block on its
  block kernels, the intermediate per 128 columns): capacity 9 per expert (experts start off
  the 8-row grid, 36 rows padded to a 128-row tile), an empty expert, empty slots; against the
  float64 oracle and XLA's batched experts. Rows past an expert's count start as NaN in the
  interpreter: the result must not see them."""
  from jmoe.experts.pallas import PallasBatchedExperts
  from jmoe.experts.xla_batched import XlaBatchedExperts
  from jmoe.modular import ExpertWeights, ModularKernel
  from jmoe.prepare_finalize import NoEPBatched
  quant = jmoe.QuantConfig(scheme)
  x, q13, q2, tw, ids = _ragged_block_problem(rng, quant)
  t, h = x.shape
  weights = ExpertWeights(q13, q2)
  assert PallasBatchedExperts().quant_support(quant) is None
  args = (x, weights, jnp.asarray(tw), jnp.asarray(ids))
  out = ModularKernel(NoEPBatched(), PallasBatchedExperts(), quant)(
      *args, activation=as_activation("silu"))
  assert not _compat.races_found()
  out = np.asarray(out, np.float32)
  assert out.shape == (t, h) and np.isfinite(out).all()
  onp.assert_rel_close(out, _block_oracle(x, weights.w13, weights.w2, tw, ids, quant), TOL,
                       f"{scheme} batched pallas vs oracle")
  xla = ModularKernel(NoEPBatched(), XlaBatchedExperts(), quant)(
      *args, activation=as_activation("silu"))
  # xla_batched dequantizes to the tokens' dtype (bf16 weights and intermediate): looser
  onp.assert_rel_close(out, np.asarray(xla, np.float32), 2 * TOL, f"{scheme} batched vs xla")


@pytest.mark.parametrize("scheme,size", (
    ("w4a16", 128),  # (mxfp4 at 128: the 320 case's code path, its tails aside)
    pytest.param("mxfp4", 128, marks=EXHAUSTIVE),
    pytest.param("w8a16", 128, marks=pytest.mark.slow),
    pytest.param("mxfp4_fp8", 128, marks=pytest.mark.slow),
    pytest.param("mxfp4", 320, marks=pytest.mark.slow)))  # 128 divides neither (TAILS)
def test_pallas_batched_weight_only_experts_match_oracle(scheme, size, rng):
  """The batched format's weight-only experts (fused_experts_weight_only_batched): 4-bit
  and int8 codes on the warp-specialized weight-only GEMMs over each expert's rows (at 320,
  as gpt-oss' 2880, the last K step and column tile past the arrays), fp8 tokens dequantized
  into bf16 (mxfp4_fp8); capacity 9 per expert, an empty expert, empty slots; against the float64
  oracle on the dequantized weights (the intermediate rounded to bf16, as the kernels keep
  it) and XLA's batched experts (which re-quantize mxfp4_fp8's intermediate to fp8: the
  kernels keep it in bf16)."""
  from jmoe.experts.pallas import PallasBatchedExperts
  from jmoe.experts.xla_batched import XlaBatchedExperts
  from jmoe.modular import ExpertWeights, ModularKernel
  from jmoe.prepare_finalize import NoEPBatched
  quant = jmoe.QuantConfig(scheme)
  x, q13, q2, tw, ids = _ragged_block_problem(rng, quant, size=size)
  weights = ExpertWeights(q13, q2)
  args = (x, weights, jnp.asarray(tw), jnp.asarray(ids))
  out = ModularKernel(NoEPBatched(), PallasBatchedExperts(), quant)(
      *args, activation=as_activation("silu"))
  assert not _compat.races_found()
  out = np.asarray(out, np.float32)
  assert out.shape == x.shape and np.isfinite(out).all()
  w13, w2 = (np.asarray(w.dequantize(jnp.float32), np.float64) for w in (q13, q2))
  xq = np.asarray(x, np.float32)
  if quant.act_dtype is not None:  # prepare's tokens, as jmoe quantizes them (test_quant's)
    from jmoe.quant.activations import dequantize_activations, quantize_activations
    xq = np.asarray(dequantize_activations(*quantize_activations(x, quant)), np.float64)
  bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)  # noqa: E731
  want = onp.fused_moe(xq, w13, w2, tw, ids, requant=bf16)
  onp.assert_rel_close(out, want, TOL, f"{scheme} batched pallas vs oracle")
  xla = ModularKernel(NoEPBatched(), XlaBatchedExperts(), quant)(
      *args, activation=as_activation("silu"))
  onp.assert_rel_close(out, np.asarray(xla, np.float32), 2 * TOL, f"{scheme} batched vs xla")


@pytest.fixture(autouse=True)
def _interpret_env(monkeypatch):
  monkeypatch.setenv("JMOE_PALLAS_INTERPRET", "1")


def test_quant_support_names_what_is_missing():
  ok = [jmoe.QuantConfig(s) for s in ("fp8_tensor", "fp8_channel", "fp8_block", "int8")]
  assert all(pallas_quant_support(q) is None for q in ok)
  assert pallas_quant_support(None) is None
  for name in ("w8a16", "w4a16", "mxfp4", "nvfp4", "mxfp8"):  # fused_experts_weight_only
    assert pallas_quant_support(jmoe.QuantConfig(name)) is None, name
  grouped_fp8_tokens = jmoe.QuantConfig("mxfp4", act_dtype="float8_e4m3fn",
                                        act_scale="dynamic_group", act_group_size=128)
  assert "one scale per token" in pallas_quant_support(grouped_fp8_tokens)
  assert "zero points" in pallas_quant_support(jmoe.QuantConfig("int8", zero_point=True))
  assert "128 x 128" in pallas_quant_support(jmoe.QuantConfig("fp8_block", block_shape=(128, 64)))
  from jmoe.experts.pallas import PallasBatchedExperts
  batched = PallasBatchedExperts()
  assert "128 x 128" in batched.quant_support(jmoe.QuantConfig("fp8_block", block_shape=(128, 64)))
  for name in ("fp8_tensor", "fp8_channel", "int8", "fp8_channel_static", "int8_static",
               "fp8_block", "w4a16", "w8a16", "mxfp4", "nvfp4", "mxfp4_fp8", "mxfp8"):
    assert batched.quant_support(jmoe.QuantConfig(name)) is None, name


def test_bad_input_names_the_argument(rng):
  quant, xq, xs, qw, gs, _ = _problem(rng, "fp8_channel", 8, 128, 128, (8,))
  with pytest.raises(ValueError, match="K-major"):
    q8.grouped_gemm_q8(xq, qw.values[:, :, :64], gs, xs, qw.scale)
  with pytest.raises(ValueError, match="8-bit"):
    q8.grouped_gemm_q8(xq.astype(jnp.bfloat16), qw.values, gs, xs, qw.scale)
  with pytest.raises(ValueError, match="a_scale"):
    q8.grouped_gemm_q8(xq, qw.values, gs, xs[:4], qw.scale)
  with pytest.raises(ValueError, match="w_scale"):
    q8.grouped_gemm_q8(xq, qw.values, gs, xs, qw.scale[:, :, :1].repeat(2, axis=2))
  with pytest.raises(ValueError, match="multiple of 128"):
    q8.grouped_gemm_q8(xq[:, :64], qw.values[:, :, :64], gs, xs, qw.scale)
  with pytest.raises(ValueError, match="a_scale must be per-group"):
    q8.grouped_gemm_fp8_block(xq, qw.values, gs, jnp.ones((8, 3)), jnp.ones((1, 1, 1)))
  with pytest.raises(ValueError, match="w_scale must be 128 x 128"):
    q8.grouped_gemm_fp8_block(xq, qw.values, gs, xs, qw.scale)


# ---------------------------------------------------------------------------------------------
# GPU lowering (nothing executed)

S = jax.ShapeDtypeStruct


def _kernels(fn, *shapes) -> set:
  text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  return set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text))


@pytest.mark.parametrize("scheme,m,ctas", [("fp8_channel", 4096, None), ("int8", 4096, None),
                                           ("fp8_tensor_static", 4096, None),
                                           ("int8_static", 4096, None),
                                           ("fp8_block", 4096, None), ("fp8_block", 8, None),
                                           ("fp8_block", 4096, 1), ("fp8_block", 4096, "ws"),
                                           ("fp8_block", 4096, "ws-pairs")])
def test_quantized_block_lowers_for_gpu(scheme, m, ctas, monkeypatch):
  """The whole quantized block (qwen3-30b-a3b's shapes) at a prefill and a decode size."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET")
  from jmoe.kernels import moe as pmoe
  quant = jmoe.QuantConfig(scheme)
  e, k, h, n = 128, 8, 2048, 768
  dt = jnp.dtype(quant.weight_dtype)

  def qw(n_out, n_in):
    ts = {"tensor": (1, 1), "channel": (n_out, 1), "block": (n_out // 128, n_in // 128)}
    static = quant.static_activations
    return jmoe.quant.QuantizedWeights(
        values=S((e, n_out, n_in), dt), scale=S((e, *ts[quant.weight_scale]), jnp.float32),
        input_scale=S((1,), jnp.float32) if static else None, scheme=quant)

  g = h // 128 if quant.weight_scale == "block" else 1
  rows = 1 if quant.static_activations else m
  ws = q8.BlockQ8Config(block_m=128, warp_specialized=True)
  cfg = {None: None, 1: q8.BlockQ8Config(), "ws": ws, "ws-pairs": ws}[ctas]
  # (None: the default, ws prefill and 2 CTAs decode; ws-pairs: GEMM2 two K steps a step)
  cfg2 = dataclasses.replace(ws, k_pairs=True) if ctas == "ws-pairs" else None
  found = _kernels(lambda x, s, w13, w2, tw, ti: pmoe.fused_experts_quantized(
      x, s, w13, w2, tw, ti, config1=cfg, config2=cfg2), S((m, h), dt), S((rows, g), jnp.float32),
      qw(2 * n, h), qw(h, n),
      S((m, k), jnp.float32), S((m, k), jnp.int32))
  if quant.weight_scale == "block":
    tail = {None: "_ws" if m * k > 64 * e else "_2cta", 1: "", "ws": "_ws",
            "ws-pairs": "_ws"}[ctas]
    gemms = {f"jmoe_gg_fp8blk_gated_qout{tail}",
             f"jmoe_gg_fp8blk{tail}" + ("_kp" if ctas == "ws-pairs" else "")}
  else:
    tag = dt.name.split("_")[0]
    gemms = {f"jmoe_gg_gated_ws_rt_{tag}", f"jmoe_gg_ws_rt_{tag}"}
  # the 8-bit rows routed as 4-byte words as bf16 rows are: up to 8192 slots by the routing
  # kernels, past them by the slots' positions and the TMA row scatter
  routing = ({"jmoe_route_block_counts", "jmoe_scatter_rows"} if m * k > 8192
             else {"jmoe_route_scatter_rows"})
  # the per-token schemes' intermediate requantized in one pass (jmoe.kernels.quant_rows)
  requant = {"jmoe_quant_rows"} if quant.act_scale == "dynamic_token" else set()
  assert found == gemms | routing | requant, found


@pytest.mark.parametrize("scheme", ("fp8_channel", "int8_static", "fp8_block"))
def test_batched_quantized_block_lowers_for_gpu(scheme, monkeypatch):
  """The batched format's quantized block at qwen3-30b-a3b's sizes (capacity 256 an expert)."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET")
  from jmoe.kernels import moe as pmoe
  quant = jmoe.QuantConfig(scheme)
  e, cap, h, n = 128, 256, 2048, 768
  dt = jnp.dtype(quant.weight_dtype)
  static = quant.static_activations
  block = scheme == "fp8_block"

  def qw(n_out, n_in):
    scale = (n_out // 128, n_in // 128) if block else (n_out, 1)
    return jmoe.quant.QuantizedWeights(
        values=S((e, n_out, n_in), dt), scale=S((e, *scale), jnp.float32),
        input_scale=S((1,), jnp.float32) if static else None, scheme=quant)

  a_scale = (1, 1) if static else (e, cap, h // 128) if block else (e, cap, 1)
  found = _kernels(lambda x, s, c, w13, w2: pmoe.fused_experts_quantized_batched(
      x, s, c, w13, w2), S((e, cap, h), dt), S(a_scale, jnp.float32),
      S((e,), jnp.int32), qw(2 * n, h), qw(h, n))
  if block:
    assert len([k for k in found if k.startswith("jmoe_gg_fp8blk")]) == 2, found
    return
  tag = dt.name.split("_")[0]
  assert {f"jmoe_gg_gated_ws_rt_{tag}", f"jmoe_gg_ws_rt_{tag}"} <= found, found


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ("fp8_block",))
def test_pallas_experts_rows_by_the_scatter_kernel(scheme, rng, monkeypatch):
  """The 8-bit token rows moved by the Pallas row scatter (as 4-byte words; past the routing
  kernels' 8192 slots): both thresholds lowered to this small problem."""
  from jmoe.kernels import moe as pmoe
  from jmoe.kernels import route
  monkeypatch.setattr(pmoe, "_PALLAS_GATHER_MIN_SLOTS", 1)
  monkeypatch.setattr(route, "_MAX_SLOTS", 0)
  jax.clear_caches()  # a cached trace would keep the other path
  quant = jmoe.QuantConfig(scheme)
  t, h, n, e, k = 7, 128, 128, 3, 2
  x, q13, q2, tw, ids = _block_problem(rng, quant, t, h, n, e, k)
  ids[1, 0] = -1
  out = np.asarray(jmoe.fused_moe(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                                  runner_backend="pallas_mosaic"), np.float32)
  jax.clear_caches()
  onp.assert_rel_close(out, _block_oracle(x, q13, q2, tw, ids, quant), TOL, scheme)


def test_pallas_experts_all_slots_empty(rng):
  """No slot routed here: no task, no weight read, zeros out."""
  quant = jmoe.QuantConfig("int8")
  x = jnp.asarray(rng.standard_normal((3, 128)), jnp.bfloat16)
  q13 = quantize_weights(jnp.asarray(rng.standard_normal((2, 128, 256)), jnp.float32), quant)
  q2 = quantize_weights(jnp.asarray(rng.standard_normal((2, 128, 128)), jnp.float32), quant)
  ids = jnp.full((3, 2), -1, jnp.int32)
  out = jmoe.fused_moe(x, q13, q2, jnp.ones((3, 2)), ids, runner_backend="pallas_mosaic")
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


def test_bench_quant_reference_is_the_oracle(rng):
  """benchmarks/bench_quant.py's host reference (its correctness check on the GPU) equals the
  float64 oracle; its flags are checked."""
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
  import bench_quant as bq
  for scheme in ("fp8_block", "int8"):
    quant = jmoe.QuantConfig(scheme)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    q13 = quantize_weights(jnp.asarray(rng.standard_normal((3, 256, 256)) / 16, jnp.float32),
                           quant)
    q2 = quantize_weights(jnp.asarray(rng.standard_normal((3, 128, 256)) / 11, jnp.float32),
                          quant)
    tw, ids = onp.random_topk(rng, 3, 3, 2)
    ref = bq.quantized_reference(x, tw, ids, q13, q2)
    onp.assert_rel_close(ref, _block_oracle(x, q13, q2, tw, ids, quant), 1e-12, scheme)
  with pytest.raises(SystemExit):
    bq.parse_args(["--schemes", "fp7"])
  assert bq.parse_args(["--block-variants", "1cta,ws"]).block_variants == ["1cta", "ws"]
  with pytest.raises(SystemExit):
    bq.parse_args(["--block-variants", "3cta"])


@pytest.mark.slow
def test_fused_block_warp_specialized(rng):
  """fp8_block's warp-specialized GEMMs in the block: GEMM2 (two 64-row compute warpgroups)
  reads the per-task scales GEMM1's warpgroups wrote."""
  from jmoe.kernels import moe as pmoe
  quant = jmoe.QuantConfig("fp8_block")
  t, h, n, e, k = 24, 128, 128, 2, 2
  x, q13, q2, tw, ids = _block_problem(rng, quant, t, h, n, e, k)
  xq, xs = quantize_activations(x, quant)
  cfg = q8.BlockQ8Config(block_m=128, num_stages=2, warp_specialized=True)
  out = _call(pmoe.fused_experts_quantized, xq, xs, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
              config1=cfg)
  onp.assert_rel_close(np.asarray(out, np.float32), _block_oracle(x, q13, q2, tw, ids, quant),
                       TOL, "ws block")


@pytest.mark.parametrize("cfg", [
    q8.BlockQ8Config(num_stages=2, k_pairs=True),
    q8.BlockQ8Config(block_m=128, num_stages=2, warp_specialized=True, k_pairs=True)])
def test_fp8_block_gemm_k_pairs(cfg, rng):
  """Two K steps a pipeline step (both wgmmas issued, the first promoted under the second):
  the same products as one step at a time, on one warpgroup and warp specialized; ragged
  groups, an empty one, bias and row scale."""
  m, gs, k, n = 70, (33, 0, 37), 512, 128
  quant, xq, xs, qw, gs, eor = _problem(rng, "fp8_block", m, k, n, gs)
  bias = jnp.asarray(0.1 * rng.standard_normal((3, n)), jnp.float32)
  rs = jnp.asarray(rng.uniform(0.5, 1.0, m), jnp.float32)
  out = _call(q8.grouped_gemm_fp8_block, xq, qw.values, gs, xs, qw.scale, bias=bias,
              row_scale=rs, config=cfg)
  _check_rows(out, _oracle(xq, xs, qw, eor, m, bias=bias, row_scale=rs), m, "k_pairs")


def test_fused_block_k_pairs_gemm2(rng):
  """The block with GEMM2 in pairs of K steps, reading GEMM1's per-task scales (K = N = 256:
  one pair); a gated GEMM or an odd number of K steps is refused by name."""
  from jmoe.kernels import moe as pmoe
  quant = jmoe.QuantConfig("fp8_block")
  t, h, n, e, k = 24, 128, 256, 2, 2
  x, q13, q2, tw, ids = _block_problem(rng, quant, t, h, n, e, k)
  xq, xs = quantize_activations(x, quant)
  cfg1 = q8.BlockQ8Config(block_m=128, num_stages=2, warp_specialized=True)
  cfg2 = q8.BlockQ8Config(block_m=128, num_stages=2, warp_specialized=True, k_pairs=True)
  out = _call(pmoe.fused_experts_quantized, xq, xs, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
              config1=cfg1, config2=cfg2)
  onp.assert_rel_close(np.asarray(out, np.float32), _block_oracle(x, q13, q2, tw, ids, quant),
                       TOL, "k_pairs block")
  with pytest.raises(ValueError, match="k_pairs=True needs an ungated GEMM"):
    pmoe.fused_experts_quantized(xq, xs, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                                 config1=dataclasses.replace(cfg1, k_pairs=True), interpret=True)


def test_fp8_block_config_rules():
  """Prefill sizes take the warp-specialized 128-row form, decode the 64-row two-CTA one;
  GEMM2 follows GEMM1's form and block_m."""
  cfg = q8.block_config(32768, 768, 2048, 128, gated=True, quantize_output=True)
  assert cfg.warp_specialized and (cfg.block_m, cfg.block_n) == (128, 128)
  assert q8.gemm2_block_config(cfg, 2048) == cfg
  assert q8.gemm2_block_config(cfg, 2048 + 64).block_n == 64
  small = q8.block_config(64, 768, 2048, 128, gated=True)
  assert not small.warp_specialized and (small.block_m, small.ctas_per_sm) == (64, 2)
