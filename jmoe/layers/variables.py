"""The layer's variable kinds and how quantized expert weights are held as nnx variables."""
from __future__ import annotations

from typing import Optional

from flax import nnx

from jmoe.quant import QuantizedWeights


class QuantizedWeight(nnx.Variable):
  """Values / scales / zero points of quantized expert weights: not trained (the quantized
  forward has no backward), so not an `nnx.Param`; `nnx.state(model, QuantizedWeight)`
  selects them."""


def variable(kind, value, names: tuple, mesh, own_mesh: bool = False) -> nnx.Variable:
  """A variable with `out_sharding` names; placed eagerly only when a mesh exists (`own_mesh`:
  on `mesh` itself, e.g. ParallelConfig's, rather than the one set by jax.set_mesh)."""
  kw = dict(mesh=mesh) if own_mesh and mesh is not None else {}
  return kind(value, out_sharding=names, eager_sharding=mesh is not None, **kw)


class QuantizedSlot:
  """One quantized weight (w13 or w2) spread over plain variables of `module`:
  `<name>_values`, `<name>_scale`, `<name>_zero` / `_global_scale` / `_perm` (or None); the
  scheme and orientation are static Python attributes."""

  @staticmethod
  def store(module: nnx.Module, name: str, w: QuantizedWeights, expert_axis: Optional[str],
            mesh, own_mesh: bool = False) -> None:
    names = (expert_axis, None, None)  # quantized experts shard over the expert axis only
    setattr(module, f"{name}_values", variable(QuantizedWeight, w.values, names, mesh, own_mesh))
    setattr(module, f"{name}_scale", variable(QuantizedWeight, w.scale, names, mesh, own_mesh))
    for part in _OPTIONAL_PARTS:  # None, or [E, ...] sharded like the values
      a = getattr(w, part)
      setattr(module, f"{name}_{part}", None if a is None else variable(
          QuantizedWeight, a, names[:a.ndim], mesh, own_mesh))
    setattr(module, f"{name}_scheme", (w.scheme, w.k_major))

  @staticmethod
  def load(module: nnx.Module, name: str) -> QuantizedWeights:
    scheme, k_major = getattr(module, f"{name}_scheme")
    parts = {p: getattr(module, f"{name}_{p}", None) for p in _OPTIONAL_PARTS}
    return QuantizedWeights(values=getattr(module, f"{name}_values")[...],
                            scale=getattr(module, f"{name}_scale")[...],
                            **{p: None if v is None else v[...] for p, v in parts.items()},
                            scheme=scheme, k_major=k_major)


# QuantizedWeights' optional arrays (nvfp4's global scale, GPTQ act-order's perm)
_OPTIONAL_PARTS = ("zero", "global_scale", "perm")
