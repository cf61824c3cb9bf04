"""Collectives used by the EP dispatchers, with the one platform switch jmoe needs.

XLA:CPU cannot compile `ragged-all-to-all` ("HLO opcode ... not supported by XLA:CPU"), so on
CPU `ragged_all_to_all` runs an equivalent built on `all_gather` (same arguments, same result,
differentiable); on GPU/TPU it is `jax.lax.ragged_all_to_all`, with every peer's slice cut
into pieces where XLA runs it as its in-process one-shot kernel (`default_chunks`). The choice
is made here and nowhere else. `JMOE_RAGGED_A2A=native|emulated` forces it.
"""
from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp

RAGGED_IMPLS = ("native", "emulated")


def ragged_impl_for(platform: str) -> str:
  """"native" or "emulated" for a mesh whose devices are on `platform`."""
  forced = os.environ.get("JMOE_RAGGED_A2A")
  if forced:
    if forced not in RAGGED_IMPLS:
      raise ValueError(f"JMOE_RAGGED_A2A={forced!r} is not one of {RAGGED_IMPLS}")
    return forced
  return "emulated" if platform == "cpu" else "native"


def mesh_platform(mesh) -> str:
  return mesh.devices.flat[0].platform


NATIVE_CHUNKS = 256


def default_chunks() -> int:
  """Pieces per peer slice for the native op: `JMOE_RAGGED_A2A_CHUNKS`, else 256.

  XLA's in-process ("one-shot") GPU kernel, its default on one host, gives each slice its own
  few thread blocks, so one slice per peer leaves the SMs idle: on 2 H200s (jax 0.11.2) the
  deepseek-v3 dispatch at 4096 tokens/GPU took 90 ms as 1 piece per peer, 12.5 ms as 8, 2.8 ms
  as 64, 1.98 ms as 256 and 1.94 ms as 1024 (BENCHMARKS.md, "Expert parallelism on 2 H200s").
  """
  raw = os.environ.get("JMOE_RAGGED_A2A_CHUNKS", str(NATIVE_CHUNKS))
  if not raw.isdigit() or int(raw) < 1:
    raise ValueError(f"JMOE_RAGGED_A2A_CHUNKS={raw!r} must be a positive integer")
  return int(raw)


def one_shot_kernel_applies(peers: int) -> bool:
  """Whether XLA runs a ragged all-to-all over `peers` devices as its in-process one-shot
  kernel (one process driving at most 8 GPUs), the case the pieces are for. Elsewhere XLA
  uses NCCL send/recv per piece or its multi-host decomposition, where pieces only add calls."""
  return peers <= 8 and jax.process_count() == 1


def split_slices(offsets: jax.Array, sizes: jax.Array, chunks: int
                 ) -> tuple[jax.Array, jax.Array]:
  """[P] slices, or [P, m] (m sub-slices per peer) -> [P * m * chunks] pieces (peer-major):
  piece j of a slice of s rows starts at j * ceil(s / chunks) and is empty past the slice's end.
  Sender and receiver cut a slice the same way from its size alone, so their piece lists
  agree."""
  offsets = offsets.reshape(offsets.shape[0], -1)
  sizes = sizes.reshape(sizes.shape[0], -1)
  if chunks == 1:
    return offsets.reshape(-1), sizes.reshape(-1)
  piece = (sizes + chunks - 1) // chunks
  j = jnp.arange(chunks, dtype=sizes.dtype)
  start = jnp.minimum(j * piece[..., None], sizes[..., None])
  size = jnp.minimum(piece[..., None], sizes[..., None] - start)
  return (offsets[..., None] + start).reshape(-1), size.reshape(-1)


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                      send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                      axis_name: str, impl: str = "native",
                      chunks: Optional[int] = None) -> jax.Array:
  """`jax.lax.ragged_all_to_all` semantics, one slice per peer (arrays [P], P = axis size) or
  m slices per peer (arrays [P, m]).

  Slice i of `operand` (`operand[input_offsets[i]:+send_sizes[i]]`) goes to peer i, where it
  lands at `output_offsets[i]` of the peer's `output`; `recv_sizes[i]` rows come from peer i
  ([P, m]: row i holds peer i's m slices, in the order the peer sends them). Rows of `output`
  nobody writes keep their value. `chunks` cuts every peer's rows into that many pieces on the
  wire (chunks // m per slice; the result is the same); by default `default_chunks()` for the
  native op where XLA's one-shot kernel runs it (`one_shot_kernel_applies`), else 1 (also for
  the emulation, whose cost grows with the number of pieces).
  """
  peers = jax.lax.axis_size(axis_name)
  native = impl == "native" and peers > 1
  if chunks is None:
    chunks = default_chunks() if native and one_shot_kernel_applies(peers) else 1
  if chunks < 1:
    raise ValueError(f"chunks must be >= 1, got {chunks}")
  per_peer = input_offsets.size // max(input_offsets.shape[0], 1)
  chunks = max(1, chunks // per_peer)
  in_off, send = split_slices(input_offsets, send_sizes, chunks)
  out_off, _ = split_slices(output_offsets, send_sizes, chunks)
  _, recv = split_slices(jnp.zeros_like(recv_sizes), recv_sizes, chunks)
  if native:
    # (on a 1-device axis the native op is a local copy that XLA's one-shot kernel ran at
    # ~1 GB/s on an H200 — 25 ms at qwen3 / 1024 tokens; the select below is a fused copy)
    return jax.lax.ragged_all_to_all(operand, output, in_off, send, out_off, recv,
                                     axis_name=axis_name)
  return _ragged_all_to_all_emulated(operand, output, in_off, send, out_off, axis_name)


def _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets,
                                axis_name):
  """All-gather based equivalent (CPU): every rank sees every slice and keeps its own.

  Takes lax's layout of N = P * c slices (slice i goes to peer i // c). Costs axis_size x the
  operand in memory and bandwidth: a test vehicle, not a fast path.
  """
  me = jax.lax.axis_index(axis_name)
  n_peers = jax.lax.axis_size(axis_name)
  c = input_offsets.shape[0] // n_peers
  all_op = jax.lax.all_gather(operand, axis_name)  # [P, R_in, ...]
  meta = jnp.stack([input_offsets, send_sizes, output_offsets]).astype(jnp.int32)  # [3, N]
  all_meta = jax.lax.all_gather(meta, axis_name)  # [P(src), 3, N]
  mine = jax.lax.dynamic_slice_in_dim(all_meta, me * c, c, axis=2)  # [P(src), 3, c]
  start_i, cnt, start_o = (mine[:, j].reshape(-1) for j in range(3))  # [P*c] each, for me
  seg_src = jnp.arange(start_i.shape[0], dtype=jnp.int32) // c
  r_in = all_op.shape[1]
  rows = jnp.arange(output.shape[0], dtype=jnp.int32)[:, None]  # [R_out, 1]
  hit = (rows >= start_o[None, :]) & (rows < (start_o + cnt)[None, :])  # [R_out, P*c]
  seg = jnp.argmax(hit, axis=1)
  got = jnp.any(hit, axis=1)
  src_row = jnp.clip(rows[:, 0] - start_o[seg] + start_i[seg], 0, r_in - 1)
  vals = all_op[seg_src[seg], src_row]
  mask = got.reshape((-1,) + (1,) * (output.ndim - 1))
  return jnp.where(mask, vals, output)


def receive_buffer(shape: tuple, dtype) -> jax.Array:
  """An output buffer for ragged_all_to_all whose rows nobody writes are never read.

  jax.lax.empty: on GPU an uninitialized allocation (XLA's AllocateBuffer), so the receive
  buffer costs no fill kernel (the zero fill of ragged_dedup's [ep * T, H] buffer took 70 µs of
  its 500 µs dispatch at deepseek-v3 / 4096 tokens on 2 H200s); zeros where lax.empty is
  missing and on CPU (where XLA lowers it to zeros). Only for buffers whose unwritten rows no
  computation that reaches a result reads: their contents are arbitrary, NaN included.
  """
  empty = getattr(jax.lax, "empty", None)
  if empty is None:  # pragma: no cover (a jax without lax.empty)
    return jnp.zeros(shape, dtype)
  return empty(tuple(shape), dtype)


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
  c = jnp.cumsum(x, axis=axis)
  return c - x


def axis_size(axis_name: Optional[str]) -> int:
  if axis_name is None:
    return 1
  return jax.lax.axis_size(axis_name)


def pack_rows(*cols: jax.Array) -> tuple[jax.Array, tuple]:
  """Columns with one leading row axis [n, ...] (any dtypes) -> (uint8 [n, bytes per row],
  layout), so rows of several arrays travel in one collective (fp8 dispatch: the e4m3 row,
  its scales, ids and weights in one ragged all-to-all instead of four launches)."""
  n = cols[0].shape[0]
  parts, layout = [], []
  for c in cols:
    if c.shape[0] != n:
      raise ValueError(f"pack_rows: every column needs {n} rows, got shape {c.shape}")
    b = jax.lax.bitcast_convert_type(c, jnp.uint8).reshape(n, -1)
    parts.append(b)
    layout.append((jnp.dtype(c.dtype), c.shape[1:], b.shape[1]))
  return jnp.concatenate(parts, axis=1), tuple(layout)


def unpack_rows(buf: jax.Array, layout: tuple) -> list[jax.Array]:
  """The inverse of `pack_rows`: uint8 [n, bytes] -> the columns, in their dtypes and shapes."""
  n = buf.shape[0]
  out, at = [], 0
  for dtype, shape, width in layout:
    b = buf[:, at:at + width]
    at += width
    if dtype.itemsize > 1:
      b = b.reshape((n,) + shape + (dtype.itemsize,))
    else:
      b = b.reshape((n,) + shape)
    out.append(jax.lax.bitcast_convert_type(b, dtype))
  return out
