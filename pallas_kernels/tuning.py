"""The autotuning search space of the grouped GEMMs (shared by `python -m jmoe tune` and
benchmarks/bench_grouped_gemm.py). Candidates that do not fit a problem are adapted by the
kernel wrapper (block_k / block_n shrink to divide K / N, stages fitted to shared memory)."""
from __future__ import annotations

from jmoe.kernels.grouped_gemm import GroupedGemmConfig as C
from jmoe.kernels.grouped_gemm_q8 import BlockQ8Config as BQ
from jmoe.kernels.tgmm import TgmmConfig as TC

SWEEP_G1 = (  # gated GEMM1, large M
    C(block_m=128, block_n=128, block_k=64, num_stages=4, wg_split="m", grid_minor="m",
      grid_tile_width=4),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, wg_split="n", grid_minor="m",
      grid_tile_width=4),
    C(block_m=256, block_n=64, block_k=64, num_stages=4, wg_split="m", grid_minor="m",
      grid_tile_width=8),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, wg_split="m", grid_minor="n"),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, wg_split="m", grid_minor="m",
      grid_tile_width=8),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, wg_split="m", grid_minor="m",
      grid_tile_width=2),
    C(block_m=64, block_n=128, block_k=64, num_stages=4, warp_specialized=False,
      cross_item=True),
    # (warp specialized with the items' pipelines chained, wg_split m, bands of 2 or 4: 15-20 %
    # slower than unchained on every preset at 16384 tokens, H200 2026-11-30; not kept)
)
SWEEP_G2 = (  # GEMM2 (row scale), large M
    C(block_m=128, block_n=256, block_k=64, num_stages=4, wg_split="n", grid_minor="m",
      grid_tile_width=4),
    C(block_m=128, block_n=256, block_k=64, num_stages=4, wg_split="n", grid_minor="n"),
    C(block_m=256, block_n=128, block_k=64, num_stages=4, wg_split="m", grid_minor="m",
      grid_tile_width=4),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, wg_split="m", grid_minor="m",
      grid_tile_width=4),
    C(block_m=128, block_n=256, block_k=64, num_stages=4, wg_split="n", grid_minor="m",
      grid_tile_width=2),
    C(block_m=128, block_n=128, block_k=64, num_stages=3, warp_specialized=False, ctas_per_sm=2),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, warp_specialized=False,
      cross_item=True),
    # warp specialized, items chained: qwen3 at 16384 tokens 706 -> 660 µs; deepseek-v3 /
    # mixtral 14-15 % slower (H200, 2026-11-30). Chained with bands of 2 lost everywhere
    C(block_m=128, block_n=256, block_k=64, num_stages=4, wg_split="n", grid_minor="n",
      cross_item=True),
)
SWEEP_SMALL = (  # narrow-row / weight-streaming candidates (both GEMMs)
    C(block_m=64, block_n=128, block_k=128, num_stages=6, wg_split="n"),
    C(block_m=64, block_n=64, block_k=128, num_stages=6, warp_specialized=False),
    C(block_m=64, block_n=256, block_k=64, num_stages=4, wg_split="n"),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, wg_split="n", grid_minor="n"),
    # decode: deeper weight pipelines (stages are fitted to shared memory)
    C(block_m=64, block_n=64, block_k=64, num_stages=8, warp_specialized=False),
    C(block_m=64, block_n=128, block_k=64, num_stages=8, wg_split="n"),
    # two CTAs per SM: one's pipeline fill / epilogue hides behind the other's loads
    C(block_m=64, block_n=128, block_k=64, num_stages=4, warp_specialized=False, ctas_per_sm=2),
    C(block_m=64, block_n=64, block_k=128, num_stages=4, warp_specialized=False, ctas_per_sm=2),
    C(block_m=128, block_n=128, block_k=64, num_stages=3, warp_specialized=False, ctas_per_sm=2),
    # one pipeline across a CTA's items: the next item's tiles load during this one's store
    C(block_m=64, block_n=128, block_k=64, num_stages=4, warp_specialized=False, cross_item=True),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, warp_specialized=False,
      cross_item=True),
    C(block_m=64, block_n=128, block_k=64, num_stages=4, warp_specialized=False, ctas_per_sm=2,
      cross_item=True),
)


SWEEP_TGMM = (  # weight gradient; H200 (mixtral / qwen3 at 1024 tokens)
    # two CTAs per SM (short per-expert contractions: one CTA's prologue / store hides behind
    # the other's wgmmas; stages fitted to half the shared memory): won on every shape on
    # 2026-11-29, 18-31 % faster than 1 CTA with 4 stages (dropped, as were 64x128 tiles)
    TC(block_k=128, block_n=128, block_r=64, num_stages=2, ctas_per_sm=2),
    # warp specialized, CTA tiles 256x128 and 128x256 (two compute warpgroups share each dout
    # or lhs tile): mixtral 9-10 % faster than the above, qwen3 no gain (2026-11-30); 128x128
    # ones were 25-50 % slower
    TC(block_k=128, block_n=128, block_r=64, num_stages=4, warp_specialized=True),
    TC(block_k=64, block_n=256, block_r=64, num_stages=4, warp_specialized=True),
    # one pipeline across a CTA's tiles (loads run ahead over tile boundaries): qwen3 dW13
    # 338 -> 295 µs (the first), dW2 171 -> 153 (the third); mixtral: WS stays ahead
    TC(block_k=128, block_n=128, block_r=64, num_stages=4, cross_tile=True),
    TC(block_k=128, block_n=128, block_r=64, num_stages=6, cross_tile=True),
    TC(block_k=128, block_n=128, block_r=64, num_stages=2, ctas_per_sm=2, cross_tile=True),
    TC(block_k=128, block_n=128, block_r=128, num_stages=3, cross_tile=True),
    # 64x256 tiles: rows of the stored gradient tile twice as long
    TC(block_k=64, block_n=256, block_r=64, num_stages=4, cross_tile=True),
    # warp specialized and cross-tile: the TMA warpgroup loads the next tile's first blocks
    # while the compute warpgroups finish and store this one (stages refitted: 3)
    TC(block_k=128, block_n=128, block_r=64, num_stages=4, warp_specialized=True,
       cross_tile=True),
    TC(block_k=64, block_n=256, block_r=64, num_stages=4, warp_specialized=True,
       cross_tile=True),
    # K tiles fastest: consecutive tiles share a dout column block (wide dout: mixtral dW13).
    # Dropped after the 2026-11-30 sweep, slower than these on every shape: per-tile WS K-fastest,
    # cross-tile K-fastest with 6 stages or 64x256 tiles
    TC(block_k=128, block_n=128, block_r=64, num_stages=4, warp_specialized=True,
       cross_tile=True, k_fastest=True),
    TC(block_k=128, block_n=128, block_r=64, num_stages=4, cross_tile=True, k_fastest=True),
    # the mixtral / qwen3 dW13 winner (2026-11-30): mixtral 1264 -> 959 µs, qwen3 258 -> 233
    TC(block_k=64, block_n=256, block_r=64, num_stages=4, warp_specialized=True,
       cross_tile=True, k_fastest=True),
    # two output buffers per warpgroup (stages refitted: 2 for the WS 64x256 tiles): the
    # store stream need not idle while an epilogue writes its tile. deepseek-v3 at 1024 tokens
    # (stores-bound: one row block per tile), WS cross-tile: dW13 4361 -> 3800 µs, dW2 2271 ->
    # 1890 (H200, 2026-11-30); 25-50 % slower wherever a tile has a K loop. Dropped: per-tile
    # WS, one-warpgroup cross-tile, K-fastest and 128x128 WS cross-tile with two whole buffers
    TC(block_k=64, block_n=256, block_r=64, num_stages=4, warp_specialized=True,
       cross_tile=True, out_buffers=2),
    # two buffers of quarter / half tiles: a chunk's store stays in flight while the next is
    # written, at half / all of one whole tile's SMEM (4 / 3 stages). H200, 2026-11-30:
    # quarters: deepseek-v3 4096 dW13 5230 -> 4646 µs, dW2 2649 -> 2362; mixtral dW2 500 ->
    # 461 (1024 tokens), 2488 -> 2460 (8192); halves, K-fastest: mixtral dW13 957 -> 917 (1024),
    # 4902 -> 4893 (8192). No gain on qwen3 or deepseek-v3 1024; the 64x256 N-fastest and
    # 128x128 forms with halves won nowhere
    TC(block_k=64, block_n=256, block_r=64, num_stages=4, warp_specialized=True,
       cross_tile=True, out_buffers=2, store_parts=4),
    TC(block_k=64, block_n=256, block_r=64, num_stages=4, warp_specialized=True,
       cross_tile=True, k_fastest=True, out_buffers=2, store_parts=2),
)


def candidates(gemm: str, rows_per_expert: float) -> tuple:
  """Configs worth timing for `gemm` ("gemm1" gated / "gemm2" / "tgmm") at this expert load."""
  if gemm == "tgmm":
    return SWEEP_TGMM
  if rows_per_expert <= 64:
    # plain GEMMs (GEMM2, training's transposed-weight GEMMs): also the chained WS 128x256 form,
    # qwen3's GEMM2 winner at 1024 tokens (64 rows per expert)
    return SWEEP_SMALL + ((SWEEP_G1[0],) if gemm == "gemm1" else (SWEEP_G2[1], SWEEP_G2[-1]))
  return SWEEP_G1 if gemm == "gemm1" else SWEEP_G2


# fp8_block's GEMM1 (GEMM2 follows its form: grouped_gemm_q8.gemm2_block_config), timed as
# the whole block: warp specialized 128-row tiles (the prefill default) and 64-row tiles on one
# or two CTAs per SM (the decode default), stages as shared memory allows
SWEEP_FP8_BLOCK = (
    BQ(block_m=128, block_n=128, num_stages=4, warp_specialized=True),
    BQ(block_m=128, block_n=128, num_stages=2, warp_specialized=True),
    BQ(block_m=64, block_n=128, num_stages=6, ctas_per_sm=2),
    BQ(block_m=64, block_n=128, num_stages=4, ctas_per_sm=2),
    BQ(block_m=64, block_n=128, num_stages=6),
    # (one warpgroup on 128-row gated tiles: two 128 x 128 f32 totals plus a step's accumulator
    # do not fit its registers)
)
