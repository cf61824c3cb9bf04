"""What the device check scripts (check_cross_item.py, check_tgmm.py) share: their command
line and their ending (winners into the tuned tables, the JSON record, the exit status). The
routing benchmarks (bench_route.py, route_parts.py) write their record with write_record; the
benchmarks compare large device arrays with device_rel_err; the torch peers sort their slots
with torch_sorted_slots."""
from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from jmoe.tune import default_config_dir, write_tables


@jax.jit
def _device_rel_err(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  err = jnp.sqrt(jnp.sum(jnp.square(a - b))) / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(b))),
                                                           1e-30)
  return jnp.where(jnp.all(jnp.isfinite(a)), err, jnp.inf)


def device_rel_err(a, b) -> float:
  """||a - b|| / ||b|| of two device arrays (inf if a has a non-finite value), fused on the
  device in float32: deepseek-v3's weight gradients (3.8e9 elements each) as float64 NumPy
  copies take 30 GB of host memory apiece."""
  return float(_device_rel_err(a, b))


def parse_args(description: str, extra=()) -> argparse.Namespace:
  """The shared options, plus extra: (flag, add_argument keywords) pairs."""
  ap = argparse.ArgumentParser(description=description)
  for flag, kw in extra:
    ap.add_argument(flag, **kw)
  ap.add_argument("--json", default=None, help="write every timed variant here")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--write-tables", action="store_true",
                  help="put the correct, faster configs into pallas_kernels/configs")
  return ap.parse_args()


def finish(args: argparse.Namespace, tool: str, rows: list, better: list) -> int:
  """Writes the winners (jmoe.tune.TuneResult) when asked and the JSON record; 0 if every
  variant ran and was correct, else 1 (so a device script can gate on it)."""
  if args.write_tables and better:
    note = f"{tool}, {datetime.date.today().isoformat()}, jax {jax.__version__}"
    for path in write_tables(better, default_config_dir(), note):
      print(f"wrote {path}")
  write_record(args.json, rows)
  return 0 if all(r.get("correct") for r in rows) else 1


def write_record(path: str | None, rows: list) -> None:
  """The JSON record of a device script (jax version, device kind, its rows), if path is set."""
  if path:
    with open(path, "w") as fh:
      json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows), fh,
                indent=1)


def run_variant(rec: dict, measure, rows: list) -> bool:
  """measure(rec) times one variant into rec and says whether it is correct (rec["correct"]);
  rec is appended to rows. An exception (a config that does not lower is a finding) goes into
  rec["error"] and counts as incorrect."""
  rows.append(rec)
  try:
    rec["correct"] = bool(measure(rec))
  except Exception as exc:  # noqa: BLE001
    rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    rec["correct"] = False
  return rec["correct"]


def torch_sorted_slots(ti, num_experts: int):
  """The torch peers' routing step: topk ids ti [T, k] (torch, int64) -> (order [T*k] slots
  sorted by expert, offs [E] int32 cumulative group ends for torch._grouped_mm / _scaled_grouped_mm,
  tok [T*k] the token of each sorted slot)."""
  import torch  # noqa: PLC0415 (the peers' machines only)
  flat = ti.reshape(-1)
  order = torch.argsort(flat, stable=True)
  counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
  counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
  return order, torch.cumsum(counts, 0, dtype=torch.int32), order // ti.shape[1]


def top_kernels(per_kernel: dict, n: int, name_width: int = 0) -> str:
  """The n kernels of a CUPTI breakdown {name: µs} that took longest, as one log line."""
  top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:n]
  return "        kernels: " + ", ".join(f"{k[:name_width] if name_width else k}={v:.1f}"
                                       for k, v in top)
