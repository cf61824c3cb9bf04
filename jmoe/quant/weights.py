"""Quantized expert weights: values + scales (+ zero points) as one pytree.

Layout. `QuantizedWeights.values` is stored K-major by default: [E, N, K] for a weight whose
logical (jmoe) shape is [E, K, N] (w13 [E, H, 2N] -> values [E, 2N, H]; w2 [E, N, H] ->
values [E, H, N]). That is the layout of Hugging Face / vLLM checkpoints ([out, in] per
expert), so loading one is a view, and the only B layout Hopper's 8-bit wgmma accepts.
`k_major=False` keeps jmoe's [E, K, N] order (what a `qwix.QArray` of a jmoe weight holds).

Scales follow qwix's convention: `scale` has the values' rank and each of its dimensions
divides the values' (one scale per tile of values.shape / scale.shape), and

    w ~= (values - zero) * broadcast(scale)            (zero = 0 when symmetric)

so per-tensor, per-channel, 128 x 128 block and group-along-K scales are one formula with
different tiles. DeepSeek-V3's `weight_scale_inv` [N/128, K/128] per expert is exactly
`scale` of the K-major 128 x 128 block scheme.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.config import QuantConfig

# largest finite value of each 8-bit value type (the scale maps a tile's max |w| onto it)
QMAX = {"float8_e4m3fn": 448.0, "int8": 127.0}
PACKED_4BIT = ("int4", "float4_e2m1fn")


def value_dtype(name: str):
  return jnp.dtype(name)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
  """One stack of quantized expert matrices.

  values: [E, N, K] (k_major, the default) or [E, K, N]; the scheme's weight_dtype.
  scale: same rank as values, each dim dividing values' (float32, or e8m0 / e4m3 for the
    microscaling formats).
  zero: zero points shaped like scale (integer schemes with zero_point=True), else None.
  input_scale: a static per-tensor activation scale (a checkpoint's `input_scale`), else None.
  scheme (static): the QuantConfig; k_major (static): the values' orientation.
  """

  values: jax.Array
  scale: jax.Array
  zero: Optional[jax.Array] = None
  input_scale: Optional[jax.Array] = None
  scheme: QuantConfig = dataclasses.field(default=None, metadata=dict(static=True))
  k_major: bool = dataclasses.field(default=True, metadata=dict(static=True))

  # array-like surface, so shape checks written for dense w13 / w2 read the logical shape
  ndim: ClassVar[int] = 3

  @property
  def shape(self) -> tuple[int, int, int]:
    """The logical (jmoe) shape [E, K, N]."""
    e, a, b = self.values.shape
    return (e, b, a) if self.k_major else (e, a, b)

  @property
  def num_experts(self) -> int:
    return int(self.values.shape[0])

  def tile(self) -> tuple[int, int]:
    """Values per scale along the two matrix dims of `values` (storage order)."""
    return (self.values.shape[1] // self.scale.shape[1], self.values.shape[2] // self.scale.shape[2])

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The reference: [E, K, N] in `dtype` (a dense copy; never on the fast path)."""
    return dequantize(self, dtype)

  def with_k_major(self, k_major: bool = True) -> "QuantizedWeights":
    """The same weights in the other orientation (one transpose of values and scales)."""
    if k_major == self.k_major:
      return self
    t = lambda a: None if a is None else jnp.swapaxes(a, 1, 2)  # noqa: E731
    return dataclasses.replace(self, values=t(self.values), scale=t(self.scale),
                               zero=t(self.zero), k_major=k_major)


def is_quantized(w: Any) -> bool:
  return isinstance(w, QuantizedWeights)


def _broadcast(scale: jax.Array, shape) -> jax.Array:
  """scale [E, a, b] -> [E, A, B] by repeating each entry over its tile."""
  for axis in (1, 2):
    reps = shape[axis] // scale.shape[axis]
    if reps != 1:
      scale = jnp.repeat(scale, reps, axis=axis)
  return scale


def dequantize(w: QuantizedWeights, dtype=jnp.float32) -> jax.Array:
  """QuantizedWeights -> dense [E, K, N] in `dtype`: (values - zero) * scale, in float32."""
  if w.scheme is not None and w.scheme.weight_dtype in PACKED_4BIT:
    raise NotImplementedError(f"dequantize: packed 4-bit {w.scheme.name} weights are not "
                              "implemented yet")
  v = w.values.astype(jnp.float32)
  if w.zero is not None:
    v = v - _broadcast(w.zero.astype(jnp.float32), v.shape)
  out = (v * _broadcast(w.scale.astype(jnp.float32), v.shape)).astype(dtype)
  return jnp.swapaxes(out, 1, 2) if w.k_major else out


def scale_tile(scheme: QuantConfig, k: int, n: int, *, argname: str = "w") -> tuple[int, int]:
  """(tile along N, tile along K) of the scheme for a [K, N] matrix; raises when they do not
  divide (naming `argname`)."""
  g = scheme.weight_scale
  if g == "tensor":
    tn, tk = n, k
  elif g == "channel":
    tn, tk = 1, k
  elif g == "block":
    tk, tn = scheme.block_shape
  else:  # group along K
    tn, tk = 1, scheme.group_size
  if k % tk or n % tn:
    raise ValueError(f"{argname}: {scheme.name} scales tiles of K={tk} x N={tn}, which do not "
                     f"divide its [K, N] = [{k}, {n}] (pad the weights or choose another "
                     "block / group size)")
  return tn, tk


def _e8m0_scale(amax: jax.Array, qmax: float) -> jax.Array:
  """The OCP MX shared scale: a power of two with amax / scale <= qmax (rounded up)."""
  exp = jnp.ceil(jnp.log2(jnp.where(amax > 0, amax / qmax, 1.0)))
  return jnp.exp2(jnp.clip(exp, -127, 127))


def quantize_weights(w: jax.Array, scheme: "QuantConfig | str", *, k_major: bool = True,
                     argname: str = "w") -> QuantizedWeights:
  """Quantize expert weights w [E, K, N] (jmoe's layout, any float dtype) to `scheme`.

  Scales map each tile's max |w| onto the value type's largest finite value (448 for e4m3,
  127 for int8; a power of two for e8m0 scales); values are rounded to nearest and clamped,
  never NaN; an all-zero tile gets scale 1. With zero_point=True (integer schemes) the tile's
  [min, max] maps onto the full integer range.
  """
  if isinstance(scheme, str):
    scheme = QuantConfig(scheme)
  if not isinstance(scheme, QuantConfig) or not scheme.is_quantized:
    raise ValueError(f"scheme must name a quantized format, got {scheme!r}")
  if scheme.weight_dtype in PACKED_4BIT:
    raise NotImplementedError(f"quantize_weights: packed 4-bit {scheme.name} weights are not "
                              "implemented yet (the 8-bit schemes are: fp8_tensor, fp8_channel, "
                              "fp8_block, int8, w8a16, mxfp8)")
  if getattr(w, "ndim", None) != 3:
    raise ValueError(f"{argname} must be [E, K, N], got shape {getattr(w, 'shape', None)}")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"{argname} must be a floating-point array to quantize, got {w.dtype}")
  e, k, n = w.shape
  tn, tk = scale_tile(scheme, k, n, argname=argname)
  wt = jnp.swapaxes(w.astype(jnp.float32), 1, 2)  # [E, N, K]
  tiles = wt.reshape(e, n // tn, tn, k // tk, tk)
  qmax = QMAX[scheme.weight_dtype]
  zero = None
  if scheme.zero_point:
    lo, hi = jnp.min(tiles, axis=(2, 4)), jnp.max(tiles, axis=(2, 4))
    lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)  # 0 stays exactly representable
    scale = jnp.where(hi > lo, (hi - lo) / (2 * qmax + 1), 1.0)
    zero = jnp.clip(jnp.round(-qmax - 1 - lo / scale), -qmax - 1, qmax)
  else:
    amax = jnp.max(jnp.abs(tiles), axis=(2, 4))
    if scheme.scale_dtype == "float8_e8m0fnu":
      scale = _e8m0_scale(amax, qmax)
    else:
      scale = jnp.where(amax > 0, amax / qmax, 1.0)
  full = lambda s: s[:, :, None, :, None]  # noqa: E731  (scale over its tile)
  q = tiles / full(scale)
  if zero is not None:
    q = q + full(zero)
  vdt = value_dtype(scheme.weight_dtype)
  if jnp.issubdtype(vdt, jnp.integer):
    q = jnp.round(q)
    q = jnp.clip(q, -qmax - 1 if zero is not None else -qmax, qmax)
  else:
    q = jnp.clip(q, -qmax, qmax)
  values = q.astype(vdt).reshape(e, n, k)
  scale = scale.astype(jnp.dtype(scheme.scale_dtype))
  out = QuantizedWeights(values=values, scale=scale,
                         zero=None if zero is None else zero.astype(vdt), scheme=scheme)
  return out if k_major else out.with_k_major(False)


def is_qwix_qarray(w: Any) -> bool:
  """A qwix.QArray (duck-typed: qwix is optional), without importing qwix."""
  return hasattr(w, "qvalue") and hasattr(w, "scale") and not isinstance(w, QuantizedWeights)


def scheme_of_qwix(qarray: Any, activations: Optional[QuantConfig] = None) -> QuantConfig:
  """The weight format a qwix.QArray of a jmoe weight [E, K, N] holds, read off its dtype and
  scale tiles; the activation format from `activations` (a QuantConfig), else weight-only."""
  qdt = jnp.dtype(qarray.qvalue.dtype).name
  dtype = {"int8": "int8", "float8_e4m3fn": "float8_e4m3fn", "int4": "int4"}.get(qdt)
  if dtype is None:
    raise TypeError(f"qarray: qwix values of dtype {qdt} have no jmoe format (int8, "
                    "float8_e4m3fn)")
  _, k, n = qarray.qvalue.shape
  tk, tn = k // qarray.scale.shape[1], n // qarray.scale.shape[2]
  if (tk, tn) == (k, n):
    fields = dict(weight_scale="tensor")
  elif (tk, tn) == (k, 1):
    fields = dict(weight_scale="channel")
  elif tn == 1:
    fields = dict(weight_scale="group", group_size=tk)
  else:
    fields = dict(weight_scale="block", block_shape=(tk, tn))
  act = {}
  if activations is not None and activations.is_quantized and activations.act_dtype:
    act = dict(act_dtype=activations.act_dtype, act_scale=activations.act_scale,
               act_group_size=activations.act_group_size)
  return QuantConfig("custom", weight_dtype=dtype, zero_point=qarray.zero_point is not None,
                     scale_dtype=jnp.dtype(qarray.scale.dtype).name, **fields, **act)


def from_qwix(qarray: Any, scheme: "QuantConfig | str | None" = None, *,
              argname: str = "qarray") -> QuantizedWeights:
  """A `qwix.QArray` of a jmoe weight [E, K, N] as QuantizedWeights, without copying: its
  qvalue / scale / zero_point become values / scale / zero (k_major=False).

  `scheme` says how the scales are meant (e.g. "int8", whose activations are int8 too); None
  reads the weight format off the QArray (`scheme_of_qwix`, weight-only). Its tiles must
  match the scheme.
  """
  if not is_qwix_qarray(qarray):
    raise TypeError(f"{argname} must be a qwix.QArray (with .qvalue and .scale), got "
                    f"{type(qarray).__name__}")
  if isinstance(scheme, str):
    scheme = QuantConfig(scheme)
  if scheme is None:
    scheme = scheme_of_qwix(qarray)
  w = QuantizedWeights(values=qarray.qvalue, scale=qarray.scale,
                       zero=getattr(qarray, "zero_point", None), scheme=scheme, k_major=False)
  check_quantized(w, argname=argname)
  return w


def check_quantized(w: QuantizedWeights, *, argname: str) -> None:
  """Trace-time checks of one QuantizedWeights against its scheme; raises naming `argname`."""
  s = w.scheme
  if not isinstance(s, QuantConfig) or not s.is_quantized:
    raise ValueError(f"{argname}.scheme must be a quantized QuantConfig, got {s!r}")
  if w.values.ndim != 3:
    raise ValueError(f"{argname}.values must be 3-D, got shape {w.values.shape}")
  if jnp.dtype(w.values.dtype) != value_dtype(s.weight_dtype):
    raise TypeError(f"{argname}.values must be {s.weight_dtype} for {s.name}, got "
                    f"{w.values.dtype}")
  if w.scale.ndim != 3 or any(v % c for v, c in zip(w.values.shape, w.scale.shape)) \
      or w.scale.shape[0] != w.values.shape[0]:
    raise ValueError(f"{argname}.scale shape {tuple(w.scale.shape)} does not tile "
                     f"{argname}.values {tuple(w.values.shape)} (one scale per expert and tile)")
  e, k, n = w.shape
  tn, tk = scale_tile(s, k, n, argname=argname)
  want = (e, n // tn, k // tk) if w.k_major else (e, k // tk, n // tn)
  if tuple(w.scale.shape) != want:
    raise ValueError(f"{argname}.scale must be {want} for {s.name} with [K, N] = [{k}, {n}] "
                     f"({'K-major' if w.k_major else '[E, K, N]'} values), got "
                     f"{tuple(w.scale.shape)}")
  if jnp.dtype(w.scale.dtype) != jnp.dtype(s.scale_dtype):
    raise TypeError(f"{argname}.scale must be {s.scale_dtype} for {s.name}, got "
                    f"{w.scale.dtype}")
  if (w.zero is not None) != bool(s.zero_point):
    raise ValueError(f"{argname}.zero: {s.name} with zero_point={s.zero_point} "
                     f"{'needs' if s.zero_point else 'takes no'} zero points")
  if w.zero is not None and tuple(w.zero.shape) != tuple(w.scale.shape):
    raise ValueError(f"{argname}.zero shape {tuple(w.zero.shape)} must match its scale "
                     f"{tuple(w.scale.shape)}")
  if w.input_scale is not None and math.prod(w.input_scale.shape) != 1:
    raise ValueError(f"{argname}.input_scale must be one per-tensor scale, got shape "
                     f"{tuple(w.input_scale.shape)}")


def weight_bytes(w: Any) -> int:
  """Bytes a kernel streams for these weights (values + scales + zero points)."""
  if isinstance(w, QuantizedWeights):
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
               for a in (w.values, w.scale, w.zero) if a is not None)
  return int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize
