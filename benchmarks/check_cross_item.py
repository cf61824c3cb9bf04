"""The cross-item grouped GEMMs (GroupedGemmConfig(cross_item=True)) on a GPU, in a process of
its own: for each routed problem, the config the block uses (tuned table or heuristic) against
the same config with cross_item=True: correctness against an f32 reference, device µs. With
--write-tables, a cross-item config that is correct and faster goes into the tuned table
(pallas_kernels/configs). Exits 1 on a mismatch or a failure, so a script can gate on it.

  PYTHONPATH=$PWD python3 benchmarks/check_cross_item.py [--json out.json] [--write-tables]

H200, jax 0.11.2, 2026-11-29, first version (one-warpgroup tiles only; device µs, per-item ->
cross-item; all correct, 1.7e-3 relative to the f32 reference):
  qwen3 GEMM1 1024 tokens  64x128: 228.9 -> 282.1;  128x128: 655.8 -> 613.5
  qwen3 GEMM2 1024 tokens  64x128: 158.8 -> 149.5;  128x128: 134.4 -> 124.4
  qwen3 GEMM2   64 tokens  64x128: 113.2 -> 106.6;  128x128: 121.5 -> 113.1
Second version (the block's own configs, warp specialized: chained pipelines; all correct):
  qwen3 GEMM1 1024 tokens 128x128 ws: 207.5 -> 221.8;  GEMM2 128x256 ws: 123.6 -> 117.5
  qwen3 GEMM1   64 tokens  64x256 ws: 189.6 -> 188.4   (the run stopped at its 120 s limit
  before GEMM2 at 64 tokens; the GEMM2 winner was entered into the table by hand)
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import timing
import check_common  # benchmarks/, the script's own directory
from jmoe.tune import TuneResult
from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import permute

PROBLEMS = (  # (name, E, top-k, tokens, K, N, gated)
    ("qwen3 GEMM1 T=1024", 128, 8, 1024, 2048, 768, True),
    ("qwen3 GEMM2 T=1024", 128, 8, 1024, 768, 2048, False),
    ("qwen3 GEMM1 T=64", 128, 8, 64, 2048, 768, True),
    ("qwen3 GEMM2 T=64", 128, 8, 64, 768, 2048, False),
)


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
  args = check_common.parse_args(__doc__.split("\n")[0])
  rows, better = [], []
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
    table = "grouped_gemm_gated" if gated else "grouped_gemm"
    base = gg.get_config(table, t * k, n, kdim, e, jnp.bfloat16, gated=gated)
    if gated:
      run = lambda cfg: jax.jit(lambda a, g, w_: gg.grouped_gemm_gated(  # noqa: E731
          a, w_, g, activation="silu", config=cfg))
    else:
      run = lambda cfg: jax.jit(lambda a, g, w_: gg.grouped_gemm(a, w_, g, config=cfg))  # noqa: E731
    ref = _reference(xs, w, np.asarray(gs), gated)
    timed = {}
    for cross in (False, True):
      cfg = dataclasses.replace(base, cross_item=cross)
      rec = dict(problem=name, config=cfg.to_json())

      def measure(rec, cfg=cfg):
        f = run(cfg)
        out = np.asarray(f(xs, gs, w), np.float32)[:tot]
        rec["err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        rec["us"] = timing.device_time(f, [(xs, gs, w)], iters=args.iters)[0]
        return rec["err"] < 1e-2

      if check_common.run_variant(rec, measure, rows):
        timed[cross] = rec["us"]
      tag = (f"{cfg.block_m}x{cfg.block_n} {'ws' if cfg.warp_specialized else '1wg'} "
             f"{'cross-item' if cross else 'per-item  '}")
      print(f"{name:20s} {tag}: " + (f"{rec['us']:8.1f} us  err {rec['err']:.1e}"
                                       if "us" in rec else rec["error"]), flush=True)
    if len(timed) == 2 and timed[True] < 0.99 * timed[False]:
      key = gg._tuned_key(e, n, kdim, jnp.bfloat16, _compat.device_kind(), gg._m_bucket(t * k))
      better.append(TuneResult(table, key, dataclasses.replace(base, cross_item=True).to_json(),
                               timed[True], 2, 0))
  return check_common.finish(args, "check_cross_item.py", rows, better)


if __name__ == "__main__":
  sys.exit(main())
