#!/usr/bin/env bash
# Session 9's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round9.sh tgmm   # one H200: the tgmm sweep on the training layout with
#                                        # the warp-specialized cross-tile kernel and K-fastest
#                                        # tile order (mixtral, then qwen3; winners into
#                                        # tgmm.json), then the training ratio on those tables
#   bash benchmarks/gpu_round9.sh tune   # one H200: more K-fastest tgmm candidates on the dW13
#                                        # shapes, `jmoe tune` of mixtral's training GEMMs (d lhs on
#                                        # transposed weights, plain GEMM1), the training ratio
#   bash benchmarks/gpu_round9.sh final  # one H200: A/B of grouped_gemm.py against the session's
#                                        # starting copy (first `git show 137cdc4:pallas_kernels/
#                                        # grouped_gemm.py > benchmarks/baseline_grouped_gemm.py`,
#                                        # untracked, so it travels), the K-fastest tgmm candidates
#                                        # on mixtral dW13, the training ratio, the block at 1 / 64
#                                        # / 1024 tokens with torch._grouped_mm, jmoe bench
#   bash benchmarks/gpu_round9.sh ratio  # one H200: the training ratio and the block again
#   bash benchmarks/gpu_round9.sh dw2    # one H200: warp-specialized cross-tile candidates for
#                                        # mixtral dW2, the training ratio, qwen3's block at 1 and
#                                        # 1024 tokens
#   bash benchmarks/gpu_round9.sh deepseek # one H200: warp-specialized cross-tile candidates for
#                                        # deepseek-v3's tgmm shapes (r9f: dW13 only, then the
#                                        # step limit)
NAME=gpu_round9; source benchmarks/gpu_env.sh
case ${1:-tgmm} in
  tgmm)
    step 230 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm_mixtral.json \
      --shapes mixtral --aligned --write-tables
    step 90 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm_qwen3.json --shapes qwen3 \
      --aligned --write-tables
    cp pallas_kernels/configs/tgmm.json $OUT/
    train_ratio 170 150 ;;
  tune)
    step 150 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm_dw13.json \
      --shapes "mixtral dW13,qwen3 dW13" --aligned --write-tables
    step 200 python3 -m jmoe tune --preset mixtral-8x7b --tokens 1024 --train \
      --tables grouped_gemm_rt,grouped_gemm
    cp pallas_kernels/configs/tgmm.json pallas_kernels/configs/grouped_gemm_rt.json \
      pallas_kernels/configs/grouped_gemm.json $OUT/
    train_ratio 150 130 ;;
  final)
    step 110 python3 benchmarks/check_gg_ab.py --baseline benchmarks/baseline_grouped_gemm.py
    step 70 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm_kf.json \
      --shapes "mixtral dW13" --aligned --configs " kf" --write-tables
    cp pallas_kernels/configs/tgmm.json $OUT/
    train_ratio 130 110
    block_run 150 125 qwen3-30b-a3b,mixtral-8x7b 1,64,1024 4
    step 70 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,4,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json ;;
  ratio)
    train_ratio 130 110
    block_run 130 110 mixtral-8x7b,qwen3-30b-a3b 1,64,1024 4 ;;
  dw2)
    step 60 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm_dw2.json \
      --shapes "mixtral dW2" --aligned --configs " ws xt" --write-tables
    cp pallas_kernels/configs/tgmm.json $OUT/
    train_ratio 130 110 mixtral-8x7b,qwen3-30b-a3b
    block_run 60 50 qwen3-30b-a3b 1,1024 8 ;;
  deepseek)
    step 200 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm_deepseek.json \
      --shapes deepseek --aligned --configs " ws xt" --write-tables
    cp pallas_kernels/configs/tgmm.json $OUT/ ;;
esac
