"""CPU tests of the Pallas Mosaic GPU grouped-GEMM kernels, in Mosaic GPU interpret mode.

The kernels run in GPU interpret mode (InterpretGPUParams(detect_races=True), through
jmoe.kernels._compat); every kernel call must finish without a detected race. Output buffers of
interpreted kernels start as NaN (uninitialized memory), which poisons them: every row that the
contract says is written (rows < sum(group_sizes)) must be finite and match the pure-jnp
reference; the pure-jnp reference is itself checked against a float64 NumPy oracle.
Shapes are tiny: interpretation is slow (seconds per kernel call).
"""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax
import jax.numpy as jnp

from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import moe as pmoe
from jmoe.kernels import permute as perm
from jmoe.kernels.activations import ACTIVATIONS, Activation
from kernel_run import EXHAUSTIVE, run_interpreted

pytestmark = pytest.mark.skipif(
    not _compat.interpret_available(),
    reason="Mosaic GPU interpret mode (private jax API) unavailable in this jax version; "
           "see pallas_kernels/_compat.py")

C = gg.GroupedGemmConfig
# Small configs (one per kernel structure): plain pipeline, warp-specialized split n / split m.
CFG_PLAIN = C(block_m=64, block_n=64, block_k=32, num_stages=2, warp_specialized=False)
CFG_WS_N = C(block_m=64, block_n=128, block_k=32, num_stages=2, wg_split="n")
CFG_2CTA = C(block_m=64, block_n=64, block_k=32, num_stages=2, warp_specialized=False,
             ctas_per_sm=2)  # two CTAs share the items (the interpreter runs both)
CFG_XI = C(block_m=64, block_n=64, block_k=32, num_stages=3, warp_specialized=False,
           cross_item=True)  # one pipeline over all of a CTA's items
CFG_XI_2CTA = dataclasses.replace(CFG_XI, ctas_per_sm=2)
CFG_XI_WS = C(block_m=64, block_n=128, block_k=32, num_stages=3, wg_split="n",
              cross_item=True)  # warp specialized: the items' pipelines chained
CFG_WS_M = C(block_m=128, block_n=64, block_k=32, num_stages=3, wg_split="m", grid_minor="m",
             grid_tile_width=1)
CFG_XI_WS_M = C(block_m=128, block_n=64, block_k=32, num_stages=3, wg_split="m",
                grid_minor="m", grid_tile_width=2, cross_item=True)  # chained, row-tile bands

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


def _interpret():
  return _compat.interpret_params(detect_races=True)


def _call(fn, *args, **kw):
  """Run an interpreted kernel (kernel_run.run_interpreted) -> f32 NumPy."""
  return np.asarray(run_interpreted(fn, *args, **kw), np.float32)


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _data(rng, m, k, n, e, dtype, *, cols=None):
  cols = n if cols is None else cols
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  rhs = (rng.standard_normal((e, k, cols)) / np.sqrt(k)).astype(np.float32)
  return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)


# ----------------------------------------------------------------------------- float64 oracle


def _oracle(lhs, rhs, gs, *, bias=None, row_scale=None, act=None, gated=False):
  lhs = np.asarray(lhs, np.float64)
  rhs = np.asarray(rhs, np.float64)
  gs = np.asarray(gs)
  m = lhs.shape[0]
  ends = np.cumsum(gs)
  starts = ends - gs
  out = np.zeros((m, rhs.shape[2] // (2 if gated else 1)))
  for g in range(len(gs)):
    rows = slice(starts[g], min(ends[g], m))
    h = lhs[rows] @ rhs[g]
    if bias is not None:
      h = h + np.asarray(bias, np.float64)[g]
    if gated:
      n = h.shape[1] // 2
      y = np.asarray(act.gated(jnp.asarray(h[:, :n], jnp.float32),
                               jnp.asarray(h[:, n:], jnp.float32)), np.float64)
    elif act is not None:
      y = np.asarray(act(jnp.asarray(h, jnp.float32)), np.float64)
    else:
      y = h
    if row_scale is not None:
      y = y * np.asarray(row_scale, np.float64)[rows, None]
    out[rows] = y
  return out


def test_reference_matches_float64_oracle(rng):
  lhs, rhs = _data(rng, 40, 32, 64, 3, jnp.float32, cols=128)
  gs = np.array([10, 0, 25])
  bias = rng.standard_normal((3, 128)).astype(np.float32)
  scale = rng.uniform(size=40).astype(np.float32)
  for act in (None, Activation("silu_no_mul")):
    ref = gg.grouped_gemm_reference(lhs, rhs[:, :, :64], jnp.asarray(gs), bias=bias[:, :64],
                                    row_scale=scale, activation=act, out_dtype=jnp.float32)
    ora = _oracle(lhs, rhs[:, :, :64], gs, bias=bias[:, :64], row_scale=scale, act=act)
    assert _rel(np.asarray(ref)[:35], ora[:35]) < 1e-5
  act = Activation("swigluoai")
  ref = gg.grouped_gemm_reference(lhs, rhs, jnp.asarray(gs), bias=bias, activation=act,
                                  gated=True, out_dtype=jnp.float32)
  ora = _oracle(lhs, rhs, gs, bias=bias, act=act, gated=True)
  assert _rel(np.asarray(ref)[:35], ora[:35]) < 1e-5


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_kernel_activation_matches_activations_module(name):
  act = Activation(name)
  x = jnp.linspace(-12.0, 12.0, 301, dtype=jnp.float32)
  y = jnp.flip(x) * 0.7
  if act.is_gated:
    want, got = act.gated(x, y), gg.kernel_activation(act, x, y)
  else:
    want, got = act(x), gg.kernel_activation(act, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("gs", [[5, 0, 0, 60, 7], [0, 0, 72, 0, 0], [1, 1, 1, 1, 1],
                                [0, 0, 0, 0, 0], [64, 64, 0, 3, 9]])
@pytest.mark.parametrize("block_m", [64, 128])
def test_tile_metadata(gs, block_m):
  m = 150
  meta, ntasks = gg.tile_metadata(jnp.asarray(gs, jnp.int32), m, block_m)
  meta, ntasks = np.asarray(meta), int(np.asarray(ntasks)[0])
  ends = np.minimum(np.cumsum(gs), m)
  starts = np.concatenate([[0], ends[:-1]])
  want = []  # tiles from each group's first row rounded down to 8, block_m apart
  for g, (s, e) in enumerate(zip(starts, ends)):
    for tile in range(s - s % 8, e if e > s else 0, block_m):
      want.append((g, tile, max(s, tile), min(e, tile + block_m)))
  assert ntasks == len(want)
  # never more tasks than a global block_m grid (one task per group per tile it touches)
  assert ntasks <= sum((e - 1) // block_m - s // block_m + 1 for s, e in zip(starts, ends) if e > s)
  assert [tuple(meta[:, t]) for t in range(ntasks)] == want
  assert meta.shape[1] == -(-m // block_m) + len(gs) - 1


# ----------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_grouped_gemm_ragged_bias_scale(rng, dtype):
  # zero-row experts, a tile straddling 3 experts, rows past the total (unwritten)
  m, k, n, e = 150, 64, 128, 5
  lhs, rhs = _data(rng, m, k, n, e, dtype)
  gs = np.array([20, 0, 3, 100, 0])  # total 123 < m
  bias = rng.standard_normal((e, n)).astype(np.float32)
  scale = rng.uniform(0.1, 1.0, size=m).astype(np.float32)
  out = _call(gg.grouped_gemm, lhs, rhs, jnp.asarray(gs, jnp.int32), row_scale=scale, bias=bias,
              out_dtype=jnp.float32, config=CFG_PLAIN)
  tot = gs.sum()
  ref = np.asarray(gg.grouped_gemm_reference(lhs, rhs, jnp.asarray(gs), row_scale=scale,
                                             bias=bias, out_dtype=jnp.float32))
  assert np.isfinite(out[:tot]).all(), "a row inside the groups was not written"
  assert _rel(out[:tot], ref[:tot]) < 1e-5  # f32 out: only accumulation-order differences
  assert np.isnan(out[tot:]).all(), "rows past sum(group_sizes) are documented as unwritten"


def test_grouped_gemm_transpose_rhs(rng):
  # rhs stored [E, N, K] (the backward's d lhs = dout @ w^T). Interpret mode cannot simulate the
  # kernel's transposed SMEM views and transposes in XLA instead; the GPU benchmark's training
  # stage checks the in-kernel path against XLA gradients.
  m, k, n, e = 150, 64, 128, 5
  lhs, rhs = _data(rng, m, k, n, e, jnp.bfloat16)
  gs = jnp.asarray([20, 0, 3, 100, 0], jnp.int32)
  rhs_t = jnp.swapaxes(rhs, 1, 2)
  out = _call(gg.grouped_gemm, lhs, rhs_t, gs, out_dtype=jnp.float32, config=CFG_PLAIN,
              transpose_rhs=True)
  ref = np.asarray(gg.grouped_gemm_reference(lhs, rhs, gs, out_dtype=jnp.float32))
  assert _rel(out[:123], ref[:123]) < 1e-5
  with pytest.raises(ValueError, match="lhs K=64 does not match rhs K=128"):
    gg.grouped_gemm(lhs, rhs, gs, transpose_rhs=True)


def test_transposed_rhs_reads_its_own_tuned_table(rng, monkeypatch):
  seen = []
  real = gg.get_config
  monkeypatch.setattr(gg, "get_config",
                      lambda name, *a, **kw: seen.append(name) or real(name, *a, **kw))
  lhs, rhs = _data(rng, 40, 64, 128, 3, jnp.bfloat16)
  gs = jnp.asarray([10, 0, 30], jnp.int32)
  out = _call(gg.grouped_gemm, lhs, jnp.swapaxes(rhs, 1, 2), gs, transpose_rhs=True)
  assert seen == ["grouped_gemm_rt"]
  assert _rel(out, _oracle(lhs, rhs, [10, 0, 30])) < TOL[jnp.bfloat16]


@pytest.mark.parametrize("sizes", [[0, 77, 0, 123], [40, 0, 100, 60]],
                         ids=["both_halves_busy", "idle_halves"])
@pytest.mark.parametrize("cfg", [CFG_WS_N, CFG_WS_M, CFG_2CTA],
                         ids=["ws_split_n", "ws_split_m", "two_ctas"])
def test_grouped_gemm_warp_specialized(rng, cfg, sizes):
  """idle_halves: with wg_split="m", expert 0's only tile leaves its second warpgroup no rows
  to store, and expert 3's tile (shifted back inside the array) its first."""
  m, k, n, e = 200, 96, 128, 4
  lhs, rhs = _data(rng, m, k, n, e, jnp.bfloat16)
  gs = np.array(sizes)
  scale = rng.uniform(0.1, 1.0, size=m).astype(np.float32)
  out = _call(gg.grouped_gemm, lhs, rhs, jnp.asarray(gs, jnp.int32), row_scale=scale, config=cfg)
  ref = np.asarray(gg.grouped_gemm_reference(lhs, rhs, jnp.asarray(gs), row_scale=scale,
                                             out_dtype=jnp.float32))
  assert np.isfinite(out).all()
  assert _rel(out, ref) < TOL[jnp.bfloat16]


@pytest.mark.parametrize("case", ["m1", "one_expert", "k48", "default_config"])
def test_grouped_gemm_edge_cases(rng, case):
  if case == "m1":  # a single row (decode), one touched expert of many
    m, k, n, gs = 1, 64, 64, [0, 0, 1, 0, 0, 0]
  elif case == "one_expert":  # every row on one expert, M not a multiple of block_m
    m, k, n, gs = 100, 32, 64, [0, 100, 0]
  elif case == "k48":  # K not a multiple of block_k: block_k shrinks to 16
    m, k, n, gs = 70, 48, 64, [20, 0, 45]
  else:
    m, k, n, gs = 90, 64, 128, [30, 30, 30]
  lhs, rhs = _data(rng, m, k, n, len(gs), jnp.bfloat16)
  cfg = None if case == "default_config" else CFG_PLAIN
  out = _call(gg.grouped_gemm, lhs, rhs, jnp.asarray(gs, jnp.int32), config=cfg)
  tot = sum(gs)
  ref = _oracle(lhs, rhs, gs)
  assert out.shape == (m, n)
  assert np.isfinite(out[:tot]).all()
  assert _rel(out[:tot], ref[:tot]) < TOL[jnp.bfloat16]


# the warp-specialized form in the slow tier; the others, the same cross-item pipeline on
# other schedules, only when asked for
@pytest.mark.parametrize("cfg", [pytest.param(CFG_XI, marks=EXHAUSTIVE),
                                 pytest.param(CFG_XI_2CTA, marks=EXHAUSTIVE),
                                 pytest.param(CFG_XI_WS, marks=pytest.mark.slow),
                                 pytest.param(CFG_XI_WS_M, marks=EXHAUSTIVE)],
                         ids=["one_cta", "two_ctas", "warp_specialized", "ws_split_m_bands"])
def test_grouped_gemm_cross_item_pipeline(rng, cfg):
  # several items per CTA through one pipeline: zero-row experts, a tile straddling groups,
  # an expert over two row tiles, rows past the total unwritten; plain (bias, scale), gated
  # and transposed-rhs (interpret: an XLA transpose) kernels
  m, k, n, e = 200, 96, 128, 5
  gs = np.array([20, 0, 3, 100, 0])
  tot = gs.sum()
  lhs, rhs = _data(rng, m, k, n, e, jnp.bfloat16)
  bias = rng.standard_normal((e, n)).astype(np.float32)
  scale = rng.uniform(0.1, 1.0, size=m).astype(np.float32)
  out = _call(gg.grouped_gemm, lhs, rhs, jnp.asarray(gs, jnp.int32), row_scale=scale, bias=bias,
              out_dtype=jnp.float32, config=cfg)
  ref = np.asarray(gg.grouped_gemm_reference(lhs, rhs, jnp.asarray(gs), row_scale=scale,
                                             bias=bias, out_dtype=jnp.float32))
  assert np.isfinite(out[:tot]).all(), "a row inside the groups was not written"
  assert _rel(out[:tot], ref[:tot]) < 1e-5
  assert np.isnan(out[tot:]).all(), "rows past sum(group_sizes) are documented as unwritten"
  _, w13 = _data(rng, m, k, n, e, jnp.bfloat16, cols=2 * n)
  act = Activation("silu")
  out = _call(gg.grouped_gemm_gated, lhs, w13, jnp.asarray(gs, jnp.int32), activation=act,
              config=cfg)
  ref = _oracle(lhs, w13, gs, act=act, gated=True)
  assert _rel(out[:tot], ref[:tot]) < TOL[jnp.bfloat16]
  out = _call(gg.grouped_gemm, lhs, jnp.swapaxes(rhs, 1, 2), jnp.asarray(gs, jnp.int32),
              transpose_rhs=True, config=cfg)
  assert _rel(out[:tot], _oracle(lhs, rhs, gs)[:tot]) < TOL[jnp.bfloat16]
  # a lone work item (one expert, one row tile, one column tile): start and end of its chain
  one = np.array([0, 40, 0, 0, 0])
  out = _call(gg.grouped_gemm, lhs[:40], rhs, jnp.asarray(one, jnp.int32), config=cfg)
  assert _rel(out, _oracle(lhs[:40], rhs, one)) < TOL[jnp.bfloat16]


def test_chain_state_reads_as_the_pipeline_reads_it():
  # item i of n: the prologue runs for the first item, the drain for the last, both for a lone one
  P = gg.plgpu.PipelinePipeline
  for i, n, want in [(0, 1, (True, False, True)), (0, 3, (True, False, False)),
                     (1, 3, (False, True, False)), (2, 3, (False, False, True))]:
    st = gg._ChainState(jnp.int32(i), jnp.int32(n))
    assert (bool(st == P.START), bool(st == P.STEADY), bool(st == P.STOP)) == want
    assert st is not None and not isinstance(st, P)  # the pipeline's dynamic-state branch


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_tanh", "swigluoai"])
def test_grouped_gemm_gated_activations(rng, name):
  m, k, n, e = 96, 32, 64, 3
  lhs, w13 = _data(rng, m, k, n, e, jnp.bfloat16, cols=2 * n)
  gs = np.array([40, 0, 50])
  bias = rng.standard_normal((e, 2 * n)).astype(np.float32)
  act = Activation(name)
  out = _call(gg.grouped_gemm_gated, lhs, w13, jnp.asarray(gs, jnp.int32), activation=act,
              bias=bias, config=CFG_PLAIN)
  ref = _oracle(lhs, w13, gs, bias=bias, act=act, gated=True)
  assert np.isfinite(out[:90]).all()
  assert _rel(out[:90], ref[:90]) < TOL[jnp.bfloat16]


def test_grouped_gemm_gated_warp_specialized_f16(rng):
  m, k, n, e = 130, 64, 128, 3
  lhs, w13 = _data(rng, m, k, n, e, jnp.float16, cols=2 * n)
  gs = np.array([65, 0, 65])
  scale = rng.uniform(0.1, 1.0, size=m).astype(np.float32)
  act = Activation("silu")
  out = _call(gg.grouped_gemm_gated, lhs, w13, jnp.asarray(gs, jnp.int32), activation=act,
              row_scale=scale, config=CFG_WS_N)
  ref = _oracle(lhs, w13, gs, act=act, gated=True, row_scale=scale)
  assert np.isfinite(out).all()
  assert _rel(out, ref) < TOL[jnp.float16]


def _act_grad_reference(dout, rhs, gs, h, act):
  """d h = VJP of act at h applied to d a = dout @ rhs[g] (f32; rows past the groups zero)."""
  da = gg.grouped_gemm_reference(dout, rhs, gs, out_dtype=jnp.float32)
  hf = jnp.asarray(h, jnp.float32)
  if act.is_gated:
    n = hf.shape[1] // 2
    _, pull = jax.vjp(act.gated, hf[:, :n], hf[:, n:])
    return np.concatenate([np.asarray(g) for g in pull(da)], axis=1)
  _, pull = jax.vjp(act, hf)
  return np.asarray(pull(da)[0])


@pytest.mark.parametrize("name,cfg", [
    ("silu", CFG_PLAIN), pytest.param("silu", CFG_XI, marks=pytest.mark.slow),
    ("silu", CFG_WS_N), pytest.param("silu", CFG_WS_M, marks=pytest.mark.slow),
    pytest.param("gelu", CFG_PLAIN, marks=pytest.mark.slow),
    pytest.param("gelu_tanh", CFG_XI, marks=pytest.mark.slow), ("swigluoai", CFG_PLAIN),
    pytest.param("silu_no_mul", CFG_PLAIN, marks=pytest.mark.slow), ("relu2_no_mul", CFG_XI)],
    ids=lambda v: v if isinstance(v, str) else "")
def test_grouped_gemm_act_grad(rng, name, cfg):
  # the backward's d a GEMM (transposed w2) with the activation's VJP in its epilogue: ragged
  # groups, an empty expert, rows past the groups (unwritten: poisoned with NaN by interpret)
  act = Activation(name)
  m, k, n, e = 150, 64, 128, 4
  dout, w = _data(rng, m, k, n, e, jnp.bfloat16)
  gs = np.array([37, 0, 90, 10])
  n_h = 2 if act.is_gated else 1
  h = jnp.asarray(2 * rng.standard_normal((m, n_h * n)), jnp.bfloat16)
  out = _call(gg.grouped_gemm_act_grad, dout, jnp.swapaxes(w, 1, 2), jnp.asarray(gs, jnp.int32),
              h, activation=act, config=cfg, transpose_rhs=True)
  ref = _act_grad_reference(dout, w, jnp.asarray(gs), h, act)
  rows = int(gs.sum())
  assert out.shape == (m, n_h * n)
  assert np.isfinite(out[:rows]).all()
  assert _rel(out[:rows], ref[:rows]) < TOL[jnp.bfloat16]


@pytest.mark.parametrize("cfg", [CFG_PLAIN, CFG_XI, CFG_WS_N], ids=["plain", "xi", "ws"])
def test_grouped_gemm_gated_return_preact(rng, cfg):
  m, k, n, e = 130, 64, 128, 3
  lhs, w13 = _data(rng, m, k, n, e, jnp.bfloat16, cols=2 * n)
  gs = np.array([60, 0, 65])
  bias = rng.standard_normal((e, 2 * n)).astype(np.float32)
  out, pre = gg.grouped_gemm_gated(lhs, w13, jnp.asarray(gs, jnp.int32), bias=bias, config=cfg,
                                   return_preact=True, interpret=_interpret())
  assert not _compat.races_found(), "race detected by the Mosaic GPU interpreter"
  out, pre = np.asarray(out, np.float32), np.asarray(pre, np.float32)
  ref = _oracle(lhs, w13, gs, bias=bias, act=Activation("silu"), gated=True)
  ref_pre = np.asarray(gg.grouped_gemm_reference(lhs, w13, jnp.asarray(gs), bias=bias,
                                                 out_dtype=jnp.float32))
  rows = int(gs.sum())
  assert np.isfinite(out[:rows]).all() and np.isfinite(pre[:rows]).all()
  assert _rel(out[:rows], ref[:rows]) < TOL[jnp.bfloat16]
  assert _rel(pre[:rows], ref_pre[:rows]) < TOL[jnp.bfloat16]
  with pytest.raises(ValueError, match="return_preact takes no row_scale"):
    gg.grouped_gemm_gated(lhs, w13, jnp.asarray(gs, jnp.int32), return_preact=True,
                          row_scale=jnp.ones((m,)))


@pytest.mark.parametrize("name", ["silu_no_mul", "gelu_no_mul", "relu2_no_mul"])
def test_grouped_gemm_non_gated_activation(rng, name):
  m, k, n, e = 64, 32, 64, 2
  lhs, rhs = _data(rng, m, k, n, e, jnp.bfloat16)
  gs = np.array([33, 31])
  bias = rng.standard_normal((e, n)).astype(np.float32)
  act = Activation(name)
  out = _call(gg.grouped_gemm, lhs, rhs, jnp.asarray(gs, jnp.int32), activation=act, bias=bias,
              config=CFG_PLAIN)
  ref = _oracle(lhs, rhs, gs, bias=bias, act=act)
  assert _rel(out, ref) < TOL[jnp.bfloat16]


def test_validation_errors():
  lhs = jnp.zeros((8, 64), jnp.bfloat16)
  rhs = jnp.zeros((2, 64, 128), jnp.bfloat16)
  gs = jnp.array([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="lhs K"):
    gg.grouped_gemm(lhs[:, :32], rhs, gs)
  with pytest.raises(ValueError, match="group_sizes"):
    gg.grouped_gemm(lhs, rhs, gs[:1])
  with pytest.raises(ValueError, match="row_scale"):
    gg.grouped_gemm(lhs, rhs, gs, row_scale=jnp.ones((7,)))
  with pytest.raises(ValueError, match="bias"):
    gg.grouped_gemm(lhs, rhs, gs, bias=jnp.ones((2, 64)))
  with pytest.raises(ValueError, match="multiple of 64"):
    gg.grouped_gemm(lhs, rhs[:, :, :96], gs)
  with pytest.raises(ValueError, match="multiple of 16"):
    gg.grouped_gemm(lhs[:, :40], rhs[:, :40], gs)
  with pytest.raises(ValueError, match="dtype"):
    gg.grouped_gemm(lhs, rhs.astype(jnp.float16), gs)
  with pytest.raises(NotImplementedError, match="float32"):
    gg.grouped_gemm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs)
  with pytest.raises(ValueError, match="gated"):
    gg.grouped_gemm(lhs, rhs, gs, activation="silu")
  with pytest.raises(ValueError, match="not gated"):
    gg.grouped_gemm_gated(lhs, rhs, gs, activation="relu2_no_mul")
  with pytest.raises(ValueError):
    C(block_m=96)
  with pytest.raises(ValueError, match="block_n % 128"):
    C(block_m=64, block_n=64, wg_split="n")
  with pytest.raises(ValueError, match="ctas_per_sm=3"):
    C(ctas_per_sm=3, warp_specialized=False)
  with pytest.raises(ValueError, match="warp_specialized=False"):
    C(ctas_per_sm=2)
  # two CTAs per SM: stages refitted to half the shared memory
  fit = gg._fit_stages(C(block_m=64, block_n=128, block_k=64, num_stages=8,
                         warp_specialized=False, ctas_per_sm=2), 2, 2, 1)
  assert gg._smem_bytes(fit, 2, 2, 1) <= gg._SMEM_PER_SM // 2 < gg._smem_bytes(
      dataclasses.replace(fit, num_stages=fit.num_stages + 1), 2, 2, 1)


# ----------------------------------------------------------------------------- permute


@pytest.mark.parametrize("t,k,e", [(1, 8, 256), (7, 2, 4), (300, 8, 16)])  # 2400 slots: argsort
def test_moe_align(rng, t, k, e):
  ids = rng.integers(-1, e, size=(t, k)).astype(np.int32)  # -1 = empty slot
  order, gs, inv = perm.moe_align(jnp.asarray(ids), e)
  r_order, r_gs, r_inv = perm.moe_align_reference(ids, e)
  np.testing.assert_array_equal(np.asarray(order), r_order)
  np.testing.assert_array_equal(np.asarray(gs), r_gs)
  np.testing.assert_array_equal(np.asarray(inv), r_inv)
  flat = ids.reshape(-1)
  ok = flat >= 0
  assert np.asarray(gs).sum() == ok.sum()
  # sorted keys are non-decreasing over the valid prefix; inverse really inverts
  assert (np.diff(flat[np.asarray(order)][: ok.sum()]) >= 0).all()
  pos = np.asarray(inv).reshape(-1)
  np.testing.assert_array_equal(np.asarray(order)[pos[ok]], np.nonzero(ok)[0])


def test_gather_sum(rng):
  t, k, h = 6, 3, 16
  inv = rng.permutation(t * k).reshape(t, k).astype(np.int32)
  inv[2, 1] = -1
  y = rng.standard_normal((t * k + 5, h)).astype(np.float32)
  y[t * k:] = np.nan  # rows nobody points at may hold anything
  out = np.asarray(perm.gather_sum(jnp.asarray(y, jnp.bfloat16), jnp.asarray(inv),
                                   out_dtype=jnp.float32))
  yb = np.asarray(jnp.asarray(y, jnp.bfloat16), np.float64)
  want = np.stack([sum(yb[i] for i in row if i >= 0) for row in inv])
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def _routing_with_empty_slots(rng, t, k, e=5, pad=4):
  """(ids [t, k] with two empty slots, sort_order padded by `pad` rows and -1 on the rows that
  hold no valid slot, inv, rows)."""
  ids = rng.integers(0, e, size=(t, k)).astype(np.int32)
  ids[1, 2] = ids[4, 0] = -1
  order, _, inv = perm.moe_align(jnp.asarray(ids), e)
  order = jnp.where(jnp.arange(t * k) < t * k - 2, order, -1)  # the empty slots sort last
  return ids, jnp.pad(order, (0, pad), constant_values=-1), inv, t * k + pad


def test_routed_rows_and_gather_sum_vjps_match_autodiff(rng):
  # moe.routed_rows (the training layout: experts padded to 8 rows, a zero tail) and the
  # unweighted gather_sum_diff: VJPs through the known inverse permutation equal JAX's own
  # (scatter-add) VJPs of the same gathers, with empty slots, padding rows and the tail.
  t, k, h, e = 7, 3, 64, 5
  ids = rng.integers(0, e, size=(t, k)).astype(np.int32)
  ids[1, 2] = ids[4, 0] = -1
  ids = jnp.asarray(ids)
  m_alloc = gg.row_alloc(t * k + 7 * min(e, t * k), 64)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((m_alloc, h)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)

  def chain(x, w, route, unpermute):
    xs, inv, order = route(x)
    return jnp.sum(unpermute(xs * w, inv, order) * ct)

  def route_diff(x_):
    xs, inv, _, _, order = pmoe.routed_rows(x_, ids, e, m_alloc, (64,), "xla")
    return xs, inv, order

  def route_jnp(x_):
    order, inv, _ = perm.moe_align_training(ids, e, m_alloc)
    return jnp.take(x_, jnp.where(order >= 0, order // k, t), axis=0, mode="fill",
                    fill_value=0), inv, order

  got = jax.grad(chain, argnums=(0, 1))(
      x, w, route_diff, lambda y, inv, o: perm.gather_sum_diff(y, None, inv, o, k, jnp.float32))
  want = jax.grad(chain, argnums=(0, 1))(
      x, w, route_jnp, lambda y, inv, o: perm.gather_sum(y, inv, out_dtype=jnp.float32))
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("y_dtype", [jnp.float32, jnp.bfloat16])
def test_weighted_gather_sum_vjp_matches_autodiff(rng, y_dtype):
  """gather_sum_diff with router weights: d y (in y's dtype, zero on rows past the valid
  slots) and d weights (zero on empty slots) equal JAX's own VJPs of the weighted gather_sum."""
  t, k, h = 7, 3, 16
  ids, order, inv, m_alloc = _routing_with_empty_slots(rng, t, k)
  y = jnp.asarray(rng.standard_normal((m_alloc, h)), y_dtype)
  tw = jnp.asarray(rng.random((t, k)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)

  def loss(y, tw, fn):
    return jnp.sum(fn(y, tw).astype(jnp.float32) * ct)

  got = jax.grad(loss, argnums=(0, 1))(
      y, tw, lambda y_, w_: perm.gather_sum_diff(y_, w_, inv, order, k, jnp.float32))
  want = jax.grad(loss, argnums=(0, 1))(
      y, tw, lambda y_, w_: perm.gather_sum(y_, inv, w_, out_dtype=jnp.float32))
  assert got[0].dtype == y_dtype
  tol = 1e-5 if y_dtype == jnp.float32 else 1e-2
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol,
                               atol=tol)
  n_valid = int((ids >= 0).sum())
  assert (np.asarray(got[0], np.float32)[n_valid:] == 0).all()
  assert (np.asarray(got[1])[ids < 0] == 0).all()


def test_gather_rows_kernel(rng):
  x = jnp.asarray(rng.standard_normal((10, 2048)), jnp.bfloat16)
  idx = jnp.asarray(rng.integers(0, 10, 40), jnp.int32)
  for r in (2, None):
    out = _call(perm.gather_rows, x, idx, rows_per_step=r)
    np.testing.assert_array_equal(out, np.asarray(x, np.float32)[np.asarray(idx)])


@pytest.mark.parametrize("num_rows", [0, 1, 13, 39, 40, 55])
def test_gather_rows_needed_rows_only(rng, num_rows):
  """With num_rows, the rows before it are copied (steps of 2 rows: 13 needs a partial step);
  steps past it are skipped; counts past the rows are clipped."""
  x = jnp.asarray(rng.standard_normal((10, 256)), jnp.bfloat16)
  idx = jnp.asarray(rng.integers(0, 10, 40), jnp.int32)
  out = _call(perm.gather_rows, x, idx, jnp.int32(num_rows), rows_per_step=2)
  n = min(num_rows, 40)
  np.testing.assert_array_equal(out[:n], np.asarray(x, np.float32)[np.asarray(idx)][:n])
  assert np.isnan(out[-(-n // 2) * 2:]).all()  # unwritten: the interpreter's NaN fill


@pytest.mark.parametrize("tokens_per_step", [None, 2, 4])  # 4 does not divide 7 tokens: 1
@pytest.mark.parametrize("num_rows", [None, 0, 5, 19])
def test_scatter_rows_equals_the_sorted_gather(rng, tokens_per_step, num_rows):
  """scatter_rows (token order, each token's row stored to its k rows) makes gather_rows'
  sorted rows: rows before num_rows (default: all) hold their slot's token, an empty slot
  (-1) stores nothing, rows past num_rows and rows no slot aims at stay unwritten."""
  t, k, e = 7, 3, 5
  ids = rng.integers(0, e, size=(t, k)).astype(np.int32)
  ids[1, 2] = ids[4, 0] = -1
  order, gs, inv = perm.moe_align(jnp.asarray(ids), e)
  x = jnp.asarray(rng.standard_normal((t, 128)), jnp.bfloat16)
  m_out = t * k + 3  # rows past the slots: unwritten
  nr = None if num_rows is None else jnp.int32(num_rows)
  out = _call(perm.scatter_rows, x, inv, m_out, nr, tokens_per_step=tokens_per_step)
  n = m_out if num_rows is None else num_rows
  live = int(np.sum(np.asarray(gs)))  # the empty slots sort last, aimed at no row
  want = np.asarray(x, np.float32)[np.asarray(order) // k]
  np.testing.assert_array_equal(out[:min(n, live)], want[:min(n, live)])
  assert np.isnan(out[min(n, live):]).all()  # unwritten: the interpreter's NaN fill


def test_scatter_rows_rejects_bad_inv():
  x = jnp.zeros((6, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="inv must be"):
    perm.scatter_rows(x, jnp.zeros((5, 2), jnp.int32), 12, interpret=True)
  with pytest.raises(ValueError, match="num_stages"):
    perm.scatter_rows(x, jnp.zeros((6, 2), jnp.int32), 12, num_stages=2, interpret=True)


@pytest.mark.parametrize("permute_impl", ["scatter", "pallas", "auto"])
def test_fused_experts_jnp_routing_row_copies(rng, permute_impl):
  # the jnp routing path (route_impl="xla") with each Pallas row copy, an empty slot included
  t, k, e, h, n = 9, 2, 4, 64, 64
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  w13, w2, _, _ = _moe_weights(rng, e, h, n)
  tw, ti = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.standard_normal((t, e)))), k)
  ti = ti.at[3, 1].set(-1)
  out = _call(pmoe.fused_experts, x, w13, w2, tw, ti, permute_impl=permute_impl,
              route_impl="xla")
  ref = np.asarray(pmoe.fused_experts_reference(x, w13, w2, tw, ti))
  assert _rel(out, ref) < 2e-2


def test_fused_experts_end_to_end(rng):
  t, k, e, h, n = 9, 2, 4, 64, 64
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  w13, w2, b13, b2 = _moe_weights(rng, e, h, n)
  logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
  tw, ti = jax.lax.top_k(jax.nn.softmax(logits), k)
  ti = ti.at[3, 1].set(-1)  # an empty slot contributes nothing
  out = _call(pmoe.fused_experts, x, w13, w2, tw, ti, activation="swigluoai", w13_bias=b13,
              w2_bias=b2, permute_impl="pallas")
  ref = np.asarray(pmoe.fused_experts_reference(x, w13, w2, tw, ti, activation="swigluoai",
                                                w13_bias=b13, w2_bias=b2))
  assert _rel(out, ref) < 2e-2


def _moe_weights(rng, e, h, n):
  """bf16 w13 [E, H, 2N], w2 [E, N, H] and f32 biases."""
  w13 = jnp.asarray(rng.standard_normal((e, h, 2 * n)) / 8, jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((e, n, h)) / 8, jnp.bfloat16)
  b13 = jnp.asarray(rng.standard_normal((e, 2 * n)), jnp.float32)
  b2 = jnp.asarray(rng.standard_normal((e, h)), jnp.float32)
  return w13, w2, b13, b2


@pytest.mark.parametrize("t", [1, 3])
def test_fused_experts_per_slot_layout(rng, t):
  # the decode layout: no sort, one task per slot (shared experts across slots included)
  k, e, h, n = 2, 4, 64, 64
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  w13, w2, b13, b2 = _moe_weights(rng, e, h, n)
  tw = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
  ti = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
  if t > 1:
    # an empty slot, an EP-remote one (local id E), one expert twice
    ti = ti.at[1, 0].set(-1).at[0, 1].set(e).at[2, 0].set(ti[2, 1])
  out = _call(pmoe.fused_experts, x, w13, w2, tw, ti, activation="silu", w13_bias=b13,
              w2_bias=b2, layout="per_slot")
  ref = np.asarray(pmoe.fused_experts_reference(x, w13, w2, tw, ti, w13_bias=b13, w2_bias=b2))
  assert np.isfinite(out).all()
  assert _rel(out, ref) < 2e-2
  with pytest.raises(ValueError, match="layout"):
    pmoe.fused_experts(x, w13, w2, tw, ti, layout="scattered")


def test_per_slot_with_cross_item_configs_runs_per_item(rng):
  # a cross-item config handed to the decode layout: slot tasks keep the per-item loop (a
  # skipped slot must not load weights), so the result still matches and skipped rows stay 0
  t, k, e, h, n = 3, 2, 4, 64, 128
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  w13, w2, _, _ = _moe_weights(rng, e, h, n)
  tw = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
  ti = jnp.asarray([[0, -1], [3, e], [1, 1]], jnp.int32)
  out = _call(pmoe.fused_experts, x, w13, w2, tw, ti, layout="per_slot",
              config1=CFG_XI, config2=CFG_XI_WS)
  ref = np.asarray(pmoe.fused_experts_reference(x, w13, w2, tw, ti), np.float32)
  assert np.isfinite(out).all()
  assert _rel(out, ref) < 2e-2


@pytest.mark.slow
@given(st.integers(1, 5), st.integers(1, 3), st.integers(0, 2**31 - 1))
@settings(max_examples=5, deadline=None)
def test_per_slot_layout_property(t, k, seed):
  """per_slot on random routing with empty (-1) and EP-remote (E) slots mixed in: equals the
  reference, and every output row is written (poisoned kernel outputs would show as NaN)."""
  rng = np.random.default_rng(seed)
  e, h, n = 4, 64, 64
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  w13, w2, b13, b2 = _moe_weights(rng, e, h, n)
  tw = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
  ti = jnp.asarray(rng.choice(np.arange(-1, e + 1), size=(t, k)), jnp.int32)  # -1 .. E
  out = _call(pmoe.fused_experts, x, w13, w2, tw, ti, w13_bias=b13, w2_bias=b2,
              layout="per_slot")
  ref = np.asarray(pmoe.fused_experts_reference(x, w13, w2, tw, ti, w13_bias=b13, w2_bias=b2),
                   np.float32)
  assert np.isfinite(out).all()
  assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("t,k,stages,dtype", [
    (1, 2, None, jnp.bfloat16),
    pytest.param(3, 2, None, jnp.float16,  # an empty slot, an expert twice; swigluoai, biases
                 marks=pytest.mark.slow),
    # the shallowest ring (every step waits for its own load), tokens past the first 8 rows,
    # EP-remote slots
    pytest.param(9, 2, 2, jnp.bfloat16, marks=pytest.mark.slow),
])
def test_fused_decode_kernel(rng, t, k, stages, dtype):
  """The one-kernel decode block against the f32 reference: the CTA walks every item in turn
  (interpret mode runs one CTA), so item boundaries, the x-row double buffer and the ring's
  wrap-around are all crossed; poisoned (unwritten) rows of empty slots must not leak."""
  from jmoe.kernels import decode as dc
  e, h, n = 4, 256, 128
  x = jnp.asarray(rng.standard_normal((t, h)), dtype)
  w13, w2, b13, b2 = _moe_weights(rng, e, h, n)
  w13, w2 = w13.astype(dtype), w2.astype(dtype)
  tw = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
  ti = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
  if t > 1:
    ti = ti.at[1, 0].set(-1).at[2, 0].set(ti[2, 1])
  if t > 8:
    ti = ti.at[5, 1].set(e).at[8, 0].set(e + 3)  # EP-remote ids (>= E) stream nothing
  config = dc.DecodeConfig(stages=stages)
  act = "swigluoai" if t == 3 else "silu"  # gpt-oss's activation, with both biases
  bias = dict(w13_bias=b13, w2_bias=b2) if t == 3 else {}
  out = _call(dc.fused_experts_decode, x, w13, w2, tw, ti, activation=act, config=config, **bias)
  ref = np.asarray(pmoe.fused_experts_reference(x, w13, w2, tw, ti, activation=act, **bias))
  assert np.isfinite(out).all()
  assert _rel(out, ref) < 2e-2
  if stages is None:  # fused_experts(layout="fused_decode") is this kernel on its default config
    via_block = _call(pmoe.fused_experts, x, w13, w2, tw, ti, activation=act,
                      layout="fused_decode", **bias)
    np.testing.assert_array_equal(via_block, out)


def test_fused_decode_all_slots_empty(rng):
  # no valid slot: the kernel runs no item, and the output is exactly zero
  from jmoe.kernels import decode as dc
  e, h, n = 2, 128, 64
  x = jnp.asarray(rng.standard_normal((2, h)), jnp.bfloat16)
  w13, w2, _, _ = _moe_weights(rng, e, h, n)
  ti = jnp.asarray([[-1, e], [e + 1, -1]], jnp.int32)
  out = _call(dc.fused_experts_decode, x, w13, w2, jnp.ones((2, 2), jnp.float32), ti)
  np.testing.assert_array_equal(out, np.zeros((2, h), np.float32))


@pytest.mark.slow
@given(st.integers(1, 5), st.integers(1, 3), st.integers(0, 2**31 - 1))
@settings(max_examples=4, deadline=None)
def test_fused_decode_property(t, k, seed):
  """Random routing with empty (-1) and EP-remote (E, E + 1) slots mixed in, at the smallest
  shape the kernel takes (H = 128: three steps per item, a three-slot ring)."""
  rng = np.random.default_rng(seed)
  e, h, n = 3, 128, 64
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  w13, w2, b13, b2 = _moe_weights(rng, e, h, n)
  tw = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
  ti = jnp.asarray(rng.choice(np.arange(-1, e + 2), size=(t, k)), jnp.int32)
  from jmoe.kernels import decode as dc
  out = _call(dc.fused_experts_decode, x, w13, w2, tw, ti, w13_bias=b13, w2_bias=b2)
  ref = np.asarray(pmoe.fused_experts_reference(x, w13, w2, tw, ti, w13_bias=b13, w2_bias=b2),
                   np.float32)
  assert np.isfinite(out).all()
  assert _rel(out, ref) < 2e-2


def test_fused_decode_rejects_what_it_cannot_run(rng):
  from jmoe.kernels import decode as dc
  x = jnp.zeros((1, 192), jnp.bfloat16)
  w13 = jnp.zeros((2, 192, 128), jnp.bfloat16)
  w2 = jnp.zeros((2, 64, 192), jnp.bfloat16)
  tw, ti = jnp.ones((1, 1)), jnp.zeros((1, 1), jnp.int32)
  with pytest.raises(ValueError, match="H=192"):
    dc.fused_experts_decode(x, w13, w2, tw, ti)
  x, w13, w2 = jnp.zeros((1, 128), jnp.bfloat16), jnp.zeros((2, 128, 192), jnp.bfloat16), \
      jnp.zeros((2, 96, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="N=96"):
    dc.fused_experts_decode(x, w13, w2, tw, ti)
  w13, w2 = jnp.zeros((2, 128, 128), jnp.bfloat16), jnp.zeros((2, 64, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="gated"):
    dc.fused_experts_decode(x, w13, w2, tw, ti, activation="relu2_no_mul")
  with pytest.raises(ValueError, match="topk_weights"):
    dc.fused_experts_decode(x, w13, w2, jnp.ones((1, 2)), ti)
  with pytest.raises(ValueError, match="stages"):
    dc.DecodeConfig(stages=1)
  with pytest.raises(ValueError, match="stages=64"):
    dc.fused_experts_decode(x, w13, w2, tw, ti, config=dc.DecodeConfig(stages=64))
  big = jnp.zeros((65, 2), jnp.int32)
  with pytest.raises(ValueError, match="130 slots"):
    dc.fused_experts_decode(jnp.zeros((65, 128), jnp.bfloat16), w13, w2, jnp.ones((65, 2)), big)


@pytest.mark.parametrize("t,k,e,h,n,act,expect", [
    (1, 8, 128, 2048, 768, "silu", "fused_decode"),  # qwen3, 1 token: 75 MB streamed
    (2, 8, 128, 2048, 768, "silu", "fused_decode"),  # 151 MB
    (4, 8, 128, 2048, 768, "silu", "per_slot"),  # 302 MB: a tie on the H200, per_slot kept
    (1, 8, 256, 7168, 2048, "silu", "per_slot"),  # deepseek-v3, 1 token
    (1, 8, 128, 2048, 768, "relu2_no_mul", "per_slot"),  # not gated
    (1, 8, 128, 2048, 720, "silu", "per_slot"),  # N not a multiple of 64
    (64, 8, 128, 2048, 768, "silu", "sorted"),  # slots share experts
])
def test_auto_layout(t, k, e, h, n, act, expect):
  from jmoe.kernels.activations import as_activation
  assert pmoe._auto_layout(t, k, e, h, n, as_activation(act), jnp.bfloat16) == expect


@pytest.mark.parametrize("cfg", [CFG_PLAIN, CFG_WS_N], ids=["plain", "ws"])
def test_grouped_gemm_slot_tasks(rng, cfg):
  # decode task list = the slot ids: row s is one task of expert ids[s]; a slot whose expert is
  # outside [0, E) (empty: -1, EP-remote: E) runs nothing and its row stays unwritten (NaN in
  # the interpreter); every other row equals the reference, rows 8+ included (tile shift)
  m, k, n, e = 14, 64, 128, 3
  lhs, rhs = _data(rng, m, k, n, e, jnp.bfloat16)
  ids = rng.integers(0, e, m).astype(np.int32)
  ids[[1, 6, 9, 12]] = [-1, e, -7, -1]
  fn = lambda lhs, rhs, interpret: gg._run(
      lhs, rhs, jnp.zeros((e,), jnp.int32), None, None, jnp.float32, cfg, interpret, False, None,
      "", slot_experts=jnp.asarray(ids))
  out = _call(fn, lhs, rhs)
  ref = np.einsum("mk,mkn->mn", np.asarray(lhs, np.float64),
                  np.asarray(rhs, np.float64)[np.clip(ids, 0, e - 1)])
  ok = (ids >= 0) & (ids < e)
  assert np.isfinite(out[ok]).all(), "a slot's row was not written"
  assert _rel(out[ok], ref[ok]) < 1e-2
  assert np.isnan(out[~ok]).all(), "a skipped slot wrote its row"


# ----------------------------------------------------------------------------- training path


TGMM_CFGS = {
    "one_wg": dict(block_k=64, block_n=64, block_r=64, num_stages=2),
    "two_ctas": dict(block_k=64, block_n=64, block_r=64, num_stages=3, ctas_per_sm=2),
    "ws": dict(block_k=64, block_n=64, block_r=64, num_stages=2, warp_specialized=True),
    "ws_r128": dict(block_k=64, block_n=128, block_r=128, num_stages=3, warp_specialized=True),
    "cross_tile": dict(block_k=64, block_n=64, block_r=64, num_stages=3, cross_tile=True),
    "cross_tile_2st": dict(block_k=64, block_n=128, block_r=64, num_stages=2, cross_tile=True),
    "cross_tile_k_fastest": dict(block_k=64, block_n=64, block_r=64, num_stages=3,
                                 cross_tile=True, k_fastest=True),
    "one_wg_k_fastest": dict(block_k=64, block_n=64, block_r=64, num_stages=2, k_fastest=True),
    # the producer runs two steps ahead across tiles; 2 tiles per CTA on the 1-CTA interpreter
    "ws_cross_tile": dict(block_k=64, block_n=64, block_r=64, num_stages=2,
                          warp_specialized=True, cross_tile=True),
    "ws_cross_tile_3st": dict(block_k=64, block_n=64, block_r=64, num_stages=3,
                              warp_specialized=True, cross_tile=True, k_fastest=True),
    # two output buffers per warpgroup, taken in turn (the 1-CTA interpreter walks every tile,
    # so both are reused many times). The interpreter's TMA stores read SMEM at once: a wait
    # one store too short passed its race detector (2026-11-30), so this checks the results and
    # the buffer indexing, not the waits; those are argued in tgmm._store_tile
    "one_wg_2out": dict(block_k=64, block_n=64, block_r=64, num_stages=2, out_buffers=2),
    "ws_2out": dict(block_k=64, block_n=64, block_r=64, num_stages=2, warp_specialized=True,
                    out_buffers=2),
    "cross_tile_2out": dict(block_k=64, block_n=64, block_r=64, num_stages=3, cross_tile=True,
                            out_buffers=2),
    "ws_cross_tile_2out": dict(block_k=64, block_n=64, block_r=64, num_stages=3,
                               warp_specialized=True, cross_tile=True, out_buffers=2),
    "ws_cross_tile_kf_2out": dict(block_k=64, block_n=64, block_r=64, num_stages=2,
                                  warp_specialized=True, cross_tile=True, k_fastest=True,
                                  out_buffers=2),
    # tiles stored in 64-column chunks through the buffers (128-column tiles: two chunks; 4
    # asked for, 2 fit)
    "one_wg_halves": dict(block_k=64, block_n=128, block_r=64, num_stages=2, store_parts=2),
    "ws_halves_2out": dict(block_k=64, block_n=128, block_r=64, num_stages=2,
                           warp_specialized=True, out_buffers=2, store_parts=2),
    "cross_tile_halves_2out": dict(block_k=64, block_n=128, block_r=64, num_stages=3,
                                   cross_tile=True, out_buffers=2, store_parts=2),
    "ws_cross_tile_quarters_2out": dict(block_k=64, block_n=128, block_r=64, num_stages=3,
                                        warp_specialized=True, cross_tile=True,
                                        out_buffers=2, store_parts=4),
}


TGMM_SIZES = {"rows_past_total": [30, 0, 70, 5, 0], "total_is_m_not_block_multiple":
              [30, 0, 70, 50, 0], "one_expert": [150, 0, 0, 0, 0], "one_row": [0, 0, 1, 0, 0]}
# every form on the case that crosses the most edges (empty experts, a last block past M); the
# whole sizes x forms product for one form; the rest of the product is the slow tier
TGMM_FULL = ("total_is_m_not_block_multiple",)
TGMM_ALL_SIZES = ("ws_cross_tile_2out",)


def _tgmm_cases():
  for cfg in TGMM_CFGS:
    for name, sizes in TGMM_SIZES.items():
      lean = name in TGMM_FULL or cfg in TGMM_ALL_SIZES
      # slow: one_wg's sizes; exhaustive (past .ci/run's budget): the rest of the product
      marks = (() if lean else (pytest.mark.slow,) if cfg == "one_wg"
               else EXHAUSTIVE)
      yield pytest.param(sizes, cfg, id=f"{name}-{cfg}", marks=marks)


@pytest.mark.parametrize("sizes,cfg", list(_tgmm_cases()))
def test_tgmm(rng, sizes, cfg):
  """Blocks start at each expert's first row; a last block reaching past M is loaded from
  M - block_r (so it overlaps rows already counted, which get masked); lhs rows past the total
  are poisoned with NaN and must not leak; empty experts are zeros."""
  from jmoe.kernels import tgmm as tg
  m, k, n = 150, 128, 128
  gs = jnp.array(sizes, jnp.int32)
  total = sum(sizes)
  x = rng.standard_normal((m, k))
  x[total:] = np.nan
  x = jnp.asarray(x, jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  out = _call(tg.tgmm, x, dy, gs, config=tg.TgmmConfig(**TGMM_CFGS[cfg]),
              out_dtype=jnp.float32)
  ends = np.cumsum(sizes)
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  ref = np.stack([x64[e_ - s:e_].T @ dy64[e_ - s:e_] for s, e_ in zip(sizes, ends)])
  assert np.isfinite(out).all()
  assert _rel(out, ref) < 1e-5
  for g, s in enumerate(sizes):
    if s == 0:
      assert (out[g] == 0).all()


@pytest.mark.parametrize("k_fastest", [False, True], ids=["n_fastest", "k_fastest"])
def test_tgmm_ws_cross_tile_walks_k_and_n_tiles(rng, k_fastest):
  """The warp-specialized cross-tile kernel over 2 K tiles x 2 N tiles per expert (each
  compute warpgroup's rows land at ki * 2 block_k + wg * block_k), in either tile order."""
  from jmoe.kernels import tgmm as tg
  m, k, n = 120, 256, 128
  sizes = [40, 0, 57]
  gs = jnp.array(sizes, jnp.int32)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  cfg = tg.TgmmConfig(block_k=64, block_n=64, block_r=64, num_stages=3, warp_specialized=True,
                      cross_tile=True, k_fastest=k_fastest)
  out = _call(tg.tgmm, x, dy, gs, config=cfg, out_dtype=jnp.float32)
  ends = np.cumsum(sizes)
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  ref = np.stack([x64[e_ - s:e_].T @ dy64[e_ - s:e_] for s, e_ in zip(sizes, ends)])
  assert _rel(out, ref) < 1e-5
  assert (out[1] == 0).all()


@settings(max_examples=25)
@given(e=st.integers(1, 4), k_tiles=st.integers(1, 5), n_tiles=st.integers(1, 5),
       num_ctas=st.integers(1, 9), k_fastest=st.booleans())
def test_tgmm_cta_walk_visits_every_tile_once(e, k_tiles, n_tiles, num_ctas, k_fastest):
  """The cross-tile kernels' per-CTA tile lists (tgmm._CtaWalk) partition the output tiles
  (expert, K tile, N tile), in either tile order; K-fastest order changes the K tile first."""
  from jmoe.kernels import tgmm as tg
  bounds = types.SimpleNamespace(at=np.zeros((2, e), np.int32))  # bounds_smem.at[0 / 1]
  seen = []
  for cta in range(num_ctas):
    w = tg._CtaWalk(jnp.int32(cta), bounds, num_ctas=num_ctas, num_tiles=e * k_tiles * n_tiles,
                    k_tiles=k_tiles, n_tiles=n_tiles, block_r=64, align=8, k_fastest=k_fastest)
    for i in range(int(w.my_tiles)):
      t, steps = w.tile(jnp.int32(i))
      assert int(steps) == 1  # empty experts: one masked step, so zeros get written
      seen.append((int(t.g), int(t.ki), int(t.ni)))
  assert sorted(seen) == [(g, ki, ni) for g in range(e) for ki in range(k_tiles)
                          for ni in range(n_tiles)]
  t1 = tg._CtaWalk(jnp.int32(1), bounds, num_ctas=1, num_tiles=e * k_tiles * n_tiles,
                   k_tiles=k_tiles, n_tiles=n_tiles, block_r=64, align=8,
                   k_fastest=k_fastest).tile(jnp.int32(0))[0]
  if k_tiles > 1 and n_tiles > 1:  # the second tile of the list
    assert (int(t1.ki), int(t1.ni)) == ((1, 0) if k_fastest else (0, 1))


@settings(max_examples=40)
@given(sizes=st.lists(st.integers(0, 200), min_size=1, max_size=6), extra=st.integers(0, 70),
       block_r=st.sampled_from([64, 128]), align=st.sampled_from([8, 64]))
def test_tgmm_row_blocks_cover_each_expert_once(sizes, extra, block_r, align):
  """The weight gradient's row blocks (tgmm._Tile): loaded from multiples of `align` that
  start inside the array, and the rows each block keeps (from its first own row to the end of its load,
  capped at the expert's end) are the expert's rows, each exactly once."""
  from jmoe.kernels import tgmm as tg
  m = max(sum(sizes) + extra, block_r)
  ends = np.cumsum(sizes).astype(np.int32)
  starts = (ends - np.asarray(sizes)).astype(np.int32)
  for g, (s, e_) in enumerate(zip(starts, ends)):
    t = tg._Tile(jnp.int32(g), jnp.asarray(starts), jnp.asarray(ends), k_tiles=1, n_tiles=1,
                 block_r=block_r, align=align)
    kept = []
    for j in range(int(t.num_blocks)):
      lo, r0 = (int(v) for v in t.rows(jnp.int32(j)))
      assert r0 % align == 0 and 0 <= r0 < m
      kept += [r for r in range(r0, r0 + block_r) if lo <= r < e_]
    assert kept == list(range(s, e_))
    assert int(t.num_blocks) <= -(-int(e_ - s) // block_r) + 1


def test_tgmm_config_validation_and_smem_fit():
  from jmoe.kernels import tgmm as tg
  with pytest.raises(ValueError, match="ctas_per_sm"):
    tg.TgmmConfig(ctas_per_sm=3)
  with pytest.raises(ValueError, match="out_buffers=3"):
    tg.TgmmConfig(out_buffers=3)
  with pytest.raises(ValueError, match="store_parts=3"):
    tg.TgmmConfig(store_parts=3)
  # two buffers of half tiles take the SMEM of one whole tile
  assert (tg._smem_bytes(128, 256, 64, 3, 2, 2, 0, 2, 2)
          == tg._smem_bytes(128, 256, 64, 3, 2, 2, 0, 1, 1))
  # deepseek-v3's dW13 winner (WS, 2 x 64x256 per CTA) with a second output buffer per
  # warpgroup: 2 stages still fit one block's shared memory, with the cross-tile bounds too
  itemsize, e = 2, 256
  for groups in (0, e):
    assert tg._smem_bytes(128, 256, 64, 2, itemsize, itemsize, groups, 2) <= tg._smem_limit(1)
  assert tg._smem_bytes(128, 256, 64, 3, itemsize, itemsize, 0, 2) > tg._smem_limit(1)
  # two resident CTAs share one SM's shared memory: the default's 2 stages must fit in half
  d = tg.DEFAULT_CONFIG
  assert d.ctas_per_sm == 2
  assert tg._smem_bytes(d.block_k, d.block_n, d.block_r, d.num_stages, 2, 2) <= tg._smem_limit(2)
  assert tg._smem_limit(2) < tg._smem_limit(1) == tg._SMEM_LIMIT


@pytest.mark.parametrize("preset,tokens,want_bm", [
    ((128, 8, 2048, 768), 1024, 128),   # qwen3: 64 rows / expert fit one 128-row tile
    ((256, 8, 7168, 2048), 1024, 64),   # deepseek-v3: 32 rows / expert
    ((8, 2, 4096, 14336), 1, 64),       # decode
])
def test_weight_streaming_heuristic_fits_a_group_in_one_tile(preset, tokens, want_bm):
  e, k, h, n = preset
  m = tokens * k
  for gated, (nn, kk) in ((True, (n, h)), (False, (h, n))):
    cfg = gg.heuristic_config(m, nn, kk, e, jnp.bfloat16, gated=gated)
    assert cfg.block_m == want_bm
    nwg, tm, tn = cfg.wg_tile()
    acc_regs = tm * tn * (2 if gated else 1) // 128  # f32 accumulators per thread of a WG
    assert acc_regs <= 128, "accumulators past the register budget"
    assert min(e, m) * (nn // cfg.block_n) >= 132 or cfg.block_n == 64


@pytest.mark.parametrize("m,e", [(1, 8), (2, 8), (64, 128), (64, 256), (128, 128), (8192, 128)])
def test_expected_groups_matches_simulation(m, e):
  # m rows routed uniformly at random: experts with any row, averaged over draws
  rng = np.random.default_rng(m * 1000 + e)
  sim = np.mean([len(np.unique(rng.integers(0, e, m))) for _ in range(4000)])
  assert gg.expected_groups(m, e) == pytest.approx(sim, rel=0.02)
  assert gg.expected_groups(m, e) == pytest.approx(e * (1 - (1 - 1 / e) ** m), rel=1e-9)
  assert gg.expected_groups(5, 1) == 1
  assert gg.expected_groups(0, e) == 1  # (the heuristic divides rows by it)


def test_fills_waves():
  assert not gg._fills_waves(131)         # an SM without an item
  assert gg._fills_waves(132) and gg._fills_waves(264)
  assert not gg._fills_waves(138)         # 2 waves, 0.52 full
  assert gg._fills_waves(240)             # 2 waves, 0.91 full


def test_heuristic_at_qwen3_8_tokens_keeps_the_sms_busy():
  # 64 slots over 128 experts touch ~50 of them: 64x256 GEMM1 tiles give ~150 items, two
  # waves with the second nearly empty (H200: 108 µs against 88 for 64-wide tiles)
  g1 = gg.heuristic_config(64, 768, 2048, 128, jnp.bfloat16, gated=True)
  g2 = gg.heuristic_config(64, 2048, 768, 128, jnp.bfloat16)
  assert (g1.block_m, g1.block_n) == (64, 64)
  assert (g2.block_m, g2.block_n) == (64, 128)
  for cfg, n in ((g1, 768), (g2, 2048)):
    assert gg._fills_waves(gg.expected_groups(64, 128) * n / cfg.block_n)


def test_tgmm_config_lookup(monkeypatch):
  from jmoe.kernels import tgmm as tg
  key = gg._tuned_key(8, 1536, 2048, jnp.bfloat16, _compat.device_kind(), gg._m_bucket(8192))
  tuned = {key: dict(block_k=64, block_n=256, block_r=64, num_stages=3, us=1.0, note="x")}
  monkeypatch.setattr(gg, "_load_tuned", lambda name: tuned if name == "tgmm" else {})
  assert tg.get_tgmm_config(8192, 2048, 1536, 8, jnp.bfloat16) == tg.TgmmConfig(
      block_k=64, block_n=256, block_r=64, num_stages=3)
  assert tg.get_tgmm_config(8192, 2048, 1536, 16, jnp.bfloat16) == tg.DEFAULT_CONFIG


def test_tgmm_config_takes_the_nearest_tuned_bucket(monkeypatch):
  # past 4096 rows a bucket without an entry takes the nearest tuned one (log distance; the
  # smaller on a tie), buckets below 4096 never lend theirs; the GEMM tables stay exact
  from jmoe.kernels import tgmm as tg
  key = lambda b: gg._tuned_key(8, 1536, 2048, jnp.bfloat16, _compat.device_kind(), b)
  cfg = lambda stages: dict(block_k=128, block_n=128, block_r=64, num_stages=stages)
  tuned = {key(1024): cfg(2), key(4096): cfg(3), key(1 << 30): cfg(5)}
  monkeypatch.setattr(gg, "_load_tuned", lambda name: tuned)
  pick = lambda m: tg.get_tgmm_config(m, 2048, 1536, 8, jnp.bfloat16).num_stages
  assert pick(3000) == 3                    # its own bucket
  assert pick(16000) == 3 and pick(60000) == 3  # 4096 is nearer than 2**30
  assert pick(1 << 29) == 5
  del tuned[key(4096)]
  assert pick(16000) == 5                   # 1024 is below the lending range
  assert tg.get_tgmm_config(2000, 2048, 1536, 8, jnp.bfloat16) == tg.DEFAULT_CONFIG
  assert gg.tuned_config("tgmm", tg.TgmmConfig, 16000, 1536, 2048, 8, jnp.bfloat16) is None


def test_gmm_grad_matches_ragged_dot(rng):
  from jmoe.kernels import tgmm as tg
  m, k, n, e = 130, 64, 128, 3
  gs = jnp.array([50, 0, 70], jnp.int32)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((e, k, n)) / 8, jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def f(x, w):
    return jnp.sum(tg.gmm(x, w, gs, None, _interpret()).astype(jnp.float32) * ct)

  def f_ref(x, w):
    return jnp.sum(jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), gs) * ct)

  try:
    gx, gw = jax.grad(f, argnums=(0, 1))(x, w)
  except Exception:
    _compat.reset_interpret_state()
    raise
  assert not _compat.races_found()
  rx, rw = jax.grad(f_ref, argnums=(0, 1))(x, w)
  assert _rel(gx, rx) < 2e-2
  assert _rel(gw, rw) < 2e-2


@pytest.mark.parametrize("empty_slot,route_impl,fused,activation", [
    (True, "kernels", False, "silu"),   # an empty slot: its row joins the zeroed tail
    pytest.param(False, "kernels", False, "silu", marks=pytest.mark.slow),
    pytest.param(True, "xla", False, "silu", marks=pytest.mark.slow),
    # GEMM1 writes a and h; act VJP in the d a GEMM
    pytest.param(True, "kernels", True, "swigluoai", marks=pytest.mark.slow),
    # non-gated: the VJP fused, no preact
    pytest.param(False, "xla", True, "relu2_no_mul", marks=pytest.mark.slow),
], ids=["empty_slot", "route_kernels", "xla_route", "fused_epilogues", "non_gated_fused"])
def test_fused_experts_train_grad(rng, empty_slot, route_impl, fused, activation):
  # jax.grad of the Pallas training path (routed_rows -> expert_mlp -> gather_sum_diff) against
  # autodiff of the f32 per-slot reference, for every input including both biases
  t, k, e, h, n = 6, 2, 3, 64, 64
  gated = not activation.endswith("_no_mul")
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  w13 = jnp.asarray(rng.standard_normal((e, h, (2 if gated else 1) * n)) / 8, jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((e, n, h)) / 8, jnp.bfloat16)
  b13 = jnp.asarray(rng.standard_normal((e, w13.shape[2])) / 4, jnp.float32)
  b2 = jnp.asarray(rng.standard_normal((e, h)) / 4, jnp.float32)
  tw, ti = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.standard_normal((t, e)), jnp.float32)), k)
  if empty_slot:  # an EP-remote / dropped slot: rows past the routed total in both GEMMs
    ti = ti.at[2, 1].set(-1)

  def loss(x, w13, w2, tw, b13, b2):
    out = pmoe.fused_experts_train(x, w13, w2, tw, ti, activation=activation, w13_bias=b13,
                                   w2_bias=b2, interpret=_interpret(), route_impl=route_impl,
                                   preact=fused and gated, fuse_act_grad=fused)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  def loss_ref(x, w13, w2, tw, b13, b2):
    return jnp.sum(pmoe.fused_experts_reference(x, w13, w2, tw, ti, activation=activation,
                                                w13_bias=b13, w2_bias=b2) ** 2)

  g = jax.grad(loss, argnums=tuple(range(6)))(x, w13, w2, tw, b13, b2)
  assert not _compat.races_found(), "race detected by the Mosaic GPU interpreter"
  g_ref = jax.grad(loss_ref, argnums=tuple(range(6)))(x, w13, w2, tw, b13, b2)
  for a, b in zip(g, g_ref):
    assert np.isfinite(np.asarray(a, np.float32)).all()
    assert _rel(a, b) < 2e-2


@pytest.fixture
def cross_tile_tgmm(monkeypatch):
  """The training path's weight gradients on the warp-specialized cross-tile kernel in K-fastest
  order (what the H200 tables pick for mixtral and qwen3); tgmm's trace cache is cleared on
  both sides so that no other test runs with (or without) the patched lookup."""
  from jmoe.kernels import tgmm as tg
  cfg = tg.TgmmConfig(block_k=64, block_n=64, block_r=64, num_stages=2, warp_specialized=True,
                      cross_tile=True, k_fastest=True)
  seen = []
  monkeypatch.setattr(tg, "get_tgmm_config", lambda *a, **kw: seen.append(a) or cfg)
  tg.tgmm.clear_cache()
  yield seen
  tg.tgmm.clear_cache()


@pytest.mark.slow
def test_fused_experts_train_grad_on_cross_tile_tgmm(rng, cross_tile_tgmm):
  # dW13 [E, 128, 128] runs warp specialized (2 x 64 rows per tile); dW2 [E, 64, 128] has K=64,
  # so it falls back to one warpgroup (the non-WS cross-tile kernel); an empty slot puts a row
  # into the zeroed tail
  t, k, e, h, n = 6, 2, 3, 128, 64
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  w13 = jnp.asarray(rng.standard_normal((e, h, 2 * n)) / 8, jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((e, n, h)) / 8, jnp.bfloat16)
  tw, ti = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.standard_normal((t, e)), jnp.float32)), k)
  ti = ti.at[2, 1].set(-1)

  def loss(x, w13, w2, tw):
    out = pmoe.fused_experts_train(x, w13, w2, tw, ti, interpret=_interpret())
    return jnp.sum(out.astype(jnp.float32) ** 2)

  def loss_ref(x, w13, w2, tw):
    return jnp.sum(pmoe.fused_experts_reference(x, w13, w2, tw, ti) ** 2)

  g = jax.grad(loss, argnums=(0, 1, 2, 3))(x, w13, w2, tw)
  assert not _compat.races_found(), "race detected by the Mosaic GPU interpreter"
  assert len(cross_tile_tgmm) == 2, "both weight gradients looked their config up"
  g_ref = jax.grad(loss_ref, argnums=(0, 1, 2, 3))(x, w13, w2, tw)
  for a, b in zip(g, g_ref):
    assert np.isfinite(np.asarray(a, np.float32)).all()
    assert _rel(a, b) < 2e-2


def test_fused_experts_train_rejects_preact_without_gate(rng):
  x = jnp.zeros((4, 64), jnp.bfloat16)
  w13 = jnp.zeros((2, 64, 64), jnp.bfloat16)
  w2 = jnp.zeros((2, 64, 64), jnp.bfloat16)
  tw, ti = jnp.ones((4, 1), jnp.float32), jnp.zeros((4, 1), jnp.int32)
  with pytest.raises(ValueError, match="preact=True needs a gated activation"):
    pmoe.fused_experts_train(x, w13, w2, tw, ti, activation="relu2_no_mul", preact=True)


# ----------------------------------------------------------------------------- batched format


@pytest.mark.parametrize("gated", [False, True])
def test_batched_grouped_gemm(rng, gated):
  e, cap, k, n = 3, 40, 32, 64
  counts = np.array([17, 0, 40])  # an empty expert, a full one, a partial one
  cols = 2 * n if gated else n
  lhs = jnp.asarray(rng.standard_normal((e, cap, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((e, k, cols)) / np.sqrt(k), jnp.bfloat16)
  scale = rng.uniform(0.1, 1.0, size=(e, cap)).astype(np.float32)
  act = Activation("gelu" if gated else "relu2_no_mul")
  fn = gg.batched_grouped_gemm_gated if gated else gg.batched_grouped_gemm
  out = _call(fn, lhs, rhs, jnp.asarray(counts, jnp.int32), row_scale=scale, activation=act,
              config=CFG_PLAIN)
  assert out.shape == (e, cap, n)
  for g in range(e):
    c = counts[g]
    want = _oracle(lhs[g, :c], rhs[g:g + 1], np.array([c]), row_scale=scale[g, :c], act=act,
                   gated=gated)
    assert np.isfinite(out[g, :c]).all()
    if c:
      assert _rel(out[g, :c], want) < TOL[jnp.bfloat16]
    assert np.isnan(out[g, c:]).all(), "rows past expert_num_tokens are documented as unwritten"


@pytest.mark.parametrize("method", ["rank", "count", "argsort", "sort"])
@pytest.mark.parametrize("t", [40, 300, 1])  # 160 slots, 1200 (count: 5 blocks, last partial), 4
def test_moe_align_methods(rng, method, t):
  ids = rng.integers(-1, 16, size=(t, 4)).astype(np.int32)
  if t == 300:
    ids[:150] = 3  # one expert with most slots, across block boundaries
  got = perm.moe_align(jnp.asarray(ids), 16, method=method)
  for a, b in zip(got, perm.moe_align_reference(ids, 16)):
    np.testing.assert_array_equal(np.asarray(a), b)
