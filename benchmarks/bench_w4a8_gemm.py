"""GPU benchmark + correctness check of the fp8-token grouped GEMMs over mxfp4 codes
(jmoe.kernels.grouped_gemm_w4a8) alone, GEMM1 (gated silu, biases) and GEMM2 (ungated), at the
presets' prefill shapes, beside the 8-bit fp8-channel kernel (jmoe.kernels.grouped_gemm_q8:
the same FLOPs on fp8 weights already in HBM, the rate the conversion must keep up with) and
the bf16 grouped GEMM on the dequantized weights.

Run on the H200 (device tool):
  source benchmarks/gpu_env.sh
  python3 benchmarks/bench_w4a8_gemm.py --presets mixtral-8x7b,qwen3-30b-a3b --tokens 4096 \
      --out $OUT/w4a8_gemm

Per preset x GEMM: the routed rows (tokens x top-k, a random routing's group sizes), each
config in --configs ("block_n[xblock_m][/num_stages]", "split" = 256-token tiles with gate and
up on the two warpgroups; "default" = the kernel's own choice for the rows per expert), the
error vs a float32 (HIGHEST) jax.lax.ragged_dot on the kernel's own operands (the tokens' fp8
values and the folded e4m3 codes x w_scale; must be <= 1e-2 relative), µs (jmoe.timing.
device_time: CUPTI kernel sum, median over --iters passes of 2 rotating input sets) and
TFLOP/s. Prints a table; writes <out>.json.
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jmoe
from jmoe import timing
from jmoe.config import PRESETS
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import grouped_gemm_q8 as q8
from jmoe.kernels import grouped_gemm_w4a8 as w4a8
from jmoe.quant import quantize_weights


# name -> (gated -> fn(xq, xs, qw, bias, group_sizes)): variants an A/B wrapper script adds
EXTRA_VARIANTS: dict = {}


def _config(spec: str, n_out: int, gated: bool):
  if spec == "default":
    return None
  if spec == "split":  # 256-token tiles, gate and up on the two warpgroups
    return w4a8.fit_stages(w4a8.W4A8Config(block_m=256, block_n=64, split_gate_up=True), 2)
  tile, _, stages = spec.partition("/")
  bn, _, bm = tile.partition("x")
  return w4a8.fit_stages(w4a8.W4A8Config(block_m=int(bm or 128), block_n=int(bn),
                                         num_stages=int(stages or 8)), 2 if gated else 1)


def _operands(key, e: int, m: int, k: int, n_total: int, sizes: np.ndarray):
  kx, kw, kb = jax.random.split(key, 3)
  x = jax.random.normal(kx, (m, k), jnp.float32)
  xs = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 448.0
  xq = (x / xs).astype(jnp.float8_e4m3fn)
  w = jax.random.normal(kw, (e, k, n_total), jnp.float32) * 0.02
  qw = quantize_weights(w, jmoe.QuantConfig("mxfp4_fp8"))
  del w
  bias = jax.random.normal(kb, (e, n_total), jnp.float32) * 0.1
  return xq, xs, qw, bias, jnp.asarray(sizes, jnp.int32)


def _reference(xq, xs, qw, bias, gs, gated: bool):
  vals, ws = w4a8.fp8_codes(qw.values, qw.scale)
  wk = jnp.swapaxes(vals * ws[..., None], 1, 2)  # [E, K, N_total]
  x = xq.astype(jnp.float32) * xs
  y = jax.lax.ragged_dot(x, wk, gs, precision=jax.lax.Precision.HIGHEST)
  if not gated:
    return y
  n = y.shape[1] // 2
  row_bias = jnp.repeat(bias, gs, axis=0, total_repeat_length=x.shape[0])
  y = y + row_bias
  return jax.nn.silu(y[:, :n]) * y[:, n:]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--presets", default="mixtral-8x7b,qwen3-30b-a3b")
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--configs", default="default,128,256,128x256,split",
                  help="comma list of block_n[xblock_m][/num_stages] or 'default'")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--peers", default="q8", help="q8: the fp8-channel kernel; none")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  rows, failed = [], False
  for preset in args.presets.split(","):
    p = PRESETS[preset]
    e, h, n, topk = p.num_experts, p.hidden_size, p.intermediate_size, p.top_k
    m = args.tokens * topk
    rng = np.random.default_rng(0)
    sizes = np.bincount(rng.integers(0, e, m), minlength=e)
    for gemm, gated, k, n_total in (("gemm1", True, h, 2 * n), ("gemm2", False, n, h)):
      n_out = n_total // 2 if gated else n_total
      sets = [_operands(jax.random.key(i), e, m, k, n_total, sizes) for i in range(2)]
      ref = np.asarray(_reference(*sets[0], gated))
      flops = 2.0 * m * k * n_total
      variants = {}
      for spec in args.configs.split(","):
        cfg = _config(spec, n_out, gated)
        if cfg is not None and (n_out % cfg.block_n or w4a8.acc_registers(cfg, gated) > 128
                                or cfg.split_gate_up and not gated):
          continue
        variants[f"w4a8 {spec}"] = jax.jit(
            lambda xq, xs, qw, b, gs, cfg=cfg: w4a8.grouped_gemm_w4a8(
                xq, qw, gs, xs, activation="silu" if gated else None,
                bias=b if gated else None, config=cfg))
      for name, make in EXTRA_VARIANTS.items():  # A/B wrappers' kernels, same operands
        variants[name] = jax.jit(make(gated))
      if "q8" in args.peers:
        w8 = [quantize_weights(jax.random.normal(jax.random.key(9 + i), (e, k, n_total),
                                                 jnp.float32) * 0.02,
                               jmoe.QuantConfig("fp8_channel")) for i in range(2)]
        q8_sets = [(s[0], s[1], w, s[3], s[4]) for s, w in zip(sets, w8)]
        variants["fp8_channel q8"] = jax.jit(
            lambda xq, xs, qw, b, gs: q8.grouped_gemm_q8(
                xq, qw.values, gs, xs, qw.scale, activation="silu" if gated else None,
                bias=b if gated else None))
      for name, fn in variants.items():
        arg_sets = q8_sets if name.startswith("fp8_channel") else sets
        row = dict(preset=preset, gemm=gemm, variant=name, m=m, k=k, n=n_total)
        try:
          out = np.asarray(fn(*arg_sets[0]).astype(jnp.float32))
          if not name.startswith("fp8_channel"):
            err = float(np.abs(out - ref).max() / np.abs(ref).max())
            row["err"] = err
            failed |= not err <= 1e-2
          us, _, _ = timing.device_time(fn, arg_sets, iters=args.iters)
          row.update(us=us, tflops=flops / us * 1e-6)
        except Exception as ex:  # noqa: BLE001 (a variant that cannot run: say why)
          row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
          failed = True
        rows.append(row)
        print(json.dumps(row), flush=True)
  print(f"\n{'preset':16} {'gemm':6} {'variant':18} {'err':>9} {'us':>9} {'TFLOP/s':>8}")
  for r in rows:
    print(f"{r['preset']:16} {r['gemm']:6} {r['variant']:18} {r.get('err', float('nan')):9.2e} "
          f"{r.get('us', float('nan')):9.1f} {r.get('tflops', float('nan')):8.1f}"
          + (f"  {r['error']}" if "error" in r else ""))
  if args.out:
    with open(args.out + ".json", "w") as f:
      json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=rows), f, indent=1)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
