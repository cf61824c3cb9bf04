#!/usr/bin/env bash
# Session 13's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round13.sh hist   # one H200: one-kernel routing whose tile-list programs
#                                         # count the experts with a digit-histogram dot
#                                         # (route._histogram): bench_route warm and L2-flushed,
#                                         # one kernel against two, 1-64 blocks; then the block at
#                                         # 64-256 tokens with two routing kernels (kernels:0)
#                                         # against one (kernels:16)
#   bash benchmarks/gpu_round13.sh knobs  # one H200: the one-kernel routing's shape (columns
#                                         # per program, tile-list tasks per program) at 8 and
#                                         # 16 blocks, warm and L2-flushed
#   bash benchmarks/gpu_round13.sh final  # one H200: the block with the committed routing (one
#                                         # kernel up to 8 blocks) against two kernels, 64-512
#                                         # tokens
#   bash benchmarks/gpu_round13.sh gsum   # one H200: the gather-sum's XLA forms (fusion count)
#   bash benchmarks/gpu_round13.sh final2 # one H200: the block with the committed code
NAME=gpu_round13; source benchmarks/gpu_env.sh
case ${1:-hist} in
  hist)
    step 120 python3 benchmarks/bench_route.py --presets qwen3-30b-a3b,deepseek-v3,mixtral-8x7b \
      --tokens 64,128,256,512,1024 --block-ms 128,64 --json $OUT/bench_route.json
    step 90 python3 benchmarks/bench_route.py --presets qwen3-30b-a3b,deepseek-v3 \
      --tokens 64,128,256 --block-ms 128,64 --cold --json $OUT/bench_route_cold.json
    step 270 env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b,deepseek-v3 --tokens 64,128,256 --iters 4 \
      --route-impls kernels:0,kernels:16 --budget-s 250 ;;
  knobs)  # r13b and r13c ran a since-removed four-field --one-variants (slots per block
          # program, columns, tasks, direct or histogram ranks); what stayed is HC:TASKS
    V=512:32,512:16,1024:32,1024:16
    for cold in "" --cold; do
      step 150 python3 benchmarks/bench_route.py --presets qwen3-30b-a3b,deepseek-v3 \
        --tokens 128,256 --block-ms 128,64 --one-variants $V $cold --iters 4 \
        --json $OUT/bench_route${cold}.json
    done ;;
  final)  # r13d: the block with one routing kernel up to 8 blocks (the default) against two
    step 330 env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b,deepseek-v3,mixtral-8x7b --tokens 64,128,256,512 --iters 5 \
      --route-impls kernels,kernels:0 --budget-s 300 ;;
  gsum)  # r13e: the weighted gather-sum's XLA forms, kernel count and time
    step 200 python3 benchmarks/check_gather_sum.py --json $OUT/gather_sum.json ;;
  final2)  # r13f: the committed code (one routing kernel up to 8 blocks, the per-j gather-sum)
    block_run 170 140 qwen3-30b-a3b,deepseek-v3 128,256,1024 4 ;;
esac
