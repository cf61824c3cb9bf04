"""GPTQ and AWQ int4 checkpoint tensors -> jmoe w4a16 weights (NumPy, once at load time).

Per linear layer [K in, N out] both formats store unsigned 4-bit codes u in int32 words, eight
per word, code j in bits 4j..4j+3, and dequantize as w = (u - zero) * scale per group of g
consecutive K rows:

  GPTQ   qweight int32 [K/8, N]   packed along K: word [i, n] holds rows 8i .. 8i+7 in order
         qzeros  int32 [K/g, N/8] packed along N: word [r, c] holds columns 8c .. 8c+7
         scales  fp16  [K/g, N]
         g_idx   int32 [K]        group of each K row (act-order / desc_act: not k // g)
         Zero points: the v1 format (AutoGPTQ, `checkpoint_format` "gptq" or absent) stores
         zero - 1 (the historical off-by-one), so zero = stored + 1; v2 (GPTQModel's
         "gptq_v2") stores the zero itself. Symmetric GPTQ stores 7 (v1) / 8 (v2) everywhere.
  AWQ    qweight int32 [K, N/8]   packed along N, interleaved: bit slot j of word [k, c]
         qzeros  int32 [K/g, N/8] holds column 8c + AWQ_ORDER[j], AWQ_ORDER = 0 2 4 6 1 3 5 7
         scales  fp16  [K/g, N]   (AutoAWQ's "gemm" version); zero points stored as is.

Act-order is folded once here, never per call: the K rows are sorted by g_idx (stable), so
each group's rows become contiguous and `QuantizedWeights.perm` records the order; for w2
(K = the intermediate N) `int4_experts` folds the permutation into w13's output columns
instead, which costs nothing at run time. A zero of exactly 8 everywhere loads as symmetric
w4a16 (no zero tensor).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bit slot j of an AWQ word holds column 8c + AWQ_ORDER[j]
_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


def unpack_int32(q: np.ndarray, axis: int, order: Optional[Sequence[int]] = None, *,
                 name: str = "qweight") -> np.ndarray:
  """int32 words [..., M, ...] -> uint8 codes [..., 8M, ...] along `axis`: bit slot j of word
  m lands at index 8m + order[j] (order None: 8m + j)."""
  q = np.asarray(q)
  if q.dtype not in (np.int32, np.uint32):
    raise TypeError(f"{name} must be int32 (eight 4-bit codes a word), got {q.dtype}")
  w = np.moveaxis(q.view(np.uint32), axis, -1)
  slots = ((w[..., None] >> _SHIFTS) & 0xF).astype(np.uint8)  # [..., M, 8] by bit slot
  if order is not None:
    out = np.empty_like(slots)
    out[..., list(order)] = slots  # slot j -> position order[j]
    slots = out
  codes = slots.reshape(*w.shape[:-1], w.shape[-1] * 8)
  return np.moveaxis(codes, -1, axis)


@dataclasses.dataclass
class Int4Linear:
  """One linear layer's int4 weights, K-major (jmoe's storage order, before packing).

  codes: uint8 [N, K] (0..15), K possibly permuted by `perm`; scale: float32 [N, K/g];
  zero: uint8 [N, K/g]; perm: int64 [K] (stored K position k holds logical row perm[k]) or
  None; group_size: g.
  """

  codes: np.ndarray
  scale: np.ndarray
  zero: np.ndarray
  perm: Optional[np.ndarray]
  group_size: int

  def dequantize(self) -> np.ndarray:
    """float32 [K, N] in logical row order (the reference)."""
    g = self.group_size
    z = np.repeat(self.zero.astype(np.float32), g, axis=1)
    w = (self.codes.astype(np.float32) - z) * np.repeat(self.scale, g, axis=1)  # [N, K]
    if self.perm is not None:
      out = np.empty_like(w)
      out[:, self.perm] = w
      w = out
    return w.T


def _group_size(k: int, scales: np.ndarray, name: str) -> int:
  groups = scales.shape[0]
  if groups == 0 or k % groups:
    raise ValueError(f"{name}.scales has {groups} groups, which do not divide K={k}")
  return k // groups


def _check(name: str, what: str, arr: np.ndarray, want: tuple) -> None:
  if tuple(arr.shape) != tuple(want):
    raise ValueError(f"{name}.{what} has shape {tuple(arr.shape)}, expected {tuple(want)}")


def gptq_linear(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray,
                g_idx: Optional[np.ndarray] = None, *, k: int, n: int, v2: bool = False,
                name: str = "linear") -> Int4Linear:
  """GPTQ qweight [K/8, N], qzeros [K/g, N/8], scales [K/g, N], g_idx [K] (optional) of a
  [K in, N out] linear -> Int4Linear (act-order sorted out; v1 zeros get their +1)."""
  qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
  if k % 8 or n % 8:
    raise ValueError(f"{name}: GPTQ packs eight 4-bit codes per int32, so K={k} and N={n} must "
                     "be multiples of 8")
  _check(name, "qweight", qweight, (k // 8, n))
  g = _group_size(k, scales, name)
  _check(name, "scales", scales, (k // g, n))
  _check(name, "qzeros", qzeros, (k // g, n // 8))
  codes = unpack_int32(qweight, 0, name=f"{name}.qweight").T  # [N, K]
  zero = unpack_int32(qzeros, 1, name=f"{name}.qzeros").astype(np.int32)  # [K/g, N]
  if not v2:
    zero = (zero + 1) & 0xF  # v1 stores zero - 1 in 4 bits: a zero of 0 was stored as 15
  perm = None
  if g_idx is not None:
    g_idx = np.asarray(g_idx).astype(np.int64)
    _check(name, "g_idx", g_idx, (k,))
    if not np.array_equal(g_idx, np.arange(k) // g):
      counts = np.bincount(g_idx, minlength=k // g)
      if g_idx.min() < 0 or g_idx.max() >= k // g or np.any(counts != g):
        raise ValueError(f"{name}.g_idx must give each of the {k // g} groups exactly {g} rows "
                         f"(act-order), got group sizes {sorted(set(counts.tolist()))}")
      perm = np.argsort(g_idx, kind="stable")
      codes = codes[:, perm]
  return Int4Linear(codes=np.ascontiguousarray(codes), scale=scales.astype(np.float32).T.copy(),
                    zero=zero.T.astype(np.uint8).copy(), perm=perm, group_size=g)


def awq_linear(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, *, k: int, n: int,
               name: str = "linear") -> Int4Linear:
  """AWQ ("gemm") qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N] of a [K in, N out]
  linear -> Int4Linear (the interleaved nibble order undone)."""
  qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
  if n % 8:
    raise ValueError(f"{name}: AWQ packs eight 4-bit codes per int32 along N, so N={n} must be "
                     "a multiple of 8")
  _check(name, "qweight", qweight, (k, n // 8))
  g = _group_size(k, scales, name)
  _check(name, "scales", scales, (k // g, n))
  _check(name, "qzeros", qzeros, (k // g, n // 8))
  codes = unpack_int32(qweight, 1, AWQ_ORDER, name=f"{name}.qweight").T  # [N, K]
  zero = unpack_int32(qzeros, 1, AWQ_ORDER, name=f"{name}.qzeros")  # [K/g, N]
  return Int4Linear(codes=np.ascontiguousarray(codes), scale=scales.astype(np.float32).T.copy(),
                    zero=zero.T.copy(), perm=None, group_size=g)


def int4_experts(gates: Sequence[Int4Linear], ups: Sequence[Int4Linear],
                 downs: Sequence[Int4Linear], *, name: str = "experts"):
  """Per-expert gate / up ([H, N]) and down ([N, H]) int4 linears -> (w13, w2)
  `QuantizedWeights` of one w4a16 scheme: w13 values [E, 2N, H/2] (gate | up), w2 values
  [E, H, N/2], packed two codes a byte along K.

  Act-order: w2's K permutation is folded into w13's output columns (gate and up alike), so
  w2 carries no perm; w13 keeps its K permutation in `perm` (gate and up share their input,
  so they must share it). Symmetric (every zero 8) loads without zero points; a per-channel
  checkpoint (one group = all of K) as weight_scale="channel".
  """
  import jax.numpy as jnp  # noqa: PLC0415

  from jmoe.config import QuantConfig  # noqa: PLC0415
  from jmoe.quant.packing import INT4_SIGN_FLIP, pack_nibbles  # noqa: PLC0415
  from jmoe.quant.weights import QuantizedWeights, check_quantized  # noqa: PLC0415

  e = len(gates)
  h = gates[0].codes.shape[1]
  n = downs[0].codes.shape[1]
  g13, g2 = gates[0].group_size, downs[0].group_size
  per_channel = g13 == h and g2 == n
  if not per_channel and g13 != g2:
    raise ValueError(f"{name}: gate/up use groups of {g13} and down groups of {g2}; one w4a16 "
                     "scheme needs one group size")
  w13_parts, w2_parts, perms = [], [], []
  for i, (gt, up, dn) in enumerate(zip(gates, ups, downs)):
    if (gt.perm is None) != (up.perm is None) or (
        gt.perm is not None and not np.array_equal(gt.perm, up.perm)):
      raise ValueError(f"{name}.{i}: gate_proj and up_proj have different act-order "
                       "permutations (g_idx); they share their input, so jmoe needs one")
    cols = [gt, up]
    if dn.perm is not None:  # stored row j of w2 = logical row perm[j]: reorder w13's columns
      p = dn.perm
      cols = [dataclasses.replace(c, codes=c.codes[p], scale=c.scale[p], zero=c.zero[p])
              for c in cols]
    w13_parts.append([np.concatenate([c.codes for c in cols]),
                      np.concatenate([c.scale for c in cols]),
                      np.concatenate([c.zero for c in cols])])
    w2_parts.append([dn.codes, dn.scale, dn.zero])
    perms.append(gt.perm)
  stack = lambda parts, j: np.stack([p[j] for p in parts])  # noqa: E731
  symmetric = all(np.all(p[2] == 8) for p in w13_parts + w2_parts)
  if per_channel:
    scheme = QuantConfig("custom", weight_dtype="int4", weight_scale="channel",
                         zero_point=not symmetric)
  else:
    scheme = QuantConfig("w4a16", group_size=g13, zero_point=not symmetric)
  has_perm = any(p is not None for p in perms)
  perm13 = (np.stack([np.arange(h) if p is None else p for p in perms]).astype(np.int32)
            if has_perm else None)
  out = []
  for parts, argname, perm in ((w13_parts, f"{name} (w13)", perm13),
                               (w2_parts, f"{name} (w2)", None)):
    w = QuantizedWeights(
        values=pack_nibbles(jnp.asarray(stack(parts, 0) ^ INT4_SIGN_FLIP), axis=2,
                            argname=argname),  # stored signed: u - 8
        scale=jnp.asarray(stack(parts, 1)),
        zero=None if symmetric else jnp.asarray(stack(parts, 2)),
        perm=None if perm is None else jnp.asarray(perm), scheme=scheme)
    check_quantized(w, argname=argname)
    out.append(w)
  assert out[0].shape == (e, h, 2 * n) and out[1].shape == (e, n, h)
  return out[0], out[1]
