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
#   bash benchmarks/gpu_round16.sh train   # one H200: the training ratio with the tuned tables:
#                                          # deepseek-v3 1024 tokens (gradient errors now on
#                                          # the device), mixtral 8192, qwen3 / mixtral 1024
#                                          # against XLA's path
#   bash benchmarks/gpu_round16.sh final   # one H200: the row copies (the shared pipeline
#                                          # helper's first GPU run), the block at 1 / 8 / 64 /
#                                          # 1024 tokens on every preset with torch
#   bash benchmarks/gpu_round16.sh probe   # one H200: HBM write / read / copy bandwidth (the
#                                          # weight gradient's floor), deepseek-v3's training
#                                          # ratio at 4096 tokens and again at 1024
#   bash benchmarks/gpu_round16.sh epi     # one H200: the training ratio with the fused
#                                          # activation epilogues (preact, fused) against the
#                                          # default in the same process: deepseek-v3 1024,
#                                          # qwen3 / mixtral 1024
#   bash benchmarks/gpu_round16.sh store   # one H200: the TMA store stream alone (1 / 2 / 8
#                                          # stores in flight per SM) beside XLA's fill / sum /
#                                          # copy: is the weight gradient at the write ceiling?
#   bash benchmarks/gpu_round16.sh align   # one H200: deepseek-v3's weight gradients with the
#                                          # experts padded to 8 rows (training's layout: most
#                                          # row blocks masked) against 64 (none masked)
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
  train)
    step 200 env OUT=$OUT/train_ds python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets deepseek-v3 --train-tokens 1024 --train-variants default --train-no-xla \
      --budget-s 170
    step 100 env OUT=$OUT/train_mix8k python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets mixtral-8x7b --train-tokens 8192 --train-variants default --train-no-xla \
      --budget-s 80
    train_ratio 200 170 ;;
  final)
    # the weight gradient's candidates at deepseek-v3's 1024 tokens (cross-tile variants never
    # timed there), then its training ratio with the result
    step 170 python3 -m jmoe tune --preset deepseek-v3 --tokens 1024 --train --draws 2 \
      --iters 3 --tables tgmm --log $OUT/tune_ds_tgmm.json
    cp pallas_kernels/configs/tgmm.json $OUT/
    step 60 env OUT=$OUT/train_ds python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets deepseek-v3 --train-tokens 1024 --train-variants default --train-no-xla \
      --budget-s 50
    step 90 python3 benchmarks/bench_permute_rows.py --tokens 16384 \
      --json $OUT/permute_rows.json
    blocks_every_preset 560
    find $OUT -empty -delete ;;  # (at most 8 files come back)
  probe)
    step 90 python3 benchmarks/probe_write_bw.py --json $OUT/write_bw.json
    for t in 4096 1024; do
      step 120 env OUT=$OUT/train_ds$t python3 benchmarks/bench_grouped_gemm.py --stages train \
        --train-presets deepseek-v3 --train-tokens $t --train-variants default --train-no-xla \
        --budget-s 100
    done
    find $OUT -empty -delete ;;
  store)
    step 150 python3 benchmarks/probe_write_bw.py --json $OUT/write_bw.json ;;
  align)
    for a in 8 64; do
      step 120 python3 benchmarks/check_tgmm.py --shapes deepseek --align $a --configs ws \
        --json $OUT/tgmm_align$a.json
    done ;;
  epi)
    step 150 env OUT=$OUT/train_ds python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets deepseek-v3 --train-tokens 1024 --train-variants default,preact,fused \
      --train-no-xla --budget-s 130
    step 150 env OUT=$OUT/train python3 benchmarks/bench_grouped_gemm.py --stages train \
      --train-presets qwen3-30b-a3b,mixtral-8x7b --train-tokens 1024 \
      --train-variants default,preact,fused --train-no-xla --budget-s 130
    find $OUT -empty -delete ;;
esac
