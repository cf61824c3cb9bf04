"""Experts on the Pallas Mosaic GPU grouped-GEMM kernels (Hopper): permute, GEMM1 with the
activation fused, GEMM2 with the router weight and bias fused, gather-sum. They weight and
reduce themselves, so finalize has nothing left to do.

Runs on sm90 GPUs; on other machines only in Pallas' GPU interpret mode (slow: tests), which
`JMOE_PALLAS_INTERPRET=1` or `PallasExperts(interpret=True)` turns on.
"""
from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp

from jmoe.experts._common import check_weights_for_activation
from jmoe.modular import ActivationFormat, Experts, NoOp, local_expert_ids
from jmoe.registry import register_runner

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _interpret_from_env() -> bool:
  return os.environ.get("JMOE_PALLAS_INTERPRET", "0") == "1"


class PallasExperts(Experts):
  name = "pallas_mosaic"
  activation_formats = (ActivationFormat.Standard, ActivationFormat.Standard)
  differentiable = False  # forward kernels only: jax.grad needs the XLA backends

  def __init__(self, interpret: Any = None):
    self.interpret = _interpret_from_env() if interpret is None else interpret

  @classmethod
  def is_available(cls) -> tuple[bool, str]:
    from jmoe.oracle import platform_info  # noqa: PLC0415

    platform, cc, kind = platform_info()
    if platform == "gpu" and cc is not None and cc[0] == 9:
      return True, f"sm{cc[0]}{cc[1]} ({kind})"
    if _interpret_from_env():
      from pallas_kernels import _compat  # noqa: PLC0415
      if _compat.interpret_available():
        return True, "GPU interpret mode (JMOE_PALLAS_INTERPRET=1)"
      return False, f"GPU interpret mode unavailable in this jax"
    where = f"{platform}" + (f" sm{cc[0]}{cc[1]}" if cc else "")
    return False, (f"needs an sm90 (Hopper) GPU, found {where}; JMOE_PALLAS_INTERPRET=1 runs "
                   "the kernels in the CPU interpreter")

  def supports_dtype(self, dtype) -> bool:
    return jnp.dtype(dtype) in _DTYPES

  def finalize_weight_and_reduce_impl(self):
    return NoOp()

  def apply(self, inp, weights, *, activation, expert_map, out_dtype):
    from pallas_kernels.moe import fused_experts  # noqa: PLC0415 (kernels load lazily)

    check_weights_for_activation(weights, activation)
    for name, arr in (("hidden_states", inp.a), ("w13", weights.w13), ("w2", weights.w2)):
      if jnp.dtype(arr.dtype) not in _DTYPES:
        raise ValueError(f"runner_backend='pallas_mosaic' takes bf16/f16 {name}, got "
                         f"{arr.dtype}; use runner_backend='xla' for {arr.dtype}")
    if weights.w13.dtype != inp.a.dtype or weights.w2.dtype != inp.a.dtype:
      raise ValueError("runner_backend='pallas_mosaic' needs hidden_states, w13 and w2 in one "
                       f"dtype, got {inp.a.dtype}, {weights.w13.dtype}, {weights.w2.dtype}")
    e = weights.num_experts
    local = local_expert_ids(inp.topk_ids, e, expert_map)  # non-local / empty -> e (skipped)
    out = fused_experts(inp.a, weights.w13, weights.w2, inp.topk_weights, local,
                        activation=activation, w13_bias=weights.w13_bias,
                        w2_bias=weights.w2_bias, interpret=self.interpret)
    return out.astype(out_dtype)


register_runner("pallas_mosaic", PallasExperts)
