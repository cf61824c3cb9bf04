#!/usr/bin/env bash
# Session 12's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round12.sh decode  # one H200: the decode block, fused_experts' default
#                                          # (per_slot: 4 kernels) against the one-kernel decode
#                                          # (pallas_kernels.decode, one TMA ring for both GEMMs)
#                                          # at ring depths 4 / 6 / auto, same run, at 1-8 tokens
NAME=gpu_round12; source benchmarks/gpu_env.sh
case ${1:-decode} in
  decode)
    step 260 env OUT=$OUT/qwen3 python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b --tokens 1,2,4,8 --iters 5 --budget-s 240 \
      --layout auto,fused_decode:4,fused_decode:6,fused_decode
    step 250 env OUT=$OUT/big python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets deepseek-v3,mixtral-8x7b --tokens 1,2 --iters 5 --budget-s 230 \
      --layout auto,fused_decode:4,fused_decode ;;
esac
