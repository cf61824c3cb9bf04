"""`python -m jmoe {bench, check, profile, ...}`."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 120)


def _ints(s: str) -> list[int]:
  return [int(v) for v in s.split(",") if v]


def _names(s: str) -> list[str]:
  return [v for v in s.split(",") if v]


def cmd_bench(args) -> int:
  import jax  # noqa: PLC0415 (keep `--help` fast)

  from jmoe import bench  # noqa: PLC0415
  from jmoe.config import PRESET_TOKENS  # noqa: PLC0415

  machine = bench.measure_machine()
  on_gpu = machine.platform == "gpu"
  scale = not on_gpu if args.scale == "auto" else args.scale == "yes"
  tokens = args.tokens or (list(PRESET_TOKENS) if on_gpu else [1, 16, 64, 256])
  backends = args.backends or bench.default_backends(machine.platform)
  peers = args.peers if args.peers is not None else (["torch_grouped_mm"] if on_gpu else [])
  if peers:
    from jmoe import bench_peers  # noqa: PLC0415
    peers = [p for p in peers if bench_peers.available(p, console)]
  console.print(f"[bold]jmoe bench[/] preset={args.preset} dtype={args.dtype} "
                f"jax={jax.__version__} device={machine.device_kind} ({machine.platform})")
  console.print(f"ceilings: {machine.peak_flops / 1e12:.2f} TFLOP/s, "
                f"{machine.bandwidth / 1e9:.1f} GB/s ({machine.how})")
  total = len(tokens) * (len(backends) + len(peers))
  with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), console=console, transient=True) as prog:
    task = prog.add_task("benchmarking", total=total)
    rows, note = bench.run_bench(args.preset, tokens, backends, args.dtype, machine, scale=scale,
                                 repeats=args.repeats, peers=peers,
                                 progress=lambda: prog.advance(task))
  console.print(f"shapes: {note}")
  table = Table(title=f"{args.preset} ({args.dtype})")
  for col in ("tokens", "backend", "µs", "TFLOP/s", "GB/s", "roofline µs", "× roofline",
              "rel err"):
    table.add_column(col, justify="right")
  for r in rows:
    if r.error:
      table.add_row(str(r.tokens), r.backend, "[red]failed[/]", "", "", f"{r.roofline_us:.1f}",
                    "", r.error[:60])
      continue
    table.add_row(str(r.tokens), r.backend, f"{r.time_us:.1f}", f"{r.tflops:.3f}",
                  f"{r.gbps:.1f}", f"{r.roofline_us:.1f}", f"{r.ratio_to_roofline:.2f}",
                  "ref" if r.rel_err is None else f"{r.rel_err:.1e}")
  console.print(table)
  if args.json:
    with open(args.json, "w") as f:
      f.write(bench.rows_to_json(rows, machine, note, args.dtype))
    console.print(f"wrote {args.json}")
  if args.plot:
    bench.plot_rows(rows, args.plot)
    console.print(f"wrote {args.plot}")
  return 1 if any(r.error for r in rows) else 0


def compatibility_matrix():
  """(pf labels, experts classes, cells) with cell = 'ok' / reason / 'unavailable: ...'."""
  from jmoe import registry  # noqa: PLC0415
  from jmoe.modular import compatibility  # noqa: PLC0415

  pfs = registry.all_prepare_finalize(parallel=None)
  mesh_backends = [b for b in registry.A2A_BACKENDS.values() if b.needs_mesh]
  experts = registry.all_experts()
  cells = []
  for label, factory in pfs:
    pf = factory()
    row = []
    for cls in experts:
      ok, why = cls.is_available()
      reason = compatibility(pf, cls())
      if reason is None:
        row.append("ok" if ok else "ok (unavailable here)")
      elif pf.activation_format != cls.activation_formats[0]:
        row.append(f"✗ {pf.activation_format.value} ≠ {cls.activation_formats[0].value}")
      else:
        row.append("✗ " + reason)
    cells.append((label, row))
  for b in mesh_backends:  # EP backends need a mesh to build: judge by format alone
    for fmt in b.by_format:
      row = []
      for cls in experts:
        row.append("ok (needs a mesh)" if cls.activation_formats[0] == fmt else
                   f"✗ {fmt.value} ≠ {cls.activation_formats[0].value}")
      cells.append((f"{b.name}:{fmt.value}", row))
  return experts, cells


def cmd_check(args) -> int:
  experts, cells = compatibility_matrix()
  table = Table(title="jmoe: prepare/finalize × experts")
  table.add_column("prepare/finalize \\ experts")
  for cls in experts:
    table.add_column(f"{cls.name}\n({cls.activation_formats[0].value})")
  for label, row in cells:
    table.add_row(label, *[("[green]" if c.startswith("ok") else "[red]") + c + "[/]"
                           for c in row])
  console.print(table)
  for cls in experts:
    ok, why = cls.is_available()
    console.print(f"  {cls.name}: {'available' if ok else 'unavailable'} — {why}")
  from jmoe.oracle import select_backend  # noqa: PLC0415
  pf, ex, why = select_backend()
  console.print(f"oracle default here: {pf!r} + {ex!r} — {why}")
  return 0


def cmd_profile(args) -> int:
  import jax  # noqa: PLC0415

  from jmoe import bench  # noqa: PLC0415
  from jmoe.api import fused_moe  # noqa: PLC0415
  from jmoe.config import get_preset  # noqa: PLC0415

  cfg = get_preset(args.preset)
  if jax.devices()[0].platform != "gpu":
    cfg, note = bench.scaled_for_cpu(cfg)
    console.print(note)
  (x, w13, w2, tw, ti), _ = bench.make_problem(cfg, args.tokens, jax.numpy.dtype(args.dtype), 0)
  fn = jax.jit(lambda *a: fused_moe(*a, activation=cfg.act, runner_backend=args.backend))
  jax.block_until_ready(fn(x, w13, w2, tw, ti))
  with jax.profiler.trace(args.out):
    for _ in range(3):
      jax.block_until_ready(fn(x, w13, w2, tw, ti))
  console.print(f"wrote a jax.profiler trace of 3 forwards to {args.out} "
                "(open with TensorBoard / Perfetto)")
  return 0


def build_parser() -> argparse.ArgumentParser:
  from jmoe.config import PRESETS, RUNNER_BACKENDS  # noqa: PLC0415

  p = argparse.ArgumentParser(prog="python -m jmoe", description=__doc__)
  sub = p.add_subparsers(dest="cmd", required=True)
  b = sub.add_parser("bench", help="time the MoE expert block per backend vs the roofline")
  b.add_argument("--preset", default="mixtral-8x7b", choices=sorted(PRESETS))
  b.add_argument("--tokens", type=_ints, default=None,
                 help="comma-separated token counts (default: CPU 1,16,64,256; GPU 1..16384)")
  b.add_argument("--backends", type=_names, default=None,
                 help=f"comma-separated runner backends ({', '.join(RUNNER_BACKENDS[1:])})")
  b.add_argument("--peers", type=_names, default=None,
                 help="comma-separated peers (torch_grouped_mm); default on a CUDA machine")
  b.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
  b.add_argument("--scale", choices=("auto", "yes", "no"), default="auto",
                 help="shrink hidden/intermediate sizes (auto: on CPU only)")
  b.add_argument("--repeats", type=int, default=10)
  b.add_argument("--json", default=None, help="write the rows as JSON here")
  b.add_argument("--plot", default=None, help="write a time-vs-tokens plot (PNG) here")
  b.set_defaults(func=cmd_bench)
  c = sub.add_parser("check", help="print the prepare/finalize × experts compatibility matrix")
  c.set_defaults(func=cmd_check)
  pr = sub.add_parser("profile", help="write a jax.profiler trace of one forward")
  pr.add_argument("--preset", default="mixtral-8x7b", choices=sorted(PRESETS))
  pr.add_argument("--tokens", type=int, default=64)
  pr.add_argument("--backend", default="auto")
  pr.add_argument("--dtype", default="bfloat16")
  pr.add_argument("--out", default="jmoe-trace")
  pr.set_defaults(func=cmd_profile)
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = build_parser().parse_args(argv)
  if getattr(args, "dtype", "x") is None:
    import jax  # noqa: PLC0415
    args.dtype = "bfloat16" if jax.devices()[0].platform == "gpu" else "float32"
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
