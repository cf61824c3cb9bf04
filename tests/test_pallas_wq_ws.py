"""The warp-specialized weight-only prefill GEMMs (jmoe.kernels.grouped_gemm_wq_ws: bf16 tokens
over int4 / e2m1 codes converted in registers by two compute warpgroups, 16-bit wgmma with the
weights as A) in Mosaic GPU interpret mode with race detection, against the float64 oracle
on the NumPy unpacking of the stored bytes; the whole block through the prefill_ws layout;
the layout rule and the refusals; the GPU lowering at mixtral-sized experts."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
import oracle_np as onp
from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm_ws as ws
from jmoe.kernels import grouped_gemm_wq_ws as wqws
from jmoe.kernels import moe as pmoe
from jmoe.kernels.activations import as_activation
from jmoe.quant import quantize_weights
from kernel_run import EXHAUSTIVE, run_interpreted
from test_pallas_decode_wq import _problem
from test_quant_formats import np_dequant

TOL = 2e-2
S = jax.ShapeDtypeStruct
needs_interpreter = pytest.mark.skipif(
    not _compat.interpret_available(),
    reason="Mosaic GPU interpret mode (private jax API) unavailable in this jax version")

SPLIT = ws.WSConfig(block_m=256, block_n=64, split_gate_up=True)
TALL = ws.WSConfig(block_m=256, block_n=128)


def grouped_oracle(x, w, sizes, gated, n, bias, rs):
  """float64 rows x [M, K] (sorted, sizes per group) through w [G, K, N_total]: gated silu
  with biases, or ungated times the row scale rs."""
  want, row = [], 0
  for g, size in enumerate(sizes):
    y = x[row:row + size] @ w[g]
    if gated:
      y = y + np.asarray(bias[g], np.float64)
      y = y[:, :n] / (1 + np.exp(-y[:, :n])) * y[:, n:]
    else:
      y = y * np.asarray(rs, np.float64)[row:row + size, None]
    want.append(y)
    row += size
  return np.concatenate(want)


@needs_interpreter
@pytest.mark.parametrize("scheme,gated,config,sizes", [
    ("w4a16", True, SPLIT, (170, 0, 300)),  # groups of 128, gate / up split, 256-token tiles
    ("nvfp4", False, None, (70, 0, 61)),  # groups of 16 (4 a 64-deep MMA), global scale
    ("w8a16", True, None, (70, 0, 61)),  # int8 codes per channel: 128-byte code rows
    pytest.param("w8a16:g128", False, None, (170, 0, 300), marks=pytest.mark.slow),
    pytest.param("mxfp4", True, None, (70, 0, 61), marks=pytest.mark.slow),  # groups of 32
    pytest.param("w4a16:zp", False, TALL, (170, 0, 300), marks=pytest.mark.slow),
    pytest.param("w4a16:channel", True, None, (70, 0, 61), marks=pytest.mark.slow)])
def test_wq_ws_gemm_matches_oracle(scheme, gated, config, sizes, rng):
  """grouped_gemm_wq_ws alone: 3 experts, one empty, tiles starting inside another expert's
  rows and the last tile shifted back, K = 256 (2 steps); gated silu with biases, or
  ungated with a row scale; bf16 tokens (mxfp4: its e8m0 scales as bytes, widened in
  registers); against the float64 oracle on the tokens' bf16 values and the NumPy unpacking
  of the codes (the kernel rounds each scaled code to bf16: the bound is the 4-bit paths'
  2e-2)."""
  name, _, variant = scheme.partition(":")
  if variant == "channel":
    quant = jmoe.QuantConfig("custom", weight_dtype="int4", weight_scale="channel")
  elif variant == "g128":
    quant = jmoe.QuantConfig(name, weight_scale="group", group_size=128)
  else:
    quant = jmoe.QuantConfig(name, zero_point=variant == "zp")
  e, k, n = 3, 256, 256 if config is None else 128
  n_total = 2 * n if gated else n
  q = quantize_weights(jnp.asarray(rng.standard_normal((e, k, n_total)) / 16, jnp.float32),
                       quant)
  sizes = np.array(sizes)
  x = jnp.asarray(rng.standard_normal((int(sizes.sum()), k)), jnp.bfloat16)
  bias = jnp.asarray(0.1 * rng.standard_normal((e, n_total)), jnp.float32) if gated else None
  rs = None if gated else jnp.asarray(rng.uniform(0.5, 1.5, int(sizes.sum())), jnp.float32)
  out = np.asarray(run_interpreted(
      lambda *a, interpret: wqws.grouped_gemm_wq_ws(
          *a, activation="silu" if gated else None, bias=bias, row_scale=rs,
          out_dtype=jnp.float32 if config is None else jnp.bfloat16, config=config,
          interpret=interpret),  # (256-token tiles: bf16 outputs, as the block's; f32
      # ones do not fit shared memory beside a 2-slot ring)
      x, q, jnp.asarray(sizes, jnp.int32)))
  want = grouped_oracle(np.asarray(x.astype(jnp.float32), np.float64), np_dequant(q), sizes, gated,
                 n, bias, rs)
  assert out.shape == (int(sizes.sum()), n) and np.isfinite(out).all()
  onp.assert_rel_close(out, want, TOL, f"wq_ws {scheme} gated={gated} vs oracle")


@needs_interpreter
@pytest.mark.parametrize("fmt,size", [
    # (lean: the prepared-operand test's mxfp4 case at 192, the same block with TAILS, an
    # empty expert and an empty slot)
    pytest.param("mxfp4", 256, marks=pytest.mark.slow),
    # TAILS: gpt-oss-like, 2.5 K steps, the last column tile half past N
    pytest.param("mxfp4", 320, marks=pytest.mark.slow),
    pytest.param("w8a16", 320, marks=pytest.mark.slow),  # int8 code tiles: 64-byte swizzle
    # (w4a16: the GEMM's lean cases and the PallasExperts-vs-XLA prefill_ws case cover it)
    pytest.param("w4a16", 256, marks=EXHAUSTIVE)])
def test_prefill_ws_block_matches_oracle(fmt, size, rng, monkeypatch):
  """fused_experts_weight_only's prefill_ws layout (both GEMMs on the sorted rows, the
  intermediate bf16): 40 tokens, k = 2 on 4 experts (expert 3 empty), an empty slot,
  swigluoai with biases (mxfp4: gpt-oss' form), H = N = size; against the float64 oracle
  with the intermediate rounded to bf16 as the path keeps it. At 320 (as gpt-oss' 2880, 128
  divides neither; `grouped_gemm_wq_ws.TAILS`) the last K step and column tile read past the
  arrays -- the interpreter reads zeros there, as TMA does (it fails with its NaN) -- and the
  last tile's second warpgroup, all past N, stores nothing."""
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, fmt, 40, size, size, 4, 2, bias=True)
  ids[3, 1] = -1
  ids[:, :] = np.where(ids == 3, 2, ids)
  out = np.asarray(run_interpreted(
      lambda *a, interpret: pmoe.fused_experts_weight_only(
          *a, w13_bias=b13, w2_bias=b2, activation="swigluoai", out_dtype=jnp.float32,
          interpret=interpret, layout="prefill_ws"),
      x, q13, q2, jnp.asarray(tw), jnp.asarray(ids)))
  bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)  # noqa: E731
  want = onp.fused_moe(np.asarray(jnp.asarray(x, jnp.float32), np.float64), np_dequant(q13),
                       np_dequant(q2), tw, ids, activation="swigluoai",
                       w13_bias=np.asarray(b13, np.float64),
                       w2_bias=np.asarray(b2, np.float64), requant=bf16)
  assert out.shape == (40, size) and np.isfinite(out).all()
  onp.assert_rel_close(out, want, TOL, f"{fmt} prefill_ws at {size} vs oracle")


def _weights(fmt, e, h, n, **kw):
  quant = jmoe.QuantConfig(fmt, **kw)
  return [jax.eval_shape(lambda s=s: quantize_weights(jnp.zeros(s, jnp.float32), quant))
          for s in ((e, h, 2 * n), (e, n, h))]


def test_prefill_ws_layout_rule_and_refusals():
  """auto takes the warp-specialized GEMMs for 4-bit and int8 codes past the decode kernels
  where they take the sizes (K and N multiples of 64: gpt-oss' 2880; of 128 with TAILS off);
  e4m3 codes, sizes they do not take and groups the kernel lacks are refused naming the
  reason."""
  silu = as_activation("silu")
  for fmt in ("w4a16", "mxfp4", "nvfp4", "w8a16"):
    w = _weights(fmt, 8, 1024, 512)
    assert pmoe.weight_only_layout(4096, 2, 1024, 512, silu, *w) == "prefill_ws", fmt
    assert pmoe.weight_only_layout(1, 2, 1024, 512, silu, *w) == "decode", fmt
  odd = _weights("mxfp4", 128, 2880, 2880)  # gpt-oss-120b: 128 rows an expert
  assert pmoe.weight_only_layout(4096, 4, 2880, 2880, silu, *odd) == "prefill_ws"
  odd2 = _weights("mxfp4", 128, 2880, 2912)  # N = 91 x 32: 64 does not divide it
  assert pmoe.weight_only_layout(4096, 4, 2880, 2912, silu, *odd2) == "dequantize"
  with pytest.raises(ValueError, match="prefill_ws.*multiples of 64"):
    pmoe.weight_only_layout(4096, 4, 2880, 2912, silu, *odd2, layout="prefill_ws")
  with pytest.MonkeyPatch.context() as mp:  # the A/B switch off: 128 again
    mp.setattr(wqws, "TAILS", False)
    assert pmoe.weight_only_layout(4096, 4, 2880, 2880, silu, *odd) == "prefill"
    with pytest.raises(ValueError, match="prefill_ws.*multiples of 128.*TAILS"):
      pmoe.weight_only_layout(4096, 4, 2880, 2880, silu, *odd, layout="prefill_ws")
  w8 = _weights("mxfp8", 8, 1024, 512)
  with pytest.raises(ValueError, match="prefill_ws.*integer or e2m1 codes"):
    pmoe.weight_only_layout(4096, 2, 1024, 512, silu, *w8, layout="prefill_ws")
  assert "zero points with groups of 128" in wqws.unsupported(
      1024, 512, _weights("w4a16", 8, 1024, 512, group_size=64, zero_point=True)[0])
  with pytest.raises(ValueError, match="do not fit shared memory"):
    jax.eval_shape(lambda x: wqws.grouped_gemm_wq_ws(
        x, _weights("w4a16", 8, 1024, 512)[0], jnp.full(8, 512, jnp.int32), activation="silu",
        out_dtype=jnp.float32, config=SPLIT), S((4096, 1024), jnp.bfloat16))
  with pytest.raises(ValueError, match="lhs must be bf16 or f16"):
    jax.eval_shape(lambda x: wqws.grouped_gemm_wq_ws(
        x, _weights("w4a16", 8, 1024, 512)[0], jnp.zeros(8, jnp.int32), activation="silu"),
        S((8, 1024), jnp.float32))


@pytest.mark.parametrize("fmt,preset", [
    ("mxfp4", "mixtral"), ("w8a16", "mixtral"),
    pytest.param("mxfp4", "gpt-oss", marks=pytest.mark.slow),  # (TAILS)
    pytest.param("w4a16", "mixtral", marks=EXHAUSTIVE),
    pytest.param("nvfp4", "mixtral", marks=EXHAUSTIVE),
    pytest.param("nvfp4", "gpt-oss", marks=pytest.mark.slow)])
def test_prefill_ws_lowers_for_the_gpu(fmt, preset, monkeypatch):
  """The block at 4096 tokens on the prefill_ws layout lowers for the GPU: mixtral-8x7b's
  default configs' shared-memory plans at full K fit (Mosaic GPU's lowering checks the
  allocation against the sm_90 limit; 256-token tiles at 1,024 rows an expert, nvfp4's
  128-token ones); gpt-oss-120b's 2880 (swigluoai, biases) with the last K step and column
  tile reaching past the arrays (TAILS)."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET", raising=False)
  e, k, h, n, act = {"mixtral": (8, 2, 4096, 14336, "silu"),
                     "gpt-oss": (128, 4, 2880, 2880, "swigluoai")}[preset]
  t = 4096
  w13, w2 = _weights(fmt, e, h, n)
  text = jax.jit(lambda x, w13, w2, tw, ti, b13, b2: pmoe.fused_experts_weight_only(
      x, w13, w2, tw, ti, w13_bias=b13, w2_bias=b2, activation=act, layout="prefill_ws")).trace(
          S((t, h), jnp.bfloat16), w13, w2, S((t, k), jnp.float32), S((t, k), jnp.int32),
          S((e, 2 * n), jnp.float32), S((e, h), jnp.float32)).lower(
              lowering_platforms=("cuda",)).as_text()
  stem = "jmoe_gg_wq8_ws" if fmt == "w8a16" else "jmoe_gg_wq_ws"
  assert {stem + "_gated", stem} <= set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text))


@pytest.mark.parametrize("fmt", ["nvfp4", pytest.param("mxfp4", marks=pytest.mark.slow),
                                 pytest.param("w8a16", marks=pytest.mark.slow)])
def test_batched_weight_only_block_lowers_for_the_gpu(fmt, monkeypatch):
  """The batched format's weight-only block (fused_experts_weight_only_batched) at
  qwen3-30b-a3b's sizes, capacity 256 an expert, lowers for the GPU on the warp-specialized
  weight-only GEMMs."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET", raising=False)
  e, cap, h, n = 128, 256, 2048, 768
  w13, w2 = _weights(fmt, e, h, n)
  text = jax.jit(lambda x, c, w13, w2: pmoe.fused_experts_weight_only_batched(
      x, c, w13, w2)).trace(S((e, cap, h), jnp.bfloat16), S((e,), jnp.int32), w13, w2).lower(
          lowering_platforms=("cuda",)).as_text()
  stem = "jmoe_gg_wq8_ws" if fmt == "w8a16" else "jmoe_gg_wq_ws"
  assert {stem + "_gated", stem} <= set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text))
