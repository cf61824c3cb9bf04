"""Every registered PrepareFinalize x Experts pair (the analogue of vLLM's modular-kernel
combinations test): compatible pairs match ReferenceExperts over a matrix of activations,
dtypes, shapes and routing cases; incompatible pairs refuse to be built, naming both parts."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
import oracle_np as onp
from jmoe import registry
from jmoe.modular import (ActivationFormat, Contiguous, Delegate, ExpertsInput, ExpertWeights,
                          IncompatiblePartsError, ModularKernel, compatibility)
from jmoe.experts import ReferenceExperts
from jmoe.prepare_finalize import NoEP, NoEPBatched
from jmoe.kernels.activations import Activation

PFS = registry.all_prepare_finalize()
EXPERTS = registry.all_experts()
PAIRS = [(label, f, cls) for (label, f), cls in itertools.product(PFS, EXPERTS)]


def _pair_id(p):
  return f"{p[0]}+{p[2].__name__}"


def _compatible(pf_factory, experts_cls):
  return compatibility(pf_factory(), experts_cls()) is None


COMPATIBLE = [p for p in PAIRS if _compatible(p[1], p[2])]
INCOMPATIBLE = [p for p in PAIRS if not _compatible(p[1], p[2])]


ALIGNED = (64, 64)  # (H, N) for experts that need aligned sizes (the Pallas kernels)


def _sizes(experts, dtype):
  """(H, N) this experts class can run at this dtype, or None: the matrix's odd sizes first,
  aligned ones for kernels that require them (e.g. the Pallas kernels: bf16/f16, 64-aligned)."""
  for h, n in ((H, N), ALIGNED):
    if experts.problem_support(dtype, h, n) is None:
      return h, n
  return None


@pytest.fixture(autouse=True)
def pallas_in_interpreter(monkeypatch):
  """Run the Pallas experts in the matrix too, in Pallas' GPU interpret mode (off a GPU)."""
  from jmoe.kernels import _compat
  if _compat.interpret_available():
    monkeypatch.setenv("JMOE_PALLAS_INTERPRET", "1")


def _skip_unavailable(experts_cls):
  ok, why = experts_cls.is_available()
  if not ok:
    pytest.skip(f"{experts_cls.__name__} unavailable here: {why}")


def test_registry_has_the_builtin_parts():
  names = {c.__name__ for c in EXPERTS}
  assert {"ReferenceExperts", "XlaExperts", "XlaBatchedExperts"} <= names
  labels = {label for label, _ in PFS}
  assert {"none:standard", "none:batched"} <= labels
  assert COMPATIBLE and INCOMPATIBLE


# ---------------------------------------------------------------------------------------------
# the matrix

T, H, N, E, K = 6, 12, 10, 5, 2


def _problem(rng, activation, routing, dtype, h=H, n=N):
  """-> (args for ModularKernel.__call__ as a dict, expert_map or None)."""
  act = Activation(activation)
  k = 1 if routing == "weight_on_input" else K
  w = onp.make_weights(rng, E, h, n, gated=act.is_gated, bias=(routing == "bias"))
  tw, ids = onp.random_topk(rng, T, E, k)
  emap = None
  if routing == "empty_slots":
    ids[::2, 1] = -1
    ids[3] = -1
  elif routing == "expert_map":  # 8 global experts, 5 local
    emap = jnp.asarray([3, -1, 0, 4, -1, 1, -1, 2], jnp.int32)
    ids = np.stack([rng.permutation(8)[:K] for _ in range(T)]).astype(np.int32)
  elif routing == "one_expert":
    ids[:, 0] = 3
    ids[:, 1] = np.where(ids[:, 1] == 3, 0, ids[:, 1])
  weights = ExpertWeights(**{n: jnp.asarray(v, dtype) for n, v in w.items()})
  return dict(x=jnp.asarray(2 * rng.standard_normal((T, h)), dtype), weights=weights,
              topk_weights=jnp.asarray(tw), topk_ids=jnp.asarray(ids), activation=act,
              expert_map=emap, apply_router_weight_on_input=(routing == "weight_on_input"))


ACTIVATIONS = ("silu", "swigluoai", "gelu_no_mul")
ROUTINGS = ("plain", "empty_slots", "expert_map", "one_expert", "bias", "weight_on_input")
DTYPES = ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2))
REFERENCE = ModularKernel(NoEP(), ReferenceExperts())


# the Pallas pairs (interpret mode, every activation x routing x dtype: 14-28 s each) run in the
# slow tier; their kernels' lean coverage is test_pallas_experts / test_pallas_quant
@pytest.mark.parametrize("pair", [pytest.param(p, marks=pytest.mark.slow)
                                  if p[2].__name__.startswith("Pallas") else p
                                  for p in COMPATIBLE], ids=_pair_id)
def test_compatible_pair_matches_reference(pair, rng):
  label, pf_factory, experts_cls = pair
  _skip_unavailable(experts_cls)
  kernel = ModularKernel(pf_factory(), experts_cls())
  failures = []
  for activation, routing, (dtype, tol) in itertools.product(ACTIVATIONS, ROUTINGS, DTYPES):
    sizes = _sizes(kernel.experts, dtype)
    if sizes is None:
      continue
    p = _problem(rng, activation, routing, dtype, *sizes)
    if p["expert_map"] is not None and kernel.prepare_finalize.activation_format == \
        ActivationFormat.Standard and not experts_cls.supports_expert_map:
      with pytest.raises(IncompatiblePartsError):
        kernel(**p)
      continue
    out = kernel(**p)
    ref = REFERENCE(**p)
    assert out.shape == (T, sizes[0]) and out.dtype == dtype
    err = onp.rel_err(np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
    if not err <= tol:
      failures.append(f"{activation}/{routing}/{jnp.dtype(dtype).name}: rel err {err:.2e}")
  assert not failures, f"{kernel!r}: " + "; ".join(failures)


@pytest.mark.parametrize("pair", COMPATIBLE, ids=_pair_id)
def test_compatible_pair_jit_and_odd_shapes(pair, rng):
  """Jitted, on shapes nothing is a multiple of 8 in (and T=1, E=1, k=E), vs the f64 oracle."""
  label, pf_factory, experts_cls = pair
  _skip_unavailable(experts_cls)
  kernel = ModularKernel(pf_factory(), experts_cls())
  dtype, tol = next(((d, t) for d, t in DTYPES if _sizes(kernel.experts, d)), (None, None))
  why = kernel.experts.problem_support(dtype or jnp.float32, 5, 3)
  if why is not None:
    pytest.skip(f"{experts_cls.__name__} takes no odd shapes: {why}")
  act = Activation("gelu_tanh")
  f = jax.jit(lambda x, w, tw, ti: kernel(x, w, tw, ti, activation=act))
  for t, h, n, e, k in ((1, 5, 3, 3, 2), (7, 9, 5, 1, 1), (4, 3, 7, 3, 3)):
    w = onp.make_weights(rng, e, h, n, bias=True)
    tw, ids = onp.random_topk(rng, t, e, k)
    x = rng.standard_normal((t, h))
    out = f(jnp.asarray(x, dtype),
            ExpertWeights(**{nm: jnp.asarray(v, dtype) for nm, v in w.items()}),
            jnp.asarray(tw), jnp.asarray(ids))
    up = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)  # noqa
    ref = onp.fused_moe(up(x), up(w["w13"]), up(w["w2"]), tw, ids, activation="gelu_tanh",
                        w13_bias=up(w["w13_bias"]), w2_bias=up(w["w2_bias"]))
    onp.assert_rel_close(np.asarray(out.astype(jnp.float32)), ref, tol,
                         f"{kernel!r} T={t} H={h} N={n} E={e}")


@pytest.mark.parametrize("pair", INCOMPATIBLE, ids=_pair_id)
def test_incompatible_pair_raises(pair):
  label, pf_factory, experts_cls = pair
  pf, experts = pf_factory(), experts_cls()
  reason = compatibility(pf, experts)
  with pytest.raises(IncompatiblePartsError) as info:
    ModularKernel(pf, experts)
  assert isinstance(info.value, ValueError)
  msg = str(info.value)
  assert repr(pf) in msg and repr(experts) in msg, msg
  assert reason in msg


SCHEMES = ("fp8_tensor", "fp8_channel", "fp8_block", "int8", "w8a16", "mxfp8", "w4a16",
           "mxfp4", "nvfp4", "fp8_channel_static")
QUANT_TRIPLES = [(p, s) for p in COMPATIBLE for s in SCHEMES]


def _claims(pair, scheme):
  return compatibility(pair[1](), pair[2](), jmoe.QuantConfig(scheme)) is None


@pytest.mark.parametrize("pair,scheme", [t for t in QUANT_TRIPLES if not _claims(*t)],
                         ids=lambda v: v if isinstance(v, str) else _pair_id(v))
def test_quantized_triple_refused_clearly(pair, scheme):
  """A (prepare/finalize, experts, scheme) triple that does not claim support refuses to be
  built, naming both parts and the scheme."""
  quant = jmoe.QuantConfig(scheme)
  with pytest.raises(IncompatiblePartsError, match="cannot be combined") as info:
    ModularKernel(pair[1](), pair[2](), quant)
  assert repr(pair[1]()) in str(info.value) and repr(pair[2]()) in str(info.value)
  assert f"QuantConfig({scheme})" in str(info.value)


def _interpreted(pair) -> bool:
  """Pallas experts off a GPU: the interpreter takes minutes per quantized block here, so
  their quantized triples are checked in tests/test_pallas_quant.py on smaller problems."""
  return pair[2].name.startswith("pallas") and not pair[2].is_available()[0]


@pytest.mark.parametrize("pair,scheme",
                         [t for t in QUANT_TRIPLES if _claims(*t) and not _interpreted(t[0])],
                         ids=lambda v: v if isinstance(v, str) else _pair_id(v))
def test_quantized_triple_matches_reference(pair, scheme, rng):
  """Every triple that claims support runs and matches ReferenceExperts on the same quantized
  weights (empty slots and an expert_map included)."""
  from jmoe.quant import calibrate_input_scales, quantize_weights
  _skip_unavailable(pair[2])
  quant = jmoe.QuantConfig(scheme)
  kernel = ModularKernel(pair[1](), pair[2](), quant)
  dtype = jnp.bfloat16 if kernel.experts.problem_support(jnp.float32, 128, 128) else jnp.float32
  failures = []
  for routing in ("empty_slots", "expert_map"):
    p = _problem(rng, "silu", routing, jnp.float32, 128, 128)
    if p["expert_map"] is not None and not pair[2].supports_expert_map and \
        kernel.prepare_finalize.activation_format == ActivationFormat.Standard:
      continue
    s13 = s2 = None
    if quant.static_activations:
      s13, s2 = calibrate_input_scales(p["x"], p["weights"].w13, p["weights"].w2,
                                       p["topk_ids"], quant)
    p["weights"] = ExpertWeights(w13=quantize_weights(p["weights"].w13, quant, input_scale=s13),
                                 w2=quantize_weights(p["weights"].w2, quant, input_scale=s2))
    p["x"] = p["x"].astype(dtype)
    out = kernel(**p)
    ref = ModularKernel(NoEP(), ReferenceExperts(), quant)(**p)
    err = onp.rel_err(np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
    if not err <= 2e-2:
      failures.append(f"{routing}: rel err {err:.2e}")
  assert not failures, f"{kernel!r} {scheme}: " + "; ".join(failures)


@pytest.mark.parametrize("activation", ["silu", "relu2_no_mul"])
@pytest.mark.parametrize("experts_cls", EXPERTS, ids=lambda c: c.__name__)
def test_workspace_shapes_match_apply(experts_cls, activation, rng):
  _skip_unavailable(experts_cls)
  experts = experts_cls()
  dtype = jnp.float32 if _sizes(experts, jnp.float32) else jnp.bfloat16
  h, n = _sizes(experts, dtype)
  pf = NoEP() if experts.activation_formats[0] == ActivationFormat.Standard else NoEPBatched()
  act = Activation(activation)
  w = onp.make_weights(rng, E, h, n, gated=act.is_gated)
  weights = ExpertWeights(w13=jnp.asarray(w["w13"], dtype), w2=jnp.asarray(w["w2"], dtype))
  tw, ids = onp.random_topk(rng, T, E, K)
  x = jnp.asarray(rng.standard_normal((T, h)), dtype)
  inp = pf.prepare(x, jnp.asarray(tw), jnp.asarray(ids), num_local_experts=E, expert_map=None,
                   apply_router_weight_on_input=False, quant=None)
  out = experts.apply(inp, weights, activation=act, expert_map=None, out_dtype=dtype)
  for got in (experts.workspace_shapes(inp, weights, dtype),  # activation inferred from w13
              experts.workspace_shapes(inp, weights, dtype, activation=act)):
    assert (got.shape, got.dtype) == (out.shape, out.dtype)


# ---------------------------------------------------------------------------------------------
# NoEPBatched capacity, Delegate, shared-output hook


def test_batched_capacity_reports_dropped(rng):
  ids = np.array([[0, 1], [0, 2], [0, 1], [0, 3], [4, 0], [2, 1]], np.int32)  # expert 0: 5 slots
  tw = rng.uniform(0.1, 1, ids.shape).astype(np.float32)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  w = onp.make_weights(rng, E, H, N)
  weights = ExpertWeights(w13=jnp.asarray(w["w13"], jnp.float32),
                          w2=jnp.asarray(w["w2"], jnp.float32))
  kw = dict(num_local_experts=E, expert_map=None, apply_router_weight_on_input=False, quant=None)
  # Default capacity (T): dropless.
  inp = NoEPBatched().prepare(x, jnp.asarray(tw), jnp.asarray(ids), **kw)
  assert int(inp.dropped) == 0 and inp.a.shape == (E, T, H)
  np.testing.assert_array_equal(inp.expert_num_tokens, [5, 3, 2, 1, 1])
  # Capacity 2: expert 0 drops 3 slots, expert 1 drops 1.
  pf = NoEPBatched(max_tokens_per_expert=2)
  assert pf.max_num_tokens_per_rank() == 2
  inp = pf.prepare(x, jnp.asarray(tw), jnp.asarray(ids), **kw)
  assert int(inp.dropped) == 4
  assert inp.a.shape == (E, 2, H)
  np.testing.assert_array_equal(inp.expert_num_tokens, [2, 2, 2, 1, 1])
  kept = np.asarray(inp.slot_pos) >= 0
  assert int((~kept).sum()) == 4
  # The kept slots are the first ones in token order (stable), and the output equals the
  # oracle with the dropped slots emptied.
  np.testing.assert_array_equal(~kept, [[0, 0], [0, 0], [1, 0], [1, 0], [0, 1], [0, 1]])
  out = ModularKernel(pf, jmoe.experts.XlaBatchedExperts())(
      x, weights, jnp.asarray(tw), jnp.asarray(ids), activation=Activation("silu"))
  ref = onp.fused_moe(np.asarray(x), w["w13"], w["w2"], tw, np.where(kept, ids, -1))
  onp.assert_rel_close(np.asarray(out), ref, 1e-5)
  # A capacity above T wastes rows but drops nothing and changes nothing.
  big = ModularKernel(NoEPBatched(max_tokens_per_expert=3 * T), jmoe.experts.XlaBatchedExperts())
  out = big(x, weights, jnp.asarray(tw), jnp.asarray(ids), activation=Activation("silu"))
  onp.assert_rel_close(np.asarray(out), onp.fused_moe(np.asarray(x), w["w13"], w["w2"], tw, ids),
                       1e-5)
  # Under jit the count is a traced value and still right.
  dropped = jax.jit(lambda a, b, c: pf.prepare(a, b, c, **kw).dropped)(
      x, jnp.asarray(tw), jnp.asarray(ids))
  assert int(dropped) == 4


def test_batched_capacity_must_be_positive():
  with pytest.raises(ValueError, match="max_tokens_per_expert"):
    NoEPBatched(max_tokens_per_expert=0)


class _DelegatingExperts(ReferenceExperts):
  """Returns the per-slot [T, k, H] layout and lets the PrepareFinalize pick the reduce."""

  name = "delegating_test"

  def finalize_weight_and_reduce_impl(self):
    return Delegate()


def test_delegate_resolves_to_prepare_finalize_default(rng):
  p = _problem(rng, "silu", "plain", jnp.float32)
  assert isinstance(NoEP().default_weight_and_reduce, Contiguous)
  out = ModularKernel(NoEP(), _DelegatingExperts())(**p)
  np.testing.assert_allclose(out, REFERENCE(**p), rtol=1e-6)
  inp = ExpertsInput(a=p["x"], topk_weights=p["topk_weights"], topk_ids=p["topk_ids"])
  with pytest.raises(RuntimeError, match="Delegate"):
    Delegate().apply(jnp.zeros((T, K, H)), inp, jnp.float32)


@pytest.mark.parametrize("label_factory", PFS, ids=lambda p: p[0])
def test_shared_output_hook_is_added(label_factory, rng):
  label, pf_factory = label_factory
  pf = pf_factory()
  experts = ReferenceExperts() if pf.activation_format == ActivationFormat.Standard \
      else jmoe.experts.XlaBatchedExperts()
  kernel = ModularKernel(pf, experts)
  p = _problem(rng, "silu", "plain", jnp.float32)
  shared = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  calls = []
  out = kernel(**p, shared_output=lambda: calls.append(1) or shared)
  assert calls == [1]
  np.testing.assert_allclose(out, kernel(**p) + shared, rtol=1e-5, atol=1e-6)


class _NoGeluExperts(ReferenceExperts):
  name = "no_gelu_test"

  def supports_activation(self, activation):
    return not activation.name.startswith("gelu")


def test_unsupported_activation_refused_before_running(rng):
  kernel = ModularKernel(NoEP(), _NoGeluExperts())
  p = _problem(rng, "gelu_no_mul", "plain", jnp.float32)
  with pytest.raises(IncompatiblePartsError, match=r"does not support activation 'gelu_no_mul'"):
    kernel(**p)
  p = _problem(rng, "silu", "plain", jnp.float32)
  np.testing.assert_allclose(kernel(**p), REFERENCE(**p), rtol=1e-6)
