"""The benchmark tools' own logic that runs without a GPU: ep_timeline.py's trace reading and
bench_grouped_gemm.py's floor ratios."""
from __future__ import annotations

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import ep_timeline  # noqa: E402


def _trace():
  meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
          dict(ph="M", pid=2, name="process_name", args=dict(name="/device:GPU:1")),
          dict(ph="M", pid=3, name="process_name", args=dict(name="/host:CPU")),
          dict(ph="M", pid=1, tid=7, name="thread_name", args=dict(name="Stream #7(Compute)"))]
  def ev(pid, ts, dur, name):
    return dict(ph="X", pid=pid, tid=7, ts=ts, dur=dur, name=name)
  events = [ev(1, 100.0, 50.0, "gather"), ev(2, 120.0, 10.0, "barrier"),
            ev(1, 151.0, 30.0, "ragged"), ev(3, 90.0, 400.0, "host work"),
            ev(1, 2000.0, 20.0, "gather"), ev(2, 2005.0, 5.0, "barrier")]
  return dict(traceEvents=meta + events)


def test_device_events_and_calls(tmp_path):
  run = tmp_path / "plugins" / "profile" / "run1"
  run.mkdir(parents=True)
  with gzip.open(run / "host.trace.json.gz", "wt") as fh:
    json.dump(_trace(), fh)
  events = ep_timeline.device_events(ep_timeline.read_trace(str(tmp_path)), "/device:GPU")
  assert [e["name"] for e in events] == ["gather", "barrier", "ragged", "gather", "barrier"]
  assert events[0]["stream"] == "Stream #7(Compute)" and events[1]["stream"] == ""
  calls = ep_timeline.split_calls(events, gap_us=500.0)  # 2000 is 1819 µs after 181: a new call
  assert [len(c) for c in calls] == [3, 2]
  first = ep_timeline.summarize(calls[0])
  assert first["span_us"] == 81.0  # 100 -> 181
  assert [e["start_us"] for e in first["events"]] == [0.0, 20.0, 51.0]


def test_per_set_floor_ratios():
  import bench_grouped_gemm
  # samples in rotation order (set 0, 1, 2, 0, 1, 2, ...); mixtral at 2 tokens touches 3, 4, 4
  # experts: each set's median against its own floor, not set 0's
  samples = [263.0, 336.0, 337.0, 264.0, 337.0, 336.0, 262.0, 336.5, 336.5]
  floors = [245.8, 327.7, 327.7]
  r = bench_grouped_gemm.per_set_floor_ratios(samples, floors)
  assert r["set_us"] == [263.0, 336.5, 336.5]
  assert abs(r["set_ratio_floor"][0] - 263.0 / 245.8) < 1e-12
  assert abs(r["ratio_floor"] - sum(r["set_ratio_floor"]) / 3) < 1e-12
  assert r["ratio_floor_worst"] == max(r["set_ratio_floor"]) < 1.08


def test_device_rel_err_matches_numpy():
  import jax.numpy as jnp
  import numpy as np

  import bench_grouped_gemm
  import check_common
  rng = np.random.default_rng(0)
  b = rng.standard_normal((64, 48)).astype(np.float32)
  a = b + 1e-2 * rng.standard_normal(b.shape).astype(np.float32)
  for dt in (jnp.float32, jnp.bfloat16):
    aj, bj = jnp.asarray(a, dt), jnp.asarray(b, dt)
    want = bench_grouped_gemm.rel_err(np.asarray(aj, np.float32), np.asarray(bj, np.float32))
    assert abs(check_common.device_rel_err(aj, bj) - want) < 1e-5 * max(want, 1e-3)
  assert check_common.device_rel_err(jnp.asarray(b), jnp.asarray(b)) == 0.0
  a[3, 5] = np.nan
  assert check_common.device_rel_err(jnp.asarray(a), jnp.asarray(b)) == float("inf")


def test_probe_tma_store_fill_tiles_the_output():
  import jax.numpy as jnp
  import numpy as np
  import pytest

  from jmoe.kernels import _compat
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this jax")
  import probe_write_bw
  tile = jnp.arange(64 * 256, dtype=jnp.float32).reshape(64, 256).astype(jnp.bfloat16)
  _compat.reset_interpret_state()
  out = np.asarray(probe_write_bw.tma_store_fill(tile, 192, 512, in_flight=2, num_ctas=4,
                                                 interpret=_compat.interpret_params()),
                   np.float32)
  assert not _compat.races_found()
  want = np.tile(np.asarray(tile, np.float32), (3, 2))
  np.testing.assert_array_equal(out, want)
  with pytest.raises(ValueError, match="multiples of the tile"):
    probe_write_bw.tma_store_fill(tile, 100, 512)


@pytest.mark.slow  # (a benchmark helper's layout: CI time)
def test_check_tgmm_problem_layout():
  import numpy as np
  import pytest

  import check_tgmm
  for align in (1, 8, 64):
    x, dy, gs = check_tgmm.make_problem("qwen3 dW2", align, tokens=4)
    gs = np.asarray(gs)
    assert x.shape == (4 * 8 + (align - 1) * 128, 768) and dy.shape == (x.shape[0], 2048)
    assert gs.shape == (128,) and (gs % align == 0).all() and gs.sum() <= x.shape[0]
    assert np.count_nonzero(gs) <= 32  # 4 tokens x top-8 touch at most 32 experts
  with pytest.raises(ValueError, match="not one of"):
    check_tgmm.make_problem("qwen3 dW3")


@pytest.mark.slow
def test_bench_train_step_tiny_smoke(tmp_path):
  """bench_train_step.py --tiny on the CPU: the reference model's donated training step runs,
  its losses are finite and the JSON is written (no timing assertions)."""
  import math

  import bench_train_step
  rc = bench_train_step.main(["--tiny", "--layers", "1", "--backends", "xla", "--steps", "1",
                              "--rotate", "1", "--out", str(tmp_path)])
  assert rc == 0
  with open(tmp_path / "train_step.json") as fh:
    result = json.load(fh)
  (run,) = result["runs"]
  assert "error" not in run, run.get("error")
  assert run["backend"] == "xla" and run["tokens_per_step"] == 4 * 16
  assert len(run["losses"]) == 4 and all(math.isfinite(x) for x in run["losses"])
  assert run["flops_per_token"] > 6 * run["active_params"] > 0
  assert result["agreement"]["tiny"]["checked"] is False


def test_bench_weight_only_decode_wq_switches():
  """bench_weight_only.py --decode-wq: the kernels' form switches for an A/B, checked by name
  and value."""
  import bench_weight_only as bw
  assert bw.parse_args(["--decode-wq", "WIDE_ROWS=0,SCALE_BYTES=1"]).decode_wq == {
      "WIDE_ROWS": False, "SCALE_BYTES": True}
  assert bw.parse_args([]).decode_wq == {}
  assert all(isinstance(getattr(*bw.switch_target(f)), bool) for f in bw.DECODE_WQ_FLAGS)
  assert bw.parse_args(["--decode-wq", "CHAINS=8"]).decode_wq == {"CHAINS": 8}
  assert getattr(*bw.switch_target("CHAINS")) == 2
  for bad in ("WIDE=0", "WIDE_ROWS=2", "SYNC_4BIT", "CHAINS=3"):
    with pytest.raises(SystemExit):
      bw.parse_args(["--decode-wq", bad])
