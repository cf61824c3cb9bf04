"""2 processes x 4 CPU devices on localhost (`jax.distributed.initialize`, gloo collectives):
the expert-parallel layer over the 8-device global mesh matches the single-device reference.

The test launches this file as a worker twice (`python tests/test_multiprocess.py WORKER ...`).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BACKENDS = (("allgather", "xla"), ("ragged_a2a", "xla"), ("padded_a2a", "xla_batched"))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker(process_id: int, port: int) -> None:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, initialization_timeout=60)
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jmoe
  from jmoe.sharding.mesh import make_parallel

  assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
  t, h, n, e, k = 32, 16, 8, 16, 4
  rng = np.random.default_rng(0)  # the same data in both processes
  x = rng.normal(size=(t, h)).astype(np.float32)
  w13 = (rng.normal(size=(e, h, 2 * n)) / 4).astype(np.float32)
  w2 = (rng.normal(size=(e, n, h)) / 3).astype(np.float32)
  logits = rng.normal(size=(t, e)).astype(np.float32)
  tw, ti = jmoe.select_experts(jnp.asarray(x), jnp.asarray(logits), k)
  tw, ti = np.asarray(tw), np.asarray(ti)
  local = jax.local_devices()[0]
  with jax.default_device(local):
    ref = np.asarray(jmoe.fused_moe(jnp.asarray(x), jnp.asarray(w13), jnp.asarray(w2),
                                    jnp.asarray(tw), jnp.asarray(ti),
                                    runner_backend="reference"))

  for mesh_kw in (dict(expert=8), dict(data=2, expert=2, tensor=2)):
    par = make_parallel(**mesh_kw)

    def put(a, spec):
      sh = NamedSharding(par.mesh, spec)
      return jax.make_array_from_callback(a.shape, sh, lambda idx: a[idx])

    tok = P(tuple(ax for ax in (par.data_axis, par.expert_axis) if ax), None)
    gx, gtw, gti = put(x, tok), put(tw, tok), put(ti, tok)
    gw13, gw2 = put(w13, P(par.expert_axis)), put(w2, P(par.expert_axis))
    for a2a, runner in BACKENDS:
      f = jax.jit(lambda x, w13, w2, tw, ti: jmoe.fused_moe(
          x, w13, w2, tw, ti, a2a_backend=a2a, runner_backend=runner, parallel=par))
      out = multihost_utils.process_allgather(f(gx, gw13, gw2, gtw, gti), tiled=True)
      err = float(np.max(np.abs(np.asarray(out) - ref)))
      assert err < 1e-4, (mesh_kw, a2a, err)
      print(f"OK process={process_id} mesh={mesh_kw} {a2a} err={err:.2e}", flush=True)

  # fp8 dispatch across the processes: the layer on fp8-rounded tokens
  from jmoe.quant import dequantize_rows_fp8, quantize_rows_fp8
  par = make_parallel(expert=8, dispatch_dtype="fp8")
  with jax.default_device(local):
    xq = dequantize_rows_fp8(*quantize_rows_fp8(jnp.asarray(x)), jnp.float32)
    ref_q = np.asarray(jmoe.fused_moe(xq, jnp.asarray(w13), jnp.asarray(w2), jnp.asarray(tw),
                                      jnp.asarray(ti), runner_backend="reference"))
  tok = P(par.expert_axis, None)
  put = lambda a, spec: jax.make_array_from_callback(  # noqa: E731
      a.shape, NamedSharding(par.mesh, spec), lambda idx: a[idx])
  f = jax.jit(lambda x, w13, w2, tw, ti: jmoe.fused_moe(
      x, w13, w2, tw, ti, a2a_backend="ragged_dedup", runner_backend="xla", parallel=par))
  out = multihost_utils.process_allgather(
      f(put(x, tok), put(w13, P("expert")), put(w2, P("expert")), put(tw, tok), put(ti, tok)),
      tiled=True)
  err = float(np.max(np.abs(np.asarray(out) - ref_q)))
  assert err < 1e-4, ("fp8 dispatch", err)
  print(f"OK process={process_id} fp8 dispatch ragged_dedup err={err:.2e}", flush=True)
  jax.distributed.shutdown()


@pytest.mark.slow  # 17-24 s; CI's .ci/run runs the slow tier too
def test_two_processes_four_devices_each():
  port = _free_port()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "WORKER", str(i),
                             str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  t0 = time.time()
  outs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=max(5.0, 240 - (time.time() - t0)))
      outs.append(out)
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail("multi-process EP run timed out")
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    assert out.count("OK process=") == 2 * len(BACKENDS) + 1, out[-4000:]


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "WORKER":
  worker(int(sys.argv[2]), int(sys.argv[3]))
