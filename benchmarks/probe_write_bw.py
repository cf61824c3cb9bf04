"""HBM bandwidth by direction on the GPU: the ceiling a weight gradient runs against.

At deepseek-v3's 1024 tokens (32 rows per expert) the weight gradient (tgmm) writes as many
bytes as the forward reads (22.5 GB of bf16 gradients), so its floor is the write bandwidth,
not the copy figure (4.3 TB/s counting read + write) the other floors use. Times, on buffers of
the size of deepseek-v3's dW13 (15 GB bf16), a fill (write only), a sum (read only) and a copy
(x + 1: read + write), each with XLA's own kernels.

    python benchmarks/probe_write_bw.py [--gbytes 15] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jmoe import timing  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--gbytes", type=float, default=15.0)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  cols = 4096
  rows = int(args.gbytes * 1e9 / 2 / cols)
  nbytes = rows * cols * 2
  # two input buffers, rotated (no cache flatters a 15 GB buffer anyway, but METHOD.md)
  xs = [jax.random.normal(jax.random.key(i), (rows, cols), jnp.float32).astype(jnp.bfloat16)
        for i in range(2)]
  scalars = [(jnp.asarray(1.5 + i, jnp.bfloat16),) for i in range(2)]
  fill = jax.jit(lambda s: jnp.full((rows, cols), s, jnp.bfloat16))
  read = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
  copy = jax.jit(lambda x: x + jnp.bfloat16(1))
  out = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, bytes=nbytes)
  for name, fn, arg_sets, moved in (("write (fill)", fill, scalars, nbytes),
                                    ("read (sum)", read, [(x,) for x in xs], nbytes),
                                    ("copy (x+1)", copy, [(x,) for x in xs], 2 * nbytes)):
    us = timing.device_time(fn, arg_sets, iters=args.iters)[0]
    out[name] = dict(us=us, tb_s=moved / us / 1e6)
    print(f"{name:14s} {nbytes / 1e9:6.2f} GB  {us:9.1f} us  {moved / us / 1e6:5.2f} TB/s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
