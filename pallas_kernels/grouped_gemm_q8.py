"""8-bit (fp8 e4m3 / int8) contiguous grouped GEMMs for Hopper: the quantized experts' GEMMs.

Operands as jmoe.quant stores them: lhs [M, K] 8-bit (rows sorted by group, as in
grouped_gemm), rhs = QuantizedWeights.values [E, N_total, K] 8-bit K-MAJOR (the only B layout
Hopper's 8-bit wgmma takes; read through a transposed SMEM view, no copy), f32 scales.

Two kernels:

* :func:`grouped_gemm_q8` (fp8_tensor, fp8_channel, int8): the scales factor out of the K sum,
  so this is grouped_gemm.py's kernel itself in its 8-bit mode (same task list, persistent grid,
  warp specialization, group-aligned row tiles; block_k = 128 = one 128-byte swizzle of 8-bit
  elements; f32 accumulation, s32 for int8) with two more epilogue vectors:
      y = act(acc * a_scale[r] * w_scale[e, n] + bias[e, n]) * row_scale[r]
  (gated: gate and up columns each with their own w_scale column). Reusing the kernel keeps one
  schedule to tune for bf16 and 8-bit: only the element type and the epilogue differ.

* :func:`grouped_gemm_fp8_block` (fp8_block: 128 x 128 weight blocks, 1 x 128 activation
  groups, DeepSeek-V3 / DeepGEMM): the scales vary along K, so each K step of 128 is one wgmma
  into a fresh accumulator that is promoted into the f32 total with
  ``a_scale[r, kb] * w_scale[e, n_blk, kb]`` (DeepGEMM's two-level accumulation: the fp8 wgmma's
  limited-precision accumulator never sums more than 128 products). Its own kernel (the total is
  the pipeline's carry) because the K loop's body differs; prefill sizes run it warp specialized
  (two compute warpgroups: one promotes while the other's wgmma runs). Its epilogue can write
  the output already quantized for the next GEMM
  (``quantize_output``): per row per 128 columns, fp8 values + f32 scales, so GEMM1's
  activation output never makes a bf16 round trip through HBM before GEMM2. Those scales are
  written per task ([T, N/128, block_m], each task owns its slot: a row's scale needs no store
  narrower than TMA's 16 bytes) and GEMM2 reads them through the same task list.

Rows past sum(group_sizes) are not written (as grouped_gemm). Forward only.

H200 figures: BENCHMARKS.md ("Quantized experts"); design notes and what was tried:
docs/kernels.md ("8-bit grouped GEMMs").
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

from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels.activations import Activation, as_activation

Q8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8))
BLOCK_K = 128  # one 128-byte swizzle row of 8-bit elements, and the fp8_block scale group
FP8_MAX = 448.0
Q8_MAX = {jnp.dtype(jnp.float8_e4m3fn): FP8_MAX, jnp.dtype(jnp.int8): 127.0}  # largest finite


# ============================================================================ validation


def _check_q8_operands(lhs, rhs, group_sizes, *, argname_rhs: str = "rhs"):
  """lhs [M, K] and rhs [E, N_total, K] of one 8-bit dtype, K a multiple of 128."""
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
  if rhs.ndim != 3:
    raise ValueError(f"{argname_rhs} must be K-major values [E, N, K], got shape {rhs.shape}")
  for name, x in (("lhs", lhs), (argname_rhs, rhs)):
    if jnp.dtype(x.dtype) not in Q8_DTYPES:
      raise ValueError(f"{name}: dtype {x.dtype} is not an 8-bit type (float8_e4m3fn or int8)")
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"lhs dtype {lhs.dtype} != {argname_rhs} dtype {rhs.dtype}")
  m, k = lhs.shape
  e, _, k2 = rhs.shape
  if k != k2:
    raise ValueError(f"lhs K={k} does not match {argname_rhs} K={k2} ({argname_rhs} is K-major "
                     f"[E, N, K], got {rhs.shape})")
  if k % BLOCK_K:
    raise ValueError(f"K={k} must be a multiple of {BLOCK_K} for the 8-bit kernels (pad lhs and "
                     f"{argname_rhs} along K with zeros)")
  if m == 0:
    raise ValueError("lhs has 0 rows")
  if group_sizes.shape != (e,):
    raise ValueError(f"group_sizes must have shape ({e},), got {group_sizes.shape}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be integer, got {group_sizes.dtype}")


def _check_epilogue(m, e, n_total, n_out, bias, row_scale):
  if row_scale is not None and row_scale.shape != (m,):
    raise ValueError(f"row_scale must have shape ({m},), got {row_scale.shape}")
  if bias is not None and bias.shape != (e, n_total):
    raise ValueError(f"bias must have shape ({e}, {n_total}), got {bias.shape}")
  if n_out % 64:
    raise ValueError(f"N={n_out} (output columns) must be a multiple of 64")


def _gate(activation, n_total: int, argname: str = "rhs"):
  """(Activation or None, gated, n_out)."""
  act = None if activation is None else as_activation(activation)
  gated = act is not None and act.is_gated
  if gated and n_total % 2:
    raise ValueError(f"{argname}: a gated activation needs 2N weight columns, got {n_total}")
  return act, gated, n_total // 2 if gated else n_total


def row_scale_vector(a_scale: jax.Array, m: int, *, argname: str = "a_scale") -> jax.Array:
  """Per-token [M, 1] / [M] or per-tensor [1, 1] / [] activation scale -> f32 [M]."""
  s = jnp.asarray(a_scale, jnp.float32)
  if s.size == 1:
    return jnp.broadcast_to(s.reshape(()), (m,))
  if s.shape in ((m,), (m, 1)):
    return s.reshape(m)
  raise ValueError(f"{argname} must be per-token [{m}, 1] or per-tensor [1, 1], got {s.shape}")


def column_scale_matrix(w_scale: jax.Array, e: int, n_total: int, *,
                        argname: str = "w_scale") -> jax.Array:
  """Per-tensor [E, 1, 1] or per-channel [E, N, 1] (QuantizedWeights.scale, K-major) or
  [E, N] weight scale -> f32 [E, N] (the epilogue's column vector)."""
  s = jnp.asarray(w_scale, jnp.float32)
  if s.ndim == 3:
    if s.shape[2] != 1:
      raise ValueError(f"{argname} varies along K (shape {s.shape}): use grouped_gemm_fp8_block")
    s = s[:, :, 0]
  if s.ndim != 2 or s.shape[0] != e or s.shape[1] not in (1, n_total):
    raise ValueError(f"{argname} must be [E={e}, 1 or {n_total}(, 1)], got {w_scale.shape}")
  return jnp.broadcast_to(s, (e, n_total))


# ============================================================================ per-tensor / channel


def q8_config(m: int, n_out: int, k: int, num_groups: int, *, gated: bool,
              dtype=jnp.float8_e4m3fn) -> gg.GroupedGemmConfig:
  """The config tuned for this 8-bit problem (`python -m jmoe tune --quant`: the grouped_gemm
  (_gated) tables, keyed by the 8-bit dtype), else the bf16 heuristic's schedule with block_k
  = 128: an 8-bit stage of 128 elements holds the same bytes as a bf16 stage of 64, so its
  tiles, stage counts and shared memory carry over."""
  table = "grouped_gemm_gated" if gated else "grouped_gemm"
  cfg = gg.tuned_config(table, gg.GroupedGemmConfig, m, n_out, k, num_groups, dtype)
  if cfg is None:
    cfg = gg.heuristic_config(m, n_out, k, num_groups, jnp.bfloat16, gated=gated,
                              out_dtype=jnp.bfloat16)
  return dataclasses.replace(cfg, block_k=BLOCK_K)


def q8_run(lhs, rhs, group_sizes, a_scale_vec, w_scale_mat, *, act, gated, bias=None,
           row_scale=None, out_dtype=jnp.bfloat16, config=None, interpret=False, meta=None,
           keep_rows=False):
  """grouped_gemm_q8 on checked operands (a_scale_vec [M] f32, w_scale_mat [E, N_total] f32);
  meta / keep_rows as grouped_gemm._run (fused_experts shares one task list)."""
  m, k = lhs.shape
  e, n_total, _ = rhs.shape
  n_out = n_total // 2 if gated else n_total
  if config is None:
    config = q8_config(m, n_out, k, e, gated=gated, dtype=lhs.dtype)
  if config.block_k != BLOCK_K:
    config = dataclasses.replace(config, block_k=BLOCK_K)
  return gg._run(lhs, rhs, group_sizes, row_scale, bias, out_dtype, config, interpret, gated, act,
                 "", meta=meta, keep_rows=keep_rows, rhs_t=True, a_scale=a_scale_vec,
                 w_scale=w_scale_mat)


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "config", "interpret"))
def grouped_gemm_q8(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, a_scale: jax.Array,
                    w_scale: jax.Array, *, activation: Activation | str | None = None,
                    bias: jax.Array | None = None, row_scale: jax.Array | None = None,
                    out_dtype=jnp.bfloat16, config: gg.GroupedGemmConfig | None = None,
                    interpret: Any = False) -> jax.Array:
  """W8A8 grouped GEMM with scales constant along K (fp8_tensor / fp8_channel / int8).

  out[r] = act(acc[r] * a_scale[r] * w_scale[g(r)] + bias[g(r)]) * row_scale[r], acc =
  lhs[r] @ rhs[g(r)]^T accumulated in f32 (int8: s32, exact).
  lhs [M, K] fp8 e4m3 / int8 sorted by group; rhs [E, N_total, K] same dtype (K-major values);
  group_sizes [E]; a_scale per-token [M, 1] (or per-tensor [1, 1]); w_scale [E, 1, 1] /
  [E, N_total, 1] (QuantizedWeights.scale) or [E, N_total]; bias [E, N_total]; row_scale [M].
  activation: None, a ``*_no_mul`` one, or a gated one (N_total = 2N: gate columns [0, N), up
  [N, 2N), each with its own w_scale column). Returns [M, N_out] out_dtype; rows past
  sum(group_sizes) are unwritten. K must be a multiple of 128, N_out of 64.
  """
  _check_q8_operands(lhs, rhs, group_sizes)
  m = lhs.shape[0]
  e, n_total, _ = rhs.shape
  act, gated, n_out = _gate(activation, n_total)
  _check_epilogue(m, e, n_total, n_out, bias, row_scale)
  return q8_run(lhs, rhs, group_sizes, row_scale_vector(a_scale, m),
                column_scale_matrix(w_scale, e, n_total), act=act, gated=gated, bias=bias,
                row_scale=row_scale, out_dtype=out_dtype, config=config, interpret=interpret)


# ============================================================================ fp8 block


@dataclasses.dataclass(frozen=True)
class BlockQ8Config:
  """fp8_block kernel tiles: block_m rows x block_n output columns (gated: its gate and its up
  columns), K steps of 128 (the scale group), num_stages TMA stages in flight. One warpgroup:
  the f32 total plus one step's accumulator must fit its registers (64 x 128 gated, up to
  128 x 128 plain). ctas_per_sm=2: two CTAs share each SM (half the shared memory each, stages
  refitted), so one CTA's wgmma runs while the other waits on its promotion or epilogue (each
  K step ends in a wgmma wait: one warpgroup alone leaves the tensor cores idle there).
  warp_specialized: a TMA warpgroup and two compute warpgroups of 64 rows each (block_m=128)
  over the same B tiles: one's promotion overlaps the other's wgmma (DeepGEMM's layout); the
  default where experts get more than 64 rows (block_config).
  k_pairs (ungated GEMMs with an even number of K steps: GEMM2): a pipeline step takes two K
  steps, both wgmmas issued into two fresh accumulators before the first is promoted, so the
  first promotion runs under the second wgmma (one more 64 x 128 accumulator live; each stage
  holds two K steps). Off by default: not yet timed on a GPU (bench_quant.py --block-variants
  ws-pairs)."""

  block_m: int = 64
  block_n: int = 128
  num_stages: int = 4
  ctas_per_sm: int = 1
  warp_specialized: bool = False
  k_pairs: bool = False

  def __post_init__(self):
    if self.block_m not in (64, 128):
      raise ValueError(f"block_m={self.block_m} must be 64 or 128")
    if self.block_n not in (64, 128):
      raise ValueError(f"block_n={self.block_n} must be 64 or 128 (inside one 128-column "
                       "weight block)")
    if self.num_stages < 2:
      raise ValueError(f"num_stages={self.num_stages} must be >= 2")
    if self.ctas_per_sm not in (1, 2):
      raise ValueError(f"ctas_per_sm={self.ctas_per_sm} must be 1 or 2")
    if self.warp_specialized and (self.block_m != 128 or self.ctas_per_sm != 1):
      raise ValueError("warp_specialized=True needs block_m=128 (64 rows per compute "
                       "warpgroup) and ctas_per_sm=1 (registers)")

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


BLOCK_TABLE = "grouped_gemm_fp8_block"  # tuned GEMM1 configs of the fp8_block block


def block_config(m: int, n_out: int, k: int, num_groups: int, *, gated: bool,
                 quantize_output: bool = False) -> BlockQ8Config:
  """The tuned entry (`python -m jmoe tune --quant fp8_block`, table grouped_gemm_fp8_block)
  if one matches, else: 128 columns (64 where N needs it; a quantized output's row scale spans
  one 128-column group). Experts with more than 64 rows on average: warp specialized, 128-row
  tiles, 64 per compute warpgroup, one promoting while the other's wgmma runs. H200, jax
  0.11.2, the whole fp8_block block against 64-row tiles on two CTAs per SM: deepseek-v3 16384
  tokens 24229 -> 13939 µs (GEMM1 17261 -> 8116), 4096: 7437 -> 4873; qwen3-30b-a3b 4096:
  626 -> 566. (256-column ungated tiles, two 128-column operands per K step, ran GEMM2 1.8x
  slower: deepseek-v3 16384 tokens 8548 vs 4622 µs.) Fewer rows (decode): 64-row tiles on two
  CTAs per SM (deepseek-v3 4096 tokens, before the warp-specialized form: 8060 -> 7531 µs
  against one CTA)."""
  tuned = gg.tuned_config(BLOCK_TABLE, BlockQ8Config, m, n_out, k, num_groups,
                          jnp.float8_e4m3fn)
  if tuned is not None and n_out % tuned.block_n == 0:
    return tuned
  rows = m / gg.expected_groups(m, num_groups)
  bn = 128 if (n_out % 128 == 0 or quantize_output) else 64
  if rows > 64:
    return BlockQ8Config(block_m=128, block_n=bn, num_stages=4, warp_specialized=True)
  return BlockQ8Config(block_m=64, block_n=bn, num_stages=6 if k >= 6 * BLOCK_K else 4,
                       ctas_per_sm=2)


def gemm2_block_config(cfg1: BlockQ8Config, n_out: int) -> BlockQ8Config:
  """GEMM2's config beside GEMM1's: the same form and block_m (GEMM2 reads GEMM1's per-task
  scales: one task list), 128 columns (64 where n_out needs it); warp specialized, 4 stages
  (GEMM2's stages are smaller than gated GEMM1's: deepseek-v3 16384 tokens 4752 µs with 3,
  4622 with 4)."""
  return dataclasses.replace(cfg1, block_n=128 if n_out % 128 == 0 else 64,
                             num_stages=4 if cfg1.warp_specialized else cfg1.num_stages)


def fit_block_stages(cfg: BlockQ8Config, n_rhs: int, k: int = 0) -> BlockQ8Config:
  """cfg with its stages lowered until one CTA's shared memory fits (its SM share); n_rhs: B
  operands per K step (2 gated). The output tile is counted at 2 bytes per element even when
  quantized (1 byte): the timed configurations were fitted that way (GEMM1 warp specialized
  on deepseek-v3: 3 stages)."""
  limit = gg._SMEM_BYTES if cfg.ctas_per_sm == 1 else gg._SMEM_PER_SM // 2 - 1024
  per = 2 if cfg.k_pairs else 1  # K steps a stage holds
  while True:
    stage = per * (cfg.block_m * BLOCK_K + n_rhs * cfg.block_n * BLOCK_K + cfg.block_m * 4)
    nwg = 2 if cfg.warp_specialized else 1
    fixed = (cfg.block_m * cfg.block_n * 2
             + nwg * (4 * 128 * 4 + n_rhs * _padded_k_blocks(k) * 4) + 2048)
    if cfg.num_stages * stage + fixed <= limit or cfg.num_stages == 2:
      return cfg
    cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)


def _padded_k_blocks(k: int) -> int:
  """K/128 rounded up to 32: each weight-scale row is a whole number of 128 bytes, so every
  row's TMA lands on a 128-byte aligned SMEM address (H200: a 64-byte row offset faulted with
  a misaligned address)."""
  return -(-(k // BLOCK_K) // 32) * 32


def _build_block_kernel(*, m_pad, k, n_out, n_total, num_groups, out_dtype, cfg: BlockQ8Config,
                        gated, act, has_scale, has_bias, t_max, num_sms, interpret,
                        a_layout: str, quant_out: bool, w_block_n: int):
  """The fp8_block kernel. Inputs: meta [4, T], ntasks [1], lhs [m_pad, K] fp8, rhs
  [E, n_total, K] fp8, a_scale ("rows": [K/128, m_pad], the transpose of [M, K/128]; "tasks":
  [T, K/128, block_m], GEMM1's quantized output scales), w_scale [E, n_total/w_block_n, KBp]
  (K/128 padded to _padded_k_blocks),
  then row_scale [m_pad] and bias [E, n_total] when present. Outputs: [m_pad, n_out] out_dtype,
  or (fp8 [m_pad, n_out], scales [T, n_out/128, block_m]) with quant_out.
  Warp specialized (cfg.warp_specialized): a memory warpgroup feeds two compute warpgroups that
  each own block_m / 2 rows of the tile (the same B tiles), so one's promotion overlaps the
  other's wgmma."""
  bm, bn, bk = cfg.block_m, cfg.block_n, BLOCK_K
  ws_mode = cfg.warp_specialized
  nwg = 2 if ws_mode else 1
  tm = bm // nwg  # rows per compute warpgroup
  n_tiles = n_out // bn
  n_rhs = 2 if gated else 1
  per = 2 if cfg.k_pairs else 1  # K steps per pipeline step
  if cfg.k_pairs and (gated or (k // bk) % 2):
    raise ValueError(f"config.k_pairs=True needs an ungated GEMM with an even number of "
                     f"128-deep K steps; got {'a gated one' if gated else f'K={k}'}")
  k_iters = k // bk // per  # pipeline steps
  transforms = _compat.smem_transforms(bk, 1)
  _cast = _compat.layout_cast(interpret)
  ladder = gg.row_ladder(tm, m_pad)
  epi_dtype = jnp.float8_e4m3fn if quant_out else out_dtype
  shape = (tm, bn)
  nbar = 5  # per warpgroup: bias gate / up, row scale, weight-scale rows gate / up

  def in_specs():
    """lhs, its scales, then each B operand: `per` specs each (K step per * kk + h)."""
    def kb(h):
      return lambda kk: per * kk + h
    halves = range(per)
    specs = [plgpu.BlockSpec((bm, bk), lambda kk, h=h: (0, kb(h)(kk)), transforms=transforms)
             for h in halves]
    specs += [plgpu.BlockSpec((1, bm), lambda kk, h=h: (kb(h)(kk), 0)) for h in halves]
    if interpret:  # the interpreter has no transposed SMEM views: rhs arrives [E, K, N]
      return specs + [plgpu.BlockSpec((bk, bn), lambda kk, h=h: (kb(h)(kk), 0),
                                      transforms=_compat.smem_transforms(bn, 1))
                      for _ in range(n_rhs) for h in halves]
    return specs + [plgpu.BlockSpec((bn, bk), lambda kk, h=h: (0, kb(h)(kk)),
                                    transforms=transforms)
                    for _ in range(n_rhs) for h in halves]

  def body(meta_ref, ntask_ref, lhs_ref, rhs_ref, as_ref, ws_ref, *rest):
    rest = list(rest)
    scale_ref = rest.pop(0) if has_scale else None
    bias_ref = rest.pop(0) if has_bias else None
    out_ref = rest.pop(0)
    qs_ref = rest.pop(0) if quant_out else None
    epi_smem, vec_smem, ws_smem, bars = rest[:4]
    pipeline_allocs = rest[4] if ws_mode else None
    num_items = ntask_ref[0] * n_tiles

    def bar(wg, j):
      return bars.at[wg * nbar + j]

    def epilogue(totals, wg, e, task, row, lo, hi, ni):
      """totals: f32 (tm, bn) of this warpgroup's rows [row + wg * tm, + tm)."""
      c0 = ni * bn
      r0 = row + wg * tm
      vec, epi = vec_smem.at[wg], epi_smem.at[wg]
      if has_bias:
        for j in range(n_rhs):
          plgpu.copy_gmem_to_smem(bias_ref.at[e, pl.ds(j * n_out + c0, bn)], vec.at[j, :bn],
                                  bar(wg, j))
      if has_scale:
        plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(r0, tm)], vec.at[2, :tm], bar(wg, 2))
      vals = []
      for j, a in enumerate(totals):
        if has_bias:
          plgpu.barrier_wait(bar(wg, j))
          b = _cast(vec.at[j, :bn][...], plgpu.Layout.WGMMA.reduce(0))
          a = a + lax.broadcast_in_dim(b, shape, [1])
        vals.append(a)
      y = gg.kernel_activation(act, *vals) if act is not None else vals[0]
      if has_scale:
        plgpu.barrier_wait(bar(wg, 2))
        s_ = _cast(vec.at[2, :tm][...], plgpu.Layout.WGMMA.reduce(1))
        y = y * lax.broadcast_in_dim(s_, shape, [0])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores read SMEM
      if quant_out:  # per row of this 128-column group: scale = amax / 448, as the XLA path
        amax = jnp.max(jnp.abs(y), axis=1)
        qscale = jnp.where(amax > 0.0, amax / FP8_MAX, 1.0)
        q = y / lax.broadcast_in_dim(qscale, shape, [0])
        epi[...] = jnp.clip(q, -FP8_MAX, FP8_MAX).astype(epi_dtype)
        vec.at[3, :tm][...] = qscale
      else:
        epi[...] = y.astype(epi_dtype)
      plgpu.commit_smem()
      if quant_out:  # the task owns its [bm] slot: stored whole, rows outside [lo, hi) unused
        plgpu.copy_smem_to_gmem(vec.at[3, :tm], qs_ref.at[task, ni, pl.ds(wg * tm, tm)])
      gg.store_task_rows(epi, out_ref, tile_row=r0, lo=lo, hi=hi, tile_m=tm, ladder=ladder,
                         cols=pl.ds(c0, bn))

    def load_weight_scales(wg, e, wblk):
      """The item's weight scales, one per K step, into SMEM once (a global load per step
      would put its latency on every step's critical path).
      (Waiting for them in the first K step instead, to hide the copy under the first tiles'
      latency, made the warp-specialized GEMM1 spill: qwen3-30b-a3b 16384 tokens 810 -> 2041
      µs on an H200.)"""
      for j in range(n_rhs):
        plgpu.copy_gmem_to_smem(ws_ref.at[e, wblk[j]], ws_smem.at[wg, j], bar(wg, 3 + j))
      for j in range(n_rhs):
        plgpu.barrier_wait(bar(wg, 3 + j))

    def a_scales(s_smem, wg):
      return _cast(s_smem.at[0, pl.ds(wg * tm, tm)][...] if ws_mode else s_smem.at[0][...],
                   plgpu.Layout.WGMMA.reduce(1))

    def my_rows(a_smem, wg):  # this warpgroup's rows of the lhs tile
      return a_smem.at[pl.ds(wg * tm, tm)] if ws_mode else a_smem

    def b_operand(b):
      return b if interpret else plgpu.transpose_ref(b, (1, 0))

    def promoted(tot, part, factor):  # tot + part * a_scale[r, kb] * w_scale[e, n_blk, kb]
      return tot + part * lax.broadcast_in_dim(factor, shape, [0])

    def step(idx, *refs):
      """One K step of 128 (k_pairs: two): per B operand a fresh wgmma, promoted into the
      carried total."""
      *refs, totals = refs
      if per == 2:
        return pair_step(idx, *refs, totals)
      a_smem, s_smem, *b_smems = refs
      (kk,) = idx
      wg = lax.axis_index("wg") if ws_mode else 0

      a = my_rows(a_smem, wg)
      sa = a_scales(s_smem, wg)
      new = []
      for j, (b, tot) in enumerate(zip(b_smems, totals)):
        def mma(acc_ref, b_op=b_operand(b)):
          plgpu.wgmma(acc_ref, a, b_op)
          plgpu.wgmma_wait(0)
          return acc_ref[...]
        part = pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))
        new.append(promoted(tot, part, sa * ws_smem[wg, j, kk]))
      return tuple(new)

    def pair_step(idx, a0, a1, s0, s1, b0, b1, totals):
      """K steps 2 kk and 2 kk + 1 (ungated): both wgmmas issued, then the first promoted
      while the second runs."""
      (kk,) = idx
      wg = lax.axis_index("wg") if ws_mode else 0
      factors = [a_scales(s_, wg) * ws_smem[wg, 0, 2 * kk + h] for h, s_ in enumerate((s0, s1))]

      def mma(acc0, acc1):
        for acc, a, b in zip((acc0, acc1), (a0, a1), (b0, b1)):
          plgpu.wgmma(acc, my_rows(a, wg), b_operand(b))
        plgpu.wgmma_wait(1)  # the first is done; the second runs under its promotion
        tot = promoted(totals[0], acc0[...], factors[0])
        plgpu.wgmma_wait(0)
        return promoted(tot, acc1[...], factors[1])
      return (pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32)),)

    def zeros():
      return tuple(_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
                   for _ in range(n_rhs))

    def compute_item(e, task, row, lo, hi, ni):
      cols = [ni * bn + j * n_out for j in range(n_rhs)]
      if interpret:
        b_views = [rhs_ref.at[e, :, pl.ds(c, bn)] for c in cols]
      else:
        b_views = [rhs_ref.at[e, pl.ds(c, bn), :] for c in cols]
      wblk = [c // w_block_n for c in cols]
      a_view = as_ref.at[task] if a_layout == "tasks" else as_ref.at[:, pl.ds(row, bm)]
      gmem = (*[lhs_ref.at[pl.ds(row, bm), :]] * per, *[a_view] * per,
              *[b for b in b_views for _ in range(per)])
      if not ws_mode:
        load_weight_scales(0, e, wblk)
        totals = plgpu.emit_pipeline(step, grid=(k_iters,), in_specs=in_specs(),
                                     max_concurrent_steps=cfg.num_stages,
                                     init_carry=zeros())(*gmem)
        epilogue(totals, 0, e, task, row, lo, hi, ni)
        return

      def compute_context(eval_pipeline):
        wg = lax.axis_index("wg")
        load_weight_scales(wg, e, wblk)
        epilogue(eval_pipeline(zeros()), wg, e, task, row, lo, hi, ni)

      plgpu.emit_pipeline_warp_specialized(
          step, grid=(k_iters,), memory_registers=40, in_specs=in_specs(), wg_axis="wg",
          num_compute_wgs=2, max_concurrent_steps=cfg.num_stages,
          compute_context=compute_context)(*gmem, allocations=pipeline_allocs)

    gg.task_item_loop(meta_ref, num_items, n_tiles, m_pad, bm, compute_item)

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [plgpu.SMEM((nwg, tm, bn), epi_dtype), plgpu.SMEM((nwg, 4, 128), jnp.float32),
             plgpu.SMEM((nwg, n_rhs, _padded_k_blocks(k)), jnp.float32),
             plgpu.Barrier(num_arrivals=1, num_barriers=nbar * nwg)]
  extra = {}
  if ws_mode:  # the pipeline's SMEM, allocated once outside the item loop
    pipe = plgpu.emit_pipeline_warp_specialized(
        lambda *_: None, grid=(k_iters,), memory_registers=40, in_specs=in_specs(),
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=cfg.num_stages,
        compute_context=lambda *_: None)
    rhs_aval = jax.ShapeDtypeStruct((k, bn) if interpret else (bn, k), jnp.float8_e4m3fn)
    scratch.append(pipe.get_allocations(
        *[jax.ShapeDtypeStruct((bm, k), jnp.float8_e4m3fn)] * per,
        *[jax.ShapeDtypeStruct((k // bk, bm), jnp.float32)] * per,
        *([rhs_aval] * (n_rhs * per))))
    extra = dict(num_threads=3, thread_name="wg")
  out_type = jax.ShapeDtypeStruct((m_pad, n_out), epi_dtype)
  if quant_out:
    out_type = (out_type, jax.ShapeDtypeStruct((t_max, n_out // 128, bm), jnp.float32))
  return _compat.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=(num_sms * cfg.ctas_per_sm,),
      grid_names=("sm",),
      compiler_params=_compat.compiler_params(approx_math=True), interpret=interpret,
      name="jmoe_gg_fp8blk" + ("_gated" if gated else "") + ("_qout" if quant_out else "")
      + ("_2cta" if cfg.ctas_per_sm == 2 else "") + ("_ws" if ws_mode else "")
      + ("_kp" if cfg.k_pairs else ""), **extra)


def block_run(lhs, rhs, w_scale, a_scale, *, a_layout, meta, act, gated, bias=None,
              row_scale=None, out_dtype=jnp.bfloat16, quantize_output=False,
              config: BlockQ8Config, interpret=False):
  """The fp8_block kernel on kernel rows: lhs [m_pad, K] (m_pad = row_alloc(M, block_m), the
  rows meta was built for), a_scale as _build_block_kernel's a_layout. Returns the kernel's
  outputs (all m_pad rows; scales per task)."""
  m_pad, k = lhs.shape
  e, n_total, _ = rhs.shape
  n_out = n_total // 2 if gated else n_total
  w_block_n = n_total // w_scale.shape[1]
  meta_arr, ntasks = meta
  interp, nsm = _compat.launch_params(interpret)
  if interp is not None:
    rhs = jnp.swapaxes(rhs, 1, 2)  # the interpreter cannot simulate transposed SMEM views
  kern = _build_block_kernel(m_pad=m_pad, k=k, n_out=n_out, n_total=n_total, num_groups=e,
                             out_dtype=jnp.dtype(out_dtype), cfg=config, gated=gated, act=act,
                             has_scale=row_scale is not None, has_bias=bias is not None,
                             t_max=meta_arr.shape[-1], num_sms=nsm, interpret=interp,
                             a_layout=a_layout, quant_out=quantize_output, w_block_n=w_block_n)
  kb = w_scale.shape[2]
  ws = jnp.pad(w_scale.astype(jnp.float32), ((0, 0), (0, 0), (0, _padded_k_blocks(k) - kb)))
  args = [meta_arr, ntasks, lhs, rhs, a_scale.astype(jnp.float32), ws]
  if row_scale is not None:
    args.append(row_scale.astype(jnp.float32))
  if bias is not None:
    args.append(bias.astype(jnp.float32))
  return kern(*args)


def task_scales_to_rows(tiles: jax.Array, meta, m: int, m_pad: int, block_m: int) -> jax.Array:
  """Per-task scales [T, G, block_m] (quantize_output) -> row-major [m, G] (jmoe.quant's
  per-group layout); rows no task covers (past sum(group_sizes)) get 1."""
  meta_arr, ntasks = meta
  t_max = meta_arr.shape[-1]
  live = jnp.arange(t_max) < ntasks[0]
  lo = jnp.where(live, meta_arr[2], jnp.iinfo(jnp.int32).max)
  hi = jnp.where(live, meta_arr[3], 0)
  r = jnp.arange(m, dtype=jnp.int32)
  task = jnp.clip(jnp.searchsorted(lo, r, side="right") - 1, 0, t_max - 1)
  first = jnp.minimum(meta_arr[1], m_pad - block_m)[task]
  covered = (r >= lo[task]) & (r < hi[task])
  vals = tiles[task, :, jnp.clip(r - first, 0, block_m - 1)]  # [m, G]
  return jnp.where(covered[:, None], vals, 1.0)


def _check_block_scales(lhs, rhs, a_scale, w_scale):
  m, k = lhs.shape
  e, n_total, _ = rhs.shape
  if a_scale.shape != (m, k // BLOCK_K):
    raise ValueError(f"a_scale must be per-group [M, K/128] = {(m, k // BLOCK_K)}, got "
                     f"{a_scale.shape}")
  if (w_scale.ndim != 3 or w_scale.shape[0] != e or w_scale.shape[2] != k // BLOCK_K
      or n_total % w_scale.shape[1] or (n_total // w_scale.shape[1]) % 128):
    raise ValueError(f"w_scale must be 128 x 128 block scales [E, N/128, K/128] = "
                     f"{(e, n_total // 128, k // BLOCK_K)}, got {w_scale.shape}")


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "config", "interpret",
                                             "quantize_output"))
def grouped_gemm_fp8_block(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                           a_scale: jax.Array, w_scale: jax.Array, *,
                           activation: Activation | str | None = None,
                           bias: jax.Array | None = None, row_scale: jax.Array | None = None,
                           out_dtype=jnp.bfloat16, quantize_output: bool = False,
                           config: BlockQ8Config | None = None, interpret: Any = False):
  """fp8_block grouped GEMM: 128 x 128 weight blocks, 1 x 128 activation groups.

  acc[r] = sum_kb (lhs[r, kb] @ rhs[g(r), :, kb]^T) * a_scale[r, kb] * w_scale[g(r), n_blk, kb]
  (each 128-deep K step promoted into an f32 total), then out[r] = act(acc[r] + bias[g(r)]) *
  row_scale[r]. lhs [M, K] fp8 e4m3, rhs [E, N_total, K] fp8 (K-major), a_scale [M, K/128],
  w_scale [E, N_total/128, K/128] (QuantizedWeights.scale), bias [E, N_total], row_scale [M].
  quantize_output: return (q [M, N_out] fp8, q_scale [M, N_out/128] f32) with act's output
  quantized per row per 128 columns in the epilogue (GEMM2's input); else [M, N_out]
  out_dtype. Rows past sum(group_sizes) are unwritten (their q_scale is 1).
  """
  _check_q8_operands(lhs, rhs, group_sizes)
  if jnp.dtype(lhs.dtype) != jnp.dtype(jnp.float8_e4m3fn):
    raise ValueError(f"lhs: fp8_block takes float8_e4m3fn operands, got {lhs.dtype}")
  _check_block_scales(lhs, rhs, a_scale, w_scale)
  m, k = lhs.shape
  e, n_total, _ = rhs.shape
  act, gated, n_out = _gate(activation, n_total)
  _check_epilogue(m, e, n_total, n_out, bias, row_scale)
  if quantize_output and n_out % 128:
    raise ValueError(f"quantize_output needs N_out={n_out} to be a multiple of 128")
  if config is None:
    config = block_config(m, n_out, k, e, gated=gated, quantize_output=quantize_output)
  if quantize_output and config.block_n != 128:
    raise ValueError("quantize_output needs config.block_n == 128 (one scale group per tile)")
  if n_out % config.block_n:
    config = dataclasses.replace(config, block_n=64)
  config = fit_block_stages(config, 2 if gated else 1, k)
  bm = config.block_m
  m_pad = gg.row_alloc(m, bm)
  pad = lambda x: x if m_pad == m else jnp.pad(x, ((0, m_pad - m),) + ((0, 0),) * (x.ndim - 1))
  meta = gg.tile_metadata(group_sizes, m, bm)
  rs = None if row_scale is None else pad(row_scale.astype(jnp.float32))
  out = block_run(pad(lhs), rhs, w_scale, pad(a_scale.astype(jnp.float32)).T, a_layout="rows",
                  meta=meta, act=act, gated=gated, bias=bias, row_scale=rs, out_dtype=out_dtype,
                  quantize_output=quantize_output, config=config, interpret=interpret)
  if not quantize_output:
    return out[:m]
  q, tiles = out
  return q[:m], task_scales_to_rows(tiles, meta, m, m_pad, bm)
