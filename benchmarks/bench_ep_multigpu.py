"""Multi-GPU expert parallelism on one host (issue 5): dispatch/combine bandwidth against the
same-run all-to-all peak, EP layer scaling over 1, 2, 4, 8 GPUs, overlap options, correctness.

    PYTHONPATH=$PWD python3 benchmarks/bench_ep_multigpu.py --out $OUT          # all GPUs
    PYTHONPATH=$PWD python3 benchmarks/bench_ep_multigpu.py --small             # CPU smoke test
        (XLA_FLAGS=--xla_force_host_platform_device_count=8; tiny shapes, wall-clock timing)

Stages (--stages, comma-separated):
  peak      all-to-all of the dispatch's bytes through jax.lax.all_to_all (and, with --torch,
            PyTorch's NCCL all_to_all_single in one process per GPU): the same-run ceiling
  comm      per a2a backend and dispatch dtype (bf16, fp8): dispatch alone (prepare) and
            dispatch + combine with identity experts, on all GPUs; bytes from
            jmoe.sharding.comm_model -> achieved GB/s, ratio to peak
  layer     the whole EP MoE layer at EP = 1, 2, 4, ... GPUs (weak scaling: fixed tokens per
            GPU): tokens/s per GPU, efficiency vs EP=1, and with the overlap options (shared
            expert, two micro-batches); the EP output checked against the 1-GPU layer; on GPUs
            also CUPTI µs per GPU in communication, GEMM and other kernels
Times are pipelined wall-clock µs per call on GPUs (jmoe.timing.throughput_time: the slowest
GPU counted once), wall-clock medians on CPU. XLA's GPU ragged all-to-all has two runtime paths,
chosen by XLA_FLAGS at start-up: the in-process "one-shot" kernel (default) and NCCL send/recv
(--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false with
--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true; it gave no result in 80 s in one
process on 2 H200s); JMOE_RAGGED_A2A_CHUNKS cuts each peer's slice into pieces (default 256).
Run the script once per setting with --tag. A backend written `ragged_dedup@packed` (or
`@direct`) is ragged_dedup with its rows packed per destination first (or sent from the
token array).
Writes $OUT/ep_multigpu[_TAG].json; prints one line per measurement.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jmoe
from jmoe import sharding
from jmoe import timing
from jmoe.config import get_preset
from jmoe.modular import NaiveBatched, NoOp
from jmoe.sharding import comm_model

RESULTS: dict = {"meta": {}, "peak": [], "comm": [], "layer": []}
BACKENDS = ("allgather", "ragged_a2a", "ragged_dedup", "padded_a2a")


def log(*a):
  print(*a, flush=True)


def backend_variant(name: str) -> tuple[str, str | None]:
  """"ragged_dedup@packed" -> ("ragged_dedup", "packed"); a plain name -> (name, None)."""
  base, _, variant = name.partition("@")
  if variant not in ("", "packed", "direct"):
    raise ValueError(f"{name!r}: the variant after @ is 'packed' or 'direct'")
  return base, variant or None


@contextlib.contextmanager
def dedup_rows(variant):
  """DEDUP_DIRECT_ROWS set while a variant's functions are built and traced (None: as is)."""
  from jmoe.sharding import prepare_finalize  # noqa: PLC0415
  old = prepare_finalize.DEDUP_DIRECT_ROWS
  if variant is not None:
    prepare_finalize.DEDUP_DIRECT_ROWS = variant == "direct"
  try:
    yield
  finally:
    prepare_finalize.DEDUP_DIRECT_ROWS = old


def dispatch_setup(args):
  """(devices, preset config, mesh, sharded (x, topk weights, topk ids)) for the dispatch tools
  (ep_dispatch_profile.py, ep_timeline.py): args.preset at args.tokens per GPU on every device;
  --small shrinks them to a CPU smoke test (and sets args.tokens to 16)."""
  devs = jax.devices()
  cfg = get_preset(args.preset)
  if args.small:
    cfg = cfg.replace(hidden_size=128, intermediate_size=64, num_experts=32,
                      num_expert_group=None, topk_group=None)
    args.tokens = 16
  par = sharding.make_parallel(expert=len(devs), devices=devs)
  xs = tuple(sharding.shard_tokens(v, par) for v in tokens(cfg, args.tokens * len(devs)))
  return devs, cfg, par, xs


def measure(fn, args, iters):
  """Median µs per call: pipelined wall clock (timing.throughput_time) on GPUs, counting the
  slowest GPU once (a CUPTI kernel sum would add up all GPUs' kernels and the time collectives
  wait for peers); plain wall-clock medians elsewhere."""
  if jax.devices()[0].platform == "gpu":
    one = timing.wall_time(fn, [args], iters=1)  # also the warm-up
    calls = max(2, min(20, int(2e5 / max(one, 1.0))))  # about 0.2 s per repetition
    return timing.throughput_time(fn, [args], calls=calls, reps=iters)
  return timing.wall_time(fn, [args], iters=iters)


KERNEL_KINDS = (  # (kind, name fragments), first match wins
    ("comm", ("nccl", "RaggedAllToAll", "MultiGpuBarrier")),
    ("gemm", ("jmoe_gg", "gemm", "matmul", "cublas", "cutlass", "tgmm", "decode")),
)


def kernel_shares(fn, args, ndev: int) -> dict:
  """CUPTI µs per GPU by kind (comm / gemm / other) of one call's kernels on `ndev` GPUs. A
  collective's kernel time includes the time it waits for its peer: "comm" is an upper bound."""
  _, _, kernels = timing.device_time(fn, [args], iters=3)
  out = {"comm": 0.0, "gemm": 0.0, "other": 0.0}
  for name, us in kernels.items():
    kind = next((k for k, frags in KERNEL_KINDS if any(f in name for f in frags)), "other")
    out[kind] += us / ndev
  return out


def weights(cfg, seed=0, dtype=jnp.bfloat16):
  """Routed experts w13 [E, H, 2N], w2 [E, N, H] and one shared expert (always made, so the
  overlap option can be timed on every preset)."""
  e, h, n = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
  ns = cfg.shared_intermediate_size or n
  ks = jax.random.split(jax.random.key(seed), 4)
  nrm = lambda k_, shape, fan: (jax.random.normal(k_, shape, jnp.float32)  # noqa: E731
                                * fan ** -0.5).astype(dtype)
  return dict(w13=nrm(ks[0], (e, h, 2 * n), h), w2=nrm(ks[1], (e, n, h), n),
              s13=nrm(ks[2], (h, 2 * ns), h), s2=nrm(ks[3], (ns, h), ns))


def tokens(cfg, t, seed=1, dtype=jnp.bfloat16):
  """x [t, H] and softmax top-k routing of random logits."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (t, cfg.hidden_size), jnp.float32).astype(dtype)
  tw, ti = jmoe.select_experts(x, jax.random.normal(k2, (t, cfg.num_experts)), cfg.top_k)
  return x, tw, ti


# ----------------------------------------------------------------------------- peak


def stage_peak(args, cfg, devs):
  """All-to-all of the bytes ragged_a2a's dispatch moves per rank (T k H b)."""
  ep = len(devs)
  par = sharding.make_parallel(expert=ep, devices=devs)
  for t in args.tokens:
    rows = t * cfg.top_k
    rec = dict(ep=ep, tokens_per_gpu=t, bytes_per_gpu=rows * cfg.hidden_size * 2)
    try:
      buf = jnp.zeros((ep * rows, cfg.hidden_size), jnp.bfloat16)
      buf = jax.device_put(buf, sharding.token_sharding(par))
      f = jax.jit(jax.shard_map(lambda v: jax.lax.all_to_all(v, par.expert_axis, 0, 0,
                                                             tiled=True),
                                mesh=par.mesh, in_specs=sharding.token_sharding(par).spec,
                                out_specs=sharding.token_sharding(par).spec))
      us = measure(f, (buf,), args.iters)
      rec.update(jax_all_to_all_us=us, jax_all_to_all_gbps=rec["bytes_per_gpu"] / us / 1e3)
      if args.torch:
        rec["torch_nccl_us"] = torch_all_to_all_us(ep, rec["bytes_per_gpu"], args.iters)
        rec["torch_nccl_gbps"] = rec["bytes_per_gpu"] / rec["torch_nccl_us"] / 1e3
      log(f"[peak] ep={ep} T/gpu={t}: jax all_to_all {us:.1f}us "
          f"{rec['jax_all_to_all_gbps']:.1f} GB/s per GPU"
          + (f", torch NCCL {rec['torch_nccl_us']:.1f}us" if "torch_nccl_us" in rec else ""))
    except Exception as e:  # noqa: BLE001
      rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      log(f"[peak] ERROR {rec['error']}")
    RESULTS["peak"].append(rec)


def _torch_worker(rank, world, nbytes, iters, port, q):
  import torch  # noqa: PLC0415
  import torch.distributed as dist  # noqa: PLC0415
  torch.cuda.set_device(rank)
  dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                          world_size=world)
  n = nbytes // 2 // world * world
  src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
  dst = torch.empty_like(src)
  for _ in range(3):
    dist.all_to_all_single(dst, src)
  torch.cuda.synchronize()
  ts = []
  for _ in range(iters):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    dist.all_to_all_single(dst, src)
    b.record()
    b.synchronize()
    ts.append(a.elapsed_time(b) * 1e3)
  if rank == 0:
    q.put(float(np.median(ts)))
  dist.destroy_process_group()


def torch_all_to_all_us(world, nbytes, iters):
  """PyTorch NCCL all_to_all_single of nbytes per GPU, one process per GPU (median µs)."""
  import torch.multiprocessing as mp  # noqa: PLC0415
  ctx = mp.get_context("spawn")
  q = ctx.Queue()
  port = 29500 + os.getpid() % 1000
  procs = [ctx.Process(target=_torch_worker, args=(r, world, nbytes, iters, port, q))
           for r in range(world)]
  for p in procs:
    p.start()
  for p in procs:
    p.join(timeout=300)
  return q.get(timeout=5)


# ----------------------------------------------------------------------------- comm


def _dispatch_combine(par, a2a, cfg, combine: bool, whole_buffer: bool = True):
  """shard_map'd prepare (+ finalize with identity experts: each received row is its own
  result), so the time is the dispatch (and combine) alone. whole_buffer=False: the dispatch
  returns one row of the received buffer, not all of it. XLA keeps a one-shot ragged
  all-to-all's output at a fixed address (its peers learn it once) and copies it into a jit
  output: 55 µs at deepseek-v3 / 4096 tokens on 2 H200s (ep_timeline.py), which a layer,
  whose experts read the buffer where it is, does not pay."""
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  from jmoe.sharding.ep import select_parts  # noqa: PLC0415
  a2a, _ = backend_variant(a2a)
  batched = a2a == "padded_a2a"
  pf, _, _ = select_parts(par, runner_backend="xla_batched" if batched else "xla",
                          a2a_backend=a2a, problem=(jnp.bfloat16, cfg.hidden_size,
                                                    cfg.intermediate_size))
  el = cfg.num_experts // pf.ep
  tok = sharding.token_sharding(par).spec

  def body(x, tw, ti):
    inp = pf.prepare(x, tw, ti, num_local_experts=el, expert_map=pf.kernel_expert_map(el),
                     apply_router_weight_on_input=False, quant=None)
    if not combine:
      # the received buffer itself: a reduction over it (this script's first version) added a
      # full read of it, 0.27 ms at deepseek-v3 / 4096 tokens (ep_dispatch_profile.py)
      return inp.a if whole_buffer else inp.a[:1]
    return pf.finalize(inp.a, inp, NaiveBatched() if batched else NoOp(), x.dtype)

  out_spec = tok if combine else P(par.expert_axis)
  return jax.jit(jax.shard_map(body, mesh=par.mesh, in_specs=(tok, tok, tok),
                               out_specs=out_spec, check_vma=False))


def stage_comm(args, cfg, devs):
  ep = len(devs)
  for t in args.tokens:
    peak = next((r.get("jax_all_to_all_gbps") for r in RESULTS["peak"]
                 if r.get("tokens_per_gpu") == t and r.get("ep") == ep), None)
    for wire in args.dispatch_dtypes:
      par = sharding.make_parallel(expert=ep, devices=devs,
                                   dispatch_dtype=None if wire == "bf16" else wire)
      xs = [sharding.shard_tokens(v, par) for v in tokens(cfg, t * ep)]
      for a2a in args.backends:
        rec = dict(a2a=a2a, ep=ep, tokens_per_gpu=t, dispatch_dtype=wire)
        try:
          with dedup_rows(backend_variant(a2a)[1]):
            model = comm_model.bytes_per_token(
                backend_variant(a2a)[0], hidden=cfg.hidden_size, top_k=cfg.top_k,
                num_experts=cfg.num_experts, ep=ep, tokens_per_rank=t,
                fp8_dispatch=wire == "fp8")
            d_us = measure(_dispatch_combine(par, a2a, cfg, False), tuple(xs), args.iters)
            d1_us = measure(_dispatch_combine(par, a2a, cfg, False, whole_buffer=False),
                            tuple(xs), args.iters)
            dc_us = measure(_dispatch_combine(par, a2a, cfg, True), tuple(xs), args.iters)
            # bytes per GPU (the model counts per token, summed over the group's ranks / ep)
            d_bytes = model["dispatch"] * t
            c_bytes = model["combine"] * t
            rec.update(dispatch_us=d_us, combine_us=dc_us - d_us,
                       dispatch_gbps=d_bytes / d_us / 1e3,
                       dispatch_in_place_us=d1_us, dispatch_in_place_gbps=d_bytes / d1_us / 1e3)
            # combine = (dispatch + combine) - dispatch: meaningful only above the timing noise
            rec["combine_gbps"] = (c_bytes / rec["combine_us"] / 1e3 if rec["combine_us"] > 0
                                   else None)
            if peak:  # against the peak's off-rank bytes, as the model counts them
              remote = peak * (ep - 1) / ep
              rec["dispatch_vs_peak"] = rec["dispatch_gbps"] / remote
              rec["dispatch_in_place_vs_peak"] = rec["dispatch_in_place_gbps"] / remote
            log(f"[comm] {a2a:12s} {wire:4s} ep={ep} T/gpu={t}: dispatch {d_us:.1f}us "
                f"({rec['dispatch_gbps']:.1f} GB/s; {d1_us:.1f}us in place), "
                f"combine {rec['combine_us']:.1f}us "
                f"({rec['combine_gbps'] or float('nan'):.1f} GB/s)"
                + (f", dispatch/peak {rec['dispatch_vs_peak']:.2f} "
                   f"({rec['dispatch_in_place_vs_peak']:.2f} in place)" if peak else ""))
        except Exception as e:  # noqa: BLE001
          rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
          log(f"[comm] {a2a} {wire} ERROR {rec['error']}")
          traceback.print_exc()
        RESULTS["comm"].append(rec)


# ----------------------------------------------------------------------------- layer


def stage_layer(args, cfg, devs, name):
  """Weak scaling: t tokens per GPU at EP = 1, 2, 4, ...; every EP output is checked against
  the no-EP layer on one GPU with the same tokens."""
  from jmoe.shared import shared_expert_mlp  # noqa: PLC0415
  act = cfg.act
  w = weights(cfg)
  t = args.layer_tokens
  base = {}  # shared -> tokens/s per GPU at EP=1

  def no_ep(x, w13, w2, tw, ti, s13, s2, shared):
    out = jmoe.fused_moe(x, w13, w2, tw, ti, activation=act)
    if shared:
      out = (out.astype(jnp.float32) + shared_expert_mlp(x, s13, s2, act)).astype(x.dtype)
    return out

  # (shared expert, micro-batches, dispatch wire dtype); fp8 once per backend, without options
  variants = [(False, 1, "bf16"), (True, 1, "bf16"), (True, 2, "bf16")]
  if "fp8" in args.dispatch_dtypes:
    variants.append((False, 1, "fp8"))
  for ep in [s_ for s_ in (1, 2, 4, 8, 16) if args.min_ep <= s_ <= len(devs)]:
    x, tw, ti = tokens(cfg, t * ep)
    ref = {}
    for a2a in (("none",) if ep == 1 else args.backends):
      for shared, mb, wire in variants:
        if a2a == "none" and (mb > 1 or wire != "bf16"):
          continue
        par = sharding.make_parallel(expert=ep, devices=devs[:ep],
                                     dispatch_dtype=None if wire == "bf16" else wire)
        rec = dict(preset=name, ep=ep, a2a=a2a, shared=shared, micro_batches=mb,
                   dispatch_dtype=wire, tokens_per_gpu=t)
        try:
          with dedup_rows(backend_variant(a2a)[1]):
            if a2a == "none":
              f = jax.jit(lambda *a, shared=shared: no_ep(*a, shared))
              args_ = (x, w["w13"], w["w2"], tw, ti, w["s13"], w["s2"])
            else:
              kw = dict(shared_w13=w["s13"], shared_w2=w["s2"]) if shared else {}
              base_a2a = backend_variant(a2a)[0]
              f = jax.jit(lambda x, w13, w2, tw, ti, a2a=base_a2a, kw=kw, mb=mb, par=par:
                          sharding.ep_fused_moe(x, w13, w2, tw, ti, activation=act, parallel=par,
                                                a2a_backend=a2a, micro_batches=mb, **kw))
              args_ = (sharding.shard_tokens(x, par), sharding.shard_expert_weights(w["w13"], par),
                       sharding.shard_expert_weights(w["w2"], par), sharding.shard_tokens(tw, par),
                       sharding.shard_tokens(ti, par))
              if shared not in ref:
                ref[shared] = np.asarray(jax.jit(lambda *a, shared=shared: no_ep(*a, shared))(
                    x, w["w13"], w["w2"], tw, ti, w["s13"], w["s2"]), np.float32)
              out = np.asarray(f(*args_), np.float32)
              rec["rel_err_vs_1gpu"] = float(np.linalg.norm(out - ref[shared])
                                             / np.linalg.norm(ref[shared]))
            us = measure(f, args_, args.iters)
            rec.update(us=us, tokens_per_s_per_gpu=t / us * 1e6)
            if jax.devices()[0].platform == "gpu":
              rec["kernel_us_per_gpu"] = kernel_shares(f, args_, ep)
            if ep == 1 and wire == "bf16":
              base[shared] = rec["tokens_per_s_per_gpu"]
            if shared in base:
              rec["efficiency_vs_ep1"] = rec["tokens_per_s_per_gpu"] / base[shared]
            log(f"[layer] {name} ep={ep} {a2a:12s} {wire:4s} shared={shared} mb={mb}: {us:.1f}us "
                f"{rec['tokens_per_s_per_gpu']:.0f} tok/s/GPU "
                f"eff={rec.get('efficiency_vs_ep1', float('nan')):.2f} "
                f"err={rec.get('rel_err_vs_1gpu', float('nan')):.1e}"
                + ("  kernels/GPU: " + " ".join(f"{k} {v:.0f}us" for k, v in
                                                 rec["kernel_us_per_gpu"].items())
                   if "kernel_us_per_gpu" in rec else ""))
        except Exception as e:  # noqa: BLE001
          rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
          log(f"[layer] {name} ep={ep} {a2a} ERROR {rec['error']}")
        RESULTS["layer"].append(rec)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="deepseek-v3")
  ap.add_argument("--layer-presets", default="deepseek-v3,qwen3-30b-a3b")
  ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096],
                  help="tokens per GPU for the peak/comm stages")
  ap.add_argument("--layer-tokens", type=int, default=4096, help="tokens per GPU (layer)")
  ap.add_argument("--stages", default="peak,comm,layer")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--torch", action="store_true", help="also PyTorch NCCL all_to_all_single")
  ap.add_argument("--backends", default=",".join(BACKENDS))
  ap.add_argument("--min-ep", type=int, default=1, help="layer stage: smallest EP size")
  ap.add_argument("--dispatch-dtypes", default="bf16,fp8",
                  help="comm stage: activation dtypes on the dispatch wire (bf16 = as is)")
  ap.add_argument("--tag", default="", help="names the output file (one per XLA setting)")
  ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ep_multigpu"))
  args = ap.parse_args()
  args.backends = args.backends.split(",")
  args.dispatch_dtypes = args.dispatch_dtypes.split(",")
  if not set(args.dispatch_dtypes) <= {"bf16", "fp8"}:
    ap.error(f"--dispatch-dtypes: {args.dispatch_dtypes} (choose from bf16, fp8)")
  unknown = {backend_variant(b)[0] for b in args.backends} - set(BACKENDS)
  if unknown:
    ap.error(f"--backends: unknown {sorted(unknown)}; choose from {BACKENDS}")
  os.makedirs(args.out, exist_ok=True)
  devs = jax.devices()
  RESULTS["meta"] = dict(jax=jax.__version__, devices=len(devs), kind=devs[0].device_kind,
                         date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), argv=sys.argv,
                         xla_flags=os.environ.get("XLA_FLAGS", ""),
                         ragged_chunks=sharding.collectives.default_chunks())
  log(f"{len(devs)} x {devs[0].device_kind}, jax {jax.__version__}")

  def shaped(name):
    cfg = get_preset(name)
    if args.small:
      cfg = cfg.replace(hidden_size=128, intermediate_size=64,
                        num_experts=max(16, min(cfg.num_experts, 32)),
                        num_expert_group=None, topk_group=None,
                        shared_intermediate_size=64 if cfg.shared_intermediate_size else None)
    return cfg

  if args.small:
    args.tokens = [16]
    args.layer_tokens = 16
  stages = args.stages.split(",")
  cfg = shaped(args.preset)
  if "peak" in stages:
    stage_peak(args, cfg, devs)
  if "comm" in stages:
    stage_comm(args, cfg, devs)
  if "layer" in stages:
    for name in args.layer_presets.split(","):
      stage_layer(args, shaped(name), devs, name)
  path = os.path.join(args.out, f"ep_multigpu{'_' + args.tag if args.tag else ''}.json")
  with open(path, "w") as f:
    json.dump(RESULTS, f, indent=1, default=str)
  log(f"wrote {path}")


if __name__ == "__main__":
  main()
