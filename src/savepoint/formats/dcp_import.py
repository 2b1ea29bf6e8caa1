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
- With ``SerializationFormat.SAFETENSORS`` a file holds its ``BYTE_IO`` items, then one
  safetensors blob of all its chunks running to the end of the file; ``.metadata`` gives each
  chunk the blob's offset and the chunk's length. A blob is told from an archive by its first
  bytes (a zip starts ``PK\x03\x04``), its header checked once, and each chunk read from it
  by its fully qualified name, held to ``.metadata``'s dtype, shape and length (no checksums).
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
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from savepoint.codecs import boxes
from savepoint.codecs import safetensors as st_format
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
    "is_dcp",
    "open_checkpoint",
]

METADATA = ".metadata"
SUFFIX = ".distcp"
LABEL = "torch.distributed.checkpoint checkpoint"
DCP_VERSION = 1  # the shape of metadata["dcp"], as savepoint.integrations.dcp.DCP_VERSION
_PICKLE_CAP = 1 << 20
_OPEN_FILES = 16  # a chunk's data.pkl (about 150 bytes in torch 2.13)


def is_dcp(entries: Iterable[str]) -> bool:
    """Whether a directory holding ``entries`` is a DCP checkpoint (``.metadata`` and at least
    one ``*.distcp`` file)."""
    names = set(entries)
    return METADATA in names and any(n.endswith(SUFFIX) for n in names)


def _no(n: int) -> None:
    """No progress to report."""


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
        self._crc: dict[tuple[str, int], tuple[str, Record]] = {}  # records not yet checked
        self._fds: dict[str, int] = {}  # least recently used first
        self._blobs: dict[tuple[str, int], dict[str, st_format.Entry] | None] = {}
        self._refs: dict[bytes, TensorRef] = {}  # each distinct data.pkl read once
        self._strides_base: dict[tuple[str, int], int] = {}  # where each chunk's bytes start
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

    label = "dcp"

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        self._chunks, self._crc = {}, {}
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
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

    def read_into(self, name: str, offset: int, dst: np.ndarray[Any, Any]) -> None:
        """``len(dst)`` bytes of the file ``name`` at ``offset`` read straight into ``dst`` (a
        few descriptors kept open: reading beats faulting a mapping in on a cold cache)."""
        fd = self._fds.pop(name, None)
        if fd is None:
            fd = local.open_read(os.path.join(self.path, name))
            while len(self._fds) >= _OPEN_FILES:
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[name] = fd
        view, pos = dst.data.cast("B"), offset
        while len(view):
            n = os.preadv(fd, [view], pos)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"{self.path}/{name} ended while being read (changed meanwhile?)",
                    path=self.path,
                )
            view, pos = view[n:], pos + n

    def _archive(self, e: Entry, item: Item, what: str) -> Archive:
        where = f"{self.path}/{item.file} at {item.offset} ({e.fqn!r}{what})"
        return Archive(self.buffer(item.file), item.offset, item.length, path=self.path, what=where)

    def _record(self, e: Entry, index: int) -> tuple[Archive, TensorRef, Record]:
        archive = self._archive(e, e.chunks[index].item, f", chunk {index}")
        ref = archive.load(TENSOR_GLOBALS, cap=_PICKLE_CAP, memo=self._refs)
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

    def chunk(self, e: Entry, index: int, *, checked: bool = True) -> np.ndarray[Any, Any]:
        """Chunk ``index`` of the tensor ``e`` as a read-only array of its box's shape whose
        items are raw (``np.void`` of the dtype's size), its storage record's CRC-32 checked
        first unless it was (``checked=False``: the caller checks it as it copies, then calls
        :meth:`checked`)."""
        key = (e.fqn, index)
        found = self._chunks.get(key)
        if found is None and self._blob(e.chunks[index].item) is not None:
            assert e.dtype is not None  # a chunk of a tensor
            start = self._strides_base[key] = self._raw_start(e, index)
            extents = boxes.extents(e.chunks[index].box)
            raw = self.buffer(e.chunks[index].item.file)[
                start : start + e.chunks[index].item.length
            ]
            found = self._chunks[key] = raw.view(_void(e.dtype.itemsize)).reshape(extents)
        if found is None:
            archive, ref, record = self._record(e, index)
            self._crc[key] = (archive.what, record)
            self._strides_base[key] = record.start + ref.offset * ref.dtype.itemsize
            found = self._chunks[key] = _strided(archive.buf, record, ref)
        if checked and key in self._crc:
            record = self._crc[key][1]
            self.checked(key, crc32(self.buffer(e.chunks[index].item.file), record, _no))
        return found

    def _blob(self, item: Item) -> dict[str, st_format.Entry] | None:
        """The tensors of the safetensors blob ``item`` starts (DCP's ``FileSystemWriter`` with
        ``SerializationFormat.SAFETENSORS`` writes, after a file's ``BYTE_IO`` items, one
        safetensors blob of all its tensors running to the end of the file, and gives each
        tensor item the blob's offset), by name; None where ``item`` starts a ``torch.save``
        archive (a zip). Parsed and checked once per blob."""
        key = (item.file, item.offset)
        if key in self._blobs:
            return self._blobs[key]
        buf = self.buffer(item.file)
        found: dict[str, st_format.Entry] | None = None
        if bytes(buf[item.offset : item.offset + 4]) != b"PK\x03\x04":
            size = self.sizes[item.file] - item.offset
            where = f"{self.path}/{item.file} at {item.offset}"
            try:
                n = st_format.header_length(bytes(buf[item.offset : item.offset + 8]), size)
                raw = bytes(buf[item.offset + 8 : item.offset + 8 + n])
                entries, _ = st_format.parse_header(raw, size)
            except st_format.HeaderError as exc:
                raise CorruptCheckpointError(
                    f"{where} is neither a torch.save archive nor a safetensors blob: {exc}",
                    path=self.path,
                ) from None
            found = {en.name: en for en in entries}
        self._blobs[key] = found
        return found

    def _raw_start(self, e: Entry, index: int) -> int:
        """Where chunk ``index`` of ``e`` starts in its file, in a safetensors blob: the blob
        must hold ``e`` under its name, of its dtype and of the chunk's shape."""
        item = e.chunks[index].item
        blob = self._blob(item)
        assert blob is not None and e.dtype is not None
        found = blob.get(e.fqn)
        want = boxes.extents(e.chunks[index].box)
        if found is None or found.dtype != e.dtype.name or tuple(found.shape) != tuple(want):
            got = "nothing" if found is None else f"a {found.dtype} tensor {list(found.shape)}"
            raise CorruptCheckpointError(
                f"{self.path}/{item.file} at {item.offset}: the safetensors blob holds {got} "
                f"for {e.fqn!r}; {METADATA} says a {e.dtype.name} chunk of shape {list(want)}",
                path=self.path,
            )
        if found.end - found.start != item.length:
            raise CorruptCheckpointError(
                f"{self.path}/{item.file}: {e.fqn!r} is {found.end - found.start} bytes in its "
                f"safetensors blob, {item.length} in {METADATA}",
                path=self.path,
            )
        return item.offset + found.start

    def data_start(self, e: Entry) -> int:
        """Where the bytes of ``e``'s only chunk start in its file."""
        return int(self._strides_base[(e.fqn, 0)])

    def exact(self, e: Entry, index: int) -> bool:
        """Whether chunk ``index`` of ``e`` is its storage record, byte for byte (so a copy of it
        in order can check the record's CRC-32 as it goes: see :class:`_DcpTensor`)."""
        chunk = self.chunk(e, index, checked=False)
        record = self._crc.get((e.fqn, index))
        return record is None or (
            chunk.flags.c_contiguous and record[1].size == chunk.size * chunk.itemsize
        )

    def checked(self, key: tuple[str, int], ok: bool) -> None:
        """Record the outcome of the CRC-32 check of chunk ``key``'s storage record."""
        what, record = self._crc.pop(key, ("", None))
        if not ok and record is not None:
            raise CorruptCheckpointError(
                f"{what}: CRC-32 mismatch in the chunk's data", path=self.path
            )

    def expected_crc(self, key: tuple[str, int]) -> int | None:
        """The CRC-32 chunk ``key`` must have, None once checked."""
        found = self._crc.get(key)
        return None if found is None else found[1].crc

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
                if self._blob(c.item) is not None:  # no checksums: checked and read
                    start = self._raw_start(e, index)
                    tally.add(c.item.length)
                    zlib.crc32(self.buffer(c.item.file)[start : start + c.item.length].data)  # read
                    continue
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
    """A tensor assembled from its chunks on every copy (see the module docstring). A tensor in
    one chunk that is its storage record, copied in order (as every reader of savepoint does),
    has the record's CRC-32 computed as it is copied and compared at the end (one pass over the
    bytes, as ``torch.load`` reads them); any other access checks each chunk before using it."""

    def __init__(self, ck: DcpCheckpoint, e: Entry) -> None:
        assert e.dtype is not None
        super().__init__(e.dtype, e.shape, kind=ck.kind)
        self._ck = ck
        self._entry = e
        self._whole = len(e.chunks) == 1
        self._crc: tuple[int, int] | None = None  # (running CRC-32, bytes hashed)

    def _copy_whole(self, dst: np.ndarray[Any, Any], start: int) -> None:
        key = (self._entry.fqn, 0)
        self._ck.chunk(self._entry, 0, checked=False)
        expected = self._ck.expected_crc(key)
        if expected is not None and start == 0:
            self._crc = (0, 0)
        if expected is None or self._crc is None or self._crc[1] != start:
            self._ck.chunk(self._entry, 0)  # out of order: the whole record checked first
        item = self._entry.chunks[0].item
        self._ck.read_into(item.file, self._ck.data_start(self._entry) + start, dst)
        if expected is not None and self._crc is not None and self._crc[1] == start:
            value = zlib.crc32(dst.data, self._crc[0])
            self._crc = (value, start + len(dst))
            if self._crc[1] == self.nbytes:
                self._crc = None
                self._ck.checked(key, value == expected)

    def release(self) -> None:
        self._crc = None

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        size = self.dtype.itemsize
        e = self._entry
        if self._whole and self._ck.exact(e, 0):
            self._copy_whole(dst, start)
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
