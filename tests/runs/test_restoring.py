"""Restore's choice of checkpoint (runs.restoring.Restorer), each rule alone on a ``memory://``
run: "latest" falls back to an older intact step with a warning, "best" and explicit steps are
never substituted, a checkpoint the writer deletes or replaces while it is read is chosen again,
tiers are sources in order. And the blob handles of an incremental run (runs.incremental)."""

from __future__ import annotations

import functools
import uuid
import warnings
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from _compare import same
from savepoint.commit.transaction import discard
from savepoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingCheckpointError,
)
from savepoint.options import SaveOptions
from savepoint.runs import layout, restoring
from savepoint.runs.catalog import Catalog
from savepoint.runs.incremental import BlobHandles
from savepoint.runs.restoring import RUN_DIRECTORY, Restorer
from savepoint.runs.tiers import Tier
from savepoint.storage.paths import Location, resolve


def state(step: int) -> dict[str, Any]:
    return {"w": np.full((8, 4), step, np.float32), "step": step}


def blank() -> dict[str, Any]:
    return {"w": np.zeros((8, 4), np.float32), "step": -1}


def new_run(steps: list[int], losses: dict[int, float] | None = None) -> Location:
    """A fresh ``memory://`` run holding ``steps``, saved by a manager ranking by ``loss``."""
    url = f"memory://restoring/{uuid.uuid4().hex}"
    with sp.CheckpointManager(url, best_metric="loss") as mgr:
        for step in steps:
            metrics = None if losses is None else {"loss": losses[step]}
            mgr.save(step, state(step), metrics)
    return resolve(url, what="run directory")


def restorer(run: Location) -> Restorer:
    """A reader's restorer next to the run (a read-only catalog: it rereads what changed)."""
    catalog = Catalog(run, best_metric="loss", best_mode="min", read_only=True)
    return Restorer(run, catalog, functools.partial(layout.committed_steps, run))


def read(r: Restorer, step: Any, **options: Any) -> tuple[int, Any]:
    found = r.read(step, options)
    assert found is not None
    return found


def damage(where: Location) -> None:
    """Invert every byte of every data file of the checkpoint at ``where``."""
    store = where.store
    for name in store.list(where.path):
        if name != "manifest.json":
            path = store.join(where.path, name)
            data = store.read_small(path, cap=None)
            store.put(path, bytes(b ^ 0xFF for b in data), exclusive=False)


def step_at(run: Location, step: int) -> Location:
    return layout.step_location(run, step)


def test_latest_falls_back_to_an_older_intact_step_with_a_warning() -> None:
    run = new_run([1, 2, 3])
    damage(step_at(run, 3))
    r = restorer(run)
    with pytest.warns(UserWarning, match="checkpoint 3 of .* failed verification, trying an older"):
        step, tree = read(r, "latest")
    assert step == 2 and r.restored_from == RUN_DIRECTORY
    same(tree, state(2))


def test_latest_of_an_empty_run_is_none_and_of_a_damaged_one_an_error() -> None:
    assert restorer(new_run([])).read("latest", {}) is None
    run = new_run([1, 2])
    for step in (1, 2):
        damage(step_at(run, step))
    with (
        pytest.warns(UserWarning, match="failed verification"),
        pytest.raises(CorruptCheckpointError, match="among 2"),
    ):
        restorer(run).read("latest", {})


def test_best_is_never_substituted() -> None:
    run = new_run([1, 2, 3], {1: 0.5, 2: 0.1, 3: 0.3})
    r = restorer(run)
    step, tree = read(r, "best")
    assert step == 2
    same(tree, state(2))
    damage(step_at(run, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, so no warning
        with pytest.raises(CorruptCheckpointError):
            r.read("best", {})
    with pytest.raises(MissingCheckpointError, match="no best checkpoint"):
        restorer(new_run([1])).read("best", {})  # (no checkpoint has a loss)


def test_an_explicit_step_is_never_substituted() -> None:
    run = new_run([1, 2])
    r = restorer(run)
    into = blank()
    assert read(r, 1, into=into)[0] == 1
    same(into, state(1))
    damage(step_at(run, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CorruptCheckpointError):
            r.read(2, {})
    with pytest.raises(
        CheckpointNotFoundError, match=r"no checkpoint for step 7 \(it has \[1, 2\]\)"
    ):
        r.read(7, {})
    with pytest.raises(ValueError, match="step must be"):
        r.read("newest", {})  # type: ignore[arg-type]


def writer_meanwhile(monkeypatch: pytest.MonkeyPatch, act: Any, *, torn: bool = False) -> list[Any]:
    """Make the next load of a checkpoint run ``act(path)`` first (the run's writer deleting or
    replacing it while it is read), that load then failing as a torn read if ``torn``; returns
    the paths loaded."""
    real = restoring.checkpoint.load
    loaded: list[Any] = []

    def load(path: Any, **options: Any) -> Any:
        loaded.append(path)
        if len(loaded) == 1:
            act(path)
            if torn:
                raise CorruptCheckpointError("a torn read (the checkpoint changed meanwhile)")
        return real(path, **options)

    monkeypatch.setattr(restoring.checkpoint, "load", load)
    return loaded


def test_latest_deleted_while_read_is_chosen_again_without_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = new_run([1, 2, 3])
    loaded = writer_meanwhile(monkeypatch, lambda path: discard(run.store, step_at(run, 3).path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step, tree = read(restorer(run), "latest")
    assert step == 2 and len(loaded) == 2
    same(tree, state(2))


def test_best_deleted_while_read_is_chosen_again(monkeypatch: pytest.MonkeyPatch) -> None:
    run = new_run([1, 2, 3], {1: 0.5, 2: 0.1, 3: 0.3})
    writer_meanwhile(monkeypatch, lambda path: discard(run.store, step_at(run, 2).path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step, tree = read(restorer(run), "best")
    assert step == 3  # the best of what the run holds now
    same(tree, state(3))


def test_an_explicit_step_deleted_while_read_is_not_found_and_replaced_is_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = new_run([1, 2])
    writer_meanwhile(monkeypatch, lambda path: discard(run.store, step_at(run, 2).path))
    with pytest.raises(CheckpointNotFoundError, match="was deleted while it was being restored"):
        restorer(run).read(2, {})
    monkeypatch.undo()

    def replace(path: Any) -> None:  # the writer saves step 1 again, with other values
        discard(run.store, step_at(run, 1).path)
        sp.save(layout.checkpoint_arg(step_at(run, 1)), state(10))

    loaded = writer_meanwhile(monkeypatch, replace, torn=True)
    step, tree = read(restorer(run), 1)  # never taken for a corrupt checkpoint: read again
    assert step == 1 and len(loaded) == 2
    same(tree, state(10))


def test_tiers_are_sources_after_the_run_directory_fastest_first() -> None:
    run = new_run([1, 2])
    tiers = []
    for name in ("fast", "slow"):
        where = resolve(f"memory://restoring-{name}/{uuid.uuid4().hex}", what="tier")
        sp.save(layout.checkpoint_arg(step_at(where, 2)), state(2))
        sp.save(layout.checkpoint_arg(step_at(where, 5)), state(5))
        tiers.append((Tier(str(where), name=name), where))
    copies = {s: [(t, step_at(w, s)) for t, w in tiers] for s in (2, 5)}
    r = restorer(run)
    assert [n for n, _ in r.sources(2, [1, 2], copies)] == [RUN_DIRECTORY, "fast", "slow"]
    assert [n for n, _ in r.sources(5, [1, 2], copies)] == ["fast", "slow"]
    assert [n for n, _ in r.sources(1, [1, 2], copies)] == [RUN_DIRECTORY]

    class Copier:  # (what the restorer asks of runs.tiers.TierCopier)
        def candidates(self) -> dict[int, list[tuple[Tier, Location]]]:
            return copies

    r.tiers = Copier()  # type: ignore[assignment]
    assert read(r, "latest")[0] == 5 and r.restored_from == "fast"
    damage(step_at(run, 2))
    damage(step_at(tiers[0][1], 2))
    step, tree = read(r, 2)  # an explicit step: its other copies only
    assert step == 2 and r.restored_from == "slow"
    same(tree, state(2))


def test_blob_handles_save_share_and_collect_alone() -> None:
    from savepoint.blobs import BlobPolicy

    run = resolve(f"memory://restoring-blobs/{uuid.uuid4().hex}", what="run directory")
    run.store.makedirs(run.join(layout.CHECKPOINTS).path)
    handles = BlobHandles(run, policy=BlobPolicy(min_blob_bytes=1024, patches=False), frozen=None)
    big = np.arange(4096, dtype=np.float32)
    for step in (1, 2):
        target = layout.checkpoint_arg(step_at(run, step))
        handles.save(target, {"big": big, "own": np.full(512, step, np.float32)}, {}, SaveOptions())
    assert set(handles.async_options()) == {"blobs", "blob_policy", "memo", "tracker", "frozen"}
    both = handles.referenced()
    discard(run.store, step_at(run, 1).path)  # retention deleted step 1
    named = handles.referenced()
    assert named < both  # step 1's own blob is no longer named; the shared one is
    handles.before_gc()
    handles.collect()
    assert set(handles.store().list()) == named
    same(sp.load(layout.checkpoint_arg(step_at(run, 2)))["big"], big)
    handles.scrub(2)  # intact: nothing removed
    assert set(handles.store().list()) == named
