"""`TransformerConfig` and tiny presets mirroring Mixtral, Qwen3-MoE and DeepSeek-V3 structure."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from jmoe.config import MoEConfig, check_choice


def _positive(name: str, value) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A decoder-only MoE transformer.

  Every layer: x + attn(norm(x)), then x + ffn(norm(x)); the ffn is a dense SwiGLU MLP for the
  first `first_dense_layers` layers (DeepSeek-V3's first_k_dense_replace) and the MoE block
  `moe` after. Attention: grouped-query (num_kv_heads divides num_heads), rotary positions,
  optional per-head RMSNorm of q and k (Qwen3). moe.hidden_size must equal hidden_size.
  """

  vocab_size: int
  num_layers: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int
  moe: MoEConfig
  head_dim: Optional[int] = None  # default hidden_size // num_heads
  first_dense_layers: int = 0
  dense_intermediate_size: Optional[int] = None  # default 4 * hidden_size
  qk_norm: bool = False
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = False

  def __post_init__(self):
    for f in ("vocab_size", "num_layers", "hidden_size", "num_heads", "num_kv_heads"):
      _positive(f, getattr(self, f))
    if not isinstance(self.moe, MoEConfig):
      raise TypeError(f"moe must be a jmoe.MoEConfig, got {type(self.moe).__name__}")
    if self.moe.hidden_size != self.hidden_size:
      raise ValueError(f"moe.hidden_size={self.moe.hidden_size} must equal hidden_size="
                       f"{self.hidden_size}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads="
                       f"{self.num_heads}")
    if self.head_dim is None and self.hidden_size % self.num_heads:
      raise ValueError(f"num_heads={self.num_heads} does not divide hidden_size="
                       f"{self.hidden_size}; give head_dim")
    if self.head_dim is not None:
      _positive("head_dim", self.head_dim)
    if self.dim_per_head % 2:
      raise ValueError(f"head_dim={self.dim_per_head} must be even (rotary pairs)")
    if not isinstance(self.first_dense_layers, int) or not \
        0 <= self.first_dense_layers <= self.num_layers:
      raise ValueError(f"first_dense_layers={self.first_dense_layers!r} must be in "
                       f"[0, num_layers={self.num_layers}]")
    if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
      raise ValueError(f"rope_theta must be a finite number > 0, got {self.rope_theta!r}")

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.hidden_size // self.num_heads

  @property
  def dense_size(self) -> int:
    return self.dense_intermediate_size or 4 * self.hidden_size

  @property
  def num_moe_layers(self) -> int:
    return self.num_layers - self.first_dense_layers

  def replace(self, **kw) -> "TransformerConfig":
    return dataclasses.replace(self, **kw)


def _tiny(family: str, vocab_size: int, hidden: int, layers: int) -> TransformerConfig:
  if family == "mixtral":  # 8 experts, top-2 softmax, GQA
    moe = MoEConfig(num_experts=8, top_k=2, hidden_size=hidden, intermediate_size=2 * hidden)
    return TransformerConfig(vocab_size, layers, hidden, num_heads=4, num_kv_heads=2, moe=moe,
                             rope_theta=1e6)
  if family == "qwen3-moe":  # many small experts, top-k of them, q/k norm
    moe = MoEConfig(num_experts=16, top_k=4, hidden_size=hidden, intermediate_size=hidden // 2)
    return TransformerConfig(vocab_size, layers, hidden, num_heads=4, num_kv_heads=2, moe=moe,
                             qk_norm=True, rope_theta=1e6)
  # deepseek-v3: sigmoid scores, grouped top-k, correction bias (aux-loss-free balancing),
  # routed scaling, one shared expert, dense first layer (MLA is not mirrored: GQA here)
  moe = MoEConfig(num_experts=16, top_k=4, hidden_size=hidden, intermediate_size=hidden // 2,
                  scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                  use_correction_bias=True, routed_scaling_factor=2.5, num_shared_experts=1)
  return TransformerConfig(vocab_size, layers, hidden, num_heads=4, num_kv_heads=4, moe=moe,
                           first_dense_layers=1, dense_intermediate_size=2 * hidden)


PRESET_FAMILIES = ("mixtral", "qwen3-moe", "deepseek-v3")


def tiny_preset(family: str, *, vocab_size: int = 256, hidden_size: int = 64,
                num_layers: int = 2) -> TransformerConfig:
  """A tiny model with the structure of `family` ("mixtral", "qwen3-moe", "deepseek-v3")."""
  check_choice("family", family, PRESET_FAMILIES)
  _positive("hidden_size", hidden_size)
  if hidden_size % 8:
    raise ValueError(f"hidden_size must be a multiple of 8 for the tiny presets, got "
                     f"{hidden_size}")
  return _tiny(family, vocab_size, hidden_size, num_layers)
