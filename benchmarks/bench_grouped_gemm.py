"""GPU benchmark + correctness check of the Pallas Mosaic GPU grouped GEMM MoE block.

Run on the H200 (device tool):
  PYTHONPATH=$PWD python3 benchmarks/bench_grouped_gemm.py --stages variants,permute,block \
      --presets mixtral-8x7b,qwen3-30b-a3b,deepseek-v3 --tokens 1,64,1024,16384

Stages:
  variants  compile + check each kernel variant on a mid-size ragged problem (try/except each)
  permute   moe_align / gather_sum device time (CUPTI)
  block     the MoE expert block (permute, GEMM1+act, GEMM2 x router weight, gather-sum) per
            preset x tokens: check vs a per-slot f32 XLA reference, CUPTI device time, the
            torch._grouped_mm peer (CUDA-graph replay), weight-streaming floor
  sweep     time GEMM1 / GEMM2 alone over jmoe.tune's candidates (--sweep-presets, --sweep-tokens)
  tgmm      the weight-gradient kernel alone over configs (the best becomes this run's default)
  train     the block's jax.grad on the Pallas path vs its forward and vs XLA
  batched   the masked batched kernels ([E, cap, H] + expert_num_tokens) at T=1, 64
Writes $OUT/bench.json (all numbers), $OUT/errors.txt (tracebacks); prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import datetime
import json
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jmoe import timing  # noqa: E402
from check_common import device_rel_err, top_kernels, torch_sorted_slots  # noqa: E402  (benchmarks/, the script's directory)
from jmoe.kernels import grouped_gemm as gg  # noqa: E402
from jmoe.kernels import moe as pmoe  # noqa: E402
from jmoe.kernels import decode  # noqa: E402
from jmoe.kernels import permute as perm  # noqa: E402
from jmoe.kernels import route as _route  # noqa: E402
from jmoe.kernels.grouped_gemm import GroupedGemmConfig as C  # noqa: E402

ONE_KERNEL_BLOCKS_DEFAULT = _route.ONE_KERNEL_BLOCKS

PRESETS = {
    "mixtral-8x7b": dict(E=8, k=2, H=4096, N=14336),
    "qwen3-30b-a3b": dict(E=128, k=8, H=2048, N=768),
    "deepseek-v3": dict(E=256, k=8, H=7168, N=2048),
    "tiny": dict(E=4, k=2, H=256, N=128),  # CPU smoke test of this script (--interpret)
}
INTERPRET = False
PERMUTE_IMPL = "auto"  # the library's choice unless the permute stage or --permute-impl decides
TUNED: dict = {}  # (preset, T) -> {"gemm1": (cfg, us), "gemm2": (cfg, us)} from the sweep stage
BW = 4.30e12  # copy bandwidth measured on this H200 (read + write), peers-h200.md
OUT = os.environ.get("OUT", "/tmp/bench_out")
os.makedirs(OUT, exist_ok=True)
ERR = open(os.path.join(OUT, "errors.txt"), "a")
RESULTS: dict = {"meta": {}, "variants": [], "permute": [], "block": [], "sweep": []}
T0 = time.time()


def log(*a):
  print(*a, flush=True)


def err(where, e):
  ERR.write(f"==== {where}\n{traceback.format_exc()}\n")
  ERR.flush()
  log(f"[ERR] {where}: {type(e).__name__}: {str(e)[:300]}")
  if INTERPRET:
    from jmoe.kernels import _compat
    _compat.reset_interpret_state()


def fail(rec, where, e):
  """Record a failed step in its result and in errors.txt; the run goes on."""
  rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
  err(where, e)


def save():
  with open(os.path.join(OUT, "bench.json"), "w") as f:
    json.dump(RESULTS, f, indent=1, default=str)


# ----------------------------------------------------------------------------- timing

def cupti_times(f, arg_sets, iters=5):
  """Median CUPTI device time (µs) of f over rotating arg sets; also per-kernel breakdown."""
  if INTERPRET:
    return wall_times(f, arg_sets, iters=1), [], {}
  return timing.device_time(f, arg_sets, iters=iters)


def wall_times(f, arg_sets, iters=20):
  return timing.wall_time(f, arg_sets, iters=iters)


# ----------------------------------------------------------------------------- problems

def make_weights(p, key, dtype=jnp.bfloat16):
  E, H, N = p["E"], p["H"], p["N"]
  k1, k2 = jax.random.split(key)
  w13 = (jax.random.normal(k1, (E, H, 2 * N), jnp.float32) * (H ** -0.5)).astype(dtype)
  w2 = (jax.random.normal(k2, (E, N, H), jnp.float32) * (N ** -0.5)).astype(dtype)
  return w13, w2


def make_inputs(p, T, key, dtype=jnp.bfloat16):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (T, p["H"]), jnp.float32).astype(dtype)
  logits = jax.random.normal(k2, (T, p["E"]), jnp.float32)
  w, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), p["k"])
  w = w / jnp.sum(w, axis=-1, keepdims=True)
  return x, w.astype(jnp.float32), ids.astype(jnp.int32)


def per_set_floor_ratios(samples, floors) -> dict:
  """Per rotated input set: the median of its samples (device_time takes them in rotation
  order: set i at i, i + n, ...) over its own floor; their mean (the headline x_floor) and the
  worst."""
  n = len(floors)
  set_us = [float(np.median(samples[i::n])) for i in range(n)]
  ratios = [u / f_ for u, f_ in zip(set_us, floors)]
  return dict(set_us=set_us, set_ratio_floor=ratios, ratio_floor=float(np.mean(ratios)),
              ratio_floor_worst=max(ratios))


def rel_err(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  if not np.all(np.isfinite(a)):
    return float("inf")
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------------------- stages

VARIANTS = {
    "nows_64x128": C(block_m=64, block_n=128, block_k=64, num_stages=4, warp_specialized=False),
    "nows_128x128": C(block_m=128, block_n=128, block_k=64, num_stages=4, warp_specialized=False),
    "ws_n_128x256": C(block_m=128, block_n=256, block_k=64, num_stages=4, wg_split="n",
                      grid_minor="m", grid_tile_width=4),
    "ws_m_128x128": C(block_m=128, block_n=128, block_k=64, num_stages=4, wg_split="m"),
    "ws_n_64x128": C(block_m=64, block_n=128, block_k=128, num_stages=6, wg_split="n"),
}


def stage_variants(args):
  key = jax.random.key(0)
  M, K, N, E = 1000, 1024, 1024, 8
  ks = jax.random.split(key, 6)
  lhs = jax.random.normal(ks[0], (M, K), jnp.float32).astype(jnp.bfloat16)
  rhs = (jax.random.normal(ks[1], (E, K, 2 * N), jnp.float32) / 32).astype(jnp.bfloat16)
  bias = jax.random.normal(ks[2], (E, 2 * N), jnp.float32)
  scale = jax.random.uniform(ks[3], (M,), jnp.float32)
  gs = jnp.array([100, 0, 333, 1, 0, 200, 250, 16], jnp.int32)  # sum 900 < M
  tot = int(gs.sum())
  ref_plain = gg.grouped_gemm_reference(lhs, rhs[:, :, :N], gs, row_scale=scale, bias=bias[:, :N],
                                        out_dtype=jnp.float32)
  ref_gated = gg.grouped_gemm_reference(lhs, rhs, gs, bias=bias, activation="silu", gated=True,
                                        out_dtype=jnp.float32)
  small_gs = jnp.array([0, 3, 0, 0, 0, 1, 0, 0], jnp.int32)
  lhs_s = lhs[:4]
  ref_small = gg.grouped_gemm_reference(lhs_s, rhs[:, :, :N], small_gs, out_dtype=jnp.float32)
  for name, cfg in VARIANTS.items():
    for kind in ("plain", "gated", "small"):
      rec = dict(variant=name, kind=kind, config=cfg.to_json())
      try:
        t = time.time()
        if kind == "plain":
          f = jax.jit(lambda a, b, g, s, bb, cfg=cfg: gg.grouped_gemm(
              a, b, g, row_scale=s, bias=bb, config=cfg))
          fargs = (lhs, rhs[:, :, :N], gs, scale, bias[:, :N])
          ref, rows = ref_plain, tot
        elif kind == "gated":
          gcfg = dataclasses.replace(cfg, block_n=max(64, cfg.block_n // 2)) if cfg.block_n > 128 \
              else cfg
          rec["config"] = gcfg.to_json()
          f = jax.jit(lambda a, b, g, bb, cfg=gcfg: gg.grouped_gemm_gated(
              a, b, g, activation="silu", bias=bb, config=cfg))
          fargs = (lhs, rhs, gs, bias)
          ref, rows = ref_gated, tot
        else:
          f = jax.jit(lambda a, b, g, cfg=cfg: gg.grouped_gemm(a, b, g, config=cfg))
          fargs = (lhs_s, rhs[:, :, :N], small_gs)
          ref, rows = ref_small, 4
        out = jax.block_until_ready(f(*fargs))
        rec["compile_s"] = time.time() - t
        # run twice more: error must not move (race check)
        e1 = rel_err(np.asarray(out[:rows], np.float32), ref[:rows])
        out2 = jax.block_until_ready(f(*fargs))
        e2 = rel_err(np.asarray(out2[:rows], np.float32), ref[:rows])
        rec.update(err=e1, err_rerun=e2, ok=bool(e1 < 2e-2 and e2 < 2e-2))
        try:
          rec["us"], _, _ = cupti_times(f, [fargs], iters=3)
        except Exception as e:  # noqa: BLE001
          err(f"variant {name} {kind} timing", e)
        log(f"[variant] {name:14s} {kind:6s} err={e1:.2e}/{e2:.2e} ok={rec['ok']} "
            f"compile={rec['compile_s']:.1f}s us={rec.get('us', float('nan')):.1f}")
      except Exception as e:  # noqa: BLE001
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
        err(f"variant {name} {kind}", e)
      RESULTS["variants"].append(rec)
      save()


def stage_permute(args):
  for T, k, E, method in [(1, 8, 256, "auto"), (1, 2, 8, "auto"), (64, 8, 256, "auto"),
                          (1024, 8, 128, "sort"), (1024, 8, 128, "count"),
                          (1024, 8, 256, "sort"), (1024, 8, 256, "count"),
                          (4096, 8, 128, "sort"), (4096, 8, 128, "count"),
                          (16384, 8, 128, "sort"), (16384, 8, 128, "count"),
                          (16384, 8, 256, "sort"), (16384, 8, 256, "count")]:
    try:
      keys = jax.random.split(jax.random.key(T), 3)
      sets = []
      for kk in keys:
        logits = jax.random.normal(kk, (T, E))
        _, ids = jax.lax.top_k(logits, k)
        sets.append((ids.astype(jnp.int32),))
      f = jax.jit(lambda ids, E=E, method=method: perm.moe_align(ids, E, method=method))
      o, g, inv = f(*sets[0])
      ro, rg, rinv = perm.moe_align_reference(np.asarray(sets[0][0]), E)
      ok = bool((np.asarray(o) == ro).all() and (np.asarray(g) == rg).all()
                and (np.asarray(inv) == rinv).all())
      us, _, pk = cupti_times(f, sets, iters=5)
      wall = wall_times(f, sets, iters=10)
      rec = dict(T=T, k=k, E=E, method=method, ok=ok, cupti_us=us, wall_us=wall, kernels=pk)
      log(f"[permute] T={T:6d} k={k} E={E:3d} {method:7s} ok={ok} device={us:.1f}us wall={wall:.1f}us "
          f"kernels={len(pk)}")
      RESULTS["permute"].append(rec)
    except Exception as e:  # noqa: BLE001
      err(f"permute T={T}", e)
  save()
  # token gather x[order // k]: XLA gather vs the Pallas TMA row-copy kernel
  global PERMUTE_IMPL
  wins = []
  for T, k, H in [(1, 8, 7168), (1024, 8, 2048), (16384, 8, 2048), (16384, 8, 7168)]:
    if INTERPRET:
      T, H = min(T, 4), min(H, 512)
    rec = dict(kind="gather", T=T, k=k, H=H)
    try:
      x = jax.random.normal(jax.random.key(T), (T, H), jnp.float32).astype(jnp.bfloat16)
      m = max(T * k, 128)
      sets = [(x, jax.random.randint(jax.random.key(i), (m,), 0, T * k).astype(jnp.int32))
              for i in range(3)]
      fx = jax.jit(lambda x, o, k=k: perm.permute_rows(x, o, k, impl="xla"))
      fp = jax.jit(lambda x, o, k=k: perm.permute_rows(x, o, k, impl="pallas",
                                                      interpret=INTERPRET))
      ok = bool(np.array_equal(np.asarray(fx(*sets[0])), np.asarray(fp(*sets[0]))))
      ux, _, _ = cupti_times(fx, sets, iters=3)
      up, _, _ = cupti_times(fp, sets, iters=3)
      rec.update(ok=ok, xla_us=ux, pallas_us=up, tbps_pallas=2 * m * H * 2 / up / 1e6)
      wins.append(ok and up < ux)
      log(f"[gather] T={T:6d} k={k} H={H}: xla {ux:.1f}us pallas {up:.1f}us ok={ok}")
    except Exception as e:  # noqa: BLE001
      fail(rec, f"gather T={T}", e)
      wins.append(False)
    RESULTS["permute"].append(rec)
  if args.permute_impl == "auto":
    PERMUTE_IMPL = "pallas" if wins and all(wins[1:]) else "xla"
  log(f"[gather] block stage uses permute_impl={PERMUTE_IMPL}")
  RESULTS["meta"]["permute_impl"] = PERMUTE_IMPL
  save()


def torch_block_fn(p):
  import torch
  import torch.nn.functional as F
  E, N = p["E"], p["N"]

  def block(x, w13, w2, tw, ti):
    T, k = ti.shape
    order, offs, tok = torch_sorted_slots(ti, E)
    xs = x[tok]
    h = torch._grouped_mm(xs, w13, offs=offs)
    a = (F.silu(h[:, :N].float()) * h[:, N:].float()).to(x.dtype)
    y = torch._grouped_mm(a, w2, offs=offs)
    y = y.float() * tw.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros(T, y.shape[1], device=x.device, dtype=torch.float32)
    out.index_add_(0, tok, y)
    return out.to(x.dtype)
  return block


def time_torch(block, arg_sets, iters=10):
  """(median µs of a CUDA-graph replay, outputs) of the torch block."""
  from jmoe.bench_peers import cuda_graph_replay
  t, outs = cuda_graph_replay(block, arg_sets, iters * len(arg_sets))
  return t * 1e6, outs


def block_configs(args, p, T, source="sweep"):
  """Configs for the block: None = library default (tuned JSON / heuristic). source "lib":
  always the library's; "sweep": this run's sweep winners where the sweep stage ran."""
  if source == "lib":
    return None, None
  if args.force_nows:
    m = T * p["k"]
    c1 = C(block_m=64 if m <= 64 * p["E"] else 128, block_n=128, block_k=64, num_stages=4,
           warp_specialized=False)
    return c1, c1
  best = TUNED.get((p["name"], T))
  if best and "gemm1" in best and "gemm2" in best:
    return best["gemm1"][0], best["gemm2"][0]
  return None, None


def stage_block(args):
  have_torch = False
  if not args.no_torch:
    try:
      import torch  # noqa: F401
      have_torch = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001
      err("import torch", e)
  for pname in args.presets.split(","):
    p = dict(PRESETS[pname], name=pname)
    if time.time() - T0 > args.budget_s:
      log(f"[block] budget reached, skipping {pname}")
      break
    try:
      w13, w2 = make_weights(p, jax.random.key(1))
      jax.block_until_ready((w13, w2))
    except Exception as e:  # noqa: BLE001
      err(f"weights {pname}", e)
      continue
    tw13 = tw2 = None
    if have_torch:
      import torch
      tw13, tw2 = torch.from_dlpack(w13), torch.from_dlpack(w2)
    layouts = args.layout.split(",")
    sources = args.block_configs.split(",")
    for T, route, layout, source in [(int(t), r, lay, src) for t in args.tokens.split(",")
                                     for r in args.route_impls.split(",") for lay in layouts
                                     for src in sources]:
      if time.time() - T0 > args.budget_s:
        log(f"[block] budget reached, skipping {pname} T={T}")
        break
      rec = dict(preset=pname, T=T, permute_impl=PERMUTE_IMPL, layout=layout,
                 route_impl=route, config_source=source, **p)
      c1_, c2_ = block_configs(args, p, T, source)
      rec["configs"] = [c.to_json() if c else None for c in (c1_, c2_)]
      m_slots = T * p["k"]  # what the library picks for a None config (tuned entry or heuristic)
      rec["lib_configs"] = [
          gg.get_config("grouped_gemm_gated", m_slots, p["N"], p["H"], p["E"], jnp.bfloat16,
                        gated=True).to_json(),
          gg.get_config("grouped_gemm", m_slots, p["H"], p["N"], p["E"], jnp.bfloat16).to_json()]
      try:
        sets = [make_inputs(p, T, jax.random.key(100 + i)) for i in range(args.rotate)]
        E, k, H, N = p["E"], p["k"], p["H"], p["N"]
        # each rotated input set touches its own experts (at mixtral's 2 tokens 3, 4 and 4 of
        # 8): a floor per set, and the time per set against it (the sets' mean ratio is the
        # headline; until the fifteenth round it was the median time over set 0's floor)
        set_touched = [len(np.unique(np.asarray(s_[2]))) for s_ in sets]
        touched = set_touched[0]
        wbytes = touched * (H * 2 * N + N * H) * 2
        flops = 2 * T * k * H * 2 * N + 2 * T * k * N * H
        flop_us = flops / args.peak_tflops / 1e6
        rec.update(touched=touched, weight_bytes=wbytes, flops=flops,
                   floor_bw_us=wbytes / BW * 1e6, floor_flop_us=flop_us,
                   set_touched=set_touched,
                   set_floor_us=[max(t_ * (H * 2 * N + N * H) * 2 / BW * 1e6, flop_us)
                                 for t_ in set_touched])
        rec["floor_us"] = max(rec["floor_bw_us"], rec["floor_flop_us"])
        c1, c2 = block_configs(args, p, T, source)
        # "kernels:N": the routing kernels in one kernel up to N blocks (route.ONE_KERNEL_BLOCKS
        # for this variant, read when it is traced)
        impl, _, okb = route.partition(":")
        if any(":" in r for r in args.route_impls.split(",")):
          # fused_experts is jitted: a cached trace would keep another variant's form
          jax.clear_caches()
          _route.ONE_KERNEL_BLOCKS = int(okb) if okb else ONE_KERNEL_BLOCKS_DEFAULT
        lay, _, stages = layout.partition(":")
        if stages:  # "fused_decode:S": the decode kernel with an S-slot weight ring
          f0 = jax.jit(lambda x, tw, ti, w13, w2, s_=int(stages): decode.fused_experts_decode(
              x, w13, w2, tw, ti, config=decode.DecodeConfig(stages=s_), interpret=INTERPRET))
        else:
          f0 = jax.jit(lambda x, tw, ti, w13, w2, c1=c1, c2=c2, lay=lay: pmoe.fused_experts(
              x, w13, w2, tw, ti, activation="silu", config1=c1, config2=c2,
              interpret=INTERPRET, permute_impl=PERMUTE_IMPL, layout=lay, route_impl=impl))
        sets = [s_ + (w13, w2) for s_ in sets]
        f = f0
        t = time.time()
        out = jax.block_until_ready(f(*sets[0]))
        rec["compile_s"] = time.time() - t
        nchk = min(T, args.check_tokens)
        x, tw, ti = sets[0][:3]
        ref = pmoe.fused_experts_reference(x[:nchk], w13, w2, tw[:nchk], ti[:nchk])
        rec["err"] = rel_err(np.asarray(out[:nchk], np.float32), ref)
        out2 = jax.block_until_ready(f(*sets[0]))
        rec["rerun_identical"] = bool(np.array_equal(np.asarray(out), np.asarray(out2)))
        us, samples, pk = cupti_times(f, sets, iters=args.iters)
        rec.update(jmoe_us=us, jmoe_samples=samples, kernels=pk)
        rec["tflops"] = flops / us / 1e6
        rec.update(per_set_floor_ratios(samples or [us] * len(sets), rec["set_floor_us"]))
        first = (route == args.route_impls.split(",")[0] and layout == layouts[0]
                 and source == sources[0])
        if have_torch and first:  # once per (preset, T)
          try:
            tsets = [(torch.from_dlpack(x_), tw13, tw2, torch.from_dlpack(w_),
                      torch.from_dlpack(i_).long()) for x_, w_, i_, _, _ in sets]
            tb = torch_block_fn(p)
            tus, touts = time_torch(tb, tsets, iters=args.iters)
            rec["torch_us"] = tus
            rec["torch_err"] = rel_err(touts[0][:nchk].float().cpu().numpy(), ref)
            rec["ratio_torch"] = us / tus
          except Exception as e:  # noqa: BLE001
            err(f"torch {pname} T={T}", e)
        log(f"[block] {pname:14s} T={T:6d} route={route:7s} layout={layout} cfg={source} "
            f"err={rec['err']:.2e} jmoe={us:9.1f}us "
            f"torch={rec.get('torch_us', float('nan')):9.1f}us floor={rec['floor_us']:8.1f}us "
            f"x_floor={rec['ratio_floor']:.2f} (worst set {rec['ratio_floor_worst']:.2f}) "
            f"x_torch={rec.get('ratio_torch', float('nan')):.2f} "
            f"compile={rec['compile_s']:.0f}s")
        log(top_kernels(pk, 4))
      except Exception as e:  # noqa: BLE001
        fail(rec, f"block {pname} T={T}", e)
      _route.ONE_KERNEL_BLOCKS = ONE_KERNEL_BLOCKS_DEFAULT
      RESULTS["block"].append(rec)
      save()
    del w13, w2, tw13, tw2


from jmoe.kernels.tuning import SWEEP_TGMM  # noqa: E402


def stage_sweep(args):
  """GEMM1 / GEMM2 alone over jmoe.tune's candidates (what `python -m jmoe tune` times), every
  candidate recorded; the best pair becomes the block stage's config for that (preset, T)."""
  from jmoe import tune  # noqa: PLC0415
  which = {"grouped_gemm_gated": "gemm1", "grouped_gemm": "gemm2"}
  for pname in args.sweep_presets.split(","):
    p = PRESETS[pname]
    for T in [int(t) for t in args.sweep_tokens.split(",")]:
      if time.time() - T0 > args.budget_s:
        log("[sweep] budget reached")
        return
      flops = {"gemm1": 2 * T * p["k"] * p["H"] * 2 * p["N"],
               "gemm2": 2 * T * p["k"] * p["N"] * p["H"]}

      def report(t, table, cfg, us, pname=pname, flops=flops):
        g = which[table]
        rec = dict(preset=pname, T=t, gemm=g, config=cfg.to_json())
        if us is None:
          rec["error"] = "failed (see jmoe.tune: a candidate that does not fit)"
        else:
          rec.update(us=us, tflops=flops[g] / us / 1e6)
          best = TUNED.setdefault((pname, t), {})
          if g not in best or us < best[g][1]:
            best[g] = (cfg, us)
        log(f"[sweep] {pname} T={t} {g} bm={cfg.block_m} bn={cfg.block_n} "
            f"split={cfg.wg_split} minor={cfg.grid_minor}/{cfg.grid_tile_width} -> "
            + (f"{us:.1f}us {rec['tflops']:.0f}TF/s" if us else "failed"))
        RESULTS["sweep"].append(rec)
        save()
      try:
        tune.tune(p["E"], p["k"], p["H"], p["N"], "silu", [T], iters=3, interpret=INTERPRET,
                  tables=list(which), report=report)
      except Exception as e:  # noqa: BLE001
        err(f"sweep {pname} T={T}", e)


def xla_block_fn(E, act="silu"):
  from jmoe.kernels.activations import as_activation
  a_ = as_activation(act)

  def block(x, w13, w2, tw, ti):
    t, k = ti.shape
    order, gs, inv = perm.moe_align(ti, E)
    xs = perm.permute_rows(x, order, k)
    h = jax.lax.ragged_dot(xs, w13, gs, preferred_element_type=jnp.float32)
    a = a_(h).astype(x.dtype)
    y = jax.lax.ragged_dot(a, w2, gs, preferred_element_type=jnp.float32)
    y = y * perm.permute_weights(tw, order)[:, None]
    return perm.gather_sum(y, inv, out_dtype=x.dtype)
  return block


def stage_tgmm_sweep(args):
  """Weight-gradient kernel configs on the training shapes (mixtral / qwen3 at 1024 tokens);
  the best total becomes tgmm's default for the train stage of this run."""
  from jmoe.kernels import tgmm as tg
  shapes = [("mixtral dW13", 8, 2048, 4096, 28672), ("mixtral dW2", 8, 2048, 14336, 4096),
            ("qwen3 dW13", 128, 8192, 2048, 1536)]
  if INTERPRET:
    shapes = [("tiny", 4, 100, 128, 256)]
  totals = {}
  for name, E, M, K, N in shapes:
    x = jax.random.normal(jax.random.key(1), (M, K), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (M, N), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.asarray(np.random.default_rng(0).multinomial(M, np.ones(E) / E), jnp.int32)
    ref = None
    for cfg in SWEEP_TGMM:
      bk, bn, br, st, tik = (cfg.block_k, cfg.block_n, cfg.block_r, cfg.num_stages,
                             cfg.transpose_in_kernel)
      rec = dict(kind="tgmm_sweep", shape=name, config=dataclasses.asdict(cfg))
      try:
        f = jax.jit(lambda a, b, g, cfg=cfg: tg.tgmm(a, b, g, config=cfg, interpret=INTERPRET))
        out = jax.block_until_ready(f(x, dy, gs))
        if ref is None:  # the reference on the device, f32 (one einsum per expert is GiBs)
          ref = f32 = out.astype(jnp.float32)
          rng_e = int(np.argmax(np.asarray(gs)))
          s0 = int(np.asarray(gs)[:rng_e].sum())
          rows = slice(s0, s0 + int(np.asarray(gs)[rng_e]))
          want = jnp.dot(x[rows].astype(jnp.float32).T, dy[rows].astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
          rec["err_vs_f32"] = rel_err(np.asarray(f32[rng_e]), np.asarray(want))
        else:
          rec["err_vs_first"] = rel_err(np.asarray(out, np.float32), np.asarray(ref))
        us, _, _ = cupti_times(f, [(x, dy, gs)], iters=3)
        rec.update(us=us, tflops=2 * M * K * N / us / 1e6)
        totals[cfg] = totals.get(cfg, 0.0) + us
        log(f"[tgmm] {name:12s} bk={bk} bn={bn} br={br} st={st} tik={tik} "
            f"cps={cfg.ctas_per_sm}: {us:8.1f}us "
            f"{rec['tflops']:5.0f}TF/s err={rec.get('err_vs_f32', rec.get('err_vs_first')):.1e}")
      except Exception as e:  # noqa: BLE001
        fail(rec, f"tgmm sweep {name} {cfg}", e)
      RESULTS.setdefault("tgmm_sweep", []).append(rec)
      save()
  ok = [r for r in RESULTS["tgmm_sweep"] if r.get("us")]
  full = {c: t for c, t in totals.items()
          if sum(r["config"] == dataclasses.asdict(c) for r in ok) == len(shapes)}
  if full:
    tg.DEFAULT_CONFIG = min(full, key=full.get)
    RESULTS["meta"]["tgmm_default"] = dataclasses.asdict(tg.DEFAULT_CONFIG)
    log(f"[tgmm] best total: {tg.DEFAULT_CONFIG}")


TRAIN_VARIANTS = {  # fused_experts_train keyword sets timed by --train-variants
    "default": {},
    "fused": dict(preact=True, fuse_act_grad=True),  # the activation in GEMM epilogues
    "preact": dict(preact=True),  # GEMM1 writes a and h (no forward activation pass)
    "xla_route": dict(route_impl="xla"),   # moe_align + gather + tile_metadata in XLA
    # the jnp routing path's row copy by XLA's gather, not permute.scatter_rows (past 8192
    # slots, where the route kernels stop)
    "take_rows": dict(_gather_min_slots=1 << 30),
    # tuned tables looked up by exact M bucket only (before the fifteenth round: a training
    # shape past the tuned buckets ran the default tgmm config)
    "exact_buckets": dict(_nearest_from=1 << 40),
}


def stage_train(args):
  # the whole block's fwd+bwd vs its forward, and vs the XLA (ragged_dot) path
  variants = [v for v in args.train_variants.split(",") if v]
  for pname in [p_ for p_ in args.train_presets.split(",") if p_]:
    p = PRESETS[pname]
    T = args.train_tokens
    rec = dict(kind="block_grad", preset=pname, T=T)
    try:
      w13, w2 = make_weights(p, jax.random.key(1))
      x, tw, ti = make_inputs(p, T, jax.random.key(11))
      ct = jax.random.normal(jax.random.key(12), (T, p["H"]), jnp.float32)
      args_ = (x, w13, w2, tw, ti, ct)

      def loss_pallas(x, w13, w2, tw, ti, ct, **kw):
        return jnp.sum(pmoe.fused_experts_train(x, w13, w2, tw, ti, interpret=INTERPRET, **kw)
                       .astype(jnp.float32) * ct)

      blk = xla_block_fn(p["E"])

      def loss_xla(x, w13, w2, tw, ti, ct):
        return jnp.sum(blk(x, w13, w2, tw, ti).astype(jnp.float32) * ct)

      fwd = jax.jit(lambda x, w13, w2, tw, ti, ct: pmoe.fused_experts(x, w13, w2, tw, ti,
                                                                       interpret=INTERPRET))
      rec["fwd_us"], _, _ = cupti_times(fwd, [args_], iters=5)
      if args.train_no_xla:  # (XLA's ragged_dot path runs out of memory past ~1024 tokens)
        gx, g_x, rec["xla_fwdbwd_us"] = None, None, float("nan")
      else:
        g_x = jax.jit(jax.grad(loss_xla, argnums=(0, 1, 2, 3)))
        gx = jax.block_until_ready(g_x(*args_))
        rec["xla_fwdbwd_us"], _, _ = cupti_times(g_x, [args_], iters=2)
      for name in variants:
        if name != variants[0]:
          jax.clear_caches()  # fused_experts_train is jitted: a cached trace keeps a module knob
        kw = {k_: v_ for k_, v_ in TRAIN_VARIANTS[name].items() if not k_.startswith("_")}
        g_p = jax.jit(jax.grad(functools.partial(loss_pallas, **kw), argnums=(0, 1, 2, 3)))
        # module knobs ("_" keys) stay set through the first call, which traces the forward
        # and the backward (a custom_vjp's backward is traced after the loss has returned)
        knobs = TRAIN_VARIANTS[name]
        saved = pmoe._PALLAS_GATHER_MIN_SLOTS, gg._NEAREST_FROM
        pmoe._PALLAS_GATHER_MIN_SLOTS = knobs.get("_gather_min_slots", saved[0])
        gg._NEAREST_FROM = knobs.get("_nearest_from", saved[1])
        try:
          gp = jax.block_until_ready(g_p(*args_))
        finally:
          pmoe._PALLAS_GATHER_MIN_SLOTS, gg._NEAREST_FROM = saved
        if gx is None:  # the first variant's grads are the reference then
          gx, rec["grad_reference"] = gp, name
        v = dict(grad_err_vs_xla=[device_rel_err(a, b) for a, b in zip(gp, gx)])
        v["fwdbwd_us"], _, pk = cupti_times(g_p, [args_], iters=5)
        v["fwdbwd_kernels"] = pk
        v["ratio_fwdbwd_fwd"] = v["fwdbwd_us"] / rec["fwd_us"]
        v["speedup_vs_xla"] = rec["xla_fwdbwd_us"] / v["fwdbwd_us"]
        rec.setdefault("variants", {})[name] = v
        if name == variants[0]:  # the headline figures (earlier rounds' keys)
          rec.update(v)
        log("        fwd+bwd kernels: " + ", ".join(f"{k_}={t_:.0f}" for k_, t_ in sorted(
            pk.items(), key=lambda kv: -kv[1])[:10]))
        log(f"[train] {pname} T={T} {name}: grad err vs xla "
            f"{['%.1e' % e_ for e_ in v['grad_err_vs_xla']]} fwd={rec['fwd_us']:.0f}us "
            f"fwd+bwd={v['fwdbwd_us']:.0f}us (x{v['ratio_fwdbwd_fwd']:.2f}) "
            f"xla fwd+bwd={rec['xla_fwdbwd_us']:.0f}us (speedup {v['speedup_vs_xla']:.2f})")
      del w13, w2
    except Exception as e:  # noqa: BLE001
      fail(rec, f"train {pname}", e)
    RESULTS.setdefault("train", []).append(rec)
    save()


def stage_batched(args):
  """The batched (masked) kernels on the decode-style layout [E, cap, H] + expert_num_tokens:
  correctness on the valid rows (the rest are unwritten by contract) and device time, GEMM1
  (gated SiLU) + GEMM2 (router weight), against the weight-streaming floor of touched experts."""
  for pname in args.presets.split(","):
    p = PRESETS[pname]
    E, k, H, N = p["E"], p["k"], p["H"], p["N"]
    if INTERPRET:
      E, H, N = 4, 128, 64
    w13, w2 = make_weights(dict(E=E, H=H, N=N), jax.random.key(1))
    for T in (1, 64):
      rec = dict(kind="batched", preset=pname, T=T)
      try:
        rng = np.random.default_rng(T)
        ids = np.stack([rng.choice(E, size=min(k, E), replace=False) for _ in range(T)])
        counts = np.bincount(ids.reshape(-1), minlength=E).astype(np.int32)
        cap = max(8, int(counts.max()))
        x = jax.random.normal(jax.random.key(T), (E, cap, H), jnp.float32).astype(jnp.bfloat16)
        sc = jax.random.uniform(jax.random.key(T + 1), (E, cap), jnp.float32)
        ent = jnp.asarray(counts)
        f = jax.jit(lambda a, ent, s_, w13, w2: gg.batched_grouped_gemm(
            gg.batched_grouped_gemm_gated(a, w13, ent, activation="silu", interpret=INTERPRET),
            w2, ent, row_scale=s_, interpret=INTERPRET))
        fargs = (x, ent, sc, w13, w2)
        out = np.asarray(jax.block_until_ready(f(*fargs)), np.float32)
        hp = jax.lax.Precision.HIGHEST

        @jax.jit
        def ref_fn(x, sc, w13, w2):  # f32 on the device (the weights are GiBs)
          hh = jnp.einsum("ech,ehn->ecn", x.astype(jnp.float32), w13.astype(jnp.float32),
                          precision=hp)
          a_ = (jax.nn.silu(hh[..., :N]) * hh[..., N:]).astype(jnp.bfloat16).astype(jnp.float32)
          return jnp.einsum("ecn,enh->ech", a_, w2.astype(jnp.float32), precision=hp) * sc[..., None]
        ref = np.asarray(ref_fn(x, sc, w13, w2))
        mask = np.arange(cap)[None, :] < counts[:, None]
        rec["err"] = rel_err(out[mask], ref[mask])
        touched = int((counts > 0).sum())
        wbytes = touched * (H * 2 * N + N * H) * 2
        us, _, pk = cupti_times(f, [fargs], iters=args.iters)
        rec.update(us=us, touched=touched, cap=cap, floor_us=wbytes / BW * 1e6, kernels=pk)
        rec["ratio_floor"] = us / rec["floor_us"]
        log(f"[batched] {pname:14s} T={T:3d} cap={cap:3d} err={rec['err']:.2e} {us:.1f}us "
            f"floor={rec['floor_us']:.1f}us x_floor={rec['ratio_floor']:.2f}")
      except Exception as e:  # noqa: BLE001
        fail(rec, f"batched {pname} T={T}", e)
      RESULTS.setdefault("batched", []).append(rec)
      save()
    del w13, w2


def stage_ceiling(args):
  try:
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    us, _, _ = cupti_times(f, [(a, b)], iters=5)
    RESULTS["meta"]["dense_bf16_tflops"] = 2 * 8192 ** 3 / us / 1e6
    log(f"[ceiling] dense bf16 8192^3: {2 * 8192 ** 3 / us / 1e6:.0f} TFLOP/s")
  except Exception as e:  # noqa: BLE001
    err("ceiling", e)


def print_table():
  log("\n=== MoE block (bf16), µs device time; floor = max(touched weights / 4.3 TB/s, "
      "flops / peak) ===")
  log(f"{'preset':14s} {'T':>6s} {'jmoe':>9s} {'torch':>9s} {'floor':>8s} {'x_torch':>7s} "
      f"{'x_floor':>7s} {'TF/s':>6s} {'err':>8s}")
  for r in RESULTS["block"]:
    if "jmoe_us" not in r:
      log(f"{r['preset']:14s} {r['T']:6d} FAILED {r.get('error', '')[:80]}")
      continue
    log(f"{r['preset']:14s} {r['T']:6d} {r['jmoe_us']:9.1f} {r.get('torch_us', float('nan')):9.1f} "
        f"{r['floor_us']:8.1f} {r.get('ratio_torch', float('nan')):7.2f} {r['ratio_floor']:7.2f} "
        f"{r['tflops']:6.0f} {r['err']:8.1e}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--stages", default="variants,permute,block")
  ap.add_argument("--presets", default="mixtral-8x7b,qwen3-30b-a3b,deepseek-v3")
  ap.add_argument("--tokens", default="1,64,1024,16384")
  ap.add_argument("--sweep-presets", default="qwen3-30b-a3b")
  ap.add_argument("--sweep-tokens", default="16384")
  ap.add_argument("--rotate", type=int, default=3)
  ap.add_argument("--train-presets", default="mixtral-8x7b")
  ap.add_argument("--permute-impl", default="auto", choices=["auto", "xla", "pallas", "scatter"])
  ap.add_argument("--train-tokens", type=int, default=1024)
  ap.add_argument("--train-variants", default="default",
                  help=f"comma list of {sorted(TRAIN_VARIANTS)}; the first gives the headline")
  ap.add_argument("--train-no-xla", action="store_true",
                  help="train stage: no XLA reference (grads checked against the first "
                       "variant's)")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--check-tokens", type=int, default=16)
  ap.add_argument("--peak-tflops", type=float, default=807.0)
  ap.add_argument("--budget-s", type=float, default=480.0)
  ap.add_argument("--no-torch", action="store_true")
  ap.add_argument("--force-nows", action="store_true")
  ap.add_argument("--layout", default="auto",
                  help="comma list of fused_experts layouts for the block stage, each timed "
                       "(auto, sorted, per_slot, fused_decode; 'fused_decode:S' = the decode "
                       "kernel with an S-slot ring)")
  ap.add_argument("--route-impls", default="auto",
                  help="comma list of fused_experts route_impl values, each timed (sorted "
                       "layout); 'kernels:N' = the routing kernels in one kernel up to N blocks")
  ap.add_argument("--block-configs", default="sweep",
                  help="comma list of the block's config sources, each timed: sweep (this "
                       "run's sweep winners where the sweep stage ran, else the library's), "
                       "lib (the library's tuned table / heuristic)")
  ap.add_argument("--interpret", action="store_true", help="CPU smoke test (GPU interpret mode)")
  args = ap.parse_args()
  global INTERPRET, PERMUTE_IMPL
  INTERPRET = args.interpret
  if args.permute_impl != "auto":
    PERMUTE_IMPL = args.permute_impl
  RESULTS["meta"].update(
      jax=jax.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
      device=str(jax.devices()[0].device_kind), argv=sys.argv)
  log(f"jax {jax.__version__} device {jax.devices()[0].device_kind} "
      f"{RESULTS['meta']['date']}")
  stages = args.stages.split(",")
  if "ceiling" in stages:
    stage_ceiling(args)
  if "variants" in stages:
    stage_variants(args)
  if "permute" in stages:
    stage_permute(args)
  if "sweep" in stages:
    stage_sweep(args)
  tuned_json = {}
  for (pn, T), best in TUNED.items():
    for which, (cfg, us) in best.items():
      p = PRESETS[pn]
      if which == "gemm1":
        key = gg._tuned_key(p["E"], p["N"], p["H"], jnp.bfloat16, RESULTS["meta"]["device"],
                            gg._m_bucket(T * p["k"]))
        tuned_json.setdefault("grouped_gemm_gated", {})[key] = dict(cfg.to_json(), us=us)
      else:
        key = gg._tuned_key(p["E"], p["H"], p["N"], jnp.bfloat16, RESULTS["meta"]["device"],
                            gg._m_bucket(T * p["k"]))
        tuned_json.setdefault("grouped_gemm", {})[key] = dict(cfg.to_json(), us=us)
  RESULTS["tuned"] = tuned_json
  if "block" in stages:
    stage_block(args)
  if "tgmm" in stages:
    stage_tgmm_sweep(args)
  if "train" in stages and time.time() - T0 < args.budget_s:
    stage_train(args)
  if "batched" in stages and time.time() - T0 < args.budget_s:
    stage_batched(args)
  save()
  print_table()
  log(f"total {time.time() - T0:.0f}s")


if __name__ == "__main__":
  main()
