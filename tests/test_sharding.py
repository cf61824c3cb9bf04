"""Expert parallelism on 8 simulated CPU devices: every EP PrepareFinalize x compatible experts
equals the single-device reference (forward and grad) over several meshes.

`tests/conftest.py` sets `--xla_force_host_platform_device_count=8` before jax initialises;
when jax was initialised with fewer devices (the file run in a process that imported jax
first) the module is skipped rather than failing.
"""
from __future__ import annotations

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax.extend.core import Literal  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jmoe  # noqa: E402
from jmoe import sharding  # noqa: E402
from jmoe.config import get_preset  # noqa: E402
from jmoe.quant import dequantize_rows_fp8, quantize_rows_fp8  # noqa: E402
from jmoe import registry  # noqa: E402
from jmoe.shared import shared_expert_mlp  # noqa: E402
from jmoe.sharding import collectives  # noqa: E402
from jmoe.sharding.mesh import (ExpertPlacement, expert_placement, make_ep_mesh,  # noqa: E402
                           make_parallel, parallel_config, place_weights)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8,
                                reason="needs 8 (simulated) devices: XLA_FLAGS set too late")

T, H, N, E, K = 16, 8, 4, 16, 3
TOL = dict(rtol=2e-5, atol=2e-5)

MESHES = {
    "e8": dict(expert=8),
    "d2e4": dict(data=2, expert=4),
    "e4t2": dict(expert=4, tensor=2),
    "e2t4": dict(expert=2, tensor=4),
    "d2e2t2": dict(data=2, expert=2, tensor=2),
}
ALL_PAIRS = [("allgather", "xla"), ("allgather", "reference"), ("allgather", "xla_batched"),
             ("ragged_a2a", "xla"), ("ragged_a2a", "reference"), ("ragged_dedup", "xla"),
             ("ragged_dedup", "reference"), ("padded_a2a", "xla_batched")]
CORE = [("allgather", "xla"), ("ragged_a2a", "xla"), ("ragged_dedup", "xla"),
        ("padded_a2a", "xla_batched")]
CHEAP = [("allgather", "reference"), ("ragged_a2a", "reference"), ("ragged_dedup", "reference"),
         ("padded_a2a", "xla_batched")]
# every pair on the expert-only mesh; the core pairs on the others (the rest of the e4t2 x pairs
# product is the slow tier)
CASES = ([("e8",) + p for p in ALL_PAIRS]
         + [pytest.param("e4t2", *p, marks=() if p in CORE else pytest.mark.slow)
            for p in ALL_PAIRS]
         + [("d2e4",) + p for p in CORE] + [("d2e2t2",) + p for p in CORE]
         + [("e2t4", "allgather", "xla_batched"), ("e2t4", "ragged_a2a", "reference"),
            ("e2t4", "padded_a2a", "xla_batched")])


@functools.lru_cache(maxsize=None)
def parallel(name: str, **kw):
  return make_parallel(**MESHES[name], **kw)


def problem(seed=0, t=T, e=E, k=K, h=H, n=N, bias=True):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
  x = f(t, h)
  w13, w2 = f(e, h, 2 * n) / 3, f(e, n, h) / 2
  b13, b2 = (f(e, 2 * n) / 3, f(e, h) / 3) if bias else (None, None)
  tw, ti = jmoe.select_experts(x, f(t, e), k)
  return dict(x=x, w13=w13, w2=w2, b13=b13, b2=b2, tw=tw, ti=ti)


# XLA:CPU compile time dominates these tests; LLVM's optimisations are not what they test
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast_jit(fn):
  """jax.jit(fn) compiled with cheap backend options (call once per argument shapes)."""
  def call(*args):
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)
  return call


def _fwd_and_vjp(fn):
  """(out, grads) of fn(x, w13, w2, tw, b13, b2; ti) with one compile."""
  def run(x, w13, w2, tw, b13, b2, ti, ct):
    out, vjp = jax.vjp(lambda *a: fn(*a, ti), x, w13, w2, tw, b13, b2)
    return out, vjp(ct)
  return fast_jit(run)


def reference(p, **kw):
  fn = lambda x, w13, w2, tw, b13, b2, ti: jmoe.fused_moe(  # noqa: E731
      x, w13, w2, tw, ti, w13_bias=b13, w2_bias=b2, runner_backend="reference", **kw)
  return _fwd_and_vjp(fn)(p["x"], p["w13"], p["w2"], p["tw"], p["b13"], p["b2"], p["ti"],
                          _cotangent(p))


def ep(p, par, a2a, runner, **kw):
  fn = lambda x, w13, w2, tw, b13, b2, ti: jmoe.fused_moe(  # noqa: E731
      x, w13, w2, tw, ti, w13_bias=b13, w2_bias=b2, runner_backend=runner, a2a_backend=a2a,
      parallel=par, **kw)
  return _fwd_and_vjp(fn)(p["x"], p["w13"], p["w2"], p["tw"], p["b13"], p["b2"], p["ti"],
                          _cotangent(p))


def _cotangent(p):
  return jnp.asarray(np.random.default_rng(7).normal(size=p["x"].shape), jnp.float32)


def assert_same(got, want):
  out, grads = got
  rout, rgrads = want
  np.testing.assert_allclose(np.asarray(out), np.asarray(rout), **TOL)
  for name, g, r in zip(("x", "w13", "w2", "topk_weights", "w13_bias", "w2_bias"), grads, rgrads):
    if r is None:
      continue
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), **TOL, err_msg=f"grad {name}")


@pytest.fixture(scope="module")
def prob():
  p = problem()
  return p, reference(p)


# --------------------------------------------------------------------------------------------
# every backend x experts x mesh: forward and grad equal the single-device reference


@pytest.mark.parametrize("mesh,a2a,runner", CASES, ids=[
    "-".join(c.values if hasattr(c, "values") else c) for c in CASES])
def test_matches_reference(prob, mesh, a2a, runner):
  p, ref = prob
  got = ep(p, parallel(mesh), a2a, runner)
  assert_same(got, ref)
  out = got[0]
  assert out.shape == p["x"].shape and out.dtype == p["x"].dtype


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("a2a,runner", CHEAP)
def test_top_k(a2a, runner, k):
  p = problem(seed=k, k=k, bias=False)
  kw = dict(apply_router_weight_on_input=True) if k == 1 else {}
  assert_same(ep(p, parallel("e8"), a2a, runner, **kw), reference(p, **kw))


@pytest.mark.parametrize("a2a,runner", [("ragged_a2a", "xla"), ("padded_a2a", "xla_batched")])
def test_bf16(a2a, runner):
  p = problem(seed=9, bias=False)
  bf = {k_: (v.astype(jnp.bfloat16) if k_ in ("x", "w13", "w2") else v) for k_, v in p.items()}
  want = jmoe.fused_moe(bf["x"], bf["w13"], bf["w2"], bf["tw"], bf["ti"],
                        runner_backend="reference")
  out = fast_jit(lambda x: jmoe.fused_moe(x, bf["w13"], bf["w2"], bf["tw"], bf["ti"],
                                          runner_backend=runner, a2a_backend=a2a,
                                          parallel=parallel("e4t2")))(bf["x"])
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)


def _skewed(kind: str):
  p = problem(seed=3, k=2)
  rng = np.random.default_rng(3)
  if kind == "one_expert":  # every token's first slot to expert 5, second slot empty
    ti = np.stack([np.full(T, 5), np.full(T, -1)], 1)
  else:  # uneven: most experts empty, a few hot, some empty slots
    ti = np.stack([rng.choice([0, 1, 9], T), rng.choice([4, 13], T)], 1)
    ti[::5, 1] = -1
  p["ti"] = jnp.asarray(ti, jnp.int32)
  return p


@pytest.mark.parametrize("kind", ["one_expert", "uneven"])
@pytest.mark.parametrize("a2a,runner", CHEAP)
def test_skewed_routing(a2a, runner, kind):
  p = _skewed(kind)
  assert_same(ep(p, parallel("d2e4"), a2a, runner), reference(p))


@pytest.mark.parametrize("a2a", ["allgather", "ragged_a2a", "ragged_dedup", "padded_a2a"])
def test_round_robin_placement(prob, a2a):
  p, ref = prob
  par = parallel("e4t2", expert_placement="round_robin")
  pl = expert_placement(E, 4, "round_robin")
  assert pl.owner.tolist()[:5] == [0, 1, 2, 3, 0]
  out = fast_jit(lambda x: jmoe.fused_moe(
      x, place_weights(p["w13"], pl), place_weights(p["w2"], pl), p["tw"], p["ti"],
      w13_bias=place_weights(p["b13"], pl), w2_bias=place_weights(p["b2"], pl),
      a2a_backend=a2a, parallel=par))(p["x"])
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref[0]), **TOL)


def test_explicit_make_mesh(prob):
  """jax 0.10's make_mesh gives Explicit axes; both plain and set_mesh use must work."""
  p, ref = prob
  mesh = jax.make_mesh((4, 2), ("expert", "tensor"))
  par = parallel_config(mesh)
  f = jax.jit(lambda x, tw, ti: jmoe.fused_moe(x, p["w13"], p["w2"], tw, ti, w13_bias=p["b13"],
                                               w2_bias=p["b2"], a2a_backend="ragged_a2a",
                                               parallel=par))
  np.testing.assert_allclose(np.asarray(f(p["x"], p["tw"], p["ti"])), np.asarray(ref[0]), **TOL)
  with jax.set_mesh(mesh):
    xs = jax.device_put(p["x"], NamedSharding(mesh, P("expert")))
    out = f(xs, p["tw"], p["ti"])
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref[0]), **TOL)
  assert out.sharding.spec == P("expert", None)


def test_output_sharded_like_input(prob):
  p, ref = prob
  par = parallel("d2e4")
  xs = sharding.shard_tokens(p["x"], par)
  out = fast_jit(lambda x: jmoe.fused_moe(x, p["w13"], p["w2"], p["tw"], p["ti"],
                                         w13_bias=p["b13"], w2_bias=p["b2"], parallel=par))(xs)
  assert out.sharding.is_equivalent_to(xs.sharding, 2)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref[0]), **TOL)


def _poisoned_receive_buffer(shape, dtype):
  """What an uninitialized GPU buffer may hold: NaN floats (0xFF bytes: NaN in float8_e4m3fn)."""
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.full(shape, jnp.nan, dtype)
  return jnp.full(shape, jnp.iinfo(dtype).max, dtype)


@pytest.mark.parametrize("a2a,runner", [pytest.param("ragged_a2a", "xla", marks=pytest.mark.slow),
                                        ("ragged_dedup", "xla"),
                                        ("ragged_dedup", "reference")])
def test_unwritten_receive_rows_are_never_read(monkeypatch, a2a, runner):
  # On the GPU the ragged paths' receive buffers are lax.empty (uninitialized; zeros on CPU).
  # Poisoned with NaN here, the layer and its gradients must still equal the single-device
  # reference (empty slots, experts without tokens), and so must the fp8 dispatch, whose
  # packed wire rows land in the same buffers
  monkeypatch.setattr(sharding.collectives, "receive_buffer", _poisoned_receive_buffer)
  p = _skewed("uneven")
  assert_same(ep(p, parallel("d2e4"), a2a, runner), reference(p))
  if a2a == "ragged_a2a":  # dropped copies (capacity 1) are not received and not read
    out = fast_jit(lambda x: sharding.ep_fused_moe(
        x, p["w13"], p["w2"], p["tw"], p["ti"], w13_bias=p["b13"], w2_bias=p["b2"],
        a2a_backend=a2a, parallel=parallel("e8"), capacity=1))(p["x"])
    assert np.isfinite(np.asarray(out)).all()
  _check_fp8_dispatch(p, "d2e4", a2a, runner)


@pytest.mark.parametrize("a2a", ["padded_a2a", "ragged_a2a"])
def test_capacity_counts_drops(a2a):
  p = problem(seed=5, k=2, bias=False)
  rng = np.random.default_rng(5)
  ti = np.stack([rng.choice([0, 1], T), rng.choice([2, 3, 15], T)], 1)
  p["ti"] = jnp.asarray(ti, jnp.int32)
  par = parallel("e8")
  ref = reference(p)[0]
  t_loc = T // 8
  for cap in (None, 1):
    out, stats = fast_jit(lambda x: sharding.ep_fused_moe(
        x, p["w13"], p["w2"], p["tw"], p["ti"], a2a_backend=a2a, parallel=par,
        capacity=cap, return_stats=True))(p["x"])
    want = 0
    kept = ti.copy()
    if cap is not None:  # per source rank and expert, slots past the first `cap` are dropped
      for r in range(8):
        blk = kept[r * t_loc:(r + 1) * t_loc].reshape(-1)
        seen = {}
        for j, e_ in enumerate(blk.tolist()):
          seen[e_] = seen.get(e_, 0) + 1
          if seen[e_] > cap:
            blk[j] = -1
            want += 1
        kept[r * t_loc:(r + 1) * t_loc] = blk.reshape(t_loc, -1)
    assert int(stats["dropped"]) == want
    np.testing.assert_array_equal(np.asarray(stats["expert_load"]),
                                  np.bincount(ti.reshape(-1), minlength=E))
    # a dropped copy contributes nothing: the reference without those slots
    want_out = ref if cap is None else jmoe.fused_moe(
        p["x"], p["w13"], p["w2"], p["tw"], jnp.asarray(kept), runner_backend="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), **TOL)
  assert want > 0


@pytest.mark.parametrize("a2a", ["allgather", "ragged_a2a", "ragged_dedup", "padded_a2a"])
def test_shared_experts_and_two_batch_overlap(prob, a2a):
  p, ref = prob
  rng = np.random.default_rng(11)
  s13 = jnp.asarray(rng.normal(size=(H, 2 * N)) / 3, jnp.float32)
  s2 = jnp.asarray(rng.normal(size=(N, H)) / 3, jnp.float32)
  want = ref[0] + shared_expert_mlp(p["x"], s13, s2, jmoe.Activation("silu"))
  out = fast_jit(lambda x: sharding.ep_fused_moe(
      x, p["w13"], p["w2"], p["tw"], p["ti"], w13_bias=p["b13"], w2_bias=p["b2"],
      a2a_backend=a2a, parallel=parallel("e4t2"), shared_w13=s13, shared_w2=s2,
      micro_batches=2))(p["x"])
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOL)


@pytest.mark.parametrize("a2a", ["allgather", "ragged_a2a", "ragged_dedup", "padded_a2a"])
def test_prepare_async_leaves_room_for_shared_work(a2a):
  """The shared-expert matmul does not depend on the dispatch collective (it can overlap).

  On CPU the ragged paths' collective is the all_gather emulation of ragged_all_to_all."""
  p = problem(bias=False)
  rng = np.random.default_rng(1)
  s13 = jnp.asarray(rng.normal(size=(H, 2 * N)), jnp.float32)
  s2 = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
  f = lambda x: sharding.ep_fused_moe(x, p["w13"], p["w2"], p["tw"], p["ti"],  # noqa: E731
                                      a2a_backend=a2a, parallel=parallel("e8"),
                                      shared_w13=s13, shared_w2=s2)
  jaxpr = jax.make_jaxpr(f)(p["x"]).jaxpr
  body = next(e for e in jaxpr.eqns if e.primitive.name == "shard_map").params["jaxpr"]
  names = [e.primitive.name for e in body.eqns]
  # the token dispatch: the first collective whose operand carries the hidden dimension
  first_a2a = next(i for i, e in enumerate(body.eqns)
                   if e.primitive.name in ("all_to_all", "all_gather", "ragged_all_to_all")
                   and any(getattr(v.aval, "shape", ())[-1:] == (H,) for v in e.invars
                           if not isinstance(v, Literal)))
  # the shared MLP's dots come after the dispatch was issued and before the experts' einsums
  dots = [i for i, n in enumerate(names) if n == "dot_general"]
  assert dots and dots[0] > first_a2a
  # ... and they read only the local tokens: no path from the all_to_all outputs
  a2a_out = set(map(id, body.eqns[first_a2a].outvars))
  dep = set(a2a_out)
  for e in body.eqns[first_a2a + 1:dots[0] + 1]:
    if any(id(v) in dep for v in e.invars if not isinstance(v, Literal)):
      dep.update(map(id, e.outvars))
  assert not any(id(v) in dep for v in body.eqns[dots[0]].outvars)


@pytest.mark.parametrize("a2a", ["allgather", "ragged_a2a", "ragged_dedup", "padded_a2a"])
def test_empty_batch(a2a):
  p = problem(t=0, bias=False)
  f = lambda x: jmoe.fused_moe(x, p["w13"], p["w2"], p["tw"], p["ti"],  # noqa: E731
                               a2a_backend=a2a, parallel=parallel("e8"))
  assert f(p["x"]).shape == (0, H)
  assert jax.grad(lambda w: jmoe.fused_moe(p["x"], w, p["w2"], p["tw"], p["ti"], a2a_backend=a2a,
                                           parallel=parallel("e8")).sum())(p["w13"]).shape \
      == p["w13"].shape


# --------------------------------------------------------------------------------------------
# fp8 dispatch (ParallelConfig.dispatch_dtype="fp8")


@pytest.mark.slow
@given(st.integers(1, 6), st.sampled_from([96, 128, 384]), st.floats(1e-3, 1e3),
       st.integers(0, 2**31 - 1))
@settings(max_examples=25, deadline=None)
def test_fp8_rows_round_trip_within_e4m3_rounding(rows, h, mag, seed):
  """Every element within half an e4m3 step (2^-4 relative) or the smallest subnormal step
  of its block's scale; zero rows exact; one scale per 128 channels (per row otherwise)."""
  a = np.random.default_rng(seed).normal(size=(rows, h)).astype(np.float32) * mag
  a[0] = 0.0
  q, scale = quantize_rows_fp8(jnp.asarray(a))
  assert q.dtype == jnp.float8_e4m3fn and scale.shape == (rows, h // 128 if h % 128 == 0 else 1)
  back = np.asarray(dequantize_rows_fp8(q, scale, jnp.float32))
  per_elem = np.repeat(np.asarray(scale), h // scale.shape[1], axis=1)
  assert (np.abs(back - a) <= np.abs(a) * 2.0**-4 + per_elem * 2.0**-9).all()
  np.testing.assert_array_equal(back[0], 0.0)


FP8_CASES = [("e8",) + c for c in CORE] + [("e4t2",) + c for c in CORE[:3]]


def _check_fp8_dispatch(p, mesh: str, a2a: str, runner: str):
  """The fp8-dispatch layer equals the reference layer on fp8-rounded tokens; returns it."""
  x_dq = dequantize_rows_fp8(*quantize_rows_fp8(p["x"]), p["x"].dtype)
  want = jmoe.fused_moe(x_dq, p["w13"], p["w2"], p["tw"], p["ti"], w13_bias=p["b13"],
                        w2_bias=p["b2"], runner_backend="reference")
  got = jax.jit(lambda x: jmoe.fused_moe(
      x, p["w13"], p["w2"], p["tw"], p["ti"], w13_bias=p["b13"], w2_bias=p["b2"],
      runner_backend=runner, a2a_backend=a2a,
      parallel=parallel(mesh, dispatch_dtype="fp8")))(p["x"])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
  return got


@pytest.mark.parametrize("mesh,a2a,runner", FP8_CASES, ids=["-".join(c) for c in FP8_CASES])
def test_fp8_dispatch_equals_the_layer_on_fp8_rounded_tokens(prob, mesh, a2a, runner):
  """The experts see each token row rounded to fp8 (per 128-channel scale) and nothing else."""
  p, ref = prob
  got = _check_fp8_dispatch(p, mesh, a2a, runner)
  err = np.linalg.norm(np.asarray(got) - np.asarray(ref[0])) / np.linalg.norm(np.asarray(ref[0]))
  assert 1e-4 < err < 0.1  # it did quantize, at fp8's precision


def test_fp8_dispatch_refuses_gradients_and_bad_dtypes(prob):
  p, _ = prob
  par = parallel("e8", dispatch_dtype="fp8")
  with pytest.raises(ValueError, match="dispatch_dtype='fp8'.*forward-only"):
    jax.grad(lambda x: jmoe.fused_moe(x, p["w13"], p["w2"], p["tw"], p["ti"],
                                      a2a_backend="ragged_a2a", parallel=par).sum())(p["x"])
  with pytest.raises(ValueError, match="dispatch_dtype='fp16' is not known"):
    parallel("e8", dispatch_dtype="fp16")


@pytest.mark.parametrize("a2a", ["ragged_a2a", "ragged_dedup"])
def test_fp8_dispatch_weight_gradients(prob, a2a):
  """Tokens that are not differentiated may travel in fp8: the weight gradients equal the
  bf16-dispatch layer's on the fp8-rounded tokens (the packed wire carries rows and their
  scales in one collective; the router weights travel apart, and stay differentiable)."""
  p, _ = prob
  x_dq = dequantize_rows_fp8(*quantize_rows_fp8(p["x"]), p["x"].dtype)

  def grads(x, dtype):
    loss = lambda w13, w2: jmoe.fused_moe(x, w13, w2, p["tw"], p["ti"], a2a_backend=a2a,
                                          parallel=parallel("e8", dispatch_dtype=dtype)).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(p["w13"], p["w2"])

  for got, want in zip(grads(p["x"], "fp8"), grads(x_dq, None)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOL)


@pytest.mark.parametrize("dtypes", [(jnp.float8_e4m3fn, jnp.float32, jnp.int32, jnp.float32),
                                    (jnp.bfloat16, jnp.int8), (jnp.float16,)])
def test_pack_rows_round_trip(dtypes):
  rng = np.random.default_rng(len(dtypes))
  cols = [jnp.asarray(rng.normal(size=(7, 3 + i)) * 50).astype(d) for i, d in enumerate(dtypes)]
  buf, layout = collectives.pack_rows(*cols)
  assert buf.dtype == jnp.uint8 and buf.shape == (7, sum(c[0].nbytes for c in cols))
  for got, want in zip(collectives.unpack_rows(buf, layout), cols):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  with pytest.raises(ValueError, match="every column needs 7 rows"):
    collectives.pack_rows(cols[0], cols[0][:3])


# --------------------------------------------------------------------------------------------
# the ragged all-to-all emulation


@pytest.mark.parametrize("chunks", [1, 3])
def test_ragged_all_to_all_emulation_matches_numpy(chunks):
  mesh = make_ep_mesh(expert=8, keep_unit_axes=False)
  ep_, rows, h = 8, 20, 3
  rng = np.random.default_rng(0)
  sizes = rng.integers(0, 3, size=(ep_, ep_))  # sizes[src, dst]
  ops = rng.normal(size=(ep_, rows, h)).astype(np.float32)
  in_off = np.cumsum(sizes, 1) - sizes + 1  # a gap of one row before the first slice
  out_off = np.cumsum(sizes, 0) - sizes + 2
  want = np.full((ep_, 2 + rows + 8, h), -1.0, np.float32)
  for s in range(ep_):
    for d in range(ep_):
      want[d, out_off[s, d]:out_off[s, d] + sizes[s, d]] = \
          ops[s, in_off[s, d]:in_off[s, d] + sizes[s, d]]

  def body(op, io, ss, oo, rs):
    out = jnp.full((want.shape[1], h), -1.0, jnp.float32)
    return collectives.ragged_all_to_all(op[0], out, io[0], ss[0], oo[0], rs[0],
                                         axis_name="expert", impl="emulated",
                                         chunks=chunks)[None]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
  i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
  got = f(jnp.asarray(ops), i32(in_off), i32(sizes), i32(out_off), i32(sizes.T))
  np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("chunks", [1, 4])
def test_ragged_all_to_all_several_slices_per_peer(chunks):
  """[P, m] arrays: m slices per peer, each landing at its own offset (chunks // m pieces each)."""
  mesh = make_ep_mesh(expert=8, keep_unit_axes=False)
  ep_, m, rows, h = 8, 2, 40, 2
  rng = np.random.default_rng(1)
  sizes = rng.integers(0, 3, size=(ep_, ep_, m))  # sizes[src, dst, slice]
  ops = rng.normal(size=(ep_, rows, h)).astype(np.float32)
  # sender: slice j of every peer in region j (rows [20 j, ...)); receiver: slice-major
  in_off = np.cumsum(sizes, 1) - sizes + 20 * np.arange(m)
  flat = sizes.transpose(2, 0, 1).reshape(m * ep_, ep_)  # [(slice, src), dst]
  out_off = (np.cumsum(flat, 0) - flat).reshape(m, ep_, ep_).transpose(1, 2, 0)  # [src, dst, j]
  want = np.full((ep_, rows, h), -1.0, np.float32)
  for s_ in range(ep_):
    for d in range(ep_):
      for j in range(m):
        want[d, out_off[s_, d, j]:out_off[s_, d, j] + sizes[s_, d, j]] = \
            ops[s_, in_off[s_, d, j]:in_off[s_, d, j] + sizes[s_, d, j]]

  def body(op, io, ss, oo, rs):
    out = jnp.full((rows, h), -1.0, jnp.float32)
    return collectives.ragged_all_to_all(op[0], out, io[0], ss[0], oo[0], rs[0],
                                         axis_name="expert", impl="emulated",
                                         chunks=chunks)[None]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
  i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
  got = f(jnp.asarray(ops), i32(in_off), i32(sizes), i32(out_off),
          i32(sizes.transpose(1, 0, 2)))
  np.testing.assert_array_equal(np.asarray(got), want)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 40)), min_size=1, max_size=8),
       st.integers(1, 9))
@settings(max_examples=15, deadline=None)  # each example compiles: 40 cost 11 s of CI
def test_split_slices_cover_each_slice_once(slices, chunks):
  """The pieces of a slice are consecutive, in order, and cover it exactly (empty ones too)."""
  offs = jnp.asarray([o for o, _ in slices], jnp.int32)
  sizes = jnp.asarray([s for _, s in slices], jnp.int32)
  o, n = collectives.split_slices(offs, sizes, chunks)
  o, n = np.asarray(o).reshape(-1, chunks), np.asarray(n).reshape(-1, chunks)
  assert (n >= 0).all()
  for i, (off, size) in enumerate(slices):
    rows = np.concatenate([np.arange(a, a + b) for a, b in zip(o[i], n[i])])
    np.testing.assert_array_equal(rows, np.arange(off, off + size))


def test_ragged_chunks_setting(monkeypatch):
  monkeypatch.delenv("JMOE_RAGGED_A2A_CHUNKS", raising=False)
  assert collectives.default_chunks() == collectives.NATIVE_CHUNKS
  monkeypatch.setenv("JMOE_RAGGED_A2A_CHUNKS", "16")
  assert collectives.default_chunks() == 16
  monkeypatch.setenv("JMOE_RAGGED_A2A_CHUNKS", "0")
  with pytest.raises(ValueError, match="JMOE_RAGGED_A2A_CHUNKS"):
    collectives.default_chunks()
  # pieces only where XLA's in-process one-shot kernel runs the op (<= 8 peers, one process)
  assert collectives.one_shot_kernel_applies(8) and not collectives.one_shot_kernel_applies(16)


def test_ragged_impl_choice(monkeypatch):
  assert collectives.ragged_impl_for("cpu") == "emulated"
  assert collectives.ragged_impl_for("gpu") == "native"
  monkeypatch.setenv("JMOE_RAGGED_A2A", "native")
  assert collectives.ragged_impl_for("cpu") == "native"
  monkeypatch.setenv("JMOE_RAGGED_A2A", "bogus")
  with pytest.raises(ValueError, match="JMOE_RAGGED_A2A"):
    collectives.ragged_impl_for("cpu")


# --------------------------------------------------------------------------------------------
# registry / oracle


def test_backends_registered():
  for name in ("allgather", "ragged_a2a", "ragged_dedup", "padded_a2a"):
    assert registry.A2A_BACKENDS[name].needs_mesh


def test_oracle_defaults_and_forcing(monkeypatch):
  monkeypatch.delenv("JMOE_A2A_BACKEND", raising=False)
  monkeypatch.delenv("JMOE_RUNNER_BACKEND", raising=False)
  par = parallel("e8")
  pf, ex, why = sharding.select_parts(par)
  assert isinstance(pf, sharding.AllGather) and "all-gather" in why
  pf, ex, _ = sharding.select_parts(par, a2a_backend="padded_a2a")
  assert isinstance(pf, sharding.PaddedA2A) and ex.name == "xla_batched"
  monkeypatch.setenv("JMOE_A2A_BACKEND", "ragged_a2a")
  pf, _, why = sharding.select_parts(par)
  assert isinstance(pf, sharding.RaggedA2A) and "JMOE_A2A_BACKEND" in why
  pf, _, _ = sharding.select_parts(parallel("e8", a2a_backend="padded_a2a"))
  assert isinstance(pf, sharding.RaggedA2A)  # the environment beats the config
  with pytest.raises(ValueError, match=r"runner_backend=.reference. has no batched-format experts"):
    sharding.select_parts(par, a2a_backend="padded_a2a", runner_backend="reference")
  with pytest.raises(ValueError, match="needs parallel"):
    jmoe.select_backend("xla", "ragged_a2a")


@pytest.mark.parametrize("preset,ep,want", [
    ("deepseek-v3", 2, "allgather"), ("qwen3-30b-a3b", 2, "allgather"),
    ("deepseek-v3", 8, "ragged_dedup"), ("qwen3-30b-a3b", 8, "ragged_dedup"),
    ("mixtral-8x7b", 8, "ragged_dedup"), ("deepseek-v3", 64, "ragged_dedup")])
def test_auto_ep_dispatch_follows_the_comm_model(preset, ep, want):
  cfg = get_preset(preset)
  got, why = jmoe.oracle.auto_ep_dispatch(ep, cfg.hidden_size, cfg.num_experts, cfg.top_k, 4096)
  assert got == want and f"EP={ep}" in why


def test_auto_ep_dispatch_in_the_layer(monkeypatch, prob):
  """With routing known, the EP layer's "auto" is the comm model's choice; forcing still wins."""
  monkeypatch.delenv("JMOE_A2A_BACKEND", raising=False)
  p, _ = prob
  t, k = p["ti"].shape
  e, h = p["w13"].shape[0], p["w13"].shape[1]
  want, _ = jmoe.oracle.auto_ep_dispatch(8, h, e, k, t // 8)
  pf, _, why = sharding.select_parts(parallel("e8"), problem=(p["x"].dtype, h, 4),
                                     routing=(e, k, t // 8))
  assert pf.name == want and "EP=8" in why
  pf, _, _ = sharding.select_parts(parallel("e8"), a2a_backend="ragged_a2a", routing=(e, k, 1))
  assert pf.name == "ragged_a2a"


def test_a2a_none_on_mesh_runs_replicated(prob):
  p, ref = prob
  out = jmoe.fused_moe(p["x"], p["w13"], p["w2"], p["tw"], p["ti"], w13_bias=p["b13"],
                       w2_bias=p["b2"], a2a_backend="none", parallel=parallel("e8"))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref[0]), **TOL)


# --------------------------------------------------------------------------------------------
# clear errors


def test_errors(prob):
  p, _ = prob
  call = lambda par, **kw: jmoe.fused_moe(  # noqa: E731
      kw.pop("x", p["x"]), kw.pop("w13", p["w13"]), kw.pop("w2", p["w2"]),
      kw.pop("tw", p["tw"]), kw.pop("ti", p["ti"]), parallel=par, **kw)
  with pytest.raises(ValueError, match=r"T=12 is not divisible .*data=2 x expert=4 = 8"):
    call(parallel("d2e4"), x=p["x"][:12], tw=p["tw"][:12], ti=p["ti"][:12])
  with pytest.raises(ValueError, match="num_experts=12 is not divisible by the expert axis"):
    call(parallel("e8"), w13=p["w13"][:12], w2=p["w2"][:12], ti=p["ti"] % 12)
  par = make_parallel(expert=1, tensor=8)
  with pytest.raises(ValueError, match="intermediate_size=4 is not divisible by the tensor axis"):
    call(par)
  with pytest.raises(ValueError, match="needs ParallelConfig.expert_axis"):
    sharding.RaggedA2A(parallel_config(make_ep_mesh(tensor=8, expert=1, keep_unit_axes=False)))
  with pytest.raises(ValueError, match="micro_batches=3"):
    sharding.ep_fused_moe(p["x"], p["w13"], p["w2"], p["tw"], p["ti"], parallel=parallel("e8"),
                          micro_batches=3)
  with pytest.raises(ValueError, match="expert_map describes one device's experts"):
    call(parallel("e8"), expert_map=jnp.arange(E, dtype=jnp.int32))
  with pytest.raises(ValueError, match="w13/w2 hold every expert"):
    call(parallel("e8"), global_num_experts=32)
  with pytest.raises(ValueError, match="repeats an expert"):
    call(parallel("e8"), a2a_backend="padded_a2a",
         ti=jnp.zeros_like(p["ti"]).at[:, 1].set(1))


# --------------------------------------------------------------------------------------------
# mesh helpers and placement


def test_make_ep_mesh_shapes():
  m = make_ep_mesh(data=2, expert=-1, tensor=2)
  assert dict(m.shape) == {"data": 2, "expert": 2, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
  m = make_ep_mesh(expert=8, keep_unit_axes=False)
  assert m.axis_names == ("expert",)
  m = make_ep_mesh(expert=4, tensor=2, axis_names=("dp", "ep", "tp"))
  par = parallel_config(m, data_axis="dp", expert_axis="ep", tensor_axis="tp")
  assert (par.axis_size(par.expert_axis), par.axis_size(par.tensor_axis)) == (4, 2)
  with pytest.raises(ValueError, match="does not match the device count"):
    make_ep_mesh(data=3, expert=2, tensor=1)
  with pytest.raises(ValueError, match="at most one axis size may be -1"):
    make_ep_mesh(data=-1, expert=-1)
  with pytest.raises(ValueError, match="cannot be split"):
    make_ep_mesh(data=3, expert=-1)
  am = sharding.as_auto_mesh(jax.make_mesh((8,), ("expert",)))
  assert am.axis_types == (jax.sharding.AxisType.Auto,)


def test_validate_messages():
  par = parallel("e4t2")
  s = sharding.validate(par, num_experts=8, intermediate_size=6, hidden_size=10, num_tokens=8)
  assert (s.dp, s.ep, s.tp) == (1, 4, 2)
  with pytest.raises(ValueError, match="hidden_size=9 is not divisible by the axis 'tensor'"):
    sharding.validate(par, num_experts=8, intermediate_size=6, hidden_size=9,
                      hidden_axis="tensor")
  with pytest.raises(ValueError, match="two roles"):
    sharding.validate(jmoe.ParallelConfig(mesh=par.mesh, expert_axis="expert",
                                          tensor_axis="expert"),
                      num_experts=8, intermediate_size=8)
  with pytest.raises(ValueError, match="expert_placement"):
    jmoe.ParallelConfig(expert_placement="random")
  with pytest.raises(ValueError, match="dispatch_capacity"):
    jmoe.ParallelConfig(dispatch_capacity=0)


@pytest.mark.parametrize("kind", ["linear", "round_robin"])
def test_placement_maps(kind):
  e, ep_ = 12, 4
  pl = expert_placement(e, ep_, kind)
  maps = pl.expert_maps
  assert maps.shape == (ep_, e)
  # every expert is local to exactly one rank, local ids 0..El-1 on each rank
  assert ((maps >= 0).sum(0) == 1).all()
  for r in range(ep_):
    assert sorted(maps[r][maps[r] >= 0].tolist()) == list(range(e // ep_))
    np.testing.assert_array_equal(maps[r][pl.local_experts(r)], np.arange(e // ep_))
    np.testing.assert_array_equal(sharding.expert_map(e, ep_, r, kind), maps[r])
  if kind == "linear":
    np.testing.assert_array_equal(maps[1], [-1, -1, -1, 0, 1, 2] + [-1] * 6)
  else:
    np.testing.assert_array_equal(pl.local_experts(1), [1, 5, 9])
  assert pl == expert_placement(e, ep_, kind) and hash(pl) == hash(expert_placement(e, ep_, kind))
  with pytest.raises(ValueError, match="permutation"):
    ExpertPlacement(np.array([0, 0, 1, 2]), 2)
  with pytest.raises(ValueError, match="not divisible"):
    expert_placement(10, 4, kind)
  with pytest.raises(ValueError, match="not known"):
    expert_placement(8, 4, "random")


@pytest.mark.parametrize("mesh,direct", [("e8", True),
                                         pytest.param("e8", False, marks=pytest.mark.slow),
                                         pytest.param("d2e4", True, marks=pytest.mark.slow),
                                         pytest.param("e4t2", True, marks=pytest.mark.slow),
                                         ("e4t2", False)])  # lean: both directions, 2 meshes
def test_ragged_dedup_row_sources(monkeypatch, mesh, direct):
  """Rows sent straight from the token array (one piece per (destination, token)) or packed
  per destination first: both equal the reference, forward and gradients, and with fp8 rows."""
  monkeypatch.setattr(sharding.prepare_finalize, "DEDUP_DIRECT_ROWS", direct)
  p = problem(seed=11, t=64)
  assert_same(ep(p, parallel(mesh), "ragged_dedup", "xla"), reference(p))
  fp8 = lambda x: jmoe.fused_moe(x, p["w13"], p["w2"], p["tw"], p["ti"],  # noqa: E731
                                 a2a_backend="ragged_dedup",
                                 parallel=parallel(mesh, dispatch_dtype="fp8"))
  x_dq = dequantize_rows_fp8(*quantize_rows_fp8(p["x"]), p["x"].dtype)
  want = jmoe.fused_moe(x_dq, p["w13"], p["w2"], p["tw"], p["ti"], runner_backend="reference")
  np.testing.assert_allclose(np.asarray(jax.jit(fp8)(p["x"])), np.asarray(want), **TOL)


def test_ragged_dedup_direct_rows_by_default_for_wide_rows(monkeypatch):
  pf = sharding.RaggedDedupA2A(parallel("e8"))
  wide = sharding.prepare_finalize.DEDUP_DIRECT_MIN_ROW_BYTES // 2
  assert pf._direct(jnp.zeros((3, wide), jnp.bfloat16))  # deepseek-v3's 14 KB rows
  assert not pf._direct(jnp.zeros((3, wide - 1), jnp.bfloat16))  # qwen3's 4 KB rows
  assert not sharding.RaggedDedupA2A(parallel("e8"), direct_rows=False)._direct(
      jnp.zeros((3, wide), jnp.bfloat16))
  # XLA's NCCL path (several processes) would send each per-token piece on its own: packed
  native = sharding.RaggedDedupA2A(parallel("e8"), ragged_impl="native")
  monkeypatch.setattr(collectives, "one_shot_kernel_applies", lambda peers: False)
  assert not native._direct(jnp.zeros((3, wide), jnp.bfloat16))


def test_ragged_dedup_sends_one_copy_per_rank():
  """A token goes once to each rank owning one of its experts, with its ids and weights."""
  p = problem(seed=3, k=4, bias=False)
  par = parallel("e8")
  pf = sharding.RaggedDedupA2A(par)
  el = E // 8

  def body(x, tw, ti):
    inp = pf.prepare(x, tw, ti, num_local_experts=el, expert_map=None,
                     apply_router_weight_on_input=False, quant=None)
    me = jax.lax.axis_index("expert")
    sent = jnp.sum(inp.extra["cnt"][me])  # rows this rank sent
    return jax.lax.psum(sent, "expert")[None]

  spec = P("expert", None)
  fn = jax.shard_map(body, mesh=par.mesh, in_specs=(spec, spec, spec), out_specs=P("expert"))
  sent = int(jax.jit(fn)(p["x"], p["tw"], p["ti"])[0])
  owners = np.asarray(p["ti"]) // el  # linear placement
  want = sum(len(set(row.tolist())) for row in owners)
  assert sent == want < T * 4
