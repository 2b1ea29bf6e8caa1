"""Read-once loads and block-checked resharding, on 8 real gloo ranks (``_readonce_worker.py``).

Every load in the session reads through a store without views that records every read, so
the bytes each rank took from storage are counted here, byte by byte:

- a replicated state (saved once, by the ranks) loaded on 8 ranks reads each stored byte of
  every tensor over the read-once threshold exactly once (checked, unchecked, whole without
  ``into``; twice with ``verify="first"``: one check pass, one copy pass), against 8 times with
  ``read_once=False``; every load is exact;
- a row-sharded tensor (8 shards) restored in 8 parts shifted off the block and shard
  boundaries: without read-once each rank reads at most its bytes plus the two partial blocks at
  each end of its part; with it every stored byte is read once, by one rank;
- a flipped byte in a block two ranks' parts share is reported by exactly the ranks that read
  it (both without read-once, the one reader with it, before anything is copied with
  ``verify="first"``), naming the block;
- golden checkpoints of manifest versions 1-3 load on the 8 ranks as in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from savepoint.codecs import manifest as mf

from . import _launch

pytestmark = pytest.mark.distributed

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("_readonce_worker.py")
WORLD = 8
BLOCK = 64 << 10
ROW = 1024 * 4


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> tuple[_launch.Session, Path]:
    workdir = tmp_path_factory.mktemp("readonce")
    s = _launch.run("readonce", WORLD, workdir, timeout=300, worker=WORKER)
    return s, workdir


def _manifest(path: Path) -> mf.Manifest:
    return mf.parse((path / mf.NAME).read_bytes())


def _counts(session: _launch.Session, label: str, manifest: mf.Manifest) -> dict[str, Any]:
    """How many times each byte of each data file was read, over every rank."""
    counts = {name: np.zeros(rec.size, np.int32) for name, rec in manifest.files.items()}
    for rank in range(WORLD):
        for name, offset, n in session.results[rank]["data"][label]:
            counts[name][offset : offset + n] += 1
    return counts


def _per_rank(session: _launch.Session, label: str, manifest: mf.Manifest) -> list[int]:
    """Data bytes (headers left out) each rank read."""
    out = []
    for rank in range(WORLD):
        total = 0
        for name, offset, n in session.results[rank]["data"][label]:
            head = manifest.files[name].header_size
            total += max(0, offset + n - max(offset, head))
        out.append(total)
    return out


def _reads_of(counts: dict[str, Any], manifest: mf.Manifest, ref: str) -> set[int]:
    """The distinct read counts of the bytes of tensor ``ref``."""
    found: set[int] = set()
    for s in manifest.tensors[ref].layout():
        found.update(np.unique(counts[s.file][s.start : s.end]).tolist())
    return found


def test_the_session_passes(session: tuple[_launch.Session, Path]) -> None:
    s, _ = session
    assert len(s.results) == WORLD, s.failures()
    assert all(outcome == "ok" for outcome in s.checks().values()), s.failures()


@pytest.mark.parametrize(
    ("label", "times"),
    [
        ("replicated read once", 1),
        ("replicated unverified", 1),
        ("replicated whole", 1),
        ("replicated first", 2),
        ("replicated each rank", WORLD),
    ],
)
def test_a_replicated_load_reads_each_stored_byte_once(
    session: tuple[_launch.Session, Path], label: str, times: int
) -> None:
    s, workdir = session
    manifest = _manifest(workdir / "rep")
    counts = _counts(s, label, manifest)
    for ref in ("w", "e", "flags"):
        assert _reads_of(counts, manifest, ref) == {times}, (label, ref)
    assert _reads_of(counts, manifest, "b") == {WORLD * (2 if times == 2 else 1)}
    stored = sum(rec.size for rec in manifest.files.values())
    read = sum(int(c.sum()) for c in counts.values())
    if times == 1:
        assert read <= 1.05 * stored, (read, stored)
    else:
        assert read >= times * 0.95 * stored


def test_reads_are_spread_over_the_ranks(session: tuple[_launch.Session, Path]) -> None:
    s, workdir = session
    manifest = _manifest(workdir / "rep")
    per_rank = _per_rank(s, "replicated read once", manifest)
    data = sum(rec.end - rec.start for rec in manifest.tensors.values())
    # the readers' shares: within a chunk (at least 256 KiB) and the small tensor of each other
    assert max(per_rank) - min(per_rank) <= (256 << 10) + 4096, per_rank
    assert sum(per_rank) < data + WORLD * 4096


def test_a_resharded_verified_load_reads_its_blocks_or_each_byte_once(
    session: tuple[_launch.Session, Path],
) -> None:
    s, workdir = session
    manifest = _manifest(workdir / "rows")
    for rank, per in enumerate(_per_rank(s, "resharded each rank", manifest)):
        lo, hi = s.results[rank]["data"]["needed rows"]
        needed = (hi - lo) * ROW
        # two saved shards at most, each read from the block holding the part's first byte to
        # the end of the block holding its last
        assert needed <= per <= needed + 4 * BLOCK, (rank, per, needed)
    counts = _counts(s, "resharded read once", manifest)
    assert _reads_of(counts, manifest, "w") == {1}
    for rank, per in enumerate(_per_rank(s, "resharded read once", manifest)):
        lo, hi = s.results[rank]["data"]["needed rows"]
        assert per <= (hi - lo) * ROW + 2 * BLOCK, (rank, per)


@pytest.mark.parametrize(
    ("label", "readers"),
    [("damaged each rank", 2), ("damaged read once", 1), ("damaged first", 1)],
)
def test_a_damaged_block_is_reported_by_exactly_the_ranks_that_read_it(
    session: tuple[_launch.Session, Path], label: str, readers: int
) -> None:
    s, _ = session
    name, offset = s.results[0]["data"][
        "flipped rows-bad-first" if "first" in label else "flipped rows-bad"
    ]
    read_it = sorted(
        rank
        for rank in range(WORLD)
        if any(f == name and o <= offset < o + n for f, o, n in s.results[rank]["data"][label])
    )
    assert len(read_it) == readers, read_it
    for rank in range(WORLD):
        assert s.results[rank]["data"][label + " ranks"] == read_it, rank
    message = s.results[0]["data"][label + " message"]
    assert "block 3 of 8" in message and "checksum mismatch" in message, message
