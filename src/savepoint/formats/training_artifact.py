"""Training-artifact directories of the burn-based trainer (seed 001), read and written.

Layout (``save_training_artifact``; every JSON file is ``serde_json::to_string_pretty``: two-space
indents, no trailing newline)::

    manifest.json          {"variant": V, "config": C, "num_params": usize, "weights_stem": "model"}
    model.mpk              the model's record, burn's DefaultRecorder (see savepoint.formats.burn):
                           the file name is weights_stem with its extension set to "mpk"
    training_report.json   the TrainingReport; savepoint reads the fields below and keeps the rest
    optimizer_state.bin    opaque bytes (optional on load)
    best_validation/       optional: manifest.json, the weights and a copy of training_report.json

    sweep directory        training_comparison.json (the TrainingComparisonReport, kept as JSON)
                           and one artifact directory per variant, named by the variant's slug

Report fields savepoint reads (serde's rules: an absent or ``null`` Option is None; the others are
required): ``variant`` and ``config`` (any JSON, compared with the manifest's), ``num_params`` and
``steps_completed`` (unsigned integers), ``best_validation`` (any JSON or None: whether there is a
best), ``best_validation_step`` (unsigned integer or None). The manifest's four fields are required;
unknown members of either document are ignored, as serde ignores them (and kept, for the report).

Loading (:func:`load`, the seed's ``load_training_artifact``; nothing is ever written):

1. ``training_report.json``, then ``manifest.json`` and the weights it names (an artifact's own
   ``best_validation/`` directory, which holds a copy of the report, reads as an artifact without
   a best: step 3 is skipped);
2. the seed's consistency checks, in its order: the report's ``variant``, ``config`` and
   ``num_params`` must equal the manifest's (:class:`ArtifactMismatchError`, a RunMismatchError,
   with the seed's messages);
3. the best-validation model: None when the report has no ``best_validation``; else the tensors of
   ``best_validation/`` when its ``manifest.json`` exists; else, when ``best_validation_step`` equals
   ``steps_completed``, the final model stands in (the same arrays, not a copy); else
   :class:`MissingBestValidationArtifact` (a MissingCheckpointError) naming the directory;
4. ``optimizer_state.bin``'s bytes, or None when it is absent.

Where savepoint is stricter than the seed (each is an error the seed would not raise, for a
directory that disagrees with itself or could not have been written by it): ``best_validation/``'s
manifest must agree with the main one on variant, config and num_params; ``weights_stem`` must be
a plain file name (no ``/``, not ``.``/``..``): a manifest cannot point outside its directory;
configs are compared as JSON values, so members serde would ignore count; no file is followed
through a symlink, and a FIFO, socket or directory where a file belongs is refused at once
(``optimizer_state.bin`` included, which the seed would treat as absent). :func:`verify` also reads
every byte and checks that ``best_validation/training_report.json``, where present, equals the report.

Errors: no directory, CheckpointNotFoundError; no ``training_report.json`` or ``manifest.json``,
IncompleteCheckpointError (the seed writes the weights and manifest, then the report: an interrupted
save); unreadable or malformed JSON, missing weights, bad records, CorruptCheckpointError.

The seed's parts: :func:`save_checkpoint` (weights then ``manifest.json``, no report),
:func:`load_manifest`, :func:`save_training_report`, :func:`load_training_report`; each writer
refuses, before writing, a document that would disagree with the directory's other one. Floats in
every JSON file are ryu's f64 text (``1e-7``, ``1e20``), as serde_json writes them; Python's
spelling (``1e-07``) reads too.

Writing (:func:`save`, the seed's ``save_training_artifact``) builds the whole directory under a
hidden sibling and swaps it in with one rename (:func:`savepoint.formats._files.atomic_directory`),
so a reader sees the old artifact or the new one, never a mix; an existing ``best_validation/`` is
replaced (or removed, without a best model) as the seed does. A directory holding anything but an
artifact's files is refused. Before writing, the artifact is checked as :func:`load` would check
it, so savepoint never writes one its reader (or the seed's) refuses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from savepoint.codecs import dtypes
from savepoint.commit import atomic
from savepoint.errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MissingBestValidationArtifact,
    UnsupportedStateError,
)
from savepoint.formats import _files, burn
from savepoint.formats._artifact_docs import (
    MANIFEST_FILE,
    MAX_JSON_BYTES,
    REPORT_FILE,
    WEIGHTS_STEM,
    CheckpointManifest,
    Report,
    check,
    check_stem,
    mismatch,
    pretty,
    read_json,
    report_fields,
    slug_of,
)
from savepoint.formats._files import LazyTensor, MappedTensor
from savepoint.formats._progress import Progress, Tally
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.storage import local
from savepoint.storage.paths import local_path

__all__ = [
    "ArtifactDirectory",
    "BEST_VALIDATION_DIR",
    "COMPARISON_FILE",
    "CheckpointManifest",
    "Framework",
    "MANIFEST_FILE",
    "MAX_JSON_BYTES",
    "OPTIMIZER_STATE_FILE",
    "Outcome",
    "REPORT_FILE",
    "Sweep",
    "TrainingArtifact",
    "WEIGHTS_STEM",
    "inspect",
    "is_artifact",
    "is_sweep",
    "load",
    "load_checkpoint",
    "load_comparison",
    "load_manifest",
    "load_sweep",
    "load_training_report",
    "open_artifact",
    "save",
    "save_checkpoint",
    "save_comparison",
    "save_sweep",
    "save_training_report",
    "verify",
]

COMPARISON_FILE = "training_comparison.json"
OPTIMIZER_STATE_FILE = "optimizer_state.bin"
BEST_VALIDATION_DIR = "best_validation"
Framework = Literal["numpy", "torch"]


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def _require_dir(path: str) -> None:
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(f"no training artifact at {path}", path=path)
    if not os.path.isdir(path):  # the directory itself may be a link (the caller named it)
        raise CorruptCheckpointError(f"{path} is not a directory", path=path)


def _document(directory: str, name: str, what: str) -> dict[str, Any]:
    path = os.path.join(directory, name)
    if not os.path.lexists(path):
        raise IncompleteCheckpointError(
            f"{directory} has no {name} ({what}): not a training artifact, or its save was "
            "interrupted; save it again",
            path=directory,
        )
    return read_json(path, what)


def _read_manifest(directory: str) -> CheckpointManifest:
    doc = _document(directory, MANIFEST_FILE, "every checkpoint has one")
    try:
        return CheckpointManifest.parse(doc)
    except ValueError as exc:
        where = os.path.join(directory, MANIFEST_FILE)
        raise CorruptCheckpointError(f"{where}: {exc}", path=where) from None


def _read_report(directory: str) -> tuple[dict[str, Any], Report]:
    doc = _document(directory, REPORT_FILE, "every training artifact has one")
    try:
        return doc, report_fields(doc)
    except ValueError as exc:
        where = os.path.join(directory, REPORT_FILE)
        raise CorruptCheckpointError(f"{where}: {exc}", path=where) from None


class _Checkpoint:
    """A manifest and its opened weights (the seed's ``load_checkpoint``)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.manifest = _read_manifest(directory)
        weights = os.path.join(directory, self.manifest.weights_file)
        if not os.path.lexists(weights):
            raise CorruptCheckpointError(
                f"{weights} is missing (the weights {os.path.join(directory, MANIFEST_FILE)} "
                "names)",
                path=weights,
            )
        self.record = burn.open_record(weights)

    def close(self) -> None:
        self.record.close()


class ArtifactDirectory:
    """A training artifact opened without reading tensor data (every check of :func:`load` done):
    ``model`` and ``best_validation_model`` map dotted names to lazy tensors. Close it (or use
    ``with``) when done."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(local_path(path, what="training artifact"))
        _require_dir(self.path)
        self.report, fields = _read_report(self.path)
        self._main = _Checkpoint(self.path)
        self._best: _Checkpoint | None = None
        self._optimizer: local.MappedFile | None = None
        try:
            self.manifest = self._main.manifest
            check(self.path, fields, self.manifest)
            self.model: dict[str, LazyTensor] = self._main.record.tensors()
            self.best_validation_model: dict[str, LazyTensor] | None = None
            self.best_validation_source: str | None = None
            # An artifact's own best_validation/ holds a copy of the report but no best of its
            # own: read as the checkpoint it is.
            parent = os.path.dirname(self.path)
            self.is_best_copy = os.path.basename(self.path) == BEST_VALIDATION_DIR and is_artifact(
                parent
            )
            if not self.is_best_copy:
                self._open_best(fields)
            self.optimizer_state, self.optimizer_size = self._open_optimizer()
        except BaseException:
            self.close()
            raise

    def _open_best(self, fields: Report) -> None:
        best_dir = os.path.join(self.path, BEST_VALIDATION_DIR)
        if not fields.has_best:
            return
        if os.path.lexists(os.path.join(best_dir, MANIFEST_FILE)):
            self._best = _Checkpoint(best_dir)
            best = self._best.manifest
            for what, got, want in (
                ("variant", best.variant, self.manifest.variant),
                ("config", best.config, self.manifest.config),
                ("num_params", best.num_params, self.manifest.num_params),
            ):
                if got != want:
                    raise mismatch(
                        self.path,
                        f"{BEST_VALIDATION_DIR}/{MANIFEST_FILE} {what} {slug_of(got)} does not "
                        f"match manifest {what} {slug_of(want)}",
                    )
            self.best_validation_model = self._best.record.tensors()
            self.best_validation_source = BEST_VALIDATION_DIR
        elif fields.best_step is not None and fields.best_step == fields.steps_completed:
            self.best_validation_model = dict(self.model)
            self.best_validation_source = "model"
        else:
            raise MissingBestValidationArtifact(
                f"training artifact is missing the best-validation checkpoint at {best_dir} "
                f"(the report's best step {fields.best_step} is not its last step "
                f"{fields.steps_completed}, so the final model cannot stand in)",
                path=best_dir,
            )

    def _open_optimizer(self) -> tuple[LazyTensor | None, int | None]:
        path = os.path.join(self.path, OPTIMIZER_STATE_FILE)
        try:
            fd = local.open_read(path)
        except FileNotFoundError:
            return None, None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return _files.ArrayTensor.of(np.empty(0, np.uint8), OPTIMIZER_STATE_FILE), 0
            try:
                self._optimizer = local.MappedFile(fd, size)
            except OSError as exc:
                raise CorruptCheckpointError(f"{path} cannot be mapped: {exc}", path=path) from None
        finally:
            os.close(fd)
        tensor = MappedTensor(self._optimizer.array, dtypes.from_name("U8"), (size,), path=path)
        return tensor, size

    def __enter__(self) -> ArtifactDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._main.close()
        if self._best is not None:
            self._best.close()
        if self._optimizer is not None:
            self._optimizer.close()
            self._optimizer = None

    def files(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for directory in [self.path] + ([self._best.directory] if self._best else []):
            for name in (MANIFEST_FILE, REPORT_FILE, OPTIMIZER_STATE_FILE):
                full = os.path.join(directory, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    out[os.path.relpath(full, self.path)] = os.path.getsize(full)
        out[self._main.manifest.weights_file] = self._main.record.size
        if self._best is not None:
            rel = os.path.join(BEST_VALIDATION_DIR, self._best.manifest.weights_file)
            out[rel] = self._best.record.size
        return out

    def tree(self) -> dict[str, Any]:
        """The artifact as a state tree (what a conversion writes): ``{"model": {...},
        "best_validation_model": {...} (only from its own directory), "optimizer_state": a U8
        tensor (when present), "manifest": {...}, "report": {...}}``."""
        tree: dict[str, Any] = {"model": dict(self.model)}
        if self._best is not None and self.best_validation_model is not None:
            tree["best_validation_model"] = dict(self.best_validation_model)
        if self.optimizer_state is not None:
            tree["optimizer_state"] = self.optimizer_state
        tree["manifest"] = json.loads(self.manifest.to_json())
        tree["report"] = self.report
        return tree

    def info(self) -> CheckpointInfo:
        def entries(prefix: str, tensors: Mapping[str, LazyTensor], file: str) -> list[TensorInfo]:
            return [
                TensorInfo(f"{prefix}/{k}", t.dtype.name, t.shape, t.nbytes, file, f"{prefix}/{k}")
                for k, t in tensors.items()
            ]

        tensors = entries("model", self.model, self.manifest.weights_file)
        if self._best is not None and self.best_validation_model is not None:
            file = os.path.join(BEST_VALIDATION_DIR, self._best.manifest.weights_file)
            tensors += entries("best_validation_model", self.best_validation_model, file)
        fields = report_fields(self.report)
        values: dict[str, Any] = {
            "variant": self.manifest.variant,
            "num_params": self.manifest.num_params,
            "steps_completed": fields.steps_completed,
            "best_validation_step": fields.best_step,
            "best_validation_model": self.best_validation_source,
            "optimizer_state_bytes": self.optimizer_size,
        }
        notes = ["burn records have no checksums: verify checks structure and sizes only"]
        if self.best_validation_source == "model":
            notes.append(
                "no best_validation/: the best step is the last, the final model stands in"
            )
        if self.is_best_copy:
            notes.append("the best-validation checkpoint of the artifact in the parent directory")
        return CheckpointInfo(
            path=self.path,
            format_version=None,
            writer=f"burn {self._main.record.metadata.version} (the weights)",
            created="",
            metadata={"config": self.manifest.config, "burn": self._main.record.metadata.to_dict()},
            tensors=tuple(tensors),
            values=values,
            files=self.files(),
            format="training-artifact",
            notes=tuple(notes),
        )


def open_artifact(path: str | os.PathLike[str]) -> ArtifactDirectory:
    """Open a training artifact directory: every check of :func:`load`, no tensor data read."""
    return ArtifactDirectory(path)


@dataclass
class TrainingArtifact:
    """A loaded training artifact (the seed's ``LoadedTrainingArtifact``).

    ``model`` and ``best_validation_model`` map dotted names to arrays (torch tensors with
    ``framework="torch"``); ``best_validation_source`` says where the best came from:
    ``"best_validation"`` (its own directory), ``"model"`` (the final model stands in: the same
    arrays) or None (no best)."""

    path: str
    manifest: CheckpointManifest
    report: dict[str, Any]
    model: dict[str, Any]
    best_validation_model: dict[str, Any] | None
    optimizer_state: bytes | None
    best_validation_source: str | None = None


def _materialize(tensors: Mapping[str, LazyTensor], framework: Framework) -> dict[str, Any]:
    out = {}
    for name, t in tensors.items():
        out[name] = _files.to_framework(np.array(t.load()), t.dtype, framework)
    return out


def load(path: str | os.PathLike[str], *, framework: Framework = "numpy") -> TrainingArtifact:
    """Read a training artifact directory (the seed's ``load_training_artifact``); read-only."""
    with open_artifact(path) as d:
        model = _materialize(d.model, framework)
        best: dict[str, Any] | None = None
        if d.best_validation_source == "model":
            best = dict(model)
        elif d.best_validation_model is not None:
            best = _materialize(d.best_validation_model, framework)
        optimizer = None
        if d.optimizer_state is not None:
            optimizer = np.array(d.optimizer_state.load()).tobytes()
        return TrainingArtifact(
            d.path, d.manifest, d.report, model, best, optimizer, d.best_validation_source
        )


def load_checkpoint(
    path: str | os.PathLike[str], *, framework: Framework = "numpy"
) -> tuple[CheckpointManifest, dict[str, Any]]:
    """A manifest and its weights alone (the seed's ``load_checkpoint``: ``best_validation/``,
    say); no report is read."""
    directory = os.path.abspath(local_path(path, what="training artifact"))
    _require_dir(directory)
    checkpoint = _Checkpoint(directory)
    try:
        return checkpoint.manifest, _materialize(checkpoint.record.tensors(), framework)
    finally:
        checkpoint.close()


def load_manifest(path: str | os.PathLike[str]) -> CheckpointManifest:
    """The seed's ``load_manifest``: the checked ``manifest.json`` of a checkpoint directory."""
    directory = os.path.abspath(local_path(path, what="training artifact"))
    _require_dir(directory)
    return _read_manifest(directory)


def load_training_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The seed's ``load_training_report``: ``training_report.json`` of a directory, checked as
    :func:`load` checks it (the fields it reads), whole."""
    directory = os.path.abspath(local_path(path, what="training artifact"))
    _require_dir(directory)
    return _read_report(directory)[0]


def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe the artifact at ``path`` (every check of :func:`load`, no tensor data read)."""
    with open_artifact(path) as d:
        return d.info()


def verify(path: str | os.PathLike[str], *, progress: Progress | None = None) -> CheckpointInfo:
    """:func:`load`'s checks, every byte read once, and ``best_validation/``'s report copy (where
    present) equal to the report; ``progress(done, total)`` is called in bytes as it reads."""
    with open_artifact(path) as d:
        sources: list[LazyTensor] = [
            t for tensors in (d.model, d.best_validation_model or {}) for t in tensors.values()
        ]
        if d.optimizer_state is not None:
            sources.append(d.optimizer_state)
        tally = Tally.over(progress, sources)
        for t in sources:
            tally.drain(t)
        copy = os.path.join(d.path, BEST_VALIDATION_DIR, REPORT_FILE)
        own_best = d.best_validation_source == BEST_VALIDATION_DIR
        if own_best and os.path.lexists(copy) and read_json(copy, "a copy") != d.report:
            raise mismatch(d.path, f"{BEST_VALIDATION_DIR}/{REPORT_FILE} differs from the report")
        return d.info()


def is_artifact(path: str | os.PathLike[str]) -> bool:
    """True for a directory holding ``training_report.json`` (savepoint's own checkpoints never
    do); used by detection, reads nothing."""
    p = os.fspath(path)
    return os.path.isdir(p) and os.path.isfile(os.path.join(p, REPORT_FILE))


def is_sweep(path: str | os.PathLike[str]) -> bool:
    """True for a directory holding ``training_comparison.json``."""
    p = os.fspath(path)
    return os.path.isdir(p) and os.path.isfile(os.path.join(p, COMPARISON_FILE))


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


_KNOWN = frozenset({MANIFEST_FILE, REPORT_FILE, OPTIMIZER_STATE_FILE, BEST_VALIDATION_DIR})


def _refuse_foreign(target: str) -> None:
    if not os.path.lexists(target):
        return
    if os.path.islink(target) or not os.path.isdir(target):
        raise CheckpointWriteError(f"{target} exists and is not a directory", path=target)
    foreign = [
        n
        for n in os.listdir(target)
        if n not in _KNOWN and not n.endswith("." + burn.EXTENSION) and not n.startswith(".")
    ]
    if foreign:
        raise CheckpointWriteError(
            f"{target} holds {', '.join(sorted(foreign)[:5])}, which no training artifact has; "
            "refusing to replace it (choose another directory)",
            path=target,
        )


def _weights(tensors: Mapping[str, Any], ids: Mapping[str, str] | None) -> Any:
    leaves = {
        name: v if isinstance(v, (burn.Param, burn.Data)) else burn.Param(v, (ids or {}).get(name))
        for name, v in tensors.items()
    }
    return burn.unflatten(leaves)


@dataclass
class Outcome:
    """What one training run produced (the seed's ``TrainingOutcome``): the model's tensors by
    dotted name, the report (a JSON object), the optimizer's bytes and the best model if any."""

    model: Mapping[str, Any]
    report: Mapping[str, Any]
    optimizer_state: bytes = b""
    best_validation_model: Mapping[str, Any] | None = None
    num_params: int | None = None
    ids: Mapping[str, str] | None = None
    metadata: burn.Metadata | None = None


def save(
    path: str | os.PathLike[str],
    model: Mapping[str, Any],
    report: Mapping[str, Any],
    *,
    optimizer_state: bytes = b"",
    best_validation_model: Mapping[str, Any] | None = None,
    num_params: int | None = None,
    weights_stem: str = WEIGHTS_STEM,
    ids: Mapping[str, str] | None = None,
    metadata: burn.Metadata | None = None,
) -> CheckpointManifest:
    """Write a training artifact directory (the seed's ``save_training_artifact``) atomically.

    ``model`` and ``best_validation_model`` map dotted names to arrays or tensors (see
    :func:`savepoint.formats.burn.save_record`; ``ids`` gives parameter ids by name for both);
    ``report`` is the training report, whose ``variant`` and ``config`` the manifests take.
    ``num_params`` defaults to burn's count (the float tensors' elements).

    Raises ArtifactMismatchError, before writing anything, when the result would not load: the
    report's ``num_params`` differs from the model's, or it names a best validation that is not
    the last step and no ``best_validation_model`` is given. CheckpointWriteError when ``path``
    holds something other than a training artifact, or the write fails (the previous artifact is
    then intact).
    """
    target = os.path.abspath(local_path(path, what="training artifact"))
    doc = dict(report)
    try:
        fields = report_fields(doc)
        check_stem(weights_stem)
    except ValueError as exc:
        raise UnsupportedStateError(f"cannot write the training artifact: {exc}") from None
    if num_params is None:
        num_params = burn.num_params(model)
    manifest = CheckpointManifest(fields.variant, fields.config, int(num_params), weights_stem)
    check(target, fields, manifest)
    last = fields.best_step is not None and fields.best_step == fields.steps_completed
    if fields.has_best and best_validation_model is None and not last:
        raise mismatch(
            target,
            f"the report has a best validation at step {fields.best_step}, not the last step "
            f"{fields.steps_completed}, and no best_validation_model was given: the artifact "
            "could not be loaded",
        )
    if not isinstance(optimizer_state, (bytes, bytearray, memoryview)):
        raise UnsupportedStateError(
            f"optimizer_state must be bytes, got {type(optimizer_state).__name__}"
        )
    report_json = pretty(doc)
    manifest_json = manifest.to_json()
    main_tree = _weights(model, ids)
    best_tree = None if best_validation_model is None else _weights(best_validation_model, ids)
    _refuse_foreign(target)
    with _files.atomic_directory(target, what="training artifact") as staging:
        burn.write_record(
            os.path.join(staging, manifest.weights_file), main_tree, metadata=metadata
        )
        local.write_small(os.path.join(staging, MANIFEST_FILE), manifest_json)
        local.write_small(os.path.join(staging, REPORT_FILE), report_json)
        local.write_small(os.path.join(staging, OPTIMIZER_STATE_FILE), bytes(optimizer_state))
        if best_tree is not None:
            best_dir = os.path.join(staging, BEST_VALIDATION_DIR)
            os.mkdir(best_dir)
            burn.write_record(
                os.path.join(best_dir, manifest.weights_file), best_tree, metadata=metadata
            )
            local.write_small(os.path.join(best_dir, MANIFEST_FILE), manifest_json)
            local.write_small(os.path.join(best_dir, REPORT_FILE), report_json)
            local.fsync_dir(best_dir)
    return manifest


def _existing(directory: str, name: str) -> Any:
    """What ``directory/name`` holds (CheckpointManifest or Report), None when it is absent."""
    if not os.path.lexists(os.path.join(directory, name)):
        return None
    return _read_manifest(directory) if name == MANIFEST_FILE else _read_report(directory)[1]


def save_checkpoint(
    path: str | os.PathLike[str],
    model: Mapping[str, Any],
    variant: Any,
    config: Any,
    *,
    num_params: int | None = None,
    weights_stem: str = WEIGHTS_STEM,
    ids: Mapping[str, str] | None = None,
    metadata: burn.Metadata | None = None,
) -> CheckpointManifest:
    """The seed's ``save_checkpoint``: the weights, then ``manifest.json``, into the directory
    ``path`` (created if needed; other files are left as they are), each file atomically. No
    report, no optimizer state (:func:`save` writes the whole artifact). Returns the manifest.

    Where the directory already holds a ``training_report.json`` the new manifest must agree with
    it (ArtifactMismatchError before anything is written): savepoint writes no artifact that
    its reader, or the seed's, would refuse."""
    directory = os.path.abspath(local_path(path, what="training artifact"))
    try:
        check_stem(weights_stem)
    except ValueError as exc:
        raise UnsupportedStateError(f"cannot write the checkpoint: {exc}") from None
    count = burn.num_params(model) if num_params is None else int(num_params)
    manifest = CheckpointManifest(variant, config, count, weights_stem)
    manifest_json, tree = manifest.to_json(), _weights(model, ids)
    if os.path.lexists(directory):
        _require_dir(directory)
        report = _existing(directory, REPORT_FILE)
        if report is not None:
            check(directory, report, manifest)
    try:
        os.makedirs(directory, exist_ok=True)
        burn.write_record(os.path.join(directory, manifest.weights_file), tree, metadata=metadata)
        atomic.replace_file(os.path.join(directory, MANIFEST_FILE), manifest_json)
    except OSError as exc:
        raise _files.write_error(directory, exc) from exc
    return manifest


def save_training_report(path: str | os.PathLike[str], report: Mapping[str, Any]) -> None:
    """The seed's ``save_training_report``: ``training_report.json`` into the directory ``path``
    (created if needed), atomically. The report must hold the fields :func:`load` reads
    (UnsupportedStateError) and agree with the directory's ``manifest.json`` where there is one
    (ArtifactMismatchError), both before anything is written."""
    directory = os.path.abspath(local_path(path, what="training artifact"))
    doc = dict(report)
    try:
        fields = report_fields(doc)
    except ValueError as exc:
        raise UnsupportedStateError(f"cannot write the training report: {exc}") from None
    data = pretty(doc)
    if os.path.lexists(directory):
        _require_dir(directory)
        manifest = _existing(directory, MANIFEST_FILE)
        if manifest is not None:
            check(directory, fields, manifest)
    try:
        os.makedirs(directory, exist_ok=True)
        atomic.replace_file(os.path.join(directory, REPORT_FILE), data)
    except OSError as exc:
        raise _files.write_error(os.path.join(directory, REPORT_FILE), exc) from exc


# ---------------------------------------------------------------------------------------------
# sweeps
# ---------------------------------------------------------------------------------------------


@dataclass
class Sweep:
    """A sweep directory: the comparison report and each variant's artifact, by slug."""

    path: str
    comparison: dict[str, Any]
    artifacts: dict[str, TrainingArtifact]


def save_comparison(path: str | os.PathLike[str], comparison: Mapping[str, Any]) -> None:
    """Write ``training_comparison.json`` into the directory ``path`` (created if needed),
    atomically."""
    directory = os.path.abspath(local_path(path, what="training artifact"))
    data = pretty(dict(comparison))
    try:
        os.makedirs(directory, exist_ok=True)
        atomic.replace_file(os.path.join(directory, COMPARISON_FILE), data)
    except OSError as exc:
        raise _files.write_error(os.path.join(directory, COMPARISON_FILE), exc) from exc


def load_comparison(path: str | os.PathLike[str]) -> dict[str, Any]:
    directory = os.path.abspath(local_path(path, what="training artifact"))
    _require_dir(directory)
    return _document(directory, COMPARISON_FILE, "every sweep has one")


def _check_slug(slug: Any) -> str:
    if not isinstance(slug, str) or slug in ("", ".", "..") or "/" in slug or "\x00" in slug:
        raise UnsupportedStateError(f"variant slug {slug!r} is not a plain directory name")
    return slug


def save_sweep(
    path: str | os.PathLike[str],
    comparison: Mapping[str, Any],
    outcomes: Mapping[str, Outcome],
) -> list[CheckpointManifest]:
    """The seed's ``save_training_sweep``: the comparison, then each outcome's artifact in the
    subdirectory named by its variant's slug (the keys of ``outcomes``)."""
    for slug in outcomes:
        _check_slug(slug)
    directory = os.path.abspath(local_path(path, what="training artifact"))
    save_comparison(directory, comparison)
    return [
        save(
            os.path.join(directory, slug),
            o.model,
            o.report,
            optimizer_state=o.optimizer_state,
            best_validation_model=o.best_validation_model,
            num_params=o.num_params,
            ids=o.ids,
            metadata=o.metadata,
        )
        for slug, o in outcomes.items()
    ]


def load_sweep(path: str | os.PathLike[str], *, framework: Framework = "numpy") -> Sweep:
    """The comparison report and every subdirectory that is a training artifact, by name."""
    directory = os.path.abspath(local_path(path, what="training artifact"))
    comparison = load_comparison(directory)
    artifacts = {
        name: load(os.path.join(directory, name), framework=framework)
        for name in sorted(os.listdir(directory))
        if not name.startswith(".") and is_artifact(os.path.join(directory, name))
    }
    return Sweep(directory, comparison, artifacts)
