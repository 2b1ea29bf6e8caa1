"""Inference snapshots as plain data (:class:`SnapshotRecord`), and their compact binary encoding.

Every snapshot encoding (this one, the kizzasi JSON/MessagePack layout in
:mod:`savepoint.codecs.kizzasi`, the native checkpoint written by ``InferenceSnapshot.save``)
reads and writes a :class:`SnapshotRecord`: host numpy arrays plus plain values. The value checks
shared by every encoding live here too (:func:`check_config`, :func:`check_metadata`,
:func:`check_shape`), so that what one encoding accepts, every other can write.

Binary layout, version 1 (``InferenceSnapshot.to_bytes``): one safetensors file, so any
safetensors reader opens the arrays::

    u64 LE   N        length of the header
    N bytes  header   UTF-8 JSON object, padded with spaces to a multiple of 8 bytes
    rest     data     the arrays' raw little-endian bytes, back to back, no holes

The header holds one entry per array, ``{"dtype": "F32", "shape": [1024, 16], "data_offsets":
[b, e]}`` (offsets relative to the data), named ``states/<i>`` and ``history/<i>`` (decimal, no
leading zeros), plus ``"__metadata__"``, a str -> str map::

    "format":    "savepoint.inference_snapshot"
    "version":   "1"
    "xxh3":      XXH3-64 of the whole blob as written, with these 16 digits read as "0" x 16
                 (so the length prefix, every header byte and the data are all covered)
    "snapshot":  JSON text {"step_count": 12, "config": {...},
                            "metadata": {"timestamp": 1700000000, "description": "",
                                         "model_id": "unknown", "tags": []},
                            "states": 32, "history": 256, "torch": ["states/0", ...]}

``states``/``history`` count the arrays; ``torch`` names the arrays captured from torch tensors
(they come back as torch tensors). Arrays are laid out largest itemsize first, so with the header
padded to 8 bytes each starts at a multiple of its own itemsize.

Rules the reader enforces (hostile input): the safetensors rules of
:mod:`savepoint.codecs.safetensors` (header size cap, offsets inside the input that tile the
data exactly, sizes equal to shape x itemsize: nothing is allocated that the input does not hold);
``format`` must match (else CorruptCheckpointError) and ``version`` must be ``"1"`` (else
IncompatibleCheckpointError); the array names must be exactly ``states/0..n-1`` and
``history/0..m-1`` (the counts are checked against the header before any name is made); the
checksum must match; the record must be valid Unicode (no lone surrogate); BOOL arrays hold only
bytes 0 and 1 (numpy would take any byte as True, and the snapshot would then differ from its
own re-encoding); shapes have at most 64 dimensions and a nominal size
(zero dimensions counted as one) below 2**62 bytes. Arrays come back as read-only views of the
input when it is ``bytes`` (no copy), copied otherwise. Empty snapshots (no arrays) are a header
alone; 0-d arrays have ``"shape": []``.

Why a safetensors blob rather than MessagePack behind a magic prefix: the arrays stay raw
little-endian bytes (one copy to write, none to read), any safetensors reader can open them, and
the header goes through the same hostile-input checks as every checkpoint data file. The
checksum makes a damaged blob an error instead of a silently different snapshot.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from savepoint.codecs import bounded_json as _json
from savepoint.codecs import checksum, dtypes, safetensors
from savepoint.errors import CorruptCheckpointError, IncompatibleCheckpointError

__all__ = [
    "FORMAT",
    "I64_MIN",
    "KINDS",
    "MAX_CONFIG_DEPTH",
    "MAX_DIMS",
    "MAX_NOMINAL_BYTES",
    "RecordError",
    "SnapshotRecord",
    "U64_LIMIT",
    "VERSION",
    "check_config",
    "check_count",
    "check_metadata",
    "check_record",
    "check_shape",
    "check_text",
    "decode",
    "encode",
    "is_count",
    "show",
]

VERSION = 1
FORMAT = "savepoint.inference_snapshot"
MAX_DIMS = 64
MAX_NOMINAL_BYTES = 1 << 62
MAX_CONFIG_DEPTH = 64
U64_LIMIT = 1 << 64
I64_MIN = -(1 << 63)
KINDS = ("numpy", "torch")
_ZERO_DIGEST = "0" * 16
_DIGEST = re.compile(rb'"xxh3"\s*:\s*"([0-9a-f]{16})"')


class RecordError(ValueError):
    """A value a snapshot cannot hold; callers turn it into the right CheckpointError."""


@dataclass
class SnapshotRecord:
    """A snapshot as plain data: host numpy arrays (any shape, any stored dtype) and values.

    ``state_kinds`` / ``history_kinds`` say, per array, whether it was captured from numpy or from
    torch ("numpy" / "torch"); empty lists mean all numpy. ``timestamp`` is whole seconds since
    the Unix epoch (the seed's ``u64``).
    """

    states: list[np.ndarray[Any, Any]]
    history: list[np.ndarray[Any, Any]] = field(default_factory=list)
    step_count: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    timestamp: int = 0
    description: str = ""
    model_id: str = "unknown"
    tags: list[str] = field(default_factory=list)
    state_kinds: list[str] = field(default_factory=list)
    history_kinds: list[str] = field(default_factory=list)
    version: int = VERSION

    def kinds(self, role: str) -> list[str]:
        arrays, kinds = (
            (self.states, self.state_kinds)
            if role == "states"
            else (self.history, self.history_kinds)
        )
        return kinds if kinds else ["numpy"] * len(arrays)


# ---------------------------------------------------------------------------------------------
# value checks shared by every encoding
# ---------------------------------------------------------------------------------------------


def show(x: Any, limit: int = 40) -> str:
    """A short description of a decoded value for an error message: bounded in size and cost
    whatever the value (no ``repr`` of a deep or huge structure, no 5000-digit integer)."""
    if x is None or isinstance(x, (bool, float)):
        return repr(x)
    if isinstance(x, int):
        return repr(x) if x.bit_length() <= 128 else f"an integer of {x.bit_length()} bits"
    if isinstance(x, str):
        return repr(x[:limit]) + ("..." if len(x) > limit else "")
    if isinstance(x, (list, tuple, dict, bytes, bytearray)):
        return f"a {type(x).__name__} of {len(x)} items"
    return f"a {type(x).__name__}"


def is_count(x: Any, limit: int = U64_LIMIT) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < limit


def check_count(x: Any, what: str) -> int:
    """``x`` as an int in [0, 2**64) (numpy integers accepted), or RecordError."""
    if isinstance(x, np.integer):
        x = int(x)
    if not is_count(x):
        raise RecordError(f"{what} must be an integer in [0, 2**64), got {show(x)}")
    return int(x)


def check_text(x: Any, what: str) -> str:
    if not isinstance(x, str):
        raise RecordError(f"{what} must be a string, got {type(x).__name__}")
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        raise RecordError(f"{what} is not valid Unicode (lone surrogate)") from None
    return str(x)


def _where(path: tuple[Any, ...]) -> str:
    # Built only for a message: a path of long keys is never joined level by level.
    return "/".join(show(p, 20).strip("'") if isinstance(p, str) else str(p) for p in path)


def check_config(value: Any, where: str = "config", *, copy: bool = True) -> Any:
    """A deep copy of a JSON value that every encoding round-trips exactly, or RecordError.

    Objects have string keys; numbers are int in [-2**63, 2**64) (MessagePack's range) or finite
    float; tuples become lists; nesting is at most 64 levels deep. ``copy=False`` checks a value
    a decoder has just built (dicts, lists and scalars only) and returns it as it is, so a
    decoded config is never held twice.
    """
    return _checked(value, (where,), 0, copy)


def _checked(value: Any, path: tuple[Any, ...], depth: int, copy: bool) -> Any:
    if depth > MAX_CONFIG_DEPTH:
        raise RecordError(f"{_where(path[:3])}/...: nested deeper than {MAX_CONFIG_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not I64_MIN <= value < U64_LIMIT:
            raise RecordError(f"{_where(path)}: integer {show(value)} is outside [-2**63, 2**64)")
        return int(value) if copy else value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RecordError(f"{_where(path)}: {value!r} is not a finite number (JSON has no NaN)")
        return float(value) if copy else value
    if isinstance(value, str):
        _text(value, path)
        return str(value) if copy else value
    if isinstance(value, Mapping):
        if not copy and type(value) is not dict:
            raise RecordError(f"{_where(path)}: a {type(value).__name__} is not a JSON object")
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise RecordError(f"{_where(path)}: key {show(k)} is not a string")
            _text(k, path)
            checked = _checked(v, (*path, k), depth + 1, copy)
            if copy:
                out[str(k)] = checked
        return out if copy else value
    if isinstance(value, (list, tuple)):
        if not copy:
            if type(value) is not list:
                raise RecordError(f"{_where(path)}: a {type(value).__name__} is not a JSON list")
            for i, v in enumerate(value):
                _checked(v, (*path, i), depth + 1, False)
            return value
        return [_checked(v, (*path, i), depth + 1, True) for i, v in enumerate(value)]
    raise RecordError(
        f"{_where(path)}: a value of type {type(value).__name__} is not JSON (use dicts with "
        "string keys, lists, str, int, finite float, bool, None)"
    )


def _text(value: str, path: tuple[Any, ...]) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RecordError(
            f"{_where(path)}: a string is not valid Unicode (lone surrogate)"
        ) from None


def check_metadata(timestamp: Any, description: Any, model_id: Any, tags: Any) -> None:
    check_count(timestamp, "metadata timestamp (seconds since the epoch)")
    check_text(description, "metadata description")
    check_text(model_id, "metadata model_id")
    if not isinstance(tags, (list, tuple)):
        raise RecordError(f"metadata tags must be a list of strings, got {type(tags).__name__}")
    for i, tag in enumerate(tags):
        check_text(tag, f"metadata tags[{i}]")


def check_shape(shape: Any, itemsize: int, where: str) -> tuple[int, ...]:
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_DIMS
        or not all(is_count(s, MAX_NOMINAL_BYTES) for s in shape)
    ):
        raise RecordError(
            f"{where}: shape must be a list of at most {MAX_DIMS} non-negative integers"
        )
    if math.prod(max(int(s), 1) for s in shape) * itemsize >= MAX_NOMINAL_BYTES:
        raise RecordError(f"{where}: shape {list(shape)} is too large")
    return tuple(int(s) for s in shape)


def check_record(record: SnapshotRecord) -> None:
    """Everything about a record except its arrays' contents; raises RecordError."""
    if record.version != VERSION:
        raise RecordError(f"snapshot version {record.version!r}; this savepoint handles {VERSION}")
    check_count(record.step_count, "step_count")
    check_metadata(record.timestamp, record.description, record.model_id, record.tags)
    if not isinstance(record.config, dict):
        raise RecordError("config must be a mapping")
    for role in ("states", "history"):
        arrays = getattr(record, role)
        kinds = record.kinds(role)
        if len(kinds) != len(arrays) or not all(k in KINDS for k in kinds):
            raise RecordError(f"{role}: one kind ('numpy' or 'torch') per array")


# ---------------------------------------------------------------------------------------------
# binary encoding
# ---------------------------------------------------------------------------------------------


def _names(role: str, count: int) -> list[str]:
    return [f"{role}/{i}" for i in range(count)]


def encode(record: SnapshotRecord) -> bytes:
    """The version-1 binary encoding of ``record`` (see the module docstring)."""
    items: list[tuple[str, dtypes.DType, np.ndarray[Any, Any]]] = []
    torch_names: list[str] = []
    for role in ("states", "history"):
        arrays = getattr(record, role)
        for name, array, kind in zip(_names(role, len(arrays)), arrays, record.kinds(role)):
            items.append((name, dtypes.from_numpy(array.dtype, name), array))
            if kind == "torch":
                torch_names.append(name)
    description = {
        "step_count": record.step_count,
        "config": record.config,
        "metadata": {
            "timestamp": record.timestamp,
            "description": record.description,
            "model_id": record.model_id,
            "tags": list(record.tags),
        },
        "states": len(record.states),
        "history": len(record.history),
        "torch": torch_names,
    }
    order = sorted(items, key=lambda item: -item[1].itemsize)  # stable: names stay in order
    header: dict[str, Any] = {}
    offset = 0
    for name, d, array in order:
        nbytes = int(array.nbytes)
        header[name] = {
            "dtype": d.name,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    # One pass to hash, one copy into the result: b"".join takes the arrays' buffers directly.
    chunks: list[Any] = [
        np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        for _, _, array in order
        if array.size
    ]
    snapshot_json = json.dumps(
        description, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "xxh3": _ZERO_DIGEST,
        "snapshot": snapshot_json,
    }
    raw = json.dumps(
        {"__metadata__": meta, **header}, separators=(",", ":"), ensure_ascii=True
    ).encode("ascii")
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw))
    hasher = checksum.new()
    for part in (prefix, raw, *chunks):
        hasher.update(part)
    placeholder = f'"xxh3":"{_ZERO_DIGEST}"'.encode("ascii")
    assert raw.count(placeholder) == 1
    raw = raw.replace(placeholder, f'"xxh3":"{checksum.hexdigest(hasher)}"'.encode("ascii"))
    return b"".join([prefix, raw, *chunks])


def _corrupt(message: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"snapshot bytes: {message}")


def _undecodable(exc: Exception, buf: memoryview) -> CorruptCheckpointError:
    """The error for bytes whose header cannot be read; JSON (the seed's ``to_bytes``) is named."""
    if bytes(buf[:64]).lstrip(b" \t\r\n").startswith(b"{"):
        return _corrupt(
            "these bytes are JSON, not savepoint's binary snapshot: the seed's Checkpoint::to_bytes "
            "layout (kizzasi) is read by InferenceSnapshot.from_seed_bytes (or from_json)"
        )
    return _corrupt(f"{exc} (truncated, or not a snapshot)")


def decode(data: bytes | bytearray | memoryview) -> SnapshotRecord:
    """The record held by ``data``; CorruptCheckpointError / IncompatibleCheckpointError if not.

    Memory: the header is parsed by the bounded safetensors header reader and the arrays are
    views of ``data`` (``bytes``) or one copy of them; the number of arrays is checked against
    the header's entries before any per-array object is made.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, got {type(data).__name__}")
    zero_copy = isinstance(data, bytes)
    buf = memoryview(data).cast("B")
    size = len(buf)
    try:
        n = safetensors.header_length(bytes(buf[:8]), size)
        header = bytes(buf[8 : 8 + n])
        entries, meta = safetensors.parse_header(header, size)
    except safetensors.HeaderError as exc:
        raise _undecodable(exc, buf) from None
    if meta.get("format") != FORMAT:
        raise _corrupt(f"not a savepoint inference snapshot (format {show(meta.get('format'))})")
    if set(meta) != {"format", "version", "xxh3", "snapshot"}:
        raise _corrupt("__metadata__ must hold exactly format, version, xxh3, snapshot")
    if meta["version"] != str(VERSION):
        raise IncompatibleCheckpointError(
            f"snapshot bytes of version {show(meta['version'])}; this savepoint reads version "
            f"{VERSION}: upgrade savepoint to read it"
        )
    found = list(_DIGEST.finditer(header))
    if len(found) != 1 or found[0].group(1).decode("ascii") != meta["xxh3"]:
        raise _corrupt("the header must hold one xxh3 checksum")
    start, end = found[0].span(1)
    view = memoryview(header)
    hasher = checksum.new()
    for part in (buf[:8], view[:start], _ZERO_DIGEST.encode("ascii"), view[end:], buf[8 + n :]):
        hasher.update(part)
    if checksum.hexdigest(hasher) != meta["xxh3"]:
        raise _corrupt("checksum mismatch (the bytes were damaged or edited)")
    try:
        text = meta["snapshot"].encode("utf-8")
    except UnicodeEncodeError:
        # A JSON escape such as "\ud800" decodes to a lone surrogate, which is not text.
        raise _corrupt("the snapshot record is not valid Unicode (a lone surrogate)") from None
    doc = _json.loads(text, CorruptCheckpointError, "snapshot header")
    if not isinstance(doc, dict) or set(doc) != {
        "step_count",
        "config",
        "metadata",
        "states",
        "history",
        "torch",
    }:
        raise _corrupt(
            "snapshot header must hold step_count, config, metadata, states, history, torch"
        )
    meta_doc = doc["metadata"]
    if not isinstance(meta_doc, dict) or set(meta_doc) != {
        "timestamp",
        "description",
        "model_id",
        "tags",
    }:
        raise _corrupt("metadata must hold timestamp, description, model_id, tags")
    counts = doc["states"], doc["history"]
    if not all(is_count(c, size + 1) for c in counts):
        raise _corrupt("array counts must be non-negative integers")
    by_name = {e.name: e for e in entries}
    # The total first: counts that disagree with the header would otherwise build millions of
    # names for a small input.
    named = sum(counts) == len(entries)
    names = {
        "states": _names("states", counts[0] if named else 0),
        "history": _names("history", counts[1] if named else 0),
    }
    if not named or set(by_name) != set(names["states"]) | set(names["history"]):
        raise _corrupt(
            f"arrays must be named states/0..{counts[0] - 1} and history/0..{counts[1] - 1}"
        )
    torch_names = doc["torch"]
    if not isinstance(torch_names, list) or not all(
        isinstance(t, str) and t in by_name for t in torch_names
    ):
        raise _corrupt("torch must list array names")
    torch_set = set(torch_names)
    arrays: dict[str, list[np.ndarray[Any, Any]]] = {"states": [], "history": []}
    kinds: dict[str, list[str]] = {"states": [], "history": []}
    for role in ("states", "history"):
        for name in names[role]:
            e = by_name[name]
            arrays[role].append(_array(buf, e, zero_copy))
            kinds[role].append("torch" if name in torch_set else "numpy")
    record = SnapshotRecord(
        states=arrays["states"],
        history=arrays["history"],
        step_count=doc["step_count"],
        config=doc["config"],
        timestamp=meta_doc["timestamp"],
        description=meta_doc["description"],
        model_id=meta_doc["model_id"],
        tags=meta_doc["tags"],
        state_kinds=kinds["states"],
        history_kinds=kinds["history"],
    )
    try:
        check_record(record)
        record.config = check_config(record.config, copy=False)
    except RecordError as exc:
        raise _corrupt(str(exc)) from None
    return record


def _array(buf: memoryview, e: safetensors.Entry, zero_copy: bool) -> np.ndarray[Any, Any]:
    """One array of the blob: a read-only view of ``buf`` (or a copy), its values checked."""
    d = dtypes.from_name(e.dtype)
    try:
        shape = check_shape(list(e.shape), d.itemsize, e.name)
    except RecordError as exc:
        raise _corrupt(str(exc)) from None
    count = math.prod(shape)
    if d.name == "BOOL":
        # numpy takes any byte as a bool, but only 0 and 1 come back from a round trip: a blob
        # holding a 2 would decode to a snapshot that differs from its own re-encoding.
        raw = np.frombuffer(buf, dtype=np.uint8, count=count, offset=e.start)
        if count and int(raw.max()) > 1:
            raise _corrupt(f"{e.name}: a BOOL array holds a byte other than 0 or 1")
    flat = np.frombuffer(buf, dtype=d.numpy, count=count, offset=e.start)
    array = flat.reshape(shape)
    if not zero_copy:
        array = array.copy()
    array.flags.writeable = False
    return array
