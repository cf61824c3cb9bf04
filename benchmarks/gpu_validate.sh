#!/usr/bin/env bash
# A GPU smoke check of the paths CPU CI cannot time, in one device call (~8 min): the training
# path's gradients and ratio and the batched kernels (bench_grouped_gemm.py, checked against
# XLA), the EP paths with the Pallas experts on a 1-device mesh and their local cost
# (python -m jmoe.sharding.bench --profile), and `python -m jmoe bench`'s GPU path (torch peer
# through DLPack). Each step has its own time limit (T_KERN, T_EP, T_BENCH) so one failure does
# not hide the rest; KSTAGES / TRAIN_PRESETS override the kernel step's stages and presets.
# Usage (device tool, repo root): bash benchmarks/gpu_validate.sh
NAME=gpu_validate; source benchmarks/gpu_env.sh
mkdir -p $OUT/k $OUT/ep
step ${T_KERN:-200} env OUT=$OUT/k python3 benchmarks/bench_grouped_gemm.py --stages ${KSTAGES:-train,batched} \
  --train-presets ${TRAIN_PRESETS:-mixtral-8x7b,qwen3-30b-a3b} --presets mixtral-8x7b,qwen3-30b-a3b,deepseek-v3 \
  --budget-s 180 --iters 3
step ${T_EP:-150} python3 -m jmoe.sharding.bench --preset qwen3-30b-a3b --tokens 1024 --iters 5 \
  --runners xla,pallas_mosaic --profile | tee $OUT/ep/local_cost.jsonl
step ${T_BENCH:-120} python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,1024 --repeats 9 --json $OUT/jmoe_bench.json
ls -R $OUT | head -30
