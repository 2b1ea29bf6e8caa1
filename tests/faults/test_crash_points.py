"""A process death at every point of a save that replaces a checkpoint: the old one or the new one.

For each commit strategy, a save of NEW over OLD is first run to learn the changes it makes to
the store (the FaultyStore's call log). Then, for every k, the same save runs on a fresh store
holding OLD and "dies" right after its k-th change (``crash_after(k)``: a SimulatedCrash, and the
store frozen so that no cleanup runs). What the next process finds in the inner store must load
as exactly OLD or exactly NEW (never a mixture, never nothing), be OLD up to the commit point
and NEW after it; and a later save must succeed and leave nothing but its own checkpoint.

The crashed "process" saves under a pid that no longer exists, as a real one would have: the
rename strategy tidies only the temporaries of dead processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.storage.base import Store, walk
from savepoint.storage.faults import FaultyStore, SimulatedCrash
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore

from ._util import assert_same

MAX_FILE_BYTES = 4096  # three data files per state


def make_state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": {f"w{i}": rng.standard_normal((32, 32 + seed)).astype(np.float32) for i in range(3)},
        "step": np.int64(seed),
        "tag": f"state-{seed}",
    }


OLD, NEW, LATER = make_state(1), make_state(2), make_state(3)

# name -> (a fresh inner store, FaultyStore options)
STRATEGIES: dict[str, tuple[Callable[[], Store], dict[str, Any]]] = {
    "rename-exchange": (MemoryStore, {}),
    "rename-two-renames": (MemoryStore, {"exchange": False}),
    "manifest-last": (lambda: MemoryStore(atomic_rename=False), {}),
}


def save(where: Any, state: dict[str, Any]) -> None:
    sp.save(where, state, metadata={"tag": state["tag"]}, max_file_bytes=MAX_FILE_BYTES)


def loads_as(store: Store, path: str) -> str:
    """ "old" or "new": which state the checkpoint at ``path`` holds, exactly and verified."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sp.load(store.at(path))
        info = sp.verify(store.at(path))
    for warning in caught:  # a fallback replace that died between its two renames
        assert "an interrupted replace left its previous checkpoint" in str(warning.message)
        assert got["tag"] == OLD["tag"]
    which = "new" if got["tag"] == NEW["tag"] else "old"
    assert_same(got, NEW if which == "new" else OLD)
    assert info.metadata == {"tag": got["tag"]}
    return which


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(child.stdout)


def fresh(strategy: str, root: str) -> tuple[Store, FaultyStore, str]:
    make, options = STRATEGIES[strategy]
    inner = make()
    inner.makedirs(root)
    path = inner.join(root, "ckpt")
    save(inner.at(path), OLD)
    return inner, FaultyStore(inner, **options), path


def files_of(store: Store, root: str) -> list[str]:
    return sorted(p[len(root) :] for p in walk(store, root))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_crash_after_any_change_leaves_old_or_new(
    strategy: str, dead_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = "/runs/r"
    _, probe, path = fresh(strategy, root)
    save(probe.at(path), NEW)
    changes = probe.mutations()
    kinds = {c.kind for c in changes}
    assert {"create_blob", "write", "finish", "put"} <= kinds, kinds
    commit_kind = "put" if strategy == "manifest-last" else "exchange"
    assert commit_kind in kinds or "rename" in kinds

    outcomes = []
    for k in range(len(changes) + 1):
        inner, store, path = fresh(strategy, root)
        store.crash_after(k)
        with monkeypatch.context() as m:
            m.setattr(os, "getpid", lambda: dead_pid)
            with pytest.raises(SimulatedCrash):
                save(store.at(path), NEW)
        crashed_at = store.crashed
        assert crashed_at is not None
        which = loads_as(inner, path)
        outcomes.append(which)
        # The next process saves again: it succeeds and tidies what the dead one left.
        save(inner.at(path), LATER)
        assert_same(sp.load(inner.at(path)), LATER)
        if strategy == "manifest-last":
            assert len(inner.list(path)) == 1, (k, crashed_at, inner.list(path))
        else:
            assert inner.list(root) == ["ckpt"], (k, crashed_at, inner.list(root))
            names = [n for n in files_of(inner, path) if n.count("/") == 1]
            assert "/manifest.json" in names

    # Old until the commit point, new from there on: one switch, never back.
    switch = outcomes.index("new")
    assert outcomes[:switch] == ["old"] * switch and outcomes[switch:] == ["new"] * (
        len(outcomes) - switch
    ), outcomes
    assert outcomes[0] == "old" and outcomes[-1] == "new"
    point = changes[switch - 1]
    if strategy == "manifest-last":
        assert point.kind == "put" and point.path.endswith("/manifest.json"), point
    else:
        assert point.kind in ("exchange", "rename") and point.dest == path, point


def test_the_same_on_a_local_disk(
    tmp_path: Any, dead_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rename strategy as it runs on a real filesystem (exchange, then the two-rename
    # fallback), crash points sampled: the first, the last, and every third change between.
    for exchange in (True, False):
        root = str(tmp_path / f"exchange-{exchange}")
        inner = LocalStore()
        path = inner.join(root, "ckpt")
        inner.makedirs(root)
        save(path, OLD)
        probe = FaultyStore(inner, exchange=exchange)
        save(probe.at(path), NEW)
        changes = probe.mutations()
        swaps = ("exchange", "rename") if exchange else ("rename",)  # a refused exchange: no
        commit = 1 + next(i for i, c in enumerate(changes) if c.kind in swaps and c.dest == path)
        save(path, OLD)
        for k in sorted({0, commit - 1, commit, len(changes), *range(1, len(changes), 3)}):
            store = FaultyStore(inner, exchange=exchange)
            store.crash_after(k)
            with monkeypatch.context() as m:
                m.setattr(os, "getpid", lambda: dead_pid)
                with pytest.raises(SimulatedCrash):
                    save(store.at(path), NEW)
            assert loads_as(inner, path) == ("new" if k >= commit else "old"), (k, store.crashed)
            save(path, OLD)
            assert os.listdir(root) == ["ckpt"], (k, store.crashed, os.listdir(root))
