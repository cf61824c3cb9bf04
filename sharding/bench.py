"""Local cost of EP dispatch preparation and combine against the grouped GEMM they surround.

On one device (a 1-device expert mesh) the collectives are trivial, so what the EP paths add
over the no-EP kernel is their local work: counting, sorting by (rank, expert), packing the send
buffer, labelling received rows, un-sorting and the weighted sum (ragged_a2a), or building and
compacting the fixed-capacity buffers (padded_a2a). Rows per device match an EP rank with the
same tokens per rank and balanced routing (T k rows), so the GEMM time is comparable too.

    python -m jmoe.sharding.bench --preset deepseek-v3 --tokens 4096
"""
from __future__ import annotations

import json
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jmoe
from jmoe import timing
from jmoe.config import get_preset
from jmoe.experts._common import sort_slots_by_expert
from jmoe.experts.xla import expert_mlp_sorted
from jmoe.modular import ExpertWeights
from jmoe.sharding.mesh import make_ep_mesh, parallel_config


def _time(fn: Callable, *args, iters: int = 20) -> float:
  """Median wall time of fn(*args) in milliseconds (results blocked on)."""
  return timing.wall_time(fn, [args], iters=iters) / 1e3


def device_profile(fn: Callable, *args, iters: int = 5, top: int = 8) -> dict:
  """GPU only: median CUPTI device time (ms) of fn(*args) and its `top` costliest kernels (µs),
  which attributes a path's overhead to the kernels that make it."""
  us, _, per = timing.device_time(fn, [args], iters=iters)
  ranked = sorted(per.items(), key=lambda kv: -kv[1])
  out = {"device_ms": us / 1e3, "kernels": len(per),
         "top": [(k_, round(v, 1)) for k_, v in ranked[:top]]}
  # what the costliest XLA fusions are: their defining lines in the optimized HLO
  hlo = fn.lower(*args).compile().as_text()
  lines = {}
  for name, _ in ranked[:3]:
    hit = [ln.strip()[:400] for ln in hlo.splitlines() if ln.strip().startswith(f"%{name} =")
           or ln.strip().startswith(f"ROOT %{name} =")]
    if hit:
      lines[name] = hit[0]
  out["hlo"] = lines
  return out


def local_cost(preset="deepseek-v3", tokens: int = 4096, dtype=jnp.bfloat16,
               capacity_factor: float = 1.25, iters: int = 20, seed: int = 0,
               runners: tuple = ("xla",), profile: bool = False) -> dict:
  """Times (ms) of the pieces for a preset name or a MoEConfig.

  runners: expert backends to put behind each path ("xla", "pallas_mosaic"); the padded path
  uses the batched class of the same runner ("xla" -> xla_batched).
  profile: also record CUPTI device time and the costliest kernels of each path (GPU only).
  """
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
  from jmoe import sharding  # noqa: PLC0415

  def path(a2a, runner):
    if a2a == "padded_a2a":
      r = "xla_batched" if runner == "xla" else runner
      return jax.jit(lambda x, tw, ti, w13, w2: sharding.ep_fused_moe(
          x, w13, w2, tw, ti, activation=act, a2a_backend="padded_a2a", runner_backend=r,
          parallel=par, capacity=cap, return_stats=True))
    # weights are arguments: closed over, they would be embedded as constants (GiBs)
    return jax.jit(lambda x, tw, ti, w13, w2: jmoe.fused_moe(x, w13, w2, tw, ti, activation=act,
                                                     runner_backend=runner, a2a_backend=a2a,
                                                     parallel=par if a2a != "none" else None))

  def gemm_only(xs, gs, w13, w2):
    return expert_mlp_sorted(xs, ExpertWeights(w13=w13, w2=w2), gs,
                             jnp.zeros((xs.shape[0],), jnp.int32), act, dtype)

  order, _, gs = sort_slots_by_expert(ti, e)
  xs = x[order // k]
  out = {"preset": preset, "tokens": tokens, "dtype": jnp.dtype(dtype).name,
         "device": str(dev.device_kind), "jax": jax.__version__, "capacity": cap}
  out["grouped_gemm_ms"] = _time(jax.jit(gemm_only), xs, gs, w13, w2, iters=iters)
  flops = 2 * tokens * k * h * w13.shape[2] + 2 * tokens * k * n * h
  out["gemm_tflops"] = flops / out["grouped_gemm_ms"] / 1e9
  ref = None
  for runner in runners:
    for a2a in ("none", "allgather", "ragged_a2a", "ragged_dedup", "padded_a2a"):
      key = f"{a2a}+{runner}"
      try:
        fn = path(a2a, runner)
        res = fn(x, tw, ti, w13, w2)
        y = res[0] if a2a == "padded_a2a" else res
        if a2a == "padded_a2a":
          out[f"{key}:dropped"] = int(res[1]["dropped"])
        y = np.asarray(y, np.float32)
        if ref is None:
          ref = y
        elif a2a != "padded_a2a" or out[f"{key}:dropped"] == 0:
          out[f"{key}:rel_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        out[f"{key}:ms"] = _time(fn, x, tw, ti, w13, w2, iters=iters)
        if profile:
          out[f"{key}:profile"] = device_profile(fn, x, tw, ti, w13, w2)
      except Exception as e:  # noqa: BLE001 (one failing path must not hide the others)
        out[f"{key}:error"] = f"{type(e).__name__}: {str(e)[:300]}"
  if "none+xla:ms" in out and "ragged_a2a+xla:ms" in out:
    out["ragged_overhead_ms"] = out["ragged_a2a+xla:ms"] - out["none+xla:ms"]
  return out


if __name__ == "__main__":
  import argparse
  ap = argparse.ArgumentParser(description="local cost of EP dispatch/combine")
  ap.add_argument("--preset", default="deepseek-v3")
  ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--runners", default="xla", help="comma-separated expert backends")
  ap.add_argument("--profile", action="store_true", help="CUPTI per-kernel breakdown (GPU)")
  a = ap.parse_args()
  for t in a.tokens:
    print(json.dumps(local_cost(a.preset, t, iters=a.iters, runners=tuple(a.runners.split(",")),
                                profile=a.profile)), flush=True)
