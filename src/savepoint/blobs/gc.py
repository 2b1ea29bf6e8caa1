"""Saves in flight and garbage collection: deleting unreferenced blobs without ever deleting one
that a checkpoint (committed or being saved) needs.

The protocol (two kinds of records, each written before the other kind is read):

**A save** runs inside a :class:`SaveSession`:

1. ``begin``: put ``sessions/<id>.json`` (create-only), then list ``gc/``. A live collection
   there (its record younger than ``gc_stale_after`` by the store's own clock) makes the save
   wait until it is gone; a stale one (its collector died) is removed and ignored. What is no
   collection's record (junk, a JSON list, a FIFO, a directory: every record a collector puts
   is a JSON object, whole when visible) is ignored with a warning; the next
   collection removes it. Where a put may be seen half done (fsspec filesystems), text that
   may be the beginning of a record counts as one. (Elsewhere a record is seen half written
   only while a create-only put writes it in place, where hard links are missing: ignoring it
   then is safe, since its collection has not listed ``sessions/`` yet and will see this
   save's record.)
2. Put blobs (written or found there already: either way the session remembers the digest), and
   refresh the session record (an overwrite: a new ``mtime``) at least every
   ``refresh_every`` seconds, so that no collector takes a slow save for a dead one.
3. ``sync`` the blob names, ``check`` that the record is still there, commit the manifest (the
   engine's job), then ``close``: the record is removed.

**A collection** (:func:`collect`):

1. Put ``gc/<id>.json`` (create-only); its ``mtime`` is "now" on the store's clock.
2. List ``sessions/``. A live session other than the caller's own makes the collection stop at
   once (``deferred``, nothing deleted): that save may be about to commit a manifest naming any
   blob that exists. Stale session records (older than ``session_stale_after``) are removed.
3. Only now ask for the referenced digests (``referenced()``: the blobs named by every committed
   manifest that is kept; the caller's own session's digests are added). Asking after step 2
   matters: a save that committed before step 2 is in it; a save that begins after step 1 waits.
4. List ``data/``; delete every blob not referenced and older than ``grace`` (by the store's
   clock), and leftover temporaries older than ``grace``. Between batches the gc record is
   refreshed; if it has vanished (a save took the collector for dead) the collection stops.
5. Remove the gc record.

Why nothing needed is deleted: a save and a collection each write their own record before reading
the other's, so (on a store whose listings see completed puts: local disks, memory, S3, GCS and
Azure today) at least one of them sees the other. If the collection sees the save, it deletes
nothing. If it does not, the save's record came after the collection's listing, so the save sees
the collection's record and waits until the collection is over before it checks any blob's
existence: it writes again whatever was deleted. Committed checkpoints are protected by step 3.

Why a crash leaves only garbage: a collection deletes blobs only; a crash between deletions
leaves unreferenced blobs, which the next collection deletes. A save that crashes leaves its
blobs and its session record: the record holds collections back (``deferred``) until it is stale
(``session_stale_after``, 1 hour by default), then its blobs are collected like any unreferenced
ones. Retention must delete a checkpoint (its manifest) *before* collecting its blobs, never the
reverse: then a crash at any point leaves every retained checkpoint whole.

``grace`` (15 minutes by default) protects, in addition, blobs written by writers that do not
take part in the protocol (another tool, an older savepoint); a run that holds its writer lock
and saves only through sessions may pass ``grace=0``.

Clocks: every age is the difference of two ``mtime`` values reported by the store (a record just
put and the record or blob judged), never the local clock, so hosts with skewed clocks agree.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from savepoint.blobs import digest as _digest
from savepoint.blobs.store import GC, SESSIONS, TMP, BlobStore, PutResult, PutStats, Recipe
from savepoint.codecs import bounded_json
from savepoint.commit import names
from savepoint.errors import CheckpointError, CheckpointWriteError, CorruptCheckpointError

if TYPE_CHECKING:
    from savepoint.blobs.frame import Compression
    from savepoint.storage.base import Stat, Store

__all__ = [
    "BlobGcReport",
    "SaveSession",
    "clear_dead_records",
    "collect",
]

SESSION_STALE_AFTER = 3600.0
GC_STALE_AFTER = 600.0
REFRESH_EVERY = 60.0
DEFAULT_GRACE = 900.0
_RECORD_CAP = 64 << 10

log = logging.getLogger(__name__)


def _record(kind: str) -> bytes:
    body = {
        "kind": kind,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),  # for people reading it; ages use the store's mtime
    }
    return (json.dumps(body) + "\n").encode()


def _write_error(blobs: BlobStore, what: str, exc: OSError) -> CheckpointError:
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointWriteError(f"{what} ({blobs.url()}): {exc}", path=blobs.url(), errno=exc.errno)


class SaveSession:
    """A save in flight on a :class:`BlobStore` (see the module docstring). Use as a context
    manager, or ``begin()`` ... ``close()``.

    ``wait``: how long ``begin`` waits for a running collection before it gives up
    (CheckpointWriteError); by default a little longer than ``gc_stale_after``, so that the
    record of a collector that died (on another host: the manager removes those of dead local
    processes) turns stale and is removed while the save waits, instead of failing it. The put methods are those of the store, and remember every digest
    they name in :attr:`referenced`; :attr:`stats` totals them."""

    def __init__(
        self,
        blobs: BlobStore,
        *,
        wait: float | None = None,
        refresh_every: float = REFRESH_EVERY,
        gc_stale_after: float = GC_STALE_AFTER,
        poll: float = 0.05,
    ) -> None:
        self.blobs = blobs
        self.id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:12]}"
        self.path = blobs.store.join(blobs.root, SESSIONS, f"{self.id}.json")
        self.referenced: set[str] = set()
        self.stats = PutStats()
        self._wait = gc_stale_after + 30.0 if wait is None else wait
        self._refresh_every = refresh_every
        self._gc_stale_after = gc_stale_after
        self._poll = poll
        self._refreshed = 0.0
        self._lock = threading.Lock()
        self._open = False
        self._records: set[str] = set()  # names under gc/ read and found to be records
        self._not_records: set[str] = set()  # ... and found to be no record (warned once)

    # -- life cycle ----------------------------------------------------------------------------

    def begin(self) -> SaveSession:
        store = self.blobs.store
        try:
            store.put(self.path, _record("save"), exclusive=True)
        except OSError as exc:
            raise _write_error(self.blobs, "cannot register the save", exc) from exc
        self._open = True
        self._refreshed = time.monotonic()
        try:
            self._wait_for_collections()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_for_collections(self) -> None:
        deadline = time.monotonic() + self._wait
        delay = self._poll
        while True:
            try:
                live = self._live_collections()
            except OSError as exc:
                raise _write_error(
                    self.blobs, "cannot check for a running blob collection", exc
                ) from exc
            if not live:
                return
            if time.monotonic() >= deadline:
                raise CheckpointWriteError(
                    f"a blob collection is running on {self.blobs.url()} ({', '.join(live)}) "
                    f"and did not finish within {self._wait:g} s; the save did not start. "
                    "Try again, or remove a collector's record under gc/ if its process is gone.",
                    path=self.blobs.url(),
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            self._refresh(force=True)  # stay young while waiting

    def _live_collections(self) -> list[str]:
        """The records under ``gc/`` of collections that may be running: young ones (by the
        store's clock, against this session's own record) that are records. A stale record is
        removed (its collector died or hung); an entry that is no collection's record (junk, a
        list, a FIFO, a directory) is ignored with a warning, and :func:`collect` removes it."""
        store = self.blobs.store
        gc_dir = store.join(self.blobs.root, GC)
        mine = store.stat(self.path)
        now = mine.mtime if mine is not None else 0.0
        live = []
        for name in store.list(gc_dir):
            path = store.join(gc_dir, name)
            if name in self._not_records:
                continue
            st = store.stat(path)
            if st is None:
                continue
            if name not in self._records:
                # Read once per name. A record being put (a temporary of a local put) counts
                # as one, by its age.
                if names.TMP_TAG not in name and not _is_record(self.blobs, path, st):
                    self._not_records.add(name)
                    log.warning(
                        "%s is not a blob collection's record (junk, not a JSON record, or "
                        "not a file): the save ignores it; the next blob collection removes it",
                        self.blobs.url(path),
                    )
                    continue
                self._records.add(name)
            if now - st.mtime > self._gc_stale_after:
                try:  # a dead collector's record; removing it also stops a hung one
                    store.remove(path)
                except FileNotFoundError:
                    pass
                continue
            live.append(name)
        return live

    def _refresh(self, *, force: bool = False) -> None:
        if not self._open:
            raise ValueError("the save session is closed")
        now = time.monotonic()
        if not force and now - self._refreshed < self._refresh_every:
            return
        with self._lock:
            if not force and now - self._refreshed < self._refresh_every:
                return
            try:
                self.blobs.store.put(self.path, _record("save"), exclusive=False)
            except OSError as exc:
                raise _write_error(self.blobs, "cannot refresh the save's record", exc) from exc
            self._refreshed = now

    def check(self) -> None:
        """CheckpointWriteError if this session's record is gone (a collector judged it stale:
        blobs it named may have been deleted); call just before committing a manifest. A
        failure to look is CheckpointWriteError too: the save cannot know it is safe."""
        try:
            mine = self.blobs.store.stat(self.path)
        except OSError as exc:
            raise _write_error(self.blobs, "cannot check the save's record", exc) from exc
        if mine is None:
            raise CheckpointWriteError(
                f"the save's record {self.blobs.url(self.path)} vanished (the save took longer "
                "than session_stale_after without refreshing); blobs it relies on may be gone: "
                "save again",
                path=self.blobs.url(self.path),
            )
        self._refresh()

    def sync(self) -> None:
        """Make every blob name written so far durable (before the manifest commits)."""
        self.blobs.sync()

    def close(self) -> None:
        """End the session (after the manifest committed, or after the save failed)."""
        if not self._open:
            return
        self._open = False
        try:
            self.blobs.store.remove(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            # Not a failure of the save (its manifest may be committed by now, and an error
            # here would hide the one that ended a failed save): a record left behind holds
            # collections back until it is stale (session_stale_after).
            log.warning(
                "cannot remove the save's record %s (%s); blob collections wait until it is "
                "stale, or until it is removed",
                self.blobs.url(self.path),
                exc,
            )

    def __enter__(self) -> SaveSession:
        if not self._open:
            self.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- puts ------------------------------------------------------------------------------------

    def _remember(self, result: PutResult) -> None:
        with self._lock:
            self.referenced.add(result.digest)

    def put(
        self,
        data: Any,
        *,
        compression: Compression | None = None,
        itemsize: int | None = None,
        digest: str | None = None,
    ) -> PutResult:
        self._refresh()
        result = self.blobs.put(
            data, compression=compression, itemsize=itemsize, digest=digest, stats=self.stats
        )
        self._remember(result)
        return result

    def put_chunked(
        self,
        data: Any,
        *,
        chunk_size: int | None = None,
        compression: Compression | None = None,
        itemsize: int | None = None,
        workers: int = 1,
        memo: _digest.FastMemo | None = None,
        keys: Sequence[tuple[int, int]] | None = None,
    ) -> Recipe:
        from savepoint.blobs.store import DEFAULT_CHUNK

        self._refresh()

        def seen(result: PutResult) -> None:
            self._remember(result)
            self._refresh()

        return self.blobs.put_chunked(
            data,
            chunk_size=chunk_size or DEFAULT_CHUNK,
            compression=compression,
            itemsize=itemsize,
            workers=workers,
            memo=memo,
            stats=self.stats,
            on_put=seen,
            keys=keys,
        )

    def reuse(self, digests: Iterable[str]) -> None:
        """Name blobs this save refers to without putting them (a recipe copied from the previous
        checkpoint for a tensor known unchanged): a collection run by this session keeps them.
        Other processes' collections are held back by the session record anyway."""
        with self._lock:
            self.referenced.update(digests)

    def reuse_existing(self, digests: Iterable[str]) -> bool:
        """:meth:`reuse` the blobs ``digests`` if every one is in the store (one existence check
        each, as a put of content already there makes); False, naming none, if any is missing
        (deleted since: the caller writes its content again). Safe against collections for the
        same reason puts are: this session's record was written before the checks."""
        names = list(dict.fromkeys(digests))
        self._refresh()
        if not all(self.blobs.exists(d) for d in names):
            return False
        self.reuse(names)
        return True

    def collect(
        self, referenced: Callable[[], Iterable[str]] | Iterable[str], **kwargs: Any
    ) -> BlobGcReport:
        """:func:`collect` run by this save (retention after its commit): this session's own
        record does not hold the collection back, and its digests are kept."""
        return collect(self.blobs, referenced, session=self, **kwargs)


@dataclass
class BlobGcReport:
    """What a collection did. ``deferred``: it stopped before deleting anything because saves
    were in flight (``live_sessions``); ``aborted``: it stopped part-way (its record vanished).
    ``kept_young``: unreferenced blobs younger than ``grace``, left for a later collection."""

    deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    temporaries_removed: int = 0
    kept_referenced: int = 0
    kept_young: int = 0
    stale_sessions_removed: int = 0
    junk_removed: int = 0
    live_sessions: list[str] = field(default_factory=list)
    deferred: bool = False
    aborted: bool = False
    dry_run: bool = False


def collect(
    blobs: BlobStore,
    referenced: Callable[[], Iterable[str]] | Iterable[str],
    *,
    grace: float = DEFAULT_GRACE,
    session: SaveSession | None = None,
    session_stale_after: float = SESSION_STALE_AFTER,
    dry_run: bool = False,
    refresh_every: float = 10.0,
) -> BlobGcReport:
    """Delete the blobs of ``blobs`` that ``referenced`` does not name (see the module docstring
    for the protocol). ``referenced``: a callable, called once no save is in flight, returning
    the digests of every kept checkpoint (preferred: it is then computed at the right moment),
    or those digests themselves (the caller computed them after every save it knows of
    committed). ``dry_run``: report what would be deleted, delete nothing."""
    store = blobs.store
    report = BlobGcReport(dry_run=dry_run)
    gc_path = store.join(blobs.root, GC, f"{uuid.uuid4().hex}.json")
    try:
        store.put(gc_path, _record("gc"), exclusive=True)
    except OSError as exc:
        raise _write_error(blobs, "cannot register the collection", exc) from exc
    keeper = _RecordKeeper(store, gc_path, refresh_every)
    try:
        if not dry_run:
            _drop_junk(blobs, report)
        mine = store.stat(gc_path)
        now = mine.mtime if mine is not None else time.time()
        sessions_dir = store.join(blobs.root, SESSIONS)
        for name in store.list(sessions_dir):
            path = store.join(sessions_dir, name)
            if session is not None and path == session.path:
                continue
            st = store.stat(path)
            if st is None:
                continue
            if now - st.mtime > session_stale_after:
                if not dry_run:
                    try:
                        store.remove(path)
                    except FileNotFoundError:
                        pass
                report.stale_sessions_removed += 1
                continue
            report.live_sessions.append(name.removesuffix(".json"))
        if report.live_sessions:
            report.deferred = True
            return report

        # From here the record is kept young by a thread (reading every kept manifest may take
        # long on an object store): a save that found it stale would have removed it and gone
        # on reusing blobs. Its absence, checked before every deletion that follows a pause
        # (this process frozen, say), stops the collection.
        keeper.start()
        keep = set(referenced() if callable(referenced) else referenced)
        if session is not None:
            with session._lock:
                keep |= session.referenced
        if not keeper.alive(force=True):
            report.aborted = True
            return report
        now = keeper.mtime or now
        for name, path in list(blobs.entries()):
            if not keeper.alive():
                report.aborted = True
                return report
            temporary = TMP in name
            if not temporary:
                if not _digest.is_digest(blobs.algorithm, name):
                    continue  # not ours: never touched
                if name in keep:
                    report.kept_referenced += 1
                    continue
            st = store.stat(path)
            if st is None or st.kind != "file":
                continue
            if now - st.mtime < grace:
                report.kept_young += 1
                continue
            if not dry_run:
                try:
                    store.remove(path)
                except FileNotFoundError:
                    continue
            if temporary:
                report.temporaries_removed += 1
            else:
                report.deleted.append(name)
                report.bytes_freed += st.size
        if not dry_run and report.deleted:
            for fan in {d[:2] for d in report.deleted}:
                store.sync_dir(store.join(blobs.data_root, fan))
        return report
    except OSError as exc:
        raise _write_error(blobs, "blob collection failed", exc) from exc
    finally:
        keeper.stop()
        try:
            store.remove(gc_path)
        except (FileNotFoundError, OSError):
            pass


class _RecordKeeper:
    """Keeps a collection's record young from a thread, every ``every`` seconds, and says
    whether it is still there: a record found gone is never put back (a save removed it as
    stale and went on). ``alive()`` is checked before each deletion: it costs a stat only when
    the last refresh is older than ``every`` (the thread fell behind: the process was paused),
    or with ``force``."""

    def __init__(self, store: Store, path: str, every: float) -> None:
        self.store, self.path, self.every = store, path, every
        self.mtime: float | None = None  # the store's time of the last refresh
        self._last = time.monotonic()
        self._gone = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="savepoint-blob-gc-record", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.refresh()
            except OSError:
                pass  # a failed refresh: alive() stats the record itself when it is late

    def refresh(self) -> None:
        with self._lock:
            if self._gone or self._stop.is_set():
                return
            if self.store.stat(self.path) is None:
                self._gone = True
                return
            self.store.put(self.path, _record("gc"), exclusive=False)
            st = self.store.stat(self.path)
            self.mtime = st.mtime if st is not None else self.mtime
            self._last = time.monotonic()

    def alive(self, *, force: bool = False) -> bool:
        with self._lock:
            if self._gone:
                return False
            late = time.monotonic() - self._last > 2 * self.every
        if force or late:
            self.refresh()
        with self._lock:
            return not self._gone

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._gone = True  # never put back once the collection is over


def _is_record(blobs: BlobStore, path: str, st: Stat) -> bool:
    """Whether ``path`` (``st`` its stat) may hold a record as :func:`_record` writes one: a
    file holding a JSON object. One that cannot be read (refused, a failed request) counts as a
    record: nothing is known against it; so does, on a store where a put may be seen half done
    (fsspec filesystems), text that may be the beginning of one."""
    if st.kind != "file":
        return False
    store = blobs.store
    try:
        raw = store.read_small(path, cap=_RECORD_CAP)
    except FileNotFoundError:
        return True  # gone meanwhile: its age (already looked up) decides, as for any record
    except CorruptCheckpointError:  # over the cap, not a regular file
        return False
    except (OSError, CheckpointError):
        return True
    try:
        doc = bounded_json.loads(raw, CorruptCheckpointError, store.url(path))
    except CorruptCheckpointError:
        return raw[:1] in (b"", b"{") and not blobs._whole_when_visible
    return isinstance(doc, dict)


def _drop_junk(blobs: BlobStore, report: BlobGcReport) -> None:
    """Remove what lies under ``gc/`` and is no collection's record (junk, a list, a FIFO, a
    directory: saves ignore those), best effort."""
    store = blobs.store
    gc_dir = store.join(blobs.root, GC)
    for name in store.list(gc_dir):
        path = store.join(gc_dir, name)
        if names.TMP_TAG in name:
            continue  # a record being put, or a dead put's (clear_dead_records)
        st = store.stat(path)
        if st is None or _is_record(blobs, path, st):
            continue
        try:
            if st.kind == "dir":
                store.remove_tree(path)
            else:
                store.remove(path)
        except OSError as exc:
            log.warning("cannot remove %s (not a collection's record): %s", blobs.url(path), exc)
            continue
        log.warning("removed %s: not a blob collection's record", blobs.url(path))
        report.junk_removed += 1


def clear_dead_records(blobs: BlobStore) -> int:
    """Remove the records of saves and collections in flight (``sessions/``, ``gc/``) that
    processes of this host left when they died (a SIGKILLed save, say): each names its host
    and pid (in its body, or in the name of a temporary a put left), and one whose pid no
    longer runs here is stale at once, by the rule of a run's lease lock
    (:func:`savepoint.storage.lease.pid_gone`). Left in place, a save's would hold every
    collection back for ``session_stale_after`` (an hour), a collection's would make the next
    save wait. Records of other hosts are left to those timeouts. For a store's writer (a run's
    manager, a tier's copier); returns how many were removed; OSError propagates."""
    from savepoint.storage.lease import pid_gone

    store, here = blobs.store, socket.gethostname()
    removed = 0
    for sub in (SESSIONS, GC):
        folder = store.join(blobs.root, sub)
        for name in store.list(folder):
            path = store.join(folder, name)
            if names.TMP_TAG in name:
                # A record being put (local disks write it aside, then rename it): the name
                # says whose. Collections count it as a record too.
                if names.dead_here(name.split(names.TMP_TAG, 1)[1]):
                    try:
                        store.remove(path)
                    except FileNotFoundError:
                        continue
                    removed += 1
                continue
            try:
                raw = store.read_small(path, cap=_RECORD_CAP)
                doc = bounded_json.loads(raw, CorruptCheckpointError, blobs.url(path))
            except (FileNotFoundError, ValueError, CheckpointError):
                continue  # gone, not a record, or not readable: left alone
            pid = doc.get("pid") if isinstance(doc, dict) else None
            if type(pid) is not int or doc.get("host") != here or not pid_gone(pid):
                continue
            try:
                store.remove(path)
            except FileNotFoundError:
                continue
            removed += 1
    return removed
