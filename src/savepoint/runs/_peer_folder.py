"""A node's peer memory: the folder where one node keeps its copies of checkpoint parts.

Layout, under ``<memory_dir>/<run id>/<node>/`` (a tmpfs such as ``/dev/shm`` by default: it
outlives the training processes, not the machine)::

    node.json                         which node and run the folder is, and its byte budget
    step-<step>/part-<part>/          one committed copy of part <part> of checkpoint <step>
        part.json                     its marker, written last: what the copy holds
        manifest.json                 the checkpoint's manifest (every part has it)
        index-r<part>.json            of a manifest version 7: rank <part>'s index file
        data-r<part>-<i>.safetensors  the data files rank <part> wrote
    .<name>.savepoint-tmp-<host>-<pid>-<random>   a copy being written, or a folder being deleted

A part is what one rank of the saving world wrote (its data files, and its index file) plus the
manifest; a checkpoint saved without a process group is one part, 0, holding every file. A copy
is written into a hidden staging folder, its marker ``part.json`` last (the size and XXH3-64 of
every file, the manifest's digest, the step, the part and the saving world), then renamed into
place: a copy is either whole, with its marker, or not there (a kill leaves a staging folder,
removed by the next :meth:`NodeFolder.clean` once its process is gone). A copy is verified
against its marker before it is used (:meth:`NodeFolder.verify`), file by file.

Nothing here talks to other processes: :mod:`savepoint.runs._peer_replicate` fills the folder,
:mod:`savepoint.runs._peer_restore` reads it. Eviction (:func:`evictions`) is a pure rule over
the steps a folder holds and their sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import shutil
from collections.abc import Iterable
from typing import Any

import numpy as np

from savepoint.codecs import bounded_json, checksum
from savepoint.commit import names
from savepoint.errors import CorruptCheckpointError
from savepoint.storage.base import Store

__all__ = [
    "BLOBS",
    "COMMON",
    "NODE_FILE",
    "PART_FILE",
    "BlobSource",
    "BytesSource",
    "CopyWriter",
    "FileSource",
    "Landing",
    "NodeFolder",
    "PartRecord",
    "assembly",
    "blob_home",
    "evictions",
    "hash_file",
    "place",
]

log = logging.getLogger("savepoint.runs.peers")

PART_FILE = "part.json"
NODE_FILE = "node.json"
PART_FORMAT = "savepoint-peer-part"
NODE_FORMAT = "savepoint-peer-node"
VERSION = 1
_MARKER_CAP = 64 << 20  # a marker lists file names and digests: far below this
HASH_BLOCK = 64 << 20


@dataclasses.dataclass(frozen=True)
class PartRecord:
    """What a committed copy of one part holds (its marker, ``part.json``)."""

    step: int
    part: int
    world: int  # the saving world: parts 0 .. world - 1 make the checkpoint
    manifest: str  # XXH3-64 of the manifest's bytes: the parts of one save share it
    files: dict[str, tuple[int, str]]  # name -> (size, XXH3-64), manifest.json included
    source: str = ""  # the node that made the copy

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PART_FORMAT,
            "version": VERSION,
            "step": self.step,
            "part": self.part,
            "world": self.world,
            "manifest": self.manifest,
            "files": {name: [size, digest] for name, (size, digest) in sorted(self.files.items())},
            "source": self.source,
        }

    @classmethod
    def from_json(cls, doc: Any, what: str) -> PartRecord:
        """The record of a marker (or of an inventory entry); CorruptCheckpointError if it is
        not one."""
        try:
            if not isinstance(doc, dict) or doc.get("format") != PART_FORMAT:
                raise ValueError("not a peer part marker")
            files = {}
            for name, (size, digest) in doc["files"].items():
                if not (_safe_name(name) and isinstance(size, int) and size >= 0):
                    raise ValueError(f"bad file entry {name!r}")
                if not checksum.is_digest(digest):
                    raise ValueError(f"bad digest for {name!r}")
                files[name] = (size, digest)
            record = cls(
                step=_count(doc["step"]),
                part=_count(doc["part"]),
                world=_count(doc["world"]),
                manifest=doc["manifest"],
                files=files,
                source=str(doc.get("source", "")),
            )
            if record.part >= record.world or not checksum.is_digest(record.manifest):
                raise ValueError("part outside its world, or a bad manifest digest")
            if "manifest.json" not in files:
                raise ValueError("no manifest.json")
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{what}: {exc}", path=what) from None
        return record


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative int")
    return value


def _safe_name(name: Any) -> bool:
    """A file name a copy may hold: relative, no ``..``, nothing hidden."""
    if not isinstance(name, str) or not name or name.startswith("/"):
        return False
    return all(p and p not in (".", "..") and not p.startswith(".") for p in name.split("/"))


BLOBS = "blobs/"  # the names of a copy's blob files (an incremental checkpoint's) start so
COMMON = ("manifest.json", "blobs/store.json")  # what every part of a checkpoint holds alike


def blob_home(blob_store: str | None) -> tuple[int, str]:
    """Where an incremental checkpoint's blob store lies, from the manifest's relative path
    (``../../blobs``): (how many folders up from the checkpoint, the path from there);
    CorruptCheckpointError for a path that does not climb and then descend."""
    parts = os.path.normpath(blob_store or "").split("/")
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    rest = "/".join(parts[ups:])
    if not ups or not _safe_name(rest):
        raise CorruptCheckpointError(
            f"a blob store at {blob_store!r} from the checkpoint cannot be kept in peer memory",
            path=str(blob_store),
        )
    return ups, rest


def assembly(base: str, step: int, blob_store: str | None) -> str:
    """The checkpoint folder a restore assembles under ``base``: deep enough that the blob store
    the manifest names (``blob_store``, relative) is ``base/<its path>`` (see :func:`place`)."""
    ups = blob_home(blob_store)[0] if blob_store else 1
    return os.path.join(base, *(["c"] * (ups - 1)), step_name(step))


def place(name: str, step: int, blob_store: str | None) -> str:
    """Where a copy's file ``name`` goes, relative to a restore's ``base`` (:func:`assembly`):
    a data file or the manifest in the checkpoint folder, a blob file (``blobs/...``) in the
    blob store beside it."""
    if name.startswith(BLOBS):
        return os.path.join(blob_home(blob_store)[1], name[len(BLOBS) :])
    ups = blob_home(blob_store)[0] if blob_store else 1
    return os.path.join(*(["c"] * (ups - 1)), step_name(step), name)


def step_name(step: int) -> str:
    return f"step-{step:010d}"


def part_name(part: int) -> str:
    return f"part-{part:05d}"


def hash_file(path: str) -> tuple[int, str]:
    """The size and XXH3-64 of the file at ``path`` (read through a mapping, in blocks)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        hasher = checksum.new()
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    for start in range(0, size, HASH_BLOCK):
                        hasher.update(view[start : start + HASH_BLOCK])
                finally:
                    view.release()
    return size, checksum.hexdigest(hasher)


class NodeFolder:
    """The folder ``root`` where node ``node`` keeps its copies (see the module docstring)."""

    def __init__(self, root: str, node: str) -> None:
        self.root, self.node = root, node

    def ensure(self, run_id: str, budget: int | None) -> None:
        """Create the folder and (re)write ``node.json`` (what ``savepoint ls`` shows)."""
        os.makedirs(self.root, exist_ok=True)
        doc = {"format": NODE_FORMAT, "version": VERSION, "node": self.node, "run": run_id}
        doc["budget"] = budget
        tmp = self.staging()
        try:
            with open(os.path.join(tmp, NODE_FILE), "w") as f:
                json.dump(doc, f)
            os.replace(os.path.join(tmp, NODE_FILE), os.path.join(self.root, NODE_FILE))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # -- where ---------------------------------------------------------------------------------

    def path(self, step: int, part: int) -> str:
        return os.path.join(self.root, step_name(step), part_name(part))

    def staging(self) -> str:
        """A fresh hidden folder of this process (removed by :meth:`clean` once it is gone)."""
        os.makedirs(self.root, exist_ok=True)
        path = os.path.join(self.root, f".copy{names.TMP_TAG}{names.HOST}-{os.getpid()}-")
        path += os.urandom(4).hex()
        os.mkdir(path)
        return path

    def clean(self) -> None:
        """Remove what dead processes of this host left (staging folders, half-deleted steps)."""
        with contextlib.suppress(OSError):
            for entry in os.listdir(self.root):
                hidden = entry.startswith(".") and names.TMP_TAG in entry
                if hidden and names.dead_here(entry.rsplit(names.TMP_TAG, 1)[1]):
                    shutil.rmtree(os.path.join(self.root, entry), ignore_errors=True)

    # -- reading -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps the folder holds any committed copy of, ascending."""
        found = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.listdir(self.root):
                if entry.startswith("step-") and entry[5:].isdigit():
                    found.append(int(entry[5:]))
        return sorted(found)

    def parts(self, steps: Iterable[int] | None = None) -> dict[int, dict[int, PartRecord]]:
        """step -> part -> the record of every committed copy (of ``steps``, or all). A copy
        whose marker is missing or damaged is not a copy (logged)."""
        found: dict[int, dict[int, PartRecord]] = {}
        for step in self.steps() if steps is None else steps:
            where = os.path.join(self.root, step_name(step))
            try:
                entries = os.listdir(where)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                if not (entry.startswith("part-") and entry[5:].isdigit()):
                    continue
                record = self.marker(os.path.join(where, entry))
                if record is not None and record.step == step and record.part == int(entry[5:]):
                    found.setdefault(step, {})[record.part] = record
        return found

    def marker(self, folder: str) -> PartRecord | None:
        """The record of the copy in ``folder``; None where it has no readable marker."""
        path = os.path.join(folder, PART_FILE)
        try:
            with open(path, "rb") as f:
                raw = f.read(_MARKER_CAP + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            log.warning("peer memory: cannot read %s (%s): that copy is not used", path, exc)
            return None
        try:
            if len(raw) > _MARKER_CAP:
                raise CorruptCheckpointError(f"{path}: too large", path=path)
            doc = bounded_json.loads(raw, CorruptCheckpointError, path)
            return PartRecord.from_json(doc, path)
        except CorruptCheckpointError as exc:
            log.warning("peer memory: %s: that copy is not used", exc)
            return None

    def verify(self, record: PartRecord, wanted: Iterable[str]) -> list[str]:
        """The files of ``wanted`` whose copy (part ``record.part`` of ``record.step``) is
        missing or differs from its marker, each with what is wrong."""
        folder = self.path(record.step, record.part)
        bad = []
        for name in wanted:
            size, digest = record.files[name]
            try:
                found = hash_file(os.path.join(folder, name))
            except OSError as exc:
                bad.append(f"{name}: {exc.strerror or exc}")
                continue
            if found != (size, digest):
                bad.append(
                    f"{name}: {found[0]} bytes, XXH3 {found[1]} (its marker: {size}, {digest})"
                )
        return bad

    def step_bytes(self) -> dict[int, int]:
        """step -> the bytes of its committed copies here."""
        return {step: sum(r.nbytes for r in parts.values()) for step, parts in self.parts().items()}

    # -- writing -------------------------------------------------------------------------------

    def commit(self, staging: str, record: PartRecord) -> None:
        """Write ``record`` as the marker of the copy in ``staging`` (its files written), then
        rename it into place, replacing an earlier copy of that part of that step."""
        with open(os.path.join(staging, PART_FILE), "w") as f:
            json.dump(record.to_json(), f)
        step_dir = os.path.join(self.root, step_name(record.step))
        os.makedirs(step_dir, exist_ok=True)
        final = self.path(record.step, record.part)
        if os.path.lexists(final):
            self._remove(final)
        os.rename(staging, final)

    def evict(self, steps: Iterable[int]) -> None:
        """Delete every copy of ``steps`` (renamed aside first: a kill leaves no half copy)."""
        for step in steps:
            where = os.path.join(self.root, step_name(step))
            if os.path.lexists(where):
                self._remove(where)
                log.info("peer memory: node %s evicted its copies of step %d", self.node, step)

    def _remove(self, path: str) -> None:
        aside = os.path.join(
            self.root,
            f".gone{names.TMP_TAG}{names.HOST}-{os.getpid()}-{os.urandom(4).hex()}",
        )
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return  # another rank of this node removed it first
        shutil.rmtree(aside, ignore_errors=True)


def evictions(
    sizes: dict[int, int], budget: int | None, anchor: int | None, incoming: int = 0
) -> list[int]:
    """The steps to delete from a folder holding ``sizes`` (step -> bytes), oldest first, to make
    room for ``incoming`` more bytes. ``anchor``: the newest step known to be complete (None:
    none known; then the newest step held stands in for it). Nothing at or after the anchor is
    ever chosen. ``budget`` None: every step before the anchor goes; otherwise the oldest go
    until the rest and ``incoming`` fit."""
    if not sizes:
        return []
    keep_from = anchor if anchor is not None else max(sizes)
    older = sorted(s for s in sizes if s < keep_from)
    if budget is None:
        return older
    total = sum(sizes.values()) + incoming
    chosen = []
    for step in older:
        if total <= budget:
            break
        chosen.append(step)
        total -= sizes[step]
    return chosen


# -- sending and receiving files (the wire's sources and targets) --------------------------------


class FileSource:
    """A local file to send, mapped read-only (``chunk`` returns views of the mapping)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "rb")  # noqa: SIM115 (closed by close())
        size = os.fstat(self.file.fileno()).st_size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # (no fault per page)
        fd = self.file.fileno()
        self._map = mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ) if size else None

    def chunk(self, start: int, end: int) -> np.ndarray[Any, Any]:
        assert self._map is not None
        return np.frombuffer(self._map, np.uint8, end - start, start)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held: freed with it
                self._map.close()
        self.file.close()


class BlobSource:
    """A file of a store to send (a zero-copy view where the store has one, else read)."""

    def __init__(self, store: Store, path: str) -> None:
        self._blob = store.open_blob(path)

    def chunk(self, start: int, end: int) -> np.ndarray[Any, Any]:
        view = self._blob.view(start, end)
        if view is None:
            view = np.empty(end - start, np.uint8)
            self._blob.read(start, view)
        return view

    def close(self) -> None:
        self._blob.close()


class Landing:
    """Files received into a folder: ``target(name, size)`` makes the file (``name`` may hold
    ``/``) and returns its writer."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def target(self, name: str, size: int) -> CopyWriter:
        return CopyWriter(os.path.join(self.folder, name))

    def close(self) -> None:
        """(Each file is closed by its writer once received.)"""


class CopyWriter:
    """This rank's own copy of a file, written chunk by chunk as it is sent."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, chunk: np.ndarray[Any, Any]) -> None:
        view = chunk.data
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


class BytesSource:
    """Bytes in memory to send (the manifest, read once)."""

    def __init__(self, data: bytes) -> None:
        self._data = np.frombuffer(data, np.uint8)

    def chunk(self, start: int, end: int) -> np.ndarray[Any, Any]:
        return self._data[start:end]

    def close(self) -> None:
        pass
