"""`python -m jmoe tune`: autotune the Pallas kernels' block configs for a preset on this GPU.

For each token count, routes random tokens with the preset's top-k, then times every candidate
config (jmoe.kernels.tuning) of GEMM1 (gated, activation fused), GEMM2 (router weight
fused) and the weight-gradient tgmm of both (with ``training``: also GEMM1 without the fused
activation and the backward's transposed-weight GEMMs), and writes the fastest into the JSON
tables the kernels read (`pallas_kernels/configs/<kernel>.json`, keyed by E, N, K, dtype,
device kind, jax minor version and M bucket). Device time comes from CUPTI (jmoe.timing); in
interpret mode (tests) from the wall clock, which says nothing about speed.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Callable, Collection, Optional, Sequence

import jax
import jax.numpy as jnp

from jmoe import timing


@dataclasses.dataclass
class TuneResult:
  kernel: str  # "grouped_gemm_gated" (GEMM1), "grouped_gemm" (GEMM2) or "tgmm" (weight grads)
  key: str
  config: dict
  us: float
  tried: int
  failed: int


def _device_time_us(fn: Callable, arg_sets: list, iters: int, interpret: bool) -> float:
  """Median device time over the rotated arg sets (interpret mode: one wall-clock run of the
  first, a smoke test, not a timing)."""
  if interpret:
    return timing.wall_time(fn, arg_sets[:1], iters=1)
  return timing.device_time(fn, arg_sets, iters=iters)[0]


def _pick(t: int, table: str, key: str, now, sweep: tuple, build: Callable, arg_sets: list, *,
          iters: int, interpret: bool, max_candidates: Optional[int], progress, report
          ) -> TuneResult:
  """Times the config in use (`now`) and the sweep's other candidates on arg_sets; returns the
  fastest as the table entry `key`. A candidate that does not fit the problem (shared memory,
  registers, layout) counts as failed; every one failing raises."""
  cands = (now,) + tuple(c for c in sweep if c != now)  # a tuned entry is often a candidate
  if max_candidates:
    cands = cands[:max_candidates]
  if progress is not None:  # the step count (num_candidates) counts the config in use + sweep
    for _ in range(min(len(sweep) + 1, max_candidates or len(sweep) + 1) - len(cands)):
      progress()
  best, failed = None, 0
  for cfg in cands:
    try:
      us = _device_time_us(build(cfg), arg_sets, iters, interpret)
      if best is None or us < best[1]:
        best = (cfg, us)
    except Exception:  # a candidate that does not fit this problem
      failed += 1
      us = None
    if report is not None:
      report(t, table, key, cfg, us)
    if progress is not None:
      progress()
  if best is None:
    raise RuntimeError(f"every candidate failed for {table} at T={t}")
  return TuneResult(table, key, best[0].to_json(), best[1], len(cands), failed)


def problems(training: bool) -> tuple[tuple[str, str], ...]:
  """(table, candidate set of jmoe.kernels.tuning.candidates) of each problem tune() times
  per token count, in order: GEMM1, GEMM2, the two weight gradients (+ with training: unfused
  GEMM1 and the two transposed-weight d lhs GEMMs)."""
  base = (("grouped_gemm_gated", "gemm1"), ("grouped_gemm", "gemm2"), ("tgmm", "tgmm"),
          ("tgmm", "tgmm"))
  train = (("grouped_gemm", "gemm2"), ("grouped_gemm_rt", "gemm2"), ("grouped_gemm_rt", "gemm2"))
  return base + (train if training else ())


def _selected(tables: Optional[Collection[str]], training: bool) -> list[bool]:
  known = {t for t, _ in problems(True)}
  if tables is not None and not set(tables) <= known:
    raise ValueError(f"tables={sorted(set(tables) - known)} are not tuned tables "
                     f"({sorted(known)})")
  return [tables is None or t in tables for t, _ in problems(training)]


def _candidates(gemm: str, num_experts: int, m: int) -> tuple:
  """jmoe.kernels.tuning's candidates for m routed slots over num_experts experts."""
  from jmoe.kernels import tuning  # noqa: PLC0415
  return tuning.candidates(gemm, m / max(1, min(num_experts, m)))


def num_candidates(num_experts: int, top_k: int, tokens: Sequence[int], *, training: bool,
                   max_candidates: Optional[int] = None,
                   tables: Optional[Collection[str]] = None) -> int:
  """tune()'s progress steps (for a progress bar): the configs it times, plus a step for the
  sweep candidate it skips where that is the config in use already."""
  sel = _selected(tables, training)
  counts = [len(_candidates(g, num_experts, t * top_k)) + 1  # + the config in use now
            for t in tokens for (_, g), on in zip(problems(training), sel) if on]
  return sum(min(c, max_candidates or c) for c in counts)


def tune(num_experts: int, top_k: int, hidden: int, intermediate: int, activation,
         tokens: Sequence[int], *, dtype=jnp.bfloat16, iters: int = 5, interpret: bool = False,
         max_candidates: Optional[int] = None, progress=None, seed: int = 0,
         training: bool = False, tables: Optional[Collection[str]] = None, draws: int = 3,
         report: Optional[Callable[[int, str, str, Any, Optional[float]], None]] = None,
         on_result: Optional[Callable[[TuneResult], None]] = None) -> list[TuneResult]:
  """Time the candidates of both GEMMs at each token count; return the best per kernel.

  training: also the GEMMs only the differentiable block runs (fused_experts_train): GEMM1
  without the fused activation ([M, 2N] out, table grouped_gemm) and both backward d lhs
  GEMMs, which read the weights transposed (table grouped_gemm_rt).
  tables: only the problems of these tables (None: all).
  report(tokens, table, key, config, µs or None when it failed): called for every candidate,
  the config in use now first (key: the table entry the problem's winner goes to).
  draws: random routings per token count; a candidate's time is its median over them in turn
  (interpret mode: draws are built, the first is run).
  on_result(result): called with each problem's winner as soon as it is known (a caller can
  save it before a later problem fails or the run is stopped).
  """
  from jmoe.kernels import grouped_gemm as gg  # noqa: PLC0415
  from jmoe.kernels import permute  # noqa: PLC0415
  from jmoe.kernels.tgmm import get_tgmm_config, tgmm  # noqa: PLC0415
  from jmoe.kernels.moe import routed_rows  # noqa: PLC0415

  sel = _selected(tables, training)  # (checks `tables` before anything is timed)
  ks = jax.random.split(jax.random.key(seed), 5)
  e, h, n = num_experts, hidden, intermediate
  w13 = (jax.random.normal(ks[0], (e, h, 2 * n), jnp.float32) / math.sqrt(h)).astype(dtype)
  w2 = (jax.random.normal(ks[1], (e, n, h), jnp.float32) / math.sqrt(n)).astype(dtype)
  device = "interpret" if interpret else jax.devices()[0].device_kind
  results = []
  def build_tgmm(cfg):
    return jax.jit(lambda a, b, g: tgmm(a, b, g, config=cfg, interpret=interpret))

  def build_plain(cfg, rt=False):
    return jax.jit(lambda a, g, w: gg.grouped_gemm(a, w, g, config=cfg, interpret=interpret,
                                                   transpose_rhs=rt))

  def problem_args(t: int, key) -> list[tuple]:
    """Each problem's arguments for one random routing of t tokens (problems() order)."""
    kd = jax.random.split(key, 4)
    x = jax.random.normal(kd[0], (t, h), jnp.float32).astype(dtype)
    logits = jax.random.normal(kd[1], (t, e), jnp.float32)
    tw, ids = jax.lax.top_k(jax.nn.softmax(logits), top_k)
    order, gs, _ = permute.moe_align(ids.astype(jnp.int32), e)
    xs = permute.permute_rows(x, order, top_k)
    hs = jax.random.normal(kd[2], (xs.shape[0], n), jnp.float32).astype(dtype)
    scale = permute.permute_weights(tw, order)
    d13 = jax.random.normal(kd[3], (xs.shape[0], 2 * n), jnp.float32).astype(dtype)
    # the weight gradients run on the training layout (experts padded to 8-row multiples,
    # jmoe.kernels.route.route_for_training): its rows and group sizes
    m = t * top_k
    m_t = gg.row_alloc(m + 7 * min(e, m), 128)
    xs_t, _, gs_t, _, _ = routed_rows(x, ids.astype(jnp.int32), e, m_t, (128,), "xla")
    hs_t = jax.random.normal(kd[2], (m_t, n), jnp.float32).astype(dtype)
    d13_t = jax.random.normal(kd[3], (m_t, 2 * n), jnp.float32).astype(dtype)
    args = [(xs, gs, w13), (hs, gs, w2, scale), (xs_t, d13_t, gs_t), (hs_t, xs_t, gs_t)]
    if training:
      args += [(xs, gs, w13), (d13, gs, w13), (xs, gs, w2)]
    return args

  for t in tokens:
    m = t * top_k
    # every candidate is timed over `draws` routings in turn: one draw's expert loads can
    # favour a tile shape (the waves its row tiles fill) that the next one does not
    per_draw = [problem_args(t, jax.random.fold_in(ks[2], d)) for d in range(max(1, draws))]
    todo = [  # (table, candidate set, output N, contraction K, build)
        ("grouped_gemm_gated", "gemm1", n, h,
         lambda cfg: jax.jit(lambda a, g, w: gg.grouped_gemm_gated(
             a, w, g, activation=activation, config=cfg, interpret=interpret))),
        ("grouped_gemm", "gemm2", h, n,
         lambda cfg: jax.jit(lambda a, g, w, s: gg.grouped_gemm(
             a, w, g, row_scale=s, config=cfg, interpret=interpret))),
        # weight gradients: dW13 = xs^T d(h13) [H, 2N], dW2 = a^T dy [N, H] (keyed K, N)
        ("tgmm", "tgmm", 2 * n, h, build_tgmm),
        ("tgmm", "tgmm", h, n, build_tgmm),
    ]
    if training:
      todo += [
          ("grouped_gemm", "gemm2", 2 * n, h, build_plain),
          # d x_sorted = d(h13) @ w13^T [M, H]; d a = dy @ w2^T [M, N]
          ("grouped_gemm_rt", "gemm2", h, 2 * n, lambda cfg: build_plain(cfg, rt=True)),
          ("grouped_gemm_rt", "gemm2", n, h, lambda cfg: build_plain(cfg, rt=True)),
      ]
    assert tuple(p[:2] for p in todo) == problems(training)
    for i, ((kernel, gemm, n_out, k_in, build), on) in enumerate(zip(todo, sel)):
      if not on:
        continue
      arg_sets = [args[i] for args in per_draw]
      # tgmm looks itself up by its rows
      m_rows = arg_sets[0][0].shape[0] if kernel == "tgmm" else m
      # the config in use now (tuned entry or heuristic) competes too: a run never writes a
      # config slower than the one it would replace
      now = (get_tgmm_config(m_rows, k_in, n_out, e, dtype) if kernel == "tgmm" else
             gg.get_config(kernel, m, n_out, k_in, e, dtype, gated=kernel.endswith("gated")))
      key = gg._tuned_key(e, n_out, k_in, dtype, device, gg._m_bucket(m_rows))
      results.append(_pick(t, kernel, key, now, _candidates(gemm, e, m), build, arg_sets,
                           iters=iters, interpret=interpret, max_candidates=max_candidates,
                           progress=progress, report=report))
      if on_result is not None:
        on_result(results[-1])
  return results


def write_tables(results: Sequence[TuneResult], out_dir: str, note: str, *,
                 keep_existing: bool = False) -> list[str]:
  """Merge results into <out_dir>/<kernel>.json (existing entries kept unless re-tuned; with
  keep_existing, kept even then: a tuning run only fills the keys the tables lack)."""
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for kernel in sorted({r.kernel for r in results}):
    path = os.path.join(out_dir, f"{kernel}.json")
    table = {}
    if os.path.exists(path):
      with open(path) as f:
        table = json.load(f)
    for r in results:
      if r.kernel == kernel and not (keep_existing and r.key in table):
        table[r.key] = dict(r.config, us=r.us, note=note)
    with open(path, "w") as f:
      json.dump(table, f, indent=1)
    written.append(path)
  return written


def default_config_dir() -> str:
  from jmoe.kernels import grouped_gemm as gg  # noqa: PLC0415
  return gg._CONFIG_DIR


def quant_problems(scheme: str) -> tuple[str, ...]:
  """The tables tune_quantized fills for a scheme, in order: the per-token schemes' GEMM1 and
  GEMM2 (the grouped-GEMM tables, keyed by the 8-bit dtype), fp8_block's block (GEMM1's
  BlockQ8Config; GEMM2 follows its form)."""
  from jmoe.config import QuantConfig  # noqa: PLC0415
  from jmoe.kernels import grouped_gemm_q8 as q8  # noqa: PLC0415
  from jmoe.kernels import grouped_gemm_wq_ws as wq_ws  # noqa: PLC0415
  quant = QuantConfig(scheme)
  if _weight_only_ws(quant):
    return wq_ws.TABLES
  if quant.act_dtype is None or jnp.dtype(quant.weight_dtype) not in q8.Q8_DTYPES:
    raise ValueError(f"--quant {scheme}: tuning covers the 8-bit W8A8 schemes the Pallas "
                     "kernels run (fp8_tensor, fp8_channel, fp8_block, int8) and the "
                     "weight-only ones' prefill GEMMs (w4a16, w8a16, mxfp4, nvfp4)")
  if quant.weight_scale == "block":
    return (q8.BLOCK_TABLE,)
  return ("grouped_gemm_gated", "grouped_gemm")


def _weight_only_ws(quant) -> bool:
  """Integer or e2m1 codes with bf16 tokens: the schemes whose prefill runs
  grouped_gemm_wq_ws."""
  from jmoe.kernels import grouped_gemm_wq_ws as wq_ws  # noqa: PLC0415
  return quant.act_dtype is None and quant.weight_dtype in wq_ws.CODE_DTYPES


def _quant_candidates(table: str, num_experts: int, m: int) -> tuple:
  from jmoe.kernels import grouped_gemm_ws as ws  # noqa: PLC0415
  from jmoe.kernels import tuning  # noqa: PLC0415
  if table.startswith("grouped_gemm_wq_ws"):
    return ws.candidates(table.endswith("gated"))
  if table.endswith("fp8_block"):
    return tuning.SWEEP_FP8_BLOCK
  return _candidates("gemm1" if table.endswith("gated") else "gemm2", num_experts, m)


def num_quant_candidates(num_experts: int, top_k: int, tokens: Sequence[int], scheme: str, *,
                         max_candidates: Optional[int] = None) -> int:
  """tune_quantized()'s progress steps: its candidates plus the config in use, per problem."""
  counts = [len(_quant_candidates(tb, num_experts, t * top_k)) + 1
            for t in tokens for tb in quant_problems(scheme)]
  return sum(min(c, max_candidates or c) for c in counts)


def tune_quantized(num_experts: int, top_k: int, hidden: int, intermediate: int, activation,
                   tokens: Sequence[int], scheme: str, *, iters: int = 5,
                   interpret: bool = False, max_candidates: Optional[int] = None,
                   progress=None, seed: int = 0, draws: int = 3,
                   report: Optional[Callable[[int, str, str, Any, Optional[float]], None]] = None,
                   on_result: Optional[Callable[[TuneResult], None]] = None
                   ) -> list[TuneResult]:
  """`python -m jmoe tune --quant SCHEME`: time the 8-bit kernels' candidate configs on
  quantized random weights and routings (arguments as tune()).

  Per-token schemes (fp8_tensor / fp8_channel / int8): GEMM1 (gated, activation fused) and
  GEMM2 separately with grouped_gemm_q8, winners into grouped_gemm_gated / grouped_gemm under
  the 8-bit dtype's key (what grouped_gemm_q8.q8_config reads). fp8_block: the whole block
  (fused_experts_quantized, sorted layout) per GEMM1 BlockQ8Config, GEMM2 following its form
  (it reads GEMM1's per-task scales), the winner into grouped_gemm_fp8_block (what
  block_config reads). 4-bit weight-only schemes (w4a16, mxfp4, nvfp4): the prefill GEMMs
  of grouped_gemm_wq_ws, GEMM1 and GEMM2, winners into grouped_gemm_wq_ws(_gated) under the
  format's label (`_tune_weight_only`). The config in use competes too, so a run never
  writes a slower one.
  """
  from jmoe.config import QuantConfig  # noqa: PLC0415
  from jmoe.kernels import grouped_gemm as gg  # noqa: PLC0415
  from jmoe.kernels import grouped_gemm_q8 as q8  # noqa: PLC0415
  from jmoe.kernels import moe as pmoe  # noqa: PLC0415
  from jmoe.kernels import permute  # noqa: PLC0415
  from jmoe.kernels.activations import as_activation  # noqa: PLC0415
  from jmoe.quant import quantize_activations, quantize_weights  # noqa: PLC0415

  tables = quant_problems(scheme)
  quant = QuantConfig(scheme)
  if quant.static_activations:  # the same GEMMs and tables as the per-token twin
    quant = quant.replace(act_scale="dynamic_token")
  act = as_activation(activation)
  e, h, n = num_experts, hidden, intermediate
  dt = jnp.dtype(quant.weight_dtype)
  ks = jax.random.split(jax.random.key(seed), 3)
  q13 = quantize_weights(jax.random.normal(ks[0], (e, h, 2 * n), jnp.float32) / math.sqrt(h),
                         quant)
  q2 = quantize_weights(jax.random.normal(ks[1], (e, n, h), jnp.float32) / math.sqrt(n), quant)
  device = "interpret" if interpret else jax.devices()[0].device_kind

  def draw(t: int, key):
    """One routing of t tokens: (block args, GEMM1 args, GEMM2 args)."""
    kd = jax.random.split(key, 3)
    x = jax.random.normal(kd[0], (t, h), jnp.float32)
    tw, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(kd[1], (t, e))), top_k)
    ids = ids.astype(jnp.int32)
    xq, xs = quantize_activations(x, quant)
    order, gs, _ = permute.moe_align(ids, e)
    tok = order // top_k
    rows, row_scale = jnp.take(xq, tok, axis=0), jnp.take(xs, tok, axis=0)
    hq, hs = quantize_activations(jax.random.normal(kd[2], (t * top_k, n), jnp.float32), quant)
    return ((xq, xs, q13, q2, tw, ids), (rows, gs, row_scale, q13.values, q13.scale),
            (hq, gs, hs, q2.values, q2.scale))

  def build(table, cfg):
    if table == q8.BLOCK_TABLE:
      return jax.jit(lambda xq, xs, w13, w2, tw, ids: pmoe.fused_experts_quantized(
          xq, xs, w13, w2, tw, ids, activation=act, config1=cfg, layout="sorted",
          interpret=interpret))
    gated = table.endswith("gated")
    return jax.jit(lambda a, g, s, v, ws: q8.grouped_gemm_q8(
        a, v, g, s, ws, activation=act if gated else None, config=cfg, interpret=interpret))

  if _weight_only_ws(quant):
    return _tune_weight_only(q13, q2, act, tokens, top_k, ks[2], tables, device, iters=iters,
                             interpret=interpret, max_candidates=max_candidates,
                             progress=progress, draws=draws, report=report,
                             on_result=on_result)
  results = []
  for t in tokens:
    m = t * top_k
    per_draw = [draw(t, jax.random.fold_in(ks[2], d)) for d in range(max(1, draws))]
    for table in tables:
      if table == q8.BLOCK_TABLE:
        i, n_out, k_in = 0, n, h
        now = q8.block_config(m, n, h, e, gated=act.is_gated, quantize_output=True)
      else:
        gated = table.endswith("gated")
        i, n_out, k_in = (1, n, h) if gated else (2, h, n)
        now = q8.q8_config(m, n_out, k_in, e, gated=gated, dtype=dt)
      sweep = _quant_candidates(table, e, m)
      if table != q8.BLOCK_TABLE:  # the 8-bit kernels run 128-deep K steps
        sweep = tuple(dict.fromkeys(dataclasses.replace(c, block_k=q8.BLOCK_K) for c in sweep))
      key = gg._tuned_key(e, n_out, k_in, dt, device, gg._m_bucket(m))
      results.append(_pick(t, table, key, now, sweep, functools.partial(build, table),
                           [args[i] for args in per_draw], iters=iters, interpret=interpret,
                           max_candidates=max_candidates, progress=progress, report=report))
      if on_result is not None:
        on_result(results[-1])
  return results


def _tune_weight_only(q13, q2, act, tokens: Sequence[int], top_k: int, key, tables, device, *,
                      iters: int, interpret: bool, max_candidates: Optional[int], progress,
                      draws: int, report, on_result) -> list[TuneResult]:
  """tune_quantized for 4-bit weight-only schemes: GEMM1 (gated) and GEMM2 of
  grouped_gemm_wq_ws on bf16 token rows sorted by random routings, each WSConfig candidate
  (`grouped_gemm_ws.candidates`) against the config in use; winners keyed by the format's
  label (what grouped_gemm_wq_ws.default_config reads)."""
  from jmoe.kernels import grouped_gemm as gg  # noqa: PLC0415
  from jmoe.kernels import grouped_gemm_wq_ws as wq_ws  # noqa: PLC0415
  from jmoe.kernels import permute  # noqa: PLC0415
  from jmoe.quant import prepare_for_kernels  # noqa: PLC0415
  e, h, n = q13.shape[0], q13.shape[1], q2.shape[1]
  q13, q2 = prepare_for_kernels(q13, q2, activation=act)  # (time the GEMMs, not the re-layout)

  def draw(t: int, k_):
    """GEMM1's and GEMM2's operands for one routing of t tokens."""
    kd = jax.random.split(k_, 3)
    x = jax.random.normal(kd[0], (t, h), jnp.float32).astype(jnp.bfloat16)
    ids = jax.lax.top_k(jax.random.normal(kd[1], (t, e)), top_k)[1].astype(jnp.int32)
    order, gs, _ = permute.moe_align(ids, e)
    rows = jnp.take(x, order // top_k, axis=0)
    mid = jax.random.normal(kd[2], (t * top_k, n), jnp.float32).astype(jnp.bfloat16)
    return (rows, q13, gs), (mid, q2, gs)

  def build(gated: bool, cfg):
    return jax.jit(lambda a, w, g: wq_ws.grouped_gemm_wq_ws(
        a, w, g, activation=act if gated else None, config=cfg, interpret=interpret))

  results = []
  for t in tokens:
    m = t * top_k
    per_draw = [draw(t, jax.random.fold_in(key, d)) for d in range(max(1, draws))]
    for i, table in enumerate(tables):
      gated = i == 0
      w, n_out, k_in = (q13, n, h) if gated else (q2, h, n)
      now = wq_ws.default_config(w, n_out, gated, jnp.bfloat16, m)
      tkey = gg._tuned_key(e, n_out, k_in, wq_ws.format_label(w), device, gg._m_bucket(m))
      results.append(_pick(t, table, tkey, now, _quant_candidates(table, e, m),
                           functools.partial(build, gated), [d[i] for d in per_draw],
                           iters=iters, interpret=interpret, max_candidates=max_candidates,
                           progress=progress, report=report))
      if on_result is not None:
        on_result(results[-1])
  return results
