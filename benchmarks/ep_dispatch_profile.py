"""Where an EP dispatch spends its time: per-kernel CUPTI breakdown of the prepare alone.

    PYTHONPATH=$PWD python3 benchmarks/ep_dispatch_profile.py --out $OUT       # all GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      PYTHONPATH=$PWD python3 benchmarks/ep_dispatch_profile.py --small       # CPU smoke test

For each a2a backend: the pipelined wall-clock µs of the dispatch (as bench_ep_multigpu.py's
comm stage) and, on GPUs, the kernels the call launches with their CUPTI µs summed over the GPUs
and divided by their number (a collective's figure includes the time it waits for its peer).
Writes $OUT/ep_dispatch_profile.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import bench_ep_multigpu as ep  # noqa: E402
from jmoe import sharding  # noqa: E402
from jmoe import timing  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="deepseek-v3")
  ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
  ap.add_argument("--backends", default="ragged_dedup,ragged_a2a,allgather")
  ap.add_argument("--top", type=int, default=14)
  ap.add_argument("--dispatch-dtypes", default="bf16,fp8",
                  help="activation dtypes on the dispatch wire (bf16 = as is)")
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--hlo", type=int, default=0,
                  help="print the fused computations of the N costliest XLA fusions")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ep_dispatch_profile"))
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  devs, cfg, par, xs = ep.dispatch_setup(args)
  res = dict(meta=dict(jax=jax.__version__, devices=len(devs), preset=args.preset,
                       tokens_per_gpu=args.tokens), backends={})
  # the bare collectives on a [T k, H] bf16 buffer split evenly over the peers: XLA's ragged
  # kernel (jmoe's pieces per peer) against the dense all_to_all of the same bytes
  ndev, rows = len(devs), args.tokens * cfg.top_k // len(devs) * len(devs)
  buf = jax.device_put(jax.random.normal(jax.random.key(0), (ndev * rows, cfg.hidden_size),
                                         jnp.bfloat16), sharding.token_sharding(par))
  spec = sharding.token_sharding(par).spec
  axis = par.expert_axis

  def ragged(v):
    n = jnp.full((ndev,), rows // ndev, jnp.int32)
    off = jnp.arange(ndev, dtype=jnp.int32) * (rows // ndev)
    me = jax.lax.axis_index(axis).astype(jnp.int32)
    return sharding.collectives.ragged_all_to_all(
        v, jnp.zeros_like(v), off, n, jnp.full((ndev,), me * (rows // ndev), jnp.int32), n,
        axis_name=axis, impl=sharding.collectives.ragged_impl_for(devs[0].platform))
  dense = lambda v: jax.lax.all_to_all(v, axis, 0, 0, tiled=True)  # noqa: E731
  res["collective"] = {}
  outs = {}
  for name, fn in (("ragged_all_to_all", ragged), ("all_to_all", dense)):
    f = jax.jit(jax.shard_map(fn, mesh=par.mesh, in_specs=spec, out_specs=spec))
    outs[name] = f(buf)
    us = ep.measure(f, (buf,), 5)
    res["collective"][name] = dict(us=us, bytes_per_gpu=rows * cfg.hidden_size * 2)
    print(f"== bare {name}: {us:.1f} us/call, {rows * cfg.hidden_size * 2 / us / 1e3:.1f} GB/s "
          "of buffer per GPU", flush=True)
  res["collective"]["same_result"] = bool(jnp.array_equal(outs["ragged_all_to_all"],
                                                          outs["all_to_all"]))
  print(f"== same result: {res['collective']['same_result']}", flush=True)
  for a2a, wire in itertools.product(args.backends.split(","),
                                     args.dispatch_dtypes.split(",")):
    par_w = sharding.make_parallel(expert=len(devs), devices=devs,
                                   dispatch_dtype=None if wire == "bf16" else wire)
    with ep.dedup_rows(ep.backend_variant(a2a)[1]):  # `ragged_dedup@packed`: rows packed first
      f = ep._dispatch_combine(par_w, a2a, cfg, False)
      rec = dict(wall_us=ep.measure(f, xs, 5))
      if devs[0].platform == "gpu":
        total, _, kernels = timing.device_time(f, [xs], iters=5)
        rec["cupti_us_per_gpu"] = total / len(devs)
        rec["kernels_us_per_gpu"] = {k: v / len(devs) for k, v in
                                     sorted(kernels.items(), key=lambda kv: -kv[1])}
    res["backends"][f"{a2a}/{wire}"] = rec
    print(f"== {a2a} ({wire} dispatch): {rec['wall_us']:.1f} us/call wall"
          + (f", kernels {rec['cupti_us_per_gpu']:.1f} us/GPU" if "cupti_us_per_gpu" in rec
             else ""), flush=True)
    for k, v in list(rec.get("kernels_us_per_gpu", {}).items())[:args.top]:
      print(f"   {v:9.1f}  {k}")
    if args.hlo:
      fusions = [k for k in rec.get("kernels_us_per_gpu", {}) if "fusion" in k][:args.hlo]
      print_fusions(f.lower(*xs).compile().as_text(), fusions or None)
  with open(os.path.join(args.out, "ep_dispatch_profile.json"), "w") as fh:
    json.dump(res, fh, indent=1)


def print_fusions(hlo: str, names, max_lines: int = 30):
  """The fused computations that the named fusion instructions call (every fusion if None)."""
  comps, cur = {}, None
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if m and "=" not in line.split("{")[0]:
      cur = m.group(1)
      comps[cur] = []
    elif cur is not None:
      comps[cur].append(line.strip())
  for line in hlo.splitlines():
    m = re.match(r"\s*%?([\w.\-]+) = .*fusion\(.*calls=%?([\w.\-]+)", line)
    if not m or (names is not None and m.group(1) not in names):
      continue
    print(f"   --- {m.group(1)}: {line.strip()[:300]}")
    for body in comps.get(m.group(2), [])[:max_lines]:
      print(f"       {body[:220]}")


if __name__ == "__main__":
  main()
