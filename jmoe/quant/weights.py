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

Packed 4-bit formats (int4 / w4a16, float4_e2m1fn / mxfp4, nvfp4) store `values` as uint8 with
two codes per byte along K (`jmoe.quant.packing`: low nibble = the even K index): K-major
values are [E, N, K/2] (or [E, K/2, N] with k_major=False), and the scale / zero shapes are
those of the logical (unpacked) values, so a kernel reads the same tiles as for 8-bit weights:

  w4a16   values: signed nibbles q = u - 8 (packing's int4); scale float32 [E, N, K/g];
          w = (u - zero) * scale = (q + 8 - zero) * scale with zero uint8 [E, N, K/g] in the
          checkpoints' unsigned terms (zero_point=True), or q * scale (symmetric).
  mxfp4   values: e2m1 codes; scale float8_e8m0fnu [E, N, K/32]. gpt-oss' `*_blocks`
          [E, N, K/32, 16] reshaped to [E, N, K/2] and its uint8 `*_scales` bitcast to e8m0 are
          exactly these arrays (loading is a view).
  nvfp4   values: e2m1 codes; scale float8_e4m3fn [E, N, K/16]; global_scale float32 [E, S]
          (S divides N: S = 1 per expert matrix, S = 2 for a w13 whose gate and up halves
          carry their own ModelOpt `weight_scale_2`); w = e2m1 * scale * global_scale.
  mxfp8   (8-bit, unpacked) values float8_e4m3fn; scale float8_e8m0fnu [E, N, K/32].

`perm` (int32 [E, K], optional) is GPTQ act-order folded at load time: the stored K position
k holds the logical K row perm[e, k], so that each group's rows are contiguous. `dequantize`
returns the logical order; a kernel gathers the activation's columns by `perm` instead.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jmoe.config import QuantConfig
from jmoe.quant.packing import (E2M1_MAX, INT4_SIGN_FLIP, INT4_SYMMETRIC_ZERO, e2m1_encode,
                                pack_nibbles, view_4bit)

# largest finite value of each value type (the scale maps a tile's max |w| onto it; int4:
# symmetric codes -7..7 around the implicit zero 8)
QMAX = {"float8_e4m3fn": 448.0, "int8": 127.0, "int4": 7.0, "float4_e2m1fn": E2M1_MAX}
PACKED_4BIT = ("int4", "float4_e2m1fn")
E4M3_MIN_SUBNORMAL = 2.0 ** -9  # nvfp4 block scales never round to 0 (a division by it)


def is_packed(scheme: Optional[QuantConfig]) -> bool:
  """Whether the scheme stores two 4-bit codes per uint8 byte."""
  return scheme is not None and scheme.weight_dtype in PACKED_4BIT


def value_dtype(name: str):
  """The storage dtype of `values` for a weight_dtype (uint8 for the packed 4-bit types)."""
  return jnp.dtype(jnp.uint8) if name in PACKED_4BIT else jnp.dtype(name)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
  """One stack of quantized expert matrices.

  values: [E, N, K] (k_major, the default) or [E, K, N]; the scheme's weight_dtype, or uint8
    [E, N, K/2] / [E, K/2, N] for the packed 4-bit types (see the module docstring).
  scale: same rank as values, each dim dividing the logical (unpacked) values' (float32, or
    e8m0 / e4m3 for the microscaling formats).
  zero: zero points shaped like scale (integer schemes with zero_point=True; uint8 0..15 for
    int4, int8 for int8), else None.
  input_scale: a static per-tensor activation scale (a checkpoint's `input_scale`), else None.
  global_scale: float32 [E, S] multiplying every value, S dividing N (nvfp4's per-tensor
    `weight_scale_2`; required with e4m3 block scales), else None.
  perm: int32 [E, K], GPTQ act-order: the stored K position k holds logical row perm[e, k]
    (else None).
  prepared: {key: [E, ...] array}, kernel operands derived from the arrays above once
    (`prepare_for_kernels`: the prefill GEMMs' group-major scales, ...) instead of on every
    call, else None. Derived data: replacing values or scales needs preparing again.
  scheme (static): the QuantConfig; k_major (static): the values' orientation.
  """

  values: jax.Array
  scale: jax.Array
  zero: Optional[jax.Array] = None
  input_scale: Optional[jax.Array] = None
  global_scale: Optional[jax.Array] = None
  perm: Optional[jax.Array] = None
  prepared: Optional[dict] = None
  scheme: QuantConfig = dataclasses.field(default=None, metadata=dict(static=True))
  k_major: bool = dataclasses.field(default=True, metadata=dict(static=True))

  # array-like surface, so shape checks written for dense w13 / w2 read the logical shape
  ndim: ClassVar[int] = 3

  @property
  def packed(self) -> bool:
    """Two 4-bit codes per uint8 of `values`, along K."""
    return is_packed(self.scheme)

  @property
  def storage_shape(self) -> tuple[int, int, int]:
    """The unpacked values' shape in storage order ([E, N, K] when k_major)."""
    e, a, b = self.values.shape
    if self.packed:
      a, b = (a, 2 * b) if self.k_major else (2 * a, b)
    return (e, a, b)

  @property
  def shape(self) -> tuple[int, int, int]:
    """The logical (jmoe) shape [E, K, N]."""
    e, a, b = self.storage_shape
    return (e, b, a) if self.k_major else (e, a, b)

  @property
  def num_experts(self) -> int:
    return int(self.values.shape[0])

  def tile(self) -> tuple[int, int]:
    """Values per scale along the two matrix dims of `values` (storage order)."""
    _, a, b = self.storage_shape
    return (a // self.scale.shape[1], b // self.scale.shape[2])

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The reference: [E, K, N] in `dtype` (a dense copy; never on the fast path)."""
    return dequantize(self, dtype)

  def take_experts(self, idx: jax.Array) -> "QuantizedWeights":
    """The experts `idx` ([U] int32 in [0, E)) as their own stack: values, scales, zero points,
    global scales, perms and prepared operands gathered along the expert axis (input_scale is
    per tensor)."""
    g = lambda a: None if a is None else jnp.take(a, idx, axis=0)  # noqa: E731
    prepared = None if self.prepared is None else {k: g(a) for k, a in self.prepared.items()}
    return dataclasses.replace(self, values=g(self.values), scale=g(self.scale),
                               zero=g(self.zero), global_scale=g(self.global_scale),
                               perm=g(self.perm), prepared=prepared)

  def with_k_major(self, k_major: bool = True) -> "QuantizedWeights":
    """The same weights in the other orientation (one transpose of values and scales; the
    prepared operands, made for the K-major kernels, are dropped)."""
    if k_major == self.k_major:
      return self
    t = lambda a: None if a is None else jnp.swapaxes(a, 1, 2)  # noqa: E731
    return dataclasses.replace(self, values=t(self.values), scale=t(self.scale),
                               zero=t(self.zero), k_major=k_major, prepared=None)


def is_quantized(w: Any) -> bool:
  return isinstance(w, QuantizedWeights)


def _broadcast(scale: jax.Array, shape) -> jax.Array:
  """scale [E, a, b] -> [E, A, B] by repeating each entry over its tile."""
  for axis in (1, 2):
    reps = shape[axis] // scale.shape[axis]
    if reps != 1:
      scale = jnp.repeat(scale, reps, axis=axis)
  return scale


def centered_values(w: QuantizedWeights) -> jax.Array:
  """The values as float32 in storage order, before zero points and scales: int4 as the
  stored signed nibble s = u - 8 (the symmetric value), e2m1 values, or the 8-bit values.
  The packed types are read by a bitcast to XLA's 4-bit types (low nibble first, as
  jmoe.quant.packing stores them), which XLA unpacks in the converting fusion itself."""
  if not w.packed:
    return w.values.astype(jnp.float32)
  nib = view_4bit(w.values)  # [E, a, b, 2]
  e, a, b, _ = nib.shape
  if not w.k_major:  # packed along axis 1: the pair goes next to it
    nib = jnp.swapaxes(nib, 2, 3)
  nib = nib.reshape(e, a, 2 * b) if w.k_major else nib.reshape(e, 2 * a, b)
  if w.scheme.weight_dtype == "float4_e2m1fn":
    return e2m1_from_int4(nib)
  return nib.astype(jnp.float32)


def e2m1_from_int4(nib: jax.Array) -> jax.Array:
  """e2m1 codes read as signed int4 -> their float32 values, through e4m3 (which Hopper
  converts in hardware; XLA emulates e2m1, 2 x slower on the H200): the sign bit and the
  3 exponent-mantissa bits, moved 4 / 2 places up, are the e4m3 number 2^-6 * the e2m1 value
  (e2m1's subnormal 0.5 lands on e4m3's subnormal 2^-7), exactly."""
  s = nib.astype(jnp.int8)  # sign-extended: bit 7 is the code's sign bit
  bits = ((s << 2) & jnp.int8(0x1C)) | (s & jnp.int8(-128))
  return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32) * 64.0


def dequantize(w: QuantizedWeights, dtype=jnp.float32) -> jax.Array:
  """QuantizedWeights -> dense [E, K, N] in `dtype`: (values - zero) * scale (* global_scale),
  in float32, rows in logical order (act-order `perm` undone). The reference of every format;
  the XLA experts run it inside the graph on every call (a dense copy of the weights)."""
  return _dequantize(w, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=1)  # one compiled graph when called eagerly
def _dequantize(w: QuantizedWeights, dtype) -> jax.Array:
  v = centered_values(w)
  if w.zero is not None:  # int4 zero points are unsigned (0..15): s - (z - 8) = u - z
    z = w.zero.astype(jnp.float32)
    if w.scheme.weight_dtype == "int4":
      z = z - INT4_SYMMETRIC_ZERO
    v = v - _broadcast(z, v.shape)
  out = v * _broadcast(w.scale.astype(jnp.float32), v.shape)
  if w.global_scale is not None:  # [E, S] along N: storage axis 1 (k_major) or 2
    g = w.global_scale.astype(jnp.float32)
    n_axis = 1 if w.k_major else 2
    g = jnp.repeat(g, out.shape[n_axis] // g.shape[1], axis=1)
    out = out * (g[:, :, None] if w.k_major else g[:, None, :])
  out = jnp.swapaxes(out, 1, 2) if w.k_major else out  # [E, K, N]
  if w.perm is not None:  # stored row k is logical row perm[k]: logical row j = stored inv[j]
    inv = jnp.argsort(w.perm, axis=1)
    out = jnp.take_along_axis(out, inv[:, :, None].astype(jnp.int32), axis=1)
  return out.astype(dtype)


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


def e8m0_scale(amax: jax.Array, qmax: float) -> jax.Array:
  """The OCP MX shared scale: the smallest power of two with amax / scale <= qmax (rounded up,
  so no value saturates; OCP's floor(log2(amax)) - emax may clip the largest by up to 2x),
  2^-127 to 2^127; 1 where amax is 0. f32 [amax's shape].

  Exact: ceil(log2(amax / qmax)) is read off the quotient's f32 bits (exponent, and whether
  any mantissa bit is set), as jnp.log2 (log(x) / log(2)) rounds some exact powers of two up
  a step. Only integer and bit operations, so the Triton-lowered kernels (jmoe.kernels.
  quant_rows) compute it with this same function."""
  r = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
  bits = lax.bitcast_convert_type(r, jnp.int32)
  field = (bits >> 23) & 0xFF
  mant = bits & 0x7FFFFF
  # normal r: 2^(field - 127) times 1.mant; subnormal r (field 0): below 2^-126, so the
  # clipped result is 2^-126 above 2^-127 (mant > 2^22), else 2^-127
  exp = jnp.where(field == 0, jnp.where(mant > 0x400000, -126, -127),
                  field - 127 + (mant != 0).astype(jnp.int32))
  exp = jnp.clip(exp, -127, 127)
  out = jnp.where(exp >= -126, (exp + 127) << 23, 0x400000)  # 2^-127 is subnormal
  return lax.bitcast_convert_type(out.astype(jnp.int32), jnp.float32)


def quantize_weights(w: jax.Array, scheme: "QuantConfig | str", *, k_major: bool = True,
                     input_scale: Any = None, argname: str = "w") -> QuantizedWeights:
  """Quantize expert weights w [E, K, N] (jmoe's layout, any float dtype) to `scheme`.

  Scales map each tile's max |w| onto the value type's largest finite value (448 for e4m3,
  127 for int8, 7 for symmetric int4, 6 for e2m1; a power of two for e8m0 scales); values
  are rounded to nearest (e2m1: ties to even) and clamped, never NaN; an all-zero tile gets
  scale 1. With zero_point=True (integer schemes) the tile's [min, max] (widened to hold 0)
  maps onto the full integer range (int4: 0..15, as GPTQ / AWQ). nvfp4 (e4m3 block scales)
  first takes a per-expert global scale max |w| / (6 * 448), as NVIDIA ModelOpt does, so the
  block scales use e4m3's range. The packed types come out as uint8, two codes a byte along K.

  input_scale: the static per-tensor scale of this GEMM's input (a scalar; schemes with
  act_scale="static_tensor" need one: a checkpoint's `input_scale`, or
  `jmoe.quant.calibrate_input_scales`), stored as float32 [1].

  Returns QuantizedWeights with K-major values [E, N, K] (packed: [E, N, K/2]) unless
  k_major=False. Raises naming `argname` when a tile does not divide [K, N] or K is odd for
  a packed type.
  """
  if isinstance(scheme, str):
    scheme = QuantConfig(scheme)
  if not isinstance(scheme, QuantConfig) or not scheme.is_quantized:
    raise ValueError(f"scheme must name a quantized format, got {scheme!r}")
  if getattr(w, "ndim", None) != 3:
    raise ValueError(f"{argname} must be [E, K, N], got shape {getattr(w, 'shape', None)}")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"{argname} must be a floating-point array to quantize, got {w.dtype}")
  e, k, n = w.shape
  tn, tk = scale_tile(scheme, k, n, argname=argname)
  if is_packed(scheme) and k % 2:
    raise ValueError(f"{argname}: {scheme.name} packs two 4-bit values per byte along K, so K "
                     f"must be even, got [K, N] = [{k}, {n}]")
  out = _quantize(w, scheme, tn, tk)
  if input_scale is not None:
    out = dataclasses.replace(out, input_scale=as_input_scale(input_scale,
                                                              argname=f"{argname}.input_scale"))
  check_static_scale(out, argname=argname)
  return out if k_major else out.with_k_major(False)


def as_input_scale(scale: Any, *, argname: str) -> jax.Array:
  """A static activation scale as QuantizedWeights holds it: float32 [1], positive where
  concrete (raises naming `argname` otherwise)."""
  a = jnp.asarray(scale, jnp.float32)
  if a.size != 1:
    raise ValueError(f"{argname} must be one per-tensor scale, got shape {tuple(a.shape)}")
  a = a.reshape(1)
  if not isinstance(a, jax.core.Tracer) and not float(a[0]) > 0:
    raise ValueError(f"{argname} must be a positive scale, got {float(a[0])}")
  return a


def check_static_scale(w: "QuantizedWeights", *, argname: str) -> None:
  """A static-activation scheme's weights carry the static scale of their GEMM's input."""
  if w.scheme.static_activations and w.input_scale is None:
    raise ValueError(f"{argname}.input_scale: {w.scheme.name} quantizes this GEMM's input with "
                     "one static per-tensor scale, and none is given (pass input_scale= to "
                     "quantize_weights, load it from the checkpoint, or use "
                     "jmoe.quant.calibrate_input_scales)")


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one compiled graph when called eagerly
def _quantize(w: jax.Array, scheme: QuantConfig, tn: int, tk: int) -> QuantizedWeights:
  """quantize_weights' arithmetic (arguments checked): K-major QuantizedWeights."""
  e, k, n = w.shape
  packed = is_packed(scheme)
  wt = jnp.swapaxes(w.astype(jnp.float32), 1, 2)  # [E, N, K]
  tiles = wt.reshape(e, n // tn, tn, k // tk, tk)
  qmax = QMAX[scheme.weight_dtype]
  full = lambda s: s[:, :, None, :, None]  # noqa: E731  (scale over its tile)
  zero = global_scale = None
  if scheme.zero_point:
    lo, hi = jnp.min(tiles, axis=(2, 4)), jnp.max(tiles, axis=(2, 4))
    lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)  # 0 stays exactly representable
    if scheme.weight_dtype == "int4":  # unsigned codes 0..15 (GPTQ / AWQ)
      qlo, qhi = 0.0, 15.0
    else:  # signed int8 codes -128..127
      qlo, qhi = -qmax - 1, qmax
    scale = jnp.where(hi > lo, (hi - lo) / (qhi - qlo), 1.0)
    zero = jnp.clip(jnp.round(qlo - lo / scale), qlo, qhi)
    q = jnp.clip(jnp.round(tiles / full(scale) + full(zero)), qlo, qhi)
  else:
    amax = jnp.max(jnp.abs(tiles), axis=(2, 4))
    if scheme.scale_dtype == "float8_e8m0fnu":
      scale = e8m0_scale(amax, qmax)
    elif scheme.scale_dtype == "float8_e4m3fn":  # nvfp4: e4m3 block scales under a global one
      tmax = jnp.max(amax, axis=(1, 2))
      global_scale = jnp.where(tmax > 0, tmax / (qmax * QMAX["float8_e4m3fn"]), 1.0)[:, None]
      block = jnp.where(amax > 0, amax / qmax / global_scale[:, :, None], 1.0)
      block = jnp.clip(block, E4M3_MIN_SUBNORMAL, QMAX["float8_e4m3fn"])
      block = block.astype(jnp.float8_e4m3fn).astype(jnp.float32)  # what dequantize reads
      scale = block * global_scale[:, :, None]
      stored_scale = block
    else:
      scale = jnp.where(amax > 0, amax / qmax, 1.0)
    q = tiles / full(scale)
    if scheme.weight_dtype == "int4":
      q = jnp.clip(jnp.round(q), -qmax - 1, qmax) + INT4_SYMMETRIC_ZERO
    elif scheme.weight_dtype == "int8":
      q = jnp.clip(jnp.round(q), -qmax, qmax)
    elif scheme.weight_dtype == "float4_e2m1fn":
      q = e2m1_encode(q)
    else:
      q = jnp.clip(q, -qmax, qmax)
  q = q.reshape(e, n, k)
  if packed:
    codes = q.astype(jnp.uint8)
    if scheme.weight_dtype == "int4":  # u -> the signed nibble of u - 8
      codes = codes ^ INT4_SIGN_FLIP
    values = pack_nibbles(codes, axis=2)
  else:
    values = q.astype(value_dtype(scheme.weight_dtype))
  if global_scale is not None:
    scale = stored_scale  # the e4m3 block scale; global_scale multiplies it
  scale = scale.astype(jnp.dtype(scheme.scale_dtype))
  zdt = jnp.uint8 if scheme.weight_dtype == "int4" else value_dtype(scheme.weight_dtype)
  out = QuantizedWeights(values=values, scale=scale,
                         zero=None if zero is None else zero.astype(zdt),
                         global_scale=global_scale, scheme=scheme)
  return out


def is_qwix_qarray(w: Any) -> bool:
  """A qwix.QArray (duck-typed: qwix is optional), without importing qwix."""
  return hasattr(w, "qvalue") and hasattr(w, "scale") and not isinstance(w, QuantizedWeights)


def scheme_of_qwix(qarray: Any, activations: Optional[QuantConfig] = None) -> QuantConfig:
  """The weight format a qwix.QArray of a jmoe weight [E, K, N] holds, read off its dtype and
  scale tiles; the activation format from `activations` (a QuantConfig), else weight-only."""
  qdt = jnp.dtype(qarray.qvalue.dtype).name
  dtype = {"int8": "int8", "float8_e4m3fn": "float8_e4m3fn"}.get(qdt)
  if dtype is None:
    raise TypeError(f"qarray: qwix values of dtype {qdt} have no jmoe view (int8, "
                    "float8_e4m3fn); 4-bit weights are jmoe's packed uint8 "
                    "(jmoe.quant.quantize_weights(w, 'w4a16'))")
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
  """Trace-time checks of one QuantizedWeights against its scheme; raises naming `argname`
  (values' dtype and shape, the scale's shape and dtype, zero points, global scale, perm)."""
  s = w.scheme
  if not isinstance(s, QuantConfig) or not s.is_quantized:
    raise ValueError(f"{argname}.scheme must be a quantized QuantConfig, got {s!r}")
  if w.values.ndim != 3:
    raise ValueError(f"{argname}.values must be 3-D, got shape {w.values.shape}")
  if jnp.dtype(w.values.dtype) != value_dtype(s.weight_dtype):
    packed = " (two 4-bit codes per byte along K)" if w.packed else ""
    raise TypeError(f"{argname}.values must be {value_dtype(s.weight_dtype).name}{packed} for "
                    f"{s.name}, got {w.values.dtype}")
  logical = w.storage_shape
  if w.scale.ndim != 3 or any(v % c for v, c in zip(logical, w.scale.shape)) \
      or w.scale.shape[0] != w.values.shape[0]:
    raise ValueError(f"{argname}.scale shape {tuple(w.scale.shape)} does not tile "
                     f"{argname}.values {tuple(logical)} (one scale per expert and tile)")
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
  if w.zero is not None:
    if tuple(w.zero.shape) != tuple(w.scale.shape):
      raise ValueError(f"{argname}.zero shape {tuple(w.zero.shape)} must match its scale "
                       f"{tuple(w.scale.shape)}")
    zdt = jnp.dtype(jnp.uint8) if s.weight_dtype == "int4" else value_dtype(s.weight_dtype)
    if jnp.dtype(w.zero.dtype) != zdt:
      raise TypeError(f"{argname}.zero must be {zdt.name} for {s.name}, got {w.zero.dtype}")
  if w.input_scale is not None and math.prod(w.input_scale.shape) != 1:
    raise ValueError(f"{argname}.input_scale must be one per-tensor scale, got shape "
                     f"{tuple(w.input_scale.shape)}")
  check_static_scale(w, argname=argname)
  if s.scale_dtype == "float8_e4m3fn" and w.global_scale is None:
    raise ValueError(f"{argname}.global_scale: {s.name}'s e4m3 block scales are relative to a "
                     "float32 global scale [E, S] (ModelOpt's weight_scale_2); got None")
  if w.global_scale is not None:
    g = w.global_scale
    if g.ndim != 2 or g.shape[0] != e or n % g.shape[1]:
      raise ValueError(f"{argname}.global_scale must be [E, S] with S dividing N={n} "
                       f"(E={e}), got shape {tuple(g.shape)}")
    if jnp.dtype(g.dtype) != jnp.float32:
      raise TypeError(f"{argname}.global_scale must be float32, got {g.dtype}")
  if w.perm is not None:
    if tuple(w.perm.shape) != (e, k):
      raise ValueError(f"{argname}.perm must be [E, K] = {(e, k)} (act-order), got shape "
                       f"{tuple(w.perm.shape)}")
    if not jnp.issubdtype(w.perm.dtype, jnp.integer):
      raise TypeError(f"{argname}.perm must be an integer array, got {w.perm.dtype}")
  for key, a in (w.prepared or {}).items():
    if getattr(a, "ndim", 0) < 1 or a.shape[0] != e:
      raise ValueError(f"{argname}.prepared[{key!r}] must be [E={e}, ...] (one row per expert), "
                       f"got shape {tuple(getattr(a, 'shape', ()))}")


def weight_bytes(w: Any) -> int:
  """Bytes a kernel streams for these weights (values + scales + zero points + global
  scales + act-order perm)."""
  if isinstance(w, QuantizedWeights):
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
               for a in (w.values, w.scale, w.zero, w.global_scale, w.perm) if a is not None)
  return int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize
