"""Weight-gradient (tgmm) variants on a GPU, in a process of their own: for the training shapes
at 1024 tokens, the config training uses now (tuned table or default) against the candidates
of jmoe.kernels.tuning.SWEEP_TGMM, outputs compared with an f32 product on a few experts and
with the first variant's, device µs. --baseline PATH also times the tgmm of another copy of
pallas_kernels/tgmm.py (e.g. `git show REV:pallas_kernels/tgmm.py > /tmp/old.py`), same data,
same run. With --write-tables a correct config >= 2 % faster than the current one goes into
tgmm.json. Exits 1 on a mismatch or a failure.

  PYTHONPATH=$PWD python3 benchmarks/check_tgmm.py [--json out.json] [--write-tables]
      [--baseline old_tgmm.py] [--shapes qwen3,mixtral] [--aligned | --align 64]
      [--configs ' kf']
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import timing
import check_common  # benchmarks/, the script's own directory
from jmoe.tune import TuneResult
from jmoe.kernels import _compat
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import permute
from jmoe.kernels import tgmm as tg
from jmoe.kernels import tuning

SHAPES = (  # (name, E, top-k, tokens, lhs columns K, dout columns N): out [E, K, N]
    ("qwen3 dW13", 128, 8, 1024, 2048, 1536),
    ("qwen3 dW2", 128, 8, 1024, 768, 2048),
    ("mixtral dW13", 8, 2, 1024, 4096, 28672),
    ("mixtral dW2", 8, 2, 1024, 14336, 4096),
    ("deepseek dW13", 256, 8, 1024, 7168, 4096),
    ("deepseek dW2", 256, 8, 1024, 2048, 7168),
)


def make_problem(name: str, align: int = 1, tokens: int | None = None):
  """(x [m, K], dout [m, N], group sizes [E]) of SHAPES' `name` on random routing, every
  expert's rows padded to a multiple of `align` (8: training's layout), m = T k + (align - 1) E.
  """
  shapes = {s[0]: s[1:] for s in SHAPES}
  if name not in shapes:
    raise ValueError(f"shape={name!r} is not one of {sorted(shapes)}")
  e, k, t, kdim, n = shapes[name]
  t = tokens or t
  keys = jax.random.split(jax.random.key(t + e + n), 3)
  m = t * k + (align - 1) * e
  x = jax.random.normal(keys[0], (m, kdim), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[1], (m, n), jnp.float32).astype(jnp.bfloat16)
  _, ids = jax.lax.top_k(jax.random.normal(keys[2], (t, e)), k)
  _, gs, _ = permute.moe_align(ids.astype(jnp.int32), e)
  return x, dy, (gs + align - 1) // align * align


def _expert_products(x, dy, gs, experts):
  """f32 x_g^T dy_g for a few experts g (host sizes)."""
  ends = np.cumsum(gs)
  return {g: np.asarray(jnp.dot(x[ends[g] - gs[g]:ends[g]].astype(jnp.float32).T,
                                dy[ends[g] - gs[g]:ends[g]].astype(jnp.float32)))
          for g in experts}


def _rel(a, b):
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _load_baseline(path):
  spec = importlib.util.spec_from_file_location("baseline_tgmm", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # dataclasses look their module up while it executes
  spec.loader.exec_module(mod)
  return mod


def _tag(cfg) -> str:
  return (f"{cfg.block_k}x{cfg.block_n} r{cfg.block_r} st{cfg.num_stages} "
          + ("ws" if getattr(cfg, "warp_specialized", False) else f"cps{cfg.ctas_per_sm}")
          + (" xt" if getattr(cfg, "cross_tile", False) else "")
          + (" kf" if getattr(cfg, "k_fastest", False) else "")
          + (" ob2" if getattr(cfg, "out_buffers", 1) == 2 else "")
          + (f" p{cfg.store_parts}" if getattr(cfg, "store_parts", 1) > 1 else ""))


def main() -> int:
  args = check_common.parse_args(__doc__.split("\n")[0], extra=[
      ("--baseline", dict(default=None, help="another tgmm.py to time alongside")),
      ("--shapes", dict(default="", help="comma-separated name prefixes (default: all)")),
      ("--aligned", dict(action="store_true",
                         help="the training layout: every expert's rows padded to a multiple "
                              "of 8 (route_for_training), so row blocks start at each expert")),
      ("--align", dict(type=int, default=0,
                       help="pad every expert's rows to a multiple of this instead (64: each "
                            "row block inside one expert, no block needs masking)")),
      ("--configs", dict(default="", help="time only the sweep candidates whose tag (as "
                                          "printed) contains this text, e.g. ' kf'"))])
  base_mod = _load_baseline(args.baseline) if args.baseline else None
  rows, better = [], []
  wanted = [w for w in args.shapes.split(",") if w]
  for name, e, k, t, kdim, n in SHAPES:
    if wanted and not any(name.startswith(w) for w in wanted):
      continue
    align = args.align or (8 if args.aligned else 1)
    x, dy, gs = make_problem(name, align)
    m = x.shape[0]
    gs_host = np.asarray(gs)
    probe = [int(g) for g in np.argsort(gs_host)[[0, len(gs_host) // 2, -1]]]
    ref = _expert_products(x, dy, gs_host, probe)
    current = tg.get_tgmm_config(m, kdim, n, e, jnp.bfloat16)
    variants = [("current", tg.tgmm, current)]
    if base_mod is not None:
      variants.append(("baseline", base_mod.tgmm, base_mod.DEFAULT_CONFIG))
    variants += [("sweep", tg.tgmm, c) for c in tuning.SWEEP_TGMM
                 if c != current and args.configs in _tag(c)]
    first_out, timed = None, {}
    for label, fn, cfg in variants:
      rec = dict(problem=name, variant=label, config=cfg.to_json())

      def measure(rec, fn=fn, cfg=cfg):
        nonlocal first_out
        f = jax.jit(lambda a, b, g: fn(a, b, g, config=cfg))
        out = f(x, dy, gs)
        rec["err_f32"] = max(_rel(np.asarray(out[g], np.float32), ref[g]) for g in probe)
        if first_out is None:
          first_out = out
        else:
          rec["diff_vs_first"] = check_common.device_rel_err(out, first_out)
        rec["us"] = timing.device_time(f, [(x, dy, gs)], iters=args.iters)[0]
        return rec["err_f32"] < 1e-2 and rec.get("diff_vs_first", 0.0) < 1e-2

      if check_common.run_variant(rec, measure, rows) and label != "baseline":
        timed[cfg] = rec["us"]
      print(f"{name:13s} {label:8s} {_tag(cfg):22s}: " + (
          f"{rec['us']:8.1f} us  err {rec['err_f32']:.1e}  "
          f"diff {rec.get('diff_vs_first', 0.0):.1e}" if "us" in rec else rec["error"]),
          flush=True)
    if current in timed and len(timed) > 1:
      best = min(timed, key=timed.get)
      if timed[best] < 0.98 * timed[current]:
        key = gg._tuned_key(e, n, kdim, jnp.bfloat16, _compat.device_kind(), gg._m_bucket(m))
        better.append(TuneResult("tgmm", key, best.to_json(), timed[best], len(variants), 0))
  return check_common.finish(args, "check_tgmm.py", rows, better)


if __name__ == "__main__":
  sys.exit(main())
