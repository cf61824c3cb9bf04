"""Train a tiny MoE transformer (jmoe.models) on Shakespeare, by character, on a data x expert mesh.

    python examples/train_tiny_moe.py                       # 8 simulated CPU devices, 2 x 4
    python examples/train_tiny_moe.py --preset deepseek-v3 --steps 300

optax AdamW with warmup + cosine decay, one `jit`ted step with the model's shardings (the MoE
weights over the expert axis, the tokens over data x expert, everything else replicated); a
progress bar with loss, aux loss and expert-load balance (max / mean); a loss-curve PNG; an orbax
checkpoint at `--ckpt-step`, restored at the end into a fresh model to check that resuming gives
the next step's loss exactly as not stopping did. `--resume DIR` continues a saved run.

Multi-host: `--num-processes 2 --process-id I --coordinator HOST:PORT` runs one process of a
`jax.distributed` job (gloo CPU collectives), each with `--devices / num_processes` devices.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="mixtral", choices=("mixtral", "qwen3-moe", "deepseek-v3"))
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=16, help="sequences per step (global)")
  p.add_argument("--seq", type=int, default=64, help="characters per sequence")
  p.add_argument("--hidden", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--lr", type=float, default=1e-2)
  p.add_argument("--warmup", type=int, default=20)
  p.add_argument("--weight-decay", type=float, default=0.01)
  p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight")
  p.add_argument("--z-coef", type=float, default=1e-3, help="router z-loss weight")
  p.add_argument("--bias-rate", type=float, default=1e-3,
                 help="DeepSeek aux-loss-free bias update rate (presets with a correction bias)")
  p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (all processes)")
  p.add_argument("--data", type=int, default=2, help="data-axis size (expert = devices / data)")
  p.add_argument("--a2a-backend", default="auto")
  p.add_argument("--runner-backend", default="auto")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--corpus", default=None, help="a UTF-8 text file (default: the shipped one)")
  p.add_argument("--out", default="tiny_moe_run", help="directory for the PNG, metrics, ckpt")
  p.add_argument("--ckpt-step", type=int, default=None, help="save here (default: steps // 2)")
  p.add_argument("--no-ckpt", action="store_true", help="skip the checkpoint and resume check")
  p.add_argument("--resume", default=None, help="continue from this checkpoint directory")
  p.add_argument("--eval-batches", type=int, default=4)
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--no-plot", action="store_true")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (multi-host)")
  args = p.parse_args(argv)
  if args.steps < 2:
    p.error("--steps must be >= 2")
  if not 0 <= args.warmup < args.steps:
    p.error(f"--warmup={args.warmup} must be in [0, --steps={args.steps})")
  if args.devices % args.num_processes:
    p.error(f"--devices={args.devices} must be a multiple of --num-processes")
  if args.devices % args.data:
    p.error(f"--data={args.data} must divide --devices={args.devices}")
  if args.batch % args.devices:
    p.error(f"--batch={args.batch} must be a multiple of --devices={args.devices} (tokens "
            "shard over data x expert)")
  return args


def setup_devices(args) -> None:
  """Simulated CPU devices (and the distributed runtime) before jax picks its backend."""
  local = args.devices // args.num_processes
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local}".strip()
  if args.num_processes > 1:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax  # noqa: PLC0415
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id,
                               initialization_timeout=60)


def main(argv=None) -> dict:
  """Run the training; returns the final metrics (also written to OUT/metrics.json)."""
  args = parse_args(argv)
  setup_devices(args)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from tiny_moe_trainer import Trainer  # noqa: PLC0415 (after the device set-up)

  trainer = Trainer(args)
  metrics = trainer.run()
  if trainer.is_main:  # the per-step losses are in OUT/metrics.json
    print(json.dumps({k: v for k, v in metrics.items() if k != "losses"}, indent=1))
  if args.num_processes > 1:
    import jax  # noqa: PLC0415
    jax.distributed.shutdown()
  return metrics


if __name__ == "__main__":
  t0 = time.time()
  main()
  print(f"wall time {time.time() - t0:.1f} s")
