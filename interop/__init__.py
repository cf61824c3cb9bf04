"""Bridges between jmoe and PyTorch.

`jmoe.interop.hf`: converters from Hugging Face transformers MoE blocks and checkpoints
(`from_hf_state_dict`, `from_hf_module`, `config_from_hf`). Importing this package does not
import torch; the converters import it lazily, only to read torch tensors.
`jmoe.interop.torch_bridge` (imports torch): `JmoeMoE`, a torch.nn.Module running the jitted jmoe
block forward and backward through DLPack; the `jmoe::fused_moe` custom op (torch.compile).
`jmoe.interop.torch` (imports torch and transformers): `from_hf(block)`,
`replace_moe_blocks(model)`, and the "jmoe" experts implementation of transformers >= 5
(`model.set_experts_implementation("jmoe")`, registered on import).
Neither is imported here: `import jmoe.interop` stays torch-free (a test checks it).
"""
from jmoe.interop.hf import (MODEL_TYPES, config_from_hf, from_hf_module, from_hf_state_dict,
                        moe_layer_prefixes, to_hf_state_dict)

__all__ = ["MODEL_TYPES", "config_from_hf", "from_hf_module", "from_hf_state_dict",
           "moe_layer_prefixes", "to_hf_state_dict"]
