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
