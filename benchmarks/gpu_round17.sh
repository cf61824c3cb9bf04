#!/usr/bin/env bash
# Session 17's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round17.sh obuf    # one H200: the weight gradient's two output buffers
#                                          # (TgmmConfig.out_buffers=2, first GPU run): `jmoe
#                                          # tune --tables tgmm` at deepseek-v3's 1024 tokens
#                                          # (the config in use competes), its training ratio,
#                                          # the ob2 candidates against the tables on qwen3 /
#                                          # mixtral, then Nsight Compute's counters on
#                                          # deepseek-v3's dW13
#   bash benchmarks/gpu_round17.sh obuf2   # one H200: `jmoe tune --tables tgmm` with the two-buffer
#                                          # candidates at qwen3 / mixtral 1024 and deepseek-v3
#                                          # 4096 tokens, then those training ratios
#   bash benchmarks/gpu_round17.sh ncuq    # one H200: Nsight Compute's counters on qwen3's block at
#                                          # 1024 tokens, GEMM1 (gated) and GEMM2: where do they
#                                          # lose to the read ceiling (DRAM bytes, L2 hits)?
#   bash benchmarks/gpu_round17.sh final   # one H200: the training ratios with this round's tables
#                                          # (deepseek-v3, qwen3, mixtral at 1024 tokens), then the
#                                          # block at 1 / 64 / 1024 tokens on every preset with torch
#   bash benchmarks/gpu_round17.sh big     # one H200: the dense ceiling, then the block at 16384
#                                          # tokens on every preset with torch (the % of dense
#                                          # targets re-checked with the code as it is now)
#   bash benchmarks/gpu_round17.sh tune16k # one H200: `jmoe tune` of the forward GEMMs at 16384 tokens
#                                          # with the chained warp-specialized candidates (deepseek-
#                                          # v3 first: 65.6 % of dense in r17e), then the block at
#                                          # 16384 tokens with the dense ceiling
#   bash benchmarks/gpu_round17.sh parts   # one H200: the weight gradient storing tiles in chunks
#                                          # (TgmmConfig.store_parts, first GPU run): `jmoe tune
#                                          # --train --tables tgmm` at deepseek-v3 1024 / 4096,
#                                          # qwen3 / mixtral 1024, then the training ratios
#   bash benchmarks/gpu_round17.sh mix8k   # one H200: `jmoe tune --train --tables tgmm` at mixtral's
#                                          # 8192 tokens with the chunked-store candidates, its
#                                          # training ratio, then qwen3 / mixtral at 1024 again
#   bash benchmarks/gpu_round17.sh rt      # one H200: `jmoe tune --train` of the plain / transposed-
#                                          # weight GEMMs with the chained WS candidate at qwen3 /
#                                          # mixtral 1024 tokens, then their training ratios
#   bash benchmarks/gpu_round17.sh last    # one H200: the thinnest targets once more with the final
#                                          # tables: qwen3's training ratio and block at 1024
#                                          # tokens, deepseek-v3's block at 16384 (% of dense)
NAME=gpu_round17; source benchmarks/gpu_env.sh
ncu_tgmm() {  # LIMIT SHAPE TAG [tgmm_once args]: speed-of-light and memory counters, one launch
  local lim=$1 shape=$2 tag=$3; shift 3
  step $lim ncu --clock-control none --kernel-name regex:jmoe_tgmm --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section LaunchStats --section Occupancy \
    python3 benchmarks/tgmm_once.py --shape "$shape" "$@" > $OUT/ncu_$tag.txt 2>&1
  tail -60 $OUT/ncu_$tag.txt
}
case ${1:-obuf} in
  obuf)
    tune_run 200 deepseek-v3 1024 tgmm tune_ds_tgmm.json --train
    cp pallas_kernels/configs/tgmm.json $OUT/
    train_run 80 65 train_ds deepseek-v3 1024
    step 100 python3 benchmarks/check_tgmm.py --shapes qwen3,mixtral --aligned --configs ob2 \
      --json $OUT/tgmm_ob2.json
    left=$((570 - SECONDS))
    [ $left -gt 40 ] && ncu_tgmm $left "deepseek dW13" ds_dw13
    find $OUT -empty -delete ;;
  obuf2)
    for pt in qwen3-30b-a3b:1024 mixtral-8x7b:1024 deepseek-v3:4096; do
      tune_run 120 ${pt%:*} ${pt#*:} tgmm tune_${pt%%-*}.json --train
    done
    cp pallas_kernels/configs/tgmm.json $OUT/
    train_run 150 130 train qwen3-30b-a3b,mixtral-8x7b 1024
    train_run 120 100 train_ds deepseek-v3 4096
    find $OUT -empty -delete ;;
  final)
    train_run 90 75 train_ds deepseek-v3 1024
    train_run 100 85 train qwen3-30b-a3b,mixtral-8x7b 1024
    blocks_every_preset 570
    find $OUT -empty -delete ;;
  big)
    step 420 env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py --stages ceiling,block \
      --presets qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --tokens 16384 --iters 3 --budget-s 380
    find $OUT -empty -delete ;;
  tune16k)
    for p in deepseek-v3 mixtral-8x7b qwen3-30b-a3b; do
      left=$((400 - SECONDS))
      [ $left -lt 60 ] && break
      tune_run $(( left < 160 ? left : 160 )) $p 16384 grouped_gemm_gated,grouped_gemm \
        tune_${p%%-*}.json
    done
    cp pallas_kernels/configs/grouped_gemm_gated.json pallas_kernels/configs/grouped_gemm.json $OUT/
    step $((580 - SECONDS)) env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py \
      --stages ceiling,block --presets deepseek-v3,mixtral-8x7b,qwen3-30b-a3b --tokens 16384 \
      --iters 3 --budget-s $((560 - SECONDS))
    find $OUT -empty -delete ;;
  parts)
    for pt in deepseek-v3:1024 qwen3-30b-a3b:1024 mixtral-8x7b:1024 deepseek-v3:4096; do
      tune_run 120 ${pt%:*} ${pt#*:} tgmm tune_${pt%%-*}${pt#*:}.json --train
    done
    cp pallas_kernels/configs/tgmm.json $OUT/
    train_run 90 75 train_ds deepseek-v3 1024
    train_run 100 85 train qwen3-30b-a3b,mixtral-8x7b 1024
    left=$((570 - SECONDS))
    [ $left -gt 60 ] && train_run $left $((left - 15)) train_ds4k deepseek-v3 4096
    find $OUT -empty -delete ;;
  mix8k)
    tune_run 170 mixtral-8x7b 8192 tgmm tune_mixtral8192.json --train
    cp pallas_kernels/configs/tgmm.json $OUT/
    train_run 100 85 train_mix8k mixtral-8x7b 8192
    left=$((400 - SECONDS))
    [ $left -gt 50 ] && train_run $left $((left - 15)) train qwen3-30b-a3b,mixtral-8x7b 1024
    find $OUT -empty -delete ;;
  rt)
    for p in qwen3-30b-a3b mixtral-8x7b; do
      tune_run 110 $p 1024 grouped_gemm,grouped_gemm_rt tune_${p%%-*}.json --train
    done
    cp pallas_kernels/configs/grouped_gemm.json pallas_kernels/configs/grouped_gemm_rt.json $OUT/
    left=$((330 - SECONDS))
    [ $left -gt 50 ] && train_run $left $((left - 15)) train qwen3-30b-a3b,mixtral-8x7b 1024
    find $OUT -empty -delete ;;
  last)
    train_run 50 40 train qwen3-30b-a3b 1024
    block_run 50 40 qwen3-30b-a3b 1024 5
    step 90 env OUT=$OUT/block16k python3 benchmarks/bench_grouped_gemm.py --stages ceiling,block \
      --presets deepseek-v3 --tokens 16384 --iters 3 --budget-s 75
    find $OUT -empty -delete ;;
  ncuq)
    for kn in jmoe_gg_gated jmoe_gg_ws_xi; do
      step 200 ncu --clock-control none --kernel-name regex:$kn --launch-skip 5 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats \
        --section Occupancy --section WorkloadDistribution \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum \
        python3 benchmarks/bench_grouped_gemm.py --stages block --presets qwen3-30b-a3b \
        --tokens 1024 --iters 1 --no-torch > $OUT/ncu_$kn.txt 2>&1
      grep -A200 "Section: GPU Speed" $OUT/ncu_$kn.txt | grep -v "^ *--\|OPT\|^ *$" | head -70
    done ;;
esac
