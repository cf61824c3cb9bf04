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


# --------------------------------------------------------------------------------------------
# per-call cost: parameters convert once, forward-only keeps no residuals, no output copy

from jmoe.block import MoEParams  # noqa: E402
from jmoe.interop import torch_bridge as tb  # noqa: E402


def _fresh(ours):
  """A second JmoeMoE built from `ours`'s current parameters (the reference after updates)."""
  values = {a: getattr(ours, a).detach().numpy() for a in ours._attrs}
  return JmoeMoE(ours.config, MoEParams(**values), runner_backend="xla")


def test_parameters_convert_once_and_again_only_when_changed():
  hf_config, block, x = build("qwen3_moe")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  before = tb.STATS["conversions"]
  with torch.no_grad():
    for _ in range(4):
      ours(x)
  assert tb.STATS["conversions"] - before == len(ours._attrs)  # once each, not per call
  ours(x).sum().backward()  # the training path reuses them too
  assert tb.STATS["conversions"] - before == len(ours._attrs)
  torch.optim.SGD(ours.parameters(), lr=0.5).step()  # in place: bumps the version counters
  with torch.no_grad():
    y = ours(x)
    want = _fresh(ours)(x)
  assert tb.STATS["conversions"] - before > len(ours._attrs)
  torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)


def test_inplace_update_of_a_copied_parameter_is_seen():
  """A non-contiguous parameter crosses as a copy: only the version counter can tell that the
  copy went stale."""
  hf_config, block, x = build("mixtral")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  w = ours.w2.detach()
  ours.w2 = torch.nn.Parameter(w.transpose(1, 2).contiguous().transpose(1, 2))
  assert not ours.w2.is_contiguous()
  with torch.no_grad():
    y0 = ours(x)
    ours.w2.mul_(3.0)
    y1 = ours(x)
  assert not torch.allclose(y0, y1)
  with torch.no_grad():
    torch.testing.assert_close(y1, _fresh(ours)(x), rtol=1e-6, atol=1e-6)


def test_replaced_parameter_or_swapped_data_is_seen():
  """The module's weight group re-checks object, data pointer and version every call."""
  hf_config, block, x = build("qwen3_moe")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  with torch.no_grad():
    y0 = ours(x).clone()
    ours.w2 = torch.nn.Parameter(ours.w2.detach() * 2.0)  # a new object
    torch.testing.assert_close(ours(x), 2.0 * y0, rtol=1e-5, atol=1e-6)
    ours.w2.data = ours.w2.data * 0.5  # the same object, new memory
    torch.testing.assert_close(ours(x), y0, rtol=1e-5, atol=1e-6)


def test_forward_only_keeps_no_residuals():
  hf_config, block, x = build("qwen3_moe")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  vjp, fwd = tb.STATS["vjp_forwards"], tb.STATS["forwards"]
  with torch.no_grad():
    y = ours(x)
  assert y.grad_fn is None and not y.requires_grad
  for p in ours.parameters():  # grad mode on, but nothing requires grad: forward-only too
    p.requires_grad_(False)
  y2 = ours(x)
  assert y2.grad_fn is None
  assert tb.STATS["vjp_forwards"] == vjp and tb.STATS["forwards"] == fwd + 2
  ours.w13.requires_grad_(True)  # now a gradient is needed: the VJP path
  assert ours(x).grad_fn is not None and tb.STATS["vjp_forwards"] == vjp + 1


def test_forward_only_call_holds_its_input_until_the_next():
  """A forward-only call keeps its imported input (a view of torch's memory) until the next
  call of the same block, which releases it: freed during the call, PJRT waits for the
  computation (BENCHMARKS.md, "torch bridge")."""
  hf_config, block, x = build("qwen3_moe")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  x2 = x * 2
  with torch.no_grad():
    ours(x)
    held = tb._HELD[ours._op_key]
    assert len(held) == 1 and held[0].unsafe_buffer_pointer() == x.data_ptr()
    ours(x2)
  assert tb._HELD[ours._op_key][0].unsafe_buffer_pointer() == x2.data_ptr()


def test_op_and_backward_hold_their_imports_until_the_next_call():
  """The custom op (torch.compile's path) holds its imported input like the eager call; the
  eager backward holds its imported gradient and the residuals, released by the next one."""
  hf_config, block, x = build("qwen3_moe")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  x = x.reshape(-1, x.shape[-1]).clone()
  tensors = [x, *[getattr(ours, a) for a in ours._attrs]]
  with torch.no_grad():
    torch.ops.jmoe.fused_moe(tensors, ours._op_key)
  held = tb._HELD[ours._op_key + "/op"]
  assert len(held) == 1 and held[0].unsafe_buffer_pointer() == x.data_ptr()
  y = ours(x.clone().requires_grad_(True))
  g = torch.randn_like(y)
  y.backward(g)
  gj, vjp_fn = tb._HELD[ours._op_key + "/bwd"]
  assert gj.unsafe_buffer_pointer() == g.data_ptr() and vjp_fn is not None
  ours(x.clone().requires_grad_(True)).backward(g * 2)
  assert tb._HELD[ours._op_key + "/bwd"][1] is not vjp_fn  # the previous one released


def test_output_is_not_copied_but_guarded_against_inplace_changes():
  hf_config, block, x = build("mixtral")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  y = ours(x)
  y.add_(1.0)  # allowed (torch semantics), but backward must then refuse
  with pytest.raises(RuntimeError, match="modified by an inplace operation"):
    y.sum().backward()


def test_bad_input_names_the_argument():
  hf_config, block, x = build("mixtral")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  with pytest.raises(ValueError, match="x must be"):
    ours(x[..., :5])
  with pytest.raises(TypeError, match="config must be"):
    JmoeMoE(None, None)


# --------------------------------------------------------------------------------------------
# to_jax / to_torch: zero-copy for every dtype jmoe uses


_DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8", "int32",
           "uint8"]  # uint8: packed 4-bit


@pytest.mark.parametrize("name", _DTYPES)
def test_zero_copy_both_ways(name):
  t = (torch.arange(24 * 16, dtype=torch.float32).reshape(24, 16) % 7 - 3).to(getattr(torch, name))
  a = tb.to_jax(t)
  assert a.unsafe_buffer_pointer() == t.data_ptr()
  assert a.shape == tuple(t.shape) and str(a.dtype) == name
  back = tb.to_torch(a)
  assert back.data_ptr() == a.unsafe_buffer_pointer() and back.dtype == t.dtype
  assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_packed_4bit_crosses_as_uint8():
  import jax.numpy as jnp
  packed = torch.tensor([[0x21, 0xF3]], dtype=torch.uint8)  # low nibble first: 1, 2, 3, -1
  a = tb.to_jax(packed)
  assert a.unsafe_buffer_pointer() == packed.data_ptr()
  vals = tb.view_packed_4bit(a, "int4")
  assert vals.shape == (1, 4) and vals.dtype == jnp.int4
  assert vals.astype(jnp.int32).tolist() == [[1, 2, 3, -1]]


def test_non_contiguous_and_unaligned_inputs_are_copied_once():
  base = torch.randn(8, 12)
  t = base.T  # non-contiguous
  a = tb.to_jax(t)
  assert a.unsafe_buffer_pointer() != base.data_ptr()
  np.testing.assert_array_equal(np.asarray(a), t.numpy())
  off = torch.randn(100)[1:33]  # 4 bytes past an aligned start: XLA:CPU wants 64
  b = tb.to_jax(off)
  np.testing.assert_array_equal(np.asarray(b), off.numpy())


def test_to_torch_refuses_deleted_buffers_and_bad_types():
  import jax.numpy as jnp
  a = jnp.ones(4)
  a.delete()
  with pytest.raises(ValueError, match="deleted or donated"):
    tb.to_torch(a)
  with pytest.raises(TypeError, match="a must be a jax.Array"):
    tb.to_torch(np.ones(3))
  with pytest.raises(TypeError, match="t must be a torch.Tensor"):
    tb.to_jax(np.ones(3))


def test_fast_dlpack_path_and_its_fallback_share_memory(monkeypatch):
  """The resolved-once jaxlib entry points (`_Fast`) and, where they fail, the public
  functions: both zero-copy, and a failure switches to the public path for good."""
  t = torch.randn(4, 16)
  a = tb.to_jax(t)
  assert tb._FAST_DLPACK and a.unsafe_buffer_pointer() == t.data_ptr()
  out = tb._to_torch(a + 1, -1)  # the bridge's output path (no checks, no kwarg retries)
  assert torch.equal(out, t + 1)
  fast = tb._fast()

  def refuse(*args, **kwargs):
    raise TypeError("incompatible function arguments")  # what a changed jaxlib signature says

  monkeypatch.setattr(fast, "to_buffer", refuse)
  monkeypatch.setattr(fast, "to_capsule", refuse)
  monkeypatch.setattr(tb, "_FAST_DLPACK", True)
  b = tb.to_jax(t)
  assert not tb._FAST_DLPACK and b.unsafe_buffer_pointer() == t.data_ptr()
  monkeypatch.setattr(tb, "_FAST_DLPACK", True)
  back = tb._to_torch(b, -1)
  assert not tb._FAST_DLPACK and back.data_ptr() == t.data_ptr()


def test_two_and_three_dimensional_inputs_give_the_same_rows():
  hf_config, block, x = build("qwen3_moe")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  with torch.no_grad():
    y3 = ours(x)
    y2 = ours(x.reshape(-1, x.shape[-1]))
  assert y3.shape == x.shape and y2.shape == (x.numel() // x.shape[-1], x.shape[-1])
  torch.testing.assert_close(y2, y3.reshape(y2.shape))


# --------------------------------------------------------------------------------------------
# torch.compile: the jmoe::fused_moe custom op


class _Recorder:
  """A torch.compile backend keeping the FX graphs it is given (and running them as is)."""

  def __init__(self):
    self.graphs = []

  def __call__(self, gm, example_inputs):
    self.graphs.append(gm)
    return gm.forward

  def ops(self):
    return [n.target for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]


def test_compile_fullgraph_keeps_one_opaque_node_and_backpropagates():
  hf_config, block, x = build("mixtral")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  rec = _Recorder()
  compiled = torch.compile(ours, fullgraph=True, backend=rec)  # fullgraph: a break raises
  x_hf = x.clone().requires_grad_(True)
  x_j = x.clone().requires_grad_(True)
  calls = tb.STATS["op_calls"]
  y = compiled(x_j)
  assert tb.STATS["op_calls"] == calls + 1
  assert len(rec.graphs) == 1 and rec.ops().count(torch.ops.jmoe.fused_moe.default) + \
      rec.ops().count(torch.ops.jmoe.fused_moe) == 1
  y_hf = block(x_hf)
  assert _rel(y, y_hf) < 1e-4
  g = torch.randn_like(y_hf)
  (y_hf * g).sum().backward()
  (y * g).sum().backward()
  assert _rel(x_j.grad, x_hf.grad) < 1e-4
  hf = dict(block.named_parameters())
  # router: jmoe's router_w [H, E] is HF's gate weight [E, H] transposed
  assert _rel(ours.router_w.grad.T, hf["gate.weight"].grad) < 1e-4
  # experts: w2 [E, N, H] is HF's down_proj [E, H, N] transposed per expert
  assert _rel(ours.w2.grad.transpose(1, 2), hf["experts.down_proj"].grad) < 1e-4
  assert _rel(ours.w13.grad.transpose(1, 2), hf["experts.gate_up_proj"].grad) < 1e-4


def test_compiled_training_loop_matches_eager():
  hf_config, block, x = build("qwen3_moe")
  eager = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  comp = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  step = torch.compile(comp, fullgraph=True, backend="aot_eager")
  losses = {}
  for name, mod, fn in (("eager", eager, eager), ("compiled", comp, step)):
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    losses[name] = []
    for _ in range(3):
      opt.zero_grad()
      loss = fn(x).square().mean()
      loss.backward()
      opt.step()
      losses[name].append(loss.item())
  np.testing.assert_allclose(losses["compiled"], losses["eager"], rtol=1e-5)
  assert losses["compiled"][-1] < losses["compiled"][0]


def test_custom_op_registration_passes_opcheck():
  hf_config, block, x = build("mixtral")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  tensors = [x.reshape(-1, x.shape[-1]).clone().requires_grad_(True)] + [
      getattr(ours, a) for a in ours._attrs]
  torch.library.opcheck(torch.ops.jmoe.fused_moe.default, (tensors, ours._op_key),
                        test_utils=("test_schema", "test_faketensor",
                                    "test_autograd_registration"))
  with torch.no_grad():  # the forward-only op: no autograd formula, inputs needing none
    frozen = [t.detach() for t in tensors]
    torch.library.opcheck(torch.ops.jmoe.fused_moe_forward.default, (frozen, ours._op_key),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("grad", [False, True])
def test_compiled_graph_takes_the_forward_only_op_where_no_gradient_flows(grad):
  """Under no_grad the graph calls jmoe::fused_moe_forward (no Python autograd layer per call);
  where a gradient flows, jmoe::fused_moe; each gives the eager block's output."""
  hf_config, block, x = build("qwen3_moe")
  ours = JmoeMoE.from_hf(block, hf_config, runner_backend="xla")
  rec = _Recorder()
  compiled = torch.compile(ours, fullgraph=True, backend=rec)
  with torch.set_grad_enabled(grad):
    y, want = compiled(x), ours(x)
  calls = lambda op: sum(o in (op, op.default) for o in rec.ops())  # noqa: E731
  assert calls(torch.ops.jmoe.fused_moe_forward) == (0 if grad else 1)
  assert calls(torch.ops.jmoe.fused_moe) == (1 if grad else 0)
  assert y.requires_grad == grad
  assert _rel(y, want) < 1e-6


# --------------------------------------------------------------------------------------------
# quantized weights cross as their packed values plus scales


def test_fp8_checkpoint_params_run_forward():
  import jax.numpy as jnp
  from jmoe.interop import hf
  from test_hf_parity import _block_jit, _fp8_experts, _load_dequantized_into, hf_forward
  h, n, e = 256, 128, 4
  hf_config, block, x = build("deepseek_v3", hidden_size=h, moe_intermediate_size=n,
                              n_routed_experts=e, n_group=2, topk_group=1,
                              num_experts_per_tok=2, n_shared_experts=1)
  names = ("gate_proj", "up_proj", "down_proj")
  sd, deq = _fp8_experts(block, e, names, [(n, h), (n, h), (h, n)], "block",
                         torch.Generator().manual_seed(5))
  _load_dequantized_into(block, deq, e, names)
  sd.update({k: v.detach() for k, v in block.state_dict().items() if "experts." not in k
             or "shared_experts" in k})
  config, params = hf.from_hf_state_dict("deepseek_v3", hf_config, sd, dtype="float32")
  ours = JmoeMoE(config, params)
  bufs = dict(ours.named_buffers())
  assert bufs["w13_values"].dtype == torch.float8_e4m3fn and bufs["w13_scale"].dtype == \
      torch.float32 and "w13" not in dict(ours.named_parameters())
  with torch.no_grad():
    y = ours(x)
  # the fp8 bytes crossed as they are (zero-copy), not a dequantized copy
  assert tb.CACHE.get(bufs["w13_values"]).unsafe_buffer_pointer() == bufs["w13_values"].data_ptr()
  want = np.asarray(_block_jit(jnp.asarray(x.reshape(-1, h).numpy()), params, config=config))
  np.testing.assert_allclose(y.reshape(-1, h).numpy(), want, rtol=1e-5, atol=1e-5)
  ref = hf_forward(block, x)
  assert np.linalg.norm(want - ref) / np.linalg.norm(ref) <= 6e-2  # W8A8 rounding


# --------------------------------------------------------------------------------------------
# weight-only weights: the kernels' prepared operands made once, on the JAX side


def _mxfp4_block(prepare: bool, runner: str):
  """A JmoeMoE of mxfp4 experts, H = 512, N = 256 (w2's e8m0 byte-scale rows 8 bytes, so the
  decode kernel reads them padded to 16: a prepared operand), 8 experts, top-2."""
  import jax
  import jmoe
  config = jmoe.MoEConfig(num_experts=8, top_k=2, hidden_size=512, intermediate_size=256,
                          dtype="bfloat16")
  p = jmoe.init_params(config, jax.random.key(3), dtype=jax.numpy.bfloat16)
  q = jmoe.MoEParams(router_w=p.router_w, w13=jmoe.quant.quantize_weights(p.w13, "mxfp4"),
                     w2=jmoe.quant.quantize_weights(p.w2, "mxfp4"))
  return JmoeMoE(config, q, runner_backend=runner, prepare_for_kernels=prepare), config, q


def test_prepared_operands_are_made_once_and_again_when_a_buffer_changes():
  from jmoe.interop import torch_bridge as tb
  from jmoe.quant import prepare_for_kernels
  ours, config, q = _mxfp4_block(True, "xla")
  plain, _, _ = _mxfp4_block(False, "xla")
  assert ("w2", "decode_wq.w2_scale_bytes") in ours._spec.fn.prepared
  assert not plain._spec.fn.prepared
  x = torch.randn(2, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
  before = tb.STATS["derivations"]
  with torch.no_grad():  # (quantized experts have no backward)
    ys, want = [ours(x) for _ in range(3)], plain(x)
  assert tb.STATS["derivations"] - before == 1  # with the first call only
  torch.testing.assert_close(ys[0], want, rtol=0, atol=0)  # (XLA ignores them)
  kept = ours._weights.arrays(ours._tensors())
  want13, want2 = prepare_for_kernels(q.w13, q.w2, activation=config.activation)
  made = {("w13", k): a for k, a in want13.prepared.items()}
  made.update({("w2", k): a for k, a in want2.prepared.items()})
  assert set(made) == set(ours._spec.fn.prepared)
  for name, a in zip(ours._spec.fn.prepared, kept[len(ours._attrs):]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(made[name]), err_msg=str(name))
  conversions = tb.STATS["conversions"]
  with torch.no_grad():
    ours.router_w.mul_(1.0)  # a change outside the quantized weights: converted, not derived
    ours(x)
  assert tb.STATS["conversions"] == conversions + 1 and tb.STATS["derivations"] - before == 1
  with torch.no_grad():
    ours.w2_scale.copy_(plain.w2_scale.flip(0))  # an in-place change: derived again
    plain.w2_scale.copy_(plain.w2_scale.flip(0))
    y, want = ours(x), plain(x)
  assert tb.STATS["derivations"] - before == 2
  torch.testing.assert_close(y, want, rtol=0, atol=0)


@pytest.mark.slow
def test_decode_kernel_reads_the_bridge_prepared_operands(monkeypatch):
  """Pallas (interpret) decode block through the bridge on its prepared operands: the XLA
  block's output (the kernels' own rounding apart), and a different one when the kept w2 byte
  scales are poisoned. (Prepared and per-call operands agree exactly: test_prepared_operands.)"""
  monkeypatch.setenv("JMOE_PALLAS_INTERPRET", "1")
  ours, _, _ = _mxfp4_block(True, "pallas_mosaic")
  plain, _, _ = _mxfp4_block(False, "xla")
  x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
  with torch.no_grad():
    y = ours(x)
    assert _rel(y.float(), plain(x).float()) < 2e-2
    i = len(ours._attrs) + ours._spec.fn.prepared.index(("w2", "decode_wq.w2_scale_bytes"))
    arrays = ours._weights._arrays
    arrays[i] = arrays[i] * 0  # (e8m0 byte 0: 2^-127, every w2 column scaled to ~0)
    assert _rel(ours(x).float(), y.float()) > 0.5
