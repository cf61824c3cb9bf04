"""Shared test set-up: the hypothesis profile, simulated CPU devices, fixtures.

The float64 NumPy oracle lives in `oracle_np.py` next to this file (importable as `oracle_np`
because pytest puts this directory on sys.path).
"""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

# Simulated CPU devices for the sharding tests; must happen before jax picks its backend.
# An XLA_FLAGS set by the caller wins.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
# XLA:CPU's LLVM optimization off: the tests check values, not CPU speed, and a fresh clone's
# run is mostly compiling (test_layers + test_quant from a cold cache: 130 -> 85 s on 2 cores;
# no fast-math either way, so the numerics are the same). README blocks run without it.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# One persistent XLA compilation cache per checkout, shared by the xdist workers and the
# subprocesses tests start (README blocks, multi-host runs): the suite compiles many identical
# programs in different tests (measured: test_route + test_layers 140 -> 99 s from a cold
# cache). Per checkout, so a fresh clone (CI) starts cold; .gitignore'd.
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      ".jax-test-cache")
for _name, _value in (("JAX_COMPILATION_CACHE_DIR", _CACHE),
                      ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"),
                      ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")):
  os.environ.setdefault(_name, _value)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "jmoe", max_examples=30, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("jmoe-long", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("JMOE_HYPOTHESIS_PROFILE", "jmoe"))


@pytest.fixture
def rng(request):
  """A numpy Generator seeded from the test's id, so every test is reproducible."""
  seed = zlib.crc32(request.node.nodeid.encode())
  return np.random.default_rng(seed)


@pytest.fixture
def no_backend_env(monkeypatch):
  monkeypatch.delenv("JMOE_RUNNER_BACKEND", raising=False)
  monkeypatch.delenv("JMOE_A2A_BACKEND", raising=False)
