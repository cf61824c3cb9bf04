"""Trace-time argument checks shared by the public entry points.

Every check raises before any kernel runs and names the offending argument. Value checks
(ids in range) run only when the values are concrete; under `jit` out-of-range ids are
treated as empty slots unless the caller runs the function under `checkify` (see
`checkify_ids`).
"""
from __future__ import annotations

import contextlib
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

try:  # public in jax 0.10; guard against its removal from jax.core
  from jax.core import Tracer as _Tracer
except ImportError:  # pragma: no cover
  from jax._src.core import Tracer as _Tracer

_state = threading.local()


def is_concrete(x) -> bool:
  """True when `x` holds values now (not a tracer under jit/grad/vmap)."""
  return not isinstance(x, _Tracer)


def checkify_enabled() -> bool:
  """Whether traces made now record the ids' range check. Off by default: the check's effect
  takes every jitted call off jit's C++ dispatch fast path (+120 µs of host time per call on
  a CPU, measured 2026-12-01: 265 vs 145 µs for a tiny block), which a decode loop pays on
  every step. `JMOE_CHECKIFY=1` or `with jmoe.checkify_ids():` around the first trace turn it on."""
  return getattr(_state, "checkify", os.environ.get("JMOE_CHECKIFY", "0") == "1")


@contextlib.contextmanager
def checkify_ids(enabled: bool = True):
  """The checkify mode: out-of-range `topk_ids` under jit become a checkify error.

  Traces made inside this context (or with `JMOE_CHECKIFY=1`) carry a debug `checkify.check`:
  a no-op in a plain `jit` (the slot is then empty), an error when the caller wraps the
  function with `jax.experimental.checkify.checkify`::

      with jmoe.checkify_ids():
        err, out = checkify.checkify(jax.jit(f))(x, ...)
      err.throw()

  The check is part of the trace, so the context must be active when the function is traced
  (a `jit` cache entry made outside it has no check; one made inside it keeps it). Outside the
  context no check is recorded (the default): it costs every jitted call its C++ fast path.
  `enabled=False` leaves the check out even where `JMOE_CHECKIFY=1` puts it in.
  """
  old = getattr(_state, "checkify", None)
  _state.checkify = enabled
  try:
    yield
  finally:
    if old is None:
      del _state.checkify
    else:
      _state.checkify = old


def check_floating(name: str, x) -> None:
  dtype = x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")


def check_topk(topk_weights, topk_ids, num_tokens: int) -> int:
  """Validate router outputs against T; returns k."""
  if topk_ids.ndim != 2 or topk_ids.shape[0] != num_tokens:
    raise ValueError(f"topk_ids must be [T, k] with T={num_tokens}, got shape {topk_ids.shape}")
  if topk_weights.shape != topk_ids.shape:
    raise ValueError(f"topk_weights shape {topk_weights.shape} does not match topk_ids shape "
                     f"{topk_ids.shape}")
  if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
    raise TypeError(f"topk_ids must be an integer array, got {topk_ids.dtype}")
  check_floating("topk_weights", topk_weights)
  if topk_ids.shape[1] == 0:
    raise ValueError(f"topk_ids must have at least one slot per token (k >= 1), got shape "
                     f"{topk_ids.shape}")
  return int(topk_ids.shape[1])


def _outside(values, hi: int) -> list:
  """Up to five concrete values outside [-1, hi)."""
  v = np.asarray(values)
  return v[(v < -1) | (v >= hi)][:5].tolist()


def check_ids_in_range(topk_ids, num_experts: int, *, argname: str = "topk_ids") -> None:
  """Eager range check (-1 allowed as the empty slot); a debug checkify check when traced."""
  if is_concrete(topk_ids):
    bad = _outside(topk_ids, num_experts)
    if bad:
      raise ValueError(f"{argname} holds ids outside [-1, {num_experts}): e.g. {bad} "
                       f"(global_num_experts={num_experts})")
  elif checkify_enabled():
    # debug=True: dropped unless the caller functionalizes with checkify.checkify (the form
    # jax documents from 0.10 on; `checkify.debug_check` is its older spelling).
    checkify.check(jnp.all((topk_ids >= -1) & (topk_ids < num_experts)),
                   f"{argname} holds ids outside [-1, {num_experts})", debug=True)


def check_expert_map(expert_map, num_local_experts: int) -> None:
  """expert_map [global_E]: integer local ids in [0, E_local), or -1 for not local."""
  if expert_map.ndim != 1:
    raise ValueError(f"expert_map must be 1-D [global_E], got shape {expert_map.shape}")
  if not jnp.issubdtype(expert_map.dtype, jnp.integer):
    raise TypeError(f"expert_map must be an integer array, got {expert_map.dtype}")
  if is_concrete(expert_map):
    bad = _outside(expert_map, num_local_experts)
    if bad:
      raise ValueError(f"expert_map holds local ids outside [-1, {num_local_experts}): e.g. "
                       f"{bad} (w13 holds {num_local_experts} local experts)")


def check_distinct_ids(topk_ids) -> None:
  """Each token's k (non-empty) ids must differ: the batched layout relies on it."""
  if not is_concrete(topk_ids) or topk_ids.shape[1] < 2:
    return
  ids = np.sort(np.asarray(topk_ids), axis=1)
  dup = (ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)
  if dup.any():
    row = int(np.argwhere(dup)[0, 0])
    raise ValueError(f"topk_ids repeats an expert within token {row}: "
                     f"{np.asarray(topk_ids)[row].tolist()}")
