"""Checkpoints of ``torch.distributed.checkpoint`` (DCP) as its own ``FileSystemWriter`` writes
them (``dcp.save(state, checkpoint_id=dir)``), read without torch and without unpickling anything
but DCP's metadata types.

A DCP checkpoint is a directory holding ``.metadata`` and ``__<rank>_<i>.distcp`` files:

- ``.metadata`` is a pickle of DCP's ``Metadata``: read through an allow-list of DCP's own
  dataclasses and the few torch names they reference (:mod:`savepoint.formats._dcp_metadata`);
  any other global is refused by name, never imported or run.
- Each tensor is stored in chunks (one per rank that held a distinct part: a DTensor ``Shard``,
  a replicated tensor once), each an item of a ``.distcp`` file at the offset and length
  ``.metadata`` gives. With DCP's default ``SerializationFormat.TORCH_SAVE`` (the only one
  ``FileSystemReader`` reads) each item is a whole ``torch.save`` archive of the chunk: a zip of
  stored records whose ``data.pkl`` names ``torch._utils._rebuild_tensor_v2`` over a storage
  record, whose bytes are the chunk's raw storage (possibly a strided view: a transposed
  tensor is saved with its strides). savepoint parses the archive itself
  (:mod:`savepoint.formats._torch_archive`: the zip's central directory, ``data.pkl`` through an
  allow-list of torch's tensor rebuilders) and maps the storage record: no torch needed.
- Values that are not tensors (a step counter, a config dict's leaves, a data loader's state)
  are ``BYTE_IO`` items: DCP's planner serialised each with ``torch.save`` (a pickle of any
  object). savepoint never unpickles them: they are kept as their raw bytes, a uint8 tensor
  under their name, and listed in the metadata's ``dcp.bytes`` and in ``inspect``'s notes.

The tree: ``{fqn: tensor}``, flat, under DCP's fully qualified names (``model.layers.0.w``,
``optim.state.model.w.exp_avg``), as ``sp.load`` reads a DCP checkpoint written through
savepoint's own ``SavepointWriter``; the metadata is ``{"dcp": {...}}`` in that writer's shape
(:data:`savepoint.integrations.dcp.DCP_VERSION`: planner data, tensor properties, the opaque
``bytes``), so ``savepoint convert`` into savepoint's format gives a checkpoint
``SavepointReader`` hands back to ``dcp.load`` whole (its ``BYTE_IO`` values included: DCP
unpickles them itself), and ``savepoint export --subtree app/model`` finds the nested names.
Tensors come back as torch tensors where torch is installed (``framework="auto"``), else numpy.

Reading: a tensor's chunks are assembled on the fly: each copy of a byte range reads, from every
chunk that overlaps it, only the box it needs (``codecs.boxes``), straight into the destination;
no tensor is ever held whole besides the result. The first read of each chunk checks the CRC-32
of its storage record (as ``torch.load`` does); ``verify`` checks every record's CRC-32 (and those
of the ``BYTE_IO`` archives) and every structural rule; ``inspect`` reads ``.metadata`` and the
files' sizes only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import stat
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from savepoint.codecs import boxes
from savepoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from savepoint.formats._dcp_metadata import MAX_BYTES, Entry, Item, Metadata, decode
from savepoint.formats._files import LazyTensor
from savepoint.formats._progress import Progress, Tally
from savepoint.formats._torch_archive import TENSOR_GLOBALS, Archive, Record, TensorRef, crc32
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.state import tree as tree_mod
from savepoint.storage import local
from savepoint.storage.paths import local_path

__all__ = [
    "DcpCheckpoint",
    "LABEL",
    "METADATA",
    "SUFFIX",
    "inspect",
    "is_dcp",
    "open_checkpoint",
    "verify",
]

METADATA = ".metadata"
SUFFIX = ".distcp"
LABEL = "torch.distributed.checkpoint checkpoint"
DCP_VERSION = 1  # the shape of metadata["dcp"], as savepoint.integrations.dcp.DCP_VERSION
_PICKLE_CAP = 1 << 20  # a chunk's data.pkl (about 150 bytes in torch 2.13)


def is_dcp(entries: Iterable[str]) -> bool:
    """Whether a directory holding ``entries`` is a DCP checkpoint (``.metadata`` and at least
    one ``*.distcp`` file)."""
    names = set(entries)
    return METADATA in names and any(n.endswith(SUFFIX) for n in names)


def _void(itemsize: int) -> np.dtype[Any]:
    return np.dtype((np.void, itemsize))


class DcpCheckpoint:
    """A DCP checkpoint directory opened for reading: ``.metadata`` decoded and checked, every
    file it names checked to hold its items; files are mapped when first read. Close it (or use
    :func:`open_checkpoint`) when done."""

    def __init__(self, path: str) -> None:
        self.path = path
        shown = os.path.join(path, METADATA)
        try:
            data = local.read_small(shown, cap=MAX_BYTES)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} has no {METADATA}", path=path) from None
        self.meta: Metadata = decode(data, path=path, what=shown)
        self.sizes = self._sizes()
        self._maps: dict[str, local.MappedFile] = {}
        self._chunks: dict[tuple[str, int], np.ndarray[Any, Any]] = {}
        self.kind = "torch" if importlib.util.find_spec("torch") is not None else "numpy"

    def _items(self) -> Iterator[tuple[Entry, Item]]:
        for e in self.meta.entries.values():
            if e.item is not None:
                yield e, e.item
            for c in e.chunks:
                yield e, c.item

    def _sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for e, item in self._items():
            if item.file not in sizes:
                where = os.path.join(self.path, item.file)
                try:
                    st = os.lstat(where)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"{self.path}/{METADATA} names {item.file}, which is not there",
                        path=self.path,
                    ) from None
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptCheckpointError(
                        f"{where} is not a regular file", path=self.path
                    ) from None
                sizes[item.file] = st.st_size
            if item.offset + item.length > sizes[item.file]:
                raise CorruptCheckpointError(
                    f"{self.path}/{item.file} is {sizes[item.file]} bytes, but {e.fqn!r} is "
                    f"stored at {item.offset}..{item.offset + item.length} (truncated?)",
                    path=self.path,
                )
        return sizes

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        self._chunks = {}
        for m in maps.values():
            m.close()

    def buffer(self, name: str) -> np.ndarray[Any, Any]:
        """The whole file ``name`` as a read-only uint8 array (mapped on first use)."""
        found = self._maps.get(name)
        if found is None:
            where = os.path.join(self.path, name)
            fd = local.open_read(where)
            try:
                size = os.fstat(fd).st_size
                if size < self.sizes[name]:
                    raise CorruptCheckpointError(f"{where} shrank while open", path=self.path)
                found = self._maps[name] = local.MappedFile(fd, self.sizes[name])
            finally:
                os.close(fd)
        return found.array

    def _archive(self, e: Entry, item: Item, what: str) -> Archive:
        where = f"{self.path}/{item.file} at {item.offset} ({e.fqn!r}{what})"
        return Archive(self.buffer(item.file), item.offset, item.length, path=self.path, what=where)

    def _record(self, e: Entry, index: int) -> tuple[Archive, TensorRef, Record]:
        archive = self._archive(e, e.chunks[index].item, f", chunk {index}")
        ref = archive.load(TENSOR_GLOBALS, cap=_PICKLE_CAP)
        want = boxes.extents(e.chunks[index].box)
        if not isinstance(ref, TensorRef) or ref.dtype != e.dtype or ref.shape != want:
            got = (
                f"a {ref.dtype.name} tensor of shape {list(ref.shape)}"
                if isinstance(ref, TensorRef)
                else f"a {type(ref).__name__}"
            )
            raise CorruptCheckpointError(
                f"{archive.what} holds {got}; {METADATA} says a "
                f"{e.dtype.name if e.dtype else '?'} chunk of shape {list(want)}",
                path=self.path,
            )
        return archive, ref, archive.storage(ref)

    def chunk(self, e: Entry, index: int) -> np.ndarray[Any, Any]:
        """Chunk ``index`` of the tensor ``e`` as a read-only array of its box's shape whose
        items are raw (``np.void`` of the dtype's size), its CRC-32 checked on first use."""
        key = (e.fqn, index)
        found = self._chunks.get(key)
        if found is None:
            archive, ref, record = self._record(e, index)
            if not crc32(archive.buf, record, lambda n: None):
                raise CorruptCheckpointError(
                    f"{archive.what}: CRC-32 mismatch in the chunk's data", path=self.path
                )
            found = self._chunks[key] = _strided(archive.buf, record, ref)
        return found

    def tree(self) -> dict[str, LazyTensor]:
        """``{fqn: tensor}`` (see the module docstring)."""
        out: dict[str, LazyTensor] = {}
        for fqn, e in self.meta.entries.items():
            out[fqn] = _DcpBytes(self, e) if e.item is not None else _DcpTensor(self, e)
        return out

    def metadata(self) -> dict[str, Any]:
        """``{"dcp": ...}`` in :class:`savepoint.integrations.dcp.SavepointWriter`'s shape."""
        entries = self.meta.entries.values()
        return {
            "dcp": {
                "version": DCP_VERSION,
                "dcp_version": self.meta.version,
                "planner_data": self.meta.planner_data,
                "properties": {e.fqn: e.properties for e in entries if e.dtype is not None},
                "bytes": [e.fqn for e in entries if e.dtype is None],
            }
        }

    def describe(self) -> CheckpointInfo:
        tensors = []
        for fqn, e in self.meta.entries.items():
            dtype = e.dtype.name if e.dtype is not None else "U8"
            files = {c.item.file for c in e.chunks} if e.item is None else {e.item.file}
            shown = next(iter(files)) if len(files) == 1 else f"{len(e.chunks)} shards"
            nbytes = math.prod(e.shape) * (e.dtype.itemsize if e.dtype else 1)
            count = max(1, len(e.chunks))
            tensors.append(
                TensorInfo.make(
                    tree_mod.join((fqn,)), dtype, e.shape, nbytes, shown, fqn, None, count
                )
            )
        opaque = [e.fqn for e in self.meta.entries.values() if e.dtype is None]
        notes = [
            "torch.distributed.checkpoint's own format: .metadata read through an allow-list of "
            "DCP's metadata types (nothing else unpickled); each chunk a torch.save archive whose "
            "CRC-32s verify checks (a load checks each chunk's before using it)"
        ]
        if opaque:
            shown_names = ", ".join(opaque[:10]) + (", ..." if len(opaque) > 10 else "")
            notes.append(
                f"{len(opaque)} value(s) DCP serialised with torch.save (BYTE_IO: {shown_names}) "
                "are pickles savepoint never unpickles: kept as their raw bytes (U8); converted "
                "to savepoint's format, SavepointReader hands them back to dcp.load, which "
                "unpickles them itself"
            )
        return CheckpointInfo(
            path=self.path,
            format_version=None,
            writer=f"torch.distributed.checkpoint {self.meta.version or ''}".strip(),
            created="",
            metadata=self.metadata(),
            tensors=tuple(tensors),
            values={},
            files={METADATA: os.path.getsize(os.path.join(self.path, METADATA)), **self.sizes},
            format="dcp",
            notes=tuple(notes),
        )

    def check(self, progress: Progress | None) -> None:
        """Every chunk parsed and its storage's CRC-32 checked; every record of every archive
        (``BYTE_IO`` ones too, when they are archives) checked against its CRC-32. Progress is
        counted in the items' bytes (their zip headers included)."""
        tally = Tally(progress, sum(i.length for _, i in self._items()))
        for e in self.meta.entries.values():
            if e.item is not None:
                try:
                    archive = self._archive(e, e.item, "")
                except CorruptCheckpointError:
                    # Not an archive: a custom planner's own bytes, which only it can check.
                    tally.add(e.item.length)
                    continue
                tally.add(e.item.length - self._crc_all(archive, tally))
                continue
            for index, c in enumerate(e.chunks):
                archive, _, _ = self._record(e, index)
                tally.add(c.item.length - self._crc_all(archive, tally))

    def _crc_all(self, archive: Archive, tally: Tally) -> int:
        """Check every record of ``archive``; the bytes read (counted as they go)."""
        for record in archive.records.values():
            if not crc32(archive.buf, record, tally.add):
                raise CorruptCheckpointError(
                    f"{archive.what}: CRC-32 mismatch in record {record.name!r}", path=self.path
                )
        return sum(r.size for r in archive.records.values())


def _strided(buf: np.ndarray[Any, Any], record: Record, ref: TensorRef) -> np.ndarray[Any, Any]:
    """The tensor ``ref`` over the bytes of its storage ``record``, as raw items (bounds were
    checked when ``ref`` was read)."""
    size = ref.dtype.itemsize
    storage = buf[record.start : record.start + record.size].view(_void(size))
    if ref.contiguous:
        count = math.prod(ref.shape)
        return storage[ref.offset : ref.offset + count].reshape(ref.shape)
    return np.lib.stride_tricks.as_strided(
        storage[ref.offset :],
        shape=ref.shape,
        strides=tuple(s * size for s in ref.stride),
        writeable=False,
    )


class _DcpBytes(LazyTensor):
    """A ``BYTE_IO`` item's raw bytes (a pickle, never unpickled), as a uint8 tensor."""

    def __init__(self, ck: DcpCheckpoint, e: Entry) -> None:
        from savepoint.codecs import dtypes

        super().__init__(dtypes.from_name("U8"), e.shape)
        assert e.item is not None
        self._ck = ck
        self._item = e.item

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        at = self._item.offset + start
        np.copyto(dst, self._ck.buffer(self._item.file)[at : at + len(dst)])


class _DcpTensor(LazyTensor):
    """A tensor assembled from its chunks on every copy (see the module docstring)."""

    def __init__(self, ck: DcpCheckpoint, e: Entry) -> None:
        assert e.dtype is not None
        super().__init__(e.dtype, e.shape, kind=ck.kind)
        self._ck = ck
        self._entry = e
        self._whole = len(e.chunks) == 1

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        size = self.dtype.itemsize
        e = self._entry
        if self._whole:
            chunk = self._ck.chunk(e, 0)
            if chunk.flags.c_contiguous:
                np.copyto(dst, chunk.reshape(-1).view(np.uint8)[start : start + len(dst)])
                return
        first, last = start // size, -(-(start + len(dst)) // size)
        aligned = start % size == 0 and len(dst) % size == 0
        out = dst if aligned else np.empty((last - first) * size, dtype=np.uint8)
        items = out.view(_void(size))
        for piece in boxes.pieces(boxes.Flat(first, last), self.shape):
            n = boxes.volume(piece.box)
            target = items[piece.offset : piece.offset + n].reshape(boxes.extents(piece.box))
            for index, c in enumerate(e.chunks):
                common = boxes.intersect(c.box, piece.box)
                if common is None:
                    continue
                source = self._ck.chunk(e, index)
                target[boxes.relative(common, piece)] = source[
                    boxes.relative(common, boxes.Piece(c.box, 0))
                ]
        if not aligned:
            skip = start - first * size
            np.copyto(dst, out[skip : skip + len(dst)])


def _open(path: str | os.PathLike[str]) -> DcpCheckpoint:
    return DcpCheckpoint(os.path.abspath(local_path(path, what="DCP checkpoint")))


@contextlib.contextmanager
def open_checkpoint(path: str | os.PathLike[str]) -> Iterator[DcpCheckpoint]:
    """The DCP checkpoint at ``path`` for the length of a ``with`` block."""
    ck = _open(path)
    try:
        yield ck
    finally:
        ck.close()


def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe the DCP checkpoint at ``path`` from its ``.metadata`` and its files' sizes."""
    with open_checkpoint(path) as ck:
        return ck.describe()


def verify(path: str | os.PathLike[str], *, progress: Progress | None = None) -> CheckpointInfo:
    """Check the DCP checkpoint at ``path`` (every structural rule, every CRC-32); its
    description when intact."""
    with open_checkpoint(path) as ck:
        ck.check(progress)
        return ck.describe()
