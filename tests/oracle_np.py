"""A float64 NumPy oracle for jmoe: routing, activations, the routed expert block and shared
experts, written as plainly as possible (per-token loops) so that it is obviously right.

Everything takes and returns NumPy float64 arrays; nothing here imports jax.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0

GATED = ("silu", "gelu", "gelu_tanh", "swigluoai")
NOT_GATED = ("silu_no_mul", "gelu_no_mul", "relu2_no_mul")
ALL_ACTIVATIONS = GATED + NOT_GATED


def f64(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# scoring and routing


def softmax(x: np.ndarray) -> np.ndarray:
  x = f64(x)
  z = np.exp(x - x.max(axis=-1, keepdims=True))
  return z / z.sum(axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
  return 1.0 / (1.0 + np.exp(-f64(x)))


def select_experts(router_logits, top_k: int, *, scoring_func: str = "softmax",
                   renormalize: bool = True, num_expert_group: Optional[int] = None,
                   topk_group: Optional[int] = None, e_score_correction_bias=None,
                   routed_scaling_factor: float = 1.0):
  """Returns (weights f64 [T, k], ids int64 [T, k], margin f64 [T]).

  `margin[t]` is the smallest gap at a decision boundary for token t (between the last kept and
  first dropped group, and between the k-th and (k+1)-th expert): when it is tiny, a float32
  implementation may legitimately pick differently.
  """
  logits = f64(router_logits)
  t, e = logits.shape
  scores = softmax(logits) if scoring_func == "softmax" else sigmoid(logits)
  has_bias = e_score_correction_bias is not None
  sel = scores + f64(e_score_correction_bias)[None] if has_bias else scores.copy()
  weights = np.zeros((t, top_k))
  ids = np.zeros((t, top_k), np.int64)
  margin = np.full((t,), np.inf)
  for i in range(t):
    allowed = np.ones(e, bool)
    if num_expert_group is not None and num_expert_group > 1:
      g = num_expert_group
      per = e // g
      gscores = []
      for j in range(g):
        s = np.sort(sel[i, j * per:(j + 1) * per])[::-1]
        gscores.append(s[:2].sum() if has_bias else s[0])
      gscores = np.array(gscores)
      gorder = np.argsort(-gscores, kind="stable")
      keep = gorder[:topk_group]
      if topk_group < g:
        margin[i] = min(margin[i], gscores[gorder[topk_group - 1]] - gscores[gorder[topk_group]])
      allowed[:] = False
      for j in keep:
        allowed[j * per:(j + 1) * per] = True
    cand = np.where(allowed, sel[i], -np.inf)
    order = np.argsort(-cand, kind="stable")
    chosen = order[:top_k]
    if top_k < e and np.isfinite(cand[order[top_k]]):
      margin[i] = min(margin[i], cand[order[top_k - 1]] - cand[order[top_k]])
    ids[i] = chosen
    w = scores[i, chosen]
    if renormalize:
      w = w / w.sum()
    weights[i] = w * routed_scaling_factor
  return weights, ids, margin


# ---------------------------------------------------------------------------------------------
# activations


def _silu(x):
  return x * sigmoid(x)


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x):
  return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _relu2(x):
  return np.maximum(x, 0.0) ** 2


def swigluoai(gate, up, alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT):
  gate = np.minimum(f64(gate), limit)
  up = np.clip(f64(up), -limit, limit)
  return gate * sigmoid(alpha * gate) * (up + 1.0)


def is_gated(name: str) -> bool:
  return name in GATED


def activation(h, name: str, alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT):
  """GEMM1 output [..., 2N] (gated) or [..., N] -> [..., N]."""
  h = f64(h)
  if name == "silu_no_mul":
    return _silu(h)
  if name == "gelu_no_mul":
    return _gelu(h)
  if name == "relu2_no_mul":
    return _relu2(h)
  n = h.shape[-1] // 2
  gate, up = h[..., :n], h[..., n:]
  if name == "silu":
    return _silu(gate) * up
  if name == "gelu":
    return _gelu(gate) * up
  if name == "gelu_tanh":
    return _gelu_tanh(gate) * up
  if name == "swigluoai":
    return swigluoai(gate, up, alpha, limit)
  raise ValueError(name)


# ---------------------------------------------------------------------------------------------
# the routed expert block


def expert_mlp(x, w13_e, w2_e, name: str, b13_e=None, b2_e=None, alpha=SWIGLUOAI_ALPHA,
               limit=SWIGLUOAI_LIMIT, requant=None):
  """One expert on one token (or a batch of tokens): x [..., H] -> [..., H]. `requant`, if
  given, maps the activation's output to what a quantized GEMM2 sees."""
  h = f64(x) @ f64(w13_e)
  if b13_e is not None:
    h = h + f64(b13_e)
  a = activation(h, name, alpha, limit)
  if requant is not None:
    a = requant(a)
  y = a @ f64(w2_e)
  if b2_e is not None:
    y = y + f64(b2_e)
  return y


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, *, activation: str = "silu",
              alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT, w13_bias=None,
              w2_bias=None, expert_map=None, apply_router_weight_on_input: bool = False,
              requant=None) -> np.ndarray:
  """out[t] = sum over slots j with a local expert e of w[t, j] * mlp_e(x[t]).

  Slots with id -1, with an id outside [0, global_E), or whose expert_map entry is -1 add
  nothing. With `apply_router_weight_on_input` the input is scaled by the weight instead.
  """
  x = f64(hidden_states)
  tw = f64(topk_weights)
  ids = np.asarray(topk_ids)
  t, k = ids.shape
  e_local = w13.shape[0]
  n_global = len(expert_map) if expert_map is not None else e_local
  out = np.zeros_like(x)
  for i in range(t):
    for j in range(k):
      g = int(ids[i, j])
      if g < 0 or g >= n_global:
        continue
      loc = int(expert_map[g]) if expert_map is not None else g
      if loc < 0 or loc >= e_local:
        continue
      b13 = None if w13_bias is None else w13_bias[loc]
      b2 = None if w2_bias is None else w2_bias[loc]
      if apply_router_weight_on_input:
        out[i] += expert_mlp(x[i] * tw[i, j], w13[loc], w2[loc], activation, b13, b2, alpha,
                             limit, requant)
      else:
        out[i] += tw[i, j] * expert_mlp(x[i], w13[loc], w2[loc], activation, b13, b2, alpha,
                                        limit, requant)
  return out


def shared_experts(hidden_states, w13, w2, activation: str = "silu", gate=None,
                   alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT) -> np.ndarray:
  """x [T, H], w13 [H, 2Ns] (gate | up), w2 [Ns, H], gate [H] -> [T, H]."""
  x = f64(hidden_states)
  y = expert_mlp(x, w13, w2, activation, alpha=alpha, limit=limit)
  if gate is not None:
    y = sigmoid(x @ f64(gate).reshape(-1, 1)) * y
  return y


def moe_block(x, params, *, top_k: int, activation: str = "silu", scoring_func="softmax",
              renormalize=True, num_expert_group=None, topk_group=None,
              routed_scaling_factor=1.0):
  """The whole block from a jmoe.MoEParams (read as numpy): router + routed + shared."""
  logits = f64(x) @ f64(params.router_w)
  if params.router_b is not None:
    logits = logits + f64(params.router_b)
  w, ids, _ = select_experts(
      logits, top_k, scoring_func=scoring_func, renormalize=renormalize,
      num_expert_group=num_expert_group, topk_group=topk_group,
      e_score_correction_bias=params.correction_bias,
      routed_scaling_factor=routed_scaling_factor)
  out = fused_moe(x, f64(params.w13), f64(params.w2), w, ids, activation=activation,
                  w13_bias=None if params.w13_bias is None else f64(params.w13_bias),
                  w2_bias=None if params.w2_bias is None else f64(params.w2_bias))
  if params.shared_w13 is not None:
    out = out + shared_experts(x, f64(params.shared_w13), f64(params.shared_w2), activation,
                               None if params.shared_gate is None else f64(params.shared_gate))
  return out


# ---------------------------------------------------------------------------------------------
# quantization (scales computed in float32, as the implementations do, so values agree exactly)

QMAX = {"float8_e4m3fn": 448.0, "int8": 127.0}


def _to_type(q, dtype_name: str):
  import ml_dtypes  # noqa: PLC0415
  if dtype_name == "int8":
    return np.clip(np.round(q), -127, 127)
  return np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def quantize_matrix(w, dtype_name: str, tile_k: int, tile_n: int, *, e8m0: bool = False):
  """Symmetric quantization of w [..., K, N] with one scale per (tile_k x tile_n) tile ->
  the dequantized values, float64 (what a quantized GEMM multiplies)."""
  w = np.asarray(w, np.float32)
  *lead, k, n = w.shape
  tiles = w.reshape(*lead, k // tile_k, tile_k, n // tile_n, tile_n)
  amax = np.abs(tiles).max(axis=(-3, -1), keepdims=True)
  qmax = np.float32(QMAX[dtype_name])
  if e8m0:
    scale = np.exp2(np.ceil(np.log2(np.where(amax > 0, amax / qmax, 1.0)))).astype(np.float32)
  else:
    scale = np.where(amax > 0, amax / qmax, np.float32(1.0)).astype(np.float32)
  q = _to_type(tiles / scale, dtype_name)
  return (q * f64(scale)).reshape(w.shape)


def quantize_rows(a, dtype_name: str, group: Optional[int], *, e8m0: bool = False):
  """Dynamic activation quantization of a [..., H]: one scale per `group` channels of a row
  (None: per row) -> dequantized float64. e8m0: power-of-two scales (OCP MX)."""
  a = np.asarray(a, np.float32)
  h = a.shape[-1]
  g = group or h
  blocks = a.reshape(*a.shape[:-1], h // g, g)
  amax = np.abs(blocks).max(axis=-1, keepdims=True)
  scale = np.where(amax > 0, amax / np.float32(QMAX[dtype_name]), np.float32(1.0))
  if e8m0:
    scale = np.exp2(np.ceil(np.log2(scale)))
  scale = scale.astype(np.float32)
  return (_to_type(blocks / scale, dtype_name) * f64(scale)).reshape(a.shape)


def quantize_static(a, dtype_name: str, scale: float):
  """Static per-tensor activation quantization of a with a fixed scale (saturating) ->
  dequantized float64."""
  s = np.float32(scale)
  return _to_type(np.asarray(a, np.float32) / s, dtype_name) * f64(s)


# ---------------------------------------------------------------------------------------------
# comparisons


def rel_err(out, ref) -> float:
  out, ref = f64(out), f64(ref)
  den = np.linalg.norm(ref)
  num = np.linalg.norm(out - ref)
  return float(num / den) if den > 0 else float(num)


def assert_rel_close(out, ref, tol: float, what: str = "") -> None:
  r = rel_err(out, ref)
  assert r <= tol, f"{what}: relative error {r:.3e} > {tol:.1e}"


def assert_routing_matches(weights, ids, ref_weights, ref_ids, margin, *, rtol=1e-5, atol=1e-6,
                           tie_tol=1e-5) -> None:
  """Per token: same set of ids (order free) and the same weight for each id; tokens whose
  oracle decision margin is below `tie_tol` may pick differently (float32 near-ties)."""
  weights, ids = f64(weights), np.asarray(ids)
  assert ids.shape == ref_ids.shape, (ids.shape, ref_ids.shape)
  for t in range(ids.shape[0]):
    got = dict(zip(ids[t].tolist(), weights[t].tolist()))
    want = dict(zip(ref_ids[t].tolist(), ref_weights[t].tolist()))
    assert len(got) == ids.shape[1], f"token {t}: repeated ids {ids[t].tolist()}"
    if set(got) != set(want):
      assert margin[t] < tie_tol, (f"token {t}: ids {sorted(got)} != oracle {sorted(want)} "
                                   f"(margin {margin[t]:.2e})")
      continue
    for eid, w in want.items():
      assert abs(got[eid] - w) <= atol + rtol * abs(w), (
          f"token {t} expert {eid}: weight {got[eid]!r} != oracle {w!r}")


# ---------------------------------------------------------------------------------------------
# random inputs (NumPy float64; the tests cast to the dtype under test)


def make_weights(rng: np.random.Generator, e: int, h: int, n: int, *, gated: bool = True,
                 bias: bool = False) -> dict:
  """Random expert weights scaled by 1/sqrt(fan_in): w13 [E, H, 2N or N], w2 [E, N, H]
  (+ w13_bias, w2_bias)."""
  out = dict(w13=rng.standard_normal((e, h, 2 * n if gated else n)) / np.sqrt(h),
             w2=rng.standard_normal((e, n, h)) / np.sqrt(n))
  if bias:
    out["w13_bias"] = 0.3 * rng.standard_normal((e, out["w13"].shape[2]))
    out["w2_bias"] = 0.3 * rng.standard_normal((e, h))
  return out


def random_topk(rng: np.random.Generator, t: int, e: int, k: int):
  """Distinct ids per token (a random permutation prefix) int32 and weights in [0.1, 1) f32."""
  ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
  w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
  return w, ids


def make_block_params(rng: np.random.Generator, config) -> dict:
  """NumPy float64 parameters for a jmoe.MoEConfig, keyed like jmoe.MoEParams' fields
  (a cheap stand-in for jmoe.init_params, whose jax.random compiles take seconds on CPU)."""
  c = config
  e, h, n = c.num_experts, c.hidden_size, c.intermediate_size
  gated = is_gated(c.activation)
  p = make_weights(rng, e, h, n, gated=gated, bias=c.expert_bias)
  p["router_w"] = rng.standard_normal((h, e)) / np.sqrt(h)
  if c.router_bias:
    p["router_b"] = 0.1 * rng.standard_normal(e)
  if c.use_correction_bias:
    p["correction_bias"] = rng.uniform(0.0, 0.1, e)
  if c.num_shared_experts:
    ns = c.shared_intermediate_size or n * c.num_shared_experts
    p["shared_w13"] = rng.standard_normal((h, 2 * ns if gated else ns)) / np.sqrt(h)
    p["shared_w2"] = rng.standard_normal((ns, h)) / np.sqrt(ns)
    if c.shared_expert_gate:
      p["shared_gate"] = rng.standard_normal(h) / np.sqrt(h)
  return p
