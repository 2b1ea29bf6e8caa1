"""InferenceSnapshot: the state a streaming model carries from step to step, captured at one step.

A state-space model, an RNN or a transformer with a KV cache carries state between steps. A
snapshot captures it whole: per-layer hidden states (arrays of any shape and stored dtype, numpy
or torch: the seed's hidden_dim x state_dim float32 matrices are one case), the input history (a
sequence of arrays, oldest first), the step count, the runtime's config (a JSON mapping) and
metadata (creation timestamp in whole seconds since the epoch, description, model id, tags: the
seed's four fields, with its defaults ``""``, ``"unknown"``, no tags).

Contract:

- Constructing a snapshot copies every array (a numpy array into a new C-contiguous, native-order
  numpy array, set read-only; a torch tensor into a new tensor on the same device, detached), so
  the model may keep changing its state. The fields give back exactly what was captured: same
  kind (numpy or torch), dtype, shape and bits, the step count included (the seed's restore loses
  it; this one does not). Snapshot arrays are not to be modified: numpy ones are read-only, torch
  has no read-only tensors, so that is on the caller. ``restore_into`` copies a snapshot back
  into the model's live arrays and lists.
- Only numpy arrays (and numpy scalars, kept as 0-d arrays) and torch tensors are accepted as
  arrays; a Python list is refused rather than guessed into a dtype.
- Config is checked and deep-copied at capture: string keys, lists, str, bool, None, int in
  [-2**63, 2**64), finite float, at most 64 levels deep: exactly what every encoding round-trips.
  ``config`` returns a fresh copy each time.

Encodings (every one round-trips every field bit for bit; readers treat input as hostile and
raise CheckpointError subclasses: CorruptCheckpointError when malformed,
IncompatibleCheckpointError for an unknown version):

==================  =========================================  ==================================
method              what                                       see
==================  =========================================  ==================================
save / load         a savepoint checkpoint directory (atomic,  below
                    checksummed); ``savepoint inspect`` reads it
to_bytes /          one safetensors blob: compact, fastest,    :mod:`savepoint.codecs.snapshot`
from_bytes          zero-copy decode
to_json /           the seed's serde JSON layout, readable by  :mod:`savepoint.codecs.kizzasi`
from_json           the seed for float32 states
to_seed_bytes /     the seed's ``to_bytes`` / ``from_bytes``:  :mod:`savepoint.codecs.kizzasi`
from_seed_bytes     that JSON, compact, as UTF-8 bytes
to_msgpack /        the same document as MessagePack           :mod:`savepoint.codecs.kizzasi`
from_msgpack
save_json /         the seed's files: pretty JSON (its         :mod:`savepoint.inference._files`
load_json,          ``save_json``) or MessagePack (its
save_msgpack /      ``save_msgpack``), written atomically
load_msgpack
==================  =========================================  ==================================

Why ``to_seed_bytes`` and not ``to_bytes``: in the seed, ``Checkpoint::to_bytes`` is
``serde_json::to_vec`` (the compact JSON document), while savepoint's ``to_bytes`` is its own
binary encoding (a safetensors blob, about 4x smaller for float32 and decoded without copying)
that pickling and ``SnapshotHistory`` rely on. One name cannot mean both, so the seed's bytes get
the seed's name with ``seed`` in it; :func:`savepoint.codecs.kizzasi.to_bytes` and
:func:`savepoint.codecs.kizzasi.from_bytes` are the same encoding on a record, under the seed's
own names in the module that is the seed's layout.

Metadata builders (the seed's ``with_description``, ``with_model_id``, ``with_tag``, plus
``with_metadata``) return a new snapshot with the metadata changed and the very same arrays: no
array is copied (snapshot arrays are never modified, so sharing them is safe).

Native layout (``save``): ``sp.save(path, {"states": [...], "history": [...]}, metadata=...)``
with the manifest metadata ``{"inference_snapshot": {"version": 1, "step_count": n, "config":
{...}, "metadata": {"timestamp", "description", "model_id", "tags"}, "states": count, "history":
count}}``. ``load`` checks that record and that the checkpoint holds exactly the tensors
``states/0..`` and ``history/0..`` before reading any data.

Readers take ``framework``: ``"auto"`` gives each array back as captured (numpy, or a CPU torch
tensor; numpy where torch cannot be imported, as ``sp.load`` does), ``"numpy"`` or ``"torch"``
force one. Pickling goes through ``to_bytes``, so a snapshot crosses process boundaries
(multiprocessing, concurrent.futures) exactly and compactly.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from savepoint import checkpoint
from savepoint.codecs import kizzasi
from savepoint.codecs import snapshot as snapshot_format
from savepoint.codecs.dtypes import DType
from savepoint.codecs.snapshot import RecordError, SnapshotRecord
from savepoint.errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    StateMismatchError,
    UnsupportedStateError,
)
from savepoint.inference import _arrays, _files
from savepoint.info import CheckpointInfo
from savepoint.state import arrays
from savepoint.storage.paths import PathArg, resolve

__all__ = [
    "Framework",
    "InferenceSnapshot",
    "NATIVE_KEY",
    "PathLike",
    "SnapshotMetadata",
    "VERSION",
]

VERSION = snapshot_format.VERSION
NATIVE_KEY = "inference_snapshot"
Framework = Literal["auto", "numpy", "torch"]
PathLike = PathArg


def _now() -> int:
    return int(time.time())


@dataclass(frozen=True)
class SnapshotMetadata:
    """The seed's metadata: ``timestamp`` (whole seconds since the Unix epoch, now by default),
    ``description``, ``model_id`` (``"unknown"`` by default) and ``tags``."""

    timestamp: int = field(default_factory=_now)
    description: str = ""
    model_id: str = "unknown"
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        tags: Any = self.tags  # a caller may pass a list (or a str, by mistake)
        if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):
            raise UnsupportedStateError("metadata tags must be a list of strings", key="metadata")
        tags = tuple(tags)
        try:
            snapshot_format.check_metadata(self.timestamp, self.description, self.model_id, tags)
            timestamp = snapshot_format.check_count(self.timestamp, "metadata timestamp")
        except RecordError as exc:
            raise UnsupportedStateError(str(exc), key="metadata") from None
        object.__setattr__(self, "timestamp", timestamp)
        object.__setattr__(self, "tags", tags)

    @classmethod
    def coerce(cls, value: Any) -> SnapshotMetadata:
        """``value`` as metadata: None (defaults), a SnapshotMetadata, a mapping or a dataclass
        with (some of) the four fields."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if not isinstance(value, Mapping):
            raise UnsupportedStateError(
                f"metadata must be a mapping or SnapshotMetadata, got {type(value).__name__}",
                key="metadata",
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(value) - names))
        if unknown:
            raise UnsupportedStateError(
                f"unknown metadata field(s) {', '.join(unknown)}; the fields are timestamp, "
                "description, model_id, tags (put anything else in config)",
                key="metadata",
            )
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "timestamp": self.timestamp,
            "description": self.description,
            "model_id": self.model_id,
            "tags": list(self.tags),
        }


# ---------------------------------------------------------------------------------------------
# the snapshot
# ---------------------------------------------------------------------------------------------


class _Prepared(NamedTuple):
    states: list[tuple[Any, str, DType]]
    history: list[tuple[Any, str, DType]]
    step_count: int
    config: dict[str, Any]
    metadata: SnapshotMetadata


class InferenceSnapshot:
    """A copy of a streaming model's state at one step; see the module docstring.

    ``InferenceSnapshot(states=[...], history=[...], step_count=n, config={...}, metadata=...)``
    copies the arrays it is given; ``metadata`` is a SnapshotMetadata, a mapping with (some of)
    its four fields, or None for the defaults (timestamp: now).
    """

    __slots__ = ("_buffers", "_config", "_history", "_metadata", "_states", "_step_count")

    _states: tuple[Any, ...]
    _history: tuple[Any, ...]
    # (exposed, writable buffers) for states and history when this snapshot made its own copies
    # (None when decoded or loaded): what SnapshotHistory.take may refill.
    _buffers: tuple[tuple[tuple[Any, ...], tuple[Any, ...]], ...] | None
    _step_count: int
    _config: dict[str, Any]
    _metadata: SnapshotMetadata

    def __init__(
        self,
        *,
        states: Iterable[Any],
        history: Iterable[Any] = (),
        step_count: int = 0,
        config: Mapping[str, Any] | None = None,
        metadata: SnapshotMetadata | Mapping[str, Any] | None = None,
        version: int = VERSION,
    ) -> None:
        self._fill(self._prepare(states, history, step_count, config, metadata, version), None)

    @classmethod
    def _prepare(
        cls,
        states: Iterable[Any],
        history: Iterable[Any],
        step_count: int,
        config: Mapping[str, Any] | None,
        metadata: SnapshotMetadata | Mapping[str, Any] | None,
        version: int = VERSION,
    ) -> _Prepared:
        """Check every input; nothing is copied yet."""
        if version != VERSION:
            raise IncompatibleCheckpointError(
                f"inference snapshot version {version!r}; this savepoint writes version {VERSION}"
            )
        try:
            step = snapshot_format.check_count(step_count, "step_count")
            if config is not None and not isinstance(config, Mapping):
                raise RecordError(f"config must be a mapping, got {type(config).__name__}")
            cfg = snapshot_format.check_config({} if config is None else config)
        except RecordError as exc:
            raise UnsupportedStateError(str(exc)) from None
        meta = SnapshotMetadata.coerce(metadata)
        return _Prepared(
            _arrays.leaves(states, "states"), _arrays.leaves(history, "history"), step, cfg, meta
        )

    @classmethod
    def _build(cls, prepared: _Prepared, reuse: InferenceSnapshot | None) -> InferenceSnapshot:
        """Copy the prepared inputs, into ``reuse``'s buffers where dtype, shape and device
        match (SnapshotHistory hands over a snapshot nobody else can see)."""
        snap = cls.__new__(cls)
        snap._fill(prepared, reuse)
        return snap

    def _fill(self, prepared: _Prepared, reuse: InferenceSnapshot | None) -> None:
        old = reuse._buffers if reuse is not None else None
        captured = []
        for role, leaves in enumerate((prepared.states, prepared.history)):
            pairs = list(zip(*old[role])) if old is not None else []
            captured.append(
                [
                    _arrays.capture(obj, kind, d, pairs[i] if i < len(pairs) else None)
                    for i, (obj, kind, d) in enumerate(leaves)
                ]
            )
        self._states = tuple(view for view, _ in captured[0])
        self._history = tuple(view for view, _ in captured[1])
        self._buffers = (
            (self._states, tuple(buffer for _, buffer in captured[0])),
            (self._history, tuple(buffer for _, buffer in captured[1])),
        )
        self._step_count = prepared.step_count
        self._config = prepared.config
        self._metadata = prepared.metadata

    # -- fields ------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The snapshot format version (1, the seed's CHECKPOINT_VERSION)."""
        return VERSION

    @property
    def states(self) -> tuple[Any, ...]:
        """Per-layer hidden states, as captured (do not modify them)."""
        return self._states

    @property
    def history(self) -> tuple[Any, ...]:
        """The input history, oldest first, as captured (do not modify it)."""
        return self._history

    @property
    def step_count(self) -> int:
        return self._step_count

    @property
    def config(self) -> dict[str, Any]:
        """A fresh deep copy of the runtime config."""
        copied: dict[str, Any] = snapshot_format.check_config(self._config)
        return copied

    @property
    def metadata(self) -> SnapshotMetadata:
        return self._metadata

    @property
    def nbytes(self) -> int:
        """Bytes of array data (states and history)."""
        return sum(
            _arrays.dtype_of(a).itemsize * int(np.prod(a.shape))
            for a in self._states + self._history
        )

    # -- metadata builders (the seed's with_*) ----------------------------------------------

    def with_metadata(
        self, metadata: SnapshotMetadata | Mapping[str, Any] | None
    ) -> InferenceSnapshot:
        """A new snapshot with ``metadata`` (as the constructor takes it) and this one's arrays,
        step count and config: the arrays are shared, not copied."""
        meta = SnapshotMetadata.coerce(metadata)
        snap = type(self).__new__(type(self))
        # The new snapshot made no copies of its own: nothing of it may be refilled (_buffers),
        # and this one is held by the caller, so no history refills it either.
        snap._buffers = None
        snap._states = self._states
        snap._history = self._history
        snap._step_count = self._step_count
        snap._config = self._config  # never modified in place (config returns copies)
        snap._metadata = meta
        return snap

    def with_description(self, description: str) -> InferenceSnapshot:
        """The seed's ``with_description``: a new snapshot sharing this one's arrays."""
        return self.with_metadata(dataclasses.replace(self._metadata, description=description))

    def with_model_id(self, model_id: str) -> InferenceSnapshot:
        """The seed's ``with_model_id``: a new snapshot sharing this one's arrays."""
        return self.with_metadata(dataclasses.replace(self._metadata, model_id=model_id))

    def with_tag(self, tag: str) -> InferenceSnapshot:
        """The seed's ``with_tag``: a new snapshot with ``tag`` appended to the tags (as the seed
        pushes it), sharing this one's arrays."""
        tags = (*self._metadata.tags, tag)
        return self.with_metadata(dataclasses.replace(self._metadata, tags=tags))

    # -- restoring ---------------------------------------------------------------------------

    def restore_into(
        self,
        states: Iterable[Any] | None = None,
        history: MutableSequence[Any] | None = None,
    ) -> None:
        """Copy the snapshot back into a model's live state.

        ``states``: one target per snapshot state (numpy arrays or torch tensors, any device),
        each filled in place; dtypes and shapes must match exactly. ``history``: a list or deque
        whose contents are replaced by the snapshot's history; an element already there is
        reused (filled in place) when its kind, dtype and shape match, others are fresh
        writable copies. Every problem is reported in one StateMismatchError before anything is
        modified.
        """
        problems: list[tuple[str, str]] = []
        targets = list(states) if states is not None else None
        if targets is not None:
            if len(targets) != len(self._states):
                problems.append(
                    ("states", f"{len(self._states)} in the snapshot, {len(targets)} targets")
                )
            else:
                for i, (target, src) in enumerate(zip(targets, self._states)):
                    problem = _arrays.target_problem(target, src)
                    if problem is not None:
                        problems.append((f"states/{i}", problem))
        live: Any = history  # typed as MutableSequence, but checked: callers pass anything
        if live is not None and not isinstance(live, MutableSequence):
            problems.append(("history", f"expected a list or deque, got {type(history).__name__}"))
        if problems:
            raise StateMismatchError(problems)
        if targets is not None:
            for target, src in zip(targets, self._states):
                _arrays.copy_into(target, src)
        if history is not None:
            old = list(history)
            used: set[int] = set()
            new = []
            for i, src in enumerate(self._history):
                target = old[i] if i < len(old) else None
                if (
                    target is not None
                    and id(target) not in used
                    and _arrays.kind_of(target) == _arrays.kind_of(src)
                    and _arrays.target_problem(target, src) is None
                ):
                    _arrays.copy_into(target, src)
                    used.add(id(target))
                    new.append(target)
                else:
                    new.append(_arrays.fresh(src))
            history.clear()
            history.extend(new)

    # -- encodings ---------------------------------------------------------------------------

    def _record(self) -> SnapshotRecord:
        meta = self._metadata
        return SnapshotRecord(
            states=[_arrays.host(a) for a in self._states],
            history=[_arrays.host(a) for a in self._history],
            step_count=self._step_count,
            config=self._config,
            timestamp=meta.timestamp,
            description=meta.description,
            model_id=meta.model_id,
            tags=list(meta.tags),
            state_kinds=[_arrays.kind_of(a) for a in self._states],
            history_kinds=[_arrays.kind_of(a) for a in self._history],
        )

    @classmethod
    def _from_record(cls, record: SnapshotRecord, framework: Framework) -> InferenceSnapshot:
        if framework not in ("auto", "numpy", "torch"):
            raise ValueError(f"framework must be 'auto', 'numpy' or 'torch', not {framework!r}")
        snap = cls.__new__(cls)
        snap._buffers = None
        snap._states = tuple(
            _arrays.adopt(a, k, framework) for a, k in zip(record.states, record.kinds("states"))
        )
        snap._history = tuple(
            _arrays.adopt(a, k, framework) for a, k in zip(record.history, record.kinds("history"))
        )
        snap._step_count = record.step_count
        snap._config = record.config
        snap._metadata = SnapshotMetadata(
            timestamp=record.timestamp,
            description=record.description,
            model_id=record.model_id,
            tags=tuple(record.tags),
        )
        return snap

    def to_json(self, *, indent: int | None = None) -> str:
        """The seed's serde JSON layout (compact; ``indent=2`` lays it out as the seed's
        ``save_json``), with savepoint's extra keys; see :mod:`savepoint.codecs.kizzasi`."""
        return kizzasi.encode_json(self._record(), indent=indent)

    @classmethod
    def from_json(
        cls, text: str | bytes | bytearray, *, framework: Framework = "auto"
    ) -> InferenceSnapshot:
        """Read what ``to_json`` or the seed's ``save_json`` / ``to_bytes`` wrote."""
        return cls._from_record(kizzasi.decode_json(text), framework)

    def to_msgpack(self) -> bytes:
        """The seed's MessagePack (structs as arrays of fields), numbers fixed width."""
        return kizzasi.encode_msgpack(self._record())

    @classmethod
    def from_msgpack(
        cls, data: bytes | bytearray | memoryview, *, framework: Framework = "auto"
    ) -> InferenceSnapshot:
        """Read what ``to_msgpack`` or the seed's ``save_msgpack`` wrote."""
        return cls._from_record(kizzasi.decode_msgpack(data), framework)

    def to_bytes(self) -> bytes:
        """The compact binary encoding (a safetensors blob); see :mod:`savepoint.codecs.snapshot`."""
        return snapshot_format.encode(self._record())

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, *, framework: Framework = "auto"
    ) -> InferenceSnapshot:
        """Read ``to_bytes`` output. numpy arrays are read-only views of ``data`` when it is
        ``bytes`` (no copy); copies otherwise."""
        return cls._from_record(snapshot_format.decode(data), framework)

    def to_seed_bytes(self) -> bytes:
        """The seed's ``to_bytes``: the compact JSON document (``to_json()``) as UTF-8 bytes.
        Not :meth:`to_bytes`, which is savepoint's own binary encoding."""
        return kizzasi.to_bytes(self._record())

    @classmethod
    def from_seed_bytes(
        cls, data: bytes | bytearray | memoryview, *, framework: Framework = "auto"
    ) -> InferenceSnapshot:
        """Read the seed's ``to_bytes`` output (or ``to_seed_bytes``): JSON as UTF-8 bytes."""
        return cls._from_record(kizzasi.from_bytes(data), framework)

    # -- files in the seed's encodings -------------------------------------------------------

    def save_json(self, path: PathLike) -> None:
        """Write the seed's ``save_json`` file: the JSON document laid out as serde_json's
        ``to_writer_pretty`` (``to_json(indent=2)``), atomically; see
        :mod:`savepoint.inference._files` for the guarantees and errors."""
        data = kizzasi.encode_json(self._record(), indent=2).encode("utf-8")
        _files.write(path, data, "kizzasi JSON snapshot")

    @classmethod
    def load_json(cls, path: PathLike, *, framework: Framework = "auto") -> InferenceSnapshot:
        """Read a file written by ``save_json`` (this one's or the seed's), or any JSON that
        ``from_json`` reads; errors are CheckpointError subclasses."""
        data = _files.read(path, "kizzasi JSON snapshot")
        return cls._from_record(kizzasi.decode_json(data), framework)

    def save_msgpack(self, path: PathLike) -> None:
        """Write ``to_msgpack()`` to ``path`` atomically (the seed's ``save_msgpack``)."""
        _files.write(path, kizzasi.encode_msgpack(self._record()), "kizzasi MessagePack snapshot")

    @classmethod
    def load_msgpack(cls, path: PathLike, *, framework: Framework = "auto") -> InferenceSnapshot:
        """Read a file written by ``save_msgpack`` (this one's or the seed's, maps or arrays)."""
        data = _files.read(path, "kizzasi MessagePack snapshot")
        return cls._from_record(kizzasi.decode_msgpack(data), framework)

    def save(self, path: PathLike) -> CheckpointInfo:
        """Save as a savepoint checkpoint directory (atomic, durable, checksummed)."""
        meta = self._metadata
        record = {
            "version": VERSION,
            "step_count": self._step_count,
            "config": self._config,
            "metadata": meta.to_dict(),
            "states": len(self._states),
            "history": len(self._history),
        }
        state = {"states": list(self._states), "history": list(self._history)}
        return checkpoint.save(path, state, metadata={NATIVE_KEY: record})

    @classmethod
    def load(
        cls, path: PathLike, *, framework: Framework = "auto", verify: bool = True
    ) -> InferenceSnapshot:
        """Load what ``save`` wrote; the layout is checked before any data is read."""
        loc = resolve(path, what="snapshot path")
        where = loc.store.url(loc.path)
        info = checkpoint.inspect(loc)
        record = _native_record(info, where)
        if framework not in ("auto", "numpy", "torch"):
            raise ValueError(f"framework must be 'auto', 'numpy' or 'torch', not {framework!r}")
        tree = checkpoint.load(loc, framework=framework, verify=verify)
        loaded: dict[str, list[Any]] = {}
        for role in ("states", "history"):
            items = tree.get(role) if isinstance(tree, dict) else None
            if not isinstance(items, list) or len(items) != record[role]:
                raise CorruptCheckpointError(
                    f"{where}: {role} does not hold the {record[role]} arrays its record says",
                    path=where,
                )
            loaded[role] = items
        snap = cls.__new__(cls)
        snap._buffers = None
        snap._states = tuple(_adopt_loaded(a) for a in loaded["states"])
        snap._history = tuple(_adopt_loaded(a) for a in loaded["history"])
        snap._step_count = record["step_count"]
        snap._config = record["config"]
        try:
            snap._metadata = SnapshotMetadata.coerce(record["metadata"])
        except UnsupportedStateError as exc:
            raise CorruptCheckpointError(f"{where}: {exc}", path=where) from None
        return snap

    # -- comparison --------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        """Exact equality: every field, every array's kind, dtype, shape and bits."""
        if not isinstance(other, InferenceSnapshot):
            return NotImplemented
        return (
            self._step_count == other._step_count
            and self._metadata == other._metadata
            and _arrays.same_json(self._config, other._config)
            and len(self._states) == len(other._states)
            and len(self._history) == len(other._history)
            and all(map(_arrays.same, self._states, other._states))
            and all(map(_arrays.same, self._history, other._history))
        )

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        # Through the binary encoding: compact, exact, read-only again on the other side (torch
        # tensors arrive on the CPU). multiprocessing and concurrent.futures pickle this way.
        return (_from_bytes, (self.to_bytes(),))

    def __repr__(self) -> str:
        shapes = sorted({f"{_arrays.dtype_of(a).name}{list(a.shape)}" for a in self._states})
        return (
            f"InferenceSnapshot(step_count={self._step_count}, states={len(self._states)} "
            f"({', '.join(shapes[:3])}{', ...' if len(shapes) > 3 else ''}), "
            f"history={len(self._history)}, nbytes={self.nbytes}, "
            f"model_id={self._metadata.model_id!r})"
        )


def _from_bytes(data: bytes) -> InferenceSnapshot:
    return InferenceSnapshot.from_bytes(data)


def _adopt_loaded(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        a.flags.writeable = False
        return a
    if arrays.is_torch_tensor(a):
        return a
    raise CorruptCheckpointError(f"expected an array, found {type(a).__name__}")


def _native_record(info: CheckpointInfo, where: str) -> dict[str, Any]:
    """The checked ``inference_snapshot`` record of a checkpoint's manifest."""
    record = info.metadata.get(NATIVE_KEY)
    if not isinstance(record, dict):
        raise IncompatibleCheckpointError(
            f"{where} is a savepoint checkpoint but not an inference snapshot (no "
            f"{NATIVE_KEY!r} record in its metadata); load it with sp.load",
            path=where,
        )
    version = record.get("version")
    if not snapshot_format.is_count(version):
        raise CorruptCheckpointError(f"{where}: snapshot version must be an integer", path=where)
    if version != VERSION:
        raise IncompatibleCheckpointError(
            f"{where}: inference snapshot version {version}; this savepoint reads version "
            f"{VERSION}: upgrade savepoint to load it",
            path=where,
        )
    expected = {"version", "step_count", "config", "metadata", "states", "history"}
    try:
        if set(record) != expected:
            raise RecordError(
                f"the snapshot record must hold exactly {', '.join(sorted(expected))}"
            )
        snapshot_format.check_count(record["step_count"], "step_count")
        if not isinstance(record["config"], dict):
            raise RecordError("config must be an object")
        record = {**record, "config": snapshot_format.check_config(record["config"])}
        if not isinstance(record["metadata"], dict):
            raise RecordError("metadata must be an object")
        for role in ("states", "history"):
            snapshot_format.check_count(record[role], f"{role} count")
    except RecordError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}", path=where) from None
    names = {f"states/{i}" for i in range(record["states"])}
    names |= {f"history/{i}" for i in range(record["history"])}
    found = {t.key for t in info.tensors}
    if found != names or info.values or info.stateful:
        raise CorruptCheckpointError(
            f"{where}: the checkpoint must hold exactly the arrays states/0..{record['states'] - 1}"
            f" and history/0..{record['history'] - 1} and nothing else",
            path=where,
        )
    return record
