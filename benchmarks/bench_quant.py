"""GPU benchmark + correctness check of jmoe's quantized (W8A8) Pallas MoE expert block.

Run on the H200 (device tool):
  PYTHONPATH=$PWD python3 benchmarks/bench_quant.py --presets qwen3-30b-a3b,deepseek-v3 \
      --tokens 1,256,4096,16384 --schemes fp8_tensor,fp8_channel,fp8_block,int8 --out $OUT

Per preset x tokens x scheme: the quantized block (activation quantization of the tokens,
routing, GEMM1 + activation (+ re-quantization), GEMM2, weighted gather-sum) as
PallasExperts runs it, timed by the CUPTI kernel sum (jmoe.timing.device_time: warm-up, median,
--rotate random inputs); beside it jmoe's bf16 block (fused_experts) and torch's fp8 row-wise
block on torch._scaled_grouped_mm (if torch sees a GPU; CUDA-graph replay). Checked in the same
run: error vs a per-slot dequantized f32 reference of the scheme (the first --check-tokens
tokens) and vs the bf16 block. Printed: µs, TFLOP/s, x floor (touched experts' 8-bit weights +
scales / BW, or the FLOPs at --peak-tflops), x bf16, x torch. Writes <out>/bench_quant.json.

--interpret runs the "tiny" preset through the kernels' CPU interpreter (a smoke test).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmoe  # noqa: E402
from jmoe import timing  # noqa: E402
from jmoe.kernels import decode_q8  # noqa: E402
from jmoe.kernels import moe as pmoe  # noqa: E402
from jmoe.kernels.activations import as_activation  # noqa: E402
from jmoe.quant import (calibrate_input_scales, quantize_activations,  # noqa: E402
                        quantize_weights)
from check_common import top_kernels, torch_sorted_slots  # noqa: E402  (benchmarks/, the script's directory)

PRESETS = {
    "mixtral-8x7b": dict(E=8, k=2, H=4096, N=14336),
    "qwen3-30b-a3b": dict(E=128, k=8, H=2048, N=768),
    "deepseek-v3": dict(E=256, k=8, H=7168, N=2048),
    "tiny": dict(E=4, k=2, H=256, N=128),  # CPU smoke test (--interpret)
}
SCHEMES = ("fp8_tensor", "fp8_channel", "fp8_block", "int8", "fp8_tensor_static",
           "fp8_channel_static", "int8_static")
CALIBRATION_TOKENS = 4096  # the static schemes' scales: calibrated on tokens of another seed
BW = 4.30e12  # H200 copy bandwidth measured here (read + write), as bench_grouped_gemm.py


def log(*a):
  print(*a, flush=True)


# ----------------------------------------------------------------------------- problems


def _unit_noise(key, shape, dist: str):
  """f32 noise of unit variance: "normal", or "student-t" (4 degrees of freedom, scaled to
  variance 1: heavier tails, closer to trained weights' outliers)."""
  if dist == "normal":
    return jax.random.normal(key, shape, jnp.float32)
  if dist == "student-t":
    return jax.random.t(key, 4.0, shape, jnp.float32) * (0.5 ** 0.5)
  raise ValueError(f"weight distribution {dist!r} is not one of normal, student-t")


def make_weights(p, key, chunk: int = 32, std: float | None = None, dist: str = "normal"):
  """bf16 w13 [E, H, 2N], w2 [E, N, H], generated in expert chunks (deepseek-v3's w13 in f32
  would be 30 GB at once). std None: 1 / sqrt(fan_in); else that standard deviation."""
  e, h, n = p["E"], p["H"], p["N"]
  parts13, parts2 = [], []
  for i, c0 in enumerate(range(0, e, chunk)):
    c = min(chunk, e - c0)
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    parts13.append((_unit_noise(k1, (c, h, 2 * n), dist) * (std or h ** -0.5))
                   .astype(jnp.bfloat16))
    parts2.append((_unit_noise(k2, (c, n, h), dist) * (std or n ** -0.5))
                  .astype(jnp.bfloat16))
  return jnp.concatenate(parts13), jnp.concatenate(parts2)


def quantize_chunked(w, scheme, chunk: int = 32, input_scale=None):
  """quantize_weights over expert chunks (its f32 temporaries stay a chunk's size); every
  array of the result (values, scales, zero points, global scales) is joined; input_scale:
  a static scheme's (set on the joined result)."""
  q = jax.jit(lambda w_, s_: quantize_weights(w_, scheme, input_scale=s_))
  s1 = input_scale if input_scale is not None else jnp.ones((1,), jnp.float32)
  parts = [q(w[c0:c0 + chunk], s1) for c0 in range(0, w.shape[0], chunk)]
  joined = jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
  return dataclasses.replace(joined, input_scale=input_scale)


def quantize_for(p, w13, w2, scheme):
  """(w13, w2) quantized to `scheme`; a static scheme's input scales calibrated on
  CALIBRATION_TOKENS random tokens routed at random (another seed than the timed inputs)."""
  s13 = s2 = None
  if jmoe.QuantConfig(scheme).static_activations:
    x, _, ids = make_inputs(p, CALIBRATION_TOKENS, jax.random.key(7))
    s13, s2 = calibrate_input_scales(x, w13, w2, ids, scheme)
  return quantize_chunked(w13, scheme, input_scale=s13), quantize_chunked(w2, scheme,
                                                                          input_scale=s2)


def make_inputs(p, t, key):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (t, p["H"]), jnp.float32).astype(jnp.bfloat16)
  logits = jax.random.normal(k2, (t, p["E"]), jnp.float32)
  w, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), p["k"])
  return x, (w / jnp.sum(w, -1, keepdims=True)).astype(jnp.float32), ids.astype(jnp.int32)


def weight_bytes_per_expert(q13, q2) -> int:
  """8-bit values + f32 scales of one expert (what a touched expert streams)."""
  e = q13.values.shape[0]
  return sum((w.values.size * w.values.dtype.itemsize + w.scale.size * 4) // e
             for w in (q13, q2))


def floors(p, t, touched, per_expert_bytes, peak_tflops):
  flops = 2 * t * p["k"] * 3 * p["H"] * p["N"]
  bw_us = touched * per_expert_bytes / BW * 1e6
  return flops, max(bw_us, flops / (peak_tflops * 1e12) * 1e6)


# ----------------------------------------------------------------------------- blocks


def quantized_block_fn(interpret, configs=(None, None), layout="auto"):
  """The quantized block as PallasExperts.apply runs it (prepare's token quantization first);
  configs: the fp8_block GEMMs' (config1, config2), None for the defaults; layout:
  fused_experts_quantized's (auto / sorted / decode)."""
  config1, config2 = configs
  def block(x, tw, ti, q13, q2):
    xq, xs = quantize_activations(x, q13.scheme, static_scale=q13.input_scale)
    return pmoe.fused_experts_quantized(xq, xs, q13, q2, tw, ti, out_dtype=jnp.bfloat16,
                                        interpret=interpret, config1=config1, config2=config2,
                                        layout=layout)
  return jax.jit(block)


def bf16_block_fn(interpret):
  return jax.jit(lambda x, tw, ti, w13, w2: pmoe.fused_experts(x, w13, w2, tw, ti,
                                                               interpret=interpret))


# default: the library's choice; 1cta / 2cta: 64-row tiles on one or two CTAs per SM; ws: warp
# specialized 128-row tiles (GEMM2 256 columns wide where it divides); ws-n128: GEMM2 128 wide
BLOCK_VARIANTS = ("default", "1cta", "2cta", "ws", "ws-n128", "ws-pairs")


def variants(schemes: dict, block_variants: list[str], layouts=("auto",)):
  """(label, scheme, fp8_block GEMM1 variant or None, layout) to time: each scheme with the
  defaults once per --layouts entry, fp8_block once per --block-variants entry (GEMM2 follows
  GEMM1's form) and --layouts entry (a variant's configs are the sorted layout's)."""
  for scheme in schemes:
    for v in (block_variants if scheme == "fp8_block" else ["default"]):
      for lay in layouts:
        label = scheme + ("" if v == "default" else f"/{v}") + (
            "" if lay == "auto" else f"/{lay}")
        yield label, scheme, (None if v == "default" else v), lay


def resolve_config(variant, p, t, gated=True):
  """A --block-variants entry -> the fp8_block GEMMs' (config1, config2); None: the default."""
  if variant is None:
    return None, None
  from jmoe.kernels import grouped_gemm_q8 as q8  # noqa: PLC0415
  base = q8.block_config(t * p["k"], p["N"], p["H"], p["E"], gated=gated, quantize_output=True)
  if variant.startswith("ws"):
    c1 = q8.BlockQ8Config(block_m=128, block_n=128, num_stages=4, warp_specialized=True)
    c2 = q8.gemm2_block_config(c1, p["H"])
    if variant == "ws-pairs":  # GEMM2 two K steps a pipeline step (BlockQ8Config.k_pairs)
      return c1, dataclasses.replace(c2, block_n=128, k_pairs=True)
    return c1, (dataclasses.replace(c2, block_n=128) if variant == "ws-n128" else c2)
  c1 = q8.BlockQ8Config(block_m=64, block_n=128, num_stages=base.num_stages,
                        ctas_per_sm=int(variant[0]))
  return c1, q8.gemm2_block_config(c1, p["H"])


QMAX = {"float8_e4m3fn": 448.0, "int8": 127.0}


def _np_quantize_rows(a: np.ndarray, dtype_name: str, group: int | None) -> np.ndarray:
  """Dynamic per-row (per-`group`-channel) quantization of a [M, H] float64 -> dequantized
  float64, converting with ml_dtypes on the host (round to nearest even, as the oracle)."""
  m, h = a.shape
  g = group or h
  blocks = a.reshape(m, h // g, g).astype(np.float32)
  amax = np.abs(blocks).max(axis=-1, keepdims=True)
  scale = np.where(amax > 0, amax / np.float32(QMAX[dtype_name]), np.float32(1.0))
  q = blocks / scale
  if dtype_name == "int8":
    q = np.round(q)
  q = np.clip(q, -QMAX[dtype_name], QMAX[dtype_name]).astype(jnp.dtype(dtype_name))
  return (q.astype(np.float64) * scale.astype(np.float64)).reshape(m, h)


@jax.jit
def _dequantized_expert(values, scale):
  """values [N, K] 8-bit * scale tiles [N / tn, K / tk] -> f32 [N, K] (fp8 / int8 -> f32 is
  exact; the conversions under test are the f32 -> 8-bit ones, done on the host)."""
  v = values.astype(jnp.float32)
  s = jnp.repeat(jnp.repeat(scale, v.shape[0] // scale.shape[0], 0), v.shape[1] // scale.shape[1],
                 1)
  return v * s


def _np_expert(w, e: int) -> np.ndarray:
  """One expert's dequantized K-major values [N, K] float64, on the host."""
  return np.asarray(jax.device_get(_dequantized_expert(w.values[e], w.scale[e])), np.float64)


def _np_quantize_static(a: np.ndarray, dtype_name: str, scale) -> np.ndarray:
  """Static per-tensor quantization of a float64 with `scale` (saturating) -> dequantized."""
  s = np.float32(np.asarray(scale).reshape(()))
  q = (a.astype(np.float32) / s)
  if dtype_name == "int8":
    q = np.round(q)
  q = np.clip(q, -QMAX[dtype_name], QMAX[dtype_name]).astype(jnp.dtype(dtype_name))
  return q.astype(np.float64) * np.float64(s)


def quantized_reference(x, tw, ti, q13, q2, inter_group=None) -> np.ndarray:
  """float64 host reference of the scheme on these tokens: the tokens quantized per the
  scheme, the dequantized 8-bit weights of each slot's expert, the activation's output
  re-quantized (per the scheme, or per inter_group columns: the decode kernel's 128), the
  router-weighted sum. Independent of the device's conversions."""
  quant = q13.scheme
  group = quant.act_group_size if quant.act_scale == "dynamic_group" else None
  if quant.static_activations:
    s2 = np.asarray(jax.device_get(q2.input_scale))
    xd = _np_quantize_static(np.asarray(x, np.float64), quant.act_dtype,
                             jax.device_get(q13.input_scale))
    requant = (lambda a: _np_quantize_rows(a, quant.act_dtype, inter_group)) if inter_group \
        else (lambda a: _np_quantize_static(a, quant.act_dtype, s2))
  else:
    xd = _np_quantize_rows(np.asarray(x, np.float64), quant.act_dtype, group)
    requant = lambda a: _np_quantize_rows(a, quant.act_dtype, inter_group or group)  # noqa: E731
  tw, ti = np.asarray(tw, np.float64), np.asarray(ti)
  out = np.zeros_like(xd)
  for t_ in range(ti.shape[0]):
    for j in range(ti.shape[1]):
      e = int(ti[t_, j])
      h = _np_expert(q13, e) @ xd[t_]
      n = h.shape[0] // 2
      a = (h[:n] / (1 + np.exp(-h[:n])) * h[n:])[None]
      out[t_] += tw[t_, j] * (_np_expert(q2, e) @ requant(a)[0])
  return out


def torch_fp8_block_fn(p):
  """torch's fp8 row-wise grouped MoE block: tokens and the activation quantized per row
  (amax / 448), torch._scaled_grouped_mm for both GEMMs with per-channel weight scales."""
  import torch  # noqa: PLC0415
  import torch.nn.functional as F  # noqa: PLC0415
  e, n = p["E"], p["N"]
  f8 = torch.float8_e4m3fn

  def rowwise(a):
    amax = a.abs().amax(dim=1, keepdim=True).float()
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (a.float() / s).clamp(-448, 448).to(f8), s.reshape(-1)

  def block(x, w13t, s13, w2t, s2, tw, ti):
    t, k = ti.shape
    order, offs, tok = torch_sorted_slots(ti, e)
    xq, xs = rowwise(x[tok])
    h = torch._scaled_grouped_mm(xq, w13t, xs, s13, offs=offs, out_dtype=torch.bfloat16)
    aq, as_ = rowwise(F.silu(h[:, :n].float()) * h[:, n:].float())
    y = torch._scaled_grouped_mm(aq, w2t, as_, s2, offs=offs, out_dtype=torch.bfloat16)
    y = y.float() * tw.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros(t, y.shape[1], device=x.device, dtype=torch.float32)
    out.index_add_(0, tok, y)
    return out.to(x.dtype)
  return block


def torch_weights(q13, q2):
  """fp8_channel QuantizedWeights -> torch (w13 [E, H, 2N] column-major view, scale [E, 2N],
  w2 [E, N, H] column-major view, scale [E, H]): the K-major values are that layout."""
  import torch  # noqa: PLC0415

  def one(w):
    v = torch.from_dlpack(w.values.view(jnp.uint8)).view(torch.float8_e4m3fn)
    return v.transpose(1, 2), torch.from_dlpack(w.scale[:, :, 0])
  return (*one(q13), *one(q2))


# ----------------------------------------------------------------------------- the run


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if not np.isfinite(a).all():
    return float("inf")
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def time_fn(f, sets, args):
  if args.interpret:
    return timing.wall_time(f, sets, iters=1), [], {}
  return timing.device_time(f, sets, iters=args.iters)


def run_one(args, p, t, sets, w13, w2, qw, rec, torch_ok):
  """Times and checks the quantized block of every scheme (and bf16, torch) at t tokens."""
  nchk = min(t, args.check_tokens)
  interp = True if args.interpret else False
  bf = bf16_block_fn(interp)
  bsets = [s + (w13, w2) for s in sets]
  rec["bf16_us"] = time_fn(bf, bsets, args)[0] if not args.no_bf16 else None
  out_bf16 = np.asarray(bf(*bsets[0])[:nchk], np.float32)
  touched = len(np.unique(np.asarray(sets[0][2])))
  rec["touched"] = touched
  for label, scheme, cfg, layout in variants(qw, args.block_variants, args.layouts):
    q13, q2 = qw[scheme]
    r = dict(scheme=label)
    rec["schemes"].append(r)
    try:
      f = quantized_block_fn(interp, resolve_config(cfg, p, t), layout)
      qsets = [s + (q13, q2) for s in sets]
      t0 = time.time()
      out = jax.block_until_ready(f(*qsets[0]))
      r["compile_s"] = time.time() - t0
      x, tw, ti = sets[0]
      used = pmoe.quantized_layout(t, p["k"], p["E"], p["H"], p["N"], as_activation("silu"),
                                   q13.scheme, layout)
      r["layout"] = used
      ref = quantized_reference(x[:nchk], tw[:nchk], ti[:nchk], q13, q2,
                                inter_group=decode_q8.BN if used == "decode" else None)
      r["err_vs_dequant_ref"] = rel_err(out[:nchk].astype(jnp.float32), ref)
      r["err_vs_bf16"] = rel_err(out[:nchk].astype(jnp.float32), out_bf16)
      us, samples, pk = time_fn(f, qsets, args)
      flops, floor_us = floors(p, t, touched, weight_bytes_per_expert(q13, q2),
                               args.peak_tflops)
      r.update(us=us, samples=samples, kernels=pk, tflops=flops / us / 1e6, floor_us=floor_us,
               x_floor=us / floor_us,
               x_bf16=us / rec["bf16_us"] if rec.get("bf16_us") else None)
      if scheme == "fp8_channel" and torch_ok:
        try:
          import torch  # noqa: PLC0415
          tb = torch_fp8_block_fn(p)
          tw_ = torch_weights(q13, q2)
          tsets = [(torch.from_dlpack(x_), *tw_, torch.from_dlpack(w_),
                    torch.from_dlpack(i_).long()) for x_, w_, i_ in sets]
          from jmoe.bench_peers import cuda_graph_replay  # noqa: PLC0415
          ts, touts = cuda_graph_replay(tb, tsets, args.iters * len(tsets))
          rec["torch_fp8_us"] = ts * 1e6
          rec["torch_fp8_err_vs_dequant_ref"] = rel_err(
              touts[0][:nchk].float().cpu().numpy(), ref)
        except Exception as e:  # noqa: BLE001
          rec["torch_error"] = f"{type(e).__name__}: {str(e)[:300]}"
          log(f"[torch] {p['name']} T={t}: {rec['torch_error']}")
      if rec.get("torch_fp8_us"):
        r["x_torch"] = us / rec["torch_fp8_us"]
      log(f"[quant] {p['name']:14s} T={t:6d} {label:14s} {us:9.1f} us {r['tflops']:7.1f} TF/s "
          f"x_floor={r['x_floor']:.2f} x_bf16={r['x_bf16'] or float('nan'):.2f} "
          f"x_torch={r.get('x_torch', float('nan')):.2f} err_ref={r['err_vs_dequant_ref']:.2e} "
          f"err_bf16={r['err_vs_bf16']:.2e} compile={r['compile_s']:.0f}s")
      log(top_kernels(pk, 5, name_width=40))
    except Exception as e:  # noqa: BLE001
      r["error"] = f"{type(e).__name__}: {str(e)[:500]}"
      log(f"[ERR] {p['name']} T={t} {label}: {r['error']}")
      traceback.print_exc()
      if args.interpret:
        from jmoe.kernels import _compat  # noqa: PLC0415
        _compat.reset_interpret_state()


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
  ap.add_argument("--tokens", default="1,256,4096,16384")
  ap.add_argument("--schemes", default=",".join(SCHEMES))
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--rotate", type=int, default=3, help="random input sets timed in rotation")
  ap.add_argument("--check-tokens", type=int, default=4,
                  help="tokens checked against the host float64 reference")
  ap.add_argument("--peak-tflops", type=float, default=1500.0,
                  help="8-bit dense matrix rate for the FLOP floor (a lead, not measured)")
  ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new cases after")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_quant"))
  ap.add_argument("--block-variants", default="default",
                  help=f"fp8_block GEMM forms to time, of {BLOCK_VARIANTS}")
  ap.add_argument("--layouts", default="auto",
                  help="fused_experts_quantized layouts to time per scheme (auto, sorted, "
                       "decode: the 8-bit decode kernel where it applies)")
  ap.add_argument("--no-torch", action="store_true")
  ap.add_argument("--no-bf16", action="store_true", help="skip timing the bf16 block")
  ap.add_argument("--interpret", action="store_true", help="CPU interpreter, tiny preset")
  ap.add_argument("--requant", choices=("kernel", "xla"), default="kernel",
                  help="the per-token schemes' intermediate requantization: one kernel "
                       "(jmoe.kernels.quant_rows, the default) or XLA's reduce + convert")
  ap.add_argument("--token-quant", choices=("kernel", "xla"), default="kernel",
                  help="prepare's per-token / per-group quantization of the tokens: "
                       "quant_rows (the default on a GPU) or XLA's reduce + convert")
  args = ap.parse_args(argv)
  for s in args.schemes.split(","):
    if s not in SCHEMES:
      ap.error(f"--schemes: {s!r} is not one of {SCHEMES}")
  args.block_variants = args.block_variants.split(",")
  args.layouts = args.layouts.split(",")
  for v in args.layouts:
    if v not in ("auto", "sorted", "decode"):
      ap.error(f"--layouts: {v!r} is not one of auto, sorted, decode")
  for v in args.block_variants:
    if v not in BLOCK_VARIANTS:
      ap.error(f"--block-variants: {v!r} is not one of {BLOCK_VARIANTS}")
  for pn in args.presets.split(","):
    if pn not in PRESETS:
      ap.error(f"--presets: {pn!r} is not one of {tuple(PRESETS)}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  from jmoe.kernels import moe as pmoe  # noqa: PLC0415
  from jmoe.quant import activations  # noqa: PLC0415
  pmoe.REQUANT_KERNEL = args.requant == "kernel"  # before anything is traced
  activations.ROWS_KERNEL = args.token_quant == "kernel"
  os.makedirs(args.out, exist_ok=True)
  t_start = time.time()
  torch_ok = False
  if not args.no_torch and not args.interpret:
    try:
      import torch  # noqa: PLC0415
      torch_ok = torch.cuda.is_available() and hasattr(torch, "_scaled_grouped_mm")
    except Exception:  # noqa: BLE001
      pass
  results = dict(meta=dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                           argv=sys.argv, torch=torch_ok), rows=[])
  path = os.path.join(args.out, "bench_quant.json")
  for pname in args.presets.split(","):
    p = dict(PRESETS[pname], name=pname)
    w13, w2 = make_weights(p, jax.random.key(1))
    qw = {}
    for s in args.schemes.split(","):
      qw[s] = quantize_for(p, w13, w2, s)
    jax.block_until_ready(qw)
    for t in [int(v) for v in args.tokens.split(",")]:
      if time.time() - t_start > args.budget_s:
        log(f"budget reached: skipping {pname} T={t}")
        continue
      rec = dict(preset=pname, T=t, **PRESETS[pname], schemes=[])
      sets = [make_inputs(p, t, jax.random.key(100 + i)) for i in range(args.rotate)]
      try:
        run_one(args, p, t, sets, w13, w2, qw, rec, torch_ok)
      except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        log(f"[ERR] {pname} T={t}: {rec['error']}")
        traceback.print_exc()
      log(f"[bf16 ] {pname:14s} T={t:6d} {rec.get('bf16_us') or float('nan'):9.1f} us"
          f"   torch fp8 {rec.get('torch_fp8_us', float('nan')):9.1f} us")
      results["rows"].append(rec)
      with open(path, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    del w13, w2, qw
  bad = [(r["preset"], r["T"], s["scheme"]) for r in results["rows"] for s in r["schemes"]
         if "error" in s or not s.get("err_vs_dequant_ref", 1.0) < 2e-2]
  log(f"wrote {path}; {len(bad)} failed or inexact: {bad}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
