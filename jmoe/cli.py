"""jmoe: Mixture-of-Experts layers for JAX. `python -m jmoe COMMAND --help` for a command's
options."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# rich gives a non-tty 80 columns; piped text gets 120 ($COLUMNS, when set, wins as in rich)
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120)


def _print_table(table: Table) -> None:
  """On a terminal (or with $COLUMNS): its width, cells wrapping where they do not fit. Piped:
  the table's natural width, however wide, so no cell is wrapped or cut in a log or a file."""
  if console.is_terminal or os.environ.get("COLUMNS"):
    console.print(table)
  else:
    width = console.width  # print(width=...) can only narrow: widen the console for the table
    console.width = max(width, console.measure(table, options=console.options.update_width(
        1 << 14)).maximum)
    try:
      console.print(table)
    finally:
      console.width = width


class UsageError(ValueError):
  """Bad command-line input; `main` prints it as `python -m jmoe CMD: error: ...` (exit 2)."""


def _ints(s: str) -> list[int]:
  vals = [int(v) for v in s.split(",") if v]
  if any(v <= 0 for v in vals):
    raise argparse.ArgumentTypeError(f"{s!r}: every value must be a positive integer")
  return vals


def _positive(s: str) -> int:
  if int(s) <= 0:
    raise argparse.ArgumentTypeError(f"{s!r}: must be a positive integer")
  return int(s)


def _schemes(s: str) -> list[str]:
  from jmoe.config import QUANT_SCHEMES  # noqa: PLC0415 (keep `--help` fast)
  names = _names(s)
  bad = [n for n in names if n not in QUANT_SCHEMES]
  if bad:
    raise argparse.ArgumentTypeError(f"{bad[0]!r} is not a quantization scheme; known: "
                                     f"{', '.join(QUANT_SCHEMES)}")
  return names


def _names(s: str) -> list[str]:
  return [v for v in s.split(",") if v]


def cmd_bench(args) -> int:
  import jax  # noqa: PLC0415 (keep `--help` fast)

  from jmoe import bench  # noqa: PLC0415
  from jmoe.config import PRESET_TOKENS  # noqa: PLC0415

  machine = bench.measure_machine(remeasure=args.remeasure)
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
  cfg, note = bench.bench_config(args.preset, scale, args.quant)
  scaled = note.startswith("scaled")
  console.print(f"shapes: {note}" + ("; --scale no for the preset's full size" if scaled else ""))
  total = len(tokens) * (len(backends) * (1 + len(args.quant)) + len(peers))
  with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), console=console, transient=True) as prog:
    task = prog.add_task("benchmarking", total=total)
    rows, note = bench.run_bench(args.preset, tokens, backends, args.dtype, machine, scale=scale,
                                 repeats=args.repeats, peers=peers, quant=args.quant,
                                 weights=args.weights, progress=lambda: prog.advance(task))
  table = Table(title=f"{args.preset} ({args.dtype}, {machine.platform})")
  has_dev = any(r.device_us is not None for r in rows)
  cols = ["tokens", "backend", "wall µs"] + (["device µs"] if has_dev else []) + [
      "TFLOP/s", "GB/s", "roofline µs", "× roofline", "rel err"]
  for col in cols:
    table.add_column(col, justify="right")
  for r in rows:
    dev = [] if not has_dev else ["" if r.device_us is None else f"{r.device_us:.1f}"]
    if r.error:
      table.add_row(str(r.tokens), r.backend, "[red]failed[/]", *dev, "", "",
                    f"{r.roofline_us:.1f}", "", r.error[:60])
      continue
    table.add_row(str(r.tokens), r.backend, f"{r.time_us:.1f}", *dev, f"{r.tflops:.3f}",
                  f"{r.gbps:.1f}", f"{r.roofline_us:.1f}", f"{r.ratio_to_roofline:.2f}",
                  "ref" if r.rel_err is None else f"{r.rel_err:.1e}")
  _print_table(table)
  console.print(bench.legend(has_dev, bool(peers), bool(args.quant)), style="dim")
  for r in rows:
    if r.error:  # the cell holds 60 characters; the full message here
      console.print(f"[red]failed[/] tokens={r.tokens} {r.backend}: {r.error}", soft_wrap=True)
  if not on_gpu and any(r.ratio_to_roofline < 1 for r in rows if not r.error):
    console.print("[yellow]× roofline < 1: the cached ceilings underestimate this machine; "
                  "--remeasure to measure them again[/]")
  if args.json:
    with open(args.json, "w") as f:
      f.write(bench.rows_to_json(rows, machine, note, args.dtype))
    console.print(f"wrote {args.json}")
  if args.plot:
    bench.plot_rows(rows, args.plot, bench.plot_title(args.preset, args.dtype, machine, cfg,
                                                      scaled))
    console.print(f"wrote {args.plot}")
  return 1 if any(r.error for r in rows) else 0


def compatibility_matrix(quant=None):
  """(pf labels, experts classes, cells) with cell = 'ok' / reason / 'unavailable: ...', for
  the scheme `quant` (None: unquantized)."""
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
      reason = compatibility(pf, cls(), quant)
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
  from jmoe.config import QuantConfig  # noqa: PLC0415
  quant = QuantConfig(args.quant) if args.quant else None
  experts, cells = compatibility_matrix(quant)
  # fold, not rich's default ellipsis: a narrow console wraps a long name or reason, never cuts
  title = "jmoe: prepare/finalize × experts" + (f", {quant}" if quant else "")
  table = Table(title=title, show_lines=True)
  table.add_column("prepare/finalize \\ experts", overflow="fold")
  for cls in experts:
    table.add_column(f"{cls.name}\n({cls.activation_formats[0].value})", overflow="fold")
  for label, row in cells:
    table.add_row(label, *[("[green]" if c.startswith("ok") else "[red]") + c + "[/]"
                           for c in row])
  _print_table(table)
  for cls in experts:
    ok, why = cls.is_available()
    console.print(f"  {cls.name}: {'available' if ok else 'unavailable'} — {why}")
  from jmoe.oracle import select_backend  # noqa: PLC0415
  try:
    pf, ex, why = select_backend(quant=quant)
  except ValueError as e:  # no backend runs this scheme here: say why, as the oracle does
    console.print(f"oracle here{' for ' + str(quant) if quant else ''}: none — {e}",
                  soft_wrap=True)
    return 1
  console.print(f"oracle here{' for ' + str(quant) if quant else ''}: {pf!r} + {ex!r} — {why}",
                soft_wrap=True)
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


def cmd_tune(args) -> int:
  import jax  # noqa: PLC0415

  from jmoe import tune  # noqa: PLC0415
  from jmoe.config import get_preset  # noqa: PLC0415

  cfg = get_preset(args.preset)
  e, k, h, n = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
  if args.shape:
    e, k, h, n = args.shape
  on_gpu = jax.devices()[0].platform == "gpu"
  if not on_gpu and not args.interpret:
    console.print("[red]tune needs a GPU[/] (or --interpret to exercise it in the CPU "
                  "interpreter, whose timings mean nothing)")
    return 2
  if not cfg.act.is_gated:
    console.print(f"[red]tune covers gated activations; {cfg.activation} is not[/]")
    return 2
  tables = args.tables.split(",") if args.tables else None
  timed: list[dict] = []  # every candidate's time, for --log
  out_dir = args.out or tune.default_config_dir()
  note = (f"jmoe tune --preset {args.preset}{' --quant ' + args.quant if args.quant else ''}, "
          f"{time.strftime('%Y-%m-%d')}, jax {jax.__version__}")

  def write_log():
    if args.log:
      with open(args.log, "w") as f:  # the winner per key is in the tables; this is the field
        json.dump({"argv": sys.argv, "jax": jax.__version__, "candidates": timed}, f, indent=1)

  def report(tokens, table, key, config, us):
    timed.append({"tokens": tokens, "table": table, "key": key, "config": config.to_json(),
                  "us": us})

  written: list[str] = []

  def save(result):  # each winner goes to disk at once: a stopped run keeps what it found
    for path in tune.write_tables([result], out_dir, note, keep_existing=args.keep_existing):
      if path not in written:
        written.append(path)
    write_log()

  if args.quant:
    tune.quant_problems(args.quant)  # an unsupported scheme stops here, before any timing
    total = tune.num_quant_candidates(e, k, args.tokens, args.quant,
                                      max_candidates=args.max_candidates)
  else:
    total = tune.num_candidates(e, k, args.tokens, training=args.train,
                               max_candidates=args.max_candidates, tables=tables)
  console.print(f"[bold]jmoe tune[/] {args.preset}: E={e} k={k} H={h} N={n} tokens={args.tokens} "
                f"{'quant=' + args.quant + ' ' if args.quant else ''}"
                f"jax={jax.__version__} device={jax.devices()[0].device_kind}")
  try:
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as prog:
      task = prog.add_task("timing candidates", total=total)
      common = dict(iters=args.iters, interpret=args.interpret,
                    max_candidates=args.max_candidates, progress=lambda: prog.advance(task),
                    draws=args.draws, report=report, on_result=save)
      if args.quant:
        results = tune.tune_quantized(e, k, h, n, cfg.act, args.tokens, args.quant, **common)
      else:
        results = tune.tune(e, k, h, n, cfg.act, args.tokens, training=args.train,
                            tables=tables, **common)
  finally:
    write_log()
  table = Table(title="best configs")
  for col in ("kernel", "key", "config", "µs", "tried", "failed"):
    table.add_column(col)
  for r in results:
    short = {k_: v for k_, v in r.config.items() if k_ != "us"}
    table.add_row(r.kernel, r.key, json.dumps(short), f"{r.us:.1f}", str(r.tried), str(r.failed))
  console.print(table)
  for path in written:
    console.print(f"wrote {path}")
  return 0


def cmd_eplb(args) -> int:
  from jmoe.config import get_preset  # noqa: PLC0415
  from jmoe.sharding import eplb  # noqa: PLC0415

  num_experts = get_preset(args.preset).num_experts
  if args.redundant is None:
    args.redundant = args.ep  # one extra slot per device (DeepSeek: 32 on 32 prefill GPUs)
  _check_eplb_slots(num_experts, args.redundant, args.ep)
  r = eplb.simulate(args.preset, args.ep, args.redundant, args.skew, plot=args.plot,
                    tokens=args.tokens, gpus_per_node=args.gpus_per_node, seed=args.seed)
  table = Table(title=f"EPLB simulation: {args.preset}, EP={args.ep}, skew={args.skew}")
  table.add_column("")
  table.add_column("before", justify="right")
  table.add_column("after EPLB", justify="right")
  table.add_row("balancedness (mean/max device load)", f"{r['balancedness_before']:.3f}",
                f"{r['balancedness_after']:.3f}")
  table.add_row("same, held-out routing sample", f"{r['balancedness_before_heldout']:.3f}",
                f"{r['balancedness_after_heldout']:.3f}")
  table.add_row("max device load (token slots)", f"{r['max_device_load_before']:.0f}",
                f"{r['max_device_load_after']:.0f}")
  console.print(table)
  console.print(f"physical experts {r['physical_experts']} ({r['redundant_used']} redundant), "
                f"max replicas of one expert {r['max_replicas']}, policy {r['policy']}, "
                f"mean device load {r['mean_device_load']:.0f}")
  if args.plot:
    console.print(f"wrote {args.plot}")
  return 0


def _check_eplb_slots(num_experts: int, redundant: int, ep: int) -> None:
  """The placement gives every device the same number of physical slots (slot p on device
  p // (P / ep)), so experts + redundant must divide by ep; say so rather than round."""
  if ep <= 0:
    raise UsageError(f"--ep={ep}: must be a positive number of devices")
  if redundant < 0:
    raise UsageError(f"--redundant={redundant}: must be >= 0")
  off = (num_experts + redundant) % ep
  if off:
    lo, hi = redundant - off, redundant - off + ep
    fix = f"{lo} or {hi}" if lo >= 0 else str(hi)
    rule = (f"must be a multiple of --ep={ep}" if num_experts % ep == 0 else
            f"must make {num_experts} experts + redundant a multiple of --ep={ep}")
    raise UsageError(
        f"--redundant={redundant}: {rule}, since every device holds the same number of "
        f"expert slots ({num_experts} + {redundant} = {num_experts + redundant} slots do not "
        f"divide over {ep} devices); try --redundant {fix}")


def build_parser() -> argparse.ArgumentParser:
  from jmoe.config import PRESETS, QUANT_SCHEMES, RUNNER_BACKENDS  # noqa: PLC0415

  p = argparse.ArgumentParser(prog="python -m jmoe", description=__doc__)
  sub = p.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")
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
  b.add_argument("--repeats", type=_positive, default=10, help="timed calls per row")
  b.add_argument("--remeasure", action="store_true",
                 help="measure the CPU ceilings again (else cached once per machine in "
                      "$XDG_CACHE_HOME/jmoe or ~/.cache/jmoe; also $JMOE_REMEASURE=1)")
  b.add_argument("--quant", type=_schemes, default=[],
                 help="also time the backends with the weights quantized to these schemes "
                      f"(comma-separated: {', '.join(QUANT_SCHEMES)}); their rel err vs the "
                      "dense block is the scheme's accuracy")
  b.add_argument("--weights", default="gaussian", choices=("gaussian", "llm"),
                 help="the random weights' distribution: gaussian, or llm (heavy tails and "
                      "channels of different size, a model of trained weights: "
                      "jmoe.bench.random_weights)")
  b.add_argument("--json", default=None, help="write the rows as JSON here")
  b.add_argument("--plot", default=None, help="write a time-vs-tokens plot (PNG) here")
  b.set_defaults(func=cmd_bench)
  c = sub.add_parser("check", help="print the prepare/finalize × experts compatibility matrix")
  c.add_argument("--quant", default=None, choices=sorted(QUANT_SCHEMES),
                 help="the matrix and the oracle's choice for this quantization scheme")
  c.set_defaults(func=cmd_check)
  pr = sub.add_parser("profile", help="write a jax.profiler trace of one forward")
  pr.add_argument("--preset", default="mixtral-8x7b", choices=sorted(PRESETS))
  pr.add_argument("--tokens", type=int, default=64)
  pr.add_argument("--backend", default="auto")
  pr.add_argument("--dtype", default="bfloat16")
  pr.add_argument("--out", default="jmoe-trace")
  pr.set_defaults(func=cmd_profile)
  t = sub.add_parser("tune", help="autotune the Pallas grouped-GEMM configs on this GPU")
  t.add_argument("--preset", default="mixtral-8x7b", choices=sorted(PRESETS))
  t.add_argument("--tokens", type=_ints, default=[1, 64, 1024, 16384])
  t.add_argument("--shape", type=_ints, default=None, help="override as E,k,H,N")
  t.add_argument("--iters", type=int, default=5)
  t.add_argument("--draws", type=int, default=3,
                 help="random routings per token count, each candidate timed over them in turn")
  t.add_argument("--max-candidates", type=int, default=None)
  t.add_argument("--interpret", action="store_true",
                 help="run in the CPU interpreter (tests the command; timings are meaningless)")
  t.add_argument("--out", default=None,
                 help="folder for the JSON tables (default: the package's pallas_kernels/configs)")
  t.add_argument("--train", action="store_true",
                 help="also the training-only GEMMs (GEMM1 without the fused activation, the "
                      "backward's transposed-weight d lhs GEMMs)")
  t.add_argument("--tables", default=None,
                 help="comma-separated tables to tune (grouped_gemm_gated = GEMM1, grouped_gemm "
                      "= GEMM2, tgmm, grouped_gemm_rt); default: all of the mode")
  t.add_argument("--log", default=None,
                 help="write every candidate's time to this JSON file (first per key: the "
                      "config in use before the run)")
  t.add_argument("--quant", default=None,
                 help="tune the kernels of this quantized scheme instead (fp8_tensor, "
                      "fp8_channel, int8: GEMM1 / GEMM2 under the 8-bit dtype's keys; fp8_block: "
                      "the block, table grouped_gemm_fp8_block; w4a16, mxfp4, nvfp4: the "
                      "weight-only prefill GEMMs, tables grouped_gemm_wq_ws(_gated))")
  t.add_argument("--keep-existing", action="store_true",
                 help="only add the keys the tables lack (entries from earlier runs or checks "
                      "stay, even where this run timed the same key)")
  t.set_defaults(func=cmd_tune)
  ep = sub.add_parser("eplb", help="simulate expert-parallel load balancing on skewed routing")
  ep.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
  ep.add_argument("--ep", type=int, default=64, help="expert-parallel devices")
  ep.add_argument("--redundant", type=int, default=None,
                  help="redundant expert replicas; experts + redundant must be a multiple of "
                       "--ep (every device holds as many slots); default: --ep, one per device")
  ep.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of expert popularity")
  ep.add_argument("--tokens", type=int, default=8192)
  ep.add_argument("--gpus-per-node", type=int, default=8)
  ep.add_argument("--seed", type=int, default=0)
  ep.add_argument("--plot", default=None, help="write per-device loads (PNG) here")
  ep.set_defaults(func=cmd_eplb)
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.cmd is None:  # a bare `python -m jmoe`: the commands, not an argparse error
    parser.print_help()
    return 0
  if getattr(args, "dtype", "x") is None:
    import jax  # noqa: PLC0415
    args.dtype = "bfloat16" if jax.devices()[0].platform == "gpu" else "float32"
  try:
    return args.func(args)
  except UsageError as e:
    parser.exit(2, f"{parser.prog} {args.cmd}: error: {e}\n")


if __name__ == "__main__":
  sys.exit(main())
