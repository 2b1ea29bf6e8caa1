"""Manifest version 7 in peer memory: each part's index file, and what the tier reads of such a
manifest without opening every rank's index.

A sharded save of a regular state writes manifest version 7 (:mod:`savepoint.codecs.manifest`):
the manifest lists every rank's data files and, per rank, the size and XXH3-64 of its index file
``index-r<rank>.json``, which holds that rank's pieces (their byte ranges and checksums). Part
``p`` of such a checkpoint in peer memory is the manifest, ``index-r<p>.json`` and the data files
rank ``p`` wrote; the index travels and is verified like the manifest (against the manifest's
record of it: :func:`index_problem`).

:func:`head` reads the members the tier needs (the world, the data files, the index records)
without any index, so a replication reads its own rank's index only, never the whole world's;
:class:`Head.units` gives the checksummed ranges of a data file from its rank's index alone (what
a receiver checks the file against as it arrives: :mod:`savepoint.runs._peer_check`). A restore
fetches the indexes its load reads (:mod:`savepoint.runs._peer_indexes`) and the parse of the
manifest then checks them again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from savepoint.codecs import bounded_json, checksum
from savepoint.codecs import manifest as mf
from savepoint.errors import CorruptCheckpointError
from savepoint.runs._peer_check import Unit, tile

__all__ = ["Head", "Units", "check_index", "head", "index_problem"]

_KEYS = ("format", "format_version", "world_size", "files", "indices")


@dataclasses.dataclass(frozen=True)
class Head:
    """The members of a version 7 manifest the tier reads (checked by :func:`head`); it answers
    as much of :class:`savepoint.codecs.manifest.Manifest` as the tier asks of one."""

    world_size: int
    files: dict[str, mf.FileRecord]
    indices: dict[str, mf.IndexRecord]
    sharded: bool = True
    has_blobs: bool = False
    blob_store: None = None

    def index(self, part: int) -> str | None:
        """The name of part ``part``'s index file (None: the manifest records none for it)."""
        name = mf.index_name(part)
        return name if name in self.indices else None

    def units(self, data: bytes) -> Units:
        """What the data files of the part whose index holds ``data`` are checked against."""
        return Units(self, data)


def head(raw: bytes) -> Head | None:
    """The version 7 members of the manifest ``raw`` (None: a manifest of another version);
    CorruptCheckpointError when they are malformed."""
    what = "peer memory: the manifest"
    if b'"indices"' not in raw:  # (no version 7 manifest lacks it: others are not parsed here)
        return None
    doc = bounded_json.loads(raw, CorruptCheckpointError, what)
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < mf.GRID:
        return None
    try:
        if doc.get("format") != mf.FORMAT or not all(key in doc for key in _KEYS):
            raise ValueError("not a version 7 manifest")
        world = _count(doc["world_size"])
        files = {
            _name(name): mf.FileRecord(_count(f["size"]), _count(f["header_size"]), _digest(f))
            for name, f in doc["files"].items()
        }
        indices = {
            _name(name): mf.IndexRecord(_count(f["size"]), _digest(f))
            for name, f in doc["indices"].items()
        }
        if not world or set(files) & set(indices):
            raise ValueError("no ranks, or a name both a data file and an index")
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{what}: {exc}", path=mf.NAME) from None
    return Head(world, files, indices)


def index_problem(record: mf.IndexRecord, size: int, digest: str) -> str | None:
    """What is wrong with an index file of ``size`` bytes hashing to ``digest`` whose manifest
    records ``record`` (None: nothing)."""
    if (size, digest) == (record.size, record.xxh3):
        return None
    return (
        f"{size} bytes, XXH3 {digest}; the manifest records {record.size} bytes, {record.xxh3} "
        "(damaged or replaced)"
    )


def check_index(head: Head, name: str, data: bytes) -> None:
    """CorruptCheckpointError unless ``data`` is the index ``name`` the manifest records."""
    problem = index_problem(head.indices[name], len(data), checksum.digest(data))
    if problem is not None:
        raise CorruptCheckpointError(f"peer memory: {name}: {problem}", path=name)


class Units:
    """The checksummed ranges of a part's data files, from its index's shards (read once)."""

    def __init__(self, head: Head, data: bytes) -> None:
        self.head = head
        self._by_file: dict[str, list[tuple[int, int, str, int, tuple[str, ...]]]] | None = None
        try:
            doc = bounded_json.loads(data, CorruptCheckpointError, "index")
            self._by_file = _pieces(doc["shards"])
        except (CorruptCheckpointError, AttributeError, KeyError, TypeError, ValueError):
            self._by_file = None  # (then no file is checked by its index: the sender hashes it)

    def __call__(self, name: str) -> list[Unit] | None:
        """The ranges of data file ``name`` (:func:`savepoint.runs._peer_check.units`)."""
        record = self.head.files.get(name)
        if record is None or self._by_file is None:
            return None
        return tile(record, self._by_file.get(name, []))


def _pieces(shards: Any) -> dict[str, list[tuple[int, int, str, int, tuple[str, ...]]]]:
    """file -> its pieces (start, end, xxh3, block size, block checksums) from an index's shards
    (malformed ones raise: the caller checks no file by that index)."""
    found: dict[str, list[tuple[int, int, str, int, tuple[str, ...]]]] = {}
    for listed in shards.values():
        for sh in listed:
            start, end = sh["offsets"]
            blocks = sh.get("blocks") or {"size": 0, "xxh3": []}
            digests = (sh["xxh3"], *blocks["xxh3"])
            if not all(isinstance(d, str) for d in (sh["file"], *digests)):
                raise ValueError("a file name or digest that is not a string")
            piece = (_count(start), _count(end), digests[0], _count(blocks["size"]))
            found.setdefault(sh["file"], []).append((*piece, digests[1:]))
    return found


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative int")
    return value


def _digest(entry: dict[str, Any]) -> str:
    value = entry["header_xxh3"] if "header_xxh3" in entry else entry["xxh3"]
    if not checksum.is_digest(value):
        raise ValueError(f"{value!r} is not a digest")
    return str(value)


def _name(name: Any) -> str:
    """A plain file name of a checkpoint (no folder, nothing hidden)."""
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise ValueError(f"{name!r} is not a plain file name")
    return name


def assembled_units(grid: Head, directory: str) -> Callable[[str], list[Unit] | None]:
    """The checksummed ranges of each data file of a version 7 restore's assembly, from the
    index files fetched into ``directory`` (a file none of them lists: None)."""
    found: list[Units] = []
    for name in sorted(grid.indices):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                found.append(Units(grid, f.read()))

    def of(name: str) -> list[Unit] | None:
        for units in found:
            got = units(name)
            if got is not None:
                return got
        return None

    return of
