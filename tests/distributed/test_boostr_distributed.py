"""``boostr.save_distributed(..., process_group=pg)`` across real processes (gloo on 127.0.0.1).

This file is also the worker: ``_launch.run`` starts it (``WORKER`` patched to this file) with the
scenario functions below installed into ``_worker``, whose ``main`` joins the group and records
the checks. Each rank writes its own ``rank_{r}/``; the parent test reads the checkpoints back in
one process (consolidated and per rank) and compares them with the per-rank states.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from savepoint.formats import boostr

if __name__ != "__main__":
    from . import _launch

pytestmark = pytest.mark.distributed
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

SPLIT = {"w": 1}
STRATEGIES: list[tuple[str, dict[str, Any]]] = [
    ("Replicated", {}),
    ("ZeroPartitioned", {"stage": 2}),
    ("TensorParallel", {"split_dims": SPLIT}),
]


def full() -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, np.ndarray[Any, Any]]]:
    rng = np.random.default_rng(11)
    model = {
        "w": rng.standard_normal((4, 9)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float64),
        "e": rng.integers(0, 9, (3, 3)).astype(np.int32),
    }
    return model, {f"{k}.m": v * 2 for k, v in model.items()}


def rank_state(strategy: str, rank: int, world: int) -> boostr.BoostrCheckpoint:
    model, opt = full()
    if strategy == "ZeroPartitioned":
        mine = [k for i, k in enumerate(model) if i % world == rank]
        model = {k: model[k] for k in mine}
        opt = {f"{k}.m": opt[f"{k}.m"] for k in mine}
    elif strategy == "TensorParallel":

        def cut(name: str, t: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            p = name.removesuffix(".m")
            return np.array_split(t, world, axis=SPLIT[p])[rank].copy() if p in SPLIT else t

        model = {k: cut(k, v) for k, v in model.items()}
        opt = {k: cut(k, v) for k, v in opt.items()}
    return boostr.BoostrCheckpoint(model, opt, boostr.TrainingState(step=5, epoch=1))


# -- scenarios (run in the worker processes) ------------------------------------------------------


def scenario_boostr(s: Any) -> None:
    rank, world = s.rank, s.world
    pg = dist.group.WORLD
    for strategy, kwargs in STRATEGIES:

        def save(strategy: str = strategy, kwargs: dict[str, Any] = kwargs) -> None:
            meta = boostr.save_distributed(
                s.path(f"boostr-{strategy}"),
                rank_state(strategy, rank, world),
                strategy=strategy,  # type: ignore[arg-type]
                process_group=pg,
                timeout=60,
                **kwargs,
            )
            assert meta.world_size == world and len(meta.shards) == world

        s.check(f"save {strategy}", save)

    from savepoint.errors import DistributedCheckpointError
    from savepoint.formats import _boostr_write

    real = _boostr_write._Rank.write

    def failing(self: Any, staging: str) -> None:
        if rank == world - 1:
            raise OSError(28, "No space left on device", staging)
        real(self, staging)

    _boostr_write._Rank.write = failing  # type: ignore[method-assign]

    def fails_everywhere() -> None:
        with pytest.raises(DistributedCheckpointError, match="No space left on device") as info:
            boostr.save_distributed(
                s.path("boostr-Replicated"),
                rank_state("Replicated", rank, world),
                process_group=pg,
                timeout=60,
            )
        assert list(info.value.ranks) == [world - 1], info.value.ranks

    s.check("failure on one rank", fails_everywhere)
    _boostr_write._Rank.write = real  # type: ignore[method-assign]
    dist.barrier()


def scenario_boostr_async(s: Any) -> None:
    """``AsyncCheckpointer.save_distributed``: every rank snapshots its part and returns at once;
    the ranks write in the background; changes made after the call are not saved; a failure on
    one rank is reported on every rank by ``wait()``."""
    import savepoint as sp
    from savepoint.errors import DistributedCheckpointError
    from savepoint.formats import _boostr_write

    rank, world = s.rank, s.world
    pg = dist.group.WORLD
    writer = os.environ.get("SAVEPOINT_TEST_BOOSTR_WRITER", "thread")

    def each_strategy() -> None:
        with sp.AsyncCheckpointer(process_group=pg, timeout=60, writer=writer) as ck:  # type: ignore[arg-type]
            for strategy, kwargs in STRATEGIES:
                mine = rank_state(strategy, rank, world)
                pending = ck.save_distributed(
                    s.path(f"async-{strategy}"),
                    mine.model,
                    mine.optimizer,
                    mine.state,
                    strategy=strategy,  # type: ignore[arg-type]
                    **kwargs,
                )
                for t in [*mine.model.values(), *(mine.optimizer or {}).values()]:
                    t += 100  # after the call: not in the checkpoint
                mine.state.metadata["late"] = "yes"
                meta = pending.wait()
                assert meta.world_size == world and len(meta.shards) == world, meta

    s.check("async save, each strategy", each_strategy)

    def group_given_per_call() -> None:
        done: list[Any] = []
        with sp.AsyncCheckpointer() as ck:  # no group of its own
            mine = rank_state("Replicated", rank, world)
            pending = ck.save_distributed(
                s.path("async-per-call"), mine.model, process_group=pg, on_commit=done.append
            )
            assert pending.wait() is done[0]
            assert done[0].shards[rank].rank == rank

    s.check("group given per call", group_given_per_call)

    real = _boostr_write._Rank.write

    def failing(self: Any, staging: str) -> None:
        if rank == world - 1:
            raise OSError(28, "No space left on device", staging)
        real(self, staging)

    def fails_everywhere() -> None:
        _boostr_write._Rank.write = failing  # type: ignore[method-assign]
        if writer == "process" and rank == world - 1:  # the writer process writes rank_{r}/
            os.environ["SAVEPOINT_WRITER_FAULT"] = "oserror:ENOSPC"
        try:
            with sp.AsyncCheckpointer(process_group=pg, timeout=60, writer=writer) as ck:  # type: ignore[arg-type]
                mine = rank_state("Replicated", rank, world)
                pending = ck.save_distributed(s.path("async-Replicated"), mine.model)
                with pytest.raises(DistributedCheckpointError, match="No space left") as info:
                    ck.wait()  # reported once, here (and by pending.wait())
                assert list(info.value.ranks) == [world - 1], info.value.ranks
                assert isinstance(pending.exception(), DistributedCheckpointError)
        finally:
            _boostr_write._Rank.write = real  # type: ignore[method-assign]
            os.environ.pop("SAVEPOINT_WRITER_FAULT", None)

    s.check("failure on one rank, reported on every rank", fails_everywhere)
    dist.barrier()


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_writes_its_own_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    monkeypatch.setattr(_launch, "WORKER", Path(__file__))
    session = _launch.run("boostr", world, tmp_path)
    assert not session.failures(), session.failures()
    names = {"save Replicated", "save ZeroPartitioned", "save TensorParallel"}
    for r in range(world):
        assert set(session.results[r]["checks"]) == names | {"failure on one rank"}
    model, opt = full()
    for strategy, _ in STRATEGIES:
        path = tmp_path / f"boostr-{strategy}"
        whole = boostr.load_consolidated(path)
        for got, want in ((whole.model, model), (whole.optimizer, opt)):
            assert got is not None and set(got) == set(want)
            for k, v in want.items():
                assert got[k].dtype == v.dtype and np.array_equal(got[k], v), (strategy, k)
        for r in range(world):
            one = boostr.load_distributed(path, r)
            want_rank = rank_state(strategy, r, world)
            assert set(one.model) == set(want_rank.model)
            for k, v in want_rank.model.items():
                assert np.array_equal(one.model[k], v), (strategy, r, k)
    # the failed save left the Replicated checkpoint as it was, and no staging directory
    assert boostr.read_sharding_meta(tmp_path / "boostr-Replicated").world_size == world
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_async_save_distributed_writes_each_rank_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """The seed's ``AsyncCheckpointer::save_distributed``: per-rank writes in the background,
    the same layout and checks as ``boostr.save_distributed``, the state as it was at the call;
    by the thread writer, and by each rank's writer process (from its staging arena)."""
    monkeypatch.setattr(_launch, "WORKER", Path(__file__))
    monkeypatch.setenv("SAVEPOINT_TEST_BOOSTR_WRITER", writer)
    world = 2
    session = _launch.run("boostr_async", world, tmp_path)
    assert not session.failures(), session.failures()
    assert len(session.checks()) == 3 * world
    model, opt = full()
    for strategy, _ in STRATEGIES:
        path = tmp_path / f"async-{strategy}"
        whole = boostr.load_consolidated(path)
        assert whole.state.step == 5 and "late" not in whole.state.metadata
        for got, want in ((whole.model, model), (whole.optimizer, opt)):
            assert got is not None and set(got) == set(want)
            for k, v in want.items():
                assert np.array_equal(got[k], v), (strategy, k)  # not the +100 made after
        for r in range(world):
            assert set(boostr.load_distributed(path, r).model) == set(
                rank_state(strategy, r, world).model
            )
    assert boostr.read_sharding_meta(tmp_path / "async-per-call").world_size == world
    # The failed save over async-Replicated committed nothing (the loop above read the earlier
    # checkpoint back intact) and left no staging directory.
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_async_save_distributed_needs_a_group_and_checks_before_returning(
    tmp_path: Path,
) -> None:
    import savepoint as sp

    with sp.AsyncCheckpointer() as ck:
        with pytest.raises(ValueError, match="process_group"):
            ck.save_distributed(tmp_path / "x", {"w": np.zeros(2)})
    with sp.AsyncCheckpointer(on_busy="skip") as ck:
        with pytest.raises(ValueError, match="skip"):
            ck.save_distributed(tmp_path / "x", {"w": np.zeros(2)}, process_group=object())
    with sp.AsyncCheckpointer() as ck:
        with pytest.raises(TypeError, match="process_group"):
            ck.save_distributed(tmp_path / "x", {"w": np.zeros(2)}, process_group=object())
        with pytest.raises(ValueError, match="strategy"):
            ck.save_distributed(
                tmp_path / "x", {"w": np.zeros(2)}, strategy="Nope", process_group=object()
            )
    assert not list(tmp_path.iterdir())


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _worker

    _worker.scenario_boostr = scenario_boostr  # type: ignore[attr-defined]
    _worker.scenario_boostr_async = scenario_boostr_async  # type: ignore[attr-defined]
    _worker.main()
