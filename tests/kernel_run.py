"""Running a Pallas kernel in Mosaic GPU interpret mode for a test: race detection on, the
interpreter reset when the kernel raises (its state would poison the next test), a race a
failure; the marks of a case past .ci/run's slow tier."""
from __future__ import annotations

import jax
import pytest

from jmoe.kernels import _compat

# a kernel case only `pytest -m slow` runs (A/B forms, asked-for-only paths, duplicates of
# another tier's coverage): pyproject's `exhaustive` marker
EXHAUSTIVE = (pytest.mark.slow, pytest.mark.exhaustive)


def run_interpreted(fn, *args, **kw):
  """fn(*args, interpret=<race-detecting params>, **kw), blocked on; asserts no race."""
  try:
    out = jax.block_until_ready(fn(*args, interpret=_compat.interpret_params(detect_races=True),
                                   **kw))
  except Exception:
    _compat.reset_interpret_state()
    raise
  assert not _compat.races_found(), "race detected by the Mosaic GPU interpreter"
  return out
