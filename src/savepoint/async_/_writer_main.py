"""The writer process of ``AsyncCheckpointer(writer="process")``: hashes, writes and commits saves
staged by its trainer, from the trainer's staging arena in shared memory.

Run as ``python -m savepoint.async_._writer_main FD PRIORITY`` by :mod:`savepoint.async_.process` (a plain
subprocess, not ``multiprocessing``: a spawned ``multiprocessing`` child re-imports the trainer's
``__main__``, which usually imports torch, and its protocol is pickle). FD is this end of a Unix
socket pair; PRIORITY is its ``writer_priority`` (:mod:`savepoint.async_._priority`), applied to
itself before anything else; each message is JSON (:mod:`savepoint.async_._wire`). This process never imports
torch: it only hashes and writes bytes that are already laid out as files, and torch would cost
it seconds of start-up and hundreds of MiB of memory (and, on a GPU machine, could initialise CUDA
in a second process). ``tests/async_/test_process_writer.py`` checks it is not loaded.

Per save the trainer sends the staged layout (file names, sizes, headers' lengths, the tensor
entries, the tree and the metadata of the manifest), where to write it (a local path, or a URL
this process resolves itself: :mod:`savepoint.async_._place`) and, when the arena is new, its
descriptor.
This process rebuilds the :class:`~savepoint.async_.staging.Staged` over its own mapping of the
arena, commits it with :func:`savepoint.engine.save.save_staged` (the same writer as the thread
writer's) and answers ``done`` with the checksums (the trainer builds its description from them)
or ``error`` with the error's type and message.

A ``verify`` message (a manager's read-back before pruning, sent between saves) is answered
``verified`` once ``sp.verify(path, direct=True)`` passed here, or with its error: the read and
the hash run at this process's priority, not in the trainer.

A boostr save (``save_boostr``, or one rank's part of ``save_distributed``) sends ``boostr``:
where each tensor is in the arena and the training state; this process writes the directory
(or ``rank_{r}/``) with boostr's own writer (:mod:`savepoint.async_._boostr`).

A sharded save sends ``pieces`` instead (the trainer runs the save's collectives): the staging
directory rank 0 made, this rank's assigned pieces and where their bytes are in the arena; this
process writes them with :func:`savepoint.distributed.save.write_rank` (the thread writer's own
step) and answers ``done`` with their records. For an incremental one its blob session stays
open until the trainer sends ``settle`` (was the checkpoint committed?), answered ``settled``.

Lifetime: the process ends when its socket reaches end of stream (the trainer closed it, exited
or was killed), or when its parent is gone; a save already handed over is finished first (a save
outlives its trainer). SIGINT and SIGTERM are ignored (a Ctrl-C or a scheduler's SIGTERM to the
process group must not tear a commit in half; the trainer decides, and its exit ends this
process); SIGKILL ends it like any process, leaving only an uncommitted staging directory.

``SAVEPOINT_WRITER_FAULT`` (tests only) injects a failure: ``raise:<savepoint error name>``,
``oserror:<errno name>``, ``delay:<seconds>`` (before writing), ``stall`` (the save sends its first progress, then sleeps: a test
kills the process mid-write), or ``crawl`` (every progress call sleeps 50 ms: a test cancels the
save mid-write).
"""

from __future__ import annotations

import errno as _errno
import mmap
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from savepoint import errors
from savepoint.async_ import _priority, _wire
from savepoint.async_.staging import BLOCK, ArenaSource, Staged, StagedFile, staged_sources
from savepoint.codecs.safetensors import Entry
from savepoint.engine import save as save_engine
from savepoint.storage.paths import resolve

__all__ = ["main"]

_POLL = 1.0  # seconds between checks that the parent still lives, while idle


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _priority.apply(args[1] if len(args) > 1 else _priority.DEFAULT)
    parent = os.getppid()
    arena: np.ndarray[Any, Any] | None = None
    while True:
        while not select.select([sock], [], [], _POLL)[0]:
            if os.getppid() != parent:
                return 0  # the trainer is gone and nothing was handed over
        try:
            message, fds = _wire.receive(sock)
        except (OSError, EOFError, ValueError):
            return 0  # a trainer killed in the middle of a message: nothing was handed over
        if message is None:
            return 0
        if fds:
            arena = _map(fds, int(message["arena_size"]))
        if message["op"] not in ("save", "pieces", "boostr", "verify"):
            continue  # a cancel that came after its save was done
        answer: dict[str, Any] | None
        if message["op"] == "verify":
            answer = _verify(message)
        elif arena is None:
            answer = {"op": "error", "type": "CheckpointWriteError", "path": message.get("path")}
            answer["message"] = "the writer process was sent a save without its staging arena"
        elif message["op"] == "pieces":
            answer = _pieces(message, arena, sock)
        elif message["op"] == "boostr":
            answer = _boostr(message, arena)
        else:
            answer = _save(message, arena, sock)
        try:
            if answer is not None:
                _wire.send(sock, answer)
        except OSError:
            pass  # the trainer is gone: the commit stands, nobody is left to tell


# The memo and tracker of each blob store this process writes to (URL -> (memo, tracker)):
# unchanged chunks are named at XXH3 speed and changed rows found from the second save on, as
# they are for the thread writer's checkpointer. Lost with the process: the next one hashes again.
_MEMOS: dict[str, tuple[Any, Any]] = {}


def _save_blobs(
    message: dict[str, Any], staged: Staged, location: Any, progress: Any
) -> dict[str, Any]:
    """An incremental save: the blob store's save session over the staged bytes, then the
    manifest committed; answered with the manifest's text (it names blobs the trainer never saw)."""
    from savepoint.blobs.patch import frozen_keys
    from savepoint.codecs import manifest as mf
    from savepoint.codecs.dtypes import BY_NAME

    blobs, policy, memo, tracker = _blob_store(message["blobs"])
    spec = message["blobs"]
    kinds = {
        e.name: (BY_NAME[e.dtype], tuple(e.shape), str(message["kinds"][e.name][0]))
        for f in staged.files
        for e in f.entries
    }
    frozen = None if spec["frozen"] is None else frozen_keys(spec["frozen"])
    with blobs.session() as session:
        directory, manifest = save_engine.save_blobs(
            location,
            staged_sources(staged, kinds),
            message["metadata"],
            session=session,
            policy=policy,
            memo=memo if policy.memo else None,
            tracker=tracker if policy.patches else None,
            frozen=frozen,
            max_file_bytes=int(message["max_file_bytes"]),
            writers=int(message["writers"]),
            direct=bool(message["direct"]),
            progress=progress,
        )
    return {"op": "done", "directory": directory, "manifest": mf.dump(manifest).decode()}


def _blob_store(spec: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """The blob store, policy, memo and patch tracker of an incremental save's ``blobs`` field
    (the memo and tracker this process keeps for that store)."""
    from savepoint.blobs import BlobPolicy, BlobStore, Compression, FastMemo
    from savepoint.blobs.patch import PatchTracker

    fields = dict(spec["policy"])
    if fields.get("compression") is not None:
        fields["compression"] = Compression(**fields["compression"])
    policy = BlobPolicy(**fields)
    url = str(spec["url"])  # a local path, or a URL (async_/_place.py)
    blobs = BlobStore.open(url, algorithm=spec["algorithm"])
    memo, tracker = _MEMOS.setdefault(url, (FastMemo(), PatchTracker()))
    return blobs, policy, memo, tracker


def _rank_session(spec: dict[str, Any]) -> Any:
    """A sharded incremental save's blob side on this rank: a session opened on its store."""
    from savepoint.distributed.save import RankSession

    blobs, policy, memo, tracker = _blob_store(spec)
    return RankSession(
        blobs.session(),
        policy,
        memo if policy.memo else None,
        tracker if policy.patches else None,
    )


def _map(fds: list[int], size: int) -> np.ndarray[Any, Any]:
    """The arena, mapped from the descriptor the trainer sent (pages faulted in at once)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    try:
        m = mmap.mmap(fds[0], size, flags=flags)
    finally:
        for fd in fds:
            os.close(fd)
    return np.frombuffer(m, dtype=np.uint8)


def _staged(message: dict[str, Any], arena: np.ndarray[Any, Any]) -> Staged:
    files = []
    for f in message["files"]:
        offset, size, header = int(f["offset"]), int(f["size"]), int(f["header"])
        image = arena[offset : offset + -(-size // BLOCK) * BLOCK]
        entries = [Entry(n, d, tuple(s), a, b) for n, d, s, a, b in f["entries"]]
        files.append(StagedFile(f["name"], image[:header].tobytes(), entries, image, size))
    # Digests computed while staged: XXH3 of host tensors (hashed as they were copied, by the
    # trainer), mlh64 of tensors hashed on their device.
    checks = dict(message.get("checks") or {})
    return Staged(message["tree"], files, list(message["order"]), checks=lambda: checks)


def _save(message: dict[str, Any], arena: np.ndarray[Any, Any], sock: socket.socket) -> Any:
    target = str(message["path"])
    try:
        staged = _staged(message, arena)
        location = resolve(target, what="checkpoint path")
        progress = _progress(sock, bool(message.get("progress")))
        _fault_before()
        if "blobs" in message:
            return _save_blobs(message, staged, location, progress)
        directory, manifest = save_engine.save_staged(
            location,
            staged,
            message["metadata"],
            direct=bool(message["direct"]),
            writers=int(message["writers"]),
            progress=progress,
        )
    except BaseException as exc:
        return {"op": "error", **_wire.error_fields(_wire.reported(exc, target))}
    return {
        "op": "done",
        "directory": directory,
        "created": manifest.created,
        "format_version": manifest.format_version,
        "files": {name: r.header_xxh3 for name, r in manifest.files.items()},
        "digests": [manifest.tensors[name].xxh3 for name in staged.order],
    }


def _pieces(
    message: dict[str, Any], arena: np.ndarray[Any, Any], sock: socket.socket
) -> dict[str, Any] | None:
    """This rank's write step of a sharded save (the trainer runs the collectives): the pieces
    the plan gave it, from the arena into the save's staging directory, synced; answered with
    their records. An incremental save's pieces go through a blob session that stays open
    until the trainer says whether the checkpoint was committed (``settle``; its patch tracker
    is told of a commit), answered ``settled``."""
    from savepoint.codecs.dtypes import BY_NAME
    from savepoint.distributed import pieces
    from savepoint.distributed import save as distributed_save

    target = str(message["path"])
    blobs = None
    try:
        items = pieces.items_from_json(message["pieces"])
        sources: dict[str, Any] = {
            item.key: ArenaSource(
                arena[int(offset) : int(offset) + item.nbytes],
                BY_NAME[item.dtype],
                tuple(int(n) for n in shape),
                str(kind),
            )
            for item, (offset, shape, kind) in zip(items, message["sources"], strict=True)
        }
        progress = _progress(sock, bool(message.get("progress")))
        _fault_before()
        if "blobs" in message:
            blobs = _rank_session(message["blobs"])
        records = distributed_save.write_rank(
            target,
            str(message["staging"]),
            int(message["rank"]),
            items,
            sources,
            max_file_bytes=int(message["max_file_bytes"]),
            writers=int(message["writers"]),
            direct=bool(message["direct"]),
            progress=progress,
            blobs=blobs,
        )
    except BaseException as exc:
        if blobs is not None:
            blobs.close(committed=False)
        return {"op": "error", **_wire.error_fields(_wire.reported(exc, target))}
    answer = {"op": "done", **pieces.records_json(records)}
    if blobs is None:
        return answer
    committed = False
    try:
        _wire.send(sock, answer)
        while (settle := _wire.receive_message(sock)) is not None:
            if settle["op"] == "settle":
                committed = bool(settle.get("committed"))
                break
    except OSError:
        pass  # the trainer is gone: the commit's outcome is unknown, the tracker not told
    finally:
        blobs.close(committed)
    return {"op": "settled"}


def _boostr(message: dict[str, Any], arena: np.ndarray[Any, Any]) -> dict[str, Any]:
    """A boostr checkpoint (``save_boostr``), or one rank's part of a distributed one
    (``save_distributed``), written from the arena (:func:`savepoint.async_._boostr.write`)."""
    from savepoint.async_ import _boostr as boostr_writer

    target = str(message["path"])
    try:
        _fault_before()
        return boostr_writer.write(message, arena)
    except BaseException as exc:
        return {"op": "error", **_wire.error_fields(_wire.reported(exc, target))}


def _verify(message: dict[str, Any]) -> dict[str, Any]:
    """A committed checkpoint read back and verified here, at this process's priority (a
    manager's check before pruning, :meth:`savepoint.async_.process.ProcessWriter.verify`):
    ``sp.verify(path, direct=True)``, answered ``verified`` or with the error it raised."""
    from savepoint import checkpoint

    target = str(message["path"])
    try:
        checkpoint.verify(target, direct=True)
    except BaseException as exc:
        return {"op": "error", **_wire.error_fields(_wire.reported(exc, target))}
    return {"op": "verified"}


def _progress(sock: socket.socket, wanted: bool) -> Any:
    """The progress callback of a save: forwards ``(done, total)`` to the trainer (at most every
    50 ms, and the last), when it asked for progress, and (at most every 20 ms) looks for a
    ``cancel`` from the trainer (``save_on_preemption`` abandoning the save): it then raises, the
    save's transaction removes what it wrote, and the answer is that error. A trainer that is
    gone cancels nothing and is told nothing: the save goes on (a save outlives its trainer; a
    managed save always asks for progress, so a report to a trainer killed mid-save must not
    end it). ``stall`` sleeps at the first call."""
    fault = os.environ.get("SAVEPOINT_WRITER_FAULT", "")
    stall, crawl = fault == "stall", fault == "crawl"
    lock = threading.Lock()
    last = [0.0, 0.0]  # the last progress sent, the last look for a cancel
    listening = [True]

    def progress(done: int, total: int) -> None:
        with lock:
            now = time.monotonic()
            if listening[0] and wanted and (done >= total or now - last[0] >= 0.05 or stall):
                last[0] = now
                try:
                    _wire.send(sock, {"op": "progress", "done": done, "total": total})
                except OSError:
                    listening[0] = False  # the trainer is gone: finish the save, tell nobody
            if listening[0] and now - last[1] >= 0.02:
                last[1] = now
                _look_for_cancel(sock, listening)
            if stall:
                time.sleep(600)
            if crawl:
                time.sleep(0.05)

    return progress


def _look_for_cancel(sock: socket.socket, listening: list[bool]) -> None:
    if not select.select([sock], [], [], 0)[0]:
        return
    message = _wire.receive_message(sock)
    if message is None:
        listening[0] = False  # the trainer is gone: finish the save
        return
    if message.get("op") == "cancel":
        raise errors.CheckpointWriteError(
            "the save was cancelled by its trainer before its commit (a preemption save "
            "abandoned it); nothing of it was committed",
            path=None,
        )


def _fault_before() -> None:
    fault = os.environ.get("SAVEPOINT_WRITER_FAULT", "")
    kind, _, name = fault.partition(":")
    if kind == "raise":
        cls = getattr(errors, name)
        raise cls(f"injected {name} (SAVEPOINT_WRITER_FAULT)")
    if kind == "delay":
        time.sleep(float(name))
    if kind == "oserror":
        number = getattr(_errno, name)
        raise OSError(number, os.strerror(number), "injected")


if __name__ == "__main__":
    sys.exit(main())
