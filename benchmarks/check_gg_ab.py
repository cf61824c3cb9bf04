"""A/B of the grouped GEMM kernels against another copy of pallas_kernels/grouped_gemm.py (e.g.
`git show REV:pallas_kernels/grouped_gemm.py > benchmarks/baseline_grouped_gemm.py`), same data,
same process, alternating A and B rounds: was a change to the kernel builder neutral for the
inference GEMMs (and mixtral's d x GEMM of the backward)? Each side uses its own config lookup
(the same tables). Device µs, CUPTI.

  PYTHONPATH=$PWD python3 benchmarks/check_gg_ab.py --baseline benchmarks/baseline_grouped_gemm.py
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import timing
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import permute

SHAPES = (  # name, E, k, T, K (lhs cols), N (output cols), kind (gated / plain / rt: the
            # backward's d lhs GEMM on transposed weights)
    ("qwen3 GEMM1 1024", 128, 8, 1024, 2048, 768, "gated"),
    ("qwen3 GEMM2 1024", 128, 8, 1024, 768, 2048, "plain"),
    ("mixtral GEMM1 1024", 8, 2, 1024, 4096, 14336, "gated"),
    ("mixtral GEMM1 64", 8, 2, 64, 4096, 14336, "gated"),
    ("mixtral GEMM2 1024", 8, 2, 1024, 14336, 4096, "plain"),
    ("mixtral d x 1024", 8, 2, 1024, 28672, 4096, "rt"),
)


def _fn(mod, kind):
  if kind == "gated":
    return jax.jit(mod.grouped_gemm_gated)
  return jax.jit(functools.partial(mod.grouped_gemm, transpose_rhs=kind == "rt"))


def _load(path):
  spec = importlib.util.spec_from_file_location("baseline_grouped_gemm", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod
  spec.loader.exec_module(mod)
  return mod


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--baseline", required=True)
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  base = _load(args.baseline)
  ok = True
  for name, e, k, t, kdim, n, kind in SHAPES:
    gated = kind == "gated"
    keys = jax.random.split(jax.random.key(e + n + t), 3)
    m = t * k
    x = jax.random.normal(keys[0], (m, kdim), jnp.float32).astype(jnp.bfloat16)
    w_shape = (e, n, kdim) if kind == "rt" else (e, kdim, 2 * n if gated else n)
    w = (jax.random.normal(keys[1], w_shape, jnp.float32) / kdim ** 0.5).astype(jnp.bfloat16)
    _, ids = jax.lax.top_k(jax.random.normal(keys[2], (t, e)), k)
    _, gs, _ = permute.moe_align(ids.astype(jnp.int32), e)
    fns = {lab: _fn(mod, kind) for lab, mod in (("new", gg), ("base", base))}
    outs = {lab: np.asarray(f(x, w, gs), np.float32) for lab, f in fns.items()}
    rows = int(np.asarray(gs).sum())
    diff = float(np.abs(outs["new"][:rows] - outs["base"][:rows]).max())
    ok &= diff == 0.0
    times = {lab: [] for lab in fns}
    for _ in range(args.rounds):  # alternate, so drift hits both sides
      for lab, f in fns.items():
        times[lab].append(timing.device_time(f, [(x, w, gs)], iters=5)[0])
    med = {lab: float(np.median(v)) for lab, v in times.items()}
    print(f"{name:20s} new {med['new']:8.1f} us  base {med['base']:8.1f} us  "
          f"new/base {med['new'] / med['base']:.3f}  max |diff| {diff:.1e}", flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
