#!/usr/bin/env bash
# Session 6's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round6.sh route   # one H200: the block with the two-kernel routing
#                                         # (pallas_kernels.route) against the jnp routing, same
#                                         # run, torch._grouped_mm once per (preset, T)
#   bash benchmarks/gpu_round6.sh xi      # one H200: session 5's cross-item check (winners into
#                                         # the tables), then the qwen3 block at 64 / 1024 tokens
NAME=gpu_round6; source benchmarks/gpu_env.sh
B=benchmarks/bench_grouped_gemm.py
P=qwen3-30b-a3b,mixtral-8x7b,deepseek-v3
case ${1:-route} in
  route)
    step 60 python3 - <<'PY'
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import route, permute as P, grouped_gemm as gg
for (T, k, E, H) in [(1024, 8, 128, 2048), (4, 2, 8, 4096), (1024, 8, 256, 7168)]:
  rng = np.random.default_rng(T)
  ids = rng.integers(0, E, (T, k)).astype(np.int32); ids[0, 0] = -1
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
  m_alloc = gg.row_alloc(T * k, 64, 128)
  xs, inv, gs, metas = route.route(x, jnp.asarray(ids), E, m_alloc, (64, 128))
  order, gs_r, inv_r = P.moe_align_reference(ids, E)
  nv = int(gs_r.sum())
  ok = (np.asarray(gs) == gs_r).all() and (np.asarray(inv) == inv_r).all() and np.array_equal(
      np.asarray(xs)[:nv], np.asarray(x)[order[:nv] // k])
  for bm, (meta, nt) in zip((64, 128), metas):
    mr, ntr = gg.tile_metadata(jnp.asarray(gs_r), m_alloc, bm)
    q = int(ntr[0])
    ok = ok and int(nt[0]) == q and np.array_equal(np.asarray(meta)[:, :q], np.asarray(mr)[:, :q])
  print(f"route T={T} k={k} E={E} H={H}: {'OK' if ok else 'MISMATCH'}")
PY
    step 400 env OUT=$OUT/block python3 $B --stages ceiling,block --presets $P \
      --tokens 4,64,1024 --route-impls kernels,xla --iters 4 --budget-s 380 ;;
  xi)
    step 240 python3 benchmarks/check_cross_item.py --json $OUT/check_cross_item.json \
      --write-tables || exit 1
    cp pallas_kernels/configs/grouped_gemm.json pallas_kernels/configs/grouped_gemm_gated.json $OUT/
    step 60 env OUT=$OUT/q1024 python3 $B --stages block --presets qwen3-30b-a3b --tokens 64,1024 \
      --iters 4 --budget-s 50 ;;
esac
