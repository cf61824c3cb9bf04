"""The expert-parallel communication model (BENCHMARKS.md section)."""
from __future__ import annotations

import pytest

from sharding import comm_model as cm


def test_hand_computed_values():
  h, k, e, ep = 4096, 2, 8, 8
  ag = cm.bytes_per_token("allgather", hidden=h, top_k=k, num_experts=e, ep=ep)
  assert ag["dispatch"] == 7 * (h * 2 + 8 * k) and ag["combine"] == 7 * h * 4
  ra = cm.bytes_per_token("ragged_a2a", hidden=h, top_k=k, num_experts=e, ep=ep,
                          tokens_per_rank=128)
  assert ra["combine"] == pytest.approx(k * 7 / 8 * h * 2)
  assert ra["dispatch"] == pytest.approx(k * 7 / 8 * h * 2 + e * 4 * 7 / 128)
  # one expert per rank: deduplication changes nothing
  dd = cm.bytes_per_token("ragged_dedup", hidden=h, top_k=k, num_experts=e, ep=ep)
  assert dd["combine"] == pytest.approx(ra["combine"])
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
  assert all(r["ragged (1 copy/rank)"] <= r["ragged_a2a"] + 1e-9 for r in rows)
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
