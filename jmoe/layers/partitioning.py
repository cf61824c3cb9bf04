"""Sharding metadata for the layer's variables, named after `ParallelConfig`'s mesh axes.

Each variable carries `out_sharding` (flax nnx metadata: a tuple of mesh axis names or None per
dimension), so `nnx.get_partition_spec(nnx.state(model))` gives the PartitionSpecs that
`jax.jit(..., out_shardings=...)` needs. With a mesh at construction (`parallel.mesh` or one set
by `jax.set_mesh`), nnx places the values eagerly (under `jit` / `nnx.eval_shape` too: then as
sharding constraints); without one, only the names are recorded.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from jmoe.config import ParallelConfig


@dataclasses.dataclass(frozen=True)
class AxisNames:
  """The mesh axes the layer's weights shard over (None = not sharded over that role)."""

  expert: Optional[str] = "expert"
  tensor: Optional[str] = "tensor"

  def spec(self, *roles: Optional[str]) -> tuple[Optional[str], ...]:
    """roles like ("expert", None, "tensor") -> axis names (None where the role is unset)."""
    return tuple(None if r is None else getattr(self, r) for r in roles)


def context_mesh():
  """The mesh set by `jax.set_mesh` / `jax.sharding.use_mesh`, or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def resolve_axes(parallel: Optional[ParallelConfig], expert_axis: Optional[str],
                 tensor_axis: Optional[str]):
  """(AxisNames, mesh or None, whether the mesh is parallel's): the parallel config's axes
  win; axes the mesh lacks are dropped, so the specs always name axes of the mesh the weights
  will live on."""
  mesh = parallel.mesh if parallel is not None and parallel.mesh is not None else context_mesh()
  if parallel is not None and parallel.mesh is not None:
    expert_axis, tensor_axis = parallel.expert_axis, parallel.tensor_axis
  if mesh is not None:
    names = set(mesh.axis_names)
    expert_axis = expert_axis if expert_axis in names else None
    tensor_axis = tensor_axis if tensor_axis in names else None
  own = parallel is not None and parallel.mesh is not None
  return AxisNames(expert_axis, tensor_axis), mesh, own
