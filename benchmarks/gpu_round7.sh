#!/usr/bin/env bash
# Session 7's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round7.sh tgmm   # one H200: the weight-gradient kernels (row blocks from
#                                        # each expert's first row; warp-specialized variants)
#                                        # against the previous kernel (--baseline, a copy of the
#                                        # last commit's tgmm.py when present), winners into
#                                        # tgmm.json, then the training ratio
#   bash benchmarks/gpu_round7.sh train  # one H200: the training ratio alone, with XLA's optimized
#                                        # HLO of it kept (train_hlo.tgz: which glue is which)
#   bash benchmarks/gpu_round7.sh rt     # one H200: tune qwen3's training-only GEMMs at 1024 tokens
#                                        # (GEMM1 without the activation, the d lhs GEMMs on
#                                        # transposed weights: no table entries yet), keeping every
#                                        # existing entry, then the training ratio
#   bash benchmarks/gpu_round7.sh big    # one H200: the tgmm sweep on mixtral and deepseek-v3
#                                        # (winners into tgmm.json), mixtral's training ratio
#   bash benchmarks/gpu_round7.sh final  # one H200: the qwen3 tgmm sweep again (64x256 cross-
#                                        # tile tiles added), the training ratio, the block at
#                                        # 1 / 64 / 1024 tokens (torch._grouped_mm in the same
#                                        # run), jmoe bench
NAME=gpu_round7; source benchmarks/gpu_env.sh
B=benchmarks/bench_grouped_gemm.py
case ${1:-tgmm} in
  tgmm)
    base=(); [ -f benchmarks/baseline_tgmm.py ] && base=(--baseline benchmarks/baseline_tgmm.py)
    step 330 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm.json --write-tables \
      "${base[@]}"
    cp pallas_kernels/configs/tgmm.json $OUT/
    step 150 env OUT=$OUT/train python3 $B --stages train \
      --train-presets qwen3-30b-a3b,mixtral-8x7b --iters 3 --budget-s 120 ;;
  train)
    step 150 env OUT=$OUT/train XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" \
      python3 $B --stages train --train-presets qwen3-30b-a3b,mixtral-8x7b --iters 3 \
      --budget-s 120
    tar czf $OUT/train_hlo.tgz -C /tmp/hlo $(cd /tmp/hlo && ls | grep after_optimizations.txt) ;;
  rt)
    step 360 python3 -m jmoe tune --preset qwen3-30b-a3b --tokens 1024 --train --iters 3 \
      --tables grouped_gemm,grouped_gemm_rt --keep-existing
    cp pallas_kernels/configs/grouped_gemm.json pallas_kernels/configs/grouped_gemm_rt.json $OUT/
    step 90 env OUT=$OUT/train python3 $B --stages train --train-presets qwen3-30b-a3b \
      --iters 3 --budget-s 70 ;;
  big)
    step 300 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm.json --write-tables \
      --shapes mixtral,deepseek
    cp pallas_kernels/configs/tgmm.json $OUT/
    step 90 env OUT=$OUT/train python3 $B --stages train --train-presets mixtral-8x7b \
      --iters 3 --budget-s 70 ;;
  final)
    step 150 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm.json --write-tables \
      --shapes qwen3
    cp pallas_kernels/configs/tgmm.json $OUT/
    step 130 env OUT=$OUT/train python3 $B --stages train \
      --train-presets qwen3-30b-a3b,mixtral-8x7b --iters 3 --budget-s 100
    step 170 env OUT=$OUT/block python3 $B --stages block --presets qwen3-30b-a3b,mixtral-8x7b \
      --tokens 1,64,1024 --iters 4 --budget-s 140
    step 80 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,4,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json ;;
esac
