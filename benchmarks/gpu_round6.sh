#!/usr/bin/env bash
# Session 6's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round6.sh route   # one H200: the block with the two-kernel routing
#                                         # (pallas_kernels.route) against the jnp routing, same
#                                         # run, torch._grouped_mm once per (preset, T)
#   bash benchmarks/gpu_round6.sh final   # one H200: routing alone (bench_route.py: one / two
#                                         # kernels / jnp), the block table on the defaults (1..16384
#                                         # tokens, torch._grouped_mm in the same run), the
#                                         # training ratio (1024 tokens), jmoe bench
#   bash benchmarks/gpu_round6.sh xt      # one H200: the cross-tile tgmm checked and timed
#                                         # against training's configs (winners into tgmm.json),
#                                         # then the training ratio again
#   bash benchmarks/gpu_round6.sh ep      # 2 H200s: the EP layer per preset (own process), now
#                                         # with the routing kernels inside the shard_map
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
  final)
    # the routing kernels inside shard_map on the GPU (interpret mode cannot run them there)
    step 60 python3 - <<'PY'
import jax, jax.numpy as jnp, numpy as np
import jmoe, sharding
from pallas_kernels import moe as pmoe
T, E, k, H, N = 256, 128, 8, 2048, 768
ks = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(ks[0], (T, H), jnp.float32).astype(jnp.bfloat16)
w13 = (jax.random.normal(ks[1], (E, H, 2 * N)) * H ** -0.5).astype(jnp.bfloat16)
w2 = (jax.random.normal(ks[2], (E, N, H)) * N ** -0.5).astype(jnp.bfloat16)
tw, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[3], (T, E))), k)
ref = np.asarray(jmoe.fused_moe(x, w13, w2, tw, ids, runner_backend="reference"), np.float32)
par = sharding.make_parallel(expert=1, devices=jax.devices()[:1])
for a2a in ("allgather", "ragged_a2a", "ragged_dedup"):
  f = jax.jit(lambda *a: jmoe.fused_moe(*a, parallel=par, a2a_backend=a2a,
                                        runner_backend="pallas_mosaic"))
  hlo = f.lower(x, w13, w2, tw, ids).as_text()
  out = np.asarray(f(x, w13, w2, tw, ids), np.float32)
  err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  print(f"EP=1 shard_map {a2a:12s}: route kernels in HLO: {'jmoe_route' in hlo}  rel err {err:.2e}")
PY
    step 50 python3 benchmarks/bench_route.py --json $OUT/route.json
    step 250 env OUT=$OUT/block python3 $B --stages ceiling,block --presets $P \
      --tokens 1,4,64,1024,16384 --iters 4 --budget-s 230
    step 70 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,4,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json
    step 120 env OUT=$OUT/train python3 $B --stages train --train-presets qwen3-30b-a3b,mixtral-8x7b \
      --iters 3 --budget-s 100 ;;
  xt)
    step 130 python3 benchmarks/check_cross_tile.py --json $OUT/check_cross_tile.json \
      --write-tables || exit 1
    cp pallas_kernels/configs/tgmm.json $OUT/
    step 110 env OUT=$OUT/train python3 $B --stages train --train-presets qwen3-30b-a3b,mixtral-8x7b \
      --iters 3 --budget-s 90 ;;
  ep)
    for p in qwen3-30b-a3b deepseek-v3; do
      step 240 python3 benchmarks/bench_ep_multigpu.py --stages layer --layer-presets $p \
        --out $OUT --tag layer_$p --backends allgather,ragged_a2a,ragged_dedup
    done ;;
esac
