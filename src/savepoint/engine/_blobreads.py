"""Blob reads: the tensors and shards of a version 4 checkpoint stored in a blob store.

The reader pins the checkpoint's directory, not its blobs (they may be thousands, shared with
every other checkpoint of the run): :func:`open_blob_store` finds the store the manifest names
(once per generation, never creating it) and :func:`blob_failure` tells a blob collected from a
checkpoint deleted or replaced since it was pinned from damage. See :mod:`.read`.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from savepoint.codecs import boxes
from savepoint.codecs import manifest as mf
from savepoint.commit import names
from savepoint.engine._checks import check_bool
from savepoint.engine._pin import Generation
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CorruptCheckpointError,
    ReplacedWhileReadingError,
)

if TYPE_CHECKING:
    from savepoint.blobs import BlobStore


def open_blob_store(gen: Generation) -> BlobStore:
    """The blob store of a version 4 checkpoint (opened once; never created)."""
    if gen.blob_store is None:
        from savepoint.blobs import BlobStore

        rel = gen.manifest.blob_store
        assert rel is not None
        # A run's alias (``<run>/latest``, a linked copy of ``<run>/checkpoints/step-N``)
        # holds the manifest of a directory one level deeper: where the store is not at
        # ``rel``, it is looked for one ``..`` closer (never further out than ``rel``).
        tries = [rel] + ([rel[3:]] if rel.startswith("../") else [])
        # ``rel`` is relative to the checkpoint's path; on a store without rename the
        # manifest is in a generation directory under it (commit._generations).
        base = gen.path
        if names.is_generation(gen.store.basename(base)):
            base = gen.store.parent(base)
        # Where both open (a store of other checkpoints next to the run, say), the one
        # holding a blob this checkpoint names is its own.
        probe = next((r.digests[0] for r in mf.recipes(gen.manifest) if r.digests), None)
        first: CheckpointError | None = None
        for candidate in tries:
            root = posixpath.normpath(posixpath.join(base, candidate))
            try:
                opened = BlobStore(
                    gen.store, root, algorithm=gen.manifest.blob_digest, create=False
                )
            except CheckpointError as exc:
                # A refusal says more than the other candidate's "no store here".
                refused = isinstance(exc, CheckpointPermissionError)
                first = exc if refused else first or exc
                continue
            gen.blob_store = gen.blob_store or opened
            if probe is None or opened.exists(probe):
                gen.blob_store = opened
                break
        if gen.blob_store is None and isinstance(first, CheckpointPermissionError):
            raise first  # may not be read: not damage
        if gen.blob_store is None:
            if gen.left_its_path() == "deleted":  # the run deleted with its store, say
                raise CheckpointNotFoundError(
                    f"{gen.shown} was deleted while it was being read (its blob store "
                    "with it); it was intact when the read began. Load a checkpoint that "
                    "is still there",
                    path=gen.shown,
                )
            root = posixpath.normpath(posixpath.join(base, rel))
            raise CorruptCheckpointError(
                f"{gen.shown}: its blob store {gen.store.url(root)} cannot be opened: {first}",
                path=gen.shown,
            ) from None
    return gen.blob_store


def blob_failure(
    gen: Generation, exc: CorruptCheckpointError, ref: str, where: str = ""
) -> CheckpointError:
    """The error for a blob read of tensor ``ref`` (``where``: which part of it) that failed
    with ``exc``. The reader pins the checkpoint's directory, not its blobs (they may be
    thousands, shared with every other checkpoint of the run), so a writer can delete the
    checkpoint being read and then collect its blobs (a run's retention does, manifest
    first). A missing blob is therefore damage only while the checkpoint is still at its
    path: deleted since it was opened, it is CheckpointNotFoundError saying so; replaced by
    another checkpoint, ReplacedWhileReadingError (``sp.load`` and ``sp.verify`` read the new
    one). Anything else is CorruptCheckpointError naming the tensor."""
    from savepoint.blobs.store import MissingBlobError

    if isinstance(exc, MissingBlobError):
        gone = gen.left_its_path()
        if gone == "deleted":
            return CheckpointNotFoundError(
                f"{gen.shown} was deleted while it was being read (by a run's retention, "
                f"say), and blob {exc.digest} of tensor {ref!r} with it; it was intact when "
                "the read began. Load a checkpoint that is still there",
                path=gen.shown,
            )
        if gone == "replaced":
            return ReplacedWhileReadingError(
                f"{gen.shown} was replaced while it was being read, and blob {exc.digest} "
                f"of tensor {ref!r} of the checkpoint being read was collected; load again",
                path=gen.shown,
            )
    return gen.corrupt(f"tensor {ref!r}{where}: {exc}", key=ref)


def read_blobs(
    gen: Generation,
    ref: str,
    dst: np.ndarray[Any, Any] | None,
    verify: bool,
    progress: Callable[[int], None] | None,
    lock: threading.Lock,
) -> None:
    """A tensor stored as blobs: read into ``dst`` (checked against the recipe's checks
    with ``verify``), or with no ``dst`` every blob checked against its digest."""
    rec = gen.manifest.tensors[ref]
    recipe = rec.recipe
    blobs = open_blob_store(gen)
    try:
        if dst is None:
            blobs.verify_recipe(recipe)
            if rec.dtype == "BOOL":
                dst = blobs.read_recipe(recipe, verify=False)
        else:
            blobs.read_recipe(recipe, out=dst, verify=verify)
    except CorruptCheckpointError as exc:
        raise blob_failure(gen, exc, ref) from None
    if dst is not None and rec.dtype == "BOOL":
        check_bool(gen, ref, dst)
    if progress is not None:
        with lock:
            progress(rec.nbytes)


def read_blob_part(
    gen: Generation, ref: str, shard: mf.ShardRecord, needed: tuple[int, int]
) -> np.ndarray[Any, Any]:
    """:func:`._shards._read_part` of a shard stored as blobs: ``needed`` read out of its recipe
    (unchecked here: the caller hashes what it reads against the recipe's checks)."""
    buf = np.empty(shard.nbytes, dtype=np.uint8)
    lo, hi = needed
    if hi > lo:
        try:
            open_blob_store(gen).read_recipe(
                shard.recipe, out=buf[lo:hi], start=lo, end=hi, verify=False
            )
        except CorruptCheckpointError as exc:
            raise blob_failure(gen, exc, ref, f" ({boxes.show(shard.region)} in blobs)") from None
    return buf


def verify_blob_shard(
    gen: Generation,
    ref: str,
    shard: mf.ShardRecord,
    progress: Callable[[int], None] | None,
    lock: threading.Lock,
) -> None:
    """Every blob of a shard stored as blobs against its digest and its recipe's check."""
    where = f" ({boxes.show(shard.region)} in blobs)"
    try:
        open_blob_store(gen).verify_recipe(shard.recipe)
        if gen.manifest.tensors[ref].dtype == "BOOL":
            content = open_blob_store(gen).read_recipe(shard.recipe, verify=False)
    except CorruptCheckpointError as exc:
        raise blob_failure(gen, exc, ref, where) from None
    if gen.manifest.tensors[ref].dtype == "BOOL":
        check_bool(gen, ref, content)
    if progress is not None:
        with lock:
            progress(shard.nbytes)
