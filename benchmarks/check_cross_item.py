"""The cross-item grouped-GEMM pipeline (GroupedGemmConfig(cross_item=True)) on a GPU, in a
process of its own: correctness against the XLA reference on routed problems, then device µs
against the per-item kernel of the same tile. Exits 1 on a mismatch or a failure, so a script
can gate tuning on it.

  PYTHONPATH=$PWD python3 benchmarks/check_cross_item.py [--json out.json]

H200, jax 0.11.2, 2026-11-29 (device µs; all correct, 1.7e-3 relative to the f32 reference):
  qwen3 GEMM1 1024 tokens  64x128: per-item 228.9, cross-item 282.1;  128x128: 655.8, 613.5
  qwen3 GEMM2 1024 tokens  64x128: 158.8, 149.5;  128x128: 134.4, 124.4
  qwen3 GEMM2   64 tokens  64x128: 113.2, 106.6;  128x128: 121.5, 113.1
The one-warpgroup GEMM2 gains 6-8 %, the gated GEMM1 loses (64x128); neither beats the
warp-specialized per-item kernels the tuned tables use there (GEMM1 208, GEMM2 117 µs at
1024 tokens inside the block). A mixtral row (K = 14336) made the run pass its 100 s limit.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import timing
from pallas_kernels import grouped_gemm as gg
from pallas_kernels import permute

C = gg.GroupedGemmConfig
PROBLEMS = (  # (name, E, top-k, tokens, K, N, gated)
    ("qwen3 GEMM1 T=1024", 128, 8, 1024, 2048, 768, True),
    ("qwen3 GEMM2 T=1024", 128, 8, 1024, 768, 2048, False),
    ("qwen3 GEMM2 T=64", 128, 8, 64, 768, 2048, False),
)
TILES = (C(block_m=64, block_n=128, block_k=64, num_stages=4, warp_specialized=False),
         C(block_m=128, block_n=128, block_k=64, num_stages=4, warp_specialized=False))


def _reference(xs, w, gs, gated):
  """f32 rows of the routed total, one matmul per expert (slices from the host's sizes)."""
  ends = np.cumsum(gs)
  parts = []
  for g in np.nonzero(gs)[0]:
    h = jnp.dot(xs[ends[g] - gs[g]:ends[g]].astype(jnp.float32), w[g].astype(jnp.float32))
    if gated:
      n = h.shape[1] // 2
      h = jax.nn.silu(h[:, :n]) * h[:, n:]
    parts.append(np.asarray(h))
  return np.concatenate(parts)


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--json", default=None)
  ap.add_argument("--iters", type=int, default=5)
  args = ap.parse_args()
  rows, ok = [], True
  for name, e, k, t, kdim, n, gated in PROBLEMS:
    keys = jax.random.split(jax.random.key(t + e), 4)
    x = jax.random.normal(keys[0], (t, kdim), jnp.float32).astype(jnp.bfloat16)
    cols = 2 * n if gated else n
    w = (jax.random.normal(keys[1], (e, kdim, cols), jnp.float32) / kdim ** 0.5).astype(
        jnp.bfloat16)
    _, ids = jax.lax.top_k(jax.random.normal(keys[2], (t, e)), k)
    order, gs, _ = permute.moe_align(ids.astype(jnp.int32), e)
    xs = permute.permute_rows(x, order, k)
    tot = int(gs.sum())
    if gated:
      run = lambda cfg: jax.jit(lambda a, g, w_: gg.grouped_gemm_gated(  # noqa: E731
          a, w_, g, activation="silu", config=cfg))
    else:
      run = lambda cfg: jax.jit(lambda a, g, w_: gg.grouped_gemm(a, w_, g, config=cfg))  # noqa: E731
    ref = _reference(xs, w, np.asarray(gs), gated)
    for base in TILES:
      for cross in (False, True):
        cfg = dataclasses.replace(base, cross_item=cross)
        rec = dict(problem=name, config=cfg.to_json())
        try:
          f = run(cfg)
          out = np.asarray(f(xs, gs, w), np.float32)[:tot]
          err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
          rec.update(err=err, us=timing.device_time(f, [(xs, gs, w)], iters=args.iters)[0])
          ok &= err < 1e-2
        except Exception as exc:  # noqa: BLE001 (a config that does not lower is a finding)
          rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
          ok = False
        rows.append(rec)
        tag = f"{cfg.block_m}x{cfg.block_n} {'cross-item' if cross else 'per-item  '}"
        print(f"{name:22s} {tag}: " + (f"{rec['us']:8.1f} us  err {rec['err']:.1e}"
                                         if "us" in rec else rec["error"]), flush=True)
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), fh,
                indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
