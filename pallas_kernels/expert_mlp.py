"""The experts' MLP over expert-sorted rows, differentiable on the Pallas kernels (training).

    y = act(xs @ w13[g] + b13[g]) @ w2[g] + b2[g]        (row r of xs belongs to group g(r))

Forward: GEMM1 writes the activation's input h, one elementwise pass makes a, GEMM2 writes y.
Backward:

    da   = dy @ w2[g]^T               (w2 read transposed: no weight copy)
    dh   = act'(h) * da               one elementwise pass (XLA)
    dw2  = tgmm(a, dy)
    dxs  = dh @ w13[g]^T              (w13 read transposed)
    dw13 = tgmm(xs, dh)

Two fused forms exist and are opt-in, because they measured slower on an H200 (2026-11-30,
benchmarks/check_act_grad.py, 1024 tokens): ``fuse_act_grad`` puts the activation's VJP in the
d a GEMM's epilogue (grouped_gemm act_grad; qwen3 140.7 vs 140.4 µs for the pair at best,
mixtral 630 vs 508: the epilogue's h tiles cost shared memory, so the GEMM runs a smaller tile,
and the epilogue is not overlapped with the next tile's loads), ``preact`` has GEMM1 write a and
h from the same accumulators (qwen3 235 vs 226, mixtral 1028 vs 867).

The GEMMs' tile lists must cover every row: the callers give the rows past the groups (the
tail) to the last group there and pass them, and any padding rows inside a group, zero
cotangents, so every row is computed, finite and harmless, and no pass masks rows. The group
sizes (without the tail) bound the weight gradient's rows; bias gradients are per-group row
sums of dh / dy.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import tgmm as _tg
from jmoe.kernels.activations import Activation
from jmoe.kernels.grouped_gemm import GroupedGemmConfig


@dataclasses.dataclass(frozen=True)
class MlpPlan:
  """The static part of one expert_mlp call: activation, the four GEMMs' configs (GEMM1, GEMM2,
  d a, d xs; resolved with grouped_gemm.kernel_config, so that the tile work lists match their
  block_m), whether GEMM1 also writes the activated rows (gated activations only) and whether
  the d a GEMM applies the activation's VJP (the fused forms of the module docstring), and the
  interpret mode."""
  act: Activation
  configs: tuple[GroupedGemmConfig, GroupedGemmConfig, GroupedGemmConfig, GroupedGemmConfig]
  preact: bool = False
  fuse_act_grad: bool = False
  interpret: Any = False


def plan_configs(m: int, hdim: int, n: int, num_experts: int, dtype, act: Activation,
                 preact: bool = False, fuse_act_grad: bool = False
                 ) -> tuple[GroupedGemmConfig, ...]:
  """The four GEMMs' configs for m rows, hidden hdim, intermediate n (per gate / up half)."""
  n13 = 2 * n if act.is_gated else n
  up = (gg.kernel_config("grouped_gemm_gated", m, n, hdim, num_experts, dtype, gated=True,
                         store_preact=True) if preact
        else gg.kernel_config("grouped_gemm", m, n13, hdim, num_experts, dtype))
  down = gg.kernel_config("grouped_gemm", m, hdim, n, num_experts, dtype)
  d_a = gg.kernel_config("grouped_gemm", m, n, hdim, num_experts, dtype, rhs_t=True,
                         act_grad=act if fuse_act_grad else None)
  d_x = gg.kernel_config("grouped_gemm", m, hdim, n13, num_experts, dtype, rhs_t=True)
  return (up, down, d_a, d_x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def expert_mlp(plan: MlpPlan, xs: jax.Array, w13: jax.Array, w2: jax.Array,
               b13: jax.Array | None, b2: jax.Array | None, group_sizes: jax.Array,
               metas: tuple) -> jax.Array:
  """y [M, H] = act(xs @ w13[g] + b13[g]) @ w2[g] + b2[g], in xs's dtype.

  xs [M, H] bf16/f16 sorted by group; w13 [E, H, 2N] (gated) or [E, H, N]; w2 [E, N, H];
  b13 [E, 2N] / b2 [E, H] or None; group_sizes [E] int32 (sum <= M); metas: one
  grouped_gemm.tile_metadata(group sizes with the rows past them added to the last group, M,
  block_m) per plan config, in plan order.
  """
  return _forward(plan, xs, w13, w2, b13, b2, group_sizes, metas)[0]


def _forward(plan, xs, w13, w2, b13, b2, gs, metas):
  c_up, c_down = plan.configs[:2]
  it = plan.interpret
  if plan.preact:
    a, h = gg._run(xs, w13, gs, None, b13, None, c_up, it, True, plan.act, "grouped_gemm_gated",
                   meta=metas[0], store_preact=True)
  else:
    h = gg._run(xs, w13, gs, None, b13, None, c_up, it, False, None, "grouped_gemm",
                meta=metas[0])
    a = _activation(plan.act, h)[0].astype(xs.dtype)
  y = gg._run(a, w2, gs, None, b2, None, c_down, it, False, None, "grouped_gemm", meta=metas[1])
  return y, (xs, w13, w2, h, a, gs, metas)


def _activation(act: Activation, h: jax.Array):
  """(act(h) in f32, its VJP at h: d a -> d h in h's dtype); h is [M, 2N] (gate | up) for a gated
  activation."""
  hf = h.astype(jnp.float32)
  if act.is_gated:
    n = hf.shape[1] // 2
    a, pull = jax.vjp(act.gated, hf[:, :n], hf[:, n:])
    return a, lambda da: jnp.concatenate(pull(da.astype(jnp.float32)), axis=1).astype(h.dtype)
  a, pull = jax.vjp(act, hf)
  return a, lambda da: pull(da.astype(jnp.float32))[0].astype(h.dtype)


def _group_sums(d: jax.Array, group_sizes: jax.Array, num_groups: int, dtype) -> jax.Array:
  """Per-group row sums of d [M, C] -> [E, C] (the bias gradient)."""
  # compare_all: one fused [M, E] compare-sum (the default scan is a loop of gathers on GPU)
  gid = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(d.shape[0]), side="right",
                         method="compare_all")
  return jax.ops.segment_sum(d.astype(jnp.float32), gid, num_segments=num_groups).astype(dtype)


def _expert_mlp_fwd(plan, xs, w13, w2, b13, b2, gs, metas):
  y, res = _forward(plan, xs, w13, w2, b13, b2, gs, metas)
  return y, res + (b13, b2)  # the (small) biases only for their dtypes


def _expert_mlp_bwd(plan, res, dy):
  xs, w13, w2, h, a, gs, metas, b13, b2 = res
  _, _, c_da, c_dx = plan.configs
  it = plan.interpret
  e = w13.shape[0]
  dy = dy.astype(xs.dtype)
  if plan.fuse_act_grad:
    dh = gg._run(dy, w2, gs, None, None, None, c_da, it, False, None, "grouped_gemm",
                 meta=metas[2], rhs_t=True, act_grad=plan.act, h=h)
  else:
    da = gg._run(dy, w2, gs, None, None, None, c_da, it, False, None, "grouped_gemm",
                 meta=metas[2], rhs_t=True)
    dh = _activation(plan.act, h)[1](da)
  dw2 = _tg.tgmm(a, dy, gs, out_dtype=w2.dtype, interpret=it)
  dxs = gg._run(dh, w13, gs, None, None, None, c_dx, it, False, None, "grouped_gemm",
                meta=metas[3], rhs_t=True)
  dw13 = _tg.tgmm(xs, dh, gs, out_dtype=w13.dtype, interpret=it)
  db13 = None if b13 is None else _group_sums(dh, gs, e, b13.dtype)
  db2 = None if b2 is None else _group_sums(dy, gs, e, b2.dtype)
  return dxs, dw13, dw2, db13, db2, None, None


expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)
