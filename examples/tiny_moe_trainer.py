"""The training loop of `train_tiny_moe.py` (imported after the devices are set up)."""
from __future__ import annotations

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointing
from char_corpus import CharCorpus, batch as corpus_batch
from jmoe.layers import load_balance
from jmoe.models import MoETransformer, tiny_preset
from jmoe.sharding.mesh import make_ep_mesh, parallel_config


def scalar(x) -> float:
  """A replicated global scalar as a float (multi-process arrays are not fully addressable)."""
  return float(np.asarray(x.addressable_data(0)))


def host_array(x) -> np.ndarray:
  """A replicated global array on this host."""
  return np.asarray(x.addressable_data(0))


class Trainer:
  """Builds the mesh, model, optimizer and jitted step from the parsed args, and runs them."""

  def __init__(self, args):
    self.args = args
    self.is_main = jax.process_index() == 0
    self.corpus = CharCorpus.load(args.corpus) if args.corpus else CharCorpus.load()
    self.train_tokens, self.val_tokens = self.corpus.split()
    mesh = make_ep_mesh(data=args.data, expert=-1, tensor=1)
    self.mesh = mesh
    self.parallel = parallel_config(mesh)
    self.cfg = tiny_preset(args.preset, vocab_size=self.corpus.vocab_size,
                           hidden_size=args.hidden, num_layers=args.layers)
    self.batch_sharding = NamedSharding(mesh, P(("data", "expert"), None))
    self.model, self.optimizer = self.fresh_state()
    self.train_step = nnx.jit(self._train_step)
    self.eval_step = nnx.jit(self._eval_step)

  # ------------------------------------------------------------------------------------------
  # model, optimizer, batches

  def schedule(self):
    a = self.args
    return optax.warmup_cosine_decay_schedule(0.0, a.lr, warmup_steps=a.warmup,
                                              decay_steps=a.steps, end_value=a.lr * 0.1)

  def fresh_state(self):
    """(model, optimizer) initialized from the seed, every array placed by its sharding names."""
    a = self.args

    def make():
      return MoETransformer(self.cfg, rngs=nnx.Rngs(a.seed), parallel=self.parallel,
                            a2a_backend=a.a2a_backend, runner_backend=a.runner_backend)

    abstract = nnx.eval_shape(make)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s),
                             nnx.get_partition_spec(abstract_state))
    state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
    model = nnx.merge(graphdef, state)
    tx = optax.adamw(self.schedule(), b1=0.9, b2=0.95, weight_decay=a.weight_decay)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # the moments follow their params' shardings; the step count is born on one device:
    # replicate it over the mesh (a checkpoint restores into these shardings)
    opt_state = jax.tree.map(self.replicated, nnx.state(optimizer))
    nnx.update(optimizer, opt_state)
    return model, optimizer

  def replicated(self, x):
    if isinstance(getattr(x, "sharding", None), NamedSharding):
      return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, NamedSharding(self.mesh, P()),
                                        lambda idx: host[idx])

  def batch(self, step: int) -> jax.Array:
    """The global batch of `step` [B, S + 1], sharded over data x expert (any process count)."""
    a = self.args
    host = corpus_batch(self.train_tokens, step, a.batch, a.seq, a.seed)
    return jax.make_array_from_callback(host.shape, self.batch_sharding, lambda idx: host[idx])

  # ------------------------------------------------------------------------------------------
  # steps

  def _loss(self, model, tokens):
    logits, aux = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    total = ce + self.args.aux_coef * aux["load_balancing_loss"] \
        + self.args.z_coef * aux["router_z_loss"]
    return total, (ce, aux)

  def _train_step(self, model, optimizer, tokens):
    grads, (ce, aux) = nnx.grad(self._loss, has_aux=True)(model, tokens)
    optimizer.update(model, grads)
    if self.cfg.moe.use_correction_bias:  # DeepSeek-V3: balance by bias, outside the gradient
      for layer, load in zip(model.moe_layers(), aux["expert_load"]):
        layer.update_correction_bias(load, self.args.bias_rate)
    balance = jnp.mean(jnp.stack([load_balance(l) for l in aux["expert_load"]]))
    return dict(loss=ce, aux=aux["load_balancing_loss"], z=aux["router_z_loss"],
                balance=balance, dropped=aux["dropped"])

  def _eval_step(self, model, tokens):
    return self._loss(model, tokens)[1][0]

  # ------------------------------------------------------------------------------------------
  # the run

  def run(self) -> dict:
    a = self.args
    os.makedirs(a.out, exist_ok=True)
    ckpt_dir = os.path.abspath(os.path.join(a.out, "ckpt"))
    ckpt_step = a.ckpt_step if a.ckpt_step is not None else a.steps // 2
    start = 0
    if a.resume:
      start = checkpointing.restore(a.resume, self.model, self.optimizer)
    history, t0, compiled_at = [], time.time(), None
    progress = self._progress()
    with progress:
      task = progress.add_task("train", total=a.steps, completed=start, loss=float("nan"),
                               aux=float("nan"), bal=float("nan"))
      for step in range(start, a.steps):
        m = self.train_step(self.model, self.optimizer, self.batch(step))
        row = {k: scalar(v) for k, v in m.items()}
        row["step"] = step
        history.append(row)
        compiled_at = compiled_at or time.time()
        progress.update(task, advance=1, loss=row["loss"], aux=row["aux"], bal=row["balance"])
        if not a.no_ckpt and step + 1 == ckpt_step and not a.resume:
          checkpointing.save(ckpt_dir, self.model, self.optimizer, step + 1)
    t_end = time.time()
    elapsed = t_end - t0
    val = float(np.mean([scalar(self.eval_step(self.model, self._val_batch(i)))
                         for i in range(a.eval_batches)]))
    tail = history[-min(20, len(history)):]
    metrics = dict(
        preset=a.preset, steps=a.steps, processes=a.num_processes, devices=jax.device_count(),
        mesh=dict(self.mesh.shape), params=self.num_params(),
        unigram_entropy=self.corpus.unigram_entropy(), first_loss=history[0]["loss"],
        final_loss=float(np.mean([r["loss"] for r in tail])), val_loss=val,
        final_aux=float(np.mean([r["aux"] for r in tail])),
        final_balance=float(np.mean([r["balance"] for r in tail])),
        dropped=int(sum(r["dropped"] for r in history)), seconds=round(elapsed, 1),
        steps_per_s_after_compile=round((len(history) - 1) / max(t_end - compiled_at, 1e-9),
                                        2),
        losses=[r["loss"] for r in history])
    if not a.no_ckpt and not a.resume and ckpt_step < a.steps:
      metrics.update(self.resume_check(ckpt_dir, ckpt_step, history))
    if self.is_main:
      with open(os.path.join(a.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
      if not a.no_plot:
        metrics["plot"] = self.plot(history, os.path.join(a.out, "loss_curve.png"))
    return metrics

  def resume_check(self, ckpt_dir: str, ckpt_step: int, history: list) -> dict:
    """Restore the checkpoint into a fresh model + optimizer and take the next step: its loss
    must equal the uninterrupted run's."""
    model, optimizer = self.fresh_state()
    saved = checkpointing.restore(ckpt_dir, model, optimizer)
    m = self.train_step(model, optimizer, self.batch(saved))
    resumed = scalar(m["loss"])
    continuous = next(r["loss"] for r in history if r["step"] == saved)
    return dict(resume_step=saved, resume_loss=resumed, continuous_loss=continuous,
                resume_abs_diff=abs(resumed - continuous))

  def _val_batch(self, i: int) -> jax.Array:
    a = self.args
    host = corpus_batch(self.val_tokens, i, a.batch, a.seq, a.seed + 1)
    return jax.make_array_from_callback(host.shape, self.batch_sharding, lambda idx: host[idx])

  def num_params(self) -> int:
    return int(sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(self.model,
                                                                          nnx.Param))))

  def _progress(self):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress,  # noqa: PLC0415
                               TextColumn, TimeElapsedColumn, TimeRemainingColumn)
    cols = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("aux {task.fields[aux]:.3f}"),
            TextColumn("load max/mean {task.fields[bal]:.2f}"), TimeElapsedColumn(),
            TimeRemainingColumn()]
    return Progress(*cols, disable=self.args.no_progress or not self.is_main)

  def plot(self, history: list, path: str) -> str:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    steps = [r["step"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, [r["loss"] for r in history], label="train cross-entropy")
    ax1.axhline(self.corpus.unigram_entropy(), ls="--", c="gray", label="unigram entropy")
    ax1.set_xlabel("step")
    ax1.set_ylabel("nats / char")
    ax1.legend()
    ax2.plot(steps, [r["aux"] for r in history], label="load-balancing loss")
    ax2.plot(steps, [r["balance"] for r in history], label="expert load max / mean")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.suptitle(f"tiny {self.args.preset} MoE on {jax.device_count()} devices "
                 f"(mesh {dict(self.mesh.shape)})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
