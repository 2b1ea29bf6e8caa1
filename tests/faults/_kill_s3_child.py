"""Child process for test_kill_s3.py: saves checkpoints to an S3 bucket (the moto server of the
tests) until it is SIGKILLed.

Usage: python _kill_s3_child.py MODE PATH START

MODE  "path": ``sp.save`` of step START, START+1, ... to ``/bucket/key`` PATH, forever;
      "run": a CheckpointManager on the run at PATH (keep_last=2) restores its newest checkpoint
      (checking it is exactly the state saved for that step) and saves the following steps.
The store is configured from the environment the parent set (endpoint, credentials), with
5 MiB parts, so that the larger states (even steps) go up as multipart uploads.

The child prints "ready R" (R: the step it starts after; -1 for none), then "saving N" just
before each save and "saved N" after it, flushed at once.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

PART = 5 * 1024 * 1024
KEEP_LAST = 2
SMALL = (256, 1024)  # 1 MiB of float32
BIG = (1536, 1024)  # 6 MiB of float32: a multipart upload of two parts
RUN_OPTIONS: dict[str, Any] = {"keep_last": KEEP_LAST, "name": "killed-s3"}


def make_state(step: int) -> dict[str, Any]:
    """The state saved at ``step``: 1-7 MiB, a different shape on even and odd steps."""
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal(BIG if step % 2 == 0 else SMALL).astype(np.float32),
        "b": rng.standard_normal(257).astype(np.float16),
        "step": step,
        "tag": f"step {step}",
    }


def make_store() -> Any:
    """An S3 store configured from the environment, with 5 MiB parts (its writer lock is a
    lease object, :mod:`savepoint.storage.lease`)."""
    from savepoint.storage.objectstore import ObjectStore

    return ObjectStore("s3", part_size=PART)


def main() -> None:
    mode, path, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import savepoint as sp

    store = make_store()
    where = store.at(path)
    if mode == "path":
        print(f"ready {start - 1}", flush=True)
        step = start
        while True:
            print(f"saving {step}", flush=True)
            sp.save(where, make_state(step))
            print(f"saved {step}", flush=True)
            step += 1
    manager = sp.CheckpointManager(where, **RUN_OPTIONS)
    latest = manager.latest_step()
    step = -1
    if latest is not None:
        want = make_state(latest)
        into: dict[str, Any] = {
            "w": np.zeros_like(want["w"]),
            "b": np.zeros_like(want["b"]),
            "step": -1,
            "tag": "",
        }
        got = manager.restore(into)
        step = -1 if got is None else got
        same = all(np.array_equal(into[k], want[k]) for k in ("w", "b"))
        if step != latest or not same or into["step"] != latest or into["tag"] != want["tag"]:
            raise SystemExit(f"restored step {step}, not exactly the state saved for {latest}")
    print(f"ready {step}", flush=True)
    while True:
        step += 1
        print(f"saving {step}", flush=True)
        manager.save(step, make_state(step))
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
