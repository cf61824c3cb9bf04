"""What the torch bridge costs per call, and jmoe from torch against transformers' own experts.

For each model shape (transformers' Qwen3-MoE block: H=2048, 128 experts, top-8, N=768;
Mixtral 8x7B's: H=4096, 8 experts, top-2, N=14336), bf16, and each T (tokens per call):

  jax_fwd / jax_fwd_bwd       the jitted JAX function the bridge runs, called directly on the
                              JAX arrays (the baseline: no torch at all)
  bridge_fwd / bridge_fwd_bwd `JmoeHFBlock` (= `jmoe.interop.torch.from_hf(block)`) from torch,
                              forward under no_grad / forward + backward
  overhead                    bridge - jax, per call (targets: <= 20 us at T=1, <= 2 % at T=4096)
  hf_grouped_mm_fwd / _bwd    the transformers block with experts_implementation="grouped_mm"
  hf_jmoe_experts_fwd         the transformers block with experts_implementation="jmoe" (its
                              router in torch, the experts through the bridge)
  compiled_fwd                torch.compile(fullgraph=True) of the JmoeHFBlock (one opaque op)

Host wall time per call, each call followed by the same wait for JAX and the bridge
(`torch.cuda.synchronize()` on CUDA, which also waits for JAX's streams; on the CPU the JAX
baseline blocks on its output, the bridge's output is ready when torch holds it); median of
--iters; the JAX and bridge calls being compared run interleaved (one of each per round).
`jax_fwd_bur` is the baseline waited for with `block_until_ready` instead (JAX's own wait),
for reference. `*_host` rows: host time per call of 32 back-to-back calls and one wait
(what a pipelined model sees). Prints a table and writes JSON to --out. `--small` runs tiny shapes (a CPU smoke test). Each model's
rows are written as soon as they exist; `--budget-s` stops starting new measurements.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_torch_bridge.py --out r.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from typing import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU

import jax  # noqa: E402
import torch  # noqa: E402

MODELS = {  # name -> (module, config class, block class, config kwargs)
    "qwen3": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
              dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                   num_experts_per_tok=8, norm_topk_prob=True)),
    "mixtral": ("mixtral", "MixtralConfig", "MixtralSparseMoeBlock",
                dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                     num_experts_per_tok=2)),
}
SMALL = {"qwen3": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2),
         "mixtral": dict(hidden_size=64, intermediate_size=96, num_local_experts=4,
                         num_experts_per_tok=2)}


def timed(fn: Callable[[], object], sync: Callable[..., None], iters: int,
          warmup: int = 3, per: int = 1) -> dict:
  """Median / p10 / p90 host microseconds of fn() + sync(its result), divided by `per`."""
  out = interleaved({"fn": (fn, sync)}, iters, warmup)["fn"]
  return {k: v if k == "iters" else v / per for k, v in out.items()}


def interleaved(fns: dict[str, tuple[Callable[[], object], Callable[..., None]]], iters: int,
                warmup: int = 3) -> dict[str, dict]:
  """`timed` for several (fn, sync) at once, one call of each per round (so clock, thermal
  and host-load drift hit them alike): name -> median / p10 / p90 host microseconds."""
  ts: dict[str, list[float]] = {k: [] for k in fns}
  for r in range(warmup + iters):
    for k, (fn, sync) in fns.items():
      t0 = time.perf_counter()
      sync(fn())
      if r >= warmup:
        ts[k].append((time.perf_counter() - t0) * 1e6)
  out = {}
  for k, v in ts.items():
    v.sort()
    out[k] = dict(median_us=statistics.median(v), p10_us=v[len(v) // 10],
                  p90_us=v[(9 * len(v)) // 10], iters=iters)
  return out


def in_stream_mode(mode: str, fn: Callable[[], object]) -> Callable[[], object]:
  """fn run with the bridge's import ordering set to `mode` (tb.STREAM_MODE), then restored."""
  from jmoe.interop import torch_bridge as tb  # noqa: PLC0415

  def f():
    old, tb.STREAM_MODE = tb.STREAM_MODE, mode
    try:
      return fn()
    finally:
      tb.STREAM_MODE = old
  return f


def build_block(name: str, small: bool, dtype: torch.dtype, device: torch.device,
                experts_impl: str):
  """The transformers block at the model's shape, random N(0, 0.02) weights."""
  import importlib  # noqa: PLC0415
  mod_name, cfg_name, block_name, kw = MODELS[name]
  mod = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
  kw = {**kw, **(SMALL[name] if small else {})}
  cfg = getattr(mod, cfg_name)(**kw, num_attention_heads=16, num_key_value_heads=4)
  cfg._experts_implementation = experts_impl
  old = torch.get_default_dtype()
  torch.set_default_dtype(dtype)
  try:
    with torch.device(device):
      block = getattr(mod, block_name)(cfg).eval()
  finally:
    torch.set_default_dtype(old)
  g = torch.Generator(device).manual_seed(0)
  with torch.no_grad():
    for p in block.parameters():
      p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) * 0.02)
  return cfg, block


def measure_model(name: str, args, device: torch.device, sync, jsync, deadline: float):
  """Yields one row per T (so a run stopped midway keeps what it measured)."""
  from jmoe.interop import torch as jt  # noqa: PLC0415
  from jmoe.interop import torch_bridge as tb  # noqa: PLC0415

  dtype = getattr(torch, args.dtype)
  cfg, block = build_block(name, args.small, dtype, device, "grouped_mm")
  ours = jt.from_hf(block, cfg, runner_backend=args.backend)
  h = cfg.hidden_size
  for t in args.tokens:
    if time.time() > deadline:
      print(f"# budget spent: {name} T={t} not measured", flush=True)
      break
    iters = args.iters if t <= 64 else max(10, args.iters // 4)
    x = torch.randn(t, h, device=device, dtype=dtype)
    row = dict(model=name, T=t, H=h, dtype=args.dtype, backend=args.backend or "auto",
               device=str(device))
    # the baseline: the same jitted JAX functions on the same (cached, converted) arrays
    tensors = [x] + [getattr(ours.moe, a) for a in ours.moe._attrs]
    spec = tb.spec_of(ours.moe._op_key)
    jit = tb._jitted(spec)
    jargs = tb._convert(spec, tensors)
    with torch.no_grad():
      row.update(interleaved({
          "jax_fwd": (lambda: jit.forward(*jargs), jsync),
          "jax_fwd_bur": (lambda: jit.forward(*jargs).block_until_ready(), lambda _=None: None),
          "bridge_fwd": (lambda: ours(x), sync)}, iters))
      if t <= 64:
        row["jax_fwd_host"] = timed(lambda: [jit.forward(*jargs) for _ in range(32)], jsync,
                                    max(5, iters // 8), per=32)
        row["bridge_fwd_host"] = timed(lambda: [ours(x) for _ in range(32)], sync,
                                       max(5, iters // 8), per=32)
    row["overhead_fwd_us"] = row["bridge_fwd"]["median_us"] - row["jax_fwd"]["median_us"]
    row["overhead_fwd_pct"] = 100 * row["overhead_fwd_us"] / row["jax_fwd"]["median_us"]
    if "bridge_fwd_host" in row:
      row["overhead_fwd_host_us"] = (row["bridge_fwd_host"]["median_us"] -
                                     row["jax_fwd_host"]["median_us"])
    g = jax.numpy.ones_like(jargs[0])

    def jax_fwd_bwd():
      out, vjp_fn = jit.forward_vjp(*jargs)
      return jit.backward(vjp_fn, g)

    xr = x.clone().requires_grad_(True)
    gt = torch.ones_like(x)

    def bridge_fwd_bwd():
      ours.moe.zero_grad(set_to_none=True)
      ours(xr).backward(gt)

    row.update(interleaved({"jax_fwd_bwd": (jax_fwd_bwd, jsync),
                            "bridge_fwd_bwd": (bridge_fwd_bwd, sync)}, iters))
    row["overhead_fwd_bwd_us"] = (row["bridge_fwd_bwd"]["median_us"] -
                                  row["jax_fwd_bwd"]["median_us"])
    row["overhead_fwd_bwd_pct"] = 100 * row["overhead_fwd_bwd_us"] / \
        row["jax_fwd_bwd"]["median_us"]
    x3 = x.reshape(1, t, h)
    with torch.no_grad():
      row["hf_grouped_mm_fwd"] = timed(lambda: block(x3), sync, iters)
    x3r = x3.clone().requires_grad_(True)

    def hf_fwd_bwd():
      block.zero_grad(set_to_none=True)
      out = block(x3r)
      (out[0] if isinstance(out, tuple) else out).backward(torch.ones_like(x3r))

    row["hf_grouped_mm_fwd_bwd"] = timed(hf_fwd_bwd, sync, iters)
    cfg._experts_implementation = "jmoe"  # the same block, experts through jmoe
    with torch.no_grad():
      row["hf_jmoe_experts_fwd"] = timed(lambda: block(x3), sync, iters)
    cfg._experts_implementation = "grouped_mm"
    if args.compile:
      try:
        comp = torch.compile(ours, fullgraph=True)
        with torch.no_grad():
          row["compiled_fwd"] = timed(lambda: comp(x), sync, iters)
      except Exception as e:  # noqa: BLE001  (reported, not fatal)
        row["compiled_fwd"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    row["fast_dlpack"] = tb._FAST_DLPACK  # False: jaxlib's internals differed, public path
    print(_line(row), flush=True)
    yield row


def _bridged(name: str, args, device: torch.device):
  """(the bridge module for one model, its torch device index)."""
  from jmoe.interop import torch as jt  # noqa: PLC0415
  from jmoe.interop import torch_bridge as tb  # noqa: PLC0415

  cfg, block = build_block(name, args.small, getattr(torch, args.dtype), device, "grouped_mm")
  return jt.from_hf(block, cfg, runner_backend=args.backend), tb._index(
      torch.empty(0, device=device))


def _jax_call(ours, t: int, args, device: torch.device):
  """(x [t, H], its torch tensors in the spec's order, the jitted forward the bridge runs, its
  JAX arguments with x converted once)."""
  from jmoe.interop import torch_bridge as tb  # noqa: PLC0415

  x = torch.randn(t, ours.moe.config.hidden_size, device=device,
                  dtype=getattr(torch, args.dtype))
  tensors = [x] + [getattr(ours.moe, a) for a in ours.moe._attrs]
  spec = tb.spec_of(ours.moe._op_key)
  return x, tensors, tb._jitted(spec).forward, tb._convert(spec, tensors)


def breakdown(name: str, args, device: torch.device, sync, jsync) -> list[dict]:
  """Where the bridge's per-call time goes (forward-only): each piece timed on its own, and
  the import's ways of ordering streams side by side."""
  from jmoe.interop import torch_bridge as tb  # noqa: PLC0415

  ours, index = _bridged(name, args, device)
  fast = tb._fast()
  rows = []
  for t in args.tokens:
    x, tensors, fwd, jargs = _jax_call(ours, t, args, device)
    xj, ws = jargs[0], jargs[1:]
    others = [xj + 0 for _ in range(8)]  # JAX-made buffers, a different one each call
    out = fwd(*jargs).block_until_ready()
    it = iter(range(10**9))

    def import_without_stream():  # no stream ordering: for this measurement only (synced)
      extra = (1 if index < 0 else fast.gpu_dl,) if fast.new_sig else ()
      return fast.to_buffer(torch._C._to_dlpack(x), fast.device(index), None, False, *extra)

    def import_old():  # torch's __dlpack__ handshake (new ExternalStream + Event a call)
      d = fast.device(index)
      stream = None if index < 0 else d.get_stream_for_external_ready_events()
      extra = (1 if index < 0 else fast.gpu_dl,) if fast.new_sig else ()
      return fast.to_buffer(x.__dlpack__(stream=stream), d, stream, False, *extra)

    none = lambda _=None: None  # noqa: E731
    imports = {"public": lambda: jax.dlpack.from_dlpack(x), "old": import_old,
               "handshake": in_stream_mode("handshake", lambda: tb.to_jax(x)),
               "no_stream": import_without_stream}
    kept = collections.deque(maxlen=8)  # imported arrays outliving their call by 8 calls

    def keep(a):
      kept.append(a)
      return a

    pieces = {
        "jax_cached_x": (lambda: fwd(xj, *ws), jsync),
        "jax_cached_x_bur": (lambda: fwd(xj, *ws).block_until_ready(), none),
        "jax_other_jax_x": (lambda: fwd(others[next(it) % 8], *ws), jsync),
        **{f"jax_import_{k}_x": ((lambda f=f: fwd(f(), *ws)), jsync) for k, f in imports.items()},
        **{f"import_{k}_alone": (f, none) for k, f in imports.items()},
        # the imported array freed right after the call (as the bridge does) or 8 calls later
        "jax_import_handshake_x_kept": (lambda: fwd(keep(imports["handshake"]()), *ws),
                                        jsync),
        "jax_import_no_stream_x_kept": (lambda: fwd(keep(import_without_stream()), *ws), jsync),
        "jax_cached_x_to_torch": (lambda: tb._to_torch(fwd(xj, *ws), index), sync),
        "jax_cached_x_to_torch_public": (lambda: torch.from_dlpack(fwd(xj, *ws)), sync),
        "to_torch_alone": (lambda: tb._to_torch(out, index), none),
        "to_torch_public_alone": (lambda: torch.from_dlpack(out), none),
        "jax_dispatch_alone": (lambda: fwd(xj, *ws), none),
        "convert_weights_alone": (lambda: [tb.CACHE.get(w) for w in tensors[1:]], none),
        "bridge": (lambda: ours(x), sync),
        "bridge_public": (in_stream_mode("public", lambda: ours(x)), sync),
        "bridge_moe_module": (lambda: ours.moe(x), sync),
        "bridge_host_only": (lambda: ours(x), none),
    }
    row = dict(model=name, T=t, fast_dlpack=tb._FAST_DLPACK, stream_mode=tb.STREAM_MODE)
    with torch.no_grad():
      for k, (fn, sy) in pieces.items():
        try:
          row[k] = timed(fn, sy, args.iters)["median_us"]
        except Exception as e:  # noqa: BLE001  (a variant this jaxlib refuses: reported)
          row[k] = f"{type(e).__name__}: {str(e)[:200]}"
        sync()
      # the bridge's own host work: the JAX call replaced by returning its input array
      key = ours.moe._op_key
      real = tb._resolve(key)
      tb._RESOLVED[key] = (real[0], type("Stub", (), {"forward": staticmethod(lambda x_, *w: x_)}))
      try:
        row["bridge_host_work_jax_stubbed"] = timed(lambda: ours(x), sync, args.iters)["median_us"]
      finally:
        tb._RESOLVED[key] = real
    row["stream_mode_after"] = tb.STREAM_MODE
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def timeline(name: str, args, device: torch.device, sync, jsync) -> list[dict]:
  """Interleaved (one call of each variant per round, so clock and thermal drift hit all
  alike): the JAX call (on the same arrays every round; `jax_fwd_fresh_spin`: on an input
  used once, as a JAX model's layer gets), the bridge, and the bridge's steps done by hand
  with host timestamps between them (import, JAX call, export, release of the imported
  input, wait), to show where a bridged call holds the host. Medians over --iters rounds,
  microseconds."""
  from jmoe.interop import torch_bridge as tb  # noqa: PLC0415

  ours, index = _bridged(name, args, device)
  rows = []
  for t in args.tokens:
    x, _, fwd, jargs = _jax_call(ours, t, args, device)
    ws = jargs[1:]
    held: list = []
    clock = time.perf_counter

    def by_hand(keep: bool) -> dict:
      t0 = clock()
      a = tb.to_jax(x)
      t1 = clock()
      out = fwd(a, *ws)
      t2 = clock()
      y = tb._to_torch(out, index)
      t3 = clock()
      if keep:
        held.append(a)
      del a, out
      t4 = clock()
      sync(y)
      t5 = clock()
      if len(held) > 4:
        held.pop(0)
      return dict(import_=t1 - t0, call=t2 - t1, export=t3 - t2, release=t4 - t3,
                  wait=t5 - t4, total=t5 - t0)

    def whole(fn, sy) -> float:
      t0 = clock()
      sy(fn())
      return clock() - t0

    def spin_jax(out):  # a busy wait (no sleeping host thread: no wake-up latency)
      while not out.is_ready():
        pass

    def spin_torch(y):  # torch's stream waits for JAX (export), so its idling means done
      stream = torch.cuda.current_stream() if y.is_cuda else None
      while stream is not None and not stream.query():
        pass

    rounds = args.iters if t <= 64 else max(20, args.iters // 3)
    # a JAX model's input is a new array every call (the previous layer's output), as the
    # bridge's import is: the baseline on arrays used once each, made before the rounds
    fresh = iter(jax.block_until_ready([jax.numpy.copy(jargs[0]) for _ in range(rounds + 3)]))
    variants = {
        "jax_fwd": lambda: whole(lambda: fwd(*jargs), jsync),
        "jax_fwd_fresh_spin": lambda: whole(lambda: fwd(next(fresh), *ws), spin_jax),
        "jax_fwd_spin": lambda: whole(lambda: fwd(*jargs), spin_jax),
        "bridge_spin": lambda: whole(lambda: ours(x), spin_torch),
        "bridge_public_spin": in_stream_mode("public",
                                             lambda: whole(lambda: ours(x), spin_torch)),
        "jax_fwd_bur": lambda: whole(lambda: fwd(*jargs).block_until_ready(), lambda _=None: None),
        "bridge": lambda: whole(lambda: ours(x), sync),
        "by_hand": lambda: by_hand(False),
        "by_hand_input_held": lambda: by_hand(True),
    }
    samples: dict = {k: [] for k in variants}
    with torch.no_grad():
      for r in range(rounds + 3):
        for k, f in variants.items():
          v = f()
          if r >= 3:
            samples[k].append(v)
    row = dict(model=name, T=t, rounds=rounds)
    for k, vs in samples.items():
      if isinstance(vs[0], dict):
        row[k] = {p: statistics.median(v[p] for v in vs) * 1e6 for p in vs[0]}
      else:
        row[k] = statistics.median(vs) * 1e6
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def capture(name: str, args, device: torch.device) -> dict:
  """Whether a bridged call can be captured into a torch CUDA graph (and replayed)."""
  from jmoe.interop import torch as jt  # noqa: PLC0415

  dtype = getattr(torch, args.dtype)
  cfg, block = build_block(name, args.small, dtype, device, "grouped_mm")
  ours = jt.from_hf(block, cfg, runner_backend=args.backend)
  x = torch.randn(1, cfg.hidden_size, device=device, dtype=dtype)
  res: dict = dict(model=name)
  with torch.no_grad():
    want = ours(x).clone()
    torch.cuda.synchronize()
    for label, fn in (("eager", ours), ("compiled", torch.compile(ours, fullgraph=True))):
      fn(x)  # warm (compiles)
      torch.cuda.synchronize()
      g = torch.cuda.CUDAGraph()
      try:
        with torch.cuda.graph(g):
          y = fn(x)
        g.replay()
        torch.cuda.synchronize()
        res[label] = dict(captured=True, max_err=float((y - want).abs().max()))
      except Exception as e:  # noqa: BLE001  (the point: what fails, and how)
        res[label] = dict(captured=False, error=f"{type(e).__name__}: {str(e)[:600]}")
      torch.cuda.synchronize()
  print("# capture", json.dumps(res), flush=True)
  return res


PROBES = ("import_handshake", "export_fast")


def probe_one(name: str, iters: int = 300) -> dict:
  """One DLPack variant on CUDA, alone (run in its own process: a variant this jaxlib
  mishandles may crash it): 300 crossings, values checked, median host us per crossing."""
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jmoe.interop import torch_bridge as tb  # noqa: PLC0415

  dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke test of this code
  index = 0 if dev == "cuda" else -1
  x = torch.randn(64, 128, device=dev)
  res: dict = dict(name=name)
  if name.startswith("import_"):
    tb.STREAM_MODE = name.removeprefix("import_")
    fn = lambda: tb.to_jax(x)  # noqa: E731
    check = lambda a: np.testing.assert_array_equal(np.asarray(a), x.cpu().numpy())  # noqa: E731
  else:
    a = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128)
    fn = lambda: tb._to_torch(a + 0, index)  # noqa: E731  a fresh output each call, as the bridge's
    check = lambda t: np.testing.assert_array_equal(t.cpu().numpy(), np.asarray(a))  # noqa: E731
  for _ in range(3):
    check(fn())
  res["median_us"] = timed(fn, lambda _=None: None, iters)["median_us"]
  import gc  # noqa: PLC0415
  gc.collect()
  if dev == "cuda":
    torch.cuda.synchronize()
  res.update(ok=True, stream_mode_after=tb.STREAM_MODE, fast_dlpack=tb._FAST_DLPACK,
             refused=len(tb._REFUSED))
  return res


def probe(out: str | None) -> int:
  """PROBES in order in one child process (a variant this jaxlib mishandles may crash it:
  those before it have reported); prints the shell exports picking the fastest variants that
  ran clean (`eval $(... --probe)`), the details to stderr."""
  import subprocess  # noqa: PLC0415
  code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import bench_torch_bridge as b\n"
          f"for n in {PROBES!r}:\n print('PROBE', json.dumps(b.probe_one(n)), flush=True)")
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150)
  results = [json.loads(ln[6:]) for ln in p.stdout.splitlines() if ln.startswith("PROBE ")]
  done = {r["name"] for r in results}
  for name in PROBES:
    if name not in done:  # the first missing one crashed (or raised); the rest did not run
      results.append(dict(name=name, ok=False, rc=p.returncode,
                          tail=(p.stdout + p.stderr)[-1500:]))
      break
  for r in results:
    print("#", json.dumps(r), file=sys.stderr, flush=True)
  ok = {r["name"]: r for r in results if r.get("ok") and not r.get("refused")}
  mode = "handshake" if "import_handshake" in ok else "public"
  export = "fast" if "export_fast" in ok else "public"
  print(f"export JMOE_TORCH_BRIDGE_STREAM={mode} JMOE_TORCH_BRIDGE_EXPORT={export}")
  if out:
    with open(out, "w") as f:
      json.dump(dict(probes=results, stream_mode=mode, export=export), f, indent=1)
  return 0


def _us(row: dict, k: str) -> str:
  v = row.get(k, {})
  return f"{v['median_us']:10.1f}" if "median_us" in v else f"{'-':>10}"


HEAD = (f"{'model':8} {'T':>5} {'jax_fwd':>10} {'bridge':>10} {'+us':>7} {'+%':>6} "
        f"{'jax_f+b':>10} {'bridge_f+b':>10} {'+us':>7} {'+%':>6} {'hf_gmm':>10} "
        f"{'hf_gmm_f+b':>10} {'hf+jmoe_ex':>10} {'compiled':>10}")


def _line(r: dict) -> str:
  return (f"{r['model']:8} {r['T']:5d} {_us(r, 'jax_fwd')} {_us(r, 'bridge_fwd')} "
          f"{r['overhead_fwd_us']:7.1f} {r['overhead_fwd_pct']:6.2f} {_us(r, 'jax_fwd_bwd')} "
          f"{_us(r, 'bridge_fwd_bwd')} {r['overhead_fwd_bwd_us']:7.1f} "
          f"{r['overhead_fwd_bwd_pct']:6.2f} {_us(r, 'hf_grouped_mm_fwd')} "
          f"{_us(r, 'hf_grouped_mm_fwd_bwd')} {_us(r, 'hf_jmoe_experts_fwd')} "
          f"{_us(r, 'compiled_fwd')}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", default="qwen3,mixtral")
  p.add_argument("--tokens", default="1,4096", type=lambda s: [int(v) for v in s.split(",")])
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  p.add_argument("--backend", default=None, help="jmoe runner_backend (default: the oracle's)")
  p.add_argument("--iters", type=int, default=100)
  p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
  p.add_argument("--compile", action="store_true", help="also time torch.compile(fullgraph)")
  p.add_argument("--budget-s", type=float, default=1e9, help="start no measurement after this")
  p.add_argument("--breakdown", action="store_true",
                 help="time the bridge's pieces (forward-only) instead of the table")
  p.add_argument("--probe", action="store_true",
                 help="CUDA: try the fast DLPack paths in a child process, print the exports")
  p.add_argument("--timeline", action="store_true",
                 help="interleaved rounds: JAX call, bridge, the bridge's steps timed by hand")
  p.add_argument("--capture", action="store_true",
                 help="try capturing a call (eager, compiled) into a torch CUDA graph")
  p.add_argument("--out", default=None, help="JSON file")
  args = p.parse_args(argv)
  if args.probe:
    return probe(args.out)
  models = [m for m in args.models.split(",") if m]
  for m in models:
    if m not in MODELS:
      p.error(f"--models: {m!r} is not one of {', '.join(MODELS)}")
  device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  if device.type == "cuda":
    sync = jsync = lambda _=None: torch.cuda.synchronize()  # noqa: E731  all streams, JAX's too
  else:  # torch holds the bridge's output only once it is computed; JAX's: block on it
    sync, jsync = (lambda _=None: None), jax.block_until_ready
  deadline = time.time() + args.budget_s
  meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              jax=jax.__version__, torch=torch.__version__, jax_devices=str(jax.devices()))
  try:
    import transformers  # noqa: PLC0415
    meta["transformers"] = transformers.__version__
  except ImportError:
    print("transformers is needed", file=sys.stderr)
    return 2
  print("#", json.dumps(meta), flush=True)
  if args.breakdown or args.capture or args.timeline:
    res: dict = dict(meta=meta)
    if args.breakdown:
      res["breakdown"] = [r for m in models for r in breakdown(m, args, device, sync, jsync)]
    if args.timeline:
      res["timeline"] = [r for m in models for r in timeline(m, args, device, sync, jsync)]
    if args.capture and device.type == "cuda":
      res["capture"] = [capture(m, args, device) for m in models]
    if args.out:
      with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0
  print(HEAD, flush=True)
  rows = []
  for m in models:
    if time.time() > deadline:
      print(f"# budget spent: {m} not measured", flush=True)
      break
    for row in measure_model(m, args, device, sync, jsync, deadline):
      rows.append(row)
      if args.out:
        with open(args.out, "w") as f:
          json.dump(dict(meta=meta, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
