"""Sharded incremental saves across real processes: gloo process groups on 127.0.0.1.

One session of 3 ranks (``incremental3`` in ``_worker.py``): ranks 0 and 1 save the same state
twice into one shared blob store (row, column, flat and ZeRO-partitioned pieces, a replicated
tensor, a small one that stays in a data file), the second time with one 4 KiB chunk changed;
the checkpoints load bit-exactly on 2, 3 (uneven: 128 rows in 43/43/42, across chunk edges) and
1 ranks and whole, and pass verify and inspect; then a CheckpointManager with ``keep_last=2``,
``incremental=True`` and the process group saves 4 steps, synchronously and then in the
background (``async_save=True``), and in the background with row patches: the retained
checkpoints restore bit-exactly and the run's blob store holds exactly the blobs they name. Last, rank 1 dies
after putting its blobs: rank 0 raises, its session is closed, the dead rank's record holds
collections back until it is stale, and then only the dead save's blob is deleted.
"""

from __future__ import annotations

import pytest

from . import _launch

pytestmark = pytest.mark.distributed

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

CHECKS = {
    "incremental save 1",
    "incremental save 2 writes only the changed chunk",
    "load 2->2",
    "load 2->3",
    "load 2->1",
    "load first 2->3",
    "whole, verify, inspect",
    "manager saves with blobs",
    "manager keeps exactly the referenced blobs",
    "manager checkpoints restore",
    "manager saves with blobs (async)",
    "manager keeps exactly the referenced blobs (async)",
    "manager checkpoints restore (async)",
    "manager saves with blobs (async, patches)",
    "manager keeps exactly the referenced blobs (async, patches)",
    "manager checkpoints restore (async, patches)",
    "manager saves row patches",
}


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> _launch.Session:
    return _launch.run("incremental3", 3, tmp_path_factory.mktemp("incremental"), timeout=90)


def test_three_ranks(session: _launch.Session) -> None:
    # Rank 1 dies on purpose in the last check.
    assert session.returncodes == {0: 0, 1: 17, 2: 0}, session.failures()
    for rank in (0, 2):
        assert set(session.results[rank]["checks"]) == CHECKS | {"a rank killed mid-save"}
    assert set(session.results[1]["checks"]) == CHECKS, session.failures()
    assert all(v == "ok" for v in session.checks().values()), session.failures()


def test_the_second_save_wrote_one_chunk(session: _launch.Session) -> None:
    data = session.results[0]["data"]
    count, size = data["first blobs"]
    # emb 2 x 32 KiB, cols 2 x 6 KiB, flat 2 x 12000 B, rep 8 KiB, zero 3 x 5 KiB: chunks of
    # 4 KiB, all distinct, each with its 32-byte header
    assert count == 16 + 4 + 6 + 2 + 6, data
    assert size == 64 * 1024 + 12 * 1024 + 24000 + 8 * 1024 + 15 * 1024 + 32 * count, data
    assert data["second blobs"] == [1, 4096 + 32], data


def test_it_takes_seconds(session: _launch.Session) -> None:
    print(f"incremental3: {session.elapsed:.1f} s")
    assert session.elapsed < 60, session.elapsed
