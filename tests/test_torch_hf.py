"""jmoe.interop.torch: transformers MoE blocks run by jmoe from torch — `from_hf` per block
(seven families, same outputs, shapes and dtypes), `replace_moe_blocks` on tiny random
`...ForCausalLM` models (same logits, same greedy tokens), `set_experts_implementation("jmoe")`
(same logits as transformers' default experts), and `jmoe.interop` staying torch-free."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jmoe.interop import torch as jt  # noqa: E402
from jmoe.interop import torch_bridge as tb  # noqa: E402
from test_hf_parity import build  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "olmoe", "llama4_text"]


def _rel(a, b) -> float:
  a, b = a.detach().double(), b.detach().double()
  return float((a - b).norm() / b.norm())


def test_importing_jmoe_interop_does_not_import_torch():
  code = "import sys, jmoe.interop; assert 'torch' not in sys.modules, 'torch imported'"
  subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("case", FAMILIES)
def test_from_hf_returns_what_the_block_returns(case):
  hf_config, block, x = build(case)
  ours = jt.from_hf(block, hf_config, runner_backend="xla")
  with torch.no_grad():
    want, got = block(x), ours(x)
  want = want if isinstance(want, tuple) else (want,)
  got = got if isinstance(got, tuple) else (got,)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    assert _rel(g, w) < 1e-4, (case, _rel(g, w))


def test_unsupported_block_raises_type_error_naming_it():
  with pytest.raises(TypeError, match="Linear is not a supported"):
    jt.from_hf(torch.nn.Linear(4, 4))


# --------------------------------------------------------------------------------------------
# whole models

_ATTN = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=24, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                         num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                         first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         routed_scaling_factor=2.0, num_key_value_heads=4)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                     layer_types=["full_attention", "sliding_attention"], sliding_window=8)),
}


def _model(case: str):
  cfg_name, model_name, kw = MODELS[case]
  cfg_cls, model_cls = getattr(transformers, cfg_name, None), getattr(transformers, model_name,
                                                                       None)
  if cfg_cls is None or model_cls is None:
    pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
  torch.manual_seed(0)
  model = model_cls(cfg_cls(**{**_ATTN, **kw})).eval()
  with torch.no_grad():  # visible routing: bigger than the default init
    for name, p in model.named_parameters():
      if "experts" in name or "gate" in name or "router" in name:
        p.normal_(0, 0.2)
  ids = torch.randint(0, _ATTN["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
  return model, ids


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_replace_moe_blocks_same_logits_and_tokens(case):
  model, ids = _model(case)
  with torch.no_grad():
    want = model(ids).logits
    want_tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
  names = jt.replace_moe_blocks(model, runner_backend="xla")
  assert names and all(isinstance(model.get_submodule(n), jt.JmoeHFBlock) for n in names)
  with torch.no_grad():
    got = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
  assert _rel(got, want) < 1e-4
  assert torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_set_experts_implementation_jmoe(case):
  """Qwen3: concatenated [E, 2N, H] weights; gpt-oss: interleaved, transposed, with biases."""
  model, ids = _model(case)
  if not hasattr(model, "set_experts_implementation"):
    pytest.skip("this transformers has no set_experts_implementation")
  with torch.no_grad():
    want = model(ids).logits
  model.set_experts_implementation("jmoe")
  assert model.config._experts_implementation == "jmoe"
  calls = tb.STATS["forwards"]
  with torch.no_grad():
    got = model(ids).logits
  assert tb.STATS["forwards"] == calls + model.config.num_hidden_layers  # jmoe ran the experts
  assert _rel(got, want) < 1e-4
  # trains through jmoe: gradients reach the experts and (through the weights) the router
  model.zero_grad()
  model(ids, labels=ids).loss.backward()
  experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
  assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0
  router = next(p for n, p in model.named_parameters()
                if n.endswith(("mlp.gate.weight", "mlp.router.weight")))
  assert router.grad is not None and router.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["replace_moe_blocks", "set_experts_implementation"])
def test_compiled_model_fullgraph_one_jmoe_node_per_layer(mode):
  model, ids = _model("qwen3_moe")
  with torch.no_grad():
    want = model(ids).logits
  if mode == "replace_moe_blocks":
    jt.replace_moe_blocks(model, runner_backend="xla")
  else:
    model.set_experts_implementation("jmoe")
  graphs = []

  def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward

  compiled = torch.compile(model, fullgraph=True, backend=backend)  # a graph break raises
  with torch.no_grad():
    got = compiled(ids).logits
  nodes = [n for g in graphs for n in g.graph.nodes
           if n.op == "call_function" and "jmoe" in str(n.target)]
  assert len(graphs) == 1 and len(nodes) == model.config.num_hidden_layers
  assert _rel(got, want) < 1e-4


def test_prepare_experts_crosses_without_relayout_and_keeps_gradients():
  model, ids = _model("qwen3_moe")
  model.zero_grad()
  model(ids, labels=ids).loss.backward()  # transformers' default experts
  experts = model.model.layers[0].mlp.experts
  want_grad = experts.gate_up_proj.grad.clone()
  with torch.no_grad():
    want = model(ids).logits
  model.set_experts_implementation("jmoe")
  assert jt.prepare_experts(model) == model.config.num_hidden_layers
  w = experts.gate_up_proj
  assert not w.is_contiguous() and w.transpose(1, 2).is_contiguous()
  with torch.no_grad():
    got = model(ids).logits
  assert _rel(got, want) < 1e-4
  # zero-copy, converted once: what JAX holds is the parameter's own memory
  key, attrs, swap = jt._experts_key(experts)
  assert swap and key.startswith("hf_experts:1:")
  conversions = tb.STATS["conversions"]
  with torch.no_grad():
    model(ids)
  assert tb.STATS["conversions"] == conversions
  view = experts.__dict__["_jmoe_views"][0]
  assert tb.CACHE.get(view).unsafe_buffer_pointer() == w.data_ptr()
  model.zero_grad()
  model(ids, labels=ids).loss.backward()
  assert _rel(experts.gate_up_proj.grad, want_grad) < 1e-4
