"""EPLB: the rebalancing algorithm, routing with replicas, weight re-layout, and that a
rebalanced expert-parallel forward gives the same outputs."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jmoe  # noqa: E402
from jmoe.sharding import eplb  # noqa: E402
from jmoe.sharding.mesh import make_parallel  # noqa: E402


def skewed_load(rng, layers, experts, skew=1.2):
  return np.stack([np.round(eplb.zipf_popularity(experts, skew, rng) * 10000)
                   for _ in range(layers)])


def test_deepseek_readme_example():
  """The second layer of the example in DeepSeek's EPLB README (4 groups, 2 nodes, 8 GPUs)."""
  w = np.array([[20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
  plan = eplb.rebalance_experts(w, 16, 4, 2, 8)
  assert plan.policy == "hierarchical"
  assert plan.phy2log[0].tolist() == [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]
  eplb.check_plan(plan, 12)


def test_balanced_packing():
  rng = np.random.default_rng(0)
  w = rng.random((3, 12))
  pack, rank = eplb.balanced_packing(w, 4)
  for l in range(3):
    assert np.bincount(pack[l], minlength=4).tolist() == [3] * 4
    for p in range(4):
      assert sorted(rank[l][pack[l] == p].tolist()) == [0, 1, 2]
  with pytest.raises(ValueError, match="cannot be packed"):
    eplb.balanced_packing(w, 5)


def test_replicate_experts_gives_replicas_to_hot_experts():
  w = np.array([[100.0, 1, 1, 50]])
  phy2log, rank, cnt = eplb.replicate_experts(w, 7)
  assert cnt.tolist() == [[3, 1, 1, 2]]
  assert sorted(phy2log[0].tolist()) == [0, 0, 0, 1, 2, 3, 3]
  for e in range(4):
    assert sorted(rank[0][phy2log[0] == e].tolist()) == list(range(cnt[0, e]))


@pytest.mark.parametrize("groups,nodes,gpus,replicas", [(8, 2, 8, 72), (4, 1, 4, 80),
                                                        (3, 2, 8, 72), (1, 1, 8, 64)])
def test_plans_are_consistent_and_balance_better(groups, nodes, gpus, replicas):
  rng = np.random.default_rng(groups * 100 + nodes)
  e = 48 if groups == 3 else 64
  load = skewed_load(rng, 2, e)
  plan = eplb.rebalance_experts(load, replicas, groups, nodes, gpus)
  assert plan.policy == ("hierarchical" if groups % nodes == 0 and nodes > 1 else "global")
  eplb.check_plan(plan, e)  # bijection of slots, log2phy inverse of phy2log, >= 1 replica
  assert plan.phy2log.shape == (2, replicas)
  for l in range(2):
    before = eplb.device_loads(np.concatenate([load[l], np.zeros((-e) % gpus)]), gpus)
    phys = (load[l] / plan.logcnt[l])[plan.phy2log[l]]  # ideal split over replicas
    after = eplb.device_loads(phys, gpus)
    assert np.isclose(after.sum(), before.sum())
    assert eplb.balancedness(after) > eplb.balancedness(before)
    if plan.policy == "hierarchical" and nodes > 1:  # whole groups stay inside one node
      per_node = replicas // nodes
      gsize = e // groups
      for n in range(nodes):
        grp = set((plan.phy2log[l][n * per_node:(n + 1) * per_node] // gsize).tolist())
        assert len(grp) == groups // nodes


def test_global_variant_balances_at_least_as_well_without_group_constraint():
  rng = np.random.default_rng(4)
  load = skewed_load(rng, 1, 64, skew=1.5)
  hier = eplb.rebalance_experts(load, 80, 8, 4, 16)
  glob = eplb.rebalance_global(load, 80, 16)
  assert glob.policy == "global"
  eplb.check_plan(glob, 64)

  def score(plan):
    return eplb.balancedness(eplb.device_loads((load[0] / plan.logcnt[0])[plan.phy2log[0]], 16))
  assert score(glob) >= score(hier) - 1e-9


@pytest.mark.parametrize("mode", ["position", "balanced"])
def test_route_to_physical(mode):
  rng = np.random.default_rng(1)
  load = skewed_load(rng, 1, 16)
  plan = eplb.rebalance_experts(load, 24, 1, 1, 4)
  ids = eplb.skewed_routing(16, 3, 64, 1.2, rng)
  ids[::7, 2] = -1
  phys = np.asarray(eplb.route_to_physical(jnp.asarray(ids), plan.log2phy, plan.logcnt, mode))
  assert ((phys == -1) == (ids == -1)).all()
  ok = ids >= 0
  assert (plan.phy2log[0][phys[ok]] == ids[ok]).all()
  if mode == "balanced":  # each expert's copies split over its replicas within one
    counts = np.bincount(phys[ok], minlength=24)
    for e in range(16):
      c = counts[plan.log2phy[0, e, :plan.logcnt[0, e]]]
      assert c.max() - c.min() <= 1
  with pytest.raises(ValueError, match="mode"):
    eplb.route_to_physical(jnp.asarray(ids), plan.log2phy, plan.logcnt, "random")


def test_expert_load_and_window():
  ids = jnp.asarray([[0, 2], [2, -1], [3, 2]], jnp.int32)
  assert eplb.expert_load(ids, 4).tolist() == [1, 0, 3, 1]
  win = eplb.LoadWindow(num_layers=2, num_experts=4, window=2)
  for step in range(3):
    win.record(np.full((2, 4), step + 1))
  assert win.load().tolist() == [[5] * 4] * 2  # steps 2 and 3 only


def test_relayout_weights():
  rng = np.random.default_rng(2)
  w13 = jnp.asarray(rng.normal(size=(8, 3, 4)), jnp.float32)
  w2 = jnp.asarray(rng.normal(size=(8, 2, 3)), jnp.float32)
  old = eplb.rebalance_experts(skewed_load(rng, 1, 8), 12, 1, 1, 4)
  new = eplb.rebalance_experts(skewed_load(rng, 1, 8), 12, 1, 1, 4)
  phys_old = eplb.physical_weights({"w13": w13, "w2": w2}, old.phy2log)
  mesh = make_parallel(expert=4, tensor=2).mesh
  moved = eplb.relayout_weights(phys_old, old.phy2log, new.phy2log,
                                sharding=NamedSharding(mesh, P("expert")))
  want = eplb.physical_weights({"w13": w13, "w2": w2}, new.phy2log)
  for k in ("w13", "w2"):
    np.testing.assert_array_equal(np.asarray(moved[k]), np.asarray(want[k]))
  assert moved["w13"].sharding.spec == P("expert")
  with pytest.raises(ValueError, match="not in the old layout"):
    eplb.relayout_weights(phys_old, np.zeros(12, int), new.phy2log)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("a2a,mode", [("ragged_a2a", "balanced"), ("padded_a2a", "position")])
def test_outputs_unchanged_by_rebalancing(a2a, mode):
  rng = np.random.default_rng(3)
  t, h, n, e, k, ep = 16, 8, 4, 16, 2, 4
  x = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
  w13 = jnp.asarray(rng.normal(size=(e, h, 2 * n)) / 3, jnp.float32)
  w2 = jnp.asarray(rng.normal(size=(e, n, h)) / 2, jnp.float32)
  ids = jnp.asarray(eplb.skewed_routing(e, k, t, 1.5, rng))
  tw = jnp.asarray(rng.random((t, k)), jnp.float32)
  ref = jmoe.fused_moe(x, w13, w2, tw, ids, runner_backend="reference")

  load = np.asarray(eplb.expert_load(ids, e))
  plan = eplb.rebalance_experts(load, e + 4, 1, 1, ep)  # 20 physical experts, 5 per rank
  phys = eplb.physical_weights({"w13": w13, "w2": w2}, plan.phy2log)
  pids = eplb.route_to_physical(ids, plan.log2phy, plan.logcnt, mode)
  par = make_parallel(expert=ep, tensor=2)
  out = jax.jit(lambda x, pids: jmoe.fused_moe(x, phys["w13"], phys["w2"], tw, pids,
                                               a2a_backend=a2a, parallel=par))(x, pids)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
  # and the replicas spread the hot experts: the busiest rank has fewer copies than before
  before = eplb.device_loads(load, ep).max()
  after = eplb.device_loads(np.bincount(np.asarray(pids).reshape(-1), minlength=e + 4), ep).max()
  assert after <= before


def test_simulate(tmp_path):
  path = str(tmp_path / "eplb.png")
  r = eplb.simulate("qwen3-30b-a3b", ep=16, redundant=16, skew=1.0, plot=path, tokens=2048)
  assert r["physical_experts"] == 144 and r["policy"] == "global"
  assert r["balancedness_after"] > r["balancedness_before"]
  assert r["balancedness_after_heldout"] > r["balancedness_before_heldout"]
  assert os.path.getsize(path) > 1000
  text = eplb.format_simulation(r)
  assert "balancedness" in text and "qwen3-30b-a3b" in text
  r = eplb.simulate("deepseek-v3", ep=64, redundant=32, skew=1.0, tokens=1024)
  assert r["redundant_used"] == 64 and r["physical_experts"] % 64 == 0  # rounded up
  assert r["policy"] == "hierarchical" and r["nodes"] == 8
  assert r["balancedness_after"] > r["balancedness_before"]
  assert r["balancedness_after_global_policy"] >= r["balancedness_after"] - 0.05
