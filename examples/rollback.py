"""Roll a streaming model back to a snapshot when a constraint is violated, then carry on.

A small recurrent model (a stack of diagonal linear state-space layers with tanh mixing, numpy
only) reads an input stream one step at a time. Its state is one 32x8 float32 matrix per layer
plus the window of recent inputs it normalises with, so a rollback must bring back both.

The serving loop takes a snapshot every ``EVERY`` steps into a bounded ``SnapshotHistory``. At
step ``GLITCH`` a sensor glitch puts a spike into the stream; the output constraint
``|y| < LIMIT`` catches it at once. The loop then rolls back to the newest snapshot taken before
the glitch, restores the model from it (states in place, input window, step count), marks the
glitching input to be clamped, and replays from the snapshot's step. With ``--persist DIR`` the
snapshots are committed to ``DIR`` and the rollback goes through a freshly opened history, as a
restarted process would.

The run is then compared with one that never took the bad path (the same stream, clamped from
the start): the outputs after the rollback and the final state must be identical, bit for bit.
``tests/inference/test_rollback_example.py`` runs it both ways.

Run it: ``python examples/rollback.py [--persist DIR]``.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np

from savepoint.inference import InferenceSnapshot, SnapshotHistory

LAYERS, HIDDEN, STATE, INPUT, WINDOW = 4, 32, 8, 8, 16
STEPS, EVERY, GLITCH, LIMIT = 200, 10, 137, 5.0


def make_stream(steps: int = STEPS, seed: int = 1) -> np.ndarray:
    """The inputs, with a glitch (a spike of 100) at step GLITCH."""
    stream = np.random.default_rng(seed).standard_normal((steps, INPUT)).astype(np.float32)
    stream[GLITCH, 4] += 100.0
    return stream


def sanitize(x: np.ndarray) -> np.ndarray:
    clipped: np.ndarray = np.clip(x, -4.0, 4.0)
    return clipped


class RecurrentModel:
    """h_l <- decay_l * h_l + B_l u;  u <- tanh(sum_s C_l h_l) + u;  y = w . u + d . x."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        shape = (LAYERS, HIDDEN, STATE)
        self.decay = rng.uniform(0.8, 0.99, shape).astype(np.float32)
        self.b = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        self.c = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        self.w_in = (rng.standard_normal((HIDDEN, INPUT)) * 0.3).astype(np.float32)
        self.w_out = (rng.standard_normal(HIDDEN) * 0.05).astype(np.float32)
        self.d = (rng.standard_normal(INPUT) * 0.1).astype(np.float32)
        self.states = [np.zeros((HIDDEN, STATE), np.float32) for _ in range(LAYERS)]
        self.window: collections.deque[np.ndarray] = collections.deque(maxlen=WINDOW)
        self.step_count = 0
        self.config = {
            "max_context": WINDOW,
            "store_history": True,
            "num_layers": LAYERS,
            "hidden_dim": HIDDEN,
            "state_dim": STATE,
        }

    def step(self, x: np.ndarray) -> float:
        self.window.append(x.copy())
        centred = x - np.mean(np.stack(self.window), axis=0)
        u = np.tanh(self.w_in @ centred)
        for layer, h in enumerate(self.states):
            h *= self.decay[layer]  # the state is updated in place, step after step
            h += self.b[layer] * u[:, None]
            u = np.tanh((self.c[layer] * h).sum(axis=1)) + u
        self.step_count += 1
        return float(self.w_out @ u + self.d @ x)

    def restore(self, snapshot: InferenceSnapshot) -> None:
        snapshot.restore_into(self.states, self.window)
        self.step_count = snapshot.step_count


@dataclass
class Run:
    outputs: dict[int, float] = field(default_factory=dict)  # step -> output, as finally served
    model: RecurrentModel = field(default_factory=RecurrentModel)
    snapshots_taken: int = 0
    rollbacks: list[tuple[int, int]] = field(default_factory=list)  # (violation step, back to)


def serve(
    stream: np.ndarray,
    *,
    clamp: set[int] | None = None,
    every: int = EVERY,
    keep: int = 4,
    persist: str | None = None,
) -> Run:
    """The serving loop: snapshot every ``every`` steps, roll back on a violation."""
    clamp = set() if clamp is None else set(clamp)
    run = Run()
    model = run.model
    history = SnapshotHistory(keep, directory=persist)
    t = 0
    while t < len(stream):
        if t % every == 0:
            history.take(
                states=model.states,
                history=model.window,
                step_count=model.step_count,
                config=model.config,
                metadata={"model_id": "tiny-ssm", "description": f"before step {t}"},
            )
            run.snapshots_taken += 1
        x = sanitize(stream[t]) if t in clamp else stream[t]
        y = model.step(x)
        if abs(y) < LIMIT:
            run.outputs[t] = y
            t += 1
            continue
        # Violation: input t is the culprit. Find the newest snapshot taken before it.
        if persist is not None:
            history = SnapshotHistory(keep, directory=persist)  # as a restarted process would
        snapshot = history.rollback()
        while snapshot is not None and snapshot.step_count > t:
            snapshot = history.rollback()  # taken after the culprit: tainted
        if snapshot is None:
            raise RuntimeError(f"no snapshot before step {t} to roll back to")
        model.restore(snapshot)
        run.rollbacks.append((t, snapshot.step_count))
        for k in range(snapshot.step_count, t + 1):
            run.outputs.pop(k, None)  # retract what was served since the snapshot
        clamp.add(t)
        t = snapshot.step_count
    return run


def same_state(a: RecurrentModel, b: RecurrentModel) -> bool:
    return (
        a.step_count == b.step_count
        and all(x.tobytes() == y.tobytes() for x, y in zip(a.states, b.states))
        and [w.tobytes() for w in a.window] == [w.tobytes() for w in b.window]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="snapshot, violate, roll back, continue")
    parser.add_argument("--persist", help="commit snapshots to this directory (default: memory)")
    args = parser.parse_args()
    stream = make_stream()
    workdir = None
    persist = args.persist
    if persist == "tmp":
        workdir = persist = tempfile.mkdtemp(prefix="savepoint-rollback-")
    try:
        rolled = serve(stream, persist=persist)
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    clean = serve(stream, clamp={GLITCH})
    for violation, back_to in rolled.rollbacks:
        print(f"step {violation}: |y| >= {LIMIT}, rolled back to the snapshot of step {back_to}")
    print(f"{len(rolled.outputs)} outputs served, {rolled.snapshots_taken} snapshots taken")
    matches = rolled.outputs == clean.outputs and same_state(rolled.model, clean.model)
    print(f"continuation matches the run that never took the bad path: {matches}")
    if not matches:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
