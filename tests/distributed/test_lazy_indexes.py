"""A resharding load of a version 7 checkpoint reads only the index files of the ranks whose pieces
it reads (issue 28, fleet-scale loads: :mod:`savepoint.codecs.manifest._v7_lazy`).

The checkpoint is saved by 8 simulated ranks on a (4, 2) mesh with the real writer (tensors split
over both mesh dimensions, nested on one tensor dimension, and replicated over the second), then
loaded rank by rank onto other meshes in this process (``sp.load(into=Shards)``: the sharded
loader without a process group). The index files a load opens are counted at the store.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import shutil
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import boxes
from savepoint.codecs import manifest as mf
from savepoint.codecs.manifest import _v7_lazy
from savepoint.distributed import Shard, layout, simulate

WORLD = 8


def state(rank: int, world: int, tp: int = 2) -> Any:
    return simulate.model_state(
        rank, world, 12, tp=tp, data=True, hidden=32, experts=2, expert_ffn=16, regular=True
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v7lazy") / "c"
    sim = simulate.simulate_save(WORLD, state, str(path), writer="real")
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert sp.verify(path).format_version == mf.GRID
    return path


@pytest.fixture(scope="module")
def full(saved: Path) -> Any:
    return sp.load(saved, framework="numpy")


def _writers(where: Path) -> dict[tuple[str, boxes.Box], str]:
    """(tensor, box) -> the index file listing that piece, read from the files themselves."""
    doc = json.loads((where / mf.NAME).read_bytes())
    out = {}
    for name in doc["indices"]:
        shards = json.loads((where / name).read_bytes())["shards"]
        for key, listed in shards.items():
            for s in listed:
                out[(key, tuple(tuple(p) for p in s["box"]))] = name
    return out


def _load(
    where: Path, rank: int, world: int, tp: int, full: Any, source: Path | None = None
) -> set[str]:
    """Load rank ``rank`` of ``world`` (mesh (world / tp, tp)), check every value; the index
    files it needed (those listing a piece meeting one of its Shards: in ``source``'s, an
    undamaged copy, where given)."""
    into = state(rank, world, tp)
    writers = _writers(source or where)
    need = set()
    for group in ("model", "optim"):
        for key, value in _shards(into[group]):
            value.local[...] = 0
            for (k, box), name in writers.items():
                meet = boxes.intersect(box, value.box) if k == key else None
                if meet is not None and boxes.volume(meet) > 0:
                    need.add(name)
    sp.load(where, into=into)
    for group in ("model", "optim"):
        for key, value in _shards(into[group]):
            *path, leaf = key.split("/")
            want: Any = full
            for part in (*path, leaf):
                want = want[part]
            got = want[tuple(slice(a, b) for a, b in value.box)]
            np.testing.assert_array_equal(value.local, got, err_msg=key)
    return need


def _shards(node: Any, prefix: str = "") -> Iterator[tuple[str, Shard]]:
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _shards(v, f"{prefix}{k}/")
        elif isinstance(v, Shard):
            yield (
                f"model/{prefix}{k}" if not prefix.startswith("state/") else f"optim/{prefix}{k}",
                v,
            )


@pytest.mark.parametrize(("world", "tp"), [(16, 2), (4, 1), (2, 2)])
def test_a_resharding_load_reads_only_the_indexes_it_needs(
    saved: Path, full: Any, opened: list[str], world: int, tp: int
) -> None:
    every = {f"index-r{r:05d}.json" for r in range(WORLD)}
    fewer = 0
    for rank in range(world):
        opened.clear()
        need = _load(saved, rank, world, tp, full)
        assert need, rank
        assert set(opened) == need, (rank, sorted(opened), sorted(need))
        assert len(opened) == len(set(opened)), f"an index read twice: {opened}"
        fewer += set(opened) < every
    if world >= 4:
        assert fewer == world  # every rank of a finer or equal mesh needs only some


def test_a_load_without_targets_and_verify_read_every_index(saved: Path, opened: list[str]) -> None:
    every = {f"index-r{r:05d}.json" for r in range(WORLD)}
    sp.verify(saved)
    assert set(opened) == every
    opened.clear()
    sp.load(saved)
    assert set(opened) == every


def _damage(where: Path, name: str, how: str) -> None:
    path = where / name
    if how == "missing":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "missing"])
def test_a_damaged_index_fails_the_loads_that_need_it_and_verify_only(
    saved: Path, full: Any, tmp_path: Path, how: str
) -> None:
    where = tmp_path / "c"
    shutil.copytree(saved, where)
    # rank 0 of 16 (mesh (8, 2)) needs the pieces of old fsdp row 0 only: ranks 0 and 1
    need = _load(where, 0, 16, 2, full)
    assert need <= {"index-r00000.json", "index-r00001.json"}, need
    _damage(where, "index-r00007.json", how)
    _load(where, 0, 16, 2, full, saved)  # an index it does not need: not read, the load succeeds
    with pytest.raises(sp.CorruptCheckpointError, match=r"index-r00007\.json"):
        sp.verify(where)
    with pytest.raises(sp.CorruptCheckpointError, match=r"index-r00007\.json"):
        _load(where, 15, 16, 2, full, saved)  # the last rank needs it
    with pytest.raises(sp.CorruptCheckpointError, match=r"index-r00007\.json"):
        sp.load(where)


def test_ranks_numbered_otherwise_than_the_mesh_fall_back_to_every_index(
    saved: Path, full: Any, tmp_path: Path, opened: list[str]
) -> None:
    # The indexes of ranks 0 and 7 swapped, the manifest's records with them: still a valid
    # checkpoint (the eager reader takes the union), but rank 0's pieces are not where the
    # mesh says: the lazy reader finds out and reads every index.
    where = tmp_path / "c"
    shutil.copytree(saved, where)
    m = mf.parse((where / mf.NAME).read_bytes(), read_index=lambda n, s: (where / n).read_bytes())
    a, b = where / "index-r00000.json", where / "index-r00007.json"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    assert m.indices is not None
    ra, rb = m.indices["index-r00000.json"], m.indices["index-r00007.json"]
    m.indices = {**m.indices, "index-r00000.json": rb, "index-r00007.json": ra}
    (where / mf.NAME).write_bytes(mf.dumps(m))
    sp.verify(where)
    opened.clear()
    _load(where, 0, 16, 2, full)
    assert len(set(opened)) == WORLD


def test_lazy_records_are_the_eager_ones(saved: Path) -> None:
    raw = (saved / mf.NAME).read_bytes()

    def read(name: str, size: int) -> bytes:
        return (saved / name).read_bytes()

    eager = mf.parse(raw, read_index=read)
    lazy = mf.parse(raw, read_index=read, lazy=True)
    assert isinstance(lazy.tensors, mf.GridTensors) and lazy.tensors.read == []
    assert list(lazy.tensors) == list(eager.tensors)
    for key, rec in eager.tensors.items():
        got = lazy.tensors[key]
        assert (got.dtype, got.shape, len(got.layout())) == (
            rec.dtype,
            rec.shape,
            len(rec.layout()),
        )
        assert tuple(got.layout()) == tuple(rec.layout()), key
        assert (got.file, got.start, got.end, got.xxh3) == (rec.file, rec.start, rec.end, rec.xxh3)
    assert lazy.tensors._full is None  # every piece was where the mesh said


# ---------------------------------------------------------------------------------------------
# the grid arithmetic against layout.grid_box and layout.writes, on random small grids
# ---------------------------------------------------------------------------------------------


def _pieces(
    shape: tuple[int, ...], mesh: tuple[int, ...], grid: tuple[Any, ...], position: int
) -> Any:
    table = types.SimpleNamespace(raw={"t": {"shape": list(shape)}}, mesh=mesh, grids={"t": grid})
    return _v7_lazy.GridPieces(types.SimpleNamespace(table=table), "t", position)  # type: ignore[arg-type]


def test_grid_pieces_match_grid_box_and_the_writers_rule() -> None:
    rnd = random.Random(7)
    for _ in range(400):
        mesh = tuple(rnd.randint(1, 4) for _ in range(rnd.randint(1, 3)))
        shape = tuple(
            rnd.randint(0 if rnd.random() < 0.1 else 1, 9) for _ in range(rnd.randint(0, 3))
        )
        grid = tuple(rnd.choice([None, *range(len(shape))]) for _ in mesh)
        count = rnd.randint(1, 5)
        position = rnd.randrange(count)
        p = _pieces(shape, mesh, grid, position)
        coords = list(itertools.product(*(range(n) for n in mesh)))
        if math.prod(shape):
            want = sorted(
                {
                    layout.grid_box(shape, mesh, c, grid)
                    for c in coords
                    if boxes.volume(layout.grid_box(shape, mesh, c, grid))
                }
            )
        else:
            want = [boxes.full(shape)]
        assert [p.region(i) for i in range(len(p))] == want, (shape, mesh, grid)
        # the writer of each piece, by the save's rule
        dims = [grid] * count
        lay = layout.Layout(
            {}, mesh, [f"k{i}" for i in range(count)], ["F32"] * count, [shape] * count, dims
        )
        for rank, c in enumerate(coords):
            if position in layout.writes(lay, c):
                box = (
                    layout.grid_box(shape, mesh, c, grid) if math.prod(shape) else boxes.full(shape)
                )
                if boxes.volume(box) or not math.prod(shape):
                    assert p.writer(want.index(box)) == rank, (shape, mesh, grid, c)
        # near: exactly the pieces meeting a box
        if math.prod(shape):
            lo = [rnd.randrange(n) for n in shape]
            region = tuple((a, rnd.randint(a + 1, n)) for a, n in zip(lo, shape))
            got = {i for i, _ in p.near(region)}
            common = [boxes.intersect(b, region) for b in want]
            meet = {i for i, c in enumerate(common) if c is not None and boxes.volume(c) > 0}
            assert got == meet, (shape, mesh, grid, region)


def test_a_hostile_mesh_is_not_listed() -> None:
    # 2**30 pieces claimed: their count and any one of them by arithmetic, never a list
    p = _pieces((1 << 40,), (1 << 30,), (0,), 0)
    assert len(p) == 1 << 30
    assert p.region(12345) == ((12345 * 1024, 12346 * 1024),)
    assert p.writer(12345) == 12345
    assert [i for i, _ in p.near(((5000, 5000 + 2048),))] == [4, 5, 6]
