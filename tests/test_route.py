"""CPU tests of jmoe.kernels.route (the two routing kernels), in Pallas interpret mode.

route() must give exactly what the jnp path gives: moe_align's stable order (checked against
its NumPy reference), grouped_gemm.tile_metadata's work lists for every block_m asked for, and
the token rows in sorted order. Rows past the valid slots are never written: the interpreter
starts output buffers uninitialized (NaN; INT_MIN for ints), and those rows must still be NaN.
route_for_training() must give the training path's layout (moe.fused_experts_train): the same
sorted rows, then zero rows (so written over the interpreter's NaN), the last expert's group
and tile lists extended over them, and the padded sort order.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax
import jax.numpy as jnp

from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import moe as pmoe
from jmoe.kernels import permute as perm
from jmoe.kernels import route

pytestmark = pytest.mark.skipif(not route.available(),
                                reason="the Pallas Triton lowering does not import")


def _check_metas(metas, group_sizes, m_alloc, block_ms):
  """Each (meta, num_tasks) equals tile_metadata(group_sizes, m_alloc, bm) on its first
  num_tasks columns (the kernels accept any task capacity >= the bound)."""
  assert len(metas) == len(block_ms)
  for bm, (meta, num_tasks) in zip(block_ms, metas):
    meta_ref, nt_ref = gg.tile_metadata(jnp.asarray(group_sizes), m_alloc, bm)
    q = int(nt_ref[0])
    assert num_tasks.shape == (1,) and int(num_tasks[0]) == q
    assert meta.shape[1] >= meta_ref.shape[1]
    np.testing.assert_array_equal(np.asarray(meta)[:, :q], np.asarray(meta_ref)[:, :q])


def _check_route(x, ids, e, block_ms, **kw):
  """Runs route() in interpret mode and checks every output against the jnp path."""
  t, k = ids.shape
  n = t * k
  m_alloc = gg.row_alloc(n, *block_ms)
  xs, inv, gs, metas = route.route(jnp.asarray(x), jnp.asarray(ids), e, m_alloc, block_ms,
                                   interpret=True, **kw)
  order, gs_ref, inv_ref = perm.moe_align_reference(ids, e)
  np.testing.assert_array_equal(np.asarray(gs), gs_ref)
  np.testing.assert_array_equal(np.asarray(inv), inv_ref)
  nv = int(gs_ref.sum())
  xs = np.asarray(xs, np.float32)
  np.testing.assert_array_equal(xs[:nv], np.asarray(x, np.float32)[order[:nv] // k])
  assert np.isnan(xs[nv:]).all(), "rows past the valid slots were written"
  _check_metas(metas, gs_ref, m_alloc, block_ms)
  return nv


def _tokens(rng, t, h):
  return jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)


def _case_ids(rng, t, k, e, case):
  """[t, k] expert ids: random with 10 % empty slots, all on the last expert, on the upper
  half only (zero-slot experts), all empty, or a third past E and a third negative."""
  ids = rng.integers(0, e, (t, k)).astype(np.int32)
  if case == "random":
    ids[rng.random((t, k)) < 0.1] = -1
  elif case == "one_expert":
    ids[:] = e - 1
  elif case == "zero_experts":
    ids = rng.integers(e // 2, e, (t, k)).astype(np.int32)
  elif case == "all_empty":
    ids[:] = -1
  elif case == "out_of_range":
    ids[::3] = e + rng.integers(0, 5, ids[::3].shape)
    ids[1::3] = -rng.integers(1, 5, ids[1::3].shape)
  return ids


@pytest.mark.parametrize("t,k,e,h,block_ms,case", [
    (1, 8, 128, 128, (64,), "random"),          # T=1 (decode): one block, one kernel
    (3, 2, 8, 64, (64, 128), "random"),         # two tile lists
    (70, 2, 8, 64, (64,), "random"),            # 140 slots: two blocks, the last one partial
    pytest.param(100, 8, 100, 128, (64, 128), "random",  # E not a power of two, 7 blocks
                 marks=pytest.mark.slow),
    (96, 4, 16, 64, (64,), "one_expert"),       # every slot on one expert (3 blocks)
    (40, 2, 16, 64, (128,), "zero_experts"),    # experts 0-7 get no slots
    (5, 2, 8, 64, (64,), "all_empty"),          # every slot empty (EP: all experts remote)
    (130, 1, 4, 64, (64,), "out_of_range"),     # ids >= E and < 0 are empty slots
])
def test_route_matches_jnp_path(rng, t, k, e, h, block_ms, case):
  ids = _case_ids(rng, t, k, e, case)
  nv = _check_route(_tokens(rng, t, h), ids, e, block_ms)
  assert nv == int(((ids >= 0) & (ids < e)).sum())


@pytest.mark.parametrize("one_kernel_blocks", [0, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", [pytest.param("random", marks=pytest.mark.slow),
                                  pytest.param("one_expert", marks=pytest.mark.slow),
                                  pytest.param("all_empty", marks=pytest.mark.slow),
                                  pytest.param("last_expert_only", marks=pytest.mark.slow)])
def test_route_one_and_two_kernels(rng, one_kernel_blocks, case):
  # 3 blocks: two kernels (block counts, then scatter) or one (a block program compares its
  # slots with every slot; the tile-list programs count the experts); 0 also sends a single
  # block through the two-kernel form
  # (150, 4, 16): 600 slots, so the one-kernel form compares in two chunks of 512 keys
  for t, k, e in [(150, 2, 8), (3, 2, 8), (64, 4, 128), (150, 4, 16)]:
    ids = rng.integers(-1, e + 1, (t, k)).astype(np.int32)
    if case == "one_expert":
      ids[:] = rng.integers(0, e)
    elif case == "all_empty":
      ids[:] = e
    elif case == "last_expert_only":  # every valid slot sorts after all others but the empty
      ids[::2] = e - 1
    _check_route(_tokens(rng, t, 64), ids, e, (64, 128), one_kernel_blocks=one_kernel_blocks)


def _check_route_for_training(x, ids, e, block_ms, m_alloc=None, **kw):
  """Runs route_for_training() in interpret mode and checks it, bit for bit, against the jnp
  form of its layout (permute.moe_align_training): every expert's rows start on a multiple of
  8, its padding rows and the tail are zero, the tail is in the last expert's tiles; order is
  -1 on padding and tail rows."""
  t, k = ids.shape
  n = t * k
  m_alloc = m_alloc or gg.row_alloc(n + 7 * min(e, n), *block_ms)
  xs, inv, gs, metas, order = route.route_for_training(
      jnp.asarray(x), jnp.asarray(ids), e, m_alloc, block_ms, interpret=True, **kw)
  order_ref, inv_ref, asize = perm.moe_align_training(jnp.asarray(ids), e, m_alloc)
  src = np.asarray(order_ref)
  xs_ref = np.where((src >= 0)[:, None], np.asarray(x, np.float32)[np.maximum(src, 0) // k], 0)
  assert gs.shape == (e,) and gs.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(gs), np.asarray(asize))
  starts = np.cumsum(np.asarray(gs)) - np.asarray(gs)
  assert (starts % 8 == 0).all() and (np.asarray(gs) % 8 == 0).all()
  np.testing.assert_array_equal(np.asarray(inv), np.asarray(inv_ref))
  assert order.shape == (m_alloc,) and order.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(order), np.asarray(order_ref))
  assert xs.shape == (m_alloc, x.shape[1]) and xs.dtype == x.dtype
  xs = np.asarray(xs, np.float32)
  assert np.isfinite(xs).all(), "rows left unwritten (the interpreter starts them at NaN)"
  np.testing.assert_array_equal(xs, xs_ref)
  gs_tail = asize.at[-1].add(m_alloc - int(jnp.sum(asize)))
  _check_metas(metas, gs_tail, m_alloc, block_ms)
  return int((np.asarray(order) >= 0).sum())


def test_moe_align_training_layout(rng):
  # the jnp reference itself, against a direct construction
  t, k, e, m_alloc = 9, 2, 5, 64
  ids = rng.integers(-1, e, (t, k)).astype(np.int32)
  order, inv, asize = (np.asarray(a) for a in perm.moe_align_training(
      jnp.asarray(ids), e, m_alloc))
  row = 0
  for g in range(e):
    slots = [s for s in range(t * k) if ids.reshape(-1)[s] == g]  # stable
    assert asize[g] == -(-len(slots) // 8) * 8
    for i, s_ in enumerate(slots):
      assert order[row + i] == s_ and inv.reshape(-1)[s_] == row + i
    assert (order[row + len(slots):row + asize[g]] == -1).all()
    row += asize[g]
  assert (order[row:] == -1).all()
  assert (inv.reshape(-1)[ids.reshape(-1) < 0] == -1).all()
  # the padding rows: exactly the rows below the tail that no slot fills, by expert
  *same, pad = perm.moe_align_training(jnp.asarray(ids), e, m_alloc, with_padding_rows=True)
  for a, b in zip(same, (order, inv, asize)):
    np.testing.assert_array_equal(np.asarray(a), b)
  pad = np.asarray(pad)
  assert pad.shape == (e * 7,)
  np.testing.assert_array_equal(np.sort(pad[pad >= 0]), np.flatnonzero(order[:row] < 0))


@pytest.mark.parametrize("case", ["random", "one_expert", "all_empty"])
def test_training_rows_by_scatter_equal_the_jnp_layout(rng, monkeypatch, case):
  """routed_rows' jnp path with the scatter copy (its padding and tail rows zeroed in the
  kernel) makes moe_align_training's rows: slots in place, every other row zero."""
  from jmoe.kernels import _compat
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable")
  monkeypatch.setattr(pmoe, "_PALLAS_GATHER_MIN_SLOTS", 1)  # the scatter at this small size
  t, k, e, h = 13, 2, 5, 64
  ids = rng.integers(-1, e, (t, k)).astype(np.int32)
  if case == "one_expert":
    ids[:] = 3
  elif case == "all_empty":  # the tail is every row
    ids[:] = -1
  m_alloc = gg.row_alloc(t * k + 7 * min(e, t * k), 64)
  x = _tokens(rng, t, h)
  xs, inv, gs, _, order = pmoe.routed_rows(
      x, jnp.asarray(ids), e, m_alloc, (64,), "xla", _compat.interpret_params(detect_races=True))
  assert not _compat.races_found()
  order_ref, inv_ref, asize = perm.moe_align_training(jnp.asarray(ids), e, m_alloc)
  src = np.asarray(order_ref)
  want = np.where((src >= 0)[:, None], np.asarray(x, np.float32)[np.maximum(src, 0) // k], 0)
  np.testing.assert_array_equal(np.asarray(xs, np.float32), want)  # (unwritten rows: NaN)
  np.testing.assert_array_equal(np.asarray(inv), np.asarray(inv_ref))
  np.testing.assert_array_equal(np.asarray(order), src)


@pytest.mark.parametrize("t,k,e,h,block_ms,case,m_alloc,one_kernel_blocks", [
    pytest.param(40, 2, 8, 64, (64,), "random", None, 1,  # a few empty slots: a short tail
                 marks=pytest.mark.slow),
    (1, 8, 128, 128, (64,), "random", None, 1),        # T=1: 8 slots, 56 zero rows, 2 col chunks
    pytest.param(6, 2, 6, 128, (64,), "random", 512, 1,  # m_alloc >> T*k: several stripes a
                 marks=pytest.mark.slow),                # program
    (20, 2, 8, 64, (64, 128), "out_of_range", None, 1),  # ids < 0 and >= E; two tile lists
    (5, 2, 8, 64, (64,), "all_empty", None, 1),        # every row is tail
    pytest.param(24, 4, 16, 64, (64,), "one_expert", None, 1,  # one middle expert; the last
                 marks=pytest.mark.slow),                      # gets the tail
    pytest.param(24, 2, 6, 64, (64,), "aligned", None, 1,  # counts multiples of 8: no padding
                 marks=pytest.mark.slow),
    (75, 2, 8, 64, (64, 128), "random", None, 1),      # 150 slots: two kernels
    pytest.param(75, 2, 8, 64, (64,), "random", None, 2,  # 150 slots in one kernel
                 marks=pytest.mark.slow),
    pytest.param(3, 2, 8, 64, (64,), "random", None, 0,  # one block through two kernels
                 marks=pytest.mark.slow),
    (16, 8, 100, 64, (64,), "random", None, 1),        # E=100: grid rows past the experts, and
                                                       # one with a partial share of padding
])
def test_route_for_training_matches_jnp_path(rng, t, k, e, h, block_ms, case, m_alloc,
                                             one_kernel_blocks):
  ids = rng.integers(0, e, (t, k)).astype(np.int32)
  if case == "random":
    ids[rng.random((t, k)) < 0.1] = -1
  elif case == "out_of_range":
    ids[::3] = e + rng.integers(0, 5, ids[::3].shape)
    ids[1::3] = -rng.integers(1, 5, ids[1::3].shape)
  elif case == "all_empty":
    ids[:] = -1
  elif case == "one_expert":
    ids[:] = e // 2
  elif case == "aligned":
    ids[:] = rng.permutation(np.repeat(np.arange(e), t * k // e)).reshape(t, k)
  nv = _check_route_for_training(_tokens(rng, t, h), ids, e, block_ms, m_alloc,
                                 one_kernel_blocks=one_kernel_blocks)
  assert nv == int(((ids >= 0) & (ids < e)).sum())


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=90), st.sampled_from([16, 32, 64]))
def test_sorted_before_is_the_stable_sort_position(keys, chunk):
  # the one-kernel form's position rule, outside a kernel: summed over key chunks, the slots
  # before each slot in a stable sort by key (7 marks empty slots and the padding, sorted last)
  n = len(keys)
  padded = np.full(-(-n // chunk) * chunk, 7, np.int32)
  padded[:n] = keys
  mine = route._sort_keys(jnp.asarray(padded[:n]), jnp.arange(n, dtype=jnp.int32), n)
  pos = sum(route._sorted_before(mine, route._sort_keys(
      jnp.asarray(padded[q:q + chunk]), q + jnp.arange(chunk, dtype=jnp.int32), n))
      for q in range(0, len(padded), chunk))
  want = np.empty(n, np.int64)
  want[np.argsort(np.asarray(keys), kind="stable")] = np.arange(n)
  np.testing.assert_array_equal(np.asarray(pos), want)


def _histogram_in_kernel(ids: np.ndarray, e: int, below: int | None):
  """route._histogram_of_slots run in a Pallas kernel (interpret mode) over ids: (total,
  before), before None when below is None."""
  from jax.experimental import pallas as pl
  ep = route._pow2(e)

  def body(ids_ref, total_ref, before_ref):
    total, before = route._histogram_of_slots(ids_ref, ids.shape[0], e, ep, below=below)
    total_ref[...] = total
    before_ref[...] = total if before is None else before

  out = jax.ShapeDtypeStruct((ep,), jnp.int32)
  call = pl.pallas_call(body, out_shape=(out, out),
                        in_specs=[pl.BlockSpec(memory_space=pl.ANY)], interpret=True)
  total, before = call(jnp.asarray(ids, jnp.int32))
  return np.asarray(total), (None if below is None else np.asarray(before))


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(-1, 300), min_size=1, max_size=700), st.sampled_from([8, 100, 256]),
       st.sampled_from([16, 128]), st.one_of(st.none(), st.integers(0, 700)))
def test_histogram_of_slots_counts_experts(ids, e, chunk, below):
  # the one-kernel form's expert count (a loop of dots of one-hot base-16 digits over chunks of
  # keys, the last chunk partial) against NumPy; ids outside [0, e) are empty slots; with
  # `below`, the same pass also counts only the slots before it
  ids = np.asarray(ids, np.int32)
  live = lambda v: v[(v >= 0) & (v < e)]
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(route, "_HIST_CHUNK", chunk)
    total, before = _histogram_in_kernel(ids, e, below)
  np.testing.assert_array_equal(total[:e], np.bincount(live(ids), minlength=e))
  if below is not None:
    np.testing.assert_array_equal(before[:e], np.bincount(live(ids[:below]), minlength=e))


def test_histogram_rejects_more_than_256_bins():
  with pytest.raises(ValueError, match="ep=512"):
    route._bins(jnp.zeros((16, 16), jnp.float32), 512)


@pytest.mark.parametrize("case", [pytest.param("random", marks=pytest.mark.slow), "one_expert"])
def test_route_one_kernel_at_the_default_limit(rng, case, monkeypatch):
  # ONE_KERNEL_BLOCKS blocks (2048 slots: qwen3 at 256 tokens) in one kernel, H = 2048: two
  # column chunks of _DIRECT_MAX_HC columns, block programs of _DIRECT_ROWS // 2 slots, tile
  # lists of _DIRECT_TASKS tasks, the expert count a loop of 16 _HIST_CHUNK-key steps
  assert route.ONE_KERNEL_BLOCKS == 16
  t, k, e = 256, 8, 128
  ids = rng.integers(-1, e, (t, k)).astype(np.int32)
  if case == "one_expert":
    ids[:] = 5

  def no_count_kernel(*a, **kw):
    raise AssertionError("the block-count kernel ran: two routing kernels")
  monkeypatch.setattr(route, "_block_counts", no_count_kernel)
  _check_route(_tokens(rng, t, 2048), ids, e, (128, 64))


@pytest.mark.slow
@settings(max_examples=6)
@given(st.data())
def test_route_property(data):
  t = data.draw(st.integers(1, 90), label="T")
  k = data.draw(st.sampled_from([1, 2, 4]), label="k")
  e = data.draw(st.sampled_from([3, 8, 32]), label="E")
  seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
  rng = np.random.default_rng(seed)
  ids = rng.integers(-1, e + 1, (t, k)).astype(np.int32)  # empty slots at both ends
  _check_route(_tokens(rng, t, 64), ids, e, (64,))


@pytest.mark.parametrize("fn", [route.route, route.route_for_training])
def test_route_rejects_bad_input(rng, fn):
  x = _tokens(rng, 4, 64)
  ids = jnp.zeros((4, 2), jnp.int32)
  with pytest.raises(ValueError, match="m_alloc"):
    fn(x, ids, 8, 4, (64,), interpret=True)
  with pytest.raises(ValueError, match="H=96"):
    fn(_tokens(rng, 4, 96), ids, 8, 64, (64,), interpret=True)
  with pytest.raises(ValueError, match="512 experts"):
    fn(x, ids, 512, 64, (64,), interpret=True)
  assert route.supports(route._MAX_SLOTS, 64, 256)
  assert not route.supports(route._MAX_SLOTS + 1, 64, 8)
  assert not route.supports(0, 64, 8)
  assert not route.supports(8, 64, route._MAX_EXPERTS + 1)


@pytest.mark.parametrize("t,k,e,case", [
    (70, 2, 8, "random"),         # two blocks, the last partial
    (100, 8, 100, "random"),      # E not a power of two (the empty-slot key counted, dropped)
    (64, 4, 128, "random"),       # E a power of two (the empty-slot key not counted)
    (96, 4, 16, "one_expert"),
    (5, 2, 8, "all_empty"),
    (130, 1, 4, "out_of_range"),
])
def test_slot_positions_match_moe_align(rng, t, k, e, case):
  """route.slot_positions (the block-count kernel, then XLA) gives moe_align's inv (stable
  sorted positions, -1 for empty slots) and group sizes."""
  ids = _case_ids(rng, t, k, e, case)
  inv, gs = route.slot_positions(jnp.asarray(ids), e, interpret=True)
  _, gs_ref, inv_ref = perm.moe_align_reference(ids, e)
  assert inv.shape == (t, k) and inv.dtype == jnp.int32 and gs.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(gs), gs_ref)
  np.testing.assert_array_equal(np.asarray(inv), inv_ref)
  with pytest.raises(ValueError, match="num_experts"):
    route.slot_positions(jnp.asarray(ids), route._MAX_EXPERTS + 1, interpret=True)


def test_blocks_before_is_the_exclusive_prefix_sum(rng):
  # 1024 blocks of counts up to BLOCK: the dot's bf16 operands and f32 sums are exact
  counts = rng.integers(0, route.BLOCK + 1, (1024, 8)).astype(np.int32)
  got = np.asarray(route._blocks_before(jnp.asarray(counts)))
  np.testing.assert_array_equal(got, np.cumsum(counts, axis=0) - counts)


@pytest.mark.slow
def test_xla_route_with_scatter_copy_equals_route_kernels(rng):
  """route_xla's scatter copy (slot_positions + permute.scatter_rows) makes route()'s rows,
  positions, group sizes and tile lists."""
  from jmoe.kernels import _compat
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable")
  t, k, e, h, bms = 150, 2, 8, 64, (64, 128)
  ids = rng.integers(-1, e, (t, k)).astype(np.int32)
  x = _tokens(rng, t, h)
  m_alloc = gg.row_alloc(t * k, *bms)
  want = route.route(x, jnp.asarray(ids), e, m_alloc, bms, interpret=True)
  got = pmoe.route_xla(x, jnp.asarray(ids), e, m_alloc, bms, permute_impl="scatter",
                       interpret=_compat.interpret_params(detect_races=True))
  assert not _compat.races_found()
  nv = int(((ids >= 0) & (ids < e)).sum())
  np.testing.assert_array_equal(np.asarray(got[0])[:nv], np.asarray(want[0])[:nv])
  for a, b in zip(got[1:3], want[1:3]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _check_metas(got[3], np.asarray(want[2]), m_alloc, bms)


@pytest.mark.parametrize("t", [5, pytest.param(150, marks=pytest.mark.slow)])
def test_fused_experts_route_kernels_equal_xla_route(rng, t):
  """Both routings feed the GEMMs the same rows in the same order: outputs are identical."""
  from jmoe.kernels import _compat
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable")
  k, e, h, n = 2, 4, 64, 64
  x = _tokens(rng, t, h)
  w13 = jnp.asarray(rng.standard_normal((e, h, 2 * n)) / 8, jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((e, n, h)) / 8, jnp.bfloat16)
  tw, ti = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.standard_normal((t, e)))), k)
  ti = ti.at[0, 1].set(-1)
  cfg = gg.GroupedGemmConfig(block_m=64, block_n=64, block_k=32, num_stages=2,
                             warp_specialized=False)
  outs = {}
  for impl in ("kernels", "xla"):
    outs[impl] = np.asarray(pmoe.fused_experts(
        x, w13, w2, tw, ti, layout="sorted", route_impl=impl, config1=cfg, config2=cfg,
        interpret=_compat.interpret_params(detect_races=True)), np.float32)
    assert not _compat.races_found()
  np.testing.assert_array_equal(outs["kernels"], outs["xla"])
  ref = np.asarray(pmoe.fused_experts_reference(x, w13, w2, tw, ti), np.float32)
  assert np.linalg.norm(outs["kernels"] - ref) / np.linalg.norm(ref) < 2e-2
  with pytest.raises(ValueError, match="route_impl"):
    pmoe.fused_experts(x, w13, w2, tw, ti, layout="sorted", route_impl="sort")


def test_fused_experts_falls_back_to_jnp_routing(rng, monkeypatch, caplog):
  """Without the Triton lowering (deprecated in jax 0.11), "auto" routes in jnp and says so."""
  import logging
  from jmoe.kernels import _compat
  if not _compat.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable")
  route.available.cache_clear()
  monkeypatch.setattr(route, "available", lambda: False)
  called = []
  monkeypatch.setattr(route, "route", lambda *a, **k: called.append(1))
  t, k, e, h, n = 7, 2, 4, 64, 64  # shapes no other test traces (fused_experts is jitted)
  x = _tokens(rng, t, h)
  w13 = jnp.asarray(rng.standard_normal((e, h, 2 * n)) / 8, jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((e, n, h)) / 8, jnp.bfloat16)
  tw, ti = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.standard_normal((t, e)))), k)
  cfg = gg.GroupedGemmConfig(block_m=64, block_n=64, block_k=32, num_stages=2,
                             warp_specialized=False)
  with caplog.at_level(logging.DEBUG, logger="jmoe.kernels.moe"):
    out = pmoe.fused_experts(x, w13, w2, tw, ti, layout="sorted", config1=cfg, config2=cfg,
                             interpret=_compat.interpret_params(detect_races=True))
  assert not called
  assert "route_impl=xla" in caplog.text and "unavailable" in caplog.text
  ref = np.asarray(pmoe.fused_experts_reference(x, w13, w2, tw, ti), np.float32)
  assert np.linalg.norm(np.asarray(out, np.float32) - ref) / np.linalg.norm(ref) < 2e-2
