"""Loading Hugging Face safetensors checkpoints lazily (`jmoe.interop.checkpoints`).

Each family's tiny checkpoint is written by transformers' own `save_pretrained` from a random
tiny config (weights ~ N(0, 0.2²), so routing is not degenerate), then loaded with jmoe and
compared with the transformers model on the same input (float32, <= 1e-4 relative):
every MoE block against the HF block, and for the families whose attention the reference model
shares (Mixtral, Qwen3-MoE) the whole model's logits against `...ForCausalLM`. Also: only the
loaded layer's tensors are read, sharded checkpoints (index json), DeepSeek FP8 experts stay
quantized, and missing / mis-shaped tensors raise naming the tensor and both shapes.
"""
from __future__ import annotations

import json
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
safetensors_torch = pytest.importorskip("safetensors.torch")

from flax import nnx  # noqa: E402

import jmoe  # noqa: E402
from jmoe.interop import checkpoints as ck  # noqa: E402
from jmoe.interop import hf  # noqa: E402

RTOL = 1e-4
_COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)
# family -> (config class, kwargs, MoE layer index to compare)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=4,
                                      num_experts_per_tok=2), 1),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=48, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24, num_experts=6,
                                         num_experts_per_tok=2), 1),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=48, moe_intermediate_size=16,
                                         head_dim=8, num_experts=6, num_experts_per_tok=3,
                                         norm_topk_prob=True), 1),
    "deepseek_v3": ("DeepseekV3Config", dict(
        intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1, routed_scaling_factor=2.5), 1),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=24, head_dim=8, num_local_experts=4,
                                     num_experts_per_tok=2, swiglu_limit=1.5), 1),
}
FULL_MODEL = ("mixtral", "qwen3_moe")  # attention shared with the reference model
_slow = pytest.mark.slow


def _seed(name: str) -> int:
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _write(family: str, directory, **overrides):
  """The HF model of `family` (randomized, eval mode), saved by save_pretrained."""
  cfg_name, kw, _ = FAMILIES[family]
  cfg = getattr(transformers, cfg_name)(**{**_COMMON, **kw, **overrides})
  torch.manual_seed(_seed(family))
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  g = torch.Generator().manual_seed(_seed(family))
  with torch.no_grad():
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
      # (not the rotary inv_freq buffers: they are not in the checkpoint)
      if t.is_floating_point() and (name in dict(model.named_parameters())
                                    or "correction_bias" in name):
        std = 0.05 if "correction_bias" in name else 0.2
        t.copy_(torch.randn(t.shape, generator=g) * std)
  model.save_pretrained(directory)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """family -> (directory, HF model); each written once per module."""
  cache = {}

  def get(family):
    if family not in cache:
      d = tmp_path_factory.mktemp(family)
      cache[family] = (str(d), _write(family, d))
    return cache[family]

  return get


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _hf_block(model, i: int, x: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    y = model.model.layers[i].mlp(torch.from_numpy(x)[None])
  y = y[0] if isinstance(y, tuple) else y
  return y.reshape(x.shape).numpy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_layer_matches_hf_block(saved, family, rng):
  """load_moe_layer(dir, i) == the transformers model's MoE block i on the same tokens, and
  only that block's tensors are read."""
  path, model = saved(family)
  i = FAMILIES[family][2]
  with ck.SafetensorsCheckpoint(path) as ckpt:
    layer = ck.load_moe_layer(ckpt, i)
    prefix = ck.moe_prefixes(ckpt)[i]
    assert ckpt.reads, "nothing was read"
    assert all(k.startswith(prefix) for k in ckpt.reads), ckpt.reads
    layer_keys = [k for k in ckpt if k.startswith(prefix)]
    assert set(ckpt.reads) == set(layer_keys)  # that block's tensors and no others
    # each once, but for hf.from_hf_state_dict's dtype probes of expert 0 (<= 2 re-reads)
    assert len(ckpt.reads) <= len(layer_keys) + 2
  assert isinstance(layer, jmoe.layers.MoE)
  assert layer.params().w13.dtype == jnp.float32
  for t in ((1, 5) if family == "mixtral" else (5,)):  # (one compile per shape: T=1 once)
    x = rng.standard_normal((t, 32)).astype(np.float32)
    got = np.asarray(layer(jnp.asarray(x)))
    assert _rel(got, _hf_block(model, i, x)) <= RTOL


@_slow  # README's checkpoint block checks qwen3-moe's logits in the lean tier
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_transformer_logits_match_hf(saved, family, rng):
  """load_transformer loads every tensor of a Mixtral / Qwen3-MoE checkpoint; the reference
  model's logits equal the transformers model's."""
  path, model = saved(family)
  jm, report = ck.load_transformer(path)
  assert report.attention_loaded and not report.skipped and not report.notes
  with ck.SafetensorsCheckpoint(path) as ckpt:
    assert report.loaded == sorted(ckpt)
  tokens = rng.integers(0, 64, (2, 6))
  logits, aux = jm(jnp.asarray(tokens))
  with torch.no_grad():
    want = model(torch.from_numpy(tokens)).logits.numpy()
  assert logits.shape == want.shape
  assert _rel(logits, want) <= RTOL
  assert aux["expert_load"].shape == (2, jm.cfg.moe.num_experts)


@pytest.mark.parametrize("family", [pytest.param("qwen2_moe", marks=_slow), "deepseek_v3",
                                    pytest.param("gpt_oss", marks=_slow)])
def test_transformer_moe_layers_only(saved, family, rng):
  """Families whose attention the reference model lacks: every MoE block (and DeepSeek's dense
  first layer, the embeddings, norms and lm_head) loads, the attention tensors are skipped
  and reported; each MoE layer of the model equals the HF block."""
  path, model = saved(family)
  jm, report = ck.load_transformer(path)
  assert not report.attention_loaded and report.notes
  assert report.skipped and all(".self_attn." in k for k in report.skipped)
  assert "model.embed_tokens.weight" in report.loaded and "lm_head.weight" in report.loaded
  x = rng.standard_normal((5, 32)).astype(np.float32)
  for i, layer in enumerate(jm.layers):
    if layer.is_moe:
      assert _rel(layer.ffn(jnp.asarray(x)), _hf_block(model, i, x)) <= RTOL
    else:  # DeepSeek's dense first layer
      assert _rel(layer.ffn(jnp.asarray(x)), _hf_block(model, i, x)) <= RTOL
  np.testing.assert_array_equal(np.asarray(jm.embed.embedding[...]),
                                model.model.embed_tokens.weight.detach().numpy())


def test_sharded_checkpoint_reads_one_layer(tmp_path, rng):
  """A checkpoint split into shards (index json): loading layer 1 opens headers only and reads
  exactly that layer's tensors, whichever shard holds them."""
  model = _write("qwen3_moe", tmp_path, num_hidden_layers=3)
  sd = {k: v.contiguous() for k, v in model.state_dict().items()}
  for f in os.listdir(tmp_path):
    if f.endswith(".safetensors"):
      os.remove(tmp_path / f)
  names = sorted(sd)
  shards = [names[:len(names) // 3], names[len(names) // 3: 2 * len(names) // 3],
            names[2 * len(names) // 3:]]
  weight_map = {}
  for j, part in enumerate(shards):
    fname = f"model-{j + 1:05d}-of-00003.safetensors"
    safetensors_torch.save_file({k: sd[k] for k in part}, str(tmp_path / fname))
    weight_map.update({k: fname for k in part})
  (tmp_path / ck.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  ckpt = ck.SafetensorsCheckpoint(tmp_path)
  assert len(ckpt.files) == 3 and set(ckpt) == set(sd)
  layer = ck.load_moe_layer(ckpt, 1)
  assert ckpt.reads and all(k.startswith("model.layers.1.mlp.") for k in ckpt.reads)
  assert ckpt.shape("model.embed_tokens.weight") == (64, 32)  # header only: not a read
  assert "model.embed_tokens.weight" not in ckpt.reads
  x = rng.standard_normal((3, 32)).astype(np.float32)
  assert _rel(layer(jnp.asarray(x)), _hf_block(model, 1, x)) <= RTOL
  ckpt.close()


def test_fp8_experts_load_quantized(tmp_path, rng):
  """DeepSeek-style FP8 experts (e4m3 weights + weight_scale_inv 128x128 blocks) written to a
  safetensors file load as a quantized layer (QuantizedWeights holding the stored bytes, not a
  dequantized copy) whose output matches the dequantized weights' through moe_block."""
  import ml_dtypes

  h, n, e = 128, 128, 4
  cfg = dict(model_type="deepseek_v3", hidden_size=h, moe_intermediate_size=n,
             n_routed_experts=e, num_experts_per_tok=2, n_group=1, topk_group=1,
             n_shared_experts=0, routed_scaling_factor=1.0, norm_topk_prob=True,
             quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  p = "model.layers.0.mlp."
  tensors = {p + "gate.weight": torch.from_numpy(rng.standard_normal((e, h), np.float32)),
             p + "gate.e_score_correction_bias": torch.zeros(e)}
  for i in range(e):
    for name, shape in (("gate_proj", (n, h)), ("up_proj", (n, h)), ("down_proj", (h, n))):
      w = (rng.standard_normal(shape) * 0.5).astype(ml_dtypes.float8_e4m3fn)
      tensors[f"{p}experts.{i}.{name}.weight"] = torch.from_numpy(
          w.view(np.uint8)).view(torch.float8_e4m3fn)
      tensors[f"{p}experts.{i}.{name}.weight_scale_inv"] = torch.from_numpy(
          rng.uniform(0.01, 0.02, (shape[0] // 128, shape[1] // 128)).astype(np.float32))
  safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
  layer = ck.load_moe_layer(tmp_path, 0)
  w13 = layer.params().w13
  assert isinstance(w13, jmoe.quant.QuantizedWeights) and w13.scheme.name == "fp8_block"
  assert w13.values.dtype == jnp.float8_e4m3fn
  cfg_d, params_d = ck.load_moe_params(tmp_path, 0, quantized="dequantize", dtype=jnp.float32)
  x = jnp.asarray(rng.standard_normal((5, h)), jnp.float32)
  want = jmoe.moe_block(x, params_d, cfg_d, runner_backend="xla")
  cfg_q, params_q = ck.load_moe_params(tmp_path, 0)  # kept quantized
  got = layer(x)
  assert _rel(got, jmoe.moe_block(x, params_q, cfg_q)) <= 1e-5  # the layer runs those bytes
  assert _rel(got, want) <= 6e-2  # W8A8 activation rounding vs the dequantized f32 block


# --------------------------------------------------------------------------------------------
# errors


def _copy_with(src_dir, dst_dir, change):
  """Copy a saved checkpoint, with `change(dict of tensors)` applied."""
  with ck.SafetensorsCheckpoint(src_dir) as ckpt:
    sd = {k: ckpt[k] for k in ckpt}
  change(sd)
  safetensors_torch.save_file(sd, os.path.join(dst_dir, "model.safetensors"))
  with open(os.path.join(src_dir, "config.json")) as f:
    (dst_dir / "config.json").write_text(f.read())


@pytest.mark.parametrize("key, shape", [
    ("model.layers.1.block_sparse_moe.experts.2.w1.weight", (48, 31)),
    ("model.layers.1.block_sparse_moe.gate.weight", (5, 32)),
])
def test_misshaped_tensor_names_it_and_both_shapes(saved, tmp_path, key, shape):
  path, _ = saved("mixtral")
  _copy_with(path, tmp_path, lambda sd: sd.__setitem__(key, torch.zeros(shape)))
  with pytest.raises(ValueError) as err:
    ck.load_moe_layer(tmp_path, 1)
  msg = str(err.value)
  want = {"w1": (48, 32), "gate": (4, 32)}["w1" if "w1" in key else "gate"]
  assert key in msg and str(shape) in msg and str(want) in msg


def test_misshaped_model_tensor(saved, tmp_path):
  path, _ = saved("qwen3_moe")
  key = "model.layers.0.self_attn.q_proj.weight"
  _copy_with(path, tmp_path, lambda sd: sd.__setitem__(key, torch.zeros(16, 32)))
  with pytest.raises(ValueError, match=r"q_proj\.weight.*\(16, 32\).*\(32, 32\)"):
    ck.load_transformer(tmp_path)


@pytest.mark.parametrize("key", ["model.layers.1.mlp.experts.3.up_proj.weight",
                                 "model.layers.1.mlp.gate.weight",
                                 "model.layers.0.post_attention_layernorm.weight"])
def test_missing_tensor_is_named(saved, tmp_path, key):
  path, _ = saved("qwen3_moe")
  _copy_with(path, tmp_path, lambda sd: sd.pop(key))
  with pytest.raises(KeyError) as err:
    ck.load_transformer(tmp_path)
  assert key in str(err.value) or "layers.1" in str(err.value)


def test_bad_arguments(saved, tmp_path):
  path, _ = saved("deepseek_v3")
  with pytest.raises(KeyError, match=r"decoder layer 0 has no MoE block.*\[1\]"):
    ck.load_moe_layer(path, 0)  # DeepSeek's first layer is dense
  with pytest.raises(TypeError, match="layer must be"):
    ck.load_moe_layer(path, 1.0)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    ck.SafetensorsCheckpoint(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="neither"):
    ck.SafetensorsCheckpoint(tmp_path)
  with pytest.raises(KeyError, match="not in the checkpoint"):
    ck.SafetensorsCheckpoint(path)["model.nothing"]
