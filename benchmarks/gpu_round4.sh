#!/usr/bin/env bash
# Session 4's multi-GPU run, one device call (under the 600 s limit) on any multi-GPU kind:
#   bash benchmarks/gpu_round4.sh   # peak, comm, layer (with the comm / GEMM / other kernel
#                                   # split) + the dispatch profile
# (the decode comparison of that session: bash benchmarks/gpu_round3.sh decode)
# NVLink multicast stays off (KINDS.md).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_round4}; mkdir -p $OUT
nvidia-smi topo -m 2>&1 | head -10
step() { local lim=$1; shift; echo "=== $* (limit ${lim}s)"; timeout $lim "$@" 2>&1 | grep -v "^W0000\|^I0000\|^E0000\|^WARNING"; return ${PIPESTATUS[0]}; }
step 420 python3 benchmarks/bench_ep_multigpu.py --torch --out $OUT --tag final
step 120 python3 benchmarks/ep_dispatch_profile.py --out $OUT
