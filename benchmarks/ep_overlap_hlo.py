"""Does XLA overlap the EP dispatch with the shared expert / the other micro-batch?

Compiles `jmoe.sharding.ep_fused_moe` for an 8-GPU expert mesh and reads the *scheduled* optimized
HLO: for every asynchronous collective (`*-start` ... `*-done`) it lists the compute (fusions,
GEMM custom calls) that the scheduler placed between start and done, i.e. what runs while the
collective is in flight.

Run it on a machine with several GPUs (the GPU compiler's latency-hiding scheduler decides the
overlap). On 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8) it is
a negative control: XLA:CPU runs collectives synchronously, so no async pairs appear. jax's mock
GPU topology (--mock) did not work on one H200 with jax 0.11.2 (2026-11-29): "1x1x8" is
refused (devices per host must equal the local topology) and "1x8x1" hung while compiling.

    PYTHONPATH=$PWD python3 benchmarks/ep_overlap_hlo.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys


def parse_schedule(hlo: str) -> list[tuple[str, str, str]]:
  """(name, opcode, line) of the entry computation's instructions, in schedule order."""
  lines = hlo.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith("ENTRY"))
  out = []
  for line in lines[start + 1:]:
    if line.startswith("}"):
      break
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(", line)
    if m:
      out.append((m.group(1), m.group(2), line.strip()))
  return out


def _kind(opcode: str, line: str) -> str:
  if opcode == "custom-call":
    m = re.search(r'custom_call_target="([^"]+)"', line)
    return f"custom-call:{m.group(1) if m else '?'}"
  if opcode == "fusion":
    m = re.search(r"kind=(\w+)", line)
    return f"fusion:{m.group(1) if m else '?'}"
  return opcode


COMPUTE = ("fusion", "custom-call", "dot", "convolution")
IGNORED = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start",
           "copy-done")


def overlap_report(hlo: str) -> list[dict]:
  """For each async collective start, the compute ops scheduled before its done."""
  sched = parse_schedule(hlo)
  report = []
  for i, (name, op, line) in enumerate(sched):
    if not op.endswith("-start") or op == "copy-start":
      continue
    done = next((j for j in range(i + 1, len(sched))
                 if sched[j][1].endswith("-done") and re.search(rf"%{re.escape(name)}\b",
                                                                 sched[j][2])), None)
    if done is None:
      continue
    between = [_kind(o, l) for _, o, l in sched[i + 1:done] if o in COMPUTE]
    coll = op
    if op == "async-start":
      m = re.search(r"calls=%?([\w.\-]+)", line)
      coll = f"async:{m.group(1) if m else '?'}"
    report.append({"collective": coll, "start": name, "done": sched[done][0],
                   "ops_between": done - i - 1, "compute_between": len(between),
                   "compute_kinds": sorted(set(between))})
  return report


def build(args):
  import jax
  import jax.numpy as jnp
  from jmoe import sharding
  from jmoe.config import get_preset

  cfg = get_preset(args.preset)
  e, k, h, n = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
  if args.small:
    h, n = 256, 128
  devs = jax.devices()
  ep = len(devs)
  print(f"{ep} devices ({devs[0].platform}, {devs[0].device_kind}); jax {jax.__version__}",
        flush=True)
  t = args.tokens_per_rank * ep
  par = sharding.parallel_config(sharding.make_ep_mesh(expert=ep, devices=devs,
                                                       keep_unit_axes=False))
  dt = jnp.bfloat16
  sds = jax.ShapeDtypeStruct
  mesh = par.mesh
  from jax.sharding import NamedSharding, PartitionSpec as P
  ax = par.expert_axis
  tok = NamedSharding(mesh, P(ax, None))
  wsh = NamedSharding(mesh, P(ax, None, None))
  rep = NamedSharding(mesh, P())
  shapes = dict(x=sds((t, h), dt, sharding=tok), w13=sds((e, h, 2 * n), dt, sharding=wsh),
                w2=sds((e, n, h), dt, sharding=wsh), tw=sds((t, k), jnp.float32, sharding=tok),
                ti=sds((t, k), jnp.int32, sharding=tok),
                s13=sds((h, 2 * n), dt, sharding=rep), s2=sds((n, h), dt, sharding=rep))
  results = {}
  for a2a, mb, runner in args.cases:
    def f(x, w13, w2, tw, ti, s13, s2, a2a=a2a, mb=mb, runner=runner):
      return sharding.ep_fused_moe(x, w13, w2, tw, ti, activation="silu", parallel=par,
                                   a2a_backend=a2a, runner_backend=runner, shared_w13=s13,
                                   shared_w2=s2, micro_batches=mb, return_stats=True)[0]
    name = f"{a2a}_mb{mb}_{runner}"
    try:
      compiled = jax.jit(f).lower(*[shapes[a] for a in ("x", "w13", "w2", "tw", "ti", "s13",
                                                         "s2")]).compile()
      hlo = compiled.as_text()
      if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        with open(os.path.join(args.hlo_dir, f"hlo_{name}.txt"), "w") as fh:
          fh.write(hlo)
      rep_ = overlap_report(hlo)
      results[name] = rep_
      print(f"== {name}: {len(rep_)} async collectives", flush=True)
      for r in rep_:
        print(f"   {r['collective']:40s} ops between={r['ops_between']:3d} "
              f"compute between={r['compute_between']:3d} {r['compute_kinds'][:6]}", flush=True)
    except Exception as ex:  # noqa: BLE001
      results[name] = {"error": f"{type(ex).__name__}: {str(ex)[:400]}"}
      print(f"== {name}: ERROR {type(ex).__name__}: {str(ex)[:400]}", flush=True)
  return results


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mock", default="", help='mock GPU topology, e.g. "1x8x1" (GPU machine)')
  ap.add_argument("--preset", default="qwen3-30b-a3b")
  ap.add_argument("--tokens-per-rank", type=int, default=512)
  ap.add_argument("--small", action="store_true", help="tiny H/N (CPU)")
  ap.add_argument("--out", default=os.environ.get("OUT", ""))
  ap.add_argument("--runner", default="xla")
  ap.add_argument("--hlo-dir", default="", help="also write each scheduled HLO here")
  args = ap.parse_args()
  if args.out:
    os.makedirs(args.out, exist_ok=True)
  if args.mock:
    import jax
    jax.config.update("jax_mock_gpu_topology", args.mock)
  args.cases = [("ragged_a2a", 1, args.runner), ("ragged_a2a", 2, args.runner),
                ("allgather", 1, args.runner), ("padded_a2a", 1, "xla_batched")]
  res = build(args)
  if args.out:
    with open(os.path.join(args.out, "overlap.json"), "w") as fh:
      json.dump(res, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
