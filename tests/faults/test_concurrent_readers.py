"""Readers racing a writer that replaces the same checkpoint: never a false corruption.

``sp.save`` over an existing checkpoint writes a hidden sibling, swaps it into place
(``renameat2(RENAME_EXCHANGE)``, or two renames where exchange is unavailable) and deletes the
previous generation. A reader that opened the previous generation must still return it whole
(its files are pinned), and one whose generation vanished before it was pinned must retry on the
new one: every load, verify and inspect returns exactly one of the two states the writer
alternates between, and none raises.

The timed races run a writer process (this file run as a script) against reader threads and a
reader process; ``SAVEPOINT_TORTURE_SECONDS`` (``make torture``) makes them long. The injected
races below replace the checkpoint at one precise moment of a load, deterministically (a hook of
a FaultyStore around the local disk, at the reader's call).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.commit import names
from savepoint.commit.transaction import discard
from savepoint.storage import local
from savepoint.storage.faults import Call, Fault, FaultyStore
from savepoint.storage.local import LocalStore
from savepoint.storage.paths import Location

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="renameat2 and unlink-while-open semantics"
)

N_TENSORS = 6
MAX_FILE_BYTES = 8 << 10  # every tensor below is bigger: one data file each
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def make_state(which: int) -> dict[str, Any]:
    """State ``which`` (0 or 1): same keys, shapes and dtypes, different bytes everywhere."""
    rng = np.random.default_rng(1000 + which)
    model = {
        f"w{i}": rng.standard_normal(2304 + 256 * i).astype(np.float32) for i in range(N_TENSORS)
    }
    return {"which": which, "model": model, "step": np.array(10 * which, dtype=np.int64)}


STATES = {w: make_state(w) for w in (0, 1)}


def save(path: str | os.PathLike[str] | Location, which: int) -> None:
    sp.save(path, STATES[which], metadata={"which": which}, max_file_bytes=MAX_FILE_BYTES)


# ---------------------------------------------------------------------------------------------
# checking what a reader got: exactly one state, never a mixture
# ---------------------------------------------------------------------------------------------


def check_model(model: Any, which: int, where: str) -> None:
    want = STATES[which]["model"]
    assert isinstance(model, dict) and sorted(model) == sorted(want), f"{where}: keys"
    for key, array in want.items():
        got = np.asarray(model[key])
        assert got.dtype == array.dtype and got.shape == array.shape, f"{where}: {key} shape"
        assert got.tobytes() == array.tobytes(), f"{where}: {key} holds bytes of another state"


def check_tree(tree: Any, where: str) -> int:
    which = tree["which"]
    assert which in STATES, f"{where}: which={which!r}"
    check_model(tree["model"], which, where)
    assert int(tree["step"]) == 10 * which, f"{where}: step of another state"
    return int(which)


def check_info(info: sp.CheckpointInfo, where: str) -> int:
    which = info.metadata["which"]
    assert which in STATES and info.values["which"] == which, f"{where}: metadata and values"
    sizes = {t.key: t.nbytes for t in info.tensors}
    assert sizes == {f"model/w{i}": (2304 + 256 * i) * 4 for i in range(N_TENSORS)} | {"step": 8}, (
        f"{where}: tensors"
    )
    return int(which)


def op_load(path: Any, held: collections.deque[tuple[int, Any]]) -> int:
    return check_tree(sp.load(path), "load")


def op_load_keys(path: Any, held: collections.deque[tuple[int, Any]]) -> int:
    # Two tensors in two data files, plus a plain value from the manifest.
    got = sp.load(path, keys=["which", "model/w1", "model/w3"])
    which = got["which"]
    assert which in STATES
    for key in ("w1", "w3"):
        want = STATES[which]["model"][key]
        assert got["model"][key].tobytes() == want.tobytes(), f"load(keys=): {key} of another state"
    return int(which)


def op_load_into(path: Any, held: collections.deque[tuple[int, Any]]) -> int:
    into = {
        "which": -1,
        "model": {k: np.zeros_like(v) for k, v in STATES[0]["model"].items()},
        "step": np.zeros((), dtype=np.int64),
    }
    sp.load(path, into=into)
    return check_tree(into, "load(into=)")


def op_load_mmap(path: Any, held: collections.deque[tuple[int, Any]]) -> int:
    tree = sp.load(path, mmap=True)
    which = check_tree(tree, "load(mmap=True)")
    # Look again at an mmap load from a few iterations ago: by now the writer has most likely
    # replaced that generation and deleted its files; the mapping must still hold its bytes.
    held.append((which, tree))
    if len(held) > 3:
        old_which, old = held.popleft()
        assert check_tree(old, "load(mmap=True), later") == old_which
    return which


def op_load_first(path: Any, held: collections.deque[tuple[int, Any]]) -> int:
    return check_tree(sp.load(path, verify="first"), "load(verify='first')")


def op_load_unverified(path: Any, held: collections.deque[tuple[int, Any]]) -> int:
    return check_tree(sp.load(path, verify=False), "load(verify=False)")


def op_verify(path: Any, held: collections.deque[tuple[int, Any]]) -> int:
    return check_info(sp.verify(path), "verify")


def op_inspect(path: Any, held: collections.deque[tuple[int, Any]]) -> int:
    return check_info(sp.inspect(path), "inspect")


OPS: dict[str, Callable[[Any, collections.deque[tuple[int, Any]]], int]] = {
    "load": op_load,
    "load(keys=)": op_load_keys,
    "load(into=)": op_load_into,
    "load(mmap=True)": op_load_mmap,
    "load(verify='first')": op_load_first,
    "load(verify=False)": op_load_unverified,
    "verify": op_verify,
    "inspect": op_inspect,
}


def read_loop(path: str, seconds: float, offset: int = 0) -> dict[str, Any]:
    """Run every op in turn for ``seconds``; count the states seen and every exception."""
    seen: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    examples: list[str] = []
    held: collections.deque[tuple[int, Any]] = collections.deque()
    names = list(OPS)
    end = time.monotonic() + seconds
    i = offset
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a spurious "interrupted replace" warning is a failure
        while time.monotonic() < end:
            name = names[i % len(names)]
            i += 1
            try:
                which = OPS[name](path, held)
            except Exception as exc:  # every outcome but a clean state is what we count
                errors[f"{name}: {type(exc).__name__}"] += 1
                if len(examples) < 10:
                    examples.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            seen[f"{name}: state {which}"] += 1
    return {"seen": dict(seen), "errors": dict(errors), "examples": examples}


# ---------------------------------------------------------------------------------------------
# the writer and reader processes (this file run as a script)
# ---------------------------------------------------------------------------------------------


def writer_main(path: str, stop: str, mode: str, limit: float) -> None:
    """Replace ``path`` with state 0, 1, 0, ... until ``stop`` exists; print the count."""
    # "rename": the two-rename fallback of filesystems that cannot exchange.
    where = FaultyStore(LocalStore(), exchange=False).at(path) if mode == "rename" else path
    saves = 0
    end = time.monotonic() + limit
    print("ready", flush=True)
    while not os.path.exists(stop) and time.monotonic() < end:
        save(where, (saves + 1) % 2)
        saves += 1
    print(json.dumps({"saves": saves}), flush=True)


class Writer:
    def __init__(self, path: Path, mode: str, limit: float) -> None:
        self.stop = path.parent / "stop-writer"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "writer", str(path), str(self.stop), mode, str(limit)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        assert first.strip() == "ready", first + self.proc.stderr.read()  # type: ignore[union-attr]

    def finish(self) -> int:
        self.stop.touch()
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, f"writer failed:\n{err}"
        return int(json.loads(out.strip().splitlines()[-1])["saves"])


def reader_process(path: Path, seconds: float, offset: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "reader", str(path), str(seconds), str(offset)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def merge(into: dict[str, Any], part: dict[str, Any]) -> None:
    for field in ("seen", "errors"):
        for k, v in part[field].items():
            into[field][k] = into[field].get(k, 0) + v
    into["examples"] += part["examples"]


def race(path: Path, mode: str, seconds: float, threads: int, processes: int) -> dict[str, Any]:
    """A writer replacing ``path`` while readers load in a loop for ``seconds``."""
    save(path, 0)
    writer = Writer(path, mode, limit=seconds + 120)
    total: dict[str, Any] = {"seen": {}, "errors": {}, "examples": []}
    try:
        procs = [reader_process(path, seconds, 3 * k) for k in range(processes)]
        parts: list[dict[str, Any]] = []
        workers = [
            threading.Thread(
                target=lambda k=k: parts.append(read_loop(str(path), seconds, 5 * k + 1))
            )
            for k in range(threads)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        for p in procs:
            out, err = p.communicate(timeout=seconds + 120)
            assert p.returncode == 0, f"reader process failed:\n{err}"
            parts.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        saves = writer.finish()
    for part in parts:
        merge(total, part)
    total["saves"] = saves
    return total


def assert_clean(result: dict[str, Any]) -> None:
    loads = sum(result["seen"].values())
    failed = sum(result["errors"].values())
    assert failed == 0, (
        f"{failed} of {loads + failed} reads failed while {result['saves']} replaces ran: "
        f"{result['errors']}\n" + "\n".join(result["examples"])
    )
    assert result["saves"] >= 10, f"the writer only replaced the checkpoint {result['saves']} times"
    assert loads >= 50, f"only {loads} reads ran"
    states = {key.rsplit(" ", 1)[1] for key in result["seen"]}
    assert states == {"0", "1"}, f"readers saw only state(s) {states}: {result['seen']}"


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "default_seconds"), [("exchange", 4.0), ("rename", 2.0)])
def test_readers_racing_a_replacing_writer_never_fail(
    tmp_path: Path, mode: str, default_seconds: float
) -> None:
    from _torture import SECONDS

    seconds = default_seconds if SECONDS <= 0 else SECONDS / 2
    assert_clean(race(tmp_path / "ckpt", mode, seconds, threads=2, processes=1))


@pytest.mark.slow
def test_reader_processes_racing_a_replacing_writer_torture(tmp_path: Path) -> None:
    """The long campaign: ``SAVEPOINT_TORTURE_SECONDS`` of reader processes (default 1.5 s)."""
    from _torture import seconds

    assert_clean(race(tmp_path / "ckpt", "exchange", seconds(1.5), threads=0, processes=2))


# ---------------------------------------------------------------------------------------------
# the same races, injected at one precise moment
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def ckpt0(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    save(path, 0)
    return path


def faulty() -> FaultyStore:
    return FaultyStore(LocalStore())


def replace_once_at(store: FaultyStore, kind: str, pattern: str, path: Path, which: int) -> Fault:
    """At the first ``kind`` call of ``store`` on a path matching ``pattern``, replace ``path``
    with state ``which`` first (deleting the generation a reader may hold)."""
    return store.hook(kind, lambda call: save(path, which), path=pattern)


DATA = "*.safetensors"
MANIFEST = "*/manifest.json"
DATA_OPS = [name for name in OPS if name != "inspect"]  # the ops that read data files


@pytest.mark.parametrize("name", DATA_OPS)
def test_generation_replaced_before_its_data_files_were_opened(ckpt0: Path, name: str) -> None:
    # The reader has the old generation's manifest; its data files are deleted before it opens
    # them. Before the fix: "data file ... is missing" (CorruptCheckpointError).
    store = faulty()
    fired = replace_once_at(store, "open_blob", DATA, ckpt0, 1)
    assert OPS[name](store.at(str(ckpt0)), collections.deque()) == 1  # retried on the new one
    assert fired.fired


@pytest.mark.parametrize("name", list(OPS))
def test_generation_replaced_before_its_manifest_was_read(ckpt0: Path, name: str) -> None:
    # The reader holds the old generation's directory; its manifest is deleted before it is read.
    # Before the fix: "has no manifest.json" (IncompleteCheckpointError).
    store = faulty()
    fired = replace_once_at(store, "read_small", MANIFEST, ckpt0, 1)
    assert OPS[name](store.at(str(ckpt0)), collections.deque()) == 1
    assert fired.fired


@pytest.mark.parametrize("name", DATA_OPS)
def test_generation_replaced_after_it_was_pinned_loads_whole(ckpt0: Path, name: str) -> None:
    # The replace (and deletion of the old generation) lands after the first data file is mapped:
    # everything the load needs is already pinned, so it returns the generation it opened.
    store = faulty()
    fired = replace_once_at(store, "view", DATA, ckpt0, 1)
    assert OPS[name](store.at(str(ckpt0)), collections.deque()) == 0
    assert fired.fired
    assert sorted(os.listdir(ckpt0.parent)) == ["ckpt"], "the old generation was not deleted"


@pytest.mark.parametrize("step", ["latest", 1])
def test_manager_restore_retries_on_the_new_generation(tmp_path: Path, step: Any) -> None:
    # CheckpointManager.restore reads through sp.load: the step's checkpoint replaced (and its
    # previous generation deleted) before its data files are opened. Before the fix, "latest"
    # skipped the intact checkpoint as corrupt (with a warning) and an explicit step raised.
    store = faulty()
    mgr = sp.CheckpointManager(store.at(str(tmp_path / "run")))
    try:
        mgr.save(1, STATES[0]).wait()
        fired = replace_once_at(store, "open_blob", DATA, Path(str(mgr.step_path(1))), 1)
        into = {
            "which": -1,
            "model": {k: np.zeros_like(v) for k, v in STATES[0]["model"].items()},
            "step": np.zeros((), dtype=np.int64),
        }
        assert mgr.restore(into, step=step, resume=False) == 1
        assert fired.fired
        assert check_tree(into, "restore") == 1
    finally:
        mgr.close()


def test_mmap_load_stays_valid_after_its_generation_is_deleted(ckpt0: Path) -> None:
    tree = sp.load(ckpt0, mmap=True)
    before = sorted(os.listdir(ckpt0))
    save(ckpt0, 1)
    save(ckpt0, 0)  # a third generation: the first one's files were unlinked two saves ago
    assert sorted(os.listdir(ckpt0.parent)) == ["ckpt"]
    assert sorted(os.listdir(ckpt0)) == before
    check_tree(tree, "mmap load after its files were deleted")
    tree["model"]["w0"][:4] = 7.0  # copy-on-write: private, never reaches any file
    assert check_tree(sp.load(ckpt0), "load") == 0


def test_a_missing_data_file_on_a_stable_generation_is_still_corrupt(ckpt0: Path) -> None:
    with open(ckpt0 / "manifest.json", encoding="utf-8") as f:
        victim = json.load(f)["tensors"]["model/w3"]["file"]
    (ckpt0 / victim).unlink()
    for name in ("load", "load(keys=)", "verify"):
        with pytest.raises(sp.CorruptCheckpointError, match="is missing"):
            OPS[name](str(ckpt0), collections.deque())
    assert sp.inspect(ckpt0).metadata == {"which": 0}  # the manifest alone is intact
    # A load that needs only intact files still works: only what a load reads must exist.
    got = sp.load(ckpt0, keys="model/w0")
    assert got["model"]["w0"].tobytes() == STATES[0]["model"]["w0"].tobytes()


def test_a_checkpoint_deleted_while_opening_is_not_found(ckpt0: Path) -> None:
    store = faulty()
    store.hook("open_blob", lambda call: discard(local.STORE, str(ckpt0)), path=DATA)
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(store.at(str(ckpt0)))


def test_a_checkpoint_replaced_on_every_attempt_gives_up_without_calling_it_corrupt(
    ckpt0: Path,
) -> None:
    store = faulty()
    replaces = store.hook(
        "open_blob", lambda call: save(ckpt0, replaces.fired % 2), path=DATA, times=None
    )
    start = time.monotonic()
    with pytest.raises(sp.CheckpointError, match="replaced") as info:
        sp.load(store.at(str(ckpt0)))
    assert not isinstance(info.value, (sp.CorruptCheckpointError, sp.IncompleteCheckpointError))
    assert 2 < replaces.fired <= 100
    assert time.monotonic() - start < 30


def test_a_hidden_previous_generation_vanishing_while_resolved(ckpt0: Path) -> None:
    # A fallback replace between its two renames: ``path`` is missing and the previous checkpoint
    # is hidden. The replace finishes (and deletes that one) while resolve looks at it. Before
    # the fix: a raw FileNotFoundError from the stat of the vanished directory.
    import shutil

    hidden = ckpt0.parent / f".ckpt{names.OLD_TAG}{names.HOST}-{os.getpid()}-0badf00d"

    def replace_finishes(call: Call) -> None:
        save(ckpt0, 1)
        shutil.rmtree(hidden)

    for name, op in OPS.items():
        shutil.rmtree(ckpt0)
        save(ckpt0, 0)
        os.rename(ckpt0, hidden)
        store = faulty()
        fired = store.hook("stat", replace_finishes, path=str(hidden))  # ranking the candidates
        assert op(store.at(str(ckpt0)), collections.deque()) == 1, name
        assert fired.fired, name


def test_a_file_read_without_being_pinned_after_a_replace_is_not_called_corrupt(
    ckpt0: Path,
) -> None:
    # A caller that names fewer files than it reads opens the rest late; if the generation is
    # gone by then, that is a replace, not damage.
    from savepoint.engine.read import Reader

    with Reader.open(str(ckpt0), needs=lambda d, m: ()) as reader:
        save(ckpt0, 1)
        with pytest.raises(sp.CheckpointError, match="replaced or deleted") as info:
            reader.raw("model/w0")
        assert not isinstance(info.value, sp.CorruptCheckpointError)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "writer":
        writer_main(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
    elif role == "reader":
        print(json.dumps(read_loop(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))))
    else:
        raise SystemExit(f"unknown role {role!r}")
