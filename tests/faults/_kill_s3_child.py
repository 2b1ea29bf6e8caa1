"""Child process for test_kill_s3.py: saves checkpoints to an S3 bucket (the moto server of the
tests) until it is SIGKILLed.

Usage: python _kill_s3_child.py MODE PATH START [AIM]

MODE  "path": ``sp.save`` of step START, START+1, ... to ``/bucket/key`` PATH, forever;
      "run": a CheckpointManager on the run at PATH (keep_last=2) restores its newest checkpoint
      (checking it is exactly the state saved for that step) and saves the following steps.
The store is configured from the environment the parent set (endpoint, credentials), with
5 MiB parts, so that the larger states (even steps) go up as multipart uploads.

The child prints "ready R" (R: the step it starts after; -1 for none), then "saving N" just
before each save and "saved N" after it, flushed at once.

AIM (one of :data:`AIMS`) stops the first save of an even step (a multipart upload) at one
moment, so that the parent's kill lands there for certain: "mid-upload" once the first part of
its data is up and the upload is not complete (an open multipart upload, which gc must abort),
"before-commit" once its data is up and its generation's manifest is not (an uncommitted
generation, which gc must remove), "after-commit" once the manifest is up and the run's books
are not (the step is committed but unrecorded: it must load as the newest). The child prints
"AIM N" there and waits to be killed.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any

import numpy as np

PART = 5 * 1024 * 1024
KEEP_LAST = 2
SMALL = (256, 1024)  # 1 MiB of float32
BIG = (1536, 1024)  # 6 MiB of float32: a multipart upload of two parts
RUN_OPTIONS: dict[str, Any] = {"keep_last": KEEP_LAST, "name": "killed-s3"}
AIMS = ("mid-upload", "before-commit", "after-commit")
_GEN_FILE = re.compile(r".*/checkpoints/step-(\d{10,})/gen-[^/]+/(manifest\.json|data-.*)")


def make_state(step: int) -> dict[str, Any]:
    """The state saved at ``step``: 1-7 MiB, a different shape on even and odd steps."""
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal(BIG if step % 2 == 0 else SMALL).astype(np.float32),
        "b": rng.standard_normal(257).astype(np.float16),
        "step": step,
        "tag": f"step {step}",
    }


def make_store(aim: str = "") -> Any:
    """An S3 store configured from the environment, with 5 MiB parts (its writer lock is a
    lease object, :mod:`savepoint.storage.lease`); with ``aim``, one that stops the first
    even-step save there (see the module docstring)."""
    from savepoint.storage.objectstore import ObjectStore

    if not aim:
        return ObjectStore("s3", part_size=PART)
    if aim not in AIMS:
        raise SystemExit(f"unknown aim {aim!r}")

    def aimed_step(path: str, kind: str) -> int | None:
        m = _GEN_FILE.fullmatch(path)
        if m is None or int(m.group(1)) % 2 or not m.group(2).startswith(kind):
            return None
        return int(m.group(1))

    class Aimed(ObjectStore):
        def put(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
            step = aimed_step(path, "manifest")
            if step is not None and aim == "before-commit":
                _wait_for_the_kill(f"{aim} {step}")
            super().put(path, data, exclusive=exclusive)
            if step is not None and aim == "after-commit":
                _wait_for_the_kill(f"{aim} {step}")

        def create_blob(self, path: str, *, size: int | None = None, direct: bool = True) -> Any:
            writer = super().create_blob(path, size=size, direct=direct)
            step = aimed_step(path, "data-")
            if step is None or aim != "mid-upload":
                return writer
            finish = writer.finish

            def stop_before_finishing() -> None:
                if writer._upload is not None:  # the multipart upload its first part opened
                    writer._upload.flush()  # that part is up
                    _wait_for_the_kill(f"{aim} {step}")
                finish()

            writer.finish = stop_before_finishing
            return writer

    return Aimed("s3", part_size=PART)


def _wait_for_the_kill(line: str) -> None:
    print(line, flush=True)
    while True:
        time.sleep(60)


def main() -> None:
    mode, path, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
    aim = sys.argv[4] if len(sys.argv) > 4 else ""
    import savepoint as sp

    store = make_store(aim)
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
