"""Weight and activation quantization formats.

Declared in `jmoe.config.QUANT_FORMATS`; the formats themselves (fp8 tensor/channel/block,
mxfp8, mxfp4, nvfp4, int8) land with the quantization work. Until then the input
quantization hook is the identity for unquantized configs and refuses the others clearly.
"""
from __future__ import annotations

from typing import Optional

import jax

from jmoe.config import QuantConfig


def quantize_activations(a: jax.Array, quant: Optional[QuantConfig]
                         ) -> tuple[jax.Array, Optional[jax.Array]]:
  """a [..., H] -> (a1q, a1_scale). Identity (scale None) when unquantized."""
  if quant is None or not quant.is_quantized:
    return a, None
  raise NotImplementedError(f"activation quantization {quant.format!r} is not implemented yet")
