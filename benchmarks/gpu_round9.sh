#!/usr/bin/env bash
# Session 9's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round9.sh tgmm   # one H200: the tgmm sweep on the training layout with
#                                        # the warp-specialized cross-tile kernel and K-fastest
#                                        # tile order (mixtral, then qwen3; winners into
#                                        # tgmm.json), then the training ratio on those tables
#   bash benchmarks/gpu_round9.sh final  # one H200: the training ratio, the block at 1 / 64 /
#                                        # 1024 tokens with torch._grouped_mm, jmoe bench
NAME=gpu_round9; source benchmarks/gpu_env.sh
B=benchmarks/bench_grouped_gemm.py
case ${1:-tgmm} in
  tgmm)
    step 230 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm_mixtral.json \
      --shapes mixtral --aligned --write-tables
    step 90 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm_qwen3.json --shapes qwen3 \
      --aligned --write-tables
    cp pallas_kernels/configs/tgmm.json $OUT/
    step 170 env OUT=$OUT/train python3 $B --stages train \
      --train-presets qwen3-30b-a3b,mixtral-8x7b --iters 5 --train-variants default \
      --budget-s 150 ;;
  final)
    step 150 env OUT=$OUT/train python3 $B --stages train \
      --train-presets qwen3-30b-a3b,mixtral-8x7b --iters 5 --train-variants default --budget-s 130
    step 170 env OUT=$OUT/block python3 $B --stages block --presets qwen3-30b-a3b,mixtral-8x7b \
      --tokens 1,64,1024 --iters 4 --budget-s 140
    step 80 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,4,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json ;;
esac
