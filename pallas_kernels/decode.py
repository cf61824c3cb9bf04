"""The decode MoE block as one Mosaic GPU kernel: GEMM1, activation and GEMM2 chained per slot.

At decode (a few tokens) the block is weight streaming, and every extra kernel launch or HBM
round trip shows. ``fused_experts_decode`` runs, for each valid slot s (token t = s // k,
expert e) and each block j of ``block_n`` intermediate columns, one work item:

    a      = act(x[t] @ w13[e][:, gate cols of j], x[t] @ w13[e][:, up cols of j])   [1, bn]
    part[j, s, :] = a @ w2[e][rows of j, :]                                           [1, H] f32

(a w13 bias, if any, is added before the activation). Both weight matrices are read exactly
once per slot, the [bn]-wide intermediate never leaves shared memory, and the sum over j and k
(router weights, w2 bias) is one small reduction after. Launches: x padded to a row tile, the
slot list (a few fused integer ops), this kernel, the reduction. Slots that share an expert
read its weights once each, so this suits batches whose slots rarely share one (like the
per_slot layout of fused_experts).

Opt-in through ``fused_experts(layout="fused_decode")``: correct on an H200, but slower than
the per_slot layout there (qwen3 T=1 37.3 vs 34.7 µs, mixtral 223 vs 176; BENCHMARKS.md, fourth
round); each item drains GEMM1's pipeline before GEMM2. Gated activations only (swigluoai
included).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels import permute as _perm
from pallas_kernels.activations import Activation, as_activation
from pallas_kernels.grouped_gemm import kernel_activation

_ROWS = 64  # wgmma's M: one row of the tile is the slot's token, the rest ride along


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """block_n: intermediate columns per work item (GEMM1 output / GEMM2 contraction);
  block_k: GEMM1 contraction step; block_h: GEMM2 output columns per step; stages: pipeline
  depths of the two GEMMs."""
  block_n: int = 64
  block_k: int = 64
  block_h: int = 128
  stages1: int = 4
  stages2: int = 3

  def __post_init__(self):
    for name in ("block_n", "block_k", "block_h"):
      v = getattr(self, name)
      if v % 64 or v <= 0:
        raise ValueError(f"{name}={v} must be a positive multiple of 64")
    if self.stages1 < 2 or self.stages2 < 2:
      raise ValueError("stages1 and stages2 must be >= 2")


def _build(*, rows, h, n, m, k, dtype, act: Activation, cfg: DecodeConfig, has_bias: bool,
           num_sms, interpret):
  """rows: rows of the padded x (>= 64, a multiple of 8); m = T * k slots; has_bias: a w13
  bias [E, 2N] (f32) is added before the activation."""
  bn, bk, bh = cfg.block_n, cfg.block_k, cfg.block_h
  n_blocks, k_iters, h_iters = n // bn, h // bk, h // bh
  itemsize = jnp.dtype(dtype).itemsize
  _cast = _compat.layout_cast(interpret)

  def body(slot_ref, expert_ref, count_ref, x_ref, w13_ref, w2_ref, *rest):
    rest = list(rest)
    b13_ref = rest.pop(0) if has_bias else None
    part_ref, a_smem, o_smem, vec_smem, vec_bar = rest
    num_items = count_ref[0] * n_blocks

    @plgpu.nd_loop((num_items,), collective_axes="sm")
    def _item(info):
      (lin,) = info.index
      i = lax.div(lin, jnp.int32(n_blocks))
      j = lax.rem(lin, jnp.int32(n_blocks))
      s = slot_ref[i]
      e = expert_ref[i]
      tok = lax.div(s, jnp.int32(k))
      # the 64-row x tile holding the token, starting on an 8-row boundary inside the array
      r0 = pl.multiple_of(jnp.minimum(tok - lax.rem(tok, 8), rows - _ROWS), 8)
      w13_e = w13_ref.at[e]
      if has_bias:  # the gate and up bias slices, loaded while GEMM1 runs
        for c, col in enumerate((j * bn, n + j * bn)):
          plgpu.copy_gmem_to_smem(b13_ref.at[e, pl.ds(col, bn)], vec_smem.at[c],
                                  vec_bar.at[c])

      def gemm1(acc_g, acc_u):
        def step(_, x_smem, g_smem, u_smem):
          plgpu.wgmma(acc_g, x_smem, g_smem)
          plgpu.wgmma(acc_u, x_smem, u_smem)
          plgpu.wgmma_wait(2)  # this step's two stay in flight; delay_release keeps their tiles
        specs = [plgpu.BlockSpec((_ROWS, bk), lambda kk: (0, kk),
                                 transforms=_compat.smem_transforms(bk, itemsize), delay_release=1)]
        specs += [plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0),
                                  transforms=_compat.smem_transforms(bn, itemsize), delay_release=1)
                  for _ in range(2)]
        plgpu.emit_pipeline(step, grid=(k_iters,), in_specs=specs,
                            max_concurrent_steps=cfg.stages1)(
                                x_ref.at[pl.ds(r0, _ROWS), :],
                                w13_e.at[:, pl.ds(j * bn, bn)],
                                w13_e.at[:, pl.ds(n + j * bn, bn)])
        plgpu.wgmma_wait(0)
        gate, up = acc_g[...], acc_u[...]
        if has_bias:
          biased = []
          for c, v in enumerate((gate, up)):
            plgpu.barrier_wait(vec_bar.at[c])
            b = _cast(vec_smem.at[c][...], plgpu.Layout.WGMMA.reduce(0))
            biased.append(v + lax.broadcast_in_dim(b, (_ROWS, bn), [1]))
          gate, up = biased
        a = kernel_activation(act, gate, up)
        a_smem[...] = a.astype(dtype)  # GEMM2's A operand: the intermediate stays on chip
        plgpu.commit_smem()

      pl.run_scoped(gemm1, plgpu.ACC((_ROWS, bn), jnp.float32),
                    plgpu.ACC((_ROWS, bn), jnp.float32))

      def gemm2_step(idx, w2_smem):
        (c,) = idx

        def one(acc):
          plgpu.wgmma(acc, a_smem, w2_smem)
          plgpu.wgmma_wait(0)
          return acc[...]

        y = pl.run_scoped(one, plgpu.ACC((_ROWS, bh), jnp.float32))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous store read o_smem
        o_smem[...] = y
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(tok - r0, 1)],
                                part_ref.at[j, pl.ds(s, 1), pl.ds(c * bh, bh)])

      plgpu.emit_pipeline(
          gemm2_step, grid=(h_iters,),
          in_specs=[plgpu.BlockSpec((bn, bh), lambda c: (0, c),
                                    transforms=_compat.smem_transforms(bh, itemsize))],
          max_concurrent_steps=cfg.stages2)(w2_ref.at[e].at[pl.ds(j * bn, bn), :])

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  return _compat.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((n_blocks, m, h), jnp.float32),
      scratch_types=[plgpu.SMEM((_ROWS, bn), dtype, transforms=_compat.smem_transforms(bn, itemsize)),
                     plgpu.SMEM((_ROWS, bh), jnp.float32),
                     plgpu.SMEM((2, bn), jnp.float32),
                     plgpu.Barrier(num_arrivals=1, num_barriers=2)],
      grid=(num_sms,),
      grid_names=("sm",),
      compiler_params=_compat.compiler_params(approx_math=True),
      interpret=interpret,
      name="jmoe_moe_decode",
  )


@functools.partial(jax.jit, static_argnames=("activation", "config", "interpret"))
def fused_experts_decode(x: jax.Array, w13: jax.Array, w2: jax.Array, topk_weights: jax.Array,
                         topk_ids: jax.Array, *, activation: Activation | str = "silu",
                         w13_bias: jax.Array | None = None, w2_bias: jax.Array | None = None,
                         config: DecodeConfig | None = None, interpret: Any = False
                         ) -> jax.Array:
  """out[t] = sum_j topk_weights[t, j] * (act(x[t] @ w13[e] + b13[e]) @ w2[e] + b2[e]),
  e = topk_ids[t, j].

  x [T, H] bf16/f16, w13 [E, H, 2N] (gate | up, gated activations only), w2 [E, N, H],
  topk_weights [T, k], topk_ids [T, k] (-1 or >= E: empty slot). H and N multiples of the
  config's blocks (64 by default). w13_bias [E, 2N] is added in the kernel before the
  activation; w2_bias [E, H] in the final reduction (once per slot). Returns [T, H] in x.dtype.
  """
  act = as_activation(activation)
  if not act.is_gated:
    raise ValueError(f"activation={act.name!r}: the decode kernel takes gated activations")
  cfg = config or DecodeConfig()
  t, k = topk_ids.shape
  e, h, n2 = w13.shape
  n = n2 // 2
  if x.shape != (t, h) or w2.shape != (e, n, h):
    raise ValueError(f"shapes: x {x.shape} (want ({t}, {h})), w2 {w2.shape} (want ({e}, {n}, {h}))")
  if x.dtype != w13.dtype or w2.dtype != w13.dtype:
    raise ValueError(f"dtypes differ: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
  if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"x dtype {x.dtype}: bfloat16 or float16")
  for name, size, block in (("H", h, cfg.block_k), ("H", h, cfg.block_h), ("N", n, cfg.block_n)):
    if size % block:
      raise ValueError(f"{name}={size} is not a multiple of the block ({block})")
  if w13_bias is not None and w13_bias.shape != (e, n2):
    raise ValueError(f"w13_bias must have shape ({e}, {n2}), got {w13_bias.shape}")
  if w2_bias is not None and w2_bias.shape != (e, h):
    raise ValueError(f"w2_bias must have shape ({e}, {h}), got {w2_bias.shape}")
  m = t * k
  ids = topk_ids.reshape(m).astype(jnp.int32)
  valid = (ids >= 0) & (ids < e)
  slots, count = _perm.valid_slots_first(valid)
  experts = jnp.where(valid, ids, 0)[slots]
  rows = max(-(-t // 8) * 8, _ROWS)
  xp = x if rows == t else jnp.pad(x, ((0, rows - t), (0, 0)))
  interp, nsm = _compat.launch_params(interpret)
  kern = _build(rows=rows, h=h, n=n, m=m, k=k, dtype=x.dtype, act=act, cfg=cfg,
                has_bias=w13_bias is not None, num_sms=nsm, interpret=interp)
  args = [slots, experts, count, xp, w13, w2]
  if w13_bias is not None:
    args.append(w13_bias.astype(jnp.float32))
  part = kern(*args)  # [N / block_n, m, H]; empty slots' rows unwritten
  y = jnp.sum(part, axis=0)
  if w2_bias is not None:
    y = y + w2_bias.astype(jnp.float32)[jnp.where(valid, ids, 0)]
  w = jnp.where(valid, topk_weights.reshape(m).astype(jnp.float32), 0.0)
  y = jnp.where(valid[:, None], y, 0.0) * w[:, None]
  return jnp.sum(y.reshape(t, k, h), axis=1).astype(x.dtype)
