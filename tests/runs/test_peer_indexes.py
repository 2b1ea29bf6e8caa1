"""Which index files of a version 7 checkpoint a restore from peer memory fetches
(:mod:`savepoint.runs._peer_indexes`), in one process: a checkpoint of 8 simulated ranks on a
(4, 2) mesh (the real writer), its indexes read from its folder as if fetched.

- the dry run names exactly the indexes the lazy reader then reads for each rank's targets, on
  finer and coarser meshes, and the plan made with them is the plan made with every index;
- ranks numbered otherwise than the mesh (two indexes swapped, the manifest's records with
  them): the plan asks for an index not fetched, which is recorded, not read; every other index
  is then fetched and the plan made again is the eager one;
- a load without sharded targets (nor a process group) fetches every index.

``tests/runs/test_peers_grid.py`` restores such checkpoints across processes and counts the
index files each rank fetches.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from savepoint.codecs import manifest as mf
from savepoint.distributed import simulate
from savepoint.distributed.needs import files_needed
from savepoint.runs._peer_indexes import Indexes, reads_lazily

WORLD = 8
NAMES = [mf.index_name(r) for r in range(WORLD)]


def state(rank: int, world: int, tp: int = 2) -> Any:
    return simulate.model_state(
        rank, world, 12, tp=tp, data=True, hidden=16, experts=2, expert_ffn=8, regular=True
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("peer-indexes") / "c"
    sim = simulate.simulate_save(WORLD, state, str(path), writer="real")
    assert not [r for r in sim.results if isinstance(r, BaseException)], sim.results
    return path


def _eager(where: Path, into: Any) -> set[str]:
    raw = (where / mf.NAME).read_bytes()
    manifest = mf.parse(raw, columns=False, read_index=lambda n, s: (where / n).read_bytes())
    return files_needed(manifest, str(where), into=into)


@pytest.mark.parametrize(("world", "tp"), [(16, 2), (4, 1), (2, 2)])
def test_the_dry_run_names_the_indexes_the_lazy_plan_reads(
    saved: Path, world: int, tp: int
) -> None:
    raw = (saved / mf.NAME).read_bytes()
    fewer = 0
    for rank in range(world):
        into = state(rank, world, tp)
        indexes = Indexes(raw, str(saved), NAMES, {"into": into})
        first = indexes.first()
        manifest = indexes.parse()
        assert isinstance(manifest.tensors, mf.GridTensors)
        files = files_needed(manifest, str(saved), into=into)
        assert indexes.missing == [] and indexes.rest() == [], (rank, indexes.missing)
        assert sorted(manifest.tensors.read) == first, (rank, first)  # (each read once)
        assert files == _eager(saved, into), rank
        fewer += len(first) < WORLD
    if world >= 4:
        assert fewer == world  # every rank of a finer or equal mesh fetches only some


def test_ranks_numbered_otherwise_than_the_mesh_fetch_every_index_in_a_second_round(
    saved: Path, tmp_path: Path
) -> None:
    where = tmp_path / "c"
    shutil.copytree(saved, where)
    m = mf.parse((where / mf.NAME).read_bytes(), read_index=lambda n, s: (where / n).read_bytes())
    a, b = where / NAMES[0], where / NAMES[7]
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    assert m.indices is not None
    m.indices = {**m.indices, NAMES[0]: m.indices[NAMES[7]], NAMES[7]: m.indices[NAMES[0]]}
    raw = mf.dumps(m)
    (where / mf.NAME).write_bytes(raw)
    into = state(0, 16, 2)
    indexes = Indexes(raw, str(where), NAMES, {"into": into})
    first = indexes.first()
    assert len(first) < WORLD, first
    with pytest.raises(Exception, match=r"index-r\d+\.json"):  # (the restore's plan catches it)
        files_needed(indexes.parse(), str(where), into=into)
    assert indexes.missing, "the plan asked for no index that was not fetched"
    rest = indexes.rest()
    assert sorted(first + rest) == NAMES, (first, rest)
    manifest = indexes.parse()
    assert files_needed(manifest, str(where), into=into) == _eager(where, into)
    assert indexes.missing == [] and indexes.rest() == []


def test_a_load_without_sharded_targets_fetches_every_index(saved: Path) -> None:
    raw = (saved / mf.NAME).read_bytes()
    plain = {"model": {"x": 1}}
    for options in ({}, {"into": plain}, {"into": None, "process_group": object()}):
        assert not reads_lazily(options)
        assert Indexes(raw, str(saved), NAMES, options).first() == NAMES
    assert reads_lazily({"into": plain, "process_group": object()})
    assert reads_lazily({"into": state(0, 4, 1)})
