"""The flax.nnx MoE layer: same values as the functional block, trainable under nnx.jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmoe
from jmoe.layers import MoE


@pytest.mark.parametrize("cfg", [
    jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=12),
    jmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=6,
                   scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                   use_correction_bias=True, routed_scaling_factor=2.5, num_shared_experts=1),
], ids=["mixtral-like", "deepseek-like"])
def test_layer_matches_block_and_trains(cfg):
  layer = MoE(cfg, rngs=nnx.Rngs(0), runner_backend="xla")
  x = jax.random.normal(jax.random.key(3), (2, 5, cfg.hidden_size))
  out = layer(x)
  ref = jmoe.moe_block(x.reshape(-1, cfg.hidden_size), layer.params(), cfg,
                       runner_backend="reference").reshape(x.shape)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)

  @nnx.jit
  def loss_and_grad(m, x):
    return nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)

  loss, grads = loss_and_grad(layer, x)
  assert np.isfinite(float(loss))
  g = nnx.state(grads, nnx.Param)
  assert float(jnp.abs(g["w13"][...]).sum()) > 0
  assert float(jnp.abs(g["router_w"][...]).sum()) > 0
  if cfg.use_correction_bias:  # not a Param: the optimizer must not see it
    assert "correction_bias" not in g
