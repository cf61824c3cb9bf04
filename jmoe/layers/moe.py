"""`jmoe.layers.MoE`: a flax.nnx MoE block (router + routed experts + shared experts).

The forward is `jmoe.moe_block`'s composition (router_logits -> select_experts -> fused_moe,
plus the shared experts), written out here so the layer can also return what training needs:
the router logits' losses, the expert load and the capacity drops.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.api import fused_moe
from jmoe.block import MoEParams, fuse_shared_params, router_logits
from jmoe.config import MoEConfig, ParallelConfig, QuantConfig
from jmoe.layers import losses
from jmoe.layers.capacity import (batched_experts_with_capacity, capacity_dropped,
                                  expert_capacity)
from jmoe.layers.partitioning import resolve_axes
from jmoe.layers.variables import QuantizedSlot, variable
from jmoe.modular import ExpertWeights
from jmoe.quant import QuantizedWeights, check_quantized, prepare_for_kernels, quantize_weights
from jmoe.router import RoutingFn, select_experts
from jmoe.shared import fuse_shared_slots, shared_expert_mlp

Initializer = Callable[..., jax.Array]
# expert weights [E, K, N]: fan_in = K, one draw per expert
expert_init_default = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=-2,
                                                        out_axis=-1, batch_axis=(0,))
dense_init_default = nnx.initializers.variance_scaling(1.0, "fan_in", "normal")


class MoE(nnx.Module):
  """A Mixture-of-Experts block as an nnx Module: x [..., H] -> [..., H].

  Args:
    config: shapes and routing semantics (every `select_experts` option: scoring, grouped
      top-k, correction bias, scaling, renormalize; activation; biases; shared experts).
    rngs: nnx.Rngs; `params` initializes, `jitter` (or `default`) draws the router jitter.
    dtype: compute dtype of the experts (None: the input's); the router runs in float32.
    param_dtype: dtype the parameters are stored in.
    runner_backend, a2a_backend, parallel: passed to `fused_moe` (the oracle picks what is
      "auto"); `parallel=ParallelConfig(mesh=...)` runs the experts expert-parallel.
    quant: a scheme name / QuantConfig: the expert weights are drawn, quantized and held as
      non-trainable `QuantizedWeight` variables (forward only: no gradient reaches them).
    input_scales: (w13's, w2's) static input scale, for the static schemes (fp8_tensor_static,
      ...) and only those: `jmoe.quant.calibrate_input_scales`; `load_params` replaces them.
    quant_training: a scheme to train in: the expert weights stay dense `nnx.Param`s, each
      call runs the forward on them quantized to the scheme and the backward as the dense
      block's at the dequantized weights (straight-through; `jmoe.quant.training`). Not with
      `quant`, a static scheme, or the capacity paths.
    prepare_for_kernels: also hold the operands the Pallas kernels derive from quantized
      weights (`jmoe.quant.prepare_for_kernels`: the prefill GEMMs' scale layouts), made at
      construction and on `load_params` instead of on every call; they cost memory (nvfp4:
      a bf16 copy of its scales). None: where the Pallas kernels may run (a GPU backend, the
      runner auto or pallas_mosaic).
    kernel_init, router_init, bias_init: initializers of the expert / shared weights, the
      router weight, and the biases (the correction bias starts at zero).
    routing_fn: `select_experts`' custom_routing_function.
    router_jitter: Switch's multiplicative jitter on the router input, x * U(1-eps, 1+eps),
      applied when not `deterministic` (the experts see the unjittered x).
    capacity_factor: per-expert capacity C = ceil(cf * T * k / E) on the batched path; copies
      over it are dropped and counted in the aux outputs' "dropped".
    sow_aux: also sow the aux outputs as `nnx.Intermediate`s (`nnx.capture(model,
      nnx.Intermediate)` collects them).
    expert_axis, tensor_axis: mesh axis names of the sharding metadata when `parallel` does
      not name them; axes the mesh lacks are dropped.

  Variables: router_w [H, E], router_b [E], w13 [E, H, 2, N] (gated; [E, H, N] otherwise),
  w2 [E, N, H], w13_bias [E, 2, N] / [E, N], w2_bias [E, H], shared_w13 [H, 2Ns],
  shared_w2 [Ns, H], shared_gate [H] are `nnx.Param`s; the DeepSeek correction_bias [E] is an
  `nnx.BatchStat` (set by `update_correction_bias`, not by the optimizer). w13 keeps gate and
  up on their own axis so the intermediate N shards over the tensor axis with each rank's gate
  and up columns together (the layout the EP entry point consumes); `params()` gives jmoe's
  [E, H, 2N]. Sharding names: experts on the expert axis, N on the tensor axis, the rest
  replicated.
  """

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32, runner_backend: Optional[str] = None,
               a2a_backend: str = "auto", parallel: Optional[ParallelConfig] = None,
               quant: Union[str, QuantConfig, None] = None,
               input_scales: Optional[tuple[Any, Any]] = None,
               quant_training: Union[str, QuantConfig, None] = None,
               prepare_for_kernels: Optional[bool] = None,
               kernel_init: Initializer = expert_init_default,
               router_init: Initializer = dense_init_default,
               bias_init: Initializer = nnx.initializers.zeros_init(),
               routing_fn: Optional[RoutingFn] = None, router_jitter: float = 0.0,
               deterministic: bool = False, capacity_factor: Optional[float] = None,
               sow_aux: bool = False, expert_axis: Optional[str] = "expert",
               tensor_axis: Optional[str] = "tensor"):
    if not isinstance(config, MoEConfig):
      raise TypeError(f"config must be a jmoe.MoEConfig, got {type(config).__name__}")
    if not (0.0 <= float(router_jitter) < 1.0):
      raise ValueError(f"router_jitter must be in [0, 1), got {router_jitter!r}")
    if capacity_factor is not None:
      expert_capacity(capacity_factor, 1, 1, 1)  # validates the number
      if config.fuse_shared_experts:
        raise ValueError("capacity_factor cannot be combined with fuse_shared_experts (the "
                         "always-chosen shared slots would be dropped too)")
      if parallel is not None and parallel.mesh is not None:
        raise ValueError("capacity_factor is the single-device batched path; with parallel= "
                         "set ParallelConfig.dispatch_capacity (its drops are returned in the "
                         "aux outputs' 'dropped' too)")
    if isinstance(quant, str):
      quant = QuantConfig(quant)
    if quant is not None and not quant.is_quantized:
      quant = None
    if isinstance(quant_training, str):
      quant_training = QuantConfig(quant_training)
    if quant_training is not None and not quant_training.is_quantized:
      quant_training = None
    if quant_training is not None:
      if quant is not None:
        raise ValueError(f"quant={quant} and quant_training={quant_training}: a layer holds "
                         "quantized weights (inference) or trains dense ones quantized per "
                         "call, not both")
      if quant_training.static_activations:
        raise ValueError(f"quant_training={quant_training}: a static scheme's calibrated input "
                         "scales are for inference; train with its dynamic twin")
      if capacity_factor is not None or (parallel is not None
                                         and parallel.dispatch_capacity is not None):
        raise ValueError("quant_training runs through fused_moe's dropless paths; the capacity "
                         "paths (capacity_factor, ParallelConfig.dispatch_capacity) do not "
                         "take it")
    self.quant_training = quant_training
    static = quant is not None and quant.static_activations
    if static != (input_scales is not None):
      raise ValueError(f"input_scales={input_scales!r} with quant={quant}: a static scheme "
                       "takes (w13's, w2's) input scale (jmoe.quant.calibrate_input_scales, or "
                       "a checkpoint's), the other schemes none")
    self.config = config
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.runner_backend = runner_backend
    self.a2a_backend = a2a_backend
    self.parallel = parallel
    self.quant = quant
    if prepare_for_kernels is None:
      runner = runner_backend or config.runner_backend
      prepare_for_kernels = (quant is not None and jax.default_backend() == "gpu"
                             and runner in (None, "auto", "pallas_mosaic"))
    self.prepare_for_kernels = bool(prepare_for_kernels)
    self.routing_fn = routing_fn
    self.router_jitter = float(router_jitter)
    self.deterministic = deterministic
    self.capacity_factor = capacity_factor
    self.sow_aux = sow_aux
    self.axes, mesh, own_mesh = resolve_axes(parallel, expert_axis, tensor_axis)
    self._init_variables(rngs, kernel_init, router_init, bias_init, mesh, own_mesh,
                         input_scales)
    # forked after the draws, so a layer's initial values do not depend on its jitter
    self.rngs = rngs.fork() if router_jitter > 0 else None

  # ------------------------------------------------------------------------------------------
  # variables

  def _init_variables(self, rngs, kernel_init, router_init, bias_init, mesh, own_mesh,
                      input_scales) -> None:
    c, pdt, ax = self.config, self.param_dtype, self.axes
    e, h, n = c.num_experts, c.hidden_size, c.intermediate_size
    gated = c.act.is_gated
    param = lambda value, *roles: variable(nnx.Param, value, ax.spec(*roles), mesh,  # noqa: E731
                                           own_mesh)

    self.router_w = param(router_init(rngs.params(), (h, e), pdt), None, None)
    self.router_b = param(bias_init(rngs.params(), (e,), pdt), None) if c.router_bias else None
    self.correction_bias = (variable(nnx.BatchStat, jnp.zeros((e,), jnp.float32), (None,), mesh,
                                     own_mesh)
                            if c.use_correction_bias else None)
    w13 = kernel_init(rngs.params(), (e, h, c.w13_out), pdt)
    w2 = kernel_init(rngs.params(), (e, n, h), pdt)
    if self.quant is not None:
      s13, s2 = input_scales or (None, None)
      self._store_quantized(quantize_weights(w13, self.quant, input_scale=s13, argname="w13"),
                            quantize_weights(w2, self.quant, input_scale=s2, argname="w2"),
                            mesh, own_mesh)
      self.w13 = self.w2 = None
    elif gated:
      self.w13 = param(w13.reshape(e, h, 2, n), "expert", None, None, "tensor")
      self.w2 = param(w2, "expert", "tensor", None)
    else:
      self.w13 = param(w13, "expert", None, "tensor")
      self.w2 = param(w2, "expert", "tensor", None)
    b13 = b2 = None
    if c.expert_bias:
      b13 = bias_init(rngs.params(), (e, c.w13_out), pdt)
      b13 = (param(b13.reshape(e, 2, n), "expert", None, "tensor") if gated
             else param(b13, "expert", "tensor"))
      b2 = param(bias_init(rngs.params(), (e, h), pdt), "expert", None)
    self.w13_bias, self.w2_bias = b13, b2
    s13 = s2 = sg = None
    if c.num_shared_experts:
      ns = c.shared_size
      s13 = param(kernel_init(rngs.params(), (1, h, 2 * ns if gated else ns), pdt)[0],
                  None, None)
      s2 = param(kernel_init(rngs.params(), (1, ns, h), pdt)[0], None, None)
      if c.shared_expert_gate:
        sg = param(router_init(rngs.params(), (h, 1), pdt)[:, 0], None)
    self.shared_w13, self.shared_w2, self.shared_gate = s13, s2, sg

  def _store_quantized(self, w13: QuantizedWeights, w2: QuantizedWeights, mesh,
                       own_mesh: bool) -> None:
    if self.prepare_for_kernels:
      dt = self.dtype if self.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
      w13, w2 = prepare_for_kernels(w13, w2, activation=self.config.act, dtype=dt)
    QuantizedSlot.store(self, "w13", w13, self.axes.expert, mesh, own_mesh)
    QuantizedSlot.store(self, "w2", w2, self.axes.expert, mesh, own_mesh)

  def params(self) -> MoEParams:
    """The current values as a MoEParams pytree in jmoe's layout (w13 [E, H, 2N], or
    QuantizedWeights for a quantized layer)."""
    c = self.config
    val = lambda v: None if v is None else v[...]  # noqa: E731
    if self.quant is not None:
      w13, w2 = QuantizedSlot.load(self, "w13"), QuantizedSlot.load(self, "w2")
    else:
      w13, w2 = self.w13[...], self.w2[...]
      w13 = w13.reshape(c.num_experts, c.hidden_size, c.w13_out)
    b13 = val(self.w13_bias)
    if b13 is not None:
      b13 = b13.reshape(c.num_experts, c.w13_out)
    return MoEParams(router_w=self.router_w[...], w13=w13, w2=w2, router_b=val(self.router_b),
                     correction_bias=val(self.correction_bias), w13_bias=b13,
                     w2_bias=val(self.w2_bias), shared_w13=val(self.shared_w13),
                     shared_w2=val(self.shared_w2), shared_gate=val(self.shared_gate))

  def load_params(self, params: MoEParams) -> None:
    """Set every variable from `params` (jmoe's layout, e.g. from `jmoe.interop`); shapes
    must match. Quantized w13 / w2 need a layer built with the same `quant`. The layer may be
    abstract (`nnx.eval_shape(lambda: MoE(...))`): its variables then take the values, so a
    loader never draws the random initial weights."""
    c = self.config
    e, h = c.num_experts, c.hidden_size
    if isinstance(params.w13, QuantizedWeights) != (self.quant is not None):
      raise ValueError(f"params.w13 is {type(params.w13).__name__} but the layer was built with "
                       f"quant={self.quant}: build it with the weights' scheme")
    if self.quant is not None:  # every part (global scales, act-order perms included)
      for name in ("w13", "w2"):
        value = getattr(params, name)
        if value.scheme != self.quant:
          raise ValueError(f"params.{name} is {value.scheme}, the layer holds {self.quant}")
        check_quantized(value, argname=f"params.{name}")
        for part in ("values", "scale"):
          var = getattr(self, f"{name}_{part}")
          if tuple(getattr(value, part).shape) != tuple(var.shape):
            raise ValueError(f"params.{name}.{part} has shape {tuple(getattr(value, part).shape)}"
                             f", the layer's variable {tuple(var.shape)}")
      _, mesh, own_mesh = resolve_axes(self.parallel, self.axes.expert, self.axes.tensor)
      self._store_quantized(dataclasses.replace(params.w13, prepared=None),
                            dataclasses.replace(params.w2, prepared=None), mesh, own_mesh)
    for name in ("router_w", "router_b", "correction_bias", "w2_bias", "shared_w13",
                 "shared_w2", "shared_gate", "w13_bias", "w13", "w2"):
      value = getattr(params, name)
      if self.quant is not None and name in ("w13", "w2"):
        continue
      var = getattr(self, name)
      if (var is None) != (value is None):
        raise ValueError(f"params.{name} is {'missing' if value is None else 'given'} but the "
                         f"layer's config {'needs' if var is not None else 'has no'} it")
      if var is None:
        continue
      if name == "w13":
        value = jnp.asarray(value).reshape(var.shape) if value.shape == (e, h, c.w13_out) \
            else value
      elif name == "w13_bias":
        value = jnp.asarray(value).reshape(var.shape) if value.shape == (e, c.w13_out) \
            else value
      self._assign(f"params.{name}", var, value)

  @staticmethod
  def _assign(argname: str, var: nnx.Variable, value) -> None:
    if tuple(value.shape) != tuple(var.shape):
      raise ValueError(f"{argname} has shape {tuple(value.shape)}, the layer's variable "
                       f"{tuple(var.shape)}")
    value = jnp.asarray(value, var.dtype)
    if isinstance(var.get_value(), jax.ShapeDtypeStruct):  # a layer built by nnx.eval_shape
      var.set_value(value)
    else:
      var[...] = value

  def update_correction_bias(self, load: jax.Array, rate: float = 1e-3) -> None:
    """DeepSeek-V3's aux-loss-free balancing, in place: bias += rate * sign(mean(load) - load).
    load [E]: the aux outputs' "expert_load" (summed over the batch / steps you choose)."""
    if self.correction_bias is None:
      raise ValueError("update_correction_bias needs MoEConfig(use_correction_bias=True)")
    self.correction_bias[...] = losses.correction_bias_update(self.correction_bias[...], load,
                                                              rate)

  # ------------------------------------------------------------------------------------------
  # forward

  def __call__(self, x: jax.Array, *, return_aux: bool = False,
               deterministic: Optional[bool] = None,
               residual: Optional[jax.Array] = None) -> Any:
    """x [..., H] -> y [..., H] (dtype: `dtype`, else x's); with return_aux, (y, aux).

    residual [..., H] (x's shape; the residual stream): y = residual + moe(x), the add inside
    the experts' final weighted reduce (`jmoe.moe_block(..., residual=)`), so under jit the
    result can take the residual's buffer. aux:

      load_balancing_loss: f32 scalar, Switch/Mixtral form (`losses.load_balancing_loss`;
        top_k when balanced);
      router_z_loss: f32 scalar, mean logsumexp(logits)^2;
      expert_load: [E] int32 routed copies per expert (before capacity drops);
      dropped: int32 scalar, copies dropped by the capacity (0 when dropless).
    """
    c = self.config
    if x.shape[-1] != c.hidden_size:
      raise ValueError(f"x must be [..., H] with H={c.hidden_size}, got shape {x.shape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, c.hidden_size)
    cdt = jnp.dtype(self.dtype) if self.dtype is not None else x.dtype
    if residual is not None:
      if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(residual.shape)}")
      residual = residual.reshape(-1, c.hidden_size)
    xc = x2.astype(cdt)
    p = self.params()
    logits = router_logits(self._jittered(x2, deterministic), p)
    weights, ids = select_experts(
        xc, logits, c.top_k, scoring_func=c.scoring_func, renormalize=c.renormalize,
        num_expert_group=c.num_expert_group, topk_group=c.topk_group,
        e_score_correction_bias=p.correction_bias, routed_scaling_factor=c.routed_scaling_factor,
        custom_routing_function=self.routing_fn)
    load = losses.expert_load(ids, c.num_experts)
    out, dropped = self._experts(xc, p, weights, ids, load, cdt, residual)
    out = out.reshape(*lead, c.hidden_size)
    aux = None
    if return_aux or self.sow_aux:
      aux = dict(load_balancing_loss=losses.load_balancing_loss(logits, ids,
                                                                scoring_func=c.scoring_func),
                 router_z_loss=losses.router_z_loss(logits), expert_load=load, dropped=dropped)
    if self.sow_aux:
      for name, value in aux.items():
        self.sow(nnx.Intermediate, name, value)
    return (out, aux) if return_aux else out

  def _jittered(self, x: jax.Array, deterministic: Optional[bool]) -> jax.Array:
    """The router's input: x * U(1 - eps, 1 + eps) when jitter is on and not deterministic."""
    deterministic = self.deterministic if deterministic is None else deterministic
    if self.router_jitter == 0.0 or deterministic:
      return x
    eps = self.router_jitter
    noise = jax.random.uniform(self.rngs.jitter(), x.shape, jnp.float32, 1.0 - eps, 1.0 + eps)
    return (x.astype(jnp.float32) * noise).astype(x.dtype)

  def _cast(self, w, cdt):
    return w if w is None or isinstance(w, QuantizedWeights) else w.astype(cdt)

  def _experts(self, x, p: MoEParams, weights, ids, load, cdt, residual=None):
    """Routed (+ shared) experts (+ residual) -> ([T, H] in cdt, dropped int32)."""
    c = self.config
    w13, w2 = self._cast(p.w13, cdt), self._cast(p.w2, cdt)
    b13, b2 = self._cast(p.w13_bias, cdt), self._cast(p.w2_bias, cdt)
    shared = None
    if c.num_shared_experts and c.fuse_shared_experts:
      fused = fuse_shared_params(MoEParams(router_w=p.router_w, w13=w13, w2=w2, w13_bias=b13,
                                           w2_bias=b2, shared_w13=self._cast(p.shared_w13, cdt),
                                           shared_w2=self._cast(p.shared_w2, cdt)), c)
      w13, w2, b13, b2 = fused.w13, fused.w2, fused.w13_bias, fused.w2_bias
      weights, ids = fuse_shared_slots(weights, ids, c.num_experts, c.num_shared_experts,
                                       c.routed_scaling_factor)
    elif c.num_shared_experts:
      shared = shared_expert_mlp(x, self._cast(p.shared_w13, cdt), self._cast(p.shared_w2, cdt),
                                 c.act, gate=p.shared_gate)
    runner = self.runner_backend or c.runner_backend
    dropped = jnp.int32(0)
    par = self.parallel
    if self.capacity_factor is not None:
      cap = expert_capacity(self.capacity_factor, x.shape[0], c.top_k, c.num_experts)
      out = batched_experts_with_capacity(
          x, ExpertWeights(w13=w13, w2=w2, w13_bias=b13, w2_bias=b2), weights, ids,
          capacity=cap, activation=c.act, runner_backend=runner,
          quant=self.quant, apply_router_weight_on_input=c.apply_router_weight_on_input,
          residual=residual)
      dropped = capacity_dropped(load, cap)
    elif par is not None and par.mesh is not None and par.dispatch_capacity is not None:
      # the EP dispatch may drop: ask the EP entry point for its count (fused_moe hides it)
      from jmoe.sharding import ep_fused_moe  # noqa: PLC0415 (optional part)
      out, stats = ep_fused_moe(
          x, w13, w2, weights, ids, activation=c.act, w13_bias=b13, w2_bias=b2,
          apply_router_weight_on_input=c.apply_router_weight_on_input, quant_config=self.quant,
          runner_backend=runner, a2a_backend=self.a2a_backend, parallel=par, return_stats=True)
      dropped = stats["dropped"]
      if residual is not None:  # the EP combine takes no residual: the plain add
        out = (residual.astype(jnp.float32) + out.astype(jnp.float32)).astype(out.dtype)
    else:
      out = fused_moe(x, w13, w2, weights, ids, activation=c.act, w13_bias=b13, w2_bias=b2,
                      apply_router_weight_on_input=c.apply_router_weight_on_input,
                      runner_backend=runner, a2a_backend=self.a2a_backend, parallel=par,
                      residual=residual, quant_config=self.quant_training)
    if shared is not None:
      out = (out.astype(jnp.float32) + shared.astype(jnp.float32)).astype(x.dtype)
    return out, dropped


def num_params(module: nnx.Module) -> int:
  """Trainable parameter count of `module`."""
  return int(sum(np.prod(v.shape) for v in jax.tree.leaves(nnx.state(module, nnx.Param))))
