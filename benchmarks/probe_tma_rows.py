"""HBM streaming rate of TMA box patterns without arithmetic (the decode kernels' load streams):
a persistent kernel, one CTA per SM, streams 1.9-3.8 GB through a ring of 2-box steps (gate /
up rows, or two column blocks), CUPTI-timed, the bf16 decode kernel's pattern as calibration.
It showed TMA's rate following the box's row width (64-byte rows ~3.2 TB/s, 128-byte ~4.5 on
the H200), which decode_wq's wide slots act on (docs/kernels.md). GPU only:

  python3 benchmarks/probe_tma_rows.py   # writes $OUT/tma_probe4.json
"""
import json, os, sys
import numpy as np, jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jmoe.kernels import _compat
from jmoe import timing

def build(shape, dtype, mode, box, stages, nsm):
  """mode 'rows': array [E, R, C], an item = (expert, row block of box[0]), gate box at rb,
  up box at rb + R/2, steps along C by box[1]. 'cols': array [E, K, C] (bf16 decode: K rows),
  item = (expert, column block pair), steps along K. 'tiled': array [E, R/br, C/bc, br, bc]."""
  e = shape[0]
  if mode == "rows":
    _, r, c = shape; nrb, ncb = r // 2 // box[0], c // box[1]
  elif mode == "cols":
    _, kk, c = shape; nrb, ncb = c // 2 // box[1], kk // box[0]
  else:
    _, nr, ncol, _, _ = shape; nrb, ncb = nr // 2, ncol
  items = e * nrb
  def body(a_hbm, out_ref, ring, o_smem, bars):
    sm = lax.axis_index("sm")
    my = lax.div(items - sm + nsm - 1, nsm)
    total = my * ncb
    def fetch(g):
      @pl.when(g < total)
      def _():
        it, s = lax.div(g, ncb), lax.rem(g, ncb)
        lin = sm + it * nsm
        ex, rb = lax.div(lin, nrb), lax.rem(lin, nrb)
        slot = lax.rem(g, stages)
        for h in range(2):
          if mode == "rows":
            src = a_hbm.at[ex, pl.ds((rb + h * nrb) * box[0], box[0]), pl.ds(s * box[1], box[1])]
          elif mode == "cols":
            src = a_hbm.at[ex, pl.ds(s * box[0], box[0]), pl.ds((rb + h * nrb) * box[1], box[1])]
          else:
            src = a_hbm.at[ex, rb + h * nrb, s]
          plgpu.copy_gmem_to_smem(src, ring.at[slot, h], bars.at[slot])
    for g in range(stages - 1):
      fetch(jnp.int32(g))
    def step(g, acc):
      plgpu.barrier_wait(bars.at[lax.rem(g, stages)])
      plgpu.commit_smem()
      fetch(g + stages - 1)
      return acc
    lax.fori_loop(0, total, step, jnp.int32(0))
    o_smem[...] = jnp.zeros((128,), jnp.float32)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[sm])
    plgpu.wait_smem_to_gmem(0)
  return _compat.kernel(
      body, out_type=jax.ShapeDtypeStruct((nsm, 128), jnp.float32),
      scratch_types=[plgpu.SMEM((stages, 2) + tuple(box), dtype), plgpu.SMEM((128,), jnp.float32),
                     plgpu.Barrier(num_arrivals=2, num_barriers=stages)],
      grid=(nsm,), grid_names=("sm",), name="probe_tma4")

def main():
  nsm = jax.devices()[0].core_count
  i32, bf = jnp.int32, jnp.bfloat16
  # (name, shape, dtype, mode, box, stages); ~0.9-1.9 GB each, items >> SMs
  cases = [
    ("bf16 decode calib [8,4096,28672] 64x64", (8, 4096, 28672), bf, "cols", (64, 64), 6),
    ("int4 mixtral w13 rows 2KiB, 128x16w (64B)", (64, 28672, 512), i32, "rows", (128, 16), 6),
    ("int4 mixtral w13 rows 2KiB, 128x32w (128B)", (64, 28672, 512), i32, "rows", (128, 32), 3),
    ("int4 mixtral w13 rows 2KiB, 128x32w (128B) s5", (64, 28672, 512), i32, "rows", (128, 32), 5),
    ("int4 deepseek w13 rows 3584B, 128x16w (64B)", (256, 4096, 896), i32, "rows", (128, 16), 6),
    ("int4 deepseek w13 rows 3584B, 128x32w (128B)", (256, 4096, 896), i32, "rows", (128, 32), 3),
    ("int4 deepseek 128x32w (128B) s5", (256, 4096, 896), i32, "rows", (128, 32), 5),
    ("int4 mixtral tiled [128x16w] contiguous", (64, 224, 32, 128, 16), i32, "tiled", (128, 16), 6),
    ("int4 deepseek tiled [128x16w] contiguous", (256, 32, 56, 128, 16), i32, "tiled", (128, 16), 6),
    ("int4 mixtral tiled [128x32w] contiguous s3", (64, 224, 16, 128, 32), i32, "tiled", (128, 32), 3),
  ]
  res = []
  key = jax.random.key(0)
  for name, shape, dt, mode, box, stages in cases:
    try:
      fn = jax.jit(build(shape, dt, mode, box, stages, nsm))
      nbytes = int(np.prod(shape)) * jnp.dtype(dt).itemsize
      sets = []
      for i in range(2):
        bits = jax.random.bits(jax.random.fold_in(key, i), shape, jnp.uint16 if dt == bf else jnp.uint32)
        sets.append((lax.bitcast_convert_type(bits, dt),))
      us, _, _ = timing.device_time(fn, sets, iters=5)
      row = dict(name=name, us=us, tbps=nbytes / us / 1e6, gb=nbytes / 1e9, stages=stages)
      del sets
    except Exception as ex:
      row = dict(name=name, error=repr(ex)[:300])
    res.append(row); print(row, flush=True)
  with open(os.path.join(os.environ.get("OUT", "/tmp"), "tma_probe4.json"), "w") as f:
    json.dump(res, f, indent=1)

if __name__ == "__main__":
  main()
