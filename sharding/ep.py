"""`ep_fused_moe`: the routed experts over a mesh, via `shard_map` and an EP PrepareFinalize.

Layout (see `sharding.mesh`): hidden_states / topk arrays [T, ...] sharded over (data, expert)
and replicated over tensor; w13 [E, H, 2N] / w2 [E, N, H] (and biases) sharded over the expert
axis on E and the tensor axis on N, replicated over data. The output [T, H] is sharded like
hidden_states. Inside the body the `ModularKernel(prepare_finalize, experts)` runs on the local
shard; `prepare`/`finalize` hold the collectives.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jmoe._validate import check_distinct_ids
from jmoe.config import ParallelConfig, QuantConfig
from jmoe.modular import ActivationFormat, ExpertWeights, ModularKernel
from jmoe.quant.weights import QuantizedWeights
from jmoe.shared import shared_expert_mlp
from jmoe.kernels.activations import Activation, as_activation
from jmoe.sharding.mesh import (ExpertPlacement, token_axes, validate, weight_specs)
from jmoe.sharding.prepare_finalize import EPPrepareFinalize

log = logging.getLogger("jmoe.sharding")


def select_parts(parallel: ParallelConfig, *, runner_backend: str = "auto",
                 a2a_backend: str = "auto", quant_config: Optional[QuantConfig] = None,
                 placement: Union[str, ExpertPlacement, None] = None,
                 capacity: Optional[int] = None, problem: Optional[tuple] = None,
                 routing: Optional[tuple[int, int, int]] = None):
  """(prepare_finalize, experts, reason) for an EP call, with placement/capacity applied.

  `problem` = (dtype, hidden_size, intermediate size per tensor rank): what the local experts
  see, so that "auto" skips runners that cannot run it; `routing` = (num_experts, top_k,
  tokens per expert rank), so that "auto" picks the dispatch by its bytes.
  """
  from jmoe import oracle  # noqa: PLC0415 (jmoe may still be importing when sharding loads)
  pf, experts, reason = oracle.select_backend(runner_backend, a2a_backend, quant=quant_config,
                                              parallel=parallel, problem=problem,
                                              routing=routing)
  if isinstance(pf, EPPrepareFinalize) and (placement is not None or capacity is not None):
    pf = type(pf)(parallel, placement=placement, capacity=capacity, ragged_impl=pf.ragged_impl)
  return pf, experts, reason


def _warn_dropped(n):
  if int(n) > 0:
    log.warning("jmoe EP dispatch dropped %d token copies (capacity too small); "
                "call sharding.ep_fused_moe(..., return_stats=True) to track them", int(n))


def ep_fused_moe(
    hidden_states: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    activation: Union[str, Activation] = "silu",
    w13_bias: Optional[jax.Array] = None,
    w2_bias: Optional[jax.Array] = None,
    apply_router_weight_on_input: bool = False,
    quant_config: Optional[QuantConfig] = None,
    runner_backend: str = "auto",
    a2a_backend: str = "auto",
    parallel: ParallelConfig,
    placement: Union[str, ExpertPlacement, None] = None,
    capacity: Optional[int] = None,
    shared_w13: Optional[jax.Array] = None,
    shared_w2: Optional[jax.Array] = None,
    shared_gate: Optional[jax.Array] = None,
    micro_batches: int = 1,
    return_stats: bool = False,
    check_vma: bool = True,
) -> Any:
  """Expert-parallel `fused_moe`: same values as the single-device call.

  Args (beyond `jmoe.fused_moe`'s):
    parallel: the mesh and the roles of its axes (`sharding.make_parallel` builds one).
    placement: "linear" / "round_robin" / an `ExpertPlacement` (default: the config's).
      `w13`/`w2`/biases are in *physical* order (`sharding.place_weights`); topk_ids are
      global (logical) ids.
    capacity: rows one source rank may send to one (rank, local expert) — the static bound of
      padded_a2a's buffers, ragged_a2a's receive buffer and allgather's batched layout;
      None = the config's `dispatch_capacity`, else T per rank (dropless for distinct ids).
      Copies over it are dropped and counted (stats "dropped", or a logged warning).
    shared_w13 [H, 2Ns], shared_w2 [Ns, H], shared_gate [H]: a shared-expert MLP, replicated,
      computed between dispatch send and receive (single-batch overlap) and added.
    micro_batches: split each rank's tokens into this many micro-batches whose dispatch and
      combine interleave with the others' expert compute (two-batch overlap for prefill).
    return_stats: also return {"dropped": int32 scalar (token copies over capacity),
      "expert_load": [E] int32 routed copies per global expert}.

  Returns:
    [T, H] sharded like hidden_states (and the stats dict when `return_stats`).
  """
  act = as_activation(activation)
  if parallel is None or parallel.mesh is None:
    raise ValueError("ep_fused_moe needs parallel=ParallelConfig(mesh=...)")
  if micro_batches < 1:
    raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
  t, h = hidden_states.shape
  e = w13.shape[0]
  n = w2.shape[1]
  k = topk_ids.shape[1]
  sizes = validate(parallel, num_experts=e, intermediate_size=n, hidden_size=h, num_tokens=t)
  t_loc = t // sizes.token_shards
  if t_loc % micro_batches:
    raise ValueError(f"micro_batches={micro_batches} does not divide the {t_loc} tokens per "
                     "shard")
  if (shared_w13 is None) != (shared_w2 is None):
    raise ValueError("shared_w13 and shared_w2 must be given together")

  pf, experts, reason = select_parts(parallel, runner_backend=runner_backend,
                                     a2a_backend=a2a_backend, quant_config=quant_config,
                                     placement=placement, capacity=capacity,
                                     problem=(hidden_states.dtype, h, n // sizes.tp),
                                     routing=(e, k, t_loc))
  kernel = ModularKernel(pf, experts, quant_config)
  if pf.activation_format == ActivationFormat.Batched:
    check_distinct_ids(topk_ids)
  expert_load = None
  if return_stats:
    flat = topk_ids.reshape(-1)
    expert_load = jnp.bincount(jnp.where(flat >= 0, flat, e), length=e + 1)[:e].astype(jnp.int32)

  if t == 0:  # an empty batch: nothing to dispatch (collectives reject empty operands)
    out = jnp.zeros((0, h), hidden_states.dtype)
    return (out, {"dropped": jnp.int32(0), "expert_load": expert_load}) if return_stats else out
  if not isinstance(pf, EPPrepareFinalize):  # a2a_backend="none" on a mesh: replicated experts
    weights = ExpertWeights(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias)
    out = kernel(hidden_states, weights, topk_weights, topk_ids, activation=act,
                 apply_router_weight_on_input=apply_router_weight_on_input)
    if shared_w13 is not None:
      s = shared_expert_mlp(hidden_states, shared_w13, shared_w2, act, gate=shared_gate)
      out = (out.astype(jnp.float32) + s.astype(jnp.float32)).astype(out.dtype)
    return (out, {"dropped": jnp.int32(0), "expert_load": expert_load}) if return_stats else out

  log.debug("jmoe EP: %r + %r (%s)", pf, experts, reason)
  gated = act.is_gated
  tp = sizes.tp
  ws = weight_specs(parallel, gated)
  quantized = isinstance(w13, QuantizedWeights)
  if quantized:
    # values, scales and zero points all shard over the expert axis (dim 0) like bf16 weights
    if tp > 1:
      raise ValueError(f"quantized w13 / w2 ({w13.scheme}) with a tensor axis of size {tp}: "
                       "tensor-parallel quantized experts are not supported yet; shard the "
                       "experts over the expert axis only")
    ws = dict(ws, w13=_quantized_spec(w13, parallel.expert_axis),
              w2=_quantized_spec(w2, parallel.expert_axis))
  # gate | up side by side would shard badly over N: view w13 as [E, H, 2, N] so each tensor
  # rank gets matching gate and up columns
  w13v = w13.reshape(e, h, 2, n) if gated and not quantized else w13
  b13v = None
  if w13_bias is not None:
    b13v = w13_bias.reshape(e, 2, n) if gated else w13_bias
  tok = token_axes(parallel)
  tspec = P(tok if tok else None, None)
  has_shared = shared_w13 is not None
  args = dict(x=hidden_states, tw=topk_weights, ti=topk_ids, w13=w13v, w2=w2, b13=b13v,
              b2=w2_bias, s13=shared_w13, s2=shared_w2, sg=shared_gate)
  specs = dict(x=tspec, tw=tspec, ti=tspec, w13=ws["w13"], w2=ws["w2"], b13=ws["w13_bias"],
               b2=ws["w2_bias"], s13=P(), s2=P(), sg=P())
  names = [a for a in args if args[a] is not None]
  ta = parallel.tensor_axis

  def body(*vals):
    v = dict(zip(names, vals))
    el = v["w13"].shape[0]
    w13l = v["w13"].reshape(el, h, -1) if gated and not quantized else v["w13"]
    b13l = None
    if "b13" in v:
      b13l = v["b13"].reshape(el, -1) if gated else v["b13"]
    b2l = v.get("b2")
    if b2l is not None and ta is not None and tp > 1:  # added once: the tensor psum follows
      b2l = jnp.where(jax.lax.axis_index(ta) == 0, b2l, jnp.zeros_like(b2l))
    weights = ExpertWeights(w13=w13l, w2=v["w2"], w13_bias=b13l, w2_bias=b2l)
    emap = pf.kernel_expert_map(el)
    shared = None
    if has_shared:
      shared = lambda: shared_expert_mlp(v["x"], v["s13"], v["s2"], act,  # noqa: E731
                                         gate=v.get("sg"))
    if micro_batches == 1:
      out = kernel(v["x"], weights, v["tw"], v["ti"], activation=act, expert_map=emap,
                   apply_router_weight_on_input=apply_router_weight_on_input,
                   shared_output=shared)
      dropped = pf.last_dropped
    else:
      out, dropped = _micro_batched(kernel, v["x"], weights, v["tw"], v["ti"], act, emap,
                                    apply_router_weight_on_input, shared, micro_batches)
    return out, dropped

  mesh = parallel.mesh
  explicit = any(t_ == AxisType.Explicit for t_ in mesh.axis_types)
  vals = [args[a] for a in names]
  if explicit:  # jax 0.10 make_mesh: Explicit axes reject inputs typed unsharded; reshard them
    vals = [jax.reshard(val, NamedSharding(mesh, specs[a])) for a, val in zip(names, vals)]
  fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs[a] for a in names),
                     out_specs=(tspec, P()), check_vma=check_vma)
  out, dropped = fn(*vals)
  if return_stats:
    return out, {"dropped": dropped, "expert_load": expert_load}
  if pf.capacity is not None:
    jax.debug.callback(_warn_dropped, dropped)
  return out


def _quantized_spec(w: QuantizedWeights, expert_axis) -> QuantizedWeights:
  """shard_map's spec for quantized weights: every [E, ...] part over the expert axis, the
  static input_scale (one per tensor) replicated."""
  spec = jax.tree.map(lambda _: P(expert_axis), w)
  if w.input_scale is not None:
    spec = dataclasses.replace(spec, input_scale=P())
  return spec


def _micro_batched(kernel, x, weights, tw, ti, act, emap, on_input, shared, nmb):
  """Two-batch overlap: issue every micro-batch's dispatch first, then compute and combine
  them in turn, so micro-batch i+1's all-to-all has no dependence on micro-batch i's GEMMs."""
  pf, experts = kernel.prepare_finalize, kernel.experts
  chunks = [(a, b, c) for a, b, c in zip(jnp.split(x, nmb), jnp.split(tw, nmb),
                                         jnp.split(ti, nmb))]
  receivers, drops = [], []
  for xc, wc, ic in chunks:
    receivers.append(pf.prepare_async(
        xc, wc, ic, num_local_experts=weights.num_experts, expert_map=emap,
        apply_router_weight_on_input=on_input, quant=kernel.quant,
        a1_scale=getattr(weights.w13, "input_scale", None)))
  s = shared() if shared is not None else None
  outs = []
  for recv in receivers:
    inp = recv()
    drops.append(inp.dropped)
    fused = experts.apply(inp, weights, activation=act, expert_map=emap, out_dtype=x.dtype)
    outs.append(pf.finalize(fused, inp, experts.finalize_weight_and_reduce_impl(), x.dtype))
  out = jnp.concatenate(outs)
  if s is not None:
    out = (out.astype(jnp.float32) + s.astype(jnp.float32)).astype(x.dtype)
  dropped = sum(d for d in drops if d is not None) if any(d is not None for d in drops) else None
  return out, (jnp.int32(0) if dropped is None else dropped)
