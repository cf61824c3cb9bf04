"""The jnp routing path's row copy on the GPU (past route()'s 8192 slots).

First the copy alone: the sorted token rows made by XLA's gather, permute.gather_rows (TMA
loads in sorted order: a token's row is read k times) and permute.scatter_rows (TMA loads in
token order, k row stores each), checked equal; device time against the bytes' floor (x read
once, the rows written once, 4.3 TB/s). Then the whole path (moe.route_xla: positions, row
copy, tile lists) with the gather after moe_align, the scatter after moe_align, the scatter
after route.slot_positions with its block scan as jnp.cumsum, and as committed (the scan as a
dot), its outputs checked equal.

    python benchmarks/bench_permute_rows.py --json OUT.json [--presets ...] [--tokens 4096,16384]
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jmoe import timing  # noqa: E402
from jmoe.config import get_preset  # noqa: E402
import check_common  # noqa: E402  (benchmarks/, the script's own directory)
from jmoe.kernels import grouped_gemm as gg  # noqa: E402
from jmoe.kernels import moe as pmoe  # noqa: E402
from jmoe.kernels import permute  # noqa: E402
from jmoe.kernels import route  # noqa: E402

BW = 4.3e12  # H200 copy rate, bytes / s (METHOD.md ceiling)


def _copy_rows(pname, k, t, sets, iters):
  """The row copy alone: XLA's gather, gather_rows, scatter_rows."""
  h = sets[0][0].shape[1]
  m = t * k
  aligned = []
  for x, ids in sets:
    order, gs, inv = permute.moe_align(ids, get_preset(pname).num_experts)
    aligned.append((x, order, inv, jnp.sum(gs)))
  variants = {
      "xla": jax.jit(lambda x, o, i, n: jnp.take(x, o // k, axis=0)),
      "gather": jax.jit(lambda x, o, i, n: permute.gather_rows(x, o // k, n)),
      "scatter": jax.jit(lambda x, o, i, n: permute.scatter_rows(x, i, m, n)),
  }
  want = np.asarray(variants["xla"](*aligned[0]))
  floor = (t * h + m * h) * 2 / BW * 1e6
  rows = []
  for name, f in variants.items():
    same = bool(np.array_equal(np.asarray(f(*aligned[0])), want))
    us, _, kernels = timing.device_time(f, aligned, iters=iters)
    rows.append(dict(preset=pname, T=t, k=k, H=h, variant=name, us=us, floor_us=floor,
                     kernels=kernels, correct=same))
    print(f"{pname:14s} T={t:6d} {name:18s} {us:8.1f} us  x floor {us / floor:5.2f}  "
          f"{'ok' if same else 'DIFFERS'}", flush=True)
  return rows


def _routing(pname, e, k, t, sets, iters):
  """moe.route_xla with the gather, the scatter after moe_align, and as committed."""
  bms = (128, 64)
  m_alloc = gg.row_alloc(t * k, *bms)

  def routed(x, i, impl, sort, by_dot=True):
    saved = pmoe._route_kernels_run, route._PREFIX_BY_DOT
    if sort:  # positions from moe_align, as without the Triton lowering
      pmoe._route_kernels_run = lambda *a: False
    route._PREFIX_BY_DOT = by_dot
    try:
      return pmoe.route_xla(x, i, e, m_alloc, bms, permute_impl=impl)
    finally:
      pmoe._route_kernels_run, route._PREFIX_BY_DOT = saved

  fns = {"route gather": jax.jit(lambda x, i: routed(x, i, "pallas", True)),
         "route sort+scatter": jax.jit(lambda x, i: routed(x, i, "scatter", True)),
         "route cumsum": jax.jit(lambda x, i: routed(x, i, "auto", False, by_dot=False)),
         "route committed": jax.jit(lambda x, i: routed(x, i, "auto", False))}
  ref = jax.block_until_ready(fns["route gather"](*sets[0]))
  nv = int(jnp.sum(ref[2]))
  rows = []
  for name, f in fns.items():
    out = jax.block_until_ready(f(*sets[0]))
    same = (np.array_equal(np.asarray(out[0][:nv]), np.asarray(ref[0][:nv]))
            and all(np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(out[1:3], ref[1:3])))
    for (m_a, q_a), (m_b, q_b) in zip(out[3], ref[3]):
      q = int(q_b[0])
      same = same and int(q_a[0]) == q and np.array_equal(np.asarray(m_a)[:, :q],
                                                          np.asarray(m_b)[:, :q])
    us, _, kernels = timing.device_time(f, sets, iters=iters)
    rows.append(dict(preset=pname, T=t, k=k, variant=name, us=us, kernels=kernels,
                     correct=bool(same)))
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:3]
    print(f"{pname:14s} T={t:6d} {name:18s} {us:8.1f} us  ({len(kernels)} kernels: "
          + ", ".join(f"{n_[:26]}={v:.1f}" for n_, v in top) + ") "
          + ("ok" if same else "DIFFERS"), flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--presets", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
  ap.add_argument("--tokens", default="4096,16384")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--no-copy", action="store_true", help="only the whole routing path")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}")
  rows = []
  for pname in args.presets.split(","):
    cfg = get_preset(pname)
    e, k, h = cfg.num_experts, cfg.top_k, cfg.hidden_size
    for t in (int(v) for v in args.tokens.split(",")):
      sets = [(jax.random.normal(jax.random.key(30 + s), (t, h), jnp.float32)
               .astype(jnp.bfloat16),
               jax.lax.top_k(jax.random.normal(jax.random.key(20 + s), (t, e)), k)[1]
               .astype(jnp.int32)) for s in range(3)]
      if not args.no_copy:
        rows += _copy_rows(pname, k, t, sets, args.iters)
      rows += _routing(pname, e, k, t, sets, args.iters)
  check_common.write_record(args.json, rows)


if __name__ == "__main__":
  main()
