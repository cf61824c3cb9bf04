"""`python -m jmoe ...` commands, run in-process on tiny settings."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console

from jmoe import bench, cli


@pytest.fixture(autouse=True, scope="module")
def _ceiling_cache(tmp_path_factory):
  """The CPU ceilings go to a cache of this module's own, measured once, not to ~/.cache."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    mp.delenv(bench.REMEASURE_ENV, raising=False)
    yield


def _flat(text: str) -> str:
  """Console output with its line wrapping undone."""
  return " ".join(text.split())


def test_check_prints_matrix_and_oracle(capsys, monkeypatch):
  monkeypatch.delenv("COLUMNS", raising=False)  # piped, as in a log (xdist workers set it)
  assert cli.main(["check"]) == 0
  out = capsys.readouterr().out
  for name in ("reference", "xla", "xla_batched", "pallas_mosaic", "none:standard",
               "none:batched", "oracle here: "):
    assert name in out
  # piped (not a tty): the table at its natural width, every name whole, nothing cut
  assert "…" not in out
  for name in ("pallas_mosaic_batched", "ragged_dedup:standard", "ok (unavailable here)",
               "✗ standard ≠ batched"):
    assert name in out


def _table_cells(text: str) -> list[list[str]]:
  """The cells of a rendered rich table (header first), each cell's wrapped lines joined and
  its spaces dropped."""
  rows, lines = [], []
  for line in text.splitlines() + [""]:
    if line[:1] in ("┃", "│"):
      lines.append(re.split("[┃│]", line)[1:-1])
    elif lines:
      rows.append(["".join(col).replace(" ", "") for col in zip(*lines)])
      lines = []
  return rows


def test_check_cells_are_whole_on_a_narrow_terminal(monkeypatch):
  buf = io.StringIO()
  monkeypatch.setattr(cli, "console", Console(file=buf, width=60, force_terminal=True,
                                              color_system=None))
  assert cli.main(["check"]) == 0
  out = buf.getvalue()
  assert "…" not in out
  experts, cells = cli.compatibility_matrix()
  want = [["prepare/finalize \\ experts"]
          + [f"{c.name}({c.activation_formats[0].value})" for c in experts]]
  want += [[label, *row] for label, row in cells]
  assert _table_cells(out) == [[c.replace(" ", "") for c in r] for r in want]
  for cls in experts:  # the availability reasons below the table, in full
    assert f"{cls.name}: " in out and _flat(cls.is_available()[1]) in _flat(out)


def test_bare_command_lists_the_commands(capsys):
  assert cli.main([]) == 0
  out = capsys.readouterr().out
  for cmd, what in (("bench", "time the MoE expert block"), ("check", "print the prepare"),
                    ("profile", "write a jax.profiler trace"), ("tune", "autotune"),
                    ("eplb", "simulate expert-parallel")):
    assert re.search(rf"^\s+{cmd}\s+{what}", out, re.M), cmd


@pytest.mark.slow  # (README's main command runs the bench in every fresh-clone check; the
@pytest.mark.exhaustive  # bench's path is lean in test_bench_reports_a_failing_backend_...)
def test_bench_writes_json_and_plot(tmp_path, capsys):
  js, png = tmp_path / "b.json", tmp_path / "b.png"
  rc = cli.main(["bench", "--preset", "qwen3-30b-a3b", "--tokens", "1,8", "--backends",
                 "xla,xla_batched", "--repeats", "2", "--json", str(js), "--plot", str(png)])
  assert rc == 0
  out = _flat(capsys.readouterr().out)
  assert "scaled for CPU" in out and "roofline" in out
  cfg, note = bench.bench_config("qwen3-30b-a3b", scale=True)
  assert f"shapes: {note}; --scale no for the preset's full size" in out
  assert bench.legend(has_device=False) in out  # under the table
  data = json.loads(js.read_text())
  rows = data["rows"]
  assert {(r["tokens"], r["backend"]) for r in rows} == {(1, "xla"), (1, "xla_batched"),
                                                          (8, "xla"), (8, "xla_batched")}
  for r in rows:
    assert r["error"] is None and r["time_us"] > 0 and r["roofline_us"] > 0
    if r["backend"] == "xla_batched":
      assert r["rel_err"] < 1e-5  # checked against the first backend in the same run
  assert png.stat().st_size > 1000


@pytest.mark.slow
def test_bench_quant_shows_speed_and_accuracy(tmp_path, capsys):
  js = tmp_path / "q.json"
  rc = cli.main(["bench", "--preset", "mixtral-8x7b", "--tokens", "4", "--backends", "xla",
                 "--quant", "fp8_block,int8", "--repeats", "1", "--json", str(js)])
  assert rc == 0
  out = _flat(capsys.readouterr().out)
  assert bench.legend(False, False, True) in out
  cfg, _ = bench.bench_config("mixtral-8x7b", True, ["fp8_block"])
  assert cfg.hidden_size % 128 == 0 and cfg.intermediate_size % 128 == 0  # 128-wide blocks
  rows = {r["backend"]: r for r in json.loads(js.read_text())["rows"]}
  assert set(rows) == {"xla", "xla fp8_block", "xla int8"}
  assert 0.005 < rows["xla int8"]["rel_err"] < rows["xla fp8_block"]["rel_err"] < 0.1
  with pytest.raises(SystemExit):
    cli.main(["bench", "--quant", "fp7"])
  assert "'fp7' is not a quantization scheme" in capsys.readouterr().err


@pytest.mark.slow  # (two bench runs: ~30 s; a benchmark option, asked-for-only)
@pytest.mark.exhaustive
def test_bench_weights_llm_changes_the_accuracy_not_the_scale(tmp_path):
  """--weights llm: heavy-tailed weights with columns of different size, the same std as the
  Gaussian ones; the block runs and the 4-bit scheme's error differs from the Gaussian run's."""
  import jax
  w = np.asarray(bench.random_weights(jax.random.key(0), (2, 256, 512), 256, "llm")) * 16
  assert abs(w.std() - 1) < 0.1 and (np.abs(w) > 5).mean() > 1e-3  # heavier tails than N(0, 1)
  errs = {}
  for dist in bench.WEIGHT_DISTS:
    js = tmp_path / f"{dist}.json"
    assert cli.main(["bench", "--preset", "mixtral-8x7b", "--tokens", "4", "--backends", "xla",
                     "--quant", "w4a16", "--repeats", "1", "--weights", dist,
                     "--json", str(js)]) == 0
    rows = {r["backend"]: r for r in json.loads(js.read_text())["rows"]}
    errs[dist] = rows["xla w4a16"]["rel_err"]
  assert all(0.01 < e < 0.5 for e in errs.values()) and errs["llm"] != errs["gaussian"]
  with pytest.raises(ValueError, match="weights='uniform'"):
    bench.random_weights(jax.random.key(0), (1, 8, 8), 8, "uniform")


def test_check_quant_prints_the_choice_and_why(capsys):
  assert cli.main(["check", "--quant", "fp8_block"]) == 0
  out = _flat(capsys.readouterr().out)
  assert "QuantConfig(fp8_block)" in out and "XlaExperts()" in out
  assert "pallas_mosaic skipped" in out
  assert cli.main(["check", "--quant", "mxfp4"]) == 0  # 4-bit: XLA dequantizes in the graph
  out = _flat(capsys.readouterr().out)
  assert "QuantConfig(mxfp4)" in out and "XlaExperts()" in out


def test_bench_reports_a_failing_backend_without_hiding_others(capsys):
  rc = cli.main(["bench", "--preset", "mixtral-8x7b", "--tokens", "1", "--backends",
                 "xla,pallas_mosaic", "--repeats", "1"])
  assert rc == 1  # pallas_mosaic cannot run on CPU: reported as failed, xla still timed
  out = capsys.readouterr().out
  assert "failed" in out and "xla" in out


def test_bench_scaling_note_says_what_from_what_and_why():
  cfg, note = bench.bench_config("mixtral-8x7b", scale=True)
  assert (cfg.hidden_size, cfg.intermediate_size) == (272, 960)
  assert note.startswith("scaled for CPU to keep the run short: hidden 4096→272, "
                         "intermediate 14336→960 (each ÷15.0, so 64 tokens cost 0.2 GFLOP "
                         "instead of 45.1)")
  assert note.endswith("8 experts, top-2 unchanged")
  assert bench.bench_config("mixtral-8x7b", scale=False)[1] == (
      "full size: E=8 top-2 hidden=4096 intermediate=14336")


def test_bench_legend_explains_every_column():
  cpu, gpu = bench.legend(has_device=False), bench.legend(has_device=True, has_peers=True)
  for text in (cpu, gpu):
    for what in ("routed expert block", "router excluded", "wall µs = host wall clock",
                 "TFLOP/s, GB/s", "roofline µs = max(FLOPs / peak, bytes / bandwidth)",
                 "so ≥ 1", "error vs the first backend"):
      assert what in text, what
  assert "× roofline = wall µs / roofline µs" in cpu and "device µs" not in cpu
  assert "device µs = sum of the call's GPU kernel durations" in gpu
  assert "× roofline = device µs / roofline µs" in gpu and "peer:*" in gpu


def test_bench_plot_title_names_device_dtype_and_shapes():
  cfg, _ = bench.bench_config("mixtral-8x7b", scale=True)
  m = bench.Machine("cpu", "AMD EPYC, 2 cores", 1e11, 5e10, "")
  title = bench.plot_title("mixtral-8x7b", "float32", m, cfg, scaled=True)
  for what in ("mixtral-8x7b", "float32", "AMD EPYC, 2 cores (cpu)", "hidden=272",
               "intermediate=960", "E=8 top-2", "scaled for CPU"):
    assert what in title, what


def test_cpu_ceilings_measured_once_per_machine_and_kept_at_their_best(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  measured = iter([(1e11, 4e10), (5e10, 6e10), (2e11, 1e10)])
  calls = []

  def fake():
    calls.append(1)
    return next(measured)

  monkeypatch.setattr(bench, "_measure_ceilings", fake)
  first = bench.measure_machine()
  again = bench.measure_machine()
  assert len(calls) == 1 and (again.peak_flops, again.bandwidth) == (1e11, 4e10)
  assert "cached in" in again.how and "--remeasure" in again.how
  cache = json.loads((tmp_path / "jmoe" / "ceilings.json").read_text())
  (key, entry), = cache.items()
  import jax
  for fact in (bench.cpu_model(), "cores=", f"jax={jax.__version__}", "cpu"):
    assert fact in key
  assert (entry["peak_flops"], entry["bandwidth"]) == (first.peak_flops, first.bandwidth)
  m = bench.measure_machine(remeasure=True)  # a slower run cannot lower a ceiling
  assert len(calls) == 2 and (m.peak_flops, m.bandwidth) == (1e11, 6e10)
  monkeypatch.setenv(bench.REMEASURE_ENV, "1")
  m = bench.measure_machine()
  assert len(calls) == 3 and (m.peak_flops, m.bandwidth) == (2e11, 6e10)


def test_eplb_redundant_not_fitting_the_devices_is_an_error(capsys):
  with pytest.raises(SystemExit) as e:  # deepseek-v3: 256 experts over the default --ep 64
    cli.main(["eplb", "--redundant", "32"])
  assert e.value.code == 2
  err = _flat(capsys.readouterr().err)
  assert "eplb: error: --redundant=32: must be a multiple of --ep=64" in err
  assert "try --redundant 0 or 64" in err
  with pytest.raises(SystemExit):  # 128 experts over 12 devices: 4 more make 132
    cli.main(["eplb", "--preset", "qwen3-30b-a3b", "--ep", "12", "--redundant", "3"])
  err = _flat(capsys.readouterr().err)
  assert "--redundant=3: must make 128 experts + redundant a multiple of --ep=12" in err
  assert "try --redundant 4" in err


def test_eplb_default_redundant_is_one_per_device(capsys):
  assert cli.main(["eplb", "--preset", "qwen3-30b-a3b", "--ep", "8", "--tokens", "256"]) == 0
  assert "physical experts 136 (8 redundant)" in capsys.readouterr().out


def test_eplb_simulation(tmp_path, capsys):
  png = tmp_path / "eplb.png"
  assert cli.main(["eplb", "--preset", "qwen3-30b-a3b", "--ep", "8", "--redundant", "8",
                   "--skew", "1.0", "--tokens", "2048", "--plot", str(png)]) == 0
  assert "balancedness" in capsys.readouterr().out
  assert png.exists()


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow  # (CI time: the lean tier keeps test_tune_tables_filter_and_report)
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


@pytest.mark.slow
@pytest.mark.parametrize("scheme,tables", [("fp8_channel", ("grouped_gemm_gated", "grouped_gemm")),
                                           ("fp8_block", ("grouped_gemm_fp8_block",))])
def test_tune_quant_writes_8bit_tables_the_kernels_read(scheme, tables, tmp_path, monkeypatch):
  """`tune --quant`: the 8-bit problems' winners under the 8-bit dtype's keys, and
  q8_config / block_config read them back."""
  import jax.numpy as jnp
  from jmoe.kernels import _compat
  from jmoe.kernels import grouped_gemm as gg
  from jmoe.kernels import grouped_gemm_q8 as q8
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this jax")
  rc = cli.main(["tune", "--shape", "4,2,128,128", "--tokens", "8", "--interpret", "--quant",
                 scheme, "--max-candidates", "1", "--iters", "1", "--draws", "1",
                 "--out", str(tmp_path), "--log", str(tmp_path / "log.json")])
  assert rc == 0
  log = json.loads((tmp_path / "log.json").read_text())["candidates"]
  assert [c["table"] for c in log] == list(tables)  # (one candidate a problem: CI's budget)
  for tb in tables:
    (key, entry), = json.loads((tmp_path / f"{tb}.json").read_text()).items()
    assert ",dtype=float8_e4m3fn," in key and entry["us"] > 0 and "--quant" in entry["note"]
  # the kernels' config functions read these tables (device kind as the tuning run wrote it)
  monkeypatch.setattr(gg, "_CONFIG_DIR", str(tmp_path))
  monkeypatch.setattr(_compat, "device_kind", lambda: "interpret")
  gg._load_tuned.cache_clear()
  try:
    if scheme == "fp8_block":
      entry = next(iter(json.loads((tmp_path / f"{tables[0]}.json").read_text()).values()))
      got = q8.block_config(16, 128, 128, 4, gated=True, quantize_output=True)
      assert got == q8.BlockQ8Config(**{f: entry[f] for f in got.to_json()})
    else:
      entry = next(iter(json.loads((tmp_path / "grouped_gemm_gated.json").read_text()).values()))
      got = q8.q8_config(16, 128, 128, 4, gated=True, dtype=jnp.float8_e4m3fn)
      assert (got.block_m, got.block_n, got.block_k) == (entry["block_m"], entry["block_n"], 128)
      assert q8.q8_config(16, 128, 128, 4, gated=True, dtype=jnp.int8) == q8.q8_config(
          16, 128, 128, 3, gated=True, dtype=jnp.int8)  # no int8 entry: the heuristic
  finally:
    gg._load_tuned.cache_clear()


@pytest.mark.slow
def test_tune_quant_weight_only_writes_tables_the_prefill_gemms_read(tmp_path, monkeypatch):
  """`tune --quant w4a16`: grouped_gemm_wq_ws' GEMM1 / GEMM2 winners under the format's
  label, and its default_config reads them back (a config that cannot run the problem --
  here for float32 outputs -- is passed over for the built-in choice)."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  import jmoe
  from jmoe.kernels import _compat
  from jmoe.kernels import grouped_gemm as gg
  from jmoe.kernels import grouped_gemm_ws as ws
  from jmoe.kernels import grouped_gemm_wq_ws as wq_ws
  from jmoe.quant import quantize_weights
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this jax")
  rc = cli.main(["tune", "--shape", "4,2,256,128", "--tokens", "64", "--interpret", "--quant",
                 "w4a16", "--max-candidates", "1", "--iters", "1", "--draws", "1",
                 "--out", str(tmp_path), "--log", str(tmp_path / "log.json")])
  assert rc == 0
  log = json.loads((tmp_path / "log.json").read_text())["candidates"]
  assert [c["table"] for c in log] == list(wq_ws.TABLES)  # (one candidate a problem)
  entries = {}
  for tb in wq_ws.TABLES:
    (key, entry), = json.loads((tmp_path / f"{tb}.json").read_text()).items()
    assert ",dtype=int4/g128," in key and entry["us"] > 0 and "--quant w4a16" in entry["note"]
    entries[tb] = ws.WSConfig(**{f: entry[f] for f in ws.WSConfig().to_json()})
  monkeypatch.setattr(gg, "_CONFIG_DIR", str(tmp_path))
  monkeypatch.setattr(_compat, "device_kind", lambda: "interpret")
  gg._load_tuned.cache_clear()
  try:
    quant = jmoe.QuantConfig("w4a16")
    w13 = jax.eval_shape(lambda: quantize_weights(jnp.zeros((4, 256, 256)), quant))
    w2 = jax.eval_shape(lambda: quantize_weights(jnp.zeros((4, 128, 256)), quant))
    assert wq_ws.default_config(w13, 128, True, jnp.bfloat16, 128) == entries[wq_ws.TABLES[0]]
    assert wq_ws.default_config(w2, 256, False, jnp.bfloat16, 128) == entries[wq_ws.TABLES[1]]
    big = dataclasses.replace(entries[wq_ws.TABLES[1]], block_m=256, block_n=128, num_stages=4)
    (tmp_path / f"{wq_ws.TABLES[1]}.json").write_text(json.dumps(
        {k: dict(big.to_json(), us=1.0) for k in json.loads(
            (tmp_path / f"{wq_ws.TABLES[1]}.json").read_text())}))
    gg._load_tuned.cache_clear()
    assert wq_ws.default_config(w2, 256, False, jnp.bfloat16, 128, jnp.float32) != big
  finally:
    gg._load_tuned.cache_clear()


def test_tune_quant_refuses_schemes_it_cannot_time():
  with pytest.raises(ValueError, match="8-bit W8A8"):
    cli.main(["tune", "--shape", "4,2,128,128", "--tokens", "8", "--interpret", "--quant",
              "w4afp8"])
