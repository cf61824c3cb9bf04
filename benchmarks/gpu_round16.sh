#!/usr/bin/env bash
# Session 16's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round16.sh tune8k  # one H200: `jmoe tune --train` at mixtral's 8192
#                                          # tokens (16384 slots: the M<=16384 GEMM buckets and
#                                          # tgmm's M<=65536, none tuned before), table by table
#                                          # so a late timeout keeps the earlier ones; then the
#                                          # training ratio with the new tables if time is left
#   bash benchmarks/gpu_round16.sh ds1k    # one H200: deepseek-v3's training at 1024 tokens
#                                          # (never measured before) with the library's tables,
#                                          # `jmoe tune --train` for its training-only GEMMs,
#                                          # the ratio again, then against XLA's path if it fits
NAME=gpu_round16; source benchmarks/gpu_env.sh
case ${1:-tune8k} in
  tune8k)
    for tables in tgmm grouped_gemm_rt grouped_gemm,grouped_gemm_gated; do
      step 240 python3 -m jmoe tune --preset mixtral-8x7b --tokens 8192 --train --draws 2 \
        --iters 3 --tables $tables --log $OUT/tune_${tables%%,*}.json
      cp pallas_kernels/configs/*.json $OUT/
    done
    left=$((540 - SECONDS))
    if [ $left -gt 120 ]; then
      step $left env OUT=$OUT/train python3 benchmarks/bench_grouped_gemm.py --stages train \
        --train-presets mixtral-8x7b --train-tokens 8192 --train-variants default \
        --train-no-xla --budget-s $((left - 30))
    fi ;;
  ds1k)
    ds_train() {  # LIMIT OUTDIR [--train-no-xla]
      step $1 env OUT=$OUT/$2 python3 benchmarks/bench_grouped_gemm.py --stages train \
        --train-presets deepseek-v3 --train-tokens 1024 --train-variants default ${3:-} \
        --budget-s $(($1 - 20))
    }
    ds_train 120 train_before --train-no-xla
    step 200 python3 -m jmoe tune --preset deepseek-v3 --tokens 1024 --train --draws 2 \
      --iters 3 --tables grouped_gemm,grouped_gemm_rt --log $OUT/tune_ds1k.json
    cp pallas_kernels/configs/grouped_gemm.json pallas_kernels/configs/grouped_gemm_rt.json $OUT/
    ds_train 120 train_after --train-no-xla
    left=$((560 - SECONDS))
    [ $left -gt 90 ] && ds_train $left train_xla ;;
esac
