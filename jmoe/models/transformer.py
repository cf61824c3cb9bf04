"""`MoETransformer`: a decoder-only language model whose FFNs are `jmoe.layers.MoE` blocks."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ParallelConfig
from jmoe.layers import MoE
from jmoe.models.attention import Attention
from jmoe.models.config import TransformerConfig


class DenseMLP(nnx.Module):
  """SwiGLU MLP x [..., D] -> [..., D] (the dense first layers)."""

  def __init__(self, d: int, n: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32):
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,  # noqa: E731
                                  param_dtype=param_dtype, rngs=rngs)
    self.gate, self.up, self.down = lin(d, n), lin(d, n), lin(n, d)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nnx.Module):
  """x + attn(norm(x)), then x + ffn(norm(x)); ffn is dense or MoE."""

  def __init__(self, cfg: TransformerConfig, index: int, *, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32, **moe_kw):
    d = cfg.hidden_size
    self.attn_norm = nnx.RMSNorm(d, epsilon=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.ffn_norm = nnx.RMSNorm(d, epsilon=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.is_moe = index >= cfg.first_dense_layers
    if self.is_moe:
      self.ffn = MoE(cfg.moe, rngs=rngs, dtype=dtype, param_dtype=param_dtype, **moe_kw)
    else:
      self.ffn = DenseMLP(d, cfg.dense_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

  def __call__(self, x: jax.Array, positions: jax.Array):
    x = x + self.attn(self.attn_norm(x), positions)
    h = self.ffn_norm(x)
    if not self.is_moe:
      return x + self.ffn(h), None
    if jnp.dtype(self.ffn.dtype or h.dtype) == x.dtype:
      # the residual stream enters the MoE's final reduce (its buffer can take the result)
      return self.ffn(h, return_aux=True, residual=x)
    y, aux = self.ffn(h, return_aux=True)
    return x + y.astype(x.dtype), aux


class MoETransformer(nnx.Module):
  """tokens [B, S] int -> (logits [B, S, vocab] f32, aux).

  aux (summed over the MoE layers, averaged for the losses): load_balancing_loss and
  router_z_loss (f32 means over MoE layers), expert_load [L_moe, E] int32, dropped int32.

  Args:
    cfg: the model; dtype / param_dtype: compute and storage dtypes;
    parallel, a2a_backend, runner_backend, capacity_factor, router_jitter: passed to every
      MoE layer (`jmoe.layers.MoE`).
  """

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32, parallel: Optional[ParallelConfig] = None,
               a2a_backend: str = "auto", runner_backend: Optional[str] = None,
               capacity_factor: Optional[float] = None, router_jitter: float = 0.0):
    if not isinstance(cfg, TransformerConfig):
      raise TypeError(f"cfg must be a TransformerConfig, got {type(cfg).__name__}")
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
    moe_kw = dict(parallel=parallel, a2a_backend=a2a_backend, runner_backend=runner_backend,
                  capacity_factor=capacity_factor, router_jitter=router_jitter)
    self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, dtype=dtype,
                                         param_dtype=param_dtype, **moe_kw)
                            for i in range(cfg.num_layers)])
    self.norm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.norm_eps, param_dtype=param_dtype,
                            rngs=rngs)
    self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
        rngs=rngs)

  def moe_layers(self) -> list[MoE]:
    return [layer.ffn for layer in self.layers if layer.is_moe]

  def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None):
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be an int [B, S] array, got {tokens.dtype} "
                       f"{tuple(tokens.shape)}")
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = self.embed(tokens)
    auxes = []
    for layer in self.layers:
      x, aux = layer(x, positions)
      if aux is not None:
        auxes.append(aux)
    x = self.norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32), combine_aux(auxes, self.cfg.moe.num_experts)


def combine_aux(auxes: list[dict], num_experts: int) -> dict:
  """Per-layer aux dicts -> one: mean losses, stacked loads [L, E], total drops."""
  if not auxes:
    z = jnp.float32(0.0)
    return dict(load_balancing_loss=z, router_z_loss=z,
                expert_load=jnp.zeros((0, num_experts), jnp.int32), dropped=jnp.int32(0))
  mean = lambda k: jnp.mean(jnp.stack([a[k] for a in auxes]))  # noqa: E731
  return dict(load_balancing_loss=mean("load_balancing_loss"),
              router_z_loss=mean("router_z_loss"),
              expert_load=jnp.stack([a["expert_load"] for a in auxes]),
              dropped=sum(a["dropped"] for a in auxes))
