"""GPU benchmark + correctness check of seed 003: `moe_block(x, ..., residual=h)` (h + moe(x),
the add inside the final weighted gather-sum, the result able to take h's buffer) against the
separate add `h + moe_block(x, ...)`.

Run on the H200 (device tool):
  PYTHONPATH=$PWD python3 benchmarks/bench_residual.py \
      --presets qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --tokens 1,256,4096 \
      --backends pallas_mosaic,xla --skip deepseek-v3:4096:xla --out $OUT

Per preset x tokens x backend (bf16 weights and activations, the preset's routing, DeepSeek's
shared expert as a separate MLP), timed by the CUPTI kernel sum (jmoe.timing.device_time,
--rotate distinct inputs):
  one    one block: jit(moe_block(x, residual=h)) vs jit(h + moe_block(x)) (h not donated: the
         output is a fresh buffer in both; the fused form saves the add's kernel and its
         [T, H] read + write);
  chain  --chain blocks in one jit, h = block(x_i, residual=h) (each h dead after its block, so
         XLA may write the next in its buffer) vs h = h + block(x_i).
Checked in the same run: ||fused - separate|| / ||separate|| (<= 1e-2: bf16 rounding of the add
happens once instead of twice), the compiled donated form's alias bytes (= T*H*2 when XLA
writes the result in h's buffer), and the number of kernels each form launches. Printed: µs,
separate / fused, and a markdown table last. Writes <out>/bench_residual.json after every
variant (a timeout keeps what finished). Exit status 1 if a check failed.

Each preset's executables (fused, separate, fused with h donated; per variant) are lowered one
after another and compiled on --compile-threads host threads, all of them before the first is
timed (XLA's autotuner runs kernels on the GPU while compiling). On the H200 that took 90 s
for qwen3-30b-a3b's 12 variants (tokens 1,256,4096 x both backends x one,chain with --chain 2,
6 threads; 2026-12-01): run one preset a call, or fewer tokens / --variants one. --budget-s:
lower no new case after that many seconds (what is compiled is still timed); --skip preset:tokens:backend,...: cases left out (deepseek-v3 at 4096 tokens
on xla: `ragged_dot` computes every expert on every row there, about a second per call).

--interpret runs the "tiny" preset through the CPU (Pallas kernels in the interpreter, wall
time instead of device time): a smoke test of this script, not a measurement.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmoe  # noqa: E402
from jmoe import timing  # noqa: E402

TINY = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                      dtype="bfloat16")


def log(*a):
  print(*a, flush=True)


def make_params(c: jmoe.MoEConfig, key, chunk: int = 16) -> jmoe.MoEParams:
  """bf16 parameters for `c`, the expert weights drawn in chunks of experts (deepseek-v3's w13
  in f32 at once would be 30 GB)."""
  e, h, n = c.num_experts, c.hidden_size, c.intermediate_size
  ks = jax.random.split(key, 8)

  def normal(k, shape, fan_in):
    return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)).astype(jnp.bfloat16)

  def experts(k, shape, fan_in):
    parts = [jax.jit(lambda kk, s=(min(chunk, e - i),) + shape[1:]: normal(kk, s, fan_in))(
        jax.random.fold_in(k, i)) for i in range(0, e, chunk)]
    return jnp.concatenate(parts)

  p = dict(router_w=jax.random.normal(ks[0], (h, e), jnp.float32) / np.sqrt(h),
           w13=experts(ks[1], (e, h, c.w13_out), h), w2=experts(ks[2], (e, n, h), n))
  if c.use_correction_bias:
    p["correction_bias"] = jax.random.uniform(ks[3], (e,), jnp.float32, 0.0, 0.1)
  if c.num_shared_experts:
    ns = c.shared_size
    p["shared_w13"] = normal(ks[4], (h, 2 * ns), h)
    p["shared_w2"] = normal(ks[5], (ns, h), ns)
  return jmoe.MoEParams(**p)


def kernels_launched(compiled_text: str) -> int:
  """Fusions, custom calls (Pallas kernels, cuBLAS) and other top-level kernels of the entry
  computation: a rough count of the launches."""
  entry = compiled_text[compiled_text.index("\nENTRY"):]
  body = entry[:entry.index("\n}")]
  return sum(1 for ln in body.splitlines()
             if " fusion(" in ln or " custom-call(" in ln or " gather(" in ln or " dot(" in ln
             or " sort(" in ln or " scatter(" in ln)


def lower_case(c, params, t: int, backend: str, args, pool) -> list:
  """Traces and lowers one preset x tokens x backend case (both variants) and hands the three
  compiles of each variant (fused, separate, fused with h donated) to `pool`, so XLA compiles
  on several host threads while the next case is lowered. Returns the variants' jobs."""
  h_dim = c.hidden_size
  key = jax.random.key(t)
  # (h, x, params): the weights are an argument, not a closure (closed over, jit would bake
  # GBs of weights into the executable as constants: minutes of compile per variant on a GPU)
  sets = [tuple(jax.random.normal(jax.random.fold_in(key, 2 * i + j), (t, h_dim), jnp.bfloat16)
                for j in range(2)) + (params,) for i in range(args.rotate)]

  def fused(h, x, p):
    return jmoe.moe_block(x, p, c, runner_backend=backend, residual=h)

  def separate(h, x, p):
    return h + jmoe.moe_block(x, p, c, runner_backend=backend)

  def chain(block):
    def f(h, x, p):
      for i in range(args.chain):
        h = block(h, x if i == 0 else (x * (1.0 + 0.01 * i)).astype(x.dtype), p)
      return h
    return f

  variants = {"one": (fused, separate), "chain": (chain(fused), chain(separate))}
  jobs = []
  for name in args.variants.split(","):
    f_fused, f_sep = variants[name]
    rec = dict(preset=args.preset_name, tokens=t, backend=backend, variant=name)
    job = dict(rec=rec, sets=sets)
    jobs.append(job)
    try:
      a0 = sets[0]
      lowered = dict(fused=jax.jit(f_fused).lower(*a0), separate=jax.jit(f_sep).lower(*a0),
                     donated=jax.jit(f_fused, donate_argnums=0).lower(*a0))
      job["compiled"] = {k: pool.submit(lw.compile) for k, lw in lowered.items()}
    except Exception as exc:  # noqa: BLE001 (a backend that cannot run a shape is a finding)
      job["error"] = exc
      job["trace"] = traceback.format_exc()
  return jobs


def run_job(job: dict, h_dim: int, args) -> None:
  """Compiled (waits for the job's compiles), checked and timed: fills job["rec"]."""
  rec, sets = job["rec"], job["sets"]
  t, backend, name = rec["tokens"], rec["backend"], rec["variant"]
  try:
    if "error" in job:
      raise job["error"]
    jf, js, donated = (job["compiled"][k].result() for k in ("fused", "separate", "donated"))
    h0, x0, p0 = sets[0]
    a, b = jf(h0, x0, p0), js(h0, x0, p0)
    err = float(jnp.linalg.norm((a - b).astype(jnp.float32))
                / jnp.maximum(jnp.linalg.norm(b.astype(jnp.float32)), 1e-30))
    rec["rel_err"] = err
    mem = donated.memory_analysis()
    rec["alias_bytes"] = int(mem.alias_size_in_bytes) if mem is not None else -1
    rec["kernels_fused"] = kernels_launched(jf.as_text())
    rec["kernels_separate"] = kernels_launched(js.as_text())
    if args.interpret:
      rec["us_fused"] = timing.wall_time(jf, sets, iters=args.iters)
      rec["us_separate"] = timing.wall_time(js, sets, iters=args.iters)
    else:
      rec["us_fused"] = timing.device_time(jf, sets, iters=args.iters)[0]
      rec["us_separate"] = timing.device_time(js, sets, iters=args.iters)[0]
    rec["speedup"] = rec["us_separate"] / rec["us_fused"]
    rec["correct"] = bool(np.isfinite(err) and err <= 1e-2
                          and rec["alias_bytes"] in (-1, t * h_dim * 2))
    log(f"{rec['preset']:14s} T={t:5d} {backend:14s} {name:5s} fused {rec['us_fused']:9.1f}"
        f" µs  separate {rec['us_separate']:9.1f} µs  x{rec['speedup']:.3f}  err {err:.1e}"
        f"  alias {rec['alias_bytes']} B  kernels {rec['kernels_fused']}/"
        f"{rec['kernels_separate']}  {'ok' if rec['correct'] else 'FAILED'}")
  except Exception as exc:  # noqa: BLE001 (a backend that cannot run a shape is a finding)
    rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    rec["correct"] = False
    log(f"{rec['preset']} T={t} {backend} {name}: ERROR {rec['error']}")
    print(job.get("trace") or traceback.format_exc(), flush=True)
  finally:
    job.pop("compiled", None)  # the executables go with the job


def main(argv=None) -> int:
  t_start = time.perf_counter()
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
  ap.add_argument("--tokens", default="1,256,4096")
  ap.add_argument("--backends", default="pallas_mosaic,xla")
  ap.add_argument("--variants", default="one,chain", help="one, chain or both")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--rotate", type=int, default=3, help="distinct (h, x) input sets")
  ap.add_argument("--chain", type=int, default=4, help="blocks in the chain variant")
  ap.add_argument("--compile-threads", type=int, default=8,
                  help="host threads compiling a preset's executables in parallel")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="lower no new case after this many seconds (cases already compiled are "
                       "still timed; skipped cases are recorded as such)")
  ap.add_argument("--skip", default="",
                  help="preset:tokens:backend,... cases not to run (e.g. deepseek-v3:4096:xla: "
                       "XLA's ragged_dot computes every expert on every row, ~1 s a call)")
  ap.add_argument("--out", default=None, help="directory for bench_residual.json")
  ap.add_argument("--interpret", action="store_true",
                  help="tiny preset on the CPU, Pallas in the interpreter (a smoke test)")
  args = ap.parse_args(argv)
  if any(v not in ("one", "chain") for v in args.variants.split(",")):
    ap.error("--variants: one, chain or one,chain")
  if args.interpret:
    os.environ["JMOE_PALLAS_INTERPRET"] = "1"
    presets = {"tiny": TINY}
  else:
    presets = {name: jmoe.get_preset(name) for name in args.presets.split(",")}
  tokens = [int(t) for t in args.tokens.split(",")]
  backends = args.backends.split(",")
  skip = set(filter(None, args.skip.split(",")))
  log(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
  rows: list = []

  def write():
    if args.out:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, "bench_residual.json"), "w") as fh:
        json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                       args=dict(iters=args.iters, rotate=args.rotate, chain=args.chain,
                                 variants=args.variants),
                       wall_s=round(time.perf_counter() - t_start, 1), rows=rows), fh, indent=1)

  def over_budget():
    return args.budget_s is not None and time.perf_counter() - t_start > args.budget_s

  pool = concurrent.futures.ThreadPoolExecutor(max(1, args.compile_threads))
  for name, c in presets.items():
    c = dataclasses.replace(c, dtype="bfloat16")
    args.preset_name = name
    cases = [(t, b) for t in tokens for b in backends]
    if over_budget():
      for t, b in cases:
        rows.append(dict(preset=name, tokens=t, backend=b, error="skipped: --budget-s reached"))
      continue
    params = make_params(c, jax.random.key(0))
    jobs = []  # in the table's order; a skipped case is one job without executables
    for t, b in cases:
      why = ("--skip" if f"{name}:{t}:{b}" in skip else
             "--budget-s reached" if over_budget() else None)
      if why:
        jobs.append(dict(rec=dict(preset=name, tokens=t, backend=b, error=f"skipped: {why}"),
                         skipped=True))
      else:
        jobs += lower_case(c, params, t, b, args, pool)
    # every compile of the preset done before any timing: XLA's autotuner runs kernels on the
    # GPU while it compiles, which CUPTI would add to a concurrent measurement
    concurrent.futures.wait([f for job in jobs for f in job.get("compiled", {}).values()])
    log(f"{name}: {sum(1 for j in jobs if 'sets' in j)} variants lowered and compiled, "
        f"{time.perf_counter() - t_start:.0f} s")
    for job in jobs:  # compiled work is timed even past the budget (a few seconds a job)
      rows.append(job["rec"])
      if job.get("skipped"):
        continue
      run_job(job, c.hidden_size, args)
      write()
    del params, jobs
  pool.shutdown(wait=False, cancel_futures=True)
  write()
  log("")
  log("| preset | tokens | backend | variant | fused µs | separate µs | separate / fused | "
      "kernels fused / separate | alias bytes | rel err |")
  log("|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    if "us_fused" in r:
      log(f"| {r['preset']} | {r['tokens']} | {r['backend']} | {r['variant']} | "
          f"{r['us_fused']:.1f} | {r['us_separate']:.1f} | {r['speedup']:.3f} | "
          f"{r['kernels_fused']} / {r['kernels_separate']} | {r['alias_bytes']} | "
          f"{r['rel_err']:.1e} |")
    else:
      log(f"| {r['preset']} | {r['tokens']} | {r['backend']} | {r.get('variant', '')} | "
          f"{r.get('error', '')[:90]} | | | | | |")
  skipped = [r for r in rows if str(r.get("error", "")).startswith("skipped")]
  # (a skipped case's row has no variant: it stands for all of them)
  bad = [r for r in rows if not r.get("correct") and r not in skipped]
  log(f"{len(rows) - len(bad) - len(skipped)} variants correct, {len(bad)} failed, "
      f"{len(skipped)} skipped, wall {time.perf_counter() - t_start:.0f} s")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
