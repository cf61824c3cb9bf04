"""Routing in one or two kernels: moe_align + tile metadata + the token gather (sorted layout).

The jnp path (permute.moe_align, grouped_gemm.tile_metadata, permute.gather_rows) is ~16 small
XLA kernels plus a row-copy kernel: at qwen3 / 1024 tokens on an H200 that is ~24 µs of
launches (1-2 µs each) and an 11 µs copy. Here (same run) it is 4.0 + 13.9 µs:

1. ``block_counts`` (grid: one program per block of 128 slots): each slot's rank among the
   same-expert slots of its block, and the block's per-expert counts.
2. ``scatter_rows`` (grid: blocks + tile-list chunks, x column chunks): every program sums the
   (small) block-count table into expert offsets; a block program computes its slots' sorted
   positions ``pos = offset[e] + slots of e in earlier blocks + rank`` and copies their token
   rows (its column chunk) there, and writes ``inv``; a tile-list program writes _TASKS
   entries of a GEMM's work list (_DIRECT_TASKS in the one-kernel form).

Up to ONE_KERNEL_BLOCKS blocks (2048 slots: qwen3 / deepseek-v3 at 256 tokens, mixtral at
1024) kernel 1 is not launched, so the sorted block is 4 kernels. A block program of kernel 2
then gets its slots' positions from one compare with every slot's key (the slots before it in
a stable sort by key), and only the tile-list programs count the experts: with _digit_counts, a
tensor-core dot of the keys' one-hot base-16 digits (32 compares a key, not E), in a loop over
chunks of keys. Loops, not unrolled code, on the one-kernel form's longest path: when the
GEMMs before have flushed L2, a program's instructions come from HBM, and the unrolled count
cost 4-11 µs more than the loop (r14b).

``route_for_training`` is the same pair of kernels (one builder, a static flag) in the layout of
the training path (moe.fused_experts_train): every expert's rows padded to a multiple of 8 with
zero rows, the rows past them (the tail) zero and in the last expert's tile lists, and the
sort order (``order``, -1 on padding and tail rows) written too. The block programs zero their
experts' padding rows; every program of kernel 2 zero-fills its column chunk of a share of the
tail (a loop that is empty when the tail is short).

Positions are those of a stable sort (the same as moe_align's), so results match the jnp path
exactly. Both kernels are Pallas with the Triton lowering: they need vector gathers/scatters and
reductions over arbitrary register tensors, which Mosaic GPU (warpgroup-level arrays, TMA) does
not express. The Triton lowering is deprecated since jax 0.11; ``available()`` says whether it
imports, and callers fall back to the jnp path when it does not.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm as gg

BLOCK = 128          # slots per block (kernel 1's [128, 128] rank compare)
_ROWS = 32           # slots per inner step of both kernels
_TASKS = 32          # tile-list entries per tile-list program of kernel 2
_MAX_HC = 256        # columns per program of kernel 2 in the two-kernel form, at most; 512
                     # past 128 experts (each program sums the whole [blocks, E] count table).
                     # r14e/r14g, µs, 256 against 512 columns: qwen3 1024 tokens 16.0-16.2
                     # against 17.5, mixtral 2048 17.6 against 19.3; deepseek-v3 512 / 1024
                     # 42.0 / 70.5 against 32.1 / 50.1
_DIRECT_TASKS = 16   # the same in the one-kernel form, whose tile-list programs count the
                     # experts first: at 8 blocks, 16 took 8.3 µs against 32's 8.1 warm, 13.3
                     # against 20.5 with L2 flushed (H200, r13c)
_DIRECT_MAX_HC = 1024  # columns per program of the one-kernel form, at most: each column chunk
                       # ranks its slots again (1024 against 512: 5.7 against 8.3 µs at 8
                       # blocks, r13c)
_DIRECT = 512        # keys per compare of the one-kernel form's sorted positions
_DIRECT_ROWS = 16    # slots per block program of the one-kernel form up to 8 blocks, half that
                     # past 8 (each ranks its slots against every slot; r14c: at 16 blocks 8
                     # took 15.4 µs on deepseek-v3 against 16.5, 32 21.2; up to 8 blocks 16 was
                     # the better on qwen3 and mixtral)
ONE_KERNEL_BLOCKS = 16  # route()'s default: one kernel up to this many blocks (2048 slots:
                        # qwen3 / deepseek-v3 at 256 tokens, mixtral at 1024). In the block at
                        # 16 blocks one kernel took 305.4 / 5010.3 / 1264.2 µs against 307.2 /
                        # 5020.1 / 1264.3 for two (r14d); its cost grows with slots squared
ONE_KERNEL_BLOCKS_TRAINING = 1  # route_for_training()'s: there every program of the one-
                                # kernel form counts every block (its rows need the table)
_ALIGN = 8           # route_for_training: experts start on multiples of this many rows
_PAD = _ALIGN - 1    # at most this many padding rows per expert
_MAX_SLOTS = 8192    # above this the jnp path (its sort/count kernels amortize; and kernel 2
                     # sums the whole [blocks, experts] count table in every program)
_MAX_EXPERTS = 256   # measured up to deepseek-v3's 256; more widens every [rows, E] one-hot


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether the Pallas Triton lowering imports (deprecated in jax 0.11, may be removed)."""
  try:
    from jax.experimental.pallas import triton as _  # noqa: F401
    return True
  except Exception:  # ImportError or a removal shim raising on import
    return False


def supports(num_slots: int, hdim: int, num_experts: int) -> bool:
  """Whether route() takes this problem (slots, token row width, experts)."""
  return 0 < num_slots <= _MAX_SLOTS and hdim % 64 == 0 and 0 < num_experts <= _MAX_EXPERTS


def _compiler_params(num_warps: int):
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


def _load_keys(ids_ref, start, size: int, n: int, e: int):
  """Expert keys of slots [start, start + size): the id, or e for an empty slot (id outside
  [0, e)) and for slots past n. A gather load at clamped indices: no out-of-bounds access."""
  slot = start + lax.broadcasted_iota(jnp.int32, (size,), 0)
  ids = ids_ref[jnp.minimum(slot, n - 1)]
  return jnp.where((slot < n) & (ids >= 0) & (ids < e), ids, e)


def _ranks(key, block, row0: int | jax.Array):
  """Rank of each slot of `key` (slots row0 + i of the block) among the slots of `block` with
  the same key before it: [len(key)]."""
  i = row0 + lax.broadcasted_iota(jnp.int32, (key.shape[0], block.shape[0]), 0)
  j = lax.broadcasted_iota(jnp.int32, (key.shape[0], block.shape[0]), 1)
  return jnp.sum(((key[:, None] == block[None, :]) & (j < i)).astype(jnp.int32), axis=1)


def _sort_keys(key, slot, n: int):
  """key * n + slot: distinct for distinct slots (slot < n + _DIRECT, key <= 256), and ordered as
  a stable sort by key orders the slots, so one compare finds the slots before another."""
  return key * n + slot


def _sorted_before(mine, theirs):
  """For each sort key (_sort_keys) of `mine`: how many of `theirs` are smaller: [len(mine)]."""
  return jnp.sum((theirs[None, :] < mine[:, None]).astype(jnp.int32), axis=1)


def _counts(key, e0: int, ec: int):
  """How many entries of `key` equal each of e0 .. e0 + ec - 1: [ec] (one compare-reduce)."""
  experts = e0 + lax.broadcasted_iota(jnp.int32, (key.shape[0], ec), 1)
  return jnp.sum((key[:, None] == experts).astype(jnp.int32), axis=0)


_DIGIT = 16  # a key's two base-16 digits: one-hot widths of _digit_counts' dot (tl.dot's minimum)


def _digit_counts(key: jax.Array) -> jax.Array:
  """[16, 16] f32: how many entries of the int32 vector `key` have each (high, low) pair of
  base-16 digits. One-hot rows of the high digit, transposed, times one-hot rows of the low
  digit: one tensor-core dot, 32 compares a key instead of one a bin. f16 one-hots and an f32
  accumulator are exact up to 2**24 keys; keys >= 256 match no high digit."""
  digit = lax.broadcasted_iota(jnp.int32, (key.shape[0], _DIGIT), 1)
  hi = (key[:, None] // _DIGIT == digit).astype(jnp.float16)
  lo = (key[:, None] % _DIGIT == digit).astype(jnp.float16)
  return lax.dot_general(hi, lo, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _bins(acc: jax.Array, ep: int) -> jax.Array:
  """The first ep bins (key h * 16 + l) of a [16, 16] _digit_counts sum, as int32 [ep]."""
  if ep > _DIGIT * _DIGIT:
    raise ValueError(f"route histogram: ep={ep} > {_DIGIT * _DIGIT}")
  # rows of ep bins: the first holds 0 .. ep - 1 (no slicing in Triton)
  acc = acc.reshape(_DIGIT * _DIGIT // ep, ep)
  row = lax.broadcasted_iota(jnp.int32, acc.shape, 0)
  return jnp.sum(jnp.where(row == 0, acc, 0.0), axis=0).astype(jnp.int32)


_HIST_CHUNK = 128  # keys per step of _histogram_of_slots (64 and 256 measured no better, r14b)


def _histogram_of_slots(ids_ref, n: int, e: int, ep: int, below=None):
  """(total, before): how many of the keys (_load_keys) of slots [0, n), and of those below
  slot `below` (None when `below` is None), equal each of 0 .. ep - 1: [ep] int32 each (ep <=
  256; the empty-slot key e is counted when e < ep). One pass over the keys for both.

  A loop over _HIST_CHUNK keys, the next chunk's load issued before this chunk's dot, so the
  code is one chunk's. A program runs it once: unrolled over every key, its code (fetched from
  HBM when the GEMMs before have flushed L2) cost the one-kernel routing 4-11 µs at 8-16 blocks
  (r14b). (A [keys, ep] one-hot compare-reduce is what made one routing kernel slow past 4
  blocks: its tile-list programs count every slot.)"""
  c = min(_HIST_CHUNK, max(_pow2(n), _DIGIT))
  nq = -(-n // c)

  keys_at = lambda q: _load_keys(ids_ref, q * c, c, n, e)

  def step(q, carry):
    acc, acc_below, key = carry
    upcoming = keys_at(jnp.minimum(q + 1, nq - 1))
    acc = acc + _digit_counts(key)
    if below is not None:  # the slots from `below` on made empty (key e)
      slot = q * c + lax.broadcasted_iota(jnp.int32, (c,), 0)
      acc_below = acc_below + _digit_counts(jnp.where(slot < below, key, e))
    return acc, acc_below, upcoming

  zero = jnp.zeros((_DIGIT, _DIGIT), jnp.float32)
  acc, acc_below, _ = lax.fori_loop(0, nq, step, (zero, zero, keys_at(0)))
  return _bins(acc, ep), (None if below is None else _bins(acc_below, ep))


def _block_counts(ids: jax.Array, e: int, ep: int, interpret: bool):
  """ids [n] int32 -> (rank [nb * BLOCK], counts [nb, ep]): each slot's rank among the
  same-key slots before it in its block of BLOCK slots, and per-block key counts. One
  compare-reduce per output (a chain of small reductions costs ~1 µs each in a program)."""
  n = ids.shape[0]
  nb = -(-n // BLOCK)

  def body(ids_ref, rank_ref, cnt_ref):
    key = _load_keys(ids_ref, pl.program_id(0) * BLOCK, BLOCK, n, e)
    rank_ref[...] = _ranks(key, key, 0)
    ec = min(ep, BLOCK)  # [BLOCK, <= BLOCK] compares: Triton's 1-D concatenate does not lower
    for q in range(ep // ec):
      cnt_ref[:, pl.ds(q * ec, ec)] = _counts(key, q * ec, ec)[None, :]

  call = pl.pallas_call(
      body,
      out_shape=(_compat.out_struct((nb * BLOCK,), jnp.int32, ids),
                 _compat.out_struct((nb, ep), jnp.int32, ids)),
      grid=(nb,),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=(pl.BlockSpec((BLOCK,), lambda b: (b,)),
                 pl.BlockSpec((1, ep), lambda b: (b, 0))),
      compiler_params=_compiler_params(4),
      interpret=interpret,
      name="jmoe_route_block_counts",
  )
  return call(ids)


_PREFIX_BY_DOT = True  # slot_positions' scan over blocks as a dot (False: jnp.cumsum)


def _blocks_before(counts: jax.Array) -> jax.Array:
  """Exclusive prefix sum over the rows of the int [blocks, E] count table. As one dot with a
  strictly lower-triangular 0/1 matrix: exact (counts <= BLOCK are bf16 integers, sums < 2**24
  in the f32 accumulator), where XLA makes jnp.cumsum a reduce_window as long as the column."""
  if not _PREFIX_BY_DOT:
    return jnp.cumsum(counts, axis=0) - counts
  nb = counts.shape[0]
  below = (lax.broadcasted_iota(jnp.int32, (nb, nb), 1)
           < lax.broadcasted_iota(jnp.int32, (nb, nb), 0)).astype(jnp.bfloat16)
  return jnp.dot(below, counts.astype(jnp.bfloat16),
                 preferred_element_type=jnp.float32).astype(jnp.int32)


def slot_positions(topk_ids: jax.Array, num_experts: int, *, interpret: Any = False
                   ) -> tuple[jax.Array, jax.Array]:
  """moe_align's inv and group sizes for any number of slots (the jnp routing path's, past
  route()'s 8192): kernel 1 (each block's ranks and expert counts), then a scan of the count
  table and one gather in XLA. With the token rows copied in token order
  (permute.scatter_rows) the sort order itself is not needed.

  topk_ids [T, k] int (ids outside [0, num_experts) are empty slots), num_experts <= 256.
  Returns inv [T, k] int32 (sorted position of each slot, stable; -1 for an empty slot) and
  group_sizes [E] int32.
  """
  t, k = topk_ids.shape
  n = t * k
  e = num_experts
  if not 0 < e <= _MAX_EXPERTS:
    raise ValueError(f"num_experts={e} must be in [1, {_MAX_EXPERTS}]")
  ids = topk_ids.reshape(n).astype(jnp.int32)
  rank, counts = _block_counts(ids, e, _pow2(e), bool(interpret))
  counts = counts[:, :e]                          # [blocks, E]; the empty-slot column dropped
  before = _blocks_before(counts)                 # per expert, slots in the blocks before
  sizes = jnp.sum(counts, axis=0)
  live = (ids >= 0) & (ids < e)
  key = jnp.where(live, ids, 0)
  pos = (jnp.cumsum(sizes) - sizes)[key] + before[jnp.arange(n) // BLOCK, key] + rank[:n]
  return jnp.where(live, pos, -1).reshape(t, k), sizes


def route(x: jax.Array, topk_ids: jax.Array, num_experts: int, m_alloc: int,
          block_ms: Sequence[int], *, one_kernel_blocks: int | None = None,
          interpret: Any = False):
  """Sort token slots by expert and gather their token rows.

  Args:
    x: [T, H] tokens (H a multiple of 64).
    topk_ids: [T, k] int expert ids; ids outside [0, num_experts) are empty slots.
    num_experts: E.
    m_alloc: rows of the gathered array (>= T * k, see grouped_gemm.row_alloc).
    block_ms: the row-tile heights whose tile work lists to build (GEMM1's, GEMM2's).
    one_kernel_blocks: up to this many blocks of BLOCK slots, kernel 2 ranks the slots itself
      and kernel 1 is not launched (None: ONE_KERNEL_BLOCKS, read at trace time).
  Returns:
    xs [m_alloc, H]: row p is the token of the slot at sorted position p; rows at and past the
      number of valid slots are unwritten.
    inv [T, k] int32: sorted position of each slot, -1 for an empty slot.
    group_sizes [E] int32.
    metas: one (meta [4, tasks], num_tasks [1]) per entry of block_ms, in the format of
      grouped_gemm.tile_metadata (tasks >= cdiv(m_alloc, block_m) + E - 1).
  """
  if one_kernel_blocks is None:
    one_kernel_blocks = ONE_KERNEL_BLOCKS
  return _route(x, topk_ids, num_experts, m_alloc, tuple(block_ms), one_kernel_blocks,
                interpret, training=False)


def route_for_training(x: jax.Array, topk_ids: jax.Array, num_experts: int, m_alloc: int,
                       block_ms: Sequence[int], *,
                       one_kernel_blocks: int = ONE_KERNEL_BLOCKS_TRAINING,
                       interpret: Any = False
                       ) -> tuple[jax.Array, jax.Array, jax.Array,
                                  list[tuple[jax.Array, jax.Array]], jax.Array]:
  """route() for the training path (moe.fused_experts_train's layout): every row is computed,
  and every expert's rows start on a multiple of 8.

  Expert e's rows are padded to asize[e] = round_up(count[e], 8): its slots (stable order)
  then zero rows. So the weight-gradient kernel's row blocks, which start on 8-row boundaries,
  start exactly at each expert (a 64-row expert is one 64-row block, not two). The rows past
  sum(asize) (the tail) are zero and belong to the last expert in the tile lists, so the GEMMs
  compute every row and need no row masks. ``order`` (the sort order that the gather-sum's
  backward reads) is -1 on padding and tail rows.

  Args: as route(); m_alloc >= T * k + 7 * min(E, T * k) (room for the padding).
  Returns:
    xs [m_alloc, H]: the rows above; every row finite.
    inv [T, k] int32: row of each slot, -1 for an empty slot.
    group_sizes [E] int32: asize (padded counts, without the tail): the experts' row ranges
      for the weight gradient.
    metas: one (meta [4, tasks], num_tasks [1]) per entry of block_ms: the first num_tasks
      columns equal grouped_gemm.tile_metadata(asize with the tail added to the last expert,
      m_alloc, block_m)'s (all m_alloc rows covered; tasks >= cdiv(m_alloc, block_m) + E - 1).
    order [m_alloc] int32: flat slot index (t * k + j) of the slot at each row, -1 on padding
      and tail rows.
  """
  return _route(x, topk_ids, num_experts, m_alloc, tuple(block_ms), one_kernel_blocks,
                interpret, training=True)


def _route(x, topk_ids, num_experts: int, m_alloc: int, block_ms: tuple, one_kernel_blocks: int,
           interpret: Any, training: bool):
  """The routing kernels of route() (training=False) and route_for_training() (True)."""
  t, k = topk_ids.shape
  n = t * k
  hdim = x.shape[1]
  e = num_experts
  if not supports(n, hdim, e):
    raise ValueError(f"route: {n} slots / H={hdim} / {e} experts not supported (<= "
                     f"{_MAX_SLOTS} slots, H a multiple of 64, <= {_MAX_EXPERTS} experts)")
  if m_alloc < n + (_PAD * min(e, n) if training else 0):
    raise ValueError(f"m_alloc={m_alloc} < T*k={n}" + (
        f" + {_PAD} padding rows per expert" if training else ""))
  interpret = bool(interpret)
  nb = -(-n // BLOCK)
  # per-expert count columns; the empty-slot key E is counted only when E < ep, and never read
  ep = _pow2(e)
  ids = topk_ids.reshape(n).astype(jnp.int32)
  # few blocks: kernel 2 ranks and counts the slots itself (one routing kernel)
  one_block = nb <= one_kernel_blocks
  if not one_block:
    rank, counts = _block_counts(ids, e, ep, interpret)
  nbp = _pow2(nb)
  # Inference in one kernel: a block program gets its slots' sorted positions from one compare
  # with every slot's key (no per-expert table) and takes one row step (_DIRECT_ROWS slots,
  # half that past 8 blocks), so its chain of reductions is short; only the tile-list programs
  # count the experts. (With every program counting every block and ranking 4 row steps, one
  # kernel took 2-3x the two-kernel form's time at 4 blocks: sixth round and r10a.)
  direct = one_block and not training
  # slots per row step of a block program
  step = (_DIRECT_ROWS if nb <= 8 else _DIRECT_ROWS // 2) if direct else _ROWS
  per_prog = step if direct else BLOCK  # slots per block program
  npb = -(-n // per_prog)                # block programs
  # tile-list programs: `tasks` tasks each, per block_m (grid rows npb + q of column 0)
  tasks = _DIRECT_TASKS if direct else _TASKS
  chunks = [-(-(-(-m_alloc // bm) + e - 1) // tasks) for bm in block_ms]
  first_chunk = [npb + sum(chunks[:i]) for i in range(len(chunks))]
  # the one-kernel form: wide column chunks (the largest power of two dividing H, at most
  # _DIRECT_MAX_HC), as every chunk ranks its slots again
  hc = min(hdim & -hdim, _DIRECT_MAX_HC) if direct else _col_chunk(hdim, npb, ep)
  n_hc = hdim // hc
  kn = min(max(_pow2(n), _ROWS), _DIRECT)  # keys per chunk of every slot's key (one kernel)

  grid_b = npb + sum(chunks)

  def body(*refs):
    n_in = 2 if one_block else 4
    n_out = 4 if training else 3
    ins, outs, meta_refs = refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]
    if one_block:
      ids_ref, x_ref = ins
    else:
      ids_ref, rank_ref, cnt_ref, x_ref = ins
    xs_ref, inv_ref, gs_ref = outs[:3]
    order_ref = outs[3] if training else None
    b = pl.program_id(0)
    c = pl.program_id(1)

    def expert_table():
      """(total [ep]: slots per expert, before [ep]: of them in blocks before b, offsets [ep]:
      each expert's first row, asize [ep]: padded sizes in training, else None)."""
      if one_block:
        # the block programs of the inference form rank their slots without the table
        total, before = _histogram_of_slots(ids_ref, n, e, ep,
                                            below=None if direct else b * BLOCK)
      else:
        blk = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
        cnt = cnt_ref[jnp.minimum(blk, nb - 1), :]                       # [nbp, ep]
        blk = lax.broadcasted_iota(jnp.int32, (nbp, ep), 0)
        cnt = jnp.where(blk < nb, cnt, 0)
        before = jnp.sum(jnp.where(blk < b, cnt, 0), axis=0)  # per expert, blocks before b
        total = jnp.sum(cnt, axis=0)
      if training:  # experts padded to multiples of _ALIGN rows
        asize = jnp.where(lax.broadcasted_iota(jnp.int32, (ep,), 0) < e,
                          (total + _PAD) // _ALIGN * _ALIGN, 0)
        return total, before, jnp.cumsum(asize) - asize, asize
      return total, before, jnp.cumsum(total) - total, None

    if not direct:
      total, before, offsets, asize = expert_table()

    @pl.when(b < npb)
    def _copy_block():
      cols = pl.ds(pl.multiple_of(c * hc, hc), hc)
      if direct:  # every slot's sort key in chunks of kn, all loads issued first
        theirs = [_sort_keys(_load_keys(ids_ref, q0, kn, n, e),
                             q0 + lax.broadcasted_iota(jnp.int32, (kn,), 0), n)
                  for q0 in range(0, n, kn)]
      else:
        base = offsets + before
        experts = lax.broadcasted_iota(jnp.int32, (_ROWS, ep), 1)
        block = _load_keys(ids_ref, jnp.minimum(b, nb - 1) * BLOCK, BLOCK, n, e)

      def copy(r, carry):
        r0 = pl.multiple_of(b * per_prog + r * step, step)
        key = _load_keys(ids_ref, r0, step, n, e)
        slot = r0 + lax.broadcasted_iota(jnp.int32, (step,), 0)
        live = key < e
        tok = jnp.where(live, slot // k, 0)
        rows = x_ref[tok, cols]  # issued before the position's reductions, which it overlaps
        if direct:
          pos = sum(_sorted_before(_sort_keys(key, slot, n), t_) for t_ in theirs)
        else:
          pos = jnp.sum(jnp.where(key[:, None] == experts, base[None, :], 0), axis=1)
          pos = pos + (_ranks(key, block, r * _ROWS) if one_block
                       else rank_ref[pl.ds(r0, _ROWS)])
        # a dead slot's masked store aims at the last row (and stores nothing)
        dst = jnp.where(live, pos, m_alloc - 1)
        _store(xs_ref, (dst, cols), rows, live[:, None], interpret)

        @pl.when(c == 0)
        def _():
          inv_ref[pl.ds(r0, step)] = jnp.where(live, pos, -1)
          if training:
            _store(order_ref, (dst,), slot, live, interpret)
        return carry

      lax.fori_loop(0, per_prog // step, copy, 0)

    if training:
      # every program (tile-list ones too) zeroes a share of the experts' padding rows
      _zero_padding(xs_ref, order_ref, offsets + total, asize - total, b, grid_b, e, ep,
                    m_alloc, hc, c, interpret)
      # the tail rows [sum(asize), m_alloc) go to the last expert in the tile lists
      n_rows = jnp.sum(asize)
      tail = m_alloc - n_rows
      tail_sizes = asize + jnp.where(lax.broadcasted_iota(jnp.int32, (ep,), 0) == e - 1, tail, 0)
      _zero_tail(xs_ref, order_ref, n_rows, tail, grid_b - 1 - b, grid_b, m_alloc, hc, c,
                 interpret)

    @pl.when((b >= npb) & (c == 0))
    def _tile_lists():
      # the one-kernel form counts the experts here, once per tile-list program
      cnt, _, first, _ = expert_table() if direct else (total, None, offsets, None)
      sizes = (tail_sizes if training
               else jnp.where(lax.broadcasted_iota(jnp.int32, (ep,), 0) < e, cnt, 0))
      for bm, q0, nq, m_ref, nt_ref in zip(block_ms, first_chunk, chunks, meta_refs[0::2],
                                           meta_refs[1::2]):
        @pl.when((b >= q0) & (b < q0 + nq))
        def _tiles(bm=bm, q0=q0, m_ref=m_ref, nt_ref=nt_ref):
          t0 = pl.multiple_of((b - q0) * tasks, tasks)
          rows, num_tasks = gg.tile_rows(first, first + sizes, bm,
                                         t0 + lax.broadcasted_iota(jnp.int32, (tasks,), 0))
          for i, v in enumerate(rows):
            m_ref[i, pl.ds(t0, tasks)] = v

          @pl.when(b == q0)
          def _():
            nt_ref[...] = jnp.broadcast_to(num_tasks, (1,))

      @pl.when(b == npb)
      def _sizes():
        gs_ref[...] = asize if training else cnt

  out = lambda shape, dtype=jnp.int32: _compat.out_struct(shape, dtype, ids)
  out_shape = [out((m_alloc, hdim), x.dtype), out((nb * BLOCK,)), out((ep,))]
  if training:
    out_shape.append(out((m_alloc,)))
  for nq in chunks:
    out_shape += [out((4, nq * tasks)), out((1,))]
  whole = lambda shape: pl.BlockSpec(shape, lambda b, c: (0,) * len(shape))
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  call = pl.pallas_call(
      body,
      out_shape=tuple(out_shape),
      grid=(grid_b, n_hc),
      in_specs=[any_spec] * (2 if one_block else 4),
      out_specs=tuple([any_spec, any_spec, whole((ep,))]
                      + ([any_spec] if training else [])
                      + [s for _ in chunks for s in (any_spec, whole((1,)))]),
      compiler_params=_compiler_params(4),
      interpret=interpret,
      name="jmoe_route_scatter_rows",
  )
  outs = call(*((ids, x) if one_block else (ids, rank, counts, x)))
  xs, inv, gs = outs[:3]
  m0 = 4 if training else 3
  metas = [(outs[m0 + 2 * i], outs[m0 + 1 + 2 * i]) for i in range(len(chunks))]
  if training:
    return xs, inv[:n].reshape(t, k), gs[:e], metas, outs[3]
  return xs, inv[:n].reshape(t, k), gs[:e], metas


def _zero_padding(xs_ref, order_ref, pad_start, pad_rows, b, nprog: int, e: int, ep: int,
                  m_alloc: int, hc: int, c, interpret):
  """Training mode: zeros in each expert's padding rows [pad_start[g], + pad_rows[g]) (< _ALIGN
  rows) of xs (column chunk c) and, at chunk 0, -1 in order. Grid row b of nprog takes experts
  [b * epb, (b + 1) * epb) in groups of _ROWS // _ALIGN or fewer: per group one masked
  [group * _ALIGN, hc] store and a [_ROWS, ep] one-hot pick at most, as the row steps (seven
  smaller stores per group cost qwen3's 1024-token routing 3 µs on an H200). Every grid row
  takes a share: with one block program taking all of qwen3's 128 experts, routing 8 tokens
  for training took 35 µs (r14h)."""
  epb = _pow2(-(-ep // nprog))
  grp = min(epb, _ROWS // _ALIGN)
  i = lax.broadcasted_iota(jnp.int32, (grp * _ALIGN,), 0)
  experts = lax.broadcasted_iota(jnp.int32, (grp * _ALIGN, ep), 1)

  def group(q, carry):
    g = b * epb + q * grp + i // _ALIGN
    j = i % _ALIGN
    pick = g[:, None] == experts
    start = jnp.sum(jnp.where(pick, pad_start[None, :], 0), axis=1)
    count = jnp.sum(jnp.where(pick, pad_rows[None, :], 0), axis=1)
    ok = (g < e) & (j < count)
    _clear_rows(xs_ref, order_ref, jnp.where(ok, start + j, m_alloc - 1), ok, hc, c, interpret)
    return carry

  # groups holding an expert below e (none in the grid rows past them)
  lax.fori_loop(0, jnp.clip(e - b * epb + grp - 1, 0, epb) // grp, group, 0)


def _zero_tail(xs_ref, order_ref, row0, tail, j, stride: int, m_alloc: int, hc: int, c,
               interpret):
  """Training mode: zeros in rows [row0, row0 + tail = m_alloc) of xs (this program's
  column chunk c, hc columns) and, at column chunk 0, -1 in order. The tail is cut into stripes
  of _ROWS rows; grid row j of `stride` (counted from the last grid row, so that the
  tile-list programs, which copy no rows, take the usual short tail) writes stripes j,
  j + stride, ...: a dynamic loop of cdiv(tail - j * _ROWS, stride * _ROWS) steps, none in
  all but cdiv(tail, _ROWS) grid rows. A stripe's rows past m_alloc are masked (aimed at the
  last row)."""
  step = stride * _ROWS
  n_steps = jnp.maximum(tail - j * _ROWS + step - 1, 0) // step

  def fill(i, carry):
    r = row0 + (j + i * stride) * _ROWS + lax.broadcasted_iota(jnp.int32, (_ROWS,), 0)
    ok = r < m_alloc
    _clear_rows(xs_ref, order_ref, jnp.minimum(r, m_alloc - 1), ok, hc, c, interpret)
    return carry

  lax.fori_loop(0, n_steps, fill, 0)


def _clear_rows(xs_ref, order_ref, dst, ok, hc: int, c, interpret):
  """Rows dst where ok: zeros in xs (column chunk c) and, at chunk 0, -1 in order."""
  cols = pl.ds(pl.multiple_of(c * hc, hc), hc)
  _store(xs_ref, (dst, cols), jnp.zeros((dst.shape[0], hc), xs_ref.dtype), ok[:, None],
         interpret)

  @pl.when(c == 0)
  def _():
    _store(order_ref, (dst,), jnp.full(dst.shape, -1, jnp.int32), ok, interpret)


def _store(ref, idx, val, mask, interpret):
  """Masked (scatter) store: Triton's masked store on the GPU; in interpret mode, where
  pl.store's mask has no discharge rule for array indices, a read-modify-write in which the
  rows (idx[0] entries) with nothing to store go to an out-of-bounds index, which the
  interpreter's scatter drops: written back in place, a masked row aimed at a stored row's
  index (a dead slot at the last row when every row is live) would race with its store."""
  if mask is None:
    ref[idx] = val
  elif interpret:
    any_row = jnp.any(mask.reshape(mask.shape[0], -1), axis=1)
    rows = jnp.where(any_row, idx[0], ref.shape[0])
    ref[(rows, *idx[1:])] = jnp.where(mask, val, ref[idx])
  else:
    from jax.experimental.pallas import triton as pltriton
    pltriton.store(ref.at[idx], val, mask=mask)


def _col_chunk(hdim: int, nb: int, ep: int) -> int:
  """Columns per program: a power of two dividing hdim, at most _MAX_HC (ep <= 128 count
  columns) or 512 (a [32, 512] row step in registers); halved until there is a program per SM
  (every program also sums the count table, so more, narrower programs cost more), at least
  64."""
  hc = 64
  while hc < (_MAX_HC if ep <= 128 else 512) and hdim % (2 * hc) == 0:
    hc *= 2
  while hc > 64 and nb * (hdim // hc) < 132:
    hc //= 2
  return hc
