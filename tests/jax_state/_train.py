"""A Flax NNX + optax training loop under a CheckpointManager, on 8 forced host devices (data
parallel: the batch split over the devices, the state replicated), run by test_jax_resume.py.

Usage: ``python _train.py RUN [--kill-at STEP] [--async]``: trains to STEPS, resuming from the
run's latest checkpoint if there is one; ``--kill-at``: SIGKILL right after that step (and its
save, if it saves then). The state is a dict (the model's nnx.State with its BatchNorm
statistics and dropout RNG, the optax adamw state, the step), so ``mgr.restore(state)``
replaces its entries; the batch of each step is drawn from the step number alone, so a resumed
run sees the batches an unbroken one would."""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import savepoint as sp

STEPS = 24
SAVE_EVERY = 5
MESH = Mesh(np.array(jax.devices()), ("data",))
REPLICATED = NamedSharding(MESH, P())
BATCH = NamedSharding(MESH, P("data"))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.fc = nnx.Linear(8, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.out(self.drop(nnx.relu(self.bn(self.fc(x)))))


TX = optax.adamw(3e-3)
GRAPH, _ = nnx.split(Net(nnx.Rngs(0, dropout=1)))


def fresh() -> dict[str, Any]:
    model = Net(nnx.Rngs(0, dropout=1))
    arrays = {"model": nnx.state(model), "opt": TX.init(nnx.state(model, nnx.Param))}
    return {**jax.device_put(arrays, REPLICATED), "step": 0}


@jax.jit
def train_step(model_state: Any, opt_state: Any, x: Any, y: Any) -> Any:
    model = nnx.merge(GRAPH, model_state)

    def loss_fn(m: Any) -> Any:
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    updates, opt_state = TX.update(grads, opt_state, params)
    nnx.update(model, optax.apply_updates(params, updates))
    return nnx.state(model), opt_state, loss


def batch(step: int) -> tuple[Any, Any]:
    x = jax.random.normal(jax.random.fold_in(jax.random.key(42), step), (64, 8))
    y = jnp.sin(x).sum(axis=1, keepdims=True)
    return jax.device_put(x, BATCH), jax.device_put(y, BATCH)


def train(run: str, kill_at: int | None, async_save: bool) -> None:
    state = fresh()
    with sp.CheckpointManager(run, keep_last=2, async_save=async_save) as mgr:
        mgr.restore(state)
        while state["step"] < STEPS:
            step = state["step"] + 1
            state["model"], state["opt"], loss = train_step(
                state["model"], state["opt"], *batch(step)
            )
            state["step"] = step
            mgr.log(step, loss=float(loss))
            if step % SAVE_EVERY == 0 or step == STEPS:
                mgr.save(step, state, force=True)
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--async", dest="async_save", action="store_true")
    args = parser.parse_args()
    train(args.run, args.kill_at, args.async_save)
