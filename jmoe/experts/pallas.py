"""Experts on the Pallas Mosaic GPU grouped-GEMM kernels (Hopper): routing (sort + token
gather), GEMM1 with the activation fused, GEMM2 with the bias fused, a gather-sum that applies
the router weights. They weight and reduce themselves, so finalize has nothing left to do.

Runs on sm90 GPUs; on other machines only in Pallas' GPU interpret mode (slow: tests), which
`JMOE_PALLAS_INTERPRET=1` or `PallasExperts(interpret=True)` turns on.

Differentiable (a `jax.custom_vjp`): without differentiation the forward runs the fused
kernels; under `jax.grad`/`vjp`, forward and backward run once on a differentiable path,
the Pallas grouped GEMM + transposed grouped GEMM (`backward="pallas"`, the default) or XLA
(`backward="xla"`, or `JMOE_PALLAS_BACKWARD=xla`).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jmoe.config import QuantConfig, pallas_interpret_from_env
from jmoe.quant.activations import K_CONSTANT_SCALES, ROW_SCALES
from jmoe.quant.weights import is_packed
from jmoe.experts._common import check_weights_for_activation, narrow_to_touched, weights_quant
from jmoe.modular import (ActivationFormat, BatchedExperts, Experts, ExpertsInput, ExpertWeights,
                          NoOp, local_expert_ids)
from jmoe.registry import register_runner

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_Q8 = ("float8_e4m3fn", "int8")


def runs_weight_only(quant: QuantConfig) -> bool:
  """Whether `quant` runs on the weight-only kernels (fused_experts_weight_only): weight-only
  formats, 4-bit codes with fp8 tokens, and mxfp8 (e4m3 codes with e8m0 scales per group;
  its e4m3 tokens, scaled per 32, enter as bf16: exact)."""
  mx8 = (quant.weight_dtype == "float8_e4m3fn" and quant.weight_scale == "group"
         and quant.scale_dtype == "float8_e8m0fnu" and quant.act_dtype == "float8_e4m3fn")
  return quant.act_dtype is None or is_packed(quant) or mx8


def pallas_quant_support(quant: Optional[QuantConfig]) -> Optional[str]:
  """Why the Pallas kernels cannot run `quant` (None: they can): W8A8 with scales that factor
  out of K (fp8_tensor / fp8_channel / int8, per-token or per-tensor dynamic activation
  scales, and their static forms: fp8_tensor_static, ...), fp8_block (128 x 128 weight blocks, 1 x 128 activation groups), and every
  weight-only format (jmoe.kernels.moe.fused_experts_weight_only: the decode kernels or the
  grouped GEMMs on the codes where they apply, else the weights dequantized per call into the
  bf16 kernels), and 4-bit codes with fp8 tokens (mxfp4_fp8, nvfp4_fp8, w4afp8: mxfp4 past
  the decode kernels on grouped_gemm_w4a8's fp8 GEMMs; else the tokens dequantized into the
  weight-only kernels, decode_wq's 8-bit form only as layout decode_fp8), and mxfp8 (e4m3 codes converted to
  bf16 in registers, the tokens' e4m3 values dequantized into bf16)."""
  if quant is None or not quant.is_quantized:
    return None
  name = quant.name
  if quant.act_dtype is None or (runs_weight_only(quant) and not is_packed(quant)):
    return None  # weight-only and mxfp8: fused_experts_weight_only takes every such format
  if is_packed(quant):  # 4-bit codes with quantized tokens
    if quant.act_dtype != "float8_e4m3fn" or quant.act_scale not in ROW_SCALES:
      return (f"{name}: {quant.weight_dtype} weights with {quant.act_dtype} activations "
              f"scaled {quant.act_scale} (the Pallas decode kernel takes fp8 tokens with one "
              "scale per token or per tensor)")
    return None
  if quant.weight_dtype not in _Q8:
    return f"{name}: {quant.weight_dtype} weights (the Pallas kernels take fp8 e4m3 / int8)"
  if quant.zero_point:
    return f"{name}: zero points (asymmetric weights) are not implemented in the Pallas kernels"
  if quant.scale_dtype != "float32":
    return f"{name}: {quant.scale_dtype} scales (the Pallas kernels take float32 scales)"
  if quant.weight_scale in ("tensor", "channel"):
    if quant.act_scale not in K_CONSTANT_SCALES:
      return (f"{name}: act_scale={quant.act_scale!r} with {quant.weight_scale} weight scales "
              "(the Pallas kernels take per-token or per-tensor dynamic, or static per-tensor, "
              "activation scales)")
    return None
  if quant.weight_scale == "block":
    if (quant.weight_dtype != "float8_e4m3fn" or tuple(quant.block_shape) != (128, 128)
        or quant.act_scale != "dynamic_group" or quant.act_group_size != 128):
      return (f"{name}: the Pallas block kernel takes fp8 128 x 128 weight blocks with 1 x 128 "
              "activation groups (fp8_block)")
    return None
  return f"{name}: {quant.weight_scale} weight scales are not implemented in the Pallas kernels"


def _check_quantized_problem(inp, weights, activation) -> None:
  """Trace-time checks of a quantized call the kernels take (pallas_quant_support passed)."""
  check_weights_for_activation(weights, activation)
  for name, w in (("w13", weights.w13), ("w2", weights.w2)):
    if not w.k_major:
      raise ValueError(f"runner_backend='pallas_mosaic': {name} values must be K-major "
                       f"([E, N, K], the 8-bit wgmma's B layout); convert once with "
                       f"{name}.with_k_major(True)")
  h, n = weights.hidden_size, weights.intermediate_size
  why = PallasExperts().problem_support(jnp.bfloat16, h, n, weights_quant(weights))
  if why is not None:
    raise ValueError(f"runner_backend='pallas_mosaic' with {weights_quant(weights)}: {why}, "
                     "or use runner_backend='xla'")
  if inp.a_scale is None:
    raise ValueError("runner_backend='pallas_mosaic' with quantized weights needs the quantized "
                     "input's a_scale (prepare quantizes hidden_states)")


def _weight_only_tokens(inp, weights, activation) -> bool:
  """Trace-time checks of a weight-only call; whether its tokens come quantized (the 4-bit
  formats with fp8 tokens, mxfp8) rather than bf16 / f16."""
  check_weights_for_activation(weights, activation)
  quantized_tokens = weights_quant(weights).act_dtype is not None
  if not quantized_tokens and jnp.dtype(inp.a.dtype) not in _DTYPES:
    raise ValueError(f"runner_backend='pallas_mosaic' takes bf16/f16 hidden_states with "
                     f"weight-only {weights_quant(weights)}, got {inp.a.dtype}")
  return quantized_tokens


BACKWARDS = ("pallas", "xla")


def _forward(act, interpret, x, w13, w2, tw, ids, b13, b2):
  from jmoe.kernels.moe import fused_experts  # noqa: PLC0415 (kernels load lazily)
  return fused_experts(x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2,
                       interpret=interpret)


def _differentiable(backward, act, interpret, x, w13, w2, tw, ids, b13, b2):
  """The same block on a path jax can differentiate."""
  if backward == "pallas":
    from jmoe.kernels.moe import fused_experts_train  # noqa: PLC0415
    return fused_experts_train(x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2,
                               interpret=interpret)
  from jmoe.experts.xla import XlaExperts  # noqa: PLC0415
  inp = ExpertsInput(a=x, topk_weights=tw, topk_ids=ids)
  return XlaExperts().apply(inp, ExpertWeights(w13, w2, b13, b2), activation=act,
                            expert_map=None, out_dtype=x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _block(backward, act, interpret, x, w13, w2, tw, ids, b13, b2):
  return _forward(act, interpret, x, w13, w2, tw, ids, b13, b2)


def _block_fwd(backward, act, interpret, x, w13, w2, tw, ids, b13, b2):
  # Under differentiation the forward runs on the differentiable twin and keeps its VJP as the
  # residual, so the backward does not recompute the forward.
  f = lambda x, w13, w2, tw, b13, b2: _differentiable(backward, act, interpret, x, w13, w2, tw,
                                                       ids, b13, b2)
  return jax.vjp(f, x, w13, w2, tw, b13, b2)


def _block_bwd(backward, act, interpret, vjp, g):
  dx, dw13, dw2, dtw, db13, db2 = vjp(g)
  return dx, dw13, dw2, dtw, None, db13, db2


_block.defvjp(_block_fwd, _block_bwd)


class PallasExperts(Experts):
  name = "pallas_mosaic"
  activation_formats = (ActivationFormat.Standard, ActivationFormat.Standard)

  def __init__(self, interpret: Any = None, backward: Optional[str] = None):
    self.interpret = pallas_interpret_from_env() if interpret is None else interpret
    self.backward = backward or os.environ.get("JMOE_PALLAS_BACKWARD", "pallas")
    if self.backward not in BACKWARDS:
      raise ValueError(f"backward={self.backward!r} is not known; known: {BACKWARDS}")

  @classmethod
  def is_available(cls) -> tuple[bool, str]:
    from jmoe.oracle import platform_info  # noqa: PLC0415

    platform, cc, kind = platform_info()
    if platform == "gpu" and cc is not None and cc[0] == 9:
      return True, f"sm{cc[0]}{cc[1]} ({kind})"
    if pallas_interpret_from_env():
      from jmoe.kernels import _compat  # noqa: PLC0415
      if _compat.interpret_available():
        return True, "GPU interpret mode (JMOE_PALLAS_INTERPRET=1)"
      return False, "GPU interpret mode unavailable in this jax"
    where = f"{platform}" + (f" sm{cc[0]}{cc[1]}" if cc else "")
    return False, (f"needs an sm90 (Hopper) GPU, found {where}; JMOE_PALLAS_INTERPRET=1 runs "
                   "the kernels in the CPU interpreter")

  def problem_support(self, dtype, hidden_size: int, intermediate_size: int,
                      quant: Optional[QuantConfig] = None) -> Optional[str]:
    if jnp.dtype(dtype) not in _DTYPES:
      return f"{jnp.dtype(dtype).name} activations: the Pallas kernels take bf16/f16"
    # the 8-bit GEMMs' K step is 128; weight-only formats the decode kernels refuse are
    # dequantized into the bf16 kernels (K step 64), so they take what bf16 takes, and so do
    # 4-bit codes with fp8 tokens (decode_wq takes multiples of 64; else the bf16 kernels)
    w8a8 = quant is not None and quant.is_quantized and not runs_weight_only(quant)
    step = 128 if w8a8 else 64
    if hidden_size % step or intermediate_size % step:
      return (f"hidden {hidden_size} / intermediate {intermediate_size} not multiples of "
              f"{step} (pad the weights once at load time)")
    return None

  def finalize_weight_and_reduce_impl(self):
    return NoOp()

  def quant_support(self, quant):
    return pallas_quant_support(quant)

  def _check(self, inp, weights, activation) -> None:
    check_weights_for_activation(weights, activation)
    for name, arr in (("hidden_states", inp.a), ("w13", weights.w13), ("w2", weights.w2)):
      if jnp.dtype(arr.dtype) not in _DTYPES:
        raise ValueError(f"runner_backend='pallas_mosaic' takes bf16/f16 {name}, got "
                         f"{arr.dtype}; use runner_backend='xla' for {arr.dtype}")
    if weights.w13.dtype != inp.a.dtype or weights.w2.dtype != inp.a.dtype:
      raise ValueError("runner_backend='pallas_mosaic' needs hidden_states, w13 and w2 in one "
                       f"dtype, got {inp.a.dtype}, {weights.w13.dtype}, {weights.w2.dtype}")
    why = self.problem_support(inp.a.dtype, weights.hidden_size, weights.intermediate_size)
    if why is not None:
      raise ValueError(f"runner_backend='pallas_mosaic' cannot run this problem: {why}")

  def apply(self, inp, weights, *, activation, expert_map, out_dtype):
    quant = weights_quant(weights)
    if quant is not None:
      return self._apply_quantized(inp, weights, quant, activation, expert_map, out_dtype)
    self._check(inp, weights, activation)
    e = weights.num_experts
    local = local_expert_ids(inp.topk_ids, e, expert_map)  # non-local / empty -> e (skipped)
    out = _block(self.backward, activation, self.interpret, inp.a, weights.w13, weights.w2,
                 inp.topk_weights, local, weights.w13_bias, weights.w2_bias)
    return out.astype(out_dtype)

  def _apply_quantized(self, inp, weights, quant, activation, expert_map, out_dtype):
    """Forward only (fused_moe's frozen-weights VJP runs the dense block for gradients)."""
    why = pallas_quant_support(quant)
    if why is not None:
      raise ValueError(f"runner_backend='pallas_mosaic' cannot run {why}")
    local = local_expert_ids(inp.topk_ids, weights.num_experts, expert_map)
    dt = jnp.dtype(out_dtype)
    kernel_out = dt if dt in _DTYPES else jnp.dtype(jnp.bfloat16)
    if runs_weight_only(quant):  # (4-bit codes: fp8 tokens too; mxfp8)
      return self._apply_weight_only(inp, weights, activation, local, kernel_out).astype(dt)
    _check_quantized_problem(inp, weights, activation)
    from jmoe.kernels.moe import fused_experts_quantized  # noqa: PLC0415
    out = fused_experts_quantized(inp.a, inp.a_scale, weights.w13, weights.w2, inp.topk_weights,
                                  local, activation=activation, w13_bias=weights.w13_bias,
                                  w2_bias=weights.w2_bias, out_dtype=kernel_out,
                                  interpret=self.interpret)
    return out.astype(out_dtype)

  def _apply_weight_only(self, inp, weights, activation, local, out_dtype):
    """w4a16 / w8a16 / mxfp4 / nvfp4 with bf16 tokens, and 4-bit codes with prepare's fp8
    tokens (mxfp4_fp8, nvfp4_fp8, w4afp8) or e4m3 codes with mxfp8's tokens (dequantized
    into bf16 there): fused_experts_weight_only's, in the layout env
    JMOE_WEIGHT_ONLY_LAYOUT names (read at trace time; default "auto": see
    jmoe.kernels.moe.weight_only_layout) -- for benchmarks that compare the layouts."""
    fp8_tokens = _weight_only_tokens(inp, weights, activation)
    from jmoe.kernels.moe import fused_experts_weight_only, weight_only_layout  # noqa: PLC0415
    t, k = local.shape
    layout = weight_only_layout(t, k, weights.hidden_size, weights.intermediate_size,
                                activation, weights.w13, weights.w2,
                                os.environ.get("JMOE_WEIGHT_ONLY_LAYOUT", "auto"))
    if layout == "dequantize":  # dequantize only the experts the slots touch
      weights, local = narrow_to_touched(weights, local)
    return fused_experts_weight_only(inp.a, weights.w13, weights.w2, inp.topk_weights, local,
                                     activation=activation, w13_bias=weights.w13_bias,
                                     w2_bias=weights.w2_bias, out_dtype=out_dtype,
                                     interpret=self.interpret, layout=layout,
                                     x_scale=inp.a_scale if fp8_tokens else None)


def _batched_forward(act, interpret, a, ent, w13, w2, b13, b2):
  from jmoe.kernels import grouped_gemm as gg  # noqa: PLC0415

  if act.is_gated:
    h = gg.batched_grouped_gemm_gated(a, w13, ent, activation=act, bias=b13, interpret=interpret)
  else:
    h = gg.batched_grouped_gemm(a, w13, ent, activation=act, bias=b13, interpret=interpret)
  y = gg.batched_grouped_gemm(h, w2, ent, bias=b2, interpret=interpret)
  live = jnp.arange(a.shape[1])[None, :] < ent[:, None]
  return jnp.where(live[..., None], y, jnp.zeros((), y.dtype))  # rows past the count: unwritten


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _batched_block(act, interpret, a, ent, w13, w2, b13, b2):
  return _batched_forward(act, interpret, a, ent, w13, w2, b13, b2)


def _batched_block_fwd(act, interpret, a, ent, w13, w2, b13, b2):
  """Under differentiation: XLA's batched einsums forward, their VJP kept as the residual."""
  from jmoe.experts.xla_batched import XlaBatchedExperts  # noqa: PLC0415

  def f(a, w13, w2, b13, b2):
    inp = ExpertsInput(a=a, topk_weights=jnp.zeros((0, 1)), topk_ids=jnp.zeros((0, 1), jnp.int32),
                       expert_num_tokens=ent, format=ActivationFormat.Batched)
    return XlaBatchedExperts().apply(inp, ExpertWeights(w13, w2, b13, b2), activation=act,
                                     expert_map=None, out_dtype=a.dtype)

  return jax.vjp(f, a, w13, w2, b13, b2)


def _batched_block_bwd(act, interpret, vjp, g):
  da, dw13, dw2, db13, db2 = vjp(g)
  return da, None, dw13, dw2, db13, db2


_batched_block.defvjp(_batched_block_fwd, _batched_block_bwd)


class PallasBatchedExperts(BatchedExperts, PallasExperts):
  """Batched format `[E, C, H]` on the masked grouped GEMMs: row tiles past an expert's
  `expert_num_tokens` are never scheduled. Finalize gathers and weights the rows
  (NaiveBatched). Backward: XLA's batched einsums."""

  name = "pallas_mosaic_batched"

  def quant_support(self, quant):
    """The W8A8 schemes (fp8_tensor, fp8_channel, int8 and their static forms, fp8_block:
    `fused_experts_quantized_batched`) and the weight-only formats
    (`fused_experts_weight_only_batched`): whatever the standard format's kernels run."""
    if quant is None or not quant.is_quantized:
      return None
    return pallas_quant_support(quant)

  def apply(self, inp, weights, *, activation, expert_map, out_dtype):
    quant = weights_quant(weights)
    if quant is not None:
      why = self.quant_support(quant)
      if why is not None:
        raise ValueError(f"runner_backend='pallas_mosaic' (batched) cannot run {why}")
      dt = jnp.dtype(out_dtype)
      if runs_weight_only(quant):
        return self._apply_weight_only_batched(inp, weights, activation, dt)
      _check_quantized_problem(inp, weights, activation)
      from jmoe.kernels.moe import fused_experts_quantized_batched  # noqa: PLC0415
      out = fused_experts_quantized_batched(
          inp.a, inp.a_scale, inp.expert_num_tokens, weights.w13, weights.w2,
          activation=activation, w13_bias=weights.w13_bias, w2_bias=weights.w2_bias,
          out_dtype=dt if dt in _DTYPES else jnp.dtype(jnp.bfloat16), interpret=self.interpret)
      return out.astype(out_dtype)
    self._check(inp, weights, activation)
    out = _batched_block(activation, self.interpret, inp.a, inp.expert_num_tokens, weights.w13,
                         weights.w2, weights.w13_bias, weights.w2_bias)
    return out.astype(out_dtype)

  def _apply_weight_only_batched(self, inp, weights, activation, out_dtype):
    fp8_tokens = _weight_only_tokens(inp, weights, activation)
    from jmoe.kernels.moe import fused_experts_weight_only_batched  # noqa: PLC0415
    out = fused_experts_weight_only_batched(
        inp.a, inp.expert_num_tokens, weights.w13, weights.w2, activation=activation,
        w13_bias=weights.w13_bias, w2_bias=weights.w2_bias,
        out_dtype=out_dtype if out_dtype in _DTYPES else jnp.dtype(jnp.bfloat16),
        interpret=self.interpret, x_scale=inp.a_scale if fp8_tokens else None)
    return out.astype(out_dtype)


register_runner("pallas_mosaic", PallasExperts)
register_runner("pallas_mosaic", PallasBatchedExperts)
