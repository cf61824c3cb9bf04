"""Token permutation for the contiguous MoE path (the ``moe_align`` analogue) and the unpermute
gather-sum, in jnp (XLA fuses them into a few small kernels; no host sync).

    sort_order, group_sizes, inv = moe_align(topk_ids, num_experts)
    x_sorted  = x[sort_order // k]                      # permute_rows(x, sort_order, k)
    y         = experts(x_sorted, group_sizes)          # rows >= sum(group_sizes) unused
    out[t]    = sum_j y[inv[t, j]]  (inv < 0 skipped)   # gather_sum(y, inv)

Past 8192 slots (where jmoe.kernels.route stops) the rows are copied by Mosaic GPU kernels:
``scatter_rows`` in token order (each token row loaded once, stored to its k rows; the
default) or ``gather_rows`` in sorted order.

Slots whose expert id is negative (``-1``: empty, e.g. an EP-remote expert or padding) or
``>= num_experts`` are excluded: they sort to the end (after every real slot), are not counted in
``group_sizes`` and get ``inv = -1``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# Up to this many slots the sort is a pairwise rank (one fused O(n^2) compare kernel, fast for
# decode); above it a sort of one int32 key (moe_align's method="auto").
_RANK_MAX_SLOTS = 2048


def inverse_permutation(order: jax.Array) -> jax.Array:
  """inv[order[i]] = i for a permutation `order` [n]: one O(n) scatter, not a second sort."""
  n = order.shape[0]
  return jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32),
                                                  unique_indices=True)


def touched_experts(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """ids (any shape; outside [0, E): skipped) -> (idx [ids.size + 1] int32: the distinct
  touched experts ascending, then fillers, every entry in [0, E); ids renumbered into idx,
  skipped ones -> ids.size + 1). For gathering only the experts a call uses."""
  u = ids.size + 1  # every distinct id, the sentinel among them
  ids = ids.astype(jnp.int32)
  skip = (ids < 0) | (ids >= num_experts)
  key = jnp.where(skip, num_experts, ids)
  touched = jnp.unique(key.reshape(-1), size=u, fill_value=num_experts)  # ascending
  renumbered = jnp.where(skip, u, jnp.searchsorted(touched, key).astype(jnp.int32))
  return jnp.minimum(touched, num_experts - 1), renumbered


@functools.partial(jax.jit, static_argnames=("num_experts", "method"))
def moe_align(topk_ids: jax.Array, num_experts: int, method: str = "auto"):
  """Sort token slots by expert.

  Args:
    topk_ids: [T, k] integer expert ids; entries < 0 or >= num_experts are empty slots.
    num_experts: E.
    method: "auto" (rank for <= 2048 slots, else count; sort when n * (E + 1) > 2**28),
      "rank" (pairwise O(n^2) rank: one fused compare-reduce, 4.8 µs device time at T=1 on
      an H200), "count" (a counting sort in
      blocks of 256 slots: in-block pairwise ranks + per-block expert counts, no sort kernel),
      "argsort" (stable argsort of (key, slot) pairs), "sort" (one int32 key expert*n+slot
      sorted alone). Whole moe_align on an H200 (jax 0.11.2, device µs), sort / count: 8192
      slots (E=128) 48.2 / 14.5; 32768 slots 43.0 / 21.0; 131072 slots 68.5 / 67.8 (E=128),
      79.9 / 76.6 (E=256). argsort: 8192 slots 49.3, 131072 (E=256) 78.3.
  Returns:
    sort_order: [T*k] int32, flat slot indices (t*k + j) in expert order (stable: within an expert,
      by slot index); empty slots last.
    group_sizes: [E] int32 slots per expert.
    inv: [T, k] int32, position of slot (t, j) in sort_order, or -1 for an empty slot.
  """
  if topk_ids.ndim != 2:
    raise ValueError(f"topk_ids must be [T, k], got shape {topk_ids.shape}")
  if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
    raise ValueError(f"topk_ids must be integer, got {topk_ids.dtype}")
  t, k = topk_ids.shape
  n = t * k
  ids = topk_ids.reshape(n).astype(jnp.int32)
  valid = (ids >= 0) & (ids < num_experts)
  key = jnp.where(valid, ids, num_experts)
  if method not in ("auto", "rank", "count", "sort", "argsort"):
    raise ValueError(f"method={method!r}")
  if method == "auto":
    method = ("rank" if n <= _RANK_MAX_SLOTS else
              "count" if n * (num_experts + 1) <= _COUNT_MAX_WORK else "sort")
  if method == "sort" and (num_experts + 1) * n >= 2 ** 31:
    method = "argsort"
  if method == "rank":
    idx = jnp.arange(n, dtype=jnp.int32)
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None])
                                               & (idx[None, :] < idx[:, None]))
    pos = jnp.sum(before, axis=1, dtype=jnp.int32)
    sort_order = jnp.zeros((n,), jnp.int32).at[pos].set(idx, unique_indices=True)
    group_sizes = jnp.sum(key[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :],
                          axis=0, dtype=jnp.int32)
  elif method == "count":
    sort_order, group_sizes, pos = _counting_sort(key, num_experts)
  elif method == "sort":
    # One int32 key (expert * n + slot) sorted alone: unique, so stability is free, and XLA can
    # use a single-operand (radix) sort instead of a key/value comparison sort.
    idx = jnp.arange(n, dtype=jnp.int32)
    sort_order = lax.rem(jnp.sort(key * n + idx), n).astype(jnp.int32)
    pos = inverse_permutation(sort_order)
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
  else:
    sort_order = jnp.argsort(key, stable=True).astype(jnp.int32)
    pos = inverse_permutation(sort_order)
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
  inv = jnp.where(valid, pos, -1).reshape(t, k)
  return sort_order, group_sizes, inv


_COUNT_BLOCK = 256
_COUNT_MAX_WORK = 1 << 28  # slots x (experts + 1): the count method's [blocks, 256, E + 1] reduce


def _counting_sort(key: jax.Array, num_experts: int):
  """Stable counting sort of small int keys in [0, num_experts] (num_experts = empty slot).

  Slots are cut into blocks of 256: a slot's position is offset[key] (experts before it) +
  block_offset[block, key] (same-key slots in earlier blocks) + its rank among same-key slots
  of its own block (a [blocks, 256, 256] compare-reduce). Every step is an elementwise or
  reduce fusion of O(n * (256 + E)) work; nothing is sorted. Returns (order, group_sizes, pos).
  """
  n = key.shape[0]
  b = _COUNT_BLOCK
  nb = -(-n // b)
  kp = jnp.pad(key, (0, nb * b - n), constant_values=num_experts).reshape(nb, b)
  j = jnp.arange(b, dtype=jnp.int32)
  same = kp[:, None, :] == kp[:, :, None]                       # [nb, i, j]
  within = jnp.sum(same & (j[None, None, :] < j[None, :, None]), axis=2, dtype=jnp.int32)
  experts = jnp.arange(num_experts + 1, dtype=jnp.int32)
  blk_counts = jnp.sum(kp[:, :, None] == experts[None, None, :], axis=1, dtype=jnp.int32)
  blk_offsets = jnp.cumsum(blk_counts, axis=0) - blk_counts     # [nb, E + 1], exclusive
  counts = jnp.sum(blk_counts, axis=0)
  offsets = jnp.cumsum(counts) - counts
  pos = (offsets[kp] + jnp.take_along_axis(blk_offsets, kp, axis=1) + within).reshape(-1)
  # padding slots carry the largest key and the largest indices: they land past position n
  order = jnp.zeros((nb * b,), jnp.int32).at[pos].set(jnp.arange(nb * b, dtype=jnp.int32),
                                                     unique_indices=True)
  return order[:n], counts[:num_experts].astype(jnp.int32), pos[:n]


def permute_rows(x: jax.Array, sort_order: jax.Array, k: int, *, impl: str = "xla",
                 interpret=False, num_rows: jax.Array | None = None) -> jax.Array:
  """x [T, H] -> [len(sort_order), H]: row i is the token of slot sort_order[i].

  impl: "xla" (jnp.take) or "pallas" (gather_rows, a TMA row-copy kernel, which leaves rows
  past num_rows unwritten when it is given)."""
  if impl == "pallas":
    return gather_rows(x, sort_order // k, num_rows, interpret=interpret)
  if impl != "xla":
    raise ValueError(f"impl={impl!r} must be 'xla' or 'pallas'")
  return jnp.take(x, sort_order // k, axis=0, mode="clip")


def permute_weights(topk_weights: jax.Array, sort_order: jax.Array) -> jax.Array:
  """topk_weights [T, k] -> [T*k] f32 in sorted-slot order (GEMM2's row_scale)."""
  return jnp.take(topk_weights.reshape(-1).astype(jnp.float32), sort_order, mode="clip")


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def gather_sum(y: jax.Array, inv: jax.Array, weights: jax.Array | None = None, *,
               out_dtype=None, residual: jax.Array | None = None) -> jax.Array:
  """out[t] = sum_j w[t, j] * y[inv[t, j]] over slots with inv >= 0, accumulated in f32. No
  atomics; one fused gather-reduce: one row gather per j, summed in order. (A [T, k, H] gather
  summed over axis 1 became two XLA fusions at deepseek-v3 / 256 tokens on an H200 and was
  0.7-1.2 µs slower: benchmarks/check_gather_sum.py, thirteenth round.)

  y [M, H] (rows in sorted-slot order), inv [T, k] from moe_align, weights [T, k] (the router
  weights; None: 1). Returns [T, H] in out_dtype (default y.dtype). Rows of y that no valid slot
  points at (e.g. past sum(group_sizes)) are never read, so they may hold anything (the grouped
  GEMM leaves them unwritten).

  residual [T, H] (seed 003, the residual stream): the sum starts from it, out = residual +
  the sum, in one fusion whose only [T, H] operand read elementwise is residual, so XLA can
  write out in residual's buffer (when residual is dead afterwards or donated).
  """
  if y.ndim != 2 or inv.ndim != 2:
    raise ValueError(f"y must be [M, H] and inv [T, k]; got {y.shape}, {inv.shape}")
  if weights is not None and weights.shape != inv.shape:
    raise ValueError(f"weights must have inv's shape {inv.shape}, got {weights.shape}")
  if residual is not None and residual.shape != (inv.shape[0], y.shape[1]):
    raise ValueError(f"residual must be [T, H] = {(inv.shape[0], y.shape[1])}, got "
                     f"{residual.shape}")
  acc = (jnp.zeros((inv.shape[0], y.shape[1]), jnp.float32) if residual is None
         else residual.astype(jnp.float32))
  for j in range(inv.shape[1]):
    row = jnp.take(y, jnp.maximum(inv[:, j], 0), axis=0, mode="clip").astype(jnp.float32)
    if weights is not None:
      row = row * weights[:, j, None].astype(jnp.float32)
    acc = acc + jnp.where((inv[:, j] >= 0)[:, None], row, 0.0)
  return acc.astype(out_dtype or y.dtype)


# ----------------------------------------------------------------------------- differentiable
# The permutation is known in both directions (sort_order and inv), so the gather-sum's VJP is a
# gather, never the scatter-add JAX derives for a gather (149 µs of mixtral's fwd+bwd at 1024
# tokens on an H200). The row gather's own VJP is moe.routed_rows'.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def gather_sum_diff(y: jax.Array, weights: jax.Array | None, inv: jax.Array,
                    sort_order: jax.Array, k: int, out_dtype, impl: str = "xla",
                    interpret=False) -> jax.Array:
  """gather_sum(y, inv, weights, out_dtype=out_dtype), differentiable in y and weights.

  VJP: d y = the row gather w[s] * d[s // k] for the row of each valid slot s (sort_order gives
  the slot of each row), zero on the other rows, computed in f32 and written once in y's dtype
  (so a bf16 GEMM output gets a bf16 cotangent with no f32 [M, H] copy in between); d weights
  [t, j] = <d[t], y[inv[t, j]]> (zero for empty slots). weights None: unweighted (d y is then
  permute_rows(d), impl "xla" or "pallas"). sort_order: the valid slot of each row of y (one
  entry per row), -1 on rows that hold none (padding, tail, empty slots): those get zero
  cotangents.
  """
  return _gather_sum_fwd(y, weights, inv, sort_order, k, out_dtype, impl, interpret)[0]


def _gather_sum_fwd(y, weights, inv, sort_order, k, out_dtype, impl, interpret):
  if sort_order.shape[0] != y.shape[0]:
    raise ValueError(f"sort_order has {sort_order.shape[0]} entries for y's {y.shape[0]} rows")
  out = gather_sum(y, inv, weights, out_dtype=out_dtype)
  # y is kept only for d weights; unweighted, a scalar carries its dtype
  return out, (y if weights is not None else jnp.zeros((), y.dtype), weights, inv, sort_order)


def _gather_sum_bwd(k, out_dtype, impl, interpret, res, d):
  y, weights, inv, order = res
  row_ok = (order >= 0)[:, None]
  order = jnp.maximum(order, 0)
  if weights is None:
    dy = permute_rows(d, order, k, impl=impl, interpret=interpret).astype(y.dtype)
    return jnp.where(row_ok, dy, jnp.zeros((), y.dtype)), None, None, None
  # both from the token row each row of y gathers, row by row (one fusion: y read once)
  w_rows = permute_weights(weights, order)
  gd = jnp.take(d, order // k, axis=0, mode="clip").astype(jnp.float32)       # [M, H]
  dy = jnp.where(row_ok, gd * w_rows[:, None], 0.0).astype(y.dtype)
  dw_rows = jnp.sum(gd * y.astype(jnp.float32), axis=1)                     # <d[t], y[p]>
  dw = jnp.take(dw_rows, jnp.maximum(inv, 0), mode="clip")
  dw = jnp.where(inv >= 0, dw, 0.0).astype(weights.dtype)
  return dy, dw, None, None


gather_sum_diff.defvjp(_gather_sum_fwd, _gather_sum_bwd)


def moe_align_training(topk_ids: jax.Array, num_experts: int, m_alloc: int, align: int = 8, *,
                       with_padding_rows: bool = False):
  """The training layout of jmoe.kernels.route.route_for_training, in jnp: moe_align with
  every expert's rows padded to a multiple of `align` (its slots, then empty rows) and the rows
  past them (the tail) empty.

  Returns (order [m_alloc]: slot of each row, -1 on padding and tail rows; inv [T, k]: row of
  each slot, -1 when empty; asize [E]: padded counts), and with with_padding_rows the padding
  rows [E * (align - 1)] (expert g's j-th padding row at g * (align - 1) + j, -1 past its
  padding): the rows besides the tail that no slot fills.
  """
  t, k = topk_ids.shape
  n = t * k
  _, gs, inv = moe_align(topk_ids, num_experts)
  asize = (gs + align - 1) // align * align
  off = jnp.cumsum(gs) - gs
  off_al = jnp.cumsum(asize) - asize
  flat = inv.reshape(-1)
  e_s = jnp.clip(topk_ids.reshape(-1).astype(jnp.int32), 0, num_experts - 1)
  pos = jnp.where(flat >= 0, flat - off[e_s] + off_al[e_s], -1)
  order = jnp.full((m_alloc,), -1, jnp.int32).at[jnp.where(pos >= 0, pos, m_alloc)].set(
      jnp.arange(n, dtype=jnp.int32), mode="drop")
  out = order, pos.reshape(t, k).astype(jnp.int32), asize.astype(jnp.int32)
  if not with_padding_rows:
    return out
  j = jnp.arange(align - 1, dtype=jnp.int32)[None, :]
  pad = jnp.where(j < (asize - gs)[:, None], (off_al + gs)[:, None] + j, -1)
  return out + (pad.reshape(-1).astype(jnp.int32),)


def moe_align_reference(topk_ids, num_experts):
  """NumPy reference of moe_align (for tests)."""
  import numpy as np
  ids = np.asarray(topk_ids).reshape(-1).astype(np.int64)
  valid = (ids >= 0) & (ids < num_experts)
  key = np.where(valid, ids, num_experts)
  order = np.argsort(key, kind="stable").astype(np.int32)
  pos = np.empty_like(order)
  pos[order] = np.arange(order.size, dtype=np.int32)
  gs = np.bincount(key[valid], minlength=num_experts).astype(np.int32)
  inv = np.where(valid, pos, -1).reshape(np.asarray(topk_ids).shape).astype(np.int32)
  return order, gs, inv


# ----------------------------------------------------------------------------- Pallas row gather


def _row_chunk(h: int) -> int:
  for c in (256, 128, 64, 32, 16, 8):
    if h % c == 0 and h // c <= 256:
      return c
  raise ValueError(f"H={h}: no TMA box chunk (need H = c * j with c in 8..256 and j <= 256)")


def gather_rows_supports(h: int) -> bool:
  """Whether gather_rows can copy rows of width h (a TMA box chunking exists)."""
  try:
    _row_chunk(h)
  except ValueError:
    return False
  return True


def _rows_per_step(count: int, h: int, dtype, requested: int | None) -> int:
  """Rows per step of a row-copy kernel: `requested`, else about 32 KB (at most 16 rows),
  lowered until it divides `count`."""
  r = requested or max(1, min(16, 32768 // (h * jnp.dtype(dtype).itemsize)))
  while count % r:
    r -= 1
  return r


def _copy_pipeline(my_steps, ns: int, bars, issue, store) -> None:
  """The row-copy kernels' software pipeline over a program's steps. Step i uses SMEM slot
  i % ns. Its loads (issue(i, slot), arriving on bars[slot]) start ns - 2 steps ahead of the
  step being stored (store(i, slot): one group of TMA stores). Before a slot is loaded again,
  the stores from it two steps back must have read it, so only the last step's group may
  still be pending."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  ahead = ns - 2
  for i0 in range(ahead):
    @pl.when(i0 < my_steps)
    def _():
      issue(jnp.int32(i0), jnp.int32(i0))

  def step(i, carry):
    slot = lax.rem(i, jnp.int32(ns))

    @pl.when(i + ahead < my_steps)
    def _():
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      issue(i + ahead, lax.rem(i + ahead, jnp.int32(ns)))

    plgpu.barrier_wait(bars.at[slot])
    store(i, slot)
    return carry

  lax.fori_loop(jnp.int32(0), my_steps, step, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("m_out", "tokens_per_step", "num_stages",
                                             "interpret"))
def scatter_rows(x: jax.Array, inv: jax.Array, m_out: int, num_rows: jax.Array | None = None,
                 *, zero_rows: jax.Array | None = None, zero_from: jax.Array | None = None,
                 tokens_per_step: int | None = None, num_stages: int = 4,
                 interpret=False) -> jax.Array:
  """out[inv[t, j]] = x[t]: gather_rows' result (sorted rows) in token order, as a Mosaic GPU
  kernel. Each token row is loaded once (one TMA load per step of consecutive tokens) and
  stored to its k rows; gather_rows loads it k times, from HBM when x outgrows L2 (H200, qwen3
  at 16384 tokens: 240 µs, 1.7x the bytes' floor).

  x [T, H] (H a multiple of 8), inv [T, k] int: each slot's row, -1 for a slot with none.
  Rows [0, num_rows) (an int scalar on device; default m_out) get their slots; a slot aimed at
  or past num_rows stores nothing, and rows no slot aims at are left unwritten, except:
  zero_rows [Z] int (rows to zero; -1 entries zero nothing) and zero_from (an int scalar on
  device: rows [zero_from, m_out) zeroed), the training layout's padding and tail (one row
  store each, spread over the programs). Returns [m_out, H]. tokens_per_step defaults to ~32
  KB per step (and divides T); num_stages >= 3 SMEM slots: one being stored, one whose stores
  may still read it, the rest loading.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jmoe.kernels import _compat
  if num_stages < 3:
    raise ValueError(f"num_stages={num_stages} must be >= 3")
  t, h = x.shape
  if inv.ndim != 2 or inv.shape[0] != t:
    raise ValueError(f"inv must be [T={t}, k], got shape {inv.shape}")
  k = inv.shape[1]
  r = _rows_per_step(t, h, x.dtype, tokens_per_step)
  c = _row_chunk(h)
  x3 = x.reshape(t, h // c, c)
  dst = inv.reshape(t * k).astype(jnp.int32)
  need = jnp.full((1,), m_out, jnp.int32) if num_rows is None else jnp.clip(
      jnp.asarray(num_rows, jnp.int32).reshape(1), 0, m_out)
  zeroing = zero_rows is not None or zero_from is not None
  zrows = (jnp.full((1,), -1, jnp.int32) if zero_rows is None
           else zero_rows.reshape(-1).astype(jnp.int32))
  zfrom = jnp.full((1,), m_out, jnp.int32) if zero_from is None else jnp.clip(
      jnp.asarray(zero_from, jnp.int32).reshape(1), 0, m_out)
  ns = num_stages
  steps = t // r
  interp, nsm = _compat.launch_params(interpret)

  def body(dst_ref, need_ref, x_ref, *rest):
    if zeroing:
      zrows_ref, zfrom_ref, zero_ref, o_ref, buf, bars, zbuf, zbar = rest
      plgpu.copy_gmem_to_smem(zero_ref, zbuf, zbar.at[0])  # one zero row, for the zeroing
    else:
      o_ref, buf, bars = rest
    sm = lax.axis_index("sm")
    my_steps = lax.div(jnp.int32(steps) - sm + jnp.int32(nsm - 1), jnp.int32(nsm))
    bound = need_ref[0]

    def issue(i, slot):  # my i-th step's tokens
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds((sm + i * nsm) * r, r)], buf.at[slot],
                              bars.at[slot])

    def store(i, slot):  # each token's row to its slots' rows: one group of stores
      s0 = (sm + i * nsm) * (r * k)
      for j in range(r):
        for q in range(k):
          d = dst_ref[s0 + j * k + q]

          @pl.when((d >= 0) & (d < bound))  # (the interpreter has no TMA store predicate)
          def _(j=j, d=d):
            plgpu.copy_smem_to_gmem(buf.at[slot, pl.ds(j, 1)], o_ref.at[pl.ds(d, 1)],
                                    commit_group=False)
      plgpu.commit_smem_to_gmem_group()

    _copy_pipeline(my_steps, ns, bars, issue, store)
    if zeroing:
      plgpu.barrier_wait(zbar.at[0])

      def zero_listed(i, carry):  # zero_rows entries sm, sm + nsm, ...
        d = zrows_ref[sm + i * nsm]

        @pl.when(d >= 0)
        def _():
          plgpu.copy_smem_to_gmem(zbuf, o_ref.at[pl.ds(d, 1)])
        return carry

      lax.fori_loop(jnp.int32(0), lax.div(jnp.int32(zrows.shape[0]) - sm + jnp.int32(nsm - 1),
                                          jnp.int32(nsm)), zero_listed, jnp.int32(0))
      first = zfrom_ref[0] + sm  # rows zero_from + sm, + nsm, ... of the tail

      def zero_tail(i, carry):
        plgpu.copy_smem_to_gmem(zbuf, o_ref.at[pl.ds(first + i * nsm, 1)])
        return carry

      lax.fori_loop(jnp.int32(0), lax.div(jnp.maximum(jnp.int32(m_out) - first, 0)
                                          + jnp.int32(nsm - 1), jnp.int32(nsm)),
                    zero_tail, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [plgpu.SMEM((ns, r, h // c, c), x.dtype),
             plgpu.Barrier(num_arrivals=1, num_barriers=ns)]
  args = (dst, need, x3)
  if zeroing:
    scratch += [plgpu.SMEM((1, h // c, c), x.dtype),
                plgpu.Barrier(num_arrivals=1, num_barriers=1)]
    args += (zrows, zfrom, jnp.zeros((1, h // c, c), x.dtype))
  kern = _compat.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m_out, h // c, c), x.dtype),
      scratch_types=scratch,
      grid=(nsm,),
      grid_names=("sm",),
      compiler_params=_compat.compiler_params(),
      interpret=interp,
      name="jmoe_scatter_rows",
  )
  return kern(*args).reshape(m_out, h)


@functools.partial(jax.jit, static_argnames=("rows_per_step", "num_stages", "interpret"))
def gather_rows(x: jax.Array, idx: jax.Array, num_rows: jax.Array | None = None, *,
                rows_per_step: int | None = None, num_stages: int = 4,
                interpret=False) -> jax.Array:
  """out[i] = x[idx[i]] as a Mosaic GPU kernel (TMA row copies, persistent grid; the loads of the
  next num_stages - 2 steps are in flight while the current step is stored).

  x [T, H] (H a multiple of 8), idx [M] int (clipped to [0, T)). num_rows (an int scalar, on
  device): only rows [0, num_rows) are needed; steps past them are skipped and their rows left
  unwritten (in an EP receive buffer, half of the [rows x k] slots can be empty, sorted last).
  rows_per_step defaults to ~32 KB per step (and divides M). num_stages >= 3 SMEM slots: one
  being stored, one whose store may still be reading it, the rest loading.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jmoe.kernels import _compat
  if num_stages < 3:
    raise ValueError(f"num_stages={num_stages} must be >= 3")
  t, h = x.shape
  m = idx.shape[0]
  r = _rows_per_step(m, h, x.dtype, rows_per_step)
  c = _row_chunk(h)
  x3 = x.reshape(t, h // c, c)
  idx = jnp.clip(idx.astype(jnp.int32), 0, t - 1)
  need = jnp.full((1,), m, jnp.int32) if num_rows is None else jnp.clip(
      jnp.asarray(num_rows, jnp.int32).reshape(1), 0, m)
  ns = num_stages
  interp, nsm = _compat.launch_params(interpret)

  def body(idx_ref, need_ref, x_ref, o_ref, buf, bars):
    sm = lax.axis_index("sm")
    live = lax.div(need_ref[0] + jnp.int32(r - 1), jnp.int32(r))  # steps holding needed rows
    my_steps = lax.div(live - sm + jnp.int32(nsm - 1), jnp.int32(nsm))

    def issue(i, slot):  # my i-th step's rows, one load each
      for j in range(r):
        tok = idx_ref[(sm + i * nsm) * r + j]
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tok, 1)], buf.at[slot, pl.ds(j, 1)],
                                bars.at[slot])

    def store(i, slot):
      plgpu.copy_smem_to_gmem(buf.at[slot], o_ref.at[pl.ds((sm + i * nsm) * r, r)])

    _copy_pipeline(my_steps, ns, bars, issue, store)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  kern = _compat.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, h // c, c), x.dtype),
      scratch_types=[plgpu.SMEM((ns, r, h // c, c), x.dtype),
                     plgpu.Barrier(num_arrivals=r, num_barriers=ns)],
      grid=(nsm,),
      grid_names=("sm",),
      compiler_params=_compat.compiler_params(),
      interpret=interp,
      name="jmoe_gather_rows",
  )
  return kern(idx, need, x3).reshape(m, h)
