"""Local cost of EP dispatch preparation and combine against the grouped GEMM they surround.

On one device (a 1-device expert mesh) the collectives are trivial, so what the EP paths add
over the no-EP kernel is their local work: counting, sorting by (rank, expert), packing the send
buffer, labelling received rows, un-sorting and the weighted sum (ragged_a2a), or building and
compacting the fixed-capacity buffers (padded_a2a). Rows per device match an EP rank with the
same tokens per rank and balanced routing (T k rows), so the GEMM time is comparable too.

    python -m sharding.bench --preset deepseek-v3 --tokens 4096
"""
from __future__ import annotations

import json
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jmoe
from jmoe.config import get_preset
from jmoe.experts._common import sort_slots_by_expert
from jmoe.experts.xla import expert_mlp_sorted
from jmoe.modular import ExpertWeights
from sharding.mesh import make_ep_mesh, parallel_config


def _time(fn: Callable, *args, iters: int = 20, warmup: int = 3) -> float:
  """Median wall time of fn(*args) in milliseconds (results blocked on)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts) * 1e3)


def local_cost(preset="deepseek-v3", tokens: int = 4096, dtype=jnp.bfloat16,
               capacity_factor: float = 1.25, iters: int = 20, seed: int = 0) -> dict:
  """Times (ms) of the pieces for a preset name or a MoEConfig."""
  cfg = get_preset(preset) if isinstance(preset, str) else preset
  preset = preset if isinstance(preset, str) else "custom"
  e, k, h, n = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(tokens, h)), dtype)
  w13 = jnp.asarray(rng.normal(size=(e, h, 2 * n)) / np.sqrt(h), dtype)
  w2 = jnp.asarray(rng.normal(size=(e, n, h)) / np.sqrt(n), dtype)
  logits = jnp.asarray(rng.normal(size=(tokens, e)), jnp.float32)
  tw, ti = jmoe.select_experts(x, logits, k)
  dev = jax.devices()[0]
  par = parallel_config(make_ep_mesh(expert=1, devices=[dev], keep_unit_axes=False))
  act = cfg.act
  cap = max(1, int(np.ceil(capacity_factor * tokens * k / e)))

  def fused(a2a, runner, **kw):
    return jax.jit(lambda x, tw, ti: jmoe.fused_moe(x, w13, w2, tw, ti, activation=act,
                                                     runner_backend=runner, a2a_backend=a2a,
                                                     parallel=par if a2a != "none" else None,
                                                     **kw))

  def gemm_only(xs, gs):
    return expert_mlp_sorted(xs, ExpertWeights(w13=w13, w2=w2), gs,
                             jnp.zeros((xs.shape[0],), jnp.int32), act, dtype)

  order, _, gs = sort_slots_by_expert(ti, e)
  xs = x[order // k]
  out = {"preset": preset, "tokens": tokens, "dtype": jnp.dtype(dtype).name,
         "device": str(dev.device_kind), "jax": jax.__version__, "capacity": cap}
  out["grouped_gemm_ms"] = _time(jax.jit(gemm_only), xs, gs, iters=iters)
  out["no_ep_xla_ms"] = _time(fused("none", "xla"), x, tw, ti, iters=iters)
  out["ragged_a2a_xla_ms"] = _time(fused("ragged_a2a", "xla"), x, tw, ti, iters=iters)
  out["allgather_xla_ms"] = _time(fused("allgather", "xla"), x, tw, ti, iters=iters)
  import sharding  # noqa: PLC0415
  padded = jax.jit(lambda x, tw, ti: sharding.ep_fused_moe(
      x, w13, w2, tw, ti, activation=act, a2a_backend="padded_a2a", runner_backend="xla_batched",
      parallel=par, capacity=cap, return_stats=True))
  out["padded_a2a_batched_ms"] = _time(padded, x, tw, ti, iters=iters)
  out["padded_dropped"] = int(padded(x, tw, ti)[1]["dropped"])
  out["ragged_overhead_ms"] = out["ragged_a2a_xla_ms"] - out["no_ep_xla_ms"]
  flops = 2 * tokens * k * h * w13.shape[2] + 2 * tokens * k * n * h
  out["gemm_tflops"] = flops / out["grouped_gemm_ms"] / 1e9
  return out


if __name__ == "__main__":
  import argparse
  ap = argparse.ArgumentParser(description="local cost of EP dispatch/combine")
  ap.add_argument("--preset", default="deepseek-v3")
  ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
  ap.add_argument("--iters", type=int, default=20)
  a = ap.parse_args()
  for t in a.tokens:
    print(json.dumps(local_cost(a.preset, t, iters=a.iters)), flush=True)
