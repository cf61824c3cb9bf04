"""The weight-only prefill GEMMs on the warp-specialized family (jmoe.kernels.grouped_gemm_ws):
bf16 / f16 tokens over 4-bit codes (w4a16: int4 per channel or per 16 / 32 / 64 / 128 along
K, zero points per 128; mxfp4 / nvfp4: e2m1 with their 8-bit scales, nvfp4's global scale)
or 8-bit integer codes (w8a16: int8 per channel or per group; its code tiles' rows 128
bytes, the conversion one widening a value).

    out[r] = act(x[r] @ dq(w[e]) * w_scale[e] + bias[e]) * row_scale[r]   (e: row r's expert)

Each compute warpgroup converts its [64 or 128, 128] code tile to the token dtype in
registers and multiplies it by the step's scale rows (`grouped_gemm_wq._a_tiles`: groups
below 64 share a 64-deep MMA, each column's scale picked with selects; zero points
subtracted; per-channel scales multiply the accumulator instead), and that tile is the
16-bit wgmma's A, the token tile its B, while the other warpgroup's MMAs run: the
conversion hides under the MMA where grouped_gemm_wq's single warpgroup waited for it.
Rows stay in the sorted layout of the bf16 kernels (GEMM1's output rows are GEMM2's token
rows; the router-weighted gather-sum follows), and 256-token tiles where the experts have the
rows, so each code is converted once per 256 tokens.

Sizes: K and the output columns multiples of 64 (`TAILS`; gpt-oss' 2880: the last K step and
column tile read past the arrays, TMA's zeros, and store no column past N); of 128 with it off.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm_ws as ws
from jmoe.kernels.prepared import Operand, operand
from jmoe.kernels.activations import Activation
from jmoe.kernels.decode_wq import _codes, _plan, _Plan
from jmoe.kernels.e2m1 import E2M1_UNIT
from jmoe.kernels.grouped_gemm_wq import SUB, _a_tiles, _group_major, _group_major_scales

GROUPS = (16, 32, 64, 128)
BK = ws.BK
TAIL = 64  # K and N_out multiples of this (a 64-deep MMA, a warpgroup's 64 columns)
# Sizes 128 does not divide (gpt-oss' 2880), on since 2026-12-07: on an H200 gpt-oss at 4096
# tokens ran mxfp4 in 2,675 us (err 2.9e-3) against grouped_gemm_wq's 4,052, nvfp4 2,690
# (5.3e-3) against 4,223, bf16 3,222. (A first form that left its stores past N to TMA's
# clipping was 7.0e-2 off on an H100; this one stores no column past N.) Off: 128 again, for
# an A/B (bench_weight_only.py --decode-wq WS_TAILS=0).
TAILS = True
CODE_DTYPES = ("int4", "float4_e2m1fn", "int8")  # the weight dtypes the kernel converts


def unsupported(k: int, n_out: int, w) -> str | None:
  """Why the kernel cannot take weights w (QuantizedWeights, logical [E, K, N_total]) with
  n_out output columns (None: it can): 4-bit codes (int4, e2m1) or int8 codes with bf16
  tokens, K-major, no act-order, scales per channel or per one of GROUPS along K, zero
  points only per 128, K and N_out multiples of 64 (TAILS: the last K step and column tile of
  sizes 128 does not divide, gpt-oss' 2880, read past the arrays, TMA's zeros, and store no
  column past N; of 128 with TAILS off)."""
  q = w.scheme
  if q is None or q.weight_dtype not in CODE_DTYPES:
    return f"{q}: integer or e2m1 codes ({', '.join(CODE_DTYPES)})"
  if q.act_dtype is not None:
    return f"{q.name}: bf16 / f16 tokens (its tokens are {q.act_dtype})"
  if not w.k_major or w.perm is not None:
    return f"{q.name}: K-major values, no act-order permutation"
  if q.weight_scale == "group" and q.group_size not in GROUPS:
    return f"{q.name}: scale groups of {q.group_size} (takes {GROUPS} or per channel)"
  if q.weight_scale not in ("group", "channel"):
    return f"{q.name}: scales per group or per channel, not {q.weight_scale}"
  if w.zero is not None and (q.weight_scale != "group" or q.group_size != BK):
    return f"{q.name}: zero points with groups of {BK} only"
  if k % TAIL or n_out % TAIL:
    return f"K={k} and N={n_out} must be multiples of {TAIL}"
  if not TAILS and (k % BK or n_out % BK):
    return (f"K={k} and N={n_out} must be multiples of {BK} (grouped_gemm_wq_ws.TAILS is "
            f"off; on, of {TAIL})")
  return None


def conversion(plan: _Plan, zero: bool, xdt) -> ws.Conversion:
  """The family's Conversion for weights of plan (`decode_wq._plan`), tokens of dtype xdt.
  mxfp4's e8m0 scales ride as their bytes and widen in registers (a shift), E2M1_UNIT then
  multiplying the accumulator per column (as a per-channel scale does); other scales
  (int4's float32, nvfp4's e4m3 with its global scale) as per-call copies in the token dtype,
  the rounding the A tile's multiply gives them anyway (half a float32 copy's bytes, in
  HBM and in the ring). (e4m3 bytes widened in the kernel -- ~8 integer ops a scale -- made
  nvfp4's GEMMs ~20 % slower on the H200: deepseek-v3 4096 tokens GEMM1 5,485 -> 6,660 µs.)"""
  byte_scales = plan.scale8 == "e8m0"
  side = []
  if plan.grouped:
    side.append((BK // plan.group, jnp.uint8 if byte_scales else jnp.dtype(xdt)))
  if zero:
    side.append((1, jnp.uint8))

  def convert(codes, sides, emulate: bool) -> list:
    s = sides[0] if plan.grouped else None
    z = sides[-1].at[0] if zero else None
    return _a_tiles(codes, s, z, plan=plan, zero=zero, xdt=xdt,
                    cast=_compat.layout_cast(emulate), interpret=emulate,
                    scale8=plan.scale8 if byte_scales else None)

  sub = max(plan.group, SUB) if plan.grouped else BK
  return ws.Conversion("wq_ws" if plan.int4 else "wq8_ws", jnp.dtype(xdt), tuple(side),
                       min(sub, BK), convert, per_token=False,
                       per_column=not plan.grouped or byte_scales, code_dtype=plan.code)


def column_scales(w, plan: _Plan) -> jax.Array:
  """The accumulator's per-column factors float32 [E, N_total]: per-channel scales, or what
  e8m0 byte scales lack (E2M1_UNIT)."""
  if not plan.grouped:
    return w.scale[:, :, 0].astype(jnp.float32)
  return jnp.full(w.values.shape[:2], E2M1_UNIT, jnp.float32)


def _weight_plan(w) -> _Plan:
  return _plan(w, w, False)


def operands(w, xdt) -> tuple[Operand, ...]:
  """The kernel's weight-derived operands for w with tokens of dtype xdt, in its argument
  order (`jmoe.kernels.prepared`: kept on w where prepared, else made per call): the grouped
  scales group-major (a step's rows contiguous: one TMA box) -- mxfp4's e8m0 as their bytes,
  the others in xdt with nvfp4's global scale and E2M1_UNIT folded in --, the zero points
  group-major, the accumulator's per-column factors (`column_scales`)."""
  plan = _weight_plan(w)
  xdt = jnp.dtype(xdt)
  ops = []
  if plan.scale8 == "e8m0":
    ops.append(Operand("wq_ws.scale_bytes", lambda w: _group_major(
        lax.bitcast_convert_type(w.scale, jnp.uint8))))
  elif plan.grouped:
    ops.append(Operand(f"wq_ws.scale.{xdt.name}", lambda w: _group_major_scales(
        w, _weight_plan(w)).astype(xdt)))
  if w.zero is not None:
    ops.append(Operand("wq_ws.zero", lambda w: _group_major(w.zero).astype(jnp.uint8)))
  if conversion(plan, w.zero is not None, xdt).per_column:
    ops.append(Operand("wq_ws.columns", lambda w: column_scales(w, _weight_plan(w))))
  return tuple(ops)


TABLES = ("grouped_gemm_wq_ws_gated", "grouped_gemm_wq_ws")  # GEMM1, GEMM2 (tuned configs)


def format_label(w) -> str:
  """The tuned tables' dtype field for w's format: codes, scale grouping, zero points, the
  scales' 8-bit type (e.g. "int4/g128", "float4_e2m1fn/g32/float8_e8m0fnu")."""
  q = w.scheme
  parts = [q.weight_dtype, f"g{q.group_size}" if q.weight_scale == "group" else "channel"]
  if w.zero is not None:
    parts.append("zp")
  if jnp.dtype(w.scale.dtype).itemsize == 1:
    parts.append(jnp.dtype(w.scale.dtype).name)
  return "/".join(parts)


def default_config(w, n_out: int, gated: bool, xdt, m: int = 0,
                   out_dtype=jnp.bfloat16) -> ws.WSConfig:
  """The config for m sorted rows over w: the entry `python -m jmoe tune --quant` wrote for
  this problem (tables TABLES, keyed by `format_label`) where it runs here, else
  `grouped_gemm_ws.default_config` for w's conversion."""
  from jmoe.kernels import grouped_gemm as gg  # noqa: PLC0415
  plan = _weight_plan(w)
  conv = conversion(plan, w.zero is not None, xdt)
  e, k = w.shape[0], w.shape[1]
  out_bytes = jnp.dtype(out_dtype).itemsize
  tuned = gg.tuned_config(TABLES[0 if gated else 1], ws.WSConfig, m, n_out, k, e,
                          format_label(w), nearest=True)
  if tuned is not None and ws.usable(tuned, conv, gated=gated, n_out=n_out,
                                     out_bytes=out_bytes):
    return tuned
  return ws.default_config(n_out, gated, conv, m / e, out_bytes)


def wq_ws_run(lhs: jax.Array, w, *, meta, act: Activation | None, gated: bool,
              bias: jax.Array | None = None, row_scale: jax.Array | None = None,
              out_dtype=jnp.bfloat16, config: ws.WSConfig | None = None,
              interpret: Any = False) -> jax.Array:
  """The kernel on sorted rows: lhs [m_pad, K] bf16 / f16 (the rows `meta` =
  tile_metadata(.., config.block_m) was built for; m_pad >= block_m), w QuantizedWeights
  (values [E, N_total, K/2]; see `unsupported`), bias [E, N_total] f32, row_scale [m_pad].
  -> [m_pad, N_out] out_dtype (rows outside the tasks unwritten)."""
  k = lhs.shape[1]
  n_total = w.values.shape[1]
  n_out = n_total // 2 if gated else n_total
  why = unsupported(k, n_out, w)
  if why is not None:
    raise ValueError(f"wq_ws_run: {why}")
  if jnp.dtype(lhs.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"lhs must be bf16 or f16, got {lhs.dtype}")
  plan = _weight_plan(w)
  zero = w.zero is not None
  conv = conversion(plan, zero, lhs.dtype)
  cfg = config or ws.default_config(n_out, gated, conv, out_bytes=jnp.dtype(out_dtype).itemsize)
  kern = ws.call_kernel(conv, cfg, lhs=lhs, n_total=n_total, gated=gated, act=act,
                        out_dtype=out_dtype, has_bias=bias is not None,
                        has_scale=row_scale is not None, interpret=interpret)
  args = ws.task_args(meta, lhs, _codes(w, plan.code))
  args += [operand(w, op) for op in operands(w, lhs.dtype)]
  return kern(*args, *ws.epilogue_args(row_scale, bias))


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "config", "interpret"))
def grouped_gemm_wq_ws(lhs: jax.Array, w, group_sizes: jax.Array, *,
                       activation: Activation | str | None = None,
                       bias: jax.Array | None = None, row_scale: jax.Array | None = None,
                       out_dtype=jnp.bfloat16, config: ws.WSConfig | None = None,
                       interpret: Any = False) -> jax.Array:
  """bf16 tokens x 4-bit experts, grouped: out[r] = act(x[r] @ dq(w[g(r)]) + bias[g(r)]) *
  row_scale[r]. lhs [M, K] bf16 / f16 sorted by group, w QuantizedWeights (logical [E, K,
  N_total], K-major; see `unsupported`), group_sizes [E], bias [E, N_total], row_scale [M].
  -> [M, N_out] out_dtype (N_out = N_total / 2 with a gated activation). Rows past
  sum(group_sizes) are unwritten."""
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [M, K], got {lhs.shape}")
  run = functools.partial(wq_ws_run, out_dtype=out_dtype, interpret=interpret)
  default = functools.partial(_default_for, w, lhs.dtype, out_dtype, lhs.shape[0])
  return ws.grouped_call(run, lhs, w, group_sizes, activation=activation, bias=bias,
                         row_scale=row_scale, config=config, default=default)


def _default_for(w, xdt, out_dtype, m: int, n_out: int, gated: bool,
                 rows_per_expert: float) -> ws.WSConfig:
  del rows_per_expert  # (default_config takes the rows: the tuned tables are keyed by them)
  return default_config(w, n_out, gated, xdt, m, out_dtype)
