"""GPU benchmark of the reference model's training step: `jmoe.models.MoETransformer` at a real
MoE's layer shapes, one jitted step (forward + backward + optax AdamW update, the model and
optimizer state donated), `runner_backend="pallas_mosaic"` against `runner_backend="xla"` on the
same initial weights and the same token batches.

Run on the H200 (device tool):
  PYTHONPATH=$PWD python3 benchmarks/bench_train_step.py --configs qwen3,mixtral \
      --backends pallas_mosaic,xla --out $OUT/train

Configs (bf16 compute, f32 parameters and AdamW moments, vocab 32000, seq 2048):
  qwen3    Qwen3-30B-A3B-like layers: hidden 2048, 128 experts top-8 (renormalized softmax),
           expert intermediate 768, 16 heads / 4 kv heads (head_dim 128), q/k norm
  mixtral  Mixtral-8x7B-like layers: hidden 4096, 8 experts top-2, intermediate 14336,
           32 heads / 8 kv heads
  (--layers, default 2; --batch sequences per step, default 4: 8192 tokens)

The xla backend's `ragged_dot` computes every expert on every routed row, so its temporaries
grow with tokens x experts: on one H200 (2026-12-01) it ran out of memory at the default 8192
tokens for both configs, and at --batch 1 (2048 tokens) for qwen3 (a 72.30 GiB allocation at
run time, after a pallas_mosaic run in the same process); mixtral at --batch 1 was not reached.
At --batch 1 --seq 1024 with xla first in --plan (a fresh allocator) both configs fit on both
backends (51.3 GiB peak in use).

Per config x backend: a fresh state from the same seed; step 0 compiles (its wall time is
reported as compile_s); steps 0..3 give the losses compared across backends (step 0 = the
initial weights, step 3 = after three AdamW updates; |a - b| / |b| <= 1e-2 passes); then
--steps timed steps over --rotate pre-transferred batches. Device time = the CUPTI sum of every
kernel one step launches (the method of `jmoe.timing.device_time`; that helper re-calls its
function on the same arguments for a warm-up, which a donated state forbids, so each step is
measured here through the same CUPTI extension of jax's Mosaic GPU profiler), median over the
timed steps; wall ms = blocked host time per step, median. The data: Zipf(1.2)-distributed
token ids over a fixed random permutation of the vocabulary (fresh tokens every batch), so the
loss moves in three steps and the comparison checks more than ln(vocab).

MFU = model FLOPs per token x tokens / device time / peak, FLOPs per token = 6 x active params
(attention projections, router, top-k experts' w13 + w2, dense FFNs, lm_head; not the input
embedding, a gather) + 12 x layers x seq x (heads x head_dim) (attention scores and values,
not halved for causality, which the reference attention does not skip either); peak =
--peak-tflops (839: the H200 bf16 dense ceiling measured on these machines). The same run also
measures a bf16 8192^3 matmul (`ceiling_tflops` in the JSON).

Note: the reference attention is the plain einsum form in float32 (scores materialized); it is
the same for both backends. Writes <out>/train_step.json after every run (a timeout keeps what
finished). Exit status 1 if a loss comparison failed.

--tiny runs a tiny config on the CPU in seconds (wall time instead of device time; XLA
backends unless --interpret, which sets JMOE_PALLAS_INTERPRET=1 for the Pallas path): a smoke
test of this script, not a measurement.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {
    "qwen3": dict(hidden=2048, experts=128, top_k=8, inter=768, heads=16, kv_heads=4,
                  qk_norm=True, vocab=32000, seq=2048, rope_theta=1e6),
    "mixtral": dict(hidden=4096, experts=8, top_k=2, inter=14336, heads=32, kv_heads=8,
                    qk_norm=False, vocab=32000, seq=2048, rope_theta=1e6),
    "tiny": dict(hidden=64, experts=4, top_k=2, inter=64, heads=2, kv_heads=1, qk_norm=False,
                 vocab=128, seq=16, rope_theta=1e4),
}
CHECK_STEPS = 4  # steps 0..3: losses compared across backends (step 0 compiles)
REL_TOL = 1e-2


def log(*a):
  print(*a, flush=True)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--configs", default="qwen3,mixtral")
  ap.add_argument("--backends", default="pallas_mosaic,xla")
  ap.add_argument("--plan", default=None,
                  help="config:backend,... in this order (default: configs x backends)")
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--batch", type=int, default=4, help="sequences per step")
  ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (config's)")
  ap.add_argument("--steps", type=int, default=10, help="timed steps (after the 4 checked)")
  ap.add_argument("--rotate", type=int, default=4, help="distinct token batches on device")
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--aux-coef", type=float, default=0.01)
  ap.add_argument("--z-coef", type=float, default=1e-3)
  ap.add_argument("--peak-tflops", type=float, default=839.0)
  ap.add_argument("--budget-s", type=float, default=None,
                  help="start no new config x backend run after this many seconds")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=None, help="directory for train_step.json")
  ap.add_argument("--tiny", action="store_true",
                  help="the tiny config on the CPU, wall time (a smoke test)")
  ap.add_argument("--interpret", action="store_true",
                  help="with --tiny: JMOE_PALLAS_INTERPRET=1 (the Pallas path in the "
                       "interpreter)")
  args = ap.parse_args(argv)
  if args.tiny:
    args.configs = "tiny"
    if args.backends == "pallas_mosaic,xla" and not args.interpret:
      args.backends = "xla,xla_batched"
  if args.interpret:
    os.environ["JMOE_PALLAS_INTERPRET"] = "1"
  if args.steps < 1 or args.rotate < 1 or args.layers < 1 or args.batch < 1:
    ap.error("--steps, --rotate, --layers and --batch must be >= 1")
  return args


def model_config(name: str, layers: int):
  from jmoe.config import MoEConfig  # noqa: PLC0415
  from jmoe.models import TransformerConfig  # noqa: PLC0415
  c = CONFIGS[name]
  moe = MoEConfig(num_experts=c["experts"], top_k=c["top_k"], hidden_size=c["hidden"],
                  intermediate_size=c["inter"])
  return TransformerConfig(vocab_size=c["vocab"], num_layers=layers, hidden_size=c["hidden"],
                           num_heads=c["heads"], num_kv_heads=c["kv_heads"], moe=moe,
                           qk_norm=c["qk_norm"], rope_theta=c["rope_theta"])


def flops_per_token(cfg, seq: int) -> tuple[float, int]:
  """(model FLOPs per token of one training step, active params per token)."""
  d, hd, m = cfg.hidden_size, cfg.dim_per_head, cfg.moe
  attn = d * cfg.num_heads * hd * 2 + d * cfg.num_kv_heads * hd * 2  # q, o; k, v
  moe = d * m.num_experts + m.top_k * (d * m.w13_out + m.intermediate_size * d)
  if m.num_shared_experts:
    moe += d * 2 * m.shared_size + m.shared_size * d
  dense = 3 * d * cfg.dense_size
  active = (cfg.num_layers * attn + cfg.num_moe_layers * moe
            + cfg.first_dense_layers * dense + d * cfg.vocab_size)
  return 6.0 * active + 12.0 * cfg.num_layers * seq * cfg.num_heads * hd, int(active)


def token_batches(vocab: int, batch: int, seq: int, n: int, seed: int):
  """n host batches [batch, seq + 1] int32: Zipf(1.2) ranks over a fixed permutation."""
  import numpy as np  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  perm = rng.permutation(vocab)
  out = []
  for _ in range(n):
    ranks = np.minimum(rng.zipf(1.2, size=(batch, seq + 1)) - 1, vocab - 1)
    out.append(perm[ranks].astype(np.int32))
  return out


def cupti_ext():
  """The CUPTI extension behind jax.experimental.mosaic.gpu.profiler.measure, or None."""
  try:
    from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415
    ext = profiler.mosaic_gpu_lib._mosaic_gpu_ext
    return ext if hasattr(ext, "_cupti_init") and hasattr(ext, "_cupti_get_timings") else None
  except Exception:  # noqa: BLE001 (no Mosaic GPU here)
    return None


def cupti_step_us(ext, call):
  """(out, µs): the CUPTI sum of the kernels `call()` launches (measure's method, without its
  warm-up re-call on the same arguments)."""
  import jax  # noqa: PLC0415
  ext._cupti_init()
  try:
    out = jax.block_until_ready(call())
  finally:
    try:
      timings = ext._cupti_get_timings(True)
    except TypeError:  # older signature
      timings = ext._cupti_get_timings()
  if not timings:
    return out, float("nan")
  return out, sum(t for _, t in timings) * 1e3


def dense_ceiling_tflops(n: int = 8192) -> float:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jmoe import timing  # noqa: PLC0415
  k = jax.random.key(1)
  sets = [tuple(jax.random.normal(jax.random.fold_in(k, i), (n, n), jnp.bfloat16)
                for _ in range(2)) for i in range(2)]
  us = timing.device_time(jax.jit(jnp.matmul), sets, iters=3)[0]
  del sets
  return 2.0 * n ** 3 / (us * 1e-6) / 1e12


def build_step(cfg, backend: str, args):
  """(graphdef, state on device, jitted donated step(state, tokens) -> (state, metrics))."""
  import functools  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from jmoe.models import MoETransformer  # noqa: PLC0415

  def make():
    model = MoETransformer(cfg, rngs=nnx.Rngs(args.seed), dtype=jnp.bfloat16,
                           param_dtype=jnp.float32, runner_backend=backend)
    tx = optax.adamw(args.lr, b1=0.9, b2=0.95, weight_decay=0.1)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  if jax.devices()[0].platform == "cpu":  # tiny: eager is faster than tracing twice
    graphdef, state = nnx.split(make())
  else:
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    state = jax.jit(lambda: nnx.split(make())[1])()

  def loss_fn(model, tokens):
    logits, aux = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    total = ce + args.aux_coef * aux["load_balancing_loss"] \
        + args.z_coef * aux["router_z_loss"]
    return total, (ce, aux)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    grads, (ce, aux) = nnx.grad(loss_fn, has_aux=True)(model, tokens)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), dict(loss=ce, aux=aux["load_balancing_loss"])

  return state, step


def run_one(name: str, cfg, backend: str, batches, args, on_gpu: bool) -> dict:
  import jax  # noqa: PLC0415
  tokens_per_step = args.batch * args.seq_used
  fpt, active = flops_per_token(cfg, args.seq_used)
  rec = dict(config=name, backend=backend, tokens_per_step=tokens_per_step,
             active_params=active, flops_per_token=fpt)
  state = step = None
  try:
    t0 = time.perf_counter()
    state, step = build_step(cfg, backend, args)
    jax.block_until_ready(state)
    rec["init_s"] = round(time.perf_counter() - t0, 2)
    # params + the two AdamW moments (+ the step count)
    rec["state_elements"] = int(sum(math.prod(x.shape) for x in jax.tree.leaves(state)))
    losses = []
    for i in range(CHECK_STEPS):
      t0 = time.perf_counter()
      state, m = step(state, batches[i % len(batches)])
      losses.append(float(m["loss"]))
      if i == 0:
        rec["compile_s"] = round(time.perf_counter() - t0, 2)
    rec["losses"] = losses
    dev_us, wall_us, timed_losses = [], [], []
    ext = cupti_ext() if on_gpu else None
    if on_gpu and ext is None:
      rec["cupti_error"] = "CUPTI extension not found: wall time"
    for i in range(args.steps):
      tok = batches[(CHECK_STEPS + i) % len(batches)]
      t0 = time.perf_counter()
      if ext is not None:
        (state, m), us = cupti_step_us(ext, lambda: step(state, tok))  # noqa: B023
        dev_us.append(us)
      else:
        state, m = jax.block_until_ready(step(state, tok))
      wall_us.append((time.perf_counter() - t0) * 1e6)
      timed_losses.append(m["loss"])  # read after the loop: no extra wait inside it
    rec["timed_losses"] = [round(float(v), 4) for v in timed_losses]
    rec["final_loss"] = float(m["loss"])
    rec["wall_ms"] = statistics.median(wall_us) / 1e3
    rec["device_ms"] = statistics.median(dev_us) / 1e3 if dev_us else None
    rec["device_ms_all"] = [round(u / 1e3, 3) for u in dev_us]
    t_ms = rec["device_ms"] if rec["device_ms"] is not None else rec["wall_ms"]
    rec["timed_by"] = "cupti" if rec["device_ms"] is not None else "wall"
    rec["tokens_per_s"] = tokens_per_step / (t_ms / 1e3)
    rec["tflops"] = fpt * tokens_per_step / (t_ms / 1e3) / 1e12
    rec["mfu"] = rec["tflops"] / args.peak_tflops
    try:
      stats = jax.devices()[0].memory_stats() or {}
      rec["peak_gib"] = round(stats.get("peak_bytes_in_use", 0) / 2 ** 30, 1)
    except Exception:  # noqa: BLE001 (CPU has none)
      pass
    log(f"{name:8s} {backend:14s} step {t_ms:9.2f} ms ({rec['timed_by']}; wall "
        f"{rec['wall_ms']:.2f})  {rec['tokens_per_s']:10.0f} tok/s  MFU "
        f"{100 * rec['mfu']:5.1f} %  compile {rec['compile_s']} s  losses "
        + " ".join(f"{x:.4f}" for x in losses))
  except Exception as exc:  # noqa: BLE001 (a backend that cannot run is a finding)
    rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    log(f"{name} {backend}: ERROR {rec['error']}")
    traceback.print_exc()
  finally:
    del state, step
    gc.collect()
  return rec


def agreement(runs: list) -> dict:
  ok = [r for r in runs if "losses" in r]
  if len(ok) < 2:
    return dict(checked=False, why="fewer than two backends ran")
  a, b = ok[0], ok[1]
  rel = [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a["losses"], b["losses"])]
  return dict(checked=True, pair=[a["backend"], b["backend"]], rel_step0=rel[0],
              rel_step3=rel[CHECK_STEPS - 1], rel_max=max(rel),
              ok=bool(rel[0] <= REL_TOL and rel[CHECK_STEPS - 1] <= REL_TOL))


def main(argv=None) -> int:
  args = parse_args(argv)
  t_start = time.perf_counter()
  import jax  # noqa: PLC0415
  on_gpu = jax.devices()[0].platform == "gpu"
  device = jax.devices()[0].device_kind
  log(f"jax {jax.__version__}, {device}")
  result = dict(jax=jax.__version__, device=device, peak_tflops=args.peak_tflops,
                layers=args.layers, batch=args.batch, lr=args.lr, configs={}, runs=[],
                agreement={})
  if on_gpu:
    try:
      result["ceiling_tflops"] = dense_ceiling_tflops()
      log(f"bf16 8192^3 matmul: {result['ceiling_tflops']:.0f} TFLOP/s")
    except Exception as exc:  # noqa: BLE001
      result["ceiling_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"

  def write():
    if args.out:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, "train_step.json"), "w") as fh:
        json.dump(result, fh, indent=1)

  plan = ([tuple(p.split(":")) for p in args.plan.split(",")] if args.plan else
          [(c, b) for c in args.configs.split(",") for b in args.backends.split(",")])
  cfgs, batches = {}, {}
  for name, backend in plan:
    if name not in cfgs:
      cfg = cfgs[name] = model_config(name, args.layers)
      seq = args.seq or CONFIGS[name]["seq"]
      result["configs"][name] = dict(CONFIGS[name], layers=args.layers, batch=args.batch,
                                     seq=seq, head_dim=cfg.dim_per_head)
      host = token_batches(cfg.vocab_size, args.batch, seq, max(args.rotate, CHECK_STEPS),
                           args.seed)
      batches[name] = [jax.device_put(b) for b in host]
      log(f"{name}: hidden {cfg.hidden_size}, {cfg.moe.num_experts} experts top-"
          f"{cfg.moe.top_k}, intermediate {cfg.moe.intermediate_size}, {cfg.num_heads}/"
          f"{cfg.num_kv_heads} heads x {cfg.dim_per_head}, {cfg.num_layers} layers, vocab "
          f"{cfg.vocab_size}, {args.batch} x {seq} tokens")
    args.seq_used = result["configs"][name]["seq"]
    if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
      rec = dict(config=name, backend=backend, error="skipped: --budget-s reached")
      log(f"{name} {backend}: skipped (budget)")
    else:
      rec = run_one(name, cfgs[name], backend, batches[name], args, on_gpu)
    result["runs"].append(rec)
    result["agreement"][name] = agreement([r for r in result["runs"] if r["config"] == name])
    write()
  log("")
  log(f"| config | backend | tokens/step | step ms ({'device' if on_gpu else 'wall'}) | "
      f"tokens/s | TFLOP/s | MFU (/{args.peak_tflops:.0f}) | loss step 0 | loss step 3 |")
  log("|---|---|---:|---:|---:|---:|---:|---:|---:|")
  for r in result["runs"]:
    if "error" in r:
      log(f"| {r['config']} | {r['backend']} | {r.get('tokens_per_step', '')} | "
          f"{r['error'][:80]} | | | | | |")
      continue
    t_ms = r["device_ms"] if r["device_ms"] is not None else r["wall_ms"]
    log(f"| {r['config']} | {r['backend']} | {r['tokens_per_step']} | {t_ms:.2f} | "
        f"{r['tokens_per_s']:.0f} | {r['tflops']:.1f} | {100 * r['mfu']:.1f} % | "
        f"{r['losses'][0]:.5f} | {r['losses'][CHECK_STEPS - 1]:.5f} |")
  bad = False
  for name, ag in result["agreement"].items():
    if ag.get("checked"):
      log(f"{name}: {ag['pair'][0]} vs {ag['pair'][1]} loss rel diff step 0 "
          f"{ag['rel_step0']:.2e}, step 3 {ag['rel_step3']:.2e}: "
          f"{'ok' if ag['ok'] else 'FAILED'}")
      bad |= not ag["ok"]
    else:
      log(f"{name}: losses not compared ({ag['why']})")
  result["wall_s"] = round(time.perf_counter() - t_start, 1)
  write()
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
