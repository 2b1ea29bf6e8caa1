"""One commit transaction for every save path; two strategies chosen by the store.

Call order::

    with Transaction(store, target, what="checkpoint") as tx:
        # begin: the target is checked (absent, an empty directory, or a committed checkpoint),
        # the parent made, stale temporaries of dead processes removed, ``tx.staging`` created
        ...write blobs under tx.staging (store.create_blob / put / link), each finished...
        path = tx.commit(manifest_bytes)    # manifest.json written last, then published
    # leaving the block without commit (an exception) aborts: staging removed, target untouched

``commit(None)`` publishes a staging directory that already holds its manifest (an alias built
from hard links), or a directory of another format that has none (a boostr checkpoint, a
training artifact: ``check=`` then says what such a save may replace). A sharded save spans several collective steps, so it calls :meth:`begin`,
:meth:`commit` and :meth:`abort` itself instead of using ``with``.

Strategies (``store.capabilities.atomic_rename``):

- "rename" (:mod:`savepoint.commit._rename`): staging is a hidden sibling of the target; after
  the manifest it is synced and renamed (or exchanged) into place, the parent synced;
- "manifest-last" (:mod:`savepoint.commit._generations`): staging is a generation directory under
  the target, unique to the attempt; the manifest's create-only put is the commit point; older
  generations are deleted afterwards.

Errors: an OSError (not already a CheckpointError) raised in ``begin``, inside the ``with`` block
or by ``commit`` becomes a :class:`~savepoint.errors.CheckpointWriteError` (with the ``errno``)
saying that the previous checkpoint is intact; the original is its ``__cause__``.

:func:`resolve` finds the committed checkpoint of a path in either layout, on any store (layout by
content, not by capability). :func:`discard` deletes one so that no crash leaves it half-deleted.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Literal, cast

from savepoint import errors_map
from savepoint.codecs import manifest as mf
from savepoint.commit import _generations, _rename, names, pointer
from savepoint.errors import CheckpointError, CheckpointWriteError, CorruptCheckpointError
from savepoint.storage import finishing, local
from savepoint.storage.base import Store

__all__ = ["Transaction", "check_target", "discard", "refused_hint", "resolve", "write_error"]

Strategy = Literal["rename", "manifest-last"]

# DEBUG: each step of a transaction (staging made, manifest written and fsynced, published,
# aborted), with the store's names for the paths. The library configures no handler.
log = logging.getLogger(__name__)


class Transaction:
    """A save of one checkpoint (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        target: str,
        *,
        what: str = "checkpoint",
        check: Callable[[Store, str], None] | None = None,
    ) -> None:
        self.store = store
        self.target = store.abspath(target)
        self.what = what
        # What may be replaced: by default (check_target) nothing but a savepoint checkpoint or
        # an empty directory; other formats pass their own rule (a boostr directory, say).
        self.check = check or (lambda store, target: check_target(store, target, what))
        self.strategy: Strategy = "rename" if store.capabilities.atomic_rename else "manifest-last"
        self.staging = ""  # set by begin()
        self.committed: str | None = None
        self._begun = False
        self._made_target = False  # manifest-last: the target directory is this attempt's
        self._kept_old = False  # rename: an "-old-" sibling was kept by the tidy before the save
        self._started = time.perf_counter()

    @property
    def shown(self) -> str:
        """How messages name the target."""
        return self.store.url(self.target)

    def begin(self) -> Transaction:
        """Check the target, make its parent, tidy stale temporaries, create the staging
        directory; on failure nothing is left behind and the error is raised (OSErrors as
        CheckpointWriteError)."""
        assert not self._begun, "a transaction begins once"
        self._begun = True
        store = self.store
        try:
            st = store.stat(self.target)
            if st is not None and st.kind == "link":
                # A symlinked checkpoint path (to another disk, say): replace what it points to.
                self.target = store.realpath(self.target)
            if self.strategy == "rename":
                self.staging = names.hidden(store, self.target, names.TMP_TAG)
                self.check(store, self.target)
                store.makedirs(store.parent(self.target))
                self._kept_old = _rename.tidy(store, self.target)[1]
            else:
                self.staging = store.join(self.target, names.generation())
                self.check(store, self.target)
                self._made_target = store.stat(self.target) is None
                store.makedirs(self.target)
            store.mkdir(self.staging)
        except BaseException as exc:
            self.abort()
            self._reraise(exc)
        self._started = time.perf_counter()
        log.debug(
            "transaction for %s (%s): staging directory %s",
            self.shown,
            self.strategy,
            store.url(self.staging),
        )
        return self

    def commit(
        self, manifest: bytes | bytearray | None, *, durable: Sequence[Callable[[], None]] = ()
    ) -> str:
        """Write ``manifest`` as ``manifest.json`` (create-only, last), publish, and return the
        directory that now holds the checkpoint (the target, or its new generation).

        A ``bytearray`` is written as it is, not copied first (a manifest of a million tensors
        is about 220 MB): every store's ``put`` takes any buffer (a view of it, or its copy).

        ``durable``: functions that wait until the staged files are durable (their fsyncs
        running on other threads, see ``pipeline.write_file(finishing=)``); each is called
        before anything is published: with the rename strategy after the manifest is written
        (so the fsyncs overlap), with generations before (the manifest is the commit point)."""
        assert self._begun and self.committed is None, "commit once, after begin"
        store = self.store
        waits = list(durable)
        try:
            data = None if manifest is None else cast(bytes, manifest)
            manifest_path = store.join(self.staging, mf.NAME)
            if self.strategy == "rename":
                if data is not None:
                    waits.extend(_write_staged_manifest(store, manifest_path, data))
                if waits:
                    # The staging directory's entries are all made: sync it while the files'
                    # fsyncs may still run, then wait for those.
                    store.sync_dir(self.staging)
                    for wait in waits:
                        wait()
                _rename.publish(store, self.staging, self.target, synced=bool(waits))
                self.committed = self.target
                log.debug(
                    "committed %s: staging fsynced, renamed into place, parent fsynced",
                    self.shown,
                )
                # A replace that died between its two renames left "-old-" behind; it is stale
                # now that the target holds a checkpoint (no listing when there was none).
                if self._kept_old:
                    with contextlib.suppress(OSError):
                        _rename.clean_stale(store, self.target)
            else:
                for wait in waits:
                    wait()
                if data is not None:
                    store.sync_dir(self.staging)
                    log.debug("synced %s", store.url(self.staging))
                    store.put(manifest_path, data, exclusive=True)
                    log.debug(
                        "wrote %s (%d bytes): the commit point", store.url(manifest_path), len(data)
                    )
                store.sync_dir(self.staging)
                _generations.switch(store, self.target)
                self.committed = self.staging
                log.debug("committed %s as generation %s", self.shown, store.url(self.staging))
                _generations.tidy(store, self.staging, self.target)
        except BaseException as exc:
            for wait in waits:  # no thread outlives a failed commit
                with contextlib.suppress(BaseException):
                    wait()
            self.abort()
            self._reraise(exc)
        log.debug(
            "transaction for %s done in %.3f s",
            self.shown,
            time.perf_counter() - self._started,
        )
        return self.target if self.strategy == "rename" else self.staging

    def abort(self) -> None:
        """Remove the staging directory, and a target directory this transaction created
        (never raises); a committed transaction keeps everything."""
        if self.committed is None and self.staging:
            log.debug(
                "aborting the transaction for %s: removing %s",
                self.shown,
                self.store.url(self.staging),
            )
            with contextlib.suppress(OSError):
                self.store.remove_tree(self.staging)
                if self._made_target and not self.store.list(self.target):
                    self.store.remove_tree(self.target)

    def _reraise(self, exc: BaseException) -> None:
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise write_error(self.store, self.target, exc, self.what) from exc
        raise exc

    def __enter__(self) -> Transaction:
        return self.begin()

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if self.committed is None:
            self.abort()
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise write_error(self.store, self.target, exc, self.what) from exc


def check_target(store: Store, target: str, what: str = "checkpoint") -> None:
    """Refuse a target that is not absent, an empty directory or a committed checkpoint (in
    either layout): a save never replaces anything else."""
    st = store.stat(target)
    if st is None:
        return
    shown = store.url(target)
    if st.kind == "link":
        st = store.stat(store.realpath(target))
    if st is None or st.kind != "dir":
        raise CheckpointWriteError(
            f"{shown} exists and is not a directory; refusing to replace it", path=shown
        )
    if (
        _rename.has_manifest(store, target)
        or not store.list(target)
        or _generations.only_generations(store, target)
        or _generations.newest(store, target) is not None
    ):
        return
    raise CheckpointWriteError(
        f"{shown} is a non-empty directory that is not a savepoint {what}; refusing to "
        "replace it (choose another path or remove it)",
        path=shown,
    )


def write_error(
    store: Store, target: str, exc: OSError, what: str = "checkpoint"
) -> CheckpointWriteError:
    """The CheckpointWriteError for an OSError met while saving ``target``."""
    shown = store.url(target)
    # The OSError's own text first: an object store's names the request and its cause.
    where = exc.filename
    if isinstance(where, str) and where.startswith("/"):
        where = store.url(where)  # the store's path as the user names it (a URL off the disk)
    return errors_map.write_error(
        exc,
        shown,
        f"saving {shown} failed",
        where=where if isinstance(where, str) and where else shown,
        tail=f"; any previous {what} there is intact and no temporary files remain",
        scheme=store.scheme,
    )


def refused_hint(store: Store) -> str:
    """What to check when ``store`` refused a write (EACCES): on the local filesystem the
    permissions of the directory; on any other store (an object store answering 403 AccessDenied
    or 401, a remote filesystem) the credentials and the access policy, which no local
    permission bit decides."""
    return errors_map.write_hint(PermissionError(), scheme=store.scheme)


def _write_staged_manifest(store: Store, path: str, data: bytes) -> list[Callable[[], None]]:
    """Write ``manifest.json`` into a staging directory (create-only). On a local disk the
    staging directory is private, so it goes straight to its name and its fsync starts on the
    finishing pool: returned is the function that waits for it (a failed fsync removes the
    file; the caller aborts the staging). Elsewhere it is put, synced, and nothing returned."""
    if not store.capabilities.direct_io:
        store.put(path, data, exclusive=True)
        log.debug("wrote and fsynced %s (%d bytes)", store.url(path), len(data))
        return []
    blob = store.create_blob(path, size=len(data), direct=False)
    try:
        blob.write(memoryview(data))
    except BaseException:
        blob.abort()
        raise
    wait = finishing.finish_later(blob)

    def synced() -> None:
        wait()
        log.debug("wrote and fsynced %s (%d bytes)", store.url(path), len(data))

    return [synced]


def resolve(store: Store, path: str, *, strict: bool = True) -> str | None:
    """The directory holding the committed checkpoint for ``path``, or None.

    In order: ``path`` itself when it holds a manifest; else its newest generation holding one
    (manifest-last layout); else, when nothing at all is at ``path``, the previous checkpoint a
    fallback replace left under an ``-old-`` name when it died between its two renames; else,
    when ``path`` is an alias pointer (:mod:`savepoint.commit.pointer`: run aliases on stores
    without hard links), the committed checkpoint it names, found by the same rules.

    None means nothing committed is there: every lookup answered. A lookup that fails (an I/O
    error, a failed request, a refused one) is never taken as "nothing there": it raises a
    CheckpointError (CheckpointPermissionError for a refusal) naming what could not be looked
    at, so that no caller records, publishes or deletes by a partial view.

    A damaged pointer (its object is not a pointer, or names a path holding no committed
    checkpoint) raises CorruptCheckpointError naming the pointer and what is wrong, instead of
    reading as a directory without a manifest; with ``strict=False`` it reads as no checkpoint
    (for the run's bookkeeping, which republishes or skips such an alias)."""
    path = store.abspath(path)
    try:
        return _resolve(store, path, strict)
    except CheckpointError:
        raise
    except PermissionError as exc:
        raise local.permission_error(exc, store.url(path)) from exc
    except OSError as exc:
        shown = store.url(path)
        raise CheckpointError(
            f"cannot look at {shown} ({exc}); a failed lookup is not taken as absent: try again "
            "once the store answers",
            path=shown,
        ) from exc


def _resolve(store: Store, path: str, strict: bool) -> str | None:
    found = _committed(store, path)
    if found is not None:
        return found
    if not strict:
        pointed = pointer.target(store, path)
        return None if pointed is None else _committed(store, pointed)
    return _follow(store, path)


# Looks at a pointer whose target holds no checkpoint before calling it damaged: a run's writer
# moves an alias on before it deletes the step the alias named, so a second look finds the new one.
_POINTER_LOOKS = 3


def _follow(store: Store, alias: str) -> str | None:
    """The committed checkpoint the pointer at ``alias`` names; None where there is no pointer;
    CorruptCheckpointError where the pointer is damaged."""
    named = None
    for _ in range(_POINTER_LOOKS):
        try:
            pointed = pointer.read(store, alias)
        except pointer.Damaged as exc:
            raise _damaged(store, alias, str(exc)) from None
        if pointed is None:
            return None
        found = _committed(store, pointed)
        if found is not None:
            return found
        if pointed == named:
            break
        named = pointed
    assert named is not None
    raise _damaged(
        store,
        alias,
        f"{store.url(store.join(alias, pointer.NAME))} names {store.url(named)}, which holds no "
        "committed checkpoint (deleted, or never committed)",
    )


def _damaged(store: Store, alias: str, reason: str) -> CorruptCheckpointError:
    shown = store.url(alias)
    return CorruptCheckpointError(
        f"{shown} is a damaged alias pointer: {reason}. Load one of the run's checkpoints (under "
        "its checkpoints/ directory) instead, or open the run with a CheckpointManager (not "
        "read_only), which rewrites its aliases",
        path=shown,
    )


def _committed(store: Store, path: str) -> str | None:
    """:func:`resolve` without following an alias pointer (raises the store's OSError)."""
    if _rename.has_manifest(store, path):
        return path
    st = store.stat(path)
    if st is not None:
        return _generations.newest(store, path)
    return _rename.old_copy(store, path)


def discard(store: Store, path: str) -> None:
    """Delete the committed checkpoint at ``path`` (absent is fine) so that no crash can leave
    it half-deleted: renamed away first where the store renames, manifests first elsewhere."""
    path = store.abspath(path)
    if store.capabilities.atomic_rename:
        _rename.discard(store, path)
    elif store.stat(path) is not None:
        _generations.discard(store, path)
