"""Checking a data file against its checkpoint's manifest while it arrives, piece by piece.

A savepoint data file is covered whole by checksums its manifest records: the header (its
``header_size`` bytes, ``header_xxh3``), then the bytes of every tensor or shard stored in it
(its ``xxh3``, or one digest per block of ``block`` bytes), which tile the rest of the file. A
replication receiver (:mod:`savepoint.runs._peer_replicate`) checks each data file against those
digests as its pieces land, each piece hashed while it is in cache, so the sender need not read
the file to hash it: the bytes are checked against what the save recorded, end to end, and the
receiver's XXH3-64 of the whole file (computed in the same pass) becomes both copies' marker.

:func:`units` reads them from a parsed manifest; a version 7 manifest keeps them in each rank's
index file instead, read by :mod:`savepoint.runs._peer_grid` (both through :func:`tile`).
:func:`units` is None for a file these checksums do not cover whole (a file of another writer
with gaps, a digest of another algorithm, blobs): then the sender hashes it as before.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from typing import Any

from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf

__all__ = ["Check", "Unit", "tile", "units", "verify_file"]

Unit = tuple[int, int, str]  # [start, end) of the file, its XXH3-64
_BLOCK = 4 << 20  # bytes hashed at a time (in cache for both hashes)


def units(manifest: mf.Manifest, name: str) -> list[Unit] | None:
    """The checksummed ranges of data file ``name`` in file order, when they tile it whole (its
    header first); None otherwise (see the module docstring)."""
    record = manifest.files.get(name)
    tensors = manifest.tensors
    if record is None or not isinstance(tensors, dict):
        return None
    pieces = []
    for rec in tensors.values():
        for shard in rec.layout():
            if shard.file != name:
                continue
            if shard.recipe is not None:
                return None
            pieces.append((shard.start, shard.end, shard.xxh3, shard.block, shard.blocks))
    return tile(record, pieces)


def tile(
    record: mf.FileRecord, pieces: Iterable[tuple[int, int, str, int, tuple[str, ...]]]
) -> list[Unit] | None:
    """The ranges of a data file of ``record`` from the pieces stored in it (start, end, XXH3-64,
    block size and block checksums: a block size of 0 checks the piece whole) and its header,
    in file order; None unless they tile the file whole."""
    found: list[Unit] = [(0, record.header_size, record.header_xxh3)]
    for start, end, xxh3, block, blocks in pieces:
        if block and blocks:
            for i, digest in enumerate(blocks):
                at = start + i * block
                found.append((at, min(end, at + block), digest))
        else:
            found.append((start, end, xxh3))
    found.sort()
    at = 0
    for start, end, digest in found:
        if start != at or end < start or not checksum.is_digest(digest):
            return None  # a gap, an overlap, or a digest of another algorithm
        at = end
    return found if at == record.size else None


class Check:
    """The running check of one file against ``units``: :meth:`update` with each piece at its
    offset, in order; :meth:`problem` says what did not match (None: every unit did)."""

    def __init__(self, units: list[Unit]) -> None:
        self._units = units
        self._i = 0
        self._hasher: Any = checksum.new()
        self._bad: str | None = None

    def update(self, offset: int, piece: memoryview) -> None:
        end = offset + len(piece)
        units = self._units
        while self._i < len(units):
            start, stop, digest = units[self._i]
            lo, hi = max(start, offset), min(stop, end)
            if hi > lo:
                self._hasher.update(piece[lo - offset : hi - offset])
            if stop > end:
                return  # the unit goes on in the next piece
            got = checksum.hexdigest(self._hasher)
            if got != digest and self._bad is None:
                self._bad = f"bytes {start}-{stop} hash to {got}, the manifest records {digest}"
            self._hasher = checksum.new()
            self._i += 1

    def problem(self) -> str | None:
        if self._bad is None and self._i < len(self._units):
            return f"{len(self._units) - self._i} checksummed ranges were not received"
        return self._bad


def verify_file(path: str, expect: tuple[int, str], covered: list[Unit]) -> bool:
    """Whether the file at ``path`` has the size of its copy's marker (``expect``) and matches
    its checkpoint's checksums (``covered``: every byte, so the marker's XXH3-64 adds nothing),
    in one pass over a mapping."""
    check = Check(covered)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    for start in range(0, size, _BLOCK):
                        piece = view[start : start + _BLOCK]
                        check.update(start, piece)
                        piece.release()
                finally:
                    view.release()
        else:
            check.update(0, memoryview(b""))
    return size == expect[0] and check.problem() is None
