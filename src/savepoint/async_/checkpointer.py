"""``AsyncCheckpointer``: save in the background, one write in flight, errors never lost.

What blocks the caller in ``save()``: calling ``state_dict()`` on Stateful objects and copying
every tensor into the staging arena, laid out as the files to be written (a parallel memcpy for a
CPU state; for CUDA tensors only the queueing of non-blocking copies, see
:mod:`savepoint.async_.staging`). What runs in the background
(:func:`savepoint.engine.save.save_staged`): checksums, the writes straight from the arena
(O_DIRECT on local disks; ``writers`` files at once), fsync, the atomic commit, then an optional
``on_commit`` callback. When
``save()`` returns, training may modify the state freely: what gets saved is the state at that
moment. The arena is reused by every save, so async saving holds one staging copy, no more.

An incremental save (``save(..., blobs=, blob_policy=)``, as ``sp.save``'s; what
``CheckpointManager(incremental=True, async_save=True)`` does) is staged the same way; in the
background the tensors the policy wants go from the arena to the blob store inside a save
session (unchanged chunks are not written again), the others into data files, and the manifest
commits after the session's ``sync`` and ``check``. ``on_commit`` runs once the session is
closed (the manager's retention and blob collection: they never overlap its own session).

One save is in flight at a time. A ``save()`` while the previous one is still writing follows
``on_busy``: ``"wait"`` (the default) blocks until it is committed; ``"skip"`` returns a skipped
``PendingSave`` and warns. A background failure is raised once, to the caller, by the next
``save()``, ``wait()`` or ``close()`` (its ``PendingSave.wait()`` raises it too), always as a
CheckpointError: an OSError (a full disk) as a CheckpointWriteError carrying its ``errno``. At
interpreter exit a pending save is finished; if it fails, the error is printed to stderr.

``save_boostr(path, model, optimizer, state)`` writes the boostr single layout instead
(``model.safetensors`` + ``optimizer.safetensors`` + ``training_state.json``, as
``savepoint.formats.boostr.save``), under exactly the same rules: the seed's async writer writes
boostr files. It is a separate method rather than a ``format=`` option because the two take
different arguments (a state tree and a JSON metadata mapping, against two flat tensor maps and a
``TrainingState``) and resolve to different descriptions (a manifest's and a boostr directory's); one
checkpointer can interleave both kinds of save, one in flight at a time.

``save_distributed(path, model, optimizer, state, strategy=..., process_group=...)`` is the seed's
``AsyncCheckpointer::save_distributed``: every rank snapshots its own part, then in the background
writes its ``rank_{r}/`` of the distributed boostr layout and rank 0 commits ``sharding_meta.json``
(``savepoint.formats.boostr.save_distributed``'s process-group form, split by
``boostr.prepare_distributed``). The seed passes ``rank`` and ``world_size``; here they are the
group's. (Sharded checkpoints in savepoint's own format are ``save(path, state)`` with a
checkpointer made with ``process_group=``: that is savepoint's native async per-rank write. With
``writer="process"`` each rank copies its part into the shared staging arena in ``save()``; in
the background its thread runs the collectives and its writer process writes its pieces,
:meth:`savepoint.async_.process.ProcessWriter.stage_sharded`.)

``writer="process"`` hashes, writes and commits in a separate writer process
(:mod:`savepoint.async_.process`) instead of a thread of this one (``writer="thread"``):
the training loop keeps the GIL and its cores; a save handed over commits even if this
process is then killed (not a sharded one: see below). Plain, incremental and CUDA saves,
to local paths and to stores named by a URL (``s3://``, ``gs://``, ``az://``, fsspec's),
which the writer process makes again from the URL and the environment it inherits
(:mod:`savepoint.async_._place`); ``memory://``, stores made by hand and ``memo=``/
``tracker=`` objects are refused in ``save()`` with an UnsupportedStorageError (a
ValueError; a ValueError for ``memo=``/``tracker=``); ``save_boostr`` and
``save_distributed`` too (:mod:`savepoint.async_._boostr`); ``progress`` is called as the
writer reports. The default, ``writer=None``, is the writer process, with the thread
writer for each save the writer process refuses (silently: ``writer`` reads
``"process"``, ``fallback`` True; the choice is measured in ``docs/performance.md``). With
``process_group`` too, the save's collectives (plan, records, commit) stay in this process's
background thread, and the writer process writes this rank's pieces from the shared arena: the
commit needs every rank's records through the group, so a sharded save does not outlive its
trainer.

``writer_priority`` (the writer process only; checked, then ignored by the thread writer): the
writer process's CPU and I/O priority, ``"low"`` (the default: niced 10, the lowest best-effort
I/O level), ``"idle"`` (``SCHED_IDLE`` and the idle I/O class: it runs only on cores nothing
else wants) or ``"normal"`` (the trainer's); None takes ``SAVEPOINT_WRITER_PRIORITY`` from the
environment, else the default. A lower priority costs a save time to durable only while
something else keeps every core busy (:mod:`savepoint.async_._priority`,
``docs/performance.md``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from savepoint import info
from savepoint.async_ import _boostr, _place, _priority
from savepoint.async_._priority import Priority as WriterPriority
from savepoint.async_._wire import reported as _reported
from savepoint.async_.pending import PendingSave
from savepoint.async_.process import ProcessWriter
from savepoint.async_.staging import StagingArena, staged_sources
from savepoint.engine import save as save_engine
from savepoint.engine import sinks
from savepoint.engine.describe import describe
from savepoint.errors import CheckpointWriteError, UnsupportedStateError, UnsupportedStorageError
from savepoint.formats import boostr
from savepoint.options import Progress, SaveOptions
from savepoint.state import tree
from savepoint.storage.paths import Location, PathArg, local_path
from savepoint.storage.paths import resolve as resolve_path

log = logging.getLogger(__name__)

__all__ = [
    "AsyncCheckpointer",
    "OnBusy",
    "Writer",
    "WriterPriority",
    "check_writer",
    "check_writer_priority",
    "verify_in",
]

check_writer_priority = _priority.check  # ``writer_priority=`` checked (CheckpointManager's too)
check_writer = _priority.check_writer  # ``writer=`` checked (CheckpointManager's too)
OnBusy = Literal["wait", "skip"]
Writer = Literal["thread", "process"]
_LIVE: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()
# Strong references while a save is in flight or its failure is unreported, so that dropping the
# last reference to a checkpointer cannot drop an error with it (the exit hook reports it).
_UNFINISHED: set[AsyncCheckpointer] = set()
# The default of each save option keyword: not given (typed Any, so ``int = _UNSET`` checks).
_UNSET: Any = object()


class AsyncCheckpointer:
    """Saves in the background, one at a time (see the module docstring).

    ``max_file_bytes`` splits the data files as ``sp.save`` does; ``writers`` files are written
    at once from the arena; ``direct=False`` asks for buffered writes (plus fsync) even where
    O_DIRECT works; ``progress(done, total)`` is called from the background thread as each save's
    tensor bytes are written; ``process_group`` and ``timeout`` make every save a sharded one
    (every rank calls ``save``). ``options`` (a :class:`~savepoint.options.SaveOptions`) gives
    them all at once; keyword arguments given as well override it. Every option is checked
    here, so a bad one fails at construction, not at the first save.

    ``writer``: who hashes, writes and commits, ``"process"`` (a separate writer process),
    ``"thread"`` (a thread of this one) or None, the default (the writer process, and the thread
    writer for each save it refuses: ``fallback`` is True); ``writer_priority``: the writer
    process's CPU and I/O priority. Both are described in the module docstring."""

    def __init__(
        self,
        *,
        on_busy: OnBusy = "wait",
        max_file_bytes: int = _UNSET,
        direct: bool = _UNSET,
        writers: int = _UNSET,
        progress: Progress | None = _UNSET,
        process_group: Any = _UNSET,
        timeout: float | None = _UNSET,
        options: SaveOptions | None = None,
        writer: Writer | None = None,
        writer_priority: WriterPriority | None = None,
    ) -> None:
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', not {on_busy!r}")
        given = {
            "max_file_bytes": max_file_bytes,
            "direct": direct,
            "writers": writers,
            "progress": progress,
            "process_group": process_group,
            "timeout": timeout,
        }
        # Keyword arguments given explicitly (even with their default value) override
        # ``options``, as in CheckpointManager; every option is checked here, not at a save.
        self.options = SaveOptions.of(
            {k: v for k, v in given.items() if v is not _UNSET}, base=options
        )
        if on_busy == "skip" and self.options.process_group is not None:
            raise ValueError(
                "on_busy='skip' cannot be used with a process group: ranks could disagree about "
                "which saves to skip"
            )
        # Sharded saves (process_group): each rank snapshots its part to host memory, and the
        # background thread runs the two-phase distributed commit (savepoint.distributed.save).
        self.process_group = self.options.process_group
        self.timeout = self.options.timeout
        self.on_busy = on_busy
        self.max_file_bytes = self.options.max_file_bytes
        self.direct = self.options.direct  # False: buffered writes + fsync even with O_DIRECT
        self.writers = self.options.writers  # files written at once (sharded: per rank)
        self.progress = self.options.progress
        self.writer = _writer(writer)
        self.fallback = writer is None  # (the default: the thread writer where it must)
        self.writer_priority = _priority.resolve(writer_priority)
        self._process = ProcessWriter(self.writer_priority) if self.writer == "process" else None
        self._arena = self._process.arena if self._process else StagingArena()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="savepoint-async")
        self._pending: PendingSave | None = None
        self._error: BaseException | None = None  # failed in the background, not yet reported
        self._memo: Any = None  # the FastMemo of incremental saves given none (made at the first)
        self._tracker: Any = None  # and their PatchTracker
        self._lock = threading.Lock()
        # save() from several threads: one stages at a time (they share the arena), in call order.
        self._save_lock = threading.Lock()
        self._closed = False
        self._forked = False
        _LIVE.add(self)

    def save(
        self,
        path: PathArg,
        state: Any,
        *,
        metadata: Mapping[str, Any] | None = None,
        on_commit: Callable[[info.CheckpointInfo], Any] | None = None,
        blobs: Any = None,
        blob_policy: Any = None,
        memo: Any = None,
        tracker: Any = None,
        frozen: Any = None,
    ) -> PendingSave:
        """Snapshot ``state`` now and write it to ``path`` (a local path, a URL: ``file://``,
        ``memory://``, ``s3://``, ..., a ``Location``) in the background.

        ``blobs`` and ``blob_policy``: an incremental save, as ``sp.save(..., blobs=,
        blob_policy=)`` (see ``docs/blobs.md``). The caller is blocked for the staging copy
        only, as for any other save; the background thread runs the blob store's save session
        (puts the chunks, makes them durable, checks the session, commits the manifest) and
        ``on_commit`` after the session is closed. ``memo``: the
        :class:`savepoint.blobs.FastMemo` naming unchanged chunks, and ``tracker``: the
        :class:`savepoint.blobs.patch.PatchTracker` finding changed rows (default: one of each
        per checkpointer, when the policy asks for them). ``frozen``: key prefixes of tensors
        that did not change since the tracker's last save of them (see
        ``CheckpointManager(frozen=)``; still staged, then only sampled). With a process group, every rank
        puts its pieces in the background (a sharded incremental save, written as chunks).

        Thread-safe: concurrent calls run one after another (they share one staging arena)."""
        location = resolve_path(path, what="checkpoint path")
        process = self._process is not None and _reaches(self, location, memo, tracker)
        incremental = None
        if blobs is not None:
            incremental, process = _incremental(
                self, location, blobs, blob_policy, memo, tracker, frozen, process
            )
        elif blob_policy is not None or memo is not None or tracker is not None or frozen:
            raise ValueError("blob_policy, memo, tracker and frozen are given without blobs=")
        with self._save_lock:
            return self._save(
                location.store.url(location.path),
                on_commit,
                lambda: self._native(location, state, metadata, incremental, process),
            )

    def writes_in_process(self, path: PathArg) -> bool:
        """Whether a save to ``path`` (no ``memo=``/``tracker=``) goes to the writer process
        (with ``writer="process"``: always, or refused)."""
        location = resolve_path(path, what="checkpoint path")
        return self._process is not None and _reaches(self, location, None, None)

    def verify_in_process(self, path: PathArg) -> None:
        """A manager's read-back before pruning, in the writer process: :func:`verify_in`."""
        verify_in(self._process, path)

    def save_boostr(
        self,
        path: str | os.PathLike[str],
        model: Mapping[str, Any],
        optimizer: Mapping[str, Any] | None = None,
        state: boostr.TrainingState | None = None,
        *,
        on_commit: Callable[[info.CheckpointInfo], Any] | None = None,
    ) -> PendingSave:
        """Snapshot a boostr checkpoint now and write it to ``path`` in the background, as
        ``savepoint.formats.boostr.save(path, model, optimizer, state)`` would (the seed's
        ``AsyncCheckpointer::save``): the same one-in-flight, ``on_busy`` and error rules as
        :meth:`save`. The blocking part checks ``state`` and copies every tensor into host
        memory owned by the save (a fresh copy per save; with ``writer="process"`` into the
        shared arena, in parallel, and the writer process writes the directory from there); the
        PendingSave resolves to the written checkpoint's description (``CheckpointInfo``). Not
        available with a process group (use :meth:`save_distributed`)."""
        target = os.path.abspath(local_path(path, what="checkpoint path"))
        if self.process_group is not None:
            raise ValueError(
                "save_boostr writes a single boostr checkpoint; with a process group use "
                "AsyncCheckpointer.save_distributed (or, synchronously, "
                "savepoint.formats.boostr.save_distributed(..., process_group=...))"
            )
        process = self._process
        with self._save_lock:
            return self._save(
                target, on_commit, lambda: _boostr_commit(process, target, model, optimizer, state)
            )

    def save_distributed(
        self,
        path: str | os.PathLike[str],
        model: Mapping[str, Any],
        optimizer: Mapping[str, Any] | None = None,
        state: boostr.TrainingState | None = None,
        *,
        strategy: boostr.Strategy = "Replicated",
        stage: int | None = None,
        split_dims: Mapping[str, int] | None = None,
        owned_params: Sequence[str] | None = None,
        process_group: Any = None,
        timeout: float | None = None,
        on_commit: Callable[[boostr.ShardingMeta], Any] | None = None,
    ) -> PendingSave:
        """Snapshot this rank's part of a distributed boostr checkpoint now and write it in the
        background (the seed's ``AsyncCheckpointer::save_distributed``): every rank of the group
        calls it, with its own ``model``, ``optimizer`` and ``state``; in the background each
        rank writes its ``rank_{r}/`` and rank 0 commits ``sharding_meta.json``, exactly as
        ``boostr.save_distributed(path, BoostrCheckpoint(model, optimizer, state),
        process_group=..., strategy=..., ...)`` does (same layout, same checks, atomic: a failure
        on any rank commits nothing and is a DistributedCheckpointError on every rank).

        ``process_group`` and ``timeout`` default to the checkpointer's; one of the two must name
        a group. The blocking part checks every argument and copies the tensors into host memory
        owned by the save (``writer="process"``: into the shared arena, and the writer process
        writes ``rank_{r}/`` while the collectives stay in the background thread, so the save
        does not outlive its trainer); the same one-in-flight, error-reporting and exit rules as
        :meth:`save` apply (``on_busy="skip"`` is refused: ranks could disagree about which saves
        to skip). The PendingSave resolves to the ``ShardingMeta`` that ``boostr.save_distributed``
        returns, which ``on_commit`` receives too."""
        group = self.process_group if process_group is None else process_group
        if group is None:
            raise ValueError(
                "save_distributed writes one rank's part of a distributed checkpoint: give "
                "process_group= (here or to AsyncCheckpointer); to write every rank from one "
                "process use savepoint.formats.boostr.save_distributed(path, [rank0, rank1, ...])"
            )
        if self.on_busy == "skip":
            raise ValueError(
                "on_busy='skip' cannot be used with save_distributed: ranks could disagree about "
                "which saves to skip"
            )
        wait = self.timeout if timeout is None else timeout
        target = os.path.abspath(local_path(path, what="checkpoint path"))
        options: dict[str, Any] = {"strategy": strategy, "stage": stage, "split_dims": split_dims}
        options.update(owned_params=owned_params, process_group=group, timeout=wait)
        # The writer process writes this rank's rank_{r}/ from the arena (async_/_boostr.py).
        prepare: Callable[..., Callable[[], Any]] = boostr.prepare_distributed
        if self._process is not None:
            prepare = functools.partial(_boostr.prepare_distributed, self._process)
        with self._save_lock:
            return self._save(
                target, on_commit, lambda: prepare(target, model, optimizer, state, **options)
            )

    def _save(
        self,
        target: str,
        on_commit: Callable[[Any], Any] | None,
        prepare: Callable[[], Callable[[], Any]],
    ) -> PendingSave:
        """Run ``prepare()`` (the snapshot) now and the function it returns (the commit) in the
        background; ``target`` is how messages name the destination."""
        if self._forked:
            raise RuntimeError(
                "this AsyncCheckpointer belongs to the parent process (it was created before "
                "fork()); create a new one in the child"
            )
        if self._closed:
            raise RuntimeError("this AsyncCheckpointer is closed")
        self._raise_background_error()
        previous = self._pending
        if previous is not None and not previous.done():
            if self.on_busy == "skip":
                warnings.warn(
                    f"skipping the save to {target}: the save to {previous.path} is still writing",
                    stacklevel=3,
                )
                return PendingSave.finished(None, skipped=True)
            previous.exception()  # wait; its error is reported below
            self._raise_background_error()
        pending = PendingSave(target)
        # The snapshot: when prepare() returns, training may change the state.
        started = time.perf_counter()
        commit = prepare()
        blocked = time.perf_counter() - started

        def write() -> None:
            try:
                info = commit()
                if on_commit is not None:
                    on_commit(info)
            except BaseException as exc:
                error = _reported(exc, target)
                with self._lock:
                    self._error = error
                pending.set_exception(error)
                log.warning("async save to %s failed: %s", target, error)
            else:
                with self._lock:
                    if self._error is None:
                        _UNFINISHED.discard(self)
                log.info(
                    "async save to %s: caller blocked %.3f s (snapshot), committed %.3f s after",
                    target,
                    blocked,
                    time.perf_counter() - started,
                )
                pending.set_result(info)

        self._pending = pending
        _UNFINISHED.add(self)
        self._executor.submit(write)
        return pending

    def _native(
        self,
        location: Location,
        state: Any,
        metadata: Mapping[str, Any] | None,
        incremental: _Incremental | None = None,
        process: bool = True,
    ) -> Callable[[], info.CheckpointInfo]:
        meta = save_engine.check_metadata(metadata)
        writer = self._process if process and _started(self) else None
        if self.process_group is not None and writer is not None:
            return writer.stage_sharded(location, state, meta, self.options, incremental)
        if self.process_group is not None:
            from savepoint.distributed import save as distributed_save

            # This rank's part copied into the reused arena, as for the writer process (the
            # previous save is finished, waited for above, so the arena may be overwritten).
            flat = distributed_save.flatten(state)
            staged, frozen = self._arena.snapshot(flat, self.max_file_bytes)
            sharded = None
            if incremental is not None:
                inc = incremental
                sharded = distributed_save.Incremental(inc.blobs, inc.policy, inc.memo, inc.tracker)

            def commit() -> info.CheckpointInfo:
                staged.wait()  # a CUDA state's copies land
                return distributed_save.save_flat(location, frozen, meta, self.options, sharded)

            return commit
        if writer is not None:
            return writer.stage(location, state, meta, self.options, incremental)
        if incremental is not None:
            return self._staged_blobs(location, state, meta, incremental)
        # The previous save is finished (waited for above), so its arena may be overwritten.
        staged = self._arena.stage(tree.flatten(state), self.max_file_bytes)

        def commit_staged() -> info.CheckpointInfo:
            directory, manifest = save_engine.save_staged(
                location,
                staged,
                meta,
                direct=self.direct,
                writers=self.writers,
                progress=self.progress,
            )
            return describe(location.store.url(directory), manifest)

        return commit_staged

    def _staged_blobs(
        self, location: Location, state: Any, meta: dict[str, Any], inc: _Incremental
    ) -> Callable[[], info.CheckpointInfo]:
        """An incremental save: the state is staged as any other (the caller's part); the
        background part puts the tensors the policy wants into the blob store from the arena,
        inside a save session, and commits the manifest."""
        flat = tree.flatten(state)
        if save_engine.has_shards(flat.tree):
            raise UnsupportedStateError("blobs= is not supported for sharded states yet")
        kinds = {name: (s.dtype, s.shape, s.kind) for name, s in flat.tensors.items()}
        # The previous save is finished (waited for above), so its arena may be overwritten.
        # (No XXH3 while staging: the blob store names chunks by its own digest.)
        staged = self._arena.stage(flat, self.max_file_bytes, hash_host=False)

        def commit_blobs() -> info.CheckpointInfo:
            staged.wait()
            with inc.blobs.session() as session:
                directory, manifest = save_engine.save_blobs(
                    location,
                    staged_sources(staged, kinds),
                    meta,
                    session=session,
                    policy=inc.policy,
                    memo=inc.memo,
                    tracker=inc.tracker,
                    frozen=inc.frozen,
                    max_file_bytes=self.max_file_bytes,
                    writers=self.writers,
                    direct=self.direct,
                    progress=self.progress,
                )
            return describe(location.store.url(directory), manifest)

        return commit_blobs

    def _raise_background_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
            if self._pending is None or self._pending.done():
                _UNFINISHED.discard(self)
        if error is not None:
            raise error

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error if it failed."""
        pending = self._pending
        if pending is not None:
            pending.exception()
        self._raise_background_error()

    def close(self) -> None:
        """Finish the save in flight, stop the background thread, and raise any unreported error."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._arena.release()
            if self._process is not None:
                self._process.close()
            _LIVE.discard(self)
            _UNFINISHED.discard(self)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _incremental(
    ckpt: AsyncCheckpointer,
    location: Location,
    blobs: Any,
    policy: Any,
    memo: Any,
    tracker: Any,
    frozen: Any = None,
    process: bool = False,
) -> tuple[_Incremental, bool]:
    """Check the arguments of an incremental save (here, in the caller's thread); with
    ``process`` (the writer process is to write it), also whether it can (the second value:
    whether it does; a checkpointer with the default writer falls back to the thread writer)."""
    from savepoint.blobs import BlobPolicy, BlobStore, FastMemo
    from savepoint.blobs.patch import PatchTracker

    store = blobs if isinstance(blobs, BlobStore) else BlobStore.open(blobs)
    matcher: Callable[[str], bool] | None = None
    policy = BlobPolicy() if policy is None else policy
    if not isinstance(policy, BlobPolicy):
        raise TypeError("blob_policy must be a savepoint.blobs.BlobPolicy")
    if memo is not None and not isinstance(memo, FastMemo):
        raise TypeError("memo must be a savepoint.blobs.FastMemo")
    if tracker is not None and not isinstance(tracker, PatchTracker):
        raise TypeError("tracker must be a savepoint.blobs.patch.PatchTracker")
    sinks.blob_store_path(location, store)  # reachable from the checkpoint
    prefixes = None
    if frozen is not None:
        from savepoint.blobs.patch import frozen_keys

        prefixes = (frozen,) if isinstance(frozen, str) else tuple(frozen)
        matcher = frozen_keys(prefixes)
    if process and ckpt.fallback:
        try:
            _place.url_of(Location(store.store, store.root), "blob store")
        except UnsupportedStorageError:
            process = False  # the default writer: the thread writer writes it
    if process:
        # The writer process keeps the memo and tracker of its saves (one per blob store): they
        # live where the chunks are hashed, and objects of this process cannot cross to it.
        if memo is not None or tracker is not None:
            raise ValueError(
                "memo= and tracker= cannot be given with writer='process': the writer process "
                "keeps its own (one per blob store, for all the saves it writes)"
            )
        _place.url_of(Location(store.store, store.root), "blob store")  # one it can reach
        return _Incremental(store, policy, None, None, matcher, prefixes), True
    if memo is None and policy.memo:
        with ckpt._lock:
            if ckpt._memo is None:
                ckpt._memo = FastMemo()
            memo = ckpt._memo
    if tracker is None and policy.patches:
        with ckpt._lock:
            if ckpt._tracker is None:
                ckpt._tracker = PatchTracker()
            tracker = ckpt._tracker
    return _Incremental(store, policy, memo, tracker, matcher, prefixes), False


def _reaches(ckpt: AsyncCheckpointer, location: Location, memo: Any, tracker: Any) -> bool:
    """Whether the writer process writes this save: always with ``writer="process"`` (a save
    it cannot write is refused later, naming why); with the default, only where it can
    (otherwise the thread writer does, silently)."""
    if not ckpt.fallback:
        return True
    if memo is not None or tracker is not None:
        return False
    try:
        _place.url_of(location, "checkpoint path")
    except UnsupportedStorageError:
        return False
    return True


def verify_in(process: ProcessWriter | None, path: PathArg) -> None:
    """Read back and verify the committed checkpoint at ``path`` in the writer ``process``
    (``sp.verify(path, direct=True)`` there, at its ``writer_priority``): for a save's
    ``on_commit`` (the background thread, the writer process idle between saves). Raises what
    the check found; CheckpointWriteError where no writer process is there to ask (the thread
    writer, or it died): verify here then."""
    location = resolve_path(path, what="checkpoint path")
    if process is None:
        shown = location.store.url(location.path)
        raise CheckpointWriteError(f"no writer process to verify {shown}", path=shown)
    process.verify(location)


def _started(ckpt: AsyncCheckpointer) -> bool:
    """Whether the writer process runs (started now if need be). With the default writer, one
    that cannot start (no usable interpreter: an embedded or frozen Python) leaves the save to
    the thread writer, with a warning; with ``writer="process"`` the error is the save's."""
    assert ckpt._process is not None
    if not ckpt.fallback:
        return True
    try:
        ckpt._process.ensure()
    except OSError as exc:
        log.warning("cannot start the savepoint writer process (%s): a thread writes this", exc)
        return False
    return True


def _writer(writer: str | None) -> Writer:
    """``writer=`` checked: "thread" or "process" (None, the default: "process", falling back
    to the thread writer where it cannot write)."""
    _priority.check_writer(writer)
    return "thread" if writer == "thread" else "process"


@dataclasses.dataclass(frozen=True)
class _Incremental:
    """An incremental save's blob store, policy, digest memo and patch tracker."""

    blobs: Any
    policy: Any
    memo: Any
    tracker: Any
    frozen: Any = None  # Callable[[str], bool]: keys the caller says did not change
    prefixes: tuple[str, ...] | None = None  # ...as the caller gave them (for the writer process)


def _boostr_commit(
    process: ProcessWriter | None,
    target: str,
    model: Mapping[str, Any],
    optimizer: Mapping[str, Any] | None,
    state: boostr.TrainingState | None,
) -> Callable[[], info.CheckpointInfo]:
    """Check and copy a boostr checkpoint now; the returned function writes it (background),
    or with ``process`` waits for the writer process to have written it (async_/_boostr.py)."""
    if process is not None:
        return _boostr.stage_single(process, target, model, optimizer, state)
    given = state if state is not None else boostr.TrainingState()
    given.to_json()  # refuse what cannot be written now, in the caller, not in the background
    frozen = dataclasses.replace(given, metadata=dict(given.metadata))
    model_copy = boostr.snapshot(model, "model")
    opt_copy = None if optimizer is None else boostr.snapshot(optimizer, "optimizer")

    def commit() -> info.CheckpointInfo:
        boostr.write(target, model_copy, opt_copy, frozen)
        return boostr.inspect(target)

    return commit


def _forget_in_child() -> None:
    # A forked child has none of the parent's threads: a save in flight is the parent's to finish
    # and report, and waiting for it at the child's exit would hang forever. The child's copies
    # of the parent's checkpointers are closed; the child makes its own.
    for ckpt in list(_LIVE):
        ckpt._forked = ckpt._closed = True
        ckpt._pending, ckpt._error = None, None
        ckpt._lock, ckpt._save_lock = threading.Lock(), threading.Lock()
    _LIVE.clear()
    _UNFINISHED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _finish_at_exit() -> None:
    for ckpt in list(set(_LIVE) | _UNFINISHED):
        try:
            ckpt.close()
        except BaseException as exc:  # nothing to raise to at exit: say it loudly
            print(f"savepoint: a background save failed at exit: {exc}", file=sys.stderr)
