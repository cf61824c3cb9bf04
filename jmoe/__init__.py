"""jmoe: Mixture-of-Experts layers for JAX, fast on NVIDIA Hopper GPUs.

The public surface: `select_experts` (routing), `fused_moe` (the routed expert block),
`moe_block` / `MoEParams` (router + experts + shared experts), the configs, and the modular
parts for those who assemble their own kernels.
"""
from jmoe import _layout

_layout.install(__name__, __file__)  # jmoe.kernels / .sharding / .interop from a source tree

from jmoe._validate import checkify_ids
from jmoe.api import fused_moe
from jmoe.block import MoEParams, init_params, moe_block, router_logits
from jmoe.config import (PRESETS, MoEConfig, ParallelConfig, QuantConfig, get_preset)
from jmoe.modular import (ActivationFormat, Contiguous, Delegate, Experts, ExpertsInput,
                          ExpertWeights, IncompatiblePartsError, ModularKernel, NaiveBatched,
                          NoOp, PrepareFinalize, TopKWeightAndReduce)
from jmoe.oracle import select_backend
from jmoe.router import select_experts
from jmoe.kernels.activations import ACTIVATIONS, Activation  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS", "Activation", "ActivationFormat", "Contiguous", "Delegate", "Experts",
    "ExpertsInput", "ExpertWeights", "IncompatiblePartsError", "ModularKernel", "MoEConfig",
    "MoEParams", "NaiveBatched", "NoOp", "PRESETS", "ParallelConfig", "PrepareFinalize",
    "QuantConfig", "TopKWeightAndReduce", "checkify_ids", "fused_moe", "get_preset",
    "init_params", "moe_block", "router_logits", "select_backend", "select_experts",
]
