#!/usr/bin/env bash
# Session 10's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round10.sh route  # one H200: routing alone, one kernel (block programs
#                                         # rank against every slot) vs two, at 1-8 blocks of
#                                         # 128 slots; the block at 1 / 64 tokens (qwen3,
#                                         # deepseek-v3: 4 blocks, now one routing kernel) and
#                                         # 1024; the training ratio on the reviewed tgmm
#                                         # producer; deepseek-v3's dW2 tgmm candidates
NAME=gpu_round10; source benchmarks/gpu_env.sh
case ${1:-route} in
  route)
    step 90 python3 benchmarks/bench_route.py --json $OUT/bench_route.json \
      --presets qwen3-30b-a3b,deepseek-v3 --tokens 16,32,64,128
    block_run 170 150 qwen3-30b-a3b,deepseek-v3 1,64,1024 4
    train_ratio 130 110
    step 120 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm_deepseek_dw2.json \
      --shapes "deepseek dW2" --aligned --configs " ws xt" --write-tables
    cp pallas_kernels/configs/tgmm.json $OUT/ ;;
esac
