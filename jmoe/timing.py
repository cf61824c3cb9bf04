"""Device-time measurement shared by `python -m jmoe bench`, `sharding.bench` and the GPU
benchmark scripts.

`device_time` sums the CUPTI-recorded durations of every kernel one call launches (jax's Mosaic
GPU profiler): the figure kernel papers and vLLM's kernel benchmarks report, free of host
dispatch and launch gaps. GPU only; wall-clock timing (`wall_time`) is for every platform, and
`throughput_time` (pipelined wall clock) is the one for programs that span several GPUs.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import jax


def wall_time(fn: Callable, arg_sets: Sequence[tuple], iters: int = 10, warmup: int = 1) -> float:
  """Median wall-clock µs of fn(*args) (blocked on), rotating over arg_sets."""
  for _ in range(warmup):
    for args in arg_sets:
      jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(iters):
    for args in arg_sets:
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      ts.append((time.perf_counter() - t0) * 1e6)
  return statistics.median(ts)


def throughput_time(fn: Callable, arg_sets: Sequence[tuple], calls: int = 20, reps: int = 5
                    ) -> float:
  """Median over `reps` of (wall time of `calls` back-to-back calls) / calls, in µs.

  Calls are dispatched asynchronously and blocked on once, so launch gaps hide behind the
  device work as they do in a serving or training loop. This is the figure for programs on
  several GPUs: a CUPTI kernel sum adds up every GPU's kernels (and the time collectives spend
  waiting for their peers), while this counts the slowest GPU once. Host syncs inside a
  collective (XLA's NCCL ragged all-to-all copies its offsets to the host) count, as they
  should.
  """
  for args in arg_sets:
    jax.block_until_ready(fn(*args))
  per_call = []
  for _ in range(reps):
    t0 = time.perf_counter()
    outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(calls)]
    jax.block_until_ready(outs)
    per_call.append((time.perf_counter() - t0) * 1e6 / calls)
  return statistics.median(per_call)


def device_time(fn: Callable, arg_sets: Sequence[tuple], iters: int = 5
                ) -> tuple[float, list[float], dict[str, float]]:
  """(median µs, all samples µs, {kernel name: median µs per call}) of the kernels fn launches.

  Rotates over arg_sets (distinct inputs, so caches do not flatter the figure); the first pass
  over them is the warm-up (compilation, module load).
  """
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 (GPU only)
  for args in arg_sets:
    jax.block_until_ready(fn(*args))
  totals: list[float] = []
  per_kernel: dict[str, list[float]] = {}
  calls = 0
  for _ in range(iters):
    for args in arg_sets:
      out, kt = profiler.measure(fn, aggregate=False)(*args)
      jax.block_until_ready(out)
      if kt is None:
        continue
      calls += 1
      totals.append(sum(t for _, t in kt) * 1e3)
      for name, t in kt:
        per_kernel.setdefault(name[:70], []).append(t * 1e3)
  if not totals:
    return float("nan"), [], {}
  # a kernel launched n times per call: its median duration x n
  pk = {k: statistics.median(v) * len(v) / calls for k, v in per_kernel.items()}
  return statistics.median(totals), totals, pk


def device_time_cold(fn: Callable, arg_sets: Sequence[tuple], flush: jax.Array, iters: int = 5,
                     match: str = "") -> tuple[float, dict[str, float]]:
  """(µs, {kernel name: µs}) of the kernels of fn whose names contain `match`, each call made
  to wait for ``flush + 1`` first: with `flush` larger than L2 (256 MB on an H200), fn starts
  with neither its data nor its code in L2, as a kernel does after the GEMMs of a MoE block.
  GPU only (device_time); the flush's own kernel is not counted unless it matches."""
  def timed(args, buf):
    args, buf = jax.lax.optimization_barrier((args, buf + 1))
    return fn(*args), buf

  _, _, kernels = device_time(jax.jit(timed), [(args, flush) for args in arg_sets], iters)
  kernels = {k: v for k, v in kernels.items() if match in k}
  return sum(kernels.values()), kernels
