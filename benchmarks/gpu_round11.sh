#!/usr/bin/env bash
# Session 11's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round11.sh diag   # one H200: why one routing kernel at 4 blocks loses in
#                                         # the block. bench_route with the block's two tile
#                                         # lists, then with L2 flushed before every call; then
#                                         # the block at 64 tokens with the routing in two
#                                         # kernels and in one (kernels:4), same run
#   bash benchmarks/gpu_round11.sh ep     # nvidia-h200-x2 (run at aa5d3e6, when ragged_dedup had
#                                         # DEDUP_PARTS, since removed): its dispatch in 1, 2 and
#                                         # 4 parts: the kernel timeline of one call per GPU and
#                                         # stream, the peak and dispatch/combine stages (bf16),
#                                         # then the deepseek-v3 layer at EP = 1, 2
#   bash benchmarks/gpu_round11.sh direct # nvidia-h200-x2 (at 8072b17): ragged_dedup's rows
#                                         # packed first or sent from the token array (one
#                                         # piece per token):
#                                         # timeline, comm at 128 / 4096 tokens (bf16, fp8), the
#                                         # layer (deepseek-v3, qwen3) at EP = 1, 2
#   bash benchmarks/gpu_round11.sh final  # one H200: the block with one routing kernel up to 4
#                                         # blocks (auto) against two (kernels:0), same run:
#                                         # mixtral at 128 / 256 tokens, qwen3 and deepseek-v3
#                                         # at 64; the block at 1 and 1024 tokens; jmoe bench
#   bash benchmarks/gpu_round11.sh inplace # nvidia-h200-x2: the layer's timeline (deepseek-v3
#                                         # direct rows; qwen3 packed and direct): does the 55 µs
#                                         # copy of the received buffer happen there too? Then
#                                         # comm with the dispatch also timed in place
#   bash benchmarks/gpu_round11.sh skip   # nvidia-h200-x2: the token gather skipping the rows past
#                                         # the routed total (an EP rank's empty slots): the
#                                         # deepseek-v3 layer's timeline; the layer (deepseek-v3,
#                                         # qwen3) at EP = 1, 2 with ragged_dedup and allgather
#   bash benchmarks/gpu_round11.sh rowsize # nvidia-h200-x2: packed vs direct rows where the rows
#                                         # are narrower: the dispatch of qwen3 (4 KB rows) and
#                                         # mixtral (8 KB), and the mixtral layer at EP = 1, 2
NAME=gpu_round11; source benchmarks/gpu_env.sh
case ${1:-diag} in
  diag)
    for cold in "" --cold; do
      step 80 python3 benchmarks/bench_route.py --presets qwen3-30b-a3b,deepseek-v3 \
        --tokens 32,64 --block-ms 128,64 $cold --json $OUT/bench_route${cold}.json
    done
    step 200 env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b,deepseek-v3 --tokens 64 --iters 4 \
      --route-impls kernels:0,kernels:4 --budget-s 180 ;;
  ep)
    step 120 python3 benchmarks/ep_timeline.py --out $OUT --max-events 70 \
      --backends ragged_dedup,ragged_dedup@2
    step 200 python3 benchmarks/bench_ep_multigpu.py --stages peak,comm --torch --out $OUT \
      --tag comm --tokens 4096 --backends ragged_dedup,ragged_dedup@2,ragged_dedup@4 \
      --dispatch-dtypes bf16
    step 200 python3 benchmarks/bench_ep_multigpu.py --stages layer --layer-presets deepseek-v3 \
      --out $OUT --tag layer --backends ragged_dedup,ragged_dedup@2 --dispatch-dtypes bf16 ;;
  direct)
    step 100 python3 benchmarks/ep_timeline.py --out $OUT --max-events 40 \
      --backends ragged_dedup@packed,ragged_dedup@direct
    step 150 python3 benchmarks/bench_ep_multigpu.py --stages peak,comm --torch --out $OUT \
      --tag comm --backends ragged_dedup@packed,ragged_dedup@direct --dispatch-dtypes bf16,fp8
    for p in deepseek-v3 qwen3-30b-a3b; do
      step 150 python3 benchmarks/bench_ep_multigpu.py --stages layer --layer-presets $p \
        --out $OUT --tag layer_$p --backends ragged_dedup@packed,ragged_dedup@direct \
        --dispatch-dtypes bf16
    done ;;
  final)
    step 200 env OUT=$OUT/small python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets mixtral-8x7b,qwen3-30b-a3b,deepseek-v3 --tokens 64,128,256 --iters 4 \
      --route-impls auto,kernels:0 --budget-s 180
    block_run 150 130 qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 1,1024 4
    step 80 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,4,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json ;;
  inplace)
    step 120 python3 benchmarks/ep_timeline.py --out $OUT/deepseek --layer --min-us 4 \
      --max-events 60 --backends ragged_dedup
    step 120 python3 benchmarks/ep_timeline.py --out $OUT/qwen3 --layer --min-us 3 \
      --max-events 50 --preset qwen3-30b-a3b --backends ragged_dedup@packed,ragged_dedup@direct
    step 150 python3 benchmarks/bench_ep_multigpu.py --stages peak,comm --torch --out $OUT \
      --tag comm --tokens 4096 --backends ragged_dedup@packed,ragged_dedup@direct,allgather \
      --dispatch-dtypes bf16 ;;
  skip)
    step 100 python3 benchmarks/ep_timeline.py --out $OUT --layer --min-us 30 \
      --max-events 40 --backends ragged_dedup
    for p in deepseek-v3 qwen3-30b-a3b; do
      step 150 python3 benchmarks/bench_ep_multigpu.py --stages layer --layer-presets $p \
        --out $OUT --tag layer_$p --backends ragged_dedup,allgather --dispatch-dtypes bf16
    done ;;
  rowsize)
    for p in qwen3-30b-a3b mixtral-8x7b; do
      step 100 python3 benchmarks/bench_ep_multigpu.py --preset $p --stages peak,comm \
        --out $OUT --tag comm_$p --tokens 4096 --dispatch-dtypes bf16 \
        --backends ragged_dedup@packed,ragged_dedup@direct
    done
    step 150 python3 benchmarks/bench_ep_multigpu.py --stages layer --layer-presets mixtral-8x7b \
      --out $OUT --tag layer_mixtral-8x7b --backends ragged_dedup@packed,ragged_dedup@direct \
      --dispatch-dtypes bf16 ;;
esac
