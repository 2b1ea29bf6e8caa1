"""Fetched files received straight into the targets (distributed.needs.direct_ranges, used by
runs._peer_restore): which tensors qualify, and that landing their ranges from the files and
loading the rest with those targets set aside restores exactly what a plain load restores, on
any world size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from distributed.test_local import check, empty_state, rank_state, save_ranks
from savepoint.codecs import manifest as mf
from savepoint.distributed import Shard
from savepoint.distributed.needs import Direct, direct_ranges
from savepoint.runs._peer_restore import _Into, _set_aside, _sinks


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt3"
    save_ranks(path, [rank_state(r, 3) for r in range(3)], max_file_bytes=1)  # a file a shard
    return path


def manifest(path: Path) -> mf.Manifest:
    return mf.parse((path / mf.NAME).read_bytes(), columns=False)


def land(path: Path, direct: list[Direct]) -> None:
    """What the wire does with a fetched file: its bytes through ``_Into``, in pieces."""
    for name, ranges in _sinks(direct).items():
        data = (path / name).read_bytes()
        sink, at = _Into(ranges), 0
        while at < len(data):
            into, n = sink.place(at, 7)  # (small pieces: every boundary is crossed)
            if into is not None:
                into[:n] = data[at : at + n]
            at += n


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_landing_the_ranges_then_loading_the_rest_restores_everything(
    sharded: Path, world: int
) -> None:
    m = manifest(sharded)
    for rank in range(world):
        into = empty_state(rank, world)
        keys = list(into)
        direct = direct_ranges(m, str(sharded), into, set(m.files))
        assert direct, "nothing qualified"
        land(sharded, direct)
        with _set_aside(direct):
            assert all(d.key not in d.parent for d in direct)
            sp.load(sharded, into=into)
        assert list(into) == keys  # put back, in order
        check(into, rank, world)


def test_only_whole_contiguous_raw_runs_of_fetched_files_qualify(sharded: Path) -> None:
    m = manifest(sharded)
    into = empty_state(0, 1)  # the whole of each tensor on one rank
    direct = direct_ranges(m, str(sharded), into, set(m.files))
    kinds = {(id(d.parent), d.key) for d in direct}
    assert (id(into), "rows") in kinds and (id(into), "rep") in kinds  # row blocks; whole
    assert len(next(d for d in direct if d.key == "rows").ranges) == 3  # one per stored shard
    assert (id(into), "cols") not in kinds  # column blocks: not one run of the target each
    assert (id(into), "flat") not in kinds  # a FlatShard target goes through the loader
    assert direct_ranges(m, str(sharded), into, set()) == []  # nothing fetched
    # only tensors whose every file is fetched
    rows = {name for name, _, _, _ in next(d for d in direct if d.key == "rows").ranges}
    assert [d.key for d in direct_ranges(m, str(sharded), into, rows)] == ["rows"]
    assert direct_ranges(m, str(sharded), into, set(sorted(rows)[1:])) == []


def test_targets_it_cannot_write_straight_into_are_left_to_the_loader(sharded: Path) -> None:
    m = manifest(sharded)
    into: dict[str, Any] = empty_state(0, 1)
    into["rep"] = np.zeros((4, 3), np.int16).T  # not C-contiguous
    into["rows"] = Shard(np.zeros((10, 6), np.float32)[:, ::1].copy(), (10, 6), (0, 0))
    into["rows"].local.flags.writeable = False
    keys = [d.key for d in direct_ranges(m, str(sharded), into, set(m.files))]
    assert "rep" not in keys and "rows" not in keys and "p0" in keys, keys
    into = empty_state(0, 1)
    into["rep"] = np.zeros((3, 5), np.int16)  # a shape mismatch: the load reports it
    assert direct_ranges(m, str(sharded), into, set(m.files)) == []


def test_a_target_set_aside_is_put_back_even_when_the_load_fails() -> None:
    a, b = np.zeros(3), np.ones(2)
    into = {"a": a, "b": b, "n": 1}
    d = Direct("a", a.view(np.uint8), into, "a", [])

    def failing_load() -> None:
        with _set_aside([d]):
            assert "a" not in into
            into["n"] = 2  # (what a load assigns stays)
            raise RuntimeError

    with pytest.raises(RuntimeError):
        failing_load()
    assert list(into) == ["a", "b", "n"] and into["a"] is a and into["n"] == 2


def test_no_tensor_lands_straight_from_a_file_the_loader_reads_too(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save_ranks(path, [rank_state(r, 3) for r in range(3)])  # a file a rank: flat in each
    m = manifest(path)
    assert all(any(s.file == f for s in m.tensors["flat"].layout()) for f in m.files)
    assert direct_ranges(m, str(path), empty_state(0, 1), set(m.files)) == []  # flat: every file
    # rank 0 of 3 loads the flat range of rank 0's file only: rows (beside it) stays with the
    # loader, rep lands straight (rank 2's file, whose flat range rank 0 does not load)
    keys = {d.key for d in direct_ranges(m, str(path), empty_state(0, 3), set(m.files))}
    assert "rows" not in keys and "flat" not in keys and "rep" in keys, keys


@pytest.mark.parametrize("same", [True, False])
def test_tied_tensors_and_shared_targets_are_left_to_the_loader(tmp_path: Path, same: bool) -> None:
    w = np.arange(64, dtype=np.float32)
    sp.save(tmp_path / "c", {"a": w, "b": w, "c": w + 1})  # a and b tied: one stored tensor
    m = manifest(tmp_path / "c")
    x, y = np.zeros(64, np.float32), np.zeros(64, np.float32)
    into = {"a": x, "b": x if same else y, "c": np.zeros(64, np.float32)}
    direct = direct_ranges(m, str(tmp_path / "c"), into, set(m.files))
    assert [d.key for d in direct] == []  # (c shares the one data file with the tied tensor)
    into2 = {"a": x, "c": x}  # one target under two keys
    assert direct_ranges(m, str(tmp_path / "c"), into2, set(m.files)) == []


def test_only_checkpoints_of_large_tensors_land_straight(tmp_path: Path) -> None:
    from savepoint.runs import _peer_restore

    big = np.arange(_peer_restore.DIRECT_AVERAGE // 4, dtype=np.float32)
    for state, lands in (({"w": big, "n": 1}, True), ({"w": big[:1000], "n": 1}, False)):
        path = tmp_path / f"c{lands}"
        sp.save(path, state)
        into = {"w": np.zeros_like(state["w"]), "n": 0}
        wanted, direct = _peer_restore._needs(manifest(path), str(path), {"into": into})
        assert wanted == set(manifest(path).files)
        assert [d.key for d in direct] == (["w"] if lands else [])
        _, none = _peer_restore._needs(manifest(path), str(path), {"into": into, "verify": "first"})
        assert none == []
