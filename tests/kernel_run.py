"""Running a Pallas kernel in Mosaic GPU interpret mode for a test: race detection on, the
interpreter reset when the kernel raises (its state would poison the next test), a race a
failure."""
from __future__ import annotations

import jax

from jmoe.kernels import _compat


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
