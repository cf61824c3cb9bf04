"""Quantized training: the forward on quantized weights, a bf16 backward into dense weights.

`fused_moe(x, w13, w2, ..., quant_config=scheme)` with dense (master) w13 / w2 lands here: each
call quantizes the weights to `scheme` and runs the quantized forward (the 8-bit / 4-bit
kernels the oracle picks, activations quantized as the scheme says), while the backward is
that of the dense block at the dequantized weights: a straight-through estimator on the
weight and activation quantization, as fp8 training recipes run it. So

    d/dw13 = the dense block's gradient at w13' = dequantize(quantize(w13))

(and likewise for x, the router weights, the biases and the residual), in the weights' dtype.
The backward recomputes the dense forward at w13' (one more forward's work; nothing from the
quantized forward is kept but its inputs). Static schemes (calibrated input scales) are for
inference: they raise here.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.config import QuantConfig
from jmoe.quant.weights import dequantize, quantize_weights


@dataclasses.dataclass(frozen=True)
class _Options:
  """fused_moe's non-array arguments, static to the custom VJP."""

  scheme: QuantConfig
  kwargs: tuple  # (name, value) pairs passed through to fused_moe

  def call(self, x, w13, w2, tw, ids, b13, b2, emap, residual):
    from jmoe.api import fused_moe  # noqa: PLC0415 (api imports this module)
    return fused_moe(x, w13, w2, tw, ids, w13_bias=b13, w2_bias=b2, expert_map=emap,
                     residual=residual, **dict(self.kwargs))


def quantized_training_moe(hidden_states: jax.Array, w13: jax.Array, w2: jax.Array,
                           topk_weights: jax.Array, topk_ids: jax.Array,
                           scheme: "QuantConfig | str", *,
                           w13_bias: Optional[jax.Array] = None,
                           w2_bias: Optional[jax.Array] = None,
                           expert_map: Optional[jax.Array] = None,
                           residual: Optional[jax.Array] = None, **kwargs: Any) -> jax.Array:
  """fused_moe's forward on w13 / w2 quantized to `scheme` per call, with the dense block's
  backward at the dequantized weights (module docstring). w13 [E, H, 2N] / w2 [E, N, H] dense
  floating arrays; kwargs: fused_moe's other keywords. Returns [T, H] as fused_moe."""
  if isinstance(scheme, str):
    scheme = QuantConfig(scheme)
  if not isinstance(scheme, QuantConfig) or not scheme.is_quantized:
    raise ValueError(f"scheme must be a quantized QuantConfig, got {scheme!r}")
  if scheme.static_activations:
    raise ValueError(f"quant_config={scheme} with dense w13 / w2 (quantized training): a static "
                     "scheme's calibrated input scales are for inference; train with its "
                     "dynamic twin (e.g. fp8_channel) and calibrate afterwards")
  for name, w in (("w13", w13), ("w2", w2)):
    if not jnp.issubdtype(getattr(w, "dtype", None), jnp.floating):
      raise TypeError(f"{name} must be a dense floating array for quantized training, got "
                      f"{type(w).__name__}")
  opts = _Options(scheme, tuple(sorted(kwargs.items())))
  return _ste_block(opts, hidden_states, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias,
                    expert_map, residual)


def _quantized(opts: _Options, w13, w2):
  return (quantize_weights(w13, opts.scheme, argname="w13"),
          quantize_weights(w2, opts.scheme, argname="w2"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ste_block(opts, x, w13, w2, tw, ids, b13, b2, emap, residual):
  q13, q2 = _quantized(opts, w13, w2)
  return opts.call(x, q13, q2, tw, ids, b13, b2, emap, residual)


def _ste_fwd(opts, x, w13, w2, tw, ids, b13, b2, emap, residual):
  out = _ste_block(opts, x, w13, w2, tw, ids, b13, b2, emap, residual)
  return out, (x, w13, w2, tw, ids, b13, b2, emap, residual)


def _ste_bwd(opts, res, g):
  x, w13, w2, tw, ids, b13, b2, emap, residual = res
  q13, q2 = _quantized(opts, w13, w2)
  d13, d2 = dequantize(q13, w13.dtype), dequantize(q2, w2.dtype)

  def dense(x, d13, d2, tw, b13, b2, residual):
    return opts.call(x, d13, d2, tw, ids, b13, b2, emap, residual)

  _, vjp = jax.vjp(dense, x, d13, d2, tw, b13, b2, residual)
  dx, dw13, dw2, dtw, db13, db2, dres = vjp(g)
  zero_int = lambda a: None if a is None else np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  return dx, dw13, dw2, dtw, zero_int(ids), db13, db2, zero_int(emap), dres


_ste_block.defvjp(_ste_fwd, _ste_bwd)
