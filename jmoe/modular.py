"""The modular MoE kernel: PrepareFinalize -> Experts -> TopKWeightAndReduce.

Names follow vLLM's modular-kernel design so its readers feel at home:

* `PrepareFinalize.prepare` turns `(x, topk_weights, topk_ids)` into an `ExpertsInput` in one of
  two activation formats — `Standard` (`a [M, H]` with `[M, k]` ids/weights) or `Batched`
  (`a [E_local, max_tokens, H]` with `expert_num_tokens [E_local]`) — quantizing the input when
  the experts want it and, in the expert-parallel variants, dispatching across a mesh.
* `Experts.apply` runs the expert MLPs (permute, GEMM1, activation, GEMM2, unpermute) and may or
  may not apply the top-k weights and reduce over k itself; it says which through
  `finalize_weight_and_reduce_impl`.
* `PrepareFinalize.finalize` combines (across the mesh, for EP) and applies that
  `TopKWeightAndReduce`.

`ModularKernel(prepare_finalize, experts)` checks at construction that the two fit and raises a
ValueError naming both when they don't. Calling it is jit-able, and differentiable when the
parts are.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Callable, ClassVar, Optional

import jax
import jax.numpy as jnp

from jmoe.config import QuantConfig
from jmoe.kernels.activations import Activation


class ActivationFormat(enum.Enum):
  Standard = "standard"  # a [M, H], topk ids/weights [M, k]
  Batched = "batched"  # a [E_local, max_tokens, H], expert_num_tokens [E_local]


def _pytree_dataclass(cls):
  """A frozen dataclass registered as a pytree; fields in `meta_fields` are static."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  meta = getattr(cls, "meta_fields", ())
  data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
  return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))


@_pytree_dataclass
class ExpertWeights:
  """Expert weights in jmoe's layout: w13 [E, H, 2N] (gate | up) or [E, H, N] (non-gated),
  w2 [E, N, H]; optional biases w13_bias [E, 2N], w2_bias [E, H]. w13 and w2 are dense
  arrays or both `jmoe.quant.QuantizedWeights` of one scheme (whose `.shape` is the logical
  shape above; their values, scales and zero points are in the scheme's layout)."""

  w13: Any
  w2: Any
  w13_bias: Optional[jax.Array] = None
  w2_bias: Optional[jax.Array] = None

  @property
  def num_experts(self) -> int:
    return int(self.w13.shape[0])

  @property
  def hidden_size(self) -> int:
    return int(self.w13.shape[1])

  @property
  def intermediate_size(self) -> int:
    return int(self.w2.shape[1])


@_pytree_dataclass
class ExpertsInput:
  """What `prepare` hands to the experts.

  Standard: `a` [M, H] (M = tokens this rank computes for), `topk_ids` [M, k] in *global*
    numbering (experts map them with `expert_map` when they support it), `topk_weights` [M, k]
    (ones when the router weight was applied on the input). A row of `a` none of whose slots
    this rank computes may hold anything, NaN included (the ragged EP paths leave such rows of
    their receive buffers unwritten): experts must not let it reach a result or a gradient,
    for example through a 0 weight times its value.
  Batched: `a` [E_local, C, H], `expert_num_tokens` [E_local]; `slot_expert`/`slot_pos` [T, k]
    locate each token slot in the batched layout (slot_pos = -1: not computed here) so that
    finalize can gather it back; `dropped` counts slots that did not fit the capacity C.
  `a_scale` carries activation quantization scales when the input was quantized.
  """

  a: jax.Array
  topk_weights: jax.Array
  topk_ids: jax.Array
  a_scale: Optional[jax.Array] = None
  expert_num_tokens: Optional[jax.Array] = None
  slot_expert: Optional[jax.Array] = None
  slot_pos: Optional[jax.Array] = None
  dropped: Optional[jax.Array] = None
  extra: Any = None  # backend-specific state prepare leaves for finalize (EP routing plans)
  format: ActivationFormat = ActivationFormat.Standard
  meta_fields: ClassVar[tuple[str, ...]] = ("format",)


# --------------------------------------------------------------------------------------------
# TopKWeightAndReduce


class TopKWeightAndReduce(abc.ABC):
  """Where the top-k weighting and the sum over k happen."""

  name: ClassVar[str]

  @abc.abstractmethod
  def apply(self, fused_out: jax.Array, inp: ExpertsInput, out_dtype,
            residual: Optional[jax.Array] = None) -> jax.Array:
    """fused_out (experts' output) -> [T, H]; with residual [T, H], residual + that, the add
    done on the f32 sum before the one cast to out_dtype (so XLA fuses it into the reduce)."""

  def __repr__(self):
    return f"{type(self).__name__}()"


class NoOp(TopKWeightAndReduce):
  """The experts already weighted and reduced: fused_out is [T, H]."""

  name = "noop"

  def apply(self, fused_out, inp, out_dtype, residual=None):
    if residual is not None:
      return _plus(residual, fused_out.astype(jnp.float32)).astype(out_dtype)
    return fused_out.astype(out_dtype)


def _plus(residual: Optional[jax.Array], acc: jax.Array) -> jax.Array:
  """acc (f32) + residual in f32 (residual None: acc)."""
  return acc if residual is None else acc + residual.astype(jnp.float32)


class Contiguous(TopKWeightAndReduce):
  """fused_out is [T, k, H] per slot: out[t] = sum_j w[t, j] * fused_out[t, j]."""

  name = "contiguous"

  def apply(self, fused_out, inp, out_dtype, residual=None):
    w = jnp.where(inp.topk_ids >= 0, inp.topk_weights.astype(jnp.float32), 0.0)
    return _plus(residual, jnp.einsum("tk,tkh->th", w, fused_out.astype(jnp.float32))
                 ).astype(out_dtype)


def weighted_row_sum(src: jax.Array, idx: jax.Array, weights: jax.Array, out_dtype,
                     residual: Optional[jax.Array] = None) -> jax.Array:
  """out[t] = sum_j weights[t, j] * src[idx[t, j]], f32 accumulation; idx < 0 contributes 0.

  src [R, H], idx / weights [T, k] -> [T, H]; residual [T, H]: added to the f32 sum (one
  fusion with the gather-reduce; XLA may write it in the residual's buffer). src, the indices and the weights are materialized
  before the gather (an optimization barrier): left fusable, XLA:GPU folded their producers
  (sorts' inverses, segment arithmetic) into the gather-reduce and recomputed them per element
  (H200, qwen3 sizes, 1024 tokens: the padded_a2a combine took 0.51 ms, 0.02 ms with it).
  """
  if src.shape[0] == 0 or idx.size == 0:  # nothing routed anywhere (e.g. zero tokens)
    if residual is not None:
      return residual.astype(out_dtype)
    return jnp.zeros(idx.shape[:1] + src.shape[1:], out_dtype)
  valid = idx >= 0
  src, idx, w, valid = jax.lax.optimization_barrier(
      (src, jnp.where(valid, idx, 0).astype(jnp.int32),
       jnp.where(valid, weights.astype(jnp.float32), 0.0), valid))
  rows = jnp.take(src, idx, axis=0, mode="clip").astype(jnp.float32)  # [T, k, H]
  # selected, not only weighted by 0: src rows nobody wrote may hold NaN (an EP receive buffer)
  rows = jnp.where(valid[..., None], rows, 0.0)
  return _plus(residual, jnp.sum(rows * w[..., None], axis=1)).astype(out_dtype)


class NaiveBatched(TopKWeightAndReduce):
  """fused_out is [E_local, C, H]: gather each slot's row back and weight-sum (no scatter)."""

  name = "naive_batched"

  def apply(self, fused_out, inp, out_dtype, residual=None):
    e, c, h = fused_out.shape
    flat_idx = jnp.where(inp.slot_pos >= 0, inp.slot_expert * c + inp.slot_pos, -1)
    return weighted_row_sum(fused_out.reshape(e * c, h), flat_idx, inp.topk_weights, out_dtype,
                            residual=residual)


class Delegate(TopKWeightAndReduce):
  """The experts don't care: the PrepareFinalize applies its own default."""

  name = "delegate"

  def apply(self, fused_out, inp, out_dtype, residual=None):
    raise RuntimeError("Delegate must be resolved by the PrepareFinalize before use")


# --------------------------------------------------------------------------------------------
# PrepareFinalize


class PrepareFinalize(abc.ABC):
  """Moves tokens to experts (`prepare`) and results back (`finalize`)."""

  name: ClassVar[str]
  activation_format: ClassVar[ActivationFormat]
  topk_indices_dtype: ClassVar[Any] = jnp.int32
  default_weight_and_reduce: ClassVar[TopKWeightAndReduce]

  def max_num_tokens_per_rank(self) -> Optional[int]:
    """Static bound on tokens per rank the layout is built for (None: any)."""
    return None

  def num_dispatchers(self) -> int:
    """How many ranks send tokens to each expert-owning rank."""
    return 1

  def quant_support(self, quant: Optional[QuantConfig]) -> Optional[str]:
    """None when prepare can quantize the input for `quant`, else the reason it cannot.
    The local and EP prepares quantize dynamically (per token, token group, or tensor) or
    with the static scale they are given (`a1_scale`, w13's input_scale)."""
    return None

  def supports_quant(self, quant: Optional[QuantConfig]) -> bool:
    return self.quant_support(quant) is None

  @abc.abstractmethod
  def prepare(self, x: jax.Array, topk_weights: jax.Array, topk_ids: jax.Array, *,
              num_local_experts: int, expert_map: Optional[jax.Array],
              apply_router_weight_on_input: bool,
              quant: Optional[QuantConfig],
              a1_scale: Optional[jax.Array] = None) -> ExpertsInput:
    """x [T, H], topk [T, k] -> ExpertsInput in `activation_format`. `a1_scale`: the static
    per-tensor scale that quantizes x under act_scale="static_tensor" (w13's input_scale);
    the experts then get it as `a_scale` [1, 1]."""

  def prepare_async(self, *args, **kwargs) -> Callable[[], ExpertsInput]:
    """Start the dispatch and return a receiver; work placed between the two overlaps it.

    Local variants have nothing to overlap: the receiver returns the prepared input.
    """
    prepared = self.prepare(*args, **kwargs)
    return lambda: prepared

  # whether finalize takes `residual=` (the local ones do; the EP combines do not yet, and
  # ModularKernel adds the residual after them)
  supports_residual: ClassVar[bool] = False

  def finalize(self, fused_out: jax.Array, inp: ExpertsInput,
               weight_and_reduce: TopKWeightAndReduce, out_dtype,
               residual: Optional[jax.Array] = None) -> jax.Array:
    """Apply the weight-and-reduce (and, for EP, combine across the mesh) -> [T, H]; with
    residual [T, H], residual + that (seed 003: the combine writes into the residual stream,
    the add inside the final reduce)."""
    if isinstance(weight_and_reduce, Delegate):
      weight_and_reduce = self.default_weight_and_reduce
    if residual is None:
      return weight_and_reduce.apply(fused_out, inp, out_dtype)
    return weight_and_reduce.apply(fused_out, inp, out_dtype, residual=residual)

  def __repr__(self):
    return f"{type(self).__name__}()"


# --------------------------------------------------------------------------------------------
# Experts


class Experts(abc.ABC):
  """The expert MLPs: permute -> GEMM1 -> act(+mul) -> [quant] -> GEMM2 -> unpermute."""

  name: ClassVar[str]
  activation_formats: ClassVar[tuple[ActivationFormat, ActivationFormat]]
  supports_expert_map: ClassVar[bool] = True
  differentiable: ClassVar[bool] = True
  # whether apply takes `residual=` [T, H] and adds it inside its own weighted reduce (only
  # meaningful with finalize_weight_and_reduce_impl NoOp); else finalize adds it
  supports_residual: ClassVar[bool] = False

  def quant_support(self, quant: Optional[QuantConfig]) -> Optional[str]:
    """None when `apply` can run weights (and activations) quantized as `quant`, else why not."""
    if quant is None or not quant.is_quantized:
      return None
    return f"{self!r} runs unquantized weights only"

  def supports_quant(self, quant: Optional[QuantConfig]) -> bool:
    return self.quant_support(quant) is None

  def supports_activation(self, activation: Activation) -> bool:
    return True

  def problem_support(self, dtype, hidden_size: int, intermediate_size: int,
                      quant: Optional[QuantConfig] = None) -> Optional[str]:
    """None when `apply` can run this dtype and these sizes (with weights quantized as `quant`),
    else the reason it cannot."""
    return None

  @classmethod
  def is_available(cls) -> tuple[bool, str]:
    """Whether this backend can run on the current platform, and why not."""
    return True, "pure JAX: runs everywhere"

  @abc.abstractmethod
  def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
    """What finalize must still do with `apply`'s output."""

  @abc.abstractmethod
  def apply(self, inp: ExpertsInput, weights: ExpertWeights, *, activation: Activation,
            expert_map: Optional[jax.Array], out_dtype) -> jax.Array:
    """Run the experts on `inp`; the result's layout matches finalize_weight_and_reduce_impl."""

  def workspace_shapes(self, inp: ExpertsInput, weights: ExpertWeights, out_dtype, *,
                       activation: Optional[Activation] = None) -> jax.ShapeDtypeStruct:
    """Static shape/dtype of `apply`'s output (for donation / output aliasing).

    `activation` defaults to silu, or silu_no_mul when w13 is [E, H, N] (non-gated)."""
    if activation is None:
      gated = weights.w13.shape[-1] == 2 * weights.intermediate_size
      activation = Activation("silu" if gated else "silu_no_mul")
    return jax.eval_shape(
        lambda i, w: self.apply(i, w, activation=activation, expert_map=None,
                                out_dtype=out_dtype), inp, weights)

  def __repr__(self):
    return f"{type(self).__name__}()"


class BatchedExperts(Experts):
  """Base of Batched-format experts: `[E_local, C, H]` in and out, ids already local (the
  batched prepare applied the expert_map), finalize gathers and weights (NaiveBatched)."""

  activation_formats = (ActivationFormat.Batched, ActivationFormat.Batched)
  supports_expert_map = False

  def finalize_weight_and_reduce_impl(self):
    return NaiveBatched()


def local_expert_ids(topk_ids: jax.Array, num_local_experts: int,
                     expert_map: Optional[jax.Array]) -> jax.Array:
  """Global ids -> local ids in [0, E_local), or E_local (a sentinel) for slots this rank does
  not compute: empty (-1), not local (expert_map -1) or out of range."""
  ids = topk_ids.astype(jnp.int32)
  if expert_map is not None:
    n_global = expert_map.shape[0]
    ok = (ids >= 0) & (ids < n_global)
    emap = jnp.asarray(expert_map, jnp.int32)  # may be a NumPy array closed over by a jit
    ids = jnp.where(ok, emap[jnp.clip(ids, 0, n_global - 1)], -1)
  valid = (ids >= 0) & (ids < num_local_experts)
  return jnp.where(valid, ids, num_local_experts)


# --------------------------------------------------------------------------------------------
# ModularKernel


class IncompatiblePartsError(ValueError):
  """A PrepareFinalize and an Experts that cannot work together."""


def compatibility(pf: PrepareFinalize, experts: Experts,
                  quant: Optional[QuantConfig] = None) -> Optional[str]:
  """None when the pair fits, else the reason it does not."""
  if pf.activation_format != experts.activation_formats[0]:
    return (f"{pf!r} produces the {pf.activation_format.value} format but {experts!r} takes "
            f"{experts.activation_formats[0].value}")
  why = pf.quant_support(quant)
  if why is not None:
    return f"{pf!r} cannot quantize the input for {quant}: {why}"
  why = experts.quant_support(quant)
  if why is not None:
    return f"{experts!r} does not support {quant}: {why}"
  return None


class ModularKernel:
  """prepare -> experts -> finalize, checked for compatibility at construction."""

  def __init__(self, prepare_finalize: PrepareFinalize, experts: Experts,
               quant: Optional[QuantConfig] = None):
    reason = compatibility(prepare_finalize, experts, quant)
    if reason is not None:
      raise IncompatiblePartsError(
          f"{prepare_finalize!r} and {experts!r} cannot be combined: {reason}")
    self.prepare_finalize = prepare_finalize
    self.experts = experts
    self.quant = quant

  def __repr__(self):
    return f"ModularKernel({self.prepare_finalize!r}, {self.experts!r})"

  def __call__(self, x: jax.Array, weights: ExpertWeights, topk_weights: jax.Array,
               topk_ids: jax.Array, *, activation: Activation,
               expert_map: Optional[jax.Array] = None,
               apply_router_weight_on_input: bool = False,
               shared_output: Optional[Callable[[], jax.Array]] = None,
               residual: Optional[jax.Array] = None) -> jax.Array:
    """x [T, H] -> [T, H]. `shared_output`, if given, is computed between dispatch send and
    receive (overlap for the EP variants) and added to the result. `residual` [T, H], if
    given, is added inside finalize's reduce (the result is residual + the MoE output)."""
    pf, experts = self.prepare_finalize, self.experts
    if expert_map is not None and pf.activation_format == ActivationFormat.Standard \
        and not experts.supports_expert_map:
      raise IncompatiblePartsError(f"{experts!r} does not support expert_map (with {pf!r})")
    if not experts.supports_activation(activation):
      raise IncompatiblePartsError(f"{experts!r} does not support activation "
                                   f"{activation.name!r} (with {pf!r})")
    receive = pf.prepare_async(
        x, topk_weights, topk_ids, num_local_experts=weights.num_experts,
        expert_map=expert_map, apply_router_weight_on_input=apply_router_weight_on_input,
        quant=self.quant, a1_scale=getattr(weights.w13, "input_scale", None))
    shared = shared_output() if shared_output is not None else None
    inp = receive()
    wr = experts.finalize_weight_and_reduce_impl()
    if residual is not None and experts.supports_residual and isinstance(wr, NoOp) \
        and pf.supports_residual:  # the experts' own gather-sum starts from the residual
      fused = experts.apply(inp, weights, activation=activation, expert_map=expert_map,
                            out_dtype=x.dtype, residual=residual)
      residual = None
    else:
      fused = experts.apply(inp, weights, activation=activation, expert_map=expert_map,
                            out_dtype=x.dtype)
    if residual is None:
      out = pf.finalize(fused, inp, wr, x.dtype)
    elif pf.supports_residual:
      out = pf.finalize(fused, inp, wr, x.dtype, residual=residual)
    else:  # a combine that cannot take it yet: the plain add after it
      out = pf.finalize(fused, inp, wr, x.dtype)
      out = (residual.astype(jnp.float32) + out.astype(jnp.float32)).astype(x.dtype)
    if shared is not None:
      out = (out.astype(jnp.float32) + shared.astype(jnp.float32)).astype(x.dtype)
    return out
