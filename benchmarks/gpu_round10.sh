#!/usr/bin/env bash
# Session 10's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round10.sh route  # one H200: routing alone, one kernel (block programs
#                                         # rank against every slot) vs two, at 1-8 blocks of
#                                         # 128 slots; the block at 1 / 64 tokens (qwen3,
#                                         # deepseek-v3: 4 blocks, now one routing kernel) and
#                                         # 1024; the training ratio on the reviewed tgmm
#                                         # producer; deepseek-v3's dW2 tgmm candidates
#   bash benchmarks/gpu_round10.sh route2 # one H200: the same routing comparison with the one-
#                                         # kernel form's block programs at one row step (32
#                                         # slots) each; the block at 16 / 64 tokens
#   bash benchmarks/gpu_round10.sh route3 # one H200: route2 with every key load issued before the
#                                         # counts and the token rows' gather before the ranks
#   bash benchmarks/gpu_round10.sh inblock # one H200: the block at 16 / 32 / 64 tokens with the
#                                         # routing in two kernels (kernels:0) and in one up to
#                                         # 4 blocks (kernels:4), in the same run
#   bash benchmarks/gpu_round10.sh final  # one H200: the block at 16 / 32 / 64 tokens with the
#                                         # routing in two kernels and in the default form (one
#                                         # kernel up to 2 blocks), same run; the block at 1 and
#                                         # 1024 tokens; jmoe bench
#   bash benchmarks/gpu_round10.sh ep     # nvidia-h200-x2: the dispatch profile with the fused
#                                         # computations of its costliest XLA fusions, then the
#                                         # peak and dispatch/combine stages (bf16), with the
#                                         # ragged paths' receive buffers uninitialized
#   bash benchmarks/gpu_round10.sh layer  # nvidia-h200-x2: the EP layer at EP = 1 and 2 (deepseek-v3,
#                                         # qwen3) with allgather and ragged_dedup
#   bash benchmarks/gpu_round10.sh diag   # one H200 (not run this session: no device time left):
#                                         # why one routing kernel at 4 blocks loses in the block;
#                                         # bench_route with the block's two tile lists, then also
#                                         # with L2 flushed before every call
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
  route2)
    step 90 python3 benchmarks/bench_route.py --json $OUT/bench_route.json \
      --presets qwen3-30b-a3b,deepseek-v3,mixtral-8x7b --tokens 16,32,64,128,256
    block_run 150 130 qwen3-30b-a3b,deepseek-v3,mixtral-8x7b 16,64 4 ;;
  route3)
    step 80 python3 benchmarks/bench_route.py --json $OUT/bench_route.json \
      --presets qwen3-30b-a3b,deepseek-v3 --tokens 16,32,64,128
    block_run 120 100 qwen3-30b-a3b,deepseek-v3 16,64 4 ;;
  inblock)
    step 240 env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b,deepseek-v3,mixtral-8x7b --tokens 16,32,64 --iters 4 \
      --route-impls kernels:0,kernels:4 --budget-s 220 ;;
  final)
    step 200 env OUT=$OUT/small python3 benchmarks/bench_grouped_gemm.py --stages block \
      --presets qwen3-30b-a3b,deepseek-v3,mixtral-8x7b --tokens 16,32,64 --iters 4 \
      --route-impls auto,kernels:0 --budget-s 180
    block_run 150 130 qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 1,1024 4
    step 80 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,4,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json ;;
  ep)
    step 150 python3 benchmarks/ep_dispatch_profile.py --out $OUT --backends \
      ragged_dedup,ragged_a2a,allgather --dispatch-dtypes bf16 --hlo 4
    step 200 python3 benchmarks/bench_ep_multigpu.py --stages peak,comm --torch --out $OUT \
      --tag comm --backends allgather,ragged_a2a,ragged_dedup --dispatch-dtypes ${DTYPES:-bf16} ;;
  diag)
    for cold in "" --cold; do
      step 80 python3 benchmarks/bench_route.py --presets qwen3-30b-a3b,deepseek-v3 \
        --tokens 32,64 --block-ms 128,64 $cold
    done ;;
  layer)
    for p in deepseek-v3 qwen3-30b-a3b; do
      step 200 python3 benchmarks/bench_ep_multigpu.py --stages layer --layer-presets $p \
        --out $OUT --tag layer_$p --backends ragged_dedup,allgather,ragged_a2a
    done ;;
esac
