"""`jmoe.layers.MoE`: a flax.nnx MoE block (router + routed experts + shared experts)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.block import MoEParams, init_params, moe_block
from jmoe.config import MoEConfig

_PARAM_FIELDS = ("router_w", "w13", "w2", "router_b", "correction_bias", "w13_bias", "w2_bias",
                 "shared_w13", "shared_w2", "shared_gate")


class MoE(nnx.Module):
  """A Mixture-of-Experts block as an nnx Module.

  Args:
    config: the block's shapes and routing semantics.
    rngs: nnx.Rngs for initialisation.
    param_dtype: dtype of the parameters (the compute dtype follows the input).
    runner_backend: force a backend ("auto" asks the oracle).

  Calling it maps x [..., H] -> [..., H]. The DeepSeek correction bias is an `nnx.BatchStat`
  (updated from load statistics, not by the optimizer); everything else is an `nnx.Param`.
  """

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
               runner_backend: Optional[str] = None):
    self.config = config
    self.runner_backend = runner_backend
    p = init_params(config, rngs.params(), dtype=param_dtype)
    for name in _PARAM_FIELDS:
      value = getattr(p, name)
      if value is None:
        setattr(self, name, None)
      elif name == "correction_bias":
        setattr(self, name, nnx.BatchStat(value))
      else:
        setattr(self, name, nnx.Param(value))

  def params(self) -> MoEParams:
    """The current values as a MoEParams pytree."""
    return MoEParams(**{n: (None if getattr(self, n) is None else getattr(self, n)[...])
                        for n in _PARAM_FIELDS})

  def __call__(self, x: jax.Array) -> jax.Array:
    lead = x.shape[:-1]
    out = moe_block(x.reshape(-1, x.shape[-1]), self.params(), self.config,
                    runner_backend=self.runner_backend)
    return out.reshape(*lead, x.shape[-1])
