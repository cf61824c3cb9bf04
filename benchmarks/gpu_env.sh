# Shell helpers for running the benchmarks on the GPU device machine (see benchmarks/README.md).
#
# The device tool runs a command in the repository root of a copy of the working tree, with a
# python3 that has jax, jaxlib (CUDA) and torch, and an empty folder $OUT whose files come back.
# Source this file first, then run each step under its own time limit:
#
#   source benchmarks/gpu_env.sh
#   step 300 python3 benchmarks/bench_grouped_gemm.py --stages block --presets qwen3-30b-a3b \
#     --tokens 1,1024 --no-torch
#   step 200 python3 -m jmoe tune --preset qwen3-30b-a3b --tokens 1024 --log $OUT/tune.json
#
# It sets PYTHONPATH=$PWD (jmoe, with jmoe.kernels / jmoe.sharding / jmoe.interop mapped from
# the source tree), unbuffered output and no JAX memory preallocation, keeps NVLink multicast
# off (KINDS.md: leave it off on the shared machines), makes $OUT (default /tmp/$NAME, NAME
# default jmoe) and prints the GPUs and their clocks. Give each step a limit well inside the
# call's: a step that times out or fails does not stop the ones after it.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NAME=${NAME:-jmoe}
OUT=${OUT:-/tmp/$NAME}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
# step LIMIT_S CMD...: CMD under `timeout LIMIT_S`, the runtime's W0000/I0000/E0000/WARNING log
# lines filtered out; returns CMD's exit status (124 on a timeout).
step() {
  local lim=$1; shift
  echo "=== $* (limit ${lim}s)"
  timeout "$lim" "$@" 2>&1 | grep -v "^W0000\|^I0000\|^E0000\|^WARNING"
  return ${PIPESTATUS[0]}
}
