"""jmoe.select_experts against the float64 NumPy oracle: every router variant, hypothesis over
shapes and values, custom routing functions, output dtypes."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jmoe
import oracle_np as onp

_STATIC = ("top_k", "scoring_func", "renormalize", "num_expert_group", "topk_group",
           "routed_scaling_factor")
select_jit = jax.jit(jmoe.select_experts, static_argnames=_STATIC)


def _route(logits, top_k, *, use_jit=False, **kw):
  fn = select_jit if use_jit else jmoe.select_experts
  w, ids = fn(None, jnp.asarray(logits, jnp.float32), top_k, **kw)
  assert w.dtype == jnp.float32 and ids.dtype == jnp.int32
  assert w.shape == ids.shape == (logits.shape[0], top_k)
  return np.asarray(w), np.asarray(ids)


def _check(logits, top_k, *, use_jit=False, bias=None, **kw):
  w, ids = _route(logits, top_k, use_jit=use_jit,
                  e_score_correction_bias=None if bias is None else jnp.asarray(bias, jnp.float32),
                  **kw)
  rw, rids, margin = onp.select_experts(np.float32(logits), top_k, e_score_correction_bias=bias,
                                        **kw)
  onp.assert_routing_matches(w, ids, rw, rids, margin)
  return w, ids


# (T, E, num_expert_group, topk_group): a small fixed menu so jit compilations are reused.
SHAPES = [(1, 4, None, None), (5, 8, None, None), (16, 16, 4, 2), (6, 12, 3, 1), (9, 32, 8, 4),
          (4, 6, 6, 3), (3, 8, 1, 1), (7, 10, 5, 5)]


@given(data=st.data())
def test_select_experts_matches_oracle(data):
  t, e, g, tg = data.draw(st.sampled_from(SHAPES), label="shape")
  max_k = e if g is None else tg * (e // g)
  top_k = data.draw(st.integers(1, min(max_k, 8)), label="top_k")
  scoring = data.draw(st.sampled_from(["softmax", "sigmoid"]), label="scoring")
  renorm = data.draw(st.booleans(), label="renormalize")
  use_bias = data.draw(st.booleans(), label="bias")
  rsf = data.draw(st.sampled_from([1.0, 2.5, 0.5]), label="rsf")
  scale = data.draw(st.floats(0.05, 4.0), label="scale")
  seed = data.draw(st.integers(0, 2 ** 31), label="seed")
  rng = np.random.default_rng(seed)
  logits = (scale * rng.standard_normal((t, e))).astype(np.float32)
  bias = rng.uniform(-0.2, 0.2, e).astype(np.float32) if use_bias else None
  w, _ = _check(logits, top_k, use_jit=False, bias=bias, scoring_func=scoring, renormalize=renorm,
                num_expert_group=g, topk_group=tg, routed_scaling_factor=rsf)
  if renorm:
    np.testing.assert_allclose(w.sum(-1), rsf, rtol=1e-5)
  assert (w > 0).all()


VARIANTS = {
    "softmax_renorm": dict(scoring_func="softmax", renormalize=True),
    "softmax_plain": dict(scoring_func="softmax", renormalize=False),
    "sigmoid_renorm": dict(scoring_func="sigmoid", renormalize=True),  # Llama 4 style + renorm
    "sigmoid_plain": dict(scoring_func="sigmoid", renormalize=False),
    "grouped_max": dict(scoring_func="softmax", renormalize=True, num_expert_group=4,
                        topk_group=2),
    "grouped_bias_deepseek": dict(scoring_func="sigmoid", renormalize=True, num_expert_group=4,
                                  topk_group=2, bias=True, routed_scaling_factor=2.5),
    "bias_no_groups": dict(scoring_func="sigmoid", renormalize=False, bias=True),
    "scaled_softmax": dict(scoring_func="softmax", renormalize=True, routed_scaling_factor=16.0),
}


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_router_variant(name, use_jit, rng):
  kw = dict(VARIANTS[name])
  bias = rng.uniform(0, 0.1, 16).astype(np.float32) if kw.pop("bias", False) else None
  logits = rng.standard_normal((8, 16)).astype(np.float32)
  _check(logits, 4, use_jit=use_jit, bias=bias, **kw)


def test_top_k_equals_num_experts(rng):
  logits = rng.standard_normal((3, 5)).astype(np.float32)
  w, ids = _check(logits, 5)
  assert all(sorted(r) == list(range(5)) for r in ids.tolist())
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_single_expert():
  w, ids = _route(np.array([[0.3], [-2.0]], np.float32), 1, scoring_func="sigmoid",
                  renormalize=False)
  np.testing.assert_array_equal(ids, [[0], [0]])
  np.testing.assert_allclose(w[:, 0], onp.sigmoid([0.3, -2.0]), rtol=1e-6)


def test_group_score_is_top2_sum_with_bias_and_max_without():
  """2 groups of 3, keep 1 group. Selection scores: group A = [0.9, 0, 0], group B =
  [0.5, 0.5, 0]. By the top-2 sum (bias given) B wins (1.0 > 0.9); by the max A wins."""
  logits = np.zeros((1, 6), np.float32)  # sigmoid scores all 0.5
  bias = np.array([0.4, -0.5, -0.5, 0.0, 0.0, -0.5], np.float32)
  w, ids = _route(logits, 2, scoring_func="sigmoid", num_expert_group=2, topk_group=1,
                  e_score_correction_bias=jnp.asarray(bias))
  assert sorted(ids[0].tolist()) == [3, 4]
  np.testing.assert_allclose(w, 0.5, rtol=1e-6)  # unbiased scores 0.5, 0.5 renormalized
  # Without a bias the group score is the max: shape the scores themselves the same way.
  logits = np.log(np.array([[0.9, 1e-3, 1e-3, 0.5, 0.5, 1e-3]], np.float32))
  w, ids = _route(logits, 2, scoring_func="softmax", num_expert_group=2, topk_group=1,
                  renormalize=False)
  assert sorted(ids[0].tolist()) == [0, 1]  # only group A's experts may be chosen
  np.testing.assert_allclose(np.sort(w[0])[::-1], onp.softmax(logits)[0, [0, 1]], rtol=1e-5)


def test_bias_selects_but_does_not_weight():
  logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
  bias = jnp.asarray([0.0, 0.0, 0.0, 10.0])
  w, ids = _route(logits, 2, scoring_func="sigmoid", renormalize=False,
                  e_score_correction_bias=bias)
  assert sorted(ids[0].tolist()) == [0, 3]
  got = dict(zip(ids[0].tolist(), w[0].tolist()))
  np.testing.assert_allclose([got[0], got[3]], onp.sigmoid([2.0, -1.0]), rtol=1e-6)


def test_scaling_applied_after_renormalize(rng):
  logits = rng.standard_normal((4, 8)).astype(np.float32)
  w1, ids1 = _route(logits, 3)
  w2, ids2 = _route(logits, 3, routed_scaling_factor=2.5)
  np.testing.assert_array_equal(ids1, ids2)
  np.testing.assert_allclose(w2, 2.5 * w1, rtol=1e-6)
  np.testing.assert_allclose(w2.sum(-1), 2.5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_output_dtypes(dtype, use_jit, rng):
  logits = jnp.asarray(rng.standard_normal((5, 8)), dtype)
  fn = select_jit if use_jit else jmoe.select_experts
  w, ids = fn(None, logits, 2, scoring_func="sigmoid")
  assert w.dtype == jnp.float32 and ids.dtype == jnp.int32
  rw, rids, margin = onp.select_experts(np.asarray(logits.astype(jnp.float32)), 2,
                                        scoring_func="sigmoid")
  onp.assert_routing_matches(w, ids, rw, rids, margin)


def test_numpy_scalar_arguments(rng):
  """Values read from configs or numpy (np.int64 top_k, np.float32 scaling) are accepted."""
  logits = rng.standard_normal((3, 8)).astype(np.float32)
  w, ids = jmoe.select_experts(None, jnp.asarray(logits), np.int64(2),
                               routed_scaling_factor=np.float32(2.5))
  rw, rids, margin = onp.select_experts(logits, 2, routed_scaling_factor=2.5)
  onp.assert_routing_matches(w, ids, rw, rids, margin)


# ---------------------------------------------------------------------------------------------
# custom routing functions


def _llama4_router(hidden_states, router_logits, top_k, renormalize):
  """Llama 4: top-k on the raw logits, sigmoid of the chosen ones."""
  del hidden_states, renormalize
  vals, ids = jax.lax.top_k(router_logits, top_k)
  return jax.nn.sigmoid(vals.astype(jnp.float32)), ids


def test_custom_routing_function(rng):
  x = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)
  logits = rng.standard_normal((4, 8)).astype(np.float32)
  seen = {}

  def fn(hs, rl, k, renorm):
    seen.update(hs=hs, rl=rl, k=k, renorm=renorm)
    return _llama4_router(hs, rl, k, renorm)

  w, ids = jmoe.select_experts(x, jnp.asarray(logits), 1, renormalize=False,
                               custom_routing_function=fn)
  assert seen["hs"] is x and seen["k"] == 1 and seen["renorm"] is False
  assert w.dtype == jnp.float32 and ids.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(ids)[:, 0], logits.argmax(-1))
  np.testing.assert_allclose(np.asarray(w)[:, 0], onp.sigmoid(logits.max(-1)), rtol=1e-6)


def test_custom_routing_function_scaled_and_cast(rng):
  """The returned weights are cast to f32 / ids to i32, and routed_scaling_factor applies."""
  logits = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)

  def fn(hs, rl, k, renorm):
    w, ids = jax.lax.top_k(rl, k)
    return jax.nn.softmax(w).astype(jnp.bfloat16), ids.astype(jnp.int16)

  w, ids = jmoe.select_experts(None, logits, 2, custom_routing_function=fn,
                               routed_scaling_factor=3.0)
  assert w.dtype == jnp.float32 and ids.dtype == jnp.int32
  np.testing.assert_allclose(np.asarray(w).sum(-1), 3.0, rtol=1e-2)


def test_custom_routing_function_jit(rng):
  logits = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
  f = jax.jit(functools.partial(jmoe.select_experts, top_k=1,
                                custom_routing_function=_llama4_router))
  w, ids = f(None, logits)
  np.testing.assert_array_equal(np.asarray(ids)[:, 0], np.asarray(logits).argmax(-1))


def test_custom_routing_function_bad_shape(rng):
  logits = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)

  def fn(hs, rl, k, renorm):
    return jnp.ones((3, k + 1)), jnp.zeros((3, k + 1), jnp.int32)

  with pytest.raises(ValueError, match="custom_routing_function"):
    jmoe.select_experts(None, logits, 2, custom_routing_function=fn)
