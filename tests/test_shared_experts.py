"""Shared experts: the separate dense MLP (with and without the Qwen2-MoE sigmoid gate) against
the float64 oracle, and the fused-slot path (shared experts as always-chosen top-k slots)
against the separate one."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
import oracle_np as onp
from jmoe.shared import fuse_shared_slots, shared_expert_mlp, split_shared_weights
from jmoe.kernels.activations import Activation

H, N, T = 12, 6, 7
# Whole blocks run jitted (one compile per config: cheaper than eager op-by-op on CPU).
block_jit = jax.jit(jmoe.moe_block, static_argnames=("config", "runner_backend"))


def _params(rng, cfg, dtype=jnp.float32):
  return jmoe.MoEParams(**{n: jnp.asarray(v, dtype if n != "correction_bias" else jnp.float32)
                           for n, v in onp.make_block_params(rng, cfg).items()})


def _np(a):
  return None if a is None else np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _oracle_block(x, params, cfg):
  p = jax.tree.map(_np, params)
  return onp.moe_block(_np(x), p, top_k=cfg.top_k, activation=cfg.activation,
                       scoring_func=cfg.scoring_func, renormalize=cfg.renormalize,
                       num_expert_group=cfg.num_expert_group, topk_group=cfg.topk_group,
                       routed_scaling_factor=cfg.routed_scaling_factor)


# ---------------------------------------------------------------------------------------------
# the separate path


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("gate", [False, True], ids=["plain", "sigmoid_gate"])
@pytest.mark.parametrize("activation", ["silu", "gelu_no_mul"])
def test_shared_expert_mlp_matches_oracle(activation, gate, dtype, tol, rng):
  gated = onp.is_gated(activation)
  ns = 2 * N
  x = jnp.asarray(rng.standard_normal((T, H)), dtype)
  w13 = jnp.asarray(rng.standard_normal((H, 2 * ns if gated else ns)) / np.sqrt(H), dtype)
  w2 = jnp.asarray(rng.standard_normal((ns, H)) / np.sqrt(ns), dtype)
  g = jnp.asarray(rng.standard_normal(H), dtype) if gate else None
  out = shared_expert_mlp(x, w13, w2, Activation(activation), gate=g)
  assert out.dtype == dtype and out.shape == (T, H)
  ref = onp.shared_experts(_np(x), _np(w13), _np(w2), activation, _np(g))
  onp.assert_rel_close(_np(out), ref, tol)


def test_shared_gate_accepts_column_vector(rng):
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  w13 = jnp.asarray(rng.standard_normal((H, 2 * N)), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
  g = jnp.asarray(rng.standard_normal(H), jnp.float32)
  a = shared_expert_mlp(x, w13, w2, Activation("silu"), gate=g)
  b = shared_expert_mlp(x, w13, w2, Activation("silu"), gate=g[:, None])
  np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "xla", "xla_batched"])
def test_qwen2_moe_block_matches_oracle(backend, rng):
  """Qwen2-MoE: softmax top-k without renormalize, a shared expert with a sigmoid gate."""
  cfg = jmoe.MoEConfig(num_experts=6, top_k=2, hidden_size=H, intermediate_size=N,
                       renormalize=False, num_shared_experts=1, shared_intermediate_size=10,
                       shared_expert_gate=True, dtype="float32")
  params = _params(rng, cfg)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  out = block_jit(x, params, config=cfg, runner_backend=backend)
  onp.assert_rel_close(_np(out), _oracle_block(x, params, cfg), 1e-5, backend)


# ---------------------------------------------------------------------------------------------
# the fused-slot path equals the separate path


def _deepseek(num_shared, fuse, **kw):
  base = dict(num_experts=8, top_k=2, hidden_size=H, intermediate_size=N, scoring_func="sigmoid",
              renormalize=True, num_expert_group=4, topk_group=2, use_correction_bias=True,
              routed_scaling_factor=2.5, num_shared_experts=num_shared, fuse_shared_experts=fuse,
              dtype="float32")
  base.update(kw)
  return jmoe.MoEConfig(**base)


@pytest.mark.parametrize("backend", ["reference", "xla", "xla_batched"])
@pytest.mark.parametrize("num_shared", [1, 2])
def test_fused_slots_equal_separate_path_deepseek(num_shared, backend, rng):
  sep = _deepseek(num_shared, False)
  fused = _deepseek(num_shared, True)
  params = _params(rng, sep)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  out_sep = block_jit(x, params, config=sep, runner_backend=backend)
  out_fused = block_jit(x, params, config=fused, runner_backend=backend)
  onp.assert_rel_close(_np(out_fused), _np(out_sep), 1e-5, "fused vs separate")
  onp.assert_rel_close(_np(out_sep), _oracle_block(x, params, sep), 1e-5, "separate vs oracle")


def test_fused_slots_jit_bf16_and_expert_bias(rng):
  """gpt-oss-like (swigluoai, expert biases) plus a shared expert: the fused path appends zero
  biases for the shared experts."""
  kw = dict(activation="swigluoai", expert_bias=True, router_bias=True, scoring_func="softmax",
            num_expert_group=None, topk_group=None, use_correction_bias=False,
            routed_scaling_factor=1.0)
  sep, fused = _deepseek(2, False, **kw), _deepseek(2, True, **kw)
  params = _params(rng, sep, jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
  out_sep = block_jit(x, params, config=sep, runner_backend="xla")
  out_fused = block_jit(x, params, config=fused, runner_backend="xla")
  assert out_fused.dtype == jnp.bfloat16
  onp.assert_rel_close(_np(out_fused), _np(out_sep), 2e-2)
  onp.assert_rel_close(_np(out_sep), _oracle_block(x, params, sep), 2e-2)


def test_split_shared_weights_is_exact(rng):
  s = 3
  for gated, act in ((True, "silu"), (False, "relu2_no_mul")):
    w13 = rng.standard_normal((H, (2 if gated else 1) * s * N))
    w2 = rng.standard_normal((s * N, H))
    x = rng.standard_normal((T, H))
    w13_s, w2_s = split_shared_weights(jnp.asarray(w13), jnp.asarray(w2), s, N, gated)
    assert w13_s.shape == (s, H, (2 if gated else 1) * N) and w2_s.shape == (s, N, H)
    parts = sum(onp.expert_mlp(x, np.asarray(w13_s[i]), np.asarray(w2_s[i]), act)
                for i in range(s))
    onp.assert_rel_close(parts, onp.shared_experts(x, w13, w2, act), 1e-6, act)
  with pytest.raises(ValueError, match="shared w2"):
    split_shared_weights(jnp.asarray(w13), jnp.asarray(w2[:-1]), s, N, False)


def test_fuse_shared_slots_layout():
  tw = jnp.asarray([[0.7, 0.3], [0.6, 0.4]], jnp.float32)
  ids = jnp.asarray([[1, 4], [0, 2]], jnp.int32)
  w, i = fuse_shared_slots(tw, ids, 5, 2, 2.5)
  np.testing.assert_array_equal(i, [[1, 4, 5, 6], [0, 2, 5, 6]])
  np.testing.assert_allclose(w, [[0.7, 0.3, 1, 1], [0.6, 0.4, 1, 1]])
  assert w.dtype == tw.dtype and i.dtype == ids.dtype
  w, i = fuse_shared_slots(tw, ids, 5, 1, 2.5, weights_include_scaling=False)
  np.testing.assert_allclose(w[:, 2], 1 / 2.5, rtol=1e-7)
  np.testing.assert_array_equal(i[:, 2], [5, 5])


def test_fuse_shared_slots_seed_convention(rng):
  """Seed 004's convention: routed weights without the routed scaling factor, shared slots of
  weight 1/rsf, the whole output multiplied by rsf afterwards: same math as jmoe's."""
  rsf, e, s = 2.5, 8, 1
  cfg = _deepseek(s, False)
  params = _params(rng, cfg)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)

  @jax.jit
  def seed_style(x, params):
    logits = jmoe.router_logits(x, params)
    w_unscaled, ids = jmoe.select_experts(
        x, logits, 2, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
        e_score_correction_bias=params.correction_bias, routed_scaling_factor=1.0)
    s13, s2 = split_shared_weights(params.shared_w13, params.shared_w2, s, N)
    w13 = jnp.concatenate([params.w13, s13])
    w2 = jnp.concatenate([params.w2, s2])
    fw, fids = fuse_shared_slots(w_unscaled, ids, e, s, rsf, weights_include_scaling=False)
    return rsf * jmoe.fused_moe(x, w13, w2, fw, fids, runner_backend="xla")

  out = seed_style(x, params)
  onp.assert_rel_close(_np(out), _np(block_jit(x, params, config=cfg, runner_backend="xla")),
                       1e-5)
  onp.assert_rel_close(_np(out), _oracle_block(x, params, cfg), 1e-5)


def test_fused_slots_with_only_one_bias(rng):
  """A model with a GEMM1 bias but no GEMM2 bias (or the reverse) fuses its shared experts too."""
  sep, fused = _deepseek(1, False), _deepseek(1, True)
  params = _params(rng, sep)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  for which in ("w13_bias", "w2_bias"):
    shape = (8, 2 * N) if which == "w13_bias" else (8, H)
    p = dataclasses.replace(params, **{which: jnp.asarray(rng.standard_normal(shape),
                                                          jnp.float32)})
    onp.assert_rel_close(_np(block_jit(x, p, config=fused, runner_backend="xla")),
                         _np(block_jit(x, p, config=sep, runner_backend="xla")), 1e-5, which)


def test_params_fused_at_load_time_equal_per_call_fusion(rng):
  """fuse_shared_params once, then moe_block skips the per-call weight concatenation."""
  from jmoe.block import fuse_shared_params

  cfg = _deepseek(2, True)
  params = _params(rng, cfg)
  fused_params = fuse_shared_params(params, cfg)
  assert fused_params.w13.shape[0] == cfg.num_experts + 2 and fused_params.shared_w13 is None
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  out_load = block_jit(x, fused_params, config=cfg, runner_backend="xla")
  out_call = block_jit(x, params, config=cfg, runner_backend="xla")
  onp.assert_rel_close(_np(out_load), _np(out_call), 1e-6, "fused at load vs per call")
  with pytest.raises(ValueError, match="already fused"):
    fuse_shared_params(fused_params, cfg)
  with pytest.raises(ValueError, match="fuse_shared_experts=True"):
    fuse_shared_params(params, _deepseek(2, False))
