"""GPU benchmark + check of jmoe's batched-format experts (`[E, C, H]` per expert, the layout
the batched prepare/finalize, `allgather_batched` / `padded_a2a` and a capacity factor make)
with quantized weights: `PallasBatchedExperts` (weight-only schemes: 4-bit codes on the
warp-specialized weight-only GEMMs, other codes dequantized into the bf16 batched kernels;
W8A8 per-tensor / per-channel schemes: the 8-bit batched GEMMs) against jmoe's bf16 batched
block on the unquantized weights and `XlaBatchedExperts` on the same quantized weights.

Per preset x scheme (one process; --tokens tokens routed at random, capacity --capacity an
expert, `NoEPBatched(max_tokens_per_expert=)`; the same drops on both backends):
  - µs: jmoe.timing.device_time (CUPTI kernel sum, median over --iters passes of 3 rotating
    input sets) of the whole ModularKernel call (prepare, experts, finalize), jitted,
  - x bf16: ÷ the bf16 batched block's time on the same inputs,
  - err vs xla: relative L2 distance to XlaBatchedExperts' output (which keeps a bf16
    intermediate for weight-only schemes: the same rounding as the kernels).
Weights: normal x 0.02, quantized by jmoe.quant.quantize_weights, given to the Pallas path
with their kernel operands made once (`prepare_for_kernels`, as the Flax layer and the torch
bridge do). Writes <out>/bench_batched_experts.json.

  source benchmarks/gpu_env.sh
  python3 benchmarks/bench_batched_experts.py --presets qwen3-30b-a3b:256:64,mixtral-8x7b:256:128 \
      --schemes w4a16,mxfp4,w8a16,mxfp4_fp8 --out $OUT/batched
"""
from __future__ import annotations

import argparse
import json
import os
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jmoe
from jmoe import timing
from jmoe.config import PRESETS
from jmoe.experts.pallas import PallasBatchedExperts
from jmoe.experts.xla_batched import XlaBatchedExperts
from jmoe.kernels.activations import as_activation
from jmoe.modular import ExpertWeights, ModularKernel
from jmoe.prepare_finalize import NoEPBatched
from jmoe.quant import prepare_for_kernels, quantize_weights


def parse_case(spec: str) -> tuple[str, int, int]:
  """'preset:tokens:capacity' -> (preset, tokens, capacity)."""
  name, t, c = spec.split(":")
  if name not in PRESETS:
    raise SystemExit(f"--presets: {name!r} is not one of {sorted(PRESETS)}")
  return name, int(t), int(c)


def block(pf, experts, quant, act):
  mk = ModularKernel(pf, experts, quant)
  return jax.jit(lambda x, w13, w2, tw, ids: mk(x, ExpertWeights(w13, w2), tw, ids,
                                                activation=act))


def run_case(name: str, t: int, cap: int, schemes: list[str], iters: int) -> dict:
  c = PRESETS[name]
  e, k, h, n = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size
  act = as_activation(c.act)
  k13, k2 = jax.random.split(jax.random.key(0))
  w13 = jax.random.normal(k13, (e, h, 2 * n), jnp.float32) * 0.02
  w2 = jax.random.normal(k2, (e, n, h), jnp.float32) * 0.02
  sets = []
  for s in range(3):
    kx, kl = jax.random.split(jax.random.key(100 + s))
    x = jax.random.normal(kx, (t, h), jnp.float32).astype(jnp.bfloat16)
    tw, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(kl, (t, e))), k)
    sets.append((x, tw, ids.astype(jnp.int32)))
  pf = NoEPBatched(max_tokens_per_expert=cap)
  dense = (w13.astype(jnp.bfloat16), w2.astype(jnp.bfloat16))
  bf16_us = timing.device_time(block(pf, PallasBatchedExperts(), None, act),
                               [(x, *dense, tw, ids) for x, tw, ids in sets], iters=iters)[0]
  rec = dict(preset=name, T=t, capacity=cap, bf16_us=bf16_us, rows={})
  print(f"{name} T={t} C={cap}: bf16 batched {bf16_us:.1f} us", flush=True)
  for sch in schemes:
    try:
      quant = jmoe.QuantConfig(sch)
      q13, q2 = quantize_weights(w13, quant), quantize_weights(w2, quant)
      p13, p2 = prepare_for_kernels(q13, q2, activation=act)
      fq, fx = block(pf, PallasBatchedExperts(), quant, act), block(pf, XlaBatchedExperts(),
                                                                    quant, act)
      x, tw, ids = sets[0]
      yq = np.asarray(fq(x, p13, p2, tw, ids), np.float32)
      yx = np.asarray(fx(x, q13, q2, tw, ids), np.float32)
      err = float(np.linalg.norm(yq - yx) / max(np.linalg.norm(yx), 1e-30))
      us = timing.device_time(fq, [(x, p13, p2, tw, ids) for x, tw, ids in sets],
                              iters=iters)[0]
      xla_us = timing.device_time(fx, [(x, q13, q2, tw, ids) for x, tw, ids in sets],
                                  iters=iters)[0]
      rec["rows"][sch] = dict(us=us, x_bf16=us / bf16_us, xla_us=xla_us, err_vs_xla=err,
                              finite=bool(np.isfinite(yq).all()))
      print(f"  {sch:10s} pallas {us:9.1f} us ({us / bf16_us:.2f} x bf16)  xla {xla_us:9.1f}  "
            f"err vs xla {err:.2e}", flush=True)
    except Exception as ex:  # noqa: BLE001  (a row that fails says why; the others run)
      traceback.print_exc()
      rec["rows"][sch] = dict(error=f"{type(ex).__name__}: {str(ex)[:400]}")
  return rec


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--presets", default="qwen3-30b-a3b:256:64,mixtral-8x7b:256:128",
                  help="comma-separated preset:tokens:capacity")
  ap.add_argument("--schemes", default="w4a16,mxfp4,nvfp4,w8a16,mxfp4_fp8,fp8_channel")
  ap.add_argument("--iters", type=int, default=3)
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_batched_experts"))
  args = ap.parse_args(argv)
  recs = [run_case(*parse_case(c), args.schemes.split(","), args.iters)
          for c in args.presets.split(",")]
  os.makedirs(args.out, exist_ok=True)
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__)
  with open(os.path.join(args.out, "bench_batched_experts.json"), "w") as f:
    json.dump(dict(meta=meta, rows=recs), f, indent=1)
  bad = [(r["preset"], s) for r in recs for s, v in r["rows"].items()
         if "error" in v or not v["finite"]]
  return 1 if bad else 0


if __name__ == "__main__":
  raise SystemExit(main())
