"""Run jmoe from PyTorch: a `torch.nn.Module` whose forward and backward are jitted JAX, with
tensors handed across zero-copy through DLPack.

    block = jmoe.interop.torch_bridge.JmoeMoE.from_hf(hf_model.model.layers[3].mlp)
    y = block(x)            # x [..., H] torch tensor; y.backward() reaches block's parameters

Per call, only the activations cross: parameters are converted to JAX once and again only when
they change (`_TensorCache`: keyed on the tensor object, checked against its data pointer and
torch's in-place version counter, so an optimizer step is seen by the next call); so are the
operands the Pallas kernels derive from weight-only quantized weights (`prepare_for_kernels`:
made on the JAX side when the module's weights convert, not inside every call). Three paths:

* forward-only (`torch.no_grad()`, or nothing differentiable requires grad): the jitted
  forward alone; no VJP, no residuals, no autograd node.
* eager training: `_BridgeFunction` (a `torch.autograd.Function`) runs `jax.vjp` under `jit`
  and keeps the VJP closure (the residuals) until backward.
* under `torch.compile`: the custom op `jmoe::fused_moe` (one opaque graph node, with a fake
  implementation for shapes); its registered autograd recomputes the forward inside the jitted
  VJP in backward (a custom op can return only tensors, so it cannot hand a VJP closure on).

CUDA stream ordering is DLPack's stream protocol, no device synchronize: on import JAX's
external-ready stream waits (an event recorded on torch's *current* stream) for the work queued
there, as `jax.dlpack.from_dlpack` would have torch's `__dlpack__` arrange; on export jaxlib
makes torch's current stream wait for the JAX computation, as `torch.from_dlpack(array)`
would. Both run through jaxlib's and torch's C entry points resolved once (`_Fast`), with the
stream handle, torch's ExternalStream and one Event cached; any failure there falls back to
the public functions. Cached parameters do not cross again, but the activations always do, and their
crossing orders everything queued before on torch's current stream (an optimizer step too).

Rules that keep the zero-copy sound: nothing here donates a JAX buffer, so a torch view of one
never dangles, and JAX never writes into memory torch owns (its inputs are never donated).
Do not pass arrays from `to_jax` to a jit with `donate_argnums`, nor donate arrays you gave
`to_torch`.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import os
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import jax
import torch

from jmoe._validate import checkify_ids
from jmoe.block import MoEParams, moe_block
from jmoe.config import MoEConfig

_FIELDS = tuple(f.name for f in dataclasses.fields(MoEParams))
# QuantizedWeights' arrays; packed 4-bit values cross as uint8, e8m0 / e4m3 scales as themselves
_QUANT_PARTS = ("values", "scale", "zero", "input_scale", "global_scale", "perm")
# XLA:CPU wants 64-byte aligned buffers; an unaligned tensor (a view at an offset) is copied.
_CPU_ALIGN = 64

# Counts for tests and profiling: conversions (a torch tensor wrapped for JAX by the cache),
# forwards (forward-only calls), vjp_forwards (forwards that keep residuals), op_calls.
STATS: collections.Counter = collections.Counter()


# --------------------------------------------------------------------------------------------
# tensors across


def to_jax(t: torch.Tensor) -> jax.Array:
  """torch -> jax, sharing memory (any dtype DLPack carries: f32, bf16, f16, fp8 e4m3/e5m2,
  int8, int32, uint8 — packed 4-bit travels as uint8 and is reinterpreted in JAX).

  One explicit copy, only when sharing is impossible: `t` non-contiguous (DLPack describes only
  dense row-major tensors to XLA) or, on the CPU, not 64-byte aligned (a view at an offset;
  XLA rejects those). `t` is detached (the JAX array is outside autograd). On CUDA the JAX
  computations using the array wait for the work queued on torch's current stream.
  """
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
  return _to_jax(t)


def _to_jax(t: torch.Tensor) -> jax.Array:
  if not t.is_contiguous():
    t = t.contiguous()  # the one documented copy
  elif not t.is_cuda and t.data_ptr() % _CPU_ALIGN:
    t = t.clone()  # torch's CPU allocator aligns to 64 bytes
  try:
    return _from_dlpack(t)
  except ValueError as e:  # another platform's alignment rule: copy once, as documented
    if "aligned" not in str(e):
      raise
    return _from_dlpack(t.clone())


# torch dtypes JAX canonicalizes on import (x64 off): they take the public, converting path
_WIDE = (torch.int64, torch.float64, torch.uint64, torch.complex128)

# How JAX waits for torch's current stream on import (CUDA), env JMOE_TORCH_BRIDGE_STREAM:
#  "handshake" (default): DLPack's protocol as `jax.dlpack.from_dlpack` runs it (torch makes
#    JAX's external-ready stream wait for its current stream, JAX records the array's
#    definition event on that stream), with the stream handle, torch's ExternalStream and one
#    reused Event cached instead of made per call (torch's `__dlpack__` makes new ones).
#    Handing jaxlib torch's stream itself (no torch-side event) is refused by jaxlib 0.11.2.
#  "public": `jax.dlpack.from_dlpack` unchanged.
# JMOE_TORCH_BRIDGE_EXPORT="public" sends outputs through `torch.from_dlpack` (default "fast").
STREAM_MODE = os.environ.get("JMOE_TORCH_BRIDGE_STREAM", "handshake")
EXPORT_MODE = os.environ.get("JMOE_TORCH_BRIDGE_EXPORT", "fast")
# Capsules a jaxlib call refused: it may already have run their deleter, so their destructor
# must never run (a double free); kept for the process' life (one per fallback, then no more).
_REFUSED: list = []


class _Fast:
  """jaxlib's and torch's DLPack entry points, resolved once (None: not available here)."""

  def __init__(self) -> None:
    from jax._src.lib import _jax, jaxlib_extension_version  # noqa: PLC0415
    self.to_buffer = _jax.dlpack_managed_tensor_to_buffer
    self.to_capsule = _jax.buffer_to_dlpack_managed_tensor
    # jaxlib >= 467 takes the DLPack device type (CUDA / ROCm / CPU) as a 5th argument
    self.new_sig = jaxlib_extension_version >= 467
    self.gpu_dl = 10 if torch.version.hip else 2  # kDLROCM / kDLCUDA
    self.raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    self.devices: dict[int, Any] = {}  # torch device index (-1: CPU) -> JAX device
    self.handshake: dict[int, tuple] = {}  # CUDA index -> (JAX stream, ExternalStream, Event)
    self.lock = threading.Lock()  # the reused event's record + wait are one step

  def device(self, index: int):
    d = self.devices.get(index)
    if d is None:
      from jax._src import xla_bridge  # noqa: PLC0415
      platform = "cpu" if index < 0 else ("rocm" if torch.version.hip else "cuda")
      d = self.devices[index] = xla_bridge.get_backend(platform).device_from_local_hardware_id(
          max(index, 0))
    return d

  def torch_stream(self, index: int) -> int:
    """torch's current stream on CUDA device `index`, as DLPack numbers it (1: legacy default)."""
    return self.raw_stream(index) or 1

  def import_(self, t: torch.Tensor, index: int) -> jax.Array:
    device = self.device(index)
    dl = 1 if index < 0 else self.gpu_dl
    extra = (dl,) if self.new_sig else ()
    if index < 0:
      return self._buffer(torch._C._to_dlpack(t), device, None, extra)
    hs = self.handshake.get(index)
    if hs is None:
      stream = device.get_stream_for_external_ready_events()
      hs = self.handshake[index] = (stream, torch.cuda.ExternalStream(stream, device=index),
                                    torch.cuda.Event())
    stream, ext, event = hs
    with self.lock:  # another thread's record between ours and the wait would be waited on
      event.record(torch.cuda.current_stream(index))
      ext.wait_event(event)
    return self._buffer(torch._C._to_dlpack(t), device, stream, extra)

  def _buffer(self, capsule, device, stream: Optional[int], extra: tuple) -> jax.Array:
    try:
      return self.to_buffer(capsule, device, stream, False, *extra)
    except BaseException:
      _REFUSED.append(capsule)  # see _REFUSED
      raise

  def export(self, a: jax.Array, index: int) -> torch.Tensor:
    """a (on torch's device `index`) -> torch; on CUDA torch's current stream waits for it."""
    stream = None if index < 0 else self.torch_stream(index)
    capsule = self.to_capsule(a, stream=stream)
    try:
      return torch._C._from_dlpack(capsule)
    except BaseException:
      _REFUSED.append(capsule)
      raise


_FAST: Optional[_Fast] = None
_FAST_DLPACK = True  # False once the fast path failed: the public functions from then on


def _fast() -> Optional[_Fast]:
  global _FAST, _FAST_DLPACK
  if _FAST is None and _FAST_DLPACK:
    try:
      _FAST = _Fast()
    except (ImportError, AttributeError):
      _FAST_DLPACK = False
  return _FAST


def _index(t: torch.Tensor) -> int:
  """torch device index, -1 for the CPU; None where the fast path does not apply."""
  if t.is_cuda:
    return t.get_device()
  return -1 if t.device.type == "cpu" and not t.is_pinned() else None


_FAST_ERRORS = (ImportError, AttributeError, TypeError, KeyError, RuntimeError,
                NotImplementedError)


def _from_dlpack(t: torch.Tensor) -> jax.Array:
  """`jax.dlpack.from_dlpack(t, copy=False)` minus its per-call Python (backend lookup,
  torch's `__dlpack__` with a new ExternalStream and Event per call, a `jnp.asarray` no-op);
  the same stream ordering (`STREAM_MODE`). Falls back to the public function where jaxlib's or
  torch's internals differ."""
  global _FAST_DLPACK
  fast = _fast()
  if fast is not None and STREAM_MODE != "public" and t.dtype not in _WIDE and not t.is_conj():
    index = _index(t)
    if index is not None:
      try:
        return fast.import_(t, index)
      except _FAST_ERRORS:
        _FAST_DLPACK = False  # internals differ (or UNIMPLEMENTED streams): public path
  return jax.dlpack.from_dlpack(t.detach(), copy=False)


def to_torch(a: jax.Array) -> torch.Tensor:
  """jax -> torch, sharing memory; on CUDA torch's current stream waits for `a` (DLPack)."""
  if not isinstance(a, jax.Array):
    raise TypeError(f"a must be a jax.Array, got {type(a).__name__}")
  if a.is_deleted():  # donated or deleted: its memory may already hold something else
    raise ValueError("a has been deleted or donated; torch cannot view its buffer")
  return torch.from_dlpack(a)


def _to_torch(a: jax.Array, index: int) -> torch.Tensor:
  """`to_torch` of a fresh output of ours on torch device `index` (-1: CPU): no checks, no
  `torch.from_dlpack` / `jax.Array.__dlpack__` Python (device lookup, kwarg retries)."""
  global _FAST_DLPACK
  fast = _fast()
  if fast is not None and EXPORT_MODE == "fast":
    try:
      return fast.export(a, index)
    except _FAST_ERRORS:
      _FAST_DLPACK = False
  return torch.from_dlpack(a)


def view_packed_4bit(a: jax.Array, dtype: str = "int4") -> jax.Array:
  """Packed 4-bit weights cross DLPack as uint8 [..., n] (two values a byte, low nibble
  first); this reinterprets them in JAX as `dtype` ("int4", "uint4", "float4_e2m1fn")
  [..., 2n] (a bitcast; free inside jit). The reverse, for torch: `jax.lax.bitcast_convert_type
  (x.reshape(..., n, 2), jnp.uint8)`."""
  import jax.numpy as jnp  # noqa: PLC0415
  if a.dtype != jnp.uint8:
    raise TypeError(f"a must be packed uint8, got {a.dtype}")
  from jmoe.quant.packing import view_4bit  # noqa: PLC0415
  out = view_4bit(a, jnp.dtype(dtype))  # [..., n, 2]
  return out.reshape(*a.shape[:-1], 2 * a.shape[-1])


class _TensorCache:
  """torch tensor -> its JAX array, converted once and again only when the tensor changed.

  Keyed on the tensor object (a weak reference: an entry dies with its tensor) and valid while
  the tensor's data pointer and version counter (bumped by every in-place op: optimizer steps,
  `copy_`, `load_state_dict`) are unchanged. Writes through `.data` bypass the counter; they
  are still seen where the conversion shared memory (always, unless non-contiguous or
  unaligned); otherwise call `invalidate()`.
  """

  def __init__(self) -> None:
    # id(tensor) -> (weakref to it, (data_ptr, version), jax array); the weakref's callback
    # drops the entry when the tensor dies (tensors cannot be WeakKeyDictionary keys: their
    # == is elementwise)
    self._entries: dict[int, tuple] = {}

  def get(self, t: torch.Tensor) -> jax.Array:
    try:
      key = (t.data_ptr(), t._version)
    except RuntimeError:  # inference-mode tensors keep no version counter: not cached
      return to_jax(t)
    hit = self._entries.get(id(t))
    if hit is not None and hit[1] == key and hit[0]() is t:
      return hit[2]
    a = to_jax(t)
    i, entries = id(t), self._entries
    ref = weakref.ref(t, lambda _, i=i, entries=entries: entries.pop(i, None))
    entries[i] = (ref, key, a)
    STATS["conversions"] += 1
    return a

  def invalidate(self) -> None:
    self._entries.clear()

  def __len__(self) -> int:
    return len(self._entries)


CACHE = _TensorCache()


# --------------------------------------------------------------------------------------------
# what crosses: a spec, its jitted functions, and the three paths


@dataclasses.dataclass(frozen=True)
class BridgeSpec:
  """One bridged JAX function `fn(*arrays) -> [T, H]` (hashable: equal specs share compiles).

  diff[i]: whether argument i is differentiable (floating and trained);
  uncached: how many leading arguments change every call (activations, routing) and cross
  each time; the rest (weights) go through `CACHE`.
  """

  fn: Callable
  diff: tuple[bool, ...]
  uncached: int = 1


class _Jitted:
  """The jitted forward, forward-with-VJP, backward and recomputing backward of one spec."""

  def __init__(self, spec: BridgeSpec):
    where = tuple(i for i, d in enumerate(spec.diff) if d)

    def fn(*args):
      # Traced without jmoe's debug checkify check of the expert ids (they come from a router,
      # in range by construction): its effect would take every call off jit's C++ fast path
      # (~+100 us of Python dispatch per call).
      with checkify_ids(False):
        return spec.fn(*args)

    def fwd_vjp(*args):  # VJP over the differentiable arguments only (ids are integers)
      def f(*d):
        full = list(args)
        for i, v in zip(where, d):
          full[i] = v
        return fn(*full)
      return jax.vjp(f, *[args[i] for i in where])

    self.forward = jax.jit(fn)
    self.forward_vjp = jax.jit(fwd_vjp)
    self.backward = jax.jit(lambda vjp_fn, g: vjp_fn(g))
    self.recompute_backward = jax.jit(lambda g, *args: fwd_vjp(*args)[1](g))


@functools.lru_cache(maxsize=None)
def _jitted(spec: BridgeSpec) -> _Jitted:
  return _Jitted(spec)


_SPECS: dict[str, BridgeSpec] = {}
_KEYS: dict[BridgeSpec, str] = {}


# key prefix -> function building the spec a key names (keys that encode their spec, so code
# traced by torch.compile can name one without registering it: no side effects while tracing)
_RESOLVERS: dict[str, Callable[[str], BridgeSpec]] = {}


def register_spec(spec: BridgeSpec) -> str:
  """The string naming `spec` for the custom op (ops take tensors and strings only)."""
  key = _KEYS.get(spec)
  if key is None:
    key = _KEYS[spec] = f"spec{len(_KEYS)}"
    _SPECS[key] = spec
  return key


def register_resolver(prefix: str, resolve: Callable[[str], BridgeSpec]) -> None:
  """Keys "prefix:..." name the spec `resolve(key)` builds (on first use, then cached)."""
  _RESOLVERS[prefix] = resolve


def spec_of(key: str) -> BridgeSpec:
  """The spec a key names (registered, or built by its prefix's resolver)."""
  spec = _SPECS.get(key)
  if spec is None:
    prefix = key.partition(":")[0]
    if prefix not in _RESOLVERS:
      raise KeyError(f"spec key {key!r} names no registered spec")
    spec = _SPECS[key] = _RESOLVERS[prefix](key)
  return spec


def _convert(spec: BridgeSpec, tensors: Sequence[torch.Tensor],
             weights: Optional["WeightGroup"] = None) -> list[jax.Array]:
  """The spec's arguments in JAX: the leading `spec.uncached` tensors cross, the rest come
  from `weights` (one module's group) or the shared `CACHE`."""
  n = spec.uncached
  moving = [to_jax(t) for t in tensors[:n]]
  return moving + (weights.arrays(tensors[n:]) if weights is not None else
                   [CACHE.get(t) for t in tensors[n:]])


class WeightGroup:
  """One module's weights as JAX arrays, checked with one pass over (object, data pointer,
  version) per call instead of a `CACHE` lookup per tensor; a change goes through `CACHE`.

  derive: `derive(arrays) -> more arrays` appended after the converted ones (the kernels'
  prepared operands, `JmoeMoE(prepare_for_kernels=)`), made again only when one of the arrays
  at `derive_from` (indices into the weights) changes: a training step that updates the
  router leaves the quantized experts' operands alone."""

  __slots__ = ("_tensors", "_state", "_arrays", "_derive", "_derive_from", "_derived")

  def __init__(self, derive: Optional[Callable[[list], list]] = None,
               derive_from: Sequence[int] = ()) -> None:
    self._tensors: tuple = ()
    self._state: Optional[list] = None
    self._arrays: list[jax.Array] = []
    self._derive = derive
    self._derive_from = tuple(derive_from)
    self._derived: Optional[tuple] = None  # (the source arrays, what derive made of them)

  def arrays(self, tensors: Sequence[torch.Tensor]) -> list[jax.Array]:
    try:
      state = [(t.data_ptr(), t._version) for t in tensors]
    except RuntimeError:  # inference-mode tensors keep no version counter: CACHE decides
      return self._with_derived([CACHE.get(t) for t in tensors])
    if state == self._state and all(map(operator.is_, tensors, self._tensors)):
      return self._arrays
    self._arrays = self._with_derived([CACHE.get(t) for t in tensors])
    self._tensors, self._state = tuple(tensors), state
    return self._arrays

  def _with_derived(self, arrays: list) -> list:
    if self._derive is None:
      return arrays
    src = tuple(arrays[i] for i in self._derive_from)
    if self._derived is None or not all(map(operator.is_, src, self._derived[0])):
      STATS["derivations"] += 1
      self._derived = (src, list(self._derive(arrays)))
    return arrays + self._derived[1]


def _needs_grad(spec: BridgeSpec, tensors: Sequence[torch.Tensor]) -> bool:
  return torch.is_grad_enabled() and any(
      d and t.requires_grad for d, t in zip(spec.diff, tensors))


def _out(a: jax.Array, like: torch.Tensor) -> torch.Tensor:
  """A fresh JAX output on `like`'s device -> torch (zero-copy, stream-ordered)."""
  index = _index(like)
  return to_torch(a) if index is None else _to_torch(a, index)


# key -> (spec, its jitted functions): one dict lookup per call instead of spec_of's and
# `_jitted`'s lru_cache (which hashes the whole frozen spec, config included, every call)
_RESOLVED: dict[str, tuple[BridgeSpec, _Jitted]] = {}


def _resolve(key: str) -> tuple[BridgeSpec, _Jitted]:
  hit = _RESOLVED.get(key)
  if hit is None:
    spec = spec_of(key)
    hit = _RESOLVED[key] = (spec, _jitted(spec))
  return hit


def run(key: str, tensors: Sequence[torch.Tensor],
        weights: Optional[WeightGroup] = None) -> torch.Tensor:
  """Run the spec `key` names (`register_spec`, `spec_of`) on torch tensors, in its function's
  argument order (`weights`: the calling module's `WeightGroup` for the cached ones).

  The output is the JAX output's own buffer, not a copy: nothing else holds that buffer in the
  forward-only path, and in the training path the output is saved for backward, so an
  in-place change of it before backward raises (torch's version check) instead of corrupting
  what the VJP residuals might share with it.
  """
  if torch.compiler.is_compiling():  # (traced: grad mode and requires_grad are guarded on)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
      return torch.ops.jmoe.fused_moe(list(tensors), key)
    return torch.ops.jmoe.fused_moe_forward(list(tensors), key)
  spec, jitted = _resolve(key)
  if torch.is_grad_enabled() and _needs_grad(spec, tensors):
    return _BridgeFunction.apply(key, spec, weights, *tensors)
  STATS["forwards"] += 1
  args = _convert(spec, tensors, weights)
  y = _out(jitted.forward(*args), tensors[0])
  _hold(key, args[:spec.uncached])
  return y


# The last call's imported inputs per (spec, path), released by the next such call: a JAX view
# of torch memory freed while its computation still runs makes PJRT wait for that computation
# on release (H100, qwen3 at 4096 tokens: ~100 us of a 1,050 us call); by the next call it is
# done or queued behind. (Torch's memory behind them is held as long.) Slots: the spec's key
# (eager forward-only calls), key + "/vjp" (eager forwards keeping residuals), key + "/bwd"
# (the eager backward's imported gradient and the residuals, which may hold the forward's
# imported input: one block's residuals outlive its backward until the next one), key +
# "/op" and "/op_bwd" (the custom op, torch.compile's path).
_HELD: dict[str, Any] = {}


def _hold(slot: str, what: Any) -> None:
  """Keep `what` (imported arrays, or what references them) alive until the next call of the
  same slot, releasing the previous call's there."""
  _HELD[slot] = what


class _BridgeFunction(torch.autograd.Function):
  """Eager training path: the VJP closure (residuals) lives in ctx until backward."""

  @staticmethod
  def forward(ctx, key: str, spec: BridgeSpec, weights: Optional[WeightGroup], *tensors):
    STATS["vjp_forwards"] += 1
    args = _convert(spec, tensors, weights)
    out, vjp_fn = _jitted(spec).forward_vjp(*args)
    y = _out(out, tensors[0])
    _hold(key + "/vjp", args[:spec.uncached])
    ctx.key, ctx.spec, ctx.vjp_fn = key, spec, vjp_fn
    ctx.save_for_backward(y)  # version guard only (see `run`)
    return y

  @staticmethod
  def backward(ctx, g):
    ctx.saved_tensors  # noqa: B018  raises if the output was modified in place
    gj = to_jax(g)
    grads = iter(_jitted(ctx.spec).backward(ctx.vjp_fn, gj))
    # residuals leave ctx now (not when the graph goes), released at the next backward
    _hold(ctx.key + "/bwd", (gj, ctx.vjp_fn))
    ctx.vjp_fn = None
    return (None, None, None, *[_out(next(grads), g) if d else None for d in ctx.spec.diff])


# --------------------------------------------------------------------------------------------
# the custom op (torch.compile): jmoe::fused_moe and its backward


# Defined with torch.library.Library, not torch.library.custom_op: custom_op's Python layers
# around the kernel cost ~25 us a call more on a 2-core CPU (~40 us of dispatch against ~15),
# and under torch.compile every call pays them.
_LIB = torch.library.Library("jmoe", "DEF")  # noqa: TOR901 (kept for the process' life)
_LIB.define("fused_moe(Tensor[] tensors, str spec) -> Tensor")
# The same forward without an autograd formula, for graphs that need no gradient: a call of
# fused_moe goes through its registered autograd's Python layer even then (~40 us a call on a
# 2-core CPU against the C++ fallback's few).
_LIB.define("fused_moe_forward(Tensor[] tensors, str spec) -> Tensor")
_LIB.define("fused_moe_backward(Tensor[] tensors, Tensor g, str spec) -> Tensor[]")


def _fused_moe_op(tensors: list[torch.Tensor], spec: str) -> torch.Tensor:
  """The spec's forward on `tensors` -> [T, H] in tensors[0]'s dtype (a fresh tensor)."""
  s, jitted = _resolve(spec)
  STATS["op_calls"] += 1
  args = _convert(s, tensors)
  y = _out(jitted.forward(*args), tensors[0])
  _hold(spec + "/op", args[:s.uncached])
  return y


def _fused_moe_backward_op(tensors: list[torch.Tensor], g: torch.Tensor,
                           spec: str) -> list[torch.Tensor]:
  """Gradients of the spec w.r.t. its differentiable tensors (forward recomputed in JAX)."""
  s, jitted = _resolve(spec)
  gj, args = to_jax(g), _convert(s, tensors)
  grads = jitted.recompute_backward(gj, *args)
  _hold(spec + "/op_bwd", [gj, *args[:s.uncached]])
  return [_out(gr, g) for gr in grads]


_LIB.impl("fused_moe", _fused_moe_op, "CompositeExplicitAutograd")
_LIB.impl("fused_moe_forward", _fused_moe_op, "CompositeExplicitAutograd")
_LIB.impl("fused_moe_backward", _fused_moe_backward_op, "CompositeExplicitAutograd")


@torch.library.register_fake("jmoe::fused_moe", lib=_LIB)
def _fused_moe_fake(tensors: list[torch.Tensor], spec: str) -> torch.Tensor:
  return torch.empty_like(tensors[0])


torch.library.register_fake("jmoe::fused_moe_forward", _fused_moe_fake, lib=_LIB)


@torch.library.register_fake("jmoe::fused_moe_backward", lib=_LIB)
def _fused_moe_backward_fake(tensors, g, spec):
  return [torch.empty_like(t) for t, d in zip(tensors, spec_of(spec).diff) if d]


def _op_setup_context(ctx, inputs, output) -> None:
  tensors, spec = inputs
  ctx.spec = spec
  ctx.save_for_backward(*tensors)


def _op_backward(ctx, g):
  tensors = ctx.saved_tensors
  grads = iter(torch.ops.jmoe.fused_moe_backward(list(tensors), g, ctx.spec))
  return [next(grads) if d else None for d in spec_of(ctx.spec).diff], None


torch.library.register_autograd("jmoe::fused_moe", _op_backward, setup_context=_op_setup_context,
                                lib=_LIB)


# --------------------------------------------------------------------------------------------
# the jmoe block as a torch module


@dataclasses.dataclass(frozen=True)
class _BlockFn:
  """x [T, H], *values[, *prepared] -> moe_block(x) [T, H]; values named by `names`
  ("w13.values" for the parts of a quantized weight, rebuilt with `quant`'s (field, scheme,
  k_major)); where more arrays follow them, they are the quantized weights' prepared kernel
  operands named by `prepared`'s (field, key) (without them the kernels make those per call)."""

  config: MoEConfig
  names: tuple[str, ...]
  quant: tuple[tuple[str, Any, bool], ...]
  runner_backend: Optional[str]
  prepared: tuple[tuple[str, str], ...] = ()

  def params(self, values: Sequence[Any]) -> MoEParams:
    """The MoEParams the arrays `values` (in this function's argument order) make."""
    from jmoe.quant.weights import QuantizedWeights  # noqa: PLC0415

    fields: dict[str, Any] = {}
    parts: dict[str, dict] = collections.defaultdict(dict)
    for n, v in zip(self.names, values):
      if "." in n:
        field, part = n.split(".")
        parts[field][part] = v
      else:
        fields[n] = v
    kept: dict[str, dict] = collections.defaultdict(dict)
    for (field, key), v in zip(self.prepared, values[len(self.names):]):
      kept[field][key] = v
    for field, scheme, k_major in self.quant:
      fields[field] = QuantizedWeights(**parts[field], scheme=scheme, k_major=k_major,
                                       prepared=kept.get(field))
    return MoEParams(**fields)

  def derive_prepared(self, values: Sequence[Any]) -> list:
    """The prepared kernel operands of the quantized weights in `values` (the names' arrays),
    in `prepared`'s order (`jmoe.quant.prepare_for_kernels`)."""
    p = self.params(values)
    made = dict(zip(("w13", "w2"), _prepared(self.config, p.w13, p.w2)))
    return [made[field][key] for field, key in self.prepared]

  def __call__(self, x, *values):
    return moe_block(x, self.params(values), self.config, runner_backend=self.runner_backend)


def _prepared(config: MoEConfig, w13, w2) -> tuple[dict, dict]:
  """The prepared kernel operands ({key: array}) of quantized w13 / w2 for an MoE of
  `config`'s activation and token dtype (`jmoe.quant.prepare_for_kernels`)."""
  from jmoe.quant import prepare_for_kernels  # noqa: PLC0415

  dt = config.dtype if config.dtype in ("bfloat16", "float16") else "bfloat16"
  w13, w2 = (dataclasses.replace(w, prepared=None) for w in (w13, w2))
  w13, w2 = prepare_for_kernels(w13, w2, activation=config.activation, dtype=dt)
  return w13.prepared or {}, w2.prepared or {}


def _prepared_keys(config: MoEConfig, params: MoEParams) -> tuple[tuple[str, str], ...]:
  """(field, key) of every operand `_prepared` keeps for params' quantized w13 / w2 (none for
  the W8A8 schemes, whose kernels read the stored arrays), from shapes only."""
  from jmoe.quant import is_quantized  # noqa: PLC0415

  if not (is_quantized(params.w13) and is_quantized(params.w2)):
    return ()
  made = jax.eval_shape(functools.partial(_prepared, config), params.w13, params.w2)
  return tuple((field, key) for field, kept in zip(("w13", "w2"), made) for key in sorted(kept))


def _from_jax(value) -> torch.Tensor:
  """A JAX / NumPy array -> an owned torch tensor (a copy: the module's parameters are torch's)."""
  import jax.numpy as jnp  # noqa: PLC0415
  return torch.from_dlpack(jnp.asarray(value)).clone()


class JmoeMoE(torch.nn.Module):
  """A jmoe MoE block as a torch module: x [..., H] -> [..., H], differentiable.

  Args:
    config: the block's MoEConfig.
    params: initial MoEParams (JAX or NumPy arrays); they become torch Parameters, except the
      DeepSeek correction bias (a buffer: updated from load statistics, not trained) and
      quantized weights (`jmoe.quant.QuantizedWeights`: their values / scales / zero points
      become buffers `w13_values`, `w13_scale`, ...; they cross to JAX as stored, packed
      arrays plus scales, and are not trained).
    runner_backend: force a jmoe backend (default: the config's, i.e. the oracle's choice).
    device: where the parameters live (torch device).
    prepare_for_kernels: for weight-only / microscaling weights, also keep the operands the
      Pallas kernels derive from them (`jmoe.quant.prepare_for_kernels`: the prefill GEMMs'
      scale layouts, decode's padded byte scales) on the JAX side, made with the first call
      and again only when a quantized buffer changes, instead of inside every call (eager
      calls; the `torch.compile` op makes them per call). They cost memory (nvfp4: a copy of
      its scales in the token dtype). None: on CUDA where the runner may be Pallas (auto or
      pallas_mosaic).
  """

  def __init__(self, config: MoEConfig, params: MoEParams, *,
               runner_backend: Optional[str] = None, device=None,
               prepare_for_kernels: Optional[bool] = None):
    super().__init__()
    from jmoe.quant.weights import is_quantized  # noqa: PLC0415

    if not isinstance(config, MoEConfig):
      raise TypeError(f"config must be a jmoe MoEConfig, got {type(config).__name__}")
    if not isinstance(params, MoEParams):
      raise TypeError(f"params must be jmoe MoEParams, got {type(params).__name__}")
    self.config = config
    self.runner_backend = runner_backend
    attrs, names, diff, quant = [], [], [True], []
    for name in _FIELDS:
      value = getattr(params, name)
      if value is None:
        continue
      if is_quantized(value):
        quant.append((name, value.scheme, value.k_major))
        for part in _QUANT_PARTS:
          if getattr(value, part) is not None:
            attr = f"{name}_{part}"
            self.register_buffer(attr, _from_jax(getattr(value, part)).to(device))
            attrs.append(attr), names.append(f"{name}.{part}"), diff.append(False)
        continue
      t = _from_jax(value).to(device)
      if name == "correction_bias":
        self.register_buffer(name, t)
      else:
        setattr(self, name, torch.nn.Parameter(t))
      attrs.append(name), names.append(name), diff.append(name != "correction_bias")
    self._attrs = tuple(attrs)
    fn = _BlockFn(config, tuple(names), tuple(quant), runner_backend)
    if prepare_for_kernels is None:
      on_cuda = torch.device(device).type == "cuda" if device is not None else False
      prepare_for_kernels = on_cuda and (runner_backend or config.runner_backend) in (
          None, "auto", "pallas_mosaic")
    keys = _prepared_keys(config, params) if prepare_for_kernels and quant else ()
    if keys:
      fn = dataclasses.replace(fn, prepared=keys)
    self._spec = BridgeSpec(fn, tuple(diff))
    self._op_key = register_spec(self._spec)
    quantized_parts = [i for i, n in enumerate(fn.names) if "." in n]
    self._weights = WeightGroup(fn.derive_prepared if keys else None, quantized_parts)

  @classmethod
  def from_hf(cls, hf_block, hf_config=None, *, dtype=None, runner_backend=None) -> "JmoeMoE":
    """Build from a live transformers MoE block (see `jmoe.interop.hf.from_hf_module`)."""
    from jmoe.interop.hf import from_hf_module  # noqa: PLC0415

    config, params = from_hf_module(hf_block, hf_config, dtype=dtype)
    device = next(hf_block.parameters()).device
    return cls(config, params, runner_backend=runner_backend, device=device)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    """x [..., H] -> [..., H] in x's dtype."""
    h = self.config.hidden_size
    if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[-1] != h:
      raise ValueError(f"x must be a torch tensor [..., {h}], got "
                       f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    flat = x if x.ndim == 2 else x.reshape(-1, h)  # a reshape is ~1 us a call each way
    y = run(self._op_key, [flat, *self._tensors()], self._weights)
    return y if x.ndim == 2 else y.reshape(x.shape)

  def _tensors(self) -> list[torch.Tensor]:
    """The parameters and buffers in the spec's order, read from the module's own dicts each
    call (so a reassigned parameter is seen) without `Module.__getattr__` (~0.7 us each)."""
    params, buffers = self._parameters, self._buffers
    out = []
    for a in self._attrs:
      t = params.get(a)
      if t is None:
        t = buffers.get(a)
        if t is None:  # replaced by a plain attribute, or removed: the ordinary lookup
          t = getattr(self, a)
      out.append(t)
    return out
