"""Kill tests: a process that dies at any step of a save, of retention or of a collection leaves
every retained checkpoint whole, and only garbage that the next collection removes.

Each scenario runs once to count its changes to the store, then once per change ``k`` on a fresh
store, "dying" right after change ``k`` (savepoint.storage.faults.FaultyStore.crash_after); the
next process then finds the store as the dead one left it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from savepoint.blobs import BlobStore, Compression, Recipe, collect
from savepoint.storage.base import Store
from savepoint.storage.faults import FaultyStore, SimulatedCrash

from .conftest import make

CHUNK = 4096
RUN = "/run"


def tensor(step: int) -> np.ndarray:
    """Step ``step``'s state: 8 chunks, 2 of which change at every step."""
    data = np.random.default_rng(0).standard_normal(8 * CHUNK // 4).astype(np.float32) * 0.01
    rows = data.reshape(8, -1)
    rows[step % 8] += step
    rows[(step * 3 + 1) % 8] -= step
    return data


def manifest_path(store: Store, root: str, step: int) -> str:
    return store.join(root, f"ckpt-{step:04d}.json")


def save(blobs: BlobStore, root: str, step: int) -> None:
    with blobs.session() as s:
        recipe = s.put_chunked(
            tensor(step), chunk_size=CHUNK, compression=Compression(min_saving=0.0)
        )
        s.sync()
        s.check()
        body = json.dumps({"step": step, "recipe": recipe.to_json()}).encode()
        blobs.store.put(manifest_path(blobs.store, root, step), body, exclusive=True)


def manifests(store: Store, root: str) -> dict[int, Recipe]:
    out = {}
    for name in store.list(root):
        if name.startswith("ckpt-"):
            doc = json.loads(store.read_small(store.join(root, name), cap=None))
            out[doc["step"]] = Recipe.from_json(doc["recipe"])
    return out


def retain(blobs: BlobStore, root: str, keep: int) -> None:
    """Retention as the manager must do it: delete manifests first, then collect."""
    steps = sorted(manifests(blobs.store, root))
    for step in steps[:-keep]:
        blobs.store.remove(manifest_path(blobs.store, root, step))
    blobs.store.sync_dir(root)
    collect(
        blobs,
        lambda: {d for r in manifests(blobs.store, root).values() for d in r.digests},
        grace=0,
    )


def check_whole(blobs: BlobStore, root: str) -> None:
    for step, recipe in manifests(blobs.store, root).items():
        got = blobs.read_recipe(recipe, verify=True)
        assert got.tobytes() == tensor(step).tobytes(), f"checkpoint {step} damaged"


Scenario = Callable[[BlobStore, str], None]


def save_then_retain(blobs: BlobStore, root: str) -> None:
    save(blobs, root, 4)
    retain(blobs, root, keep=2)


SCENARIOS: dict[str, Scenario] = {
    "save": lambda blobs, root: save(blobs, root, 4),
    "retention": lambda blobs, root: retain(blobs, root, keep=1),
    "save-then-retention": save_then_retain,
}


@pytest.mark.parametrize("kind", ["memory", "local"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_crash_anywhere_leaves_retained_checkpoints_whole(
    kind: str, scenario: str, tmp_path: Path
) -> None:
    def fresh(tag: str) -> tuple[Store, str, str]:
        store, root = make(kind, tmp_path / tag)
        run = store.parent(root)
        blobs = BlobStore(store, root)
        for step in (1, 2, 3):
            save(blobs, run, step)
        return store, root, run

    inner, root, run = fresh("count")
    counting = FaultyStore(inner)
    SCENARIOS[scenario](BlobStore(counting, root), run)
    changes = len(counting.mutations())
    assert changes > 0

    for k in range(changes + 1):
        inner, root, run = fresh(f"k{k}")
        faulty = FaultyStore(inner)
        faulty.crash_after(k)
        try:
            SCENARIOS[scenario](BlobStore(faulty, root), run)
        except SimulatedCrash:
            pass
        # the next process
        blobs = BlobStore(inner, root)
        check_whole(blobs, run)
        assert len(manifests(inner, run)) >= 1
        # its collection (the dead save's record counts as stale) leaves no garbage
        report = collect(
            blobs,
            lambda: {d for r in manifests(inner, run).values() for d in r.digests},  # noqa: B023
            grace=0,
            session_stale_after=-1,
        )
        assert not report.deferred
        referenced = {d for r in manifests(inner, run).values() for d in r.digests}
        assert set(blobs.list()) == referenced
        assert [n for n, _ in blobs.entries() if ".tmp-" in n] == []
        check_whole(blobs, run)
