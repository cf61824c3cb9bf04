"""jax.grad of fused_moe on the XLA paths against the reference backend's grad and against
central finite differences of the float64 NumPy oracle."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
import oracle_np as onp

T, H, N, E, K = 4, 5, 3, 4, 2
ARGNAMES = ("x", "w13", "w2", "w13_bias", "w2_bias", "topk_weights")


def _problem(rng, activation="silu", k=K, empty=False):
  w = onp.make_weights(rng, E, H, N, gated=onp.is_gated(activation), bias=True)
  tw, ids = onp.random_topk(rng, T, E, k)
  if empty:
    ids[1, -1] = -1
    ids[2, :] = -1 if k == 1 else ids[2, :]
  p = dict(x=rng.standard_normal((T, H)), topk_weights=tw.astype(np.float64), **w)
  cot = rng.standard_normal((T, H))  # the loss is <fused_moe(...), cot>
  return p, ids, cot


def _loss_fn(ids, cot, backend, activation, apply_on_input=False, expert_map=None):
  ids = jnp.asarray(ids)
  cot = jnp.asarray(cot, jnp.float32)

  def loss(params):
    out = jmoe.fused_moe(params["x"], params["w13"], params["w2"], params["topk_weights"], ids,
                         w13_bias=params["w13_bias"], w2_bias=params["w2_bias"],
                         activation=activation, runner_backend=backend, expert_map=expert_map,
                         apply_router_weight_on_input=apply_on_input)
    return jnp.sum(out.astype(jnp.float32) * cot)
  return loss


def _oracle_loss(p, ids, cot, activation, apply_on_input=False, expert_map=None):
  out = onp.fused_moe(p["x"], p["w13"], p["w2"], p["topk_weights"], ids, activation=activation,
                      w13_bias=p["w13_bias"], w2_bias=p["w2_bias"], expert_map=expert_map,
                      apply_router_weight_on_input=apply_on_input)
  return float(np.sum(out * cot))


def _fd_directional(p, name, direction, f, eps=1e-5):
  """Central difference of f along `direction` in parameter `name` (float64)."""
  plus = dict(p, **{name: p[name] + eps * direction})
  minus = dict(p, **{name: p[name] - eps * direction})
  return (f(plus) - f(minus)) / (2 * eps)


def _to_jax(p, dtype=jnp.float32):
  return {n: jnp.asarray(v, dtype) for n, v in p.items()}


def _check_against_fd(grads, p, f, rng, what, n_dirs=3, tol=2e-4):
  for name in ARGNAMES:
    g = np.asarray(grads[name], np.float64)
    for _ in range(n_dirs):
      d = rng.standard_normal(p[name].shape)
      want = _fd_directional(p, name, d, f)
      got = float(np.sum(g * d))
      scale = max(abs(want), np.linalg.norm(g) * np.linalg.norm(d) * 1e-3, 1e-6)
      assert abs(got - want) <= tol * scale, (
          f"{what}: d/d{name} along a random direction: jax {got:.6g} vs finite differences "
          f"{want:.6g}")


@pytest.mark.parametrize("activation", ["silu", "swigluoai", "gelu_no_mul"])
@pytest.mark.parametrize("backend", ["reference", "xla", "xla_batched"])
def test_grad_matches_finite_differences(backend, activation, rng):
  p, ids, cot = _problem(rng, activation, empty=True)
  loss = _loss_fn(ids, cot, backend, activation)
  grads = jax.grad(loss)(_to_jax(p))
  f = functools.partial(_oracle_loss, ids=ids, cot=cot, activation=activation)
  _check_against_fd(grads, p, f, rng, f"{backend}/{activation}")


@pytest.mark.parametrize("backend", ["xla", "xla_batched"])
def test_grad_matches_reference_backend_jit(backend, rng):
  p, ids, cot = _problem(rng, "gelu_tanh", empty=True)
  ref = jax.jit(jax.grad(_loss_fn(ids, cot, "reference", "gelu_tanh")))(_to_jax(p))
  got = jax.jit(jax.value_and_grad(_loss_fn(ids, cot, backend, "gelu_tanh")))(_to_jax(p))[1]
  for name in ARGNAMES:
    onp.assert_rel_close(np.asarray(got[name]), np.asarray(ref[name]), 1e-5,
                         f"{backend} d/d{name}")


@pytest.mark.parametrize("backend", ["xla", "xla_batched"])
def test_grad_with_expert_map(backend, rng):
  """Non-local experts' weights get zero gradient; local ones match finite differences."""
  p, _, cot = _problem(rng)
  emap = np.array([-1, 2, 0, -1, 1, 3], np.int32)  # 6 global experts, all 4 local ones mapped
  ids = np.array([[1, 0], [4, 3], [2, 3], [1, 5]], np.int32)
  loss = _loss_fn(ids, cot, backend, "silu", expert_map=jnp.asarray(emap))
  grads = jax.grad(loss)(_to_jax(p))
  # Slot 1 of tokens 0-2 (global 0 and 3) is not local.
  f = functools.partial(_oracle_loss, ids=ids, cot=cot, activation="silu", expert_map=emap)
  _check_against_fd(grads, p, f, rng, backend)
  tw_grad = np.asarray(grads["topk_weights"])
  assert tw_grad[0, 1] == 0 and tw_grad[1, 1] == 0 and tw_grad[2, 1] == 0  # non-local slots


@pytest.mark.parametrize("backend", ["xla", "xla_batched"])
def test_grad_router_weight_on_input(backend, rng):
  p, ids, cot = _problem(rng, k=1)
  loss = _loss_fn(ids, cot, backend, "silu", apply_on_input=True)
  grads = jax.grad(loss)(_to_jax(p))
  f = functools.partial(_oracle_loss, ids=ids, cot=cot, activation="silu", apply_on_input=True)
  _check_against_fd(grads, p, f, rng, backend)


def test_grad_unused_expert_is_zero(rng):
  p, ids, cot = _problem(rng)
  ids = np.where(ids == 3, (ids + 1) % 3, ids)  # nobody routes to expert 3
  ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 3, ids[:, 1])
  for backend in ("xla", "xla_batched"):
    g = jax.grad(_loss_fn(ids, cot, backend, "silu"))(_to_jax(p))
    for name in ("w13", "w2", "w13_bias", "w2_bias"):
      assert np.all(np.asarray(g[name])[3] == 0), (backend, name)
      assert np.all(np.isfinite(np.asarray(g[name])))


E2E_CONFIGS = {
    "mixtral": dict(num_experts=E, top_k=K),
    "deepseek_fused_shared": dict(num_experts=8, top_k=K, scoring_func="sigmoid",
                                  num_expert_group=4, topk_group=2, use_correction_bias=True,
                                  routed_scaling_factor=2.5, num_shared_experts=1,
                                  fuse_shared_experts=True),
}


@pytest.mark.parametrize("name", list(E2E_CONFIGS))
def test_grad_end_to_end_through_router(name, rng):
  """Training use: d loss / d (router weights, expert weights, x) through select_experts."""
  cfg = jmoe.MoEConfig(hidden_size=H, intermediate_size=N, dtype="float32", **E2E_CONFIGS[name])
  params = jmoe.MoEParams(**{n: jnp.asarray(v, jnp.float32)
                             for n, v in onp.make_block_params(rng, cfg).items()})
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)

  def loss(params, x, backend):
    return jnp.sum(jmoe.moe_block(x, params, cfg, runner_backend=backend) ** 2)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
  ref = grad(params, x, "reference")
  for backend in ("xla", "xla_batched"):
    got = grad(params, x, backend)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      onp.assert_rel_close(np.asarray(a), np.asarray(b), 1e-5, backend)
  assert np.linalg.norm(np.asarray(ref[0].router_w)) > 0  # the router learns
  if cfg.use_correction_bias:  # the bias only selects: no gradient reaches it
    np.testing.assert_array_equal(ref[0].correction_bias, 0.0)


def test_grad_bf16_close_to_f32(rng):
  p, ids, cot = _problem(rng)
  g32 = jax.grad(_loss_fn(ids, cot, "xla", "silu"))(_to_jax(p))
  g16 = jax.grad(_loss_fn(ids, cot, "xla", "silu"))(_to_jax(p, jnp.bfloat16))
  for name in ("x", "w13", "w2"):
    assert g16[name].dtype == jnp.bfloat16
    onp.assert_rel_close(np.asarray(g16[name].astype(jnp.float32)), np.asarray(g32[name]),
                         5e-2, name)
