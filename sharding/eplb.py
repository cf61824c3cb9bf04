"""Expert-parallel load balancing (EPLB): replicate hot experts and place the replicas.

A reimplementation of the algorithm of DeepSeek's EPLB (github.com/deepseek-ai/EPLB), in NumPy:

* `rebalance_experts(load, num_replicas, num_groups, num_nodes, num_gpus)`: when the expert
  groups divide over the nodes, the **hierarchical** policy — pack expert groups onto nodes
  (balanced packing), replicate the hottest experts inside each node, pack the physical
  experts onto the node's GPUs; otherwise the **global** policy (one node, one group).
  Returns `phy2log [L, P]`, `log2phy [L, E, max_replicas]` (-1 padded) and `logcnt [L, E]`.
* `route_to_physical`: logical top-k ids -> physical ids, spreading a logical expert's tokens
  over its replicas (by token position, or balanced by occurrence within the batch).
* `relayout_weights`: move expert weights (a pytree of `[P, ...]` arrays) from one physical
  layout to another; under `jit` with an expert-axis sharding XLA moves the rows across devices.
* Load statistics: `expert_load` (a forward's side output, see `ep_fused_moe(...,
  return_stats=True)`), `LoadWindow` (per-layer counts accumulated over the last N steps).
* `simulate(preset, ep, redundant, skew)`: balancedness before/after on skewed routing (the
  `python -m jmoe eplb` command).

Physical slot p lives on device `p // (P / num_gpus)`, i.e. the placement of physical experts
over the expert axis is linear: pass the physical weights and physical ids to `fused_moe`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

# --------------------------------------------------------------------------------------------
# the algorithm (host side, NumPy)


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
  """Pack n weighted items into `num_packs` packs of n/num_packs items each, greedily
  (heaviest first into the lightest pack with room), per row.

  Returns pack_index [L, n], rank_in_pack [L, n].
  """
  weight = np.asarray(weight, np.float64)
  layers, n = weight.shape
  if n % num_packs:
    raise ValueError(f"{n} items cannot be packed into {num_packs} equal packs")
  per_pack = n // num_packs
  if per_pack == 1:
    idx = np.broadcast_to(np.arange(n), (layers, n)).copy()
    return idx, np.zeros_like(idx)
  pack_index = np.full((layers, n), -1, np.int64)
  rank_in_pack = np.full((layers, n), -1, np.int64)
  for i in range(layers):
    pack_w = np.zeros(num_packs)
    pack_n = np.zeros(num_packs, np.int64)
    for item in np.argsort(-weight[i], kind="stable"):
      cand = np.where(pack_n < per_pack, pack_w, np.inf)
      pack = int(np.argmin(cand))
      pack_index[i, item] = pack
      rank_in_pack[i, item] = pack_n[pack]
      pack_w[pack] += weight[i, item]
      pack_n[pack] += 1
  return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Give `num_phy - E` extra replicas, each to the expert with the highest load per replica.

  Returns phy2log [L, num_phy], rank [L, num_phy] (replica index), logcnt [L, E].
  """
  weight = np.asarray(weight, np.float64)
  layers, num_log = weight.shape
  if num_phy < num_log:
    raise ValueError(f"num_phy={num_phy} is less than the {num_log} logical experts")
  phy2log = np.tile(np.arange(num_phy), (layers, 1))
  rank = np.zeros((layers, num_phy), np.int64)
  logcnt = np.ones((layers, num_log), np.int64)
  rows = np.arange(layers)
  for i in range(num_log, num_phy):
    hot = np.argmax(weight / logcnt, axis=-1)
    phy2log[:, i] = hot
    rank[:, i] = logcnt[rows, hot]
    logcnt[rows, hot] += 1
  return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
  inv = np.empty_like(perm)
  np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
  return inv


def rebalance_experts_hierarchical(weight: np.ndarray, num_physical_experts: int,
                                   num_groups: int, num_nodes: int, num_gpus: int):
  """DeepSeek's hierarchical policy. Returns phy2log [L, P], phyrank [L, P], logcnt [L, E]."""
  weight = np.asarray(weight, np.float64)
  layers, num_log = weight.shape
  if num_log % num_groups:
    raise ValueError(f"num_groups={num_groups} does not divide the {num_log} experts")
  if num_groups % num_nodes:
    raise ValueError(f"num_nodes={num_nodes} does not divide num_groups={num_groups}")
  if num_gpus % num_nodes:
    raise ValueError(f"num_nodes={num_nodes} does not divide num_gpus={num_gpus}")
  if num_physical_experts % num_gpus:
    raise ValueError(f"num_gpus={num_gpus} does not divide the {num_physical_experts} physical "
                     "experts")
  group_size = num_log // num_groups
  groups_per_node = num_groups // num_nodes
  phy_per_gpu = num_physical_experts // num_gpus
  log_per_node = num_log // num_nodes

  # 1. pack groups to nodes; mlog = "node-major logical" numbering
  tokens_per_group = weight.reshape(layers, num_groups, group_size).sum(-1)
  gpack, grank = balanced_packing(tokens_per_group, num_nodes)
  log2mlog = (((gpack * groups_per_node + grank) * group_size)[..., None]
              + np.arange(group_size)).reshape(layers, num_log)
  mlog2log = _inverse(log2mlog)

  # 2. replicate experts inside each node
  tokens_per_mlog = np.take_along_axis(weight, mlog2log, -1).reshape(-1, log_per_node)
  phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog,
                                                 num_physical_experts // num_nodes)

  # 3. pack each node's physical experts onto its GPUs
  tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, -1)
  pack, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
  phy2pphy = pack * phy_per_gpu + rank_in_pack
  pphy2phy = _inverse(phy2pphy)

  pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)  # [L*nodes, P/nodes]
  pphy2mlog = (pphy2mlog.reshape(layers, num_nodes, -1)
               + np.arange(0, num_log, log_per_node).reshape(1, -1, 1)).reshape(layers, -1)
  pphy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)
  pphyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(layers, -1)
  logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, -1)
  return pphy2log, pphyrank, logcnt


@dataclasses.dataclass(frozen=True)
class EPLBPlan:
  """The output of `rebalance_experts` (one row per layer)."""

  phy2log: np.ndarray  # [L, P] physical slot -> logical expert
  log2phy: np.ndarray  # [L, E, R] logical expert -> its physical slots (-1 padded)
  logcnt: np.ndarray  # [L, E] replicas per logical expert
  policy: str  # "hierarchical" or "global"

  @property
  def num_physical(self) -> int:
    return int(self.phy2log.shape[1])

  def layer(self, i: int) -> "EPLBPlan":
    return EPLBPlan(self.phy2log[i:i + 1], self.log2phy[i:i + 1], self.logcnt[i:i + 1],
                    self.policy)


def rebalance_experts(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> EPLBPlan:
  """Plan replicas and placement from a load matrix `weight [L, E]` (or [E]).

  The hierarchical policy when `num_groups % num_nodes == 0`, else the global one (which is
  the hierarchical one with a single group on a single node; `policy` reports "global" for
  any single-node plan, where both coincide).
  """
  weight = np.asarray(weight, np.float64)
  if weight.ndim == 1:
    weight = weight[None]
  layers, num_log = weight.shape
  if num_replicas < num_log:
    raise ValueError(f"num_replicas={num_replicas} is less than the {num_log} logical experts")
  if num_groups % num_nodes == 0:
    policy = "hierarchical" if num_nodes > 1 else "global"  # one node: the same thing
    phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, num_groups,
                                                              num_nodes, num_gpus)
  else:
    policy = "global"
    phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1,
                                                              num_gpus)
  maxcnt = int(logcnt.max())
  log2phy = np.full((layers, num_log * maxcnt), -1, np.int64)
  np.put_along_axis(log2phy, phy2log * maxcnt + phyrank,
                    np.broadcast_to(np.arange(num_replicas), (layers, num_replicas)), axis=1)
  return EPLBPlan(phy2log.astype(np.int32),
                  log2phy.reshape(layers, num_log, maxcnt).astype(np.int32),
                  logcnt.astype(np.int32), policy)


def rebalance_global(weight: np.ndarray, num_replicas: int, num_gpus: int) -> EPLBPlan:
  """The global policy regardless of groups: replicate over all experts, pack to all GPUs."""
  return rebalance_experts(weight, num_replicas, 1, 1, num_gpus)


def check_plan(plan: EPLBPlan, num_logical: int) -> None:
  """Raise AssertionError unless the maps are consistent (used by the tests and the CLI)."""
  for l in range(plan.phy2log.shape[0]):
    p2l, l2p, cnt = plan.phy2log[l], plan.log2phy[l], plan.logcnt[l]
    assert (cnt >= 1).all(), "a logical expert has no replica"
    assert np.bincount(p2l, minlength=num_logical).tolist() == cnt.tolist()
    seen = set()
    for e in range(num_logical):
      slots = l2p[e][l2p[e] >= 0]
      assert len(slots) == cnt[e] and (l2p[e][cnt[e]:] == -1).all()
      assert (p2l[slots] == e).all()
      seen.update(slots.tolist())
    assert seen == set(range(plan.num_physical)), "log2phy does not cover every slot once"


# --------------------------------------------------------------------------------------------
# load statistics


def expert_load(topk_ids: jax.Array, num_experts: int) -> jax.Array:
  """[E] int32 routed token copies per expert (-1 slots ignored); jit-able."""
  flat = topk_ids.reshape(-1)
  return jnp.bincount(jnp.where(flat >= 0, flat, num_experts),
                      length=num_experts + 1)[:num_experts].astype(jnp.int32)


class LoadWindow:
  """Per-layer expert loads over the last `window` steps (a ring buffer on the host)."""

  def __init__(self, num_layers: int, num_experts: int, window: int = 128):
    self.buf = np.zeros((window, num_layers, num_experts), np.int64)
    self.steps = 0

  def record(self, loads) -> None:
    """loads: [L, E] (or [E] for one layer) counts of one step."""
    loads = np.asarray(loads).reshape(self.buf.shape[1:])
    self.buf[self.steps % self.buf.shape[0]] = loads
    self.steps += 1

  def load(self) -> np.ndarray:
    """[L, E] summed over the window."""
    return self.buf.sum(0)


# --------------------------------------------------------------------------------------------
# routing with replicas and weight re-layout


def route_to_physical(topk_ids: jax.Array, log2phy, logcnt, mode: str = "position"
                      ) -> jax.Array:
  """Logical ids [T, k] -> physical ids [T, k] (-1 stays -1); one layer's maps.

  mode "position": replica = token index mod replica count (deterministic spread).
  mode "balanced": replica = occurrence index of the expert within this batch mod count, so a
    logical expert's tokens split over its replicas as evenly as possible (least-loaded).
  """
  log2phy = jnp.asarray(log2phy, jnp.int32)
  logcnt = jnp.asarray(logcnt, jnp.int32)
  if log2phy.ndim == 3:
    log2phy, logcnt = log2phy[0], logcnt[0]
  t, k = topk_ids.shape
  ids = topk_ids.astype(jnp.int32)
  valid = ids >= 0
  safe = jnp.where(valid, ids, 0)
  cnt = logcnt[safe]
  if mode == "position":
    rep = jnp.arange(t, dtype=jnp.int32)[:, None] % cnt
  elif mode == "balanced":
    flat = jnp.where(valid, ids, log2phy.shape[0]).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=log2phy.shape[0] + 1)
    starts = jnp.cumsum(counts) - counts
    occ = jnp.empty_like(flat).at[order].set(jnp.arange(flat.shape[0], dtype=flat.dtype)
                                             - starts[flat[order]])
    rep = occ.reshape(t, k) % cnt
  else:
    raise ValueError(f"mode={mode!r} is not 'position' or 'balanced'")
  return jnp.where(valid, log2phy[safe, rep], -1)


def physical_weights(weights: Any, phy2log) -> Any:
  """Logical-order expert arrays (a pytree of [E, ...]) -> physical order [P, ...]."""
  idx = jnp.asarray(np.asarray(phy2log).reshape(-1), jnp.int32)
  return jax.tree.map(lambda w: None if w is None else jnp.take(w, idx, axis=0), weights)


def relayout_weights(weights: Any, old_phy2log, new_phy2log, sharding=None) -> Any:
  """Move expert arrays (a pytree of [P_old, ...]) from `old_phy2log` to `new_phy2log` layout.

  Each new slot copies one old slot that holds the same logical expert. With `sharding` (e.g.
  `NamedSharding(mesh, P("expert"))`) the result is placed accordingly; under jit XLA turns the
  gather into the cross-device moves.
  """
  old = np.asarray(old_phy2log).reshape(-1)
  new = np.asarray(new_phy2log).reshape(-1)
  first = {}
  for p, e in enumerate(old.tolist()):
    first.setdefault(e, p)
  missing = sorted(set(new.tolist()) - set(first))
  if missing:
    raise ValueError(f"logical experts {missing[:8]} are not in the old layout")
  idx = jnp.asarray([first[e] for e in new.tolist()], jnp.int32)
  move = jax.jit(lambda tree: jax.tree.map(lambda w: jnp.take(w, idx, axis=0), tree),
                 out_shardings=sharding)
  return move(weights)


# --------------------------------------------------------------------------------------------
# balancedness and the simulation command


def device_loads(phys_load: np.ndarray, num_gpus: int) -> np.ndarray:
  """[..., P] per-physical-slot loads -> [..., num_gpus] per-device loads (linear placement)."""
  phys_load = np.asarray(phys_load, np.float64)
  return phys_load.reshape(phys_load.shape[:-1] + (num_gpus, -1)).sum(-1)


def balancedness(loads: np.ndarray) -> float:
  """mean / max of per-device loads (1.0 = perfect)."""
  loads = np.asarray(loads, np.float64)
  return float(loads.mean() / loads.max()) if loads.max() > 0 else 1.0


def skewed_routing(num_experts: int, top_k: int, num_tokens: int, skew: float,
                   rng: np.random.Generator, popularity: Optional[np.ndarray] = None
                   ) -> np.ndarray:
  """[T, k] distinct expert ids per token drawn with Zipf(skew) expert popularity."""
  if popularity is None:
    popularity = zipf_popularity(num_experts, skew, rng)
  g = rng.gumbel(size=(num_tokens, num_experts)) + np.log(popularity)[None]
  return np.argsort(-g, axis=1)[:, :top_k].astype(np.int32)


def zipf_popularity(num_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
  p = 1.0 / np.arange(1, num_experts + 1) ** skew
  return rng.permutation(p / p.sum())


def simulate(preset: str, ep: int, redundant: int, skew: float, plot: Optional[str] = None, *,
             tokens: int = 8192, gpus_per_node: int = 8, seed: int = 0) -> dict:
  """Balancedness of a preset's experts over `ep` devices before and after EPLB.

  Routing: `tokens` tokens, top-k distinct experts with Zipf(`skew`) popularity. The plan is
  built from one sample (the statistics window) and scored on that sample and on a fresh one
  from the same distribution (held-out). `redundant` is rounded up so that
  experts + redundant divides over `ep` devices. With `plot`, writes a PNG of per-device loads.
  """
  from jmoe.config import get_preset  # noqa: PLC0415

  cfg = get_preset(preset)
  e, k = cfg.num_experts, cfg.top_k
  if ep <= 0:
    raise ValueError(f"ep must be positive, got {ep}")
  num_phy = e + max(redundant, 0)
  if num_phy % ep:
    num_phy += ep - num_phy % ep
  redundant_used = num_phy - e
  num_nodes = max(1, ep // gpus_per_node)
  num_groups = cfg.num_expert_group or 1
  rng = np.random.default_rng(seed)
  pop = zipf_popularity(e, skew, rng)
  ids = skewed_routing(e, k, tokens, skew, rng, pop)
  held = skewed_routing(e, k, tokens, skew, rng, pop)
  load = np.bincount(ids.reshape(-1), minlength=e)

  # before: linear placement without replicas (needs E % ep == 0; else pad with empty slots)
  pad = (-e) % ep
  before = device_loads(np.concatenate([load, np.zeros(pad)]), ep)
  plan = rebalance_experts(load, num_phy, num_groups, num_nodes, ep)
  check_plan(plan, e)

  route = jax.jit(route_to_physical, static_argnames="mode")

  def after_loads(sample):
    phys = np.asarray(route(jnp.asarray(sample), plan.log2phy, plan.logcnt, mode="balanced"))
    return device_loads(np.bincount(phys.reshape(-1), minlength=num_phy), ep)

  after = after_loads(ids)
  after_held = after_loads(held)
  glob = rebalance_global(load, num_phy, ep) if plan.policy == "hierarchical" else plan
  gphys = np.asarray(route(jnp.asarray(ids), glob.log2phy, glob.logcnt, mode="balanced"))
  after_global = device_loads(np.bincount(gphys.reshape(-1), minlength=num_phy), ep)
  before_held = device_loads(np.concatenate([np.bincount(held.reshape(-1), minlength=e),
                                             np.zeros(pad)]), ep)
  result = dict(
      preset=preset, experts=e, top_k=k, ep=ep, redundant=redundant,
      redundant_used=redundant_used, physical_experts=num_phy, skew=skew, tokens=tokens,
      nodes=num_nodes, groups=num_groups, policy=plan.policy,
      balancedness_before=balancedness(before), balancedness_after=balancedness(after),
      balancedness_before_heldout=balancedness(before_held),
      balancedness_after_heldout=balancedness(after_held),
      balancedness_after_global_policy=balancedness(after_global),
      max_device_load_before=float(before.max()), max_device_load_after=float(after.max()),
      mean_device_load=float(before.mean()), max_replicas=int(plan.logcnt.max()),
      device_loads_before=before.tolist(), device_loads_after=after.tolist())
  if plot:
    _plot(result, plot)
    result["plot"] = plot
  return result


def _plot(result: dict, path: str) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  b = np.asarray(result["device_loads_before"])
  a = np.asarray(result["device_loads_after"])
  fig, ax = plt.subplots(figsize=(max(6, len(b) * 0.12 + 3), 3.5))
  x = np.arange(len(b))
  ax.bar(x - 0.2, b, 0.4, label=f"before (balancedness {result['balancedness_before']:.2f})")
  ax.bar(x + 0.2, a, 0.4, label=f"after EPLB (balancedness {result['balancedness_after']:.2f})")
  ax.axhline(b.mean(), color="k", lw=0.8, ls="--", label="mean")
  ax.set_xlabel("device")
  ax.set_ylabel("routed token copies")
  ax.set_title(f"{result['preset']}: EP={result['ep']}, +{result['redundant_used']} replicas, "
               f"skew={result['skew']} ({result['policy']})")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def format_simulation(result: dict) -> str:
  """A short human-readable report of `simulate`'s result (for the CLI)."""
  r = result
  rounded = ("" if r["redundant_used"] == r["redundant"]
             else f", rounded up from {r['redundant']}")
  lines = [
      f"{r['preset']}: {r['experts']} experts, top-{r['top_k']}, EP={r['ep']} "
      f"({r['nodes']} node(s)), {r['physical_experts']} physical experts "
      f"(+{r['redundant_used']} replicas{rounded}), policy {r['policy']}",
      f"routing: {r['tokens']} tokens, Zipf skew {r['skew']}",
      f"balancedness (mean/max device load): before {r['balancedness_before']:.3f} -> after "
      f"{r['balancedness_after']:.3f}; held-out sample {r['balancedness_before_heldout']:.3f} "
      f"-> {r['balancedness_after_heldout']:.3f}",
      f"global policy instead (replicas may leave their group's node): "
      f"{r['balancedness_after_global_policy']:.3f}",
      f"max device load: {r['max_device_load_before']:.0f} -> {r['max_device_load_after']:.0f} "
      f"(mean {r['mean_device_load']:.0f}); max replicas per expert {r['max_replicas']}",
  ]
  if "plot" in r:
    lines.append(f"plot: {r['plot']}")
  return "\n".join(lines)
