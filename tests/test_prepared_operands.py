"""Kernel operands prepared once from quantized weights (`jmoe.quant.prepare_for_kernels`,
`jmoe.kernels.prepared`): which operands each layout gets, that the prefill kernels read the
prepared arrays and not the stored scales (the stored ones poisoned with NaN, the output
still the float64 oracle's; interpret mode with race detection), the refusals, the pytree
and expert-slicing rules, and the flax layer holding and re-making them."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmoe
import oracle_np as onp
from jmoe.kernels import _compat
from jmoe.kernels import moe as pmoe
from jmoe.kernels import prepared
from jmoe.layers import MoE
from jmoe.quant import prepare_for_kernels, quantize_activations, quantize_weights
from jmoe.quant.activations import dequantize_activations
from kernel_run import EXHAUSTIVE, run_interpreted
from test_pallas_decode_wq import _oracle, _problem
from test_pallas_w4a8 import _fp8_per_row
from test_quant_formats import np_dequant

TOL = 2e-2
needs_interpreter = pytest.mark.skipif(
    not _compat.interpret_available(),
    reason="Mosaic GPU interpret mode (private jax API) unavailable in this jax version")


def _weights(fmt, e=4, h=256, n=256, seed=0, **kw):
  rng = np.random.default_rng(seed)
  quant = jmoe.QuantConfig(fmt, **kw)
  return [quantize_weights(jnp.asarray(rng.standard_normal(s) / 16, jnp.float32), quant)
          for s in ((e, h, 2 * n), (e, n, h))]


@pytest.mark.parametrize("fmt,kw,h,want13", [
    ("mxfp4", {}, 256, {"wq_ws.scale_bytes": ("uint8", (4, 8, 512)),
                        "wq_ws.columns": ("float32", (4, 512))}),
    ("nvfp4", {}, 256, {"wq_ws.scale.bfloat16": ("bfloat16", (4, 16, 512))}),
    ("w4a16", dict(zero_point=True), 256, {"wq_ws.scale.bfloat16": ("bfloat16", (4, 2, 512)),
                                           "wq_ws.zero": ("uint8", (4, 2, 512))}),
    # 128 not dividing H: prefill_ws' (grouped_gemm_wq_ws.TAILS: K and N multiples of 64;
    # decode_wq's padded byte scales below: it takes H >= 256); e4m3 codes: grouped_gemm_wq's
    ("mxfp4", {}, 192, {"wq_ws.scale_bytes": ("uint8", (4, 6, 512)),
                        "wq_ws.columns": ("float32", (4, 512))}),
    ("mxfp8", {}, 256, {"wq.scale": ("float32", (4, 8, 512))}),
    ("mxfp4_fp8", {}, 256, {"w4a8.shifts": ("uint8", (4, 8, 512)),
                            "w4a8.w_scale": ("float32", (4, 512))}),
    ("nvfp4_fp8", {}, 256, {"wq_ws.scale.bfloat16": ("bfloat16", (4, 16, 512))}),
])
def test_prepare_keeps_the_operands_of_the_layouts_that_can_run(fmt, kw, h, want13):
  """prepare_for_kernels gives w13 the prefill layout's operands (prefill_ws where auto takes
  it, grouped_gemm_wq's float32 scales elsewhere, grouped_gemm_w4a8's shifts for
  mxfp4 with fp8 tokens, the bf16-token ones where fp8 tokens are dequantized), each equal to
  what the kernel would make per call; the stored arrays are the same objects."""
  w13, w2 = _weights(fmt, h=h, **kw)
  p13, p2 = prepare_for_kernels(w13, w2)
  got = {k: (jnp.dtype(a.dtype).name, tuple(a.shape)) for k, a in p13.prepared.items()}
  assert got == want13
  assert (set(p2.prepared) - {"decode_wq.w2_scale_bytes"}
          == set(want13) - {"decode_wq.w13_scale_bytes"})  # (decode: below)
  assert p13.values is w13.values and p13.scale is w13.scale and p13.zero is w13.zero
  ops = {op.key: op for op in _operands_of(p13)}
  for key, a in p13.prepared.items():
    np.testing.assert_array_equal(np.asarray(a), np.asarray(ops[key].make(w13)), err_msg=key)


def _operands_of(w):
  from jmoe.kernels import decode_wq, grouped_gemm_w4a8, grouped_gemm_wq, grouped_gemm_wq_ws
  view = pmoe.weight_only_view(w)
  return (grouped_gemm_w4a8.OPERANDS + grouped_gemm_wq.operands(view)
          + grouped_gemm_wq_ws.operands(view, jnp.bfloat16)
          + (decode_wq.W13_SCALE_BYTES, decode_wq.W2_SCALE_BYTES))


def test_prepare_token_dtype_and_schemes_without_operands():
  """float16 tokens get float16 scale copies; int8 codes per channel (w8a16) their float32
  column factors; the W8A8 schemes (read as stored) come back without prepared operands."""
  p13, _ = prepare_for_kernels(*_weights("w4a16"), dtype=jnp.float16)
  assert set(p13.prepared) == {"wq_ws.scale.float16"}
  assert p13.prepared["wq_ws.scale.float16"].dtype == jnp.float16
  p13, _ = prepare_for_kernels(*_weights("w8a16"))
  assert set(p13.prepared) == {"wq_ws.columns"}
  w13, w2 = _weights("fp8_block")
  p13, p2 = prepare_for_kernels(w13, w2)
  assert p13.prepared is None and p2.prepared is None


def test_prepare_refusals():
  """Dense weights, two schemes, a token dtype the kernels lack: each a clear error; a
  prepared operand from other weights is refused at trace time naming its key and the fix;
  a prepared array without one row per expert fails check_quantized."""
  w13, w2 = _weights("mxfp4")
  with pytest.raises(TypeError, match="w13 must be jmoe.quant.QuantizedWeights"):
    prepare_for_kernels(jnp.zeros((4, 256, 512)), w2)
  with pytest.raises(ValueError, match="one scheme"):
    prepare_for_kernels(w13, _weights("nvfp4")[1])
  with pytest.raises(ValueError, match="dtype.*bfloat16 or float16"):
    prepare_for_kernels(w13, w2, dtype=jnp.float32)
  p13, _ = prepare_for_kernels(*_weights("mxfp4", h=384))  # other weights' operands
  stale = dataclasses.replace(w13, prepared=p13.prepared)
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((512, 2), jnp.int32)
  with pytest.raises(ValueError, match=r"prepared\['wq_ws.scale_bytes'\].*Prepare again"):
    jax.eval_shape(lambda x, ti: pmoe.fused_experts_weight_only(
        x, stale, w2, ti.astype(jnp.float32), ti, layout="prefill_ws"), x, ids)
  bad = dataclasses.replace(w13, prepared={"wq_ws.columns": jnp.zeros((3, 512))})
  with pytest.raises(ValueError, match=r"w13.prepared\['wq_ws.columns'\] must be \[E=4"):
    jmoe.quant.check_quantized(bad, argname="w13")


def test_prepared_operands_follow_the_experts():
  """take_experts gathers the prepared rows with the values (EP's local experts, the touched
  experts); with_k_major drops them; under jit they are ordinary pytree leaves."""
  p13, _ = prepare_for_kernels(*_weights("nvfp4"))
  idx = jnp.array([2, 0])
  sub = p13.take_experts(idx)
  for k, a in p13.prepared.items():
    np.testing.assert_array_equal(np.asarray(sub.prepared[k]), np.asarray(a)[[2, 0]])
  assert p13.with_k_major(False).prepared is None
  leaves = jax.tree.leaves(p13)
  assert any(a is p13.prepared["wq_ws.scale.bfloat16"] for a in leaves)
  jitted = jax.jit(lambda a, b: prepare_for_kernels(a, b)[0])(*_weights("nvfp4"))
  np.testing.assert_array_equal(np.asarray(jitted.prepared["wq_ws.scale.bfloat16"]),
                                np.asarray(p13.prepared["wq_ws.scale.bfloat16"]))


def _poisoned(w):
  """w with its stored scales (and zero points) NaN / garbage: only prepared operands can
  give the right output."""
  z = None if w.zero is None else jnp.full_like(w.zero, 3)
  return dataclasses.replace(w, scale=jnp.full_like(w.scale, jnp.nan), zero=z)


@needs_interpreter
@pytest.mark.parametrize("sid,h,layout", [
    pytest.param("mxfp4", 256, "prefill_ws", marks=EXHAUSTIVE),  # (lean: at 192, below)
    ("mxfp4", 192, "auto"),  # 128 does not divide H = N = 192 (prefill or prefill_ws)
    pytest.param("mxfp8", 256, "prefill", marks=pytest.mark.slow),  # grouped_gemm_wq
    pytest.param("nvfp4", 256, "prefill_ws", marks=EXHAUSTIVE),  # (bf16 copies: as w4a16-zp)
    pytest.param("w4a16-zp", 256, "prefill_ws", marks=pytest.mark.slow),
    pytest.param("mxfp4_fp8", 256, "prefill_fp8", marks=pytest.mark.slow)])
def test_prefill_reads_the_prepared_operands(sid, h, layout, rng):
  """The prefill layouts on prepared weights whose stored scales are poisoned: 40 tokens,
  k = 2 over 4 experts (expert 3 empty), an empty slot, swigluoai with biases; the output is
  the float64 oracle's on the unpoisoned weights (the stored scales were not read)."""
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, sid, 40, h, h, 4, 2, bias=True)
  ids[3, 1] = -1
  ids[:, :] = np.where(ids == 3, 2, ids)
  p13, p2 = prepare_for_kernels(q13, q2, activation="swigluoai")
  kw = dict(w13_bias=b13, w2_bias=b2, activation="swigluoai", out_dtype=jnp.float32,
            layout=layout)
  if q13.scheme.act_dtype is not None:  # fp8 tokens
    x, xs = quantize_activations(x, q13.scheme)
    kw["x_scale"] = xs
  out = np.asarray(run_interpreted(
      lambda *a, interpret: pmoe.fused_experts_weight_only(*a, interpret=interpret, **kw),
      x, _poisoned(p13), _poisoned(p2), jnp.asarray(tw), jnp.asarray(ids)))
  assert np.isfinite(out).all()
  if sid == "mxfp4_fp8":
    x_hat = np.asarray(x.astype(jnp.float32), np.float64) * np.asarray(xs, np.float64)
    want = onp.fused_moe(x_hat, np_dequant(q13), np_dequant(q2), tw, ids,
                         activation="swigluoai", w13_bias=np.asarray(b13, np.float64),
                         w2_bias=np.asarray(b2, np.float64), requant=_fp8_per_row)
  else:  # (mxfp8: its fp8 tokens' values in bf16, the intermediate bf16)
    x_hat = x if sid != "mxfp8" else dequantize_activations(x, xs)
    want = _oracle(jnp.asarray(x_hat, jnp.float32), q13, q2, tw, ids, b13, b2, "swigluoai")
  onp.assert_rel_close(out, want, TOL, f"{sid} {layout} on prepared operands")


def test_operand_without_prepared_arrays_makes_them():
  """operand() on weights that carry none makes the array from the stored ones."""
  w13, _ = _weights("mxfp4")
  op = prepared.Operand("wq_ws.columns", lambda w: jnp.ones(w.values.shape[:2]))
  assert prepared.operand(w13, op).shape == (4, 512)


def test_layer_holds_and_remakes_prepared_operands():
  """A quantized MoE layer with prepare_for_kernels holds the operands as variables beside
  the weights; load_params replaces every part -- nvfp4's global scales included -- and
  makes the operands again from the loaded weights."""
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=256)
  layer = MoE(cfg, rngs=nnx.Rngs(0), quant="nvfp4", prepare_for_kernels=True,
                          dtype=jnp.bfloat16)
  held = layer.params().w13
  assert set(held.prepared) == {"wq_ws.scale.bfloat16"}
  w13, w2 = _weights("nvfp4", seed=1)
  w13 = dataclasses.replace(w13, global_scale=w13.global_scale * 3)  # unlike the layer's
  layer.load_params(dataclasses.replace(layer.params(), w13=w13, w2=w2))
  got = layer.params()
  np.testing.assert_array_equal(np.asarray(got.w13.global_scale), np.asarray(w13.global_scale))
  want13, _ = prepare_for_kernels(w13, w2, activation=cfg.act)
  np.testing.assert_array_equal(np.asarray(got.w13.prepared["wq_ws.scale.bfloat16"]),
                                np.asarray(want13.prepared["wq_ws.scale.bfloat16"]))
  plain = MoE(cfg, rngs=nnx.Rngs(0), quant="nvfp4", prepare_for_kernels=False)
  assert plain.params().w13.prepared is None


@pytest.mark.slow
def test_prepared_weights_shard_over_the_expert_axis(rng):
  """EP on 8 simulated devices: prepared operands shard over the expert axis with the
  values (shard_expert_weights, prepare_for_kernels on the sharded weights both work); the
  block equals the one-device block on the unprepared weights."""
  from jmoe import sharding
  t, h, n, e = 16, 128, 128, 8
  q13, q2 = _weights("nvfp4", e=e, h=h, n=n)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  tw, ids = (jnp.asarray(a) for a in onp.random_topk(rng, t, e, 2))
  ref = jmoe.fused_moe(x, q13, q2, tw, ids)
  par = sharding.make_parallel(data=2, expert=4)
  s13, s2 = (sharding.shard_expert_weights(w, par) for w in (q13, q2))
  p13, p2 = prepare_for_kernels(s13, s2)
  assert p13.prepared["wq_ws.scale.bfloat16"].sharding.spec[0] == par.expert_axis
  f = jax.jit(lambda *a: jmoe.fused_moe(*a, parallel=par, a2a_backend="ragged_a2a"))
  out = f(sharding.shard_tokens(x, par), p13, p2, tw, ids)
  onp.assert_rel_close(np.asarray(out), np.asarray(ref), 1e-5, "prepared nvfp4 over EP")


def test_checkpoint_layer_is_prepared_on_load():
  """moe_layer_from_params (the checkpoint loaders' layer: built abstract, then loaded) makes
  the operands from the loaded weights."""
  from jmoe.interop.checkpoints import moe_layer_from_params
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=256)
  w13, w2 = _weights("mxfp4", seed=2)
  template = MoE(cfg, rngs=nnx.Rngs(0), quant="mxfp4", prepare_for_kernels=False).params()
  layer = moe_layer_from_params(cfg, dataclasses.replace(template, w13=w13, w2=w2),
                                prepare_for_kernels=True)
  got = layer.params().w2.prepared["wq_ws.scale_bytes"]
  want = prepare_for_kernels(w13, w2)[1].prepared["wq_ws.scale_bytes"]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@needs_interpreter
@pytest.mark.parametrize("h,n,bias", [pytest.param(512, 256, False, marks=pytest.mark.slow),
                                        (320, 320, True)])
def test_decode_reads_prepared_byte_scales(h, n, bias, rng):
  """decode_wq with e8m0 byte scales whose rows are not TMA's 16-byte pitch: w2's 8 bytes at
  N = 256 (qwen3 mxfp4's are 24), and at gpt-oss-like sizes (320: `padded_sizes`) w13's and
  w2's 10, w13's also padded to the padded H's windows. Those rows are prepared; with the
  stored scales they replace poisoned the output is still the oracle's."""
  x, q13, q2, tw, ids, b13, b2 = _problem(rng, "mxfp4", 2, h, n, 8, 2, bias=bias)
  p13, p2 = prepare_for_kernels(q13, q2, activation="swigluoai")
  assert p2.prepared["decode_wq.w2_scale_bytes"].shape == (8, h, 16)
  if h % 128:
    assert p13.prepared["decode_wq.w13_scale_bytes"].shape == (8, 2 * n, 16)
    p13 = dataclasses.replace(p13, scale=jnp.full_like(p13.scale, jnp.nan))
  poisoned = dataclasses.replace(p2, scale=jnp.full_like(p2.scale, jnp.nan))
  out = np.asarray(run_interpreted(
      lambda *a, interpret: pmoe.fused_experts_weight_only(
          *a, out_dtype=jnp.float32, interpret=interpret, layout="decode",
          activation="swigluoai", w13_bias=b13, w2_bias=b2),
      x, p13, poisoned, jnp.asarray(tw), jnp.asarray(ids)))
  assert np.isfinite(out).all()
  want = _oracle(jnp.asarray(x, jnp.float32), q13, q2, tw, ids, b13, b2, "swigluoai")
  onp.assert_rel_close(out, want, TOL, f"mxfp4 decode on prepared byte scales (H={h})")


@pytest.mark.parametrize("sid,h", [("w4a16", 1024), ("w4a16-zp", 2048)])
def test_decode_reduction_reads_prepared_w2_scales(sid, h, rng):
  """decode_wq leaves w2's scales per 128 to the reduction after the kernel; prepared, it
  reads them as [E, N / 128, H] (`decode_wq.W2_SCALE_T`, float32: the same products as the
  stored layout's). The reduction (zero points' term included) on parts of random slots, an
  empty one too, with the stored scales poisoned equals the one on the stored scales, bit
  for bit."""
  from jmoe.kernels import decode_wq
  x, q13, q2, tw, ids, _, _ = _problem(rng, sid, 3, h, 256, 8, 2)
  p13, p2 = prepare_for_kernels(q13, q2)
  assert p2.prepared[decode_wq.W2_SCALE_T.key].shape == (8, 2, h)
  assert decode_wq.W2_SCALE_T.key not in (p13.prepared or {})  # (GEMM1's are the kernel's)
  ids = jnp.asarray(ids).reshape(-1).at[1].set(-1)
  plan = decode_wq._plan(q13, q2, False)
  part = jnp.asarray(rng.standard_normal((2, ids.shape[0], h)), jnp.float32)
  asum = jnp.asarray(rng.standard_normal((2, ids.shape[0], 8)), jnp.float32)
  want = decode_wq._w2_scaled(part, asum, ids, q2, plan, 8)
  poisoned = dataclasses.replace(p2, scale=jnp.full_like(p2.scale, jnp.nan))
  got = decode_wq._w2_scaled(part, asum, ids, poisoned, plan, 8)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
