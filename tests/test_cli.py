"""`python -m jmoe ...` commands, run in-process on tiny settings."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jmoe import cli


def test_check_prints_matrix_and_oracle(capsys):
  assert cli.main(["check"]) == 0
  out = capsys.readouterr().out
  for name in ("reference", "xla", "xla_batched", "pallas_mosaic", "none:standard",
               "none:batched", "oracle default here"):
    assert name in out


def test_bench_writes_json_and_plot(tmp_path, capsys):
  js, png = tmp_path / "b.json", tmp_path / "b.png"
  rc = cli.main(["bench", "--preset", "qwen3-30b-a3b", "--tokens", "1,8", "--backends",
                 "xla,xla_batched", "--repeats", "2", "--json", str(js), "--plot", str(png)])
  assert rc == 0
  out = capsys.readouterr().out
  assert "scaled for CPU" in out and "roofline" in out
  data = json.loads(js.read_text())
  rows = data["rows"]
  assert {(r["tokens"], r["backend"]) for r in rows} == {(1, "xla"), (1, "xla_batched"),
                                                          (8, "xla"), (8, "xla_batched")}
  for r in rows:
    assert r["error"] is None and r["time_us"] > 0 and r["roofline_us"] > 0
    if r["backend"] == "xla_batched":
      assert r["rel_err"] < 1e-5  # checked against the first backend in the same run
  assert png.stat().st_size > 1000


def test_bench_reports_a_failing_backend_without_hiding_others(capsys):
  rc = cli.main(["bench", "--preset", "mixtral-8x7b", "--tokens", "1", "--backends",
                 "xla,pallas_mosaic", "--repeats", "1"])
  assert rc == 1  # pallas_mosaic cannot run on CPU: reported as failed, xla still timed
  out = capsys.readouterr().out
  assert "failed" in out and "xla" in out


def test_eplb_simulation(tmp_path, capsys):
  png = tmp_path / "eplb.png"
  assert cli.main(["eplb", "--preset", "qwen3-30b-a3b", "--ep", "8", "--redundant", "8",
                   "--skew", "1.0", "--tokens", "2048", "--plot", str(png)]) == 0
  assert "balancedness" in capsys.readouterr().out
  assert png.exists()


def test_tune_in_interpret_mode_writes_tables(tmp_path, capsys):
  from jmoe.kernels import _compat
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this jax")
  rc = cli.main(["tune", "--preset", "mixtral-8x7b", "--shape", "4,2,64,64", "--tokens", "8",
                 "--interpret", "--max-candidates", "1", "--iters", "1", "--out", str(tmp_path),
                 "--log", str(tmp_path / "log.json")])
  assert rc == 0
  log = json.loads((tmp_path / "log.json").read_text())["candidates"]
  assert [c["table"] for c in log] == ["grouped_gemm_gated", "grouped_gemm", "tgmm", "tgmm"]
  assert all(c["tokens"] == 8 and c["us"] > 0 and "block_k" in c["config"] for c in log)
  assert len({(c["table"], c["key"]) for c in log}) == 4  # the weight gradients: 2 problems
  for kernel in ("grouped_gemm", "grouped_gemm_gated"):
    table = json.loads((tmp_path / f"{kernel}.json").read_text())
    (key, entry), = table.items()
    assert key.startswith("E=4,") and ",jax=" in key and entry["us"] > 0
    assert {"block_m", "block_n", "block_k", "num_stages"} <= set(entry)
  tg = json.loads((tmp_path / "tgmm.json").read_text())  # dW13 and dW2 shapes
  assert sorted(k_.split(",")[1:3] for k_ in tg) == [["N=128", "K=64"], ["N=64", "K=64"]]
  assert all({"block_k", "block_n", "block_r", "num_stages"} <= set(v) for v in tg.values())


def test_tune_train_adds_training_gemm_tables(tmp_path, capsys):
  from jmoe.kernels import _compat
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this jax")
  rc = cli.main(["tune", "--preset", "mixtral-8x7b", "--shape", "4,2,64,64", "--tokens", "8",
                 "--interpret", "--max-candidates", "1", "--iters", "1", "--train",
                 "--out", str(tmp_path)])
  assert rc == 0
  plain = json.loads((tmp_path / "grouped_gemm.json").read_text())  # GEMM2 and unfused GEMM1
  assert sorted(k_.split(",")[1:3] for k_ in plain) == [["N=128", "K=64"], ["N=64", "K=64"]]
  rt = json.loads((tmp_path / "grouped_gemm_rt.json").read_text())  # d x_sorted, d a
  assert sorted(k_.split(",")[1:3] for k_ in rt) == [["N=64", "K=128"], ["N=64", "K=64"]]


def test_tune_cli_tables_option(tmp_path, capsys):
  from jmoe.kernels import _compat
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this jax")
  rc = cli.main(["tune", "--preset", "mixtral-8x7b", "--shape", "4,2,64,64", "--tokens", "8",
                 "--interpret", "--max-candidates", "1", "--iters", "1", "--tables",
                 "grouped_gemm", "--out", str(tmp_path)])
  assert rc == 0
  assert sorted(p.name for p in tmp_path.iterdir()) == ["grouped_gemm.json"]  # GEMM2 only
  with pytest.raises(ValueError, match="not tuned tables"):
    cli.main(["tune", "--shape", "4,2,64,64", "--tokens", "8", "--interpret", "--tables",
              "gemm2", "--out", str(tmp_path)])


def test_tune_saves_each_winner_before_a_later_problem_fails(tmp_path, monkeypatch):
  from jmoe import tune
  calls = []

  def fake_time(fn, arg_sets, iters, interpret):  # GEMM1's candidate times; GEMM2's all fail
    calls.append(fn)
    if len(calls) > 1:
      raise RuntimeError("does not fit")
    return 7.0

  monkeypatch.setattr(tune, "_device_time_us", fake_time)
  with pytest.raises(RuntimeError, match="every candidate failed for grouped_gemm "):
    cli.main(["tune", "--preset", "mixtral-8x7b", "--shape", "4,2,64,64", "--tokens", "8",
              "--interpret", "--max-candidates", "1", "--out", str(tmp_path),
              "--log", str(tmp_path / "log.json")])
  (key, entry), = json.loads((tmp_path / "grouped_gemm_gated.json").read_text()).items()
  assert key.startswith("E=4,N=64,K=64,") and entry["us"] == 7.0
  assert not (tmp_path / "grouped_gemm.json").exists()
  log = json.loads((tmp_path / "log.json").read_text())["candidates"]
  assert [(c["table"], c["us"]) for c in log] == [("grouped_gemm_gated", 7.0),
                                                  ("grouped_gemm", None)]


def test_tune_times_the_config_in_use_once(monkeypatch):
  from jmoe import tune
  from jmoe.kernels import tgmm as tg
  from jmoe.kernels import tuning
  in_use = tuning.SWEEP_TGMM[2]  # a tuned entry that is also a sweep candidate
  monkeypatch.setattr(tg, "get_tgmm_config", lambda *a, **kw: in_use)
  monkeypatch.setattr(tune, "_device_time_us", lambda *a, **kw: 1.0)
  seen, steps = [], []
  tune.tune(4, 2, 64, 64, "silu", [8], interpret=True, tables=["tgmm"],
            report=lambda *a: seen.append(a), progress=lambda: steps.append(1))
  for key in {k_ for _, _, k_, _, _ in seen}:
    cfgs = [c for _, _, k_, c, _ in seen if k_ == key]
    assert cfgs[0] == in_use and cfgs.count(in_use) == 1
    assert len(cfgs) == len(tuning.SWEEP_TGMM)  # the sweep, its copy of the one in use skipped
  assert len(steps) == tune.num_candidates(4, 2, [8], training=False, tables=["tgmm"])


def test_tune_keep_existing_only_fills_missing_keys(tmp_path):
  from jmoe import tune
  (tmp_path / "tgmm.json").write_text(json.dumps({"old": {"block_k": 64, "us": 1.0}}))
  res = [tune.TuneResult("tgmm", "old", {"block_k": 128}, 2.0, 1, 0),
         tune.TuneResult("tgmm", "new", {"block_k": 128}, 3.0, 1, 0)]
  tune.write_tables(res, str(tmp_path), "n", keep_existing=True)
  table = json.loads((tmp_path / "tgmm.json").read_text())
  assert table["old"] == {"block_k": 64, "us": 1.0}
  assert table["new"] == {"block_k": 128, "us": 3.0, "note": "n"}
  tune.write_tables(res, str(tmp_path), "n")
  assert json.loads((tmp_path / "tgmm.json").read_text())["old"]["us"] == 2.0


def test_tune_tables_filter_and_report():
  from jmoe.kernels import _compat
  from jmoe import tune
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this jax")
  seen = []
  res = tune.tune(4, 2, 64, 64, "silu", [8], interpret=True, max_candidates=2, iters=1,
                  tables=["grouped_gemm_gated"], report=lambda *a: seen.append(a))
  assert [r.kernel for r in res] == ["grouped_gemm_gated"]
  assert len(seen) == 2 == tune.num_candidates(4, 2, [8], training=False, max_candidates=2,
                                               tables=["grouped_gemm_gated"])
  assert all(t == 8 and k == "grouped_gemm_gated" and key == res[0].key and us > 0
             for t, k, key, _, us in seen)
  with pytest.raises(ValueError, match="not tuned tables"):
    tune.tune(4, 2, 64, 64, "silu", [8], interpret=True, tables=["gemm1"])


def test_tune_refuses_cpu_without_interpret(capsys):
  assert cli.main(["tune", "--preset", "qwen3-30b-a3b", "--tokens", "8"]) == 2
  assert "needs a GPU" in capsys.readouterr().out


def test_module_entry_point_help():
  r = subprocess.run([sys.executable, "-m", "jmoe", "--help"], capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0
  for cmd in ("bench", "check", "profile", "tune", "eplb"):
    assert cmd in r.stdout
