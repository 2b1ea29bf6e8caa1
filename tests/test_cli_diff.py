"""``savepoint diff``: tensors with equal stored checksums are not read (digests compared only
between records hashed the same way), and differences are printed as they are found."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import savepoint as sp
from savepoint.cli import main
from savepoint.engine.read import Reader
from savepoint.errors import CorruptCheckpointError
from savepoint.formats import diff as diff_mod


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The refs every Reader.transfer is asked to copy, in order."""
    seen: list[str] = []
    original = Reader.transfer

    def transfer(self: Reader, jobs: Any, **kwargs: Any) -> None:
        seen.extend(ref for ref, _ in jobs)
        original(self, jobs, **kwargs)

    monkeypatch.setattr(Reader, "transfer", transfer)
    return seen


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    state = {f"t{i}": rng.standard_normal(5000).astype(np.float32) for i in range(6)}
    sp.save(tmp_path / "a", state)
    state["t3"] = state["t3"] + 1
    sp.save(tmp_path / "b", state)
    return tmp_path / "a", tmp_path / "b"


def test_equal_checksums_are_not_read(tmp_path: Path, reads: list[str]) -> None:
    a, b = _pair(tmp_path)
    report = sp.diff(a, b)
    assert reads == ["t3", "t3"]  # only the tensor whose digests differ, once per side
    rows = {t.key: t for t in report.tensors}
    assert rows["t3"].equal is False and rows["t3"].by_checksum is False
    assert all(rows[k].equal and rows[k].by_checksum for k in rows if k != "t3")
    reads.clear()
    full = sp.diff(a, b, read_all=True)
    assert sorted(reads) == sorted(2 * [f"t{i}" for i in range(6)])
    assert [(t.key, t.equal) for t in full.tensors] == [(t.key, t.equal) for t in report.tensors]
    assert not any(t.by_checksum for t in full.tensors)


def test_digests_of_different_kinds_are_read(tmp_path: Path, reads: list[str]) -> None:
    """A version 3 (sharded) save records a block-combined digest for a shard over 128 KiB,
    not the hash of the bytes: compared with an unsharded save's digest it proves nothing, so
    the data is read, and found equal."""
    full = np.arange(1 << 18, dtype=np.float32).reshape(512, 512)
    sp.save(tmp_path / "sharded", {"w": sp.Shard(full, (512, 512), (0, 0))})
    sp.save(tmp_path / "whole", {"w": full})
    assert sp.inspect(tmp_path / "sharded").format_version == 3
    report = sp.diff(tmp_path / "sharded", tmp_path / "whole")
    assert reads == ["w", "w"]
    assert report.identical and not report.tensors[0].by_checksum
    reads.clear()
    same = sp.diff(tmp_path / "sharded", tmp_path / "sharded")  # same kind, same digests
    assert reads == [] and same.tensors[0].by_checksum


def test_same_digests_rules() -> None:
    from savepoint.codecs import boxes
    from savepoint.codecs import manifest as mf

    whole = mf.TensorRecord("F32", (4,), "f", 0, 16, "aaaaaaaaaaaaaaaa")
    assert diff_mod.same_digests(whole, whole)
    assert not diff_mod.same_digests(whole, mf.TensorRecord("F32", (4,), "g", 0, 16, "b" * 16))
    blocked = mf.TensorRecord("F32", (4,), "f", 0, 16, "a" * 16, (), 65536, ("x",))
    assert not diff_mod.same_digests(whole, blocked)  # same digest text, different kinds
    s1 = mf.ShardRecord("f", 0, 8, "c" * 16, boxes.Flat(0, 2))
    s2 = mf.ShardRecord("f", 8, 16, "d" * 16, boxes.Flat(2, 4))
    split = mf.whole("F32", (4,), (s1, s2))
    assert diff_mod.same_digests(split, split)
    assert not diff_mod.same_digests(split, whole)
    other = mf.whole("F32", (4,), (s1, mf.ShardRecord("f", 8, 16, "e" * 16, boxes.Flat(2, 4))))
    assert not diff_mod.same_digests(split, other)


def test_manifest_differences_come_before_any_tensor_is_read(
    tmp_path: Path, reads: list[str]
) -> None:
    sp.save(tmp_path / "a", {"w": np.ones(3), "gone": np.zeros(2), "v": 1})
    sp.save(tmp_path / "b", {"w": np.ones(3) * 2, "new": np.zeros(2), "v": 2})
    with diff_mod.compare(tmp_path / "a", tmp_path / "b") as comparison:
        report = comparison.report
        assert (report.removed, report.added, reads) == (["gone"], ["new"], [])
        assert report.values == [("v", 1, 2)]
        assert [k for k, _, _ in comparison.planned()] == ["w"]
        rows = comparison.tensors()
        assert reads == []  # a generator: nothing read until asked
        first = next(rows)
        assert first.key == "w" and not first.equal and reads == ["w", "w"]


def test_cli_prints_rows_as_they_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first differing tensor's row is on stdout even when a later tensor then fails."""
    sp.save(tmp_path / "a", {"x": np.ones(3), "y": np.ones(3), "n": 1})
    sp.save(tmp_path / "b", {"x": np.ones(3) * 2, "y": np.ones(3) * 3, "n": 2})
    original = diff_mod._compare

    def compare(key: str, *args: Any) -> Any:
        if key == "y":
            raise CorruptCheckpointError("y is damaged", path=str(tmp_path / "b"))
        return original(key, *args)

    monkeypatch.setattr(diff_mod, "_compare", compare)
    result = invoke("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[2] == "~ n: 1 -> 2"
    assert lines[3].split() == [
        "tensor",
        "dtype",
        "shape",
        "max",
        "abs",
        "diff",
        "rel",
        "L2",
        "diff",
    ]
    assert lines[4].split()[:3] == ["x", "F64", "[3]"]
    assert "y is damaged" in result.stderr


def test_cli_columns_line_up_and_summary_counts_checksums(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    result = invoke("diff", str(a), str(b), "--all")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    table = lines[2:-1]
    assert len(table) == 7  # the header and six rows
    starts = {line.index(line.split()[1], len(line.split()[0])) for line in table}
    assert len(starts) == 1  # the dtype column starts at one place on every row
    assert "6 tensors compared, 5 identical (5 by stored checksum, not read)" in lines[-1]
    doc = json.loads(invoke("diff", str(a), str(b), "--json").stdout)
    assert (doc["compared"], doc["by_checksum"]) == (6, 5)
    doc = json.loads(invoke("diff", str(a), str(b), "--json", "--read-all").stdout)
    assert doc["by_checksum"] == 0


def test_diff_progress_counts_bytes_read(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    calls: list[tuple[int, int]] = []
    sp.diff(a, b, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (40000, 40000)  # t3, on both sides
