"""Seed 003 in JAX: `moe_block(..., residual=h)` = h + moe(x), the add inside the final weighted
gather-sum, the result in h's buffer.

Checked on every local runner backend (Pallas in GPU interpret mode) against the separate add
`h + moe_block(x)`, with T = 1, empty experts, shared experts and bf16; gradients (h's
cotangent passes through unchanged); the alias (jit with h donated: XLA aliases the output to
h's buffer, `memory_analysis().alias_size_in_bytes` = T*H*itemsize and no "donated buffers were
not usable" warning) and the fusion (in the compiled HLO the fusion that reads h is the one
that gathers the expert rows); the layer, the capacity path, the reference model's decoder
layer, expert parallelism (the plain add after the combine) and bad input.
"""
from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmoe
import jmoe.layers
import jmoe.models
from jmoe.kernels import _compat
from jmoe.kernels import permute as perm

H = 64
BACKENDS = ("reference", "xla", "xla_batched", "pallas_mosaic")
FUSED = ("xla", "xla_batched", "pallas_mosaic")  # the add lands in the gather-sum's fusion


@pytest.fixture(autouse=True)
def interpret_env(monkeypatch):
  monkeypatch.setenv("JMOE_PALLAS_INTERPRET", "1")


def _skip_pallas(backend):
  if backend.startswith("pallas") and not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this jax")


def _problem(seed, t, *, shared=False, num_experts=8, dtype=jnp.float32):
  c = jmoe.MoEConfig(num_experts=num_experts, top_k=2, hidden_size=H, intermediate_size=64,
                     num_shared_experts=1 if shared else 0,
                     shared_intermediate_size=64 if shared else None)
  ks = jax.random.split(jax.random.key(seed), 3)
  p = jmoe.init_params(c, ks[0], dtype=dtype)
  x = jax.random.normal(ks[1], (t, H), dtype)
  h = jax.random.normal(ks[2], (t, H), dtype)
  return c, p, x, h


def _separate(x, p, c, h, backend):
  y = jmoe.moe_block(x, p, c, runner_backend=backend)
  return (h.astype(jnp.float32) + y.astype(jnp.float32)).astype(h.dtype)


def _tol(dtype):
  return dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1.6e-2)


_slow = pytest.mark.slow
# (backend, T, shared experts, E): T = 1; 32 experts for 3 tokens leave most experts empty
CASES = [("reference", 13, True, 8), ("xla", 1, False, 8), ("xla", 13, True, 8),
         ("xla", 3, False, 32), ("xla_batched", 1, False, 8), ("xla_batched", 3, False, 32),
         pytest.param("reference", 1, False, 8, marks=_slow),
         pytest.param("xla_batched", 13, True, 8, marks=_slow),
         pytest.param("pallas_mosaic", 1, False, 8, marks=_slow),
         pytest.param("pallas_mosaic", 13, True, 8, marks=_slow),
         pytest.param("pallas_mosaic", 3, False, 32, marks=_slow)]
# (the lean Pallas case is test_residual_buffer_is_aliased_and_add_fused[pallas_mosaic])


@pytest.mark.parametrize("backend, t, shared, num_experts", CASES)
def test_matches_separate_add(backend, t, shared, num_experts):
  _skip_pallas(backend)
  dtype = jnp.bfloat16 if backend.startswith("pallas") else jnp.float32
  c, p, x, h = _problem(t + num_experts, t, shared=shared, num_experts=num_experts, dtype=dtype)

  @jax.jit
  def both(x, p, h):
    return (jmoe.moe_block(x, p, c, runner_backend=backend, residual=h),
            _separate(x, p, c, h, backend))

  got, want = both(x, p, h)
  assert got.shape == (t, H) and got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             **_tol(dtype))


@pytest.mark.parametrize("backend", [pytest.param("reference", marks=_slow), "xla",
                                     pytest.param("xla_batched", marks=_slow)])
def test_gradients(backend):
  """d/d(h, x, params) of <g, moe_block(x, residual=h)> equal those of <g, h + moe_block(x)>;
  d h is g itself."""
  c, p, x, h = _problem(5, 7, shared=True)
  g = jax.random.normal(jax.random.key(9), (7, H))

  def fused(h, x, p):
    return jnp.sum(g * jmoe.moe_block(x, p, c, runner_backend=backend, residual=h))

  def separate(h, x, p):
    return jnp.sum(g * (h + jmoe.moe_block(x, p, c, runner_backend=backend)))

  got = jax.jit(jax.grad(fused, argnums=(0, 1, 2)))(h, x, p)
  want = jax.jit(jax.grad(separate, argnums=(0, 1, 2)))(h, x, p)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(g))
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _users_of(hlo: str, prefix: str) -> list[str]:
  """The ENTRY instructions that read the parameter jax named `prefix`... (after the Python
  argument), followed by the bodies of the fused computations they call."""
  entry = hlo[hlo.index("\nENTRY"):]
  name = re.search(r"[(, ](" + re.escape(prefix) + r"[\w.\-]*): ", entry.splitlines()[1]).group(1)
  users = [ln for ln in entry.splitlines()[2:]
           if re.search(r"[(, ]%" + re.escape(name) + r"[,)]", ln)]
  bodies = []
  for ln in users:
    m = re.search(r"calls=%([\w.\-]+)", ln)
    if m:
      start = hlo.index("%" + m.group(1) + " ")
      bodies.append(hlo[start:hlo.index("\n}", start)])
  return users + bodies


@pytest.mark.parametrize("backend", FUSED)
def test_residual_buffer_is_aliased_and_add_fused(backend):
  """jit(donate h): the output takes h's buffer (alias bytes = T*H*itemsize, no unusable-donation
  warning, h consumed), and the one fusion that reads h is the gather-sum (it gathers)."""
  _skip_pallas(backend)
  dtype = jnp.bfloat16 if backend.startswith("pallas") else jnp.float32
  t = 16
  c, p, x, h = _problem(3, t, dtype=dtype)
  f = jax.jit(lambda residual_stream, x: jmoe.moe_block(x, p, c, runner_backend=backend,
                                                       residual=residual_stream),
              donate_argnums=0)
  compiled = f.lower(h, x).compile()
  assert compiled.memory_analysis().alias_size_in_bytes == t * H * jnp.dtype(dtype).itemsize
  users = _users_of(compiled.as_text(), "residual_stream")
  fusions = [u for u in users if " fusion(" in u]
  assert len(fusions) == 1, users  # h is read once, by one fusion ...
  assert any(" gather(" in b for b in users), "the fusion reading h does not gather"  # ... the sum
  want = jax.jit(lambda x, h: _separate(x, p, c, h, backend))(x, h)
  h2 = h + 0
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # "Some donated buffers were not usable" would raise
    out = f(h2, x)
  assert h2.is_deleted()
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             **_tol(dtype))


def test_gather_sum_residual():
  """permute.gather_sum(..., residual=r) = r + the weighted gather-sum (float64 NumPy)."""
  rng = np.random.default_rng(0)
  y = rng.standard_normal((10, 8)).astype(np.float32)
  inv = np.array([[0, 3], [5, -1], [-1, -1], [9, 2]], np.int32)
  w = rng.random((4, 2)).astype(np.float32)
  r = rng.standard_normal((4, 8)).astype(np.float32)
  want = r.astype(np.float64).copy()
  for t in range(4):
    for j in range(2):
      if inv[t, j] >= 0:
        want[t] += w[t, j] * y[inv[t, j]]
  got = perm.gather_sum(jnp.asarray(y), jnp.asarray(inv), jnp.asarray(w), residual=jnp.asarray(r))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="residual must be"):
    perm.gather_sum(jnp.asarray(y), jnp.asarray(inv), residual=jnp.zeros((4, 7)))


@_slow
def test_layer_and_capacity_path():
  c, _, x, h = _problem(7, 12, shared=True)
  layer = jmoe.layers.MoE(c, rngs=nnx.Rngs(0))
  x3, h3 = x.reshape(3, 4, H), h.reshape(3, 4, H)
  np.testing.assert_allclose(layer(x3, residual=h3), h3 + layer(x3), rtol=1e-5, atol=1e-5)
  y, aux = layer(x3, residual=h3, return_aux=True)
  assert y.shape == (3, 4, H) and aux["dropped"] == 0
  c2 = jmoe.MoEConfig(num_experts=4, top_k=2, hidden_size=H, intermediate_size=64)
  capped = jmoe.layers.MoE(c2, rngs=nnx.Rngs(1), capacity_factor=0.5)
  (y, aux), (y0, aux0) = (capped(x, residual=h, return_aux=True), capped(x, return_aux=True))
  assert int(aux["dropped"]) > 0  # drops happen, and the residual still passes through
  np.testing.assert_allclose(y, h + y0, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="residual must have x's shape"):
    layer(x3, residual=h)


@_slow
def test_model_decoder_layer_passes_its_residual():
  """The decoder layer's MoE half is x + ffn(norm(x)) computed as ffn(norm(x), residual=x)."""
  cfg = jmoe.models.tiny_preset("qwen3-moe", vocab_size=32, hidden_size=32, num_layers=1)
  model = jmoe.models.MoETransformer(cfg, rngs=nnx.Rngs(0))
  layer = model.layers[0]
  x = jax.random.normal(jax.random.key(0), (2, 5, 32))
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  got, _ = layer(x, pos)
  a = x + layer.attn(layer.attn_norm(x), pos)
  want = a + layer.ffn(layer.ffn_norm(a))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # (a mesh compile: 14 s under load; the lean budget is spent)
def test_expert_parallel_adds_after_the_combine():
  """Under a mesh the EP combine takes no residual yet: fused_moe adds it after, same result."""
  devs = np.array(jax.devices()[:2])
  if devs.size < 2:
    pytest.skip("needs 2 (simulated) devices")
  mesh = jax.sharding.Mesh(devs, ("expert",))
  c, p, x, h = _problem(11, 8)
  w, ids = jmoe.select_experts(x, jmoe.router_logits(x, p), 2)
  par = jmoe.ParallelConfig(mesh=mesh, expert_axis="expert")
  kw = dict(parallel=par, a2a_backend="allgather", runner_backend="xla")
  got = jmoe.fused_moe(x, p.w13, p.w2, w, ids, residual=h, **kw)
  want = h + jmoe.fused_moe(x, p.w13, p.w2, w, ids, **kw)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_residual():
  c, p, x, h = _problem(1, 4)
  with pytest.raises(ValueError, match=r"residual must be \[T, H\]"):
    jmoe.moe_block(x, p, c, residual=h[:3])
  with pytest.raises(TypeError, match="residual must be a floating-point array"):
    jmoe.moe_block(x, p, c, residual=h.astype(jnp.int32))


@_slow
@pytest.mark.parametrize("backends", ["xla"])
def test_benchmark_script_runs(backends, tmp_path):
  """benchmarks/bench_residual.py --interpret (the tiny preset on the CPU) runs, checks and
  records every variant (a crash test: CPU timings mean nothing; the Pallas residual path
  itself is test_residual_buffer_is_aliased_and_add_fused's, in interpret mode)."""
  import importlib.util
  import json
  import os
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks",
                      "bench_residual.py")
  spec = importlib.util.spec_from_file_location("bench_residual", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  rc = mod.main(["--interpret", "--tokens", "1", "--backends", backends, "--iters", "1",
                 "--rotate", "1", "--chain", "2", "--out", str(tmp_path)])
  rows = json.load(open(tmp_path / "bench_residual.json"))["rows"]
  assert rc == 0 and len(rows) == 2 and all(r["correct"] for r in rows)
  assert all(r["alias_bytes"] == 1 * 128 * 2 for r in rows)
