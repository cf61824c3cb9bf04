"""The weighted gather-sum (the sorted block's last step) in XLA formulations: kernel count and
device time on the GPU, outputs checked against the [T, k, H] axis sum.

    python benchmarks/check_gather_sum.py [--json OUT.json]

At deepseek-v3 / 256 tokens XLA split the axis sum (the earlier permute.gather_sum,
a [T, k, H] gather summed over k) into two fusions, a compare fusion and the gather-reduce (the block was 6 kernels); this
tries forms that keep one. per_j won and is permute.gather_sum now (docs/kernels.md, routing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jmoe import timing  # noqa: E402
from jmoe.kernels import permute as perm  # noqa: E402


def axis_sum(y, inv, w):
  """The earlier permute.gather_sum: a [T, k, H] gather summed over axis 1."""
  g = jnp.take(y, jnp.maximum(inv, 0), axis=0, mode="clip").astype(jnp.float32)
  g = jnp.where((inv >= 0)[:, :, None], g * w.astype(jnp.float32)[:, :, None], 0.0)
  return jnp.sum(g, axis=1).astype(y.dtype)


def masked_weights(y, inv, w):
  """The [T, k] mask folded into the weights first, then one gather-multiply-reduce."""
  wm = jnp.where(inv >= 0, w.astype(jnp.float32), 0.0)
  g = jnp.take(y, jnp.maximum(inv, 0), axis=0, mode="clip").astype(jnp.float32)
  g = jnp.where(wm[:, :, None] != 0.0, g * wm[:, :, None], 0.0)
  return jnp.sum(g, axis=1).astype(y.dtype)


def fill(y, inv, w):
  """Empty slots aimed past the last row, gathered as zeros (mode="fill")."""
  idx = jnp.where(inv >= 0, inv, y.shape[0])
  g = jnp.take(y, idx, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
  return jnp.sum(g * w.astype(jnp.float32)[:, :, None], axis=1).astype(y.dtype)


# per_j: one row gather per j, summed in order (permute.gather_sum since r13e)
FORMS = {"axis_sum": axis_sum, "masked_weights": masked_weights, "fill": fill,
         "per_j": lambda y, i, w: perm.gather_sum(y, i, w)}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="256:8:7168,512:8:7168,128:8:7168,256:8:2048,1024:8:2048",
                  help="comma list of T:k:H")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  rows = []
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}")
  for shape in args.shapes.split(","):
    t, k, h = (int(v) for v in shape.split(":"))
    m = t * k + 256
    sets = []
    for s in range(3):
      k1, k2, k3 = jax.random.split(jax.random.key(s), 3)
      y = jax.random.normal(k1, (m, h), jnp.float32).astype(jnp.bfloat16)
      y = y.at[t * k:].set(jnp.nan)  # rows no valid slot points at: unwritten in the block
      inv = jax.random.permutation(k2, t * k).reshape(t, k).astype(jnp.int32)
      inv = jnp.where(jax.random.uniform(k3, (t, k)) < 0.1, -1, inv)
      w = jax.random.uniform(k3, (t, k), jnp.float32)
      sets.append((y, inv, w))
    ref = np.asarray(jax.jit(FORMS["axis_sum"])(*sets[0]), np.float32)
    line = f"T={t:5d} k={k} H={h:5d}"
    for name, f in FORMS.items():
      fj = jax.jit(f)
      out = np.asarray(fj(*sets[0]), np.float32)
      ok = bool(np.isfinite(out).all() and np.allclose(out, ref, rtol=1e-2, atol=1e-2))
      us, _, kernels = timing.device_time(fj, sets, iters=args.iters)
      rows.append(dict(T=t, k=k, H=h, form=name, us=us, kernels=kernels, ok=ok))
      line += f"  {name}={us:.1f}us/{len(kernels)}k{'' if ok else ' WRONG'}"
    print(line, flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
