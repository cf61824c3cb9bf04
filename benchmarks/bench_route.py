"""The routing step alone on the GPU: jmoe.kernels.route (one kernel vs two) against the jnp
path (moe_align + tile_metadata + the token gather), CUPTI device time, outputs checked equal.

    python benchmarks/bench_route.py --json OUT.json [--presets ...] [--tokens ...]

Per (preset, T): µs and kernel count of each variant; route's one-kernel form is timed at
one_kernel_blocks = number of blocks, the two-kernel form at 0.

Inside the MoE block the one-kernel form at 4 blocks took about twice its time here (see
docs/kernels.md, routing). Two differences can be tried apart: `--block-ms 128,64` builds two tile lists, as the
block does, and `--cold` streams a 256 MB buffer through L2 before every call, as the block's
GEMMs do (timed inside the call; only the routing kernels' time is reported then).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jmoe import timing  # noqa: E402
import check_common  # noqa: E402  (benchmarks/, the script's own directory)
from jmoe.kernels import grouped_gemm as gg  # noqa: E402
from jmoe.kernels import moe as pmoe  # noqa: E402
from jmoe.kernels import route  # noqa: E402

PRESETS = {"mixtral-8x7b": (8, 2, 4096), "qwen3-30b-a3b": (128, 8, 2048),
           "deepseek-v3": (256, 8, 7168)}  # E, k, H


def route_problems(presets: str, tokens: str):
  """(preset, E, k, H, T, slots) for every comma-listed preset and token count route() takes."""
  for pname in presets.split(","):
    e, k, h = PRESETS[pname]
    for t in (int(v) for v in tokens.split(",")):
      if route.supports(t * k, h, e):
        yield pname, e, k, h, t, t * k


def _variant(x, i, *, v, e, m_alloc, bms, nb):
  """The one-kernel form with its knobs HC:TASKS set while it is traced."""
  hc, tasks = (int(a) for a in v.split(":"))
  saved = route._DIRECT_MAX_HC, route._DIRECT_TASKS
  route._DIRECT_MAX_HC, route._DIRECT_TASKS = hc, tasks
  try:
    return route.route(x, i, e, m_alloc, bms, one_kernel_blocks=nb)
  finally:
    route._DIRECT_MAX_HC, route._DIRECT_TASKS = saved


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
  ap.add_argument("--tokens", default="16,64,128,256,1024")
  ap.add_argument("--block-ms", default="128",
                  help="comma list: the row-tile heights whose tile lists route builds")
  ap.add_argument("--cold", action="store_true",
                  help="stream a 256 MB buffer through L2 before every call")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--one-variants", default="",
                  help="comma list of HC:TASKS: the one-kernel form again with "
                       "route._DIRECT_MAX_HC / _DIRECT_TASKS set so (r13b/r13c ran an "
                       "earlier four-field form, kept for old result files)")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  rows = []
  # a 256 MB buffer, more than the H200's 50 MB L2: adding 1 to it evicts the routing's inputs
  flush = jnp.zeros((64 << 20,), jnp.float32) if args.cold else None
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}")
  print(f"{'preset':14s} {'T':>5s} {'blocks':>6s} {'jnp':>14s} {'route 2 kern':>14s} "
        f"{'route 1 kern':>14s}  outputs")
  for pname, e, k, h, t, n in route_problems(args.presets, args.tokens):
    bms = tuple(int(v) for v in args.block_ms.split(","))
    m_alloc = gg.row_alloc(n, *bms)
    nb = -(-n // route.BLOCK)
    sets = []
    for i in range(3):
      k1, k2 = jax.random.split(jax.random.key(10 + i))
      x = jax.random.normal(k1, (t, h), jnp.float32).astype(jnp.bfloat16)
      _, ids = jax.lax.top_k(jax.random.normal(k2, (t, e)), k)
      sets.append((x, ids.astype(jnp.int32)))
    fns = {
        "jnp": jax.jit(lambda x, i: pmoe.route_xla(x, i, e, m_alloc, bms)),
        "two": jax.jit(lambda x, i: route.route(x, i, e, m_alloc, bms,
                                                one_kernel_blocks=0)),
        "one": jax.jit(lambda x, i: route.route(x, i, e, m_alloc, bms,
                                                one_kernel_blocks=nb)),
    }
    for v in filter(None, args.one_variants.split(",")):
      fns["one " + v] = jax.jit(functools.partial(_variant, v=v, e=e, m_alloc=m_alloc, bms=bms,
                                                  nb=nb))
    rec = dict(preset=pname, T=t, slots=n, blocks=nb, block_ms=bms, cold=args.cold)
    ref = jax.block_until_ready(fns["jnp"](*sets[0]))
    nv = int(jnp.sum(ref[2]))
    same = []
    for name, f in fns.items():
      out = jax.block_until_ready(f(*sets[0]))
      q = int(ref[3][0][1][0])
      same.append(bool(np.array_equal(np.asarray(out[0][:nv]), np.asarray(ref[0][:nv]))
                       and np.array_equal(np.asarray(out[1]), np.asarray(ref[1]))
                       and np.array_equal(np.asarray(out[3][0][0])[:, :q],
                                          np.asarray(ref[3][0][0])[:, :q])))
      if args.cold and name != "jnp":  # only the routing kernels' time counts then
        us, kernels = timing.device_time_cold(f, sets, flush, iters=args.iters,
                                              match="jmoe_route")
      else:
        us, _, kernels = timing.device_time(f, sets, iters=args.iters)
      rec[name] = dict(us=us, kernels=kernels)
    rec["outputs_equal"] = all(same)
    rows.append(rec)
    cell = lambda r: f"{r['us']:8.1f} ({len(r['kernels']):2d})"
    print(f"{pname:14s} {t:5d} {nb:6d} {cell(rec['jnp']):>14s} {cell(rec['two']):>14s} "
          f"{cell(rec['one']):>14s}  {'equal' if rec['outputs_equal'] else 'DIFFER'}  "
          + "  ".join(f"{k_[4:]}={rec[k_]['us']:.1f}" for k_ in fns if k_.startswith("one ")),
          flush=True)
  check_common.write_record(args.json, rows)


if __name__ == "__main__":
  main()
