"""MoE expert activations, as pure elementwise jnp math.

Shared by the XLA experts (jmoe) and the Pallas epilogues (pallas_kernels), so that
every backend computes exactly the same function. Everything is evaluated in float32.

Gated activations take the two halves of the GEMM1 output: ``gate = h[..., :N]`` and
``up = h[..., N:]`` and return ``[..., N]``. Non-gated ones (``*_no_mul``) take the
whole GEMM1 output ``[..., N]``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def _silu(x):
  return x * jax.nn.sigmoid(x)


def _gelu(x):
  return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x):
  return jax.nn.gelu(x, approximate=True)


def _relu2(x):
  r = jnp.maximum(x, 0.0)
  return r * r


def swigluoai(gate, up, alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT):
  """gpt-oss gated activation: gate clamped above at limit, up to [-limit, limit]."""
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return gate * jax.nn.sigmoid(alpha * gate) * (up + 1.0)


_GATED: dict[str, Callable] = {"silu": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh}
_NOT_GATED: dict[str, Callable] = {
    "silu_no_mul": _silu,
    "gelu_no_mul": _gelu,
    "relu2_no_mul": _relu2,
}

ACTIVATIONS: tuple[str, ...] = tuple(_GATED) + ("swigluoai",) + tuple(_NOT_GATED)


@dataclasses.dataclass(frozen=True)
class Activation:
  """A named activation with its parameters (hashable: usable as a static jit arg)."""

  name: str = "silu"
  alpha: float = SWIGLUOAI_ALPHA  # swigluoai only
  limit: float = SWIGLUOAI_LIMIT  # swigluoai only

  def __post_init__(self):
    if self.name not in ACTIVATIONS:
      raise ValueError(f"activation={self.name!r} is not known; known: {', '.join(ACTIVATIONS)}")

  @property
  def is_gated(self) -> bool:
    return self.name not in _NOT_GATED

  def gated(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    """act(gate) * up in float32, for gated activations. Shapes [..., N] -> [..., N]."""
    gate = gate.astype(jnp.float32)
    up = up.astype(jnp.float32)
    if self.name == "swigluoai":
      return swigluoai(gate, up, self.alpha, self.limit)
    return _GATED[self.name](gate) * up

  def __call__(self, h: jax.Array) -> jax.Array:
    """Apply to a GEMM1 output h: [..., 2N] -> [..., N] (gated) or [..., N] -> [..., N]."""
    h = h.astype(jnp.float32)
    if not self.is_gated:
      return _NOT_GATED[self.name](h)
    n = h.shape[-1] // 2
    return self.gated(h[..., :n], h[..., n:])


def as_activation(activation: "str | Activation", *, alpha: float | None = None,
                  limit: float | None = None) -> Activation:
  """Normalise a name or Activation, raising a clear error for unknown names."""
  if isinstance(activation, Activation):
    kw = {k: float(v) for k, v in (("alpha", alpha), ("limit", limit)) if v is not None}
    return dataclasses.replace(activation, **kw) if kw else activation
  if not isinstance(activation, str):
    raise TypeError(f"activation must be a str or Activation, got {type(activation).__name__}")
  kw = {}
  if alpha is not None:
    kw["alpha"] = float(alpha)
  if limit is not None:
    kw["limit"] = float(limit)
  return Activation(activation, **kw)
