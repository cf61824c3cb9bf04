#!/usr/bin/env bash
# Session 14's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round14.sh parts  # one H200: the one-kernel routing at 16 blocks with
#                                         # parts removed / knobs changed, warm and L2-flushed
#   bash benchmarks/gpu_round14.sh hist   # one H200: the tile-list programs' histogram in a
#                                         # loop of key chunks against unrolled, 8 and 16 blocks
#   bash benchmarks/gpu_round14.sh rank   # one H200: the one-kernel form's block programs
#   bash benchmarks/gpu_round14.sh block16 # one H200: the block, one routing kernel up to 16
#                                         # blocks against two (qwen3/deepseek 256, mixtral 1024)
#   bash benchmarks/gpu_round14.sh two    # one H200: the two-kernel form's knobs, 32-128 blocks
#   bash benchmarks/gpu_round14.sh final  # one H200: the committed code (block, training ratio)
#   bash benchmarks/gpu_round14.sh cols   # one H200: kernel 2's column rule; the block at 1024
#   bash benchmarks/gpu_round14.sh small  # one H200: the smallest count dots, block and training
#   bash benchmarks/gpu_round14.sh pad    # one H200: training routing, padding spread over programs
# Knobs since removed (the runs are recorded in BENCHMARKS.md, fourteenth round): hist's
# _HIST_CHUNK=0 (the unrolled count), rank's _COMBINED=0 (the three-compare rank), cols'
# _MAX_PROGRAMS; _MAX_HC now binds only up to 128 experts.
NAME=gpu_round14; source benchmarks/gpu_env.sh
case ${1:-parts} in
  parts)
    step 300 python3 benchmarks/route_parts.py --presets qwen3-30b-a3b,deepseek-v3 \
      --tokens 256 --json $OUT/route_parts.json ;;
  hist)  # r14b: the looped histogram (route._HIST_CHUNK) against the unrolled one (0)
    step 300 python3 benchmarks/route_parts.py --presets qwen3-30b-a3b,deepseek-v3 \
      --tokens 128,256 --variants two,one,one:_HIST_CHUNK=0,one:_HIST_CHUNK=64,one:_HIST_CHUNK=256,one:h64 \
      --json $OUT/route_parts.json ;;
  rank)  # r14c: the one-kernel form's block programs: one compare per key pair (sort keys),
         # slots per block program (route._DIRECT_ROWS), columns per program
    V=two,one,one:_COMBINED=0,one:_DIRECT_ROWS=32,one:_DIRECT_ROWS=8,one:_DIRECT_MAX_HC=2048,one:h64
    step 250 python3 benchmarks/route_parts.py --presets qwen3-30b-a3b,deepseek-v3 \
      --tokens 128,256 --variants $V --json $OUT/route_parts.json
    step 100 python3 benchmarks/route_parts.py --presets mixtral-8x7b \
      --tokens 512,1024 --variants $V --json $OUT/route_parts_mixtral.json ;;
  block16)  # r14d: the block with one routing kernel up to 16 blocks against two kernels
    step 300 env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b,deepseek-v3 --tokens 256 --iters 5 \
      --route-impls kernels:0,kernels:16 --budget-s 270
    step 200 env OUT=$OUT/block_mixtral python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets mixtral-8x7b --tokens 1024 --iters 5 \
      --route-impls kernels:0,kernels:16 --budget-s 170 ;;
  two)  # r14e: the two-kernel form's knobs at 32-64 blocks (qwen3 512 / 1024 tokens)
    V=two,two:_ROWS=16,two:_TASKS=16,two:_TASKS=64,two:_MAX_HC=1024,two:_MAX_HC=256,two:h64
    step 250 python3 benchmarks/route_parts.py --presets qwen3-30b-a3b,mixtral-8x7b \
      --tokens 512,1024,2048 --variants $V --json $OUT/route_parts.json ;;
  final)  # r14f: the committed code: the block, and the training ratio
    block_run 200 170 qwen3-30b-a3b,deepseek-v3 128,256,1024 4
    step 120 env OUT=$OUT/block_mixtral python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets mixtral-8x7b --tokens 256,1024 --iters 4 --budget-s 100
    train_ratio 220 190 ;;
  cols)  # r14g: kernel 2's column rule (_MAX_HC / _MAX_PROGRAMS) on deepseek-v3, then the
         # block at 1024 tokens with the committed rule
    step 150 python3 benchmarks/route_parts.py --presets deepseek-v3,qwen3-30b-a3b \
      --tokens 512,1024 --variants two,two:_MAX_HC=512,two:_MAX_PROGRAMS=100000 \
      --json $OUT/route_parts.json
    block_run 150 120 qwen3-30b-a3b,deepseek-v3 1024 5 ;;
  small)  # r14h: the smallest expert-count dots on the GPU (16-64 slots: chunks of 16-64 keys),
          # in the block and in route_for_training's one-block form (the training path at 8
          # tokens), each checked against XLA in the same run
    step 150 env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets mixtral-8x7b,qwen3-30b-a3b --tokens 4,8,16 --iters 4 --budget-s 120
    step 200 env OUT=$OUT/train python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets qwen3-30b-a3b,mixtral-8x7b --train-tokens 8 --iters 4 \
      --train-variants default --budget-s 170 ;;
  pad)  # r14i: the training routing with every grid row zeroing padding: 8 tokens, and the
        # training ratio at 1024 tokens (qwen3)
    step 150 env OUT=$OUT/train8 python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets qwen3-30b-a3b,mixtral-8x7b --train-tokens 8 --iters 4 \
      --train-variants default --budget-s 120
    train_ratio 150 120 qwen3-30b-a3b ;;
esac
