#!/usr/bin/env bash
# Session 3's kernel round on one H200, in two device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round3.sh fwd    # T=1024 sweep (group-aligned tiles) + the block at
#                                        # 1..16384 tokens + the per_slot decode layout
#   bash benchmarks/gpu_round3.sh train  # dense ceiling + moe_align methods + the block on the
#                                        # new defaults; tgmm configs (2 CTAs / SM) + fwd+bwd
#   bash benchmarks/gpu_round3.sh final  # the block and fwd+bwd on the final defaults (count
#                                        # moe_align, 2-CTA tgmm, unmasked training GEMMs) and
#                                        # `python -m jmoe bench`
#   bash benchmarks/gpu_round3.sh decode # (next session) the one-kernel decode block against
#                                        # per_slot and sorted, first in a process of its own
NAME=gpu_round3; source benchmarks/gpu_env.sh
B=benchmarks/bench_grouped_gemm.py
P=qwen3-30b-a3b,mixtral-8x7b,deepseek-v3
case ${1:-fwd} in
  fwd)
    step 360 env OUT=$OUT/sorted python3 $B --stages sweep,block --sweep-presets $P --sweep-tokens 1024 \
      --presets $P --tokens 1,16,1024,16384 --iters 4 --budget-s 330
    step 150 env OUT=$OUT/per_slot python3 $B --stages block --layout per_slot --presets $P \
      --tokens 1,4,16 --iters 4 --no-torch --budget-s 130 ;;
  train)
    step 200 env OUT=$OUT/final python3 $B --stages ceiling,permute,block --presets $P \
      --tokens 1,4,1024,16384 --iters 4 --budget-s 180
    step 330 env OUT=$OUT/train python3 $B --stages tgmm,train --train-presets mixtral-8x7b,qwen3-30b-a3b \
      --iters 3 --budget-s 310 ;;
  final)
    step 200 env OUT=$OUT/block python3 $B --stages ceiling,block --presets $P \
      --tokens 1,1024,16384 --iters 4 --budget-s 180
    step 200 env OUT=$OUT/train python3 $B --stages train --train-presets mixtral-8x7b,qwen3-30b-a3b \
      --iters 3 --budget-s 180
    step 120 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json ;;
  decode)
    for L in fused_decode per_slot sorted; do
      step 120 env OUT=$OUT/$L python3 $B --stages block --layout $L --presets $P --tokens 1,4 \
        --iters 4 --no-torch --budget-s 110
    done ;;
esac
