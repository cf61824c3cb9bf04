"""`python -m jmoe bench`: time the routed-expert block per backend against the roofline.

The block timed is `fused_moe` for fixed router outputs (softmax top-k of random logits):
permute, GEMM1, activation, GEMM2, weighted reduction. Every backend is checked against the
first one in the same run (relative Frobenius error), on fresh random data.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import registry
from jmoe.api import fused_moe
from jmoe import timing
from jmoe.config import MoEConfig, get_preset
from jmoe.oracle import platform_info
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


def measure_machine() -> Machine:
  """The two ceilings: H200 figures on a GPU, a quick measurement elsewhere."""
  platform, cc, kind = platform_info()
  if platform == "gpu":
    return Machine(platform, kind, H200_PEAK_FLOPS, H200_BANDWIDTH,
                   "H200 ceilings from shared/research/peers-h200.md")
  n = 1024
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  mm = jax.jit(lambda a: a @ a)
  t = _best_time(lambda: mm(a), repeats=10)
  big = jnp.ones((1 << 24,), jnp.float32)
  cp = jax.jit(lambda x: x + 1.0)
  tc = _best_time(lambda: cp(big), repeats=10)
  return Machine(platform, kind or platform, 2 * n ** 3 / t, 2 * big.nbytes / tc,
                 f"measured here: f32 {n}^3 matmul, {big.nbytes >> 20} MiB x+1")


def _best_time(fn: Callable[[], jax.Array], repeats: int) -> float:
  """Fastest of `repeats` runs: a ceiling is what the machine can do, not its typical noise."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


def scaled_for_cpu(cfg: MoEConfig, target_flops: float = 2e8) -> tuple[MoEConfig, str]:
  """Shrink H and N (keeping E, k, ratios) so one block at 64 tokens costs ~target_flops."""
  flops = 64 * cfg.top_k * 2 * cfg.hidden_size * (cfg.w13_out + cfg.intermediate_size)
  f = math.sqrt(max(flops / target_flops, 1.0))
  if f <= 1.0:
    return cfg, "full size"
  h = max(16, int(round(cfg.hidden_size / f / 16)) * 16)
  n = max(16, int(round(cfg.intermediate_size / f / 16)) * 16)
  small = cfg.replace(hidden_size=h, intermediate_size=n, shared_intermediate_size=None)
  return small, (f"scaled for CPU: hidden {cfg.hidden_size}->{h}, intermediate "
                 f"{cfg.intermediate_size}->{n} (experts and top-k unchanged)")


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


def make_problem(cfg: MoEConfig, tokens: int, dtype, seed: int):
  """Random weights and routing for one problem; returns (args, touched_experts)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  e, h, n, w = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.w13_out
  x = jax.random.normal(ks[0], (tokens, h), jnp.float32).astype(dtype)
  w13 = (jax.random.normal(ks[1], (e, h, w), jnp.float32) / math.sqrt(h)).astype(dtype)
  w2 = (jax.random.normal(ks[2], (e, n, h), jnp.float32) / math.sqrt(n)).astype(dtype)
  logits = jax.random.normal(ks[3], (tokens, e), jnp.float32)
  weights, ids = select_experts(x, logits, cfg.top_k, renormalize=True)
  touched = int(np.unique(np.asarray(ids)).size)
  return (x, w13, w2, weights, ids), touched


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
              progress=None, peers: Sequence[str] = ()) -> tuple[list[Row], str]:
  """Time each backend at each token count. Returns (rows, scaling note)."""
  cfg = get_preset(preset)
  note = "full size"
  if scale:
    cfg, note = scaled_for_cpu(cfg)
  jdtype = jnp.dtype(dtype)
  rows: list[Row] = []
  fns = {b: _backend_fn(b, cfg) for b in backends}
  for t in tokens:
    problems = [make_problem(cfg, t, jdtype, seed) for seed in range(rotate)]
    touched = problems[0][1]
    flops = block_flops(t, cfg)
    nbytes = block_bytes(t, cfg, touched, jdtype.itemsize)
    roof = max(flops / machine.peak_flops, nbytes / machine.bandwidth)
    ref_out = None
    for b in list(backends) + list(peers):
      label = b if b in backends else f"peer:{b}"
      try:
        dev = None
        if b in backends:
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
        rows.append(Row(preset, t, label, dt * 1e6, flops / d / 1e12, nbytes / d / 1e9,
                        roof * 1e6, d / roof, err,
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


def plot_rows(rows: list[Row], path: str) -> None:
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
  ax.set_ylabel("time per block (µs)")
  ax.set_title(f"jmoe bench: {rows[0].preset}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
