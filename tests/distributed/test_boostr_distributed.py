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


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _worker

    _worker.scenario_boostr = scenario_boostr  # type: ignore[attr-defined]
    _worker.main()
