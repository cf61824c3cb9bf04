"""The 8-bit decode kernel (jmoe.kernels.decode_q8) in Mosaic GPU interpret mode with race
detection, against a float64 NumPy oracle of its scheme (tokens per row, the intermediate per
128 columns of each slot), and its GPU lowering at a preset's full size."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
import oracle_np as onp
from jmoe.kernels import _compat
from jmoe.kernels import decode_q8
from jmoe.kernels import moe as pmoe
from jmoe.kernels.activations import as_activation
from jmoe.quant import quantize_activations, quantize_weights
from kernel_run import run_interpreted

pytestmark = pytest.mark.skipif(
    not _compat.interpret_available(),
    reason="Mosaic GPU interpret mode (private jax API) unavailable in this jax version")

TOL = 2e-2
S = jax.ShapeDtypeStruct


def _problem(rng, scheme, t, h, n, e, k, bias=False):
  quant = jmoe.QuantConfig(scheme)
  x = jnp.asarray(2 * rng.standard_normal((t, h)), jnp.float32)
  w13 = rng.standard_normal((e, h, 2 * n)) / np.sqrt(h)
  w13.reshape(-1)[rng.choice(w13.size, 3, replace=False)] *= 30  # outliers the scales follow
  q13 = quantize_weights(jnp.asarray(w13, jnp.float32), quant)
  q2 = quantize_weights(jnp.asarray(rng.standard_normal((e, n, h)) / np.sqrt(n), jnp.float32),
                        quant)
  tw, ids = onp.random_topk(rng, t, e, k)
  b13 = jnp.asarray(0.1 * rng.standard_normal((e, 2 * n)), jnp.float32) if bias else None
  b2 = jnp.asarray(0.1 * rng.standard_normal((e, h)), jnp.float32) if bias else None
  return quant, x, q13, q2, tw, ids, b13, b2


def _oracle(x, q13, q2, tw, ids, quant, b13=None, b2=None):
  """float64: tokens quantized per row (fp8_block: per 128 columns), the intermediate per 128
  columns of each slot."""
  w13, w2 = (np.asarray(w.dequantize(jnp.float32), np.float64) for w in (q13, q2))
  xq = onp.quantize_rows(np.asarray(x, np.float32), quant.act_dtype, quant.act_group_size)
  requant = lambda a: onp.quantize_rows(a, quant.act_dtype, decode_q8.BN)  # noqa: E731
  kw = {}
  if b13 is not None:
    kw = dict(w13_bias=np.asarray(b13, np.float64), w2_bias=np.asarray(b2, np.float64))
  return onp.fused_moe(xq, w13, w2, tw, ids, activation="silu", requant=requant, **kw)


def _run(x, q13, q2, tw, ids, quant, **kw):
  xq, xs = quantize_activations(x, quant)
  return np.asarray(run_interpreted(decode_q8.fused_experts_decode_q8, xq, xs, q13, q2,
                                    jnp.asarray(tw), jnp.asarray(ids), out_dtype=jnp.float32,
                                    **kw))


@pytest.mark.parametrize("scheme,bias", [("fp8_channel", True),
                                         pytest.param("int8", False, marks=pytest.mark.slow)])
def test_decode_q8_matches_oracle(scheme, bias, rng):
  """Two items per slot (N = 256), an empty slot (-1), an expert no slot uses, T = 3."""
  quant, x, q13, q2, tw, ids, b13, b2 = _problem(rng, scheme, 3, 256, 256, 4, 2, bias=bias)
  ids[1, 1] = -1
  ids[:, :] = np.where(ids == 3, 2, ids)
  out = _run(x, q13, q2, tw, ids, quant, w13_bias=b13, w2_bias=b2)
  assert out.shape == (3, 256) and np.isfinite(out).all()
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids, quant, b13, b2), TOL,
                       f"{scheme} decode_q8 vs oracle")


@pytest.mark.slow
def test_decode_q8_fp8_block_matches_oracle(rng):
  """fp8_block (128 x 128 weight blocks, tokens per 128 columns): H = 1536 is 12 groups, one
  whole window of 8 and a partial one; two items per slot, biases, an empty slot, T = 3."""
  quant, x, q13, q2, tw, ids, b13, b2 = _problem(rng, "fp8_block", 3, 1536, 256, 4, 2,
                                                 bias=True)
  ids[1, 1] = -1
  assert decode_q8.supports(3, 2, 1536, 256, "silu", quant)
  out = _run(x, q13, q2, tw, ids, quant, w13_bias=b13, w2_bias=b2)
  assert out.shape == (3, 1536) and np.isfinite(out).all()
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids, quant, b13, b2), TOL,
                       "fp8_block decode_q8 vs oracle")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ("fp8_tensor", "fp8_channel", "int8"))
def test_decode_q8_one_token_all_schemes(scheme, rng):
  quant, x, q13, q2, tw, ids, _, _ = _problem(rng, scheme, 1, 512, 128, 8, 2)
  out = _run(x, q13, q2, tw, ids, quant)
  onp.assert_rel_close(out, _oracle(x, q13, q2, tw, ids, quant), TOL, f"{scheme} T=1")


def test_static_scheme_decodes_with_its_token_scale(rng, monkeypatch):
  """fp8_tensor_static at one token takes the decode kernel through fused_moe: the token
  quantized with w13's static input_scale, the intermediate per 128 columns (the kernel's own,
  finer than w2's static scale)."""
  monkeypatch.setenv("JMOE_PALLAS_INTERPRET", "1")
  quant = jmoe.QuantConfig("fp8_tensor_static")
  t, h, n, e, k = 1, 256, 256, 8, 2
  x = jnp.asarray(2 * rng.standard_normal((t, h)), jnp.bfloat16)
  w13 = jnp.asarray(rng.standard_normal((e, h, 2 * n)) / np.sqrt(h), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((e, n, h)) / np.sqrt(n), jnp.float32)
  tw, ids = onp.random_topk(rng, t, e, k)
  s13 = float(jnp.max(jnp.abs(x.astype(jnp.float32)))) / 448 * 0.5  # the largest saturate
  q13 = quantize_weights(w13, quant, input_scale=s13)
  q2 = quantize_weights(w2, quant, input_scale=1.0)  # unused by the decode kernel
  assert pmoe.quantized_layout(t, k, e, h, n, as_activation("silu"), quant) == "decode"
  out = jmoe.fused_moe(x, q13, q2, jnp.asarray(tw), jnp.asarray(ids),
                       runner_backend="pallas_mosaic")
  assert not _compat.races_found()
  d13, d2 = (np.asarray(w.dequantize(jnp.float32), np.float64) for w in (q13, q2))
  xq = onp.quantize_static(np.asarray(x, np.float32), quant.act_dtype, np.float32(s13))
  requant = lambda a: onp.quantize_rows(a, quant.act_dtype, decode_q8.BN)  # noqa: E731
  ref = onp.fused_moe(xq, d13, d2, tw, ids, requant=requant)
  onp.assert_rel_close(np.asarray(out, np.float32), ref, TOL, "fp8_tensor_static decode")


def test_quantized_block_takes_the_decode_kernel_and_refuses_bad_input():
  """The layout rule (decode where slots rarely share an expert and the scheme's scales are
  constant along K), the explicit layout's errors, and the kernel's shape checks."""
  silu = as_activation("silu")
  ch, blk = jmoe.QuantConfig("fp8_channel"), jmoe.QuantConfig("fp8_block")
  assert pmoe.quantized_layout(1, 8, 128, 2048, 768, silu, ch) == "decode"
  assert pmoe.quantized_layout(64, 8, 128, 2048, 768, silu, ch) == "sorted"
  assert pmoe.quantized_layout(1, 8, 128, 2048, 768, silu, blk) == "decode"
  blk64 = jmoe.QuantConfig("fp8_block", block_shape=(128, 64))  # blocks an item does not fit
  assert pmoe.quantized_layout(1, 8, 128, 2048, 768, silu, blk64) == "sorted"
  assert not decode_q8.supports(1, 8, 1280, 768, silu, blk)  # H / 128 not a multiple of 4
  with pytest.raises(ValueError, match="does not take"):
    pmoe.quantized_layout(1, 8, 128, 2048, 768, silu, blk64, layout="decode")
  with pytest.raises(ValueError, match="layout="):
    pmoe.quantized_layout(1, 8, 128, 2048, 768, silu, ch, layout="fast")
  qw = quantize_weights(jnp.ones((2, 256, 128), jnp.float32), ch)  # H = 256, N = 64
  q2 = quantize_weights(jnp.ones((2, 64, 256), jnp.float32), ch)
  xq = jnp.ones((1, 256), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="N=64 of 128"):
    decode_q8.fused_experts_decode_q8(xq, jnp.ones((1, 1)), qw, q2, jnp.ones((1, 2)),
                                      jnp.zeros((1, 2), jnp.int32))


@pytest.mark.parametrize("scheme,preset", [("fp8_channel", "qwen3-30b-a3b"),
                                           ("fp8_block", "deepseek-v3")])
def test_decode_q8_lowers_for_gpu(scheme, preset, monkeypatch):
  """A preset's block at 1 token through fused_experts_quantized: one decode kernel."""
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET", raising=False)
  quant = jmoe.QuantConfig(scheme)
  c = jmoe.PRESETS[preset]
  e, k, h, n, t = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, 1
  dt = jnp.float8_e4m3fn
  block = scheme == "fp8_block"

  def qw(n_out, n_in):
    scale = (n_out // 128, n_in // 128) if block else (n_out, 1)
    return jmoe.quant.QuantizedWeights(values=S((e, n_out, n_in), dt),
                                       scale=S((e, *scale), jnp.float32), scheme=quant)

  text = jax.jit(lambda x, s, w13, w2, tw, ti: pmoe.fused_experts_quantized(
      x, s, w13, w2, tw, ti)).trace(
          S((t, h), dt), S((t, h // 128 if block else 1), jnp.float32), qw(2 * n, h), qw(h, n),
          S((t, k), jnp.float32), S((t, k), jnp.int32)).lower(
              lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"jmoe_[a-z0-9_]+?(?=_mosaic_gpu|\")", text)) == {"jmoe_moe_decode_q8"}
