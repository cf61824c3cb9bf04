"""GPU benchmark + correctness check of jmoe's weight-only / microscaling MoE block (issue 26).

The peer's wheels (the device machine has none of them; xprof is stubbed by this script),
downloaded once here into the git-ignored .whl/ (never committed):
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl tokamax==0.0.17 qwix==0.1.8 einshape immutabledict tensorboardx pydantic==2.14.4 \
      pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions
Run on the H200 (device tool, carry=[".whl"]):
  source benchmarks/gpu_env.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
  python3 benchmarks/bench_weight_only.py --presets mixtral-8x7b --tokens 1,16,4096 --out $OUT/wo

Per preset x tokens x scheme (one process, fixed random routing per input set):
  - jmoe's quantized block through the public API (`fused_moe` with QuantizedWeights; whatever
    backend the oracle picks, printed with its reason),
  - jmoe's bf16 block (the same API, dense bf16 weights) on the scheme's dequantized weights,
  - floors: the packed-weight floor (the touched experts' packed values + scales + zero points +
    global scales / BW), the bf16 floor (their bf16 weights / BW), the FLOP floor (--peak-tflops),
  - the peer: tokamax 0.0.17 `ragged_dot` with `qwix.QArray` int8 / int4 weights (--peers), the
    block around it being jmoe's slot sort + GEMM1 + activation (+ biases) + GEMM2 + weighted
    combine in JAX; its Mosaic GPU kernel is asked for explicitly, and where tokamax refuses a
    shape (NotImplementedError) the row says why and times its "xla" fallback instead,
  - errors: the quantized block vs a float32 (HIGHEST) reference on the dequantized weights of
    the first --check-tokens tokens (must be <= 2e-2), and vs jmoe's bf16 block on the
    unquantized weights, every token (the format's accuracy figure); the peer likewise.
Timing: jmoe.timing.device_time (CUPTI kernel sum; the first pass is the warm-up; median over
--iters passes of --rotate distinct input sets). Weights: normal (or --weight-dist student-t)
with std --weight-std, bf16. Prints a table last; writes <out>/bench_weight_only.json.

--smoke (alias --interpret): tiny shapes on the CPU (XLA path; the peer is a stand-in,
jax.lax.ragged_dot on qwix.dequantize, when tokamax cannot be imported); a test of the
script, not a timing. Exit status 1 when a row failed or missed the 2e-2 bound.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmoe  # noqa: E402
from jmoe.config import PRESETS as JMOE_PRESETS, QUANT_SCHEMES, QuantConfig  # noqa: E402
from jmoe.experts._common import add_bias, sort_slots_by_expert  # noqa: E402
from jmoe.kernels.activations import Activation  # noqa: E402
from jmoe.quant import dequantize, prepare_for_kernels, weight_bytes  # noqa: E402
from jmoe.quant.activations import fake_quantize  # noqa: E402
from jmoe.quant.weights import PACKED_4BIT  # noqa: E402
from jmoe.experts.pallas import runs_weight_only  # noqa: E402
from jmoe.kernels.moe import LAYOUTS, fp8_token_kernels  # noqa: E402
from bench_quant import (BW, log, make_inputs, make_weights, quantize_chunked,  # noqa: E402
                         rel_err, time_fn)
from check_common import top_kernels  # noqa: E402  (benchmarks/, the script's directory)

H200_PEAK_FLOPS = 810e12  # dense bf16 through XLA, measured (jmoe.bench)
TOL = 2e-2
_HI = jax.lax.Precision.HIGHEST


def _preset(name: str, cfg) -> dict:
  return dict(name=name, E=cfg.num_experts, k=cfg.top_k, H=cfg.hidden_size,
              N=cfg.intermediate_size, act=cfg.act, bias=cfg.expert_bias)


# jmoe's presets (gpt-oss-120b: H 2880, 128 experts, top-4, N 2880, swigluoai with biases)
PRESETS = {n: _preset(n, c) for n, c in JMOE_PRESETS.items()}
SMOKE_PRESETS = {
    "tiny": dict(name="tiny", E=4, k=2, H=256, N=128, act=Activation("silu"), bias=False),
    "tiny-oss": dict(name="tiny-oss", E=4, k=2, H=192, N=192, act=Activation("swigluoai"),
                     bias=True),
}
WEIGHT_ONLY = tuple(n for n, s in QUANT_SCHEMES.items() if s.get("act_dtype") is None)
CODES4 = PACKED_4BIT
CODES4_FP8 = tuple(n for n, s in QUANT_SCHEMES.items()
                   if s.get("act_dtype") and s["weight_dtype"] in CODES4)
GROUPS = (128, 64, 32, 16)


# ----------------------------------------------------------------------------- schemes


def parse_scheme(spec: str, h: int, n: int) -> tuple[str, QuantConfig]:
  """'w4a16' / 'w4a16:g32:zp' / 'w8a16:g128' -> (label, QuantConfig). A named scheme's own
  group size that does not divide H and N (w4a16's 128 on gpt-oss' 2880) falls back to the
  largest of GROUPS that does, and the label says so ('w4a16@g64')."""
  base, *mods = spec.split(":")
  kw, explicit = {}, False
  for m in mods:
    if m == "zp":
      kw["zero_point"] = True
    elif m[:1] == "g" and m[1:].isdigit():
      kw.update(weight_scale="group", group_size=int(m[1:]))
      explicit = True
    else:
      raise ValueError(f"scheme {spec!r}: modifier {m!r} is not gNNN or zp")
  q = QuantConfig(base, **kw)
  if not runs_weight_only(q):
    raise ValueError(f"scheme {spec!r} quantizes activations too; this benchmark is for the "
                     f"weight-only ones ({', '.join(WEIGHT_ONLY)}), 4-bit codes with fp8 "
                     f"tokens ({', '.join(CODES4_FP8)}) and mxfp8; use bench_quant.py")
  label = spec
  if q.weight_scale == "group" and (h % q.group_size or n % q.group_size):
    fit = [g for g in GROUPS if h % g == 0 and n % g == 0 and g < q.group_size]
    if explicit or q.scale_dtype != "float32" or not fit:
      raise ValueError(f"scheme {spec!r}: group {q.group_size} does not divide H={h} and N={n}")
    q = q.replace(group_size=fit[0])
    label = f"{spec}@g{fit[0]}"
  return label, q


def take_experts(q, idx):
  """QuantizedWeights of the experts idx (an index array or a slice)."""
  f = lambda a: None if a is None else a[idx]  # noqa: E731
  return dataclasses.replace(q, values=f(q.values), scale=f(q.scale), zero=f(q.zero),
                             global_scale=f(q.global_scale), perm=f(q.perm))


def dequantize_chunked(q, dtype, chunk: int = 32):
  """dequantize over expert chunks (its f32 temporaries stay a chunk's size)."""
  return jnp.concatenate([dequantize(take_experts(q, slice(c0, c0 + chunk)), dtype)
                          for c0 in range(0, q.num_experts, chunk)])


# ----------------------------------------------------------------------------- reference


def fp8_per_block(a: np.ndarray, block: int = 128) -> np.ndarray:
  """a [..., N] through e4m3 with one scale (amax / 448) per `block` columns: the fp8 decode
  kernels' intermediate. On the host (ml_dtypes): inside the jitted reference on the H200 the
  f32 -> f8 -> f32 round trip left the values unrounded (XLA's excess-precision rewrites)."""
  out = np.empty_like(a)
  for c in range(0, a.shape[-1], block):
    blk = a[..., c:c + block]
    s = np.abs(blk).max(axis=-1, keepdims=True) / 448.0
    s = np.where(s > 0, s, 1.0)
    out[..., c:c + block] = np.clip(blk / s, -448, 448).astype(
        ml_dtypes.float8_e4m3fn).astype(np.float32) * s
  return out


@functools.partial(jax.jit, static_argnames="act")
def _reference_gemm1(x, pos, w13, b13, act):
  """The activations [t, k, N] (f32) of the tokens x [t, H] on the dense experts w13
  [u, H, 2N] (pos [t, k]: each slot's expert among the u)."""
  h = jnp.einsum("th,uhn->tun", x.astype(jnp.float32), w13, precision=_HI)
  h = jnp.take_along_axis(h, pos[:, :, None], axis=1)  # [t, k, 2N]
  if b13 is not None:
    h = h + b13[pos]
  return act(h)


@jax.jit
def _reference_gemm2(a, tw, pos, w2, b2):
  """The block's output [t, H] from the activations a [t, k, N] and w2 [u, N, H]."""
  y = jnp.einsum("tkn,unh->tkuh", a, w2, precision=_HI)
  y = jnp.take_along_axis(y, pos[:, :, None, None], axis=2)[:, :, 0]  # [t, k, H]
  if b2 is not None:
    y = y + b2[pos]
  return jnp.einsum("tk,tkh->th", tw.astype(jnp.float32), y, precision=_HI)


def reference(x, tw, ti, dense13, dense2, b13, b2, act, requant=None) -> np.ndarray:
  """float32 reference on dense weights of the experts the slots use: dense13(ids) [u, H, 2N]
  and dense2(ids) [u, N, H] (f32, e.g. a scheme's dequantize of just those experts);
  requant: the intermediate [t, k, N] -> as the block quantizes it (None: unrounded)."""
  ti = np.asarray(ti)
  ids = np.unique(ti)
  pos = jnp.asarray(np.searchsorted(ids, ti).astype(np.int32))
  jids = jnp.asarray(ids)
  a = _reference_gemm1(x, pos, dense13(jids),
                       None if b13 is None else b13[jids].astype(jnp.float32), act)
  if requant is not None:  # the scheme's intermediate, outside the jitted halves
    a = requant(a)
  out = _reference_gemm2(a, tw, pos, dense2(jids),
                         None if b2 is None else b2[jids].astype(jnp.float32))
  return np.asarray(out, np.float64)


# ----------------------------------------------------------------------------- jmoe's block


def block_fn(act, runner):
  """jmoe's block through the public API (dense or QuantizedWeights w13 / w2)."""
  def block(x, tw, ti, w13, w2, b13, b2):
    return jmoe.fused_moe(x, w13, w2, tw, ti, activation=act, w13_bias=b13, w2_bias=b2,
                          runner_backend=runner)
  return jax.jit(block)


def weight_only_layout_of(p, t, q13, q2) -> str:
  """The layout the Pallas experts run this call in (`moe.weight_only_layout`)."""
  from jmoe.kernels.moe import weight_only_layout  # noqa: PLC0415
  layout = os.environ.get("JMOE_WEIGHT_ONLY_LAYOUT", "auto")  # (--layouts sets it)
  return weight_only_layout(t, p["k"], p["H"], p["N"], p["act"], q13, q2, layout)


def oracle_choice(runner, quant, h, n) -> tuple[str, str]:
  """(experts class, reason) the oracle picks for this call (what fused_moe will run)."""
  try:
    _, experts, why = jmoe.select_backend(runner, quant=quant, problem=(jnp.bfloat16, h, n))
    return type(experts).__name__, why
  except Exception as e:  # noqa: BLE001
    return "none", f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------- the peer


def _xprof_stub() -> None:
  """tokamax 0.0.17 imports xprof.cli.tools.get_kernel_stats_tool at import time (its xprof
  timing mode only): a stub module whose function raises is enough for anything else."""
  try:
    import xprof.cli.tools  # noqa: F401, PLC0415
    return
  except ImportError:
    pass
  root = tempfile.mkdtemp(prefix="xprof_stub_")
  os.makedirs(os.path.join(root, "xprof", "cli"))
  for f, body in (("__init__.py", ""), ("cli/__init__.py", ""),
                  ("cli/tools.py", "def get_kernel_stats_tool(*a, **k):\n"
                                   "  raise RuntimeError('xprof stub (bench_weight_only.py)')\n")):
    with open(os.path.join(root, "xprof", f), "w") as fh:
      fh.write(body)
  sys.path.insert(0, root)


def import_tokamax():
  """(tokamax module or None, why not)."""
  try:
    _xprof_stub()
    import tokamax  # noqa: PLC0415
    return tokamax, ""
  except Exception as e:  # noqa: BLE001
    return None, f"{type(e).__name__}: {str(e)[:300]}"


# lhs [M, K] . rhs [G, N, K] (contract lhs 1 with rhs 2): the pre-transposed layout tokamax's
# sm90 kernel reads (`mk,enk->mn`); its default [G, K, N] form transposes rhs in the graph
TRANS_RHS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def parse_peer(spec: str) -> tuple[str, int | None]:
  """'int8' (per channel) / 'int4:g128' -> (qtype, group along K or None)."""
  qt, *mods = spec.split(":")
  if qt not in ("int8", "int4") or len(mods) > 1 or (mods and not (
      mods[0][:1] == "g" and mods[0][1:].isdigit())):
    raise ValueError(f"--peers: {spec!r} is not int8|int4 with an optional :gNNN")
  return qt, int(mods[0][1:]) if mods else None


def qwix_quantize(w, qtype: str, group, layout: str, chunk: int = 32):
  """w [E, K, N] bf16 -> qwix.QArray in `layout` ("nk": [E, N, K], "kn": [E, K, N]), scales
  (bf16, qwix's default for bf16 weights) per output channel, or per `group` along K."""
  import qwix  # noqa: PLC0415

  def one(c):
    if layout == "nk":
      c = jnp.swapaxes(c, 1, 2)
      return qwix.quantize(c, jnp.dtype(qtype), channelwise_axes=(0, 1),
                           tiled_axes={2: group} if group else None)
    return qwix.quantize(c, jnp.dtype(qtype), channelwise_axes=(0, 2),
                         tiled_axes={1: group} if group else None)
  q = jax.jit(one)
  parts = [q(w[c0:c0 + chunk]) for c0 in range(0, w.shape[0], chunk)]
  return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def qarray_bytes(q) -> int:
  """Packed bytes of a QArray (int4: half a byte a value) + its scales (+ zero points)."""
  bits = jnp.iinfo(jnp.dtype(q.qtype)).bits
  n = q.qvalue.size * bits // 8 + q.scale.size * q.scale.dtype.itemsize
  if q.zero_point is not None:
    n += q.zero_point.size * q.zero_point.dtype.itemsize
  return int(n)


def qarray_dense(q, layout: str):
  """ids -> f32 [u, K, N] dequantized experts of a QArray (its scales taken to f32 first)."""
  import qwix  # noqa: PLC0415

  def dense(ids):
    sub = jax.tree.map(lambda a: a[ids], q)
    sub = dataclasses.replace(sub, scale=sub.scale.astype(jnp.float32))
    d = qwix.dequantize(sub).astype(jnp.float32)
    return jnp.swapaxes(d, 1, 2) if layout == "nk" else d
  return dense


def peer_block_fn(rdot, act, num_experts: int):
  """The peer's block: jmoe's slot sort, rdot(rows, w, group_sizes) for GEMM1 and GEMM2 (bf16
  out), the activation and biases in f32, the router-weighted combine (as jmoe's XLA experts)."""
  def block(x, tw, ti, w13, w2, b13, b2):
    t, k = ti.shape
    order, inv, gs = sort_slots_by_expert(ti, num_experts)
    eor = ti.reshape(-1)[order]
    xs = x[order // k]
    m = xs.shape[0]
    pad = (-m) % 8  # tokamax's sm90 kernel copies rows in blocks of >= 8
    if pad:
      xs = jnp.pad(xs, ((0, pad), (0, 0)))
    h = add_bias(rdot(xs, w13, gs).astype(jnp.float32), b13, jnp.pad(eor, (0, pad)))
    a = act(h).astype(x.dtype)
    y = add_bias(rdot(a, w2, gs).astype(jnp.float32), b2, jnp.pad(eor, (0, pad)))[:m]
    per_slot = y[inv].reshape(t, k, y.shape[-1])
    return jnp.einsum("tk,tkh->th", tw.astype(jnp.float32), per_slot).astype(x.dtype)
  return jax.jit(block)


def _nk_mosaic_op(w):
  """tokamax's Mosaic GPU ragged dot with the config its sm90 heuristic picks for the same
  weights in the [G, K, N] form. Its heuristic reads the K tile of the scales off rhs axis 1
  before undoing the transposed dimension numbers, so for [G, N, K] weights it would take
  block_k = 1; the kernel itself reads [G, N, K] (`mk,enk->mn`)."""
  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as tpg  # noqa: PLC0415
  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as tcommon  # noqa: PLC0415
  tile_k = w.shape[2] // w.scale.shape[2]
  cfg = tpg.Config(block_m=64, block_n=64, block_k=min(tile_k, 256), num_stages=2, split_k=1,
                   persistent=True, grid_minor_dim=tcommon.MatmulDimension.M,
                   grid_tile_width=1)
  return tpg.PallasMosaicGpuRaggedDot().replace(config=cfg)


def make_rdot(tokamax, layout: str, impl):
  """rows [M, K] x QArray -> [M, N] through tokamax's public ragged_dot(_general) (impl:
  "mosaic", "xla"); tokamax None: the CPU stand-in (jax.lax.ragged_dot on the bf16
  qwix.dequantize)."""
  if tokamax is None:
    import qwix  # noqa: PLC0415

    def stand_in(xs, w, gs):
      wd = qwix.dequantize(w)
      if layout == "nk":
        return jax.lax.ragged_dot_general(xs, wd, gs, TRANS_RHS)
      return jax.lax.ragged_dot(xs, wd, gs)
    return stand_in
  if layout == "nk":
    return lambda xs, w, gs: tokamax.ragged_dot_general(
        xs, w, gs, ragged_dot_dimension_numbers=TRANS_RHS,
        implementation=(_nk_mosaic_op(w),) if impl == "mosaic" else impl)
  return lambda xs, w, gs: tokamax.ragged_dot(xs, w, gs, implementation=impl)


# ----------------------------------------------------------------------------- one case


def touched_experts(sets) -> float:
  """Mean over the input sets of the distinct experts their slots use."""
  return float(np.mean([len(np.unique(np.asarray(s[2]))) for s in sets]))


def timed(args, f, fsets, r: dict) -> None:
  """Times f over the argument sets into r (us, samples, top kernels)."""
  us, samples, pk = time_fn(f, fsets, args)
  r.update(us=us, samples=samples, kernels=pk)


def run_peers(args, p, t, sets, case, peer_w, tokamax, tk_why, bias, out_ref):
  """Every --peers x --peer-layouts entry of the peer at t tokens, into case["peers"]."""
  b13, b2 = bias
  nchk = min(t, args.check_tokens)
  x, tw, ti = sets[0]
  for (label, layout), (q13, q2, nbytes) in peer_w.items():
    r = dict(peer=label, layout=layout)
    case["peers"].append(r)
    impls = ["mosaic", "xla"] if tokamax is not None else [None]
    for impl in impls:
      try:
        f = peer_block_fn(make_rdot(tokamax, layout, impl), p["act"], p["E"])
        fsets = [s + (q13, q2, b13, b2) for s in sets]
        t0 = time.time()
        out = jax.block_until_ready(f(*fsets[0]))
        r["compile_s"] = time.time() - t0
        r["impl"] = impl or f"stand-in: jax.lax.ragged_dot(qwix.dequantize) ({tk_why})"
        if impl == "xla":
          r["impl"] = "xla (mosaic refused)"
        break
      except Exception as e:  # noqa: BLE001  (NotImplementedError: a shape it refuses)
        why = f"{type(e).__name__}: {str(e)[:400]}"
        if impl == "mosaic":  # then time what a user gets: tokamax's own fallback
          r["mosaic_refused"] = why
          log(f"[peer ] {p['name']} T={t} {label}/{layout}: mosaic refused: {why}")
          if not isinstance(e, NotImplementedError):
            traceback.print_exc()
          continue
        r["error"] = why
        log(f"[ERR ] peer {p['name']} T={t} {label}/{layout} ({impl}): {why}")
        traceback.print_exc()
        break
    if "impl" not in r:
      r.setdefault("error", "no implementation ran")
      continue
    try:
      ref = reference(x[:nchk], tw[:nchk], ti[:nchk], qarray_dense(q13, layout),
                      qarray_dense(q2, layout), b13, b2, p["act"])
      r["err_vs_dequant_ref"] = rel_err(out[:nchk].astype(jnp.float32), ref)
      r["err_vs_bf16"] = rel_err(out.astype(jnp.float32), out_ref)
      timed(args, f, fsets, r)
      r["floor_us"] = case["touched"] * nbytes / p["E"] / BW * 1e6
      r["x_floor"] = r["us"] / max(r["floor_us"], case["flop_floor_us"])
      log(f"[peer ] {p['name']:14s} T={t:6d} {label + '/' + layout:18s} {r['us']:9.1f} us "
          f"x_floor={r['x_floor']:.2f} impl={r['impl'][:40]} err_ref={r['err_vs_dequant_ref']:.2e}"
          f" err_bf16={r['err_vs_bf16']:.2e} compile={r['compile_s']:.0f}s")
      log(top_kernels(r["kernels"], 4, name_width=40))
    except Exception as e:  # noqa: BLE001
      r["error"] = f"{type(e).__name__}: {str(e)[:500]}"
      log(f"[ERR ] peer {p['name']} T={t} {label}/{layout}: {r['error']}")
      traceback.print_exc()


def run_scheme(args, p, t, sets, case, label, quant, q, d, bias, out_ref, fn):
  """jmoe's quantized block and its bf16 block on the dequantized weights at t tokens."""
  q13, q2 = q
  d13, d2 = d
  b13, b2 = bias
  nchk = min(t, args.check_tokens)
  x, tw, ti = sets[0]
  backend, why = oracle_choice(args.runner, quant, p["H"], p["N"])
  r = dict(scheme=label, quant=quant.name, backend=backend, reason=why)
  case["schemes"].append(r)
  try:
    qsets = [s + (q13, q2, b13, b2) for s in sets]
    t0 = time.time()
    out = jax.block_until_ready(fn(*qsets[0]))
    r["compile_s"] = time.time() - t0
    # fp8-token schemes: the reference sees the tokens' fp8 values and, where the decode
    # kernel's 8-bit form runs them (decode_fp8), the intermediate per 128 columns as it does
    # (the bf16-token kernels keep it bf16; the XLA experts quantize it per token, the
    # fp8-token prefill GEMMs per token after GEMM1's bf16 output)
    xr = fake_quantize(x[:nchk], quant) if quant.act_dtype else x[:nchk]
    requant = None
    layout8 = (weight_only_layout_of(p, t, q13, q2) if fp8_token_kernels(quant) else None)
    if quant.act_dtype and backend != "PallasExperts":
      requant = functools.partial(fake_quantize, quant=quant)  # XLA's: per token (eager)
    elif layout8 == "prefill_fp8":  # per token, from GEMM1's bf16 output
      requant = lambda a: fake_quantize(  # noqa: E731
          a.astype(jnp.bfloat16).astype(jnp.float32), quant)
    elif layout8 == "decode_fp8":
      requant = lambda a: jnp.asarray(fp8_per_block(np.asarray(a)))  # noqa: E731
    r["reference"] = ("bf16 tokens" if not quant.act_dtype else "fp8 tokens" + (
        ", intermediate fp8" if requant is not None else ""))
    ref = reference(xr, tw[:nchk], ti[:nchk],
                    lambda ids: dequantize(take_experts(q13, ids), jnp.float32),
                    lambda ids: dequantize(take_experts(q2, ids), jnp.float32), b13, b2, p["act"],
                    requant=requant)
    r["err_vs_dequant_ref"] = rel_err(out[:nchk].astype(jnp.float32), ref)
    r["err_vs_bf16"] = rel_err(out.astype(jnp.float32), out_ref)
    timed(args, fn, qsets, r)
    per_expert = (weight_bytes(q13) + weight_bytes(q2)) / p["E"]
    r["packed_floor_us"] = case["touched"] * per_expert / BW * 1e6
    r["x_floor"] = r["us"] / max(r["packed_floor_us"], case["flop_floor_us"])
    if not args.no_bf16:
      b = {}
      dsets = [s + (d13, d2, b13, b2) for s in sets]
      bout = jax.block_until_ready(fn(*dsets[0]))
      r["err_vs_bf16_on_dequant"] = rel_err(out.astype(jnp.float32), bout.astype(jnp.float32))
      timed(args, fn, dsets, b)
      r["bf16_us"] = b["us"]
      r["x_bf16"] = r["us"] / b["us"]
    log(f"[jmoe ] {p['name']:14s} T={t:6d} {label:14s} {r['us']:9.1f} us "
        f"x_floor={r['x_floor']:.2f} x_bf16={r.get('x_bf16', float('nan')):.2f} "
        f"err_ref={r['err_vs_dequant_ref']:.2e} "
        f"err_bf16={r['err_vs_bf16']:.2e} compile={r['compile_s']:.0f}s")
    log(f"        oracle: {backend}: {why}")
    log(top_kernels(r["kernels"], 4, name_width=40))
  except Exception as e:  # noqa: BLE001
    r["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    log(f"[ERR ] {p['name']} T={t} {label}: {r['error']}")
    traceback.print_exc()


# ----------------------------------------------------------------------------- the run


# the kernels' form switches: jmoe.kernels.decode_wq's, decode_wq_shared's SYNC_SHARED,
# grouped_gemm_wq_ws' TAILS (as WS_TAILS); and the numeric CHAINS (int4_mma.CHAINS: 2, 4, 8)
DECODE_WQ_FLAGS = ("SYNC_4BIT", "WIDE_ROWS", "SCALE_BYTES", "PAD_TAILS", "TWO_WG", "SYNC_SHARED",
                   "WS_TAILS")
NUMERIC_SWITCHES = {"CHAINS": ("2", "4", "8")}


def switch_target(flag: str) -> tuple:
  """(module, attribute) that switch `flag` of DECODE_WQ_FLAGS / NUMERIC_SWITCHES sets."""
  from jmoe.kernels import (decode_wq, decode_wq_shared, grouped_gemm_wq_ws,  # noqa: PLC0415
                            int4_mma)
  if flag == "WS_TAILS":
    return grouped_gemm_wq_ws, "TAILS"
  if flag == "CHAINS":
    return int4_mma, "CHAINS"
  return (decode_wq_shared if flag == "SYNC_SHARED" else decode_wq), flag


def parse_decode_wq(spec: str, error) -> dict:
  """'WIDE_ROWS=0,CHAINS=4' -> {flag: bool or int}; error(msg) on an unknown flag or value."""
  flags = {}
  for item in filter(None, spec.split(",")):
    name, _, value = item.partition("=")
    if name in NUMERIC_SWITCHES and value in NUMERIC_SWITCHES[name]:
      flags[name] = int(value)
      continue
    if name not in DECODE_WQ_FLAGS or value not in ("0", "1"):
      error(f"--decode-wq: {item!r} is not FLAG=0|1 with FLAG one of {DECODE_WQ_FLAGS}, nor "
            f"one of {NUMERIC_SWITCHES}")
    flags[name] = value == "1"
  return flags


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--presets", default="mixtral-8x7b,qwen3-30b-a3b,deepseek-v3,gpt-oss-120b")
  ap.add_argument("--tokens", default="1,16,4096")
  ap.add_argument("--schemes", default=",".join(WEIGHT_ONLY),
                  help="weight-only schemes, each NAME[:gNNN][:zp] (e.g. w4a16:g32:zp)")
  ap.add_argument("--peers", default="int8,int4:g128",
                  help="tokamax QArray weights: int8|int4[:gNNN] (no group: per channel); "
                       "'none' skips the peer")
  ap.add_argument("--peer-layouts", default="nk,kn",
                  help="nk: QArray [E, N, K] through ragged_dot_general with transposed "
                       "dimension numbers (the layout its sm90 kernel reads, given the config "
                       "its heuristic picks for kn); kn: [E, K, N] through ragged_dot (its "
                       "default form, which transposes the weights in the graph)")
  ap.add_argument("--runner", default="auto", help="fused_moe's runner_backend")
  ap.add_argument("--layouts", default="auto",
                  help="weight-only layouts to time, each a row (moe.LAYOUTS: auto, decode, "
                       "decode_fp8, decode_shared, prefill, prefill_fp8, dequantize; "
                       "JMOE_WEIGHT_ONLY_LAYOUT)")
  ap.add_argument("--decode-wq", default="",
                  help="the kernels' form switches for an A/B, FLAG=0|1 comma-separated: "
                       f"{', '.join(DECODE_WQ_FLAGS)} (default: all on; WS_TAILS is "
                       "grouped_gemm_wq_ws.TAILS), and CHAINS=2|4|8 (int4_mma.CHAINS, "
                       "default 2); run one process per "
                       "setting: a traced kernel keeps the form it was traced with)")
  ap.add_argument("--prepared", default="yes", choices=("yes", "no", "both"),
                  help="time the weights with the kernels' derived operands made once "
                       "(jmoe.quant.prepare_for_kernels), as loaded only (no), or both rows")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--rotate", type=int, default=3, help="random input sets timed in rotation")
  ap.add_argument("--check-tokens", type=int, default=4,
                  help="tokens checked against the float32 dequantized reference")
  ap.add_argument("--weight-std", type=float, default=0.02)
  ap.add_argument("--weight-dist", default="normal", choices=("normal", "student-t"))
  ap.add_argument("--peak-tflops", type=float, default=H200_PEAK_FLOPS / 1e12,
                  help="bf16 dense matrix rate for the FLOP floor")
  ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new cases after")
  ap.add_argument("--no-bf16", action="store_true", help="skip jmoe's bf16 block")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_weight_only"))
  ap.add_argument("--smoke", "--interpret", dest="smoke", action="store_true",
                  help="CPU smoke test: tiny presets (tiny, tiny-oss), tokens 1,16")
  args = ap.parse_args(argv)
  if args.smoke:
    if args.presets == ap.get_default("presets"):
      args.presets = ",".join(SMOKE_PRESETS)
    if args.tokens == ap.get_default("tokens"):
      args.tokens = "1,16"
    args.iters = min(args.iters, 1)
    args.rotate = min(args.rotate, 2)
  args.interpret = args.smoke  # bench_quant.time_fn: wall clock, one pass
  known = {**PRESETS, **SMOKE_PRESETS}
  for pn in args.presets.split(","):
    if pn not in known:
      ap.error(f"--presets: {pn!r} is not one of {tuple(known)}")
  for s in args.schemes.split(","):
    try:
      parse_scheme(s, 4096, 4096)
    except ValueError as e:
      if "does not divide" not in str(e):
        ap.error(f"--schemes: {e}")
  args.decode_wq = parse_decode_wq(args.decode_wq, ap.error)
  args.peers = [] if args.peers in ("", "none") else args.peers.split(",")
  args.layouts = args.layouts.split(",")
  for lay in args.layouts:
    if lay not in LAYOUTS:
      ap.error(f"--layouts: {lay!r} is not one of {', '.join(LAYOUTS)}")
  for s in args.peers:
    try:
      parse_peer(s)
    except ValueError as e:
      ap.error(str(e))
  args.peer_layouts = args.peer_layouts.split(",")
  for lay in args.peer_layouts:
    if lay not in ("nk", "kn"):
      ap.error(f"--peer-layouts: {lay!r} is not nk or kn")
  return args


def add_peer_ratios(results) -> None:
  """x_peer (jmoe's quantized block / the fastest peer row of its case) on every scheme row."""
  for c in results["cases"]:
    peers = [s for s in c["peers"] if s.get("us")]
    if not peers:
      continue
    best = min(peers, key=lambda s: s["us"])
    for r in c["schemes"]:
      if r.get("us"):
        r["x_peer"] = r["us"] / best["us"]
        r["best_peer"] = f"{best['peer']}/{best['layout']}"


def fmt(v, spec=".1f"):
  return "-" if v is None else format(v, spec)


def floor(case, bytes_us):
  """The floor a row's x_floor divides by: its bytes' time or the case's FLOPs', the larger."""
  return None if bytes_us is None else max(bytes_us, case["flop_floor_us"])


def table(results) -> str:
  """The short table printed last: one line per (preset, T, scheme or peer); floor: the
  larger of the row's weight bytes / BW (packed for the schemes and the peer) and the FLOPs /
  --peak-tflops."""
  lines = [f"{'preset':14s} {'T':>5s} {'what':24s} {'backend':22s} {'us':>9s} {'floor':>8s} "
           f"{'x_floor':>7s} {'x_bf16':>6s} {'x_peer':>6s} {'err_ref':>8s} {'err_bf16':>8s}"]
  for c in results["cases"]:
    lines.append(f"{c['preset']:14s} {c['T']:5d} {'bf16 (unquantized)':24s} "
                 f"{c.get('bf16_backend', '-')[:22]:22s} {fmt(c.get('bf16_us')):>9s} "
                 f"{fmt(floor(c, c['bf16_floor_us'])):>8s} "
                 f"{fmt(c.get('bf16_x_floor'), '.2f'):>7s}")
    for r in c["peers"]:
      lines.append(f"{'':14s} {'':5s} {('tokamax ' + r['peer'] + '/' + r['layout'])[:24]:24s} "
                   f"{(r.get('impl') or 'error')[:22]:22s} {fmt(r.get('us')):>9s} "
                   f"{fmt(floor(c, r.get('floor_us'))):>8s} {fmt(r.get('x_floor'), '.2f'):>7s} "
                   f"{'':6s} {'':6s} {fmt(r.get('err_vs_dequant_ref'), '.1e'):>8s} "
                   f"{fmt(r.get('err_vs_bf16'), '.1e'):>8s}")
    for r in c["schemes"]:
      lines.append(f"{'':14s} {'':5s} {r['scheme'][:24]:24s} {r['backend'][:22]:22s} "
                   f"{fmt(r.get('us')):>9s} {fmt(floor(c, r.get('packed_floor_us'))):>8s} "
                   f"{fmt(r.get('x_floor'), '.2f'):>7s} {fmt(r.get('x_bf16'), '.2f'):>6s} "
                   f"{fmt(r.get('x_peer'), '.2f'):>6s} "
                   f"{fmt(r.get('err_vs_dequant_ref'), '.1e'):>8s} "
                   f"{fmt(r.get('err_vs_bf16'), '.1e'):>8s}")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  for name, on in args.decode_wq.items():  # before anything is traced
    setattr(*switch_target(name), on)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "bench_weight_only.json")
  t_start = time.time()
  tokamax, tk_why = (None, "no peers asked") if not args.peers else import_tokamax()
  if args.peers and tokamax is None:
    log(f"tokamax unavailable: {tk_why}" + ("; the CPU stand-in runs instead" if args.smoke
                                            else "; no peer rows"))
  try:
    import qwix  # noqa: F401, PLC0415
    qwix_ok = True
  except ImportError as e:
    qwix_ok, tk_why = False, f"qwix: {e}"
  run_peer = bool(args.peers) and qwix_ok and (tokamax is not None or args.smoke)
  results = dict(meta=dict(
      jax=jax.__version__, device=jax.devices()[0].device_kind, argv=sys.argv,
      tokamax=getattr(tokamax, "__version__", None), tokamax_why=tk_why or None,
      bandwidth=BW, peak_tflops=args.peak_tflops, weight_std=args.weight_std,
      weight_dist=args.weight_dist, smoke=args.smoke, decode_wq=args.decode_wq), cases=[])
  log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; tokamax "
      f"{results['meta']['tokamax']}; peers {'on' if run_peer else 'off'}")
  tokens = [int(v) for v in args.tokens.split(",")]
  presets = {**PRESETS, **SMOKE_PRESETS}

  def save():
    with open(path, "w") as fh:
      json.dump(results, fh, indent=1, default=str)

  for pname in args.presets.split(","):
    p = presets[pname]
    e, k, h, n = p["E"], p["k"], p["H"], p["N"]
    w13, w2 = make_weights(p, jax.random.key(1), std=args.weight_std, dist=args.weight_dist)
    bias = (None, None)
    if p["bias"]:
      kb1, kb2 = jax.random.split(jax.random.key(2))
      bias = ((jax.random.normal(kb1, (e, 2 * n)) * 0.1).astype(jnp.bfloat16),
              (jax.random.normal(kb2, (e, h)) * 0.1).astype(jnp.bfloat16))
    fn = block_fn(p["act"], args.runner)
    bf_backend, bf_why = oracle_choice(args.runner, None, h, n)
    cases, sets_of, out_ref = {}, {}, {}
    # the unquantized bf16 block and the peers, per token count
    for t in tokens:
      if time.time() - t_start > args.budget_s:
        log(f"budget reached: skipping {pname} T={t}")
        continue
      sets = sets_of[t] = [make_inputs(p, t, jax.random.key(100 + i)) for i in range(args.rotate)]
      touched = touched_experts(sets)
      flops = 2 * t * k * 3 * h * n
      case = cases[t] = dict(
          preset=pname, T=t, E=e, k=k, H=h, N=n, touched=touched,
          bf16_floor_us=touched * 3 * h * n * 2 / BW * 1e6,
          flop_floor_us=flops / (args.peak_tflops * 1e12) * 1e6, bf16_backend=bf_backend,
          bf16_reason=bf_why, schemes=[], peers=[])
      results["cases"].append(case)
      try:
        wsets = [s + (w13, w2) + bias for s in sets]
        t0 = time.time()
        out_ref[t] = np.asarray(jax.block_until_ready(fn(*wsets[0])), np.float64)
        case["bf16_compile_s"] = time.time() - t0
        if not args.no_bf16:
          b = {}
          timed(args, fn, wsets, b)
          case.update(bf16_us=b["us"], bf16_kernels=b["kernels"],
                      bf16_x_floor=b["us"] / max(case["bf16_floor_us"], case["flop_floor_us"]))
        log(f"[bf16 ] {pname:14s} T={t:6d} {case.get('bf16_us', float('nan')):9.1f} us "
            f"bf16 floor {case['bf16_floor_us']:.1f} us, touched {touched:.1f}; oracle: "
            f"{bf_backend}: {bf_why}")
      except Exception as ex:  # noqa: BLE001
        case["error"] = f"{type(ex).__name__}: {str(ex)[:500]}"
        log(f"[ERR ] {pname} T={t} bf16: {case['error']}")
        traceback.print_exc()
      save()
    if run_peer:
      peer_w = {}
      for spec in args.peers:
        qt, g = parse_peer(spec)
        g = g if g is None or (h % g == 0 and n % g == 0) else next(
            (x for x in GROUPS if h % x == 0 and n % x == 0), None)
        label = qt + (f"-g{g}" if g else "-channel")
        for lay in args.peer_layouts:
          q13, q2 = qwix_quantize(w13, qt, g, lay), qwix_quantize(w2, qt, g, lay)
          peer_w[(label, lay)] = (q13, q2, qarray_bytes(q13) + qarray_bytes(q2))
      for t in tokens:
        if time.time() - t_start > args.budget_s:
          log(f"budget reached: skipping the peer at {pname} T={t}")
          continue
        if t in out_ref:
          run_peers(args, p, t, sets_of[t], cases[t], peer_w, tokamax, tk_why, bias, out_ref[t])
          save()
      del peer_w
    for spec in args.schemes.split(","):
      try:
        label, quant = parse_scheme(spec, h, n)
      except ValueError as ex:
        log(f"[skip] {pname} {spec}: {ex}")
        for t in tokens:
          cases[t]["schemes"].append(dict(scheme=spec, backend="-", error=str(ex)))
        continue
      if time.time() - t_start > args.budget_s:
        log(f"budget reached: skipping {pname} {label}")
        continue
      q = (quantize_chunked(w13, quant), quantize_chunked(w2, quant))
      # every expert's dequantized copy only for the bf16 block on them (the reference
      # dequantizes the slots' experts itself): deepseek-v3's 22.5 GB did not fit an H100
      d = (None, None) if args.no_bf16 else (dequantize_chunked(q[0], jnp.bfloat16),
                                             dequantize_chunked(q[1], jnp.bfloat16))
      jax.block_until_ready((q, d))
      variants = {"no": q} if args.prepared == "no" else {}
      if args.prepared in ("yes", "both"):  # the kernels' derived operands made once
        variants["yes"] = jax.block_until_ready(prepare_for_kernels(*q, activation=p["act"]))
      if args.prepared == "both":
        variants["no"] = q
      for t in tokens:
        if time.time() - t_start > args.budget_s:
          log(f"budget reached: skipping {pname} T={t} {label}")
          continue
        if t in out_ref:
          for prep, qv in variants.items():
            for lay in args.layouts:  # a fresh jit per layout: the env var is read when tracing
              os.environ["JMOE_WEIGHT_ONLY_LAYOUT"] = lay
              name = (label if lay == "auto" else f"{label}[{lay}]") + (
                  "[unprepared]" if args.prepared == "both" and prep == "no" else "")
              run_scheme(args, p, t, sets_of[t], cases[t], name, quant, qv, d, bias,
                         out_ref[t], fn if lay == "auto" else block_fn(p["act"], args.runner))
              cases[t]["schemes"][-1]["prepared"] = prep == "yes"
              save()
            os.environ.pop("JMOE_WEIGHT_ONLY_LAYOUT", None)
      del q, d, variants
    del w13, w2, bias
  add_peer_ratios(results)
  save()
  bad = [(c["preset"], c["T"], r["scheme"]) for c in results["cases"] for r in c["schemes"]
         if "error" in r or not r.get("err_vs_dequant_ref", 1.0) <= TOL]
  bad += [(c["preset"], c["T"], "bf16") for c in results["cases"] if "error" in c]
  log(f"\n{table(results)}\n\nwrote {path}; {len(bad)} failed or inexact (> {TOL}): {bad}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
