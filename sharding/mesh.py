"""Meshes for expert parallelism, size validation and expert placement.

A jmoe mesh has up to three roles, named by `ParallelConfig`:

* the **data** axis: independent replicas of the MoE block, each with its own tokens;
* the **expert** axis: experts are split over it (EP), tokens are split over it too;
* the **tensor** axis: every expert's intermediate dimension N is split over it (TP), tokens
  are replicated over it.

Tokens are therefore sharded over `(data, expert)` and replicated over `tensor`; `w13`/`w2`
are sharded over `expert` (dim 0) and `tensor` (the N dim), replicated over `data`.

`jax.make_mesh` in jax 0.10 defaults to `AxisType.Explicit`, whose axes make `shard_map`
reject unsharded inputs; every helper here builds `Auto` meshes, and `as_auto_mesh` converts
a mesh built elsewhere.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jmoe.config import ParallelConfig

PLACEMENTS = ("linear", "round_robin")
DEFAULT_AXIS_NAMES = ("data", "expert", "tensor")


# --------------------------------------------------------------------------------------------
# meshes


def make_ep_mesh(data: int = 1, expert: int = -1, tensor: int = 1, *,
                 devices: Optional[Sequence[jax.Device]] = None,
                 axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
                 keep_unit_axes: bool = True) -> Mesh:
  """A mesh with data/expert/tensor axes of the given sizes (Auto axis types).

  One size may be -1: it takes whatever the device count leaves. The product of the sizes
  must equal the number of devices. `keep_unit_axes=False` drops axes of size 1 (the
  `ParallelConfig` then names only the axes that exist).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, expert, tensor]
  if len(axis_names) != 3:
    raise ValueError(f"axis_names must name (data, expert, tensor), got {axis_names!r}")
  n = len(devices)
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one axis size may be -1, got data={data}, expert={expert}, "
                     f"tensor={tensor}")
  for name, s in zip(axis_names, sizes):
    if s != -1 and (not isinstance(s, (int, np.integer)) or s <= 0):
      raise ValueError(f"axis {name!r} size must be a positive int or -1, got {s!r}")
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if n % known:
      raise ValueError(f"{n} devices cannot be split into data={data} x expert={expert} x "
                       f"tensor={tensor}: {known} does not divide {n}")
    sizes[sizes.index(-1)] = n // known
  if math.prod(sizes) != n:
    raise ValueError(f"data={sizes[0]} x expert={sizes[1]} x tensor={sizes[2]} = "
                     f"{math.prod(sizes)} does not match the device count {n}")
  names, shape = list(axis_names), list(sizes)
  if not keep_unit_axes:
    kept = [(a, s) for a, s in zip(names, shape) if s > 1] or [(axis_names[1], 1)]
    names, shape = [a for a, _ in kept], [s for _, s in kept]
  arr = np.array(devices, dtype=object).reshape(shape)
  return Mesh(arr, tuple(names), axis_types=(AxisType.Auto,) * len(names))


def as_auto_mesh(mesh: Mesh) -> Mesh:
  """The same devices and axis names with every axis `Auto` (see the module docstring)."""
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def parallel_config(mesh: Mesh, *, data_axis: Optional[str] = "data",
                    expert_axis: Optional[str] = "expert", tensor_axis: Optional[str] = "tensor",
                    **kw) -> ParallelConfig:
  """A ParallelConfig for `mesh`, keeping only the role axes the mesh has."""
  names = set(mesh.axis_names)
  pick = lambda a: a if a in names else None  # noqa: E731
  return ParallelConfig(mesh=mesh, data_axis=pick(data_axis), expert_axis=pick(expert_axis),
                        tensor_axis=pick(tensor_axis), **kw)


def make_parallel(data: int = 1, expert: int = -1, tensor: int = 1, *, devices=None,
                  **kw) -> ParallelConfig:
  """`make_ep_mesh` + `parallel_config` in one call."""
  return parallel_config(make_ep_mesh(data, expert, tensor, devices=devices), **kw)


# --------------------------------------------------------------------------------------------
# validation


@dataclasses.dataclass(frozen=True)
class AxisSizes:
  dp: int
  ep: int
  tp: int

  @property
  def token_shards(self) -> int:
    return self.dp * self.ep


def axis_sizes(parallel: ParallelConfig) -> AxisSizes:
  return AxisSizes(parallel.axis_size(parallel.data_axis), parallel.axis_size(parallel.expert_axis),
                   parallel.axis_size(parallel.tensor_axis))


def token_axes(parallel: ParallelConfig) -> tuple[str, ...]:
  """Mesh axes the token dimension is sharded over: (data, expert), those that are set."""
  return tuple(a for a in (parallel.data_axis, parallel.expert_axis) if a is not None)


def validate(parallel: ParallelConfig, *, num_experts: int, intermediate_size: int,
             hidden_size: Optional[int] = None, num_tokens: Optional[int] = None,
             hidden_axis: Optional[str] = None) -> AxisSizes:
  """Check that the MoE sizes divide the mesh axes; raise a ValueError naming both if not.

  `hidden_axis` (optional) names a mesh axis the hidden size must divide (for callers that
  shard H, e.g. a sequence/TP-sharded residual stream).
  """
  if parallel.mesh is None:
    raise ValueError("ParallelConfig.mesh is None: expert parallelism needs a mesh")
  roles = [(r, getattr(parallel, r)) for r in ("data_axis", "expert_axis", "tensor_axis")]
  used = [a for _, a in roles if a is not None]
  if len(set(used)) != len(used):
    raise ValueError(f"a mesh axis plays two roles: {dict(roles)}")
  s = axis_sizes(parallel)
  if num_experts % s.ep:
    raise ValueError(f"num_experts={num_experts} is not divisible by the expert axis "
                     f"{parallel.expert_axis!r} of size {s.ep}")
  if intermediate_size % s.tp:
    raise ValueError(f"intermediate_size={intermediate_size} is not divisible by the tensor "
                     f"axis {parallel.tensor_axis!r} of size {s.tp}")
  if hidden_axis is not None and hidden_size is not None:
    hs = parallel.axis_size(hidden_axis)
    if hidden_size % hs:
      raise ValueError(f"hidden_size={hidden_size} is not divisible by the axis {hidden_axis!r} "
                       f"of size {hs}")
  if num_tokens is not None and num_tokens % s.token_shards:
    axes = " x ".join(f"{a}={parallel.axis_size(a)}" for a in token_axes(parallel))
    raise ValueError(f"num_tokens T={num_tokens} is not divisible by the token-sharding axes "
                     f"({axes} = {s.token_shards}); pad the batch to a multiple of "
                     f"{s.token_shards}")
  return s


# --------------------------------------------------------------------------------------------
# expert placement


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertPlacement:
  """Which expert lives where.

  `phys_to_log[p]` is the global (logical) expert held by physical slot p; slot p lives on
  expert-axis rank `p // num_local` as its local expert `p % num_local`. The weights passed
  to the EP entry point are in *physical* order (`place_weights`). With replicas (EPLB), a
  logical expert has several slots; the router's ids are then mapped to physical ids first
  (`sharding.eplb.route_to_physical`) and the placement over physical ids is linear.
  """

  phys_to_log: np.ndarray  # [E] int
  ep_size: int
  kind: str = "custom"

  def __post_init__(self):
    p = np.asarray(self.phys_to_log, np.int64)
    object.__setattr__(self, "phys_to_log", p)
    e = p.shape[0]
    if p.ndim != 1 or sorted(p.tolist()) != list(range(e)):
      raise ValueError("phys_to_log must be a permutation of range(num_experts)")
    if e % self.ep_size:
      raise ValueError(f"num_experts={e} is not divisible by the expert axis size {self.ep_size}")

  @property
  def num_experts(self) -> int:
    return int(self.phys_to_log.shape[0])

  @property
  def num_local(self) -> int:
    return self.num_experts // self.ep_size

  @functools.cached_property
  def log_to_phys(self) -> np.ndarray:
    inv = np.empty_like(self.phys_to_log)
    inv[self.phys_to_log] = np.arange(self.num_experts)
    return inv

  @functools.cached_property
  def owner(self) -> np.ndarray:
    """[E] global id -> expert-axis rank holding it."""
    return (self.log_to_phys // self.num_local).astype(np.int32)

  @functools.cached_property
  def local_index(self) -> np.ndarray:
    """[E] global id -> local index on its owner."""
    return (self.log_to_phys % self.num_local).astype(np.int32)

  @functools.cached_property
  def expert_maps(self) -> np.ndarray:
    """[ep, E] int32: row r is rank r's `expert_map` (global -> local, -1 not local)."""
    m = np.full((self.ep_size, self.num_experts), -1, np.int32)
    m[self.owner, np.arange(self.num_experts)] = self.local_index
    return m

  def expert_map(self, rank: int) -> np.ndarray:
    return self.expert_maps[rank]

  def local_experts(self, rank: int) -> np.ndarray:
    """Global ids held by `rank`, in local order."""
    return self.phys_to_log[rank * self.num_local:(rank + 1) * self.num_local]

  def __eq__(self, other):
    return (isinstance(other, ExpertPlacement) and self.ep_size == other.ep_size
            and np.array_equal(self.phys_to_log, other.phys_to_log))

  def __hash__(self):
    return hash((self.ep_size, self.phys_to_log.tobytes()))

  def __repr__(self):
    return f"ExpertPlacement({self.kind}, E={self.num_experts}, ep={self.ep_size})"


def expert_placement(num_experts: int, ep_size: int,
                     kind: Union[str, ExpertPlacement] = "linear") -> ExpertPlacement:
  """`linear`: rank r holds experts [r*El, (r+1)*El); `round_robin`: rank r holds r, r+ep, …"""
  if isinstance(kind, ExpertPlacement):
    if kind.num_experts != num_experts or kind.ep_size != ep_size:
      raise ValueError(f"{kind!r} does not fit num_experts={num_experts}, ep={ep_size}")
    return kind
  if kind not in PLACEMENTS:
    raise ValueError(f"expert placement {kind!r} is not known; known: {PLACEMENTS}")
  if num_experts % ep_size:
    raise ValueError(f"num_experts={num_experts} is not divisible by the expert axis size "
                     f"{ep_size}")
  el = num_experts // ep_size
  if kind == "linear":
    p2l = np.arange(num_experts)
  else:  # slot r*El + j holds expert j*ep + r
    r, j = np.divmod(np.arange(num_experts), el)
    p2l = j * ep_size + r
  return ExpertPlacement(p2l, ep_size, kind)


def expert_map(num_experts: int, ep_size: int, rank: int, kind: str = "linear") -> np.ndarray:
  """Rank `rank`'s global -> local map (-1 = not local), as vLLM's `expert_map`."""
  return expert_placement(num_experts, ep_size, kind).expert_map(rank)


def place_weights(w, placement: ExpertPlacement):
  """Reorder an expert-major array ([E, ...]) from logical to physical order."""
  return w[np.asarray(placement.phys_to_log)]


# --------------------------------------------------------------------------------------------
# shardings


def weight_specs(parallel: ParallelConfig, gated: bool = True) -> dict[str, P]:
  """PartitionSpecs of the expert weights as the EP entry point consumes them.

  w13 is consumed as [E, H, 2, N] (gated: gate/up split so N shards cleanly over the tensor
  axis) or [E, H, N]; the specs below are for the jmoe layout [E, H, 2N] when tp == 1 and for
  the [E, H, 2, N] view otherwise.
  """
  ea, ta = parallel.expert_axis, parallel.tensor_axis
  return {
      "w13": P(ea, None, None, ta) if gated else P(ea, None, ta),
      "w2": P(ea, ta, None),
      "w13_bias": P(ea, None, ta) if gated else P(ea, ta),
      "w2_bias": P(ea, None),
  }


def token_sharding(parallel: ParallelConfig) -> NamedSharding:
  """NamedSharding of hidden_states / topk arrays [T, ...]: tokens over (data, expert)."""
  ax = token_axes(parallel)
  return NamedSharding(parallel.mesh, P(ax if ax else None, None))


def shard_tokens(x, parallel: ParallelConfig):
  return jax.device_put(x, token_sharding(parallel))


def shard_expert_weights(w, parallel: ParallelConfig, name: str = "w13"):
  """device_put an expert weight in jmoe's layout sharded over the expert axis (dim 0).

  The tensor-axis split of N happens inside the EP entry point (it needs gate/up split).
  QuantizedWeights: every [E, ...] part so; a static input_scale (one per tensor) replicated."""
  experts = NamedSharding(parallel.mesh, P(parallel.expert_axis))
  if getattr(w, "input_scale", None) is None:
    return jax.device_put(w, experts)
  shardings = jax.tree.map(lambda _: experts, w)
  shardings = dataclasses.replace(shardings, input_scale=NamedSharding(parallel.mesh, P()))
  return jax.device_put(w, shardings)
