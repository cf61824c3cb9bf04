#!/usr/bin/env bash
# Session 8's device calls (each under the 600 s call limit):
#   bash benchmarks/gpu_round8.sh train  # one H200: the training path (routing kernels in their
#                                        # training mode, expert_mlp) against its variants with
#                                        # fused activation epilogues / with the XLA routing, qwen3
#                                        # and mixtral at 1024 tokens, XLA's optimized HLO kept
#   bash benchmarks/gpu_round8.sh aligned # one H200: the qwen3 tgmm sweep on the training layout
#                                        # (experts padded to 8-row multiples; winners into
#                                        # tgmm.json), then the training ratio
#   bash benchmarks/gpu_round8.sh train2 # one H200: the training ratio again (padding rows zeroed
#                                        # per expert chunk; gather-sum backward masks by order)
#   bash benchmarks/gpu_round8.sh final  # one H200: the training ratio (d y and d weights of the
#                                        # gather-sum backward row by row), the block at 1 / 64 /
#                                        # 1024 tokens with torch._grouped_mm, jmoe bench
#   bash benchmarks/gpu_round8.sh ab     # one H200: the inference GEMMs against an older
#                                        # grouped_gemm.py (not in the repo: first `git show
#                                        # cde41bd:pallas_kernels/grouped_gemm.py > benchmarks/
#                                        # baseline_grouped_gemm.py`, untracked, so it travels)
#   bash benchmarks/gpu_round8.sh epi    # one H200: the fused activation epilogues (d a GEMM with
#                                        # the activation's VJP; GEMM1 writing a and h) over a few
#                                        # configs against the unfused pairs (check_act_grad.py)
#   bash benchmarks/gpu_round8.sh tgmm   # one H200: the qwen3 tgmm sweep (the cross-tile loop as
#                                        # mended in session 7's review), then the training ratio
NAME=gpu_round8; source benchmarks/gpu_env.sh
B=benchmarks/bench_grouped_gemm.py
V=default,fused,xla_route
case ${1:-train} in
  train)
    step 300 env OUT=$OUT/train XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" \
      python3 $B --stages train --train-presets qwen3-30b-a3b,mixtral-8x7b --iters 3 \
      --train-variants $V --budget-s 280
    tar czf $OUT/train_hlo.tgz -C /tmp/hlo $(cd /tmp/hlo && ls | grep after_optimizations.txt) ;;
  aligned)
    step 150 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm.json --shapes qwen3 \
      --aligned --write-tables
    cp pallas_kernels/configs/tgmm.json $OUT/
    step 200 env OUT=$OUT/train python3 $B --stages train \
      --train-presets qwen3-30b-a3b,mixtral-8x7b --iters 3 --train-variants default,xla_route \
      --budget-s 180 ;;
  train2)
    step 200 env OUT=$OUT/train python3 $B --stages train \
      --train-presets qwen3-30b-a3b,mixtral-8x7b --iters 5 --train-variants default,xla_route \
      --budget-s 180 ;;
  final)
    train_ratio 150 130
    block_run 170 140 qwen3-30b-a3b,mixtral-8x7b 1,64,1024 4
    step 80 python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,4,1024 --repeats 9 \
      --json $OUT/jmoe_bench.json ;;
  ab)
    step 200 python3 benchmarks/check_gg_ab.py --baseline benchmarks/baseline_grouped_gemm.py ;;
  epi)
    step 330 python3 benchmarks/check_act_grad.py --json $OUT/check_act_grad.json ;;
  tgmm)
    step 150 python3 benchmarks/check_tgmm.py --json $OUT/check_tgmm.json --shapes qwen3
    step 200 env OUT=$OUT/train python3 $B --stages train \
      --train-presets qwen3-30b-a3b,mixtral-8x7b --iters 3 --train-variants $V --budget-s 180 ;;
esac
