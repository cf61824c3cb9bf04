"""The GPU programs lower on the CPU machine (jit(...).trace(...).lower(lowering_platforms=
("cuda",))): the Mosaic GPU and Triton lowerings run here, at the presets' full sizes and with
the H200's tuned tables in effect, so a kernel that only the GPU path would reject (a layout, a
Triton op such as a 1-D concatenate, a shared-memory overrun at a tuned config) fails in CI
rather than on the device. Nothing is executed.
"""
from __future__ import annotations

import re

import pytest

import jax
import jax.numpy as jnp

from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import moe as pmoe
from jmoe.kernels import route
from jmoe.kernels import tgmm as tg

S = jax.ShapeDtypeStruct
PRESETS = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336),
           "deepseek": (256, 8, 7168, 2048)}  # E, top-k, H, N


@pytest.fixture
def h200_tables(monkeypatch):
  """Tuned-table lookups as on the H200 (device kind and jax minor version of the tables)."""
  monkeypatch.setattr(_compat, "device_kind", lambda: "NVIDIA H200")
  monkeypatch.setattr(_compat, "JAX_VERSION", (0, 11, 2))


def _kernels(fn, *shapes, **kw_shapes) -> set:
  text = jax.jit(fn).trace(*shapes, **kw_shapes).lower(lowering_platforms=("cuda",)).as_text()
  return set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text))


@pytest.mark.parametrize("preset,t,expect", [
    ("qwen3", 1, set()),                               # the one-kernel decode block
    pytest.param("qwen3", 2, set(), marks=pytest.mark.slow),  # the one-kernel decode block
    ("qwen3", 4, set()),                               # per_slot decode
    ("qwen3", 1024, {"jmoe_route_block_counts", "jmoe_route_scatter_rows"}),
    pytest.param("qwen3", 128, {"jmoe_route_scatter_rows"},  # 8 blocks: one routing kernel
                 marks=pytest.mark.slow),
    ("qwen3", 256, {"jmoe_route_scatter_rows"}),       # 16 blocks: one routing kernel
    ("qwen3", 512, {"jmoe_route_block_counts", "jmoe_route_scatter_rows"}),  # 32 blocks: two
    ("mixtral", 1024, {"jmoe_route_scatter_rows"}),    # 16 blocks: one
    ("mixtral", 4, {"jmoe_route_scatter_rows"}),                        # one routing kernel
    ("deepseek", 32, {"jmoe_route_scatter_rows"}),      # 2 blocks of 128 slots: one kernel
    pytest.param("deepseek", 64, {"jmoe_route_scatter_rows"},  # 4 blocks: one kernel
                 marks=pytest.mark.slow),
    pytest.param("deepseek", 128, {"jmoe_route_scatter_rows"},  # 8 blocks: one kernel
                 marks=pytest.mark.slow),
    ("deepseek", 256, {"jmoe_route_scatter_rows"}),     # 16 blocks: one kernel
    ("deepseek", 512, {"jmoe_route_block_counts", "jmoe_route_scatter_rows"}),  # 32 blocks
])
def test_fused_experts_lowers_for_gpu(h200_tables, preset, t, expect):
  e, k, h, n = PRESETS[preset]
  found = _kernels(lambda x, w13, w2, tw, ti: pmoe.fused_experts(x, w13, w2, tw, ti),
                   S((t, h), jnp.bfloat16), S((e, h, 2 * n), jnp.bfloat16),
                   S((e, n, h), jnp.bfloat16), S((t, k), jnp.float32), S((t, k), jnp.int32))
  if preset == "qwen3" and t <= 2:
    assert found == {"jmoe_moe_decode"}, found
    return
  assert any(name.startswith("jmoe_gg_gated") for name in found), found
  routing = {name for name in found if "route" in name}
  if not route.available():  # pragma: no cover (a jax without the Triton lowering)
    assert not routing
  else:
    assert routing == (set() if t * k <= e // 4 else expect), found  # decode sorts nothing


@pytest.mark.parametrize("preset,t", [("qwen3", 256), ("mixtral", 1024)])
def test_training_path_lowers_for_gpu(h200_tables, preset, t):
  # mixtral at 1024 tokens: the tuned tables pick the warp-specialized cross-tile tgmm
  e, k, h, n = PRESETS[preset]

  def loss(x, w13, w2, tw, ti):
    return jnp.sum(pmoe.fused_experts_train(x, w13, w2, tw, ti).astype(jnp.float32))

  found = _kernels(jax.grad(loss, argnums=(0, 1, 2, 3)), S((t, h), jnp.bfloat16),
                   S((e, h, 2 * n), jnp.bfloat16), S((e, n, h), jnp.bfloat16),
                   S((t, k), jnp.float32), S((t, k), jnp.int32))
  assert any(name.startswith("jmoe_tgmm") for name in found), found
  assert any(name.endswith("_rt") for name in found), found  # d lhs on transposed weights
  if preset == "mixtral":
    assert "jmoe_tgmm_ws_xt" in found, found
  if route.available():  # the routing kernels in their training mode
    assert {"jmoe_route_block_counts", "jmoe_route_scatter_rows"} <= found, found


@pytest.mark.skipif(not route.available(), reason="the Pallas Triton lowering does not import")
@pytest.mark.parametrize("preset,t,expect", [
    ("qwen3", 1024, {"jmoe_route_block_counts", "jmoe_route_scatter_rows"}),  # 8192 slots
    ("mixtral", 4, {"jmoe_route_scatter_rows"}),                              # one kernel
    ("deepseek", 1, {"jmoe_route_scatter_rows"}),     # one program zeroes 256 experts' padding
])
def test_route_for_training_lowers_for_gpu(preset, t, expect):
  e, k, h, _ = PRESETS[preset]
  m_alloc = gg.row_alloc(t * k + 7 * min(e, t * k), 128)  # as fused_experts_train
  found = _kernels(lambda x, ti: route.route_for_training(x, ti, e, m_alloc, (128, 64)),
                   S((t, h), jnp.bfloat16), S((t, k), jnp.int32))
  assert found == expect, found


@pytest.mark.parametrize("cfg,name", [
    (dict(ctas_per_sm=2, num_stages=2), "jmoe_tgmm_2cta"),
    (dict(warp_specialized=True, num_stages=3), "jmoe_tgmm_ws"),
    (dict(warp_specialized=True, num_stages=3, transpose_in_kernel=False), "jmoe_tgmm_ws"),
    (dict(block_r=128, num_stages=2), "jmoe_tgmm"),
    (dict(cross_tile=True, num_stages=4), "jmoe_tgmm_xt"),
    (dict(cross_tile=True, num_stages=2, ctas_per_sm=2), "jmoe_tgmm_xt_2cta"),
    (dict(cross_tile=True, num_stages=3, transpose_in_kernel=False), "jmoe_tgmm_xt"),
    (dict(cross_tile=True, warp_specialized=True, num_stages=3), "jmoe_tgmm_ws_xt"),
    (dict(cross_tile=True, warp_specialized=True, num_stages=3, k_fastest=True,
          transpose_in_kernel=False), "jmoe_tgmm_ws_xt"),
    (dict(warp_specialized=True, num_stages=3, k_fastest=True), "jmoe_tgmm_ws"),
    (dict(block_k=64, block_n=256, warp_specialized=True, out_buffers=2), "jmoe_tgmm_ws"),
    (dict(block_k=64, block_n=256, warp_specialized=True, cross_tile=True, out_buffers=2),
     "jmoe_tgmm_ws_xt"),
    (dict(cross_tile=True, out_buffers=2), "jmoe_tgmm_xt"),
    (dict(num_stages=2, out_buffers=2), "jmoe_tgmm"),
    (dict(warp_specialized=True, cross_tile=True, k_fastest=True, out_buffers=2),
     "jmoe_tgmm_ws_xt"),
    (dict(block_k=64, block_n=256, warp_specialized=True, cross_tile=True, out_buffers=2,
          store_parts=2), "jmoe_tgmm_ws_xt"),
    (dict(block_k=64, block_n=256, warp_specialized=True, out_buffers=2, store_parts=4),
     "jmoe_tgmm_ws"),
    (dict(cross_tile=True, store_parts=2), "jmoe_tgmm_xt"),
], ids=["two_ctas", "ws", "ws_lhs_transposed_by_xla", "rows_128", "cross_tile",
        "cross_tile_two_ctas", "cross_tile_lhs_transposed_by_xla", "ws_cross_tile",
        "ws_cross_tile_k_fastest_lhs_transposed_by_xla", "ws_k_fastest", "ws_64x256_two_out",
        "ws_cross_tile_64x256_two_out", "cross_tile_two_out", "one_wg_two_out",
        "ws_cross_tile_k_fastest_two_out", "ws_cross_tile_64x256_halves_two_out",
        "ws_64x256_quarters_two_out", "cross_tile_halves"])
def test_tgmm_lowers_for_gpu(cfg, name):
  cfg = tg.TgmmConfig(**{"block_k": 128, "block_n": 128, **cfg})
  found = _kernels(lambda a, b, g: tg.tgmm(a, b, g, config=cfg), S((8192, 2048), jnp.bfloat16),
                   S((8192, 1536), jnp.bfloat16), S((128,), jnp.int32))
  assert found == {name}, found


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_tanh", "swigluoai", "gelu_no_mul",
                                  "relu2_no_mul"])
def test_activation_epilogues_lower_for_gpu(h200_tables, name):
  # every activation in the forward epilogue and (training) its VJP in the d a GEMM's epilogue,
  # at qwen3's sizes on the tuned (warp-specialized) configs, which the staged h tiles refit
  e, _, h, n = PRESETS["qwen3"]
  m = 8192
  gated = not name.endswith("_no_mul")
  n13 = 2 * n if gated else n
  if gated:
    fwd = lambda x, w, g: gg.grouped_gemm_gated(x, w, g, activation=name, return_preact=True)
  else:
    fwd = lambda x, w, g: gg.grouped_gemm(x, w, g, activation=name)
  found = _kernels(fwd, S((m, h), jnp.bfloat16), S((e, h, n13), jnp.bfloat16),
                   S((e,), jnp.int32))
  assert any(k.startswith("jmoe_gg") for k in found), found
  bwd = lambda d, w, g, hh: gg.grouped_gemm_act_grad(d, w, g, hh, activation=name,
                                                      transpose_rhs=True)
  found = _kernels(bwd, S((m, h), jnp.bfloat16), S((e, n, h), jnp.bfloat16),
                   S((e,), jnp.int32), S((m, n13), jnp.bfloat16))
  assert any(k.endswith("_actgrad") for k in found), found


@pytest.mark.parametrize("preset", ["qwen3", "mixtral", "deepseek"])
@pytest.mark.parametrize("t,bias", [(1, False), (16, True)])
def test_decode_kernel_lowers_for_gpu(preset, t, bias):
  # the one-kernel decode block at full size: the swapped (transposed) wgmma operands, the ring
  # at its default depth within shared memory (checked by Mosaic GPU at lowering), a w13 bias
  from jmoe.kernels import decode as dc
  e, k, h, n = PRESETS[preset]
  kw = dict(w13_bias=S((e, 2 * n), jnp.float32)) if bias else {}
  found = _kernels(lambda x, w13, w2, tw, ti, **kw: dc.fused_experts_decode(x, w13, w2, tw, ti,
                                                                            **kw),
                   S((t, h), jnp.bfloat16), S((e, h, 2 * n), jnp.bfloat16),
                   S((e, n, h), jnp.bfloat16), S((t, k), jnp.float32), S((t, k), jnp.int32), **kw)
  assert found == {"jmoe_moe_decode"}, found
