"""jmoe.fused_moe on every local runner backend against the float64 NumPy oracle: activations x
dtypes x routing edge cases, eager and jit, and the out-of-range-id semantics under jit
(empty slot, or an error in the checkify mode)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import checkify

import jmoe
import oracle_np as onp

BACKENDS = ("reference", "xla", "xla_batched")
DTYPES = {"f32": (jnp.float32, 1e-5), "bf16": (jnp.bfloat16, 2e-2)}
_STATIC = ("activation", "runner_backend", "apply_router_weight_on_input", "global_num_experts",
           "swiglu_alpha", "swiglu_limit")
fused_jit = jax.jit(jmoe.fused_moe, static_argnames=_STATIC)
# The standard problem (T, H, N, E, k): H and N not multiples of 8. Most cases reuse it so that
# eager op compilations are shared.
STD = (6, 12, 10, 5, 2)


@dataclasses.dataclass
class Case:
  """One fused_moe problem in float64 (cast to the dtype under test by `run`)."""

  x: np.ndarray
  w13: np.ndarray
  w2: np.ndarray
  topk_weights: np.ndarray
  topk_ids: np.ndarray
  activation: str = "silu"
  w13_bias: Optional[np.ndarray] = None
  w2_bias: Optional[np.ndarray] = None
  expert_map: Optional[np.ndarray] = None
  apply_router_weight_on_input: bool = False
  alpha: Optional[float] = None
  limit: Optional[float] = None


def make_case(rng, t, h, n, e, k, *, activation="silu", bias=False, ids=None, x_scale=1.0,
              **kw) -> Case:
  w = onp.make_weights(rng, e, h, n, gated=onp.is_gated(activation), bias=bias)
  tw, rid = onp.random_topk(rng, t, e, k)
  return Case(x=x_scale * rng.standard_normal((t, h)), w13=w["w13"], w2=w["w2"],
              topk_weights=tw, topk_ids=rid if ids is None else np.asarray(ids, np.int32),
              activation=activation, w13_bias=w.get("w13_bias"), w2_bias=w.get("w2_bias"), **kw)


def run(case: Case, backend: str, dtype=jnp.float32, use_jit: bool = False):
  """-> (jmoe output as f64, oracle output on the same dtype-rounded inputs)."""
  cast = lambda a: None if a is None else jnp.asarray(a, dtype)  # noqa: E731
  x, w13, w2 = cast(case.x), cast(case.w13), cast(case.w2)
  b13, b2 = cast(case.w13_bias), cast(case.w2_bias)
  emap = None if case.expert_map is None else jnp.asarray(case.expert_map, jnp.int32)
  fn = fused_jit if use_jit else jmoe.fused_moe
  out = fn(x, w13, w2, jnp.asarray(case.topk_weights, jnp.float32),
           jnp.asarray(case.topk_ids, jnp.int32), activation=case.activation,
           swiglu_alpha=case.alpha, swiglu_limit=case.limit, w13_bias=b13, w2_bias=b2,
           expert_map=emap, apply_router_weight_on_input=case.apply_router_weight_on_input,
           runner_backend=backend)
  assert out.shape == case.x.shape and out.dtype == dtype
  up = lambda a: None if a is None else np.asarray(a.astype(jnp.float32), np.float64)  # noqa
  akw = {}
  if case.alpha is not None:
    akw["alpha"] = case.alpha
  if case.limit is not None:
    akw["limit"] = case.limit
  ref = onp.fused_moe(up(x), up(w13), up(w2), case.topk_weights, case.topk_ids,
                      activation=case.activation, w13_bias=up(b13), w2_bias=up(b2),
                      expert_map=case.expert_map,
                      apply_router_weight_on_input=case.apply_router_weight_on_input, **akw)
  return np.asarray(out.astype(jnp.float32), np.float64), ref


# ---------------------------------------------------------------------------------------------
# activations x dtypes x backends (one shape, H and N not multiples of 8)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("activation", onp.ALL_ACTIVATIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_dtype_matrix(backend, activation, dtype, rng):
  dt, tol = DTYPES[dtype]
  case = make_case(rng, *STD, activation=activation, x_scale=2.0)
  out, ref = run(case, backend, dt)
  onp.assert_rel_close(out, ref, tol, f"{backend}/{activation}/{dtype}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_swigluoai_custom_alpha_limit(backend, rng):
  """Clamps active: GEMM1 outputs reach well past limit=0.5."""
  case = make_case(rng, *STD, activation="swigluoai", bias=True, x_scale=3.0,
                   alpha=1.0, limit=0.5)
  out, ref = run(case, backend)
  onp.assert_rel_close(out, ref, 1e-5, backend)
  default = dataclasses.replace(case, alpha=None, limit=None)
  out_d, _ = run(default, backend)
  assert onp.rel_err(out_d, ref) > 1e-2  # the parameters are not ignored


# ---------------------------------------------------------------------------------------------
# routing edge cases


def _case_t1(rng):
  return make_case(rng, 1, 12, 10, 5, 2)


def _case_one_expert(rng):
  ids = np.stack([np.full(6, 2), np.array([0, 1, 3, 4, 0, 1])], 1)
  return make_case(rng, *STD, ids=ids)


def _case_idle_experts(rng):
  return make_case(rng, *STD, ids=[[0, 1], [1, 0]] * 3)


def _case_e1(rng):
  return make_case(rng, 5, 12, 10, 1, 1)


def _case_k_eq_e(rng):
  return make_case(rng, 6, 12, 10, 5, 5)


def _case_odd_dims(rng):
  return make_case(rng, 5, 7, 3, 3, 2, activation="gelu")


def _case_empty_slots(rng):
  ids = [[0, -1], [-1, 3], [-1, -1], [2, 4], [1, -1], [3, 0]]
  return make_case(rng, *STD, ids=ids)


def _case_expert_map(rng):
  # global 10 experts, 5 live here: global 1->0, 3->1, 4->2, 6->3, 9->4.
  c = make_case(rng, *STD)
  c.expert_map = np.array([-1, 0, -1, 1, 2, -1, 3, -1, -1, 4], np.int32)
  c.topk_ids = np.stack([rng.permutation(10)[:2] for _ in range(6)]).astype(np.int32)
  c.topk_ids[0] = [0, 5]  # a token with no local expert at all
  c.topk_ids[1] = [-1, 9]  # an empty slot next to a local one
  c.topk_ids[2] = [3, 7]  # a local and a non-local one
  return c


def _case_bias(rng):
  return make_case(rng, *STD, activation="swigluoai", bias=True, x_scale=3.0)


def _case_bias_no_mul(rng):
  return make_case(rng, *STD, activation="relu2_no_mul", bias=True)


def _case_weight_on_input(rng):
  return make_case(rng, 6, 12, 10, 5, 1, apply_router_weight_on_input=True)


def _case_many_tokens(rng):
  return make_case(rng, 40, 12, 10, 6, 3)


CASES = {f.__name__[6:]: f for f in (
    _case_t1, _case_one_expert, _case_idle_experts, _case_e1, _case_k_eq_e, _case_odd_dims,
    _case_empty_slots, _case_expert_map, _case_bias, _case_bias_no_mul, _case_weight_on_input,
    _case_many_tokens)}


# Cases on shapes of their own run eagerly on the default backend only: eager op-by-op
# compilation of new shapes is what costs time on CPU, and the jit runs cover the rest.
_OWN_SHAPES = ("t1", "e1", "k_eq_e", "odd_dims", "weight_on_input", "many_tokens")
ROUTING_PARAMS = [(name, backend, use_jit) for name in CASES for backend in BACKENDS
                  for use_jit in (False, True)
                  if use_jit or backend == "xla" or name not in _OWN_SHAPES]


@pytest.mark.parametrize("name,backend,use_jit", ROUTING_PARAMS,
                         ids=[f"{n}-{b}-{'jit' if j else 'eager'}" for n, b, j in ROUTING_PARAMS])
def test_routing_cases(name, backend, use_jit, rng):
  case = CASES[name](rng)
  out, ref = run(case, backend, use_jit=use_jit)
  onp.assert_rel_close(out, ref, 1e-5, f"{name}/{backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_routing_cases_bf16(backend, rng):
  for name in ("empty_slots", "expert_map", "weight_on_input"):
    out, ref = run(CASES[name](rng), backend, jnp.bfloat16)
    onp.assert_rel_close(out, ref, 2e-2, f"{name}/{backend}")


def test_token_without_experts_is_zero(rng):
  case = _case_expert_map(rng)
  for backend in BACKENDS:
    out, _ = run(case, backend)
    np.testing.assert_array_equal(out[0], 0.0)


def test_weight_on_input_differs_from_weight_on_output(rng):
  """With a nonlinear MLP, scaling the input is not the same as scaling the output."""
  case = _case_weight_on_input(rng)
  out_in, _ = run(case, "xla")
  out_out, _ = run(dataclasses.replace(case, apply_router_weight_on_input=False), "xla")
  assert onp.rel_err(out_in, out_out) > 1e-2


def test_backends_agree_and_auto(rng, no_backend_env):
  case = make_case(rng, *STD, bias=True)
  outs = {b: run(case, b)[0] for b in BACKENDS + ("auto",)}
  for b in BACKENDS:
    onp.assert_rel_close(outs[b], outs["reference"], 1e-5, b)
  np.testing.assert_array_equal(outs["auto"], outs["xla"])  # the oracle's CPU choice


# ---------------------------------------------------------------------------------------------
# out-of-range ids under jit: empty slots, or an error in the checkify mode


def _bad_id_case(rng):
  c = make_case(rng, *STD)
  c.topk_ids = np.array([[0, 7], [-3, 2], [1, 4], [5, -1], [2, 3], [4, 0]], np.int32)
  return c


def _args(case):
  return (jnp.asarray(case.x, jnp.float32), jnp.asarray(case.w13, jnp.float32),
          jnp.asarray(case.w2, jnp.float32), jnp.asarray(case.topk_weights),
          jnp.asarray(case.topk_ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_ids_under_jit_are_empty_slots(backend, rng):
  case = _bad_id_case(rng)
  f = jax.jit(lambda *a: jmoe.fused_moe(*a, runner_backend=backend))
  out = np.asarray(f(*_args(case)), np.float64)
  clean = np.where((case.topk_ids >= 0) & (case.topk_ids < 5), case.topk_ids, -1)
  ref = onp.fused_moe(case.x, case.w13, case.w2, case.topk_weights, clean)
  onp.assert_rel_close(out, ref, 1e-5, backend)
  with pytest.raises(ValueError, match="topk_ids"):  # eager: concrete ids raise
    jmoe.fused_moe(*_args(case), runner_backend=backend)


def test_out_of_range_ids_with_expert_map_under_jit(rng):
  case = _case_expert_map(rng)
  case.topk_ids[2] = [10, 3]  # 10 lies outside the 10 global experts
  case.topk_ids[3] = [-2, 4]
  f = jax.jit(lambda *a: jmoe.fused_moe(*a[:5], expert_map=a[5], runner_backend="xla"))
  out = np.asarray(f(*_args(case), jnp.asarray(case.expert_map)), np.float64)
  clean = np.where((case.topk_ids < 10) & (case.topk_ids >= -1), case.topk_ids, -1)
  ref = onp.fused_moe(case.x, case.w13, case.w2, case.topk_weights, clean,
                      expert_map=case.expert_map)
  onp.assert_rel_close(out, ref, 1e-5)


def test_no_check_is_recorded_outside_the_checkify_mode(rng):
  """The default: no checkify effect in the trace (it would cost every call jit's fast path),
  so out-of-range ids are empty slots even under checkify.checkify."""
  case = _bad_id_case(rng)
  f = jax.jit(lambda *a: jmoe.fused_moe(*a, runner_backend="xla"))
  assert "check" not in str(jax.make_jaxpr(f)(*_args(case)))
  err, _ = checkify.checkify(f)(*_args(case))
  err.throw()  # nothing recorded, nothing raised


@pytest.mark.parametrize("backend", ["xla", "xla_batched"])
def test_checkify_mode_turns_bad_ids_into_error(backend, rng):
  case = _bad_id_case(rng)
  f = jax.jit(lambda *a: jmoe.fused_moe(*a, runner_backend=backend))
  with jmoe.checkify_ids():  # traced inside the checkify mode: the trace carries the check
    err, out = checkify.checkify(f)(*_args(case))
  with pytest.raises(Exception, match="topk_ids holds ids outside"):
    err.throw()
  # In-range ids pass the check, and the same jitted function still runs without checkify.
  good = dataclasses.replace(case, topk_ids=np.where(np.abs(case.topk_ids) < 5,
                                                     np.abs(case.topk_ids), 0).astype(np.int32))
  good.topk_ids[:, 1] = (good.topk_ids[:, 0] + 1) % 5
  with jmoe.checkify_ids():
    err, out = checkify.checkify(f)(*_args(good))
  err.throw()
  np.testing.assert_allclose(np.asarray(out), np.asarray(f(*_args(good))), rtol=1e-6)
  ref = onp.fused_moe(good.x, good.w13, good.w2, good.topk_weights, good.topk_ids)
  onp.assert_rel_close(out, ref, 1e-5)


def test_jit_retrace_not_needed_across_values(rng):
  """Static shapes: new routing values reuse the compiled function."""
  f = jax.jit(lambda *a: jmoe.fused_moe(*a, runner_backend="xla"))
  c1, c2 = make_case(rng, *STD), make_case(rng, *STD)
  for c in (c1, c2):
    out = np.asarray(f(*_args(c)), np.float64)
    onp.assert_rel_close(out, onp.fused_moe(c.x, c.w13, c.w2, c.topk_weights, c.topk_ids), 1e-5)
  assert f._cache_size() == 1


# ---------------------------------------------------------------------------------------------
# more edge cases


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens(backend, rng):
  """An empty batch (a data-parallel rank with no tokens) runs, jitted and differentiated."""
  w = onp.make_weights(rng, 4, 6, 5)
  args = (jnp.zeros((0, 6), jnp.float32), jnp.asarray(w["w13"], jnp.float32),
          jnp.asarray(w["w2"], jnp.float32), jnp.zeros((0, 2), jnp.float32),
          jnp.zeros((0, 2), jnp.int32))
  out = fused_jit(*args, runner_backend=backend)
  assert out.shape == (0, 6)
  g = jax.grad(lambda w13: fused_jit(args[0], w13, *args[2:], runner_backend=backend).sum())(
      args[1])
  np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_weights_in_dead_slots_do_not_leak(backend, rng):
  """Empty (-1) slots contribute nothing, even when their weight is garbage (NaN)."""
  case = _case_expert_map(rng)
  case.topk_ids[3:, 1] = -1
  tw = case.topk_weights.copy()
  dead = case.topk_ids < 0
  if backend != "reference":  # the fast paths also mask non-local slots' weights
    dead |= case.expert_map[np.maximum(case.topk_ids, 0)] < 0
  tw[dead] = np.nan
  out, ref = run(Case(**{**case.__dict__, "topk_weights": tw}), backend)
  ref = onp.fused_moe(case.x, case.w13, case.w2, np.where(dead, 0.0, tw), case.topk_ids,
                      expert_map=case.expert_map)
  assert np.isfinite(out).all()
  onp.assert_rel_close(out, ref, 1e-5, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_and_mixed_dtypes(backend, rng):
  case = make_case(rng, *STD, bias=True)
  out, ref = run(case, backend, jnp.float16)
  onp.assert_rel_close(out, ref, 5e-3, f"{backend}/f16")
  # bf16 activations with f32 weights: computed in f32, returned in bf16.
  x = jnp.asarray(case.x, jnp.bfloat16)
  out = jmoe.fused_moe(x, jnp.asarray(case.w13, jnp.float32), jnp.asarray(case.w2, jnp.float32),
                       jnp.asarray(case.topk_weights), jnp.asarray(case.topk_ids),
                       w13_bias=jnp.asarray(case.w13_bias, jnp.float32),
                       w2_bias=jnp.asarray(case.w2_bias, jnp.float32), runner_backend=backend)
  assert out.dtype == jnp.bfloat16
  ref = onp.fused_moe(np.asarray(x.astype(jnp.float32)), case.w13, case.w2, case.topk_weights,
                      case.topk_ids, w13_bias=case.w13_bias, w2_bias=case.w2_bias)
  onp.assert_rel_close(np.asarray(out.astype(jnp.float32)), ref, 1e-2, f"{backend}/mixed")


@given(data=st.data())
def test_fused_moe_values_hypothesis(data):
  """Random values, empty slots and expert maps on the standard shape (jit caches reused)."""
  backend = data.draw(st.sampled_from(BACKENDS), label="backend")
  activation = data.draw(st.sampled_from(["silu", "swigluoai", "relu2_no_mul"]), label="act")
  seed = data.draw(st.integers(0, 2 ** 31), label="seed")
  x_scale = data.draw(st.floats(0.01, 8.0), label="x_scale")
  p_empty = data.draw(st.sampled_from([0.0, 0.3, 1.0]), label="p_empty")
  n_global = data.draw(st.sampled_from([5, 9]), label="global_experts")
  rng = np.random.default_rng(seed)
  case = make_case(rng, *STD, activation=activation, bias=True, x_scale=x_scale)
  local = rng.permutation(n_global)[:5]
  emap = -np.ones(n_global, np.int32)
  emap[local] = rng.permutation(5)
  case.expert_map = emap
  ids = np.stack([rng.permutation(n_global)[:2] for _ in range(STD[0])]).astype(np.int32)
  case.topk_ids = np.where(rng.uniform(size=ids.shape) < p_empty, -1, ids).astype(np.int32)
  out, ref = run(case, backend, use_jit=True)
  if np.linalg.norm(ref) == 0:
    np.testing.assert_array_equal(out, 0.0)
  else:
    onp.assert_rel_close(out, ref, 1e-5, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_routing_arrays_closed_over_by_jit(backend, rng):
  """An expert_map / topk arrays held as NumPy constants inside a jitted function."""
  case = _case_expert_map(rng)
  emap = case.expert_map.astype(np.int64)
  tw, ids = case.topk_weights, case.topk_ids
  w13, w2 = jnp.asarray(case.w13, jnp.float32), jnp.asarray(case.w2, jnp.float32)
  f = jax.jit(lambda x: jmoe.fused_moe(x, w13, w2, tw, ids, expert_map=emap,
                                       runner_backend=backend))
  out = np.asarray(f(jnp.asarray(case.x, jnp.float32)), np.float64)
  ref = onp.fused_moe(case.x, case.w13, case.w2, tw, ids, expert_map=emap)
  onp.assert_rel_close(out, ref, 1e-5, backend)
