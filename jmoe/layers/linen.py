"""`jmoe.layers.linen.MoE`: the nnx layer for flax.linen models (through `nnx.bridge`).

    moe = jmoe.layers.linen.MoE(config)                       # a linen Module
    variables = moe.init(key, x)                              # {"params": ..., "batch_stats": ...}
    y, aux = moe.apply(variables, x, return_aux=True)

Parameters live in "params" with the nnx layer's names, shapes and sharding metadata
(`flax.linen.get_partition_spec(variables)` gives the specs); the DeepSeek correction bias
lives in "batch_stats" (update it with `jmoe.layers.correction_bias_update`).
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.nnx import bridge

from jmoe.config import MoEConfig, ParallelConfig
from jmoe.layers.moe import MoE as NnxMoE


class MoE(nn.Module):
  """x [..., H] -> [..., H] (and the aux dict with `return_aux=True`); the fields are the nnx
  layer's constructor arguments (see `jmoe.layers.MoE`)."""

  config: MoEConfig
  dtype: Any = None
  param_dtype: Any = jnp.float32
  runner_backend: Optional[str] = None
  a2a_backend: str = "auto"
  parallel: Optional[ParallelConfig] = None
  quant: Any = None
  capacity_factor: Optional[float] = None
  expert_axis: Optional[str] = "expert"
  tensor_axis: Optional[str] = "tensor"

  @nn.compact
  def __call__(self, x: jax.Array, *, return_aux: bool = False):
    layer = bridge.to_linen(
        NnxMoE, self.config, dtype=self.dtype, param_dtype=self.param_dtype,
        runner_backend=self.runner_backend, a2a_backend=self.a2a_backend,
        parallel=self.parallel, quant=self.quant, capacity_factor=self.capacity_factor,
        expert_axis=self.expert_axis, tensor_axis=self.tensor_axis, name="moe")
    return layer(x, return_aux=return_aux)
