"""Where the routing kernels spend their time (GPU): the same route() or route_for_training()
call with parts of its work removed or its knobs changed, warm and with L2 flushed.

    python benchmarks/route_parts.py --json OUT.json [--presets ...] [--tokens 256]

Variants (each traced with route's module knobs set as named, then restored):
  two        the two-kernel form (block_counts + scatter_rows)
  one        the one-kernel form as committed
  one:nolist no tile lists (block_ms empty): the block programs alone
  one:h64    token rows of 64 columns: ranking and tile lists, almost no row copy
  two:h64    the two-kernel form on the same 64-column rows
  one:KEY=V  a route module constant set to V (e.g. _DIRECT_TASKS=8, _ROWS=16)
  train      route_for_training as committed (one kernel up to ONE_KERNEL_BLOCKS_TRAINING)
  train2     route_for_training in two kernels; train:... and train2:... take the knobs above
Not a test: outputs are checked against the first variant of the same kind (inference or
training, token row width) where both build tile lists.
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
import check_common  # noqa: E402  (benchmarks/, the script's own directory)
from bench_route import route_problems  # noqa: E402
from jmoe.kernels import grouped_gemm as gg  # noqa: E402
from jmoe.kernels import route  # noqa: E402


def _build(variant: str, e: int, n: int, bms: tuple):
  """(jitted routing fn, its token-row width override or None) for one variant name."""
  form, _, knob = variant.partition(":")
  training = form.startswith("train")
  m_alloc = gg.row_alloc(n + (route._PAD * min(e, n) if training else 0), *bms)
  blocks = {"one": -(-n // route.BLOCK), "train": route.ONE_KERNEL_BLOCKS_TRAINING}.get(form, 0)
  use_bms = () if knob == "nolist" else bms
  patch = {}
  if "=" in knob:
    name, val = knob.split("=")
    patch[name] = int(val)

  def fn(x, i):
    saved = {name: getattr(route, name) for name in patch}
    for name, val in patch.items():
      setattr(route, name, val)
    try:
      fn_ = route.route_for_training if training else route.route
      return fn_(x, i, e, m_alloc, use_bms, one_kernel_blocks=blocks)
    finally:
      for name, val in saved.items():
        setattr(route, name, val)

  return jax.jit(fn), (64 if knob == "h64" else None)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3")
  ap.add_argument("--tokens", default="256")
  ap.add_argument("--block-ms", default="128,64")
  ap.add_argument("--variants",
                  default="two,one,one:nolist,one:h64,two:h64,one:_DIRECT_TASKS=8,one:_ROWS=16")
  ap.add_argument("--iters", type=int, default=4)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  flush = jnp.zeros((64 << 20,), jnp.float32)  # 256 MB: more than the H200's 50 MB L2
  bms = tuple(int(v) for v in args.block_ms.split(","))
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}")
  rows = []
  for pname, e, k, h, t, n in route_problems(args.presets, args.tokens):
    nb = -(-n // route.BLOCK)
    ids = []
    for s in range(3):
      _, i = jax.lax.top_k(jax.random.normal(jax.random.key(20 + s), (t, e)), k)
      ids.append(i.astype(jnp.int32))
    xs = {w: [jax.random.normal(jax.random.key(30 + s), (t, w), jnp.float32)
              .astype(jnp.bfloat16) for s in range(3)] for w in (h, 64)}
    ref = {}
    for variant in args.variants.split(","):
      f, width = _build(variant, e, n, bms)
      sets = list(zip(xs[width or h], ids))
      out = jax.block_until_ready(f(*sets[0]))
      key = (width, variant.endswith("nolist"), variant.startswith("train"))
      nv = int(jnp.sum(out[2])) if not key[1] else None
      if key not in ref:
        ref[key] = out
      same = key[1] or (np.array_equal(np.asarray(out[0][:nv]), np.asarray(ref[key][0][:nv]))
                        and np.array_equal(np.asarray(out[1]), np.asarray(ref[key][1])))
      warm, _, kw = timing.device_time(f, sets, iters=args.iters)
      cold, kc = timing.device_time_cold(f, sets, flush, iters=args.iters, match="jmoe_route")
      rows.append(dict(preset=pname, T=t, blocks=nb, variant=variant, warm_us=warm,
                       cold_us=cold, kernels_warm=kw, kernels_cold=kc, same=bool(same)))
      print(f"{pname:14s} {t:5d} {nb:3d} {variant:22s} warm {warm:6.1f}  cold {cold:6.1f}  "
            f"({len(kw)} kernels) {'' if same else 'DIFFER'}", flush=True)
  check_common.write_record(args.json, rows)


if __name__ == "__main__":
  main()
