"""The expert-parallel communication model (BENCHMARKS.md section)."""
from __future__ import annotations

import math
import re

import pytest

from jmoe.sharding import comm_model as cm


def test_hand_computed_values():
  h, k, e, ep = 4096, 2, 8, 8
  ag = cm.bytes_per_token("allgather", hidden=h, top_k=k, num_experts=e, ep=ep)
  assert ag["dispatch"] == 7 * (h * 2 + 8 * k) and ag["combine"] == 7 * h * 4
  ra = cm.bytes_per_token("ragged_a2a", hidden=h, top_k=k, num_experts=e, ep=ep,
                          tokens_per_rank=128)
  assert ra["combine"] == pytest.approx(k * 7 / 8 * h * 2)
  assert ra["dispatch"] == pytest.approx(k * 7 / 8 * h * 2 + e * 4 * 7 / 128)
  # one expert per rank: deduplication sends the same rows (plus the k ids and weights)
  dd = cm.bytes_per_token("ragged_dedup", hidden=h, top_k=k, num_experts=e, ep=ep)
  assert dd["combine"] == pytest.approx(ra["combine"])
  assert dd["dispatch"] == pytest.approx(k * 7 / 8 * (h * 2 + 8 * k) + 8 * 4 * 7 / 128)
  pd = cm.bytes_per_token("padded_a2a", hidden=h, top_k=k, num_experts=e, ep=ep,
                          tokens_per_rank=128)
  assert pd["combine"] == pytest.approx(e * h * 2 * 7 / 8)  # dropless: E rows per token
  pc = cm.bytes_per_token("padded_a2a", hidden=h, top_k=k, num_experts=e, ep=ep,
                          tokens_per_rank=128, capacity_factor=1.0)
  assert pc["combine"] == pytest.approx(k * h * 2 * 7 / 8)
  f8 = cm.bytes_per_token("ragged_a2a", hidden=h, top_k=k, num_experts=e, ep=ep,
                          fp8_dispatch=True)
  assert f8["dispatch"] < 0.6 * ra["dispatch"]
  with pytest.raises(ValueError, match="not modelled"):
    cm.bytes_per_token("nccl", hidden=h, top_k=k, num_experts=e, ep=ep)


def test_trends():
  rows = cm.table()
  ds = [r for r in rows if r["preset"] == "deepseek-v3"]
  assert [r["ep"] for r in ds] == [8, 16, 32, 64, 128, 256]
  assert all(a["allgather"] < b["allgather"] for a, b in zip(ds, ds[1:]))
  presets = cm.PRESETS
  for r in rows:
    el = presets[r["preset"]].num_experts // r["ep"]
    if el >= 2:  # several experts per rank: one copy per rank sends less
      assert r["ragged (1 copy/rank)"] < r["ragged_a2a"]
    else:  # one expert per rank: nothing to deduplicate, the ids and weights cost a little
      assert r["ragged_a2a"] <= r["ragged (1 copy/rank)"] <= r["ragged_a2a"] * 1.01
  assert [r["ep"] for r in rows if r["preset"] == "mixtral-8x7b"] == [8]
  tk = cm.topk_table()
  assert all(a["ragged_a2a"] < b["ragged_a2a"] for a, b in zip(tk, tk[1:]))


def test_write_section_keeps_other_sections(tmp_path):
  p = tmp_path / "BENCHMARKS.md"
  p.write_text("# jmoe benchmarks\n\n## Grouped GEMM\n\nnumbers\n\n## Later\n\nmore\n")
  cm.write_section(str(p))
  cm.write_section(str(p))  # idempotent: replaced, not appended twice
  text = p.read_text()
  assert text.count(cm.SECTION) == 1
  assert "## Grouped GEMM\n\nnumbers" in text and "## Later\n\nmore" in text
  new = tmp_path / "NEW.md"
  cm.write_section(str(new))
  assert new.read_text().startswith("# jmoe benchmarks")


_COLLECTIVE = re.compile(
    r'"stablehlo\.(all_gather|all_to_all|reduce_scatter|all_reduce)"\(.*?replica_groups = '
    r'dense<\[\[([0-9, ]*)\]'
    r'.*?:\s*\((tensor<[^>]*>)\)\s*->\s*tensor<[^>]*>', re.S)
_BYTES = {"f32": 4, "i32": 4, "bf16": 2, "f16": 2}


def wire_bytes_per_rank(stablehlo: str) -> float:
  """Bytes one rank sends for the collectives in a lowered module (ring algorithms)."""
  total = 0.0
  for op, group, ttype in _COLLECTIVE.findall(stablehlo):
    g = len(group.split(","))
    *dims, dt = ttype[len("tensor<"):-1].split("x")
    nbytes = math.prod(int(d) for d in dims) * _BYTES[dt]
    total += {"all_gather": (g - 1) * nbytes, "all_to_all": (g - 1) / g * nbytes,
              "reduce_scatter": (g - 1) / g * nbytes, "all_reduce": 2 * (g - 1) / g * nbytes}[op]
  return total


@pytest.mark.parametrize("a2a", ["allgather", "padded_a2a"])
def test_model_matches_the_emitted_collectives(a2a):
  """The model's formula equals what the lowered program actually exchanges (f32, EP=8)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jmoe
  from jmoe.sharding import make_parallel
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (simulated) devices")
  t, h, n, e, k, ep = 32, 8, 4, 16, 2, 8
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
  w13 = jnp.asarray(rng.normal(size=(e, h, 2 * n)), jnp.float32)
  w2 = jnp.asarray(rng.normal(size=(e, n, h)), jnp.float32)
  tw, ti = jmoe.select_experts(x, jnp.asarray(rng.normal(size=(t, e)), jnp.float32), k)
  par = make_parallel(expert=ep)
  text = jax.jit(lambda x, tw, ti: jmoe.fused_moe(x, w13, w2, tw, ti, a2a_backend=a2a,
                                                  parallel=par)).lower(x, tw, ti).as_text()
  per_token = wire_bytes_per_rank(text) / (t // ep)
  model = cm.bytes_per_token(a2a, hidden=h, top_k=k, num_experts=e, ep=ep, act_bytes=4,
                             tokens_per_rank=t // ep)["total"]
  assert per_token == pytest.approx(model)
