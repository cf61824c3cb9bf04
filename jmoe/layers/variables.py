"""The layer's variable kinds and how quantized expert weights are held as nnx variables."""
from __future__ import annotations

from typing import Optional

from flax import nnx

from jmoe.quant import QuantizedWeights


class QuantizedWeight(nnx.Variable):
  """Values / scales / zero points of quantized expert weights: frozen (gradients flow around
  them, not into them), so not an `nnx.Param`; `nnx.state(model, QuantizedWeight)` selects
  them."""


def variable(kind, value, names: tuple, mesh, own_mesh: bool = False) -> nnx.Variable:
  """A variable with `out_sharding` names; placed eagerly only when a mesh exists (`own_mesh`:
  on `mesh` itself, e.g. ParallelConfig's, rather than the one set by jax.set_mesh)."""
  kw = dict(mesh=mesh) if own_mesh and mesh is not None else {}
  return kind(value, out_sharding=names, eager_sharding=mesh is not None, **kw)


class QuantizedSlot:
  """One quantized weight (w13 or w2) spread over plain variables of `module`:
  `<name>_values`, `<name>_scale`, `<name>_zero` / `_global_scale` / `_perm` and the
  replicated `<name>_input_scale` of a static scheme (or None), and
  one `<name>_prepared_<key>` per prepared kernel operand (`jmoe.quant.prepare_for_kernels`;
  their keys in `<name>_prepared_keys`); the scheme and orientation are static Python
  attributes."""

  @staticmethod
  def store(module: nnx.Module, name: str, w: QuantizedWeights, expert_axis: Optional[str],
            mesh, own_mesh: bool = False) -> None:
    """Set (or replace) the variables of slot `name` from w; the old prepared operands go."""
    names = (expert_axis, None, None)  # quantized experts shard over the expert axis only
    put = lambda a: variable(QuantizedWeight, a, names[:a.ndim] + (None,) * (a.ndim - 3),  # noqa: E731
                             mesh, own_mesh)
    setattr(module, f"{name}_values", put(w.values))
    setattr(module, f"{name}_scale", put(w.scale))
    for part in _OPTIONAL_PARTS:  # None, or [E, ...] sharded like the values
      a = getattr(w, part)
      setattr(module, f"{name}_{part}", None if a is None else put(a))
    s = w.input_scale  # one per tensor: replicated
    setattr(module, f"{name}_input_scale",
            None if s is None else variable(QuantizedWeight, s, (None,) * s.ndim, mesh, own_mesh))
    for key in getattr(module, f"{name}_prepared_keys", ()):
      delattr(module, _prepared_attr(name, key))
    prepared = w.prepared or {}
    for key, a in prepared.items():  # ([E, ...] each: sharded like the values)
      setattr(module, _prepared_attr(name, key), put(a))
    setattr(module, f"{name}_prepared_keys", tuple(prepared))
    setattr(module, f"{name}_scheme", (w.scheme, w.k_major))

  @staticmethod
  def load(module: nnx.Module, name: str) -> QuantizedWeights:
    scheme, k_major = getattr(module, f"{name}_scheme")
    parts = {p: getattr(module, f"{name}_{p}", None) for p in (*_OPTIONAL_PARTS, "input_scale")}
    keys = getattr(module, f"{name}_prepared_keys", ())
    prepared = {k: getattr(module, _prepared_attr(name, k))[...] for k in keys}
    return QuantizedWeights(values=getattr(module, f"{name}_values")[...],
                            scale=getattr(module, f"{name}_scale")[...],
                            **{p: None if v is None else v[...] for p, v in parts.items()},
                            prepared=prepared or None, scheme=scheme, k_major=k_major)


def _prepared_attr(name: str, key: str) -> str:
  return f"{name}_prepared_" + "".join(c if c.isalnum() else "_" for c in key)


# QuantizedWeights' optional arrays (zero points, nvfp4's global scale, GPTQ act-order's perm)
_OPTIONAL_PARTS = ("zero", "global_scale", "perm")
