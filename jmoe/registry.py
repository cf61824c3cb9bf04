"""The registry of modular parts (the analogue of vLLM's `mk_objects.py`).

Runner backends map an activation format to an Experts class; a2a backends are factories of
PrepareFinalize objects. Other packages (the Pallas experts, `sharding/`) register themselves
here, so jmoe's core never imports them at module import time.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from jmoe.modular import ActivationFormat, Experts, PrepareFinalize

# runner backend name -> {input activation format: Experts class}
RUNNERS: dict[str, dict[ActivationFormat, type[Experts]]] = {}
# a2a backend name -> factory(parallel_config, activation_format, **kw) -> PrepareFinalize
A2A_BACKENDS: dict[str, "A2ABackend"] = {}


@dataclasses.dataclass(frozen=True)
class A2ABackend:
  """A family of PrepareFinalize classes for one way of moving tokens."""

  name: str
  by_format: dict  # ActivationFormat -> factory(parallel: ParallelConfig | None) -> PrepareFinalize
  needs_mesh: bool = False
  description: str = ""


def register_runner(name: str, experts_cls: type[Experts]) -> type[Experts]:
  fmt = experts_cls.activation_formats[0]
  RUNNERS.setdefault(name, {})[fmt] = experts_cls
  return experts_cls


def register_a2a(backend: A2ABackend) -> A2ABackend:
  A2A_BACKENDS[backend.name] = backend
  return backend


def all_experts() -> list[type[Experts]]:
  seen = []
  for fam in RUNNERS.values():
    for cls in fam.values():
      if cls not in seen:
        seen.append(cls)
  return seen


def all_prepare_finalize(parallel=None) -> list[tuple[str, Callable[[], PrepareFinalize]]]:
  """(label, factory) for every registered PrepareFinalize usable with `parallel`."""
  out = []
  for b in A2A_BACKENDS.values():
    if b.needs_mesh and parallel is None:
      continue
    for fmt, factory in b.by_format.items():
      out.append((f"{b.name}:{fmt.value}", lambda f=factory: f(parallel)))
  return out


def _load_builtin() -> None:
  from jmoe.experts import ReferenceExperts, XlaBatchedExperts, XlaExperts
  from jmoe.prepare_finalize import NoEP, NoEPBatched

  register_runner("reference", ReferenceExperts)
  register_runner("xla", XlaExperts)
  register_runner("xla", XlaBatchedExperts)
  register_runner("xla_batched", XlaBatchedExperts)
  register_a2a(A2ABackend(
      "none", {ActivationFormat.Standard: lambda parallel: NoEP(),
               ActivationFormat.Batched: lambda parallel: NoEPBatched()},
      description="no expert parallelism: all experts on this device"))
  _load_optional()


def _load_optional() -> None:
  """Parts that live outside jmoe's core register through their own modules."""
  import importlib
  for mod in ("jmoe.experts.pallas", "jmoe.sharding.register"):
    try:
      importlib.import_module(mod)
    except ModuleNotFoundError as e:  # the part is not built yet / not installed
      if e.name is None or not mod.startswith(e.name):
        raise


_load_builtin()
