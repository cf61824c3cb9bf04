"""Bit-level packing of the 4-bit formats: two 4-bit codes per uint8, e2m1 codes, e8m0 scales.

One convention everywhere in jmoe (and the one gpt-oss, ModelOpt nvfp4 and compressed-tensors
use): along the packed axis, byte i holds code 2i in its LOW nibble and code 2i+1 in its HIGH
nibble. The packed axis is always K (the GEMM's contraction), so a K-major weight [N, K] packs
to [N, K/2] bytes, and a gpt-oss `*_blocks` tensor [N, K/32, 16] is that array reshaped.

Codes:
  int4   the two's complement nibble of q = u - 8 in [-8, 7] (= u ^ 8), where u in [0, 15]
         is GPTQ's / AWQ's unsigned code: w = (u - zero) * scale with zero = 8 for symmetric
         weights, i.e. w = q * scale. Signed nibbles are what jnp.int4 (XLA, qwix), and the
         kernels' int4 -> bf16 conversion, read: a view, no per-call arithmetic.
  e2m1   OCP FP4: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; magnitudes
         0, 0.5, 1, 1.5, 2, 3, 4, 6 (`E2M1_VALUES[code]`).
  e8m0   OCP MX scale byte c: 2 ** (c - 127) (c = 255 is NaN); `jnp.float8_e8m0fnu` is that
         byte, so a checkpoint's uint8 scales are viewed, not converted.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# value of each e2m1 code (index = the 4-bit code)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E2M1_MAX = 6.0
INT4_SYMMETRIC_ZERO = 8  # the implicit zero point of symmetric int4 (in unsigned u)
INT4_SIGN_FLIP = 8  # stored nibble = u ^ 8: the two's complement of u - 8


def pack_nibbles(codes: jax.Array, axis: int = -1, *, argname: str = "codes") -> jax.Array:
  """codes [..., K, ...] (values 0..15, any integer dtype) -> uint8 [..., K/2, ...] along
  `axis`: byte i = codes[2i] | codes[2i+1] << 4. Raises when K is odd (naming `argname`)."""
  axis = axis % codes.ndim
  k = codes.shape[axis]
  if k % 2:
    raise ValueError(f"{argname}: two 4-bit values pack into one byte along K, so K must be "
                     f"even, got K={k} (shape {tuple(codes.shape)})")
  c = jnp.moveaxis(codes.astype(jnp.uint8) & 0xF, axis, -1)
  c = c.reshape(*c.shape[:-1], k // 2, 2)
  packed = c[..., 0] | (c[..., 1] << 4)
  return jnp.moveaxis(packed, -1, axis)


def unpack_nibbles(packed: jax.Array, axis: int = -1) -> jax.Array:
  """uint8 [..., K/2, ...] -> codes uint8 [..., K, ...] (0..15): the inverse of pack_nibbles."""
  if jnp.dtype(packed.dtype) != jnp.uint8:
    raise TypeError(f"packed 4-bit values must be uint8 (two codes a byte), got {packed.dtype}")
  axis = axis % packed.ndim
  p = jnp.moveaxis(packed, axis, -1)
  codes = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
  return jnp.moveaxis(codes, -1, axis)


def view_4bit(packed: jax.Array, dtype=jnp.int4) -> jax.Array:
  """uint8 [..., n] -> `dtype` (int4 / uint4 / float4_e2m1fn) [..., n, 2], the same bytes read
  as their nibbles (low first): a bitcast, free inside jit.

  Behind an optimization barrier: XLA's constant folding gets bitcasts to 4-bit types wrong
  (jaxlib 0.10: the nibbles come out reordered), so weights closed over by a jitted function
  (HLO constants) would otherwise be unpacked into garbage."""
  return jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(packed), dtype)


def e2m1_decode(codes: jax.Array) -> jax.Array:
  """e2m1 codes (0..15) -> their float32 values (a 16-entry table lookup)."""
  return jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]


def e2m1_encode(x: jax.Array) -> jax.Array:
  """float x -> the nearest e2m1 code (uint8 0..15), ties to the even mantissa, |x| > 6
  saturating to 6 (never NaN: e2m1 has none); NaN inputs encode as 0.

  Done with comparisons against the midpoints, not a cast, so it runs on every backend."""
  x = jnp.nan_to_num(x.astype(jnp.float32))
  a = jnp.abs(x)
  # magnitude code m in 0..7 for values 0, .5, 1, 1.5, 2, 3, 4, 6; a tie goes to the code
  # with mantissa bit 0 (even): 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
  # 3.5 -> 4.0, 5 -> 4.0
  m = ((a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
       + (a >= 3.5) + (a > 5.0))
  sign = jnp.where((x < 0) & (m > 0), 8, 0).astype(jnp.uint8)
  return (m.astype(jnp.uint8) | sign)


def e8m0_from_exponent(exp: jax.Array) -> jax.Array:
  """integer exponents e (clipped to [-127, 127]) -> float8_e8m0fnu scales 2 ** e."""
  e = jnp.clip(exp, -127, 127).astype(jnp.int32)
  return jax.lax.bitcast_convert_type((e + 127).astype(jnp.uint8), jnp.float8_e8m0fnu)


def e8m0_as_uint8(scale: jax.Array) -> jax.Array:
  """float8_e8m0fnu scales -> their bytes (the checkpoint's uint8), a bitcast."""
  return jax.lax.bitcast_convert_type(scale, jnp.uint8)


def uint8_as_e8m0(codes) -> jax.Array:
  """A checkpoint's uint8 e8m0 scale bytes -> float8_e8m0fnu (a bitcast: the same bytes)."""
  return jax.lax.bitcast_convert_type(jnp.asarray(codes, jnp.uint8), jnp.float8_e8m0fnu)
