"""Kill tests of ``sp.copy`` with blobs: a process that dies after any single change the copy makes
to the destination leaves its checkpoints whole (the one being replaced is the old or the new,
never a mix) and only garbage a collection removes; the copy run again then succeeds.

Each scenario runs once on a recording store to count its changes, then once per change ``k`` on
a fresh destination, "dying" right after change ``k`` (FaultyStore.crash_after)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from _compare import same
from savepoint.blobs import BlobPolicy, BlobStore, Compression
from savepoint.engine.read import Reader
from savepoint.storage.base import Store
from savepoint.storage.faults import FaultyStore, SimulatedCrash
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location

POLICY = BlobPolicy(chunk_size=16 << 10, min_blob_bytes=8 << 10, compression=Compression())
FROZEN = np.random.default_rng(0).standard_normal(12_000).astype(np.float32)  # 3 chunks


def state(step: int) -> dict[str, Any]:
    return {
        "frozen": FROZEN,
        "adapter": np.random.default_rng(step).standard_normal(3000).astype(np.float32),
        "step": step,
    }


def named(where: Location) -> set[str]:
    with Reader.open(where) as reader:
        return {
            d
            for rec in reader.manifest.tensors.values()
            if rec.recipe is not None
            for d in rec.recipe.digests
        }


def prepared(tmp_path: Path, rename: bool) -> tuple[MemoryStore, dict[int, Path]]:
    """A destination run holding copies of steps 1 and 2 (step 2 is replaced by the copy under
    test), and the source checkpoints."""
    sources = {}
    for step in (1, 2, 3):
        sources[step] = tmp_path / "src" / "checkpoints" / f"step-{step}"
        if not sources[step].exists():
            sp.save(
                sources[step], state(step), blobs=tmp_path / "src" / "blobs", blob_policy=POLICY
            )
    inner = MemoryStore(atomic_rename=rename)
    sp.copy(sources[1], Location(inner, "/run/checkpoints/step-1"))
    sp.copy(sources[2], Location(inner, "/run/checkpoints/step-2"))
    return inner, sources


def copy_step_3_over_step_2(store: Store, sources: dict[int, Path]) -> None:
    sp.copy(sources[3], Location(store, "/run/checkpoints/step-2"))


@pytest.mark.parametrize("rename", [True, False], ids=["rename", "manifest-last"])
def test_a_copy_killed_after_any_change_leaves_the_destination_whole(
    tmp_path: Path, rename: bool
) -> None:
    inner, sources = prepared(tmp_path, rename)
    recording = FaultyStore(inner)
    copy_step_3_over_step_2(recording, sources)
    changes = len(recording.mutations())
    assert changes > 5, changes  # blobs, the session record, staging, the manifest ...
    for k in range(changes + 1):
        inner, _ = prepared(tmp_path, rename)
        faulty = FaultyStore(inner)
        faulty.crash_after(k)
        try:
            copy_step_3_over_step_2(faulty, sources)
        except SimulatedCrash:
            pass
        else:
            assert k == changes
        # the next process finds: step 1 whole, step 2 the old copy or the new one
        step1 = Location(inner, "/run/checkpoints/step-1")
        step2 = Location(inner, "/run/checkpoints/step-2")
        same(sp.load(step1), state(1))
        got = sp.load(step2)
        assert got["step"] in (2, 3), k
        same(got, state(got["step"]))
        # a collection once the dead copy's session is stale keeps what both name
        blobs = BlobStore(inner, "/run/blobs", create=False)
        kept = named(step1) | named(step2)  # read after the crash, before the collection
        report = blobs.collect(kept, grace=0, session_stale_after=-1.0)
        assert not report.deferred
        assert set(blobs.list()) == kept, k
        same(sp.load(step1), state(1))
        same(sp.load(step2), state(got["step"]))
        # and the copy, run again, succeeds
        copy_step_3_over_step_2(inner, sources)
        same(sp.load(step2), state(3))
        sp.verify(step2)
