"""Flax layers."""
from jmoe.layers.moe import MoE

__all__ = ["MoE"]
