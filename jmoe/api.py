"""The functional entry point: `fused_moe`."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import oracle
from jmoe._validate import (check_distinct_ids, check_expert_map, check_floating,
                            check_ids_in_range, check_topk)
from jmoe.config import ParallelConfig, QuantConfig
from jmoe.modular import ActivationFormat, ExpertWeights, ModularKernel
from jmoe.kernels.activations import Activation, as_activation
from jmoe.quant.activations import check_act_groups
from jmoe.quant.weights import (QuantizedWeights, check_quantized, from_qwix, is_qwix_qarray,
                                scheme_of_qwix)


def as_quantized(w13, w2, quant_config: Optional[QuantConfig]):
  """qwix.QArray weights -> QuantizedWeights (no copy; the activation format from
  quant_config, else weight-only); anything else unchanged."""
  out = []
  for name, w in (("w13", w13), ("w2", w2)):
    if is_qwix_qarray(w):
      w = from_qwix(w, scheme_of_qwix(w, quant_config), argname=name)
    out.append(w)
  return out


def resolve_quant(w13, w2, quant_config: Optional[QuantConfig]) -> Optional[QuantConfig]:
  """The call's scheme: that of the quantized w13 / w2 (both, one scheme), checked against
  `quant_config` when given. Raises naming the argument that disagrees."""
  q13, q2 = isinstance(w13, QuantizedWeights), isinstance(w2, QuantizedWeights)
  if q13 != q2:
    dense, quantized = ("w2", "w13") if q13 else ("w13", "w2")
    raise TypeError(f"{quantized} is quantized ({(w13 if q13 else w2).scheme}) but {dense} is a "
                    f"dense array: quantize both with jmoe.quant.quantize_weights, one scheme")
  if not q13:
    if quant_config is not None and quant_config.is_quantized:
      raise ValueError(f"quant_config={quant_config} but w13 / w2 are dense arrays: pass "
                       "jmoe.quant.quantize_weights(w, scheme) as w13 and w2")
    return None
  check_quantized(w13, argname="w13")
  check_quantized(w2, argname="w2")
  if w13.scheme != w2.scheme:
    raise ValueError(f"w13 is {w13.scheme} but w2 is {w2.scheme}: both must share one scheme")
  if quant_config is not None and quant_config != w13.scheme:
    raise ValueError(f"quant_config={quant_config} differs from the weights' scheme "
                     f"{w13.scheme}; leave quant_config out (the weights carry it)")
  return w13.scheme


@dataclasses.dataclass(frozen=True)
class _Call:
  """fused_moe's non-array arguments after validation (static to the frozen-weights VJP)."""

  act: Activation
  apply_router_weight_on_input: bool
  global_num_experts: Optional[int]
  quant_config: Optional[QuantConfig]
  runner_backend: str
  a2a_backend: str
  parallel: Optional[ParallelConfig]

  def __call__(self, x, w13, w2, tw, ids, b13, b2, emap, residual, *, dense: bool = False):
    return _run_experts(x, w13, w2, tw, ids, self.act, b13, b2,
                        self.apply_router_weight_on_input, self.global_num_experts, emap,
                        None if dense else self.quant_config, self.runner_backend,
                        self.a2a_backend, self.parallel, residual)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _frozen_quantized(call: _Call, x, q13, q2, tw, ids, b13, b2, emap, residual):
  """The quantized block on frozen QuantizedWeights. Its VJP is the dense block's at the
  dequantized weights for x, the router weights, the biases and the residual (straight
  through the activation quantization); the weights get none (frozen: a LoRA / QLoRA-style
  fine-tune trains what is around them)."""
  return call(x, q13, q2, tw, ids, b13, b2, emap, residual)


def _frozen_fwd(call, x, q13, q2, tw, ids, b13, b2, emap, residual):
  out = _frozen_quantized(call, x, q13, q2, tw, ids, b13, b2, emap, residual)
  return out, (x, q13, q2, tw, ids, b13, b2, emap, residual)


def _frozen_bwd(call, res, g):
  from jmoe.quant.weights import dequantize  # noqa: PLC0415
  x, q13, q2, tw, ids, b13, b2, emap, residual = res
  # the dequantized experts exist only in this backward (a dense copy of the weights here)
  d13, d2 = dequantize(q13, x.dtype), dequantize(q2, x.dtype)

  def dense(x, tw, b13, b2, residual):
    return call(x, d13, d2, tw, ids, b13, b2, emap, residual, dense=True)

  _, vjp = jax.vjp(dense, x, tw, b13, b2, residual)
  dx, dtw, db13, db2, dres = vjp(g)
  zero_int = lambda a: None if a is None else np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  return dx, None, None, dtw, zero_int(ids), db13, db2, zero_int(emap), dres


_frozen_quantized.defvjp(_frozen_fwd, _frozen_bwd)


def _check_weights(hidden_states, w13, w2, w13_bias, w2_bias, act: Activation,
                   num_experts_hint: Optional[int] = None) -> None:
  if hidden_states.ndim != 2:
    raise ValueError(f"hidden_states must be [T, H], got shape {hidden_states.shape}")
  check_floating("hidden_states", hidden_states)
  if w13.ndim != 3:
    raise ValueError(f"w13 must be [E, H, 2N] (or [E, H, N] for *_no_mul), got {w13.shape}")
  if w2.ndim != 3:
    raise ValueError(f"w2 must be [E, N, H], got shape {w2.shape}")
  if not isinstance(w13, QuantizedWeights):
    check_floating("w13", w13)
  if not isinstance(w2, QuantizedWeights):
    check_floating("w2", w2)
  e, h, w = w13.shape
  if hidden_states.shape[1] != h:
    raise ValueError(f"hidden size mismatch: hidden_states has H={hidden_states.shape[1]} but "
                     f"w13 has H={h} (w13 shape {w13.shape})")
  if act.is_gated and w % 2:
    raise ValueError(f"w13 must be [E, H, 2N] for the gated activation {act.name!r}: its last "
                     f"dim {w} is odd (w13 shape {w13.shape})")
  if w2.shape[0] != e:
    raise ValueError(f"expert count mismatch: w13 has E={e}, w2 has E={w2.shape[0]}")
  # w13 fixes E, H and N; w2 must agree with it, and the message blames w2 when it does not
  n = w // 2 if act.is_gated else w
  if w2.shape != (e, n, h):
    raise ValueError(f"w2 must be [E, N, H] = {(e, n, h)} to match w13 {tuple(w13.shape)} "
                     f"(activation {act.name!r}), got w2 shape {tuple(w2.shape)}")
  if w13_bias is not None and w13_bias.shape != (e, w):
    raise ValueError(f"w13_bias must have shape {(e, w)}, got {w13_bias.shape}")
  if w2_bias is not None and w2_bias.shape != (e, h):
    raise ValueError(f"w2_bias must have shape {(e, h)}, got {w2_bias.shape}")


def fused_moe(
    hidden_states: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    activation: "str | Activation" = "silu",
    swiglu_alpha: Optional[float] = None,
    swiglu_limit: Optional[float] = None,
    w13_bias: Optional[jax.Array] = None,
    w2_bias: Optional[jax.Array] = None,
    apply_router_weight_on_input: bool = False,
    global_num_experts: Optional[int] = None,
    expert_map: Optional[jax.Array] = None,
    quant_config: Optional[QuantConfig] = None,
    runner_backend: str = "auto",
    a2a_backend: str = "auto",
    parallel: Optional[ParallelConfig] = None,
    residual: Optional[jax.Array] = None,
) -> jax.Array:
  """Run the routed experts of one MoE block.

  Args:
    hidden_states: [T, H] activations (bf16/f16/f32).
    w13: [E, H, 2N] gate (`[..., :N]`) and up (`[..., N:]`) projections; [E, H, N] for the
      non-gated `*_no_mul` activations. Or `jmoe.quant.QuantizedWeights` of that logical
      shape (w13 and w2 both, one scheme): the call then runs that scheme, and they are
      frozen (under `jax.grad`, the other arguments get the dense block's VJP at the
      dequantized weights; the weights get none).
    w2: [E, N, H] down projection (dense or quantized, as w13).
    topk_weights: [T, k] router weights (from `select_experts`).
    topk_ids: [T, k] int expert ids in global numbering; -1 marks an empty slot.
    activation: "silu", "gelu", "gelu_tanh", "swigluoai", "silu_no_mul", "gelu_no_mul",
      "relu2_no_mul" (or an `Activation`). `swiglu_alpha`/`swiglu_limit` tune swigluoai.
    w13_bias: [E, 2N] (or [E, N]); w2_bias: [E, H].
    apply_router_weight_on_input: scale the input by the router weight (top_k must be 1).
    global_num_experts: experts in the whole model (default: len(expert_map) or E).
    expert_map: [global_E] int, global id -> local id on this device, -1 = not local
      (those slots contribute nothing).
    quant_config: the scheme; None takes it from quantized w13 / w2 (given, it must match).
      With dense w13 / w2: quantized training -- each call quantizes them to the scheme and
      runs the quantized forward; the backward is the dense block's at the dequantized
      weights (straight-through; `jmoe.quant.training`).
    runner_backend: "auto" (the oracle), "reference", "xla", "xla_batched", "pallas_mosaic".
    a2a_backend, parallel: expert parallelism over a mesh (see `sharding`).
    residual: [T, H] floating (e.g. the residual stream h): return residual + the experts'
      output, the add on the f32 sum inside the final weighted reduce (one fusion; XLA writes
      the result in residual's buffer when it is dead afterwards or donated). Under expert
      parallelism (parallel with a mesh) it is a plain add after the combine.

  Returns:
    [T, H] in hidden_states' dtype.

  Ids outside [-1, global_num_experts) raise when concrete. Under jit they count as empty
  slots; traced inside `jmoe.checkify_ids()` and run under `jax.experimental.checkify.checkify`
  they become a checkify error (off by default: the check costs jit's fast dispatch path).
  """
  act = as_activation(activation, alpha=swiglu_alpha, limit=swiglu_limit)
  if is_qwix_qarray(w13) or is_qwix_qarray(w2):
    w13, w2 = as_quantized(w13, w2, quant_config)
    quant_config = None  # the converted weights carry it (its activation format included)
  _check_weights(hidden_states, w13, w2, w13_bias, w2_bias, act)
  if (quant_config is not None and quant_config.is_quantized
      and not isinstance(w13, QuantizedWeights) and not isinstance(w2, QuantizedWeights)):
    # dense (master) weights with a scheme: quantized training (jmoe.quant.training)
    from jmoe.quant.training import quantized_training_moe  # noqa: PLC0415
    return quantized_training_moe(
        hidden_states, w13, w2, topk_weights, topk_ids, quant_config, w13_bias=w13_bias,
        w2_bias=w2_bias, expert_map=expert_map, residual=residual, activation=act,
        apply_router_weight_on_input=apply_router_weight_on_input,
        global_num_experts=global_num_experts, runner_backend=runner_backend,
        a2a_backend=a2a_backend, parallel=parallel)
  quant_config = resolve_quant(w13, w2, quant_config)
  if quant_config is not None:
    check_act_groups(quant_config, w13.shape[1], argname="hidden_states (H)")
    check_act_groups(quant_config, w2.shape[1], argname="w2 (the intermediate N)")
    call = _Call(act, apply_router_weight_on_input, global_num_experts, quant_config,
                 runner_backend, a2a_backend, parallel)
    return _frozen_quantized(call, hidden_states, w13, w2, topk_weights, topk_ids, w13_bias,
                             w2_bias, expert_map, residual)
  return _run_experts(hidden_states, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias,
                      apply_router_weight_on_input, global_num_experts, expert_map, None,
                      runner_backend, a2a_backend, parallel, residual)


def _run_experts(hidden_states, w13, w2, topk_weights, topk_ids, act: Activation, w13_bias,
                 w2_bias, apply_router_weight_on_input: bool, global_num_experts, expert_map,
                 quant_config: Optional[QuantConfig], runner_backend: str, a2a_backend: str,
                 parallel: Optional[ParallelConfig], residual):
  """fused_moe after its weights and scheme are checked: routing checks, then the EP path or
  the oracle's (prepare/finalize, experts) pair."""
  t = hidden_states.shape[0]
  k = check_topk(topk_weights, topk_ids, t)
  e_local = w13.shape[0]
  if apply_router_weight_on_input and k != 1:
    raise ValueError(f"apply_router_weight_on_input requires top_k == 1, got top_k={k}")
  if expert_map is not None:
    check_expert_map(expert_map, e_local)
    if global_num_experts is not None and global_num_experts != expert_map.shape[0]:
      raise ValueError(f"global_num_experts={global_num_experts} does not match "
                       f"expert_map length {expert_map.shape[0]}")
    global_num_experts = expert_map.shape[0]
  elif global_num_experts is None:
    global_num_experts = e_local
  elif (parallel is None or parallel.mesh is None) and global_num_experts != e_local:
    raise ValueError(f"global_num_experts={global_num_experts} differs from w13's E={e_local} "
                     "but no expert_map says which experts are local")
  if k > global_num_experts:
    raise ValueError(f"top_k={k} exceeds global_num_experts={global_num_experts}")
  check_ids_in_range(topk_ids, global_num_experts)
  if residual is not None:
    if tuple(residual.shape) != tuple(hidden_states.shape):
      raise ValueError(f"residual must be [T, H] = {tuple(hidden_states.shape)} like "
                       f"hidden_states, got shape {tuple(residual.shape)}")
    check_floating("residual", residual)

  if parallel is not None and parallel.mesh is not None:
    # w13/w2 are the global (expert-sharded) arrays here; placement comes from the config
    if expert_map is not None:
      raise ValueError("expert_map describes one device's experts; with parallel=ParallelConfig"
                       "(mesh=...) pass the global w13/w2 and set ParallelConfig."
                       "expert_placement (see sharding.place_weights)")
    if global_num_experts != e_local:
      raise ValueError(f"global_num_experts={global_num_experts} differs from w13's "
                       f"E={e_local}: with a mesh, w13/w2 hold every expert (sharded)")
    from jmoe.sharding import ep_fused_moe  # noqa: PLC0415 (sharding registers into jmoe, not reverse)
    out = ep_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, activation=act,
                       w13_bias=w13_bias, w2_bias=w2_bias,
                       apply_router_weight_on_input=apply_router_weight_on_input,
                       quant_config=quant_config, runner_backend=runner_backend,
                       a2a_backend=a2a_backend, parallel=parallel)
    if residual is None:
      return out
    return (residual.astype(jnp.float32) + out.astype(jnp.float32)).astype(out.dtype)

  pf, experts, _ = oracle.select_backend(runner_backend, a2a_backend, quant=quant_config,
                                         parallel=None,
                                         problem=(hidden_states.dtype, w13.shape[1], w2.shape[1]))
  if pf.activation_format == ActivationFormat.Batched:
    check_distinct_ids(topk_ids)
  kernel = ModularKernel(pf, experts, quant_config)
  weights = ExpertWeights(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias)
  return kernel(hidden_states, weights, topk_weights, topk_ids, activation=act,
                expert_map=expert_map, apply_router_weight_on_input=apply_router_weight_on_input,
                residual=residual)
