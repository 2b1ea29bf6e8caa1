"""Child process for test_kill.py: saves known states to one path until it is killed.

Usage: python _kill_child.py PATH MODE FIRST [HOOK]

MODE  "loop": save FIRST, then the other state, alternating forever; "once": save FIRST, exit.
FIRST "A" or "B".
HOOK  optional: the child SIGKILLs itself at one precise step of the save (see HOOKS).

The child saves through a FaultyStore around the local disk: its hooks mark the phases and kill
at the chosen call. Environment: SAVEPOINT_TEST_NO_EXCHANGE=1 (and the "fallback-" hooks) make
the store answer that it cannot exchange, so replaces use the two-rename fallback.

After importing, the child prints "ready"; then, on entering each step of a save, a phase marker
("phase data", "phase manifest", ...), flushed at once, so the parent can aim its kills.
"""

from __future__ import annotations

import os
import signal
import sys
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


def _kill_self(call: object = None) -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    path, mode, first = sys.argv[1:4]
    hook = sys.argv[4] if len(sys.argv) > 4 else ""

    import savepoint as sp
    from savepoint.codecs import manifest as mf
    from savepoint.commit import names
    from savepoint.storage.faults import Call, FaultyStore
    from savepoint.storage.local import LocalStore

    target = os.path.abspath(path)
    exchange = os.environ.get("SAVEPOINT_TEST_NO_EXCHANGE") != "1" and not hook.startswith(
        "fallback-"
    )
    store = FaultyStore(LocalStore(), exchange=exchange)
    states = {w: make_state(w) for w in "AB"}

    def mark(phase: str) -> None:
        sys.stdout.write(f"phase {phase}\n")
        sys.stdout.flush()

    # Hooks that kill at one precise step (the store's calls are the steps).
    staging = f"*/.{os.path.basename(target)}{names.TMP_TAG}*"
    if hook == "mid-data":  # two data files complete, the others not started
        store.hook("finish", _kill_self, nth=2, path="*/data-*", after=True)
    elif hook == "mid-manifest":

        def half_manifest(call: Call) -> None:
            # A torn manifest: half its first bytes written into the staging directory.
            with open(call.path, "ab") as f:
                f.write(b'{"format": "savepoint"'[: (call.nbytes or 2) // 2])
            _kill_self()

        store.hook("write", half_manifest, path=f"*/{mf.NAME}")
    elif hook == "before-commit":  # every byte written, the staging directory not yet synced
        store.hook("sync_dir", _kill_self, path=staging)
    elif hook == "after-exchange":
        store.hook("exchange", _kill_self, after=True)
    elif hook == "mid-cleanup":

        def remove_some(call: Call) -> None:
            # The replaced checkpoint (a complete one, under its hidden name) loses its manifest
            # and one data file, then the process dies.
            if os.path.isfile(os.path.join(call.path, mf.NAME)):
                os.unlink(os.path.join(call.path, mf.NAME))
                os.unlink(os.path.join(call.path, sorted(os.listdir(call.path))[0]))
                _kill_self()

        store.hook("remove_tree", remove_some, times=None)
    elif hook == "fallback-between-renames":
        # The old checkpoint is hidden away, the new one not yet in place.
        store.hook("rename", _kill_self, path=target, after=True)
    elif hook == "fallback-after-renames":
        # The new one is in place, the old one not yet removed.
        store.hook("rename", _kill_self, nth=2, path=target, after=True)
    elif hook:
        raise SystemExit(f"unknown hook {hook!r}")

    # Phase markers for the parent's aimed kills.
    for kind, pattern, phase in [
        ("create_blob", "*/data-*", "data"),
        ("create_blob", f"*/{mf.NAME}", "manifest"),
        ("sync_dir", staging, "commit"),
        ("exchange", None, "exchange"),
        ("remove_tree", None, "cleanup"),
    ]:
        store.hook(kind, lambda call, phase=phase: mark(phase), path=pattern, times=None)

    print("ready", flush=True)
    which = first
    while True:
        mark("save")
        sp.save(
            store.at(target),
            states[which],
            metadata=metadata(which),
            max_file_bytes=MAX_FILE_BYTES,
        )
        mark("saved " + which)
        if mode == "once":
            return
        which = "B" if which == "A" else "A"


if __name__ == "__main__":
    main()
