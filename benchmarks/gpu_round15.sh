#!/usr/bin/env bash
# Session 15's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round15.sh small8  # one H200: GEMM1 / GEMM2 candidates at qwen3's 2 and
#                                          # 8 tokens (16 / 64 slots: buckets without a tuned
#                                          # entry), the block with the library's configs and
#                                          # the sweep's best; training routing at 8 tokens
#                                          # taken apart
#   bash benchmarks/gpu_round15.sh scatter # one H200: the jnp routing path's row copy in token
#                                          # order (scatter_rows) against sorted order
#                                          # (gather_rows) alone, then the block at 16384 tokens
#   bash benchmarks/gpu_round15.sh route16k # one H200: the jnp routing path with the scatter
#                                          # after route.slot_positions; the block at 16384
#                                          # tokens on every preset with the dense ceiling
#   bash benchmarks/gpu_round15.sh scan    # one H200: slot_positions' block scan as a dot
#                                          # against jnp.cumsum; GEMM1 / GEMM2 candidates at
#                                          # qwen3's 16384 tokens, the block with both
#   bash benchmarks/gpu_round15.sh train4k # one H200: training past 8192 slots (the jnp
#                                          # routing path): the row copy by scatter_rows
#                                          # against XLA's gather (qwen3 4096, mixtral 8192)
#   bash benchmarks/gpu_round15.sh final   # one H200: the committed code: the block at small
#                                          # and 1024 tokens, training at 2048 tokens of qwen3
#                                          # (the jnp routing path) with both row copies
#   bash benchmarks/gpu_round15.sh mix2    # one H200: GEMM candidates at mixtral's 2 tokens
#                                          # (3 experts: 2 waves for 1.45 of work), the block
#                                          # at 2 / 3 tokens with both; training at qwen3's
#                                          # 2048 tokens without the XLA reference
#   bash benchmarks/gpu_round15.sh small   # one H200: the committed code, every preset from 1
#                                          # to 256 tokens and at 1024, floors per input set
#   bash benchmarks/gpu_round15.sh mix1k   # one H200: GEMM candidates at mixtral's 1024 tokens
#                                          # timed over three routings (r15h: one of three
#                                          # took 12 % longer), the block with both
#   bash benchmarks/gpu_round15.sh trainbig # one H200: training past the tuned buckets (mixtral
#                                          # 8192, qwen3 2048 tokens): the weight gradient with
#                                          # the nearest bucket's tuned config against the default
NAME=gpu_round15; source benchmarks/gpu_env.sh
case ${1:-small8} in
  small8)
    step 420 env OUT=$OUT/sweep python3 benchmarks/bench_grouped_gemm.py --stages sweep,block \
      --sweep-presets qwen3-30b-a3b --sweep-tokens 8,2 --presets qwen3-30b-a3b --tokens 8,2 \
      --block-configs lib,sweep --iters 5 --budget-s 380
    step 120 python3 benchmarks/route_parts.py --presets qwen3-30b-a3b,mixtral-8x7b --tokens 8 \
      --variants train,train2,train:h64,train:nolist,one --json $OUT/route_parts.json ;;
  scatter)
    step 200 python3 benchmarks/bench_permute_rows.py --tokens 4096,16384 \
      --json $OUT/permute_rows.json
    for impl in pallas scatter; do
      step 150 env OUT=$OUT/block_$impl python3 benchmarks/bench_grouped_gemm.py --stages block \
        --presets qwen3-30b-a3b --tokens 16384 --iters 3 --permute-impl $impl --budget-s 120
    done ;;
  route16k)
    step 200 python3 benchmarks/bench_permute_rows.py --no-copy --tokens 4096,16384 \
      --json $OUT/route_xla.json
    step 330 env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py --stages ceiling,block \
      --presets qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --tokens 16384 --iters 3 --budget-s 300 ;;
  scan)
    step 200 python3 benchmarks/bench_permute_rows.py --no-copy --tokens 4096,16384 \
      --json $OUT/route_xla.json
    step 330 env OUT=$OUT/sweep python3 benchmarks/bench_grouped_gemm.py \
      --stages ceiling,sweep,block --sweep-presets qwen3-30b-a3b --sweep-tokens 16384 \
      --presets qwen3-30b-a3b --tokens 16384 --block-configs lib,sweep --iters 3 \
      --budget-s 300 ;;
  train4k)
    step 250 env OUT=$OUT/train_qwen3 python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets qwen3-30b-a3b --train-tokens 4096 --train-variants default,take_rows \
      --budget-s 220
    step 250 env OUT=$OUT/train_mixtral python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets mixtral-8x7b --train-tokens 8192 --train-variants default,take_rows \
      --budget-s 220 ;;
  final)
    block_run 260 230 qwen3-30b-a3b 4,8,16,64,256,1024 4
    step 120 env OUT=$OUT/block_mixtral python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets mixtral-8x7b --tokens 1,2,8,1024 --iters 4 --budget-s 100
    step 180 env OUT=$OUT/train python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets qwen3-30b-a3b --train-tokens 2048 --train-variants default,take_rows \
      --budget-s 150 ;;
  mix2)
    step 300 env OUT=$OUT/sweep python3 benchmarks/bench_grouped_gemm.py --stages sweep,block \
      --sweep-presets mixtral-8x7b --sweep-tokens 2 --presets mixtral-8x7b --tokens 2,3 \
      --block-configs lib,sweep --iters 5 --budget-s 270
    step 150 env OUT=$OUT/train python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets qwen3-30b-a3b --train-tokens 2048 --train-variants take_rows,default \
      --train-no-xla --budget-s 120 ;;
  small)
    block_run 200 170 qwen3-30b-a3b 1,2,4,8,16,32,64,128,256,1024 4
    step 130 env OUT=$OUT/block_mixtral python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets mixtral-8x7b --tokens 1,2,3,4,8,16,64,256,1024 --iters 4 --budget-s 110
    step 170 env OUT=$OUT/block_deepseek python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets deepseek-v3 --tokens 1,2,4,8,16,64,256,1024 --iters 3 --budget-s 150 ;;
  mix1k)
    step 300 env OUT=$OUT/sweep python3 benchmarks/bench_grouped_gemm.py --stages sweep,block \
      --sweep-presets mixtral-8x7b --sweep-tokens 1024 --presets mixtral-8x7b --tokens 1024 \
      --block-configs lib,sweep --iters 4 --budget-s 270 ;;
  trainbig)
    step 130 env OUT=$OUT/train_mixtral python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets mixtral-8x7b --train-tokens 8192 --train-variants default,exact_buckets \
      --train-no-xla --budget-s 110
    step 90 env OUT=$OUT/train_qwen3 python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets qwen3-30b-a3b --train-tokens 2048 --train-variants default,exact_buckets \
      --train-no-xla --budget-s 70 ;;
esac
