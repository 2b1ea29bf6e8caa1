"""Child process for test_manager.py's kill test: a training loop that saves through a
CheckpointManager until it is SIGKILLed.

Usage: python -W error _kill_manager_child.py RUN_DIR

On start it reopens the run, restores the newest checkpoint (checking it is exactly the state that
was saved for that step) and continues from the next step. It prints "ready" once restored, then
"saving N" just before each save and "saved N" after it, flushed at once.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

KEEP_LAST = 2
SHAPES = {"w1": (256, 512), "w2": (512, 256), "w3": (128, 256)}
RUN_OPTIONS: dict[str, Any] = {
    "keep_last": KEEP_LAST,
    "best_metric": "val",
    "best_mode": "min",
    "name": "killed",
    "variant": "v1",
    "config": {"lr": 0.01, "layers": [3, 4]},
    "num_params": sum(int(np.prod(s)) for s in SHAPES.values()),
}


def make_state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    state: dict[str, Any] = {
        k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()
    }
    state["step"] = step
    state["tag"] = f"step {step}"
    return state


def blank_state() -> dict[str, Any]:
    state: dict[str, Any] = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    state["step"] = -1
    state["tag"] = ""
    return state


def metrics(step: int) -> dict[str, float]:
    # Not monotone, so the best step moves around and is sometimes older than the last two.
    return {"val": float((step * 7) % 11) + 0.5, "loss": 1.0 / step}


def main() -> None:
    import savepoint as sp

    directory = sys.argv[1]
    manager = sp.CheckpointManager(directory, **RUN_OPTIONS)
    into = blank_state()
    restored = manager.restore(into)
    if restored is not None:
        want = make_state(restored)
        bad = [k for k in SHAPES if not np.array_equal(into[k], want[k])]
        if bad or into["step"] != restored or into["tag"] != want["tag"]:
            raise SystemExit(f"restored step {restored} does not match its saved state: {bad}")
    step = (restored or 0) + 1
    print("ready", flush=True)
    while True:
        state = make_state(step)
        manager.log(step, loss=metrics(step)["loss"])
        print(f"saving {step}", flush=True)
        manager.save(step, state, metrics(step))
        print(f"saved {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
