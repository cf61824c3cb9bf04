"""Bridges between jmoe and PyTorch.

`jmoe.interop.hf`: converters from Hugging Face transformers MoE blocks and checkpoints
(`from_hf_state_dict`, `from_hf_module`, `config_from_hf`). Importing this package does not
import torch; the converters import it lazily, only to read torch tensors.
`jmoe.interop.torch_bridge` (imports torch): `JmoeMoE`, a torch.nn.Module running the jitted jmoe
block forward and backward through DLPack.
"""
from jmoe.interop.hf import (MODEL_TYPES, config_from_hf, from_hf_module, from_hf_state_dict,
                        moe_layer_prefixes, to_hf_state_dict)

__all__ = ["MODEL_TYPES", "config_from_hf", "from_hf_module", "from_hf_state_dict",
           "moe_layer_prefixes", "to_hf_state_dict"]
