"""Run jmoe from PyTorch: a `torch.nn.Module` whose forward and backward are jitted JAX, with
tensors handed across zero-copy through DLPack.

    block = jmoe.interop.torch_bridge.JmoeMoE.from_hf(hf_model.model.layers[3].mlp)
    y = block(x)            # x [..., H] torch tensor; y.backward() reaches block's parameters

Parameters stay torch `nn.Parameter`s (optimizers, state_dict and device moves work as usual).
Each call converts them to JAX arrays with `jax.dlpack.from_dlpack` (no copy on one device),
runs `jax.vjp` of `jmoe.moe_block` under `jit`, and keeps the VJP closure for backward.
Tensors crossing must be contiguous (DLPack rejects general strides) and not require grad
(they are detached first); fp4/int4 cannot cross DLPack.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import torch

from jmoe.block import MoEParams, moe_block
from jmoe.config import MoEConfig

_FIELDS = tuple(f.name for f in dataclasses.fields(MoEParams))


def to_jax(t: torch.Tensor) -> jax.Array:
  """torch -> jax, zero-copy where DLPack allows (detached, contiguous)."""
  return jax.dlpack.from_dlpack(t.detach().contiguous())


def to_torch(a: jax.Array) -> torch.Tensor:
  """jax -> torch, zero-copy."""
  return torch.from_dlpack(a)


@functools.lru_cache(maxsize=None)
def _compiled(config: MoEConfig, present: tuple[str, ...], runner_backend: Optional[str]):
  """Jitted forward-with-VJP and backward for one config and one set of present params."""

  def block(x, *values):
    params = MoEParams(**dict(zip(present, values)))
    return moe_block(x, params, config, runner_backend=runner_backend)

  fwd = jax.jit(lambda *args: jax.vjp(block, *args))
  bwd = jax.jit(lambda vjp_fn, g: vjp_fn(g))
  return fwd, bwd


class _MoEFunction(torch.autograd.Function):

  @staticmethod
  def forward(ctx, config, present, runner_backend, x, *values):
    fwd, bwd = _compiled(config, present, runner_backend)
    out, vjp_fn = fwd(to_jax(x), *[to_jax(v) for v in values])
    ctx.vjp_fn, ctx.bwd = vjp_fn, bwd
    ctx.needs = ctx.needs_input_grad[3:]
    # A copy: the VJP residuals may alias the output buffer, and an in-place torch op on the
    # output must not change what backward sees.
    return to_torch(out).clone()

  @staticmethod
  def backward(ctx, g):
    grads = ctx.bwd(ctx.vjp_fn, to_jax(g))
    out = [to_torch(gr) if need else None for gr, need in zip(grads, ctx.needs)]  # zero-copy
    return (None, None, None, *out)


class JmoeMoE(torch.nn.Module):
  """A jmoe MoE block as a torch module: x [..., H] -> [..., H], differentiable.

  Args:
    config: the block's MoEConfig.
    params: initial MoEParams (JAX or NumPy arrays); they become torch Parameters, except the
      DeepSeek correction bias, which is a buffer (updated from load statistics, not trained).
    runner_backend: force a jmoe backend (default: the oracle's choice).
  """

  def __init__(self, config: MoEConfig, params: MoEParams, *,
               runner_backend: Optional[str] = None, device=None):
    super().__init__()
    self.config = config
    self.runner_backend = runner_backend
    for name in _FIELDS:
      value = getattr(params, name)
      if value is None:
        continue
      t = torch.from_dlpack(jnp.asarray(value)).clone().to(device)
      if name == "correction_bias":
        self.register_buffer(name, t)
      else:
        setattr(self, name, torch.nn.Parameter(t))

  @classmethod
  def from_hf(cls, hf_block, hf_config=None, *, dtype=None, runner_backend=None) -> "JmoeMoE":
    """Build from a live transformers MoE block (see `jmoe.interop.hf.from_hf_module`)."""
    from jmoe.interop.hf import from_hf_module  # noqa: PLC0415

    config, params = from_hf_module(hf_block, hf_config, dtype=dtype)
    device = next(hf_block.parameters()).device
    return cls(config, params, runner_backend=runner_backend, device=device)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    present = tuple(n for n in _FIELDS if getattr(self, n, None) is not None)
    lead = x.shape[:-1]
    y = _MoEFunction.apply(self.config, present, self.runner_backend,
                           x.reshape(-1, x.shape[-1]), *[getattr(self, n) for n in present])
    return y.reshape(*lead, x.shape[-1])
