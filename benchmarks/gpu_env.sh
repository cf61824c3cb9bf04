# Sourced by the benchmarks/gpu_*.sh device scripts: the environment every device call uses
# and `step`, which runs one command under its own time limit (so one failure does not hide
# the rest) without the runtime's log spam. Usage: NAME=gpu_roundN; source benchmarks/gpu_env.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# NVLink multicast stays off (KINDS.md); harmless on one GPU
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/$NAME}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
step() {
  local lim=$1; shift
  echo "=== $* (limit ${lim}s)"
  timeout $lim "$@" 2>&1 | grep -v "^W0000\|^I0000\|^E0000\|^WARNING"
  return ${PIPESTATUS[0]}
}
# The training ratio and the MoE block (benchmarks/bench_grouped_gemm.py), as the rounds run them
train_ratio() {  # LIMIT BUDGET_S [PRESETS]
  step $1 env OUT=$OUT/train python3 benchmarks/bench_grouped_gemm.py --stages train \
    --train-presets ${3:-qwen3-30b-a3b,mixtral-8x7b} --iters 5 --train-variants default \
    --budget-s $2
}
block_run() {  # LIMIT BUDGET_S PRESETS TOKENS ITERS
  step $1 env OUT=$OUT/block python3 benchmarks/bench_grouped_gemm.py --stages block \
    --presets $3 --tokens $4 --iters $5 --budget-s $2
}
train_run() {  # LIMIT BUDGET_S OUTDIR PRESETS TOKENS: the training ratio, default path, no XLA
  step $1 env OUT=$OUT/$3 python3 benchmarks/bench_grouped_gemm.py --stages train \
    --train-presets $4 --train-tokens $5 --train-variants default --train-no-xla --budget-s $2
}
tune_run() {  # LIMIT PRESET TOKENS TABLES LOGFILE [jmoe tune args]: every candidate logged
  local lim=$1 preset=$2 tokens=$3 tables=$4 log=$5
  shift 5
  step $lim python3 -m jmoe tune --preset $preset --tokens $tokens --draws 2 --iters 3 \
    --tables $tables --log $OUT/$log "$@"
}
blocks_every_preset() {  # UNTIL_S: the block at 1 / 64 / 1024 tokens with torch, preset by
                         # preset while the call has time left (until UNTIL_S seconds in)
  local p left
  for p in qwen3-30b-a3b mixtral-8x7b deepseek-v3; do
    left=$(( $1 - SECONDS ))
    [ $left -lt 40 ] && break
    block_run $(( left < 110 ? left : 110 )) 80 $p 1,64,1024 3
    mv $OUT/block/bench.json $OUT/block_$p.json
  done
}
