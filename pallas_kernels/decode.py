"""The decode MoE block as one Mosaic GPU kernel: GEMM1, activation and GEMM2 chained per slot,
all weight loads of a CTA in one TMA ring, the weights as wgmma's 64-row operand.

At decode (a few tokens) the block is weight streaming: what counts is keeping HBM busy from the
first byte to the last and launching few kernels. ``fused_experts_decode`` runs, for each valid
slot s (token t = s // k, expert e = topk_ids[s]) and each block j of 64 intermediate columns,
one work item:

    a             = act(x[t] @ w13[e][:, gate cols of j] (+ b), x[t] @ w13[e][:, up cols of j])
    part[j, s, :] = a @ w2[e][rows of j, :]                                     [1, H] f32

Each item is H / 64 GEMM1 steps (a [64, 64] gate and a [64, 64] up tile) then H / 128 GEMM2
steps (two [64, 64] tiles of w2's rows j), all 16 KiB. A CTA walks its items (slot-major, so
the first waves touch every slot) as one stream of steps through one ring of SMEM slots: the
loads of the next GEMM2 steps fly while GEMM1 finishes, and the next item's loads while GEMM2
finishes, so the ring never drains between the two GEMMs or between items.

Operands are swapped ("swap AB"): a weight tile, transposed, is wgmma's M x K operand (64 output
columns), and the token is the 8-column B operand (its vector 8 times; wgmma's smallest N). A
64-row token tile would cost 8x the tensor-core work per weight byte, which is what bound the
first form of this kernel (and per_slot's GEMMs) to ~31-35 GB/s per SM. The token row is not
padded in HBM (a copy kernel): the item's x row is loaded once into SMEM and each step
broadcasts its 64 columns into a tile whose first 8 rows are B. The activation goes the same way
(accumulator column -> SMEM vector -> broadcast tile), and each GEMM2 step stores one f32 row.

Launches: this kernel and one reduction (the sum over j and k with the router weights, the w2
bias). No slot list, no sort, no token gather: the kernel reads topk_ids itself and gives an
empty or EP-remote slot (id outside [0, E)) no items.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jmoe.kernels import _compat
from jmoe.kernels.activations import Activation, as_activation
from jmoe.kernels.grouped_gemm import kernel_activation

log = logging.getLogger(__name__)

_ROWS = 64  # rows of the broadcast x / activation tiles (the first 8 are wgmma's B operand)
_N = 8  # wgmma's N: the token, 8 times (all columns of an accumulator are equal)
BN = 64  # intermediate columns per item (GEMM1's M per gate / up, GEMM2's K)
BK = 64  # GEMM1's contraction step
BH = 128  # GEMM2's output columns per step (two 64-row A tiles)
MAX_SLOTS = 128  # the kernel scans topk_ids in registers: decode-sized batches only
_SMEM_BYTES = 232448 - 6 * 1024  # sm_90 max dynamic SMEM, less each buffer's 1 KiB alignment
_MAX_STAGES = 8  # H200 (r12d), qwen3 1 token: 6 / 8 / 11 slots 21.9 / 20.5 / 24.3 µs


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """stages: 16 KiB slots of the weight ring (None: as many as shared memory holds, up to 8)."""
  stages: int | None = None

  def __post_init__(self):
    if self.stages is not None and self.stages < 2:
      raise ValueError(f"stages={self.stages} must be >= 2")


def _fixed_smem(h: int, itemsize: int, has_bias: bool) -> int:
  """SMEM besides the ring: two x tiles, the activation tile and vector, GEMM2's output row,
  two x rows (and two gate / up bias slices)."""
  return (2 * _ROWS * BK * itemsize + _ROWS * BN * itemsize + BN * 4 + BH * 4
          + 2 * h * itemsize + (2 * 2 * BN * 4 if has_bias else 0))


def max_stages(h: int, itemsize: int, has_bias: bool) -> int:
  """The deepest ring that fits shared memory for hidden size h."""
  free = _SMEM_BYTES - _fixed_smem(h, itemsize, has_bias)
  return min(_MAX_STAGES, free // (2 * BK * BN * itemsize))


def slot_item(ids_ref, lin, *, m: int, k: int, e: int, nb: int):
  """(valid-slot count, (slot, expert, block j, token)) of work item `lin`: block j = lin % nb
  of the (lin // nb)-th valid slot of ids_ref [m] (an id outside [0, E) is an empty or
  EP-remote slot: no items). The decode kernels' item order (slot-major, so the first waves
  touch every slot)."""
  v, j = lax.div(lin, jnp.int32(nb)), lax.rem(lin, jnp.int32(nb))
  cnt, slot, expert = jnp.int32(0), jnp.int32(0), jnp.int32(0)
  for s in range(m):  # m <= MAX_SLOTS independent scalar loads
    ident = ids_ref[s]
    ok = (ident >= 0) & (ident < e)
    hit = ok & (cnt == v)
    slot = jnp.where(hit, s, slot)
    expert = jnp.where(hit, ident, expert)
    cnt = cnt + ok.astype(jnp.int32)
  return cnt, (slot, expert, j, lax.div(slot, jnp.int32(k)))


def cta_items(ids_ref, sm, num_sms: int, *, m: int, k: int, e: int, nb: int):
  """The decode kernels' work split: (item(it) = slot_item of this CTA's it-th item (lin =
  sm + it * num_sms), its first item's info, its item count)."""
  def item(it):
    return slot_item(ids_ref, sm + it * num_sms, m=m, k=k, e=e, nb=nb)

  count, info0 = item(jnp.int32(0))
  return item, info0, jnp.maximum(lax.div(count * nb - sm + num_sms - 1, num_sms), 0)


def ring_step(g, i, cur, nxt, *, spi: int, stages: int):
  """Step g of a CTA's load stream, fetched while item i runs: (its item's index, its step
  within that item (spi steps an item), the item's (slot, expert, block, token) -- item i's
  `cur` or item i + 1's `nxt` --, its ring slot g % stages)."""
  it, r = lax.div(g, jnp.int32(spi)), lax.rem(g, jnp.int32(spi))
  pick = it == i
  info = tuple(jnp.where(pick, a, b) for a, b in zip(cur, nxt))
  return it, r, info, lax.rem(g, jnp.int32(stages))


def token_operand(tile, t_b=None):
  """B = the tile's first 8 rows, [8, K] K-major, as wgmma's logical [K, 8] operand; t_b: an
  SMEM [K, 8] scratch the interpreter (whose wgmma takes no transposed ref) copies them into."""
  rows = tile.at[pl.ds(0, _N)]
  if t_b is not None:
    t_b[...] = rows[...].T
    return t_b
  return plgpu.transpose_ref(rows, (1, 0))


def pair_columns(a0, a1, b, rows: int, acc_dtype=jnp.float32, scales=None):
  """A GEMM2 step's two MMAs: A operands a0(), a1() (built in order, inside the accumulators'
  scope) [rows, K] against one B [K, 8] whose 8 columns are equal -> column 0 of each
  accumulator as f32 [rows]. With `scales` (SMEM [2, rows, 8] f32) B's columns differ
  instead and each accumulator's row sums weighted by its scales come back."""
  def mma(acc_a, acc_b):
    plgpu.wgmma(acc_a, a0(), b)
    plgpu.wgmma(acc_b, a1(), b)
    plgpu.wgmma_wait(0)
    if scales is not None:
      return tuple(jnp.sum(acc[...] * scales.at[j][...], axis=1)
                   for j, acc in enumerate((acc_a, acc_b)))
    return tuple(jnp.max(acc[...].astype(jnp.float32), axis=1) for acc in (acc_a, acc_b))

  return pl.run_scoped(mma, plgpu.ACC((rows, _N), acc_dtype), plgpu.ACC((rows, _N), acc_dtype))


def store_part_row(o_row, ys, dst) -> None:
  """A GEMM2 step's output [len(ys) x 128 (or 64)] through the SMEM row o_row [1, BH'] into
  dst, once the previous step's store has read o_row."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  width = o_row.shape[1] // len(ys)
  for j, y in enumerate(ys):
    o_row.at[0, pl.ds(j * width, width)][...] = y
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_row, dst)


def combine_parts(part: jax.Array, ids: jax.Array, topk_weights: jax.Array, w2_bias, *,
                  num_experts: int, out_dtype) -> jax.Array:
  """The decode kernels' partial rows part [NB, m, H] f32 (empty slots' rows unwritten) -> the
  block's output [T, H]: the sum over blocks, the w2 bias once per slot, the router weights,
  the sum over each token's k slots."""
  t, k = topk_weights.shape
  h = part.shape[-1]
  m = t * k
  valid = (ids >= 0) & (ids < num_experts)
  y = jnp.sum(part, axis=0)
  if w2_bias is not None:
    y = y + w2_bias.astype(jnp.float32)[jnp.where(valid, ids, 0)]
  w = topk_weights.reshape(m).astype(jnp.float32)
  # unwritten rows are selected away (a NaN times 0 is NaN). In this form XLA makes one fusion
  # at qwen3 / 1 token (1.7 µs); a where before one sum over (j, k) made two (3.6 µs)
  y = jnp.where(valid[:, None], y * w[:, None], 0.0)
  return jnp.sum(y.reshape(t, k, h), axis=1).astype(out_dtype)


def _build(*, h, n, m, k, e, dtype, act: Activation, stages: int, has_bias: bool, num_sms,
           interpret):
  """x is passed as [T * H / 64, 64] (one x row = H / 64 rows of it)."""
  nb, k1, k2 = n // BN, h // BK, h // BH
  spi = k1 + k2  # steps per item
  hr = h // BK  # rows of the [T * H / 64, 64] view per token
  if stages - 1 >= spi:
    raise ValueError(f"stages={stages} must be at most {spi} (steps per item)")
  itemsize = jnp.dtype(dtype).itemsize
  _cast = _compat.layout_cast(interpret)
  tf = _compat.smem_transforms(BN, itemsize)
  emulate_t = interpret is not None  # the interpreter's wgmma takes no transposed operand

  def body(ids_ref, x_ref, w13_ref, w2_ref, *rest):
    rest = list(rest)
    b13_ref = rest.pop(0) if has_bias else None
    part_ref, ring, xt, a_smem, a_vec, o_row, x_rows = rest[:7]
    rest = rest[7:]
    b_smem = rest.pop(0) if has_bias else None
    bars, xbar = rest[:2]
    t_a, t_b = rest[2:] if emulate_t else (None, None)
    sm = lax.axis_index("sm")

    def lhs(tile):
      """A = tile^T: a weight tile [K rows, M columns] as wgmma's M x K operand (swap AB: the
      weights are the 64-row side, the token the 8-column one)."""
      if emulate_t:
        t_a[...] = tile[...].T
        return t_a
      return plgpu.transpose_ref(tile, (1, 0))

    rhs = functools.partial(token_operand, t_b=t_b)  # B: the token's vector 8 times

    item, info0, my_items = cta_items(ids_ref, sm, num_sms, m=m, k=k, e=e, nb=nb)
    total = my_items * spi

    def fetch(g, i, cur, nxt):
      """Loads the CTA's step g (item i's or item i + 1's) into slot g % stages."""
      @pl.when(g < total)
      def _fetch():
        it, r, (_, ex, jb, tok), slot = ring_step(g, i, cur, nxt, spi=spi, stages=stages)
        dst, bar = ring.at[slot], bars.at[slot]

        @pl.when(r == 0)  # the item's x row (and bias slices) ride with its first step
        def _row():
          xb = lax.rem(it, 2)
          plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tok * hr, hr)], x_rows.at[xb], xbar.at[xb])
          if has_bias:
            for c, col in enumerate((jb * BN, n + jb * BN)):
              plgpu.copy_gmem_to_smem(b13_ref.at[ex, pl.ds(col, BN)], b_smem.at[xb, c],
                                      xbar.at[xb])

        @pl.when(r < k1)
        def _w13():
          rows = pl.ds(r * BK, BK)
          plgpu.copy_gmem_to_smem(w13_ref.at[ex, rows, pl.ds(jb * BN, BN)], dst.at[0], bar)
          plgpu.copy_gmem_to_smem(w13_ref.at[ex, rows, pl.ds(n + jb * BN, BN)], dst.at[1], bar)

        @pl.when(r >= k1)
        def _w2():
          c = r - k1
          for half in range(2):
            cols = pl.ds(c * BH + half * (BH // 2), BH // 2)
            plgpu.copy_gmem_to_smem(w2_ref.at[ex, pl.ds(jb * BN, BN), cols], dst.at[half], bar)

    # the first stages - 1 steps all belong to item 0 (stages - 1 < steps per item)
    for g in range(stages - 1):
      fetch(jnp.int32(g), jnp.int32(0), info0, info0)

    def one_item(i, cur):
      _, nxt = item(i + 1)
      slot_id, _, jb, _ = cur
      xb = lax.rem(i, 2)
      base = i * spi
      plgpu.barrier_wait(xbar.at[xb])

      def gemm1(acc_g, acc_u):
        @pl.loop(0, k1)
        def _step(r):
          g = base + r
          xtile = xt.at[lax.rem(g, 2)]  # step g - 2, its last reader, is done
          xtile[...] = lax.broadcast_in_dim(x_rows.at[xb, r][...], (_ROWS, BK), [1])
          plgpu.commit_smem()
          slot = lax.rem(g, jnp.int32(stages))
          plgpu.barrier_wait(bars.at[slot])
          x_t = rhs(xtile)
          plgpu.wgmma(acc_g, lhs(ring.at[slot, 0]), x_t)
          plgpu.wgmma(acc_u, lhs(ring.at[slot, 1]), x_t)
          plgpu.wgmma_wait(2)  # step g - 1's pair is done: its slot takes step g + stages - 1
          fetch(g + stages - 1, i, cur, nxt)

        plgpu.wgmma_wait(0)
        gate, up = acc_g[...], acc_u[...]  # [BN, 8]: rows = intermediate columns
        if has_bias:
          biased = []
          for c, v in enumerate((gate, up)):
            b = _cast(b_smem.at[xb, c][...], plgpu.Layout.WGMMA.reduce(1))
            biased.append(v + lax.broadcast_in_dim(b, (BN, _N), [0]))
          gate, up = biased
        # the activation vector, through SMEM, into every row of GEMM2's B tile
        a_vec[...] = jnp.max(kernel_activation(act, gate, up), axis=1)
        plgpu.commit_smem()
        a = _cast(a_vec[...], plgpu.Layout.WGMMA.reduce(0))
        a_smem[...] = lax.broadcast_in_dim(a, (_ROWS, BN), [1]).astype(dtype)
        plgpu.commit_smem()

      pl.run_scoped(gemm1, plgpu.ACC((BN, _N), jnp.float32), plgpu.ACC((BN, _N), jnp.float32))

      @pl.loop(0, k2)
      def _gemm2(c):
        g = base + k1 + c
        slot = lax.rem(g, jnp.int32(stages))
        plgpu.barrier_wait(bars.at[slot])

        ys = pair_columns(lambda: lhs(ring.at[slot, 0]), lambda: lhs(ring.at[slot, 1]),
                          rhs(a_smem), BH // 2)
        fetch(g + stages - 1, i, cur, nxt)
        store_part_row(o_row, ys, part_ref.at[jb, pl.ds(slot_id, 1), pl.ds(c * BH, BH)])

      return nxt

    lax.fori_loop(0, my_items, one_item, info0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [
      plgpu.SMEM((stages, 2, BK, BN), dtype, transforms=tf),  # the weight ring
      plgpu.SMEM((2, _ROWS, BK), dtype, transforms=tf),  # x tiles (two steps in flight)
      plgpu.SMEM((_ROWS, BN), dtype, transforms=tf),  # the activation: GEMM2's B
      plgpu.SMEM((BN,), jnp.float32),  # the activation vector
      plgpu.SMEM((1, BH), jnp.float32),  # a GEMM2 step's output row
      plgpu.SMEM((2, hr, BK), dtype),  # x rows of this item and the next
  ]
  if has_bias:
    scratch.append(plgpu.SMEM((2, 2, BN), jnp.float32))
  scratch += [plgpu.Barrier(num_arrivals=2, num_barriers=stages),
              plgpu.Barrier(num_arrivals=3 if has_bias else 1, num_barriers=2)]
  if emulate_t:
    scratch += [plgpu.SMEM((BN, BK), dtype), plgpu.SMEM((BK, _N), dtype)]
  return _compat.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((nb, m, h), jnp.float32),
      scratch_types=scratch,
      grid=(num_sms,),
      grid_names=("sm",),
      compiler_params=_compat.compiler_params(approx_math=True),
      interpret=interpret,
      name="jmoe_moe_decode",
  )


def supports(t: int, k: int, h: int, n: int, act: Activation | str) -> bool:
  """Whether fused_experts_decode takes this problem (else fused_experts' per_slot layout)."""
  return (as_activation(act).is_gated and t * k <= MAX_SLOTS and h % BH == 0 and n % BN == 0
          and h // BK <= 256)


@functools.partial(jax.jit, static_argnames=("activation", "config", "interpret"))
def fused_experts_decode(x: jax.Array, w13: jax.Array, w2: jax.Array, topk_weights: jax.Array,
                         topk_ids: jax.Array, *, activation: Activation | str = "silu",
                         w13_bias: jax.Array | None = None, w2_bias: jax.Array | None = None,
                         config: DecodeConfig | None = None, interpret: Any = False
                         ) -> jax.Array:
  """out[t] = sum_j topk_weights[t, j] * (act(x[t] @ w13[e] + b13[e]) @ w2[e] + b2[e]),
  e = topk_ids[t, j].

  x [T, H] bf16/f16, w13 [E, H, 2N] (gate | up, gated activations only), w2 [E, N, H],
  topk_weights [T, k], topk_ids [T, k] (-1 or >= E: empty slot). T * k <= 128 (decode),
  H a multiple of 128 (at most 16384), N a multiple of 64. w13_bias [E, 2N] is added in the
  kernel before the activation; w2_bias [E, H] in the final reduction (once per slot). Returns
  [T, H] in x.dtype.
  """
  act = as_activation(activation)
  if not act.is_gated:
    raise ValueError(f"activation={act.name!r}: the decode kernel takes gated activations")
  cfg = config or DecodeConfig()
  t, k = topk_ids.shape
  e, h, n2 = w13.shape
  n = n2 // 2
  if x.shape != (t, h) or w2.shape != (e, n, h):
    raise ValueError(f"shapes: x {x.shape} (want ({t}, {h})), w2 {w2.shape} "
                     f"(want ({e}, {n}, {h}))")
  if topk_weights.shape != (t, k):
    raise ValueError(f"topk_weights must have shape ({t}, {k}) like topk_ids, got "
                     f"{topk_weights.shape}")
  if x.dtype != w13.dtype or w2.dtype != w13.dtype:
    raise ValueError(f"dtypes differ: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
  if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"x dtype {x.dtype}: bfloat16 or float16")
  if h % BH or h // BK > 256:
    raise ValueError(f"H={h} must be a multiple of {BH} and at most {256 * BK}")
  if n % BN:
    raise ValueError(f"N={n} is not a multiple of {BN}")
  if t * k > MAX_SLOTS:
    raise ValueError(f"topk_ids has {t * k} slots; the decode kernel takes at most {MAX_SLOTS}")
  if w13_bias is not None and w13_bias.shape != (e, n2):
    raise ValueError(f"w13_bias must have shape ({e}, {n2}), got {w13_bias.shape}")
  if w2_bias is not None and w2_bias.shape != (e, h):
    raise ValueError(f"w2_bias must have shape ({e}, {h}), got {w2_bias.shape}")
  itemsize = jnp.dtype(x.dtype).itemsize
  has_bias = w13_bias is not None
  stages = cfg.stages or min(max_stages(h, itemsize, has_bias), h // BK + h // BH)
  if stages > max_stages(h, itemsize, has_bias):
    raise ValueError(f"stages={stages} does not fit shared memory at H={h} "
                     f"(at most {max_stages(h, itemsize, has_bias)})")
  m = t * k
  log.debug("fused_experts_decode: %d slots, H=%d, N=%d, %d-slot ring%s", m, h, n, stages,
            "" if cfg.stages else " (as deep as shared memory allows, at most 8)")
  ids = topk_ids.reshape(m).astype(jnp.int32)
  interp, nsm = _compat.launch_params(interpret)
  kern = _build(h=h, n=n, m=m, k=k, e=e, dtype=x.dtype, act=act, stages=stages,
                has_bias=has_bias, num_sms=nsm, interpret=interp)
  args = [ids, x.reshape(t * h // BK, BK), w13, w2]
  if has_bias:
    args.append(w13_bias.astype(jnp.float32))
  part = kern(*args)  # [N / 64, m, H]; empty slots' rows unwritten
  return combine_parts(part, ids, topk_weights, w2_bias, num_experts=e, out_dtype=x.dtype)
