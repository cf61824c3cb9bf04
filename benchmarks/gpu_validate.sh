#!/usr/bin/env bash
# One device call: the GPU paths first run on the H200 in session 2 (training, batched kernels,
# EP with Pallas experts + attribution of the EP paths' local cost, `python -m jmoe bench`'s GPU
# path). Each step has its own time limit so one failure does not hide the rest.
# Usage (device tool): bash benchmarks/gpu_validate.sh
NAME=gpu_validate; source benchmarks/gpu_env.sh
mkdir -p $OUT/k $OUT/ep
step ${T_KERN:-200} env OUT=$OUT/k python3 benchmarks/bench_grouped_gemm.py --stages ${KSTAGES:-train,batched} \
  --train-presets ${TRAIN_PRESETS:-mixtral-8x7b,qwen3-30b-a3b} --presets mixtral-8x7b,qwen3-30b-a3b,deepseek-v3 \
  --budget-s 180 --iters 3
step ${T_EP:-150} python3 -m sharding.bench --preset qwen3-30b-a3b --tokens 1024 --iters 5 \
  --runners xla,pallas_mosaic --profile | tee $OUT/ep/local_cost.jsonl
step ${T_BENCH:-120} python3 -m jmoe bench --preset qwen3-30b-a3b --tokens 1,1024 --repeats 9 --json $OUT/jmoe_bench.json
ls -R $OUT | head -30
