"""Child process for test_kill.py: saves known states to one path until it is killed.

Usage: python _kill_child.py PATH MODE FIRST [HOOK]

MODE  "loop": save FIRST, then the other state, alternating forever; "once": save FIRST, exit.
FIRST "A" or "B".
HOOK  optional: the child SIGKILLs itself at one precise step of the save (see HOOKS).

Environment: SAVEPOINT_TEST_NO_EXCHANGE=1 disables renameat2(RENAME_EXCHANGE), so replaces use
the two-rename fallback.

After importing, the child prints "ready"; then, on entering each step of a save, a phase marker
("phase data", "phase manifest", ...), flushed at once, so the parent can aim its kills.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

MAX_FILE_BYTES = 600_000


def make_state(which: str) -> dict[str, Any]:
    """State A or B: ~3.5 MiB over several tensors; they differ in values and in structure."""
    rng = np.random.default_rng({"A": 1, "B": 2}[which])
    state: dict[str, Any] = {
        "model": {f"w{i}": rng.standard_normal((256, 512)).astype(np.float32) for i in range(6)},
        "emb": rng.standard_normal((1000 if which == "A" else 900, 64)).astype(ml_dtypes.bfloat16),
        "opt": {
            "step": np.int64(100 if which == "A" else 200),
            "lr": 0.1 if which == "A" else 0.05,
        },
        "which": which,
        "history": [which, {"A": 1, "B": 2}[which], None],
    }
    if which == "B":
        state["model"]["bias"] = rng.standard_normal(512).astype(np.float16)
    return state


def metadata(which: str) -> dict[str, Any]:
    return {"which": which}


def _kill_self() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    path, mode, first = sys.argv[1:4]
    hook = sys.argv[4] if len(sys.argv) > 4 else ""

    import savepoint as sp
    from savepoint import _writer
    from savepoint.commit import atomic
    from savepoint.storage import local

    states = {w: make_state(w) for w in "AB"}

    def mark(phase: str) -> None:
        sys.stdout.write(f"phase {phase}\n")
        sys.stdout.flush()

    def wrap(module: Any, name: str, phase: str, after: Callable[..., None] | None = None) -> None:
        real = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            mark(phase)
            result = real(*args, **kwargs)
            if after is not None:
                after(result, *args)
            return result

        setattr(module, name, wrapper)

    if os.environ.get("SAVEPOINT_TEST_NO_EXCHANGE") == "1":
        atomic.exchange = lambda a, b: False  # type: ignore[assignment]

    # Hooks that kill at one precise step.
    if hook == "mid-data":
        calls = {"n": 0}

        def after_file(result: Any, *args: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 2:  # two data files complete, the others not started
                _kill_self()

        wrap(local, "write_file", "data-file", after_file)
    elif hook == "mid-manifest":

        def half_manifest(path_: str, data: bytes) -> None:
            fd = os.open(path_, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data[: len(data) // 2])
            _kill_self()

        local.write_small = half_manifest  # type: ignore[assignment]
    elif hook == "before-commit":
        atomic.commit = lambda staging, target: _kill_self()  # type: ignore[assignment]
    elif hook == "after-exchange":
        real_exchange = atomic.exchange

        def exchange_then_die(a: str, b: str) -> bool:
            if real_exchange(a, b):
                _kill_self()
            return False

        atomic.exchange = exchange_then_die  # type: ignore[assignment]
    elif hook == "mid-cleanup":
        real_remove = atomic.remove_tree

        def remove_some(p: str) -> None:
            # The replaced checkpoint (a complete one, under its hidden name) loses its manifest
            # and one data file, then the process dies.
            if os.path.isfile(os.path.join(p, "manifest.json")):
                os.unlink(os.path.join(p, "manifest.json"))
                os.unlink(os.path.join(p, sorted(os.listdir(p))[0]))
                _kill_self()
            real_remove(p)

        atomic.remove_tree = remove_some  # type: ignore[assignment]
    elif hook in ("fallback-between-renames", "fallback-after-renames"):
        atomic.exchange = lambda a, b: False  # type: ignore[assignment]
        real_rename = os.rename
        target = os.path.abspath(path)

        def rename_then_die(src: str, dst: str) -> None:
            real_rename(src, dst)
            if hook == "fallback-between-renames" and src == target:
                _kill_self()  # the old checkpoint is hidden away, the new one not yet in place
            if hook == "fallback-after-renames" and dst == target:
                _kill_self()  # the new one is in place, the old one not yet removed

        atomic.os.rename = rename_then_die  # type: ignore[attr-defined]
    elif hook:
        raise SystemExit(f"unknown hook {hook!r}")

    # Phase markers for the parent's aimed kills.
    wrap(atomic, "clean_stale", "clean-stale")
    wrap(_writer, "write_files", "data")
    wrap(local, "write_small", "manifest")
    wrap(atomic, "commit", "commit")
    wrap(atomic, "exchange", "exchange")
    wrap(atomic, "remove_tree", "cleanup")

    print("ready", flush=True)
    which = first
    while True:
        mark("save")
        sp.save(path, states[which], metadata=metadata(which), max_file_bytes=MAX_FILE_BYTES)
        mark("saved " + which)
        if mode == "once":
            return
        which = "B" if which == "A" else "A"


if __name__ == "__main__":
    main()
