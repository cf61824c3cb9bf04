"""Peers timed in the same run as jmoe's backends (GPU only; torch imported lazily).

`torch_grouped_mm`: PyTorch's CUTLASS grouped GEMM (`torch._grouped_mm`) running the same MoE
block on the same weights and routing (handed over zero-copy through DLPack): sort slots by
expert, GEMM1, activation, GEMM2, weighted gather-sum. Timed with CUDA events.
"""
from __future__ import annotations

import statistics
from typing import Callable, Sequence

import numpy as np

from jmoe.config import MoEConfig


def available(name: str, console=None) -> bool:
  if name != "torch_grouped_mm":
    raise ValueError(f"peer={name!r} is not known; known: 'torch_grouped_mm'")
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    if console:
      console.print("peer torch_grouped_mm skipped: torch is not installed")
    return False
  if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
    if console:
      console.print("peer torch_grouped_mm skipped: needs CUDA and torch._grouped_mm")
    return False
  return True


def _torch_block(torch, x, w13t, w2t, tw, ti, cfg: MoEConfig):
  t, k = ti.shape
  e = w13t.shape[0]
  flat = ti.reshape(-1)
  order = torch.argsort(flat, stable=True)
  inv = torch.empty_like(order)  # inverse permutation by one scatter, not a second sort
  inv[order] = torch.arange(order.numel(), device=order.device)
  counts = torch.zeros(e, dtype=torch.int32, device=flat.device)  # bincount syncs the host:
  counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # no CUDA-graph capture
  offs = torch.cumsum(counts, 0, dtype=torch.int32)
  xs = x[order // k]
  h = torch._grouped_mm(xs, w13t.transpose(-2, -1), offs=offs)
  n = cfg.intermediate_size
  if cfg.activation == "silu":
    a = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
  elif cfg.activation == "swigluoai":
    g = h[:, :n].float().clamp(max=cfg.swiglu_limit)
    u = h[:, n:].float().clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
    a = (g * torch.sigmoid(cfg.swiglu_alpha * g) * (u + 1)).to(h.dtype)
  else:
    raise NotImplementedError(f"torch peer: activation {cfg.activation}")
  y = torch._grouped_mm(a, w2t.transpose(-2, -1), offs=offs)
  per_slot = y[inv].reshape(t, k, -1).float()
  return (per_slot * tw.float()[..., None]).sum(1).to(x.dtype)


def cuda_graph_replay(fn: Callable, arg_sets: Sequence[tuple], repeats: int
                      ) -> tuple[float, list]:
  """(median seconds of one CUDA-graph replay of fn(*args), the captured outputs), rotating
  over arg_sets: the device-time figure of a torch block, launch gaps gone."""
  import torch  # noqa: PLC0415
  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):  # warm-up outside the capture (allocator, handles)
    for a in arg_sets:
      fn(*a)
  torch.cuda.current_stream().wait_stream(stream)
  graphs, outs = [], []
  for a in arg_sets:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
      outs.append(fn(*a))
    graphs.append(g)
  for g in graphs:
    g.replay()
  torch.cuda.synchronize()
  times = []
  for i in range(repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graphs[i % len(graphs)].replay()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
  return statistics.median(times), outs


def run_peer(name: str, cfg: MoEConfig, problems: Sequence[tuple], repeats: int):
  """Run and time the peer on each problem.

  Returns (outputs as numpy, median seconds eager, median seconds of a CUDA-graph replay).
  """
  import torch  # noqa: PLC0415

  prepared = []
  for x, w13, w2, tw, ti in problems:
    tx = torch.from_dlpack(x)
    # CUTLASS wants the weights' last two dims column-major: keep [E, N, K] contiguous.
    w13t = torch.from_dlpack(w13).transpose(-2, -1).contiguous()
    w2t = torch.from_dlpack(w2).transpose(-2, -1).contiguous()
    prepared.append((tx, w13t, w2t, torch.from_dlpack(tw), torch.from_dlpack(ti).long()))
  outs = [np.asarray(_torch_block(torch, *p, cfg).float().cpu()) for p in prepared]
  for p in prepared:  # warm-up
    _torch_block(torch, *p, cfg)
  torch.cuda.synchronize()
  times = []
  for i in range(repeats):
    p = prepared[i % len(prepared)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _torch_block(torch, *p, cfg)
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
  try:
    graph = cuda_graph_replay(lambda *p: _torch_block(torch, *p, cfg), prepared, repeats)[0]
  except RuntimeError:  # an op that cannot be captured: report eager only
    graph = float("nan")
  return outs, statistics.median(times), graph
