"""GPU-only test (skipped cleanly without CUDA in torch and a GPU in JAX): the torch bridge on
CUDA — zero-copy crossings, and stream ordering through the DLPack stream protocol.

The ordering tests would fail without it: torch work queued on a side stream (behind a
`torch.cuda._sleep` that holds that stream ~50 ms) must be visible to the JAX computation, and
torch work queued right after the call on that stream must see JAX's result; and the call
must not synchronize the device (it returns while the side stream still sleeps).

Run on a CUDA machine with `XLA_PYTHON_CLIENT_PREALLOCATE=false` (JAX and torch share the GPU).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
try:
  _GPU = jax.devices("gpu")
except RuntimeError:
  _GPU = []
_WHY = ("GPU-only test: torch sees no CUDA device" if not torch.cuda.is_available() else
        "GPU-only test: JAX sees no GPU" if not _GPU else None)
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

import jmoe  # noqa: E402
from jmoe.interop import torch_bridge as tb  # noqa: E402
from jmoe.interop.torch_bridge import JmoeMoE  # noqa: E402

DEV = torch.device("cuda")
_SLEEP_CYCLES = 100_000_000  # ~50 ms at ~2 GHz: long enough to lose any unordered race


def _block(t=8192, h=1024, e=8, n=512):
  config = jmoe.MoEConfig(num_experts=e, top_k=2, hidden_size=h, intermediate_size=n,
                          dtype="float32")
  params = jmoe.init_params(config, jax.random.PRNGKey(0))
  ours = JmoeMoE(config, params, runner_backend="xla", device=DEV)
  x = torch.randn(t, h, device=DEV, generator=torch.Generator(DEV).manual_seed(0))
  return ours, x


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "float8_e4m3fn",
                                  "float8_e5m2", "int8", "int32", "uint8"])
def test_zero_copy_on_cuda(name):
  t = torch.ones(64, 32, device=DEV).to(getattr(torch, name))
  a = tb.to_jax(t)
  assert a.unsafe_buffer_pointer() == t.data_ptr() and a.devices() == {_GPU[0]}
  assert tb.to_torch(a).data_ptr() == a.unsafe_buffer_pointer()


@pytest.fixture(params=["handshake", "public"])
def stream_mode(request, monkeypatch):
  """Both ways the import orders torch's stream before JAX (tb.STREAM_MODE): the cached
  handshake and the public `jax.dlpack.from_dlpack`."""
  monkeypatch.setattr(tb, "STREAM_MODE", request.param)
  return request.param


def test_side_stream_work_before_and_after_the_call_is_ordered(stream_mode):
  ours, x = _block()
  with torch.no_grad():
    want = ours(x).clone()  # the reference, everything settled
    ours(x)  # warm: compiled
  torch.cuda.synchronize()
  side = torch.cuda.Stream()
  src = x.clone()
  staged = torch.full_like(x, float("nan"))
  torch.cuda.synchronize()
  with torch.cuda.stream(side), torch.no_grad():
    torch.cuda._sleep(_SLEEP_CYCLES)  # hold the side stream
    staged.copy_(src)  # x is ready only after the sleep
    t0 = time.perf_counter()
    y = ours(staged)  # JAX must wait for the copy (torch -> JAX ordering)
    host_s = time.perf_counter() - t0
    after = y * 2.0  # torch must wait for JAX (JAX -> torch ordering)
  torch.cuda.synchronize()
  assert host_s < 0.03, f"the call blocked the host {host_s * 1e3:.1f} ms: a device sync?"
  assert torch.isfinite(y).all(), "JAX read x before the side stream wrote it"
  torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
  torch.testing.assert_close(after, 2.0 * want, rtol=1e-5, atol=1e-5)


def test_reused_event_orders_every_call_on_alternating_streams(stream_mode):
  """The cached handshake event is re-recorded each call: every call must still wait for its
  own stream's work (two side streams taking turns, each held by a sleep)."""
  ours, x = _block(t=2048)
  scales = [1.0, 2.0, 3.0, 0.5, 1.5, 4.0]
  with torch.no_grad():
    want = [ours(x * k).clone() for k in scales]  # settled references
  torch.cuda.synchronize()
  sides = [torch.cuda.Stream(), torch.cuda.Stream()]
  outs = []
  with torch.no_grad():
    for i, k in enumerate(scales):
      with torch.cuda.stream(sides[i % 2]):
        staged = torch.full_like(x, float("nan"))
        torch.cuda._sleep(_SLEEP_CYCLES // 4)
        staged.copy_(x * k)
        outs.append(ours(staged))
  torch.cuda.synchronize()
  for y, w in zip(outs, want):
    assert torch.isfinite(y).all(), "a call read its input before its stream wrote it"
    torch.testing.assert_close(y, w, rtol=1e-5, atol=1e-5)


def test_parameter_update_on_the_stream_is_seen(stream_mode):
  ours, x = _block(t=2048)
  with torch.no_grad():
    y0 = ours(x).clone()
    torch.cuda._sleep(_SLEEP_CYCLES)
    ours.w2.mul_(2.0)  # queued behind the sleep on the current stream
    y1 = ours(x)
  torch.cuda.synchronize()
  # the routed experts scale linearly in w2 (no shared experts here)
  torch.testing.assert_close(y1, 2.0 * y0, rtol=1e-5, atol=1e-5)


def test_gradients_on_a_side_stream():
  ours, x = _block(t=2048)
  xr = x.clone().requires_grad_(True)
  (ours(xr) ** 2).sum().backward()
  want_x, want_w = xr.grad.clone(), ours.w13.grad.clone()
  ours.zero_grad()
  xr.grad = None
  torch.cuda.synchronize()
  side = torch.cuda.Stream()
  with torch.cuda.stream(side):
    torch.cuda._sleep(_SLEEP_CYCLES)
    x2 = (x * 1.0).requires_grad_(True)
    (ours(x2) ** 2).sum().backward()
  torch.cuda.synchronize()
  torch.testing.assert_close(x2.grad, want_x, rtol=1e-4, atol=1e-4)
  torch.testing.assert_close(ours.w13.grad, want_w, rtol=1e-4, atol=1e-4)
  assert np.isfinite(ours.w13.grad.cpu().numpy()).all()


def _quantized_block(scheme: str, prepare, h=1024, n=512, e=8):
  """bf16 JmoeMoE on CUDA with quantized experts (the oracle's runner: Pallas on Hopper)."""
  config = jmoe.MoEConfig(num_experts=e, top_k=2, hidden_size=h, intermediate_size=n,
                          dtype="bfloat16")
  p = jmoe.init_params(config, jax.random.PRNGKey(1), dtype=jax.numpy.bfloat16)
  q = jmoe.MoEParams(router_w=p.router_w, w13=jmoe.quant.quantize_weights(p.w13, scheme),
                     w2=jmoe.quant.quantize_weights(p.w2, scheme))
  return JmoeMoE(config, q, device=DEV, prepare_for_kernels=prepare), config, q


@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4"])
def test_prepared_operands_on_cuda_change_nothing_but_the_work(scheme):
  """Weight-only experts on CUDA prepare their kernel operands by default: made once, the
  same output as the module that makes them inside every call, at one token and at 512."""
  ours, _, _ = _quantized_block(scheme, None)
  plain, _, _ = _quantized_block(scheme, False)
  assert ours._spec.fn.prepared and not plain._spec.fn.prepared
  before = tb.STATS["derivations"]
  with torch.no_grad():
    for t in (1, 512):
      x = torch.randn(t, 1024, device=DEV, generator=torch.Generator(DEV).manual_seed(t))
      x = x.to(torch.bfloat16)
      torch.testing.assert_close(ours(x), plain(x), rtol=1e-2, atol=1e-2)
  assert tb.STATS["derivations"] - before == 1


def test_gradients_around_frozen_quantized_experts_on_cuda():
  """fp8 experts in a training step: the tokens' and router's gradients are the dense block's
  at the dequantized weights (the quantized weights are frozen buffers)."""
  ours, config, q = _quantized_block("fp8_channel", None)
  bf16 = jax.numpy.bfloat16
  dense = JmoeMoE(config, jmoe.MoEParams(router_w=q.router_w, w13=q.w13.dequantize(bf16),
                                         w2=q.w2.dequantize(bf16)), device=DEV)
  x = torch.randn(256, 1024, device=DEV, generator=torch.Generator(DEV).manual_seed(0))
  x = x.to(torch.bfloat16)
  r = torch.randn(256, 1024, device=DEV, generator=torch.Generator(DEV).manual_seed(1))
  grads = []
  for m in (ours, dense):  # a linear loss: both backwards get the same cotangent
    xr = x.clone().requires_grad_(True)
    (m(xr).float() * r).sum().backward()
    grads.append((xr.grad.float(), m.router_w.grad.float()))
  for got, want in zip(*grads):
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 5e-2
