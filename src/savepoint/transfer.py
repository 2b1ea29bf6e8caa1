"""Copy one committed checkpoint to another place, on any store, committed there like a save.

``sp.copy("/dev/shm/run/step-100", "s3://bucket/run/step-100")`` reads the source's manifest and
data files from one pinned generation (a concurrent replace of the source cannot mix two
checkpoints into the copy), checks every checksum of the source first (``verify=True``, the
default: a copy never spreads damage to another tier), streams each data file into the
destination's staging area through page-aligned buffers (O_DIRECT on local disks, multipart
uploads on object stores) and commits with the source's manifest, byte for byte, through the
same :class:`~savepoint.commit.transaction.Transaction` a save uses: a crash or an error at any
point leaves the destination's previous checkpoint (or nothing) and no half copy. The copy is the
same checkpoint: same manifest, same files, same checksums.

The destination may be replaced if it holds a committed savepoint checkpoint (like ``sp.save``);
``overwrite=False`` refuses then. Copying a checkpoint onto itself is refused. ``progress``:
``progress(done, total)`` in bytes, over the verification and the copy together.
"""

from __future__ import annotations

import logging
import mmap
import posixpath
import time
from typing import Any

from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import Transaction, check_target
from savepoint.engine import collector
from savepoint.engine import load as load_engine
from savepoint.engine.describe import describe
from savepoint.engine.read import Reader
from savepoint.errors import CheckpointError, CheckpointWriteError, UnsupportedStateError
from savepoint.info import CheckpointInfo
from savepoint.options import Progress, check_load
from savepoint.storage.base import BlobReader, BlobWriter, Store
from savepoint.storage.paths import PathArg
from savepoint.storage.paths import resolve as resolve_path

__all__ = ["copy"]

log = logging.getLogger(__name__)

CHUNK = 16 << 20  # bytes per read and write; a multiple of every store's alignment


def copy(
    src: PathArg,
    dst: PathArg,
    *,
    verify: bool = True,
    overwrite: bool = True,
    direct: bool = True,
    progress: Progress | None = None,
) -> CheckpointInfo:
    """Copy the committed checkpoint at ``src`` to ``dst`` (paths or URLs, any stores); return
    the description of the copy. See the module docstring."""
    check_load(progress=progress, what="copy")
    source = resolve_path(src, what="checkpoint path")
    target = resolve_path(dst, what="checkpoint path")
    started = time.perf_counter()
    with collector.paused(), Reader.open(source) as reader:
        if _same_place(source.store, source.path, target.store, target.path):
            raise ValueError(f"cannot copy {reader.shown} onto itself")
        _check_blobs(reader, source.store, target.store, target.path)
        sizes = sum(record.size for record in reader.manifest.files.values())
        checked = 0  # bytes the verification counted: the bar covers both passes

        def verifying(done: int, total: int) -> None:
            nonlocal checked
            checked = total
            if progress is not None:
                progress(done, total + sizes)

        if verify:
            load_engine.verify(reader, verifying)
        assert reader.pinned is not None
        raw = reader.pinned.read_small(mf.NAME, cap=mf.MAX_MANIFEST_BYTES)
        store = target.store

        def check(store: Store, path: str) -> None:
            if not overwrite and store.stat(path) is not None:
                shown = store.url(path)
                raise CheckpointWriteError(
                    f"{shown} exists and overwrite=False: nothing was copied", path=shown
                )
            check_target(store, path)

        copied = 0
        with Transaction(store, target.path, check=check) as tx:
            buffer = mmap.mmap(-1, CHUNK)
            try:
                for name, record in reader.manifest.files.items():
                    blob = reader.open_file(name, check_header=False).blob
                    writer = store.create_blob(
                        store.join(tx.staging, name), size=record.size, direct=direct
                    )
                    try:
                        _stream(blob, writer, record.size, buffer)
                        if progress is not None:
                            progress(checked + copied + record.size, checked + sizes)
                        writer.finish()
                    except BaseException:
                        writer.abort()
                        raise
                    copied += record.size
            finally:
                buffer.close()
            path = tx.commit(raw)
        shown = store.url(path)
        info = describe(shown, reader.manifest)
    seconds = time.perf_counter() - started
    log.info(
        "copied %s to %s: %d files, %d bytes in %.3f s (%s)",
        reader.shown,
        shown,
        len(reader.manifest.files),
        copied,
        seconds,
        "source verified" if verify else "not verified",
    )
    return info


def _stream(blob: BlobReader, writer: BlobWriter, size: int, buffer: mmap.mmap) -> None:
    view = memoryview(buffer)
    align = max(1, getattr(writer, "alignment", 1))
    offset = 0
    try:
        while offset < size:
            n = min(CHUNK, size - offset)
            part: Any = view[:n]
            try:
                blob.read(offset, part)
            except EOFError:
                raise CheckpointError(
                    f"a data file shrank while being copied (at byte {offset} of {size})"
                ) from None
            padded = -(-n // align) * align  # the last write padded; finish() cuts it off
            if padded != n:
                view[n:padded] = bytes(padded - n)
            writer.write(view[:padded])
            offset += n
    finally:
        view.release()


def _check_blobs(reader: Reader, src: Store, dst: Store, dst_path: str) -> None:
    """An incremental checkpoint (version 4) names its blob store relative to itself: a copy is
    only whole where that name reaches the same store (a sibling in the same run directory).
    Copying the blobs themselves is not supported yet: refuse clearly, before writing."""
    rel = reader.manifest.blob_store
    if rel is None:
        return
    there = posixpath.normpath(posixpath.join(reader.path, rel))
    here = posixpath.normpath(posixpath.join(dst_path, rel))
    if not _same_place(src, there, dst, here):
        raise UnsupportedStateError(
            f"{reader.shown} keeps its tensors in the blob store {src.url(there)} ({rel!r} from "
            f"the checkpoint); copying it to {dst.url(dst_path)} would leave them behind "
            f"(there it would name {dst.url(here)}). Copy it next to itself, or load it and "
            "save a plain checkpoint there; copying blobs is not supported yet"
        )


def _same_place(a: Store, a_path: str, b: Store, b_path: str) -> bool:
    return a.url(a.abspath(a_path)).rstrip("/") == b.url(b.abspath(b_path)).rstrip("/")
