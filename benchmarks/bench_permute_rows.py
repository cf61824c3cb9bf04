"""The routing's row copy alone (GPU): the sorted token rows of the jnp routing path made by
XLA's gather, permute.gather_rows (TMA loads in sorted order: a token's row is read k times)
and permute.scatter_rows (TMA loads in token order, k row stores each), checked equal in the
same run; device time against the bytes' floor (x read once, the rows written once, 4.3 TB/s).

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
from pallas_kernels import permute  # noqa: E402

BW = 4.3e12  # H200 copy rate, bytes / s (METHOD.md ceiling)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--presets", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
  ap.add_argument("--tokens", default="4096,16384")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}")
  rows = []
  for pname in args.presets.split(","):
    cfg = get_preset(pname)
    e, k, h = cfg.num_experts, cfg.top_k, cfg.hidden_size
    for t in (int(v) for v in args.tokens.split(",")):
      m = t * k
      sets = []
      for s in range(3):
        _, ids = jax.lax.top_k(jax.random.normal(jax.random.key(20 + s), (t, e)), k)
        order, gs, inv = permute.moe_align(ids.astype(jnp.int32), e)
        x = jax.random.normal(jax.random.key(30 + s), (t, h), jnp.float32).astype(jnp.bfloat16)
        sets.append((x, order, inv, jnp.sum(gs)))
      variants = {
          "xla": jax.jit(lambda x, o, i, n: jnp.take(x, o // k, axis=0)),
          "gather": jax.jit(lambda x, o, i, n: permute.gather_rows(x, o // k, n)),
          "scatter": jax.jit(lambda x, o, i, n: permute.scatter_rows(x, i, m, n)),
      }
      want = np.asarray(variants["xla"](*sets[0]))
      floor = (t * h + m * h) * 2 / BW * 1e6
      for name, f in variants.items():
        got = np.asarray(f(*sets[0]))
        us, _, kernels = timing.device_time(f, sets, iters=args.iters)
        same = bool(np.array_equal(got, want))
        rows.append(dict(preset=pname, T=t, k=k, H=h, variant=name, us=us, floor_us=floor,
                         kernels=kernels, correct=same))
        print(f"{pname:14s} T={t:6d} {name:8s} {us:8.1f} us  x floor {us / floor:5.2f}  "
              f"{'ok' if same else 'DIFFERS'}", flush=True)
  check_common.write_record(args.json, rows)


if __name__ == "__main__":
  main()
