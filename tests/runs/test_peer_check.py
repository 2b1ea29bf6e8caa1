"""A data file checked against its manifest as it arrives (runs._peer_check): the ranges tile the
file, any split into pieces checks the same, and a damaged byte anywhere is found."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import manifest as mf
from savepoint.runs._peer_check import Check, units


def saved(tmp_path: Path) -> tuple[mf.Manifest, dict[str, bytes]]:
    rng = np.random.default_rng(3)
    state = {
        "big": rng.standard_normal(300_000).astype(np.float32),  # block checksums
        "small": rng.standard_normal(100).astype(np.float64),
        "empty": np.zeros(0, np.float32),
        "scalar": np.float16(2.5),
        "n": 7,
    }
    sp.save(tmp_path / "c", state)
    manifest = mf.parse((tmp_path / "c" / mf.NAME).read_bytes(), columns=False)
    files = {n: (tmp_path / "c" / n).read_bytes() for n in manifest.files}
    return manifest, files


def run(found: list[tuple[int, int, str]], data: bytes, piece: int) -> str | None:
    check = Check(found)
    view = memoryview(data)
    for at in range(0, len(data), piece):
        check.update(at, view[at : at + piece])
    return check.problem()


@pytest.mark.parametrize("piece", [7, 4096, 65536 + 3, 1 << 20])
def test_an_intact_file_checks_whatever_its_pieces(tmp_path: Path, piece: int) -> None:
    manifest, files = saved(tmp_path)
    for name, data in files.items():
        found = units(manifest, name)
        assert found is not None and found[0][0] == 0 and found[-1][1] == len(data)
        assert len(found) == 5  # the header, then each tensor (the empty one too)
        assert run(found, data, piece) is None


@pytest.mark.parametrize("where", ["header", "data", "last"])
def test_a_damaged_byte_is_found(tmp_path: Path, where: str) -> None:
    manifest, files = saved(tmp_path)
    ((name, data),) = files.items()
    found = units(manifest, name)
    assert found is not None
    at = {"header": 20, "data": len(data) // 2, "last": len(data) - 1}[where]
    damaged = bytearray(data)
    damaged[at] ^= 0x01
    problem = run(found, bytes(damaged), 65536 + 3)
    assert problem is not None and "the manifest records" in problem
    assert run(found, data[: len(data) - 5], 4096) is not None  # truncated: not all there


def test_a_file_the_manifest_does_not_cover_whole_has_no_units(tmp_path: Path) -> None:
    manifest, files = saved(tmp_path)
    (name,) = files
    record = manifest.files[name]
    grown = mf.FileRecord(record.size + 8, record.header_size, record.header_xxh3)
    assert units(manifest, "no-such-file") is None
    files_attr = dict(manifest.files)
    files_attr[name] = grown
    try:
        object.__setattr__(manifest, "files", files_attr)
    except (AttributeError, TypeError):
        pytest.skip("a manifest's files cannot be swapped here")
    assert units(manifest, name) is None  # 8 bytes no checksum covers


def test_ranges_split_anywhere_across_pieces_check_the_same() -> None:
    from savepoint.codecs import checksum

    data = np.random.default_rng(5).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    bounds = [0, 1, 1, 9000, 65536, 65537, 200_000, 300_000]  # (one empty range)
    found = [(a, b, checksum.digest(data[a:b])) for a, b in itertools.pairwise(bounds)]
    for piece in (1000, 65536, 65536 + 1, 300_000):
        assert run(found, data, piece) is None
    damaged = bytearray(data)
    damaged[65536] ^= 0x80
    problem = run(found, bytes(damaged), 4096)
    assert problem is not None and problem.startswith("bytes 65536-65537")


def test_a_version_7_parts_files_are_checked_against_its_index_alone(tmp_path: Path) -> None:
    # (runs._peer_grid: an index's shards give the ranges a parsed manifest gives)
    from savepoint.codecs import checksum
    from savepoint.runs._peer_grid import Head, head, index_problem

    manifest, files = saved(tmp_path)
    pieces = [(k, s) for k, r in manifest.tensors.items() for s in r.layout()]
    index = mf.index_bytes(pieces)
    record = mf.IndexRecord(len(index), checksum.digest(index))
    grid = Head(1, dict(manifest.files), {mf.index_name(0): record})
    for name in files:
        assert grid.units(index)(name) == units(manifest, name) is not None, name
    assert grid.units(b"{")("data.safetensors") is None  # (a malformed index checks nothing)
    assert grid.units(index)("other") is None
    big = max(pieces, key=lambda p: p[1].end - p[1].start)  # (left out: a gap in its file)
    assert grid.units(mf.index_bytes([p for p in pieces if p is not big]))(big[1].file) is None
    assert index_problem(record, len(index), checksum.digest(index)) is None
    assert "the manifest records" in str(index_problem(record, len(index), "0" * 16))
    # head(): None for another version; the members of a version 7 manifest checked
    assert head((tmp_path / "c" / mf.NAME).read_bytes()) is None
    doc = {"format": mf.FORMAT, "format_version": 7, "world_size": 1, "files": {}}
    doc["indices"] = {"index-r00000.json": {"size": record.size, "xxh3": record.xxh3}}
    assert head(json.dumps(doc).encode()) == Head(1, {}, {"index-r00000.json": record})
    doc["indices"] = {"../x": {"size": 1, "xxh3": record.xxh3}}
    with pytest.raises(sp.CorruptCheckpointError, match="plain file name"):
        head(json.dumps(doc).encode())
