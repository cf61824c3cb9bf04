"""Quantized MoE: weight formats, activation quantization, and the fp8 EP dispatch.

Schemes are data (`jmoe.QuantConfig("fp8_block")`, `jmoe.config.QUANT_SCHEMES`); weights are
a pytree (`QuantizedWeights`: values + scales (+ zero points), K-major like checkpoints)
accepted wherever `w13` / `w2` are::

    w13q = jmoe.quant.quantize_weights(w13, "fp8_block")    # [E, H, 2N] -> values [E, 2N, H]
    w2q = jmoe.quant.quantize_weights(w2, "fp8_block")
    y = jmoe.fused_moe(x, w13q, w2q, topk_weights, topk_ids)

`dequantize` is the reference. `quantize_activations` is what `prepare` does to GEMM1's input
and the experts do to GEMM2's. The static schemes (fp8_tensor_static, fp8_channel_static,
int8_static) quantize both with scales fixed in advance: each weight's `input_scale`, from
its checkpoint or `calibrate_input_scales`. Dense weights with a scheme
(`fused_moe(..., quant_config=...)`) train through the quantized forward with a
straight-through bf16 backward (`training`).

The 4-bit formats (w4a16, mxfp4, nvfp4) pack two codes per uint8 along K (`packing`; the
layouts are in `weights`' docstring); `int4_checkpoints` reads GPTQ / AWQ tensors, and
`jmoe.interop.hf` loads gpt-oss MXFP4, GPTQ / AWQ and ModelOpt nvfp4 checkpoints packed. The XLA
experts run every format (the packed ones dequantized in the graph on every call); the Pallas
kernels run every format on Hopper (`jmoe.kernels.moe`: the W8A8 GEMMs, and the weight-only
decode and prefill kernels that convert codes in registers). `prepare_for_kernels` makes
once, after loading, the scale layouts those kernels would otherwise make on every call.
"""
from jmoe.quant.activations import (dequantize_activations, fake_quantize,
                                    quantize_activations)
from jmoe.quant.dispatch import (FP8_DISPATCH_BLOCK, FP8_DISPATCH_DTYPE, dequantize_rows_fp8,
                                 quantize_rows_fp8)
from jmoe.quant import int4_checkpoints, packing
from jmoe.quant.calibration import calibrate_input_scales
from jmoe.quant.kernel_layout import prepare_for_kernels
from jmoe.quant.weights import (QuantizedWeights, check_quantized, dequantize, from_qwix,
                                is_quantized, quantize_weights, weight_bytes)

__all__ = [
    "FP8_DISPATCH_BLOCK", "FP8_DISPATCH_DTYPE", "QuantizedWeights", "calibrate_input_scales",
    "check_quantized",
    "dequantize", "dequantize_activations", "dequantize_rows_fp8", "fake_quantize",
    "from_qwix", "int4_checkpoints", "is_quantized", "packing", "prepare_for_kernels",
    "quantize_activations", "quantize_rows_fp8",
    "quantize_weights", "weight_bytes",
]
