"""Reading a manifest: :func:`parse`, the top level of every version.

:func:`parse` checks the trailer, reads the JSON with the bounded reader, then checks the
document: its header (:func:`_version`), its data files (:func:`_files`), the members that say
which kind of manifest it is (:func:`_kind`: blob store, world size), its tensor entries with the
decoder of their version (:func:`_tensors`), and the tree; last it compares the members it found
with those the text holds, which finds a repeated key (:func:`_count`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from savepoint.codecs import bounded_json as _json
from savepoint.codecs import checksum
from savepoint.codecs.manifest import _records, _v1
from savepoint.codecs.manifest._checks import (
    FILE_NAME,
    check_tree,
    is_digest,
    natural,
    offset,
    require,
    show,
)
from savepoint.codecs.manifest._records import (
    BLOBS,
    BLOCKED,
    CAP,
    DEVICE_CHECKS,
    FORMAT,
    GRID,
    SHARDED,
    VERSION,
    FileRecord,
    Manifest,
    ManifestError,
    ManifestVersionError,
    TensorRecord,
)
from savepoint.codecs.manifest._v2_sharded import sharded_tensor
from savepoint.codecs.manifest._v4_blobs import blob_members, blob_record
from savepoint.codecs.manifest._v6_device import KEYS as DEVICE_KEYS
from savepoint.codecs.manifest._v6_device import device_record
from savepoint.codecs.manifest._v7_grid import ReadIndex, grid_records, grid_table
from savepoint.codecs.manifest._v7_lazy import GridTensors

_TRAILER = re.compile(rb',\n "manifest_xxh3": "([0-9a-f]{16})"\n}\n\Z')
_FILE = frozenset(("size", "header_size", "header_xxh3"))
_MAX_WORLD = 1 << 31
# Top-level members whose objects parse counts itself (the others are counted by walking them).
_CHECKED = frozenset(
    ("format", "format_version", "writer", "created", "checksum", "files", "tensors", "tree")
)
_CHECKED_SHARDED = _CHECKED | {"world_size"}


def parse(
    raw: bytes, *, columns: bool = True, read_index: ReadIndex | None = None, lazy: bool = False
) -> Manifest:
    """Check ``raw`` completely and return the manifest it holds.

    ``columns``: a version 1 manifest's records are kept as a :class:`TensorTable` (no record
    made until asked for: what ``inspect`` and ``verify`` want); otherwise, or where the entries
    need the per-entry checks, as a dict of records (what a load, asking for each several
    times, wants).

    ``read_index(name, size)``: the bytes of a version 7 manifest's index file ``name`` (at
    most ``size`` of them; :mod:`._v7_grid`); a version 7 manifest without it is refused.
    ``lazy``: a version 7 manifest's indexes are read when a record needs them, not here (its
    ``tensors`` a :class:`._v7_lazy.GridTensors`: what a resharding load wants); every other
    version reads the same either way.

    Raises ManifestError (malformed, including JSON the bounded reader refuses: too deep, too
    dense for its size, numbers out of range) or ManifestVersionError (a newer format).
    """
    require(len(raw) <= _records.MAX_MANIFEST_BYTES, f"manifest is larger than the {CAP} cap")
    trailer = _TRAILER.search(raw)
    require(trailer is not None, "manifest has no checksum trailer (truncated or edited)")
    assert trailer is not None
    require(
        checksum.digest(raw[: trailer.start()]) == trailer.group(1).decode("ascii"),
        "manifest checksum does not match its content",
    )
    # Repeated keys are found by counting members (see bounded_json.loads_counted): the checks
    # below walk every object anyway. Any problem is reported after a parse that names a
    # repeated key first, as the reader always has.
    doc, pairs = _json.loads_counted(raw, ManifestError, "manifest")
    if pairs is None:
        return _manifest(doc, None, columns, read_index, lazy)
    try:
        return _manifest(doc, pairs, columns, read_index, lazy)
    except (ManifestError, ManifestVersionError):
        _json.loads(raw, ManifestError, "manifest")
        raise
    except _Repeated:
        # Raises naming the repeated key; were none found, the count was off: check it again.
        doc = _json.loads(raw, ManifestError, "manifest")
        return _manifest(doc, None, columns, read_index, lazy)


class _Repeated(Exception):
    """The document's objects hold fewer members than its text: a key is repeated."""


def _manifest(
    doc: Any,
    pairs: int | None,
    columns: bool = True,
    read_index: ReadIndex | None = None,
    lazy: bool = False,
) -> Manifest:
    """The checks of :func:`parse` on its parsed document; ``pairs``: the members the text holds
    (None: repeated keys already refused), compared with those of the objects found."""
    version = _version(doc)
    files = _files(doc["files"])
    if version >= GRID:
        return _grid(doc, pairs, files, read_index, lazy)
    blob_store, blob_digest, world_size = _kind(doc, version)
    raw_tensors = doc.get("tensors")
    require(isinstance(raw_tensors, dict), "tensors must be an object")
    tensors = _tensors(raw_tensors, files, version, world_size, blob_digest, columns)
    tree = doc.get("tree")
    found = check_tree(tree, tensors)
    if pairs is not None and found + _count(doc, version) != pairs:
        raise _Repeated
    return Manifest(
        tree=tree,
        files=files,
        tensors=tensors,
        metadata=doc["metadata"],
        writer=doc["writer"],
        created=doc["created"],
        format_version=version,
        world_size=world_size,
        blob_store=blob_store,
        blob_digest=blob_digest,
    )


def _grid(
    doc: dict[str, Any],
    pairs: int | None,
    files: dict[str, FileRecord],
    read_index: ReadIndex | None,
    lazy: bool = False,
) -> Manifest:
    """Version 7 (:mod:`._v7_grid`; ``lazy``: :mod:`._v7_lazy`)."""
    world_size = doc.get("world_size")
    require(
        type(world_size) is int and 1 <= world_size < _MAX_WORLD,
        f"world_size must be an integer in [1, 2**31), got {show(world_size)}",
    )
    require("blob_store" not in doc, "a version 7 manifest names no blob store")
    assert type(world_size) is int
    table = grid_table(doc, files, world_size, read_index)
    tensors = GridTensors(table) if lazy else grid_records(table)
    tree: Any = doc.get("tree")
    found = check_tree(tree, tensors)
    others = sum(_json.members(v) for k, v in doc.items() if k != "tree")
    if pairs is not None and found + len(doc) + others != pairs:
        raise _Repeated
    return Manifest(
        tree=tree,
        files=files,
        tensors=tensors,
        metadata=doc["metadata"],
        writer=doc["writer"],
        created=doc["created"],
        format_version=doc["format_version"],
        world_size=world_size,
        mesh=table.mesh,
        indices=table.indices,
        grids=table.grids,
    )


def _version(doc: Any) -> int:
    """The checked header of the document (format, version, checksum, writer, created,
    metadata, and that ``files`` is an object): its format version."""
    require(isinstance(doc, dict), "manifest is not a JSON object")
    require(
        doc.get("format") == FORMAT,
        f"not a savepoint manifest (format {show(doc.get('format'))})",
    )
    version = doc.get("format_version")
    require(natural(version), f"format_version must be a non-negative integer, got {show(version)}")
    if version > VERSION:
        raise ManifestVersionError(
            f"written in format version {show(version)} by {show(doc.get('writer'))}; this "
            f"savepoint reads versions up to {VERSION}: upgrade savepoint to load it"
        )
    require(
        doc.get("checksum") == checksum.ALGORITHM, f"unknown checksum {show(doc.get('checksum'))}"
    )
    for key in ("writer", "created"):
        require(isinstance(doc.get(key), str), f"{key} must be a string")
    require(isinstance(doc.get("metadata"), dict), "metadata must be an object")
    require(isinstance(doc.get("files"), dict), "files must be an object")
    return int(version)


def _files(raw_files: dict[str, Any]) -> dict[str, FileRecord]:
    """The checked ``files`` member."""
    files: dict[str, FileRecord] = {}
    for name, f in raw_files.items():
        require(
            bool(FILE_NAME.fullmatch(name)) and ".." not in name,
            f"data file name {show(name)} is not a plain file name inside the checkpoint",
        )
        require(
            type(f) is dict and f.keys() == _FILE,
            f"file {name!r}: entry must have size, header_size, header_xxh3",
        )
        size, header_size = f["size"], f["header_size"]
        require(
            offset(size) and offset(header_size),
            f"file {name!r}: bad sizes (size {show(size)}, header_size {show(header_size)}: "
            "integers in [0, 2**63) expected)",
        )
        require(8 <= header_size <= size, f"file {name!r}: header larger than the file")
        require(is_digest(f["header_xxh3"]), f"file {name!r}: bad header checksum")
        files[name] = FileRecord(size, header_size, f["header_xxh3"])
    return files


def _kind(doc: dict[str, Any], version: int) -> tuple[str | None, str | None, int | None]:
    """The checked ``blob_store``, ``blob_digest`` and ``world_size`` (each None where the
    manifest has none)."""
    blob_store = blob_digest = None
    if BLOBS <= version < DEVICE_CHECKS or (version >= DEVICE_CHECKS and "blob_store" in doc):
        blob_store, blob_digest = blob_members(doc)
    world_size = None
    if SHARDED <= version <= BLOCKED or (version >= BLOBS and "world_size" in doc):
        world_size = doc.get("world_size")
        require(
            type(world_size) is int and 1 <= world_size < _MAX_WORLD,
            f"world_size must be an integer in [1, 2**31), got {show(world_size)}",
        )
    return blob_store, blob_digest, world_size


def _tensors(
    raw_tensors: dict[str, Any],
    files: dict[str, FileRecord],
    version: int,
    world_size: int | None,
    blob_digest: str | None,
    columns: bool,
) -> Mapping[str, TensorRecord]:
    """The tensor records, each entry checked by the decoder of its version."""
    if version >= BLOBS and world_size is None:
        return {
            name: _unsharded(name, t, files, blob_digest, version)
            for name, t in raw_tensors.items()
        }
    if version >= SHARDED:
        return {
            name: sharded_tensor(name, t, files, version, blob_digest)
            for name, t in raw_tensors.items()
        }
    return _v1.records(raw_tensors, files, columns)


def _unsharded(
    name: str, t: Any, files: dict[str, FileRecord], algorithm: str | None, version: int
) -> TensorRecord:
    """One tensor entry of an unsharded manifest of version 4 or later: a version 1 entry, one
    naming a blob recipe, or (from version 6) one with a device checksum."""
    if type(t) is dict and "blobs" in t:
        return blob_record(name, t, algorithm, version)
    if version >= DEVICE_CHECKS and type(t) is dict and t.keys() == DEVICE_KEYS:
        return device_record(name, t, files)
    return _v1.check_entry(name, t, files)


def _count(doc: dict[str, Any], version: int) -> int:
    """The members of the document's objects other than those of the tree's nodes (which
    :func:`check_tree` counts), for the repeated-key check of :func:`parse`."""
    raw_tensors = doc["tensors"]
    found = len(doc) + 4 * len(doc["files"])
    found += len(raw_tensors) * 6 if version < SHARDED else _json.members(raw_tensors)
    checked = (
        _CHECKED if version < SHARDED else _CHECKED_SHARDED if version <= BLOCKED else _CHECKED
    )
    found += sum(_json.members(v) for k, v in doc.items() if k not in checked)
    return found
