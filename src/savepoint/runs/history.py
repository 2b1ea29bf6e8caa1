"""The run's history log: the loss and metric history, appended to, never rewritten.

``report.json`` (version 2) holds what a run *is now* (its checkpoints, best, lineage): small, and
replaced atomically once per save. What a run *did step by step* (every ``log()`` call, the
metrics of every save, the points where a resume forgot history) is appended to a log beside it,
so that neither a save nor a ``log()`` costs more after a million steps than after none.

On disk, one JSON object per line (UTF-8, ``\\n``-terminated)::

    {"step": 12, "loss": 0.53}                       a log() call (loss, metrics, or both)
    {"step": 12, "loss": 0.53, "metrics": {"lr": 0.1}}
    {"step": 400, "metrics": {"val_loss": 0.31}}     the metrics of a save (merged per step)
    {"resumed_from": 300}                            history after step 300 is forgotten

A loss that is not a finite number is stored as the string ``"nan"``, ``"inf"`` or ``"-inf"``
(as ``report.json`` version 1 did). Replaying the records in order gives the report's
``loss_history`` and ``metric_history`` exactly as a version 1 report held them.

Two layouts, by store:

- **the local filesystem**: one file, ``history.jsonl``, opened with ``O_APPEND`` by the writer.
  Each save (and ``close()``) appends the records gathered since the last one in one ``write``;
  the background step of the save ``fdatasync``s it (a kill never loses what was written, the
  page cache keeps it; a power cut may lose the last batch, never what an earlier save synced).
  A kill in the middle of a ``write`` leaves a *torn last line*: readers ignore everything after
  the last ``\\n``, and the next writer cuts it off before appending (:meth:`AppendLog.repair`).
- **every other store** (object stores, memory, fsspec): no store there can append, so each batch
  is a *segment*, ``history/<first>-<last>.jsonl`` (12-digit sequence numbers), put create-only:
  it is there whole or not at all. Segments are read in order of their numbers; the background
  step of a save *compacts* them (size-tiered: :data:`FANOUT` neighbours of the same size class
  become one segment covering their range, up to :data:`SEGMENT_CAP` bytes), so a run holds a
  few dozen segments at most and each record is rewritten a bounded number of times (about
  ``log(SEGMENT_CAP / batch) / log(FANOUT)``), whatever the length of the run. A merged segment
  is put before its parts are deleted; a reader ignores any segment whose range lies inside
  another's, so a compaction cut short leaves duplicates that nobody reads (and that the next
  compaction deletes).

A reader reads ``history.jsonl`` (if any) and then the segments: a run copied from one store to
another reads the same, and its next writer keeps the layout it finds (segments once there are
any, so that records stay in order).

A version 1 ``report.json`` (written before this log existed) holds its whole history inline;
it is read as it is, and the first report a writer writes moves that history into the log
(:meth:`HistoryWriter.rewrite`, the log first and the report after it: until the new report is
in place, the old one is the one readers follow).
"""

from __future__ import annotations

import abc
import contextlib
import errno
import json
import math
import os
import re
import stat
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from savepoint.codecs import bounded_json
from savepoint.errors import CheckpointError, CheckpointPermissionError, CorruptCheckpointError
from savepoint.storage.base import Store
from savepoint.storage.local import LocalStore
from savepoint.storage.paths import Location

__all__ = [
    "AppendLog",
    "FANOUT",
    "HISTORY_FILE",
    "HistoryWriter",
    "Mark",
    "SEGMENTS_DIR",
    "SEGMENT_CAP",
    "Segment",
    "SegmentLog",
    "apply",
    "decode",
    "encode",
    "loss_record",
    "read",
    "records_of",
    "segments",
    "writer",
]

HISTORY_FILE = "history.jsonl"
SEGMENTS_DIR = "history"
FANOUT = 4
SEGMENT_CAP = 16 << 20
_SEGMENT = re.compile(r"(\d{12})-(\d{12})\.jsonl")
_READ_TRIES = 20  # a compaction may delete a listed segment before it is read: list again
_TAIL_CHUNK = 1 << 16

Record = dict[str, Any]


# -- records -------------------------------------------------------------------------------------


def encode(records: Iterable[Record | tuple[int, float | None, dict[str, Any] | None]]) -> bytes:
    """The records as log lines (compact JSON, one per line). A ``(step, loss, metrics)`` tuple
    is a ``log()`` call (:func:`loss_record`); one with a loss alone, the common case, is
    formatted directly (``repr`` of a finite float is its JSON)."""
    lines = []
    for r in records:
        if isinstance(r, tuple):
            step, loss, metrics = r
            if metrics is None and loss is not None and math.isfinite(loss):
                lines.append(f'{{"step":{int(step)},"loss":{float(loss)!r}}}\n')
                continue
            r = loss_record(step, loss, metrics)
        lines.append(json.dumps(r, separators=(",", ":"), allow_nan=False, default=_jsonable))
        lines.append("\n")
    return "".join(lines).encode("utf-8")


def _jsonable(value: Any) -> Any:
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in a run's history")


def decode(data: bytes, shown: str) -> list[Record]:
    """The complete records in ``data``: whatever follows the last ``\\n`` (a torn last line, a
    kill in the middle of an append) is ignored, and so are empty lines and lines of NUL bytes
    (what a crash can leave where a filesystem had allocated but not written). A complete line
    that is not a record is CorruptCheckpointError naming the file and the line. Every parse is
    bounded as all JSON savepoint reads is (:mod:`savepoint.codecs.bounded_json`: nesting,
    memory), and reads what Python's ``json`` wrote (NaN allowed)."""
    end = data.rfind(b"\n")
    if end < 0:
        return []
    body = data[:end]
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(
            f"{shown} is not UTF-8 (byte {exc.start}): the run's history log is damaged",
            path=shown,
        ) from None
    every = body.split(b"\n")
    lines = [line for line in every if line.strip(b"\x00 \t\r")]
    try:
        # One parse of the whole log as an array: about twice as fast as a parse per line.
        records = _parse(b"[" + b",".join(lines) + b"]", shown)
        if all(isinstance(r, dict) for r in records) and len(records) == len(lines):
            return records  # type: ignore[no-any-return]
    except CorruptCheckpointError:
        pass
    out = []
    for number, line in enumerate(every, start=1):
        if not line.strip(b"\x00 \t\r"):
            continue
        try:
            record = _parse(line, shown)
        except CorruptCheckpointError as exc:
            cause = str(exc).split(" is not valid JSON: ", 1)[-1]
            raise _damaged(shown, f"line {number}", f"not JSON ({cause[:80]})") from None
        if not isinstance(record, dict):
            raise _damaged(shown, f"line {number}", "not a JSON object")
        out.append(record)
    return out


def _parse(raw: bytes, shown: str) -> Any:
    return bounded_json.loads(raw, CorruptCheckpointError, shown, strict=False)


def _damaged(shown: str, where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{shown}: {where} of the run's history log is {what}; the checkpoints are not "
        "affected: remove that line (or the log, losing the loss and metric history) and open "
        "the run again",
        path=shown,
    )


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _loss(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def apply(
    records: Iterable[Record],
    loss_history: list[tuple[int, float]],
    metric_history: dict[int, dict[str, Any]],
    shown: str = "history",
) -> None:
    """Replay ``records`` onto the two histories, in place (see the module docstring). A record
    with a value of the wrong kind is CorruptCheckpointError; unknown members are ignored (a
    newer writer may add some)."""
    for number, record in enumerate(records, start=1):
        if "resumed_from" in record:
            step = record["resumed_from"]
            if not _is_step(step):
                raise _damaged(shown, f"record {number}", "a resume marker without a valid step")
            loss_history[:] = [(s, v) for s, v in loss_history if s <= step]
            for s in [s for s in metric_history if s > step]:
                del metric_history[s]
            continue
        step = record.get("step")
        if not isinstance(step, int) or not _is_step(step):
            raise _damaged(shown, f"record {number}", "a record without a valid step")
        if "loss" in record:
            loss = _loss(record["loss"])
            if loss is None:
                raise _damaged(shown, f"record {number}", "a loss that is not a number")
            loss_history.append((step, loss))
        metrics = record.get("metrics")
        if metrics is not None:
            if not isinstance(metrics, dict):
                raise _damaged(shown, f"record {number}", "metrics that are not a JSON object")
            metric_history.setdefault(step, {}).update(metrics)


def loss_record(step: int, loss: float | None, metrics: dict[str, Any] | None) -> Record:
    record: Record = {"step": step}
    if loss is not None:
        record["loss"] = loss if math.isfinite(loss) else repr(loss)
    if metrics:
        record["metrics"] = metrics
    return record


def records_of(
    loss_history: Sequence[tuple[int, float]], metric_history: dict[int, dict[str, Any]]
) -> list[Record]:
    """Records that replay to exactly these histories (a migration, see the module docstring)."""
    out = [loss_record(s, v, None) for s, v in loss_history]
    out += [{"step": s, "metrics": m} for s, m in sorted(metric_history.items()) if m]
    return out


# -- reading -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    first: int
    last: int
    name: str


def segments(store: Store, directory: str) -> tuple[list[Segment], list[Segment]]:
    """The segments of ``directory`` that make up the history, in order, and those a longer one
    covers (left by a compaction cut short). Two segments that overlap without one covering the
    other are CorruptCheckpointError."""
    found = []
    for name in store.list(directory):
        m = _SEGMENT.fullmatch(name)
        if m and int(m.group(1)) <= int(m.group(2)):
            found.append(Segment(int(m.group(1)), int(m.group(2)), name))
    found.sort(key=lambda s: (s.first, -s.last))
    live: list[Segment] = []
    covered: list[Segment] = []
    for seg in found:
        if live and seg.last <= live[-1].last:
            covered.append(seg)
        elif live and seg.first <= live[-1].last:
            shown = store.url(directory)
            raise CorruptCheckpointError(
                f"{shown}: history segments {live[-1].name} and {seg.name} overlap; one of them "
                "was not written by savepoint",
                path=shown,
            )
        else:
            live.append(seg)
    return live, covered


def read(run: Location) -> list[tuple[str, list[Record]]] | None:
    """Every record of the run's history log, in order, by the file (or segment) that holds it
    (``(name, records)``, as messages name it); None when the run has none (no
    ``history.jsonl``, no segment). CorruptCheckpointError for a damaged log,
    CheckpointPermissionError for one this user may not read."""
    store = run.store
    base_path = run.join(HISTORY_FILE).path
    base = _read_file(store, base_path)
    directory = run.join(SEGMENTS_DIR).path
    for _ in range(_READ_TRIES):
        try:
            live, _covered = segments(store, directory)
            parts = []
            for seg in live:
                path = store.join(directory, seg.name)
                parts.append((store.url(path), decode(_read_blob(store, path), store.url(path))))
        except FileNotFoundError:
            continue  # compacted meanwhile: list again
        if base is None and not live:
            return None
        head = [] if base is None else [(store.url(base_path), base)]
        return head + parts
    raise CheckpointError(
        f"{store.url(directory)}: the history segments kept changing while they were read "
        f"({_READ_TRIES} tries); try again",
        path=store.url(directory),
    )


def _read_file(store: Store, path: str) -> list[Record] | None:
    try:
        data = _read_blob(store, store.realpath(path))
    except (FileNotFoundError, NotADirectoryError):
        return None
    return decode(data, store.url(path))


def _read_blob(store: Store, path: str) -> bytes:
    try:
        return store.read_small(path, cap=None)
    except CheckpointPermissionError as exc:
        shown = store.url(path)
        raise CheckpointPermissionError(
            f"{shown}: permission denied; the run itself may be intact: make the file readable "
            "by this user (or read it as one who may) and try again",
            path=shown,
            errno=exc.errno,
        ) from None


# -- writing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mark:
    """Where the log stood before an append (what :meth:`HistoryWriter.rollback` goes back to)."""

    position: int  # AppendLog: the file's size; SegmentLog: the segment's sequence number
    created: bool = False  # AppendLog: this append created the file


class HistoryWriter(abc.ABC):
    """The writer's side of the log (one per writing manager, used under its lock)."""

    @abc.abstractmethod
    def append(self, data: bytes) -> Mark | None:
        """Add ``data`` (whole lines) to the log; None when ``data`` is empty. Raises OSError,
        with nothing added."""

    @abc.abstractmethod
    def rollback(self, mark: Mark | None) -> None:
        """Take back an append (a save that is undone). Raises OSError."""

    @abc.abstractmethod
    def rewrite(self, data: bytes) -> None:
        """Make ``data`` the whole log (moving a version 1 report's history into it)."""

    def repair(self) -> None:
        """Cut off what a killed writer left (a torn last line; segments a longer one covers)."""
        return  # optional: nothing to do unless a log overrides it

    def sync(self) -> None:
        """Make what was appended durable (the background step of a save)."""
        return  # optional: nothing to do unless a log overrides it

    def compact(self) -> None:
        """Bound the number of segments (the background step of a save)."""
        return  # optional: nothing to do unless a log overrides it

    def close(self) -> None:
        return  # optional: nothing to do unless a log overrides it


class AppendLog(HistoryWriter):
    """``history.jsonl`` on the local filesystem, appended to with ``O_APPEND``."""

    def __init__(self, run: Location) -> None:
        self._store = run.store
        self._path = run.join(HISTORY_FILE).path
        self._fd: int | None = None
        self._closer: weakref.finalize | None = None  # type: ignore[type-arg]
        self._size = 0

    def _open(self, create: bool) -> tuple[int, bool]:
        if self._fd is not None:
            return self._fd, False
        path = os.path.realpath(self._path)  # a run file may be reached through a symlink
        created = False
        flags = os.O_RDWR | os.O_APPEND | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if not create:
                raise
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(
                    f"{self._store.url(self._path)} is not a regular file, but the run keeps its "
                    "history log there: move it out of the way and open the run again",
                    path=self._store.url(self._path),
                )
            self._size = st.st_size
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # A manager dropped without close(): the descriptor goes with this object.
        self._closer = weakref.finalize(self, os.close, fd)
        return fd, created

    def repair(self) -> None:
        try:
            fd, _ = self._open(create=False)
        except FileNotFoundError:
            return
        keep = _complete_prefix(fd, self._size)
        if keep != self._size:
            os.ftruncate(fd, keep)
            self._size = keep

    def append(self, data: bytes) -> Mark | None:
        if not data:
            return None
        fd, created = self._open(create=True)
        self._size = os.fstat(fd).st_size  # the file, not what this writer last left
        mark = Mark(self._size, created)
        try:
            if not created and self._size and _last_byte(fd, self._size) != b"\n":
                # A torn line no repair has cut yet (a writer killed after this one opened).
                keep = _complete_prefix(fd, self._size)
                os.ftruncate(fd, keep)
                mark = Mark(keep, False)
                self._size = keep
            view = memoryview(data)
            while len(view):
                n = os.write(fd, view)
                if n == 0:
                    raise OSError(errno.EIO, "write returned 0 bytes", self._store.url(self._path))
                view = view[n:]
        except BaseException:
            with contextlib.suppress(OSError):
                self.rollback(mark)
            raise
        self._size = mark.position + len(data)
        return mark

    def rollback(self, mark: Mark | None) -> None:
        if mark is None or self._fd is None:
            return
        os.ftruncate(self._fd, mark.position)
        self._size = mark.position
        if mark.created and mark.position == 0:
            # The file this append created goes too (a failed first save takes nothing).
            self.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.realpath(self._path))

    def rewrite(self, data: bytes) -> None:
        self.close()
        self._store.put(self._store.realpath(self._path), data, exclusive=False)

    def sync(self) -> None:
        fd = self._fd
        if fd is not None:
            os.fdatasync(fd)

    def close(self) -> None:
        self._fd = None
        if self._closer is not None:
            closer, self._closer = self._closer, None
            closer()


def _last_byte(fd: int, size: int) -> bytes:
    return os.pread(fd, 1, size - 1)


def _complete_prefix(fd: int, size: int) -> int:
    """The length of the file up to and including its last ``\\n`` (0: none)."""
    end = size
    while end > 0:
        start = max(0, end - _TAIL_CHUNK)
        chunk = os.pread(fd, end - start, start)
        at = chunk.rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


class SegmentLog(HistoryWriter):
    """``history/<first>-<last>.jsonl`` segments, put create-only (stores that cannot append)."""

    def __init__(self, run: Location) -> None:
        self._store = run.store
        self._dir = run.join(SEGMENTS_DIR).path
        self._live: list[tuple[Segment, int]] | None = None  # with sizes, once listed
        self._next = 1

    def _listing(self) -> list[tuple[Segment, int]]:
        if self._live is None:
            live, _covered = segments(self._store, self._dir)
            sized = []
            for seg in live:
                found = self._store.stat(self._store.join(self._dir, seg.name))
                sized.append((seg, found.size if found is not None else 0))
            self._live = sized
            self._next = (live[-1].last + 1) if live else 1
        return self._live

    def _name(self, first: int, last: int) -> str:
        return f"{first:012d}-{last:012d}.jsonl"

    def append(self, data: bytes) -> Mark | None:
        if not data:
            return None
        live = self._listing()
        if not live:
            self._store.makedirs(self._dir)
        seq = self._next
        seg = Segment(seq, seq, self._name(seq, seq))
        self._store.put(self._store.join(self._dir, seg.name), data, exclusive=True)
        live.append((seg, len(data)))
        self._next = seq + 1
        return Mark(seq)

    def rollback(self, mark: Mark | None) -> None:
        if mark is None or self._live is None:
            return
        name = self._name(mark.position, mark.position)
        with contextlib.suppress(FileNotFoundError):
            self._store.remove(self._store.join(self._dir, name))
        self._live = [(s, n) for s, n in self._live if s.name != name]
        self._next = min(self._next, mark.position)

    def rewrite(self, data: bytes) -> None:
        for name in self._store.list(self._dir):
            if _SEGMENT.fullmatch(name):
                self._store.remove(self._store.join(self._dir, name))
        self._live, self._next = [], 1
        self.append(data)

    def repair(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            _live, covered = segments(self._store, self._dir)
            for seg in covered:
                self._store.remove(self._store.join(self._dir, seg.name))

    def compact(self) -> None:
        live = self._listing()
        while len(live) >= FANOUT:
            tail = live[-FANOUT:]
            level = _level(tail[-1][1])
            total = sum(n for _, n in tail)
            if any(_level(n) != level for _, n in tail) or total > SEGMENT_CAP:
                return
            first, last = tail[0][0].first, tail[-1][0].last
            merged = Segment(first, last, self._name(first, last))
            data = b"".join(
                self._store.read_small(self._store.join(self._dir, s.name), cap=None)
                for s, _ in tail
            )
            self._store.put(self._store.join(self._dir, merged.name), data, exclusive=True)
            del live[-FANOUT:]
            live.append((merged, len(data)))
            for seg, _ in tail:
                with contextlib.suppress(FileNotFoundError):
                    self._store.remove(self._store.join(self._dir, seg.name))


def _level(size: int) -> int:
    """A segment's size class: segments of one class are merged (powers of :data:`FANOUT`)."""
    level, limit = 0, 4096
    while size > limit:
        level, limit = level + 1, limit * FANOUT
    return level


def writer(run: Location) -> HistoryWriter:
    """The writer for the run's history: :class:`AppendLog` on the local filesystem (unless the
    run already has segments, copied from another store), :class:`SegmentLog` elsewhere."""
    store = run.store
    if isinstance(store, LocalStore) and not store.list(run.join(SEGMENTS_DIR).path):
        return AppendLog(run)
    return SegmentLog(run)
