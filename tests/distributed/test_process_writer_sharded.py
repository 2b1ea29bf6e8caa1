"""Sharded saves through the writer process (``writer="process"`` with ``process_group=``, issue
27): 2 gloo ranks on 127.0.0.1 (``writer2`` in ``_worker_writer.py``).

Each rank's background thread runs the collectives; its writer process writes the rank's pieces
from the shared staging arena. Checked: an ``AsyncCheckpointer`` save loads bit-exactly (on 2
ranks, whole, verified, described as ``inspect`` describes it), holds the state at ``save()``
(changed right after), reuses the writer process and its arena, which never loads torch; a
``CheckpointManager(async_save=True, writer="process")``, plain and incremental (blobs), keeps
and restores its steps; an incremental save whose caller stops it on rank 1 (a raising
``progress``) fails on both ranks, its blob sessions closed; a writer process SIGKILLed mid-write on rank 1 is a
DistributedCheckpointError on both ranks naming it, the previous checkpoint loads, nothing is
left staged, and the next save starts a new writer process. Last, rank 1's trainer dies after
``save()`` returned, its writer process still writing: a sharded save does not outlive its
trainer (its commit needs every rank's records, through the group), so rank 0 raises, the
previous checkpoint stays, and the orphaned writer process exits (what it wrote, nobody
commits).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from . import _launch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("_worker_writer.py")
CHECKS = {
    "async checkpointer",
    "manager",
    "incremental manager",
    "an incremental save its caller stops",
    "writer process killed mid-write",
}


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> _launch.Session:
    return _launch.run("writer2", 2, tmp_path_factory.mktemp("writer"), timeout=90, worker=WORKER)


def test_sharded_saves_through_the_writer_process(session: _launch.Session) -> None:
    # Rank 1's trainer dies on purpose in the last check.
    assert session.returncodes == {0: 0, 1: 17}, session.failures()
    assert set(session.results[0]["checks"]) == CHECKS | {"a trainer killed after save() returned"}
    assert set(session.results[1]["checks"]) == CHECKS, session.failures()
    assert all(v == "ok" for v in session.checks().values()), session.failures()


def test_a_writer_process_whose_trainer_died_exits(session: _launch.Session) -> None:
    """Its pieces cannot be committed any more: it exits (at the end of its write)."""
    pid = session.results[1]["data"]["orphan"]
    deadline = time.monotonic() + 15
    while not _gone(pid):
        assert time.monotonic() < deadline, f"the orphaned writer process {pid} still runs"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_the_kill_is_named_on_every_rank(session: _launch.Session) -> None:
    for rank in (0, 1):
        message = session.results[rank]["data"]["killed"]["message"]
        assert "failed on rank 1 of 2" in message, message
        assert "CheckpointWriteError: the savepoint writer process (pid" in message, message


def test_it_takes_seconds(session: _launch.Session) -> None:
    print(f"writer2: {session.elapsed:.1f} s")
    assert session.elapsed < 45, session.elapsed
