"""When each kernel of an EP dispatch runs, per GPU and stream (what CUPTI sums hide).

    PYTHONPATH=$PWD python3 benchmarks/ep_timeline.py --out $OUT               # all GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      PYTHONPATH=$PWD python3 benchmarks/ep_timeline.py --small --pids /host:CPU  # CPU smoke test

ep_dispatch_profile.py sums each kernel's time, which says what is costly but not what waits
for what: a collective's time includes its wait for the peer, and kernels on other streams
overlap. Here a jax.profiler trace of a few calls (each call alone, 2 ms apart) is read back
(its Chrome-trace JSON) and, for the median call, every device event is listed with its
stream, start (µs from the call's first event on any GPU) and duration, with the span from the
first event to the last. Backends as in bench_ep_multigpu.py (`ragged_dedup@packed`: rows
packed first).
Writes $OUT/ep_timeline.json.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))
import bench_ep_multigpu as ep  # noqa: E402
from jmoe import sharding  # noqa: E402


def read_trace(log_dir: str) -> dict:
  """The Chrome-trace JSON that jax.profiler wrote under log_dir."""
  path, = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
  with gzip.open(path, "rt") as fh:
    return json.load(fh)


def device_events(trace: dict, pid_filter: str) -> list[dict]:
  """Complete events ("X") of the processes whose name contains pid_filter, each with its
  process and thread (stream) names; sorted by start."""
  names, threads = {}, {}
  for ev in trace.get("traceEvents", []):
    if ev.get("ph") != "M":
      continue
    if ev.get("name") == "process_name":
      names[ev["pid"]] = ev["args"]["name"]
    elif ev.get("name") == "thread_name":
      threads[(ev["pid"], ev.get("tid"))] = ev["args"]["name"]
  out = []
  for ev in trace.get("traceEvents", []):
    if ev.get("ph") != "X" or pid_filter not in names.get(ev.get("pid"), ""):
      continue
    out.append(dict(device=names[ev["pid"]], stream=threads.get((ev["pid"], ev.get("tid")), ""),
                    name=ev.get("name", ""), ts=float(ev["ts"]), dur=float(ev.get("dur", 0))))
  return sorted(out, key=lambda e: e["ts"])


def split_calls(events: list[dict], gap_us: float) -> list[list[dict]]:
  """Groups of events separated by more than gap_us of silence on every device."""
  calls, end = [], None
  for ev in events:
    if end is None or ev["ts"] > end + gap_us:
      calls.append([])
    calls[-1].append(ev)
    end = max(end or ev["ts"], ev["ts"] + ev["dur"])
  return calls


def summarize(call: list[dict]) -> dict:
  t0 = call[0]["ts"]
  span = max(e["ts"] + e["dur"] for e in call) - t0
  rows = [dict(device=e["device"], stream=e["stream"], start_us=round(e["ts"] - t0, 1),
               dur_us=round(e["dur"], 1), name=e["name"][:90]) for e in call]
  return dict(span_us=span, events=rows)


def layer_fn(cfg, par, a2a, xs):
  """(jitted EP layer, its arguments): ep_fused_moe on the tokens xs with random weights."""
  w = ep.weights(cfg)
  f = jax.jit(lambda x, tw, ti, w13, w2: sharding.ep_fused_moe(
      x, w13, w2, tw, ti, activation=cfg.act, parallel=par, a2a_backend=a2a))
  return f, xs + (sharding.shard_expert_weights(w["w13"], par),
                  sharding.shard_expert_weights(w["w2"], par))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="deepseek-v3")
  ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
  ap.add_argument("--backends", default="ragged_dedup@packed,ragged_dedup@direct")
  ap.add_argument("--combine", action="store_true", help="dispatch + combine (identity experts)")
  ap.add_argument("--layer", action="store_true",
                  help="the whole EP MoE layer (ep_fused_moe) instead of the dispatch")
  ap.add_argument("--calls", type=int, default=7)
  ap.add_argument("--pids", default="/device:GPU", help="trace processes to read")
  ap.add_argument("--max-events", type=int, default=80, help="events printed per call")
  ap.add_argument("--min-us", type=float, default=0.0,
                  help="print only events at least this long (the JSON keeps all)")
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ep_timeline"))
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  devs, cfg, par, xs = ep.dispatch_setup(args)
  res = dict(meta=dict(jax=jax.__version__, devices=len(devs), kind=devs[0].device_kind,
                       preset=args.preset, tokens_per_gpu=args.tokens, combine=args.combine,
                       layer=args.layer),
             backends={})
  for a2a in args.backends.split(","):
    with ep.dedup_rows(ep.backend_variant(a2a)[1]):
      if args.layer:
        f, xs_ = layer_fn(cfg, par, ep.backend_variant(a2a)[0], xs)
      else:
        f, xs_ = ep._dispatch_combine(par, a2a, cfg, args.combine), xs
      for _ in range(3):
        jax.block_until_ready(f(*xs_))
      log_dir = tempfile.mkdtemp(prefix="ep_timeline_")
      with jax.profiler.trace(log_dir):
        for _ in range(args.calls):
          jax.block_until_ready(f(*xs_))
          time.sleep(0.002)
    calls = split_calls(device_events(read_trace(log_dir), args.pids), gap_us=500.0)
    if not calls:
      print(f"== {a2a}: no events under {args.pids!r}", flush=True)
      continue
    spans = [summarize(c)["span_us"] for c in calls]
    mid = sorted(range(len(calls)), key=lambda i: spans[i])[len(calls) // 2]
    rec = summarize(calls[mid])
    rec.update(calls=len(calls), spans_us=[round(s_, 1) for s_ in spans],
               median_span_us=statistics.median(spans))
    res["backends"][a2a] = rec
    print(f"== {a2a}: {len(calls)} calls, span median {rec['median_span_us']:.1f} us "
          f"(first event to last, any GPU); the median call:", flush=True)
    for e in [e for e in rec["events"] if e["dur_us"] >= args.min_us][:args.max_events]:
      print(f"   {e['start_us']:8.1f} {e['dur_us']:8.1f}  {e['device'][-6:]:>6s} "
            f"{e['stream'][:22]:22s} {e['name'][:70]}")
  with open(os.path.join(args.out, "ep_timeline.json"), "w") as fh:
    json.dump(res, fh, indent=1)


if __name__ == "__main__":
  main()
