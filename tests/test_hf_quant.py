"""4-bit checkpoints kept packed by `interop.hf.from_hf_state_dict(quantized="keep")`: gpt-oss
MXFP4 (`*_blocks` / `*_scales`), GPTQ (v1 and v2 zero points, act-order `g_idx`), AWQ (the
interleaved nibble order) and NVIDIA ModelOpt nvfp4 per-expert linears.

transformers cannot produce these tensors on CPU (its MXFP4 quantizer needs triton; GPTQ / AWQ
/ ModelOpt are separate packages), so each test packs them here, from integer codes and scales
it draws, with the format's documented bit layout (own code, shares nothing with jmoe.quant).
jmoe's dequantized weights must equal the float64 values of those codes and scales, and the
jmoe block on the packed weights must match the transformers block holding those values."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import jmoe  # noqa: E402
import oracle_np as onp  # noqa: E402
from jmoe.interop import hf  # noqa: E402
from jmoe.quant import QuantizedWeights, dequantize  # noqa: E402

AWQ_PACK = [0, 2, 4, 6, 1, 3, 5, 7]  # bit slot j holds column 8c + AWQ_PACK[j]
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2)
E, H, N, G = 4, 96, 64, 32  # H != 2N keeps the fused layouts unambiguous


@jax.jit(static_argnums=2)
def _block_jit(x, params, config):
  return jmoe.moe_block(x, params, config)


def _qwen_block(seed=0):
  from transformers.models.qwen3_moe import modeling_qwen3_moe as m
  cfg = m.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=N, num_experts=E,
                         num_experts_per_tok=2, norm_topk_prob=True, **_ATTN)
  block = m.Qwen3MoeSparseMoeBlock(cfg).eval()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=g))
  x = torch.randn(7, H, generator=g)
  return cfg, block, x


def _set_experts(block, gates, ups, downs):
  """Put float64 [in, out] expert weights into the transformers block (its own layout)."""
  ex = block.experts
  with torch.no_grad():
    if hasattr(ex, "gate_up_proj"):  # transformers >= 5: fused [E, 2N, H] / [E, H, N]
      gu = np.stack([np.concatenate([g.T, u.T]) for g, u in zip(gates, ups)])
      ex.gate_up_proj.copy_(torch.from_numpy(gu.astype(np.float32)))
      ex.down_proj.copy_(torch.from_numpy(np.stack([d.T for d in downs]).astype(np.float32)))
    else:  # per-expert nn.Linear
      for i, (g, u, d) in enumerate(zip(gates, ups, downs)):
        ex[i].gate_proj.weight.copy_(torch.from_numpy(g.T.astype(np.float32)))
        ex[i].up_proj.weight.copy_(torch.from_numpy(u.T.astype(np.float32)))
        ex[i].down_proj.weight.copy_(torch.from_numpy(d.T.astype(np.float32)))


def _hf_out(block, x):
  with torch.no_grad():
    y = block(x[None])
  return (y[0] if isinstance(y, tuple) else y).reshape(-1, x.shape[-1]).numpy()


def _pack_words(u: np.ndarray, axis: int, order=range(8)) -> np.ndarray:
  """uint 4-bit codes [.., 8M, ..] -> int32 words along `axis`, slot j <- index 8m + order[j]."""
  u = np.moveaxis(u.astype(np.uint32), axis, -1)
  u = u.reshape(*u.shape[:-1], -1, 8)
  w = np.zeros(u.shape[:-1], np.uint32)
  for j, src in enumerate(order):
    w |= u[..., src] << np.uint32(4 * j)
  return np.moveaxis(w.view(np.int32), -1, axis)


def _int4_linear(rng, k, m, act_order=False, symmetric=False):
  """Random GPTQ-style codes for a [k in, m out] linear: (u [k, m], zero [k/G, m], scale
  [k/G, m] fp16, g_idx [k]) and its float64 weight (u - zero[g]) * scale[g]."""
  if act_order:
    perm = rng.permutation(k)
    g_idx = np.empty(k, np.int32)
    g_idx[perm] = np.arange(k) // G  # the rows GPTQ visits together form a group
  else:
    g_idx = (np.arange(k) // G).astype(np.int32)
  u = rng.integers(0, 16, (k, m))
  zero = np.full((k // G, m), 8) if symmetric else rng.integers(0, 16, (k // G, m))
  if not symmetric:
    zero[0, :3] = [0, 15, 1]  # the v1 wrap-around (0 stored as 15) and the extremes
  scale = rng.uniform(0.005, 0.03, (k // G, m)).astype(np.float16)
  w = (u - zero[g_idx]) * scale.astype(np.float64)[g_idx]
  return u, zero, scale, g_idx, w


def _check_block(cfg_dict, block, x, sd, ws, tol=1e-4, down_perms=None):
  """`down_perms[i]`: the order act-order gave expert i's down_proj rows (the documented fold:
  stable argsort of g_idx), which jmoe carries into w13's columns."""
  gates, ups, downs = ws
  _set_experts(block, gates, ups, downs)
  want = _hf_out(block, x)
  config, params = hf.from_hf_state_dict(None, cfg_dict, sd, "", dtype=jnp.float32)
  assert isinstance(params.w13, QuantizedWeights) and isinstance(params.w2, QuantizedWeights)
  if down_perms is not None:
    gates = [g[:, p] for g, p in zip(gates, down_perms)]
    ups = [u[:, p] for u, p in zip(ups, down_perms)]
    downs = [d[p] for d, p in zip(downs, down_perms)]
  w13 = np.stack([np.concatenate([g, u], axis=1) for g, u in zip(gates, ups)])
  onp.assert_rel_close(np.asarray(dequantize(params.w13), np.float64), w13, 1e-7, "w13")
  onp.assert_rel_close(np.asarray(dequantize(params.w2), np.float64), np.stack(downs), 1e-7,
                       "w2")
  got = _block_jit(jnp.asarray(x.numpy()), params, config)
  onp.assert_rel_close(np.asarray(got), want, tol, "block vs transformers")
  return config, params


def _cfg_dict(cfg, **quant):
  d = cfg.to_dict()
  d["quantization_config"] = quant
  return d


@pytest.mark.parametrize("v2,act_order,symmetric", [(False, True, False), (True, False, True)],
                         ids=["v1-act_order", "v2-symmetric"])
def test_gptq_checkpoint_stays_packed(v2, act_order, symmetric, rng):
  cfg, block, x = _qwen_block()
  sd = {"gate.weight": block.gate.weight.detach()}
  ws = ([], [], [])
  g_idx13, perms = None, []
  for i in range(E):
    for j, (nm, (k, m)) in enumerate(zip(("gate_proj", "up_proj", "down_proj"),
                                         [(H, N), (H, N), (N, H)])):
      # gate and up share their input, so GPTQ gives them one act-order
      if nm == "up_proj":
        lin = _int4_linear_with_gidx(rng, k, m, g_idx13, symmetric)
      else:
        lin = _int4_linear(rng, k, m, act_order=act_order and i % 2 == 0, symmetric=symmetric)
        g_idx13 = lin[3] if nm == "gate_proj" else g_idx13
      u, zero, scale, gi, w = lin
      stored_zero = zero if v2 else (zero - 1) & 0xF  # v1: zero - 1 in 4 bits
      base = f"experts.{i}.{nm}."
      sd[base + "qweight"] = torch.from_numpy(_pack_words(u, 0))
      sd[base + "qzeros"] = torch.from_numpy(_pack_words(stored_zero, 1))
      sd[base + "scales"] = torch.from_numpy(scale)
      sd[base + "g_idx"] = torch.from_numpy(gi)
      ws[j].append(w)
      if nm == "down_proj":
        perms.append(np.argsort(gi, kind="stable"))
  q = dict(quant_method="gptq", bits=4, group_size=G, desc_act=act_order, sym=symmetric,
           checkpoint_format="gptq_v2" if v2 else "gptq")
  _, params = _check_block(_cfg_dict(cfg, **q), block, x, sd, ws, down_perms=perms)
  assert params.w13.scheme.group_size == G and params.w13.scheme.zero_point == (not symmetric)
  assert (params.w13.perm is not None) == act_order and params.w2.perm is None
  assert params.w13.values.dtype == jnp.uint8 and params.w13.values.shape == (E, 2 * N, H // 2)


def _int4_linear_with_gidx(rng, k, m, g_idx, symmetric):
  u = rng.integers(0, 16, (k, m))
  zero = np.full((k // G, m), 8) if symmetric else rng.integers(0, 16, (k // G, m))
  scale = rng.uniform(0.005, 0.03, (k // G, m)).astype(np.float16)
  return u, zero, scale, g_idx, (u - zero[g_idx]) * scale.astype(np.float64)[g_idx]


def test_awq_checkpoint_stays_packed(rng):
  cfg, block, x = _qwen_block(1)
  sd = {"gate.weight": block.gate.weight.detach()}
  ws = ([], [], [])
  for i in range(E):
    for j, (nm, (k, m)) in enumerate(zip(("gate_proj", "up_proj", "down_proj"),
                                         [(H, N), (H, N), (N, H)])):
      u, zero, scale, _, w = _int4_linear(rng, k, m)
      base = f"experts.{i}.{nm}."
      sd[base + "qweight"] = torch.from_numpy(_pack_words(u, 1, AWQ_PACK))  # [K, N/8]
      sd[base + "qzeros"] = torch.from_numpy(_pack_words(zero, 1, AWQ_PACK))
      sd[base + "scales"] = torch.from_numpy(scale)
      ws[j].append(w)
  _, params = _check_block(_cfg_dict(cfg, quant_method="awq", bits=4, group_size=G,
                                     version="gemm", zero_point=True), block, x, sd, ws)
  assert params.w13.zero.dtype == jnp.uint8 and params.w13.perm is None


def test_nvfp4_checkpoint_stays_packed(rng):
  cfg, block, x = _qwen_block(2)
  sd = {"gate.weight": block.gate.weight.detach()}
  ws = ([], [], [])
  e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
  for i in range(E):
    for j, (nm, (k, m)) in enumerate(zip(("gate_proj", "up_proj", "down_proj"),
                                         [(H, N), (H, N), (N, H)])):
      codes = rng.integers(0, 16, (m, k)).astype(np.uint8)  # [out, in]
      bs = rng.uniform(0.5, 300, (m, k // 16)).astype(ml_dtypes.float8_e4m3fn)
      g = np.float32(rng.uniform(1e-4, 1e-3))  # gate and up get different globals
      base = f"experts.{i}.{nm}."
      sd[base + "weight"] = torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4))
      sd[base + "weight_scale"] = torch.from_numpy(bs.view(np.uint8)).view(torch.float8_e4m3fn)
      sd[base + "weight_scale_2"] = torch.tensor(g)
      sd[base + "input_scale"] = torch.tensor(np.float32(0.01))
      w = e2m1[codes] * np.repeat(bs.astype(np.float64), 16, axis=1) * np.float64(g)
      ws[j].append(w.T)
  _, params = _check_block(_cfg_dict(cfg, quant_method="modelopt", quant_algo="NVFP4"), block,
                           x, sd, ws)
  assert params.w13.scheme.name == "nvfp4" and params.w13.global_scale.shape == (E, 2)
  assert params.w13.scale.dtype == jnp.float8_e4m3fn


def _gpt_oss():
  from transformers.models.gpt_oss import modeling_gpt_oss as m
  cfg = m.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=E,
                       num_experts_per_tok=2, head_dim=8, **_ATTN)
  block = m.GptOssMLP(cfg).eval()
  if getattr(block.experts, "limit", None) != cfg.swiglu_limit:
    block.experts.alpha, block.experts.limit = cfg.swiglu_alpha, cfg.swiglu_limit
  g = torch.Generator().manual_seed(4)
  with torch.no_grad():
    for name, t in block.named_parameters():
      if "blocks" not in name and "scales" not in name and t.is_floating_point():
        t.copy_(torch.randn(t.shape, generator=g) * 0.2)
  return cfg, block, torch.randn(7, 64, generator=g)


def _np_mxfp4(blocks, scales):
  """Independent float64 reading of gpt-oss MXFP4: [E, out, G, 16] bytes, low nibble first."""
  e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
  vals = np.empty(blocks.shape[:-1] + (32,))
  vals[..., 0::2], vals[..., 1::2] = e2m1[blocks & 15], e2m1[blocks >> 4]
  vals = vals * np.exp2(scales.astype(np.float64) - 127)[..., None]
  return vals.reshape(*blocks.shape[:2], -1)  # [E, out, in]


def test_gpt_oss_mxfp4_checkpoint_stays_packed(rng):
  cfg, block, x = _gpt_oss()
  h, n = 64, 32
  gu_b = rng.integers(0, 256, (E, 2 * n, h // 32, 16), dtype=np.uint8)
  gu_s = rng.integers(122, 127, (E, 2 * n, h // 32), dtype=np.uint8)
  dn_b = rng.integers(0, 256, (E, h, n // 32, 16), dtype=np.uint8)
  dn_s = rng.integers(122, 127, (E, h, n // 32), dtype=np.uint8)
  gu, dn = _np_mxfp4(gu_b, gu_s), _np_mxfp4(dn_b, dn_s)  # [E, 2N, H] interleaved, [E, H, N]
  with torch.no_grad():  # transformers' layout: [E, H, 2N] / [E, N, H]
    block.experts.gate_up_proj.copy_(torch.from_numpy(np.swapaxes(gu, 1, 2).astype(np.float32)))
    block.experts.down_proj.copy_(torch.from_numpy(np.swapaxes(dn, 1, 2).astype(np.float32)))
  want = _hf_out(block, x)
  sd = {k: v for k, v in block.state_dict().items()
        if k not in ("experts.gate_up_proj", "experts.down_proj")}
  sd.update({"experts.gate_up_proj_blocks": torch.from_numpy(gu_b),
             "experts.gate_up_proj_scales": torch.from_numpy(gu_s),
             "experts.down_proj_blocks": torch.from_numpy(dn_b),
             "experts.down_proj_scales": torch.from_numpy(dn_s)})
  config, params = hf.from_hf_state_dict("gpt_oss", cfg, sd, "", dtype=jnp.float32)
  w13, w2 = params.w13, params.w2
  assert w13.scheme.name == "mxfp4" and w13.scale.dtype == jnp.float8_e8m0fnu
  # the checkpoint's bytes, reshaped (w2) or with gate / up rows regrouped (w13)
  np.testing.assert_array_equal(np.asarray(w2.values), dn_b.reshape(E, h, n // 2))
  np.testing.assert_array_equal(np.asarray(w2.scale).view(np.uint8), dn_s)
  np.testing.assert_array_equal(np.asarray(w13.values)[:, :n], gu_b[:, 0::2].reshape(E, n, -1))
  want13 = np.concatenate([gu[:, 0::2], gu[:, 1::2]], axis=1)  # gate | up rows
  np.testing.assert_array_equal(np.asarray(dequantize(w13), np.float64),
                                np.swapaxes(want13, 1, 2))
  np.testing.assert_array_equal(np.asarray(dequantize(w2), np.float64), np.swapaxes(dn, 1, 2))
  got = _block_jit(jnp.asarray(x.numpy()), params, config)
  onp.assert_rel_close(np.asarray(got), want, 1e-4, "gpt-oss mxfp4 block vs transformers")
  _, dense = hf.from_hf_state_dict("gpt_oss", cfg, sd, "", quantized="dequantize")
  assert dense.w13.dtype == jnp.bfloat16


def test_bad_packed_tensors_name_the_tensor_and_shapes(rng):
  cfg, block, _ = _qwen_block()
  sd = {"gate.weight": block.gate.weight.detach()}
  for i in range(E):
    for nm, (k, m) in zip(("gate_proj", "up_proj", "down_proj"), [(H, N), (H, N), (N, H)]):
      u, zero, scale, g_idx, _ = _int4_linear(rng, k, m)
      base = f"experts.{i}.{nm}."
      sd[base + "qweight"] = _pack_words(u, 0)
      sd[base + "qzeros"] = _pack_words((zero - 1) & 0xF, 1)
      sd[base + "scales"] = scale
      sd[base + "g_idx"] = g_idx
  cfg_d = _cfg_dict(cfg, quant_method="gptq", bits=4, group_size=G)
  bad = dict(sd, **{"experts.1.down_proj.qweight": sd["experts.1.down_proj.qweight"][:4]})
  with pytest.raises(ValueError, match=r"experts.1.down_proj.qweight has shape \(4, 96\), "
                                       r"expected \(8, 96\)"):
    hf.from_hf_state_dict(None, cfg_d, bad, "")
  missing = {k: v for k, v in sd.items() if k != "experts.2.up_proj.qzeros"}
  with pytest.raises(KeyError, match=r"experts.2.up_proj.qzeros"):
    hf.from_hf_state_dict(None, cfg_d, missing, "")
  g_bad = dict(sd, **{"experts.0.gate_proj.g_idx": np.zeros(H, np.int32)})
  with pytest.raises(ValueError, match=r"experts.0.gate_proj.g_idx must give each of the 3 "
                                       r"groups exactly 32 rows"):
    hf.from_hf_state_dict(None, cfg_d, g_bad, "")
  with pytest.raises(ValueError, match=r"bits=8 are not supported"):
    hf.from_hf_state_dict(None, _cfg_dict(cfg, quant_method="gptq", bits=8), sd, "")
  gcfg, gblock, _ = _gpt_oss()
  sd = {k: v for k, v in gblock.state_dict().items()
        if k not in ("experts.gate_up_proj", "experts.down_proj")}
  sd.update({"experts.gate_up_proj_blocks": np.zeros((E, 64, 2, 16), np.uint8),
             "experts.gate_up_proj_scales": np.zeros((E, 64, 2), np.uint8),
             "experts.down_proj_blocks": np.zeros((E, 64, 1, 8), np.uint8),
             "experts.down_proj_scales": np.zeros((E, 64, 1), np.uint8)})
  with pytest.raises(ValueError, match=r"experts.down_proj_blocks has shape \(4, 64, 1, 8\), "
                                       r"expected \(4, 64, 1, 16\)"):
    hf.from_hf_state_dict("gpt_oss", gcfg, sd, "")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_torch_module_takes_packed_weights(scheme):
  """JmoeMoE: packed uint8 values, e4m3 / e8m0 scales and nvfp4's global scale cross DLPack
  as buffers, as stored, and the module computes what jmoe does."""
  import dataclasses
  from jmoe.interop.torch_bridge import JmoeMoE
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32,
                       dtype="float32")
  p = jmoe.init_params(cfg, jax.random.key(0))
  p = dataclasses.replace(p, w13=jmoe.quant.quantize_weights(p.w13, scheme),
                          w2=jmoe.quant.quantize_weights(p.w2, scheme))
  mod = JmoeMoE(cfg, p)
  bufs = dict(mod.named_buffers())
  assert bufs["w13_values"].dtype == torch.uint8
  assert bufs["w13_scale"].dtype == (torch.float8_e4m3fn if scheme == "nvfp4"
                                     else torch.float8_e8m0fnu)
  assert ("w13_global_scale" in bufs) == (scheme == "nvfp4")
  x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
  with torch.no_grad():
    y = mod(x).numpy()
  want = np.asarray(_block_jit(jnp.asarray(x.numpy()), p, cfg))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_torch_module_takes_static_input_scales():
  """JmoeMoE with a static scheme: each weight's input_scale crosses as a buffer and the
  module computes what jmoe does with it (changing the buffer changes the result)."""
  import dataclasses
  from jmoe.interop.torch_bridge import JmoeMoE
  cfg = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                       dtype="float32")
  p = jmoe.init_params(cfg, jax.random.key(0))
  p = dataclasses.replace(
      p, w13=jmoe.quant.quantize_weights(p.w13, "fp8_channel_static", input_scale=4.0 / 448),
      w2=jmoe.quant.quantize_weights(p.w2, "fp8_channel_static", input_scale=1.0 / 448))
  mod = JmoeMoE(cfg, p)
  assert float(dict(mod.named_buffers())["w2_input_scale"][0]) == np.float32(1.0 / 448)
  x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
  with torch.no_grad():
    y = mod(x).numpy()
  want = np.asarray(_block_jit(jnp.asarray(x.numpy()), p, cfg))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
  with torch.no_grad():
    mod.w2_input_scale.mul_(4.0)  # seen by the bridge (version counter): a coarser grid
    y4 = mod(x).numpy()
  p4 = dataclasses.replace(p, w2=dataclasses.replace(p.w2, input_scale=p.w2.input_scale * 4))
  np.testing.assert_allclose(y4, np.asarray(_block_jit(jnp.asarray(x.numpy()), p4, cfg)),
                             rtol=1e-5, atol=1e-6)
  assert not np.allclose(y4, y)
