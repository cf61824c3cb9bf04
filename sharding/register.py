"""Registers the expert-parallel PrepareFinalize families into `jmoe.registry`.

Imported by `jmoe.registry._load_optional`; importing it twice is harmless.
"""
from __future__ import annotations

from jmoe.modular import ActivationFormat
from jmoe.registry import A2ABackend, register_a2a
from jmoe.sharding.prepare_finalize import (AllGather, AllGatherBatched, PaddedA2A, RaggedA2A,
                                       RaggedDedupA2A, factory)

register_a2a(A2ABackend(
    "allgather",
    {ActivationFormat.Standard: factory(AllGather),
     ActivationFormat.Batched: factory(AllGatherBatched)},
    needs_mesh=True,
    description="all-gather tokens + top-k over the expert axis, local experts with "
                "expert_map, reduce-scatter (hybrid EP x TP, DP-attention style)"))
register_a2a(A2ABackend(
    "ragged_a2a", {ActivationFormat.Standard: factory(RaggedA2A)}, needs_mesh=True,
    description="ragged all-to-all of exactly the routed copies (high throughput; DeepEP "
                "normal analogue); all_gather emulation on CPU"))
register_a2a(A2ABackend(
    "ragged_dedup", {ActivationFormat.Standard: factory(RaggedDedupA2A)}, needs_mesh=True,
    description="ragged all-to-all with one copy of a token per destination rank, its top-k "
                "ids and weights alongside; partial sums come back (DeepEP normal mode)"))
register_a2a(A2ABackend(
    "padded_a2a", {ActivationFormat.Batched: factory(PaddedA2A)}, needs_mesh=True,
    description="fixed capacity per (rank, local expert), static shapes, one all_to_all each "
                "way (low latency; DeepEP low-latency analogue)"))
