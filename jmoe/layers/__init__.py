"""Flax layers: `MoE` (nnx), its training signals (`losses`), and `linen.MoE` for linen users."""
from jmoe.layers import losses
from jmoe.layers.losses import (correction_bias_update, expert_load, load_balance,
                                load_balancing_loss, router_z_loss)
from jmoe.layers.moe import MoE, num_params
from jmoe.layers.variables import QuantizedWeight

__all__ = ["MoE", "QuantizedWeight", "correction_bias_update", "expert_load", "load_balance",
           "load_balancing_loss", "losses", "num_params", "router_z_loss"]
