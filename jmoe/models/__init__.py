"""A reference decoder-only MoE transformer in flax.nnx and tiny presets of known families.

    cfg = jmoe.models.tiny_preset("deepseek-v3", vocab_size=256)
    model = jmoe.models.MoETransformer(cfg, rngs=nnx.Rngs(0))
    logits, aux = model(tokens)                          # [B, S] int -> [B, S, V], aux dict
"""
from jmoe.models.attention import Attention, rotary
from jmoe.models.config import PRESET_FAMILIES, TransformerConfig, tiny_preset
from jmoe.models.transformer import DecoderLayer, DenseMLP, MoETransformer, combine_aux

__all__ = ["Attention", "DecoderLayer", "DenseMLP", "MoETransformer", "PRESET_FAMILIES",
           "TransformerConfig", "combine_aux", "rotary", "tiny_preset"]
