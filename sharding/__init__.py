"""Expert parallelism for jmoe: meshes, placement, shard_map'd PrepareFinalize, EPLB.

`jmoe.fused_moe(..., parallel=ParallelConfig(mesh=...))` lands in `ep_fused_moe`; the EP
PrepareFinalize families register into `jmoe.registry` from `sharding.register` as the
a2a backends "allgather", "ragged_a2a" and "padded_a2a".
"""
from sharding.ep import ep_fused_moe, select_parts
from sharding.mesh import (ExpertPlacement, as_auto_mesh, expert_map, expert_placement,
                           make_ep_mesh, make_parallel, parallel_config, place_weights,
                           shard_expert_weights, shard_tokens, token_sharding, validate)
from sharding.prepare_finalize import (AllGather, AllGatherBatched, EPPrepareFinalize, PaddedA2A,
                                       RaggedA2A)

__all__ = [
    "AllGather", "AllGatherBatched", "EPPrepareFinalize", "ExpertPlacement", "PaddedA2A",
    "RaggedA2A", "as_auto_mesh", "ep_fused_moe", "expert_map", "expert_placement",
    "make_ep_mesh", "make_parallel", "parallel_config", "place_weights", "select_parts",
    "shard_expert_weights", "shard_tokens", "token_sharding", "validate",
]
