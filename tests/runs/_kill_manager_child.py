"""Child process for test_manager.py's kill test: a training loop that saves through a
CheckpointManager until it is SIGKILLed.

Usage: python -W error _kill_manager_child.py RUN_DIR [WHERE:STEP]

On start it reopens the run, restores the newest checkpoint (checking it is exactly the state that
was saved for that step) and continues from the next step. It prints "ready" once restored, then
"saving N" just before each save and "saved N" after it, flushed at once.

WHERE:STEP makes the child SIGKILL itself at one point inside the save of STEP:

- ``alias``: after the checkpoint is committed, as latest/ or best/ is about to be swapped in;
- ``report``: after the aliases are swapped, as report.json is about to be replaced;
- ``discard``: after the report and aliases, as the first old checkpoint is about to be deleted
  (in the background step of the save, which the loop waits for before the next save when a kill
  point is set).

Each hook wraps the local store's call that takes the step (``LocalStore.put`` of report.json,
or the ``replace`` that renames the temporary a save wrote it under over report.json,
the ``rename``/``exchange`` that publishes an alias, the ``rename`` that moves a checkpoint away to
delete it) and fires only for that file, so the point is the same whatever the order of the
manager's other steps.
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


def install_kill_hook(where: str, at_step: int, current: list[int]) -> None:
    """Arrange the SIGKILL described in the module docstring (``current[0]`` is the step being
    saved)."""
    import os
    import signal

    from savepoint.storage.local import LocalStore

    def die() -> None:
        print(f"killed {where} {current[0]}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(name: str, fires: Any) -> None:
        real = getattr(LocalStore, name)

        def hooked(self: LocalStore, *args: Any, **kwargs: Any) -> Any:
            if current[0] == at_step and fires(*args):
                die()
            return real(self, *args, **kwargs)

        setattr(LocalStore, name, hooked)

    def alias(_staging: str, path: str) -> bool:
        return os.path.basename(path) in ("latest", "best")

    def moved_away(path: str, hidden: str) -> bool:  # the first step of deleting a checkpoint
        name, parent = os.path.basename(path), os.path.basename(os.path.dirname(path))
        return parent == "checkpoints" and name.startswith("step-") and "-tmp-" in hidden

    def report(path: str, *_: Any) -> bool:  # put in place, or under a temporary name
        name = os.path.basename(path)
        return name == "report.json" or name.startswith(".report.json.savepoint-tmp-")

    def report_in_place(_temporary: str, path: str) -> bool:
        return os.path.basename(path) == "report.json"

    if where == "report":
        wrap("put", report)
        wrap("replace", report_in_place)
    elif where == "alias":
        wrap("rename", alias)
        wrap("exchange", alias)
    elif where == "discard":
        wrap("rename", moved_away)
    else:
        raise SystemExit(f"unknown kill point {where!r}")


def main() -> None:
    import savepoint as sp

    directory = sys.argv[1]
    current = [-1]
    if len(sys.argv) > 2:
        where, at = sys.argv[2].split(":")
        install_kill_hook(where, int(at), current)
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
        if len(sys.argv) > 2:
            # The background step of the last save (verification, pruning) runs while
            # ``current`` still names that save, so a kill point fires in the save it names.
            manager.wait()
        current[0] = step
        manager.save(step, state, metrics(step))
        print(f"saved {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
