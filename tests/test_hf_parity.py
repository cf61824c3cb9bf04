"""Parity with Hugging Face transformers' own MoE blocks (torch CPU, float32).

Each case builds the transformers sparse-MoE block from a tiny config object (nothing is
downloaded), fills its weights from a seeded torch generator, runs it, converts its state with
`jmoe.interop.hf` and checks `jmoe.moe_block` against it to <= 1e-4 relative (||a-b|| / ||b||):
the six families of the foundation issue on every CPU runner backend (and with fused shared
experts where that is expressible), the families sharing their semantics on one backend. The
routing itself (chosen experts and weights) is compared first, so a failure says whether the
router or the experts disagree.

Beyond the live blocks: the older per-expert checkpoint names (`experts.{i}.w1/w3/w2`,
`experts.{i}.gate_proj/up_proj/down_proj`), the inverse converter, bfloat16 tensors, gpt-oss
MXFP4 and DeepSeek FP8 block-quantized checkpoints, a whole tiny model's safetensors file, and
clear errors. Also passes against transformers 4.56 (per-expert nn.Linear blocks).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import jmoe  # noqa: E402
from jmoe.interop import hf  # noqa: E402

RTOL = 1e-4
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2)

# name -> (model module, config class, block class, config kwargs)
CASES = {
    "mixtral": ("mixtral", "MixtralConfig", "MixtralSparseMoeBlock",
                dict(hidden_size=32, intermediate_size=48, num_local_experts=6,
                     num_experts_per_tok=2, **_ATTN)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
                  dict(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                       num_experts_per_tok=3, norm_topk_prob=True, **_ATTN)),
    "qwen3_moe-no_norm": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
                          dict(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                               num_experts_per_tok=3, norm_topk_prob=False, **_ATTN)),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock",
                  dict(hidden_size=32, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, **_ATTN)),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE",
                    dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16,
                         num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                         routed_scaling_factor=2.5, norm_topk_prob=True, **_ATTN)),
    "deepseek_v3-one_group": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE",
                              dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8,
                                   num_experts_per_tok=2, n_group=1, topk_group=1,
                                   n_shared_experts=1, routed_scaling_factor=1.5,
                                   norm_topk_prob=False, **_ATTN)),
    # alpha / limit away from the defaults (and limit small enough that clamping happens)
    "gpt_oss": ("gpt_oss", "GptOssConfig", "GptOssMLP",
                dict(hidden_size=32, intermediate_size=24, num_local_experts=6,
                     num_experts_per_tok=2, swiglu_alpha=1.5, swiglu_limit=1.2, head_dim=8,
                     **_ATTN)),
    "llama4_text": ("llama4", "Llama4TextConfig", "Llama4TextMoe",
                    dict(hidden_size=32, intermediate_size=24, num_local_experts=5,
                         num_experts_per_tok=1, head_dim=8, **_ATTN)),
}
# Families sharing one of the above semantics: checked on one backend to keep the file fast.
EXTRA_CASES = {
    "minimax": ("minimax", "MiniMaxConfig", "MiniMaxSparseMoeBlock",
                dict(hidden_size=32, intermediate_size=40, num_local_experts=6,
                     num_experts_per_tok=2, head_dim=8, **_ATTN)),
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock",
              dict(hidden_size=32, intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                   norm_topk_prob=False, **_ATTN)),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeTextConfig", "Qwen3VLMoeTextSparseMoeBlock",
                     dict(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                          num_experts_per_tok=3, **_ATTN)),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextSparseMoeBlock",
                   dict(hidden_size=32, moe_intermediate_size=24,
                        shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                        norm_topk_prob=True, **_ATTN)),
    "glm4_moe": ("glm4_moe", "Glm4MoeConfig", "Glm4MoeMoE",
                 dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=12,
                      num_experts_per_tok=3, n_group=3, topk_group=2, n_shared_experts=1,
                      routed_scaling_factor=1.8, norm_topk_prob=True, **_ATTN)),
    "dots1": ("dots1", "Dots1Config", "Dots1MoE",
              dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                   routed_scaling_factor=2.0, norm_topk_prob=False, **_ATTN)),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2Config", "DeepseekV2Moe",
                    dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=12,
                         num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2, n_shared_experts=2, routed_scaling_factor=1.5, **_ATTN)),
}
BACKENDS = ("reference", "xla", "xla_batched")


def _seed(name: str) -> int:
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _classes(case: str):
  mod_name, cfg_name, block_name, kw = {**CASES, **EXTRA_CASES}[case]
  mod = pytest.importorskip(f"transformers.models.{mod_name}.modeling_{mod_name}",
                            reason=f"transformers {transformers.__version__} has no {mod_name}")
  cfg_cls = getattr(mod, cfg_name, None) or getattr(transformers, cfg_name, None)
  block_cls = getattr(mod, block_name, None)
  if cfg_cls is None or block_cls is None:
    pytest.skip(f"transformers {transformers.__version__} lacks {cfg_name} / {block_name}")
  return cfg_cls, block_cls, kw


def _randomize(module, seed: int) -> None:
  """Every float parameter and buffer ~ N(0, 0.2²); the DeepSeek correction bias smaller."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    for name, t in tensors:
      if not t.is_floating_point():
        continue
      std = 0.05 if "correction_bias" in name else 0.2
      t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * std)


def build(case: str, **overrides):
  """(hf_config, block, x [B, S, H] torch f32) for `case`, deterministic."""
  cfg_cls, block_cls, kw = _classes(case)
  hf_config = cfg_cls(**{**kw, **overrides})
  block = block_cls(hf_config).eval()
  experts = getattr(block, "experts", None)
  if case.startswith("gpt_oss") and getattr(experts, "limit", None) != hf_config.swiglu_limit:
    # transformers 4.5x hard-codes alpha/limit on the experts module: make it use the config's
    experts.alpha, experts.limit = hf_config.swiglu_alpha, hf_config.swiglu_limit
  _randomize(block, _seed(case))
  g = torch.Generator().manual_seed(_seed(case) + 1)
  x = torch.randn(2, 9, hf_config.hidden_size, generator=g)
  return hf_config, block, x


def hf_forward(block, x) -> np.ndarray:
  with torch.no_grad():
    y = block(x)
  if isinstance(y, tuple):  # gpt-oss -> (out, router_scores), Llama 4 -> (out, router_logits)
    y = y[0]
  return y.reshape(-1, y.shape[-1]).float().numpy()


def hf_routing(case: str, block, x2d):
  """(weights, ids) [T, k] as the HF block routes, sorted by expert id per token; None when this
  transformers version's router returns something else (then only the outputs are compared)."""
  with torch.no_grad():
    if case.startswith("llama4"):
      scores, logits = block.router(x2d)
      if scores.shape != logits.shape:  # older versions return scores as [E, T]
        scores = scores.T
      ids = torch.topk(logits, block.top_k, dim=1)[1]
      w = scores.gather(1, ids)
    else:
      router = block.router if hasattr(block, "router") else block.gate
      out = router(x2d)
      if not (isinstance(out, tuple) and len(out) == 3 and out[1].shape == out[2].shape):
        return None
      _, w, ids = out
  return _sort_by_id(w.float().numpy(), ids.numpy())


def jmoe_routing(x, params, c) -> tuple[np.ndarray, np.ndarray]:
  w, ids = _route_jit(x, params, c)
  return _sort_by_id(np.asarray(w), np.asarray(ids))


@jax.jit(static_argnums=2)
def _route_jit(x, params, c):
  return jmoe.select_experts(
      x, jmoe.router_logits(x, params), c.top_k, scoring_func=c.scoring_func,
      renormalize=c.renormalize, num_expert_group=c.num_expert_group, topk_group=c.topk_group,
      e_score_correction_bias=params.correction_bias,
      routed_scaling_factor=c.routed_scaling_factor)


def _sort_by_id(w, ids):
  order = np.argsort(ids, axis=1)
  return np.take_along_axis(w, order, 1), np.take_along_axis(ids, order, 1)


def rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------------------------
# parity with the live blocks


_block_jit = jax.jit(jmoe.moe_block, static_argnames=("config",))


def _fusable(c) -> bool:
  return bool(c.num_shared_experts) and not (c.shared_expert_gate or
                                            c.apply_router_weight_on_input)


@jax.jit(static_argnames=("config", "backends"))
def _jmoe_all(x, params, config, backends):
  """Routing, then the block on each backend (and with fused shared experts): one compile."""
  w, ids = jmoe.select_experts(
      x, jmoe.router_logits(x, params), config.top_k, scoring_func=config.scoring_func,
      renormalize=config.renormalize, num_expert_group=config.num_expert_group,
      topk_group=config.topk_group, e_score_correction_bias=params.correction_bias,
      routed_scaling_factor=config.routed_scaling_factor)
  outs = {b: jmoe.moe_block(x, params, config, runner_backend=b) for b in backends}
  if _fusable(config):  # shared experts fused as always-chosen top-k slots: same result
    outs["fused shared experts"] = jmoe.moe_block(
        x, params, config.replace(fuse_shared_experts=True), runner_backend="xla")
  return (w, ids), outs


def _check_parity(case, backends, eager=False):
  hf_config, block, x = build(case)
  want = hf_forward(block, x)
  config, params = hf.from_hf_module(block, hf_config)
  assert config.dtype == "float32"
  xj = jnp.asarray(x.reshape(-1, x.shape[-1]).numpy())
  (jw, jids), outs = _jmoe_all(xj, params, config=config, backends=backends)

  # the router first: same experts, same weights
  hf_route = hf_routing(case, block, x.reshape(-1, x.shape[-1]))
  if hf_route is not None:
    hw, hids = hf_route
    jw, jids = _sort_by_id(np.asarray(jw), np.asarray(jids))
    np.testing.assert_array_equal(jids, hids, err_msg=f"{case}: different experts chosen")
    np.testing.assert_allclose(jw, hw, rtol=1e-5, atol=1e-6, err_msg=f"{case}: routing weights")

  assert set(outs) == set(backends) | ({"fused shared experts"} if _fusable(config) else set())
  for name, got in outs.items():
    assert got.shape == want.shape and got.dtype == jnp.float32
    err = rel_err(got, want)
    assert err <= RTOL, f"{case} [{name}]: relative error {err:.3g} > {RTOL}"
  if eager:  # not jitted, with the config's own backend ("auto")
    err = rel_err(jmoe.moe_block(xj, params, config), want)
    assert err <= RTOL, f"{case} [eager]: relative error {err:.3g}"


@pytest.mark.parametrize("case", list(CASES))
def test_block_parity(case):
  _check_parity(case, BACKENDS, eager=case == "mixtral")


@pytest.mark.parametrize("case", list(EXTRA_CASES))
def test_block_parity_related_families(case):
  _check_parity(case, ("xla",))


def test_deepseek_case_exercises_groups_and_bias():
  """Guard the DeepSeek parity case: grouping and the correction bias change the selection."""
  hf_config, block, x = build("deepseek_v3")
  config, params = hf.from_hf_module(block, hf_config)
  xj = jnp.asarray(x.reshape(-1, x.shape[-1]).numpy())
  _, grouped = jmoe_routing(xj, params, config)
  _, flat = jmoe_routing(xj, params, config.replace(num_expert_group=None, topk_group=None))
  _, unbiased = jmoe_routing(xj, dataclasses.replace(params, correction_bias=None), config)
  assert (grouped != flat).any(), "the group limit never changes the choice: weak test"
  assert (grouped != unbiased).any(), "the correction bias never changes the choice: weak test"


def test_gpt_oss_case_exercises_clamp():
  """Guard the gpt-oss case: the swiglu limit clamps some gate and up values."""
  hf_config, block, x = build("gpt_oss")
  config, params = hf.from_hf_module(block, hf_config)
  assert (config.activation, config.swiglu_alpha, config.swiglu_limit) == ("swigluoai", 1.5, 1.2)
  h = np.einsum("th,ehn->etn", x.reshape(-1, 32).numpy(), np.asarray(params.w13))
  n = config.intermediate_size
  assert (h[..., :n] > 1.2).any() and (np.abs(h[..., n:]) > 1.2).any()


# --------------------------------------------------------------------------------------------
# checkpoint layouts


def _legacy_state_dict(case: str, block, prefix: str) -> dict:
  """The block's tensors under the pre-fusion per-expert names, as HF checkpoints store them."""
  sd = {k: v.detach().clone() for k, v in block.state_dict().items()}
  gate_up = sd.pop("experts.gate_up_proj")  # [E, 2N, H]
  down = sd.pop("experts.down_proj")  # [E, H, N]
  n = gate_up.shape[1] // 2
  names = ("w1", "w3", "w2") if case == "mixtral" else ("gate_proj", "up_proj", "down_proj")
  for i in range(gate_up.shape[0]):
    sd[f"experts.{i}.{names[0]}.weight"] = gate_up[i, :n].clone()
    sd[f"experts.{i}.{names[1]}.weight"] = gate_up[i, n:].clone()
    sd[f"experts.{i}.{names[2]}.weight"] = down[i].clone()
  return {prefix + k: v for k, v in sd.items()}


def _assert_same_params(a, b):
  for f in ("router_w", "router_b", "correction_bias", "w13", "w2", "w13_bias", "w2_bias",
            "shared_w13", "shared_w2", "shared_gate"):
    x, y = getattr(a, f), getattr(b, f)
    assert (x is None) == (y is None), f
    if x is not None:
      assert x.shape == y.shape and x.dtype == y.dtype, (f, x.shape, y.shape, x.dtype, y.dtype)
      np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), f)


@pytest.mark.parametrize("case,prefix", [
    ("mixtral", "model.layers.1.block_sparse_moe."),
    ("qwen3_moe", "model.layers.0.mlp."),
    ("qwen2_moe", "model.layers.2.mlp"),  # no trailing dot: added
    ("deepseek_v3", "model.layers.3.mlp."),
])
def test_legacy_per_expert_names(case, prefix):
  hf_config, block, _ = build(case)
  if "experts.gate_up_proj" not in block.state_dict():
    pytest.skip("this transformers stores per-expert linears already (covered by parity)")
  want_cfg, want = hf.from_hf_module(block, hf_config)
  sd = _legacy_state_dict(case, block, prefix if prefix.endswith(".") else prefix + ".")
  sd["model.layers.99.mlp.gate.weight"] = torch.zeros(1)  # other layers are ignored
  cfg, got = hf.from_hf_state_dict(case, hf_config, sd, prefix)
  assert cfg == want_cfg
  _assert_same_params(got, want)


@pytest.mark.parametrize("case", list(CASES) + list(EXTRA_CASES))
def test_to_hf_state_dict_round_trip(case):
  """jmoe -> HF names gives back the block's own state dict, tensor for tensor; the per-expert
  layout converts back to the same jmoe parameters."""
  hf_config, block, _ = build(case)
  config, params = hf.from_hf_module(block, hf_config)
  mt = hf.BLOCK_CLASSES[type(block).__name__]
  want = block.state_dict()
  fused = "experts.gate_up_proj" in want  # transformers >= 5; older: per-expert linears
  got = hf.to_hf_state_dict(mt, config, params, as_torch=True,
                            layout="fused" if fused else "per_expert")
  assert set(got) == set(want)
  for k, v in want.items():
    assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
    torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
  if hf.FAMILIES[mt] not in ("gpt_oss", "llama4_text"):
    sd = hf.to_hf_state_dict(mt, config, params, "model.layers.4.mlp", layout="per_expert")
    _, back = hf.from_hf_state_dict(mt, hf_config, sd, "model.layers.4.mlp.")
    _assert_same_params(back, params)


def test_from_hf_module_finds_the_config():
  """Blocks of transformers >= 5 carry their config (on the experts): no need to pass it."""
  hf_config, block, _ = build("qwen2_moe")
  if not any(getattr(m, "config", None) is not None for m in block.modules()):
    pytest.skip("this transformers' blocks carry no config")
  assert hf.from_hf_module(block)[0] == hf.from_hf_module(block, hf_config)[0]


@pytest.mark.parametrize("case,overrides", [
    ("qwen3_vl_moe", {}),  # Qwen3-VL checkpoints store fused experts as [E, H, 2N] / [E, N, H]
    ("qwen3_moe", {"moe_intermediate_size": 16}),  # H == 2N: gate_up_proj's shape is ambiguous
])
def test_fused_checkpoint_in_x_at_w_order(case, overrides):
  hf_config, block, _ = build(case, **overrides)
  sd = dict(block.state_dict())
  if "experts.gate_up_proj" not in sd:
    pytest.skip("this transformers stores per-expert linears")
  _, want = hf.from_hf_module(block, hf_config)
  for k in ("experts.gate_up_proj", "experts.down_proj"):
    sd[k] = sd[k].transpose(1, 2)
  _, got = hf.from_hf_state_dict(None, hf_config, sd)
  _assert_same_params(got, want)


def test_config_dict_and_numpy_state_dict():
  """config.json as a plain dict, tensors as NumPy arrays (safetensors.numpy) work alike."""
  hf_config, block, x = build("qwen2_moe")
  want_cfg, want = hf.from_hf_module(block, hf_config)
  sd = {"model.layers.0.mlp." + k: v.numpy() for k, v in block.state_dict().items()}
  cfg, got = hf.from_hf_state_dict(None, hf_config.to_dict(), sd, "model.layers.0.mlp.")
  assert cfg == want_cfg
  _assert_same_params(got, want)


def test_llama4_multimodal_config_uses_text_config():
  cfg_cls, _, kw = _classes("llama4_text")
  wrapper_cls = getattr(transformers, "Llama4Config", None)
  if wrapper_cls is None:
    pytest.skip("transformers has no Llama4Config")
  want = hf.config_from_hf(None, cfg_cls(**kw))
  assert hf.config_from_hf(None, wrapper_cls(text_config=kw)) == want
  assert hf.config_from_hf("llama4", {"model_type": "llama4", "text_config": kw}) == want


def test_importing_jmoe_and_interop_does_not_import_torch():
  code = ("import sys, jmoe, interop, interop.hf; "
          "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "deepseek_v3", "llama4_text"])
def test_bfloat16_tensors_convert_exactly(case):
  hf_config, block, _ = build(case)
  _, p32 = hf.from_hf_module(block, hf_config)
  config, params = hf.from_hf_module(block.to(torch.bfloat16), hf_config)
  assert config.dtype == "bfloat16" and params.w13.dtype == jnp.bfloat16
  for f in ("w13", "w2", "shared_w13", "shared_w2"):
    a, b = getattr(params, f), getattr(p32, f)
    if b is not None:
      np.testing.assert_array_equal(np.asarray(a, np.float32),
                                    np.asarray(b.astype(jnp.bfloat16), np.float32), f)
  assert params.router_w.dtype == jnp.float32  # routers stay f32 (rounded to bf16 values)


@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_block(case):
  """End to end in bfloat16, to DESIGN.md's bf16 tolerance (2e-2; HF rounds its router logits
  and some intermediates to bf16 where jmoe keeps float32: about 5e-3 here)."""
  hf_config, block, x = build(case)
  block = block.to(torch.bfloat16)
  config, params = hf.from_hf_module(block, hf_config)
  assert config.dtype == "bfloat16" and params.w13.dtype == jnp.bfloat16
  xb = x.to(torch.bfloat16)
  want = hf_forward(block, xb)
  got = _block_jit(jnp.asarray(xb.reshape(-1, 32).float().numpy(), jnp.bfloat16), params,
                   config=config)
  assert got.dtype == jnp.bfloat16
  assert rel_err(np.asarray(got, np.float32), want) <= 2e-2


def test_mxfp4_dequant_matches_transformers():
  mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
  convert = getattr(mxfp4, "convert_moe_packed_tensors", None)
  if convert is None:
    pytest.skip("transformers has no convert_moe_packed_tensors")
  g = torch.Generator().manual_seed(3)
  blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)
  scales = torch.randint(120, 132, (3, 10, 2), generator=g, dtype=torch.uint8)
  want = convert(blocks, scales, dtype=torch.float32).numpy()  # [E, H, 2N]: transposed
  got = hf.dequant_mxfp4(blocks.numpy(), scales.numpy())  # [E, 2N, H]
  np.testing.assert_array_equal(np.swapaxes(got, 1, 2), want)


def _quantize_mxfp4(w: np.ndarray, g: np.random.Generator):
  """Random MXFP4 codes and scales for a [E, out, in] weight shape (values don't matter)."""
  e, o, i = w.shape
  blocks = g.integers(0, 256, (e, o, i // 32, 16), dtype=np.uint8)
  scales = g.integers(122, 126, (e, o, i // 32), dtype=np.uint8)
  return blocks, scales


def test_gpt_oss_mxfp4_checkpoint():
  """A gpt-oss checkpoint with MXFP4 experts: convert, and match the block holding the
  dequantized weights."""
  hf_config, block, x = build("gpt_oss", hidden_size=64, intermediate_size=32)
  e, h, n = 6, 64, 32
  g = np.random.default_rng(5)
  gu_blocks, gu_scales = _quantize_mxfp4(np.empty((e, 2 * n, h)), g)
  dn_blocks, dn_scales = _quantize_mxfp4(np.empty((e, h, n)), g)
  with torch.no_grad():  # the block gets the dequantized weights, in its own layout
    block.experts.gate_up_proj.copy_(torch.from_numpy(
        np.swapaxes(hf.dequant_mxfp4(gu_blocks, gu_scales), 1, 2).copy()))
    block.experts.down_proj.copy_(torch.from_numpy(
        np.swapaxes(hf.dequant_mxfp4(dn_blocks, dn_scales), 1, 2).copy()))
  want = hf_forward(block, x)
  prefix = "model.layers.0.mlp."
  sd = {prefix + k: v for k, v in block.state_dict().items()
        if k not in ("experts.gate_up_proj", "experts.down_proj")}
  sd.update({prefix + "experts.gate_up_proj_blocks": torch.from_numpy(gu_blocks),
             prefix + "experts.gate_up_proj_scales": torch.from_numpy(gu_scales),
             prefix + "experts.down_proj_blocks": torch.from_numpy(dn_blocks),
             prefix + "experts.down_proj_scales": torch.from_numpy(dn_scales)})
  # quantized="keep" (the default) keeps MXFP4 packed: tests/test_hf_quant.py
  config, params = hf.from_hf_state_dict("gpt_oss", hf_config, sd, prefix, quantized="dequantize")
  assert params.w13.dtype == jnp.bfloat16  # dequantized checkpoints default to bf16 ...
  config, params = hf.from_hf_state_dict("gpt_oss", hf_config, sd, prefix, dtype=jnp.float32,
                                         quantized="dequantize")
  got = _block_jit(jnp.asarray(x.reshape(-1, h).numpy()), params, config=config)
  assert rel_err(got, want) <= RTOL


def test_deepseek_fp8_block_checkpoint():
  """DeepSeek-V3's FP8 checkpoints: e4m3 weights + `weight_scale_inv` per 128x128 block."""
  if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("torch has no float8_e4m3fn")
  # N = 136 and H = 160: partial 128-blocks on both axes
  hf_config, block, x = build("deepseek_v3", hidden_size=160, moe_intermediate_size=136,
                              n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                              n_shared_experts=1)
  g = torch.Generator().manual_seed(11)
  prefix = "model.layers.5.mlp."
  sd, deq = {}, {}
  for name in [f"experts.{i}.{p}" for i in range(8) for p in ("gate_proj", "up_proj", "down_proj")
               ] + [f"shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]:
    out, inn = (160, 136) if name.endswith("down_proj") else (136, 160)
    w8 = (torch.randn(out, inn, generator=g) * 2).to(torch.float8_e4m3fn)
    s = torch.rand((out + 127) // 128, (inn + 127) // 128, generator=g) * 0.05 + 0.01
    sd[prefix + name + ".weight"], sd[prefix + name + ".weight_scale_inv"] = w8, s
    deq[name] = w8.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inn]
  with torch.no_grad():
    if hasattr(block.experts, "gate_up_proj"):  # transformers >= 5: fused [E, 2N, H], [E, H, N]
      block.experts.gate_up_proj.copy_(torch.stack(
          [torch.cat([deq[f"experts.{i}.gate_proj"], deq[f"experts.{i}.up_proj"]])
           for i in range(8)]))
      block.experts.down_proj.copy_(torch.stack([deq[f"experts.{i}.down_proj"] for i in range(8)]))
    else:  # per-expert nn.Linear
      for i in range(8):
        for p in ("gate_proj", "up_proj", "down_proj"):
          getattr(block.experts[i], p).weight.copy_(deq[f"experts.{i}.{p}"])
    for p in ("gate_proj", "up_proj", "down_proj"):
      getattr(block.shared_experts, p).weight.copy_(deq[f"shared_experts.{p}"])
  sd[prefix + "gate.weight"] = block.gate.weight.detach()
  sd[prefix + "gate.e_score_correction_bias"] = block.gate.e_score_correction_bias.detach()
  want = hf_forward(block, x)
  config, params = hf.from_hf_state_dict("deepseek_v3", hf_config, sd, prefix, dtype="float32",
                                         quantized="dequantize")  # partial 128-blocks
  got = _block_jit(jnp.asarray(x.reshape(-1, 160).numpy()), params, config=config)
  assert rel_err(got, want) <= RTOL


def _fp8_experts(block, e, names, shapes, scale_kind, g, dtype="fp8"):
  """Random e4m3 (dtype "int8": int8) expert linears with their scales as a checkpoint stores
  them (per-expert keys), the block loaded with the dequantized weights; -> (state dict part,
  dequantized)."""
  sd, deq = {}, {}
  for i in range(e):
    for nm, (out, inn) in zip(names, shapes):
      if dtype == "int8":
        w8 = torch.randint(-127, 128, (out, inn), generator=g, dtype=torch.int32).to(torch.int8)
      else:
        w8 = (torch.randn(out, inn, generator=g) * 2).to(torch.float8_e4m3fn)
      key = f"experts.{i}.{nm}"
      if scale_kind == "block":
        s = torch.rand(out // 128, inn // 128, generator=g) * 0.05 + 0.01
        sd[key + ".weight_scale_inv"] = s
        full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
      elif scale_kind == "tensor":
        s = torch.rand((), generator=g) * 0.05 + 0.01
        sd[key + ".weight_scale"] = s
        full = s
      else:  # channel
        s = torch.rand(out, 1, generator=g) * 0.05 + 0.01
        sd[key + ".weight_scale"] = s
        full = s
      sd[key + ".weight"] = w8
      deq[key] = w8.float() * full
  return sd, deq


def _load_dequantized_into(block, deq, e, names):
  with torch.no_grad():
    if hasattr(block.experts, "gate_up_proj"):  # transformers >= 5: fused [E, 2N, H], [E, H, N]
      block.experts.gate_up_proj.copy_(torch.stack(
          [torch.cat([deq[f"experts.{i}.{names[0]}"], deq[f"experts.{i}.{names[1]}"]])
           for i in range(e)]))
      block.experts.down_proj.copy_(torch.stack([deq[f"experts.{i}.{names[2]}"]
                                                 for i in range(e)]))
    else:
      for i in range(e):
        for nm, attr in zip(names, ("gate_proj", "up_proj", "down_proj")):
          getattr(block.experts[i], attr).weight.copy_(deq[f"experts.{i}.{nm}"])


@pytest.mark.parametrize("case,scale_kind", [("deepseek_v3", "block"), ("mixtral", "tensor"),
                                             ("mixtral", "channel")])
def test_fp8_checkpoint_stays_quantized(case, scale_kind):
  """FP8 checkpoints load as QuantizedWeights (the stored e4m3 bytes and scales, no
  dequantized copy) and run W8A8: within fp8 activation rounding of the transformers block
  holding the dequantized weights; equal to jmoe's dequantized load up to that rounding."""
  from jmoe.quant import QuantizedWeights
  h, n, e = 256, 128, 4
  if case == "deepseek_v3":
    hf_config, block, x = build(case, hidden_size=h, moe_intermediate_size=n, n_routed_experts=e,
                                n_group=2, topk_group=1, num_experts_per_tok=2,
                                n_shared_experts=1)
    names = ("gate_proj", "up_proj", "down_proj")
    extra = {"gate.weight": block.gate.weight.detach(),
             "gate.e_score_correction_bias": block.gate.e_score_correction_bias.detach()}
    for p in ("gate_proj", "up_proj", "down_proj"):
      extra[f"shared_experts.{p}.weight"] = getattr(block.shared_experts, p).weight.detach()
  else:
    hf_config, block, x = build(case, hidden_size=h, intermediate_size=n, num_local_experts=e)
    names = ("w1", "w3", "w2")
    extra = {"gate.weight": block.gate.weight.detach()}
  g = torch.Generator().manual_seed(5)
  sd, deq = _fp8_experts(block, e, names, [(n, h), (n, h), (h, n)], scale_kind, g)
  _load_dequantized_into(block, deq, e, names)
  prefix = "model.layers.1.mlp."
  sd = {prefix + k: v for k, v in {**sd, **extra}.items()}
  want = hf_forward(block, x)
  config, params = hf.from_hf_state_dict(case, hf_config, sd, prefix, dtype="float32")
  assert isinstance(params.w13, QuantizedWeights) and isinstance(params.w2, QuantizedWeights)
  assert params.w13.scheme.name == ("fp8_block" if scale_kind == "block" else "fp8_channel")
  stored = sd[prefix + f"experts.2.{names[1]}.weight"].view(torch.uint8).numpy()
  np.testing.assert_array_equal(np.asarray(params.w13.values[2, n:]).view(np.uint8), stored)
  x2 = jnp.asarray(x.reshape(-1, h).numpy())
  got = _block_jit(x2, params, config=config)
  assert rel_err(got, want) <= 6e-2, "fp8 activation rounding (W8A8) vs the dequantized block"
  _, dense = hf.from_hf_state_dict(case, hf_config, sd, prefix, dtype="float32",
                                   quantized="dequantize")
  assert rel_err(_block_jit(x2, dense, config=config), want) <= RTOL


@pytest.mark.parametrize("dtype", ["fp8", pytest.param("int8", marks=pytest.mark.slow)])
def test_static_checkpoint_runs_its_input_scales(dtype):
  """A per-tensor FP8 export with activation_scheme "static" (every expert linear has an
  `input_scale`, each expert its own; int8: compressed-tensors' static W8A8 with per-channel
  weight scales) loads as fp8_channel_static / int8_static with one input scale per GEMM, the
  largest over the experts (and over gate / up): the block matches a float64 oracle that
  quantizes with exactly those scales, and the transformers block holding the dequantized
  weights within 8-bit activation rounding. Without the input scales: the dynamic scheme."""
  import oracle_np as onp
  from jmoe.quant import QuantizedWeights
  h, n, e = 256, 128, 4
  names = ("w1", "w3", "w2")
  act_dtype, qmax = ("int8", 127.0) if dtype == "int8" else ("float8_e4m3fn", 448.0)
  hf_config, block, x = build("mixtral", hidden_size=h, intermediate_size=n, num_local_experts=e)
  g = torch.Generator().manual_seed(8)
  sd, deq = _fp8_experts(block, e, names, [(n, h), (n, h), (h, n)],
                         "channel" if dtype == "int8" else "tensor", g, dtype=dtype)
  if dtype == "int8":  # int8 codes span 127 levels: smaller scales keep the weights' size
    for key in [k for k in sd if k.endswith(".weight_scale")]:
      sd[key] = sd[key] * 0.05
      deq[key[:-len(".weight_scale")]] = sd[key[:-len("_scale")]].float() * sd[key]
  amax_x = float(x.abs().max())
  s1 = {i: amax_x / qmax * (0.9 + 0.1 * i) for i in range(e)}  # expert 3 calibrated widest
  inter = max(float(((x.reshape(-1, h) @ deq[f"experts.{i}.w1"].T).sigmoid()
                      * (x.reshape(-1, h) @ deq[f"experts.{i}.w1"].T)
                      * (x.reshape(-1, h) @ deq[f"experts.{i}.w3"].T)).abs().max())
              for i in range(e))  # every token through every expert: the widest range
  s2 = {i: inter / qmax * (1.0 + 0.05 * (i % 3)) for i in range(e)}
  for i in range(e):
    sd[f"experts.{i}.w1.input_scale"] = torch.tensor(s1[i])
    sd[f"experts.{i}.w3.input_scale"] = torch.tensor(s1[i] * 0.95)
    sd[f"experts.{i}.w2.input_scale"] = torch.tensor(s2[i])
  _load_dequantized_into(block, deq, e, names)
  prefix = "model.layers.0.block_sparse_moe."
  sd = {prefix + k: v for k, v in {**sd, "gate.weight": block.gate.weight.detach()}.items()}
  config, params = hf.from_hf_state_dict("mixtral", hf_config, sd, prefix, dtype="float32")
  static_name = "int8_static" if dtype == "int8" else "fp8_channel_static"
  assert isinstance(params.w13, QuantizedWeights) and params.w13.scheme.name == static_name
  want_s13, want_s2 = np.float32(max(s1.values())), np.float32(max(s2.values()))
  assert float(params.w13.input_scale[0]) == want_s13
  assert float(params.w2.input_scale[0]) == want_s2
  x2 = np.asarray(x.reshape(-1, h).numpy())
  tw, ids = onp.random_topk(np.random.default_rng(3), x2.shape[0], e, 2)
  got = jmoe.fused_moe(jnp.asarray(x2), params.w13, params.w2, jnp.asarray(tw),
                       jnp.asarray(ids))
  d13, d2 = (np.asarray(w.dequantize(jnp.float32), np.float64) for w in (params.w13, params.w2))
  ref = onp.fused_moe(onp.quantize_static(x2, act_dtype, want_s13), d13, d2, tw, ids,
                      requant=lambda a: onp.quantize_static(a, act_dtype, want_s2))
  onp.assert_rel_close(np.asarray(got, np.float32), ref, 1e-5, f"static {dtype} vs oracle")
  block_out = _block_jit(jnp.asarray(x2), params, config=config)
  assert rel_err(block_out, hf_forward(block, x)) <= 6e-2
  dynamic = dict(hf_config.to_dict(), quantization_config={"quant_method": "fp8",
                                                            "activation_scheme": "dynamic"})
  _, dyn = hf.from_hf_state_dict("mixtral", type(hf_config)(**dynamic), sd, prefix,
                                 dtype="float32")
  assert dyn.w13.scheme.name == ("int8" if dtype == "int8" else "fp8_channel")
  assert dyn.w13.input_scale is None
  partial = {k: v for k, v in sd.items() if not k.endswith("experts.2.w2.input_scale")}
  with pytest.raises(ValueError, match="11 of 12 expert linears have an input_scale"):
    hf.from_hf_state_dict("mixtral", hf_config, partial, prefix)


def test_fp8_checkpoint_bad_scales_name_the_tensor():
  hf_config, block, x = build("mixtral", hidden_size=256, intermediate_size=128,
                              num_local_experts=2)
  g = torch.Generator().manual_seed(6)
  sd, _ = _fp8_experts(block, 2, ("w1", "w3", "w2"), [(128, 256), (128, 256), (256, 128)],
                       "block", g)
  sd["gate.weight"] = block.gate.weight.detach()
  bad = dict(sd)
  bad["experts.1.w3.weight_scale_inv"] = torch.ones(2, 2)
  with pytest.raises(ValueError, match=r"experts.1.w3.weight_scale_inv has shape \(2, 2\), "
                                       r"expected \(1, 2\) for experts.1.w3.weight \(128, 256\)"):
    hf.from_hf_state_dict("mixtral", hf_config, bad, "")
  del bad["experts.1.w3.weight_scale_inv"]
  with pytest.raises(KeyError, match=r"the scale of FP8 weight experts.1.w3.weight"):
    hf.from_hf_state_dict("mixtral", hf_config, bad, "")
  asym = dict(sd, **{"experts.0.w1.weight_zero_point": torch.zeros(128, 1)})
  with pytest.raises(ValueError, match=r"experts.0.w1.weight_zero_point: asymmetric 8-bit"):
    hf.from_hf_state_dict("mixtral", hf_config, asym, "")


def test_whole_model_safetensors(tmp_path):
  """A tiny whole Mixtral model saved as safetensors: find its MoE blocks, convert, compare."""
  st = pytest.importorskip("safetensors.numpy")
  cfg_cls, _, kw = _classes("mixtral")
  model_cls = getattr(transformers, "MixtralForCausalLM", None)
  if model_cls is None:
    pytest.skip("transformers has no MixtralForCausalLM")
  hf_config = cfg_cls(**kw, num_hidden_layers=2, vocab_size=64)
  model = model_cls(hf_config).eval()
  _randomize(model, 7)
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  path = tmp_path / "model.safetensors"
  st.save_file(sd, str(path))
  loaded = st.load_file(str(path))
  prefixes = hf.moe_layer_prefixes(loaded)
  assert len(prefixes) == 2, prefixes
  x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
  for i, prefix in enumerate(prefixes):
    config, params = hf.from_hf_state_dict(None, hf_config, loaded, prefix)
    layer = model.model.layers[i]
    want = hf_forward(getattr(layer, "mlp", None) or layer.block_sparse_moe, x)
    got = _block_jit(jnp.asarray(x.reshape(-1, 32).numpy()), params, config=config)
    assert rel_err(got, want) <= RTOL


# --------------------------------------------------------------------------------------------
# errors


def test_unknown_model_type_names_the_supported_ones():
  with pytest.raises(ValueError, match="supported: mixtral"):
    hf.config_from_hf("switch_transformers", {"num_experts": 4})


def test_missing_tensor_names_the_prefix_and_keys():
  hf_config, block, _ = build("mixtral")
  sd = dict(block.state_dict())
  del sd["gate.weight"]
  with pytest.raises(KeyError, match="router weight"):
    hf.from_hf_state_dict("mixtral", hf_config, sd)
  with pytest.raises(KeyError, match="model.layers.7.mlp."):
    hf.from_hf_state_dict("mixtral", hf_config, {}, "model.layers.7.mlp.")


def test_shape_mismatch_raises():
  hf_config, block, _ = build("qwen3_moe")
  sd = dict(block.state_dict())
  key = "experts.down_proj" if "experts.down_proj" in sd else "experts.1.down_proj.weight"
  sd[key] = sd[key][..., :-1]
  with pytest.raises(ValueError, match=key):
    hf.from_hf_state_dict("qwen3_moe", hf_config, sd)


def test_llama4_top_k_above_one_is_refused():
  cfg_cls, _, kw = _classes("llama4_text")
  with pytest.raises(ValueError, match="top_k == 1"):
    hf.config_from_hf(None, cfg_cls(**{**kw, "num_experts_per_tok": 2}))


def test_unknown_activation_raises():
  cfg_cls, _, kw = _classes("mixtral")
  with pytest.raises(ValueError, match="hidden_act"):
    hf.config_from_hf("mixtral", cfg_cls(**kw, hidden_act="relu"))
