"""jmoe inside PyTorch / Hugging Face transformers models (imports torch; `jmoe.interop` does
not).

Three ways in, from the most to the least of the block jmoe runs:

* `from_hf(block)`: a transformers MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
  DeepSeek-V3, gpt-oss, Llama 4, and the families sharing their semantics, see
  `jmoe.interop.hf.BLOCK_CLASSES`) -> a torch module computing the same thing with jmoe
  (router, experts and shared experts), returning what the block returns (a tensor, or
  gpt-oss's `(hidden, router_scores)` / Llama 4's `(hidden [T, H], router_logits)`).
* `replace_moe_blocks(model)`: `from_hf` on every supported block of a model, in place.
* `model.set_experts_implementation("jmoe")` (transformers >= 5; registered when this module is
  imported): transformers keeps its router and calls jmoe for the experts only, reading the
  experts module's layout flags (concatenated or interleaved gate/up, transposed, biases).
  Torch-Linear-order weights are transposed inside each call unless `prepare_experts(model)`
  stored them in jmoe's memory order once.

All three go through `jmoe.interop.torch_bridge` (zero-copy DLPack, weights converted once,
forward-only calls without residuals, the `jmoe::fused_moe` custom op under `torch.compile`).
Not carried over: transformers' router-logit recording (`output_router_logits=True`) for
replaced blocks, expert parallelism of transformers' own (`_is_expert_parallel`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from jmoe.interop import hf
from jmoe.interop.torch_bridge import BridgeSpec, JmoeMoE, register_resolver, run

__all__ = ["JmoeHFBlock", "from_hf", "jmoe_experts_forward", "prepare_experts",
           "register_experts_implementation", "replace_moe_blocks"]


# --------------------------------------------------------------------------------------------
# whole blocks


class JmoeHFBlock(torch.nn.Module):
  """A transformers MoE block run by jmoe: forward(hidden_states [B, S, H] or [T, H]) returns
  what the replaced block returns (same shapes and dtypes).

  `moe` is the `JmoeMoE` holding the parameters (router_w [H, E], w13 [E, H, 2N], ...).
  """

  def __init__(self, moe: JmoeMoE, family: str, block_class: str):
    super().__init__()
    self.moe = moe
    self.family = family
    self.block_class = block_class
    self.top_k = moe.config.top_k

  def forward(self, hidden_states: torch.Tensor):
    y = self.moe(hidden_states)
    if self.family == "gpt_oss":  # (hidden [B, S, H], router_scores [T, k]) as GptOssMLP
      return y, self._gpt_oss_router_scores(hidden_states)
    if self.family == "llama4_text":  # (out [T, H], router_logits [T, E]) as Llama4TextMoe
      return y.reshape(-1, y.shape[-1]), self._router_logits(hidden_states)
    return y

  def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
    """[T, E] x @ router_w (+ router_b), in x's dtype (as the HF routers' Linear)."""
    x2 = x.reshape(-1, x.shape[-1])
    w = self.moe.router_w.to(x2.dtype)
    b = getattr(self.moe, "router_b", None)
    return torch.addmm(b.to(x2.dtype), x2, w) if b is not None else x2 @ w

  def _gpt_oss_router_scores(self, x: torch.Tensor) -> torch.Tensor:
    """[T, k] softmax over the top-k router logits (GptOssTopKRouter)."""
    top, _ = torch.topk(self._router_logits(x), self.top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype)

  def extra_repr(self) -> str:
    return f"replaces={self.block_class}, family={self.family}"


def _check_block(block: Any) -> str:
  name = type(block).__name__
  if not isinstance(block, torch.nn.Module) or name not in hf.BLOCK_CLASSES:
    raise TypeError(f"block: {name} is not a supported transformers MoE block; supported: "
                    f"{', '.join(sorted(hf.BLOCK_CLASSES))}")
  return hf.BLOCK_CLASSES[name]


def from_hf(block: torch.nn.Module, hf_config: Any = None, *, dtype=None,
            runner_backend: Optional[str] = None) -> JmoeHFBlock:
  """A transformers MoE block -> `JmoeHFBlock` on the block's device, in its dtype (or
  `dtype`); raises TypeError naming the class of an unsupported block."""
  model_type = _check_block(block)
  config, params = hf.from_hf_module(block, hf_config, model_type, dtype=dtype)
  device = next(block.parameters()).device
  moe = JmoeMoE(config, params, runner_backend=runner_backend, device=device)
  return JmoeHFBlock(moe, hf.FAMILIES[hf.resolve_model_type(model_type)], type(block).__name__)


def replace_moe_blocks(model: torch.nn.Module, *, dtype=None,
                       runner_backend: Optional[str] = None) -> list[str]:
  """Swap every supported MoE block of `model` for a `JmoeHFBlock`, in place; returns the
  replaced modules' names (e.g. ["model.layers.0.mlp", ...])."""
  if not isinstance(model, torch.nn.Module):
    raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
  hf_config = getattr(model, "config", None)
  found = [(name, m) for name, m in model.named_modules()
           if type(m).__name__ in hf.BLOCK_CLASSES]
  for name, block in found:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, from_hf(block, hf_config, dtype=dtype, runner_backend=runner_backend))
  return [name for name, _ in found]


# --------------------------------------------------------------------------------------------
# transformers' experts interface: set_experts_implementation("jmoe")


@dataclasses.dataclass(frozen=True)
class _ExpertsFn:
  """x [T, H], ids [T, k] int32, weights [T, k], gate_up, down (+ biases) in the experts
  module's layout -> [T, H]. Layout: transposed -> gate_up [E, H, 2N], down [E, N, H] (x @ W),
  else [E, 2N, H] / [E, H, N] (torch Linear); concatenated -> gate | up, else interleaved."""

  transposed: bool
  concatenated: bool
  activation: str
  swiglu_alpha: Optional[float]
  swiglu_limit: Optional[float]
  runner_backend: str

  def __call__(self, x, ids, weights, gate_up, down, b13=None, b2=None):
    import jax.numpy as jnp  # noqa: PLC0415
    from jmoe.api import fused_moe  # noqa: PLC0415

    w13 = gate_up if self.transposed else jnp.swapaxes(gate_up, 1, 2)  # [E, H, 2N]
    w2 = down if self.transposed else jnp.swapaxes(down, 1, 2)  # [E, N, H]
    if not self.concatenated:  # g0 u0 g1 u1 ... -> gate | up (jmoe's layout)
      w13 = jnp.concatenate([w13[..., 0::2], w13[..., 1::2]], axis=-1)
      if b13 is not None:
        b13 = jnp.concatenate([b13[..., 0::2], b13[..., 1::2]], axis=-1)
    kw = {}
    if self.activation == "swigluoai":
      kw = dict(swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
    return fused_moe(x, w13, w2, weights.astype(jnp.float32), ids, activation=self.activation,
                     w13_bias=b13, w2_bias=b2, runner_backend=self.runner_backend, **kw)


def _experts_activation(experts: torch.nn.Module) -> tuple[str, Optional[float], Optional[float]]:
  """(jmoe activation, swiglu alpha, limit) of a transformers experts module."""
  name = type(experts).__name__
  from transformers.integrations import moe as hf_moe  # noqa: PLC0415
  custom_gate = getattr(type(experts), "_apply_gate", None) is not getattr(
      hf_moe, "_default_apply_gate", None)
  if custom_gate:
    if name == "GptOssExperts":
      return "swigluoai", float(experts.alpha), float(experts.limit)
    raise NotImplementedError(f"{name} has its own _apply_gate, which jmoe does not know")
  act = getattr(experts.config, "hidden_act", "silu")
  if act not in hf._HF_ACTIVATIONS:
    raise NotImplementedError(f"{name}: hidden_act={act!r} has no jmoe equivalent")
  act = hf._HF_ACTIVATIONS[act]
  if not getattr(experts, "has_gate", True):
    act += "_no_mul"
  return act, None, None


def _experts_key(experts: torch.nn.Module) -> tuple[str, tuple[str, ...]]:
  """(op key, weight attribute names) of an experts module. The key encodes the layout, so
  this is pure and torch.compile traces it (`spec_of` builds the spec from the key)."""
  cached = experts.__dict__.get("_jmoe_key")
  if cached is not None:
    return cached
  name = type(experts).__name__
  if getattr(experts, "has_post_expert_norm", False):
    raise NotImplementedError(f"{name}: a post-expert norm is not supported by jmoe")
  if getattr(experts, "_is_expert_parallel", False):
    raise NotImplementedError(f"{name}: transformers' expert parallelism is not supported by "
                              "jmoe's experts implementation (use jmoe.sharding)")
  act, alpha, limit = _experts_activation(experts)
  gated = getattr(experts, "has_gate", True)
  attrs = ("gate_up_proj" if gated else "up_proj", "down_proj")
  if getattr(experts, "has_bias", False):
    attrs += ("gate_up_proj_bias" if gated else "up_proj_bias", "down_proj_bias")
  transposed = bool(getattr(experts, "is_transposed", False))
  concatenated = int(bool(getattr(experts, "is_concatenated", True)))
  # torch-Linear-order weights whose memory is already x @ W order (`prepare_experts`): JAX
  # gets the transposed views, contiguous, so they cross without a copy or a relayout
  swap = not transposed and all(getattr(experts, a).transpose(1, 2).is_contiguous()
                                for a in attrs[:2])
  key = (f"hf_experts:{int(transposed or swap)}:{concatenated}:{act}:{alpha}:{limit}:"
         f"{len(attrs)}")
  if not torch.compiler.is_compiling():  # eager: skip the above on later calls
    experts.__dict__["_jmoe_key"] = (key, attrs, swap)
  return key, attrs, swap


def _experts_spec(key: str) -> BridgeSpec:
  """The spec an "hf_experts:..." key names (see `_experts_key`)."""
  _, transposed, concatenated, act, alpha, limit, n = key.split(":")
  num = lambda v: None if v == "None" else float(v)  # noqa: E731
  fn = _ExpertsFn(transposed == "1", concatenated == "1", act, num(alpha), num(limit), "auto")
  # x, ids (integers), routing weights (the router's gradient flows through them), weights
  return BridgeSpec(fn, (True, False, True) + (True,) * int(n), uncached=3)


register_resolver("hf_experts", _experts_spec)


def jmoe_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                         top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
  """transformers' experts signature: hidden_states [T, H], top_k_index [T, k],
  top_k_weights [T, k] -> [T, H] in hidden_states' dtype, by `jmoe.fused_moe`."""
  key, attrs, swap = _experts_key(self)
  weights = [getattr(self, a) for a in attrs]
  if swap:
    weights[:2] = _xw_views(self, weights[:2])
  tensors = [hidden_states, top_k_index.to(torch.int32), top_k_weights]
  return run(key, tensors + weights)


def _xw_views(experts: torch.nn.Module, ws: list[torch.Tensor]) -> list[torch.Tensor]:
  """The [E, in, out] (contiguous) views of prepared weights. Forward-only eager calls reuse
  one pair of views (new view objects would miss the conversion cache every call); calls that
  need gradients make fresh ones (a cached view from a no-grad call would cut the graph)."""
  if torch.is_grad_enabled() or torch.compiler.is_compiling():
    return [w.transpose(1, 2) for w in ws]
  cached = experts.__dict__.get("_jmoe_views")
  if cached is None or any(v.data_ptr() != w.data_ptr() or v._base is not w
                           for v, w in zip(cached, ws)):
    cached = experts.__dict__["_jmoe_views"] = [w.transpose(1, 2) for w in ws]
  return cached


def prepare_experts(model: torch.nn.Module) -> int:
  """Store the expert weights of `model`'s experts modules (torch Linear order, gate | up) in
  the memory order jmoe reads, keeping their shapes: `w.data = w.data.transpose(1, 2)
  .contiguous().transpose(1, 2)` (one copy per weight, now; no extra memory after).

  Then the "jmoe" experts implementation hands them to JAX as they are, instead of
  transposing them inside every call (a weight-sized copy per call: ~0.6 ms per layer at
  Qwen3-30B's shapes on an H200). transformers' own implementations keep working (they read
  the same values through strided views). Returns how many modules were changed.
  """
  n = 0
  for m in model.modules():
    w13, w2 = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.ndim == 3
            and w2.ndim == 3) or getattr(m, "is_transposed", False) or \
        not getattr(m, "is_concatenated", True):
      continue  # gpt-oss-style interleaved columns are not a stride away from jmoe's layout
    with torch.no_grad():
      for w in (w13, w2):
        w.data = w.data.transpose(1, 2).contiguous().transpose(1, 2)
    m.__dict__.pop("_jmoe_key", None)
    m.__dict__.pop("_jmoe_views", None)
    n += 1
  return n


def register_experts_implementation(name: str = "jmoe") -> None:
  """Register `jmoe_experts_forward` in transformers' ExpertsInterface as `name` (done on
  import of this module), so `model.set_experts_implementation(name)` routes to jmoe."""
  try:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: PLC0415
  except ImportError as e:
    raise RuntimeError("set_experts_implementation needs transformers >= 5 (its "
                       "ExpertsInterface)") from e
  ALL_EXPERTS_FUNCTIONS.register(name, jmoe_experts_forward)


try:
  register_experts_implementation()
except RuntimeError:  # no transformers (or an older one): from_hf and the bridge still work
  pass
