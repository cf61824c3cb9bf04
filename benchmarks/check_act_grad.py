"""The training GEMMs with fused activation epilogues on a GPU, in a process of their own: for
the training shapes at 1024 tokens, device µs of

  d a:  the d a GEMM (dy @ w2^T) with the activation's VJP fused (grouped_gemm_act_grad) over a
        few configs, against the unfused pair (the d a GEMM on its table config, then XLA's
        activation VJP);
  up:   GEMM1 writing the activated rows and h (grouped_gemm_gated(return_preact=True)) over a
        few configs, against the unfused pair (GEMM1 without the activation, then XLA's
        activation);

every fused output compared with the unfused one (rows of the routed total). Exits 1 on a
mismatch or a failure.

  PYTHONPATH=$PWD python3 benchmarks/check_act_grad.py [--json out.json] [--shapes qwen3]
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jmoe import timing
import check_common  # benchmarks/, the script's own directory
from jmoe.kernels import grouped_gemm as gg
from jmoe.kernels import permute
from jmoe.kernels.activations import Activation

C = gg.GroupedGemmConfig
SHAPES = (("qwen3", 128, 8, 1024, 2048, 768), ("mixtral", 8, 2, 1024, 4096, 14336))  # E k T H N
CANDIDATES = (
    C(block_m=128, block_n=128, block_k=64, num_stages=4, wg_split="n"),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, wg_split="n", cross_item=True),
    C(block_m=128, block_n=256, block_k=32, num_stages=4, wg_split="n", cross_item=True),
    C(block_m=256, block_n=128, block_k=32, num_stages=4, wg_split="m"),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, warp_specialized=False),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, warp_specialized=False,
      cross_item=True),
    C(block_m=64, block_n=128, block_k=64, num_stages=6, wg_split="n"),
)


def _tag(cfg) -> str:
  if cfg is None:
    return "table/auto"
  return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} st{cfg.num_stages} "
          + (f"ws-{cfg.wg_split}" if cfg.warp_specialized else "1wg")
          + (" xi" if cfg.cross_item else ""))


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main() -> int:
  args = check_common.parse_args(__doc__.split("\n")[0], extra=[
      ("--shapes", dict(default="", help="comma-separated preset names (default: all)"))])
  act = Activation("silu")
  rows = []
  wanted = [w for w in args.shapes.split(",") if w]
  for name, e, k, t, hdim, n in SHAPES:
    if wanted and name not in wanted:
      continue
    keys = jax.random.split(jax.random.key(e + n), 6)
    m = t * k
    bf = jnp.bfloat16
    xs = jax.random.normal(keys[0], (m, hdim), jnp.float32).astype(bf)
    dy = jax.random.normal(keys[1], (m, hdim), jnp.float32).astype(bf)
    h = (2 * jax.random.normal(keys[2], (m, 2 * n), jnp.float32)).astype(bf)
    w13 = (jax.random.normal(keys[3], (e, hdim, 2 * n), jnp.float32) / hdim ** 0.5).astype(bf)
    w2 = (jax.random.normal(keys[4], (e, n, hdim), jnp.float32) / n ** 0.5).astype(bf)
    _, ids = jax.lax.top_k(jax.random.normal(keys[5], (t, e)), k)
    _, gs, _ = permute.moe_align(ids.astype(jnp.int32), e)

    def unfused_da(dy, w2, gs, h):
      da = gg.grouped_gemm(dy, w2, gs, transpose_rhs=True).astype(jnp.float32)
      hf = h.astype(jnp.float32)
      _, pull = jax.vjp(act.gated, hf[:, :n], hf[:, n:])
      return jnp.concatenate(pull(da), axis=1).astype(bf)

    def unfused_up(xs, w13, gs):
      hh = gg.grouped_gemm(xs, w13, gs)
      hf = hh.astype(jnp.float32)
      return act.gated(hf[:, :n], hf[:, n:]).astype(bf), hh

    problems = [
        ("d a", unfused_da, (dy, w2, gs, h),
         lambda cfg: (lambda dy, w2, gs, h: gg.grouped_gemm_act_grad(
             dy, w2, gs, h, activation=act, config=cfg, transpose_rhs=True))),
        ("up", unfused_up, (xs, w13, gs),
         lambda cfg: (lambda xs, w13, gs: gg.grouped_gemm_gated(
             xs, w13, gs, activation=act, config=cfg, return_preact=True))),
    ]
    for pname, unfused, fargs, make in problems:
      ref = None
      for label, cfg in [("unfused", None), ("fused", None)] + [("fused", c) for c in CANDIDATES]:
        rec = dict(problem=f"{name} {pname}", variant=label, config=_tag(cfg))

        def measure(rec, label=label, cfg=cfg):
          nonlocal ref
          f = jax.jit(unfused if label == "unfused" else make(cfg))
          out = jax.block_until_ready(f(*fargs))
          valid = int(np.asarray(gs).sum())
          if ref is None:
            ref = jax.tree.map(lambda o: np.asarray(o[:valid], np.float32), out)
            rec["err"] = 0.0
          else:
            rec["err"] = max(_rel(o[:valid], r) for o, r in zip(jax.tree.leaves(out),
                                                                 jax.tree.leaves(ref)))
          rec["us"] = timing.device_time(f, [fargs], iters=args.iters)[0]
          return rec["err"] < 1e-2

        check_common.run_variant(rec, measure, rows)
        print(f"{name:8s} {pname:4s} {label:8s} {_tag(cfg):28s}: " + (
            f"{rec['us']:8.1f} us  err {rec['err']:.1e}" if "us" in rec else rec["error"]),
            flush=True)
  return check_common.finish(args, "check_act_grad.py", rows, [])


if __name__ == "__main__":
  sys.exit(main())
