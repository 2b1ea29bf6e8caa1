"""Hostile repeated saves on one group: whatever changes between two saves, on whichever rank,
the second commits exactly what a fresh save of its state commits (markers, REGRID, the
describe memo and the plan cache never keep a stale plan or a stale tree), and nothing hangs.

In process (the world simulator's ranks, ``simulate.World``: the real save protocol, real
writer); the real gloo group's cases are in ``test_grid_markers_gloo.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.distributed import Shard, pieces, plancache, save, simulate
from savepoint.distributed.layout import Grid, grid_box
from savepoint.options import SaveOptions
from savepoint.storage.paths import resolve as resolve_path

WORLD = 4
State = Callable[[int, int, int], Any]  # (save, rank, world) -> the rank's state


def grid_state(
    rank: int,
    world: int,
    *,
    coord: int | None = None,
    rows: int = 8,
    dtype: Any = np.float32,
    step: Any = 1,
    fill: float = 0.0,
    extra: bool = False,
    drop: bool = False,
    irregular: bool = False,
) -> dict[str, Any]:
    """A regular state: ``w`` split on rows over a 1-d mesh (this rank at ``coord``), ``b``
    replicated, a plain value; every rank holds its box of the same global arrays."""
    c = rank if coord is None else coord
    whole = np.arange(rows * 3, dtype=dtype).reshape(rows, 3) + dtype(fill)
    box = grid_box(whole.shape, (world,), (c,), (0,))
    local = whole[tuple(slice(a, b) for a, b in box)].copy()
    grid = None if irregular else Grid((world,), (c,), (0,))
    model: dict[str, Any] = {"w": Shard(local, whole.shape, [a for a, _ in box], grid=grid)}
    if not drop:
        model["b"] = np.full(3, 2.0 + fill, dtype)
    if extra:
        model["e"] = np.full(2, 5.0, np.float32)
    return {"model": model, "cfg": {"step": step}}


def run_saves(
    world: int,
    state: State,
    paths: list[Path],
    before: Callable[[int, Any], None] | None = None,
    options: SaveOptions | None = None,
) -> list[list[Any]]:
    """Each save of ``paths`` in turn by ``world`` simulated ranks of one group (the memos kept
    between saves, as on a real group): per save, every rank's result or exception."""
    sim = simulate.World(world)

    def body(coord: Any) -> list[Any]:
        out: list[Any] = []
        for i, where in enumerate(paths):
            if before is not None:
                before(i, coord)
            coord.new_save()
            location = resolve_path(str(where), what="checkpoint path")

            def flat(i: int = i) -> Any:
                return save.flatten(state(i, coord.rank, world)), {}

            run = save.SaveRun(location, coord, flat, None, save.LocalWriter(None))
            try:
                out.append(run.run(options or SaveOptions()))
            except Exception as exc:  # noqa: BLE001 (each save's outcome is recorded)
                out.append(exc)
        return out

    try:
        results = sim.run(body)
    finally:
        for c in getattr(sim, "coordinators", []):
            plancache.forget(c.memo_key)
            save.forget(c.memo_key)
    for r in results:
        assert not isinstance(r, BaseException), r
    return [[results[r][i] for r in range(world)] for i in range(len(paths))]


def manifest(path: Path) -> Any:
    found = json.loads((path / "manifest.json").read_text())
    found.pop("created", None)
    found.pop("manifest_xxh3", None)
    return found


def typed(value: Any) -> Any:
    """``value`` (a loaded tree) with every leaf's type and bytes: 1, True and 1.0 differ."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    return (type(value).__name__, repr(value))


def fresh_save(state: Callable[[int, int], Any], path: Path, world: int) -> list[Any]:
    """What a fresh group (no memo) makes of ``state`` at ``path``: every rank's outcome."""
    return run_saves(world, lambda _, r, w: state(r, w), [path])[0]


def assert_same(got: Path, fresh: Path) -> None:
    """``got`` commits what ``fresh`` does: the manifest and the contents, types included."""
    assert manifest(got) == manifest(fresh)
    assert typed(sp.load(got, framework="numpy")) == typed(sp.load(fresh, framework="numpy"))
    sp.verify(got)


def ok(outcome: list[Any]) -> None:
    assert all(isinstance(x, sp.CheckpointInfo) for x in outcome), outcome


# What changes on one rank between two saves (rank 1 unless the case says rank 0).
CHANGES: dict[str, tuple[int, dict[str, Any]]] = {
    "shape": (1, {"rows": 12}),
    "dtype": (1, {"dtype": np.float64}),
    "key added": (1, {"extra": True}),
    "key removed": (1, {"drop": True}),
    "plain value": (1, {"step": 2}),
    "bool for int": (1, {"step": True}),
    "new bytes": (1, {"fill": 100.0}),  # new objects, same shapes: the new bytes are saved
    "irregular": (1, {"irregular": True}),
    "rank 0 shape": (0, {"rows": 12}),
    "rank 0 value": (0, {"step": 2}),
    "rank 0 bool for int": (0, {"step": True}),
    "rank 0 float for int": (0, {"step": 1.0}),
    "rank 0 new bytes": (0, {"fill": 100.0}),
    "every rank bool for int": (-1, {"step": True}),
    "every rank negative zero": (-1, {"step": -0.0}),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_change_on_one_rank_commits_what_a_fresh_save_would(case: str, tmp_path: Path) -> None:
    who, change = CHANGES[case]
    base: dict[str, Any] = {"step": 0.0} if "negative" in case else {}

    def second(rank: int, world: int) -> Any:
        changed = who in (-1, rank)
        return grid_state(rank, world, **({**base, **change} if changed else base))

    def state(i: int, rank: int, world: int) -> Any:
        return grid_state(rank, world, **base) if i in (0, 1) else second(rank, world)

    # three saves: the second sends markers, the third the change
    got = run_saves(WORLD, state, [tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    ok(got[0])
    ok(got[1])
    fresh = fresh_save(second, tmp_path / "fresh", WORLD)
    if all(isinstance(x, sp.CheckpointInfo) for x in fresh):
        ok(got[2])
        assert_same(tmp_path / "c", tmp_path / "fresh")
    else:  # a state a fresh save refuses is refused after markers too
        assert all(isinstance(x, sp.DistributedCheckpointError) for x in got[2]), got[2]
        assert not (tmp_path / "c").exists()
