"""Hugging Face safetensors checkpoints -> `jmoe.layers.MoE` and `jmoe.models.MoETransformer`.

A checkpoint is read lazily, tensor by tensor: `SafetensorsCheckpoint(path)` opens the
safetensors file(s) of a directory (one `model.safetensors`, or the shards an
`model.safetensors.index.json` names) and reads only their headers; it is a read-only Mapping
name -> tensor whose `__getitem__` reads that one tensor (`safe_open(...).get_tensor`), so a
layer's load touches that layer's tensors and nothing else (`reads` lists them). The layout
conversion is `jmoe.interop.hf.from_hf_state_dict`'s (every family and layout it knows,
FP8 experts kept quantized with `quantized="keep"`).

    from jmoe.interop import checkpoints
    layer = checkpoints.load_moe_layer("path/to/checkpoint", 3)     # decoder layer 3's MoE
    y = layer(x)                                                      # x [T, H]
    model, report = checkpoints.load_transformer("path/to/checkpoint")

What `load_transformer` loads into the reference model, by `config.json`'s model_type:

==================  ==========================================================================
mixtral, qwen3_moe  everything: embeddings, every layer's norms, attention (q/k/v/o, Qwen3's
                    q/k norms) and MoE block, the final norm and lm_head; the logits match
                    transformers' `...ForCausalLM` (default rope only; a `sliding_window`
                    shorter than the sequence is not modelled).
qwen2_moe           embeddings, norms, MoE blocks (shared expert and its gate), lm_head; not
                    the attention (its q/k/v biases have no place in the reference model).
deepseek_v3         embeddings, norms, the dense first layers' MLPs, MoE blocks (correction
                    bias, shared experts), lm_head; not the attention (MLA; the reference
                    model has grouped-query attention).
gpt_oss             embeddings, norms, MoE blocks (router and expert biases, swigluoai),
                    lm_head; not the attention (biases, sinks, sliding windows, yarn rope).
==================  ==========================================================================

The report's `skipped` names every checkpoint tensor that was not loaded (the attention of the
last three, for instance), and `attention_loaded` says whether the logits can match.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, Optional, Union

import numpy as np

from jmoe.interop import hf

PathLike = Union[str, "os.PathLike[str]"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# families whose attention is the reference model's (GQA, rotate-half rope, no biases)
_ATTENTION_FAMILIES = ("mixtral", "qwen3_moe")


# --------------------------------------------------------------------------------------------
# lazy checkpoint


class SafetensorsCheckpoint(Mapping):
  """A read-only Mapping over the tensors of a safetensors checkpoint, read on access.

  Args:
    path: a directory holding `model.safetensors` or `model.safetensors.index.json` (and
      usually `config.json`), a `.safetensors` file, or an index json file.
    framework: what `get_tensor` returns: "pt" (torch tensors, any dtype incl. bf16 / fp8;
      the default when torch is installed), "numpy" (no bf16), or "flax" (jax arrays).

  Only the files' headers are read on construction. `ckpt[name]` reads that one tensor;
  `shape(name)` / `dtype(name)` read nothing. `reads` lists the names read so far, in order
  (tests use it to check that loading a layer reads that layer only). `config` is the parsed
  `config.json` beside the tensors (None when there is none). Use as a context manager, or
  call `close()`, to release the file handles.
  """

  def __init__(self, path: PathLike, *, framework: Optional[str] = None):
    from safetensors import safe_open  # noqa: PLC0415

    self._safe_open = safe_open
    path = os.fspath(path)
    if framework is None:
      try:
        import torch  # noqa: F401, PLC0415
        framework = "pt"
      except ImportError:
        framework = "flax"
    if framework not in ("pt", "numpy", "np", "flax", "jax"):
      raise ValueError(f"framework={framework!r}: 'pt', 'numpy' or 'flax'")
    self.framework = framework
    if os.path.isdir(path):
      root = path
      index = os.path.join(path, INDEX_NAME)
      single = os.path.join(path, SINGLE_NAME)
      if os.path.exists(index):
        files = self._from_index(index)
      elif os.path.exists(single):
        files = None
        self._key_file = None
        self._files = [single]
      else:
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not found:
          raise FileNotFoundError(f"path={path!r} holds neither {INDEX_NAME} nor any "
                                  ".safetensors file")
        self._files = [os.path.join(path, f) for f in found]
        files = None
    elif path.endswith(".json"):
      root = os.path.dirname(path)
      files = self._from_index(path)
    elif os.path.isfile(path):
      root = os.path.dirname(path)
      self._files = [path]
      files = None
    else:
      raise FileNotFoundError(f"path={path!r} does not exist")
    self.root = root
    self._handles: dict[str, Any] = {}
    if files is None:  # headers: which file holds which tensor
      self._key_file = {}
      for f in self._files:
        for k in self._handle(f).keys():
          self._key_file[k] = f
    self.reads: list[str] = []
    cfg = os.path.join(root, "config.json")
    self.config: Optional[dict] = json.load(open(cfg)) if os.path.exists(cfg) else None

  def _from_index(self, index_path: str) -> dict:
    with open(index_path) as fh:
      index = json.load(fh)
    if "weight_map" not in index:
      raise ValueError(f"{index_path} has no 'weight_map'")
    base = os.path.dirname(index_path)
    self._key_file = {k: os.path.join(base, f) for k, f in index["weight_map"].items()}
    self._files = sorted(set(self._key_file.values()))
    for f in self._files:
      if not os.path.exists(f):
        raise FileNotFoundError(f"{index_path} names the shard {f}, which does not exist")
    return self._key_file

  def _handle(self, f: str):
    h = self._handles.get(f)
    if h is None:
      h = self._handles[f] = self._safe_open(f, framework=self.framework)
    return h

  # Mapping
  def __getitem__(self, key: str):
    f = self._key_file.get(key)
    if f is None:
      raise KeyError(f"tensor {key!r} is not in the checkpoint at {self.root!r}")
    self.reads.append(key)
    return self._handle(f).get_tensor(key)

  def __contains__(self, key) -> bool:
    return key in self._key_file

  def __iter__(self) -> Iterator[str]:
    return iter(self._key_file)

  def __len__(self) -> int:
    return len(self._key_file)

  # header-only queries
  def shape(self, key: str) -> tuple[int, ...]:
    """The tensor's shape, from the file header (nothing is read)."""
    if key not in self._key_file:
      raise KeyError(f"tensor {key!r} is not in the checkpoint at {self.root!r}")
    return tuple(self._handle(self._key_file[key]).get_slice(key).get_shape())

  def dtype(self, key: str) -> str:
    """The tensor's safetensors dtype name ("BF16", "F8_E4M3", ...), from the header."""
    if key not in self._key_file:
      raise KeyError(f"tensor {key!r} is not in the checkpoint at {self.root!r}")
    return self._handle(self._key_file[key]).get_slice(key).get_dtype()

  @property
  def files(self) -> list[str]:
    return list(self._files)

  def close(self) -> None:
    for h in self._handles.values():
      exit_ = getattr(h, "__exit__", None)
      if exit_ is not None:
        exit_(None, None, None)
    self._handles.clear()

  def __enter__(self) -> "SafetensorsCheckpoint":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"SafetensorsCheckpoint({self.root!r}, {len(self)} tensors in "
            f"{len(self._files)} file(s))")


def _as_checkpoint(path_or_ckpt) -> tuple[Mapping, bool]:
  """(mapping, opened_here)."""
  if isinstance(path_or_ckpt, Mapping):
    return path_or_ckpt, False
  return SafetensorsCheckpoint(path_or_ckpt), True


def _hf_config(ckpt: Mapping, hf_config: Any) -> Any:
  if hf_config is not None:
    return hf_config
  cfg = getattr(ckpt, "config", None)
  if cfg is None:
    raise ValueError("no hf_config given and no config.json beside the checkpoint's tensors; "
                     "pass hf_config (a transformers config or config.json as a dict)")
  return cfg


def moe_prefixes(ckpt: Mapping, model_type: Optional[str] = None) -> dict[int, str]:
  """Decoder layer index -> the prefix of its MoE block ("model.layers.3.mlp."), for the
  layers that have one (DeepSeek's dense first layers do not)."""
  out = {}
  for p in hf.moe_layer_prefixes(ckpt, model_type):
    m = re.search(r"layers\.(\d+)\.", p)
    if m is None:
      raise ValueError(f"MoE block prefix {p!r} names no layer index (layers.<i>.)")
    out[int(m.group(1))] = p
  return dict(sorted(out.items()))


def _resolve_prefix(ckpt: Mapping, layer: Union[int, str], model_type) -> str:
  if isinstance(layer, str):
    prefix = layer if layer.endswith(".") or not layer else layer + "."
    if not any(k.startswith(prefix) for k in ckpt):
      raise KeyError(f"layer={layer!r}: no tensor in the checkpoint starts with {prefix!r}")
    return prefix
  if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
    raise TypeError(f"layer must be a decoder layer index (int) or a tensor-name prefix (str), "
                    f"got {type(layer).__name__}")
  found = moe_prefixes(ckpt, model_type)
  if int(layer) not in found:
    raise KeyError(f"layer={layer}: decoder layer {layer} has no MoE block in this checkpoint; "
                   f"the MoE layers are {sorted(found)}")
  return found[int(layer)]


# --------------------------------------------------------------------------------------------
# one MoE layer


def load_moe_params(path_or_ckpt: Union[PathLike, Mapping], layer: Union[int, str], *,
                    hf_config: Any = None, model_type: Optional[str] = None, dtype=None,
                    quantized: str = "keep", config_overrides: Optional[dict] = None
                    ) -> tuple["jmoe.MoEConfig", "jmoe.MoEParams"]:  # noqa: F821
  """One MoE block of a checkpoint as `(MoEConfig, MoEParams)` for `jmoe.moe_block`.

  Args:
    path_or_ckpt: a checkpoint directory / file (see `SafetensorsCheckpoint`) or an open
      Mapping of tensors (a `SafetensorsCheckpoint`, a state dict).
    layer: the decoder layer's index (its MoE block is found by the router's name:
      `model.layers.<i>.mlp.` / `.block_sparse_moe.`) or the block's tensor-name prefix.
    hf_config: the transformers config (or config.json as a dict); default: config.json.
    model_type: default: the config's `model_type`.
    dtype, quantized, config_overrides: as `jmoe.interop.hf.from_hf_state_dict` (dtype None
      keeps the checkpoint's; quantized "keep" leaves FP8 experts as QuantizedWeights).

  Only the block's tensors are read. A missing tensor raises KeyError naming it; a tensor of
  the wrong shape raises ValueError naming it with its shape and the expected one.
  """
  ckpt, opened = _as_checkpoint(path_or_ckpt)
  try:
    cfg = _hf_config(ckpt, hf_config)
    prefix = _resolve_prefix(ckpt, layer, model_type)
    return hf.from_hf_state_dict(model_type, cfg, ckpt, prefix, dtype=dtype,
                                 quantized=quantized, config_overrides=config_overrides)
  finally:
    if opened:
      ckpt.close()


def _abstract_moe(config, **layer_kwargs):
  """A `jmoe.layers.MoE` whose variables are shapes only (no random draw); with router
  jitter (which keeps an rng stream) a concrete one."""
  from flax import nnx  # noqa: PLC0415

  from jmoe.layers import MoE  # noqa: PLC0415

  make = lambda: MoE(config, rngs=nnx.Rngs(0), **layer_kwargs)  # noqa: E731
  return make() if layer_kwargs.get("router_jitter", 0.0) else nnx.eval_shape(make)


def moe_layer_from_params(config, params, *, param_dtype=None, **layer_kwargs):
  """A `jmoe.layers.MoE` holding `params` (jmoe's layout; dense or QuantizedWeights experts).

  param_dtype defaults to the experts' dtype (float32 when they are quantized); the layer's
  quantization scheme is that of quantized experts. No initial weights are drawn: the layer is
  built abstract (`nnx.eval_shape`) and takes the values. layer_kwargs go to `MoE`.
  """
  import jax.numpy as jnp  # noqa: PLC0415

  from jmoe.quant import QuantizedWeights  # noqa: PLC0415

  quantized = isinstance(params.w13, QuantizedWeights)
  if param_dtype is None:
    param_dtype = jnp.float32 if quantized else params.w13.dtype
  if quantized:
    if "quant" in layer_kwargs and layer_kwargs["quant"] not in (None, params.w13.scheme):
      raise ValueError(f"quant={layer_kwargs['quant']} but the checkpoint's experts are "
                       f"{params.w13.scheme}")
    layer_kwargs["quant"] = params.w13.scheme
    if params.w13.input_scale is not None:  # a static scheme: the layer holds its scales
      layer_kwargs["input_scales"] = (params.w13.input_scale, params.w2.input_scale)
  layer = _abstract_moe(config, param_dtype=param_dtype, **layer_kwargs)
  layer.load_params(params)
  return layer


def load_moe_layer(path_or_ckpt: Union[PathLike, Mapping], layer: Union[int, str], *,
                   hf_config: Any = None, model_type: Optional[str] = None, dtype=None,
                   quantized: str = "keep", config_overrides: Optional[dict] = None,
                   param_dtype=None, **layer_kwargs) -> "jmoe.layers.MoE":  # noqa: F821
  """One MoE block of a checkpoint as a `jmoe.layers.MoE` (x [..., H] -> [..., H]).

  Arguments as `load_moe_params` (`dtype` is the loaded parameters' dtype); param_dtype
  (default: the loaded experts' dtype) and layer_kwargs (runner_backend, parallel, the compute
  `dtype` as `compute_dtype`, ...) go to `jmoe.layers.MoE`. FP8 experts loaded with
  quantized="keep" make a quantized layer (forward only).
  """
  config, params = load_moe_params(path_or_ckpt, layer, hf_config=hf_config,
                                   model_type=model_type, dtype=dtype, quantized=quantized,
                                   config_overrides=config_overrides)
  if "compute_dtype" in layer_kwargs:
    layer_kwargs["dtype"] = layer_kwargs.pop("compute_dtype")
  return moe_layer_from_params(config, params, param_dtype=param_dtype, **layer_kwargs)


# --------------------------------------------------------------------------------------------
# the reference model


def _rope_theta(cfg: Any) -> tuple[float, str]:
  rp = hf._get(cfg, "rope_parameters", "rope_scaling", default=None)
  theta = hf._get(cfg, "rope_theta", default=None)
  rtype = "default"
  if isinstance(rp, Mapping):
    theta = rp.get("rope_theta", theta)
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
  elif rp is not None:
    theta = getattr(rp, "rope_theta", theta)
  return float(theta if theta is not None else 10000.0), rtype


def transformer_config_from_hf(hf_config: Any, *, model_type: Optional[str] = None,
                               dtype: str = "float32", **moe_overrides
                               ) -> "jmoe.models.TransformerConfig":  # noqa: F821
  """The reference model's `TransformerConfig` mirroring an HF MoE model's structure
  (layers, widths, heads, dense first layers, norms' epsilon, rope theta, q/k norm, tied
  embeddings); its `moe` is `hf.config_from_hf`'s. Raises for layouts the reference model
  cannot hold (MoE and dense layers interleaved)."""
  from jmoe.models import TransformerConfig  # noqa: PLC0415

  mt = hf.resolve_model_type(model_type, hf_config)
  fam = hf.FAMILIES[mt]
  cfg = hf._text_config(hf_config)
  g = lambda *n, **kw: hf._get(cfg, *n, **kw)  # noqa: E731
  layers = int(g("num_hidden_layers"))
  first_dense = 0
  if fam == "deepseek_v3":
    first_dense = int(g("first_k_dense_replace", default=0))
  if fam in ("qwen3_moe", "qwen2_moe"):
    only = list(g("mlp_only_layers", default=[]) or [])
    step = int(g("decoder_sparse_step", default=1))
    dense = sorted(set(only) | {i for i in range(layers) if (i + 1) % step})
    if dense:
      raise ValueError(f"{mt}: layers {dense} are dense (mlp_only_layers / decoder_sparse_step)"
                       "; the reference model has dense layers only before the MoE ones")
  theta, _ = _rope_theta(cfg)
  heads = int(g("num_attention_heads"))
  hidden = int(g("hidden_size"))
  head_dim = g("head_dim", default=None)
  if fam == "deepseek_v3" or head_dim is None:
    head_dim = hidden // heads if hidden % heads == 0 else None
  return TransformerConfig(
      vocab_size=int(g("vocab_size")), num_layers=layers, hidden_size=hidden,
      num_heads=heads, num_kv_heads=int(g("num_key_value_heads", default=heads)),
      moe=hf.config_from_hf(mt, hf_config, dtype=dtype, **moe_overrides),
      head_dim=int(head_dim) if head_dim is not None else None,
      first_dense_layers=first_dense,
      dense_intermediate_size=int(g("intermediate_size")) if first_dense else None,
      qk_norm=fam == "qwen3_moe", rope_theta=theta,
      norm_eps=float(g("rms_norm_eps", default=1e-6)),
      tie_embeddings=bool(hf._get(hf_config, "tie_word_embeddings", default=False)))


@dataclasses.dataclass
class LoadReport:
  """What `load_transformer` did: `loaded` / `skipped` checkpoint tensor names (every tensor
  of the checkpoint is in exactly one), and whether the attention was loaded (only then do
  the logits match the HF model's)."""

  model_type: str
  attention_loaded: bool
  loaded: list
  skipped: list
  notes: list


def _attention_matches(fam: str, cfg: Any) -> tuple[bool, str]:
  if fam not in _ATTENTION_FAMILIES:
    return False, (f"{fam} attention is not the reference model's grouped-query attention "
                   "(biases / MLA / sinks): its tensors are skipped")
  _, rtype = _rope_theta(cfg)
  if rtype != "default":
    return False, f"rope_type={rtype!r} is not modelled: attention tensors skipped"
  if bool(hf._get(cfg, "attention_bias", default=False)):
    return False, "attention_bias=True is not modelled: attention tensors skipped"
  return True, ""


def load_transformer(path_or_ckpt: Union[PathLike, Mapping], *, model=None,
                     hf_config: Any = None, model_type: Optional[str] = None,
                     param_dtype=None, quantized: str = "keep", **model_kwargs
                     ) -> tuple["jmoe.models.MoETransformer", LoadReport]:  # noqa: F821
  """A checkpoint into the reference `jmoe.models.MoETransformer` (see the module docstring
  for what loads per family).

  Args:
    path_or_ckpt: a checkpoint directory / file or an open Mapping of tensors.
    model: a model to load into (its config must match the checkpoint's); default: one built
      from `transformer_config_from_hf` with `param_dtype` (default float32) and model_kwargs.
    hf_config, model_type, quantized: as `load_moe_params`. FP8 experts kept quantized replace
      that layer's MoE with a quantized one (forward only).

  Returns:
    (model, LoadReport). tokens [B, S] -> model(tokens) = (logits [B, S, V], aux).
  """
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from jmoe.models import MoETransformer  # noqa: PLC0415
  from jmoe.quant import QuantizedWeights  # noqa: PLC0415

  ckpt, opened = _as_checkpoint(path_or_ckpt)
  try:
    cfg = _hf_config(ckpt, hf_config)
    mt = hf.resolve_model_type(model_type, cfg)
    fam = hf.FAMILIES[mt]
    tcfg = transformer_config_from_hf(cfg, model_type=mt)
    attn_ok, why = _attention_matches(fam, hf._text_config(cfg))
    if model is None:
      pdt = jnp.float32 if param_dtype is None else param_dtype
      make = lambda: MoETransformer(tcfg, rngs=nnx.Rngs(0), param_dtype=pdt,  # noqa: E731
                                    **model_kwargs)
      # everything is overwritten when the attention loads: build it abstract (no draws)
      model = nnx.eval_shape(make) if attn_ok and not model_kwargs.get("router_jitter") \
          else make()
    elif not isinstance(model, MoETransformer):
      raise TypeError(f"model must be a jmoe.models.MoETransformer, got {type(model).__name__}")
    else:
      shape = lambda m: (m.num_experts, m.top_k, m.hidden_size, m.intermediate_size,  # noqa
                         m.num_shared_experts)
      if model.cfg.replace(moe=tcfg.moe) != tcfg or shape(model.cfg.moe) != shape(tcfg.moe):
        raise ValueError(f"model.cfg {model.cfg} does not match the checkpoint's {tcfg}")
    notes = [] if attn_ok else [why]
    loaded: set = set()

    def put(var, key: str, transpose: bool = False) -> None:
      if key not in ckpt:
        raise KeyError(f"tensor {key!r} is missing from the checkpoint (the model's "
                       f"{tuple(var.shape)} variable needs it)")
      shape = tuple(ckpt.shape(key)) if hasattr(ckpt, "shape") else tuple(ckpt[key].shape)
      want = tuple(var.shape)[::-1] if transpose else tuple(var.shape)
      if shape != want:
        raise ValueError(f"tensor {key!r} has shape {shape}, expected {want}")
      a = hf.to_numpy(ckpt[key])
      if a.dtype.itemsize < 2 or a.dtype.kind not in "fV":
        a = a.astype(np.float32)
      value = jnp.asarray(a.T if transpose else a, var.dtype)
      if isinstance(var.get_value(), jax.ShapeDtypeStruct):
        var.set_value(value)
      else:
        var[...] = value
      loaded.add(key)

    put(model.embed.embedding, "model.embed_tokens.weight")
    put(model.norm.scale, "model.norm.weight")
    if model.lm_head is not None:
      put(model.lm_head.kernel, "lm_head.weight", transpose=True)
    prefixes = moe_prefixes(ckpt, mt)
    for i, layer in enumerate(model.layers):
      p = f"model.layers.{i}."
      put(layer.attn_norm.scale, p + "input_layernorm.weight")
      put(layer.ffn_norm.scale, p + "post_attention_layernorm.weight")
      if attn_ok:
        a = layer.attn
        for name in ("q", "k", "v", "o"):
          put(getattr(a, name).kernel, f"{p}self_attn.{name}_proj.weight", transpose=True)
        if a.q_norm is not None:
          put(a.q_norm.scale, p + "self_attn.q_norm.weight")
          put(a.k_norm.scale, p + "self_attn.k_norm.weight")
      if layer.is_moe:
        if i not in prefixes:
          raise KeyError(f"decoder layer {i} is an MoE layer in the model but the checkpoint "
                         f"has no MoE block (router) under {p}")
        before = len(getattr(ckpt, "reads", ()))
        _, params = hf.from_hf_state_dict(mt, cfg, ckpt, prefixes[i], quantized=quantized)
        keys = [k for k in ckpt if k.startswith(prefixes[i])]
        loaded.update(keys if not hasattr(ckpt, "reads") else ckpt.reads[before:])
        old = layer.ffn
        if isinstance(params.w13, QuantizedWeights):
          layer.ffn = moe_layer_from_params(
              old.config, params, param_dtype=old.param_dtype, dtype=old.dtype,
              runner_backend=old.runner_backend, a2a_backend=old.a2a_backend,
              parallel=old.parallel, capacity_factor=old.capacity_factor,
              router_jitter=old.router_jitter)
        else:
          old.load_params(params)
      else:
        d = layer.ffn
        for name in ("gate", "up", "down"):
          put(getattr(d, name).kernel, f"{p}mlp.{name}_proj.weight", transpose=True)
    report = LoadReport(model_type=mt, attention_loaded=attn_ok, loaded=sorted(loaded),
                        skipped=sorted(set(ckpt) - loaded), notes=notes)
    return model, report
  finally:
    if opened:
      ckpt.close()


__all__ = ["LoadReport", "SafetensorsCheckpoint", "load_moe_layer", "load_moe_params",
           "load_transformer", "moe_layer_from_params", "moe_prefixes",
           "transformer_config_from_hf"]
