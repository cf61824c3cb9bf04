"""Converters from Hugging Face transformers MoE blocks and checkpoints to jmoe.

One entry point does the work: `from_hf_state_dict(model_type, hf_config, state_dict, prefix)`
reads one MoE block's tensors from a state dict (a torch module's `state_dict()`, a dict of
NumPy arrays from `safetensors.numpy.load_file`, or torch tensors from `safetensors.torch`) and
returns `(MoEConfig, MoEParams)` such that `jmoe.moe_block(x, params, config)` computes what the
transformers block computes. `from_hf_module(block)` is the shortcut for a live module.

Supported model types (`MODEL_TYPES`, HF `config.model_type` spellings), by family:

=======================  ================================================================
mixtral, minimax         softmax top-k, renormalize
qwen3_moe, olmoe,        softmax top-k, renormalize iff `norm_topk_prob` (Qwen3-VL: always);
qwen3_vl_moe             Qwen3-VL checkpoints store fused experts in x @ W order
qwen2_moe, qwen3_next    as qwen3_moe + one shared expert scaled by sigmoid(x @ shared_expert_gate)
deepseek_v3, glm4_moe,   sigmoid scores, `e_score_correction_bias` (selection only), grouped
dots1                    top-k (`n_group`/`topk_group`, group score = sum of its top-2),
                         renormalize iff `norm_topk_prob`, `routed_scaling_factor`,
                         `n_shared_experts` shared experts
deepseek_v2              softmax, `topk_method` greedy or group_limited_greedy (group score =
                         its max), no renormalization (as transformers), `routed_scaling_factor`,
                         shared experts
gpt_oss                  softmax over the top-k router logits (router bias), swigluoai with the
                         config's alpha/limit, interleaved gate/up columns, expert biases;
                         MXFP4 checkpoints (`*_blocks`/`*_scales`) stay mxfp4 (see below)
llama4_text (llama4)     sigmoid of the top-1 logit applied to the expert *input*, plus a
                         shared expert
=======================  ================================================================

Weight layouts understood, per family, whichever the checkpoint or the installed transformers
uses:

* fused `experts.gate_up_proj` + `experts.down_proj` (transformers >= 5 for Mixtral/Qwen/DeepSeek:
  `[E, 2N, H]` / `[E, H, N]`, torch `nn.Linear` order; gpt-oss, Llama 4 and Qwen3-VL
  checkpoints: `[E, H, 2N]` / `[E, N, H]`, x @ W order). The orientation is read from the
  shapes; when H == 2N makes gate_up_proj ambiguous, down_proj's orientation decides (and
  when N == H makes down_proj ambiguous, the family's known layout).
* per-expert linears `experts.{i}.gate_proj|up_proj|down_proj.weight` (Qwen, DeepSeek
  checkpoints, transformers < 5) or `experts.{i}.w1|w3|w2.weight` (Mixtral checkpoints, gate
  w1, up w3, down w2).
* FP8 per-expert linears — DeepSeek's `weight` + `weight_scale_inv` (128x128 blocks), or
  `weight` + `weight_scale` per tensor / channel — stay quantized (`quantized="keep"`, the
  default: `jmoe.quant.QuantizedWeights`, no dequantized copy) or are dequantized
  (`quantized="dequantize"`); FP8 shared experts are dequantized (they run as a dense MLP).
* 4-bit experts, kept packed with `quantized="keep"` (jmoe/quant/weights.py documents the
  layouts): gpt-oss MXFP4 `experts.gate_up_proj_blocks` / `_scales` and `down_proj_*` as
  mxfp4 (the blocks reshaped, the uint8 scales bitcast to e8m0; gate_up's interleaved rows
  regrouped gate | up); GPTQ (`qweight` / `qzeros` / `scales` / `g_idx`, v1 zero points
  unless `quantization_config.checkpoint_format == "gptq_v2"`, act-order folded at load time)
  and AWQ ("gemm" packing) per-expert linears as w4a16 (`jmoe.quant.int4_checkpoints`);
  NVIDIA ModelOpt nvfp4 per-expert linears (`weight` / `weight_scale` / `weight_scale_2`) as
  nvfp4. `quantized="dequantize"` turns any of them into bfloat16 (or `dtype`) arrays.

jmoe's layout: w13 [E, H, 2N] (gate = w13[..., :N], up = w13[..., N:]), w2 [E, N, H], router_w
[H, E]; shared experts as one dense MLP shared_w13 [H, 2Ns], shared_w2 [Ns, H], shared_gate [H].

`to_hf_state_dict` is the inverse (jmoe parameters under the HF names, fused or per-expert).

Example (a checkpoint on disk; nothing here downloads)::

  import json, safetensors.numpy, jmoe
  from jmoe.interop import hf
  cfg = json.load(open("config.json"))
  sd = safetensors.numpy.load_file("model-00001-of-00004.safetensors")
  for prefix in hf.moe_layer_prefixes(sd):            # "model.layers.0.mlp.", ...
    config, params = hf.from_hf_state_dict(None, cfg, sd, prefix)
    y = jmoe.moe_block(x, params, config)             # x [T, H]

This module imports torch lazily (only to read torch tensors); jmoe never imports it.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

# HF model_type -> the family whose MoE-block semantics it shares.
FAMILIES = {
    "mixtral": "mixtral", "minimax": "mixtral",
    "qwen3_moe": "qwen3_moe", "olmoe": "qwen3_moe", "qwen3_vl_moe_text": "qwen3_moe",
    "qwen2_moe": "qwen2_moe", "qwen3_next": "qwen2_moe",
    "deepseek_v3": "deepseek_v3", "glm4_moe": "deepseek_v3", "dots1": "deepseek_v3",
    "deepseek_v2": "deepseek_v2",
    "gpt_oss": "gpt_oss",
    "llama4_text": "llama4_text",
}
MODEL_TYPES = tuple(FAMILIES)
_ALIASES = {"llama4": "llama4_text", "qwen3_vl_moe": "qwen3_vl_moe_text"}
# Families whose experts' width is `intermediate_size` (the others: `moe_intermediate_size`).
_N_FROM_INTERMEDIATE = ("mixtral", "minimax", "olmoe", "gpt_oss", "llama4_text")

# Class names of the transformers MoE blocks -> model type (for `from_hf_module`).
BLOCK_CLASSES = {
    "MixtralSparseMoeBlock": "mixtral",
    "MiniMaxSparseMoeBlock": "minimax",
    "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "Qwen3NextSparseMoeBlock": "qwen3_next",
    "OlmoeSparseMoeBlock": "olmoe",
    "Qwen3VLMoeTextSparseMoeBlock": "qwen3_vl_moe_text",
    "DeepseekV3MoE": "deepseek_v3",
    "DeepseekV2Moe": "deepseek_v2",
    "Glm4MoeMoE": "glm4_moe",
    "Dots1MoE": "dots1",
    "GptOssMLP": "gpt_oss",
    "Llama4TextMoe": "llama4_text",
}

# Families whose fused expert tensors are stored in x @ W order ([E, H, 2N], [E, N, H]);
# the others use torch Linear order ([E, 2N, H], [E, H, N]).
_FUSED_XW_ORDER = ("gpt_oss", "llama4_text")
# Families whose fused gate_up columns interleave gate and up (gate = [..., ::2]).
_INTERLEAVED = ("gpt_oss",)

_HF_ACTIVATIONS = {
    "silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
}

_MISSING = object()


# --------------------------------------------------------------------------------------------
# config


def _get(cfg: Any, *names: str, default: Any = _MISSING) -> Any:
  """The first of `names` that `cfg` (a transformers config or a plain dict) defines."""
  for n in names:
    if isinstance(cfg, Mapping):
      if n in cfg and cfg[n] is not None:
        return cfg[n]
    else:
      v = getattr(cfg, n, None)
      if v is not None:
        return v
  if default is _MISSING:
    kind = type(cfg).__name__
    raise KeyError(f"hf_config ({kind}) defines none of {names}")
  return default


def _text_config(cfg: Any) -> Any:
  """Multimodal wrappers (Llama4Config) keep the MoE fields in `text_config`."""
  if _get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=None) is None:
    sub = _get(cfg, "text_config", default=None)
    if sub is not None:
      return sub
  return cfg


def resolve_model_type(model_type: Optional[str], hf_config: Any = None) -> str:
  """Normalise `model_type` (or read `hf_config.model_type`) to one of `MODEL_TYPES`."""
  if model_type is None:
    if hf_config is None:
      raise ValueError("model_type is None and no hf_config to read it from")
    model_type = _get(_text_config(hf_config), "model_type", default=None) or _get(
        hf_config, "model_type", default=None)
  mt = _ALIASES.get(model_type, model_type)
  if mt not in MODEL_TYPES:
    raise ValueError(f"model_type={model_type!r} is not supported; supported: "
                     f"{', '.join(MODEL_TYPES)}")
  return mt


def _activation(cfg: Any, model_type: str) -> str:
  if model_type == "gpt_oss":
    return "swigluoai"
  act = _get(cfg, "hidden_act", "hidden_activation", default="silu")
  if act not in _HF_ACTIVATIONS:
    raise ValueError(f"hidden_act={act!r} has no jmoe equivalent; known: "
                     f"{', '.join(_HF_ACTIVATIONS)}")
  return _HF_ACTIVATIONS[act]


def config_from_hf(model_type: Optional[str], hf_config: Any, *, dtype: str = "bfloat16",
                   **overrides) -> "MoEConfig":
  """The jmoe `MoEConfig` of one MoE block of an HF model (`overrides` replace fields)."""
  from jmoe.config import MoEConfig, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT  # noqa: PLC0415

  mt = resolve_model_type(model_type, hf_config)
  fam = FAMILIES[mt]
  cfg = _text_config(hf_config)
  kw: dict[str, Any] = dict(
      num_experts=int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts")),
      top_k=int(_get(cfg, "num_experts_per_tok", "top_k")),
      hidden_size=int(_get(cfg, "hidden_size")),
      intermediate_size=int(_get(cfg, "intermediate_size" if mt in _N_FROM_INTERMEDIATE
                                 else "moe_intermediate_size")),
      activation=_activation(cfg, mt),
      dtype=dtype,
  )

  def shared(ns: int) -> None:  # DeepSeek-style: n_shared_experts experts of the routed width
    if ns:
      kw.update(num_shared_experts=ns, shared_intermediate_size=ns * kw["intermediate_size"])

  if fam == "mixtral":
    kw.update(scoring_func="softmax", renormalize=True)
  elif fam in ("qwen3_moe", "qwen2_moe"):
    # Qwen3-VL-MoE always renormalizes (its config has no norm_topk_prob)
    norm = mt == "qwen3_vl_moe_text" or bool(_get(cfg, "norm_topk_prob", default=False))
    kw.update(scoring_func="softmax", renormalize=norm)
    if fam == "qwen2_moe":
      ns = int(_get(cfg, "shared_expert_intermediate_size", default=0))
      if ns:
        kw.update(num_shared_experts=1, shared_intermediate_size=ns, shared_expert_gate=True)
  elif fam == "deepseek_v3":
    n_group = int(_get(cfg, "n_group", default=1))
    topk_group = int(_get(cfg, "topk_group", default=1))
    kw.update(scoring_func="sigmoid", renormalize=bool(_get(cfg, "norm_topk_prob", default=True)),
              use_correction_bias=True,
              routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", default=1.0)))
    if n_group > 1:
      kw.update(num_expert_group=n_group, topk_group=topk_group)
    shared(int(_get(cfg, "n_shared_experts", default=0)))
  elif fam == "deepseek_v2":
    # transformers' DeepseekV2TopkRouter: softmax, greedy or group-limited greedy (group score =
    # the group's max), no renormalization (it ignores norm_topk_prob), times the scaling factor.
    method = _get(cfg, "topk_method", default="greedy")
    if method not in ("greedy", "group_limited_greedy"):
      raise ValueError(f"deepseek_v2 topk_method={method!r} is not supported (greedy, "
                       "group_limited_greedy)")
    kw.update(scoring_func="softmax", renormalize=False,
              routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", default=1.0)))
    n_group = int(_get(cfg, "n_group", default=1))
    if method == "group_limited_greedy" and n_group > 1:
      kw.update(num_expert_group=n_group, topk_group=int(_get(cfg, "topk_group")))
    shared(int(_get(cfg, "n_shared_experts", default=0)))
  elif fam == "gpt_oss":
    kw.update(scoring_func="softmax", renormalize=True, expert_bias=True, router_bias=True,
              swiglu_alpha=float(_get(cfg, "swiglu_alpha", default=SWIGLUOAI_ALPHA)),
              swiglu_limit=float(_get(cfg, "swiglu_limit", default=SWIGLUOAI_LIMIT)))
  elif fam == "llama4_text":
    if kw["top_k"] != 1:
      raise ValueError(f"llama4_text with num_experts_per_tok={kw['top_k']}: jmoe applies the "
                       "router weight on the input only with top_k == 1 (as Llama 4 ships)")
    kw.update(scoring_func="sigmoid", renormalize=False, apply_router_weight_on_input=True,
              num_shared_experts=1, shared_intermediate_size=kw["intermediate_size"])
  kw.update(overrides)
  return MoEConfig(**kw)


# --------------------------------------------------------------------------------------------
# tensors


def _torch_to_numpy(t) -> np.ndarray:
  import torch  # noqa: PLC0415 (interop only; lazily)
  import ml_dtypes  # noqa: PLC0415

  t = t.detach().cpu()
  if not t.is_contiguous():
    t = t.contiguous()
  special = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16)}
  for name in ("float8_e4m3fn", "float8_e5m2"):  # numpy has no such dtypes: view the bytes
    if hasattr(torch, name):
      special[getattr(torch, name)] = (torch.uint8, getattr(ml_dtypes, name))
  if t.dtype in special:
    as_int, np_dtype = special[t.dtype]
    return t.view(as_int).numpy().view(np_dtype)
  return t.numpy()


def to_numpy(x) -> np.ndarray:
  """A torch tensor (any dtype incl. bf16 / fp8), jax array or NumPy array -> NumPy."""
  if isinstance(x, np.ndarray):
    return x
  if type(x).__module__.startswith("torch"):
    return _torch_to_numpy(x)
  return np.asarray(x)


class _Reader:
  """Looks tensors up under `prefix` and says what is missing, with the keys that are there."""

  def __init__(self, state_dict: Mapping, prefix: str, hf_config: Any):
    self.sd = state_dict
    self.prefix = prefix
    self.hf_config = hf_config

  def has(self, key: str) -> bool:
    return self.prefix + key in self.sd

  def first(self, *keys: str) -> Optional[str]:
    return next((k for k in keys if self.has(k)), None)

  def raw(self, key: str) -> np.ndarray:
    return to_numpy(self.sd[self.prefix + key])

  def missing(self, what: str, tried) -> KeyError:
    near = sorted(k for k in self.sd if k.startswith(self.prefix))[:12]
    return KeyError(f"{what}: none of {[self.prefix + k for k in tried]} in the state dict; "
                    f"keys under prefix {self.prefix!r}: {near}")

  def linear(self, key: str) -> np.ndarray:
    """`key` names a torch Linear weight [out, in]; 8-bit ones (FP8 with block, tensor or
    channel scales; int8 with tensor or channel scales) are dequantized."""
    w = self.raw(key)
    if not _is_8bit(w):
      return w
    block = _block_size(self.hf_config)
    w, scale, kind = _q8_linear(self, key, block)
    if kind == "block":
      return _dequant_fp8_block(w, scale, block)
    return w.astype(np.float32) * scale


def _block_size(hf_config: Any) -> tuple[int, int]:
  q = _get(hf_config, "quantization_config", default=None) if hf_config is not None else None
  bs = _get(q, "weight_block_size", default=None) if q is not None else None
  return tuple(bs) if bs else (128, 128)


def _dequant_fp8_block(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """DeepSeek FP8: w [out, in] (e4m3), scale_inv [ceil(out/b0), ceil(in/b1)] -> f32 w * scale."""
  out, inn = w.shape
  s = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], 0), block[1], 1)[:out, :inn]
  return w.astype(np.float32) * s


FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """gpt-oss MXFP4: blocks [..., G, 16] uint8 (two e2m1 codes a byte, low nibble first),
  scales [..., G] uint8 (e8m0, bias 127) -> f32 [..., G*32] (one scale per 32 values)."""
  blocks = blocks.astype(np.uint8)
  if blocks.shape[:-1] != scales.shape:
    raise ValueError(f"mxfp4 blocks {blocks.shape} and scales {scales.shape} do not match")
  lo = FP4_VALUES[blocks & 0x0F]
  hi = FP4_VALUES[blocks >> 4]
  vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
  vals = np.ldexp(vals, (scales.astype(np.int32) - 127)[..., None])
  return vals.reshape(*blocks.shape[:-2], -1)


def _deinterleave(w: np.ndarray) -> np.ndarray:
  """[..., 2N] with gate/up interleaved (g0 u0 g1 u1 ...) -> [..., 2N] as gate | up."""
  return np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)


def _orient(w: np.ndarray, xw_shape: tuple, linear_shape: tuple, prefer_xw: bool,
            what: str) -> np.ndarray:
  """Return `w` in x @ W order [E, in, out], given it is that or torch order [E, out, in]."""
  if w.shape == xw_shape and (prefer_xw or w.shape != linear_shape):
    return w
  if w.shape == linear_shape:
    return np.swapaxes(w, 1, 2)
  raise ValueError(f"{what} has shape {w.shape}; expected {xw_shape} (x @ W order) or "
                   f"{linear_shape} (torch Linear order)")


def _fused_gate_up_key(r: _Reader) -> Optional[str]:
  key = "experts.gate_up_proj"
  return r.first(key + "_blocks", key, key + ".weight")


def _fused_gate_up(r: _Reader, mt: str, e: int, h: int, n: int) -> Optional[np.ndarray]:
  key = "experts.gate_up_proj"
  if r.has(key + "_blocks"):  # MXFP4 (gpt-oss checkpoints): [E, 2N, H/32, 16] -> [E, 2N, H]
    w = dequant_mxfp4(r.raw(key + "_blocks"), r.raw(key + "_scales"))
  elif r.has(key):
    w = r.raw(key)
  elif r.has(key + ".weight"):
    w = r.raw(key + ".weight")
  else:
    return None
  if w.ndim != 3:
    raise ValueError(f"{r.prefix}{key} must be 3-D, got shape {w.shape}")
  # MXFP4 tensors are always stored [E, 2N, H]. Otherwise, when H == 2N leaves the shape
  # ambiguous, down_proj (stored the same way, and distinguishable then) tells; else the family.
  prefer_xw = FAMILIES[mt] in _FUSED_XW_ORDER and not r.has(key + "_blocks")
  dk = r.first("experts.down_proj", "experts.down_proj.weight")
  if dk is not None and h == 2 * n and h != n:
    down_shape = tuple(r.sd[r.prefix + dk].shape)
    if down_shape in ((e, n, h), (e, h, n)):
      prefer_xw = down_shape == (e, n, h)
  w = _orient(w, (e, h, 2 * n), (e, 2 * n, h), prefer_xw, r.prefix + key)
  return _deinterleave(w) if FAMILIES[mt] in _INTERLEAVED else w


def _fused_down(r: _Reader, mt: str, e: int, h: int, n: int) -> np.ndarray:
  key = "experts.down_proj"
  if r.has(key + "_blocks"):
    w = dequant_mxfp4(r.raw(key + "_blocks"), r.raw(key + "_scales"))
    prefer_xw = False
  else:
    k = r.first(key, key + ".weight")
    if k is None:
      raise r.missing("expert down projection", [key, key + "_blocks"])
    w = r.raw(k)
    prefer_xw = FAMILIES[mt] in _FUSED_XW_ORDER
  return _orient(w, (e, n, h), (e, h, n), prefer_xw, r.prefix + key)


_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _per_expert(r: _Reader, e: int, h: int, n: int) -> tuple[np.ndarray, np.ndarray]:
  for g, u, d in _PER_EXPERT_NAMES:
    if r.has(f"experts.0.{g}.weight"):
      gates, ups, downs = [], [], []
      for i in range(e):
        keys = [f"experts.{i}.{nm}.weight" for nm in (g, u, d)]
        for k in keys:
          if not r.has(k):
            raise r.missing(f"expert {i}", [k])
        ws = [r.linear(k) for k in keys]
        for k, w, want in zip(keys, ws, [(n, h), (n, h), (h, n)]):
          if w.shape != want:
            raise ValueError(f"{r.prefix}{k} has shape {w.shape}, expected {want} (out, in) "
                             f"for H={h}, N={n}")
        gates.append(ws[0].T)
        ups.append(ws[1].T)
        downs.append(ws[2].T)
      w13 = np.concatenate([np.stack(gates), np.stack(ups)], axis=-1)
      return w13, np.stack(downs)
  raise r.missing("expert weights", ["experts.gate_up_proj", "experts.gate_up_proj_blocks"] +
                  [f"experts.0.{g}.weight" for g, _, _ in _PER_EXPERT_NAMES])


def _is_fp8(a: np.ndarray) -> bool:
  import ml_dtypes  # noqa: PLC0415
  return a.dtype == np.dtype(ml_dtypes.float8_e4m3fn)


def _is_8bit(a: np.ndarray) -> bool:
  """FP8 e4m3 or int8 weights (W8A8 checkpoints: vLLM / ModelOpt FP8, compressed-tensors)."""
  return _is_fp8(a) or a.dtype == np.dtype(np.int8)


def _q8_linear(r: _Reader, key: str, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, str]:
  """An 8-bit torch Linear `key` [out, in] as (values [out, in] e4m3 / int8, scale,
  granularity): `weight_scale_inv` per (block[0] x block[1]) tile (DeepSeek FP8) -> scale
  [out/b0, in/b1], "block"; `weight_scale` per tensor or per output channel (llm-compressor /
  vLLM / ModelOpt FP8, compressed-tensors int8 exports) -> scale [out, 1], "channel" (a
  per-tensor scale repeated over its channels: exact, and gate and up keep their own).
  Asymmetric weights (`weight_zero_point`) raise."""
  w = r.raw(key)
  base = key[:-len(".weight")] if key.endswith(".weight") else key
  if r.has(base + ".weight_zero_point"):
    raise ValueError(f"{r.prefix}{base}.weight_zero_point: asymmetric 8-bit weights are not "
                     "loaded (symmetric W8A8 only); pass quantized='dequantize'")
  if r.has(key + "_scale_inv") and _is_fp8(w):
    s = r.raw(key + "_scale_inv").astype(np.float32)
    want = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    if s.shape != want:
      raise ValueError(f"{r.prefix}{key}_scale_inv has shape {s.shape}, expected {want} for "
                       f"{r.prefix}{key} {w.shape} in {block[0]}x{block[1]} blocks")
    return w, s, "block"
  if r.has(base + ".weight_scale"):
    s = r.raw(base + ".weight_scale").astype(np.float32)
    if s.size == 1:
      return w, np.full((w.shape[0], 1), s.reshape(()), np.float32), "channel"
    if s.size == w.shape[0]:
      return w, s.reshape(w.shape[0], 1), "channel"
    raise ValueError(f"{r.prefix}{base}.weight_scale has shape {s.shape}: neither one scale nor "
                     f"one per output channel of {r.prefix}{key} {w.shape}")
  kind = "FP8" if _is_fp8(w) else "int8"
  raise r.missing(f"the scale of {kind} weight {key}", [key + "_scale_inv", base + ".weight_scale"])


def _per_expert_8bit(r: _Reader, e: int, h: int, n: int):
  """Per-expert 8-bit linears (FP8 or int8) kept quantized: (w13, w2) QuantizedWeights in
  jmoe's K-major layout (values [E, 2N, H] = gate | up as stored, [E, H, N]); None when the
  checkpoint's experts are not 8-bit."""
  from jmoe.config import QuantConfig  # noqa: PLC0415
  from jmoe.quant.weights import QuantizedWeights, check_quantized  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  names = next(((g, u, d) for g, u, d in _PER_EXPERT_NAMES if r.has(f"experts.0.{g}.weight")),
               None)
  if names is None or not _is_8bit(r.raw(f"experts.0.{names[0]}.weight")):
    return None
  int8 = not _is_fp8(r.raw(f"experts.0.{names[0]}.weight"))
  block = _block_size(r.hf_config)
  w13v, w13s, w2v, w2s, kinds = [], [], [], [], set()
  inputs = {0: [], 1: []}  # static input scales of GEMM1 (gate, up) and GEMM2 (down)
  for i in range(e):
    parts = []
    for j, (nm, want) in enumerate(zip(names, [(n, h), (n, h), (h, n)])):
      key = f"experts.{i}.{nm}.weight"
      if not r.has(key):
        raise r.missing(f"expert {i}", [key])
      if r.has(f"experts.{i}.{nm}.input_scale"):
        inputs[j // 2].append(_input_scale(r, f"experts.{i}.{nm}.input_scale"))
      w, sc, kind = _q8_linear(r, key, block)
      if w.shape != want:
        raise ValueError(f"{r.prefix}{key} has shape {w.shape}, expected {want} (out, in) for "
                         f"H={h}, N={n}")
      parts.append((w, sc))
      kinds.add(kind)
    (g, gs), (u, us), (d, ds) = parts
    w13v.append(np.concatenate([g, u]))
    w13s.append(np.concatenate([gs, us]))
    w2v.append(d)
    w2s.append(ds)
  if len(kinds) != 1:
    raise ValueError(f"{r.prefix}experts mix FP8 scale kinds {sorted(kinds)}")
  kind = kinds.pop()
  if kind == "block":
    if n % block[0] or h % block[0] or h % block[1] or n % block[1]:
      raise ValueError(f"{r.prefix}experts: FP8 {block[0]}x{block[1]} blocks do not divide "
                       f"H={h} / N={n}, so the weights cannot stay quantized; pass "
                       "quantized='dequantize'")
    scheme = QuantConfig("fp8_block", block_shape=(block[1], block[0]))
  else:
    scheme = QuantConfig("int8" if int8 else "fp8_channel")
  statics = _static_input_scales(r, inputs, 3 * e, kind)
  if statics[0] is not None:
    scheme = QuantConfig("int8_static" if int8 else "fp8_channel_static")
  q = [QuantizedWeights(values=jnp.asarray(np.stack(v)), scale=jnp.asarray(np.stack(sc)),
                        input_scale=None if st is None else jnp.asarray(st), scheme=scheme)
       for v, sc, st in ((w13v, w13s, statics[0]), (w2v, w2s, statics[1]))]
  check_quantized(q[0], argname=f"{r.prefix}experts (w13)")
  check_quantized(q[1], argname=f"{r.prefix}experts (w2)")
  return q[0], q[1]


def _input_scale(r: _Reader, key: str) -> float:
  """One linear's static activation scale (a positive scalar), else an error naming it."""
  a = r.raw(key).astype(np.float32)
  if a.size != 1 or not np.isfinite(a).all() or not float(a.reshape(())) > 0:
    raise ValueError(f"{r.prefix}{key} must be one positive per-tensor scale, got shape "
                     f"{a.shape} {a.reshape(-1)[:4]}")
  return float(a.reshape(()))


def _static_input_scales(r: _Reader, inputs: dict, n_linears: int, kind: str):
  """(GEMM1's, GEMM2's) static input scale as float32 [1], or (None, None) for dynamic
  activations. A checkpoint whose every expert linear has an `input_scale` (per-tensor FP8
  with activation_scheme "static", as vLLM's Fp8 / compressed-tensors static exports) runs
  them, one scale per GEMM: the largest over experts (and over gate / up), as vLLM does, so no
  expert's inputs saturate more than it calibrated. quantization_config's activation_scheme
  "dynamic" ignores them; some but not all linears having one is an error."""
  found = len(inputs[0]) + len(inputs[1])
  if found == 0 or _quantization_config(r.hf_config).get("activation_scheme") == "dynamic":
    return None, None
  if found != n_linears:
    raise ValueError(f"{r.prefix}experts: {found} of {n_linears} expert linears have an "
                     "input_scale; a static FP8 checkpoint has one for every linear")
  if kind == "block":
    raise ValueError(f"{r.prefix}experts: static input_scale with 128x128 block weight scales "
                     "(no scheme pairs them; block FP8 quantizes activations per 1x128 group)")
  return (np.asarray([max(inputs[0])], np.float32), np.asarray([max(inputs[1])], np.float32))


def _quantization_config(hf_config: Any) -> dict:
  """The checkpoint's `quantization_config` as a dict ({} when none)."""
  q = _get(hf_config, "quantization_config", default=None) if hf_config is not None else None
  if q is None:
    return {}
  return dict(q) if isinstance(q, Mapping) else dict(getattr(q, "to_dict", lambda: vars(q))())


def _per_expert_int4(r: _Reader, e: int, h: int, n: int):
  """GPTQ / AWQ int4 per-expert linears (`experts.{i}.gate_proj.qweight` / `qzeros` /
  `scales` (/ `g_idx`)) -> (w13, w2) w4a16 QuantizedWeights; None when the experts are not
  int4. GPTQ or AWQ comes from `quantization_config.quant_method`, else from qweight's shape
  ([K/8, N]: GPTQ, [K, N/8]: AWQ); GPTQ zero points are v1 (+1) unless `checkpoint_format`
  is "gptq_v2"."""
  from jmoe.quant import int4_checkpoints as i4  # noqa: PLC0415

  names = next(((g, u, d) for g, u, d in _PER_EXPERT_NAMES if r.has(f"experts.0.{g}.qweight")),
               None)
  if names is None:
    return None
  qc = _quantization_config(r.hf_config)
  method = str(qc.get("quant_method", "")).lower()
  if qc.get("bits", 4) != 4:
    raise ValueError(f"{r.prefix}experts: {method or 'int'} checkpoints with bits="
                     f"{qc.get('bits')} are not supported (4-bit only)")
  if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
    raise ValueError(f"{r.prefix}experts: AWQ version={qc.get('version')!r} packs differently; "
                     "only AutoAWQ's 'gemm' layout is supported")
  v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
  out = ([], [], [])
  for i in range(e):
    for j, (nm, (k, m)) in enumerate(zip(names, [(h, n), (h, n), (n, h)])):
      base = f"experts.{i}.{nm}."
      keys = [base + t for t in ("qweight", "qzeros", "scales")]
      for key in keys:
        if not r.has(key):
          raise r.missing(f"int4 expert {i} {nm}", [key])
      qw, qz, sc = (r.raw(key) for key in keys)
      kind = method if method in ("gptq", "awq") else (
          "gptq" if qw.shape == (k // 8, m) else "awq")
      what = r.prefix + base[:-1]
      if kind == "gptq":
        gi = r.raw(base + "g_idx") if r.has(base + "g_idx") else None
        lin = i4.gptq_linear(qw, qz, sc, gi, k=k, n=m, v2=v2, name=what)
      else:
        lin = i4.awq_linear(qw, qz, sc, k=k, n=m, name=what)
      out[j].append(lin)
  return i4.int4_experts(*out, name=r.prefix + "experts")


def _per_expert_nvfp4(r: _Reader, e: int, h: int, n: int):
  """NVIDIA ModelOpt nvfp4 per-expert linears (`weight` uint8 [out, in/2] e2m1 pairs,
  `weight_scale` e4m3 [out, in/16], `weight_scale_2` f32 global, `input_scale` f32) ->
  (w13, w2) nvfp4 QuantizedWeights: values and block scales as stored, gate and up keeping
  their own global scale (w13.global_scale [E, 2]). None when the experts are not nvfp4.
  `input_scale` is for fp4 activations; the weight-only (bf16 activations) path ignores it."""
  import ml_dtypes  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from jmoe.config import QuantConfig  # noqa: PLC0415
  from jmoe.quant.weights import QuantizedWeights, check_quantized  # noqa: PLC0415

  names = next(((g, u, d) for g, u, d in _PER_EXPERT_NAMES
                if r.has(f"experts.0.{g}.weight_scale_2")), None)
  if names is None or r.raw(f"experts.0.{names[0]}.weight").dtype != np.uint8:
    return None
  parts = {nm: ([], [], []) for nm in names}
  for i in range(e):
    for nm, (k, m) in zip(names, [(h, n), (h, n), (n, h)]):
      base = f"experts.{i}.{nm}."
      for t in ("weight", "weight_scale", "weight_scale_2"):
        if not r.has(base + t):
          raise r.missing(f"nvfp4 expert {i} {nm}", [base + t])
      w, s, g = (r.raw(base + t) for t in ("weight", "weight_scale", "weight_scale_2"))
      for t, arr, want in (("weight", w, (m, k // 2)), ("weight_scale", s, (m, k // 16))):
        if arr.shape != want:
          raise ValueError(f"{r.prefix}{base}{t} has shape {arr.shape}, expected {want} "
                           f"(out, in / {2 if t == 'weight' else 16}) for H={h}, N={n}")
      if w.dtype != np.uint8:
        raise TypeError(f"{r.prefix}{base}weight must be uint8 (two e2m1 codes a byte), got "
                        f"{w.dtype}")
      if s.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise TypeError(f"{r.prefix}{base}weight_scale must be float8_e4m3fn, got {s.dtype}")
      if g.size != 1:
        raise ValueError(f"{r.prefix}{base}weight_scale_2 must be one scale, got shape "
                         f"{g.shape}")
      for lst, arr in zip(parts[nm], (w, s, np.float32(g.reshape(())))):
        lst.append(arr)
  gate, up, down = (parts[nm] for nm in names)
  scheme = QuantConfig("nvfp4")
  w13 = QuantizedWeights(
      values=jnp.asarray(np.concatenate([np.stack(gate[0]), np.stack(up[0])], axis=1)),
      scale=jnp.asarray(np.concatenate([np.stack(gate[1]), np.stack(up[1])], axis=1)),
      global_scale=jnp.asarray(np.stack([gate[2], up[2]], axis=1), jnp.float32), scheme=scheme)
  w2 = QuantizedWeights(values=jnp.asarray(np.stack(down[0])),
                        scale=jnp.asarray(np.stack(down[1])),
                        global_scale=jnp.asarray(np.stack(down[2])[:, None], jnp.float32),
                        scheme=scheme)
  check_quantized(w13, argname=f"{r.prefix}experts (w13)")
  check_quantized(w2, argname=f"{r.prefix}experts (w2)")
  return w13, w2


def _gpt_oss_mxfp4(r: _Reader, e: int, h: int, n: int):
  """gpt-oss MXFP4 experts kept as mxfp4 QuantizedWeights: `*_blocks` [E, out, in/32, 16]
  reshaped to values [E, out, in/2] (a view) and `*_scales` [E, out, in/32] bitcast to e8m0;
  gate_up's interleaved rows (g0 u0 g1 u1 ...) regrouped as gate | up (one strided copy)."""
  import jax.numpy as jnp  # noqa: PLC0415

  from jmoe.config import QuantConfig  # noqa: PLC0415
  from jmoe.quant.packing import uint8_as_e8m0  # noqa: PLC0415
  from jmoe.quant.weights import QuantizedWeights, check_quantized  # noqa: PLC0415

  def load(key: str, out: int, k: int):
    if k % 32:
      raise ValueError(f"{r.prefix}{key}_blocks: MXFP4 scales groups of 32 along K={k}")
    for t in ("_blocks", "_scales"):
      if not r.has(key + t):
        raise r.missing("MXFP4 experts", [key + t])
    blocks, scales = r.raw(key + "_blocks"), r.raw(key + "_scales")
    for t, arr, want in (("_blocks", blocks, (e, out, k // 32, 16)),
                         ("_scales", scales, (e, out, k // 32))):
      if arr.shape != want:
        raise ValueError(f"{r.prefix}{key}{t} has shape {arr.shape}, expected {want} "
                         f"(E, out, in / 32{', 16' if t == '_blocks' else ''}) for E={e}, "
                         f"H={h}, N={n}")
      if arr.dtype != np.uint8:
        raise TypeError(f"{r.prefix}{key}{t} must be uint8, got {arr.dtype}")
    return blocks.reshape(e, out, k // 2), scales

  b13, s13 = load("experts.gate_up_proj", 2 * n, h)
  b13 = np.concatenate([b13[:, 0::2], b13[:, 1::2]], axis=1)  # rows: gate | up
  s13 = np.concatenate([s13[:, 0::2], s13[:, 1::2]], axis=1)
  b2, s2 = load("experts.down_proj", h, n)
  scheme = QuantConfig("mxfp4")
  out = []
  for b, sc, what in ((b13, s13, "w13"), (b2, s2, "w2")):
    w = QuantizedWeights(values=jnp.asarray(b), scale=uint8_as_e8m0(sc), scheme=scheme)
    check_quantized(w, argname=f"{r.prefix}experts ({what})")
    out.append(w)
  return out[0], out[1]


def _mlp(r: _Reader, names: tuple[str, ...]) -> Optional[tuple[np.ndarray, np.ndarray]]:
  """A dense gated MLP (gate_proj/up_proj/down_proj) under one of `names` -> w13 [H,2Ns], w2."""
  for name in names:
    if r.has(f"{name}.gate_proj.weight"):
      g = r.linear(f"{name}.gate_proj.weight").T
      u = r.linear(f"{name}.up_proj.weight").T
      d = r.linear(f"{name}.down_proj.weight").T
      return np.concatenate([g, u], axis=-1), d
  return None


def from_hf_state_dict(model_type: Optional[str], hf_config: Any, state_dict: Mapping,
                       prefix: str = "", *, dtype=None, config_overrides: Optional[dict] = None,
                       quantized: str = "keep") -> tuple["MoEConfig", "MoEParams"]:
  """Convert one HF MoE block's tensors to jmoe.

  Args:
    model_type: one of `MODEL_TYPES` (or "llama4"); None reads `hf_config.model_type`.
    hf_config: the transformers config object of the model (or its config.json as a dict).
    state_dict: name -> tensor (torch tensors, NumPy or jax arrays); for a lazily opened
      safetensors file pass `{k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}`.
    prefix: the block's prefix in `state_dict`, e.g. "model.layers.3.mlp." ("" for a block's
      own `state_dict()`); a missing trailing "." is added.
    dtype: dtype of the returned parameters; None keeps the checkpoint's expert dtype
      (dequantized FP8 / MXFP4 weights become bfloat16).
    config_overrides: MoEConfig fields to set (e.g. runner_backend, fuse_shared_experts).
    quantized: "keep" (default): FP8 expert weights load as `jmoe.quant.QuantizedWeights`,
      their values and scales as stored — DeepSeek's `weight_scale_inv` 128x128 blocks as
      fp8_block, per-tensor / per-channel `weight_scale` exports as fp8_channel (a tensor's
      scale repeated over its channels), int8 ones (compressed-tensors W8A8) as int8 — and
      run W8A8 with dynamic activation scales, or, where every expert linear has a static
      `input_scale` (activation_scheme "static"), as fp8_channel_static / int8_static with one
      input scale per GEMM (the largest over the experts, as vLLM); gpt-oss MXFP4 as mxfp4, GPTQ / AWQ
      int4 as w4a16, ModelOpt nvfp4 as nvfp4 (values and scales as stored; the XLA experts
      dequantize them in the graph, no Pallas kernel takes them yet). "dequantize": bfloat16
      weights (or `dtype`).

  Returns:
    (MoEConfig, MoEParams) for `jmoe.moe_block`.
  """
  import jax.numpy as jnp  # noqa: PLC0415

  from jmoe.block import MoEParams  # noqa: PLC0415

  mt = resolve_model_type(model_type, hf_config)
  if prefix and not prefix.endswith("."):
    prefix += "."
  r = _Reader(state_dict, prefix, hf_config)
  probe = config_from_hf(mt, hf_config, dtype="float32")
  e, h, n = probe.num_experts, probe.hidden_size, probe.intermediate_size

  # experts
  if quantized not in ("keep", "dequantize"):
    raise ValueError(f"quantized={quantized!r}: 'keep' or 'dequantize'")
  kept = None
  if _fused_gate_up_key(r) is None:
    kept = _per_expert_8bit(r, e, h, n) if quantized == "keep" else None
    kept = kept or _per_expert_int4(r, e, h, n) or _per_expert_nvfp4(r, e, h, n)
  elif quantized == "keep" and r.has("experts.gate_up_proj_blocks"):
    kept = _gpt_oss_mxfp4(r, e, h, n)
  dense_from_packed = None
  if kept is not None and quantized == "dequantize":  # int4 / nvfp4 asked for dense
    from jmoe.quant.weights import dequantize  # noqa: PLC0415
    dense_from_packed = tuple(np.asarray(dequantize(w)) for w in kept)
    kept = None
  w13 = None if kept is not None or dense_from_packed else _fused_gate_up(r, mt, e, h, n)
  if dense_from_packed:
    w13, w2 = dense_from_packed
    src_key = None
  elif kept is not None:
    w13, w2 = (np.zeros((e, h, 2 * n), np.float32), np.zeros((e, n, h), np.float32))  # shapes
    src_key = None
  elif w13 is not None:
    w2 = _fused_down(r, mt, e, h, n)
    src_key = r.first("experts.down_proj", "experts.down_proj.weight")
  else:
    w13, w2 = _per_expert(r, e, h, n)
    src_key = r.first("experts.0.down_proj.weight", "experts.0.w2.weight")
  # quantized checkpoints (MXFP4 blocks, FP8) dequantize to bfloat16 unless told otherwise
  src_dtype = np.dtype(np.uint8) if src_key is None else r.raw(src_key).dtype
  if w13.shape != (e, h, 2 * n) or w2.shape != (e, n, h):
    raise ValueError(f"expert weights {w13.shape}/{w2.shape} do not match the config "
                     f"(E={e}, H={h}, N={n}: want {(e, h, 2 * n)} and {(e, n, h)})")
  if dtype is None:
    dtype = jnp.bfloat16 if np.dtype(src_dtype).itemsize < 2 else src_dtype
  dtype = jnp.dtype(dtype)

  def arr(x, dt=None):
    return None if x is None else jnp.asarray(np.asarray(x).astype(dt or dtype))

  # router
  rk = r.first("gate.weight", "router.weight")
  if rk is None:
    raise r.missing("router weight", ["gate.weight", "router.weight"])
  router_w = r.raw(rk)
  if router_w.shape != (e, h):
    raise ValueError(f"{prefix}{rk} has shape {router_w.shape}, expected {(e, h)}")
  p: dict[str, Any] = dict(router_w=arr(router_w.T, np.float32))
  p["w13"], p["w2"] = kept if kept is not None else (arr(w13), arr(w2))
  if probe.router_bias:
    bk = r.first("router.bias", "gate.bias")
    if bk is None:
      raise r.missing("router bias", ["router.bias", "gate.bias"])
    p["router_b"] = arr(r.raw(bk), np.float32)
  if probe.use_correction_bias:
    ck = r.first("gate.e_score_correction_bias", "e_score_correction_bias")
    p["correction_bias"] = (arr(r.raw(ck), np.float32) if ck is not None
                            else jnp.zeros((e,), jnp.float32))
  if probe.expert_bias:
    b13 = r.first("experts.gate_up_proj_bias")
    b2 = r.first("experts.down_proj_bias")
    if b13 is None or b2 is None:
      raise r.missing("expert biases", ["experts.gate_up_proj_bias", "experts.down_proj_bias"])
    bias13 = r.raw(b13)
    p["w13_bias"] = arr(_deinterleave(bias13) if FAMILIES[mt] in _INTERLEAVED else bias13)
    p["w2_bias"] = arr(r.raw(b2))

  # shared experts
  if probe.num_shared_experts:
    mlp = _mlp(r, ("shared_experts", "shared_expert", "shared_mlp"))
    if mlp is None:
      raise r.missing("shared expert", [f"{s}.gate_proj.weight" for s in
                                        ("shared_experts", "shared_expert", "shared_mlp")])
    sw13, sw2 = mlp
    if sw2.shape != (probe.shared_size, h):
      raise ValueError(f"shared expert down_proj is {sw2.shape[::-1]} (out, in), expected "
                       f"{(h, probe.shared_size)}")
    p["shared_w13"], p["shared_w2"] = arr(sw13), arr(sw2)
    if probe.shared_expert_gate:
      gk = r.first("shared_expert_gate.weight")
      if gk is None:
        raise r.missing("shared expert gate", ["shared_expert_gate.weight"])
      p["shared_gate"] = arr(r.raw(gk).reshape(-1), np.float32)

  config = config_from_hf(mt, hf_config, dtype=str(dtype), **(config_overrides or {}))
  return config, MoEParams(**p)


def to_hf_state_dict(model_type: str, config: "MoEConfig", params: "MoEParams",
                     prefix: str = "", *, layout: str = "fused", as_torch: bool = False) -> dict:
  """The inverse of `from_hf_state_dict`: jmoe parameters under the HF block's tensor names.

  `layout="fused"` writes the installed transformers' fused expert tensors
  (`experts.gate_up_proj` / `experts.down_proj`); `layout="per_expert"` the checkpoint names
  (`experts.{i}.w1|w3|w2.weight` for Mixtral, `experts.{i}.gate_proj|up_proj|down_proj.weight`
  for the others; gpt-oss and Llama 4 only have the fused layout). Values are NumPy arrays in
  the parameters' dtypes, or torch tensors with `as_torch=True`.
  """
  mt = resolve_model_type(model_type)
  fam = FAMILIES[mt]
  if layout not in ("fused", "per_expert"):
    raise ValueError(f"layout={layout!r} is not known; known: 'fused', 'per_expert'")
  if layout == "per_expert" and fam in ("gpt_oss", "llama4_text"):
    raise ValueError(f"{mt} has no per-expert layout; use layout='fused'")
  if prefix and not prefix.endswith("."):
    prefix += "."
  n = config.intermediate_size

  def np_(x):
    return None if x is None else np.asarray(x)

  w13, w2 = np_(params.w13), np_(params.w2)
  out: dict[str, np.ndarray] = {}
  router = "router" if fam in ("gpt_oss", "llama4_text") else "gate"
  out[f"{router}.weight"] = np_(params.router_w).T
  if params.router_b is not None:
    out[f"{router}.bias"] = np_(params.router_b)
  if params.correction_bias is not None:
    out["gate.e_score_correction_bias"] = np_(params.correction_bias)
  if layout == "fused":
    if fam in _INTERLEAVED:  # gate | up -> g0 u0 g1 u1 ...
      w13 = np.stack([w13[..., :n], w13[..., n:]], axis=-1).reshape(w13.shape)
    if fam in _FUSED_XW_ORDER:
      out["experts.gate_up_proj"], out["experts.down_proj"] = w13, w2
    else:
      out["experts.gate_up_proj"] = np.swapaxes(w13, 1, 2)
      out["experts.down_proj"] = np.swapaxes(w2, 1, 2)
    if params.w13_bias is not None:
      b13 = np_(params.w13_bias)
      if fam in _INTERLEAVED:
        b13 = np.stack([b13[..., :n], b13[..., n:]], axis=-1).reshape(b13.shape)
      out["experts.gate_up_proj_bias"] = b13
      out["experts.down_proj_bias"] = np_(params.w2_bias)
  else:
    g, u, d = _PER_EXPERT_NAMES[1] if fam == "mixtral" else _PER_EXPERT_NAMES[0]
    for i in range(w13.shape[0]):
      out[f"experts.{i}.{g}.weight"] = w13[i, :, :n].T
      out[f"experts.{i}.{u}.weight"] = w13[i, :, n:].T
      out[f"experts.{i}.{d}.weight"] = w2[i].T
  if params.shared_w13 is not None:
    name = "shared_experts" if fam in ("deepseek_v3", "deepseek_v2") else "shared_expert"
    sw13, ns = np_(params.shared_w13), np_(params.shared_w2).shape[0]
    out[f"{name}.gate_proj.weight"] = sw13[:, :ns].T
    out[f"{name}.up_proj.weight"] = sw13[:, ns:].T
    out[f"{name}.down_proj.weight"] = np_(params.shared_w2).T
  if params.shared_gate is not None:
    out["shared_expert_gate.weight"] = np_(params.shared_gate).reshape(1, -1)
  out = {prefix + k: np.ascontiguousarray(v) for k, v in out.items()}
  if as_torch:
    out = {k: _numpy_to_torch(v) for k, v in out.items()}
  return out


def _numpy_to_torch(a: np.ndarray):
  import torch  # noqa: PLC0415
  import ml_dtypes  # noqa: PLC0415

  if a.dtype == ml_dtypes.bfloat16:
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
  return torch.from_numpy(a.copy())


def from_hf_module(module, hf_config: Any = None, model_type: Optional[str] = None, *,
                   dtype=None) -> tuple["MoEConfig", "MoEParams"]:
  """Convert a live transformers MoE block (e.g. `model.model.layers[3].mlp`)."""
  if model_type is None:
    model_type = BLOCK_CLASSES.get(type(module).__name__)
  if hf_config is None:
    hf_config = getattr(module, "config", None)
    if hf_config is None:
      for child in module.modules():
        hf_config = getattr(child, "config", None)
        if hf_config is not None:
          break
    if hf_config is None:
      raise ValueError(f"{type(module).__name__} carries no config; pass hf_config")
  overrides = {}
  experts = getattr(module, "experts", None)
  mt = resolve_model_type(model_type, hf_config)
  if FAMILIES[mt] == "gpt_oss" and experts is not None:
    # what the live block computes: transformers 4.5x hard-codes alpha 1.702 / limit 7.0 on the
    # experts module whatever the config says; 5.x copies the config's values there.
    for attr, field in (("alpha", "swiglu_alpha"), ("limit", "swiglu_limit")):
      if isinstance(getattr(experts, attr, None), (int, float)):
        overrides[field] = float(getattr(experts, attr))
  return from_hf_state_dict(mt, hf_config, module.state_dict(), "", dtype=dtype,
                            config_overrides=overrides)


def moe_layer_prefixes(state_dict: Mapping, model_type: Optional[str] = None) -> list[str]:
  """The prefixes of the MoE blocks in a full-model state dict, in layer order (those that have a
  router: `...mlp.`, `...block_sparse_moe.`, `...feed_forward.`)."""
  pat = re.compile(r"^(.*?)(gate|router)\.weight$")
  out = []
  for k in state_dict:
    m = pat.match(k)
    if m and (m.group(1) + "experts.gate_up_proj" in state_dict
              or m.group(1) + "experts.gate_up_proj_blocks" in state_dict
              or any(m.group(1) + f"experts.0.{g}.{t}" in state_dict
                     for g, _, _ in _PER_EXPERT_NAMES for t in ("weight", "qweight"))):
      out.append(m.group(1))

  def layer_no(p):
    nums = re.findall(r"\.(\d+)\.", p)
    return (int(nums[-1]) if nums else -1, p)

  return sorted(out, key=layer_no)
