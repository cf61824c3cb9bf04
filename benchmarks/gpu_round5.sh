#!/usr/bin/env bash
# Session 5's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round5.sh decode  # one H200: tune GEMM1/GEMM2 (2-CTA candidates; the
#                                         # decode buckets) for qwen3 at 1, 4, 1024 tokens and
#                                         # mixtral at 4, then the block at 1 and 4 tokens
#                                         # (per_slot: 4 launches) and qwen3 at 1024 vs torch
#   bash benchmarks/gpu_round5.sh final   # one H200: the block table on the tuned tables (1..16384
#                                         # tokens, torch._grouped_mm in the same run) + jmoe bench
#   bash benchmarks/gpu_round5.sh xi      # one H200: the cross-item GEMMs (one-warpgroup: one
#                                         # pipeline; warp-specialized: chained pipelines) checked
#                                         # and timed against the block's configs in their own
#                                         # process; winners into the tables; then the block
#   bash benchmarks/gpu_round5.sh ep      # 2+ H200s: the EP layer (own process per preset),
#                                         # then comm (bf16 / fp8 dispatch) + dispatch profile
NAME=gpu_round5; source benchmarks/gpu_env.sh
B=benchmarks/bench_grouped_gemm.py
P=qwen3-30b-a3b,mixtral-8x7b,deepseek-v3
case ${1:-decode} in
  decode)
    step 170 python3 -m jmoe tune --preset qwen3-30b-a3b --tokens 1,4,1024 \
      --tables grouped_gemm_gated,grouped_gemm --iters 5
    step 80 python3 -m jmoe tune --preset mixtral-8x7b --tokens 4 \
      --tables grouped_gemm_gated,grouped_gemm --iters 5
    cp pallas_kernels/configs/grouped_gemm.json pallas_kernels/configs/grouped_gemm_gated.json $OUT/
    step 110 env OUT=$OUT/auto python3 $B --stages block --layout auto --presets $P --tokens 1,4 \
      --iters 4 --no-torch --budget-s 100
    step 90 env OUT=$OUT/q1024 python3 $B --stages block --presets qwen3-30b-a3b --tokens 1024 \
      --iters 4 --budget-s 80 ;;
  final)
    step 330 env OUT=$OUT/block python3 $B --stages ceiling,block --presets $P \
      --tokens 1,4,64,1024,16384 --iters 4 --budget-s 310
    step 100 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,4,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json ;;
  xi)
    step 240 python3 benchmarks/check_cross_item.py --json $OUT/check_cross_item.json \
      --write-tables || exit 1
    cp pallas_kernels/configs/grouped_gemm.json pallas_kernels/configs/grouped_gemm_gated.json $OUT/
    step 60 env OUT=$OUT/q1024 python3 $B --stages block --presets qwen3-30b-a3b --tokens 64,1024 \
      --iters 4 --budget-s 50 ;;
  ep)
    E=benchmarks/bench_ep_multigpu.py
    for p in deepseek-v3 qwen3-30b-a3b; do
      step 230 python3 $E --stages layer --layer-presets $p --out $OUT --tag layer_$p \
        --backends allgather,ragged_a2a,ragged_dedup
    done
    step 150 python3 $E --stages peak,comm --torch --out $OUT --tag comm
    step 90 python3 benchmarks/ep_dispatch_profile.py --out $OUT ;;
esac
