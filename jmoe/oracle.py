"""Backend selection: which PrepareFinalize and which Experts run a given MoE call.

`select_backend` returns `(prepare_finalize, experts, reason)`. Every choice can be forced:
by argument (`runner_backend=`, `a2a_backend=`, like SGLang's `--moe-runner-backend` /
`--moe-a2a-backend`) or by the environment (`JMOE_RUNNER_BACKEND`, `JMOE_A2A_BACKEND`); an
explicit argument wins over the environment, which wins over "auto".
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import jax

from jmoe import registry
from jmoe.config import A2A_BACKENDS, RUNNER_BACKENDS, ParallelConfig, QuantConfig, check_choice
from jmoe.modular import ActivationFormat, Experts, PrepareFinalize, compatibility
from jmoe.quant.weights import is_packed

log = logging.getLogger("jmoe.oracle")


@functools.lru_cache(maxsize=None)
def platform_info() -> tuple[str, Optional[tuple[int, int]], str]:
  """(platform, compute capability or None, device kind) of the default device."""
  dev = jax.devices()[0]
  cc = None
  raw = getattr(dev, "compute_capability", None)
  if raw:
    try:
      major, minor = str(raw).split(".")[:2]
      cc = (int(major), int(minor))
    except ValueError:
      cc = None
  return dev.platform, cc, getattr(dev, "device_kind", "")


def _resolve(name: str, arg: str, env: str, choices) -> tuple[str, str]:
  check_choice(name, arg, choices)
  if arg != "auto":
    return arg, f"{name}={arg!r} forced by argument"
  env_val = os.environ.get(env)
  if env_val:
    check_choice(f"{env} (environment)", env_val, choices)
    if env_val != "auto":
      return env_val, f"{name}={env_val!r} forced by ${env}"
  return "auto", ""


# runner_backend="auto" walks these, best first, and takes the first that passes every
# capability check (device, registration, availability, problem shape, quantization scheme);
# adding a backend or a format adds a candidate or a capability, not a selection function
AUTO_RUNNERS = ("pallas_mosaic", "xla")


def _device_check(runner: str) -> Optional[str]:
  """None when this machine's device can run `runner`, else why not."""
  if runner != "pallas_mosaic":
    return None
  platform, cc, kind = platform_info()
  if platform != "gpu":
    return f"platform={platform}: no GPU kernels"
  if cc is None or cc[0] != 9:
    where = f"sm{cc[0]}{cc[1]}" if cc else "unknown compute capability"
    return f"GPU {kind} ({where}) is not Hopper (sm90)"
  return None


def runner_support(runner: str, quant: Optional[QuantConfig], fmt: Optional[ActivationFormat],
                   problem=None) -> Optional[str]:
  """None when `runner`'s experts can run this call here, else the first reason they cannot."""
  why = _device_check(runner)
  if why:
    return why
  cls = registry.RUNNERS.get(runner, {}).get(fmt or ActivationFormat.Standard)
  if cls is None:
    return f"no {(fmt or ActivationFormat.Standard).value}-format experts registered"
  ok, why = cls.is_available()
  if not ok:
    return f"unavailable ({why})"
  experts = cls()
  if problem:
    why = experts.problem_support(*problem, quant=quant)
    if why:
      return f"cannot run this problem ({why})"
  return experts.quant_support(quant)


_RUNNER_WHAT = {"pallas_mosaic": "Pallas Mosaic GPU grouped GEMM", "xla": "XLA ragged_dot"}


def _auto_runner(quant: Optional[QuantConfig], fmt: Optional[ActivationFormat],
                 problem=None) -> tuple[str, str]:
  """(runner, reason): the first AUTO_RUNNERS candidate that passes, with why the better ones
  were skipped."""
  skipped = []
  for runner in AUTO_RUNNERS:
    why = runner_support(runner, quant, fmt, problem)
    if why is None:
      platform, cc, kind = platform_info()
      where = f"sm{cc[0]}{cc[1]} GPU ({kind})" if cc else f"platform={platform}"
      chose = f"{where}: {_RUNNER_WHAT.get(runner, runner)}"
      if quant is not None and quant.is_quantized:
        chose += f" for {quant}"
        if runner == "pallas_mosaic" and quant.act_dtype is None:
          chose += (" (weight-only: the decode_wq kernels at <= 128 slots where they take "
                    "the format, one slot or up to 8 slots of an expert per work item; past "
                    "that, or where slots share experts in a format the shared kernel lacks, "
                    "4-bit and int8 codes on the warp-specialized grouped_gemm_wq_ws GEMMs where "
                    "K and N are multiples of 64, else on the grouped_gemm_wq GEMMs while experts "
                    "average <= 512 rows; else the weights dequantized per call into the "
                    "bf16 kernels)")
        elif runner == "pallas_mosaic" and is_packed(quant):
          chose += (" (4-bit codes with fp8 tokens: at <= 128 slots where slots rarely "
                    "share experts the tokens dequantized to bf16 into the bf16-token decode "
                    "kernel, faster than its 8-bit MMA form (layout decode_fp8); elsewhere "
                    "mxfp4 on the grouped_gemm_w4a8 fp8 GEMMs (K and N multiples of 128), "
                    "the other formats with the tokens dequantized to bf16 into the "
                    "weight-only kernels, the intermediate bf16)")
      return runner, "; ".join(skipped + [chose])
    skipped.append(f"{runner} skipped: {why}")
  what = f"{quant}" if quant is not None and quant.is_quantized else "this call"
  raise ValueError(f"no runner backend can run {what}: {'; '.join(skipped)}")


# ragged_dedup's sort and packing cost about what all-gather saves at EP=2 (measured on 2 H200s,
# BENCHMARKS.md): it is chosen only when the all-gather would move this many times its bytes
DEDUP_BYTES_MARGIN = 2.0


def auto_ep_dispatch(ep: int, hidden_size: int, num_experts: int, top_k: int,
                     tokens_per_rank: int) -> tuple[str, str]:
  """("allgather" | "ragged_dedup", reason) from the bytes `sharding.comm_model` predicts.

  All-gather sends every token to every rank and needs no sort; its bytes grow with EP, while
  the deduplicated ragged all-to-all sends a token once to each rank holding one of its experts.
  """
  from jmoe.sharding import comm_model  # noqa: PLC0415 (sharding imports jmoe)
  kw = dict(hidden=hidden_size, top_k=top_k, num_experts=num_experts, ep=ep,
            tokens_per_rank=max(tokens_per_rank, 1))
  ag = comm_model.bytes_per_token("allgather", **kw)["total"]
  dd = comm_model.bytes_per_token("ragged_dedup", **kw)["total"]
  ratio = ag / dd if dd else float("inf")
  if ratio > DEDUP_BYTES_MARGIN:
    return "ragged_dedup", (f"EP={ep}: all-gather would send {ratio:.1f}x the bytes of the "
                            "deduplicated ragged all-to-all")
  return "allgather", (f"EP={ep}: all-gather sends {ratio:.1f}x the bytes of the deduplicated "
                       f"ragged all-to-all (<= {DEDUP_BYTES_MARGIN}x) and needs no sort")


def select_backend(runner_backend: str = "auto", a2a_backend: str = "auto", *,
                   quant: Optional[QuantConfig] = None,
                   parallel: Optional[ParallelConfig] = None,
                   problem: Optional[tuple] = None,
                   routing: Optional[tuple[int, int, int]] = None
                   ) -> tuple[PrepareFinalize, Experts, str]:
  """Choose the parts for one call; `problem` = (dtype, hidden_size, intermediate_size) when
  known, so that "auto" skips backends that cannot run it; `routing` = (num_experts, top_k,
  tokens per expert rank) when known, so that "auto" picks the EP dispatch by its bytes.

  Returns (prepare_finalize, experts, reason)."""
  runner, runner_why = _resolve("runner_backend", runner_backend, "JMOE_RUNNER_BACKEND",
                                RUNNER_BACKENDS)
  a2a, a2a_why = _resolve("a2a_backend", a2a_backend, "JMOE_A2A_BACKEND", A2A_BACKENDS)

  ep_size = parallel.axis_size(parallel.expert_axis) if parallel is not None else 1
  if a2a == "auto":
    if parallel is None or parallel.mesh is None:
      a2a, a2a_why = "none", "no mesh: no expert parallelism"
    elif parallel.a2a_backend != "auto":
      a2a, a2a_why = parallel.a2a_backend, f"a2a_backend={parallel.a2a_backend!r} from ParallelConfig"
    elif ep_size == 1 and parallel.axis_size(parallel.tensor_axis) == 1:
      a2a, a2a_why = "none", "expert axis of size 1"
    elif ep_size > 1 and routing is not None and problem is not None:
      a2a, a2a_why = auto_ep_dispatch(ep_size, problem[1], *routing)
    else:
      a2a, a2a_why = "allgather", "default EP dispatch: all-gather / reduce-scatter"
  backend = registry.A2A_BACKENDS.get(a2a)
  if backend is None:
    raise ValueError(f"a2a_backend={a2a!r} is not available (registered: "
                     f"{', '.join(registry.A2A_BACKENDS)})")
  if backend.needs_mesh and (parallel is None or parallel.mesh is None):
    raise ValueError(f"a2a_backend={a2a!r} needs parallel=ParallelConfig(mesh=...)")

  if runner == "auto":
    fmts = list(backend.by_format)
    runner, runner_why = _auto_runner(quant, fmts[0] if len(fmts) == 1 else None, problem)
  family = registry.RUNNERS.get(runner)
  if not family:
    raise ValueError(f"runner_backend={runner!r} is not available here (registered: "
                     f"{', '.join(registry.RUNNERS)})")
  reasons = []
  for fmt, pf_factory in backend.by_format.items():
    experts_cls = family.get(fmt)
    if experts_cls is None:
      reasons.append(f"runner_backend={runner!r} has no {fmt.value}-format experts")
      continue
    ok, why = experts_cls.is_available()
    if not ok:
      raise ValueError(f"runner_backend={runner!r} cannot run here: {why}")
    pf, experts = pf_factory(parallel), experts_cls()
    reason = compatibility(pf, experts, quant)
    if reason is None:
      why = "; ".join(w for w in (runner_why, a2a_why) if w)
      log.debug("jmoe oracle: %r + %r (%s)", pf, experts, why)
      return pf, experts, why
    reasons.append(reason)
  what = f"{quant}" if quant is not None and quant.is_quantized else "unquantized weights"
  raise ValueError(f"{what} cannot run with runner_backend={runner!r} and a2a_backend={a2a!r}: "
                   f"{reasons[0]}")
