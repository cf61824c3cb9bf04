"""Causal grouped-query attention with rotary positions (and Qwen3's optional q/k norm)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.models.config import TransformerConfig


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotate pairs (x[..., :d/2], x[..., d/2:]) by position-dependent angles (the HF/Llama
  "rotate_half" form). x [B, S, heads, d], positions [B, S] int -> same shape and dtype."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))  # [d/2]
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, d/2]
  cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Attention(nnx.Module):
  """x [B, S, D] -> [B, S, D]; causal; num_kv_heads groups of num_heads // num_kv_heads."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32):
    d, hd = cfg.hidden_size, cfg.dim_per_head
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,  # noqa: E731
                                  param_dtype=param_dtype, rngs=rngs)
    self.cfg = cfg
    self.q = lin(d, cfg.num_heads * hd)
    self.k = lin(d, cfg.num_kv_heads * hd)
    self.v = lin(d, cfg.num_kv_heads * hd)
    self.o = lin(cfg.num_heads * hd, d)
    norm = lambda: nnx.RMSNorm(hd, epsilon=cfg.norm_eps, param_dtype=param_dtype,  # noqa: E731
                               rngs=rngs) if cfg.qk_norm else None
    self.q_norm, self.k_norm = norm(), norm()

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    c = self.cfg
    b, s, _ = x.shape
    hd, g = c.dim_per_head, c.num_heads // c.num_kv_heads
    q = self.q(x).reshape(b, s, c.num_heads, hd)
    k = self.k(x).reshape(b, s, c.num_kv_heads, hd)
    v = self.v(x).reshape(b, s, c.num_kv_heads, hd)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta)
    q = q.reshape(b, s, c.num_kv_heads, g, hd)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q.astype(jnp.float32), k.astype(jnp.float32))
    logits = logits / np.sqrt(hd)
    causal = jnp.tril(jnp.ones((s, s), jnp.bool_))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v.astype(jnp.float32)).astype(x.dtype)
    return self.o(out.reshape(b, s, c.num_heads * hd))
