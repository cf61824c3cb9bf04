"""Trace-time argument checks shared by the public entry points.

Every check raises before any kernel runs and names the offending argument. Value checks
(ids in range) run only when the values are concrete; under `jit` out-of-range ids are
treated as empty slots unless the checkify mode is on (see `checkify_ids`).
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
  return getattr(_state, "checkify", os.environ.get("JMOE_CHECKIFY", "0") == "1")


@contextlib.contextmanager
def checkify_ids(enabled: bool = True):
  """Turn out-of-range `topk_ids` under jit into a checkify error.

  Inside this context `fused_moe` emits `checkify.check`s, so the caller must wrap the
  function with `jax.experimental.checkify.checkify` and call `.throw()` on the error::

      with jmoe.checkify_ids():
        err, out = checkify.checkify(jax.jit(f))(x, ...)
      err.throw()

  `JMOE_CHECKIFY=1` turns it on for the whole process.
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
  if not jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                        jnp.floating):
    raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")


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
  return int(topk_ids.shape[1])


def check_ids_in_range(topk_ids, num_experts: int, *, argname: str = "topk_ids") -> None:
  """Eager range check (-1 allowed as the empty slot); a checkify check when enabled."""
  if is_concrete(topk_ids):
    ids = np.asarray(topk_ids)
    bad = (ids < -1) | (ids >= num_experts)
    if bad.any():
      raise ValueError(f"{argname} holds ids outside [-1, {num_experts}): e.g. "
                       f"{ids[bad][:5].tolist()} (global_num_experts={num_experts})")
  elif checkify_enabled():
    checkify.check(jnp.all((topk_ids >= -1) & (topk_ids < num_experts)),
                   f"{argname} holds ids outside [-1, {num_experts})")


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
