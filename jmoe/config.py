"""Frozen, validated configuration dataclasses and the benchmark presets.

`MoEConfig` describes one MoE block (router + routed experts + shared experts), `QuantConfig`
the weight/activation format, `ParallelConfig` the mesh the block is sharded over. All are
frozen (hashable, so usable as static jit arguments) and validated on creation: a bad value
raises a ValueError naming the field.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any, Optional

import jax.numpy as jnp

from jmoe.kernels.activations import ACTIVATIONS, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, Activation

SCORING_FUNCS = ("softmax", "sigmoid")
RUNNER_BACKENDS = ("auto", "reference", "xla", "xla_batched", "pallas_mosaic")


def pallas_interpret_from_env() -> bool:
  """JMOE_PALLAS_INTERPRET=1: the Pallas kernels run in the CPU interpreter (tests, no GPU)."""
  return os.environ.get("JMOE_PALLAS_INTERPRET", "0") == "1"

A2A_BACKENDS = ("auto", "none", "allgather", "ragged_a2a", "ragged_dedup", "padded_a2a")
EXPERT_PLACEMENTS = ("linear", "round_robin")
DISPATCH_DTYPES = (None, "fp8")


def _positive_int(name: str, value: Any) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_choice(name: str, value: Any, choices) -> None:
  """Raise a ValueError naming `name` when `value` is not one of `choices`."""
  if value not in choices:
    known = ", ".join(repr(c) for c in choices)
    raise ValueError(f"{name}={value!r} is not known; known: {known}")


# Quantization schemes as data (DESIGN.md, "Quantized formats"). A scheme = how the expert
# weights are stored (value dtype, the granularity of their scales, zero points) x how the
# activations entering each GEMM are quantized (dtype and scale granularity, or not at all).
WEIGHT_DTYPES = ("float8_e4m3fn", "int8", "int4", "float4_e2m1fn")
# tensor: one scale per expert matrix; channel: one per output channel; block: one per
# (bk x bn) tile of [K, N]; group: one per g consecutive K values of each output channel
WEIGHT_SCALES = ("tensor", "channel", "block", "group")
SCALE_DTYPES = ("float32", "float8_e8m0fnu", "float8_e4m3fn")
ACT_DTYPES = (None, "float8_e4m3fn", "int8")
# static_tensor: one calibrated scale (a checkpoint's input_scale); dynamic_tensor: max |x| over
# the call; dynamic_token: one per row; dynamic_group: one per `act_group_size` channels per row
ACT_SCALES = (None, "static_tensor", "dynamic_tensor", "dynamic_token", "dynamic_group")

# name -> the scheme's fields (users name schemes by the words vLLM / checkpoints use)
QUANT_SCHEMES: dict[str, dict[str, Any]] = {
    "fp8_tensor": dict(weight_dtype="float8_e4m3fn", weight_scale="tensor",
                       act_dtype="float8_e4m3fn", act_scale="dynamic_token"),
    "fp8_channel": dict(weight_dtype="float8_e4m3fn", weight_scale="channel",
                        act_dtype="float8_e4m3fn", act_scale="dynamic_token"),
    # static: one calibrated activation scale per GEMM input (the checkpoint's input_scale;
    # vLLM's fp8 activation_scheme "static"), so GEMM1's epilogue writes GEMM2's 8-bit input
    "fp8_tensor_static": dict(weight_dtype="float8_e4m3fn", weight_scale="tensor",
                              act_dtype="float8_e4m3fn", act_scale="static_tensor"),
    "fp8_channel_static": dict(weight_dtype="float8_e4m3fn", weight_scale="channel",
                               act_dtype="float8_e4m3fn", act_scale="static_tensor"),
    "fp8_block": dict(weight_dtype="float8_e4m3fn", weight_scale="block", block_shape=(128, 128),
                      act_dtype="float8_e4m3fn", act_scale="dynamic_group", act_group_size=128),
    "int8": dict(weight_dtype="int8", weight_scale="channel", act_dtype="int8",
                 act_scale="dynamic_token"),
    "int8_static": dict(weight_dtype="int8", weight_scale="channel", act_dtype="int8",
                        act_scale="static_tensor"),
    "w8a16": dict(weight_dtype="int8", weight_scale="channel"),
    "w4a16": dict(weight_dtype="int4", weight_scale="group", group_size=128),
    "mxfp8": dict(weight_dtype="float8_e4m3fn", weight_scale="group", group_size=32,
                  scale_dtype="float8_e8m0fnu", act_dtype="float8_e4m3fn",
                  act_scale="dynamic_group", act_group_size=32),
    "mxfp4": dict(weight_dtype="float4_e2m1fn", weight_scale="group", group_size=32,
                  scale_dtype="float8_e8m0fnu"),
    "nvfp4": dict(weight_dtype="float4_e2m1fn", weight_scale="group", group_size=16,
                  scale_dtype="float8_e4m3fn"),
    # 4-bit weights with fp8 tokens (one scale per token): the codes convert to e4m3
    # exactly, so the decode kernel's MMAs are 8-bit (SGLang's "w4afp8": int4 per 128)
    "w4afp8": dict(weight_dtype="int4", weight_scale="group", group_size=128,
                   act_dtype="float8_e4m3fn", act_scale="dynamic_token"),
    "mxfp4_fp8": dict(weight_dtype="float4_e2m1fn", weight_scale="group", group_size=32,
                      scale_dtype="float8_e8m0fnu", act_dtype="float8_e4m3fn",
                      act_scale="dynamic_token"),
    "nvfp4_fp8": dict(weight_dtype="float4_e2m1fn", weight_scale="group", group_size=16,
                      scale_dtype="float8_e4m3fn", act_dtype="float8_e4m3fn",
                      act_scale="dynamic_token"),
}
QUANT_FORMATS = (None, *QUANT_SCHEMES, "custom")
_SCHEME_DEFAULTS = dict(weight_dtype=None, weight_scale=None, block_shape=None, group_size=None,
                        zero_point=False, scale_dtype="float32", act_dtype=None, act_scale=None,
                        act_group_size=None)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """A quantization scheme for the expert weights and the activations entering the GEMMs.

  `QuantConfig("fp8_block")` takes a named scheme (QUANT_SCHEMES); any field given as well
  overrides the name's (`QuantConfig("fp8_block", block_shape=(128, 64))`);
  `format="custom"` spells every field out. `format=None` is unquantized. Fields:

    weight_dtype: stored value type (WEIGHT_DTYPES).
    weight_scale: scale granularity over each expert's [K, N] matrix (WEIGHT_SCALES);
      block_shape (bk, bn) for "block", group_size g along K for "group".
    zero_point: asymmetric weights (w = (q - zero) * scale).
    scale_dtype: "float32", or the microscaling types (e8m0 for mx, e4m3 for nvfp4).
    act_dtype / act_scale / act_group_size: how GEMM1's input and GEMM2's input (the
      activation's output) are quantized; act_dtype None = weight-only (a16).

  Validated on creation: a bad value raises a ValueError naming the field.
  """

  format: Optional[str] = None
  weight_dtype: Optional[str] = None
  weight_scale: Optional[str] = None
  block_shape: Optional[tuple[int, int]] = None
  group_size: Optional[int] = None
  zero_point: Optional[bool] = None
  scale_dtype: Optional[str] = None
  act_dtype: Optional[str] = None
  act_scale: Optional[str] = None
  act_group_size: Optional[int] = None

  def __post_init__(self):
    check_choice("QuantConfig.format", self.format, QUANT_FORMATS)
    if self.format is None:
      given = [f for f, d in _SCHEME_DEFAULTS.items() if getattr(self, f) not in (None, d)]
      if given:
        raise ValueError(f"QuantConfig.{given[0]}={getattr(self, given[0])!r} given without a "
                         "format: name a scheme (format='fp8_block', ...) or format='custom'")
      return
    named = QUANT_SCHEMES.get(self.format, {})
    for f, default in _SCHEME_DEFAULTS.items():  # fill what the caller left out
      if getattr(self, f) is None:
        object.__setattr__(self, f, named.get(f, default))
    if self.block_shape is not None:
      object.__setattr__(self, "block_shape", tuple(self.block_shape))
    self._validate()

  def _validate(self):
    q = "QuantConfig."
    check_choice(q + "weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
    check_choice(q + "weight_scale", self.weight_scale, WEIGHT_SCALES)
    check_choice(q + "scale_dtype", self.scale_dtype, SCALE_DTYPES)
    check_choice(q + "act_dtype", self.act_dtype, ACT_DTYPES)
    check_choice(q + "act_scale", self.act_scale, ACT_SCALES)
    if self.weight_scale == "block":
      bs = self.block_shape
      if not (isinstance(bs, tuple) and len(bs) == 2
              and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bs)):
        raise ValueError(f"{q}block_shape must be (bk, bn) positive ints for weight_scale="
                         f"'block', got {self.block_shape!r}")
    elif self.block_shape is not None:
      raise ValueError(f"{q}block_shape={self.block_shape!r} needs weight_scale='block', got "
                       f"weight_scale={self.weight_scale!r}")
    if self.weight_scale == "group":
      _positive_int(q + "group_size", self.group_size)
    elif self.group_size is not None:
      raise ValueError(f"{q}group_size={self.group_size!r} needs weight_scale='group', got "
                       f"weight_scale={self.weight_scale!r}")
    if not isinstance(self.zero_point, bool):
      raise ValueError(f"{q}zero_point must be a bool, got {self.zero_point!r}")
    if self.zero_point and self.weight_dtype not in ("int8", "int4"):
      raise ValueError(f"{q}zero_point=True needs an integer weight_dtype, got "
                       f"{self.weight_dtype!r}")
    if (self.act_dtype is None) != (self.act_scale is None):
      raise ValueError(f"{q}act_dtype={self.act_dtype!r} and act_scale={self.act_scale!r}: give "
                       "both (quantized activations) or neither (weight-only)")
    if self.act_scale == "dynamic_group":
      _positive_int(q + "act_group_size", self.act_group_size)
    elif self.act_group_size is not None:
      raise ValueError(f"{q}act_group_size={self.act_group_size!r} needs act_scale="
                       f"'dynamic_group', got act_scale={self.act_scale!r}")
    if self.act_dtype == "int8" and self.weight_dtype != "int8":
      raise ValueError(f"{q}act_dtype='int8' needs weight_dtype='int8' (an int8 x int8 GEMM), "
                       f"got weight_dtype={self.weight_dtype!r}")
    if self.act_dtype == "float8_e4m3fn" and self.weight_dtype not in ("float8_e4m3fn",
                                                                       "float4_e2m1fn", "int4"):
      raise ValueError(f"{q}act_dtype='float8_e4m3fn' needs fp8, fp4 or int4 weights, got "
                       f"weight_dtype={self.weight_dtype!r}")

  @property
  def is_quantized(self) -> bool:
    return self.format is not None

  @property
  def static_activations(self) -> bool:
    """Activations quantized with calibrated scales fixed in advance (act_scale
    "static_tensor": QuantizedWeights.input_scale), not per call."""
    return self.is_quantized and self.act_scale == "static_tensor"

  @property
  def weight_only(self) -> bool:
    """Activations stay in the model dtype (w8a16, w4a16, mxfp4 with bf16 activations)."""
    return self.is_quantized and self.act_dtype is None

  @property
  def name(self) -> str:
    """The scheme's name, or its fields when they differ from every named scheme."""
    if self.format is None:
      return "none"
    fields = {f: getattr(self, f) for f in _SCHEME_DEFAULTS}
    for name, scheme in QUANT_SCHEMES.items():
      if fields == {**_SCHEME_DEFAULTS, **scheme}:
        return name
    return ", ".join(f"{f}={v!r}" for f, v in fields.items() if v != _SCHEME_DEFAULTS[f])

  def __str__(self):
    return f"QuantConfig({self.name})"

  def replace(self, **kw) -> "QuantConfig":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """One MoE block: router, routed experts, shared experts.

  Shapes follow jmoe's convention: w13 [E, H, 2N] (gate | up), w2 [E, N, H].
  """

  num_experts: int
  top_k: int
  hidden_size: int
  intermediate_size: int
  activation: str = "silu"
  swiglu_alpha: float = SWIGLUOAI_ALPHA
  swiglu_limit: float = SWIGLUOAI_LIMIT
  scoring_func: str = "softmax"
  renormalize: bool = True
  num_expert_group: Optional[int] = None
  topk_group: Optional[int] = None
  use_correction_bias: bool = False
  routed_scaling_factor: float = 1.0
  expert_bias: bool = False  # w13_bias / w2_bias (gpt-oss)
  router_bias: bool = False
  apply_router_weight_on_input: bool = False
  num_shared_experts: int = 0
  shared_intermediate_size: Optional[int] = None  # default: intermediate_size * num_shared_experts
  shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ w_gate) scales the shared output
  fuse_shared_experts: bool = False  # seed 004: shared experts as always-chosen top-k slots
  runner_backend: str = "auto"
  dtype: str = "bfloat16"

  def __post_init__(self):
    for f in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
      _positive_int(f, getattr(self, f))
    if self.top_k > self.num_experts:
      raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
    check_choice("activation", self.activation, ACTIVATIONS)
    check_choice("scoring_func", self.scoring_func, SCORING_FUNCS)
    check_choice("runner_backend", self.runner_backend, RUNNER_BACKENDS)
    if (self.num_expert_group is None) != (self.topk_group is None):
      raise ValueError("num_expert_group and topk_group must be given together")
    if self.num_expert_group is not None:
      _positive_int("num_expert_group", self.num_expert_group)
      _positive_int("topk_group", self.topk_group)
      if self.num_experts % self.num_expert_group:
        raise ValueError(f"num_expert_group={self.num_expert_group} does not divide "
                         f"num_experts={self.num_experts}")
      if self.topk_group > self.num_expert_group:
        raise ValueError(f"topk_group={self.topk_group} exceeds num_expert_group="
                         f"{self.num_expert_group}")
    if self.apply_router_weight_on_input and self.top_k != 1:
      raise ValueError("apply_router_weight_on_input requires top_k == 1, "
                       f"got top_k={self.top_k}")
    if not (isinstance(self.routed_scaling_factor, numbers.Real)
            and math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
      raise ValueError("routed_scaling_factor must be a finite number > 0, got "
                       f"{self.routed_scaling_factor!r}")
    if not isinstance(self.num_shared_experts, int) or isinstance(self.num_shared_experts, bool) \
        or self.num_shared_experts < 0:
      raise ValueError(f"num_shared_experts must be an int >= 0, got {self.num_shared_experts!r}")
    try:
      floating = jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
    except TypeError:
      floating = False
    if not floating:
      raise ValueError(f"dtype={self.dtype!r} is not a floating-point dtype")
    if self.fuse_shared_experts and self.num_shared_experts == 0:
      raise ValueError("fuse_shared_experts=True needs num_shared_experts > 0")
    if self.fuse_shared_experts and self.shared_expert_gate:
      raise ValueError("fuse_shared_experts cannot express a shared_expert_gate (a per-token "
                       "sigmoid weight); use the separate shared-expert path")
    if self.fuse_shared_experts and self.apply_router_weight_on_input:
      raise ValueError("fuse_shared_experts cannot be combined with apply_router_weight_on_input "
                       "(the fused slots make top_k > 1, and the shared experts must see the "
                       "unscaled input); use the separate shared-expert path")
    if self.shared_intermediate_size is not None:
      _positive_int("shared_intermediate_size", self.shared_intermediate_size)
      if self.fuse_shared_experts and \
          self.shared_intermediate_size != self.num_shared_experts * self.intermediate_size:
        raise ValueError(f"fuse_shared_experts needs shared_intermediate_size="
                         f"{self.shared_intermediate_size} == num_shared_experts * "
                         f"intermediate_size = {self.num_shared_experts * self.intermediate_size}")

  @property
  def act(self) -> Activation:
    return Activation(self.activation, self.swiglu_alpha, self.swiglu_limit)

  @property
  def w13_out(self) -> int:
    """Width of GEMM1's output: 2N for gated activations, N otherwise."""
    n = self.intermediate_size
    return 2 * n if self.act.is_gated else n

  @property
  def shared_size(self) -> int:
    return self.shared_intermediate_size or self.intermediate_size * self.num_shared_experts

  def replace(self, **kw) -> "MoEConfig":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """How a block is spread over a mesh. Implemented by the expert-parallel issue.

  `mesh` is a jax.sharding.Mesh; `data_axis`/`expert_axis`/`tensor_axis` name its axes
  (None = not used).
  """

  mesh: Any = None
  data_axis: Optional[str] = None
  expert_axis: Optional[str] = None
  tensor_axis: Optional[str] = None
  a2a_backend: str = "auto"
  # Which expert-axis rank holds which expert: "linear" (rank r: [r*El, (r+1)*El)) or
  # "round_robin" (rank r: r, r+ep, ...). Weights are passed in physical order
  # (`sharding.place_weights`).
  expert_placement: str = "linear"
  # EP dispatch capacity: rows one source rank may send to one (rank, local expert); bounds
  # the static buffers of padded_a2a / ragged_a2a / allgather's batched layout. None = dropless
  # (tokens per rank); smaller values drop the overflow and count it.
  dispatch_capacity: Optional[int] = None
  # Activation dtype on the EP dispatch wire: None (the activations' own) or "fp8" (rows as
  # float8_e4m3fn with an f32 scale per 128 channels, dequantized on arrival; see jmoe.quant).
  # Halves the dispatch bytes at fp8 rounding (~2-3 % relative per element); combine unchanged.
  # Rows and their scales travel packed in one collective. Forward only: differentiating
  # w.r.t. the tokens raises (weight gradients are allowed). On 2 H200s over NVLink it is a
  # wash (BENCHMARKS.md): the collective halves, but the quantize before and the dequantize
  # for the bf16 experts after cost as much; it is for slower wires.
  dispatch_dtype: Optional[str] = None

  def __post_init__(self):
    check_choice("a2a_backend", self.a2a_backend, A2A_BACKENDS)
    check_choice("dispatch_dtype", self.dispatch_dtype, DISPATCH_DTYPES)
    check_choice("expert_placement", self.expert_placement, EXPERT_PLACEMENTS)
    if self.dispatch_capacity is not None:
      _positive_int("dispatch_capacity", self.dispatch_capacity)
    if self.mesh is not None:
      for name in ("data_axis", "expert_axis", "tensor_axis"):
        ax = getattr(self, name)
        if ax is not None and ax not in self.mesh.axis_names:
          raise ValueError(f"{name}={ax!r} is not an axis of the mesh {self.mesh.axis_names}")

  def axis_size(self, axis: Optional[str]) -> int:
    if axis is None or self.mesh is None:
      return 1
    return int(self.mesh.shape[axis])


# Benchmark presets (DESIGN.md). Shapes only: weights are drawn at random.
PRESETS: dict[str, MoEConfig] = {
    "mixtral-8x7b": MoEConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336),
    "qwen3-30b-a3b": MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768),
    "deepseek-v3": MoEConfig(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048,
                             scoring_func="sigmoid", renormalize=True, num_expert_group=8,
                             topk_group=4, use_correction_bias=True, routed_scaling_factor=2.5,
                             num_shared_experts=1),
    "gpt-oss-120b": MoEConfig(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880,
                              activation="swigluoai", expert_bias=True, router_bias=True),
}
PRESET_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)


def get_preset(name: str) -> MoEConfig:
  check_choice("preset", name, tuple(PRESETS))
  return PRESETS[name]
