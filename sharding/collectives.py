"""Collectives used by the EP dispatchers, with the one platform switch jmoe needs.

XLA:CPU cannot compile `ragged-all-to-all` ("HLO opcode ... not supported by XLA:CPU"), so on
CPU `ragged_all_to_all` runs an equivalent built on `all_gather` (same arguments, same result,
differentiable); on GPU/TPU it is `jax.lax.ragged_all_to_all`. The choice is made here and
nowhere else. `JMOE_RAGGED_A2A=native|emulated` forces it.
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


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                      send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                      axis_name: str, impl: str = "native") -> jax.Array:
  """`jax.lax.ragged_all_to_all` semantics, one slice per peer (arrays of length axis size).

  Slice i of `operand` (`operand[input_offsets[i]:+send_sizes[i]]`) goes to peer i, where it
  lands at `output_offsets[i]` of the peer's `output`; `recv_sizes[i]` rows come from peer i.
  Rows of `output` nobody writes keep their value.
  """
  if impl == "native" and jax.lax.axis_size(axis_name) > 1:
    # (on a 1-device axis the native op is a local copy that XLA's one-shot kernel ran at
    # ~1 GB/s on an H200 — 25 ms at qwen3 / 1024 tokens; the select below is a fused copy)
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axis_name)
  return _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets,
                                     axis_name)


def _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets,
                                axis_name):
  """All-gather based equivalent (CPU): every rank sees every slice and keeps its own.

  Costs axis_size x the operand in memory and bandwidth: a test vehicle, not a fast path.
  """
  me = jax.lax.axis_index(axis_name)
  all_op = jax.lax.all_gather(operand, axis_name)  # [P, R_in, ...]
  meta = jnp.stack([input_offsets, send_sizes, output_offsets]).astype(jnp.int32)  # [3, P]
  all_meta = jax.lax.all_gather(meta, axis_name)  # [P(src), 3, P(dst)]
  start_i, cnt, start_o = (all_meta[:, j, me] for j in range(3))  # [P(src)] each, for me
  n_src, r_in = all_op.shape[0], all_op.shape[1]
  rows = jnp.arange(output.shape[0], dtype=jnp.int32)[:, None]  # [R_out, 1]
  hit = (rows >= start_o[None, :]) & (rows < (start_o + cnt)[None, :])  # [R_out, P]
  src = jnp.argmax(hit, axis=1)
  got = jnp.any(hit, axis=1)
  src_row = jnp.clip(rows[:, 0] - start_o[src] + start_i[src], 0, r_in - 1)
  vals = all_op[src, src_row]
  mask = got.reshape((-1,) + (1,) * (output.ndim - 1))
  return jnp.where(mask, vals, output)


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
  c = jnp.cumsum(x, axis=axis)
  return c - x


def axis_size(axis_name: Optional[str]) -> int:
  if axis_name is None:
    return 1
  return jax.lax.axis_size(axis_name)
