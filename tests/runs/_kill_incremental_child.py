"""Child process for test_incremental_crash.py: a training loop that saves through an incremental
CheckpointManager (keep_last=2) until it is SIGKILLed.

Usage: python -W error _kill_incremental_child.py RUN_DIR [async]

On start it reopens the run, restores the newest checkpoint (checking it is exactly the state
that was saved for that step) and continues from the next step. It prints "ready" once restored,
then "saved N" after each save returns, flushed at once.

The state of step ``s`` is deterministic: tensor ``i`` changes every ``i + 1`` steps (tensor 0 at
every step, the last one rarely), plus a frozen tensor and a few small entries, so that every
save reuses some blobs and writes others, and retention deletes blobs of retired checkpoints.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from savepoint.blobs import BlobPolicy

CHUNK = 16 << 10
POLICY = BlobPolicy(chunk_size=CHUNK, min_blob_bytes=8 << 10)
RUN_OPTIONS: dict[str, Any] = {"incremental": True, "keep_last": 2, "blob_policy": POLICY}
LAYERS = 4
LAYER = CHUNK // 4 + 100  # float32 elements: a chunk and a short one


def _layer(i: int, version: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(1000 * i + version).standard_normal(LAYER).astype(np.float32)


FROZEN = np.random.default_rng(7).standard_normal(4 * CHUNK // 4).astype(np.float32)


def make_state(step: int) -> dict[str, Any]:
    state: dict[str, Any] = {"frozen": FROZEN}
    for i in range(LAYERS):
        state[f"layer{i}"] = _layer(i, step // (i + 1))
    state["bias"] = np.full(16, step, np.float64)  # small: in the checkpoint's data file
    state["step"] = step
    return state


def blank_state() -> dict[str, Any]:
    state: dict[str, Any] = {"frozen": np.zeros_like(FROZEN)}
    for i in range(LAYERS):
        state[f"layer{i}"] = np.zeros(LAYER, np.float32)
    state["bias"] = np.zeros(16, np.float64)
    state["step"] = -1
    return state


def check_state(got: dict[str, Any], step: int) -> None:
    """Raise AssertionError unless ``got`` is bit for bit the state saved for ``step``."""
    want = make_state(step)
    assert set(got) == set(want), sorted(got)
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert got[key].tobytes() == value.tobytes(), f"step {step}: {key} differs"
        else:
            assert got[key] == value, key


def main() -> None:
    import savepoint as sp

    directory = sys.argv[1]
    async_save = len(sys.argv) > 2 and sys.argv[2] == "async"
    manager = sp.CheckpointManager(directory, async_save=async_save, **RUN_OPTIONS)
    into = blank_state()
    restored = manager.restore(into)
    if restored is not None:
        try:
            check_state(into, restored)
        except AssertionError as exc:
            raise SystemExit(
                f"restored step {restored} does not match its saved state: {exc}"
            ) from None
    step = (restored or 0) + 1
    print("ready", flush=True)
    while True:
        manager.save(step, make_state(step))
        print(f"saved {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
