"""Save and restore an nnx model + optimizer with orbax, keeping every array's sharding."""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx


def _abstract(tree):
  """Arrays -> ShapeDtypeStructs with their shardings (what orbax restores into)."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                      tree)


def save(path: str, model: nnx.Module, optimizer: nnx.Optimizer, step: int) -> None:
  """Write {model, optimizer, step} under `path` (an absolute directory, created)."""
  state = {"model": nnx.to_pure_dict(nnx.state(model)),
           "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.abspath(path), state, force=True)
  with open(os.path.join(path, "STEP"), "w") as f:  # process 0 may write it; all read it
    f.write(str(step))


def restore(path: str, model: nnx.Module, optimizer: nnx.Optimizer) -> int:
  """Load `path` into `model` and `optimizer` in place (same shapes, same shardings); returns
  the step it was saved at."""
  model_state, opt_state = nnx.state(model), nnx.state(optimizer)
  target = {"model": _abstract(nnx.to_pure_dict(model_state)),
            "optimizer": _abstract(nnx.to_pure_dict(opt_state))}
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(os.path.abspath(path), target)
  nnx.replace_by_pure_dict(model_state, restored["model"])
  nnx.replace_by_pure_dict(opt_state, restored["optimizer"])
  nnx.update(model, model_state)
  nnx.update(optimizer, opt_state)
  with open(os.path.join(path, "STEP")) as f:
    return int(f.read())
