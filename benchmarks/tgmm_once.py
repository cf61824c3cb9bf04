"""Run one weight-gradient (tgmm) problem a few times and nothing else, for a profiler that
reads hardware counters (Nsight Compute) to attach to:

  ncu --clock-control none --kernel-name regex:jmoe_tgmm --launch-skip 1 --launch-count 1 \\
      --section SpeedOfLight --section MemoryWorkloadAnalysis \\
      python3 benchmarks/tgmm_once.py --shape "deepseek dW13" [--align 8] [--config '{...}']

The problem is one of check_tgmm.SHAPES on random routing (check_tgmm.make_problem), experts
padded to --align rows as in training's layout; the config is the library's (tuned table or
default) unless --config gives a TgmmConfig as JSON. Prints the output's checksum so the work
cannot be skipped.
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

from check_tgmm import make_problem  # noqa: E402  (benchmarks/, the script's own directory)
from jmoe.kernels import tgmm as tg  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shape", default="deepseek dW13")
  ap.add_argument("--align", type=int, default=8)
  ap.add_argument("--tokens", type=int, default=None)
  ap.add_argument("--config", default=None, help="a TgmmConfig as JSON")
  ap.add_argument("--runs", type=int, default=2, help="calls (the first one compiles)")
  ap.add_argument("--interpret", action="store_true")
  args = ap.parse_args()
  x, dy, gs = make_problem(args.shape, args.align, args.tokens)
  cfg = (tg.TgmmConfig(**json.loads(args.config)) if args.config else
         tg.get_tgmm_config(x.shape[0], x.shape[1], dy.shape[1], gs.shape[0], x.dtype))
  interpret = None
  if args.interpret:
    from jmoe.kernels import _compat  # noqa: PLC0415
    interpret = _compat.interpret_params()
  fn = jax.jit(lambda a, b, g: tg.tgmm(a, b, g, config=cfg, interpret=interpret))
  for _ in range(args.runs):
    out = jax.block_until_ready(fn(x, dy, gs))
  print(f"{args.shape} align {args.align} rows {x.shape[0]} config {cfg.to_json()} "
        f"checksum {float(jnp.sum(out, dtype=jnp.float32)):.6e}")


if __name__ == "__main__":
  main()
