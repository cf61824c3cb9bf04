"""examples/train_tiny_moe.py as 2 processes x 4 CPU devices on localhost (`jax.distributed`,
gloo collectives) gives the single-process 8-device loss curve within float tolerance."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "examples", "train_tiny_moe.py")
QUICK = ["--steps", "4", "--warmup", "1", "--layers", "1", "--hidden", "32", "--seq", "32",
         "--eval-batches", "1", "--no-progress", "--no-plot", "--no-ckpt"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # two jax.distributed processes (~20 s); tests/test_multiprocess.py stays lean
def test_two_processes_match_one(tmp_path):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the script sets the simulated device count per process
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  port = _free_port()
  multi = [[sys.executable, SCRIPT, *QUICK, "--out", str(tmp_path / "multi"),
            "--num-processes", "2", "--process-id", str(i), "--coordinator",
            f"127.0.0.1:{port}"] for i in range(2)]
  single = [sys.executable, SCRIPT, *QUICK, "--out", str(tmp_path / "single")]
  procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for cmd in (*multi, single)]
  t0, outs = time.time(), []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=max(5.0, 170 - (time.time() - t0)))[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail("the multi-process training run timed out")
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  with open(tmp_path / "multi" / "metrics.json") as f:
    m = json.load(f)
  with open(tmp_path / "single" / "metrics.json") as f:
    s = json.load(f)
  assert (m["processes"], m["devices"], s["processes"], s["devices"]) == (2, 8, 1, 8)
  np.testing.assert_allclose(m["losses"], s["losses"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(m["val_loss"], s["val_loss"], rtol=1e-5)
  assert m["losses"][-1] < m["losses"][0]
