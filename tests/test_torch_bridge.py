"""jmoe.interop.torch_bridge: a jmoe block as a torch module, forward and backward through DLPack,
against Hugging Face's own torch MoE block (values and gradients)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jmoe.interop.torch_bridge import JmoeMoE  # noqa: E402
from test_hf_parity import build  # noqa: E402


def _rel(a, b):
  a, b = a.detach().double().numpy(), b.detach().double().numpy()
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("case", ["mixtral", "deepseek_v3"])
def test_forward_and_backward_match_hf(case):
  hf_config, block, x = build(case)
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  x_hf = x.clone().requires_grad_(True)
  x_j = x.clone().requires_grad_(True)
  y_hf = block(x_hf)
  y_hf = y_hf[0] if isinstance(y_hf, tuple) else y_hf
  y_j = ours(x_j)
  assert y_j.shape == x.shape and y_j.dtype == x.dtype
  assert _rel(y_j, y_hf) < 1e-4
  g = torch.randn_like(y_hf)
  (y_hf * g).sum().backward()
  (y_j * g).sum().backward()
  assert _rel(x_j.grad, x_hf.grad) < 1e-4
  # expert weights: jmoe's w2 [E, N, H] is the transpose of HF's down projection per expert
  grads = {n: p.grad for n, p in ours.named_parameters()}
  assert set(grads) >= {"router_w", "w13", "w2"}
  assert all(g_ is not None and torch.isfinite(g_).all() for g_ in grads.values())
  hf_down = [p for n, p in block.named_parameters()
             if ("down" in n or n.endswith("w2.weight")) and "shared" not in n]
  hf_down_grad_norm = sum(float(p.grad.double().norm() ** 2) for p in hf_down) ** 0.5
  assert abs(float(grads["w2"].double().norm()) - hf_down_grad_norm) < 1e-4 * hf_down_grad_norm
  if case == "deepseek_v3":
    assert "correction_bias" in dict(ours.named_buffers())


def test_module_trains_with_a_torch_optimizer():
  hf_config, block, x = build("qwen3_moe")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  opt = torch.optim.SGD(ours.parameters(), lr=0.1)
  target = torch.zeros_like(x)
  losses = []
  for _ in range(3):
    opt.zero_grad()
    loss = ((ours(x) - target) ** 2).mean()
    loss.backward()
    opt.step()
    losses.append(loss.item())
  assert losses[-1] < losses[0]
