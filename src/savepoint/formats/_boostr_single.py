"""boostr single checkpoint directories: ``training_state.json``, the safetensors files, reading
and writing. The format is specified in :mod:`savepoint.formats.boostr`, the public interface."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from savepoint.codecs import bounded_json as _json
from savepoint.codecs import serde_text
from savepoint.errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)
from savepoint.formats import _files
from savepoint.formats._files import LazyTensor, SafetensorsFile
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.state import arrays
from savepoint.state.arrays import TensorSource
from savepoint.storage import local
from savepoint.storage.paths import local_path

if TYPE_CHECKING:
    from savepoint.formats._boostr_distributed import ShardingMeta

CHECKPOINT_VERSION = 2
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "training_state.json"
SHARDING = "sharding_meta.json"
MAX_JSON_BYTES = 64 << 20
RANK_DIR = re.compile(r"rank_(0|[1-9][0-9]*)")
_U64 = 1 << 64
Framework = Literal["numpy", "torch"]


class Bad(CorruptCheckpointError):
    """A malformed JSON document (a CorruptCheckpointError); the readers re-raise it with the
    file's path."""


def uint(doc: dict[str, Any], key: str, default: int | None, bound: int = _U64) -> int:
    """Member ``key`` as serde reads an unsigned integer field: a JSON integer in ``[0, bound)``
    (not a bool, not a float such as ``5.0`` or ``-0``), ``default`` when absent."""
    value = doc.get(key, default)
    if value is None:
        raise Bad(f"{key!r} is {'missing' if key not in doc else 'null'}")
    if type(value) is not int or not 0 <= value < bound:
        raise Bad(f"{key!r} must be an integer in [0, {bound}), got {show(value)}")
    return value


def show(value: Any) -> str:
    """``repr(value)``, shortened: a hostile number can have thousands of digits."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def read_json(path: str, what: str) -> Any:
    """The JSON object in ``path``, read through ``local.open_read`` (never blocks on a FIFO,
    refuses symlinks; an unreadable file is CheckpointPermissionError) and the bounded JSON
    reader, with serde's number rules (see :func:`savepoint.codecs.bounded_json.loads`)."""
    try:
        raw = local.read_small(path, cap=MAX_JSON_BYTES)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing ({what})", path=path) from None
    doc = _json.loads(raw, CorruptCheckpointError, str(path), serde=True)
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path} is not a JSON object", path=path)
    return doc


@dataclass
class TrainingState:
    """``training_state.json``. ``version`` is what was read (1 when absent); writes use 2."""

    step: int = 0
    epoch: int = 0
    learning_rate: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    version: int = CHECKPOINT_VERSION

    @classmethod
    def parse(cls, doc: dict[str, Any]) -> TrainingState:
        """Validate a parsed document (raises ValueError with the reason)."""
        version = uint(doc, "version", 1, 1 << 32)
        if version == 0:
            raise Bad("'version' 0 does not exist (versions start at 1)")
        if version > CHECKPOINT_VERSION:
            raise IncompatibleCheckpointError(
                f"training_state.json version {version} is newer than the versions savepoint "
                f"reads (1-{CHECKPOINT_VERSION})"
            )
        lr = doc.get("learning_rate", 0.0)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise Bad(f"'learning_rate' must be a number, got {show(lr)}")
        try:
            lr = float(lr)  # serde reads an integer as the nearest f64
        except OverflowError:  # an integer literal of more than 308 digits
            lr = math.inf
        if not math.isfinite(lr):
            raise Bad("'learning_rate' is out of range for a 64-bit float (serde refuses it)")
        metadata = doc.get("metadata", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise Bad("'metadata' must map strings to strings")
        return cls(
            step=uint(doc, "step", None),
            epoch=uint(doc, "epoch", 0),
            learning_rate=lr,
            metadata=dict(metadata),
            version=version,
        )

    def to_json(self) -> bytes:
        """The document the seed's writer produces (always the current version)."""
        step, epoch = check_uint(self.step, "step"), check_uint(self.epoch, "epoch")
        lr = self.learning_rate
        if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating, np.integer)):
            raise UnsupportedStateError(f"learning_rate must be a number, got {type(lr).__name__}")
        if not math.isfinite(float(lr)):
            raise UnsupportedStateError(
                f"learning_rate {lr} cannot be written: serde writes non-finite numbers as null, "
                "which boostr cannot read back"
            )
        if not isinstance(self.metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.metadata.items()
        ):
            raise UnsupportedStateError("boostr metadata must map strings to strings")
        doc = {
            "version": CHECKPOINT_VERSION,
            "step": step,
            "epoch": epoch,
            "learning_rate": float(lr),
            "metadata": dict(self.metadata),
        }
        return serde_text.dumps(doc, indent=2).encode("utf-8")


def check_uint(value: Any, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise UnsupportedStateError(f"{what} must be an integer, got {type(value).__name__}")
    if not 0 <= int(value) < _U64:
        raise UnsupportedStateError(f"{what} {int(value)} does not fit boostr's u64 field")
    return int(value)


def read_training_state(directory: str | os.PathLike[str]) -> TrainingState:
    path = os.path.join(os.fspath(directory), STATE)
    doc = read_json(path, "every boostr checkpoint has one")
    try:
        return TrainingState.parse(doc)
    except IncompatibleCheckpointError as exc:
        raise IncompatibleCheckpointError(f"{path}: {exc}", path=path) from None
    except Bad as exc:
        raise CorruptCheckpointError(f"{path}: {exc}", path=path) from None


@dataclass
class BoostrCheckpoint:
    """A boostr checkpoint in memory: named tensors (numpy arrays or torch tensors)."""

    model: dict[str, Any]
    optimizer: dict[str, Any] | None = None
    state: TrainingState = field(default_factory=TrainingState)


class BoostrDirectory:
    """A boostr checkpoint opened without reading tensor data (a single checkpoint, or the
    consolidated view of a distributed one): ``model`` and ``optimizer`` map names to lazy tensors.
    Close it (or use ``with``) when done."""

    def __init__(
        self,
        path: str,
        model: dict[str, LazyTensor],
        optimizer: dict[str, LazyTensor] | None,
        state: TrainingState,
        files: list[SafetensorsFile],
        *,
        meta: ShardingMeta | None = None,
        sources: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.model = model
        self.optimizer = optimizer
        self.state = state
        self.meta = meta
        self.files = files  # the opened safetensors files, closed by close()
        self._sources = sources or {}

    def __enter__(self) -> BoostrDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self.files:
            f.close()

    def tree(self) -> dict[str, Any]:
        """``{"model": {...}, "optimizer": {...} (when present), "step", "epoch",
        "learning_rate"}``; the metadata map is ``state.metadata``."""
        tree: dict[str, Any] = {"model": dict(self.model)}
        if self.optimizer is not None:
            tree["optimizer"] = dict(self.optimizer)
        tree.update(
            step=self.state.step, epoch=self.state.epoch, learning_rate=self.state.learning_rate
        )
        return tree

    def load(self, framework: Framework = "numpy") -> BoostrCheckpoint:
        def get(t: LazyTensor) -> Any:
            array = np.array(t.load())  # a private, writable copy
            return _files.to_framework(array, t.dtype, framework)

        return BoostrCheckpoint(
            model={k: get(t) for k, t in self.model.items()},
            optimizer=None
            if self.optimizer is None
            else {k: get(t) for k, t in self.optimizer.items()},
            state=self.state,
        )

    def info(self) -> CheckpointInfo:
        def entries(prefix: str, tensors: dict[str, LazyTensor], file: str) -> list[TensorInfo]:
            out = []
            for k, t in tensors.items():
                key = f"{prefix}/{k}"
                source = self._sources.get(key, file)
                out.append(TensorInfo(key, t.dtype.name, t.shape, t.nbytes, source, key))
            return out

        tensors = entries("model", self.model, MODEL)
        if self.optimizer is not None:
            tensors += entries("optimizer", self.optimizer, OPTIMIZER)
        values: dict[str, Any] = {
            "step": self.state.step,
            "epoch": self.state.epoch,
            "learning_rate": self.state.learning_rate,
        }
        files = {os.path.relpath(f.path, self.path): f.size for f in self.files}
        no_checksums = (
            "boostr checkpoints have no checksums: verify checks structure and sizes only"
        )
        if self.meta is None:
            return self._info(tensors, values, files, "boostr", self.state.version, no_checksums)
        first = self.meta.shards[0] if self.meta.shards else None
        values["world_size"] = self.meta.world_size
        if first is not None:
            values["strategy"] = first.strategy + (
                f" (stage {first.stage})" if first.stage is not None else ""
            )
        return self._info(
            tensors,
            values,
            files,
            "boostr-distributed",
            self.meta.version,
            "tensors as consolidated from the ranks (file: where they come from)",
            no_checksums,
        )

    def _info(
        self,
        tensors: list[TensorInfo],
        values: dict[str, Any],
        files: dict[str, int],
        fmt: str,
        version: int,
        *notes: str,
    ) -> CheckpointInfo:
        return CheckpointInfo(
            path=self.path,
            format_version=version,
            writer="",
            created="",
            metadata=dict(self.state.metadata),
            tensors=tuple(tensors),
            values=values,
            files=files,
            format=fmt,
            notes=notes,
        )


def corrupt(path: str, message: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {message}", path=path)


def require_dir(path: str) -> None:
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}", path=path)
    if not os.path.isdir(path):
        raise CorruptCheckpointError(f"{path} is not a directory", path=path)


class Rank:
    """The files of one single checkpoint directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.state = read_training_state(directory)
        model_path = os.path.join(directory, MODEL)
        if not os.path.lexists(model_path):
            raise corrupt(directory, f"{MODEL} is missing (every boostr checkpoint has one)")
        self.files: list[SafetensorsFile] = [SafetensorsFile(model_path)]
        self.model = self.files[0]
        self.optimizer: SafetensorsFile | None = None
        try:
            opt_path = os.path.join(directory, OPTIMIZER)
            if os.path.lexists(opt_path):
                self.optimizer = SafetensorsFile(opt_path)
                self.files.append(self.optimizer)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for f in self.files:
            f.close()


def all_tensors(file: SafetensorsFile | None) -> dict[str, LazyTensor] | None:
    return None if file is None else {n: file.tensor(n) for n in file.names()}


def open_checkpoint(path: str | os.PathLike[str]) -> BoostrDirectory:
    """Open a single boostr checkpoint directory (structure checked, no tensor data read)."""
    directory = os.path.abspath(local_path(path, what="boostr checkpoint"))
    require_dir(directory)
    rank = Rank(directory)
    model = all_tensors(rank.model)
    assert model is not None
    return BoostrDirectory(directory, model, all_tensors(rank.optimizer), rank.state, rank.files)


def load(path: str | os.PathLike[str], *, framework: Framework = "numpy") -> BoostrCheckpoint:
    """Read a single boostr checkpoint into memory (the seed's ``load_checkpoint``)."""
    with open_checkpoint(path) as d:
        return d.load(framework)


def tensor_sources(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], what: str
) -> list[tuple[str, TensorSource]]:
    """``tensors`` as (name, source) pairs, in order; UnsupportedStateError for a name that is
    not a str, is repeated or is ``__metadata__``, or a value that is not an array or tensor."""
    pairs = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    out: list[tuple[str, TensorSource]] = []
    seen: set[str] = set()
    for name, value in pairs:
        if not isinstance(name, str):
            raise UnsupportedStateError(f"{what} tensor name {name!r} is not a str")
        if name == "__metadata__" or name in seen:
            raise UnsupportedStateError(
                f"{what} tensor name {name!r} is reserved by safetensors or repeated", key=name
            )
        seen.add(name)
        if isinstance(value, LazyTensor):
            out.append((name, value))
            continue
        source = arrays.make_source(value, name)
        if source is None:
            raise UnsupportedStateError(
                f"{what} {name!r}: a {type(value).__name__} is not a numpy array or torch tensor",
                key=name,
            )
        out.append((name, source))
    return out


def check_replaceable(target: str) -> None:
    """Refuse (CheckpointWriteError) to write over ``target`` unless it is absent, an empty
    directory, or a single or distributed boostr checkpoint."""
    try:
        foreign = os.path.lexists(target) and (
            not os.path.isdir(target)
            or (
                bool(os.listdir(target))
                and not os.path.isfile(os.path.join(target, STATE))
                and not os.path.isfile(os.path.join(target, SHARDING))
            )
        )
    except OSError as exc:
        raise _files.write_error(target, exc) from None
    if foreign:
        raise CheckpointWriteError(
            f"{target} exists and is not a boostr checkpoint directory; refusing to replace it",
            path=target,
        )


def write(
    path: str | os.PathLike[str],
    model: Mapping[str, Any] | Iterable[tuple[str, Any]],
    optimizer: Mapping[str, Any] | Iterable[tuple[str, Any]] | None,
    state: TrainingState,
) -> None:
    """Write a single checkpoint directory atomically (tensors may be lazy: they are streamed).

    An existing boostr checkpoint at ``path`` is replaced in one step; any other non-empty
    directory there is refused.
    """
    target = os.path.abspath(local_path(path, what="boostr checkpoint"))
    check_replaceable(target)
    model_items = tensor_sources(model, "model")
    opt_items = tensor_sources(optimizer, "optimizer") if optimizer is not None else []
    document = state.to_json()
    with _files.atomic_directory(target, what="boostr checkpoint") as staging:
        _files.write_safetensors(os.path.join(staging, MODEL), model_items)
        if opt_items:
            _files.write_safetensors(os.path.join(staging, OPTIMIZER), opt_items)
        local.write_small(os.path.join(staging, STATE), document)


def save(
    path: str | os.PathLike[str],
    model: Mapping[str, Any],
    optimizer: Mapping[str, Any] | None = None,
    state: TrainingState | None = None,
) -> None:
    """The seed's ``save_checkpoint``: ``model`` and ``optimizer`` map names to arrays or tensors."""
    write(path, model, optimizer, state or TrainingState())
