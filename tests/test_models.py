"""jmoe.models: the reference MoE transformer and its tiny family presets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmoe
from jmoe.layers import MoE
from jmoe.models import (MoETransformer, PRESET_FAMILIES, TransformerConfig, rotary,
                         tiny_preset)
from jmoe.sharding.mesh import make_parallel


def test_rotary_matches_float64_and_is_relative():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(1, 5, 2, 8)).astype(np.float32)
  pos = np.arange(5)[None] + 3
  out = np.asarray(rotary(jnp.asarray(x), jnp.asarray(pos), 100.0), np.float64)
  d = 8
  inv = 1.0 / 100.0 ** (np.arange(0, d, 2) / d)
  ang = pos[0][:, None] * inv  # [S, d/2]
  x1, x2 = x[..., :4].astype(np.float64), x[..., 4:].astype(np.float64)
  c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
  np.testing.assert_allclose(out, np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1),
                             rtol=1e-5, atol=1e-5)
  q, k = jnp.asarray(x[:, :1]), jnp.asarray(x[:, 1:2])  # <rot(q, m), rot(k, n)> = f(m - n)
  dots = [float(jnp.sum(rotary(q, jnp.array([[m]]), 100.0) * rotary(k, jnp.array([[n]]), 100.0)))
          for m, n in ((7, 2), (12, 7))]
  np.testing.assert_allclose(dots[0], dots[1], rtol=1e-4)


# ~20 s a family (deepseek-v3 crosses the most features: grouped sigmoid routing, the correction
# bias, a shared expert, a dense first layer): the slow tier; the lean tier trains the model in
# test_train_example
@pytest.mark.slow
@pytest.mark.parametrize("family", PRESET_FAMILIES)
def test_presets_are_causal_and_train(family):
  cfg = tiny_preset(family, vocab_size=64, hidden_size=32)
  model = MoETransformer(cfg, rngs=nnx.Rngs(0), runner_backend="xla")
  moes = model.moe_layers()
  assert len(moes) == cfg.num_moe_layers and all(isinstance(m, MoE) for m in moes)
  if family == "deepseek-v3":
    assert not model.layers[0].is_moe and moes[0].shared_w13 is not None
    assert moes[0].correction_bias is not None
  if family == "qwen3-moe":
    assert model.layers[0].attn.q_norm is not None
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
  logits, aux = model(tokens)
  assert logits.shape == (2, 12, 64)
  assert aux["expert_load"].shape == (cfg.num_moe_layers, cfg.moe.num_experts)
  assert int(aux["expert_load"].sum()) == cfg.num_moe_layers * 24 * cfg.moe.top_k
  later = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % 64)  # changing the future ...
  np.testing.assert_allclose(model(later)[0][:, :8], logits[:, :8], rtol=1e-5, atol=1e-5)

  @nnx.jit
  def grads(m, t):
    def loss(m):
      lg, aux = m(t[:, :-1])
      ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(lg), t[:, 1:, None], -1))
      return ce + 0.01 * aux["load_balancing_loss"]
    return nnx.grad(loss)(m)

  g = grads(model, tokens)
  leaves = jax.tree.leaves(nnx.state(g, nnx.Param))
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in leaves)
  assert float(jnp.abs(g["embed"]["embedding"][...]).sum()) > 0


def test_config_errors_name_the_field():
  moe = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
  with pytest.raises(ValueError, match="moe.hidden_size"):
    TransformerConfig(64, 2, 16, 4, 2, moe)
  with pytest.raises(ValueError, match="num_kv_heads"):
    TransformerConfig(64, 2, 32, 4, 3, moe)
  with pytest.raises(ValueError, match="first_dense_layers"):
    TransformerConfig(64, 2, 32, 4, 2, moe, first_dense_layers=3)
  with pytest.raises(ValueError, match="family"):
    tiny_preset("llama")
  with pytest.raises(ValueError, match="tokens"):
    MoETransformer(tiny_preset("mixtral", vocab_size=8, hidden_size=16), rngs=nnx.Rngs(0))(
        jnp.ones((2, 3)))


def test_expert_parallel_model_matches_one_device():
  cfg = tiny_preset("mixtral", vocab_size=64, hidden_size=32)
  par = make_parallel(data=2, expert=4)
  one = MoETransformer(cfg, rngs=nnx.Rngs(0))
  ep = MoETransformer(cfg, rngs=nnx.Rngs(0), parallel=par, a2a_backend="ragged_a2a",
                      runner_backend="xla")
  tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, 64)
  fwd = nnx.jit(lambda m, t: m(t))
  (l1, a1), (l2, a2) = fwd(one, tokens), fwd(ep, tokens)
  np.testing.assert_allclose(l1, l2, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(a1["expert_load"], a2["expert_load"])
