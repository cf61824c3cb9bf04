"""Expert parallelism for jmoe: meshes, placement, shard_map'd PrepareFinalize, EPLB.

`jmoe.fused_moe(..., parallel=ParallelConfig(mesh=...))` lands in `ep_fused_moe`; the EP
PrepareFinalize families register into `jmoe.registry` from `sharding.register` as the
a2a backends "allgather", "ragged_a2a" and "padded_a2a"::

    par = sharding.make_parallel(data=2, expert=4)          # or parallel_config(any_mesh)
    x = sharding.shard_tokens(x, par)                        # tokens over (data, expert)
    out = jax.jit(lambda x, w13, w2, tw, ti: jmoe.fused_moe(
        x, w13, w2, tw, ti, parallel=par, a2a_backend="ragged_a2a"))(x, w13, w2, tw, ti)

w13/w2 are the global arrays (sharded over the expert axis on E and the tensor axis on N, or
left for jit to shard); `ep_fused_moe` adds placement, capacity, shared experts overlapped with
the dispatch, micro-batches (two-batch overlap) and a stats side output (dropped copies, expert
load for `sharding.eplb`). `sharding.comm_model` models the bytes each backend sends.
"""
from jmoe.sharding.ep import ep_fused_moe, select_parts
from jmoe.sharding.mesh import (ExpertPlacement, as_auto_mesh, expert_map, expert_placement,
                           make_ep_mesh, make_parallel, parallel_config, place_weights,
                           shard_expert_weights, shard_tokens, token_sharding, validate)
from jmoe.sharding.prepare_finalize import (AllGather, AllGatherBatched, EPPrepareFinalize, PaddedA2A,
                                       RaggedA2A, RaggedDedupA2A)

__all__ = [
    "AllGather", "AllGatherBatched", "EPPrepareFinalize", "ExpertPlacement", "PaddedA2A",
    "RaggedA2A", "RaggedDedupA2A", "as_auto_mesh", "ep_fused_moe", "expert_map", "expert_placement",
    "make_ep_mesh", "make_parallel", "parallel_config", "place_weights", "select_parts",
    "shard_expert_weights", "shard_tokens", "token_sharding", "validate",
]
