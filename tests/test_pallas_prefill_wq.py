"""The weight-only prefill GEMMs (jmoe.kernels.grouped_gemm_wq: int4 / int8 codes dequantized
in registers as wgmma's A operand, the token rows as B) in Mosaic GPU interpret mode with race
detection, against the float64 oracle on the NumPy unpacking of the stored bytes; the layout
rule; the task-column map; the GPU lowering at mixtral-8x7b's size."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
import oracle_np as onp
from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import grouped_gemm_wq
from jmoe.kernels import grouped_gemm_wq_ws as wqws
from jmoe.kernels import moe as pmoe
from jmoe.kernels.activations import as_activation
from jmoe.quant import quantize_weights
from kernel_run import EXHAUSTIVE, run_interpreted
from test_pallas_decode_wq import _oracle, _problem

pytestmark = pytest.mark.skipif(
    not _compat.interpret_available(),
    reason="Mosaic GPU interpret mode (private jax API) unavailable in this jax version")

TOL = 2e-2
S = jax.ShapeDtypeStruct


def _prefill(x, q13, q2, tw, ids, b13=None, b2=None, activation="silu"):
  return np.asarray(run_interpreted(
      lambda *a, interpret: pmoe.fused_experts_weight_only(
          *a, w13_bias=b13, w2_bias=b2, activation=activation, out_dtype=jnp.float32,
          interpret=interpret, layout="prefill"),
      x, q13, q2, jnp.asarray(tw), jnp.asarray(ids)))


# (EXHAUSTIVE: since grouped_gemm_wq_ws takes sizes 64 divides (TAILS), auto runs these
# GEMMs for e4m3 codes (mxfp8) only; 4-bit / int8 codes reach them with layout="prefill")
@pytest.mark.parametrize("sid,bias,activation", [
    ("mxfp8-codes", True, "swigluoai"),  # e4m3, e8m0 / 32: what auto runs here
    pytest.param("w4a16", True, "silu", marks=pytest.mark.slow),
    pytest.param("mxfp4", True, "swigluoai", marks=EXHAUSTIVE),  # e2m1, groups of 32
    pytest.param("w8a16", False, "swigluoai", marks=EXHAUSTIVE),  # per-channel scales
    pytest.param("w4a16-zp", True, "silu", marks=EXHAUSTIVE),
    pytest.param("w8a16-g128-zp", False, "gelu", marks=EXHAUSTIVE),
    pytest.param("nvfp4", False, "silu", marks=EXHAUSTIVE),  # groups of 16, global scale
])
def test_prefill_wq_matches_oracle(sid, bias, activation, rng):
  """40 tokens, k = 2 on 4 experts (80 rows in one 128-row allocation: tiles that start inside
  another expert's rows), expert 3 empty, an empty slot; N = 256 (4 gate / up blocks), H = 256
  (2 steps, 2 GEMM2 items)."""
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, sid, 40, 256, 256, 4, 2, bias=bias)
  ids[3, 1] = -1
  ids[:, :] = np.where(ids == 3, 2, ids)
  out = _prefill(x, q13, q2, tw, ids, b13, b2, activation)
  assert out.shape == (40, 256) and np.isfinite(out).all()
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids, b13, b2, activation), TOL,
                       f"{sid} prefill_wq vs oracle")


@pytest.mark.parametrize("sid,h,n", [
    # gpt-oss-like: 2.5 GEMM1 steps, 2.5 GEMM2 row blocks, 1.5 steps
    pytest.param("mxfp8-codes", 320, 192, marks=pytest.mark.slow),
    pytest.param("mxfp4", 320, 192, marks=EXHAUSTIVE),
    pytest.param("w8a16", 192, 320, marks=EXHAUSTIVE),  # per channel
])
def test_prefill_wq_sizes_128_does_not_divide(sid, h, n, rng):
  """H and N multiples of 64, not of 128 (gpt-oss: 2880): the last K step of each GEMM
  shifted back inside K with its overlap zeroed in the A tile, GEMM2's last row block shifted
  back inside H (its overlap written twice)."""
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, sid, 24, h, n, 4, 2, bias=True)
  ids[5, 0] = -1
  out = _prefill(x, q13, q2, tw, ids, b13, b2, "swigluoai")
  assert out.shape == (24, h) and np.isfinite(out).all()
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids, b13, b2, "swigluoai"), TOL,
                       f"{sid} H={h} N={n} prefill_wq vs oracle")


@pytest.mark.slow
@pytest.mark.exhaustive
def test_prefill_wq_one_expert_many_tiles(rng):
  """All 300 slots on one expert (3 row tiles, the last shifted back inside the rows) but
  one slot on another; T = 150."""
  x, q13, q2, tw, ids, _, _ = _problem(rng, "w4a16", 150, 256, 128, 4, 2)
  ids[:, :] = 1
  ids[7, 0] = 2
  out = _prefill(x, q13, q2, tw, ids)
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids), TOL, "one expert, three tiles")


def test_slot_columns_follow_the_tiles():
  """Each slot's column in the task-major output: its tile's task, its row's offset from the
  tile (shifted back inside the rows for a tile reaching past them)."""
  group_sizes = jnp.asarray([5, 0, 130, 3], jnp.int32)  # rows 0-4, 5-134, 135-137
  rows = 144
  meta, nt = gg.tile_metadata(group_sizes, rows, 128)
  inv = jnp.asarray([[0, 4], [5, 134], [135, -1], [137, 100]], jnp.int32)
  cols = np.asarray(grouped_gemm_wq.slot_columns(inv, meta, nt, rows))
  m, n = np.asarray(meta), int(nt[0])
  for r, c in zip(np.asarray(inv).ravel(), cols.ravel()):
    if r < 0:
      assert c == -1
      continue
    task, col = divmod(int(c), 128)
    assert task < n and m[2, task] <= r < m[3, task]  # the task holds row r
    assert min(m[1, task], rows - 128) + col == r


def test_prefill_wq_says_what_it_does_not_take():
  silu = as_activation("silu")
  w = lambda scheme, e, k, n, **kw: quantize_weights(  # noqa: E731
      jnp.ones((e, k, n), jnp.float32), jmoe.QuantConfig(scheme, **kw))
  q13, q2 = w("w4a16", 2, 256, 512), w("w4a16", 2, 256, 256)
  assert grouped_gemm_wq.unsupported(4096, 256, 256, silu, q13, q2) is None
  assert "gated" in grouped_gemm_wq.unsupported(4096, 256, 256, "gelu_no_mul", q13, q2)
  mx = w("mxfp4", 2, 256, 512)
  assert grouped_gemm_wq.unsupported(4096, 256, 256, silu, mx, mx) is None
  fp8 = w("fp8_tensor", 2, 256, 512)
  assert "bf16 tokens, not float8_e4m3fn" in grouped_gemm_wq.unsupported(4096, 256, 256, silu,
                                                                         fp8, fp8)
  g32zp = w("w4a16", 2, 256, 512, group_size=32, zero_point=True)
  assert "zero points need scales per 128" in grouped_gemm_wq.unsupported(
      4096, 256, 256, silu, g32zp, g32zp)
  assert "multiples of 64" in grouped_gemm_wq.unsupported(4096, 160, 256, silu, q13, q2)
  zp = w("w4a16", 2, 256, 512, zero_point=True)
  assert "multiples of 128" in grouped_gemm_wq.unsupported(4096, 192, 256, silu, zp, zp)
  gpt_oss = w("mxfp4", 2, 2880, 5760)  # H = N = 2880: 45 blocks of 64
  assert grouped_gemm_wq.unsupported(4096, 2880, 2880, silu, gpt_oss, gpt_oss) is None
  with pytest.raises(ValueError, match="stages1=1"):
    grouped_gemm_wq.PrefillWQConfig(stages1=1)
  with pytest.raises(ValueError, match="ctas_per_sm=3"):
    grouped_gemm_wq.PrefillWQConfig(ctas_per_sm=3)
  # auto: beyond the decode kernels the warp-specialized GEMMs where they take the sizes
  # (test_pallas_wq_ws.py: multiples of 64, grouped_gemm_wq_ws.TAILS); where not, these
  # while the experts average <= 512 rows, else dequantize
  assert pmoe.weight_only_layout(64, 8, 256, 256, silu, q13, q2) == "prefill_ws"
  odd13, odd2 = (w("w4a16", 2, 256, 384, group_size=64),
                 w("w4a16", 2, 192, 256, group_size=64))  # N = 192
  w8 = w("w8a16", 2, 256, 512), w("w8a16", 2, 256, 256)  # int8: the warp-specialized GEMMs
  assert pmoe.weight_only_layout(64, 8, 256, 256, silu, *w8) == "prefill_ws"
  w8_odd = w("w8a16", 2, 256, 384), w("w8a16", 2, 192, 256)
  assert pmoe.weight_only_layout(64, 8, 256, 192, silu, odd13, odd2) == "prefill_ws"
  assert pmoe.weight_only_layout(64, 8, 256, 192, silu, *w8_odd) == "prefill_ws"
  with pytest.MonkeyPatch.context() as mp:  # their 128-multiple form: these, or dequantize
    mp.setattr(wqws, "TAILS", False)
    assert pmoe.weight_only_layout(64, 8, 256, 192, silu, odd13, odd2) == "prefill"  # 256 an expert
    assert pmoe.weight_only_layout(4096, 2, 256, 192, silu, odd13, odd2) == "dequantize"
    assert pmoe.weight_only_layout(64, 8, 256, 192, silu, *w8_odd) == "dequantize"  # int8


def test_prefill_wq_lowers_for_gpu(monkeypatch):
  """mixtral-8x7b's block at 4096 tokens, w4a16 with zero points: the routing kernels and the
  two weight-only GEMMs."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET", raising=False)
  quant = jmoe.QuantConfig("w4a16", zero_point=True)
  e, k, h, n, t = 8, 2, 4096, 14336, 4096
  w13, w2 = (jax.eval_shape(lambda s=shape: quantize_weights(jnp.zeros(s, jnp.bfloat16), quant))
             for shape in ((e, h, 2 * n), (e, n, h)))
  text = jax.jit(lambda x, w13, w2, tw, ti: pmoe.fused_experts_weight_only(
      x, w13, w2, tw, ti, layout="prefill")).trace(
          S((t, h), jnp.bfloat16), w13, w2, S((t, k), jnp.float32),
          S((t, k), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  kernels = set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text))
  assert {"jmoe_gg_wq_gated", "jmoe_gg_wq"} <= kernels
