"""The 8-bit (W8A8) decode MoE block as one Mosaic GPU kernel: decode.py's design with 8-bit
weights, tokens and intermediate (fp8_tensor / fp8_channel / int8 schemes).

Per valid slot s (token t = s // k, expert e = topk_ids[s]) and block j of 128 intermediate
columns, one work item:

    a             = act(x_q[t] @ w13[e][gate rows of j]^T * sx[t] * sw13[gate rows] (+ b),
                        the same for the up rows)                                [128]
    a_q, sa       = a quantized (fp8 / int8) with one scale for the item's 128 values
    part[j, s, :] = (a_q @ w2[e][:, cols of j]^T) * sa * sw2[e, :]                 [1, H] f32

The weights stay as QuantizedWeights store them (K-major [E, N, K] values), which is the A
operand 8-bit wgmma takes with no transpose; the token is the 8-column B operand (its row 8
times, made in HBM by the wrapper: 8 x H bytes per token). Each step moves three TMA copies
into one ring slot: GEMM1 steps a 128 x 128 gate tile, an up tile and the token's 8 x 128
tile; GEMM2 steps two 128 x 128 tiles of w2 (256 output columns) and their 256 channel scales.
So one CTA's loads are one stream (decode.py: the ring never drains between the GEMMs or
between items), with 8-bit weights the only large bytes.

The intermediate's scale is per item (128 columns of one slot) rather than per token: a
token's scale would span every item (every CTA) of the slot. The item's GEMM2 partial is
multiplied by it before the store, so this only makes the intermediate more accurate than a
per-token scale (the XLA path's); the tests compare with a reference of the kernel's scheme.

fp8_block (128 x 128 weight blocks, tokens per 1 x 128 group, DeepSeek-V3's scheme): an item's
128 rows are one block row of w13 (gate or up) and its 128 intermediate columns one block
column of w2, so a GEMM1 step's tile has one weight scale and one token-group scale. The K
groups' products are kept apart as decode_wq keeps its scale groups: column j of the token's B
tile holds the token masked to the groups g with g % 8 == j (the wrapper builds it), so after a
window of 8 steps the accumulator's column j is group 8w + j's partial sum, multiplied by that
group's factor (weight block scale x the token's group scale, made per slot by the wrapper)
before the sum over columns. The intermediate's per-item scale is fp8_block's own 1 x 128
group; a GEMM2 step's two 128-row tiles have one w2 block scale each (a 16-byte box of the
slot's per-block factors rides with the step instead of 256 channel scales).

Launches: this kernel and decode.combine_parts' reduction (fp8_block: and the per-slot scale
factors' gathers).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jmoe.kernels import _compat
from jmoe.kernels.activations import Activation, as_activation
from jmoe.kernels.decode import (MAX_SLOTS, combine_parts, cta_items, pair_columns,
                                 ring_step, store_part_row, token_operand)
from jmoe.kernels.grouped_gemm import kernel_activation
from jmoe.kernels.grouped_gemm_q8 import Q8_MAX
from jmoe.quant.activations import K_CONSTANT_SCALES

_N = 8  # wgmma's N: the token (or activation) row, 8 times
BN = 128  # intermediate columns per item (GEMM1's M per gate / up, GEMM2's K)
BK = 128  # GEMM1's contraction step: one 128-byte swizzle of 8-bit values
BH = 256  # GEMM2's output columns per step (two 128-row A tiles)
_ROWS = 64  # rows of the activation tile (its first 8 are GEMM2's B operand)
_SMEM_BYTES = 232448 - 12 * 1024  # sm_90 max dynamic SMEM, less each buffer's 1 KiB alignment
_MAX_STAGES = 6
BLOCK = (128, 128)  # fp8_block's weight block the kernel takes (one item's rows / columns)


@dataclasses.dataclass(frozen=True)
class DecodeQ8Config:
  """stages: ring slots of 34 KiB (None: as many as shared memory holds, up to 6)."""
  stages: int | None = None

  def __post_init__(self):
    if self.stages is not None and self.stages < 2:
      raise ValueError(f"stages={self.stages} must be >= 2")


def _stage_bytes() -> int:
  return 2 * BN * BK + _N * BK + BH * 4


def _vec_width(h: int, block: bool) -> int:
  """The per-item vectors' width: BN (channel scales, biases), or fp8_block's per-group
  factors (H / 128 of them, padded to whole windows of 8)."""
  return max(BN, _groups(h)) if block else BN


def _groups(h: int) -> int:
  """fp8_block: H's 128-column groups padded to whole windows of _N."""
  return -(-(h // BK) // _N) * _N


def max_stages(h: int, has_bias: bool, block: bool = False) -> int:
  """The deepest ring that fits shared memory (besides it: the activation tile and vector,
  a GEMM2 output row, the item's scale / bias vectors; fp8_block: the gate / up sums)."""
  fixed = (_ROWS * BN + BN * 4 + BH * 4 + 2 * 4 * _vec_width(h, block) * 4 + _ROWS * 4
           + 2 * BK * _N + (2 * BN * 4 if block else 0))
  return min(_MAX_STAGES, (_SMEM_BYTES - fixed) // _stage_bytes())


def _build(*, h, n, m, k, e, dtype, act: Activation, stages: int, has_bias: bool, num_sms,
           interpret, block: bool = False):
  """block: fp8_block (module docstring): ws13 is the per-slot factors [m, 2N / 128, G]
  (G = `_groups(h)`), ws2 the per-slot w2 block scales [m, N / 128, H / 128], x the masked
  token tiles; else per-channel ws13 [E, 2N], ws2 [E, H] and x the token row 8 times."""
  nb, k1, k2 = n // BN, h // BK, h // BH
  vw, gp = _vec_width(h, block), _groups(h)
  n_windows = gp // _N
  spi = k1 + k2  # steps per item
  if stages - 1 >= spi:
    raise ValueError(f"stages={stages} must be at most {spi} (steps per item)")
  integer = jnp.issubdtype(dtype, jnp.integer)
  acc_dtype = jnp.int32 if integer else jnp.float32
  qmax = Q8_MAX[jnp.dtype(dtype)]
  _cast = _compat.layout_cast(interpret)
  tf = _compat.smem_transforms(BK, 1)
  emulate_t = interpret is not None  # the interpreter's wgmma takes no transposed operand

  def body(ids_ref, *rest):
    rest = list(rest)
    xs_ref = None if block else rest.pop(0)  # (block: the token scales ride in ws13)
    x_ref, w13_ref, ws13_ref, w2_ref, ws2_ref = rest[:5]
    del rest[:5]
    b13_ref = rest.pop(0) if has_bias else None
    part_ref, ring, xring, sring, a_smem, a_vec, s_vec, o_row, vec, bars, xbar = rest[:11]
    rest = rest[11:]
    gvec = rest.pop(0) if block else None
    t_b = rest.pop(0) if emulate_t else None
    sm = lax.axis_index("sm")

    rhs = functools.partial(token_operand, t_b=t_b)
    item, info0, my_items = cta_items(ids_ref, sm, num_sms, m=m, k=k, e=e, nb=nb)
    total = my_items * spi

    def fetch(g, i, cur, nxt):
      """Loads the CTA's step g (item i's or item i + 1's) into slot g % stages: three copies
      per step, whichever GEMM it belongs to (one barrier count)."""
      @pl.when(g < total)
      def _fetch():
        it, r, (sid, ex, jb, tok), slot = ring_step(g, i, cur, nxt, spi=spi, stages=stages)
        dst, bar = ring.at[slot], bars.at[slot]

        @pl.when(r == 0)  # the item's weight scales (and biases) ride with its first step
        def _vectors():
          vb = lax.rem(it, 2)
          for c, col in enumerate((jb * BN, n + jb * BN)):
            if block:  # the slot's gate / up group factors of block row c * N / 128 + jb
              plgpu.copy_gmem_to_smem(ws13_ref.at[sid, c * nb + jb],
                                      vec.at[vb, c, pl.ds(0, gp)], xbar.at[vb])
            else:
              plgpu.copy_gmem_to_smem(ws13_ref.at[ex, pl.ds(col, BN)],
                                      vec.at[vb, c, pl.ds(0, BN)], xbar.at[vb])
            if has_bias:
              plgpu.copy_gmem_to_smem(b13_ref.at[ex, pl.ds(col, BN)],
                                      vec.at[vb, 2 + c, pl.ds(0, BN)], xbar.at[vb])

        @pl.when(r < k1)
        def _w13():
          cols = pl.ds(r * BK, BK)
          plgpu.copy_gmem_to_smem(w13_ref.at[ex, pl.ds(jb * BN, BN), cols], dst.at[0], bar)
          plgpu.copy_gmem_to_smem(w13_ref.at[ex, pl.ds(n + jb * BN, BN), cols], dst.at[1], bar)
          plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tok * _N, _N), cols], xring.at[slot], bar)

        @pl.when(r >= k1)
        def _w2():
          c = r - k1
          for half in range(2):
            rows = pl.ds(c * BH + half * (BH // 2), BH // 2)
            plgpu.copy_gmem_to_smem(w2_ref.at[ex, rows, pl.ds(jb * BN, BN)], dst.at[half], bar)
          if block:  # the step's two block scales, in a 16-byte box of the slot's row
            plgpu.copy_gmem_to_smem(ws2_ref.at[sid, jb, pl.ds(lax.div(c, 2) * 4, 4)],
                                    sring.at[slot, pl.ds(0, 4)], bar)
          else:
            plgpu.copy_gmem_to_smem(ws2_ref.at[ex, pl.ds(c * BH, BH)], sring.at[slot], bar)

    for g in range(stages - 1):  # the first stages - 1 steps all belong to item 0
      fetch(jnp.int32(g), jnp.int32(0), info0, info0)

    def one_item(i, cur):
      _, nxt = item(i + 1)
      slot_id, _, jb, tok = cur
      vb = lax.rem(i, 2)
      base = i * spi
      plgpu.barrier_wait(xbar.at[vb])

      def gemm1_steps(acc_g, acc_u, first, count):
        @pl.loop(first, first + count)
        def _step(r):
          g = base + r
          slot = lax.rem(g, jnp.int32(stages))
          plgpu.barrier_wait(bars.at[slot])
          x_t = rhs(xring.at[slot])
          plgpu.wgmma(acc_g, ring.at[slot, 0], x_t)
          plgpu.wgmma(acc_u, ring.at[slot, 1], x_t)
          plgpu.wgmma_wait(2)  # step g - 1's pair is done: its slot takes step g + stages - 1
          fetch(g + stages - 1, i, cur, nxt)

        plgpu.wgmma_wait(0)

      def gate_up_channel():
        """[2] x [BN]: the gate / up dot products, per-channel / per-tensor scales."""
        def gemm1(acc_g, acc_u):
          gemm1_steps(acc_g, acc_u, 0, k1)
          sx = xs_ref[tok]
          return tuple(  # [BN, 8], rows = intermediate columns, its 8 columns equal
              jnp.max(acc[...].astype(jnp.float32), axis=1) * sx
              * _cast(vec.at[vb, c, pl.ds(0, BN)][...], plgpu.Layout.WGMMA.reduce(1))
              for c, acc in enumerate((acc_g, acc_u)))

        return pl.run_scoped(gemm1, plgpu.ACC((BN, _N), acc_dtype),
                             plgpu.ACC((BN, _N), acc_dtype))

      def gate_up_block():
        """fp8_block: window w's accumulator column j is group 8w + j's partial sum; its
        factor (block scale x token group scale) multiplies it before the sum over columns,
        the windows' sums adding up in gvec."""
        @pl.loop(0, n_windows)
        def _window(w):
          def gemm1(acc_g, acc_u):
            gemm1_steps(acc_g, acc_u, w * _N, jnp.minimum(_N, k1 - w * _N))
            for c, acc in enumerate((acc_g, acc_u)):
              f = _cast(vec.at[vb, c, pl.ds(w * _N, _N)][...], plgpu.Layout.WGMMA.reduce(0))
              p = jnp.sum(acc[...] * lax.broadcast_in_dim(f, (BN, _N), [1]), axis=1)
              dst = gvec.at[c]

              @pl.when(w == 0)  # (so gvec needs no zeroing)
              def _first(dst=dst, p=p):
                dst[...] = p

              @pl.when(w > 0)
              def _more(dst=dst, p=p):
                dst[...] = dst[...] + p
            plgpu.commit_smem()

          pl.run_scoped(gemm1, plgpu.ACC((BN, _N), acc_dtype), plgpu.ACC((BN, _N), acc_dtype))

        return [_cast(gvec.at[c][...], plgpu.Layout.WGMMA.reduce(1)) for c in range(2)]

      vals = []
      for c, v in enumerate(gate_up_block() if block else gate_up_channel()):
        if has_bias:
          v = v + _cast(vec.at[vb, 2 + c, pl.ds(0, BN)][...], plgpu.Layout.WGMMA.reduce(1))
        vals.append(lax.broadcast_in_dim(v, (BN, _N), [0]))
      a_vec[...] = jnp.max(kernel_activation(act, *vals), axis=1)
      plgpu.commit_smem()
      # the item's scale: every row of the broadcast tile holds the 128 values, so a
      # per-row max is the amax (a cross-row reduction has no cheap form here)
      a = _cast(a_vec[...], plgpu.Layout.WGMMA.reduce(0))
      tile = lax.broadcast_in_dim(a, (_ROWS, BN), [1])
      amax = jnp.max(jnp.abs(tile), axis=1)
      sa = jnp.where(amax > 0.0, amax / qmax, 1.0)
      q = tile / lax.broadcast_in_dim(sa, (_ROWS, BN), [0])
      if integer:
        q = jnp.round(q)
      a_smem[...] = jnp.clip(q, -qmax, qmax).astype(dtype)
      s_vec[...] = sa
      plgpu.commit_smem()

      @pl.loop(0, k2)
      def _gemm2(c):
        g = base + k1 + c
        slot = lax.rem(g, jnp.int32(stages))
        plgpu.barrier_wait(bars.at[slot])

        ys = pair_columns(lambda: ring.at[slot, 0], lambda: ring.at[slot, 1], rhs(a_smem),
                          BH // 2, acc_dtype)
        sa = s_vec[0]
        if block:  # one scale per 128-row tile: the box's entries 2c mod 4 and the next
          at = lax.rem(2 * c, 4)
          scales = [sring[slot, at + half] for half in range(2)]
        else:
          scales = [_cast(sring.at[slot, pl.ds(half * (BH // 2), BH // 2)][...],
                          plgpu.Layout.WGMMA.reduce(1)) for half in range(2)]
        fetch(g + stages - 1, i, cur, nxt)  # after the scales' read: the slot is reloaded
        store_part_row(o_row, [y * s2 * sa for y, s2 in zip(ys, scales)],
                       part_ref.at[jb, pl.ds(slot_id, 1), pl.ds(c * BH, BH)])

      return nxt

    lax.fori_loop(0, my_items, one_item, info0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [
      plgpu.SMEM((stages, 2, BN, BK), dtype, transforms=tf),  # the weight ring
      plgpu.SMEM((stages, _N, BK), dtype, transforms=tf),  # GEMM1 steps' token tiles
      plgpu.SMEM((stages, BH), jnp.float32),  # GEMM2 steps' w2 channel scales
      plgpu.SMEM((_ROWS, BN), dtype, transforms=tf),  # the quantized activation: GEMM2's B
      plgpu.SMEM((BN,), jnp.float32),  # the activation vector
      plgpu.SMEM((_ROWS,), jnp.float32),  # the item's activation scale (every entry)
      plgpu.SMEM((1, BH), jnp.float32),  # a GEMM2 step's output row
      plgpu.SMEM((2, 4, vw), jnp.float32),  # per item: gate / up scales (and biases)
      plgpu.Barrier(num_arrivals=3, num_barriers=stages),
      plgpu.Barrier(num_arrivals=4 if has_bias else 2, num_barriers=2),
  ]
  if block:
    scratch.append(plgpu.SMEM((2, BN), jnp.float32))  # gate / up sums over the windows
  if emulate_t:
    scratch.append(plgpu.SMEM((BK, _N), dtype))
  return _compat.kernel(
      body, out_type=jax.ShapeDtypeStruct((nb, m, h), jnp.float32), scratch_types=scratch,
      grid=(num_sms,), grid_names=("sm",),
      compiler_params=_compat.compiler_params(approx_math=True), interpret=interpret,
      name="jmoe_moe_decode_q8")


def supports(t: int, k: int, h: int, n: int, act: Activation | str, quant) -> bool:
  """Whether fused_experts_decode_q8 takes this problem: a gated activation, <= 128 slots, H a
  multiple of 256, N of 128, and a scheme whose scales are constant along K (per tensor /
  channel weights, per-token, per-tensor or static activations; under a static scheme the
  tokens come quantized with the static scale and the intermediate keeps the kernel's
  per-item scale, finer than the static one) -- or fp8_block with 128 x 128 weight blocks and
  tokens per 1 x 128 group, H a multiple of 512 (the per-slot factor rows' 16-byte pitch)."""
  if not (as_activation(act).is_gated and t * k <= MAX_SLOTS and h % BH == 0 and n % BN == 0
          and quant.act_dtype is not None and jnp.dtype(quant.act_dtype) in Q8_MAX):
    return False
  if _block_scheme(quant):
    return h % (4 * BK) == 0
  return quant.weight_scale in ("tensor", "channel") and quant.act_scale in K_CONSTANT_SCALES


def _block_scheme(quant) -> bool:
  """fp8_block as the kernel takes it: 128 x 128 weight blocks, tokens per 1 x 128 group."""
  return (quant.weight_scale == "block" and tuple(quant.block_shape) == BLOCK
          and quant.act_scale == "dynamic_group" and quant.act_group_size == BK)


def token_group_tiles(x_q: jax.Array) -> jax.Array:
  """x_q [T, H] -> the B rows [T * 8, H]: row j of a token keeps the columns of the 128-groups
  g with g % 8 == j (zeros elsewhere), so a window of 8 GEMM1 steps keeps the groups' sums in
  the accumulator's 8 columns."""
  t, h = x_q.shape
  keep = (jnp.arange(h)[None, :] // BK) % _N == jnp.arange(_N)[:, None]  # [8, H]
  return jnp.where(keep[None], x_q[:, None, :], jnp.zeros((), x_q.dtype)).reshape(t * _N, h)


def _block_factors(x_scale: jax.Array, w13, w2, ids: jax.Array, k: int):
  """fp8_block's per-slot scales: GEMM1's factors [m, 2N / 128, G] (w13's block scale of the
  slot's expert times its token's group scale; G = H / 128 padded to whole windows with
  zeros) and w2's block scales [m, N / 128, H / 128] (a slot's row per item)."""
  e, g = w13.values.shape[0], x_scale.shape[1]
  sid = jnp.clip(ids, 0, e - 1)
  tok = jnp.arange(ids.shape[0]) // k
  f13 = w13.scale[sid].astype(jnp.float32) * x_scale.astype(jnp.float32)[tok][:, None, :]
  f13 = jnp.pad(f13, ((0, 0), (0, 0), (0, _groups(g * BK) - g)))
  f2 = jnp.swapaxes(w2.scale[sid].astype(jnp.float32), 1, 2)
  return f13, f2


def _channel_scales(s: jax.Array, e: int, rows: int, argname: str) -> jax.Array:
  """QuantizedWeights.scale [E, 1, 1] / [E, rows, 1] -> f32 [E, rows]."""
  if s.shape not in ((e, 1, 1), (e, rows, 1)):
    raise ValueError(f"{argname} must be per-tensor [E, 1, 1] or per-channel [E, {rows}, 1] "
                     f"(K-major values), got {s.shape}")
  return jnp.broadcast_to(s[:, :, 0].astype(jnp.float32), (e, rows))


@functools.partial(jax.jit, static_argnames=("activation", "config", "out_dtype", "interpret"))
def fused_experts_decode_q8(x_q: jax.Array, x_scale: jax.Array, w13, w2,
                            topk_weights: jax.Array, topk_ids: jax.Array, *,
                            activation: Activation | str = "silu",
                            w13_bias: jax.Array | None = None,
                            w2_bias: jax.Array | None = None, out_dtype=jnp.bfloat16,
                            config: DecodeQ8Config | None = None,
                            interpret: Any = False) -> jax.Array:
  """The W8A8 decode block: out[t] = sum_j topk_weights[t, j] * (act(dq(x[t]) @ dq(w13[e]) +
  b13[e]) @ dq(w2[e]) + b2[e]), e = topk_ids[t, j], with the intermediate quantized per 128
  columns of each slot (module docstring).

  x_q [T, H] fp8 e4m3 / int8 (prepare's quantized tokens), x_scale [T, 1] (or [1, 1]) f32 --
  fp8_block: [T, H / 128]; w13 / w2 jmoe.quant.QuantizedWeights (K-major values [E, 2N, H] /
  [E, H, N] of x_q's dtype, per-tensor or per-channel scales, or fp8_block's 128 x 128 block
  scales [E, 2N / 128, H / 128] / [E, H / 128, N / 128]); topk_weights / topk_ids [T, k] (-1 or
  >= E: empty slot), T * k <= 128; H a multiple of 256 (fp8_block: 512), N of 128; biases f32
  [E, 2N] / [E, H]. Returns [T, H].
  """
  act = as_activation(activation)
  if not act.is_gated:
    raise ValueError(f"activation={act.name!r}: the decode kernel takes gated activations")
  cfg = config or DecodeQ8Config()
  t, k = topk_ids.shape
  e, n2, h = w13.values.shape
  n = n2 // 2
  if x_q.shape != (t, h) or w2.values.shape != (e, h, n):
    raise ValueError(f"shapes: x_q {x_q.shape} (want ({t}, {h})), w2 values "
                     f"{w2.values.shape} (want K-major ({e}, {h}, {n}))")
  if topk_weights.shape != (t, k):
    raise ValueError(f"topk_weights must have shape ({t}, {k}) like topk_ids, got "
                     f"{topk_weights.shape}")
  dt = jnp.dtype(x_q.dtype)
  if dt not in Q8_MAX or w13.values.dtype != dt or w2.values.dtype != dt:
    raise ValueError(f"dtypes: x_q {x_q.dtype}, w13 {w13.values.dtype}, w2 {w2.values.dtype}: "
                     "one 8-bit type (float8_e4m3fn or int8)")
  if h % BH or n % BN:
    raise ValueError(f"H={h} must be a multiple of {BH} and N={n} of {BN}")
  if t * k > MAX_SLOTS:
    raise ValueError(f"topk_ids has {t * k} slots; the decode kernel takes at most {MAX_SLOTS}")
  block = w13.scheme is not None and w13.scheme.weight_scale == "block"
  if block and not _block_scheme(w13.scheme):
    raise ValueError(f"{w13.scheme}: block scales of {BLOCK[0]} x {BLOCK[1]} with tokens per "
                     f"1 x {BK} group are what the decode kernel takes")
  if block and h % (4 * BK):
    raise ValueError(f"H={h} must be a multiple of {4 * BK} for fp8_block")
  want = ((t, h // BK),) if block else ((t, 1), (1, 1))
  if x_scale.shape not in want:
    raise ValueError(f"x_scale must be " + (f"per 1 x {BK} group [{t}, {h // BK}]" if block else
                                            f"per-token [{t}, 1] or per-tensor [1, 1]")
                     + f", got {x_scale.shape}")
  if w13_bias is not None and w13_bias.shape != (e, n2):
    raise ValueError(f"w13_bias must have shape ({e}, {n2}), got {w13_bias.shape}")
  has_bias = w13_bias is not None
  cap = max_stages(h, has_bias, block)
  stages = cfg.stages or min(cap, h // BK + h // BH)
  if stages > cap:
    raise ValueError(f"stages={stages} does not fit shared memory (at most {cap})")
  m = t * k
  ids = topk_ids.reshape(m).astype(jnp.int32)
  interp, nsm = _compat.launch_params(interpret)
  kern = _build(h=h, n=n, m=m, k=k, e=e, dtype=dt, act=act, stages=stages, has_bias=has_bias,
                num_sms=nsm, interpret=interp, block=block)
  if block:  # (the token scales ride in GEMM1's per-slot factors)
    s13, s2 = _block_factors(x_scale, w13, w2, ids, k)
    args = [ids, token_group_tiles(x_q)]
  else:
    xs = jnp.broadcast_to(x_scale.astype(jnp.float32).reshape(-1), (t,))
    x8 = jnp.broadcast_to(x_q[:, None, :], (t, _N, h)).reshape(t * _N, h)  # B: the row 8 times
    s13 = _channel_scales(w13.scale, e, n2, "w13.scale")
    s2 = _channel_scales(w2.scale, e, h, "w2.scale")
    args = [ids, xs, x8]
  args += [w13.values, s13, w2.values, s2]
  if has_bias:
    args.append(w13_bias.astype(jnp.float32))
  part = kern(*args)  # [N / 128, m, H]
  return combine_parts(part, ids, topk_weights, w2_bias, num_experts=e, out_dtype=out_dtype)
