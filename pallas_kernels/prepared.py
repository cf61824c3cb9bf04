"""Kernel operands that depend only on the weights, made once instead of on every call.

Some kernels read a quantized weight's scales in another layout or dtype than the stored one
(the prefill GEMMs read them group-major, one TMA box a K step; int4's and nvfp4's as copies
in the token dtype with the global scale folded in; mxfp4 with fp8 tokens as exponent
shifts). Made inside the jitted call, that is XLA work on every call that repeats itself:
on deepseek-v3 at 4096 tokens, about 1.1 ms a call for nvfp4's scale copies and 0.2-0.3 ms for
mxfp4's transposes (H200; BENCHMARKS.md's GEMM-vs-block times). `jmoe.quant.prepare_for_kernels`
(vLLM's `process_weights_after_loading`) makes them once and keeps them on the weights
(`QuantizedWeights.prepared`, a dict of arrays, each [E, ...] so it shards, slices and
gathers with the experts); a kernel's argument code asks `operand(w, op)`, which returns the
kept array or, where there is none, makes it in the call as before. Loading stays a view:
the stored values and scales are untouched, the prepared arrays sit beside them.

An `Operand` names one derived array and how to make it from the weights; each kernel
module lists its own (`operands(w, ...)` or `OPERANDS` there), and `jmoe.kernels.moe.prepare_weight_only` picks
the ones the layouts that can run would read.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax


@dataclasses.dataclass(frozen=True)
class Operand:
  """One weight-derived kernel operand: `key` (unique among a weight's prepared arrays) and
  `make(w) -> array` ([E, ...], E the weights' experts)."""

  key: str
  make: Callable[[Any], jax.Array]


def operand(w, op: Operand) -> jax.Array:
  """op's array for weights w: the prepared one where w carries it (its shape and dtype
  checked against what op.make would give, at trace time), else op.make(w)."""
  kept = (getattr(w, "prepared", None) or {}).get(op.key)
  if kept is None:
    return op.make(w)
  want = jax.eval_shape(op.make, w)
  if tuple(kept.shape) != tuple(want.shape) or kept.dtype != want.dtype:
    raise ValueError(
        f"prepared[{op.key!r}] is {kept.dtype}{list(kept.shape)} but these weights give "
        f"{want.dtype}{list(want.shape)}: prepared from other weights? Prepare again "
        "(jmoe.quant.prepare_for_kernels) after changing values or scales")
  return kept


def with_prepared(w, ops) -> Any:
  """w with ops' arrays made and kept (beside any it already has; an op's key already
  there is made again)."""
  kept = dict(getattr(w, "prepared", None) or {})
  stripped = dataclasses.replace(w, prepared=None)  # make from the stored arrays only
  for op in ops:  # (jitted: one fusion each, and only the new arrays are outputs)
    kept[op.key] = jax.jit(op.make)(stripped)
  return dataclasses.replace(w, prepared=kept or None)
