"""Contiguous grouped GEMM for Hopper in Pallas Mosaic GPU (wgmma + TMA + multi-stage pipeline).

    out[r, :] = epilogue(lhs[r, :] @ rhs[g(r)])     for r < sum(group_sizes)

where the rows of ``lhs`` are sorted by group: group g owns rows
``[sum(group_sizes[:g]), sum(group_sizes[:g+1]))``.

Epilogue order (f32): ``y = act(acc + bias[g]) * row_scale[r]`` (gated:
``y = act(acc_gate + bias_gate[g], acc_up + bias_up[g]) * row_scale[r]``), cast to ``out_dtype``.
With no activation this is ``(acc + bias[g]) * row_scale[r]``: vLLM's GEMM2, where the down-proj
bias is part of the expert output and the router weight multiplies the whole expert output.

Rows ``r >= sum(group_sizes)`` (and every row when the sum is 0) are NOT written: their content is
unspecified. If ``sum(group_sizes) > M`` only the first M rows are computed.

Schedule: the (group, row tile) work list is built on device with jnp (no host sync). Row tiles
are aligned to their group's first row, so a group of s rows is exactly cdiv(s, block_m) tasks
and no tile straddles a group boundary; each task stores only its own rows (power-of-two TMA
stores, so a neighbour group's rows are never overwritten). Groups with zero rows produce no
task, so their weights are never read: at decode only touched experts' weights are streamed. A
persistent grid (one CTA per SM) walks the dynamic number of (task, column-tile) work items.

8-bit mode (_run's a_scale / w_scale; entry point jmoe.kernels.grouped_gemm_q8.grouped_gemm_q8):
fp8 e4m3 / int8 lhs and K-major rhs (rhs_t, the only B layout 8-bit wgmma takes), block_k 128
(one 128-byte swizzle), an s32 accumulator for int8, and the accumulator's row / column scales
applied before bias and activation. The same schedules; only the element type and the
epilogue's two vectors differ.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jmoe.kernels import _compat
from jmoe.kernels.activations import Activation, as_activation

log = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SMEM_BYTES = 232448 - 1024  # max dynamic SMEM per CTA on sm_90 (as Mosaic GPU reports it)
_SMEM_PER_SM = 233472  # sm_90: shared memory of one SM (1 KiB of it reserved per CTA)


# ============================================================================ config


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
  """Block configuration.

  block_m: CTA rows (64 or 128; per compute warpgroup 64 or 128 rows).
  block_n: CTA output columns (for the gated kernel: output columns, each with its gate and its up
    column, so the kernel reads 2*block_n weight columns).
  block_k: K step per pipeline stage (multiple of 16; 64 gives 128-byte swizzle for 16-bit types).
  num_stages: pipeline depth (TMA stages in flight).
  warp_specialized: 1 TMA warpgroup + 2 compute warpgroups (True) or one warpgroup doing both.
  wg_split: how the 2 compute warpgroups split the CTA tile: "n" (each block_m x block_n/2) or
    "m" (each block_m/2 x block_n). Ignored when not warp specialized.
  grid_minor: "n": consecutive work items walk the column tiles of one row tile (lhs reuse);
    "m": they walk row tiles within a band of ``grid_tile_width`` column tiles (weight reuse in L2).
  grid_tile_width: band width for grid_minor="m".
  ctas_per_sm: 2 runs two CTAs per SM, each with half the shared memory (stages refitted), so
    one CTA's pipeline fill and epilogue hide behind the other's loads (short contractions,
    decode). One warpgroup only (two warp-specialized CTAs would not fit the registers).
  cross_item: the next work item's first tiles load while the current one finishes and
    stores: no pipeline fill per item. One warpgroup: one software pipeline over all of a
    CTA's (item, K step) pairs. Warp specialized: the items' pipelines are chained (Pallas'
    pipeline_state START / STEADY / STOP), so the memory warpgroup runs ahead into the next
    item; this needs the K steps to be a multiple of the stages (stages are lowered to a
    divisor, else the items run unchained). The decode slot-task path keeps the per-item loop
    (a skipped slot must not load weights). H200 (benchmarks/check_cross_item.py): correct;
    GEMM2 5-8 % faster than per-item (qwen3 1024 tokens, ws 128x256: 123.6 -> 117.5 µs, now
    in the tuned table), the gated GEMM1 slower (ws 128x128: 207.5 -> 221.8).
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_stages: int = 4
  warp_specialized: bool = True
  wg_split: str = "n"
  grid_minor: str = "n"
  grid_tile_width: int = 1
  ctas_per_sm: int = 1
  cross_item: bool = False

  def __post_init__(self):
    if self.ctas_per_sm not in (1, 2):
      raise ValueError(f"ctas_per_sm={self.ctas_per_sm} must be 1 or 2")
    if self.ctas_per_sm == 2 and self.warp_specialized:
      raise ValueError("ctas_per_sm=2 needs warp_specialized=False (registers)")
    if self.block_m not in (64, 128, 256):
      raise ValueError(f"block_m={self.block_m} must be 64, 128 or 256")
    if self.block_n % 64 or self.block_n <= 0:
      raise ValueError(f"block_n={self.block_n} must be a positive multiple of 64")
    if self.block_k % 16 or self.block_k <= 0:
      raise ValueError(f"block_k={self.block_k} must be a positive multiple of 16")
    if self.num_stages < 2:
      raise ValueError(f"num_stages={self.num_stages} must be >= 2")
    if self.wg_split not in ("m", "n"):
      raise ValueError(f"wg_split={self.wg_split!r} must be 'm' or 'n'")
    if self.grid_minor not in ("m", "n"):
      raise ValueError(f"grid_minor={self.grid_minor!r} must be 'm' or 'n'")
    if self.grid_tile_width < 1:
      raise ValueError("grid_tile_width must be >= 1")
    if self.warp_specialized and self.wg_split == "n" and self.block_n % 128:
      raise ValueError(f"wg_split='n' needs block_n % 128 == 0 (got {self.block_n})")
    if self.warp_specialized and self.wg_split == "m" and self.block_m < 128:
      raise ValueError(f"wg_split='m' needs block_m >= 128 (got {self.block_m})")

  def wg_tile(self) -> tuple[int, int, int]:
    """(number of compute warpgroups, rows per warpgroup, cols per warpgroup)."""
    if not self.warp_specialized:
      return 1, self.block_m, self.block_n
    if self.wg_split == "m":
      return 2, self.block_m // 2, self.block_n
    return 2, self.block_m, self.block_n // 2

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def _smem_bytes(cfg: GroupedGemmConfig, itemsize: int, out_itemsize: int, n_rhs: int,
                n_epi: int = 1) -> int:
  """n_epi: output tiles staged per warpgroup in the epilogue (2-3 with a second output)."""
  stage = (cfg.block_m * cfg.block_k + n_rhs * cfg.block_k * cfg.block_n) * itemsize
  nwg, tm, tn = cfg.wg_tile()
  out = n_epi * nwg * tm * tn * out_itemsize
  vec = nwg * (tm + 2 * tn) * 4 + 1024
  return cfg.num_stages * stage + out + vec


def _smem_limit(cfg: GroupedGemmConfig) -> int:
  """Shared memory one CTA may use: all of it, or its share when two CTAs share an SM."""
  return _SMEM_BYTES if cfg.ctas_per_sm == 1 else _SMEM_PER_SM // 2 - 1024


def _fit_stages(cfg: GroupedGemmConfig, itemsize, out_itemsize, n_rhs,
                n_epi: int = 1) -> GroupedGemmConfig:
  while (cfg.num_stages > 2
         and _smem_bytes(cfg, itemsize, out_itemsize, n_rhs, n_epi) > _smem_limit(cfg)):
    cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
  return cfg


def _fit_smem(cfg: GroupedGemmConfig, itemsize, out_itemsize, n_rhs,
              n_epi: int) -> GroupedGemmConfig:
  """_fit_stages, then, for epilogues that stage extra tiles (n_epi > 1) and still overflow at
  two stages: halve block_k (down to 32), then leave warp specialization (tiles <= 128 x 128),
  then halve the tile."""
  fitted = _fit_stages(cfg, itemsize, out_itemsize, n_rhs, n_epi)
  while _smem_bytes(fitted, itemsize, out_itemsize, n_rhs, n_epi) > _smem_limit(fitted):
    c = fitted
    if c.block_k > 32:
      c = dataclasses.replace(c, block_k=c.block_k // 2, num_stages=cfg.num_stages)
    elif c.warp_specialized:
      c = dataclasses.replace(c, warp_specialized=False, block_m=min(c.block_m, 128),
                              block_n=min(c.block_n, 128), num_stages=cfg.num_stages)
    elif c.block_n > 64:
      c = dataclasses.replace(c, block_n=c.block_n // 2, num_stages=cfg.num_stages)
    elif c.block_m > 64:
      c = dataclasses.replace(c, block_m=c.block_m // 2, num_stages=cfg.num_stages)
    else:
      raise ValueError(f"grouped_gemm: no tile of {cfg} fits shared memory with {n_epi} "
                       "staged epilogue tiles")
    fitted = _fit_stages(c, itemsize, out_itemsize, n_rhs, n_epi)
  if fitted != cfg:
    log.debug("grouped_gemm: config %s fitted to shared memory as %s", cfg, fitted)
  return fitted


_CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


@functools.lru_cache(maxsize=None)
def _load_tuned(kernel_name: str) -> dict:
  path = os.path.join(_CONFIG_DIR, f"{kernel_name}.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _tuned_key(E, N, K, dtype, device_kind, m_bucket, jax_version=None) -> str:
  """Key of a tuned entry; configs are tuned per jax minor version (lowering changes between).
  dtype: the operands' dtype, or a format label (str) for kernels that convert codes."""
  jv = jax_version or ".".join(str(v) for v in _compat.JAX_VERSION[:2])
  dt = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
  return f"E={E},N={N},K={K},dtype={dt},device={device_kind},jax={jv},M<={m_bucket}"


# decode: a bucket per power of two up to 64 slots. The best tile width depends on how many
# experts are touched (H200: mixtral's 4-token GEMM2 config, 256 columns, doubles its 1-token time)
_M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 16384, 65536, 1 << 30)


def _m_bucket(m: int) -> int:
  for b in _M_BUCKETS:
    if m <= b:
      return b
  return _M_BUCKETS[-1]


_NUM_SMS = 132  # H100 / H200 SXM
# the heuristic's narrowest acceptable wave fill: H200, qwen3 at 8 tokens (2026-11-30): GEMM2's
# 64x256 tiles (0.76 of their last wave's worth) lost 5 µs to 64x128 ones (0.87)
_MIN_WAVE_EFFICIENCY = 0.8


def expected_groups(m: int, num_groups: int) -> float:
  """Experts expected to get any of m rows routed uniformly at random over num_groups (the
  heuristic's count of weight streams; at 64 slots of 128 experts about 50, not 64)."""
  e = max(1, num_groups)
  return max(1.0, min(float(m), e * -math.expm1(m * math.log1p(-1.0 / e)) if e > 1 else 1.0))


def _fills_waves(items: float, nsm: int = _NUM_SMS) -> bool:
  """Every SM gets an item, and the last wave is not mostly idle (138 items on 132 SMs fill
  their 2 waves to 0.52)."""
  return items >= nsm and items / (math.ceil(items / nsm) * nsm) >= _MIN_WAVE_EFFICIENCY


def heuristic_config(m: int, n: int, k: int, num_groups: int, dtype, *, gated: bool = False,
                     out_dtype=None) -> GroupedGemmConfig:
  """Shape-aware default. m = rows of lhs, n = output columns, k = contraction."""
  itemsize = jnp.dtype(dtype).itemsize
  out_itemsize = jnp.dtype(out_dtype or dtype).itemsize
  block_k = 64
  while k % block_k and block_k > 16:
    block_k //= 2
  touched = expected_groups(m, num_groups)
  rows_per_group = m / touched
  if rows_per_group <= 64:
    # Weight streaming: each touched expert's weights should stream once per column tile, so a
    # group's rows should fit in one row tile (tiles are group-aligned); then the widest column
    # tile whose items fill the SMs' waves. H200 sweep at 1024 tokens (2026-11-29): qwen3 (64
    # rows / expert) best at block_m 128 (GEMM1 128x128, GEMM2 128x256), deepseek-v3 (32 rows /
    # expert) at 64x256 for both GEMMs. At 8 tokens of qwen3 (~46 experts touched, 2026-11-30)
    # GEMM1's 64x256 tiles (138 items: 2 waves for 1.05 of work) took 108 µs, 64x64 88 µs.
    bm = 128 if rows_per_group > 48 else 64
    widths = (128,) if (gated and bm == 128) else (256, 128)  # gated 128x256: too many registers
    bn = next((w for w in widths if n % w == 0 and _fills_waves(touched * (n // w))), 64)
    if bn == 64:  # few column tiles per expert (decode): one warpgroup, deep K pipeline
      cfg = GroupedGemmConfig(block_m=64, block_n=64, block_k=128 if k % 128 == 0 else block_k,
                              num_stages=6, warp_specialized=False)
    elif bm == 64 and bn == 128:
      cfg = GroupedGemmConfig(block_m=64, block_n=128, block_k=128 if k % 128 == 0 else block_k,
                              num_stages=6, wg_split="n")
    else:
      cfg = GroupedGemmConfig(block_m=bm, block_n=bn, block_k=block_k, num_stages=4,
                              wg_split="n")
  else:
    if n < 128:
      cfg = GroupedGemmConfig(block_m=128, block_n=64, block_k=block_k, num_stages=4,
                              warp_specialized=True, wg_split="m")
    elif gated:
      # H200 sweep (2026-11-29): split "m", walk row tiles in bands of 4 column tiles when the
      # column tiles divide into bands (mixtral, deepseek), else column-minor (qwen3, N=768).
      minor = "m" if pl.cdiv(n, 128) % 4 == 0 else "n"
      cfg = GroupedGemmConfig(block_m=128, block_n=128, block_k=block_k, num_stages=4,
                              warp_specialized=True, wg_split="m", grid_minor=minor,
                              grid_tile_width=4 if minor == "m" else 1)
    else:
      # H200 sweep: 128x256 CTA tiles, column-minor walk was best on all three presets.
      cfg = GroupedGemmConfig(block_m=128, block_n=256 if n >= 256 else 128, block_k=block_k,
                              num_stages=4, warp_specialized=True, wg_split="n", grid_minor="n")
  return _fit_stages(cfg, itemsize, out_itemsize, 2 if gated else 1)


_NEAREST_FROM = 4096  # rows from which a bucket without an entry takes its nearest neighbour's


def tuned_config(kernel_name: str, cls, m: int, n: int, k: int, num_groups: int, dtype, *,
                 nearest: bool = False):
  """The `cls` config tuned for this problem in pallas_kernels/configs/<kernel_name>.json, or
  None. Keys: E, N, K, dtype, device kind, jax minor version, M bucket; fields of the entry
  that `cls` does not know (``us``, ``note``) are dropped. nearest: from _NEAREST_FROM rows,
  a bucket without an entry takes the entry of the nearest bucket (in log M, the smaller on a
  tie) from _NEAREST_FROM up, of the same E, N, K, dtype, device and jax."""
  table = _load_tuned(kernel_name)
  dev = _compat.device_kind()
  bucket = _m_bucket(m)
  key = _tuned_key(num_groups, n, k, dtype, dev, bucket)
  entry = table.get(key)
  if entry is None and nearest and m > _NEAREST_FROM:
    have = [b for b in _M_BUCKETS if b >= _NEAREST_FROM
            and _tuned_key(num_groups, n, k, dtype, dev, b) in table]
    if have:
      b = min(have, key=lambda b_: (abs(math.log(b_ / bucket)), b_))
      key = _tuned_key(num_groups, n, k, dtype, dev, b)
      entry = table[key]
  log.debug("%s: %s config for %s", kernel_name, "tuned" if entry else "no tuned", key)
  if entry is None:
    return None
  fields = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k_: v for k_, v in entry.items() if k_ in fields})


def get_config(kernel_name: str, m: int, n: int, k: int, num_groups: int, dtype, *,
               gated: bool = False, out_dtype=None) -> GroupedGemmConfig:
  """Tuned config from jmoe.kernels/configs/<kernel>.json if one matches, else the heuristic."""
  cfg = tuned_config(kernel_name, GroupedGemmConfig, m, n, k, num_groups, dtype)
  if cfg is None:
    cfg = heuristic_config(m, n, k, num_groups, dtype, gated=gated, out_dtype=out_dtype)
    log.debug("grouped_gemm: heuristic %s", cfg)
  return cfg


def kernel_config(kernel_name: str, m: int, n_out: int, k: int, num_groups: int, dtype, *,
                  config: GroupedGemmConfig | None = None, gated: bool = False, out_dtype=None,
                  rhs_t: bool = False, act_grad: Activation | None = None,
                  store_preact: bool = False) -> GroupedGemmConfig:
  """The config a kernel call runs with: `config` or the table's / heuristic's (transposed-rhs
  GEMMs, the backward's d lhs, read the ``<kernel_name>_rt`` table), adapted to K and N and
  fitted to shared memory for its epilogue. Callers that build the tile work list themselves
  (meta) build it for this config's block_m."""
  out_dtype = jnp.dtype(out_dtype or dtype)
  if config is None:
    config = get_config(kernel_name + ("_rt" if rhs_t else ""), m, n_out, k, num_groups, dtype,
                        gated=gated, out_dtype=out_dtype)
  cfg = _adapt_config(config, k, n_out)
  return _fit_smem(cfg, jnp.dtype(dtype).itemsize, out_dtype.itemsize, 2 if gated else 1,
                   epilogue_tiles(act_grad, store_preact))


# ============================================================================ metadata


def row_ladder(tile_m: int, m_pad: int) -> list[int]:
  """The power-of-two row counts a tile's store is cut into (the largest <= min(tile_m,
  m_pad), then halves down to 1): a task's rows [lo, hi) go out as at most one TMA store of
  each, so no row of another task's is written."""
  ladder, r = [], min(tile_m, m_pad)
  while r > 0:
    ladder.append(1 << int(math.log2(r)))
    r //= 2
  return ladder


# saturation bounds of the 8-bit outputs (the largest finite e4m3; int8's symmetric range)
_OUT_8BIT_MAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.int8): 127.0}


def to_out_dtype(v: jax.Array, out_dtype) -> jax.Array:
  """An epilogue's f32 tile in `out_dtype`. 8-bit outputs (GEMM1 writing GEMM2's quantized
  input under a static scale) saturate as jmoe.quant.quantize_activations does: e4m3 clamps
  to +-448 (never NaN), int8 rounds to nearest even, then clamps to +-127."""
  dt = jnp.dtype(out_dtype)
  qmax = _OUT_8BIT_MAX.get(dt)
  if qmax is None:
    return v.astype(dt)
  if jnp.issubdtype(dt, jnp.integer):
    v = jnp.round(v)
  return jnp.clip(v, -qmax, qmax).astype(dt)


def store_task_rows(src, dst, *, tile_row, lo, hi, tile_m: int, ladder: list[int],
                    cols) -> None:
  """TMA-stores the rows of the SMEM tile src [tile_m, C] (tile rows tile_row..) that lie in
  the task's [lo, hi) to dst[rows, cols] (cols: a pl.ds of C columns), one store per ladder
  step present in the row count."""
  start = jnp.maximum(lo - tile_row, 0)
  size = jnp.maximum(jnp.minimum(hi, tile_row + tile_m) - jnp.maximum(lo, tile_row), 0)
  for rows in ladder:
    @pl.when((size & rows) != 0)
    def _store():
      plgpu.copy_smem_to_gmem(src.at[pl.ds(start, rows)],
                              dst.at[pl.ds(tile_row + start, rows), cols])
    start = start + (size & rows)


def task_item_loop(meta_ref, num_items, n_tiles: int, m_pad: int, tile_m: int,
                   compute_item) -> None:
  """The persistent kernels' work loop over items (task, column tile) of a `tile_metadata`
  list, spread over the grid's "sm" axis: compute_item(expert, task, first tile row, first
  row, end row, column tile), the tile row shifted back inside m_pad rows."""
  @plgpu.nd_loop((num_items,), collective_axes="sm")
  def _loop(info):
    (lin,) = info.index
    task, ni = lax.div(lin, jnp.int32(n_tiles)), lax.rem(lin, jnp.int32(n_tiles))
    e = meta_ref[0, task]
    row = pl.multiple_of(jnp.minimum(meta_ref[1, task], m_pad - tile_m), 8)
    compute_item(e, task, row, meta_ref[2, task], meta_ref[3, task], ni)


def tile_metadata(group_sizes: jax.Array, m: int, block_m: int):
  """Work list of (group, row tile) tasks computed on device.

  Returns (meta int32[4, T], num_tasks int32[1]) with T = cdiv(m, block_m) + G - 1 (a static
  upper bound); column t < num_tasks of meta is (group, first row of the tile, first row, end
  row) of task t. Groups with zero rows produce no task. Rows past m are dropped (group sizes
  are clipped to m in total). See :func:`tile_metadata_from_bounds` for the tiling.
  """
  gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  g = gs.shape[0]
  ends = jnp.minimum(jnp.cumsum(gs), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return tile_metadata_from_bounds(starts, ends, block_m, pl.cdiv(m, block_m) + g - 1)


def tile_metadata_from_bounds(starts: jax.Array, ends: jax.Array, block_m: int, t_max: int):
  """Like tile_metadata for groups at arbitrary row ranges [starts[g], ends[g]) (increasing,
  non-overlapping); t_max must bound the number of tasks.

  Tiles are aligned to their group, not to a global block_m grid: group g's tiles start at
  base = starts[g] rounded down to a multiple of 8 (TMA reads of the swizzled lhs tiles start on
  8-row boundaries) and step by block_m; a task stores rows [max(starts[g], tile),
  min(ends[g], tile + block_m)). So a group of s rows costs cdiv(s + starts[g] % 8, block_m)
  tasks, never more than a global grid's, and streams its weights that many times per column
  tile (a global grid adds a task, and a weight pass, for every group boundary inside a tile:
  at 64 rows per expert that doubles the weight traffic). A tile may reach past the array end;
  the kernel shifts it back (its rows stay inside) and stores only [lo, hi).
  """
  rows, num_tasks = tile_rows(starts.astype(jnp.int32), ends.astype(jnp.int32), block_m,
                              jnp.arange(t_max, dtype=jnp.int32))
  return jnp.stack(rows), num_tasks.reshape(1)


def tile_rows(starts: jax.Array, ends: jax.Array, block_m: int, t: jax.Array):
  """Entries t [n] of tile_metadata_from_bounds' work list: ([group, tile, lo, hi] int32 [n]
  each, num_tasks scalar); entries at and past num_tasks are zero. starts / ends int32 [G].
  Only compare-reduces and one-hot picks (no gathers), so the routing kernels (Pallas on the
  Triton lowering) build their tile lists with this same function."""
  ends = jnp.maximum(ends, starts)
  g = starts.shape[0]
  base = starts - lax.rem(starts, 8)
  ntiles = jnp.where(ends > starts, (ends - base + block_m - 1) // block_m, 0)
  tile_end = jnp.cumsum(ntiles)
  tile_start = tile_end - ntiles
  # group of task t = number of groups whose tasks all end at or before t (compare-sum: fuses)
  e = jnp.minimum(jnp.sum((tile_end[None, :] <= t[:, None]).astype(jnp.int32), axis=1), g - 1)
  onehot = lax.broadcasted_iota(jnp.int32, (t.shape[0], g), 1) == e[:, None]
  pick = lambda v: jnp.sum(jnp.where(onehot, v[None, :], 0), axis=1)
  tile = pick(base) + (t - pick(tile_start)) * block_m
  lo = jnp.maximum(pick(starts), tile)
  hi = jnp.minimum(pick(ends), tile + block_m)
  num_tasks = jnp.sum(ntiles)
  valid = t < num_tasks
  return [jnp.where(valid, v, 0) for v in (e, tile, lo, hi)], num_tasks


# ============================================================================ in-kernel activations
# Same functions as jmoe.kernels.activations (which the tests check against), written with
# primitives Mosaic GPU lowers (no lax.logistic): sigmoid(x) = 1 / (1 + exp(-x)).


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _erf(x):
  """erf with |error| < 1.5e-7 (Abramowitz & Stegun 7.1.26): Mosaic GPU has no layout rule for
  math.erf, so the kernels build it from exp."""
  a = jnp.maximum(x, -x)
  t = 1.0 / (1.0 + 0.3275911 * a)
  poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
                                                                        + t * 1.061405429))))
  r = 1.0 - poly * jnp.exp(-(a * a))
  return jnp.where(x < 0.0, -r, r)


def _act_single(name: str, x):
  if name in ("silu", "silu_no_mul"):
    return x * _sigmoid(x)
  if name in ("gelu", "gelu_no_mul"):
    return 0.5 * x * (1.0 + _erf(x * 0.7071067811865476))
  if name == "gelu_tanh":
    c = 0.7978845608028654
    return 0.5 * x * (1.0 + jnp.tanh(c * (x + 0.044715 * (x * x * x))))
  if name == "relu2_no_mul":
    r = jnp.maximum(x, 0.0)
    return r * r
  raise ValueError(f"activation {name!r} has no single-input form")


def kernel_activation(act: Activation, gate, up=None):
  """f32 activation as computed inside the kernels (gated when ``up`` is given)."""
  if up is None:
    return _act_single(act.name, gate)
  if act.name == "swigluoai":
    g = jnp.minimum(gate, act.limit)
    u = jnp.minimum(jnp.maximum(up, -act.limit), act.limit)
    return g * _sigmoid(act.alpha * g) * (u + 1.0)
  return _act_single(act.name, gate) * up


def _act_single_grad(name: str, x):
  """d act(x) / d x, written out (jax.vjp's add_any has no Mosaic GPU lowering)."""
  if name in ("silu", "silu_no_mul"):
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))
  if name in ("gelu", "gelu_no_mul"):
    return (0.5 * (1.0 + _erf(x * 0.7071067811865476))
            + x * jnp.exp(-0.5 * x * x) * 0.3989422804014327)
  if name == "gelu_tanh":
    c = 0.7978845608028654
    t = jnp.tanh(c * (x + 0.044715 * (x * x * x)))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 0.134145 * (x * x))
  if name == "relu2_no_mul":
    return 2.0 * jnp.maximum(x, 0.0)
  raise ValueError(f"activation {name!r} has no single-input form")


def kernel_activation_vjp(act: Activation, dy, gate, up=None):
  """The activation's VJP at (gate[, up]) applied to dy, as the kernels compute it (f32):
  [d gate] or [d gate, d up]. Clamps (swigluoai) pass no gradient where they clip."""
  if up is None:
    return [dy * _act_single_grad(act.name, gate)]
  if act.name == "swigluoai":
    g = jnp.minimum(gate, act.limit)
    u = jnp.minimum(jnp.maximum(up, -act.limit), act.limit)
    s = _sigmoid(act.alpha * g)
    dg = dy * (u + 1.0) * s * (1.0 + act.alpha * g * (1.0 - s))
    du = dy * g * s
    zero = jnp.zeros_like(dy)
    return [jnp.where(gate < act.limit, dg, zero),
            jnp.where((up > -act.limit) & (up < act.limit), du, zero)]
  return [dy * up * _act_single_grad(act.name, gate), dy * _act_single(act.name, gate)]


# ============================================================================ kernel


_BARS_PER_WG = 5  # epilogue barriers per warpgroup: bias gate / up, row scale, h gate / up
_QBARS = 3  # 8-bit mode: the accumulator's row scale, its column scales gate / up


def epilogue_tiles(act_grad: Activation | None, store_preact: bool) -> int:
  """Output tiles each warpgroup stages in SMEM: 1, the act_grad's h tiles (1-2, reused for its
  outputs), or activated + gate + up (store_preact)."""
  if act_grad is not None:
    return 2 if act_grad.is_gated else 1
  return 3 if store_preact else 1


def _load_wgmma(ref, interpret):
  """An SMEM tile into registers in the wgmma accumulator's layout (plain ref read in interpret
  mode, which has no layouts)."""
  if interpret:
    return ref[...]
  return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA, optimized=False)


class _ChainState:
  """Pallas' `pipeline_state` of item i of a CTA's n chained pipelines, as the pipeline reads
  it (`state == START` gates the prologue loads, `state == STOP` the final drain): traced
  booleans, so a lone item can be both START and STOP, which no single enum value is."""

  def __init__(self, i, n):
    self.first, self.last = i == 0, i == n - 1

  def __eq__(self, other):
    states = plgpu.PipelinePipeline
    if other == states.START:
      return self.first
    if other == states.STOP:
      return self.last
    if other == states.STEADY:
      return ~(self.first | self.last)
    return NotImplemented

  __hash__ = None


def _build_kernel(*, m_pad, k, n_out, n_total, num_groups, dtype, out_dtype, cfg: GroupedGemmConfig,
                  gated: bool, act: Activation | None, has_scale: bool, has_bias: bool,
                  t_max: int, num_sms: int, interpret, rhs_t: bool = False,
                  slot_tasks: int = 0, act_grad: Activation | None = None,
                  store_preact: bool = False, has_qscale: bool = False):
  """rhs_t: rhs is stored [E, N, K] and read through transposed SMEM views (wgmma takes a
  transposed B operand for 16-bit types), so the backward's d lhs = dout @ rhs^T needs no
  transposed copy of the weights. slot_tasks (decode): meta is [slot_tasks] expert ids, one
  task per row s (rows [s, s + 1), tile from s rounded down to 8); a slot whose expert is
  outside [0, E) (empty, EP-remote) is skipped. No task list to build, nothing to compact.
  act_grad (training backward): the kernel also reads h [m_pad, n_h * n_out], the activation's
  input (gate and up blocks when gated, n_h = 2), and writes the activation's VJP at the product
  d a instead of d a: [m_pad, n_h * n_out]. Each item's h tiles load by TMA while its K loop
  runs. store_preact (training forward, gated): a second output [m_pad, 2 * n_out] holds the
  activation's input (gate | up, bias added) next to the activated [m_pad, n_out].
  has_qscale (8-bit mode, fp8 / int8 operands, rhs_t): two more inputs after bias, the
  accumulator's row scale a_scale [m_pad] f32 and column scale w_scale [E, n_total] f32,
  applied to the f32 (int8: s32) accumulator before bias and activation."""
  nwg, tile_m, tile_n = cfg.wg_tile()
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  k_iters = pl.cdiv(k, bk)
  n_tiles = pl.cdiv(n_out, bn)
  itemsize = jnp.dtype(dtype).itemsize
  transforms = _compat.smem_transforms(bk, itemsize)
  # a [bk, bn] B tile's swizzle spans bn: 8-bit types meet that layout only in interpret mode
  # (rhs_t is swapped there), where 128 elements of swizzle would not tile bn = 64
  b_transforms = transforms if itemsize > 1 else _compat.smem_transforms(min(bk, bn), itemsize)
  ladder = row_ladder(tile_m, m_pad)
  n_rhs = 2 if gated else 1
  n_h = 0 if act_grad is None else (2 if act_grad.is_gated else 1)
  n_epi = epilogue_tiles(act_grad, store_preact)
  # int8 x int8 accumulates exactly in s32 (wgmma's only integer accumulator)
  acc_dtype = jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32
  bars_per_wg = _BARS_PER_WG + (_QBARS if has_qscale else 0)
  num_ctas = num_sms * cfg.ctas_per_sm
  cross_item = cfg.cross_item and not slot_tasks  # a skipped slot must not load weights
  stages = cfg.num_stages
  if cross_item and cfg.warp_specialized:  # chained pipelines: K steps a multiple of stages
    stages = next((s for s in range(stages, 1, -1) if k_iters % s == 0), 0)
    cross_item = stages > 0
    stages = stages or cfg.num_stages
  _cast = _compat.layout_cast(interpret)
  width = cfg.grid_tile_width if n_tiles % cfg.grid_tile_width == 0 else 1

  def rhs_spec(**kw):
    if rhs_t:
      return plgpu.BlockSpec((bn, bk), lambda kk: (0, kk), transforms=transforms, **kw)
    return plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0), transforms=b_transforms, **kw)

  def rhs_views(rhs_e, ni):
    cols = [ni * bn] + ([n_out + ni * bn] if gated else [])
    if rhs_t:
      return [rhs_e.at[pl.ds(c, bn), :] for c in cols]
    return [rhs_e.at[:, pl.ds(c, bn)] for c in cols]

  def b_operand(b, wg_cols=None):
    """The [bk, bn] (or [bk, tile_n] for columns wg_cols) B operand of one pipeline step."""
    if rhs_t:
      if wg_cols is not None:
        b = b.at[pl.ds(wg_cols, tile_n), :]
      return plgpu.transpose_ref(b, (1, 0))
    return b if wg_cols is None else b.at[:, pl.ds(wg_cols, tile_n)]

  def item_to_task_col(lin, num_tasks):
    if cfg.grid_minor == "n":
      return lax.div(lin, jnp.int32(n_tiles)), lax.rem(lin, jnp.int32(n_tiles))
    band_size = num_tasks * width
    band = lax.div(lin, band_size)
    r_ = lax.rem(lin, band_size)
    task = lax.rem(r_, num_tasks)
    col = band * width + lax.div(r_, num_tasks)
    return task, col

  def body(meta_ref, ntask_ref, lhs_ref, rhs_ref, *rest):
    rest = list(rest)
    scale_ref = rest.pop(0) if has_scale else None
    bias_ref = rest.pop(0) if has_bias else None
    ascale_ref = rest.pop(0) if has_qscale else None
    wscale_ref = rest.pop(0) if has_qscale else None
    h_ref = rest.pop(0) if act_grad is not None else None
    out_ref = rest.pop(0)
    pre_ref = rest.pop(0) if store_preact else None
    epi_smem, vec_smem, bars = rest[:3]
    pipeline_allocs = rest[3] if cfg.warp_specialized else None

    num_tasks = slot_tasks or ntask_ref[0]
    num_items = num_tasks * n_tiles

    def origin(wg, row, ni):
      """First row and column of this warpgroup's part of the item's output tile."""
      if cfg.warp_specialized and cfg.wg_split == "m":
        return row + wg * tile_m, ni * bn
      if cfg.warp_specialized:
        return row, ni * bn + wg * tile_n
      return row, ni * bn

    def bar(wg, j):  # per warpgroup: bias gate/up, row scale, the h tiles of act_grad, qscales
      return bars.at[wg * bars_per_wg + j]

    def prefetch(wg, row, ni):
      """act_grad: start the TMA of the item's h tiles (the epilogue waits for them)."""
      if act_grad is None:
        return
      r0, c0 = origin(wg, row, ni)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores read them
      for j in range(n_h):
        plgpu.copy_gmem_to_smem(h_ref.at[pl.ds(r0, tile_m), pl.ds(j * n_out + c0, tile_n)],
                                epi_smem.at[wg, j], bar(wg, 3 + j))

    def epilogue(accs, wg, e, row, lo, hi, ni):
      """accs: f32 values (tile_m, tile_n); stores rows [lo, hi) of this warpgroup's tile."""
      r0, c0 = origin(wg, row, ni)
      # bias / row-scale vectors: TMA into SMEM, then into registers.
      if has_bias:
        plgpu.copy_gmem_to_smem(bias_ref.at[e, pl.ds(c0, tile_n)], vec_smem.at[wg, 0, :tile_n],
                                bar(wg, 0))
        if gated:
          plgpu.copy_gmem_to_smem(bias_ref.at[e, pl.ds(n_out + c0, tile_n)],
                                  vec_smem.at[wg, 1, :tile_n], bar(wg, 1))
      if has_scale:
        plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(r0, tile_m)], vec_smem.at[wg, 2, :tile_m],
                                bar(wg, 2))
      if has_qscale:
        q0 = _BARS_PER_WG
        plgpu.copy_gmem_to_smem(ascale_ref.at[pl.ds(r0, tile_m)], vec_smem.at[wg, 3, :tile_m],
                                bar(wg, q0))
        for j in range(n_rhs):
          plgpu.copy_gmem_to_smem(wscale_ref.at[e, pl.ds(j * n_out + c0, tile_n)],
                                  vec_smem.at[wg, 4 + j, :tile_n], bar(wg, q0 + 1 + j))
      shape = (tile_m, tile_n)
      vals = []
      if has_qscale:
        plgpu.barrier_wait(bar(wg, q0))
        sa = _cast(vec_smem.at[wg, 3, :tile_m][...], plgpu.Layout.WGMMA.reduce(1))
        sa = lax.broadcast_in_dim(sa, shape, [0])
      for j, a in enumerate(accs):
        if has_qscale:  # dequantize: acc * a_scale[r] * w_scale[e, n] (s32 -> f32 first)
          plgpu.barrier_wait(bar(wg, q0 + 1 + j))
          sw = _cast(vec_smem.at[wg, 4 + j, :tile_n][...], plgpu.Layout.WGMMA.reduce(0))
          a = a.astype(jnp.float32) * sa * lax.broadcast_in_dim(sw, shape, [1])
        if has_bias:
          plgpu.barrier_wait(bar(wg, j))
          b = _cast(vec_smem.at[wg, j, :tile_n][...], plgpu.Layout.WGMMA.reduce(0))
          a = a + lax.broadcast_in_dim(b, shape, [1])
        vals.append(a)
      if act_grad is not None:
        hs = []
        for j in range(n_h):
          plgpu.barrier_wait(bar(wg, 3 + j))
          hs.append(_load_wgmma(epi_smem.at[wg, j], interpret).astype(jnp.float32))
        grads = kernel_activation_vjp(act_grad, vals[0], *hs)
        outs = [(g, out_ref, j * n_out + c0) for j, g in enumerate(grads)]
      else:
        if gated:
          y = kernel_activation(act, vals[0], vals[1])
        elif act is not None:
          y = kernel_activation(act, vals[0])
        else:
          y = vals[0]
        if has_scale:
          plgpu.barrier_wait(bar(wg, 2))
          s = _cast(vec_smem.at[wg, 2, :tile_m][...], plgpu.Layout.WGMMA.reduce(1))
          y = y * lax.broadcast_in_dim(s, shape, [0])
        outs = [(y, out_ref, c0)]
        if store_preact:
          outs += [(vals[0], pre_ref, c0), (vals[1], pre_ref, n_out + c0)]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous item's stores read epi_smem
      for j, (v, _, _) in enumerate(outs):
        epi_smem.at[wg, j][...] = to_out_dtype(v, out_dtype)
      plgpu.commit_smem()
      for j, (_, dst, col) in enumerate(outs):
        store_task_rows(epi_smem.at[wg, j], dst, tile_row=r0, lo=lo, hi=hi, tile_m=tile_m,
                        ladder=ladder, cols=pl.ds(col, tile_n))

    def when_valid(e):
      """Runs the item only for an expert in [0, E) for slot tasks (else always)."""
      if not slot_tasks:
        return lambda f: f()
      return pl.when((e >= 0) & (e < num_groups))

    def task_info(lin):
      task, ni = item_to_task_col(lin, num_tasks)
      if slot_tasks:
        row = pl.multiple_of(jnp.minimum(task - task % 8, m_pad - bm), 8)
        return meta_ref[task], row, task, task + 1, ni
      e = meta_ref[0, task]
      # the tile's first row; a tile reaching past the array is shifted back inside it
      row = pl.multiple_of(jnp.minimum(meta_ref[1, task], m_pad - bm), 8)
      lo = meta_ref[2, task]
      hi = meta_ref[3, task]
      return e, row, lo, hi, ni

    def my_items():
      """(this CTA's index, how many items it runs): items lin = cta + i * num_ctas, as in the
      per-item nd_loop."""
      cta = lax.axis_index("sm")
      return cta, lax.div(num_items - cta + num_ctas - 1, num_ctas)

    def run_cross_item():
      """One pipeline over (this CTA's items, K steps): items lin = cta + i * num_ctas. The
      index maps read each item's expert / row / column tile from the task list, the body zeroes
      the accumulators at an item's first step and runs the epilogue at its last."""
      cta, mine = my_items()

      def item(i):
        return task_info(cta + i * num_ctas)

      def lhs_index(i, kk):
        _, row, _, _, _ = item(i)
        return row, kk

      def rhs_index(j):
        def index(i, kk):
          e, _, _, _, ni = item(i)
          col = ni + j * (n_out // bn)
          return (e, col, kk) if rhs_t else (e, kk, col)
        return index

      rhs_block = (None, bn, bk) if rhs_t else (None, bk, bn)
      specs = [plgpu.BlockSpec((pl.Element(bm), bk), lhs_index, transforms=transforms,
                               delay_release=1)]
      specs += [plgpu.BlockSpec(rhs_block, rhs_index(j),
                                transforms=transforms if rhs_t else b_transforms,
                                delay_release=1) for j in range(n_rhs)]

      # GPU interpret mode cannot store into a wgmma accumulator (no wgmma_accumulator_store
      # rule in jax 0.10-0.11): there an item's starting value is kept in SMEM and subtracted.
      emulate_reset = interpret is not None

      def scope(*acc_refs, bases=()):
        def step(idx, a_smem, *b_smems):
          i, kk = idx

          @pl.when(kk == 0)
          def _reset():
            _, row, _, _, ni = item(i)
            prefetch(0, row, ni)
            for j, acc in enumerate(acc_refs):
              if emulate_reset:
                bases[j][...] = acc[...]
              else:
                acc[...] = jnp.zeros((tile_m, tile_n), acc_dtype)

          for acc, b in zip(acc_refs, b_smems):
            plgpu.wgmma(acc, a_smem, b_operand(b))
          plgpu.wgmma_wait(n_rhs)

          @pl.when(kk == k_iters - 1)
          def _store():
            plgpu.wgmma_wait(0)
            e, row, lo, hi, ni = item(i)
            vals = [a[...] for a in acc_refs]
            if emulate_reset:
              vals = [v - b[...] for v, b in zip(vals, bases)]
            epilogue(vals, 0, e, row, lo, hi, ni)

        @pl.when(mine > 0)
        def _run():
          plgpu.emit_pipeline(step, grid=(mine, k_iters), in_specs=specs,
                              max_concurrent_steps=stages)(lhs_ref, *[rhs_ref] * n_rhs)
      accs = [plgpu.ACC((tile_m, tile_n), acc_dtype) for _ in range(n_rhs)]
      if emulate_reset:  # REGS and SMEM allocations need their own scopes
        pl.run_scoped(lambda *bases: pl.run_scoped(functools.partial(scope, bases=bases), *accs),
                      *[plgpu.SMEM((tile_m, tile_n), acc_dtype) for _ in range(n_rhs)])
      else:
        pl.run_scoped(scope, *accs)

    if cfg.warp_specialized:
      def mma_body(_, a_smem, *refs):
        b_refs, accs = refs[:n_rhs], refs[n_rhs]
        wg = lax.axis_index("wg")
        if cfg.wg_split == "m":
          a = a_smem.at[pl.ds(wg * tile_m, tile_m)]
          bs = [b_operand(b) for b in b_refs]
        else:
          a = a_smem
          bs = [b_operand(b, wg * tile_n) for b in b_refs]
        for acc, b in zip(accs, bs):
          plgpu.wgmma(acc, a, b)
        plgpu.wgmma_wait(0)
        return accs

      def make_pipeline(body_fn, ctx, state=None):
        specs = [plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=transforms)]
        specs += [rhs_spec() for _ in range(n_rhs)]
        return plgpu.emit_pipeline_warp_specialized(
            body_fn, grid=(k_iters,), memory_registers=40, in_specs=specs, wg_axis="wg",
            num_compute_wgs=2, max_concurrent_steps=stages, compute_context=ctx,
            pipeline_state=state)

      def compute_item(e, row, lo, hi, ni, state=None):
        def compute_context(eval_pipeline):
          def scope(*acc_refs):
            wg = lax.axis_index("wg")
            prefetch(wg, row, ni)
            accs = eval_pipeline(tuple(acc_refs))
            epilogue([a[...] for a in accs], wg, e, row, lo, hi, ni)
          pl.run_scoped(scope, *[plgpu.ACC((tile_m, tile_n), acc_dtype)
                                 for _ in range(n_rhs)])

        b_views = rhs_views(rhs_ref.at[e], ni)
        make_pipeline(mma_body, compute_context, state)(
            lhs_ref.at[pl.ds(row, bm), :], *b_views, allocations=pipeline_allocs)

      def run_chained():
        """The CTA's items (lin = cta + i * num_ctas) as one chain of pipelines: the first
        starts it (prologue loads), the last drains it, and in between the memory warpgroup
        runs ahead into the next item. One call site (a WS pipeline traced at two sites leaks
        tracers), so the state is dynamic: `_ChainState`."""
        cta, n = my_items()

        @pl.loop(0, n)
        def _items(i):
          e, row, lo, hi, ni = task_info(cta + i * num_ctas)
          compute_item(e, row, lo, hi, ni, _ChainState(i, n))

    else:
      def compute_item(e, row, lo, hi, ni):
        b_views = rhs_views(rhs_ref.at[e], ni)

        def scope(*acc_refs):
          prefetch(0, row, ni)

          def step(_, a_smem, *b_smems):
            for acc, b in zip(acc_refs, b_smems):
              plgpu.wgmma(acc, a_smem, b_operand(b))
            plgpu.wgmma_wait(n_rhs)
          specs = [plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=transforms,
                                   delay_release=1)]
          specs += [rhs_spec(delay_release=1) for _ in range(n_rhs)]
          plgpu.emit_pipeline(step, grid=(k_iters,), in_specs=specs,
                              max_concurrent_steps=cfg.num_stages)(
                                  lhs_ref.at[pl.ds(row, bm), :], *b_views)
          plgpu.wgmma_wait(0)
          epilogue([a[...] for a in acc_refs], 0, e, row, lo, hi, ni)
        pl.run_scoped(scope, *[plgpu.ACC((tile_m, tile_n), acc_dtype) for _ in range(n_rhs)])

    if cross_item:
      run_chained() if cfg.warp_specialized else run_cross_item()
    else:
      @plgpu.nd_loop((num_items,), collective_axes="sm")
      def _loop(info):
        (lin,) = info.index
        e, row, lo, hi, ni = task_info(lin)

        @when_valid(e)
        def _item():
          compute_item(e, row, lo, hi, ni)

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  scratch = [
      plgpu.SMEM((nwg, n_epi, tile_m, tile_n), out_dtype),
      plgpu.SMEM((nwg, 6 if has_qscale else 3, max(tile_m, tile_n)), jnp.float32),
      plgpu.Barrier(num_arrivals=1, num_barriers=bars_per_wg * nwg),
  ]
  if cfg.warp_specialized:
    ignore = lambda *_, **__: None
    specs = [plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=transforms)]
    specs += [rhs_spec() for _ in range(n_rhs)]
    pipe = plgpu.emit_pipeline_warp_specialized(
        ignore, grid=(k_iters,), memory_registers=40, in_specs=specs, wg_axis="wg",
        num_compute_wgs=2, max_concurrent_steps=stages, compute_context=ignore)
    lhs_aval = jax.ShapeDtypeStruct((bm, k), dtype)
    rhs_aval = jax.ShapeDtypeStruct((bn, k) if rhs_t else (k, bn), dtype)
    scratch.append(pipe.get_allocations(lhs_aval, *([rhs_aval] * n_rhs)))

  extra = {}
  if cfg.warp_specialized:
    extra = dict(num_threads=3, thread_name="wg")
  out_type = jax.ShapeDtypeStruct((m_pad, n_out * max(n_h, 1)), out_dtype)
  if store_preact:
    out_type = (out_type, jax.ShapeDtypeStruct((m_pad, 2 * n_out), out_dtype))
  return _compat.kernel(
      body,
      out_type=out_type,
      scratch_types=scratch,
      grid=(num_ctas,),
      grid_names=("sm",),
      compiler_params=_compat.compiler_params(approx_math=True),
      interpret=interpret,
      name=(("jmoe_gg_gated" if gated else "jmoe_gg") + ("_ws" if cfg.warp_specialized else "")
            + ("_2cta" if cfg.ctas_per_sm == 2 else "") + ("_xi" if cross_item else "")
            + ("_rt" if rhs_t else "") + ("_actgrad" if act_grad is not None else "")
            + ("_preact" if store_preact else "")
            + (f"_{jnp.dtype(dtype).name.split('_')[0]}" if has_qscale else "")),
      **extra,
  )


# ============================================================================ public API


def _check_dtype(name, x):
  if jnp.dtype(x.dtype) == jnp.dtype(jnp.float32):
    raise NotImplementedError(
        f"{name}: float32 inputs are not supported by the Mosaic GPU grouped GEMM (bf16/f16 only); "
        "use the XLA path or cast to bfloat16")
  if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
    raise ValueError(f"{name}: dtype {x.dtype} is not supported (bfloat16 or float16)")


def _adapt_config(cfg: GroupedGemmConfig, k: int, n_out: int) -> GroupedGemmConfig:
  """Shrink block_k / block_n so they divide K / N: tiles never read or write past K or N (only
  past M, where the extra rows are never stored)."""
  bk, bn = cfg.block_k, cfg.block_n
  while k % bk:
    bk //= 2
  while n_out % bn:
    bn //= 2
  if bk != cfg.block_k or bn != cfg.block_n:
    ws, split = cfg.warp_specialized, cfg.wg_split
    if ws and split == "n" and bn % 128:
      split = "m"
    if ws and split == "m" and cfg.block_m < 128:
      ws = False
    log.debug("grouped_gemm: config %s adapted to K=%d N=%d: block_k=%d block_n=%d", cfg, k,
              n_out, bk, bn)
    cfg = dataclasses.replace(cfg, block_k=bk, block_n=bn, warp_specialized=ws, wg_split=split)
  return cfg


def _validate(lhs, rhs, group_sizes, row_scale, bias, rhs_cols, gated=False):
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
  if rhs.ndim != 3:
    raise ValueError(f"rhs must be [E, K, N], got shape {rhs.shape}")
  m, k = lhs.shape
  e, k2, n = rhs.shape
  if k != k2:
    raise ValueError(f"lhs K={k} does not match rhs K={k2} (lhs {lhs.shape}, rhs {rhs.shape})")
  _check_dtype("lhs", lhs)
  _check_dtype("rhs", rhs)
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"lhs dtype {lhs.dtype} != rhs dtype {rhs.dtype}")
  if group_sizes.shape != (e,):
    raise ValueError(f"group_sizes must have shape ({e},), got {group_sizes.shape}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be integer, got {group_sizes.dtype}")
  if row_scale is not None and row_scale.shape != (m,):
    raise ValueError(f"row_scale must have shape ({m},), got {row_scale.shape}")
  if bias is not None and bias.shape != (e, rhs_cols):
    raise ValueError(f"bias must have shape ({e}, {rhs_cols}), got {bias.shape}")
  if k % 16:
    raise ValueError(f"K={k} must be a multiple of 16 (pad lhs and rhs along K with zeros)")
  n_out = rhs_cols // 2 if gated else rhs_cols
  if n_out % 64:
    raise ValueError(f"N={n_out} (output columns) must be a multiple of 64; pad the weight columns "
                     "(and bias) with zeros once at load time")
  if m == 0:
    raise ValueError("lhs has 0 rows")


def row_alloc(m: int, *block_ms: int) -> int:
  """Rows the kernels need for m rows: a multiple of 8 (tiles start on 8-row boundaries) and at
  least one row tile. Callers that build lhs by a gather allocate this many rows up front."""
  return max(-(-m // 8) * 8, *block_ms)


def _run(lhs, rhs, group_sizes, row_scale, bias, out_dtype, config, interpret, gated, act,
         kernel_name, meta=None, keep_rows=False, rhs_t=False, slot_experts=None,
         act_grad=None, h=None, store_preact=False, a_scale=None, w_scale=None):
  """meta: precomputed tile_metadata(group_sizes, M, block_m) (shared by GEMM1 and GEMM2).
  keep_rows: return all kernel rows (see row_alloc) instead of slicing back to M.
  rhs_t: rhs is [E, N, K] (used transposed). slot_experts [S] int32 (decode, instead of meta):
  row s < S is one task of expert slot_experts[s]; outside [0, E): skipped, row unwritten.
  act_grad + h [M, n_h * N]: return the activation's VJP at the product (see _build_kernel).
  store_preact (gated): return (activated, gate | up pre-activation).
  a_scale [M] + w_scale [E, n_total] (8-bit mode, both or neither): the accumulator's row and
  column scales (see _build_kernel's has_qscale)."""
  m, k = lhs.shape
  e = rhs.shape[0]
  n_total = rhs.shape[1] if rhs_t else rhs.shape[2]
  n_out = n_total // 2 if gated else n_total
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  cfg = kernel_config(kernel_name, m, n_out, k, e, lhs.dtype, config=config, gated=gated,
                      out_dtype=out_dtype, rhs_t=rhs_t, act_grad=act_grad,
                      store_preact=store_preact)
  if rhs_t and interpret:  # the interpreter cannot simulate transposed SMEM views
    rhs, rhs_t = jnp.swapaxes(rhs, 1, 2), False
  bm = cfg.block_m
  m_pad = row_alloc(m, bm)
  if m_pad != m:  # a copy: callers that can (fused_experts) allocate m_pad rows themselves
    lhs = jnp.pad(lhs, ((0, m_pad - m), (0, 0)))
    if h is not None:
      h = jnp.pad(h, ((0, m_pad - m), (0, 0)))
  if row_scale is not None:
    row_scale = row_scale.astype(jnp.float32)
    if m_pad != m:
      row_scale = jnp.pad(row_scale, (0, m_pad - m))
  if bias is not None:
    bias = bias.astype(jnp.float32)
  has_qscale = a_scale is not None
  if has_qscale:
    a_scale = a_scale.astype(jnp.float32)
    if m_pad != m:
      a_scale = jnp.pad(a_scale, (0, m_pad - m))
    w_scale = w_scale.astype(jnp.float32)
  if slot_experts is not None:  # the task count is static: ntasks is not read
    meta, ntasks = slot_experts.astype(jnp.int32), jnp.zeros((1,), jnp.int32)
  else:
    meta, ntasks = tile_metadata(group_sizes, m, bm) if meta is None else meta
  t_max = meta.shape[-1]
  interp, nsm = _compat.launch_params(interpret)
  kern = _build_kernel(m_pad=m_pad, k=k, n_out=n_out, n_total=n_total, num_groups=e,
                       dtype=lhs.dtype, out_dtype=out_dtype, cfg=cfg, gated=gated, act=act,
                       has_scale=row_scale is not None, has_bias=bias is not None, t_max=t_max,
                       num_sms=nsm, interpret=interp, rhs_t=rhs_t,
                       slot_tasks=0 if slot_experts is None else slot_experts.shape[0],
                       act_grad=act_grad, store_preact=store_preact, has_qscale=has_qscale)
  args = [meta, ntasks, lhs, rhs]
  if row_scale is not None:
    args.append(row_scale)
  if bias is not None:
    args.append(bias)
  if has_qscale:
    args += [a_scale, w_scale]
  if act_grad is not None:
    args.append(h)
  out = kern(*args)
  if m_pad != m and not keep_rows:
    out = jax.tree.map(lambda o: o[:m], out)
  return out


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "activation",
                                             "transpose_rhs"))
def grouped_gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                 row_scale: jax.Array | None = None, bias: jax.Array | None = None,
                 activation: Activation | str | None = None, out_dtype=None,
                 config: GroupedGemmConfig | None = None, interpret: Any = False,
                 transpose_rhs: bool = False) -> jax.Array:
  """out[r] = act((lhs[r] @ rhs[g(r)] + bias[g(r)])) * row_scale[r] for r < sum(group_sizes).

  lhs [M, K] bf16/f16 (rows sorted by group), rhs [E, K, N] same dtype, group_sizes [E] int.
  row_scale [M] (f32), bias [E, N] (f32 or any float), activation: None or a non-gated
  ``*_no_mul`` Activation (gated ones need :func:`grouped_gemm_gated`). Accumulates in f32.
  Returns [M, N] in out_dtype (default lhs.dtype); rows >= sum(group_sizes) are unwritten.
  K must be a multiple of 16 and N a multiple of 64 (ValueError otherwise: pad the weights once);
  config.block_k / block_n are shrunk to divide K / N. float32 inputs raise NotImplementedError
  (callers fall back to XLA). interpret: False, True (GPU interpret mode on CPU, race detection
  on) or an InterpretGPUParams.
  transpose_rhs: rhs is given as [E, N, K] and multiplied transposed (no copy: the kernel reads
  transposed tiles; the backward's d lhs = dout @ w^T).
  """
  act = None
  if activation is not None:
    act = as_activation(activation)
    if act.is_gated:
      raise ValueError(f"activation={act.name!r} is gated: use grouped_gemm_gated")
  if transpose_rhs:
    if rhs.ndim != 3:
      raise ValueError(f"rhs must be [E, N, K] with transpose_rhs, got shape {rhs.shape}")
    _validate(lhs, jax.ShapeDtypeStruct((rhs.shape[0], rhs.shape[2], rhs.shape[1]), rhs.dtype),
              group_sizes, row_scale, bias, rhs.shape[1])
  else:
    _validate(lhs, rhs, group_sizes, row_scale, bias, rhs.shape[2])
  return _run(lhs, rhs, group_sizes, row_scale, bias, out_dtype, config, interpret, False, act,
              "grouped_gemm", rhs_t=transpose_rhs)


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "config", "interpret",
                                             "return_preact"))
def grouped_gemm_gated(lhs: jax.Array, w13: jax.Array, group_sizes: jax.Array, *,
                       activation: Activation | str = "silu", bias: jax.Array | None = None,
                       row_scale: jax.Array | None = None, out_dtype=None,
                       config: GroupedGemmConfig | None = None, interpret: Any = False,
                       return_preact: bool = False):
  """GEMM1 with the gated activation fused: out[r, j] = act(h[r, j], h[r, N + j]) (* row_scale).

  h = lhs[r] @ w13[g(r)] + bias[g(r)], w13 [E, K, 2N] with gate columns [0, N) and up columns
  [N, 2N) (the jmoe convention). The [M, 2N] intermediate never reaches HBM: each output tile
  computes its gate and up columns in two f32 accumulators. Returns [M, N]; rows past
  sum(group_sizes) are unwritten.
  return_preact (training, no row_scale): also return h [M, 2N] in out_dtype, the activation's
  input that its backward needs, written from the same accumulators: (out, h).
  """
  act = as_activation(activation)
  if not act.is_gated:
    raise ValueError(f"activation={act.name!r} is not gated: use grouped_gemm(activation=...)")
  if w13.ndim != 3 or w13.shape[2] % 2:
    raise ValueError(f"w13 must be [E, K, 2N], got shape {w13.shape}")
  if return_preact and row_scale is not None:
    raise ValueError("return_preact takes no row_scale (h is the unscaled activation input)")
  _validate(lhs, w13, group_sizes, row_scale, bias, w13.shape[2], gated=True)
  return _run(lhs, w13, group_sizes, row_scale, bias, out_dtype, config, interpret, True, act,
              "grouped_gemm_gated", store_preact=return_preact)


def _validate_act_grad(lhs, h, act: Activation, n_out: int):
  n_h = 2 if act.is_gated else 1
  if h.shape != (lhs.shape[0], n_h * n_out):
    raise ValueError(f"h must be [M, {n_h} * N] = {(lhs.shape[0], n_h * n_out)} for "
                     f"activation={act.name!r}, got {h.shape}")
  if h.dtype != lhs.dtype:
    raise ValueError(f"h dtype {h.dtype} != dout dtype {lhs.dtype}")


@functools.partial(jax.jit, static_argnames=("activation", "config", "interpret",
                                             "transpose_rhs"))
def grouped_gemm_act_grad(dout: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                          h: jax.Array, *, activation: Activation | str = "silu",
                          config: GroupedGemmConfig | None = None, interpret: Any = False,
                          transpose_rhs: bool = False) -> jax.Array:
  """The activation's backward fused into the GEMM that makes its cotangent (training).

  d a = dout[r] @ rhs[g(r)] (rhs [E, K, N], or [E, N, K] with transpose_rhs: the backward of
  ``a @ w2`` passes w2 itself), then dh = VJP of the activation at h, applied to d a. h [M, 2N]
  (gate | up) for a gated activation, [M, N] otherwise, in dout's dtype. Each item's h tiles
  load by TMA while its K loop runs, so d a never reaches HBM. Returns dh with h's shape; rows
  past sum(group_sizes) are unwritten.
  """
  act = as_activation(activation)
  if transpose_rhs:
    if rhs.ndim != 3:
      raise ValueError(f"rhs must be [E, N, K] with transpose_rhs, got shape {rhs.shape}")
    _validate(dout, jax.ShapeDtypeStruct((rhs.shape[0], rhs.shape[2], rhs.shape[1]), rhs.dtype),
              group_sizes, None, None, rhs.shape[1])
    n_out = rhs.shape[1]
  else:
    _validate(dout, rhs, group_sizes, None, None, rhs.shape[2])
    n_out = rhs.shape[2]
  _validate_act_grad(dout, h, act, n_out)
  return _run(dout, rhs, group_sizes, None, None, None, config, interpret, False, None,
              "grouped_gemm", rhs_t=transpose_rhs, act_grad=act, h=h)


# ============================================================================ references


def grouped_gemm_reference(lhs, rhs, group_sizes, *, row_scale=None, bias=None, activation=None,
                           gated=False, out_dtype=None):
  """Pure-jnp reference (f32 math, dense per-row gather of the group's weights by masking).

  Rows past sum(group_sizes) are returned as zeros.
  """
  m = lhs.shape[0]
  e = rhs.shape[0]
  gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.cumsum(gs)
  row = jnp.arange(m)
  gid = jnp.searchsorted(ends, row, side="right")
  valid = gid < e
  gid_c = jnp.minimum(gid, e - 1)
  h = jnp.zeros((m, rhs.shape[2]), jnp.float32)
  for g in range(e):
    hg = jnp.dot(lhs.astype(jnp.float32), rhs[g].astype(jnp.float32),
                 precision=lax.Precision.HIGHEST)
    h = jnp.where((gid_c == g)[:, None], hg, h)
  if bias is not None:
    h = h + bias.astype(jnp.float32)[gid_c]
  if gated:
    n = h.shape[1] // 2
    y = as_activation(activation).gated(h[:, :n], h[:, n:])
  elif activation is not None:
    y = as_activation(activation)(h)
  else:
    y = h
  if row_scale is not None:
    y = y * row_scale.astype(jnp.float32)[:, None]
  y = jnp.where(valid[:, None], y, 0.0)
  return y.astype(out_dtype or lhs.dtype)


# ============================================================================ batched (masked) format


def _batched(lhs, rhs, expert_num_tokens, row_scale, bias, out_dtype, config, interpret, gated,
             act, kernel_name):
  if lhs.ndim != 3:
    raise ValueError(f"lhs must be [E, max_tokens, K], got shape {lhs.shape}")
  e, cap, k = lhs.shape
  if rhs.ndim != 3 or rhs.shape[0] != e:
    raise ValueError(f"rhs must be [E={e}, K, N], got shape {rhs.shape}")
  if expert_num_tokens.shape != (e,):
    raise ValueError(f"expert_num_tokens must have shape ({e},), got {expert_num_tokens.shape}")
  if row_scale is not None and row_scale.shape != (e, cap):
    raise ValueError(f"row_scale must have shape ({e}, {cap}), got {row_scale.shape}")
  m = e * cap
  lhs2 = lhs.reshape(m, k)
  scale2 = None if row_scale is None else row_scale.reshape(m)
  _validate(lhs2, rhs, expert_num_tokens, scale2, bias, rhs.shape[2], gated=gated)
  n_out = rhs.shape[2] // 2 if gated else rhs.shape[2]
  if config is None:
    config = get_config(kernel_name, m, n_out, k, e, lhs.dtype, gated=gated, out_dtype=out_dtype)
  bm = config.block_m
  counts = jnp.clip(expert_num_tokens.astype(jnp.int32), 0, cap)
  starts = jnp.arange(e, dtype=jnp.int32) * cap
  t_max = e * pl.cdiv(cap, bm)  # tiles are aligned to each expert's first row
  meta = tile_metadata_from_bounds(starts, starts + counts, bm, t_max)
  out = _run(lhs2, rhs, expert_num_tokens, scale2, bias, out_dtype, config, interpret, gated, act,
             kernel_name, meta=meta)
  return out.reshape(e, cap, n_out)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "activation"))
def batched_grouped_gemm(lhs: jax.Array, rhs: jax.Array, expert_num_tokens: jax.Array, *,
                         row_scale: jax.Array | None = None, bias: jax.Array | None = None,
                         activation: Activation | str | None = None, out_dtype=None,
                         config: GroupedGemmConfig | None = None, interpret: Any = False
                         ) -> jax.Array:
  """Batched (masked) format: out[e, r] = epilogue(lhs[e, r] @ rhs[e]) for r < expert_num_tokens[e].

  lhs [E, max_tokens, K], rhs [E, K, N], expert_num_tokens [E] int, row_scale [E, max_tokens],
  bias [E, N]. Same kernel as grouped_gemm: row tiles past an expert's count are never scheduled
  (no compute, no weight loads for experts with 0 tokens); rows r >= expert_num_tokens[e] of the
  [E, max_tokens, N] result are unwritten.
  """
  act = None
  if activation is not None:
    act = as_activation(activation)
    if act.is_gated:
      raise ValueError(f"activation={act.name!r} is gated: use batched_grouped_gemm_gated")
  return _batched(lhs, rhs, expert_num_tokens, row_scale, bias, out_dtype, config, interpret,
                  False, act, "grouped_gemm")


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype", "config", "interpret"))
def batched_grouped_gemm_gated(lhs: jax.Array, w13: jax.Array, expert_num_tokens: jax.Array, *,
                               activation: Activation | str = "silu",
                               bias: jax.Array | None = None,
                               row_scale: jax.Array | None = None, out_dtype=None,
                               config: GroupedGemmConfig | None = None, interpret: Any = False
                               ) -> jax.Array:
  """Batched format of grouped_gemm_gated: [E, max_tokens, K] x [E, K, 2N] -> [E, max_tokens, N]."""
  act = as_activation(activation)
  if not act.is_gated:
    raise ValueError(f"activation={act.name!r} is not gated: use batched_grouped_gemm")
  return _batched(lhs, w13, expert_num_tokens, row_scale, bias, out_dtype, config, interpret,
                  True, act, "grouped_gemm_gated")
