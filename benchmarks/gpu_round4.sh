#!/usr/bin/env bash
# Session 4's multi-GPU run, one device call (under the 600 s limit) on any multi-GPU kind:
#   bash benchmarks/gpu_round4.sh   # peak, comm, layer (with the comm / GEMM / other kernel
#                                   # split) + the dispatch profile
# (the decode comparison of that session: bash benchmarks/gpu_round3.sh decode)
NAME=gpu_round4; source benchmarks/gpu_env.sh
nvidia-smi topo -m 2>&1 | head -10
step 420 python3 benchmarks/bench_ep_multigpu.py --torch --out $OUT --tag final
step 120 python3 benchmarks/ep_dispatch_profile.py --out $OUT
