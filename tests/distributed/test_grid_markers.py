"""Hostile repeated saves on one group: whatever changes between two saves, on whichever rank,
the second commits exactly what a fresh save of its state commits (markers, REGRID, the
describe memo and the plan cache never keep a stale plan or a stale tree), and nothing hangs.

In process (the world simulator's ranks, ``simulate.World``: the real save protocol, real
writer); the real gloo group's cases are in ``test_grid_markers_gloo.py``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.blobs import BlobPolicy, BlobStore
from savepoint.distributed import Shard, layout, plancache, save, simulate
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
    incremental: Callable[[int], save.Incremental | None] = lambda i: None,
    options: Callable[[int], SaveOptions] = lambda i: SaveOptions(),
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

            inc = incremental(i)
            run = save.SaveRun(location, coord, flat, inc, save.LocalWriter(inc))
            try:
                out.append(run.run(options(i)))
            except Exception as exc:  # each save's outcome is recorded
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


def fresh_save(
    state: Callable[[int, int], Any],
    path: Path,
    world: int,
    incremental: save.Incremental | None = None,
    options: SaveOptions | None = None,
) -> list[Any]:
    """What a fresh group (no memo) makes of ``state`` at ``path``: every rank's outcome."""
    return run_saves(
        world,
        lambda _, r, w: state(r, w),
        [path],
        incremental=lambda _: incremental,
        options=lambda _: options or SaveOptions(),
    )[0]


def assert_same(got: Path, fresh: Path) -> None:
    """``got`` commits what ``fresh`` does: the manifest and the contents, types included."""
    assert manifest(got) == manifest(fresh)
    assert typed(sp.load(got, framework="numpy")) == typed(sp.load(fresh, framework="numpy"))
    sp.verify(got)


def ok(outcome: list[Any]) -> None:
    assert all(isinstance(x, sp.CheckpointInfo) for x in outcome), outcome


# What changes between two saves, per rank (-1: every rank).
CHANGES: dict[str, dict[int, dict[str, Any]]] = {
    "shape": {1: {"rows": 12}},
    "dtype": {1: {"dtype": np.float64}},
    "key added": {1: {"extra": True}},
    "key removed": {1: {"drop": True}},
    "bool for int": {1: {"step": True}},
    "new bytes": {1: {"fill": 100.0}},  # new objects, same shapes: the new bytes are saved
    "irregular": {1: {"irregular": True}},
    "coordinates swapped": {1: {"coord": 2}, 2: {"coord": 1}},  # same shapes, other boxes
    "coordinate shared": {1: {"coord": 2}},
    "rank 0 shape": {0: {"rows": 12}},
    "rank 0 bool for int": {0: {"step": True}},
    "rank 0 float for int": {0: {"step": 1.0}},
    "rank 0 new bytes": {0: {"fill": 100.0}},
    "every rank bool for int": {-1: {"step": True}},
    "every rank negative zero": {-1: {"step": -0.0}},
    "every rank new bytes": {-1: {"fill": 7.0}},
}
BASES = {"regular": {}, "irregular": {"irregular": True}}


def changed(case: str, base: str) -> tuple[State, Callable[[int, int], Any]]:
    """The states of three saves (the second sends markers, the third has ``case``'s change)
    and the third's alone."""
    start = {**BASES[base], **({"step": 0.0} if "zero" in case else {})}

    def second(rank: int, world: int) -> Any:
        change = CHANGES[case].get(rank, CHANGES[case].get(-1, {}))
        return grid_state(rank, world, **{**start, **change})

    def state(i: int, rank: int, world: int) -> Any:
        return grid_state(rank, world, **start) if i < 2 else second(rank, world)

    return state, second


# The irregular state (planned whole, the plan cache): the changes to plain values and bytes.
CASES = [(c, "regular") for c in CHANGES] + [
    (c, "irregular") for c in CHANGES if any(w in c for w in ("bool", "float", "zero", "bytes"))
]


@pytest.mark.parametrize(("case", "base"), CASES)
def test_a_change_on_one_rank_commits_what_a_fresh_save_would(
    case: str, base: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, second = changed(case, base)
    checks: list[int] = []
    check = layout.check
    monkeypatch.setattr(layout, "check", lambda *a: checks.append(1) or check(*a))
    got = run_saves(WORLD, state, [tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    ok(got[0])
    ok(got[1])
    if base == "regular":  # the second save was markers only; the third checked or markers
        assert 1 <= len(checks) <= 2
    fresh = fresh_save(second, tmp_path / "fresh", WORLD)
    if all(isinstance(x, sp.CheckpointInfo) for x in fresh):
        ok(got[2])
        assert_same(tmp_path / "c", tmp_path / "fresh")
    else:  # a state a fresh save refuses is refused after markers too
        assert all(isinstance(x, sp.DistributedCheckpointError) for x in got[2]), got[2]
        assert [str(x) for x in got[2]] == [str(x).replace("fresh", "c") for x in fresh]
        assert not (tmp_path / "c").exists()


def _forget_on(ranks: set[int], at: int) -> Callable[[int, Any], None]:
    """Before save ``at``, ``ranks`` lose their memos (their processes restarted)."""

    def before(i: int, coord: Any) -> None:
        if i == at and coord.rank in ranks:
            save.forget(coord.memo_key)
            plancache.forget(coord.memo_key)

    return before


@pytest.mark.parametrize(
    ("restarted", "case"),
    [
        ({0}, None),
        ({1}, None),
        ({0}, "coordinates swapped"),
        ({1}, "coordinates swapped"),
        ({0, 3}, "rank 0 new bytes"),
    ],
)
def test_a_restarted_rank_with_or_without_a_change(
    restarted: set[int], case: str | None, tmp_path: Path
) -> None:
    state, second = changed(case or "every rank new bytes", "regular")
    if case is None:
        state, second = (lambda i, r, w: grid_state(r, w)), (lambda r, w: grid_state(r, w))
    paths = [tmp_path / n for n in "abc"]
    got = run_saves(WORLD, state, paths, before=_forget_on(restarted, 2))
    for outcome in got:
        ok(outcome)
    ok(fresh_save(second, tmp_path / "fresh", WORLD))
    assert_same(tmp_path / "c", tmp_path / "fresh")


def test_two_states_saved_alternately_on_one_group(tmp_path: Path) -> None:
    """Two checkpointers of one process on one group (one memo key): each save its own."""
    states = [
        lambda r, w: grid_state(r, w),
        lambda r, w: grid_state(r, w, rows=12, extra=True, step=True, coord=(r + 1) % w),
    ]
    paths = [tmp_path / f"s{i}" for i in range(5)]
    got = run_saves(WORLD, lambda i, r, w: states[i % 2](r, w), paths)
    for outcome in got:
        ok(outcome)
    for k in (0, 1):
        ok(fresh_save(states[k], tmp_path / f"fresh{k}", WORLD))
    for i, where in enumerate(paths):
        assert_same(where, tmp_path / f"fresh{i % 2}")


@pytest.mark.parametrize("base", list(BASES))
def test_one_state_saved_to_two_paths_alternately(base: str, tmp_path: Path) -> None:
    """a, b, a, b (new bytes each time): a save over an existing checkpoint replaces it."""

    def state(i: int, r: int, w: int) -> Any:
        return grid_state(r, w, fill=float(i), **BASES[base])

    got = run_saves(WORLD, state, [tmp_path / n for n in ("a", "b", "a", "b")])
    for outcome in got:
        ok(outcome)
    for i, name in ((2, "a"), (3, "b")):
        ok(fresh_save(lambda r, w, i=i: state(i, r, w), tmp_path / f"fresh{i}", WORLD))
        assert_same(tmp_path / name, tmp_path / f"fresh{i}")


SWAP = CHANGES["coordinates swapped"]


def _swapped(rank: int, world: int) -> Any:
    return grid_state(rank, world, **SWAP.get(rank, {}))


@pytest.mark.parametrize(
    ("failing", "during", "after"),
    [(1, "same", "same"), (1, "swap", "same"), (1, "swap", "swap"), (0, "swap", "swap")],
)
def test_a_save_failing_in_its_write_step_then_the_next(
    failing: int, during: str, after: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed save's plan was accepted (markers may name it next time): the next save
    still commits what a fresh save commits, of the state it is given."""
    states = {"same": lambda r, w: grid_state(r, w), "swap": _swapped}
    plan = [states["same"], states[during], states[after]]
    current: dict[int, int] = {}
    write = save.write_pieces

    def failing_write(target: Any, staging: str, rank: int, *args: Any, **kw: Any) -> Any:
        if rank == failing and current[rank] == 1:
            raise OSError("injected: the disk is full")
        return write(target, staging, rank, *args, **kw)

    def before(i: int, coord: Any) -> None:
        current[coord.rank] = i

    monkeypatch.setattr(save, "write_pieces", failing_write)
    paths = [tmp_path / n for n in "abc"]
    got = run_saves(WORLD, lambda i, r, w: plan[i](r, w), paths, before=before)
    ok(got[0])
    assert all(isinstance(x, sp.DistributedCheckpointError) for x in got[1]), got[1]
    assert "injected" in str(got[1][0]) and not paths[1].exists()
    ok(got[2])
    ok(fresh_save(plan[2], tmp_path / "fresh", WORLD))
    assert_same(paths[2], tmp_path / "fresh")


def test_the_memo_key_names_the_group_rank_and_timeout() -> None:
    """Another world size, another rank of it, another timeout: another memo (no stale plan)."""

    class Coord:
        def __init__(self, ranks: tuple[int, ...], rank: int, timeout: float) -> None:
            self._ranks, self.rank, self.timeout = ranks, rank, timeout

    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available():  # pragma: no cover
        pytest.skip("no torch.distributed")
    keys = {
        plancache.key(Coord(ranks, rank, timeout))
        for ranks, rank, timeout in [
            ((0, 1, 2, 3), 1, 60.0),
            ((0, 1), 1, 60.0),
            ((0, 1, 2, 3), 2, 60.0),
            ((0, 1, 2, 3), 1, 30.0),
            ((1, 0, 2, 3), 1, 60.0),
        ]
    }
    assert len(keys) == 5


def test_memos_of_a_gone_world_or_beyond_the_kept_keys_are_dropped() -> None:
    """What a process keeps per group (describe's memo, the plan cache, rank 0's implied plan)
    does not pile up: a key of an earlier default group (the world initialised again) is
    dropped at the next save of the new one, and past KEYS_KEPT groups the least recently
    used is; a simulated world's keys are left to it."""
    old = [("torch", 1, (0, 1), 60.0, r) for r in range(3)]
    try:
        for k in old:
            assert plancache.touch(k) == []
            plancache.rank_memo(k, "kept", store=True)  # type: ignore[arg-type]
            save._accepted[k] = "kept"
        sim = ("sim", 7, 0)
        assert plancache.touch(sim) == []
        new = ("torch", 2, (0, 1, 2), 60.0, 0)
        stale = plancache.touch(new)
        assert sorted(stale) == sorted(old)
        for k in stale:
            save.forget(k)
        assert all(plancache.rank_memo(k) is None and k not in save._accepted for k in old)
        many = [("torch", 2, (0, r), 60.0, 0) for r in range(1, plancache.KEYS_KEPT + 3)]
        dropped: list[Any] = []
        for k in many:
            dropped += plancache.touch(k)
        assert dropped == [new, many[0], many[1]]  # least recently used first
        assert plancache.touch(many[2]) == []  # used again: kept, now the newest
    finally:
        for k in [*old, *many, new]:
            save.forget(k)


def test_incremental_and_plain_saves_interleaved(tmp_path: Path) -> None:
    """blobs= saves (planned whole, the plan cache) between grid saves (markers): new bytes
    each time, the coordinates swapped from the fourth save on."""
    blobs = BlobStore.open(tmp_path / "blobs")
    inc = save.Incremental(
        blobs, BlobPolicy(chunk_size=4096, min_blob_bytes=16, workers=1, patches=False)
    )
    kinds = [None, inc, None, inc, inc, None]

    def state(i: int, r: int, w: int) -> Any:
        return grid_state(r, w, fill=float(i % 4), **(SWAP.get(r, {}) if i >= 3 else {}))

    paths = [tmp_path / f"s{i}" for i in range(len(kinds))]
    for outcome in run_saves(WORLD, state, paths, incremental=kinds.__getitem__):
        ok(outcome)
    for i, kind in enumerate(kinds):
        fresh = tmp_path / f"fresh{i}"
        ok(fresh_save(lambda r, w, i=i: state(i, r, w), fresh, WORLD, kind))
        assert_same(paths[i], fresh)


class Mode(str, enum.Enum):  # a config's enum: a str subclass, which marshal refuses
    TRAIN = "train"
    EVAL = "eval"


def test_a_state_holding_a_str_enum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An enum value and key in a regular state: saved (its layout's digest once raised
    ValueError: unmarshallable object), repeated with markers, changed to the other value."""
    checks: list[int] = []
    check = layout.check
    monkeypatch.setattr(layout, "check", lambda *a: checks.append(1) or check(*a))

    def second(r: int, w: int) -> Any:
        return {**grid_state(r, w), "mode": Mode.EVAL, "by": {Mode.TRAIN: 2}}

    def state(i: int, r: int, w: int) -> Any:
        return (
            {**grid_state(r, w), "mode": Mode.TRAIN, "by": {Mode.TRAIN: 1}}
            if i < 2
            else second(r, w)
        )

    got = run_saves(WORLD, state, [tmp_path / n for n in "abc"])
    for outcome in got:
        ok(outcome)
    assert len(checks) == 2  # the second save: markers; the third: another layout, checked
    assert sp.load(tmp_path / "b", framework="numpy")["mode"] == "train"
    ok(fresh_save(second, tmp_path / "fresh", WORLD))
    assert_same(tmp_path / "c", tmp_path / "fresh")


def test_grid_false_between_grid_saves(tmp_path: Path) -> None:
    """``grid=False`` saves (planned whole, version 3) between grid saves (markers, version
    7) of the same state with new bytes: each commits what a fresh save with its options does."""
    grids = [True, False, True, False, True]

    def state(i: int, r: int, w: int) -> Any:
        return grid_state(r, w, fill=float(i))

    def options(i: int) -> SaveOptions:
        return SaveOptions(grid=grids[i])

    paths = [tmp_path / f"s{i}" for i in range(len(grids))]
    for outcome in run_saves(WORLD, state, paths, options=options):
        ok(outcome)
    for i in range(len(grids)):
        fresh = tmp_path / f"fresh{i}"
        ok(fresh_save(lambda r, w, i=i: state(i, r, w), fresh, WORLD, options=options(i)))
        assert_same(paths[i], fresh)
    assert [manifest(p)["format_version"] for p in paths] == [7, 3, 7, 3, 7]
