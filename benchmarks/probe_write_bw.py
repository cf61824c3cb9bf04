"""HBM bandwidth by direction on the GPU: the ceiling a weight gradient runs against.

At deepseek-v3's 1024 tokens (32 rows per expert) the weight gradient (tgmm) writes as many
bytes as the forward reads (22.5 GB of bf16 gradients), so its floor is the write bandwidth,
not the copy figure (4.3 TB/s counting read + write) the other floors use. Times, on buffers of
the size of deepseek-v3's dW13 (15 GB bf16), a fill (write only), a sum (read only) and a copy
(x + 1: read + write), each with XLA's own kernels, and a Mosaic GPU kernel that does nothing
but TMA-store one SMEM tile over the buffer (tgmm's 64x256 output tiles, 1, 2 or 8
stores in flight per SM): the store stream with no loads or math in its way.

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
from jax import lax  # noqa: E402

from jmoe import timing  # noqa: E402


def tma_store_fill(tile, rows: int, cols: int, *, in_flight: int = 4, num_ctas: int = 132,
                   interpret=False):
  """[rows, cols] made of copies of `tile` [br, bc] stored by TMA from SMEM: each of num_ctas
  programs loads the tile once and walks its output tiles, at most in_flight stores pending."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jmoe.kernels import _compat
  br, bc = tile.shape
  if rows % br or cols % bc:
    raise ValueError(f"rows={rows}, cols={cols} must be multiples of the tile {tile.shape}")
  n_c = cols // bc

  def body(src_ref, out_ref, buf, bar):
    plgpu.copy_gmem_to_smem(src_ref, buf, bar.at[0])
    plgpu.barrier_wait(bar.at[0])

    @plgpu.nd_loop(((rows // br) * n_c,), collective_axes="sm")
    def _loop(info):
      (lin,) = info.index
      plgpu.wait_smem_to_gmem(in_flight - 1, wait_read_only=True)
      plgpu.copy_smem_to_gmem(buf, out_ref.at[pl.ds(lax.div(lin, n_c) * br, br),
                                              pl.ds(lax.rem(lin, n_c) * bc, bc)])

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  return _compat.kernel(
      body, out_type=jax.ShapeDtypeStruct((rows, cols), tile.dtype),
      scratch_types=[plgpu.SMEM((br, bc), tile.dtype,
                                transforms=_compat.smem_transforms(bc, tile.dtype.itemsize)),
                     plgpu.Barrier(num_arrivals=1, num_barriers=1)],
      grid=(num_ctas,), grid_names=("sm",), compiler_params=_compat.compiler_params(),
      interpret=interpret, name="jmoe_probe_tma_store")(tile)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--gbytes", type=float, default=15.0)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  cols = 4096
  rows = int(args.gbytes * 1e9 / 2 / cols) // 64 * 64  # whole 64-row tiles
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
  # the TMA store stream, tgmm's output tile; 1 in flight = tgmm's epilogue (one SMEM tile per
  # warpgroup, its previous store must have read it)
  tiles = [(jax.random.normal(jax.random.key(7 + i), (64, 256), jnp.float32)
            .astype(jnp.bfloat16),) for i in range(2)]
  for depth in (1, 2, 8):
    fn = jax.jit(lambda t, d=depth: tma_store_fill(t, rows, cols, in_flight=d))
    got = fn(*tiles[0])
    ok = bool(jnp.array_equal(got[-64:, -256:], tiles[0][0]))
    del got
    us = timing.device_time(fn, tiles, iters=args.iters)[0]
    name = f"tma store x{depth}"
    out[name] = dict(us=us, tb_s=nbytes / us / 1e6, ok=ok)
    print(f"{name:14s} {nbytes / 1e9:6.2f} GB  {us:9.1f} us  {nbytes / us / 1e6:5.2f} TB/s  "
          f"{'ok' if ok else 'WRONG'}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
