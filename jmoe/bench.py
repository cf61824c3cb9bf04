"""`python -m jmoe bench`: time the routed-expert block per backend against the roofline.

The block timed is `fused_moe` for fixed router outputs (softmax top-k of random logits):
permute, GEMM1, activation, GEMM2, weighted reduction. Every backend is checked against the
first one in the same run (relative Frobenius error), on fresh random data.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import platform as pyplatform
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jmoe import registry
from jmoe.api import fused_moe
from jmoe import timing
from jmoe.config import MoEConfig, QuantConfig, get_preset
from jmoe.oracle import platform_info
from jmoe.quant.kernel_layout import prepare_for_kernels
from jmoe.quant.calibration import calibrate_input_scales
from jmoe.quant.weights import quantize_weights, weight_bytes
from jmoe.router import select_experts

# Ceilings measured on an H200 (shared/research/peers-h200.md): dense bf16 matmul through XLA
# and device-to-device copy counting read + write.
H200_PEAK_FLOPS = 810e12
H200_BANDWIDTH = 4.3e12


@dataclasses.dataclass
class Machine:
  platform: str
  device_kind: str
  peak_flops: float
  bandwidth: float
  how: str


# CPU ceilings are measured once per machine and cached (`cache_path()`): measuring takes
# seconds, and a fresh measurement on a shared CPU drifts ~2x between runs, and "× roofline"
# with it.
REMEASURE_ENV = "JMOE_REMEASURE"
_MATMUL_SIZES = (1024, 2048)  # f32 n x n matmuls
_READ_MIB = (16, 128)  # one inside a typical L3, one outside: the ceiling is the faster
_REPEATS = 15


def cache_path() -> pathlib.Path:
  """`$XDG_CACHE_HOME/jmoe/ceilings.json` (default `~/.cache/jmoe/ceilings.json`)."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(root) / "jmoe" / "ceilings.json"


def cpu_model() -> str:
  """The CPU's marketing name ('AMD EPYC', 'Intel(R) Xeon(R) ...'), else the architecture."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.lower().startswith(("model name", "hardware")):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return pyplatform.processor() or pyplatform.machine() or "unknown CPU"


def _cores() -> int:
  try:
    return len(os.sched_getaffinity(0))  # the cores this process may use (taskset, cgroups)
  except AttributeError:
    return os.cpu_count() or 1


def machine_key(platform_name: str, kind: str) -> str:
  """What the ceilings depend on: CPU, cores, jax/jaxlib (XLA's kernels), backend, XLA_FLAGS."""
  import jaxlib  # noqa: PLC0415
  return "|".join([cpu_model(), f"cores={_cores()}", f"jax={jax.__version__}",
                   f"jaxlib={jaxlib.__version__}", f"{platform_name}:{kind}",
                   f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}"])


def _measure_ceilings() -> tuple[float, float]:
  """(peak FLOP/s, bandwidth B/s): the best of many runs of dense f32 matmuls and of
  streaming reads (a sum). Not `x + 1`: its fresh output buffer pays page faults on every call
  on a CPU, which made the bandwidth ~10x too low: a roofline time too long to be a bound."""
  flops = 0.0
  for n in _MATMUL_SIZES:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    flops = max(flops, 2 * n ** 3 / _best_time(lambda: mm(a), _REPEATS))  # noqa: B023
  bw = 0.0
  for mib in _READ_MIB:
    x = jnp.ones((mib << 18,), jnp.float32)
    rd = jax.jit(jnp.sum)
    bw = max(bw, x.nbytes / _best_time(lambda: rd(x), _REPEATS))  # noqa: B023
  return flops, bw


def measure_machine(remeasure: bool = False) -> Machine:
  """The two ceilings: H200 figures on a GPU; elsewhere measured once and cached per machine
  (`cache_path()`, keyed by `machine_key`). `remeasure` (or $JMOE_REMEASURE=1) measures again
  and keeps the best of the old and new figures: a ceiling is the most the machine was seen
  to do, so a run on a busy machine cannot lower it."""
  platform_name, _, kind = platform_info()
  if platform_name == "gpu":
    return Machine(platform_name, kind, H200_PEAK_FLOPS, H200_BANDWIDTH,
                   "H200 ceilings from shared/research/peers-h200.md")
  path, key = cache_path(), machine_key(platform_name, kind)
  kind = f"{cpu_model()}, {_cores()} cores" if platform_name == "cpu" else kind or platform_name
  remeasure = remeasure or os.environ.get(REMEASURE_ENV, "") not in ("", "0")
  try:
    cache = json.loads(path.read_text())
  except (OSError, ValueError):
    cache = {}
  old = cache.get(key)
  what = (f"best of {_REPEATS} runs: f32 matmul {'/'.join(map(str, _MATMUL_SIZES))}^2, "
          f"read {'/'.join(map(str, _READ_MIB))} MiB")
  if old is not None and not remeasure:
    return Machine(platform_name, kind, old["peak_flops"], old["bandwidth"],
                   f"measured {old['date']}, {what}; cached in {path}, --remeasure to redo")
  flops, bw = _measure_ceilings()
  if old is not None:
    flops, bw = max(flops, old["peak_flops"]), max(bw, old["bandwidth"])
  cache[key] = {"peak_flops": flops, "bandwidth": bw, "date": time.strftime("%Y-%m-%d")}
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # atomic: two runs at once cannot tear it
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)
    where = f"cached in {path}"
  except OSError as e:
    where = f"not cached ({e})"
  return Machine(platform_name, kind, flops, bw, f"measured now, {what}; {where}")


def _best_time(fn: Callable[[], jax.Array], repeats: int) -> float:
  """Fastest of `repeats` runs: a ceiling is what the machine can do, not its typical noise."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


CPU_TARGET_FLOPS = 2e8  # one scaled block at 64 tokens: a few ms on a laptop core


def scaled_for_cpu(cfg: MoEConfig, target_flops: float = CPU_TARGET_FLOPS, multiple: int = 16
                   ) -> tuple[MoEConfig, str]:
  """Shrink H and N (keeping E, k, ratios) so one block at 64 tokens costs ~target_flops;
  both stay multiples of `multiple` (128 where quantized weights need 128-wide blocks).

  Returns (config, note); the note says what was scaled, from what to what, and why."""
  flops = block_flops(64, cfg)
  f = math.sqrt(max(flops / target_flops, 1.0))
  if f <= 1.0:
    return cfg, f"full size: {shape_str(cfg)}"
  h = max(multiple, int(round(cfg.hidden_size / f / multiple)) * multiple)
  n = max(multiple, int(round(cfg.intermediate_size / f / multiple)) * multiple)
  small = cfg.replace(hidden_size=h, intermediate_size=n, shared_intermediate_size=None)
  return small, (f"scaled for CPU to keep the run short: hidden {cfg.hidden_size}→{h}, "
                 f"intermediate {cfg.intermediate_size}→{n} (each ÷{f:.1f}, so 64 tokens cost "
                 f"{block_flops(64, small) / 1e9:.2g} GFLOP instead of {flops / 1e9:.3g}); "
                 f"{cfg.num_experts} experts, top-{cfg.top_k} unchanged")


def bench_config(preset: str, scale: bool, quant: Sequence[str] = ()
                 ) -> tuple[MoEConfig, str]:
  """The preset's config as benchmarked, and the note on its shapes."""
  cfg = get_preset(preset)
  if not scale:
    return cfg, f"full size: {shape_str(cfg)}"
  return scaled_for_cpu(cfg, multiple=128 if quant else 16)


def shape_str(cfg: MoEConfig) -> str:
  return (f"E={cfg.num_experts} top-{cfg.top_k} hidden={cfg.hidden_size} "
          f"intermediate={cfg.intermediate_size}")


def legend(has_device: bool, has_peers: bool = False, has_quant: bool = False) -> str:
  """What the table's columns mean (printed under it)."""
  rate_time = "device µs" if has_device else "wall µs"
  return ("Timed: the routed expert block of one forward (permute, GEMM1, activation, GEMM2, "
          "weighted sum) for fixed router outputs, router excluded; median over calls rotating "
          "3 random problems. "
          "wall µs = host wall clock per call" +
          ("; device µs = sum of the call's GPU kernel durations (CUPTI)" if has_device else "") +
          f"; TFLOP/s, GB/s = the block's FLOPs (2·T·k·H·(W13+N)) and bytes (touched expert "
          f"weights + tokens in and out) per {rate_time}; roofline µs = max(FLOPs / peak, "
          f"bytes / bandwidth) at the ceilings above; × roofline = {rate_time} / roofline µs, "
          "so ≥ 1 (1 = at the ceiling); rel err = relative Frobenius error vs the first "
          "backend (ref)" + ("; peer:* = another library's kernels" if has_peers else "") +
          ("; 'backend scheme' rows run weights quantized to that scheme (bytes: the packed "
           "weights and scales), their rel err against the dense ref is the scheme's accuracy"
           if has_quant else "") + ".")


def plot_title(preset: str, dtype: str, machine: Machine, cfg: MoEConfig, scaled: bool) -> str:
  return (f"jmoe bench: {preset} routed experts, forward, {dtype}\n"
          f"{machine.device_kind} ({machine.platform}); {shape_str(cfg)}"
          + (" (scaled for CPU)" if scaled else ""))


def block_flops(tokens: int, cfg: MoEConfig) -> float:
  """FLOPs of the routed block: 2·T·k·H·W1 + 2·T·k·N·H."""
  return 2.0 * tokens * cfg.top_k * cfg.hidden_size * (cfg.w13_out + cfg.intermediate_size)


def block_bytes(tokens: int, cfg: MoEConfig, touched_experts: int, itemsize: int) -> float:
  """Distinct expert weights touched + activations in and out."""
  per_expert = cfg.hidden_size * (cfg.w13_out + cfg.intermediate_size) * itemsize
  return touched_experts * per_expert + 2 * tokens * cfg.hidden_size * itemsize


@dataclasses.dataclass
class Row:
  preset: str
  tokens: int
  backend: str
  time_us: float
  tflops: float
  gbps: float
  roofline_us: float
  ratio_to_roofline: float
  rel_err: Optional[float]
  error: Optional[str] = None
  # GPU: kernels only (jax: CUPTI sum of the call's kernels; torch: one CUDA-graph replay)
  device_us: Optional[float] = None


WEIGHT_DISTS = ("gaussian", "llm")


def random_weights(key, shape: tuple, fan_in: int, dist: str = "gaussian") -> jax.Array:
  """Expert weights [E, K, N] float32 with std about 1/sqrt(fan_in) (K = fan_in).
  "gaussian": i.i.d. normal (the 4-bit formats' hard case: no structure for the scales to
  follow). "llm": a model of trained LLM weights' known shape -- heavy tails (Student-t,
  4 degrees of freedom, unit variance) and output channels of different size (a log-normal
  scale per column, sigma 0.5) -- for accuracy figures closer to checkpoints'; not a
  checkpoint's distribution."""
  if dist not in WEIGHT_DISTS:
    raise ValueError(f"weights={dist!r}: one of {', '.join(WEIGHT_DISTS)}")
  if dist == "gaussian":
    return jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)
  kt, kv, kc = jax.random.split(key, 3)
  df = 4  # Student-t as z / sqrt(chi2_df / df), chi2_df a sum of df squared normals: the same
  # law as jax.random.t, whose gamma sampler (a while loop) takes seconds to compile on a CPU
  chi2 = jnp.sum(jnp.square(jax.random.normal(kv, (df,) + shape, jnp.float32)), axis=0)
  w = jax.random.normal(kt, shape, jnp.float32) * lax.rsqrt(chi2 / df) / math.sqrt(df / (df - 2))
  sigma = 0.5
  cols = jnp.exp(sigma * jax.random.normal(kc, shape[:1] + (1,) + shape[2:], jnp.float32)
                 - sigma * sigma)  # (E[cols^2] = 1)
  return w * cols / math.sqrt(fan_in)


def make_problem(cfg: MoEConfig, tokens: int, dtype, seed: int, weights: str = "gaussian"):
  """Random weights (`random_weights` of distribution `weights`) and routing for one problem;
  returns (args, touched_experts)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  e, h, n, w = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.w13_out
  x = jax.random.normal(ks[0], (tokens, h), jnp.float32).astype(dtype)
  w13 = random_weights(ks[1], (e, h, w), h, weights).astype(dtype)
  w2 = random_weights(ks[2], (e, n, h), n, weights).astype(dtype)
  logits = jax.random.normal(ks[3], (tokens, e), jnp.float32)
  weights, ids = select_experts(x, logits, cfg.top_k, renormalize=True)
  touched = int(np.unique(np.asarray(ids)).size)
  return (x, w13, w2, weights, ids), touched


def quantized_problems(problems, scheme: str, cfg: MoEConfig, prepare: bool = False):
  """The problems with w13 / w2 quantized to `scheme` (once, outside the timed calls), and
  with `prepare` the kernels' derived operands made once too (`prepare_for_kernels`, as a
  loaded model holds them)."""
  out = []
  for (x, w13, w2, tw, ti), touched in problems:
    s13 = s2 = None
    if QuantConfig(scheme).static_activations:  # calibrated on the problem's tokens
      s13, s2 = calibrate_input_scales(x, w13, w2, ti, scheme, activation=cfg.act)
    q13 = quantize_weights(w13, scheme, input_scale=s13, argname="w13")
    q2 = quantize_weights(w2, scheme, input_scale=s2, argname="w2")
    if prepare:
      dt = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
      q13, q2 = prepare_for_kernels(q13, q2, activation=cfg.act, dtype=dt)
    out.append(((x, q13, q2, tw, ti), touched))
  return out


def _backend_fn(backend: str, cfg: MoEConfig) -> Callable:
  act = cfg.act
  return jax.jit(lambda x, w13, w2, tw, ti: fused_moe(x, w13, w2, tw, ti, activation=act,
                                                       runner_backend=backend))


def _rel_err(out, ref) -> float:
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def default_backends(platform: str) -> list[str]:
  if platform == "gpu":
    names = ["xla"]
    if "pallas_mosaic" in registry.RUNNERS:
      names.insert(0, "pallas_mosaic")
    return names
  return ["xla", "xla_batched", "reference"]


def run_bench(preset: str, tokens: Sequence[int], backends: Sequence[str], dtype: str,
              machine: Machine, *, scale: bool, repeats: int = 10, rotate: int = 3,
              progress=None, peers: Sequence[str] = (), quant: Sequence[str] = (),
              weights: str = "gaussian") -> tuple[list[Row], str]:
  """Time each backend at each token count, dense and then with the weights quantized to each
  `quant` scheme (rows "backend scheme"; their rel err is against the dense reference, so it
  is the scheme's accuracy). weights: the weights' distribution (`random_weights`).
  Returns (rows, scaling note)."""
  cfg, note = bench_config(preset, scale, quant)
  jdtype = jnp.dtype(dtype)
  rows: list[Row] = []
  fns = {b: _backend_fn(b, cfg) for b in backends}
  for t in tokens:
    problems = [make_problem(cfg, t, jdtype, seed, weights) for seed in range(rotate)]
    touched = problems[0][1]
    flops = block_flops(t, cfg)
    nbytes = block_bytes(t, cfg, touched, jdtype.itemsize)
    roof = max(flops / machine.peak_flops, nbytes / machine.bandwidth)
    ref_out = None
    runs = [(b, None) for b in list(backends) + list(peers)]
    runs += [(b, q) for q in quant for b in backends]
    prepare = jax.default_backend() == "gpu"  # (the CPU runs XLA: no Pallas operands)
    quantized = {q: quantized_problems(problems, q, cfg, prepare) for q in quant}
    for b, q in runs:
      label = (b if b in backends else f"peer:{b}") + (f" {q}" if q else "")
      try:
        dev = None
        if q is not None:
          fn = fns[b]
          qproblems = quantized[q]
          outs = [fn(*p[0]) for p in qproblems]
          arg_sets = [p[0] for p in qproblems]
          iters = max(1, repeats // rotate)
          dt = timing.wall_time(fn, arg_sets, iters=iters) / 1e6
          if machine.platform == "gpu":
            dev = timing.device_time(fn, arg_sets, iters=iters)[0] / 1e6
          qbytes = touched * (weight_bytes(arg_sets[0][1]) + weight_bytes(arg_sets[0][2])) \
              / cfg.num_experts + 2 * t * cfg.hidden_size * jdtype.itemsize
        elif b in backends:
          fn = fns[b]
          outs = [fn(*p[0]) for p in problems]  # compile + correctness on fresh data
          arg_sets = [p[0] for p in problems]
          iters = max(1, repeats // rotate)
          dt = timing.wall_time(fn, arg_sets, iters=iters) / 1e6
          if machine.platform == "gpu":
            dev = timing.device_time(fn, arg_sets, iters=iters)[0] / 1e6
        else:
          from jmoe import bench_peers  # noqa: PLC0415 (torch only when asked)
          outs, dt, dev = bench_peers.run_peer(b, cfg, [p[0] for p in problems], repeats)
        if ref_out is None:
          ref_out, err = outs, None
        else:
          err = max(_rel_err(o, r) for o, r in zip(outs, ref_out))
        # rates and the roofline ratio from the kernels-only time where there is one
        d = dev if dev is not None and dev == dev else dt
        row_bytes = qbytes if q is not None else nbytes
        # 8-bit weights: their own floor (half the bytes); the FLOP ceiling stays the dense one
        row_roof = max(flops / machine.peak_flops, row_bytes / machine.bandwidth)
        rows.append(Row(preset, t, label, dt * 1e6, flops / d / 1e12, row_bytes / d / 1e9,
                        row_roof * 1e6, d / row_roof, err,
                        device_us=None if dev is None else dev * 1e6))
      except Exception as e:  # one failing backend must not hide the others
        rows.append(Row(preset, t, label, float("nan"), float("nan"), float("nan"), roof * 1e6,
                        float("nan"), None, f"{type(e).__name__}: {str(e)[:200]}"))
      if progress is not None:
        progress()
  return rows, note


def rows_to_json(rows: list[Row], machine: Machine, note: str, dtype: str) -> str:
  return json.dumps({"machine": dataclasses.asdict(machine), "scaling": note, "dtype": dtype,
                     "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
                     "rows": [dataclasses.asdict(r) for r in rows]}, indent=1)


def plot_rows(rows: list[Row], path: str, title: Optional[str] = None) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for backend in dict.fromkeys(r.backend for r in rows):
    pts = [(r.tokens, r.time_us) for r in rows if r.backend == backend and r.error is None]
    if pts:
      ax.plot(*zip(*pts), marker="o", label=backend)
  roof = sorted({(r.tokens, r.roofline_us) for r in rows})
  ax.plot(*zip(*roof), "k--", label="roofline")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("tokens")
  ax.set_ylabel("wall µs per block")
  ax.set_title(title or f"jmoe bench: {rows[0].preset}", fontsize=10)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
