"""``run.json`` and ``report.json``: what a run claims, and what it did.

``run.json`` (written once, when the run directory is created)::

    {"format": "savepoint-run", "version": 1, "name": "...", "variant": "...", "config": {...},
     "num_params": 1234, "created": "2026-11-21T08:00:00Z", "savepoint_version": "0.1.0",
     "run_id": "9f0c...e1"}

``run_id`` is the run's identity: 32 random hex digits made with the run (``uuid4``), which no
other run shares even where names, variants and configs are alike. Storage tiers record it in
``tier.json`` (:mod:`savepoint.runs.tiers`). ``report.json`` records it too, so a run that loses
its ``run.json`` keeps it. A run made by a savepoint without run ids gets one in the next
``report.json`` a writer writes (an open alone changes nothing).

``report.json`` (version 2; replaced atomically once per save, by the background step of a save
that prunes, and at close)::

    {"format": "savepoint-report", "version": 2, "name", "variant", "config", "num_params",
     "run_id",
     "steps_completed": 500, "epoch": 3, "wall_time_s": 12.5,
     "history": {"file": "history.jsonl", "segments": "history/"},
     "best": {"metric": "val_loss", "mode": "min", "step": 400, "metrics": {...}} | null,
     "latest_step": 500, "checkpoints": [500, 400, ...], "discarding": [100],
     "lineage": [{"resumed_from": 300, "at": "...", "steps_completed_before": 340}],
     "config_changes": [{"step": 300, "at": "...",
                         "changes": [{"key": "optim.lr", "old": 0.1, "new": 0.05}]}],
     "verify_failures": [{"step": 600, "at": "...", "error": "..."}]}

The loss and metric history (``loss_history``, ``metric_history`` of :class:`Report`) is not in
it: it is appended to the run's history log (:mod:`savepoint.runs.history`), so that a save
writes a report of the same size after a million logged steps as after none. :func:`load_report`
reads both and returns the whole report; ``Report.to_json()`` is that whole report as one
self-contained document (version 1, history inline: what ``savepoint report --json`` prints).
A version 1 ``report.json`` (savepoint before issue 16: the history inline) is read as it is;
the first report a writer writes moves its history into the log.

``verify_failures`` records each checkpoint that did not verify when it was read back before
pruning: such a checkpoint is never counted by retention nor chosen as best, so it never takes
the place of a good one (see :mod:`savepoint.runs.saving`).

``checkpoints`` are the saved steps, newest first; ``latest_step`` and ``best`` are among them, and
the ``latest/`` and ``best/`` aliases hold exactly those checkpoints (or are absent).
``discarding`` lists steps that retention or an abandoned timeline is deleting: they are no longer
part of the run, and are deleted after this report is written (so the report never names a deleted
checkpoint); a writer that was killed before it finished leaves them here, and the next
``CheckpointManager`` to open the run finishes the job. Readers ignore them.

``config`` (in both files) is the run's *current* config; ``config_changes`` is its history: each
reopening with a different config appends the keys that changed (dotted paths into the config; a
key added has no ``old``, a key removed no ``new``) and the latest committed step when it was
reopened. ``num_params`` is the caller's, or the element count of the first saved state. Both are
written to ``report.json`` first and to ``run.json`` after it: a ``run.json`` that lags behind
(killed in between) is not a mismatch (:func:`lagging_run`), and a writer's open brings it up to
date.

The consistency check (:func:`check_consistent`) follows the seed's artifact loader: a report
whose variant, config or parameter count disagrees with ``run.json``, or whose best checkpoint is
missing, is an error (``RunMismatchError``, ``MissingCheckpointError``).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import json
import math
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from savepoint import errors_map
from savepoint._version import __version__
from savepoint.codecs import bounded_json
from savepoint.commit import names
from savepoint.errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    MissingCheckpointError,
    RunMismatchError,
)
from savepoint.runs import history as _history
from savepoint.storage import finishing
from savepoint.storage.base import Store, read_error
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = [
    "REPORT_FILE",
    "RUN_FILE",
    "Report",
    "RunInfo",
    "StagedJson",
    "check_consistent",
    "config_diff",
    "count_elements",
    "identity_problems",
    "lagging_run",
    "load_report",
    "missing_best",
    "new_run_id",
    "now_iso",
    "plain_value",
    "read_history",
    "read_json",
    "read_report",
    "stage_json",
    "write_json",
]

RUN_FILE = "run.json"
REPORT_FILE = "report.json"
REPORT_VERSION = 2  # 1: the history inline (before issue 16); 2: the history in the log
MAX_JSON_BYTES = 64 << 20
_HISTORY_FIELDS = ("loss_history", "metric_history")
_OMITTED_WHEN_NONE = ("run_id", "save_intervals")  # (files written before them stay byte-identical)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z")


def new_run_id() -> str:
    """A new run's identity: 128 random bits, as 32 hex digits."""
    return uuid.uuid4().hex


def _run_id(value: Any, path: str) -> str | None:
    """A ``run_id`` member as read (None: absent, a run made before run ids)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 128:
        raise CorruptCheckpointError(
            f"{path}: run_id must be a non-empty string of at most 128 characters", path=path
        )
    return value


@dataclass
class RunInfo:
    name: str
    variant: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    num_params: int | None = None
    created: str = field(default_factory=now_iso)
    savepoint_version: str = __version__
    run_id: str | None = field(default_factory=new_run_id)

    def to_json(self) -> dict[str, Any]:
        doc = {"format": "savepoint-run", "version": 1, **asdict(self)}
        if doc["run_id"] is None:
            del doc["run_id"]
        return doc

    @classmethod
    def from_json(cls, doc: Any, path: str) -> RunInfo:
        if not isinstance(doc, dict) or doc.get("format") != "savepoint-run":
            raise CorruptCheckpointError(f"{path} is not a savepoint run.json", path=path)
        _check_version(doc, path)
        try:
            return cls(
                name=str(doc["name"]),
                variant=doc.get("variant"),
                config=dict(doc.get("config") or {}),
                num_params=doc.get("num_params"),
                created=str(doc.get("created", "")),
                savepoint_version=str(doc.get("savepoint_version", "")),
                run_id=_run_id(doc.get("run_id"), path),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{path}: malformed run.json ({exc})", path=path) from None


@dataclass
class Report:
    name: str
    variant: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    num_params: int | None = None
    steps_completed: int = 0
    epoch: int | None = None
    wall_time_s: float = 0.0
    loss_history: list[tuple[int, float]] = field(default_factory=list)
    metric_history: dict[int, dict[str, Any]] = field(default_factory=dict)
    best: dict[str, Any] | None = None
    latest_step: int | None = None
    checkpoints: list[int] = field(default_factory=list)
    lineage: list[dict[str, Any]] = field(default_factory=list)
    retention: list[dict[str, Any]] = field(default_factory=list)
    discarding: list[int] = field(default_factory=list)
    config_changes: list[dict[str, Any]] = field(default_factory=list)
    verify_failures: list[dict[str, Any]] = field(default_factory=list)
    run_id: str | None = None
    # What a save policy that watches its saves achieved (policies.Continuous.achieved): the
    # intervals between saves and their times to durable. Absent from report.json when None.
    save_intervals: dict[str, Any] | None = None

    @classmethod
    def for_run(cls, run: RunInfo) -> Report:
        return cls(
            name=run.name,
            variant=run.variant,
            config=run.config,
            num_params=run.num_params,
            run_id=run.run_id,
        )

    def to_json(self) -> dict[str, Any]:
        """The whole report, history included, as one self-contained document (version 1, the
        layout every savepoint reads)."""
        doc = self._members()
        doc["loss_history"] = [[s, plain_value(v)] for s, v in self.loss_history]
        doc["metric_history"] = {str(k): v for k, v in sorted(self.metric_history.items())}
        return {"format": "savepoint-report", "version": 1, **doc}

    def to_file_json(self) -> dict[str, Any]:
        """``report.json`` as the writer stores it (version 2): everything but the history, which
        is in the history log. Its size does not grow with the number of steps logged."""
        doc = self._members()
        history = {"file": _history.HISTORY_FILE, "segments": _history.SEGMENTS_DIR + "/"}
        return {"format": "savepoint-report", "version": REPORT_VERSION, "history": history, **doc}

    def _members(self) -> dict[str, Any]:
        # Field by field, not dataclasses.asdict: that would deep-copy the whole history.
        return {
            f.name: copy.deepcopy(getattr(self, f.name))
            for f in fields(self)
            if f.name not in _HISTORY_FIELDS
            and not (f.name in _OMITTED_WHEN_NONE and getattr(self, f.name) is None)
        }

    @classmethod
    def from_json(cls, doc: Any, path: str) -> Report:
        if not isinstance(doc, dict) or doc.get("format") != "savepoint-report":
            raise CorruptCheckpointError(f"{path} is not a savepoint report.json", path=path)
        _check_version(doc, path, REPORT_VERSION)
        kinds: dict[str, type | tuple[type, ...]] = {
            "metric_history": dict,
            "loss_history": list,
            "lineage": list,
            "checkpoints": list,
            "discarding": list,
            "config_changes": list,
            "verify_failures": list,
            "save_intervals": (dict, type(None)),
        }
        for key, kind in kinds.items():
            if key in doc and not isinstance(doc[key], kind):
                name = kind.__name__ if isinstance(kind, type) else "object or null"
                raise CorruptCheckpointError(f"{path}: {key} must be a JSON {name}", path=path)
        best = doc.get("best")
        if best is not None and not (
            isinstance(best, dict)
            and isinstance(best.get("metric"), str)
            and best.get("mode", "min") in ("min", "max")
        ):
            # A best naming no usable metric would silently drop the best checkpoint (and best/).
            raise CorruptCheckpointError(
                f'{path}: best must be null or an object with a "metric" name and a "mode" of '
                '"min" or "max"',
                path=path,
            )
        steps = [doc.get("latest_step"), (doc.get("best") or {}).get("step")]
        steps += doc.get("checkpoints", []) + doc.get("discarding", [])
        if not all(s is None or _is_step(s) for s in steps):
            raise CorruptCheckpointError(
                f"{path}: steps (latest_step, best.step, checkpoints, discarding) must be "
                "non-negative integers",
                path=path,
            )
        try:
            return cls(
                name=str(doc["name"]),
                variant=doc.get("variant"),
                config=dict(doc.get("config") or {}),
                num_params=doc.get("num_params"),
                steps_completed=int(doc.get("steps_completed", 0)),
                epoch=doc.get("epoch"),
                wall_time_s=float(doc.get("wall_time_s", 0.0)),
                loss_history=[(int(s), float(v)) for s, v in doc.get("loss_history", [])],
                metric_history={int(k): dict(v) for k, v in doc.get("metric_history", {}).items()},
                best=doc.get("best"),
                latest_step=doc.get("latest_step"),
                checkpoints=[int(s) for s in doc.get("checkpoints", [])],
                lineage=list(doc.get("lineage", [])),
                retention=list(doc.get("retention", [])),
                discarding=[int(s) for s in doc.get("discarding", [])],
                config_changes=[dict(c) for c in doc.get("config_changes", [])],
                verify_failures=[dict(c) for c in doc.get("verify_failures", [])],
                run_id=_run_id(doc.get("run_id"), path),
                save_intervals=doc.get("save_intervals"),
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise CorruptCheckpointError(
                f"{path}: malformed report.json ({exc})", path=path
            ) from None

    def truncate_after(self, step: int) -> None:
        """Forget history past ``step``: a resumed run replays those steps and logs them again."""
        self.loss_history = [(s, v) for s, v in self.loss_history if s <= step]
        self.metric_history = {s: m for s, m in self.metric_history.items() if s <= step}


REBUILD_HINT = (
    "the checkpoints are not affected: move report.json aside and open the run with a "
    "CheckpointManager, which rebuilds it from the checkpoints (the loss and metric history and the "
    "resume lineage it held are lost)"
)


def load_report(directory: PathArg, *, history: bool = True) -> Report | None:
    """The report of the run at ``directory`` (``report.json`` and, with ``history``, the loss and
    metric history of its log), or None when it has no ``report.json``.

    A damaged ``report.json`` is CorruptCheckpointError saying how to rebuild it
    (:data:`REBUILD_HINT`), a damaged history log CorruptCheckpointError naming the record; an
    unreadable one CheckpointPermissionError; one written by a newer savepoint
    IncompatibleCheckpointError. ``history=False`` reads ``report.json`` alone (the histories
    are then empty for a version 2 report): what a reader needs to choose a checkpoint, at a
    cost that does not grow with the length of the run."""
    return read_report(directory, history=history)[0]


def read_report(directory: PathArg, *, history: bool = True) -> tuple[Report | None, int | None]:
    """:func:`load_report`, and the version of ``report.json`` as found (None: no report)."""
    run = resolve(directory, what="run directory")
    where = run.join(REPORT_FILE)
    path = str(where)
    try:
        doc = read_json(where)
        if doc is None:
            return None, None
        report = Report.from_json(doc, path)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{exc}; {REBUILD_HINT}", path=path) from exc
    version = doc.get("version", 1)
    if history and version >= 2:
        read_history(run, report)
    return report, version


def read_history(run: Location, report: Report) -> None:
    """Fill ``report``'s histories from the run's history log (see :mod:`~.history`)."""
    for shown, records in _history.read(run) or []:
        _history.apply(records, report.loss_history, report.metric_history, shown)


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_version(doc: dict[str, Any], path: str, newest: int = 1) -> None:
    version = doc.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise CorruptCheckpointError(f"{path}: version must be an integer", path=path)
    if version > newest:
        raise IncompatibleCheckpointError(
            f"{path}: format version {version} is newer than this savepoint reads; upgrade "
            "savepoint",
            path=path,
        )


def plain_value(v: Any) -> Any:
    """A value as stored in run files (see ``manager._plain``)."""
    item = getattr(v, "item", None)
    if callable(item) and getattr(v, "ndim", 0) == 0:
        v = item()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, Mapping):
        return {str(k): plain_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain_value(x) for x in v]
    return v


def read_json(path: PathArg) -> Any:
    """The JSON document at ``path`` (a local path, URL or Location), or None when there is no
    file there.

    Errors: CheckpointPermissionError when it may not be read (mode, owner); CorruptCheckpointError
    when it is not a regular file (a FIFO is refused, never waited on), is larger than
    :data:`MAX_JSON_BYTES`, cannot be read, or is not valid UTF-8 JSON; CheckpointError for any
    other failure to open it (``Store.read_small``). Nothing else escapes."""
    where = resolve(path, what="run file")
    store, shown = where.store, str(where)
    try:
        # A run file may be reached through a symlink: resolve it (reads refuse one).
        raw = store.read_small(store.realpath(where.path), cap=MAX_JSON_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError as exc:  # CheckpointPermissionError, or a store's raw refusal
        raise errors_map.permission_error(exc, shown, what="the run itself") from None
    except OSError as exc:
        raise read_error(shown, exc) from None
    # Bounded (nesting, memory), and read as Python's json wrote it (NaN allowed).
    return bounded_json.loads(raw, CorruptCheckpointError, shown, strict=False)


def write_json(path: PathArg, doc: Mapping[str, Any], *, sync_dir: bool = True) -> None:
    """Replace the file at ``path`` atomically (readers see the old document or the new one).
    One top-level member per line, values compact: readable, and small for long histories.
    Raises OSError.

    ``sync_dir=False`` (a store that renames): the new document is written and synced under a
    hidden temporary name (:mod:`savepoint.commit.names`) and renamed over ``path``, and the
    directory is *not* synced: a power cut before the caller syncs it may bring back the
    previous document (whole), never a mixture (see :func:`stage_json`)."""
    if sync_dir:
        where = resolve(path, what="run file")
        where.store.put(where.path, _encode_json(doc), exclusive=False)
        return
    stage_json(path, doc).publish()


def _encode_json(doc: Mapping[str, Any]) -> bytes:
    members = ",\n".join(
        f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'), default=_jsonable)}"
        for k, v in doc.items()
    )
    return ("{\n" + members + "\n}\n").encode("utf-8")


class StagedJson:
    """A document :func:`stage_json` wrote aside: :meth:`publish` puts it in place, :meth:`abort`
    drops it. One of the two must be called."""

    def __init__(
        self,
        store: Store,
        path: str,
        data: bytes,
        temporary: str | None,
        synced: Callable[[], None],
    ) -> None:
        self._store, self._path, self._data = store, path, data
        self._temporary, self._synced = temporary, synced

    def publish(self) -> None:
        """Wait for the temporary's fsync, then rename it over the path (the directory is not
        synced); on a store that does not rename, write the document in place. Raises OSError
        (the temporary removed)."""
        store = self._store
        if self._temporary is None:
            store.put(self._path, self._data, exclusive=False)
            return
        try:
            self._synced()
            store.replace(self._temporary, self._path)
        except BaseException:
            with contextlib.suppress(OSError):
                store.remove(self._temporary)
            raise

    def abort(self) -> None:
        """Drop the document (never raises)."""
        if self._temporary is not None:
            with contextlib.suppress(BaseException):
                self._synced()
            with contextlib.suppress(OSError):
                self._store.remove(self._temporary)


def stage_json(path: PathArg, doc: Mapping[str, Any]) -> StagedJson:
    """Write the document that will replace ``path`` (:func:`write_json`'s text) under a hidden
    temporary name (:mod:`savepoint.commit.names`, create-only) and start its fsync on the
    finishing pool (:mod:`savepoint.storage.finishing`): the caller can do other work before it
    calls :meth:`StagedJson.publish`, which waits for the fsync and renames, leaving the
    directory unsynced. A manager's save stages its report before it links the aliases, so the
    report's fsync runs while they are made. On a store that does not rename nothing is written
    until ``publish`` (a put is atomic there). Raises OSError."""
    data = _encode_json(doc)
    where = resolve(path, what="run file")
    store = where.store
    if not store.capabilities.atomic_rename:
        return StagedJson(store, where.path, data, None, lambda: None)
    temporary = names.hidden(store, where.path, names.TMP_TAG)
    blob = store.create_blob(temporary, size=len(data), direct=False)
    try:
        blob.write(memoryview(data))
    except BaseException:
        blob.abort()
        raise
    if store.capabilities.direct_io:
        synced = finishing.finish_later(blob)
    else:
        try:
            blob.finish()
        except BaseException:
            blob.abort()
            raise
        synced = _done
    return StagedJson(store, where.path, data, temporary, synced)


def _done() -> None:
    pass


def _jsonable(value: Any) -> Any:
    # numpy and torch scalars in metrics or configs: store their Python value.
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in a run report")


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The keys that differ between two configs, as dotted paths into nested mappings, sorted:
    ``{"key", "old", "new"}`` (no ``old`` for a key added, no ``new`` for one removed)."""
    changes: list[dict[str, Any]] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        for key in sorted(set(a) | set(b), key=str):
            path = f"{prefix}{key}"
            if (
                key in a
                and key in b
                and isinstance(a[key], Mapping)
                and isinstance(b[key], Mapping)
            ):
                walk(a[key], b[key], path + ".")
            elif key not in b:
                changes.append({"key": path, "old": a[key]})
            elif key not in a:
                changes.append({"key": path, "new": b[key]})
            elif a[key] != b[key]:
                changes.append({"key": path, "old": a[key], "new": b[key]})

    walk(old, new, "")
    return changes


def lagging_run(run: RunInfo, report: Report) -> RunInfo | None:
    """``run`` brought up to date with ``report``, or None when it is not behind it.

    ``run.json`` is behind when a writer recorded a config change or a derived ``num_params`` in
    ``report.json`` and was stopped before rewriting ``run.json``: the report's config differs
    exactly in the keys of its last ``config_changes`` entry, or ``run.json`` has no
    ``num_params`` while the report has one."""
    fixed = run
    if run.num_params is None and isinstance(report.num_params, int):
        fixed = replace(fixed, num_params=report.num_params)
    if run.config != report.config and report.config_changes:
        recorded = {c.get("key") for c in report.config_changes[-1].get("changes") or []}
        if {c["key"] for c in config_diff(run.config, report.config)} == recorded:
            fixed = replace(fixed, config=report.config)
    return None if fixed is run else fixed


def count_elements(state: Any) -> int | None:
    """The parameter count a run records when the caller gives none: the element count of
    ``state["model"]`` when the state has a model, else of every tensor and array in ``state``
    (a module counts its parameters, an object with ``state_dict`` its state). None: no tensor."""
    if isinstance(state, Mapping) and "model" in state:
        state = state["model"]
    total = _elements(state, 0)
    return total or None


def _elements(obj: Any, depth: int) -> int:
    if depth > 100:
        return 0
    parameters = getattr(obj, "parameters", None)
    if callable(parameters) and hasattr(obj, "state_dict"):  # a torch module
        return sum(int(p.numel()) for p in parameters())
    numel = getattr(obj, "numel", None)
    if callable(numel) and hasattr(obj, "shape"):  # a torch tensor
        return int(numel())
    size = getattr(obj, "size", None)
    if isinstance(size, int) and hasattr(obj, "shape") and hasattr(obj, "dtype"):  # numpy
        return size
    if isinstance(obj, Mapping):
        return sum(_elements(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_elements(v, depth + 1) for v in obj)
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict):
        return _elements(state_dict(), depth + 1)
    return 0


def identity_problems(run: RunInfo, report: Report) -> list[str]:
    """How ``report`` and ``run.json`` disagree on the run's identity (variant, config, parameter
    count; a ``run.json`` that merely lags behind the report is not a problem, see
    :func:`lagging_run`)."""
    run = lagging_run(run, report) or run
    problems = []
    if report.variant != run.variant:
        problems.append(
            f"report variant {report.variant!r} does not match run variant {run.variant!r}"
        )
    if report.config != run.config:
        keys = ", ".join(c["key"] for c in config_diff(run.config, report.config))
        problems.append(f"report config does not match run config (keys: {keys})")
    if report.num_params != run.num_params:
        problems.append(
            f"report num_params {report.num_params} does not match run num_params {run.num_params}"
        )
    return problems


def missing_best(directory: str, report: Report, steps_on_disk: Iterable[int]) -> str | None:
    """Why the report's best checkpoint is missing from the run, or None when it is there."""
    best_step = (report.best or {}).get("step")
    if best_step is None or best_step in set(steps_on_disk):
        return None
    return (
        f"the report's best checkpoint (step {best_step}) is missing from "
        f'{os.path.join(directory, "checkpoints")}. Put it back, or set "best" to null in '
        "report.json and open the run again (with best_metric=...) to rank the checkpoints "
        "that are left"
    )


def check_consistent(
    directory: str, run: RunInfo, report: Report, steps_on_disk: Iterable[int]
) -> None:
    """Raise if the report and run.json disagree, or the report's best checkpoint is missing."""
    problems = identity_problems(run, report)
    if problems:
        raise RunMismatchError(
            f"{directory}: run artifact is inconsistent: {'; '.join(problems)}", path=directory
        )
    missing = missing_best(directory, report, steps_on_disk)
    if missing is not None:
        raise MissingCheckpointError(f"{directory}: {missing}", path=directory)
