"""The packed 4-bit and microscaling weight formats (w4a16 with and without zero points, w8a16
per group, mxfp4, nvfp4, mxfp8): their bytes against an independent float64 NumPy unpacking
(ml_dtypes for e2m1 / e4m3, 2 ** (c - 127) for e8m0), quantization against a NumPy
quantizer, the XLA experts against a float64 oracle on those unpacked weights (ragged routing,
empty experts, T=1), GPTQ act-order, the oracle's choices and the errors bad input gets."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmoe
import oracle_np as onp
from jmoe.quant import QuantizedWeights, check_quantized, dequantize, quantize_weights
from jmoe.quant import packing
from test_quant import check_quantized_edge_cases_under_jit

# id -> QuantConfig fields
FORMATS = {
    "w4a16": dict(format="w4a16"),
    "w4a16-g32-zp": dict(format="w4a16", group_size=32, zero_point=True),
    "w4a16-g64": dict(format="w4a16", group_size=64),
    "w8a16-g64": dict(format="w8a16", weight_scale="group", group_size=64),
    "mxfp4": dict(format="mxfp4"),
    "nvfp4": dict(format="nvfp4"),
    "mxfp8": dict(format="mxfp8"),
}
# the format's own error vs the unquantized weights (Gaussian weights with a few outliers),
# measured x ~1.3: int4 / e2m1 ~ 4 bits, e4m3 3 mantissa bits, int8 7 bits
ERROR_BOUND = {"w4a16": 0.16, "w4a16-g32-zp": 0.12, "w4a16-g64": 0.16, "w8a16-g64": 0.01,
               "mxfp4": 0.2, "nvfp4": 0.16, "mxfp8": 0.05}


def _quant(fid: str) -> jmoe.QuantConfig:
  return jmoe.QuantConfig(**FORMATS[fid])


def _weights(rng, e, k, n, outliers=True):
  w = rng.standard_normal((e, k, n)) / np.sqrt(k)
  if outliers:
    w.reshape(-1)[rng.choice(w.size, 5, replace=False)] *= 20
  return w.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# an independent NumPy reading of the stored bytes (shares no code with jmoe.quant)


def np_unpack_nibbles(b: np.ndarray, axis: int) -> np.ndarray:
  b = np.moveaxis(np.asarray(b, np.uint8), axis, -1)
  out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.uint8)
  out[..., 0::2], out[..., 1::2] = b & 0x0F, b >> 4
  return np.moveaxis(out, -1, axis)


def np_scale(s) -> np.ndarray:
  s = np.asarray(s)
  if s.dtype == ml_dtypes.float8_e8m0fnu:
    return np.exp2(s.view(np.uint8).astype(np.float64) - 127)
  return s.astype(np.float64)


def np_dequant(qw: QuantizedWeights) -> np.ndarray:
  """float64 [E, K, N] from the stored arrays of K-major QuantizedWeights."""
  assert qw.k_major
  s = qw.scheme
  v = np.asarray(qw.values)
  if s.weight_dtype == "int4":  # signed nibbles q = u - 8; w = (u - zero) * scale
    nib = np_unpack_nibbles(v, 2).astype(np.int64)
    q = np.where(nib >= 8, nib - 16, nib).astype(np.float64) + 8.0
    z = 8.0 if qw.zero is None else np.asarray(qw.zero).astype(np.float64)
  elif s.weight_dtype == "float4_e2m1fn":
    q = np_unpack_nibbles(v, 2).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    z = 0.0
  else:
    q = v.astype(np.float64)
    z = 0.0 if qw.zero is None else np.asarray(qw.zero).astype(np.float64)
  e, n, k = q.shape
  sc = np_scale(qw.scale)
  rep = lambda a: np.repeat(np.repeat(a, n // a.shape[1], 1), k // a.shape[2], 2)  # noqa: E731
  if not np.isscalar(z):
    z = rep(z)
  w = (q - z) * rep(sc)
  if qw.global_scale is not None:
    g = np.asarray(qw.global_scale, np.float64)
    w = w * np.repeat(g, n // g.shape[1], 1)[:, :, None]
  return np.swapaxes(w, 1, 2)


def np_quantize(w: np.ndarray, q: jmoe.QuantConfig) -> np.ndarray:
  """The scheme's quantization of w [E, K, N] in NumPy -> the dequantized float64 values."""
  e, k, n = w.shape
  tk = q.group_size if q.weight_scale == "group" else k
  t = w.astype(np.float32).reshape(e, k // tk, tk, n)
  amax = np.abs(t).max(axis=2, keepdims=True)
  if q.weight_dtype == "int4" and q.zero_point:
    lo, hi = np.minimum(t.min(2, keepdims=True), 0), np.maximum(t.max(2, keepdims=True), 0)
    s = np.where(hi > lo, (hi - lo) / np.float32(15), np.float32(1)).astype(np.float32)
    z = np.clip(np.rint(np.float32(0) - lo / s), 0, 15)
    deq = (np.clip(np.rint(t / s + z), 0, 15) - z) * s.astype(np.float64)
  elif q.weight_dtype == "int4":
    s = np.where(amax > 0, amax / np.float32(7), np.float32(1)).astype(np.float32)
    deq = np.clip(np.rint(t / s), -8, 7) * s.astype(np.float64)
  elif q.weight_dtype == "float4_e2m1fn" and q.scale_dtype == "float8_e8m0fnu":
    s = np.exp2(np.ceil(np.log2(np.where(amax > 0, amax / np.float32(6), 1)))).astype(np.float32)
    deq = (t / s).astype(ml_dtypes.float4_e2m1fn).astype(np.float64) * s
  elif q.weight_dtype == "float4_e2m1fn":  # nvfp4: global amax / (6 * 448), e4m3 blocks
    tmax = np.abs(w).max(axis=(1, 2)).astype(np.float32)
    g = np.where(tmax > 0, tmax / np.float32(6 * 448), np.float32(1))[:, None, None, None]
    bs = np.where(amax > 0, amax / np.float32(6) / g, np.float32(1)).astype(np.float32)
    bs = np.clip(bs, 2.0 ** -9, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = bs * g
    deq = (t / s).astype(ml_dtypes.float4_e2m1fn).astype(np.float64) * s.astype(np.float64)
  else:
    return onp.quantize_matrix(w, q.weight_dtype, tk, 1,
                               e8m0=q.scale_dtype == "float8_e8m0fnu")
  return deq.reshape(e, k, n)


# ---------------------------------------------------------------------------------------------
# the bit layouts


def test_nibble_packing_layout(rng):
  codes = rng.integers(0, 16, (3, 5, 64)).astype(np.uint8)
  for axis in (2, 1):
    c = codes if axis == 2 else np.swapaxes(codes, 1, 2)
    packed = np.asarray(packing.pack_nibbles(jnp.asarray(c), axis=axis))
    lo = np.take(c, np.arange(0, c.shape[axis], 2), axis=axis)
    hi = np.take(c, np.arange(1, c.shape[axis], 2), axis=axis)
    np.testing.assert_array_equal(packed, lo | (hi << 4))  # low nibble = the even index
    np.testing.assert_array_equal(np.asarray(packing.unpack_nibbles(jnp.asarray(packed),
                                                                    axis=axis)), c)
    np.testing.assert_array_equal(np_unpack_nibbles(packed, axis), c)
  with pytest.raises(ValueError, match=r"w13: two 4-bit values pack into one byte along K, so "
                                       r"K must be even, got K=7"):
    packing.pack_nibbles(jnp.zeros((2, 7), jnp.uint8), argname="w13")
  with pytest.raises(TypeError, match=r"packed 4-bit values must be uint8"):
    packing.unpack_nibbles(jnp.zeros((2, 4), jnp.int32))


def test_e2m1_and_e8m0_codes_match_ml_dtypes(rng):
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  x = np.concatenate([ties, -ties, [0.0, -0.0, 6.0, 7.0, 1e9, -1e9, 0.1, 5.01]],
                     ).astype(np.float32)
  x = np.concatenate([x, rng.uniform(-7, 7, 500).astype(np.float32)])
  codes = np.asarray(packing.e2m1_encode(jnp.asarray(x)))
  assert codes.dtype == np.uint8 and codes.max() < 16
  want = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)  # RNE, saturating at 6
  np.testing.assert_array_equal(codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32), want)
  np.testing.assert_array_equal(np.asarray(packing.e2m1_decode(jnp.asarray(codes))), want)
  # the dequantize path's reading: the codes as signed int4, through e4m3 (signs of zero too)
  from jmoe.quant.weights import e2m1_from_int4
  every = np.concatenate([codes, np.arange(16, dtype=np.uint8)])
  as_int4 = jnp.asarray(np.where(every >= 8, every.astype(np.int8) - 16, every).astype(np.int8))
  got = np.asarray(e2m1_from_int4(as_int4.astype(jnp.int4)))
  of_codes = every.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  np.testing.assert_array_equal(got, of_codes)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(of_codes))
  b = np.array([0, 1, 100, 126, 127, 128, 254], np.uint8)
  e8 = packing.uint8_as_e8m0(b)
  assert e8.dtype == jnp.float8_e8m0fnu
  np.testing.assert_array_equal(np.asarray(e8.astype(jnp.float32), np.float64),
                                np.exp2(b.astype(np.float64) - 127))
  np.testing.assert_array_equal(np.asarray(packing.e8m0_as_uint8(e8)), b)
  np.testing.assert_array_equal(
      np.asarray(packing.e8m0_as_uint8(packing.e8m0_from_exponent(jnp.asarray([-3, 0, 5])))),
      [124, 127, 132])


# ---------------------------------------------------------------------------------------------
# quantize / dequantize


@pytest.mark.parametrize("fid", list(FORMATS))
def test_quantize_weights_matches_numpy(fid, rng):
  q = _quant(fid)
  e, k, n = 2, 256, 64
  w = _weights(rng, e, k, n)
  qw = quantize_weights(jnp.asarray(w), q)
  check_quantized(qw, argname="w")
  g = q.group_size
  packed = q.weight_dtype in ("int4", "float4_e2m1fn")
  assert qw.values.shape == (e, n, k // 2 if packed else k) and qw.shape == (e, k, n)
  assert qw.values.dtype == (jnp.uint8 if packed else jnp.dtype(q.weight_dtype))
  assert qw.scale.shape == (e, n, k // g if g else 1)
  assert qw.scale.dtype == jnp.dtype(q.scale_dtype)
  assert (qw.zero is not None) == q.zero_point and (qw.global_scale is not None) == (
      q.scale_dtype == "float8_e4m3fn")
  got = np.asarray(dequantize(qw), np.float64)
  assert np.all(np.isfinite(got))
  onp.assert_rel_close(got, np_dequant(qw), 1e-7, f"{fid}: dequantize vs NumPy unpacking")
  onp.assert_rel_close(got, np_quantize(w, q), 1e-6, f"{fid}: quantize vs NumPy")
  assert onp.rel_err(got, w) < ERROR_BOUND[fid], onp.rel_err(got, w)
  kn = quantize_weights(jnp.asarray(w), q, k_major=False)
  assert kn.shape == (e, k, n) and kn.values.shape[1] == (k // 2 if packed else k)
  np.testing.assert_array_equal(np.asarray(dequantize(kn)), got)
  np.testing.assert_array_equal(np.asarray(dequantize(qw.with_k_major(False))), got)
  bf16 = e * k * n * 2
  assert jmoe.quant.weight_bytes(qw) < (0.35 if packed else 0.6) * bf16


def test_int4_zero_points_keep_zero_exact(rng):
  """One-sided weights: zero points beat symmetric scales, and 0 stays exactly 0."""
  w = np.abs(_weights(rng, 2, 128, 32, outliers=False)) + 0.2
  w[:, ::5] = 0.0
  zp = quantize_weights(jnp.asarray(w), jmoe.QuantConfig("w4a16", group_size=32,
                                                         zero_point=True))
  assert zp.zero.dtype == jnp.uint8 and int(zp.zero.max()) <= 15
  got = np.asarray(dequantize(zp))
  assert np.all(got[:, ::5] == 0.0)
  sym = np.asarray(dequantize(quantize_weights(jnp.asarray(w), jmoe.QuantConfig(
      "w4a16", group_size=32))))
  assert onp.rel_err(got, w) < onp.rel_err(sym, w)


def test_act_order_perm_is_undone_by_dequantize(rng):
  """GPTQ act-order: values stored with K permuted per expert (perm[e, k] = the logical row
  at stored position k) dequantize to the logical order, and the experts compute with it."""
  e, h, n = 3, 128, 64
  w13, w2 = _weights(rng, e, h, 2 * n), _weights(rng, e, n, h)
  perm = np.stack([rng.permutation(h) for _ in range(e)]).astype(np.int32)
  q = jmoe.QuantConfig("w4a16", group_size=32)
  stored = np.take_along_axis(w13, perm[:, :, None], axis=1)  # stored row k = logical perm[k]
  base = quantize_weights(jnp.asarray(stored), q)
  q13 = dataclasses.replace(base, perm=jnp.asarray(perm))
  check_quantized(q13, argname="w13")
  dense = np.asarray(dequantize(q13))
  want = np.empty_like(dense)
  want[np.arange(e)[:, None], perm] = np.asarray(dequantize(base))
  np.testing.assert_array_equal(dense, want)
  assert onp.rel_err(dense, w13) < ERROR_BOUND["w4a16"]
  q2 = quantize_weights(jnp.asarray(w2), q)
  x = rng.standard_normal((6, h)).astype(np.float32)
  tw, ids = onp.random_topk(rng, 6, e, 2)
  out = jmoe.fused_moe(jnp.asarray(x), q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                       runner_backend="xla")
  ref = onp.fused_moe(x, want, np_dequant(q2), tw, ids)
  onp.assert_rel_close(np.asarray(out), ref, 1e-5, "act-order w4a16")


# ---------------------------------------------------------------------------------------------
# the XLA experts


def _routing(rng, t, e, k):
  """Ragged top-k: empty (-1) slots, expert 2 takes most tokens, expert 3 none."""
  tw, ids = onp.random_topk(rng, t, e, k)
  ids[::3, 1] = -1
  ids[:, 0] = np.where(ids[:, 1] == 2, 0, 2)
  ids[:, 1] = np.where(ids[:, 1] == 3, -1, ids[:, 1])
  return tw, ids


def _oracle(x, q13, q2, tw, ids, quant, **kw):
  """float64: the NumPy-unpacked weights; activations quantized per the scheme."""
  w13, w2 = np_dequant(q13), np_dequant(q2)
  if quant.act_dtype is None:
    return onp.fused_moe(x, w13, w2, tw, ids, **kw)
  group = quant.act_group_size if quant.act_scale == "dynamic_group" else None
  mx = quant.scale_dtype == "float8_e8m0fnu"  # MX: power-of-two activation scales too
  rq = lambda a: onp.quantize_rows(a, quant.act_dtype, group, e8m0=mx)  # noqa: E731
  return onp.fused_moe(rq(x), w13, w2, tw, ids, requant=rq, **kw)


def _check_experts(fid, backend, rng, t=9, h=128, n=128, e=4, k=2):
  quant = _quant(fid)
  x = (2 * rng.standard_normal((t, h))).astype(np.float32)
  w13, w2 = _weights(rng, e, h, 2 * n), _weights(rng, e, n, h)
  q13, q2 = quantize_weights(jnp.asarray(w13), quant), quantize_weights(jnp.asarray(w2), quant)
  tw, ids = _routing(rng, t, e, k) if t > 1 else onp.random_topk(rng, t, e, k)
  out = jmoe.fused_moe(jnp.asarray(x), q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                       runner_backend=backend)
  assert out.shape == (t, h) and out.dtype == jnp.float32
  # weight-only: f32 GEMMs on exactly the dequantized weights; mxfp8 also rounds activations
  tol = 1e-5 if quant.weight_only else 2e-2
  onp.assert_rel_close(np.asarray(out), _oracle(x, q13, q2, tw, ids, quant), tol,
                       f"{fid}/{backend} T={t} vs NumPy-unpacked oracle")
  assert onp.rel_err(np.asarray(out), onp.fused_moe(x, w13, w2, tw, ids)) < \
      3 * ERROR_BOUND[fid], "the format's error vs unquantized"


# the group-size variants run in the slow tier (test_experts_match_oracle_exhaustive)
@pytest.mark.parametrize("fid", [f for f in FORMATS if "g64" not in f])
def test_xla_experts_match_oracle(fid, rng):
  _check_experts(fid, "xla", rng)


def test_xla_experts_single_token(rng):
  _check_experts("mxfp4", "xla", rng, t=1)


def test_few_slots_on_many_experts_xla(rng):
  """6 slots (two empty) on 16 experts: the paths that dequantize per call take only the
  touched experts (jmoe.experts._common.narrow_to_touched); the output is the oracle's."""
  _check_experts("mxfp4", "xla", rng, t=3, e=16)


@pytest.mark.parametrize("fid,h,n,activation", [
    pytest.param("nvfp4", 128, 128, "silu", marks=pytest.mark.slow),  # (lean: the 2880-kind)
    ("mxfp4", 192, 64, "swigluoai")])  # gpt-oss' kind: H / N multiples of 64, not 128; biases
def test_few_slots_on_many_experts_pallas(fid, h, n, activation, rng, monkeypatch):
  """The same on the Pallas experts (the touched experts' weights dequantized into the bf16
  kernels: the layout pinned, since the prefill GEMMs take these sizes too), bf16 tokens,
  against the XLA experts and the oracle."""
  from jmoe.kernels import _compat
  monkeypatch.setenv("JMOE_PALLAS_INTERPRET", "1")
  monkeypatch.setenv("JMOE_WEIGHT_ONLY_LAYOUT", "dequantize")
  quant, t, e, k = _quant(fid), 3, 16, 2
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  q13 = quantize_weights(jnp.asarray(_weights(rng, e, h, 2 * n)), quant)
  q2 = quantize_weights(jnp.asarray(_weights(rng, e, n, h)), quant)
  bias = activation == "swigluoai"
  b13 = (0.1 * rng.standard_normal((e, 2 * n))).astype(np.float32) if bias else None
  b2 = (0.1 * rng.standard_normal((e, h))).astype(np.float32) if bias else None
  tw, ids = _routing(rng, t, e, k)
  kw = dict(activation=activation, w13_bias=b13, w2_bias=b2)
  run = lambda b: np.asarray(jmoe.fused_moe(  # noqa: E731
      x, q13, q2, jnp.asarray(tw), jnp.asarray(ids), runner_backend=b,
      **{a: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for a, v in kw.items()}),
      np.float32)
  out = run("pallas_mosaic")
  assert not _compat.races_found()
  onp.assert_rel_close(out, run("xla"), 2e-2, f"{fid}: pallas vs xla")
  onp.assert_rel_close(out, _oracle(np.asarray(x, np.float32), q13, q2, tw, ids, quant, **kw),
                       2e-2, f"{fid}: pallas vs oracle")


def test_narrow_to_touched_renumbers_the_slots(rng):
  from jmoe.experts._common import narrow_to_touched
  from jmoe.modular import ExpertWeights
  e = 10
  q = quantize_weights(jnp.asarray(_weights(rng, e, 64, 32, outliers=False)), _quant("mxfp4"))
  bias = jnp.arange(e * 32, dtype=jnp.float32).reshape(e, 32)
  ids = jnp.array([[7, 2], [e, 7], [2, e]], jnp.int32)  # duplicates and skipped slots
  w, got = narrow_to_touched(ExpertWeights(q, q, bias, None), ids)
  u = ids.size + 1
  assert w.num_experts == u and got.shape == ids.shape
  np.testing.assert_array_equal(np.asarray(got == u), np.asarray(ids == e))
  live = np.asarray(ids < e)
  np.testing.assert_array_equal(np.asarray(w.w13_bias)[np.asarray(got)[live]],
                                np.asarray(bias)[np.asarray(ids)[live]])
  np.testing.assert_array_equal(np.asarray(w.w13.values)[np.asarray(got)[live]],
                                np.asarray(q.values)[np.asarray(ids)[live]])
  same, same_ids = narrow_to_touched(ExpertWeights(q, q), jnp.zeros((5, 2), jnp.int32))
  assert same.w13 is q and same_ids.shape == (5, 2)  # 10 slots on 10 experts: unchanged


def _divides(fid, h, n):
  g = _quant(fid).group_size or 1
  return h % g == 0 and n % g == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", [  # (reference, xla_batched: past .ci/run's budget)
    pytest.param("reference", marks=pytest.mark.exhaustive), "xla",
    pytest.param("xla_batched", marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("fid,t,h,n", [(f, *s) for f in FORMATS
                                       for s in ((1, 128, 128), (17, 256, 128), (33, 384, 64))
                                       if _divides(f, *s[1:])])
def test_experts_match_oracle_exhaustive(fid, backend, t, h, n, rng):
  _check_experts(fid, backend, rng, t=t, h=h, n=n)


@pytest.mark.slow
@pytest.mark.parametrize("fid", list(FORMATS))
def test_quantized_formats_under_jit_with_biases_and_expert_map(fid, rng):
  check_quantized_edge_cases_under_jit(_quant(fid), rng, fid)


@pytest.mark.slow
@pytest.mark.parametrize("group", (32, 64, 128))
@pytest.mark.parametrize("zero_point", (False, True))
def test_int4_group_sizes(group, zero_point, rng):
  q = jmoe.QuantConfig("w4a16", group_size=group, zero_point=zero_point)
  w = _weights(rng, 3, 512, 96)
  qw = quantize_weights(jnp.asarray(w), q)
  got = np.asarray(dequantize(qw), np.float64)
  onp.assert_rel_close(got, np_dequant(qw), 1e-7, f"g{group} zp={zero_point}")
  onp.assert_rel_close(got, np_quantize(w, q), 1e-6, f"g{group} zp={zero_point} vs NumPy")


# ---------------------------------------------------------------------------------------------
# the oracle and bad input


def test_oracle_runs_every_format_on_xla_and_says_what_pallas_takes(no_backend_env):
  """On the CPU every format runs on XLA; the Pallas experts take every weight-only format
  (decode_wq or the dequantized bf16 kernels) and mxfp8 (its tokens dequantized into them),
  and name what they miss for a W8A8 format they do not take."""
  from jmoe.experts.pallas import PallasExperts
  for fid in FORMATS:
    q = _quant(fid)
    _, experts, why = jmoe.select_backend(quant=q)
    assert experts.name == "xla" and "pallas_mosaic skipped" in why, why
    reason = PallasExperts().quant_support(q)
    if q.act_dtype is None or q.name == "mxfp8":
      assert reason is None, (fid, reason)
    else:
      assert reason and q.name in reason, (fid, reason)
  f32_groups = jmoe.QuantConfig("mxfp8", scale_dtype="float32")  # fp8 tokens per 32, not MX
  reason = PallasExperts().quant_support(f32_groups)
  assert reason and "group weight scales" in reason, reason


def test_bad_input_names_the_argument(rng):
  w = jnp.asarray(_weights(rng, 2, 96, 64))
  with pytest.raises(ValueError, match=r"w13: w4a16 scales tiles of K=128 x N=1, which do not "
                                       r"divide its \[K, N\] = \[96, 64\]"):
    quantize_weights(w, "w4a16", argname="w13")
  with pytest.raises(ValueError, match=r"w2: .* packs two 4-bit values per byte along K, so K "
                                       r"must be even, got \[K, N\] = \[9, 64\]"):
    quantize_weights(jnp.ones((2, 9, 64)), jmoe.QuantConfig("w4a16", group_size=3),
                     argname="w2")
  mx = quantize_weights(jnp.asarray(_weights(rng, 2, 128, 64)), "mxfp4")
  with pytest.raises(TypeError, match=r"w13.scale must be float8_e8m0fnu for mxfp4, got float32"):
    check_quantized(dataclasses.replace(mx, scale=mx.scale.astype(jnp.float32)), argname="w13")
  with pytest.raises(TypeError, match=r"w13.values must be uint8 \(two 4-bit codes per byte "
                                      r"along K\) for mxfp4, got int8"):
    check_quantized(dataclasses.replace(mx, values=mx.values.astype(jnp.int8)), argname="w13")
  with pytest.raises(ValueError, match=r"w13.zero: mxfp4 with zero_point=False takes no zero "
                                       r"points"):
    check_quantized(dataclasses.replace(mx, zero=jnp.zeros(mx.scale.shape, jnp.uint8)),
                    argname="w13")
  with pytest.raises(ValueError, match=r"w13.scale must be \(2, 64, 4\) for mxfp4 with "
                                       r"\[K, N\] = \[128, 64\]"):
    check_quantized(dataclasses.replace(mx, scale=mx.scale[:, :, :2]), argname="w13")
  nv = quantize_weights(jnp.asarray(_weights(rng, 2, 128, 64)), "nvfp4")
  with pytest.raises(ValueError, match=r"w2.global_scale: nvfp4's e4m3 block scales are "
                                       r"relative to a float32 global scale"):
    check_quantized(dataclasses.replace(nv, global_scale=None), argname="w2")
  with pytest.raises(ValueError, match=r"w2.global_scale must be \[E, S\] with S dividing N=64"):
    check_quantized(dataclasses.replace(nv, global_scale=jnp.ones((2, 3))), argname="w2")
  i4 = quantize_weights(jnp.asarray(_weights(rng, 2, 128, 64)), "w4a16")
  with pytest.raises(ValueError, match=r"w13.perm must be \[E, K\] = \(2, 128\)"):
    check_quantized(dataclasses.replace(i4, perm=jnp.zeros((2, 64), jnp.int32)), argname="w13")
  # through the API, at trace time, before any GEMM
  x, tw, ids = jnp.ones((3, 128)), jnp.full((3, 2), 0.5), jnp.asarray([[0, 1]] * 3, jnp.int32)
  w13 = quantize_weights(jnp.asarray(_weights(rng, 2, 128, 128)), "mxfp4")
  w2 = quantize_weights(jnp.asarray(_weights(rng, 2, 64, 128)), "mxfp4")
  with pytest.raises(TypeError, match=r"w2.scale must be float8_e8m0fnu for mxfp4"):
    jax.jit(jmoe.fused_moe).lower(x, w13, dataclasses.replace(
        w2, scale=w2.scale.astype(jnp.float32)), tw, ids)


def test_nnx_slots_keep_every_part(rng):
  """The flax layer's variables hold every array of the weights: nvfp4's global scale and
  act-order's perm included (dropping either would compute with the wrong weights)."""
  from flax import nnx
  from jmoe.layers.variables import QuantizedSlot
  nv = quantize_weights(jnp.asarray(_weights(rng, 2, 64, 32)), "nvfp4")
  i4 = quantize_weights(jnp.asarray(_weights(rng, 2, 64, 32)),
                        jmoe.QuantConfig("w4a16", group_size=32, zero_point=True))
  i4 = dataclasses.replace(i4, perm=jnp.asarray(np.stack([rng.permutation(64) for _ in
                                                          range(2)]), jnp.int32))
  for w in (nv, i4):
    m = nnx.Module()
    QuantizedSlot.store(m, "w13", w, None, None)
    back = QuantizedSlot.load(m, "w13")
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(back)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(w) == jax.tree.structure(back)


@pytest.mark.slow
def test_nnx_layer_holds_nvfp4_global_scales():
  """The flax layer runs nvfp4 (its global scale kept) and matches its dequantized weights."""
  from flax import nnx
  from jmoe.layers import MoE
  from jmoe.layers.variables import QuantizedWeight
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
  layer = MoE(cfg, rngs=nnx.Rngs(0), quant="nvfp4", runner_backend="xla")
  q = nnx.state(layer, QuantizedWeight)
  assert "w13_global_scale" in q and "w2_values" in q
  p = layer.params()
  assert p.w13.global_scale.shape == (4, 1) and p.w13.values.dtype == jnp.uint8
  x = jax.random.normal(jax.random.key(1), (5, 64))
  dense = jmoe.MoEParams(router_w=p.router_w, w13=p.w13.dequantize(), w2=p.w2.dequantize())
  onp.assert_rel_close(np.asarray(layer(x)), np.asarray(jmoe.moe_block(
      x, dense, cfg, runner_backend="reference")), 1e-5, "nvfp4 layer vs its dequantized weights")


@pytest.mark.slow
@pytest.mark.parametrize("fid,a2a", [("nvfp4", "allgather"), ("mxfp4", "ragged_a2a"),
                                     ("w4a16-g32-zp", "ragged_dedup")])
def test_packed_weights_shard_over_the_expert_axis(fid, a2a, rng):
  """EP on 8 simulated devices: every array of the packed weights (global scales included)
  shards over the expert axis; equal to the one-device block."""
  from jmoe import sharding
  quant = _quant(fid)
  t, h, n, e = 16, 128, 64, 8
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  q13 = quantize_weights(jnp.asarray(_weights(rng, e, h, 2 * n)), quant)
  q2 = quantize_weights(jnp.asarray(_weights(rng, e, n, h)), quant)
  tw, ids = (jnp.asarray(a) for a in onp.random_topk(rng, t, e, 2))
  ref = jmoe.fused_moe(x, q13, q2, tw, ids)
  par = sharding.make_parallel(data=2, expert=4)
  f = jax.jit(lambda *a: jmoe.fused_moe(*a, parallel=par, a2a_backend=a2a))
  out = f(sharding.shard_tokens(x, par), sharding.shard_expert_weights(q13, par),
          sharding.shard_expert_weights(q2, par), tw, ids)
  onp.assert_rel_close(np.asarray(out), np.asarray(ref), 1e-5, f"{fid} over {a2a}")


@pytest.mark.slow
def test_mxfp4_weights_with_fp8_activations(rng):
  """mxfp4 weights with e4m3 activations (power-of-two scales per 32): the XLA path runs the
  scheme's exact values."""
  quant = jmoe.QuantConfig("mxfp4", act_dtype="float8_e4m3fn", act_scale="dynamic_group",
                           act_group_size=32)
  t, h, n, e = 9, 128, 64, 4
  x = (2 * rng.standard_normal((t, h))).astype(np.float32)
  w13, w2 = _weights(rng, e, h, 2 * n), _weights(rng, e, n, h)
  q13, q2 = quantize_weights(jnp.asarray(w13), quant), quantize_weights(jnp.asarray(w2), quant)
  tw, ids = _routing(rng, t, e, 2)
  out = jmoe.fused_moe(jnp.asarray(x), q13, q2, jnp.asarray(tw), jnp.asarray(ids))
  onp.assert_rel_close(np.asarray(out), _oracle(x, q13, q2, tw, ids, quant), 2e-2,
                       "mxfp4 x e4m3 vs NumPy oracle")


def test_int4_checkpoint_words_and_per_channel_gptq(rng):
  """GPTQ / AWQ int32 words: code j of word m at bits 4j (AWQ: column 8m + [0 2 4 6 1 3 5 7][j]);
  a GPTQ checkpoint without groups (group_size -1: one scale row) loads per channel."""
  from jmoe.quant import int4_checkpoints as i4
  words = rng.integers(-2**31, 2**31, (3, 2)).astype(np.int32)
  u = words.view(np.uint32)
  rows = i4.unpack_int32(words, 0)  # [24, 2]
  assert rows[8 * 2 + 5, 1] == (u[2, 1] >> 20) & 15
  cols = i4.unpack_int32(words, 1, i4.AWQ_ORDER)  # [3, 16]
  assert cols[1, 8 + 2] == (u[1, 1] >> 4) & 15 and cols[1, 8 + 1] == (u[1, 1] >> 16) & 15
  with pytest.raises(TypeError, match=r"qweight must be int32"):
    i4.unpack_int32(words.astype(np.int64), 0)
  h, n = 64, 32
  lins = []
  for k, m in ((h, n), (h, n), (n, h)):
    codes = rng.integers(0, 16, (k, m))
    qw = np.zeros((k // 8, m), np.uint32)
    for j in range(8):
      qw |= codes[j::8].astype(np.uint32) << np.uint32(4 * j)
    scales = rng.uniform(0.01, 0.02, (1, m)).astype(np.float16)
    zeros = np.full((1, m // 8), 0x77777777, np.uint32).view(np.int32)  # v1 symmetric
    lin = i4.gptq_linear(qw.view(np.int32), zeros, scales, k=k, n=m)
    np.testing.assert_array_equal(lin.dequantize(), (codes - 8) * scales.astype(np.float32))
    lins.append([lin])
  w13, w2 = i4.int4_experts(*lins)
  assert w13.scheme.weight_scale == "channel" and w13.zero is None and w13.scale.shape == (
      1, 2 * n, 1)
  np.testing.assert_array_equal(np.asarray(dequantize(w2))[0], lins[2][0].dequantize())
