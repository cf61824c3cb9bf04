"""Quantized MoE: schemes, weight / activation quantization against a float64 NumPy oracle,
the quantized experts of every backend that claims a scheme, qwix interop, the oracle's
choices and the errors bad input gets."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
import oracle_np as onp
from jmoe.config import QUANT_SCHEMES
from jmoe.quant import (QuantizedWeights, dequantize, dequantize_activations, from_qwix,
                        quantize_activations, quantize_weights)

EIGHT_BIT = ("fp8_tensor", "fp8_channel", "fp8_block", "int8", "w8a16", "mxfp8")
FOUR_BIT = ("w4a16", "mxfp4", "nvfp4")
BACKENDS = ("reference", "xla", "xla_batched")


def _tiles(q: jmoe.QuantConfig, k: int, n: int) -> tuple[int, int]:
  """(tile along K, tile along N) of the scheme's weight scales (independent of the code)."""
  return {"tensor": (k, n), "channel": (k, 1), "group": (q.group_size, 1),
          "block": tuple(q.block_shape or (0, 0))}[q.weight_scale]


def _weights(rng, e, k, n, outliers=True):
  w = rng.standard_normal((e, k, n)) / np.sqrt(k)
  if outliers:  # a few large values: the scales must follow them, nothing may saturate to NaN
    w.reshape(-1)[rng.choice(w.size, 5, replace=False)] *= 40
  return w.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# schemes


def test_every_named_scheme_builds_and_names_itself():
  for name in QUANT_SCHEMES:
    q = jmoe.QuantConfig(name)
    assert q.is_quantized and q.name == name and str(q) == f"QuantConfig({name})"
    assert jmoe.QuantConfig(name, **{f: getattr(q, f) for f in ("weight_dtype", "weight_scale")}
                            ) == q
  assert jmoe.QuantConfig("w8a16").weight_only and not jmoe.QuantConfig("int8").weight_only
  assert not jmoe.QuantConfig().is_quantized and jmoe.QuantConfig().name == "none"
  custom = jmoe.QuantConfig("fp8_block", block_shape=(128, 64))
  assert custom.block_shape == (128, 64) and "block_shape=(128, 64)" in custom.name


BAD_SCHEMES = {
    "unknown_format": (dict(format="fp3"), r"QuantConfig.format='fp3' is not known"),
    "field_without_format": (dict(act_dtype="int8"),
                             r"QuantConfig.act_dtype='int8' given without a format"),
    "custom_needs_dtype": (dict(format="custom"), r"QuantConfig.weight_dtype=None is not known"),
    "bad_weight_scale": (dict(format="fp8_channel", weight_scale="row"),
                         r"QuantConfig.weight_scale='row' is not known"),
    "block_shape_kind": (dict(format="fp8_block", block_shape=(128, 0)),
                         r"QuantConfig.block_shape must be \(bk, bn\) positive ints"),
    "block_shape_without_block": (dict(format="fp8_channel", block_shape=(128, 128)),
                                  r"QuantConfig.block_shape=\(128, 128\) needs weight_scale="),
    "group_without_group": (dict(format="fp8_block", group_size=32),
                            r"QuantConfig.group_size=32 needs weight_scale='group'"),
    "zero_point_on_fp8": (dict(format="fp8_channel", zero_point=True),
                          r"QuantConfig.zero_point=True needs an integer weight_dtype"),
    "act_dtype_without_scale": (dict(format="w8a16", act_dtype="int8"),
                                r"QuantConfig.act_dtype='int8' and act_scale=None"),
    "act_group_size_without_group": (dict(format="int8", act_group_size=64),
                                     r"QuantConfig.act_group_size=64 needs act_scale="),
    "int8_acts_fp8_weights": (dict(format="fp8_channel", act_dtype="int8"),
                              r"QuantConfig.act_dtype='int8' needs weight_dtype='int8'"),
    "bad_scale_dtype": (dict(format="int8", scale_dtype="bfloat16"),
                        r"QuantConfig.scale_dtype='bfloat16' is not known"),
}


@pytest.mark.parametrize("name", list(BAD_SCHEMES))
def test_bad_scheme_names_the_field(name):
  kwargs, pattern = BAD_SCHEMES[name]
  with pytest.raises(ValueError, match=pattern):
    jmoe.QuantConfig(**kwargs)


# ---------------------------------------------------------------------------------------------
# weights and activations against the NumPy oracle


@pytest.mark.parametrize("scheme", EIGHT_BIT)
def test_quantize_weights_matches_numpy(scheme, rng):
  q = jmoe.QuantConfig(scheme)
  e, k, n = 2, 256, 384
  w = _weights(rng, e, k, n)
  qw = quantize_weights(jnp.asarray(w), q)
  tk, tn = _tiles(q, k, n)
  assert qw.values.shape == (e, n, k) and qw.values.dtype == jnp.dtype(q.weight_dtype)
  assert qw.scale.shape == (e, n // tn, k // tk) and qw.shape == (e, k, n)
  ref = onp.quantize_matrix(w, q.weight_dtype, tk, tn, e8m0=q.scale_dtype == "float8_e8m0fnu")
  got = np.asarray(dequantize(qw), np.float64)
  assert np.all(np.isfinite(got))
  onp.assert_rel_close(got, ref, 1e-6, f"{scheme} dequantize vs NumPy")
  # the format's own error, bounded (e4m3: 3 mantissa bits; int8: 127 levels per scale)
  assert onp.rel_err(got, w) < (0.04 if "8" in q.weight_dtype and "float" in q.weight_dtype
                                else 0.02)
  kn = quantize_weights(jnp.asarray(w), q, k_major=False)
  assert kn.values.shape == (e, k, n)
  np.testing.assert_array_equal(np.asarray(dequantize(kn)), np.asarray(dequantize(qw)))
  np.testing.assert_array_equal(np.asarray(dequantize(qw.with_k_major(False))), got)


def test_int8_zero_points_keep_zero_exact(rng):
  q = jmoe.QuantConfig("int8", zero_point=True)
  w = np.abs(_weights(rng, 2, 128, 64, outliers=False)) + 0.5  # one-sided: zero points matter
  w[:, ::7] = 0.0
  qw = quantize_weights(jnp.asarray(w), q)
  assert qw.zero is not None and qw.zero.shape == qw.scale.shape
  got = np.asarray(dequantize(qw))
  assert np.all(got[:, ::7] == 0.0)
  sym = np.asarray(dequantize(quantize_weights(jnp.asarray(w), "int8")))
  assert onp.rel_err(got, w) < onp.rel_err(sym, w)


@pytest.mark.parametrize("scheme", ("fp8_tensor", "fp8_block", "int8", "mxfp8"))
def test_quantize_activations_matches_numpy(scheme, rng):
  q = jmoe.QuantConfig(scheme)
  a = (rng.standard_normal((7, 256)) * rng.uniform(0.01, 30, (7, 1))).astype(np.float32)
  a[3] = 0.0  # an all-zero row: scale 1, values 0
  qa, scale = quantize_activations(jnp.asarray(a), q)
  assert qa.dtype == jnp.dtype(q.act_dtype)
  group = q.act_group_size if q.act_scale == "dynamic_group" else None
  assert scale.shape == (7, 256 // group if group else 1)
  ref = onp.quantize_rows(a, q.act_dtype, group, e8m0=q.scale_dtype == "float8_e8m0fnu")
  got = np.asarray(dequantize_activations(qa, scale))
  onp.assert_rel_close(got, ref, 1e-6, scheme)
  assert np.all(got[3] == 0.0) and np.all(np.asarray(scale)[3] == 1.0)


def test_e8m0_scale_is_exact_at_powers_of_two(rng):
  """The MX scale is the smallest power of two with amax / scale <= qmax: exact where amax /
  qmax is itself a power of two (log(x) / log(2) rounds most of those up a step) and equal to
  float64 NumPy's 2^ceil(log2) elsewhere in f32's normal range; 2^-127 / 2^127 at the clips,
  1 for amax 0."""
  from jmoe.quant.weights import e8m0_scale
  ks = np.arange(-126, 125)  # (6 * 2^125 is past f32's largest)
  amax = (np.float32(6.0) * np.exp2(ks.astype(np.float64))).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(e8m0_scale(jnp.asarray(amax), 6.0)),
                                np.exp2(ks).astype(np.float32))
  a = (np.abs(rng.standard_normal(4096)) * np.exp2(rng.integers(-100, 100, 4096))).astype(
      np.float32)
  want = np.exp2(np.ceil(np.log2((a / np.float32(448.0)).astype(np.float64))))
  np.testing.assert_array_equal(np.asarray(e8m0_scale(jnp.asarray(a), 448.0)),
                                want.astype(np.float32))
  edge = jnp.asarray([0.0, 2.0 ** -126, 1.5 * 2.0 ** 127], jnp.float32)  # (normal inputs:
  # XLA on the CPU flushes subnormal ones to 0)
  np.testing.assert_array_equal(np.asarray(e8m0_scale(edge, jnp.float32([1.0, 16.0, 1.0]))),
                                np.float32([1.0, 2.0 ** -127, 2.0 ** 127]))


@pytest.mark.parametrize("act_dtype", ("float8_e4m3fn", "int8"))
def test_static_scale_saturates_never_nan(act_dtype):
  """A calibrated scale too small for the data clamps to the type's range (e4m3: 448)."""
  q = jmoe.QuantConfig("custom", weight_dtype="int8" if act_dtype == "int8" else act_dtype,
                       weight_scale="channel", act_dtype=act_dtype, act_scale="static_tensor")
  a = jnp.asarray([[1e4, -1e4, 3.0, 0.0]], jnp.float32)
  qa, scale = quantize_activations(a, q, static_scale=jnp.float32(0.5))
  back = np.asarray(dequantize_activations(qa, scale))
  qmax = 448.0 if act_dtype != "int8" else 127.0
  np.testing.assert_array_equal(back, [[qmax * 0.5, -qmax * 0.5, 3.0, 0.0]])
  with pytest.raises(ValueError, match="needs the calibrated input_scale"):
    quantize_activations(a, q)


# ---------------------------------------------------------------------------------------------
# the quantized experts


def _routing(rng, t, e, k, case):
  tw, ids = onp.random_topk(rng, t, e, k)
  if case == "ragged":
    ids[::3, 1] = -1  # empty slots
    ids[:, 0] = np.where(ids[:, 1] == 2, 0, 2)  # expert 2 takes most tokens; expert 3 none
    ids[:, 1] = np.where(ids[:, 1] == 3, -1, ids[:, 1])
  return tw, ids


def _oracle(x, q13, q2, tw, ids, quant, activation="silu", **kw):
  """float64 reference of a quantized block: dequantized weights, the activations quantized
  per the scheme before each GEMM."""
  w13, w2 = (np.asarray(dequantize(w), np.float64) for w in (q13, q2))
  if quant.act_dtype is None:
    xq, requant = x, None
  else:
    group = quant.act_group_size if quant.act_scale == "dynamic_group" else None
    mx = quant.scale_dtype == "float8_e8m0fnu"  # power-of-two activation scales
    requant = lambda a: onp.quantize_rows(a, quant.act_dtype, group, e8m0=mx)  # noqa: E731
    xq = requant(x)
  return onp.fused_moe(xq, w13, w2, tw, ids, activation=activation, requant=requant, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", EIGHT_BIT)
def test_quantized_experts_match_oracle(scheme, backend, rng):
  quant = jmoe.QuantConfig(scheme)
  t, h, n, e, k = 9, 256, 128, 4, 2
  x = (2 * rng.standard_normal((t, h))).astype(np.float32)
  w13, w2 = _weights(rng, e, h, 2 * n), _weights(rng, e, n, h)
  q13, q2 = quantize_weights(jnp.asarray(w13), quant), quantize_weights(jnp.asarray(w2), quant)
  tw, ids = _routing(rng, t, e, k, "ragged")
  out = jmoe.fused_moe(jnp.asarray(x), q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                       runner_backend=backend)
  assert out.shape == (t, h) and out.dtype == jnp.float32
  onp.assert_rel_close(np.asarray(out), _oracle(x, q13, q2, tw, ids, quant), 2e-2,
                       f"{scheme}/{backend} vs dequantized oracle")
  dense = onp.fused_moe(x, w13, w2, tw, ids)
  assert onp.rel_err(np.asarray(out), dense) < 0.1, "the scheme's error vs unquantized"


def check_quantized_edge_cases_under_jit(quant: jmoe.QuantConfig, rng, label: str) -> None:
  """T=1, every token on one expert, an expert_map, biases and swigluoai, jitted (the XLA
  experts against the float64 oracle of the dequantized weights). Shared with
  test_quant_formats (the 4-bit and mx formats)."""
  h, n, e = 128, 128, 3
  w13, w2 = _weights(rng, e, h, 2 * n), _weights(rng, e, n, h)
  q13, q2 = quantize_weights(jnp.asarray(w13), quant), quantize_weights(jnp.asarray(w2), quant)
  b13 = (0.1 * rng.standard_normal((e, 2 * n))).astype(np.float32)
  b2 = (0.1 * rng.standard_normal((e, h))).astype(np.float32)
  f = jax.jit(lambda x, q13, q2, tw, ids, emap: jmoe.fused_moe(
      x, q13, q2, tw, ids, activation="swigluoai", w13_bias=jnp.asarray(b13),
      w2_bias=jnp.asarray(b2), expert_map=emap,
      runner_backend="xla"))
  emap = np.asarray([2, -1, 0, 1, -1], np.int32)  # 5 global experts, 3 here
  for t, ids in ((1, [[0, 3]]), (6, [[2, 0]] * 6), (4, [[1, 4], [4, 1], [-1, 2], [3, -1]])):
    ids = np.asarray(ids, np.int32)
    tw = rng.uniform(0.1, 1, ids.shape).astype(np.float32)
    x = rng.standard_normal((t, h)).astype(np.float32)
    out = f(jnp.asarray(x), q13, q2, jnp.asarray(tw), jnp.asarray(ids), jnp.asarray(emap))
    ref = _oracle(x, q13, q2, tw, ids, quant, activation="swigluoai", w13_bias=b13,
                  w2_bias=b2, expert_map=emap)
    onp.assert_rel_close(np.asarray(out), ref, 2e-2, f"{label} T={t}")


@pytest.mark.parametrize("scheme", ("fp8_block", "int8"))
def test_quantized_edge_cases_under_jit(scheme, rng):
  check_quantized_edge_cases_under_jit(jmoe.QuantConfig(scheme), rng, scheme)


def test_moe_block_runs_quantized_weights(rng):
  cfg = jmoe.get_preset("deepseek-v3").replace(num_experts=8, num_expert_group=4, topk_group=2,
                                               hidden_size=256, intermediate_size=128, top_k=2)
  params = jmoe.init_params(cfg, jax.random.key(0))
  qparams = dataclasses.replace(params, w13=quantize_weights(params.w13, "fp8_block"),
                                w2=quantize_weights(params.w2, "fp8_block"))
  x = jnp.asarray(rng.standard_normal((5, cfg.hidden_size)), jnp.float32)
  y, yq = jmoe.moe_block(x, params, cfg), jax.jit(jmoe.moe_block, static_argnums=2)(
      x, qparams, cfg)
  assert onp.rel_err(np.asarray(yq), np.asarray(y)) < 0.1


@pytest.mark.parametrize("scheme,a2a", [pytest.param("fp8_block", "allgather", marks=pytest.mark.slow),
                                        pytest.param("fp8_block", "ragged_dedup",
                                                     marks=pytest.mark.slow),
                                        ("int8", "ragged_a2a"), ("fp8_channel", "padded_a2a"),
                                        ("fp8_channel_static", "ragged_a2a"),
                                        pytest.param("int8_static", "allgather",
                                                     marks=pytest.mark.slow),
                                        pytest.param("fp8_tensor_static", "padded_a2a",
                                                     marks=pytest.mark.slow)])
def test_quantized_weights_shard_over_the_expert_axis(scheme, a2a, rng):
  """EP on 8 simulated devices (data 2 x expert 4): quantized rows and their scales ride the
  dispatch and the experts take them as they arrive (a static scheme's rows travel without
  scales: every rank holds the replicated input_scale); equal to the one-device block."""
  from jmoe import sharding
  from jmoe.quant import calibrate_input_scales
  t, h, n, e, k = 16, 128, 128, 8, 2
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  w13, w2 = jnp.asarray(_weights(rng, e, h, 2 * n)), jnp.asarray(_weights(rng, e, n, h))
  tw, ids = (jnp.asarray(a) for a in onp.random_topk(rng, t, e, k))
  s13 = s2 = None
  if jmoe.QuantConfig(scheme).static_activations:
    s13, s2 = calibrate_input_scales(x, w13, w2, ids, scheme)
  q13 = quantize_weights(w13, scheme, input_scale=s13)
  q2 = quantize_weights(w2, scheme, input_scale=s2)
  ref = jmoe.fused_moe(x, q13, q2, tw, ids)
  par = sharding.make_parallel(data=2, expert=4)
  f = jax.jit(lambda *a: jmoe.fused_moe(*a, parallel=par, a2a_backend=a2a))
  out = f(sharding.shard_tokens(x, par), sharding.shard_expert_weights(q13, par),
          sharding.shard_expert_weights(q2, par), tw, ids)
  onp.assert_rel_close(np.asarray(out), np.asarray(ref), 1e-5, f"{scheme} over {a2a}")
  tp = sharding.make_parallel(expert=4, tensor=2)
  with pytest.raises(ValueError, match=r"tensor-parallel quantized experts are not supported"):
    jmoe.fused_moe(x, q13, q2, tw, ids, parallel=tp, a2a_backend="allgather")


# ---------------------------------------------------------------------------------------------
# qwix


@pytest.mark.slow
def test_qwix_qarray_is_taken_without_copying(rng):
  qwix = pytest.importorskip("qwix")
  w13, w2 = _weights(rng, 4, 128, 256), _weights(rng, 4, 128, 128)
  q13 = qwix.quantize(jnp.asarray(w13), "int8", channelwise_axes=(0, 2))
  q2 = qwix.quantize(jnp.asarray(w2), "int8", channelwise_axes=(0, 2), tiled_axes={1: 64})
  c13 = from_qwix(q13)
  assert c13.values is q13.qvalue and c13.scale is q13.scale and not c13.k_major
  assert c13.scheme.name == "w8a16" and from_qwix(q2).scheme.group_size == 64
  np.testing.assert_array_equal(np.asarray(dequantize(c13)), np.asarray(qwix.dequantize(q13)))
  tw, ids = onp.random_topk(rng, 5, 4, 2)
  x = rng.standard_normal((5, 128)).astype(np.float32)
  q2c = qwix.quantize(jnp.asarray(w2), "int8", channelwise_axes=(0, 2))
  for quant in (None, jmoe.QuantConfig("int8")):  # weight-only, then int8 activations too
    out = jmoe.fused_moe(jnp.asarray(x), q13, q2c, jnp.asarray(tw), jnp.asarray(ids),
                         quant_config=quant)
    ref = _oracle(x, from_qwix(q13), from_qwix(q2c), tw, ids, quant or c13.scheme)
    onp.assert_rel_close(np.asarray(out), ref, 2e-2, f"qwix {quant}")


# ---------------------------------------------------------------------------------------------
# the oracle and bad input


def test_oracle_walks_candidates_with_reasons(no_backend_env):
  pf, experts, why = jmoe.select_backend(quant=jmoe.QuantConfig("fp8_block"))
  assert experts.name == "xla" and "pallas_mosaic skipped: platform=cpu" in why
  assert "for QuantConfig(fp8_block)" in why
  from jmoe.experts.pallas import pallas_quant_support
  for scheme in FOUR_BIT:  # on the CPU: XLA; the Pallas experts take them (weight-only)
    _, experts, why = jmoe.select_backend(quant=jmoe.QuantConfig(scheme))
    assert experts.name == "xla" and f"for QuantConfig({scheme})" in why
    assert pallas_quant_support(jmoe.QuantConfig(scheme)) is None
  # 4-bit codes with fp8 tokens: the decode kernel's 8-bit form takes per-token scales only
  assert pallas_quant_support(jmoe.QuantConfig("mxfp4_fp8")) is None
  assert "one scale per token or per tensor" in pallas_quant_support(
      jmoe.QuantConfig("custom", weight_dtype="float4_e2m1fn", weight_scale="group",
                       group_size=32, act_dtype="float8_e4m3fn", act_scale="dynamic_group",
                       act_group_size=32))
  for scheme in ("fp8_tensor_static", "fp8_channel_static", "int8_static"):  # both take them
    _, experts, why = jmoe.select_backend(quant=jmoe.QuantConfig(scheme))
    assert experts.name == "xla" and f"for QuantConfig({scheme})" in why
    assert pallas_quant_support(jmoe.QuantConfig(scheme)) is None


def _dense_and_quantized(rng, scheme="fp8_block", e=4, h=256, n=128):
  w13, w2 = jnp.asarray(_weights(rng, e, h, 2 * n)), jnp.asarray(_weights(rng, e, n, h))
  return (w13, w2, quantize_weights(w13, scheme), quantize_weights(w2, scheme))


def test_bad_quantized_input_names_the_argument(rng, no_backend_env):
  w13, w2, q13, q2 = _dense_and_quantized(rng)
  x = jnp.ones((3, 256))
  tw, ids = jnp.full((3, 2), 0.5), jnp.asarray([[0, 1], [2, 3], [1, 2]], jnp.int32)
  call = lambda a, b, **kw: jmoe.fused_moe(x, a, b, tw, ids, **kw)  # noqa: E731
  with pytest.raises(TypeError, match=r"w13 is quantized \(QuantConfig\(fp8_block\)\) but w2 is "
                                      r"a dense array"):
    call(q13, w2)
  with pytest.raises(TypeError, match=r"w2 is quantized .* but w13 is a dense array"):
    call(w13, q2)
  with pytest.raises(ValueError, match=r"w13 is QuantConfig\(fp8_block\) but w2 is "
                                       r"QuantConfig\(fp8_channel\)"):
    call(q13, quantize_weights(w2, "fp8_channel"))
  with pytest.raises(ValueError, match=r"quant_config=QuantConfig\(int8\) differs from the "
                                       r"weights' scheme QuantConfig\(fp8_block\)"):
    call(q13, q2, quant_config=jmoe.QuantConfig("int8"))
  bad_scale = QuantizedWeights(values=q13.values, scale=q13.scale[:, :1], scheme=q13.scheme)
  with pytest.raises(ValueError, match=r"w13.scale must be \(4, 2, 2\) for fp8_block"):
    call(bad_scale, q2)
  bad_dtype = QuantizedWeights(values=q2.values.astype(jnp.int8), scale=q2.scale,
                               scheme=q2.scheme)
  with pytest.raises(TypeError, match=r"w2.values must be float8_e4m3fn for fp8_block, got int8"):
    call(q13, bad_dtype)
  with pytest.raises(ValueError, match=r"w13: fp8_block scales tiles of K=128 x N=128, which do "
                                       r"not divide its \[K, N\] = \[200, 256\]"):
    quantize_weights(jnp.ones((4, 200, 256)), "fp8_block", argname="w13")
  with pytest.raises(ValueError, match=r"w13: mxfp4 scales tiles of K=32 x N=1, which do not "
                                       r"divide its \[K, N\] = \[200, 256\]"):
    quantize_weights(jnp.ones((4, 200, 256)), "mxfp4", argname="w13")
  with pytest.raises(TypeError, match=r"w must be a floating-point array to quantize"):
    quantize_weights(jnp.ones((4, 128, 128), jnp.int32), "int8")
  g = jmoe.QuantConfig("int8", act_scale="dynamic_group", act_group_size=96)
  w13g, w2g = quantize_weights(w13, g), quantize_weights(w2, g)
  with pytest.raises(ValueError, match=r"hidden_states \(H\): .* groups of 96 channels, which do "
                                       r"not divide its width 256"):
    call(w13g, w2g)


@pytest.mark.parametrize("scheme", [pytest.param("fp8_block", marks=pytest.mark.slow), "mxfp4"])
def test_gradients_around_frozen_quantized_experts(scheme, rng):
  """QuantizedWeights are frozen: the VJP of the quantized block is the dense block's at the
  dequantized weights for x, the router weights, the biases and the residual (straight
  through the activation quantization), and the weights get none."""
  _, _, q13, q2 = _dense_and_quantized(rng, scheme)
  t, h, e = 3, 256, 4
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  res = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  tw = jnp.asarray(rng.random((t, 2)), jnp.float32)
  ids = jnp.asarray([[0, 1], [2, -1], [1, 2]], jnp.int32)
  b13 = jnp.asarray(0.1 * rng.standard_normal((e, 256)), jnp.float32)
  b2 = jnp.asarray(0.1 * rng.standard_normal((e, h)), jnp.float32)

  def block(x, a, b, tw, b13, b2, res):
    return jmoe.fused_moe(x, a, b, tw, ids, w13_bias=b13, w2_bias=b2, residual=res)

  y, vjp = jax.vjp(jax.jit(lambda x, tw, b13, b2, res: block(x, q13, q2, tw, b13, b2, res)),
                   x, tw, b13, b2, res)
  onp.assert_rel_close(np.asarray(y), np.asarray(block(x, q13, q2, tw, b13, b2, res)), 1e-6,
                       f"{scheme} forward (jit vs eager)")
  d13, d2 = dequantize(q13, jnp.float32), dequantize(q2, jnp.float32)
  _, dense_vjp = jax.vjp(lambda x, tw, b13, b2, res: block(x, d13, d2, tw, b13, b2, res),
                         x, tw, b13, b2, res)
  g = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
  names = ("x", "topk_weights", "w13_bias", "w2_bias", "residual")
  for name, got, want in zip(names, vjp(g), dense_vjp(g)):
    onp.assert_rel_close(np.asarray(got), np.asarray(want), 1e-5, f"{scheme} d{name}")
  if scheme == "fp8_block":  # (float32 scales) frozen: a zero cotangent
    _, wvjp = jax.vjp(lambda s: block(x, dataclasses.replace(q13, scale=s), q2, tw, b13, b2,
                                      res), q13.scale)
    assert float(jnp.abs(wvjp(g)[0]).max()) == 0.0


@pytest.mark.parametrize("scheme", ["fp8_channel", "int8", "fp8_block", "w4a16"])
def test_quantized_training_straight_through(scheme, rng):
  """Dense w13 / w2 with quant_config: the forward is the quantized block (bit for bit as on
  quantize_weights' weights), the backward the dense block's VJP at the dequantized weights
  for the same cotangent (x, both weights, router weights, biases, residual); an empty slot
  and an unused expert included."""
  q = jmoe.QuantConfig(scheme)
  t, h, n, e, k = 6, 256, 128, 4, 2
  w13, w2 = (jnp.asarray(a) for a in (_weights(rng, e, h, 2 * n), _weights(rng, e, n, h)))
  b13 = jnp.asarray(0.1 * rng.standard_normal((e, 2 * n)), jnp.float32)
  b2 = jnp.asarray(0.1 * rng.standard_normal((e, h)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  res = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  tw = jnp.asarray(rng.random((t, k)), jnp.float32)
  ids = jnp.asarray([[0, 1], [2, 1], [1, -1], [0, 2], [2, 0], [1, 2]], jnp.int32)  # 3 unused

  def block(x, a, b, tw, b13, b2, res, **kw):
    return jmoe.fused_moe(x, a, b, tw, ids, w13_bias=b13, w2_bias=b2, residual=res, **kw)

  args = (x, w13, w2, tw, b13, b2, res)
  y, vjp = jax.vjp(jax.jit(lambda *a: block(*a, quant_config=q)), *args)
  q13, q2 = quantize_weights(w13, q), quantize_weights(w2, q)
  onp.assert_rel_close(np.asarray(y), np.asarray(block(x, q13, q2, tw, b13, b2, res)), 1e-6,
                       f"{scheme} forward (jit vs eager)")
  d13, d2 = dequantize(q13, jnp.float32), dequantize(q2, jnp.float32)
  _, dense_vjp = jax.vjp(block, x, d13, d2, tw, b13, b2, res)
  g = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
  names = ("x", "w13", "w2", "topk_weights", "w13_bias", "w2_bias", "residual")
  for name, got, want in zip(names, vjp(g), dense_vjp(g)):
    onp.assert_rel_close(np.asarray(got), np.asarray(want), 1e-5, f"{scheme} d{name}")
  assert float(jnp.abs(vjp(g)[1][3]).max()) == 0.0  # expert 3 takes no slot: no gradient


def test_quantized_training_over_the_expert_axis(rng):
  """Quantized training under EP (8 simulated devices, ragged all-to-all): the gradients of
  x, w13 and w2 equal the one-device ones."""
  from jmoe import sharding
  t, h, n, e, k = 16, 128, 128, 8, 2
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  w13, w2 = jnp.asarray(_weights(rng, e, h, 2 * n)), jnp.asarray(_weights(rng, e, n, h))
  tw, ids = (jnp.asarray(a) for a in onp.random_topk(rng, t, e, k))
  q = jmoe.QuantConfig("fp8_channel")
  par = sharding.make_parallel(data=2, expert=4)

  def loss(x, a, b, **kw):
    return jnp.sum(jmoe.fused_moe(x, a, b, tw, ids, quant_config=q, **kw) ** 2)

  want = jax.grad(loss, argnums=(0, 1, 2))(x, w13, w2)
  got = jax.jit(jax.grad(functools.partial(loss, parallel=par, a2a_backend="ragged_a2a"),
                         argnums=(0, 1, 2)))(
      sharding.shard_tokens(x, par), sharding.shard_expert_weights(w13, par),
      sharding.shard_expert_weights(w2, par))
  for name, a, b in zip(("x", "w13", "w2"), got, want):
    onp.assert_rel_close(np.asarray(a), np.asarray(b), 1e-5, f"EP d{name}")


def test_quantized_training_refuses_static_schemes(rng):
  w13, w2, _, _ = _dense_and_quantized(rng)
  tw, ids = jnp.full((3, 2), 0.5), jnp.asarray([[0, 1], [2, 3], [1, 2]], jnp.int32)
  with pytest.raises(ValueError, match="static scheme's calibrated input scales are for "
                                       "inference"):
    jmoe.fused_moe(jnp.ones((3, 256)), w13, w2, tw, ids,
                   quant_config=jmoe.QuantConfig("fp8_channel_static"))


@pytest.mark.parametrize("scheme", ["w4a16", "mxfp4"])
def test_packed_weights_closed_over_by_jit_unpack_as_eager(scheme, rng):
  """4-bit weights captured by a jitted function become HLO constants, which XLA's constant
  folding would unpack wrongly through a bitcast to a 4-bit type (jmoe.quant.packing.view_4bit
  keeps the bitcast out of its reach): the jitted block equals the eager one."""
  from jmoe.quant.packing import view_4bit
  packed = jnp.asarray(rng.integers(0, 256, (16, 64)), jnp.uint8)
  lo_hi = np.stack([np.asarray(packed) & 0xF, np.asarray(packed) >> 4], -1).astype(np.int32)
  want = np.where(lo_hi > 7, lo_hi - 16, lo_hi)  # signed nibbles
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda: view_4bit(packed))(), np.int32), want)
  _, _, q13, q2 = _dense_and_quantized(rng, scheme)
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
  tw, ids = jnp.full((3, 2), 0.5), jnp.asarray([[0, 1], [2, -1], [1, 2]], jnp.int32)
  eager = jmoe.fused_moe(x, q13, q2, tw, ids)
  jitted = jax.jit(lambda x: jmoe.fused_moe(x, q13, q2, tw, ids))(x)
  onp.assert_rel_close(np.asarray(jitted, np.float32), np.asarray(eager, np.float32), 1e-2,
                       f"{scheme} jitted on constant weights vs eager")


@pytest.mark.parametrize("scheme", ["fp8_channel", pytest.param("w4a16", marks=pytest.mark.slow)])
def test_gradients_around_frozen_quantized_experts_over_the_expert_axis(scheme, rng):
  """Frozen QuantizedWeights sharded over the expert axis (8 simulated devices, ragged
  all-to-all): the tokens' and router weights' gradients equal the one-device ones."""
  from jmoe import sharding
  t, h, n, e, k = 16, 128, 128, 8, 2
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  q13, q2 = (quantize_weights(jnp.asarray(a), scheme)
             for a in (_weights(rng, e, h, 2 * n), _weights(rng, e, n, h)))
  tw, ids = (jnp.asarray(a) for a in onp.random_topk(rng, t, e, k))
  par = sharding.make_parallel(data=2, expert=4)

  def loss(x, tw, a, b, **kw):
    return jnp.sum(jmoe.fused_moe(x, a, b, tw, ids, **kw) ** 2)

  want = jax.grad(loss, argnums=(0, 1))(x, tw, q13, q2)
  got = jax.jit(jax.grad(functools.partial(loss, parallel=par, a2a_backend="ragged_a2a"),
                         argnums=(0, 1)))(
      sharding.shard_tokens(x, par), tw, sharding.shard_expert_weights(q13, par),
      sharding.shard_expert_weights(q2, par))
  for name, a, b in zip(("x", "topk_weights"), got, want):
    onp.assert_rel_close(np.asarray(a), np.asarray(b), 1e-5, f"EP {scheme} d{name}")
