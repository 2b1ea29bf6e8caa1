"""What the foreign formats (``.shrew``, safetensors files, boostr directories) share.

- Lazy tensors: :class:`LazyTensor` and its kinds are ``TensorSource`` objects (see
  :mod:`savepoint.state.arrays`) whose bytes stay where they are (a file range, a mapped
  safetensors file, a native checkpoint) until a writer copies them, chunk by chunk. A conversion
  therefore holds at most one tensor in memory, and usually not even that: a file range is read
  straight into the writer's staging buffer.
- safetensors files: :class:`SafetensorsFile` checks the whole header with the strict parser of
  :mod:`savepoint.codecs.safetensors` (size cap, dtypes, shape x dtype sizes, offsets that tile
  the data exactly) before mapping the file; :func:`write_safetensors` streams sources to disk with
  the caller's ``__metadata__``, keeping the caller's tensor order in the header.
- Atomic single files: :func:`atomic_file` writes under a hidden sibling name, fsyncs, renames
  over the target and fsyncs the parent, so readers see the old file or the new one.
- Opening a user's file: :func:`open_file` never blocks (a FIFO named ``x.shrew`` is refused).
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np

from savepoint import errors_map
from savepoint.codecs import checksum, dtypes
from savepoint.codecs import safetensors as st_format
from savepoint.codecs.dtypes import DType
from savepoint.commit import atomic
from savepoint.commit.transaction import Transaction
from savepoint.engine import pipeline
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from savepoint.formats import _kernel_copy
from savepoint.state import arrays
from savepoint.state.arrays import TensorSource
from savepoint.storage import local
from savepoint.storage.base import Store
from savepoint.storage.local import STORE as LOCAL

CHUNK = 4 << 20  # bytes per read or write when a tensor is streamed through a bounded buffer
U8 = np.dtype(np.uint8)


# ---------------------------------------------------------------------------------------------
# lazy tensors
# ---------------------------------------------------------------------------------------------


class LazyTensor(abc.ABC):
    """A tensor whose bytes are fetched only when copied (``TensorSource``), or on ``load()``."""

    def __init__(self, dtype: DType, shape: tuple[int, ...], *, kind: str = "numpy") -> None:
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.nbytes = math.prod(self.shape) * dtype.itemsize
        self.kind = kind

    def identity(self) -> tuple[Any, ...] | None:
        return None

    @abc.abstractmethod
    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        """Copy bytes ``[start, start + dst.size)`` of the tensor into ``dst``."""

    def release(self) -> None:  # noqa: B027 - optional hook; most lazy tensors hold nothing
        """Drop whatever the copies made (a materialized tensor, a running checksum)."""

    def load(self) -> np.ndarray[Any, Any]:
        """The whole tensor as a numpy array of its dtype and shape."""
        out = np.empty(self.nbytes, dtype=U8)
        try:
            for pos in range(0, self.nbytes, CHUNK):
                self.copy_to(out[pos : pos + CHUNK], pos)
        finally:
            self.release()
        return out.view(self.dtype.numpy).reshape(self.shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.dtype.name}, {self.shape})"


def chunks(source: TensorSource, size: int = CHUNK) -> Iterator[memoryview]:
    """The bytes of ``source`` in order, through one reused buffer of at most ``size`` bytes.

    Each chunk is valid until the next one is produced; ``source.release()`` runs at the end.
    """
    buf = np.empty(min(size, source.nbytes), dtype=U8)
    try:
        for pos in range(0, source.nbytes, size):
            n = min(size, source.nbytes - pos)
            source.copy_to(buf[:n], pos)
            yield buf[:n].data
    finally:
        source.release()


def drain(source: TensorSource) -> None:
    """Read every byte of ``source`` once and drop it (a check that the data can be read)."""
    for _ in chunks(source):
        pass


class ArrayTensor(LazyTensor):
    """A tensor already in memory (numpy array or torch tensor), behind the lazy interface."""

    def __init__(self, source: TensorSource) -> None:
        super().__init__(source.dtype, source.shape, kind=source.kind)
        self._source = source

    @classmethod
    def of(cls, value: Any, key: str) -> ArrayTensor | None:
        source = arrays.make_source(value, key)
        return None if source is None else cls(source)

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        self._source.copy_to(dst, start)

    def release(self) -> None:
        self._source.release()


class MappedTensor(LazyTensor):
    """Bytes in a mapped file (``view``: a uint8 slice of the mapping).

    With ``xxh3`` the bytes are hashed as they are copied, in order, and a mismatch at the end
    raises CorruptCheckpointError naming ``name``; ``load()`` checks the whole tensor first.
    ``block``: ``xxh3`` is of block checksums of that size (see savepoint.codecs.checksum).
    ``file``: ``(fd, offset)`` where the same bytes lie raw in an open file (the mapped one), so
    a writer may have the kernel copy them (:mod:`savepoint.formats._kernel_copy`) and then
    :meth:`check` the copy; None where no descriptor is kept.
    """

    def __init__(
        self,
        view: np.ndarray[Any, Any],
        dtype: DType,
        shape: tuple[int, ...],
        *,
        kind: str = "numpy",
        xxh3: str | None = None,
        block: int = 0,
        name: str = "",
        path: str = "",
        file: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(dtype, shape, kind=kind)
        if len(view) != self.nbytes:
            raise ValueError("view length disagrees with shape x dtype")
        self.file = file
        self._view = view
        self._xxh3 = xxh3
        self._block = block
        self._name = name
        self._path = path
        self._hasher: Any = None
        self._hashed = 0

    def _check(self, got: str) -> None:
        if got != self._xxh3:
            raise CorruptCheckpointError(
                f"{self._path}: checksum mismatch in tensor {self._name!r}",
                path=self._path,
                key=self._name,
            )

    def _check_all(self) -> None:
        self.check(self._view)

    def check(self, copy: Any) -> None:
        """Check ``copy`` (a buffer of the tensor's whole bytes: a copy made elsewhere) against
        the checksum, CorruptCheckpointError naming the tensor if it differs; nothing to do
        without a checksum."""
        if self._xxh3 is None:
            return
        hasher = checksum.Hasher(self._block, expect=self._xxh3)
        hasher.update(copy)
        self._check(hasher.result().xxh3)

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        piece = self._view[start : start + len(dst)]
        np.copyto(dst, piece)
        if self._xxh3 is None:
            return
        if start == 0:
            self._hasher, self._hashed = checksum.Hasher(self._block, expect=self._xxh3), 0
        if self._hasher is not None and start == self._hashed:
            self._hasher.update(piece)
            self._hashed += len(piece)
            if self._hashed == self.nbytes:
                self._check(self._hasher.result().xxh3)
                self._hasher = None
        else:
            # Out-of-order copies (no writer of savepoint does this): check the whole tensor once.
            self._hasher = None
            self._check_all()

    def release(self) -> None:
        self._hasher = None
        self._hashed = 0

    def load(self) -> np.ndarray[Any, Any]:
        """A read-only view of the mapping (no copy), checked first when a checksum is known."""
        if self._xxh3 is not None:
            self._check_all()
        return self._view.view(self.dtype.numpy).reshape(self.shape)


class FileRangeTensor(LazyTensor):
    """``nbytes`` at ``offset`` in an open file, read straight into each destination buffer."""

    def __init__(
        self, fd: int, offset: int, dtype: DType, shape: tuple[int, ...], *, path: str = ""
    ) -> None:
        super().__init__(dtype, shape)
        self._fd = fd
        self._offset = offset
        self._path = path

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        view = dst.data.cast("B")
        pos = self._offset + start
        while len(view):
            n = os.preadv(self._fd, [view], pos)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"{self._path}: the file ended while reading tensor data (was it changed "
                    "while being read?)",
                    path=self._path,
                )
            view, pos = view[n:], pos + n


class Materialized(LazyTensor):
    """A tensor made whole, as its bytes, on the first copy and dropped on release: what cannot
    be read a range at a time (a concatenation, a widened copy, an assembled native tensor)."""

    _made: np.ndarray[Any, Any] | None = None

    @abc.abstractmethod
    def make(self) -> np.ndarray[Any, Any]:
        """The tensor's bytes as a flat uint8 array."""

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        if self._made is None:
            self._made = self.make()
        np.copyto(dst, self._made[start : start + len(dst)])

    def release(self) -> None:
        self._made = None


class ConcatTensor(Materialized):
    """The concatenation of ``parts`` along ``axis``; made on the first copy, dropped on release.

    The parts are usually mapped (so reading them costs no memory); the result is the one tensor
    a conversion holds at a time.
    """

    def __init__(self, parts: Sequence[LazyTensor], axis: int) -> None:
        shape = list(parts[0].shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        super().__init__(parts[0].dtype, tuple(shape))
        self.parts = tuple(parts)
        self.axis = axis

    def make(self) -> np.ndarray[Any, Any]:
        joined = np.concatenate([p.load() for p in self.parts], axis=self.axis)
        return np.ascontiguousarray(joined).reshape(-1).view(U8)

    def load(self) -> np.ndarray[Any, Any]:
        made = self._made if self._made is not None else self.make()
        self.release()
        out: np.ndarray[Any, Any] = made.view(self.dtype.numpy).reshape(self.shape)
        return np.array(out)


def to_framework(array: np.ndarray[Any, Any], dtype: DType, framework: str) -> Any:
    """``array`` as numpy (unchanged) or as a torch tensor sharing its memory."""
    if framework == "numpy":
        return array
    if framework != "torch":
        raise ValueError(f"framework must be 'numpy' or 'torch', not {framework!r}")
    from savepoint.state import torch_tensors

    if not array.flags.writeable:
        array = array.copy()
    return torch_tensors.from_numpy(array, dtype)


def open_file(path: str) -> BinaryIO:
    """A user's file opened for reading, without ever blocking.

    The path is resolved first (a user may name a symlink, the Hugging Face cache is made of
    them), then opened through :func:`savepoint.storage.local.open_read`: ``O_NONBLOCK``, then
    ``fstat``. A FIFO, a socket, a device or a directory is refused with a CheckpointError
    subclass instead of hanging in ``open`` or ``read``; a missing file is a
    CheckpointNotFoundError, an unreadable one a CheckpointPermissionError.
    """
    try:
        fd = local.open_read(os.path.realpath(path), shown=path)
    except FileNotFoundError:  # open_read raises CheckpointErrors for everything else
        raise CheckpointNotFoundError(f"no file at {path}", path=path) from None
    return os.fdopen(fd, "rb")


# ---------------------------------------------------------------------------------------------
# safetensors files
# ---------------------------------------------------------------------------------------------


class SafetensorsFile:
    """A safetensors file opened for reading; every header rule is checked before mapping.

    ``entries`` are in header order; ``tensor(name)`` is a :class:`MappedTensor` (no copy).
    Close it (or use ``with``) when done; arrays from ``load()`` keep the mapping alive.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            # Never blocks on a FIFO, refuses symlinks and special files (CorruptCheckpointError),
            # and an unreadable file is CheckpointPermissionError.
            fd = local.open_read(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no file at {path}", path=path) from None
        try:
            self.size = os.fstat(fd).st_size
            try:
                n = st_format.header_length(local.read_exact(fd, 0, min(8, self.size)), self.size)
                raw = local.read_exact(fd, 8, n)
                entries, metadata = st_format.parse_header(raw, self.size)
                del raw
            except st_format.HeaderError as exc:
                raise CorruptCheckpointError(f"{path}: {exc}", path=path) from None
            self.header_size = 8 + n
            self._map = local.MappedFile(fd, self.size)
        except EOFError:
            raise CorruptCheckpointError(
                f"{path} shrank while being read (was it changed meanwhile?)", path=path
            ) from None
        except (OSError, ValueError) as exc:  # EIO, or a mapping the system refuses
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path} cannot be read: {exc}", path=path) from None
        finally:
            os.close(fd)
        self.entries = entries
        self.metadata = metadata
        self._by_name = {e.name: e for e in entries}

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._map.close()

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def entry(self, name: str) -> st_format.Entry:
        return self._by_name[name]

    def tensor(self, name: str) -> MappedTensor:
        e = self._by_name[name]
        return MappedTensor(
            self._map.slice(e.start, e.end), dtypes.from_name(e.dtype), e.shape, path=self.path
        )


def write_safetensors(
    path: str,
    tensors: Sequence[tuple[str, TensorSource]],
    metadata: Mapping[str, str] | None = None,
    *,
    pool: pipeline.StagingPool | None = None,
    finishing: list[Callable[[], None]] | None = None,
    align: bool = False,
) -> None:
    """Stream ``tensors`` into a new safetensors file at ``path`` (which must not exist), fsynced:
    copied by the kernel and checked in the new file when every tensor lies raw in an open file
    (:mod:`savepoint.formats._kernel_copy`; its fsync deferred with ``finishing``, and with
    ``align`` the header padded so that the copies are page-aligned, see there),
    else through the staging buffers of ``pool`` (by default the write pipeline's shared pool)."""
    header, order = st_format.ordered_layout(
        [(name, s.dtype.name, s.shape, s.nbytes) for name, s in tensors], metadata
    )
    sources = [tensors[i][1] for i in order]
    target = os.path.abspath(path)
    if not _kernel_copy.write(target, header, sources, finishing, align=align):
        pipeline.write_blob(LOCAL, target, header, sources, pool=pool)


# ---------------------------------------------------------------------------------------------
# atomic single files
# ---------------------------------------------------------------------------------------------


def write_error(target: str, exc: OSError) -> CheckpointWriteError:
    return errors_map.write_error(
        exc,
        target,
        f"writing {target} failed",
        where=exc.filename if isinstance(exc.filename, str) and exc.filename else target,
        tail="; any previous file there is intact and no temporary file remains",
        cause=False,
    )


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; when the block succeeds, the file written there
    (and fsynced by the caller) replaces ``path`` atomically and the parent is fsynced. On any
    error the temporary file is removed and ``path`` is untouched."""
    target = os.path.abspath(path)
    parent = os.path.dirname(target)
    tmp = atomic.staging_path(target)
    try:
        os.makedirs(parent, exist_ok=True)
        atomic.clean_stale(target)  # temporaries of writers that died (never a live one's)
        yield tmp
        os.replace(tmp, target)
        local.fsync_dir(parent)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise write_error(target, exc) from exc
        raise


@contextlib.contextmanager
def atomic_directory(path: str, *, what: str = "checkpoint") -> Iterator[str]:
    """Yield an empty staging directory next to ``path``; on success it becomes ``path`` in one
    step through the same :class:`~savepoint.commit.transaction.Transaction` as every native
    save (the caller has checked that what is at ``path`` may be replaced). On any error the
    staging directory is removed and ``path`` is untouched; OSErrors become
    CheckpointWriteErrors."""
    with Transaction(LOCAL, os.path.abspath(path), what=what, check=_replaceable) as tx:
        yield tx.staging
        tx.commit(None)


def _replaceable(store: Store, target: str) -> None:
    """The callers of :func:`atomic_directory` check their own targets (a boostr directory, a
    training artifact) before writing anything."""


def fsync_file(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())
