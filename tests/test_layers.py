"""The flax.nnx MoE layer: same values as the functional block, trainable under nnx.jit."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmoe
from jmoe.layers import MoE


@pytest.mark.parametrize("cfg", [
    pytest.param(jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=12),
                 marks=pytest.mark.slow),  # (deepseek-like's options are the superset)
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


# ---------------------------------------------------------------------------------------------
# issue 27: routing options, dtypes, initializers, quantized experts, sharding metadata, EP

import oracle_np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jmoe.layers import QuantizedWeight, losses  # noqa: E402
from jmoe.sharding.mesh import make_parallel  # noqa: E402

def _spec(v):
  """A PartitionSpec out of get_partition_spec's Variable (flax 0.12: get_value)."""
  return v.get_value() if hasattr(v, "get_value") else v.value


ROUTING = {
    "softmax-norenorm": dict(num_experts=8, top_k=2, renormalize=False),
    "sigmoid-grouped-bias": dict(num_experts=8, top_k=2, scoring_func="sigmoid",
                                 num_expert_group=4, topk_group=2, use_correction_bias=True,
                                 routed_scaling_factor=2.5),
    "gpt-oss-biases": dict(num_experts=4, top_k=2, activation="swigluoai", expert_bias=True,
                           router_bias=True),
    "qwen2-shared-gate": dict(num_experts=4, top_k=2, num_shared_experts=1,
                              shared_intermediate_size=12, shared_expert_gate=True),
    "fused-shared": dict(num_experts=4, top_k=2, num_shared_experts=2, fuse_shared_experts=True),
    "not-gated": dict(num_experts=4, top_k=1, activation="relu2_no_mul"),
}


def _np_block(layer, x):
  c = layer.config
  p = layer.params()
  return oracle_np.moe_block(
      np.asarray(x, np.float64).reshape(-1, c.hidden_size), p, top_k=c.top_k,
      activation=c.activation, scoring_func=c.scoring_func, renormalize=c.renormalize,
      num_expert_group=c.num_expert_group, topk_group=c.topk_group,
      routed_scaling_factor=c.routed_scaling_factor)


@pytest.mark.parametrize("name", list(ROUTING))
def test_routing_options_match_float64_oracle(name):
  cfg = jmoe.MoEConfig(hidden_size=16, intermediate_size=8, **ROUTING[name])
  layer = MoE(cfg, rngs=nnx.Rngs(1), runner_backend="xla",
              bias_init=jax.nn.initializers.normal(0.1))
  if cfg.use_correction_bias:
    layer.correction_bias[...] = jnp.linspace(0.0, 0.1, cfg.num_experts)
  x = jax.random.normal(jax.random.key(2), (3, 4, 16))
  np.testing.assert_allclose(layer(x).reshape(-1, 16), _np_block(layer, x), rtol=2e-5,
                             atol=2e-5)


def test_custom_routing_fn_dtype_and_initializers():
  cfg = jmoe.MoEConfig(num_experts=4, top_k=1, hidden_size=8, intermediate_size=8)
  first = lambda x, logits, k, renorm: (jnp.ones((x.shape[0], 1)),  # noqa: E731
                                        jnp.zeros((x.shape[0], 1), jnp.int32))
  layer = MoE(cfg, rngs=nnx.Rngs(0), routing_fn=first, dtype=jnp.bfloat16,
              param_dtype=jnp.bfloat16, kernel_init=jax.nn.initializers.constant(0.01))
  assert layer.w13[...].dtype == jnp.bfloat16 and layer.router_w[...].dtype == jnp.bfloat16
  assert float(layer.w2[...][0, 0, 0]) == pytest.approx(0.01, rel=1e-2)
  x = jax.random.normal(jax.random.key(0), (5, 8))
  y = layer(x)
  assert y.dtype == jnp.bfloat16
  p = layer.params()
  ref = oracle_np.fused_moe(np.asarray(x, np.float64), np.asarray(p.w13, np.float64),
                            np.asarray(p.w2, np.float64), np.ones((5, 1)), np.zeros((5, 1), int))
  np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=3e-2, atol=1e-4)


def test_bad_arguments_name_themselves():
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
  with pytest.raises(ValueError, match="router_jitter"):
    MoE(cfg, rngs=nnx.Rngs(0), router_jitter=1.5)
  with pytest.raises(ValueError, match="capacity_factor"):
    MoE(cfg, rngs=nnx.Rngs(0), capacity_factor=0)
  with pytest.raises(TypeError, match="config"):
    MoE({"num_experts": 4}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="H=8"):
    MoE(cfg, rngs=nnx.Rngs(0))(jnp.ones((2, 6)))
  layer = MoE(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="params.w2"):
    layer.load_params(layer.params().__class__(**{**vars(layer.params()),
                                                  "w2": jnp.ones((4, 8, 9))}))


def test_load_params_round_trip():
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=6,
                       expert_bias=True)
  src = jmoe.init_params(cfg, jax.random.key(5))
  layer = MoE(cfg, rngs=nnx.Rngs(0))
  layer.load_params(src)
  for a, b in zip(jax.tree.leaves(layer.params()), jax.tree.leaves(src)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scheme,size", [("fp8_channel", 16), ("int8", 16), ("fp8_block", 128),
                                         ("fp8_channel_static", 16)])
def test_quantized_layer_forward(scheme, size):
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=size, intermediate_size=size)
  scales = None
  if scheme.endswith("_static"):
    scales = (1.0, 1.0)  # replaced below by scales calibrated on the layer's own weights
    with pytest.raises(ValueError, match="input_scales=None with quant=QuantConfig"):
      MoE(cfg, rngs=nnx.Rngs(0), quant=scheme)
  layer = MoE(cfg, rngs=nnx.Rngs(0), quant=scheme, input_scales=scales, runner_backend="xla")
  assert not nnx.state(layer, nnx.Param).get("w13_values")
  q = nnx.state(layer, QuantizedWeight)
  assert "w13_values" in q and "w2_scale" in q
  x = jax.random.normal(jax.random.key(1), (6, size))
  p = layer.params()
  if scales is not None:  # load_params takes the calibrated scales
    _, ids = jmoe.select_experts(x, jmoe.router_logits(x, p), cfg.top_k)
    scales = jmoe.quant.calibrate_input_scales(x, p.w13, p.w2, ids, scheme)
    p = dataclasses.replace(p, w13=dataclasses.replace(p.w13, input_scale=scales[0]),
                            w2=dataclasses.replace(p.w2, input_scale=scales[1]))
    layer.load_params(p)
    q = nnx.state(layer, QuantizedWeight)
  dense = jmoe.MoEParams(router_w=p.router_w, w13=p.w13.dequantize(), w2=p.w2.dequantize())
  ref = jmoe.moe_block(x, dense, cfg, runner_backend="reference")
  rel = float(jnp.linalg.norm(layer(x) - ref) / jnp.linalg.norm(ref))
  assert rel < 0.08, rel  # activation quantization error only
  specs = nnx.get_partition_spec(q)
  assert _spec(specs["w13_values"]) == P("expert", None, None)
  if scales is not None:  # held, replicated, and given back by params()
    assert float(layer.params().w2.input_scale[0]) == float(scales[1][0])
    assert _spec(specs["w2_input_scale"]) == P(None)


def test_quantized_training_layer():
  """quant_training: dense Params, the forward quantized per call (the quantized block on the
  layer's own weights), straight-through gradients reach the expert weights and the router;
  the combinations it cannot take are refused by name."""
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128)
  layer = MoE(cfg, rngs=nnx.Rngs(0), quant_training="fp8_channel", runner_backend="xla")
  x = jax.random.normal(jax.random.key(3), (6, cfg.hidden_size))
  p = layer.params()
  q = dataclasses.replace(p, w13=jmoe.quant.quantize_weights(p.w13, "fp8_channel"),
                          w2=jmoe.quant.quantize_weights(p.w2, "fp8_channel"))
  ref = jmoe.moe_block(x, q, cfg, runner_backend="xla")
  np.testing.assert_allclose(layer(x), ref, rtol=1e-5, atol=1e-6)
  loss, grads = nnx.jit(lambda m, x: nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m))(
      layer, x)
  g = nnx.state(grads, nnx.Param)
  for name in ("w13", "w2", "router_w"):
    assert np.isfinite(np.asarray(g[name][...])).all() and float(jnp.abs(g[name][...]).sum()) > 0
  with pytest.raises(ValueError, match="not both"):
    MoE(cfg, rngs=nnx.Rngs(0), quant="fp8_channel", quant_training="fp8_channel")
  with pytest.raises(ValueError, match="calibrated input scales are for inference"):
    MoE(cfg, rngs=nnx.Rngs(0), quant_training="fp8_channel_static")
  with pytest.raises(ValueError, match="capacity paths"):
    MoE(cfg, rngs=nnx.Rngs(0), quant_training="int8", capacity_factor=1.25)


def test_partition_specs_without_mesh():
  cfg = jmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8,
                       expert_bias=True, num_shared_experts=1)
  specs = nnx.get_partition_spec(nnx.state(MoE(cfg, rngs=nnx.Rngs(0))))
  assert _spec(specs["w13"]) == P("expert", None, None, "tensor")
  assert _spec(specs["w2"]) == P("expert", "tensor", None)
  assert _spec(specs["w13_bias"]) == P("expert", None, "tensor")
  assert _spec(specs["w2_bias"]) == P("expert", None)
  assert _spec(specs["router_w"]) == P(None, None)
  assert _spec(specs["shared_w13"]) == P(None, None)


def _mesh_cfg():
  return jmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8,
                        num_shared_experts=1)


def test_jit_out_shardings_place_the_layer():
  cfg = _mesh_cfg()
  par = make_parallel(data=2, expert=2, tensor=2)
  abstract = nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0)))
  specs = nnx.get_partition_spec(nnx.state(abstract))
  shardings = jax.tree.map(lambda s: NamedSharding(par.mesh, s), specs)
  state = jax.jit(lambda: nnx.state(MoE(cfg, rngs=nnx.Rngs(0))), out_shardings=shardings)()
  assert state["w13"][...].sharding.spec == P("expert", None, None, "tensor")
  assert state["w2"][...].sharding.spec == P("expert", "tensor", None)
  layer = nnx.merge(nnx.graphdef(abstract), state)
  x = jax.random.normal(jax.random.key(1), (32, 16))
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), _np_block(layer, x),
                             rtol=2e-5, atol=2e-5)


def test_set_mesh_places_eagerly_and_drops_missing_axes():
  cfg = _mesh_cfg()
  par = make_parallel(data=4, expert=2, tensor=1)
  mesh2 = jax.make_mesh((4, 2), ("data", "expert"),
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh2):
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    assert layer.w13[...].sharding.spec == P("expert", None, None, None)
    x = jax.random.normal(jax.random.key(1), (32, 16))
    y = nnx.jit(lambda m, x: m(x))(layer, x)
  np.testing.assert_allclose(y, _np_block(layer, x), rtol=2e-5, atol=2e-5)
  del par


@pytest.mark.parametrize("mesh_kw,a2a,runner", [
    (dict(expert=8), "ragged_a2a", "xla"),
    (dict(data=2, expert=2, tensor=2), "allgather", "xla"),
    (dict(data=2, expert=4), "padded_a2a", "xla_batched"),
])
def test_expert_parallel_layer_matches_one_device(mesh_kw, a2a, runner):
  cfg = _mesh_cfg()
  par = make_parallel(**mesh_kw)
  one = MoE(cfg, rngs=nnx.Rngs(0))
  ep = MoE(cfg, rngs=nnx.Rngs(0), parallel=par, a2a_backend=a2a, runner_backend=runner)
  assert ep.w13[...].sharding.spec[0] == "expert"
  x = jax.random.normal(jax.random.key(1), (32, 16))

  @nnx.jit
  def loss_grad(m, x):
    return nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)

  (l1, g1), (l2, g2) = loss_grad(one, x), loss_grad(ep, x)
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  np.testing.assert_allclose(g1["w13"][...], g2["w13"][...], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# training extras: aux losses, load, the DeepSeek bias update, jitter, capacity (vs float64)


def _np_router(layer, x_router):
  p = layer.params()
  logits = np.asarray(x_router, np.float64) @ np.asarray(p.router_w, np.float64)
  return logits


def _np_aux(logits, ids, e, scoring="softmax"):
  t = logits.shape[0]
  probs = oracle_np.softmax(logits) if scoring == "softmax" else oracle_np.sigmoid(logits)
  probs = probs / probs.sum(-1, keepdims=True)
  load = np.bincount(ids.reshape(-1), minlength=e)
  lb = e * np.sum(load / t * probs.mean(0))
  z = np.log(np.exp(logits).sum(-1))
  return lb, np.mean(z ** 2), load


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_aux_outputs_match_float64(scoring):
  cfg = jmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8,
                       scoring_func=scoring)
  layer = MoE(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(4), (2, 12, 16))
  y, aux = layer(x, return_aux=True)
  np.testing.assert_allclose(y, layer(x))
  logits = _np_router(layer, x.reshape(-1, 16))
  _, ids, _ = oracle_np.select_experts(logits, 2, scoring_func=scoring)
  lb, z, load = _np_aux(logits, ids, 8, scoring)
  np.testing.assert_allclose(aux["load_balancing_loss"], lb, rtol=1e-5)
  np.testing.assert_allclose(aux["router_z_loss"], z, rtol=1e-5)
  np.testing.assert_array_equal(aux["expert_load"], load)
  assert int(aux["dropped"]) == 0
  # perfectly uniform routing gives top_k
  uniform = losses.load_balancing_loss(jnp.zeros((8, 8)), jnp.arange(16).reshape(8, 2) % 8)
  np.testing.assert_allclose(uniform, 2.0, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside:DeprecationWarning")
def test_aux_losses_train_and_sow():
  cfg = jmoe.MoEConfig(num_experts=4, top_k=1, hidden_size=8, intermediate_size=8)
  layer = MoE(cfg, rngs=nnx.Rngs(0), sow_aux=True)
  x = jax.random.normal(jax.random.key(0), (16, 8))

  def loss(m):
    _, aux = m(x, return_aux=True)
    return aux["load_balancing_loss"] + 1e-2 * aux["router_z_loss"]

  g = nnx.grad(loss)(layer)
  assert float(jnp.abs(g["router_w"][...]).sum()) > 0
  if hasattr(nnx, "capture"):
    _, inter = nnx.capture(layer, nnx.Intermediate)(x)
    assert "load_balancing_loss" in inter and "expert_load" in inter
  else:  # older flax: sown values stay on the module
    layer(x)
    assert "load_balancing_loss" in nnx.pop(layer, nnx.Intermediate)


def test_correction_bias_update_outside_the_gradient():
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                       scoring_func="sigmoid", use_correction_bias=True)
  layer = MoE(cfg, rngs=nnx.Rngs(0))
  load = jnp.array([10, 2, 4, 0])
  before = np.asarray(layer.correction_bias[...], np.float64)
  layer.update_correction_bias(load, rate=0.01)
  want = before + 0.01 * np.sign(np.mean([10, 2, 4, 0]) - np.array([10, 2, 4, 0], np.float64))
  np.testing.assert_allclose(layer.correction_bias[...], want, rtol=1e-6)

  @nnx.jit
  def step(m, x):  # the update as a training loop applies it: after the step, in jit
    _, aux = m(x, return_aux=True)
    m.update_correction_bias(aux["expert_load"], 1e-3)
    return aux["expert_load"]

  step(layer, jnp.ones((4, 8)))
  assert not np.allclose(layer.correction_bias[...], want)
  with pytest.raises(ValueError, match="use_correction_bias"):
    MoE(cfg.replace(use_correction_bias=False), rngs=nnx.Rngs(0)).update_correction_bias(load)


def test_router_jitter_touches_routing_only():
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
  layer = MoE(cfg, rngs=nnx.Rngs(0), router_jitter=0.3, runner_backend="xla")
  x = jax.random.normal(jax.random.key(1), (16, 8))
  np.testing.assert_allclose(layer(x, deterministic=True),
                             MoE(cfg, rngs=nnx.Rngs(0))(x), rtol=1e-6)
  noise = jax.random.uniform(nnx.clone(layer.rngs).jitter(), x.shape, jnp.float32, 0.7, 1.3)
  y, aux = layer(x, return_aux=True)
  logits = _np_router(layer, np.asarray(x, np.float64) * np.asarray(noise, np.float64))
  w, ids, _ = oracle_np.select_experts(logits, 2)
  p = layer.params()
  ref = oracle_np.fused_moe(np.asarray(x, np.float64), np.asarray(p.w13, np.float64),
                            np.asarray(p.w2, np.float64), w, ids)
  np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(aux["expert_load"], np.bincount(ids.reshape(-1), minlength=4))
  assert not np.allclose(layer(x), y)  # a fresh draw each call


def test_capacity_factor_drops_and_counts():
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
  layer = MoE(cfg, rngs=nnx.Rngs(0), capacity_factor=0.5, runner_backend="xla_batched")
  x = jax.random.normal(jax.random.key(7), (16, 8)) + 0.5  # a skewed router input
  y, aux = layer(x, return_aux=True)
  cap = int(np.ceil(0.5 * 16 * 2 / 4))
  logits = _np_router(layer, x)
  w, ids, _ = oracle_np.select_experts(logits, 2)
  seen = np.zeros(4, int)
  kept = w.copy()
  for t in range(16):  # the first `cap` copies in token order keep their expert
    for j in range(2):
      seen[ids[t, j]] += 1
      if seen[ids[t, j]] > cap:
        kept[t, j] = 0.0
  load = np.bincount(ids.reshape(-1), minlength=4)
  assert int(aux["dropped"]) == int(np.maximum(load - cap, 0).sum()) > 0
  np.testing.assert_array_equal(aux["expert_load"], load)
  p = layer.params()
  ref = oracle_np.fused_moe(np.asarray(x, np.float64), np.asarray(p.w13, np.float64),
                            np.asarray(p.w2, np.float64), kept, ids)
  np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match="batched-format runner"):
    MoE(cfg, rngs=nnx.Rngs(0), capacity_factor=1.0, runner_backend="reference")(x)


def test_ep_dispatch_capacity_drops_are_returned():
  cfg = jmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8)
  par = make_parallel(expert=8, dispatch_capacity=1)
  layer = MoE(cfg, rngs=nnx.Rngs(0), parallel=par, a2a_backend="padded_a2a",
              runner_backend="xla")
  x = jax.random.normal(jax.random.key(1), (64, 16)) + 1.0
  _, aux = nnx.jit(lambda m, x: m(x, return_aux=True))(layer, x)
  assert int(aux["dropped"]) > 0
  assert int(aux["expert_load"].sum()) == 128


def test_linen_wrapper_matches_nnx():
  from flax import linen as nn  # noqa: PLC0415

  from jmoe.layers import linen  # noqa: PLC0415
  cfg = jmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8,
                       scoring_func="sigmoid", use_correction_bias=True, num_shared_experts=1)
  x = jax.random.normal(jax.random.key(0), (2, 6, 16))
  mod = linen.MoE(cfg, runner_backend="xla")
  variables = mod.init(jax.random.key(1), x)
  specs = nn.get_partition_spec(variables)
  assert specs["params"]["moe"]["w13"] == P("expert", None, None, "tensor")
  y, aux = mod.apply(variables, x, return_aux=True)
  layer = MoE(cfg, rngs=nnx.Rngs(0), runner_backend="xla")
  unbox = lambda v: v.value if hasattr(v, "value") else v  # noqa: E731
  params = jax.tree.map(unbox, nn.unbox(variables["params"]["moe"]),
                        is_leaf=lambda v: hasattr(v, "value"))
  for name, value in params.items():
    getattr(layer, name)[...] = value
  layer.correction_bias[...] = unbox(variables["batch_stats"]["moe"]["correction_bias"])
  y2, aux2 = layer(x, return_aux=True)
  np.testing.assert_allclose(y, y2, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(aux["load_balancing_loss"], aux2["load_balancing_loss"], rtol=1e-6)


def test_quantized_layer_expert_parallel():
  cfg = jmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=16)
  par = make_parallel(expert=8)
  one = MoE(cfg, rngs=nnx.Rngs(0), quant="int8")
  ep = MoE(cfg, rngs=nnx.Rngs(0), quant="int8", parallel=par, a2a_backend="ragged_a2a",
           runner_backend="xla")
  assert ep.w13_values[...].sharding.spec == P("expert", None, None)
  x = jax.random.normal(jax.random.key(0), (16, 16))
  fwd = nnx.jit(lambda m, x: m(x))
  np.testing.assert_allclose(fwd(ep, x), fwd(one, x), rtol=1e-5, atol=1e-5)


def test_quantized_layer_trains_what_is_around_its_frozen_experts():
  """A quantized layer under nnx.grad: the router (an nnx.Param) gets the dense block's
  gradient at the dequantized experts; the quantized experts are frozen variables, not Params."""
  from jmoe.layers.variables import QuantizedWeight
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128)
  layer = MoE(cfg, rngs=nnx.Rngs(0), quant="fp8_channel", runner_backend="xla")
  x = jax.random.normal(jax.random.key(1), (8, 128))
  grads = nnx.grad(lambda m, x: jnp.sum(m(x) ** 2))(layer, x)
  router = [a for a in jax.tree.leaves(nnx.state(grads, nnx.Param))]
  assert router and all(bool(jnp.isfinite(a).all()) for a in router)
  assert any(float(jnp.abs(a).max()) > 0 for a in router)
  assert jax.tree.leaves(nnx.state(layer, QuantizedWeight))
  assert not jax.tree.leaves(nnx.state(grads, QuantizedWeight))
