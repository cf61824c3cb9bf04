#!/usr/bin/env bash
# Session 12's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round12.sh decode  # one H200: the decode block, fused_experts' default
#                                          # (per_slot: 4 kernels) against the one-kernel decode
#                                          # (pallas_kernels.decode, one TMA ring for both GEMMs)
#                                          # at ring depths 4 / 6 / auto, same run, at 1-8 tokens
#   bash benchmarks/gpu_round12.sh final   # one H200: the block's default (auto: the decode kernel
#                                          # at qwen3 1 token) against per_slot and the decode
#                                          # kernel's ring depths; the block at 64 and 1024
#                                          # tokens; the training ratio; jmoe bench
#   bash benchmarks/gpu_round12.sh pad     # one H200: GEMM2's output tiles with padded rows (no
#                                          # 8-way bank conflicts): per_slot vs the decode kernel
#   bash benchmarks/gpu_round12.sh swap    # one H200: the decode kernel with swapped operands
#                                          # (weights as wgmma's 64-row A, the token as an
#                                          # 8-column B) against per_slot, 1-8 tokens
#   bash benchmarks/gpu_round12.sh count   # one H200: one-kernel routing whose tile-list programs
#                                          # reduce their one-hot counts once (not once per
#                                          # block): bench_route warm and L2-flushed at 64-256
#                                          # tokens, then the block at 128 / 256 tokens with one
#                                          # routing kernel (kernels:16) against two (kernels:0)
#   bash benchmarks/gpu_round12.sh final2  # one H200, the committed code: the block's default
#                                          # (auto) against per_slot at 1-4 tokens, the other
#                                          # presets at 1 token, qwen3 at 1024; jmoe bench
NAME=gpu_round12; source benchmarks/gpu_env.sh
case ${1:-decode} in
  decode)
    step 260 env OUT=$OUT/qwen3 python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b --tokens 1,2,4,8 --iters 5 --budget-s 240 \
      --layout auto,fused_decode:4,fused_decode:6,fused_decode
    step 250 env OUT=$OUT/big python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets deepseek-v3,mixtral-8x7b --tokens 1,2 --iters 5 --budget-s 230 \
      --layout auto,fused_decode:4,fused_decode ;;
  final)
    step 150 env OUT=$OUT/decode python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b --tokens 1,2 --iters 7 --budget-s 130 \
      --layout auto,per_slot,fused_decode:8,fused_decode:10
    block_run 200 180 qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 1,64,1024 4
    train_ratio 150 130
    step 80 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,4,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json ;;
  pad)
    step 120 env OUT=$OUT/qwen3 python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b --tokens 1,2,4 --iters 7 --budget-s 100 \
      --layout per_slot,fused_decode:6,fused_decode:8
    step 120 env OUT=$OUT/big python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets deepseek-v3,mixtral-8x7b --tokens 1 --iters 5 --budget-s 100 \
      --layout per_slot,fused_decode:6,fused_decode ;;
  swap)
    step 200 env OUT=$OUT/qwen3 python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b --tokens 1,2,4,8 --iters 7 --budget-s 180 \
      --layout per_slot,fused_decode:6,fused_decode:8,fused_decode
    step 200 env OUT=$OUT/big python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets deepseek-v3,mixtral-8x7b --tokens 1,2,4 --iters 5 --budget-s 180 \
      --layout auto,fused_decode:6,fused_decode ;;
  count)
    for cold in "" --cold; do
      step 90 python3 benchmarks/bench_route.py --presets qwen3-30b-a3b,deepseek-v3 \
        --tokens 64,128,256 --block-ms 128,64 $cold --json $OUT/bench_route${cold}.json
    done
    step 250 env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b,deepseek-v3 --tokens 128,256 --iters 4 \
      --route-impls kernels:0,kernels:16 --budget-s 230 ;;
  final2)
    step 150 env OUT=$OUT/decode python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b --tokens 1,2,4 --iters 7 --budget-s 130 --layout auto,per_slot
    block_run 150 130 qwen3-30b-a3b,deepseek-v3,mixtral-8x7b 1,1024 4
    step 80 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,4,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json ;;
esac
