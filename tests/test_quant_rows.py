"""CPU tests of jmoe.kernels.quant_rows (dynamic per-row / per-group activation quantization in
one kernel), in Pallas interpret mode: the codes and scales equal
jmoe.quant.activations.quantize_activations' exactly, and the dequantized values equal the
float64 NumPy oracle's; the Triton lowering for the GPU takes the shapes the 8-bit block uses.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jmoe
from jmoe.kernels import quant_rows as qr
from jmoe.quant.activations import dequantize_activations, quantize_activations

import oracle_np as onp

pytestmark = pytest.mark.skipif(not qr.available(),
                                reason="the Pallas Triton lowering does not import")

# (scheme, group): per row into e4m3 and int8, per 128 columns into e4m3 (fp8_block's tokens);
# mxfp4_fp8's rows take power-of-two scales (its intermediate), mxfp8's groups of 32 too
FORMATS = [("fp8_channel", None), ("int8", None), ("fp8_block", 128), ("mxfp4_fp8", None),
           ("mxfp8", 32)]


@pytest.mark.parametrize("scheme,group", FORMATS)
@pytest.mark.parametrize("rows,width", [(7, 256), (48, 768), (37, 1792)])
def test_codes_and_scales_equal_the_reference(scheme, group, rows, width, rng):
  """Row counts that 16 does not divide (7: blocks of 4 rows at rows 0 and 3; 37: 16-row
  blocks, the last shifted back to rows 21-36, over rows the one before wrote), widths whose
  chunks are not powers of two (768 = 3 x 256, 1792 = 7 x 256); a zero row (scale 1), a row of one huge value and
  tiny ones (the huge one at +-qmax exactly, the rest rounding to 0 or small codes)."""
  quant = jmoe.QuantConfig(scheme)
  x = rng.standard_normal((rows, width)).astype(np.float32) * 3
  x[1] = 0.0
  x[2] = 1e-3 * x[2]
  x[2, 5] = -4e4
  x = jnp.asarray(x, jnp.bfloat16)
  pow2 = quant.scale_dtype == "float8_e8m0fnu"
  q, scale = qr.quantize_rows(x, quant.act_dtype, group=group, pow2=pow2, interpret=True)
  q_ref, scale_ref = quantize_activations(x, quant)
  assert q.dtype == q_ref.dtype and scale.shape == scale_ref.shape
  np.testing.assert_array_equal(np.asarray(scale), np.asarray(scale_ref))
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_ref, np.float32))
  deq = np.asarray(dequantize_activations(q, scale), np.float64)
  assert np.isfinite(deq).all()
  # the reference's x / scale on XLA (as a product with the reciprocal) and NumPy's quotient
  # may round a value at a code boundary apart: a code in a thousand one step off
  onp.assert_rel_close(deq, onp.quantize_rows(x, quant.act_dtype, group, e8m0=pow2), 1e-2,
                       scheme)


def test_int8_rounds_half_to_even():
  """Codes at exact ties round as jnp.round does (half to even), from floor in the kernel."""
  v = jnp.asarray([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -3.5, 0.49999997, 3.4999998], jnp.float32)
  np.testing.assert_array_equal(np.asarray(qr._round_half_even(v)), np.round(np.asarray(v)))
  # through the kernel: a row scaled so that its amax is 127 and the others land on ties
  x = jnp.asarray([[127.0, 0.5, 1.5, 2.5, -2.5, 3.5, 4.5, -5.5] * 2], jnp.float32)
  q, scale = qr.quantize_rows(x, "int8", interpret=True)
  assert float(scale[0, 0]) == 1.0
  np.testing.assert_array_equal(np.asarray(q), np.round(np.asarray(x)).astype(np.int8))


def test_unsupported_shapes_name_the_reason():
  assert not qr.supports(16, 24, jnp.float8_e4m3fn)           # 8-column chunks
  assert not qr.supports(16, 256, jnp.bfloat16)                # not an 8-bit code type
  assert not qr.supports(16, 256, jnp.float8_e4m3fn, group=96)  # not a power of two
  assert qr.supports(16, 2880, jnp.float8_e4m3fn)              # gpt-oss: 64-column chunks
  with pytest.raises(ValueError, match=r"quantize_rows: x \(4, 24\)"):
    qr.quantize_rows(jnp.zeros((4, 24), jnp.bfloat16), jnp.float8_e4m3fn)


@pytest.mark.parametrize("width,group,pow2", [(768, None, False), (2048, 128, False),
                                              (7168, 128, False), (14336, None, True)])
def test_lowers_for_gpu(width, group, pow2):
  """The Triton lowering takes the per-row form at qwen3's intermediate width (and at
  mixtral's with mxfp4_fp8's power-of-two scales: their bit operations) and the group form at
  qwen3's / deepseek-v3's token widths (e4m3 casts need compute capability 8.9+)."""
  x = jax.ShapeDtypeStruct((4096, width), jnp.bfloat16)
  text = jax.jit(lambda a: qr.quantize_rows(a, jnp.float8_e4m3fn, group=group, pow2=pow2)
                 ).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  name = "jmoe_quant_rows" if group is None else "jmoe_quant_groups"
  assert re.search(name, text), name


@pytest.mark.parametrize("scheme", ["fp8_channel", "fp8_block", "mxfp8"])
def test_quantize_activations_takes_the_kernel(scheme, rng, monkeypatch):
  """prepare's quantize_activations runs the kernel where the kernels run (the interpreter
  here; on a GPU the lowering below), batched [E, C, H] rows included, with the jnp form's
  values; ROWS_KERNEL=False keeps the jnp form."""
  from jmoe.quant import activations
  quant = jmoe.QuantConfig(scheme)
  x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.bfloat16)
  monkeypatch.setattr(activations, "ROWS_KERNEL", False)
  want = quantize_activations(x, quant)
  monkeypatch.setattr(activations, "ROWS_KERNEL", True)
  monkeypatch.setenv("JMOE_PALLAS_INTERPRET", "1")
  assert activations._rows_kernel_applies(x, quant)
  got = quantize_activations(x, quant)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  # on a Hopper GPU, not interpreted: the kernel is in the lowered program
  from jmoe import oracle
  monkeypatch.delenv("JMOE_PALLAS_INTERPRET")
  monkeypatch.setattr(oracle, "platform_info", lambda: ("gpu", (9, 0), "NVIDIA H100"))
  text = jax.jit(lambda a: quantize_activations(a, quant)).trace(
      jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)).lower(
          lowering_platforms=("cuda",)).as_text()
  assert re.search("jmoe_quant_(rows|groups)", text)
  # an A100 (no e4m3 casts in Triton) and the CPU, not interpreted: the jnp form
  for where in (("gpu", (8, 0), "NVIDIA A100"), ("cpu", None, "cpu")):
    monkeypatch.setattr(oracle, "platform_info", lambda where=where: where)
    assert not activations._rows_kernel_applies(x, quant)
