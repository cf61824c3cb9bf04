"""Bad input raises a clear exception that names the argument, before any kernel runs."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from jmoe import oracle
from jmoe.modular import ModularKernel

T, H, N, E, K = 4, 6, 5, 5, 2


@pytest.fixture
def no_kernel(monkeypatch):
  """Any kernel launch fails the test: validation must happen before."""
  def boom(self, *a, **kw):
    raise AssertionError(f"{self!r} ran before the bad input was rejected")
  monkeypatch.setattr(ModularKernel, "__call__", boom)


def _good(rng=None):
  rng = rng or np.random.default_rng(0)
  return dict(
      hidden_states=jnp.asarray(rng.standard_normal((T, H)), jnp.float32),
      w13=jnp.asarray(rng.standard_normal((E, H, 2 * N)), jnp.float32),
      w2=jnp.asarray(rng.standard_normal((E, N, H)), jnp.float32),
      topk_weights=jnp.full((T, K), 0.5, jnp.float32),
      topk_ids=jnp.asarray([[0, 1], [2, 3], [4, 0], [1, 2]], jnp.int32))


def _call(**override):
  args = _good()
  args.update(override)
  pos = [args.pop(n) for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids")]
  return jmoe.fused_moe(*pos, **args)


def test_good_input_runs():
  out = _call()
  assert out.shape == (T, H)


# ---------------------------------------------------------------------------------------------
# fused_moe

_g = _good()
FUSED_BAD = {
    "top_k_exceeds_experts": (dict(topk_ids=jnp.zeros((T, 6), jnp.int32),
                                   topk_weights=jnp.ones((T, 6))),
                              ValueError, r"top_k=6 exceeds global_num_experts=5"),
    "hidden_size_mismatch": (dict(hidden_states=jnp.ones((T, H + 1))), ValueError,
                             r"hidden size mismatch: hidden_states has H=7"),
    "w2_expert_count": (dict(w2=jnp.ones((E + 1, N, H))), ValueError,
                        r"expert count mismatch: w13 has E=5, w2 has E=6"),
    "w2_hidden": (dict(w2=jnp.ones((E, N, H + 1))), ValueError, r"w2 must be \[E, N, H\]"),
    "w2_intermediate": (dict(w2=jnp.ones((E, N + 2, H))), ValueError,
                        r"w2 must be \[E, N, H\] = \(5, 5, 6\) to match w13 \(5, 6, 10\) "
                        r"\(activation 'silu'\), got w2 shape \(5, 7, 6\)"),
    "w13_width": (dict(w13=jnp.ones((E, H, 2 * N + 1))), ValueError,
                  r"w13 must be \[E, H, 2N\] for the gated activation 'silu': its last dim 11 "
                  r"is odd"),
    "w13_width_no_mul": (dict(activation="silu_no_mul"), ValueError,
                         r"w2 must be \[E, N, H\] = \(5, 10, 6\) to match w13 .*'silu_no_mul'"),
    "w13_rank": (dict(w13=jnp.ones((H, 2 * N))), ValueError, r"w13 must be \[E, H, 2N\]"),
    "w2_rank": (dict(w2=jnp.ones((N, H))), ValueError, r"w2 must be \[E, N, H\]"),
    "hidden_rank": (dict(hidden_states=jnp.ones((1, T, H))), ValueError,
                    r"hidden_states must be \[T, H\]"),
    "w13_bias_shape": (dict(w13_bias=jnp.ones((E, N))), ValueError, r"w13_bias must have shape"),
    "w2_bias_shape": (dict(w2_bias=jnp.ones((E, N))), ValueError, r"w2_bias must have shape"),
    "ids_weights_mismatch": (dict(topk_weights=jnp.ones((T, K + 1))), ValueError,
                             r"topk_weights shape \(4, 3\) does not match topk_ids shape"),
    "ids_token_mismatch": (dict(topk_ids=jnp.zeros((T + 1, K), jnp.int32)), ValueError,
                           r"topk_ids must be \[T, k\] with T=4"),
    "ids_rank": (dict(topk_ids=jnp.zeros((T,), jnp.int32)), ValueError, r"topk_ids must be"),
    "ids_zero_slots": (dict(topk_ids=jnp.zeros((T, 0), jnp.int32), topk_weights=jnp.ones((T, 0))),
                       ValueError, r"topk_ids must have at least one slot per token"),
    "ids_float": (dict(topk_ids=jnp.zeros((T, K), jnp.float32)), TypeError,
                  r"topk_ids must be an integer array"),
    "weights_int": (dict(topk_weights=jnp.ones((T, K), jnp.int32)), TypeError, r"topk_weights"),
    "weight_on_input_top2": (dict(apply_router_weight_on_input=True), ValueError,
                             r"apply_router_weight_on_input requires top_k == 1, got top_k=2"),
    "id_too_large": (dict(topk_ids=jnp.asarray([[0, 1], [2, 5], [4, 0], [1, 2]], jnp.int32)),
                     ValueError, r"topk_ids holds ids outside \[-1, 5\).*\[5\]"),
    "id_below_minus_one": (dict(topk_ids=jnp.asarray([[0, 1], [2, -2], [4, 0], [1, 2]],
                                                     jnp.int32)),
                           ValueError, r"topk_ids holds ids outside \[-1, 5\)"),
    "id_beyond_expert_map": (dict(expert_map=jnp.asarray([0, 1, 2, 3], jnp.int32)), ValueError,
                             r"topk_ids holds ids outside \[-1, 4\)"),
    "hidden_int": (dict(hidden_states=jnp.ones((T, H), jnp.int32)), TypeError,
                   r"hidden_states must be a floating-point array"),
    "w13_int": (dict(w13=jnp.ones((E, H, 2 * N), jnp.int8)), TypeError, r"w13 must be a floating"),
    "unknown_activation": (dict(activation="swish"), ValueError,
                           r"activation='swish' is not known; known: silu, gelu, gelu_tanh, "
                           r"swigluoai, silu_no_mul, gelu_no_mul, relu2_no_mul"),
    "activation_type": (dict(activation=3), TypeError, r"activation must be a str"),
    "unknown_backend": (dict(runner_backend="cutlass"), ValueError,
                        r"runner_backend='cutlass' is not known; known: 'auto', 'reference', "
                        r"'xla', 'xla_batched'"),
    "unknown_a2a": (dict(a2a_backend="deepep"), ValueError,
                    r"a2a_backend='deepep' is not known; known: 'auto', 'none'"),
    "expert_map_rank": (dict(expert_map=jnp.zeros((2, 5), jnp.int32)), ValueError,
                        r"expert_map must be 1-D"),
    "expert_map_vs_global": (dict(expert_map=jnp.arange(5, dtype=jnp.int32),
                                  global_num_experts=6), ValueError,
                             r"global_num_experts=6 does not match expert_map length 5"),
    "global_without_map": (dict(global_num_experts=8), ValueError,
                           r"global_num_experts=8 differs from w13's E=5 but no expert_map"),
    "global_without_map_meshless": (dict(global_num_experts=8, parallel=jmoe.ParallelConfig()),
                                    ValueError, r"global_num_experts=8 differs from w13's E=5"),
    "expert_map_value": (dict(expert_map=jnp.asarray([0, 1, 2, 3, 5, -1], jnp.int32)),
                         ValueError, r"expert_map holds local ids outside \[-1, 5\)"),
    "expert_map_float": (dict(expert_map=jnp.asarray([0., 1., 2., 3., 4.])), TypeError,
                         r"expert_map must be an integer array"),
    "duplicate_ids_batched": (dict(topk_ids=jnp.asarray([[0, 1], [2, 2], [4, 0], [1, 2]],
                                                        jnp.int32),
                                   runner_backend="xla_batched"),
                              ValueError, r"topk_ids repeats an expert within token 1"),
}


@pytest.mark.parametrize("name", list(FUSED_BAD))
def test_fused_moe_bad_input(name, no_kernel, no_backend_env):
  override, exc, pattern = FUSED_BAD[name]
  with pytest.raises(exc, match=pattern):
    _call(**override)


@pytest.mark.parametrize("name", ["top_k_exceeds_experts", "hidden_size_mismatch", "w13_width",
                                  "ids_weights_mismatch", "weight_on_input_top2", "hidden_int",
                                  "unknown_backend", "unknown_activation"])
def test_fused_moe_bad_input_under_jit(name, no_kernel, no_backend_env):
  """Shape/dtype/name errors are trace-time errors: jit raises them too."""
  override, exc, pattern = FUSED_BAD[name]
  args = _good()
  args.update(override)
  static = {n: args.pop(n) for n in list(args) if not hasattr(args[n], "shape")}
  with pytest.raises(exc, match=pattern):
    jax.jit(lambda a: jmoe.fused_moe(**a, **static))(args)


def test_minus_one_and_map_minus_one_are_not_errors():
  ids = jnp.asarray([[0, -1], [-1, -1], [4, 0], [1, 2]], jnp.int32)
  assert _call(topk_ids=ids).shape == (T, H)
  emap = jnp.asarray([0, -1, 1, 2, 3, 4, -1], jnp.int32)
  assert _call(expert_map=emap, topk_ids=jnp.asarray([[6, 1], [5, 3], [0, 2], [1, 4]],
                                                     jnp.int32)).shape == (T, H)


# ---------------------------------------------------------------------------------------------
# select_experts


def _logits(t=T, e=8):
  return jnp.asarray(np.random.default_rng(1).standard_normal((t, e)), jnp.float32)


ROUTER_BAD = {
    "top_k_exceeds_experts": (dict(top_k=9), ValueError,
                              r"top_k=9 exceeds the number of experts E=8"),
    "top_k_zero": (dict(top_k=0), ValueError, r"top_k must be a positive int, got 0"),
    "top_k_float": (dict(top_k=2.0), ValueError, r"top_k must be a positive int"),
    "group_not_dividing": (dict(num_expert_group=3, topk_group=1), ValueError,
                           r"num_expert_group=3 does not divide the number of experts E=8"),
    "topk_group_too_big": (dict(num_expert_group=4, topk_group=5), ValueError,
                           r"topk_group=5 must be in \[1, num_expert_group=4\]"),
    "topk_group_zero": (dict(num_expert_group=4, topk_group=0), ValueError, r"topk_group=0"),
    "group_alone": (dict(num_expert_group=4), ValueError,
                    r"num_expert_group and topk_group must be given together"),
    "top_k_beyond_groups": (dict(top_k=5, num_expert_group=4, topk_group=2), ValueError,
                            r"top_k=5 exceeds the experts left in topk_group=2 groups of 2"),
    "unknown_scoring": (dict(scoring_func="softplus"), ValueError,
                        r"scoring_func='softplus' is not known; known: 'softmax', 'sigmoid'"),
    "bias_shape": (dict(e_score_correction_bias=jnp.zeros(7)), ValueError,
                   r"e_score_correction_bias must have shape \(8,\)"),
    "rsf_zero": (dict(routed_scaling_factor=0.0), ValueError,
                 r"routed_scaling_factor must be a finite number > 0, got 0.0"),
    "rsf_negative": (dict(routed_scaling_factor=-1.0), ValueError, r"routed_scaling_factor"),
    "rsf_nan": (dict(routed_scaling_factor=math.nan), ValueError, r"routed_scaling_factor.*nan"),
    "rsf_inf": (dict(routed_scaling_factor=math.inf), ValueError, r"routed_scaling_factor.*inf"),
    "rsf_array": (dict(routed_scaling_factor=jnp.float32(2.0)), ValueError,
                  r"routed_scaling_factor"),
    "nan_logits": (dict(router_logits=_logits().at[1, 2].set(jnp.nan)), ValueError,
                   r"router_logits contains NaN or inf"),
    "inf_logits": (dict(router_logits=_logits().at[0, 0].set(jnp.inf)), ValueError,
                   r"router_logits contains NaN or inf"),
    "logits_rank": (dict(router_logits=jnp.ones((2, T, 8))), ValueError,
                    r"router_logits must be \[T, E\]"),
    "logits_int": (dict(router_logits=jnp.ones((T, 8), jnp.int32)), TypeError,
                   r"router_logits must be floating point"),
    "hidden_tokens": (dict(hidden_states=jnp.ones((T + 1, 3))), ValueError,
                      r"hidden_states must be \[T, H\] with T=4"),
}


@pytest.mark.parametrize("name", list(ROUTER_BAD))
def test_select_experts_bad_input(name):
  override, exc, pattern = ROUTER_BAD[name]
  args = dict(hidden_states=None, router_logits=_logits(), top_k=2)
  args.update(override)
  with pytest.raises(exc, match=pattern):
    jmoe.select_experts(args.pop("hidden_states"), args.pop("router_logits"), args.pop("top_k"),
                        **args)


def test_nan_logits_under_jit_are_not_checked_but_grouped_checks_are():
  """Values are only checked eagerly; structural errors still raise under jit."""
  f = jax.jit(lambda l: jmoe.select_experts(None, l, 2))
  w, _ = f(_logits().at[1, 2].set(jnp.nan))
  assert w.shape == (T, 2)
  with pytest.raises(ValueError, match="num_expert_group=3 does not divide"):
    jax.jit(lambda l: jmoe.select_experts(None, l, 2, num_expert_group=3, topk_group=1))(_logits())


# ---------------------------------------------------------------------------------------------
# configs

_BASE = dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8)
CONFIG_BAD = {
    "num_experts_zero": (dict(num_experts=0), r"num_experts must be a positive int, got 0"),
    "hidden_float": (dict(hidden_size=16.0), r"hidden_size must be a positive int"),
    "top_k_bool": (dict(top_k=True), r"top_k must be a positive int"),
    "top_k_exceeds": (dict(top_k=9), r"top_k=9 exceeds num_experts=8"),
    "activation": (dict(activation="geglu"), r"activation='geglu' is not known"),
    "scoring": (dict(scoring_func="tanh"), r"scoring_func='tanh' is not known"),
    "runner": (dict(runner_backend="triton"), r"runner_backend='triton' is not known"),
    "group_alone": (dict(num_expert_group=2), r"must be given together"),
    "group_not_dividing": (dict(num_expert_group=3, topk_group=1),
                           r"num_expert_group=3 does not divide num_experts=8"),
    "topk_group_too_big": (dict(num_expert_group=2, topk_group=3),
                           r"topk_group=3 exceeds num_expert_group=2"),
    "weight_on_input_top2": (dict(apply_router_weight_on_input=True),
                             r"apply_router_weight_on_input requires top_k == 1"),
    "rsf_zero": (dict(routed_scaling_factor=0.0), r"routed_scaling_factor must be"),
    "rsf_nan": (dict(routed_scaling_factor=math.nan), r"routed_scaling_factor must be"),
    "rsf_inf": (dict(routed_scaling_factor=math.inf), r"routed_scaling_factor must be"),
    "shared_negative": (dict(num_shared_experts=-1), r"num_shared_experts must be"),
    "fuse_without_shared": (dict(fuse_shared_experts=True), r"fuse_shared_experts=True needs"),
    "fuse_with_gate": (dict(fuse_shared_experts=True, num_shared_experts=1,
                            shared_expert_gate=True), r"cannot express a shared_expert_gate"),
    "fuse_with_weight_on_input": (dict(fuse_shared_experts=True, num_shared_experts=1, top_k=1,
                                       apply_router_weight_on_input=True),
                                  r"fuse_shared_experts cannot be combined with "
                                  r"apply_router_weight_on_input"),
    "fuse_shared_size": (dict(fuse_shared_experts=True, num_shared_experts=2,
                              shared_intermediate_size=12),
                         r"fuse_shared_experts needs shared_intermediate_size=12"),
    "shared_size_zero": (dict(num_shared_experts=1, shared_intermediate_size=0),
                         r"shared_intermediate_size must be a positive int"),
    "dtype": (dict(dtype="int8"), r"dtype='int8' is not a floating-point dtype"),
    "dtype_unknown": (dict(dtype="float33"), r"dtype='float33'"),
}


@pytest.mark.parametrize("name", list(CONFIG_BAD))
def test_moe_config_bad_field(name):
  override, pattern = CONFIG_BAD[name]
  with pytest.raises(ValueError, match=pattern):
    jmoe.MoEConfig(**{**_BASE, **override})


def test_moe_config_good_and_frozen():
  cfg = jmoe.MoEConfig(**_BASE, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
  hash(cfg)
  with pytest.raises(Exception):
    cfg.top_k = 3  # type: ignore[misc]
  with pytest.raises(ValueError, match="top_k=9"):
    cfg.replace(top_k=9)
  for name in jmoe.PRESETS:
    assert jmoe.get_preset(name) is jmoe.PRESETS[name]
  with pytest.raises(ValueError, match=r"preset='nope' is not known; known: 'mixtral-8x7b'"):
    jmoe.get_preset("nope")


def test_router_logits_bad_input():
  params = jmoe.MoEParams(router_w=jnp.ones((H, E)), w13=_g["w13"], w2=_g["w2"])
  with pytest.raises(TypeError, match=r"x must be a floating-point array, got dtype int32"):
    jmoe.router_logits(jnp.ones((T, H), jnp.int32), params)
  with pytest.raises(TypeError, match=r"params.router_w must be a floating-point array"):
    jmoe.router_logits(jnp.ones((T, H)), jmoe.MoEParams(
        router_w=jnp.ones((H, E), jnp.int8), w13=_g["w13"], w2=_g["w2"]))
  with pytest.raises(ValueError, match=r"x has H=7 but params.router_w is \[H, E\] = \(6, 5\)"):
    jmoe.router_logits(jnp.ones((T, H + 1)), params)


def test_quant_and_parallel_config_bad_fields():
  with pytest.raises(ValueError, match=r"QuantConfig.format='fp3' is not known"):
    jmoe.QuantConfig(format="fp3")
  with pytest.raises(ValueError, match=r"a2a_backend='nccl' is not known"):
    jmoe.ParallelConfig(a2a_backend="nccl")


def test_quantized_format_refused_before_kernel(no_kernel, no_backend_env):
  """Dense weights with a scheme (quantized training) whose tiles do not fit them: the error
  names the weight before any kernel runs."""
  with pytest.raises(ValueError, match=r"w13: fp8_block .* do not divide"):
    _call(quant_config=jmoe.QuantConfig(format="fp8_block"))


# ---------------------------------------------------------------------------------------------
# the backend oracle and its environment overrides


def test_env_runner_backend_override(monkeypatch):
  monkeypatch.setenv("JMOE_RUNNER_BACKEND", "reference")
  monkeypatch.delenv("JMOE_A2A_BACKEND", raising=False)
  pf, experts, reason = oracle.select_backend()
  assert type(experts).__name__ == "ReferenceExperts"
  assert "JMOE_RUNNER_BACKEND" in reason
  # An explicit argument wins over the environment.
  _, experts, reason = oracle.select_backend("xla_batched")
  assert type(experts).__name__ == "XlaBatchedExperts" and "argument" in reason
  # fused_moe follows the environment.
  ran = []
  orig = jmoe.experts.ReferenceExperts.apply

  def spy(self, *a, **kw):
    ran.append(type(self).__name__)
    return orig(self, *a, **kw)
  monkeypatch.setattr(jmoe.experts.ReferenceExperts, "apply", spy)
  _call()
  assert ran == ["ReferenceExperts"]


def test_env_auto_is_the_default(monkeypatch):
  monkeypatch.setenv("JMOE_RUNNER_BACKEND", "auto")
  _, experts, reason = oracle.select_backend()
  assert type(experts).__name__ == "XlaExperts" and "cpu" in reason


@pytest.mark.parametrize("var,arg", [("JMOE_RUNNER_BACKEND", "runner_backend"),
                                     ("JMOE_A2A_BACKEND", "a2a_backend")])
def test_env_invalid_value(var, arg, monkeypatch, no_kernel):
  monkeypatch.setenv(var, "bogus")
  with pytest.raises(ValueError, match=rf"{var} \(environment\)='bogus' is not known; known: "):
    oracle.select_backend()
  with pytest.raises(ValueError, match=var):
    _call()
  # An explicit argument wins without reading the environment.
  oracle.select_backend(**{arg: "reference" if arg == "runner_backend" else "none"})


def test_unknown_backend_lists_known_ones():
  with pytest.raises(ValueError) as info:
    oracle.select_backend("nope")
  for name in ("'auto'", "'reference'", "'xla'", "'xla_batched'"):
    assert name in str(info.value)


def test_env_a2a_backend_override(monkeypatch):
  monkeypatch.delenv("JMOE_RUNNER_BACKEND", raising=False)
  monkeypatch.setenv("JMOE_A2A_BACKEND", "none")
  pf, _, reason = oracle.select_backend()
  assert type(pf).__name__ == "NoEP" and "JMOE_A2A_BACKEND" in reason
  monkeypatch.setenv("JMOE_A2A_BACKEND", "allgather")
  with pytest.raises(ValueError, match=r"a2a_backend='allgather' needs parallel=ParallelConfig"):
    oracle.select_backend()
  # the batched runner with the local a2a picks the batched PrepareFinalize
  monkeypatch.setenv("JMOE_A2A_BACKEND", "none")
  pf, experts, _ = oracle.select_backend("xla_batched")
  assert type(pf).__name__ == "NoEPBatched" and type(experts).__name__ == "XlaBatchedExperts"


def test_pallas_backend_refused_clearly_when_unavailable(no_backend_env):
  from jmoe import registry
  fam = registry.RUNNERS.get("pallas_mosaic")
  if not fam:
    pytest.skip("pallas_mosaic is not registered")
  ok, why = next(iter(fam.values())).is_available()
  if ok:
    pytest.skip(f"pallas_mosaic is available here ({why})")
  with pytest.raises(ValueError, match=r"runner_backend='pallas_mosaic' cannot run here"):
    _call(runner_backend="pallas_mosaic")
