"""Every JSON file savepoint reads besides manifests, nested 2,000 deep (4,001 bytes: under
every file's size cap): the public call that reads it raises a CheckpointError subclass, or
goes on where the file is a record it may ignore; never a RecursionError. They are all parsed
by :mod:`savepoint.codecs.bounded_json` (nesting refused past 512 levels before parsing). The
fuzz targets of ``tests/fuzz/targets_json.py`` mutate each of them further."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.blobs import BlobPolicy
from savepoint.errors import CorruptCheckpointError, RunLockedError
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location

DEEP = b"[" * 2000 + b"]" * 2000 + b"\n"
POLICY = BlobPolicy(chunk_size=4096, min_blob_bytes=1024)
OPTIONS: dict[str, Any] = {"incremental": True, "keep_last": 2, "blob_policy": POLICY}


def state(step: int) -> dict[str, Any]:
    return {"w": np.arange(2048, dtype=np.float32) + step, "step": step}


def _manager(run: Location, **more: Any) -> sp.CheckpointManager:
    return sp.CheckpointManager(run, **OPTIONS, **more)


def _save_and_gc(run: Location) -> None:
    with _manager(run) as m:
        m.save(3, state(3))
        m.gc(grace=0)


def _step(run: Location, step: int = 2) -> Location:
    return run.join("checkpoints", f"step-{step:010d}")


def _second_writer(run: Location) -> None:
    """A second manager while the first holds the lock, whose file (the holder's description,
    written in the locked file itself) is rewritten in place: the lock stays held."""
    with _manager(run):
        with open(run.join(".writer.lock").path, "r+b") as f:
            f.truncate()
            f.write(DEEP)
        _manager(run)


def _open_run_load(run: Location) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "checkpoint 2 failed verification, trying ..."
        sp.open_run(run).load()


def _tier(run: Location) -> None:
    _manager(run, tiers=[sp.Tier(run.join("tier").path)]).close()


@dataclass(frozen=True)
class Case:
    file: str | None  # where the deep JSON goes, relative to the run (None: the call puts it)
    call: Callable[[Location], object]
    raises: type[Exception] | None  # None: the call goes on (the file is ignored)
    backend: str = "local"


CASES = {
    "store.json/load": Case(
        "blobs/store.json", lambda r: sp.load(_step(r)), CorruptCheckpointError
    ),
    "store.json/verify": Case(
        "blobs/store.json", lambda r: sp.verify(_step(r)), CorruptCheckpointError
    ),
    "store.json/open_run": Case("blobs/store.json", _open_run_load, sp.CheckpointError),
    "store.json/save": Case(
        "blobs/store.json", lambda r: _manager(r).save(3, state(3)), CorruptCheckpointError
    ),
    "store.json/s3-load": Case(
        "blobs/store.json", lambda r: sp.load(_step(r)), CorruptCheckpointError, "s3"
    ),
    "tier.json": Case("tier/tier.json", _tier, sp.CheckpointError),
    "session record": Case("blobs/sessions/x.json", _save_and_gc, None),
    "collection record": Case("blobs/gc/x.json", _save_and_gc, None),
    "lease (s3)": Case(".writer.lock", lambda r: _manager(r).close(), None, "s3"),
    "writer lock holder": Case(None, _second_writer, RunLockedError),
    "report.json": Case("report.json", lambda r: sp.open_run(r).steps(), CorruptCheckpointError),
    "run.json": Case("run.json", lambda r: sp.open_run(r).info, CorruptCheckpointError),
    "history log": Case("history.jsonl", lambda r: sp.open_run(r).report, CorruptCheckpointError),
    "alias pointer": Case(
        "latest/savepoint-alias.json",
        lambda r: sp.load(r.join("latest")),
        CorruptCheckpointError,
        "object-store",
    ),
}


def _run(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Location:
    if backend == "local":
        run = LocalStore().at(str(tmp_path / "run"))
    elif backend == "object-store":
        run = MemoryStore(atomic_rename=False).at("/b/run")
    else:
        from faults._kill_s3_child import make_store

        run = make_store().at(f"/{request.getfixturevalue('s3_bucket')}/run")
    with _manager(run) as m:
        for step in (1, 2):
            m.save(step, state(step))
    return run


@pytest.mark.parametrize("name", sorted(CASES))
def test_deeply_nested_json_in_each_file_is_a_checkpoint_error_never_recursion(
    name: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    case = CASES[name]
    run = _run(case.backend, tmp_path, request)
    if case.file is not None:
        where = run.join(*case.file.split("/"))
        where.store.makedirs(where.store.parent(where.path))
        where.store.put(where.path, DEEP, exclusive=False)
    if case.raises is None:
        case.call(run)
    else:
        with pytest.raises(case.raises):
            case.call(run)
