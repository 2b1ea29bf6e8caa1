"""Resharding loads of version 7 checkpoints read lazily: exact values, and exactly the index
files of the ranks that wrote the pieces a load needs (:mod:`savepoint.codecs.manifest._v7_lazy`).

Regular states (Shards carrying their grid, as DTensors are read) saved by N simulated ranks with
the real writer, on 1-D and 2-D meshes: uneven splits, a tensor split twice on one dimension, one
split over both mesh dimensions, dims smaller than the mesh (ranks holding empty pieces), a tensor
without elements, a scalar, replicated tensors; then loaded rank by rank (``sp.load(into=...)``,
no process group) onto M ranks of other meshes, M > N and M = 1 among them, verified and not.
Also: damage to an index a load does not need, and the checkpoint deleted or replaced under a
load.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import boxes
from savepoint.codecs import manifest as mf
from savepoint.distributed import Shard, layout, simulate
from savepoint.distributed import load as dload

# name -> (shape, dtype, tensor dimension split over each mesh dimension, for 2-D meshes)
SPECS: dict[str, tuple[tuple[int, ...], str, tuple[int | None, ...]]] = {
    "uneven": ((7, 5), "float32", (0, 1)),
    "nested": ((5, 3), "float32", (0, 0)),
    "tiny": ((3,), "int16", (0, None)),  # fewer rows than ranks: empty pieces
    "empty": ((0, 4), "float32", (0, None)),
    "plain": ((6,), "float64", (None, None)),
    "cols": ((2, 9), "uint8", (1, 0)),
    "scalar": ((), "float32", (None, None)),
    "half": ((4, 6), "float16", (None, 1)),  # replicated over the first mesh dimension
    "empty-tp": ((0, 6), "float32", (None, 1)),  # its writer's part is [0, 0) x [3, 6), say
}


def full(name: str) -> np.ndarray[Any, Any]:
    shape, dtype, _ = SPECS[name]
    values = np.arange(math.prod(shape), dtype=np.float64) * 1.25 + len(name)
    return values.astype(dtype).reshape(shape)


def state(rank: int, mesh: tuple[int, ...], zero: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s state on ``mesh`` (C order), its parts zeroed where ``zero``."""
    coord = tuple(int(c) for c in np.unravel_index(rank, mesh))
    out: dict[str, Any] = {}
    for name, (shape, _, grid) in SPECS.items():
        dims = grid[: len(mesh)]
        whole = full(name)
        if all(d is None for d in dims):
            out[name] = np.zeros_like(whole) if zero else whole.copy()
            continue
        box = layout.grid_box(shape, mesh, coord, dims)
        local = whole[tuple(slice(a, b) for a, b in box)].copy()
        if zero:
            local[...] = 0
        grid = layout.Grid(mesh, coord, dims)
        out[name] = Shard(local, shape, [a for a, _ in box], grid=grid)
    return out


def save(where: Path, mesh: tuple[int, ...]) -> Path:
    sim = simulate.simulate_save(
        math.prod(mesh), lambda r, w: state(r, mesh), str(where), writer="real"
    )
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert sp.verify(where).format_version == mf.GRID
    return where


def writers(where: Path) -> dict[str, list[tuple[boxes.Box, str]]]:
    """Per tensor, each piece's box and the index listing it, read from the files."""
    doc = json.loads((where / mf.NAME).read_bytes())
    out: dict[str, list[tuple[boxes.Box, str]]] = {}
    for name in doc["indices"]:
        for key, listed in json.loads((where / name).read_bytes())["shards"].items():
            for s in listed:
                out.setdefault(key, []).append((tuple(tuple(p) for p in s["box"]), name))
    return out


def needed(where: Path, into: dict[str, Any]) -> set[str]:
    """The indexes listing a piece that meets a target's region: with an element of it (a
    tensor without elements needs no index); a tensor stored as one piece (replicated, say) is
    read whole, its writer's index with it."""
    out = set()
    for key, pieces in writers(where).items():
        value = into[key]
        region = value.box if isinstance(value, Shard) else boxes.full(SPECS[key][0])
        for box, name in pieces:
            meet = boxes.intersect(box, region)
            meets = meet is not None and boxes.volume(meet) > 0
            if meets or (len(pieces) == 1 and boxes.volume(box)):
                out.add(name)
    return out


def check(into: dict[str, Any]) -> None:
    for key, value in into.items():
        got = value.local if isinstance(value, Shard) else value
        want = full(key)
        if isinstance(value, Shard):
            want = want[tuple(slice(a, b) for a, b in value.box)]
        assert got.dtype == want.dtype, key
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), key  # bit-exact


@pytest.mark.parametrize(
    ("saved", "loaded", "verify"),
    [
        ((2, 2), (3, 1), True),
        ((2, 3), (1,), False),
        ((2, 3), (8,), True),
        ((4,), (3, 2), False),
        ((3,), (2, 2), True),
        ((2, 2), (5, 2), "first"),
        ((4, 2), (2, 4), True),
    ],
)
def test_resharding_loads_are_exact_and_read_the_needed_indexes_only(
    tmp_path: Path,
    opened: list[str],
    saved: tuple[int, ...],
    loaded: tuple[int, ...],
    verify: bool | str,
) -> None:
    where = save(tmp_path / "c", saved)
    every = {f"index-r{r:05d}.json" for r in range(math.prod(saved))}
    for rank in range(math.prod(loaded)):
        into = state(rank, loaded, zero=True)
        opened.clear()
        sp.load(where, into=into, verify=verify)
        check(into)
        assert len(opened) == len(set(opened)), f"an index read twice: {opened}"
        assert set(opened) == needed(where, into), (rank, sorted(opened))
        assert set(opened) <= every


def _damage(path: Path, how: str, other: Path) -> None:
    if how == "missing":
        path.unlink()
    elif how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x20
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-5])
    elif how == "another-rank's":
        path.write_bytes(other.read_bytes())
    else:
        path.write_bytes(b"{}")


@pytest.mark.parametrize("how", ["missing", "flip", "truncated", "another-rank's", "emptied"])
def test_a_damaged_index_fails_only_the_loads_that_need_it(tmp_path: Path, how: str) -> None:
    where = save(tmp_path / "c", (2, 2))
    victim = "index-r00001.json"
    mesh = (4, 1)
    need = [needed(where, state(rank, mesh)) for rank in range(4)]
    _damage(where / victim, how, where / "index-r00003.json")
    for rank in range(4):
        into = state(rank, mesh, zero=True)
        if victim in need[rank]:
            with pytest.raises(sp.CorruptCheckpointError, match=victim.replace(".", r"\.")):
                sp.load(where, into=into)
            continue
        sp.load(where, into=into)  # an index it does not need: not read, the load succeeds
        check(into)
    # rows [4, 8) of a (4, 1) mesh (ranks 2, 3) meet old fsdp row 1 only: not rank 1's pieces
    # (old (0, 1): "uneven" [0, 4) x [3, 5), say)
    assert [victim in n for n in need] == [True, True, False, False]
    with pytest.raises(sp.CorruptCheckpointError, match=victim.replace(".", r"\.")):
        sp.verify(where)


@pytest.mark.parametrize("when", ["before-the-indexes", "before-the-data"])
@pytest.mark.parametrize("how", ["deleted", "replaced", "moved-aside"])
def test_the_checkpoint_gone_under_a_load_is_load_again_or_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str, how: str
) -> None:
    where = save(tmp_path / "c", (2, 2))
    other = None
    if how == "replaced":  # another checkpoint, of other values, there instead
        with monkeypatch.context() as m:
            m.setattr(sys.modules[__name__], "full", lambda name, real=full: real(name) + 1)
            other = save(tmp_path / "other", (4,))

    def away() -> None:
        if how == "moved-aside":  # (as a replace leaves it until it deletes it)
            where.rename(tmp_path / "aside")
            return
        shutil.rmtree(where)
        if other is not None:
            other.rename(where)

    # opened (its manifest read, no index yet), or planned (indexes read, data files opened)
    owner, hook = (
        (dload.shard, "swap_targets") if when == "before-the-indexes" else (dload, "_fill")
    )
    real = getattr(owner, hook)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        away()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, hook, hooked)
    into = state(3, (2, 2), zero=True)
    if when == "before-the-indexes" and how != "moved-aside":
        # its indexes are read while planning: gone, they are no damage but "load again"
        with pytest.raises(sp.ReplacedWhileReadingError, match=f"was {how} .*index-r.*load again"):
            sp.load(where, into=into)
        for value in into.values():  # nothing was written
            assert not (value.local if isinstance(value, Shard) else value).any()
        return
    # planned (the data files it reads are open), or its files still there: it reads the
    # checkpoint it opened, not the one at the path now
    sp.load(where, into=into)
    check(into)
