"""Token permutation for the contiguous MoE path (the ``moe_align`` analogue) and the unpermute
gather-sum, in jnp (XLA fuses them into a few small kernels; no host sync).

    sort_order, group_sizes, inv = moe_align(topk_ids, num_experts)
    x_sorted  = x[sort_order // k]                      # permute_rows(x, sort_order, k)
    y         = experts(x_sorted, group_sizes)          # rows >= sum(group_sizes) unused
    out[t]    = sum_j y[inv[t, j]]  (inv < 0 skipped)   # gather_sum(y, inv)

Slots whose expert id is negative (``-1``: empty, e.g. an EP-remote expert or padding) or
``>= num_experts`` are excluded: they sort to the end (after every real slot), are not counted in
``group_sizes`` and get ``inv = -1``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Up to this many slots the sort is a pairwise rank (one fused O(n^2) compare kernel, fast for
# decode); above it a stable argsort.
_RANK_MAX_SLOTS = 2048


@functools.partial(jax.jit, static_argnames=("num_experts",))
def moe_align(topk_ids: jax.Array, num_experts: int):
  """Sort token slots by expert.

  Args:
    topk_ids: [T, k] integer expert ids; entries < 0 or >= num_experts are empty slots.
    num_experts: E.
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
  if n <= _RANK_MAX_SLOTS:
    idx = jnp.arange(n, dtype=jnp.int32)
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None])
                                               & (idx[None, :] < idx[:, None]))
    pos = jnp.sum(before, axis=1, dtype=jnp.int32)
    sort_order = jnp.zeros((n,), jnp.int32).at[pos].set(idx, unique_indices=True)
    group_sizes = jnp.sum(key[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :],
                          axis=0, dtype=jnp.int32)
  else:
    sort_order = jnp.argsort(key, stable=True).astype(jnp.int32)
    pos = jnp.zeros((n,), jnp.int32).at[sort_order].set(jnp.arange(n, dtype=jnp.int32),
                                                        unique_indices=True)
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
  inv = jnp.where(valid, pos, -1).reshape(t, k)
  return sort_order, group_sizes, inv


def permute_rows(x: jax.Array, sort_order: jax.Array, k: int) -> jax.Array:
  """x [T, H] -> [T*k, H]: row i is the token of slot sort_order[i]."""
  return jnp.take(x, sort_order // k, axis=0, mode="clip")


def permute_weights(topk_weights: jax.Array, sort_order: jax.Array) -> jax.Array:
  """topk_weights [T, k] -> [T*k] f32 in sorted-slot order (GEMM2's row_scale)."""
  return jnp.take(topk_weights.reshape(-1).astype(jnp.float32), sort_order, mode="clip")


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def gather_sum(y: jax.Array, inv: jax.Array, *, out_dtype=None) -> jax.Array:
  """out[t] = sum_j y[inv[t, j]] over slots with inv >= 0, accumulated in f32. No atomics.

  y [M, H] (rows in sorted-slot order), inv [T, k] from moe_align. Returns [T, H] in out_dtype
  (default y.dtype). Rows of y that no valid slot points at (e.g. past sum(group_sizes)) are never
  read, so they may hold anything (the grouped GEMM leaves them unwritten).
  """
  if y.ndim != 2 or inv.ndim != 2:
    raise ValueError(f"y must be [M, H] and inv [T, k]; got {y.shape}, {inv.shape}")
  g = jnp.take(y, jnp.maximum(inv, 0), axis=0, mode="clip").astype(jnp.float32)  # [T, k, H]
  g = jnp.where((inv >= 0)[:, :, None], g, 0.0)
  return jnp.sum(g, axis=1).astype(out_dtype or y.dtype)


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
