"""The kizzasi inference-checkpoint layout (seed 003): JSON and MessagePack, read and write.

The seed (``kizzasi_inference::checkpoint::Checkpoint``, serde-derived) writes, in this field
order::

    {
      "version": 1,                          u32, CHECKPOINT_VERSION; the seed refuses any other
      "config": {"max_context": 8192, "store_history": true, "num_layers": 4,
                 "hidden_dim": 256, "state_dim": 16},          its ContextConfig, all fields
      "states": [                            one per layer
        {"hidden_dim": 2, "state_dim": 3,    usize, usize
         "state_data": [0.0, 1.5, ...],      f32 x hidden_dim*state_dim, the matrix row-major
         "updated": true}                    bool; the seed always writes true, its reader
      ],                                     ignores it
      "history": [[1.0, 2.0], [3.0, 4.0]],   input vectors (f32 lists), oldest first
      "step_count": 2,                       usize
      "metadata": {"timestamp": 1700000000,  u64 seconds since the Unix epoch
                   "description": "", "model_id": "unknown", "tags": []}
    }

``save_json`` pretty-prints it (serde_json ``to_writer_pretty``: two-space indent, no trailing
newline), ``to_bytes`` writes it compact. The seed's MessagePack (``rmp_serde::encode::write``)
holds the same values with every struct written as an array of its fields in the order above
(``config`` included: ``[max_context, store_history, num_layers, hidden_dim, state_dim]``);
``rmp_serde`` reads structs from such arrays or from maps keyed by field name. The seed's readers
ignore unknown keys; its reader fails on a missing field, on a ``null``, a string or a boolean
where it wants a number, and on NaN/Infinity in JSON.

What savepoint writes (``to_json`` / ``to_msgpack``) is that layout with extra keys for what the
seed cannot express, so the seed still reads every document (as f32 matrices):

- an array that is not the seed's plain case (a 2-D float32 state, a 1-D float32 history entry)
  gets ``"dtype"`` (savepoint's dtype name: ``"F64"``, ``"BF16"``, ``"I64"``, ``"BOOL"``, ``"C64"``,
  ...) and ``"shape"`` (a list). Its values are still written flat, row-major, as numbers the
  seed's ``f32`` reader accepts: integers as integers, booleans as 0/1, complex numbers as
  interleaved (real, imaginary) pairs, every float exactly (see below). ``hidden_dim`` x
  ``state_dim`` is then ``shape[0]`` x (the rest, times 2 for complex); a 0-d array is 1 x 1;
- ``"kind": "torch"`` marks an array captured from a torch tensor (read back as one);
- non-finite floats (NaN, +-Inf, which JSON cannot hold and serde_json refuses) are written as
  ``0.0`` in the values and listed in ``"nonfinite": [[index, "7fc00000"], ...]``: the flat index
  (into the interleaved values for complex) and the raw bits as lowercase hex of the element
  width, so every NaN payload and sign comes back bit-exact. MessagePack uses the same rule, so
  both encodings carry the same document;
- a state's extra keys sit in its own object; a history entry's sit in the top-level
  ``"history_layout"`` list, parallel to ``"history"`` (``null`` for a plain entry; the key is
  omitted when every entry is plain).

Numbers. JSON floats are written with Python's ``repr`` of the value widened to float64: the
shortest text that parses back to exactly that float64, and a float32 (or float16, bfloat16,
float8) widened to float64 is exact, so the value comes back bit for bit, through Python's
parser and through serde_json's (even without its ``float_roundtrip`` feature: a one-ulp float64
error cannot move a value that is exactly a float32). Values that print the same both ways
(``0.5``, ``-0.0``, ``100.0``) give the seed's bytes exactly; others are longer than the seed's
(``0.10000000149011612`` for its ``0.1``) and exponents are spelled ``1e+300`` (serde: ``1e300``),
all valid JSON for the same values. The seed writes float32 as their shortest float32 text
(``0.1``), which savepoint parses to float64 and narrows, the path serde_json itself takes.
Integers (usize, u64, int64 and uint64 data) are exact in both directions.

MessagePack numbers are fixed width by dtype: float32 (and the narrower floats, widened) as
``float 32`` (0xca), float64 as ``float 64`` (0xcb), integers as the int/uint family of their
width (0xcc-0xd3), booleans as positive fixints 0/1. Savepoint writes maps (rmp_serde's named
form: for the seed's plain case its bytes are exactly ``rmp_serde::encode::write_named``'s) and
reads maps or the seed's arrays.

The seed's reader also requires its ContextConfig fields in ``config``; savepoint writes the
snapshot's config verbatim, so give it those fields when the seed is to read the result.

Cost: both readers build Python lists before arrays (about 100 ms per MiB of float32 for JSON,
20 for MessagePack, on the development machine); :mod:`savepoint.formats.snapshot` is the fast
encoding.

Version: ``1``, the only one the seed knows; savepoint's extra keys are additions within it. A
document of another version is an IncompatibleCheckpointError.

Reading is strict (hostile input): wrong types, missing fields, duplicate keys, value counts that
disagree with ``hidden_dim`` x ``state_dim`` or with ``shape``, numbers outside their dtype's
range (a BOOL value other than 0 or 1 included), strings that are not UTF-8 (lone surrogates),
shapes over 64 dimensions or 2**62 nominal bytes are CorruptCheckpointError. Unknown keys are
ignored, as the seed ignores them.

Reading is bounded, whatever the input:

- nesting deeper than :data:`MAX_DEPTH` (72) levels is a CorruptCheckpointError at any depth
  (1,000 or 1,000,000 levels: never a RecursionError); error messages show values briefly;
- MessagePack is read by a reader that walks the known layout (:class:`_Reader`), not by
  ``msgpack.unpackb``: numeric arrays go straight from the input into numpy arrays (vectorised
  for the layouts the seed and savepoint write), unknown keys are passed over without building
  anything, and everything built is charged to a budget. Peak traced memory <= 16 x input + 64 MiB
  (:data:`BUDGET_FACTOR`, :data:`BUDGET_SLACK`) + 1 MiB of conversion temporaries; a document
  that would need more (millions of empty containers, one-letter strings or tiny arrays packed a
  few bytes each: a numpy array costs about 150 bytes however small, so a history of more than
  about 300,000 one-value entries is refused) is a CorruptCheckpointError;
- JSON is parsed by :mod:`savepoint.formats._json` (24 x input + 64 MiB, nesting <= 512) and what
  the parsed document becomes is held to :data:`JSON_BUDGET_FACTOR` (8) x input + 64 MiB, so peak
  <= 32 x input + 128 MiB.

Real snapshots are far from both limits: numbers as written here or by the seed cost about their
own size once decoded.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from savepoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from savepoint.formats import _json
from savepoint.formats.snapshot import (
    KINDS,
    MAX_CONFIG_DEPTH,
    RecordError,
    SnapshotRecord,
    check_config,
    check_record,
    check_shape,
    is_count,
    show,
)
from savepoint.state import dtypes
from savepoint.state.dtypes import DType

CHECKPOINT_VERSION = 1
CHECKPOINT_FIELDS = ("version", "config", "states", "history", "step_count", "metadata")
STATE_FIELDS = ("hidden_dim", "state_dim", "state_data", "updated")
METADATA_FIELDS = ("timestamp", "description", "model_id", "tags")
CONTEXT_CONFIG_FIELDS = ("max_context", "store_history", "num_layers", "hidden_dim", "state_dim")

_FLOATS = {"F16", "BF16", "F32", "F64", "C64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
_INTS = {"U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}
_MSGPACK_INT = {
    "U8": (0xCC, ">u1"),
    "U16": (0xCD, ">u2"),
    "U32": (0xCE, ">u4"),
    "U64": (0xCF, ">u8"),
    "I8": (0xD0, ">i1"),
    "I16": (0xD1, ">i2"),
    "I32": (0xD2, ">i4"),
    "I64": (0xD3, ">i8"),
}
_HEX = re.compile(r"[0-9a-f]+")


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


@dataclass
class _Numbers:
    """An array's flat values as written: complex split into pairs, non-finite zeroed."""

    flat: np.ndarray[Any, Any]
    dtype: DType

    def to_list(self) -> list[Any]:
        name = self.dtype.name
        if name == "BOOL":
            return self.flat.astype(np.uint8).tolist()  # type: ignore[no-any-return]
        if name in _INTS or name in ("F32", "F64", "C64"):
            return self.flat.tolist()  # type: ignore[no-any-return]
        return self.flat.astype(np.float64).tolist()  # type: ignore[no-any-return]

    def to_msgpack(self, packer: Any) -> bytes:
        name, flat = self.dtype.name, self.flat
        head: bytes = packer.pack_array_header(flat.size)
        if name == "BOOL":
            return head + flat.astype(np.uint8).tobytes()  # positive fixints 0x00 / 0x01
        marker, wire = _MSGPACK_INT.get(name) or ((0xCB, ">f8") if name == "F64" else (0xCA, ">f4"))
        items = np.empty(flat.size, dtype=[("marker", "u1"), ("value", wire)])
        items["marker"] = marker
        # Narrow floats (float16, bfloat16, float8) widen to float32 exactly.
        items["value"] = (
            flat
            if flat.dtype.kind in "iub" or name in ("F32", "F64", "C64")
            else (flat.astype(np.float32))
        )
        return head + items.tobytes()


def _numbers(array: np.ndarray[Any, Any], d: DType) -> tuple[_Numbers, list[list[Any]]]:
    flat = np.ascontiguousarray(array).reshape(-1)
    if d.name == "C64":
        flat = flat.view(np.float32)
    nonfinite: list[list[Any]] = []
    if d.name in _FLOATS:
        with np.errstate(invalid="ignore"):
            wide = flat if flat.dtype in (np.float32, np.float64) else flat.astype(np.float32)
        bad = ~np.isfinite(wide)
        if bad.any():
            width = flat.dtype.itemsize
            bits = flat.view(f"<u{width}")
            nonfinite = [[int(i), f"{int(bits[i]):0{2 * width}x}"] for i in np.flatnonzero(bad)]
            flat = flat.copy()
            flat[bad] = 0
    return _Numbers(flat, d), nonfinite


def seed_dims(shape: tuple[int, ...], d: DType) -> tuple[int, int]:
    """(hidden_dim, state_dim) the seed sees for an array of ``shape``: its flat values as a
    matrix of ``shape[0]`` rows (one row for a 0-d array), complex values counting twice."""
    pair = 2 if d.name == "C64" else 1
    if not shape:
        return 1, pair
    return shape[0], math.prod(shape[1:]) * pair


def _extras(array: np.ndarray[Any, Any], d: DType, kind: str, plain_ndim: int) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if d.name != "F32" or array.ndim != plain_ndim:
        extras["dtype"] = d.name
        extras["shape"] = list(array.shape)
    if kind == "torch":
        extras["kind"] = "torch"
    return extras


def _document(record: SnapshotRecord, numbers: Callable[[_Numbers], Any]) -> dict[str, Any]:
    states = []
    for i, (array, kind) in enumerate(zip(record.states, record.kinds("states"))):
        d = dtypes.from_numpy(array.dtype, f"states/{i}")
        values, nonfinite = _numbers(array, d)
        hidden_dim, state_dim = seed_dims(tuple(array.shape), d)
        entry = {
            "hidden_dim": hidden_dim,
            "state_dim": state_dim,
            "state_data": numbers(values),
            "updated": True,
            **_extras(array, d, kind, 2),
        }
        if nonfinite:
            entry["nonfinite"] = nonfinite
        states.append(entry)
    history = []
    layout: list[dict[str, Any] | None] = []
    for i, (array, kind) in enumerate(zip(record.history, record.kinds("history"))):
        d = dtypes.from_numpy(array.dtype, f"history/{i}")
        values, nonfinite = _numbers(array, d)
        history.append(numbers(values))
        extras = _extras(array, d, kind, 1)
        if nonfinite:
            extras["nonfinite"] = nonfinite
        layout.append(extras or None)
    doc: dict[str, Any] = {
        "version": record.version,
        "config": record.config,
        "states": states,
        "history": history,
        "step_count": record.step_count,
        "metadata": {
            "timestamp": record.timestamp,
            "description": record.description,
            "model_id": record.model_id,
            "tags": list(record.tags),
        },
    }
    if any(entry is not None for entry in layout):
        doc["history_layout"] = layout
    return doc


def encode_json(record: SnapshotRecord, *, indent: int | None = None) -> str:
    """The JSON text of ``record``: compact (the seed's ``to_bytes``) or, with ``indent=2``,
    laid out as the seed's ``save_json`` lays it out."""
    doc = _document(record, _Numbers.to_list)
    separators = (",", ": ") if indent is not None else (",", ":")
    return json.dumps(
        doc, indent=indent, separators=separators, ensure_ascii=False, allow_nan=False
    )


def encode_msgpack(record: SnapshotRecord) -> bytes:
    """The MessagePack bytes of ``record``: the JSON document as maps, numbers fixed width."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    out: list[bytes] = []

    def pack(obj: Any) -> None:
        if isinstance(obj, _Numbers):
            out.append(obj.to_msgpack(packer))
        elif isinstance(obj, dict):
            out.append(packer.pack_map_header(len(obj)))
            for key, value in obj.items():
                out.append(packer.pack(key))
                pack(value)
        elif isinstance(obj, list):
            out.append(packer.pack_array_header(len(obj)))
            for value in obj:
                pack(value)
        else:
            out.append(packer.pack(obj))

    pack(_document(record, lambda numbers: numbers))
    return b"".join(out)


# ---------------------------------------------------------------------------------------------
# reading: the document (shared by JSON and MessagePack)
# ---------------------------------------------------------------------------------------------

MAX_DEPTH = MAX_CONFIG_DEPTH + 8
"""Deepest nesting the MessagePack reader accepts, counted from the document (config's own
limit is 64 levels below its key)."""
BUDGET_FACTOR = 16
JSON_BUDGET_FACTOR = 8
BUDGET_SLACK = 64 << 20
"""What decoding may build, in bytes of Python objects and arrays: ``BUDGET_FACTOR`` x the
input's size + ``BUDGET_SLACK`` for MessagePack (everything but the input), and
``JSON_BUDGET_FACTOR`` x the size + the slack for what a JSON document (already parsed by the
bounded :mod:`savepoint.formats._json`) becomes. A real snapshot (numbers as the seed or savepoint
write them) uses about 1 x its size; only input that packs millions of tiny containers, strings
or arrays into a few bytes each reaches the limit."""


class _Malformed(ValueError):
    pass


class _Budget:
    """Bytes of objects and arrays a decoder may still build (see :data:`BUDGET_FACTOR`)."""

    def __init__(self, size: int, factor: int) -> None:
        self.size = size
        self.factor = factor
        self.left = factor * size + BUDGET_SLACK

    def charge(self, nbytes: int) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise _Malformed(
                f"the document decodes to more than {self.factor} x its {self.size} bytes "
                f"+ {BUDGET_SLACK >> 20} MiB of objects and arrays (millions of tiny containers, "
                "strings or arrays?)"
            )

    def array(self, count: int, itemsize: int, ndim: int = 1) -> None:
        """Charge one numpy array of ``count`` items (its object, shape and data)."""
        self.charge(128 + 16 * ndim + count * itemsize)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise _Malformed(message)


def decode_json(text: str | bytes | bytearray) -> SnapshotRecord:
    """The record held by a JSON document in the seed's layout (savepoint's extra keys included)."""
    if isinstance(text, str):
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:
            raise CorruptCheckpointError("kizzasi JSON is not valid Unicode") from None
    elif isinstance(text, (bytes, bytearray)):
        raw = bytes(text)
    else:
        raise TypeError(f"expected str or bytes, got {type(text).__name__}")
    doc = _json.loads(raw, CorruptCheckpointError, "kizzasi JSON")
    # The document is built (bounded by _json); what it becomes is charged to its own budget.
    return _parse(doc, "kizzasi JSON", _Budget(len(raw), JSON_BUDGET_FACTOR))


def decode_msgpack(data: bytes | bytearray | memoryview) -> SnapshotRecord:
    """The record held by MessagePack ``data``: savepoint's maps or the seed's arrays.

    Bounded (see :class:`_Reader`): nesting deeper than :data:`MAX_DEPTH` levels, more decoded
    objects than :data:`BUDGET_FACTOR` x ``len(data)`` + :data:`BUDGET_SLACK` bytes, a length
    running past the end and trailing bytes are CorruptCheckpointError.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, got {type(data).__name__}")
    reader = _Reader(memoryview(data).cast("B"))
    try:
        doc = reader.document()
    except _Malformed as exc:
        raise CorruptCheckpointError(f"kizzasi MessagePack: {exc}") from None
    return _parse(doc, "kizzasi MessagePack", reader.budget)


def _parse(doc: Any, what: str, budget: _Budget) -> SnapshotRecord:
    try:
        return _parse_document(doc, budget)
    except (_Malformed, RecordError) as exc:
        raise CorruptCheckpointError(f"{what}: {exc}") from None


def _is_values(x: Any) -> bool:
    return isinstance(x, (list, _Packed))


def _parse_document(doc: Any, budget: _Budget) -> SnapshotRecord:
    _need(isinstance(doc, dict), "the document is not an object")
    _need("version" in doc, "missing field version")
    version = doc["version"]
    if not is_count(version):
        raise _Malformed(f"version must be a non-negative integer, got {show(version)}")
    if version != CHECKPOINT_VERSION:
        # Before anything else: another version may lay its fields out differently.
        raise IncompatibleCheckpointError(
            f"kizzasi checkpoint version {version}; savepoint reads version {CHECKPOINT_VERSION} "
            "(the only version the seed defines)"
        )
    missing = [f for f in CHECKPOINT_FIELDS if f not in doc]
    _need(not missing, f"missing field(s) {', '.join(missing)}")
    _need(isinstance(doc["config"], dict), "config must be an object")
    # The document was just decoded: check its config where it is, without a second copy.
    config = check_config(doc["config"], copy=False)
    metadata = doc["metadata"]
    _need(isinstance(metadata, dict), "metadata must be an object")
    missing = [f for f in METADATA_FIELDS if f not in metadata]
    _need(not missing, f"metadata: missing field(s) {', '.join(missing)}")
    _need(isinstance(metadata["tags"], list), "metadata tags must be a list")
    raw_states, raw_history = doc["states"], doc["history"]
    _need(isinstance(raw_states, list), "states must be a list")
    _need(isinstance(raw_history, list), "history must be a list")

    states, state_kinds = [], []
    for i, entry in enumerate(raw_states):
        where = f"states[{i}]"
        _need(isinstance(entry, dict), f"{where} is not an object")
        missing = [f for f in STATE_FIELDS if f not in entry]
        _need(not missing, f"{where}: missing field(s) {', '.join(missing)}")
        hidden_dim, state_dim = entry["hidden_dim"], entry["state_dim"]
        _need(
            is_count(hidden_dim) and is_count(state_dim),
            f"{where}: hidden_dim and state_dim must be non-negative integers",
        )
        _need(isinstance(entry["updated"], bool), f"{where}: updated must be a boolean")
        array, kind = _array(entry["state_data"], entry, (hidden_dim, state_dim), where, budget)
        d = dtypes.from_numpy(array.dtype, where)
        _need(
            seed_dims(tuple(array.shape), d) == (hidden_dim, state_dim),
            f"{where}: hidden_dim x state_dim {hidden_dim} x {state_dim} disagrees with shape "
            f"{list(array.shape)}",
        )
        states.append(array)
        state_kinds.append(kind)

    layout = doc.get("history_layout")
    if layout is None:
        layout = [None] * len(raw_history)
    _need(
        isinstance(layout, list) and len(layout) == len(raw_history),
        "history_layout must be a list with one entry per history element",
    )
    history, history_kinds = [], []
    for i, (values, extras) in enumerate(zip(raw_history, layout)):
        where = f"history[{i}]"
        _need(extras is None or isinstance(extras, dict), f"history_layout[{i}] is not an object")
        _need(_is_values(values), f"{where} is not a list of numbers")
        array, kind = _array(values, extras or {}, (len(values),), where, budget)
        history.append(array)
        history_kinds.append(kind)

    record = SnapshotRecord(
        states=states,
        history=history,
        step_count=doc["step_count"],
        config=config,
        timestamp=metadata["timestamp"],
        description=metadata["description"],
        model_id=metadata["model_id"],
        tags=metadata["tags"],
        state_kinds=state_kinds,
        history_kinds=history_kinds,
        version=version,
    )
    check_record(record)
    return record


def _array(
    values: Any,
    extras: dict[str, Any],
    default_shape: tuple[int, ...],
    where: str,
    budget: _Budget,
) -> tuple[np.ndarray[Any, Any], str]:
    """One array from its flat values and its extra keys (dtype, shape, kind, nonfinite)."""
    name = extras.get("dtype", "F32")
    if not (isinstance(name, str) and name in dtypes.BY_NAME):
        raise _Malformed(f"{where}: unknown dtype {show(name)}")
    d = dtypes.BY_NAME[name]
    shape = check_shape(extras["shape"], d.itemsize, where) if "shape" in extras else default_shape
    kind = extras.get("kind", "numpy")
    if kind not in KINDS:
        raise _Malformed(f"{where}: kind must be 'numpy' or 'torch', got {show(kind)}")
    _need(_is_values(values), f"{where}: values must be a list of numbers")
    pair = 2 if name == "C64" else 1
    expected = math.prod(shape) * pair
    _need(
        len(values) == expected,
        f"{where}: {len(values)} values for shape {list(shape)} of {name} ({expected} needed)",
    )
    target = np.dtype(np.float32) if name == "C64" else np.dtype(d.numpy)
    budget.array(len(values), target.itemsize, len(shape))
    flat = values.decode(d, where) if isinstance(values, _Packed) else _flat(values, d, where)
    nonfinite = extras.get("nonfinite")
    if nonfinite is not None and not isinstance(nonfinite, _NonFinite):
        nonfinite = _NonFinite.of_list(nonfinite, where, budget)
    if nonfinite is not None and len(nonfinite):
        _need(name in _FLOATS, f"{where}: nonfinite values in an array of {name}")
        nonfinite.patch(flat, where)
    if name == "C64":
        flat = flat.view(np.complex64)
    array = flat.reshape(shape)
    array.flags.writeable = False
    return array, kind


def _flat(values: list[Any], d: DType, where: str) -> np.ndarray[Any, Any]:
    """``values`` as a flat array of ``d`` (its float32 components for complex), checked."""
    types = set(map(type, values))
    name = d.name
    if name == "BOOL":
        _need(types <= {int, bool}, f"{where}: boolean values must be 0 or 1")
        _need(all(v in (0, 1) for v in values), f"{where}: boolean values must be 0 or 1")
        return np.array(values, dtype=np.uint8).astype(np.bool_)
    if name in _INTS:
        _need(types <= {int}, f"{where}: {name} values must be integers")
        if values:
            info = np.iinfo(d.numpy)
            _need(
                info.min <= min(values) and max(values) <= info.max,
                f"{where}: a value lies outside the range of {name}",
            )
        return np.array(values, dtype=d.numpy)
    _need(types <= {int, float}, f"{where}: {name} values must be numbers")
    try:
        wide = np.array(values, dtype=np.float64)
    except (OverflowError, ValueError, TypeError):
        raise _Malformed(f"{where}: a value is not a float64 number") from None
    return _narrow(wide, d, where)


def _narrow(wide: np.ndarray[Any, Any], d: DType, where: str) -> np.ndarray[Any, Any]:
    """float64 values as ``d``'s floats (float32 for complex); a finite value that does not fit
    is an error, never an infinity."""
    target = np.dtype(np.float32) if d.name == "C64" else d.numpy
    if target == np.float64:
        return wide
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = wide.astype(target)
        check = narrow if target == np.float32 else narrow.astype(np.float32)
    _need(
        not (~np.isfinite(check) & np.isfinite(wide)).any(),
        f"{where}: a value lies outside the range of {d.name}",
    )
    return narrow


class _NonFinite:
    """An array's ``nonfinite`` list, ``[[index, hex bits], ...]``, as two integer arrays."""

    def __init__(self, indices: np.ndarray[Any, Any], bits: np.ndarray[Any, Any], digits: int):
        self.indices = indices
        self.bits = bits
        self.digits = digits  # hex digits of every entry (0 when there is none)

    def __len__(self) -> int:
        return len(self.indices)

    @classmethod
    def of_list(cls, entries: Any, where: str, budget: _Budget) -> _NonFinite:
        _need(isinstance(entries, list), f"{where}: nonfinite must be a list of [index, bits]")
        budget.array(len(entries), 16)
        indices = np.empty(len(entries), dtype=np.int64)
        bits = np.empty(len(entries), dtype=np.uint64)
        digits = 0
        for i, entry in enumerate(entries):
            _need(
                isinstance(entry, list)
                and len(entry) == 2
                and is_count(entry[0], 1 << 62)
                and isinstance(entry[1], str),
                f"{where}: a nonfinite entry is not [index, hex digits]",
            )
            indices[i], bits[i], digits = (
                entry[0],
                _hex_bits(entry[1], digits, where),
                len(entry[1]),
            )
        return cls(indices, bits, digits)

    def patch(self, flat: np.ndarray[Any, Any], where: str) -> None:
        width = flat.dtype.itemsize
        _need(
            self.digits == 2 * width and bool((self.indices < flat.size).all()),
            f"{where}: a nonfinite entry is not [index < {flat.size}, {2 * width} hex digits]",
        )
        _need(
            len(np.unique(self.indices)) == len(self.indices),
            f"{where}: a nonfinite index repeats",
        )
        unsigned = np.dtype(f"<u{width}")
        patch = self.bits.astype(unsigned).view(flat.dtype)
        with np.errstate(invalid="ignore"):
            wide = patch if patch.dtype in (np.float32, np.float64) else patch.astype(np.float32)
        _need(not np.isfinite(wide).any(), f"{where}: a nonfinite entry holds a finite value")
        flat.view(unsigned)[self.indices] = patch.view(unsigned)


def _hex_bits(text: str, digits: int, where: str) -> int:
    _need(
        0 < len(text) <= 16 and (digits in (0, len(text))) and _HEX.fullmatch(text) is not None,
        f"{where}: a nonfinite entry's bits are not 2, 4, 8 or 16 lowercase hex digits, the same "
        "for every entry",
    )
    return int(text, 16)


# ---------------------------------------------------------------------------------------------
# reading: bounded MessagePack
# ---------------------------------------------------------------------------------------------

_CHUNK = 1 << 14  # elements converted at a time on the mixed path (temporaries <= 1 MiB)
_VCHUNK = 1 << 16  # elements converted at a time on the vectorised paths (temporaries <= 1 MiB)
# Fixed-width numbers: marker -> (big-endian numpy dtype of the value, width with the marker).
_WIRE = {
    0xCA: (">f4", 5),
    0xCB: (">f8", 9),
    0xCC: (">u1", 2),
    0xCD: (">u2", 3),
    0xCE: (">u4", 5),
    0xCF: (">u8", 9),
    0xD0: (">i1", 2),
    0xD1: (">i2", 3),
    0xD2: (">i4", 5),
    0xD3: (">i8", 9),
}
_STRUCT = {
    m: struct.Struct(f">{c}")
    for m, c in zip(range(0xCA, 0xD4), ("f", "d", "B", "H", "I", "Q", "b", "h", "i", "q"))
}
# Width of each number-or-boolean element by its marker (0: anything else).
_NUMBER_WIDTH = bytes(
    1 if b <= 0x7F or b >= 0xE0 or b in (0xC2, 0xC3) else _WIRE[b][1] if b in _WIRE else 0
    for b in range(256)
)
# For skipping: nil, the empty string and empty containers are whole one-byte values too.
_SKIP_WIDTH = bytes(1 if b in (0xC0, 0xA0, 0x80, 0x90) else w for b, w in enumerate(_NUMBER_WIDTH))
_PACKED_COST = 96  # a _Packed (slots) and its slot in a list: 88 bytes measured
_NO_BOUNDS: list[int] = []  # shared by every array that is not on the mixed path
# str 8/16/32 and bin 8/16/32: the size of their length field.
_LENGTH_BYTES = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4, 0xD4: -1, 0xD5: -2, 0xD6: -4, 0xD7: -8, 0xD8: -16}


class _Reader:
    """A MessagePack reader for the kizzasi document that never builds more than its budget.

    ``msgpack.unpackb`` builds every value before a caller can look at it: 8 MiB of ``0x90``
    (empty arrays) become 8 million lists, about 500 MiB. This reader walks the document's
    known layout instead: numeric arrays (``state_data``, history entries) are located and
    checked without building a Python object per value and decoded straight into numpy arrays
    once their dtype is known (:class:`_Packed`); ``nonfinite`` lists go straight into integer
    arrays; unknown keys are skipped without building anything; every other value (config,
    metadata, the small fields) is built and charged to a budget. Nesting depth is counted, so
    no input reaches Python's recursion limit.
    """

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0
        self.end = len(buf)
        self.budget = _Budget(len(buf), BUDGET_FACTOR)
        self.charge = self.budget.charge

    # -- primitives --------------------------------------------------------------------------

    def need(self, n: int) -> None:
        if n > self.end - self.pos:
            raise _Malformed(
                f"a value needs {n} bytes at offset {self.pos} but only {self.end - self.pos} "
                "remain (truncated)"
            )

    def peek(self) -> int:
        self.need(1)
        return int(self.buf[self.pos])

    def uint(self, nbytes: int) -> int:
        self.need(nbytes)
        value = int.from_bytes(self.buf[self.pos : self.pos + nbytes], "big")
        self.pos += nbytes
        return value

    def container(self) -> tuple[str, int] | None:
        """Consume an array or map header: ``("array" | "map", n)``; None (nothing consumed)
        for any other value. ``n`` is checked against what is left (one byte per item)."""
        m = self.peek()
        if 0x90 <= m <= 0x9F or m in (0xDC, 0xDD):
            kind, items = "array", 1
        elif 0x80 <= m <= 0x8F or m in (0xDE, 0xDF):
            kind, items = "map", 2
        else:
            return None
        self.pos += 1
        n = m & 0x0F if m <= 0x9F else self.uint(2 if m in (0xDC, 0xDE) else 4)
        self.need(n * items)
        return kind, n

    def scalar(self) -> Any:
        """One value that is not a container."""
        m = self.peek()
        self.pos += 1
        if m <= 0x7F:
            return m
        if m >= 0xE0:
            return m - 0x100
        if m == 0xC0:
            return None
        if m in (0xC2, 0xC3):
            return m == 0xC3
        fmt = _STRUCT.get(m)
        if fmt is not None:
            self.need(fmt.size)
            (value,) = fmt.unpack_from(self.buf, self.pos)
            self.pos += fmt.size
            return value
        if 0xA0 <= m <= 0xBF or m in (0xD9, 0xDA, 0xDB):
            n = m & 0x1F if m <= 0xBF else self.uint(_LENGTH_BYTES[m])
            raw = self.take(n)
            try:
                return str(raw, "utf-8")
            except UnicodeDecodeError:
                raise _Malformed(f"a string at offset {self.pos - n} is not valid UTF-8") from None
        if m in (0xC4, 0xC5, 0xC6):
            return bytes(self.take(self.uint(_LENGTH_BYTES[m])))
        if m in _EXT:
            raise _Malformed(f"an extension value at offset {self.pos - 1} (not in the layout)")
        raise _Malformed(f"byte 0x{m:02x} at offset {self.pos - 1} does not start a value")

    def take(self, n: int) -> memoryview:
        self.need(n)
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def value(self, depth: int) -> Any:
        """Any value, built and charged to the budget."""
        if depth > MAX_DEPTH:
            raise _Malformed(f"nested deeper than {MAX_DEPTH} levels (offset {self.pos})")
        header = self.container()
        if header is None:
            v = self.scalar()
            self.charge(8 + (sys.getsizeof(v) if isinstance(v, (int, float, str, bytes)) else 0))
            return v
        kind, n = header
        if kind == "array":
            self.charge(64 + 8 * n)
            return [self.value(depth + 1) for _ in range(n)]
        self.charge(64 + 48 * n)
        out: dict[str, Any] = {}
        for _ in range(n):
            key = self.key()
            if key in out:
                raise _Malformed(f"duplicate key {show(key)}")
            out[key] = self.value(depth + 1)
        return out

    def key(self) -> str:
        if self.container() is not None:
            raise _Malformed(f"a map key at offset {self.pos} is not a string")
        key = self.scalar()
        if not isinstance(key, str):
            raise _Malformed(f"a map key at offset {self.pos} is not a string, got {show(key)}")
        return key

    def skip(self, depth: int) -> None:
        """Pass over one value without building it (iterative: any nesting, no recursion)."""
        left = [1]  # values still to pass at each open level
        while left:
            if left[-1] == 0:
                left.pop()
                continue
            left[-1] -= 1
            if depth + len(left) > MAX_DEPTH + 1:
                raise _Malformed(f"nested deeper than {MAX_DEPTH} levels (offset {self.pos})")
            header = self.container()
            if header is not None:
                kind, n = header
                run = (
                    _scalar_run(self.buf, self.pos, n, _SKIP_WIDTH)
                    if kind == "array" and n
                    else None
                )
                if run is not None:
                    self.pos = run[2]  # an array of numbers, passed over at numpy speed
                else:
                    left.append(n * (2 if kind == "map" else 1))
                continue
            m = self.peek()
            if m in _EXT:  # ignored like any unknown value, as the seed ignores it
                self.pos += 1
                fixed = _EXT[m]  # fixext: minus the data size; ext: the length field's size
                self.take(1 - fixed if fixed < 0 else self.uint(fixed) + 1)  # type byte, data
            elif 0xA0 <= m <= 0xBF:
                self.pos += 1
                self.take(m & 0x1F)
            elif m in _LENGTH_BYTES:
                self.pos += 1
                self.take(self.uint(_LENGTH_BYTES[m]))
            else:
                width = _NUMBER_WIDTH[m]
                if width == 0 and m != 0xC0:
                    raise _Malformed(f"byte 0x{m:02x} at offset {self.pos} does not start a value")
                self.need(max(width, 1))
                self.pos += max(width, 1)

    # -- the layout --------------------------------------------------------------------------

    def document(self) -> Any:
        header = self.container()
        if header is None:
            doc = self.value(0)
        elif header[0] == "array":
            n = header[1]
            first = self.value(1) if n else None
            if is_count(first) and first != CHECKPOINT_VERSION:
                return {"version": first}  # another version may lay its fields out differently
            _need(
                n == len(CHECKPOINT_FIELDS),
                f"the checkpoint as an array must have {len(CHECKPOINT_FIELDS)} fields "
                f"({', '.join(CHECKPOINT_FIELDS)}), got {n}",
            )
            doc = {"version": first}
            for name in CHECKPOINT_FIELDS[1:]:
                doc[name] = self.field(name)
        else:
            doc = self.fields(header[1], 0, self.field)
        if self.pos != self.end:
            raise _Malformed(f"{self.end - self.pos} bytes after the document")
        return doc

    def fields(self, n: int, depth: int, read: Any) -> dict[str, Any]:
        """A map's entries: ``read(key)`` gives a known key's value, or None to skip it."""
        out: dict[str, Any] = {}
        seen: set[str] = set()
        self.charge(64 + 48 * n)
        for _ in range(n):
            key = self.key()
            if key in seen:
                raise _Malformed(f"duplicate key {show(key)}")
            seen.add(key)
            value = read(key)
            if value is _SKIP:
                self.skip(depth + 1)
            else:
                out[key] = value
        return out

    def field(self, name: str) -> Any:
        if name == "states":
            return self.listed(lambda i: self.state(f"states[{i}]"))
        if name == "history":
            return self.listed(lambda i: self.numbers(f"history[{i}]"))
        if name == "history_layout":
            return self.listed(self.layout)
        if name in ("config", "metadata"):
            fields = CONTEXT_CONFIG_FIELDS if name == "config" else METADATA_FIELDS
            return _struct(self.value(1), fields, name)
        if name in CHECKPOINT_FIELDS:
            return self.value(1)
        return _SKIP

    def listed(self, item: Callable[[int], Any]) -> Any:
        start = self.pos
        header = self.container()
        if header is None or header[0] != "array":
            self.pos = start  # not a list: built as it is, for the layout check to report
            return self.value(1)
        self.charge(64 + 8 * header[1])
        return [item(i) for i in range(header[1])]

    def state(self, where: str) -> Any:
        header = self.container()
        if header is None:
            return self.value(2)
        kind, n = header
        if kind == "array":
            _need(
                n == len(STATE_FIELDS),
                f"{where} as an array must have {len(STATE_FIELDS)} fields "
                f"({', '.join(STATE_FIELDS)}), got {n}",
            )
            self.charge(64 + 48 * n)
            hidden_dim, state_dim = self.value(3), self.value(3)
            data = self.numbers(where)
            return dict(zip(STATE_FIELDS, (hidden_dim, state_dim, data, self.value(3))))
        return self.fields(n, 2, lambda key: self.extra(key, where, STATE_FIELDS))

    def layout(self, i: int) -> Any:
        header = self.container()
        if header is None:
            return self.value(2)
        kind, n = header
        if kind == "array":
            self.charge(64 + 8 * n)
            return [self.value(3) for _ in range(n)]
        return self.fields(n, 2, lambda key: self.extra(key, f"history[{i}]", ()))

    def extra(self, key: str, where: str, known: tuple[str, ...]) -> Any:
        if key == "state_data" and known:
            return self.numbers(where)
        if key == "nonfinite":
            return self.nonfinite(where)
        if key in known or key in ("dtype", "shape", "kind"):
            return self.value(3)
        return _SKIP

    def numbers(self, where: str) -> Any:
        """A numeric array, located and checked without building its values (:class:`_Packed`)."""
        start = self.pos
        header = self.container()
        if header is None or header[0] != "array":
            self.pos = start
            return self.value(3)
        n = header[1]
        self.charge(_PACKED_COST)
        packed = _Packed(self, self.pos, n)
        self.pos = packed.scan(where)
        return packed

    def nonfinite(self, where: str) -> Any:
        start = self.pos
        header = self.container()
        if header is None or header[0] != "array":
            self.pos = start
            return self.value(3)
        n = header[1]
        self.need(5 * n)  # [index, "hex"] takes at least 5 bytes
        self.budget.array(n, 16)
        indices = np.empty(n, dtype=np.int64)
        bits = np.empty(n, dtype=np.uint64)
        digits = 0
        for i in range(n):
            entry = self.container()
            _need(
                entry == ("array", 2),
                f"{where}: a nonfinite entry is not [index, hex digits]",
            )
            index, text = self.scalar(), self.scalar()
            _need(
                is_count(index, 1 << 62) and isinstance(text, str),
                f"{where}: a nonfinite entry is not [index, hex digits]",
            )
            indices[i], bits[i], digits = index, _hex_bits(text, digits, where), len(text)
        return _NonFinite(indices, bits, digits)


_SKIP: Any = object()


def _struct(value: Any, fields: tuple[str, ...], what: str) -> Any:
    """rmp_serde's positional form of a struct (an array of its fields) as the named form."""
    if isinstance(value, list):
        _need(
            len(value) == len(fields),
            f"{what} as an array must have {len(fields)} fields ({', '.join(fields)}), "
            f"got {len(value)}",
        )
        return dict(zip(fields, value))
    return value


class _Packed:
    """A MessagePack array of numbers, located in the input but not yet decoded.

    :meth:`scan` checks every element is a number (or a boolean) and finds the end; once the
    dtype is known, :meth:`decode` converts the elements straight into a numpy array. The
    common layouts (every element one fixed-width type, as the seed and savepoint write them;
    every element one byte) are converted vectorised; any other mix goes through Python values
    ``_CHUNK`` at a time, so temporaries stay bounded either way.
    """

    __slots__ = ("bounds", "count", "layout", "marker", "reader", "start")

    def __init__(self, reader: _Reader, start: int, count: int) -> None:
        self.reader = reader
        self.start = start
        self.count = count
        self.layout = "mixed"
        self.marker = 0
        self.bounds: list[int] = _NO_BOUNDS  # mixed: offsets of elements 0, _CHUNK, ..., end

    def __len__(self) -> int:
        return self.count

    def scan(self, where: str) -> int:
        """Check the elements; return the offset just past the array."""
        buf, n, start = self.reader.buf, self.count, self.start
        if n == 0:
            self.layout = "empty"
            return start
        run = _scalar_run(buf, start, n)
        if run is not None:
            self.layout, self.marker, end = run
            return end
        # Any other mix: one pass in Python over the markers, keeping where every _CHUNK-th
        # element starts so that decode() can hand msgpack one checked chunk at a time.
        pos, table, bounds = start, _NUMBER_WIDTH, []
        try:
            for i in range(n):
                if not i % _CHUNK:
                    bounds.append(pos)
                width = table[buf[pos]]
                if not width:
                    raise _Malformed(f"{where}: values must be numbers")
                pos += width
        except IndexError:
            raise _Malformed(f"{where}: the values run past the end (truncated)") from None
        if pos > len(buf):
            raise _Malformed(f"{where}: the values run past the end (truncated)")
        bounds.append(pos)
        self.bounds = bounds
        return pos

    def decode(self, d: DType, where: str) -> np.ndarray[Any, Any]:
        """The elements as a flat array of ``d`` (its float32 components for complex), checked
        as :func:`_flat` checks a JSON list."""
        n = self.count
        out = np.empty(n, dtype=np.float32 if d.name == "C64" else d.numpy)
        if self.layout == "mixed":
            self._mixed(out, d, where)
            return out
        buf = self.reader.buf
        if self.layout == "uniform":
            wire = _WIRE[self.marker][0]
            items = np.frombuffer(
                buf, dtype=np.dtype([("m", "u1"), ("v", wire)]), count=n, offset=self.start
            )
            values, kind = items["v"], "float" if self.marker in (0xCA, 0xCB) else "int"
        elif self.layout == "tiny":
            raw = np.frombuffer(buf, dtype=np.uint8, count=n, offset=self.start)
            booleans = (raw == 0xC2) | (raw == 0xC3)
            kind = "bool" if booleans.any() else "int"
            if kind == "bool":
                values = np.where(booleans, raw == 0xC3, raw.view(np.int8)).astype(np.int8)
            else:
                values = raw.view(np.int8)  # positive and negative fixints are int8 bytes
        else:
            return out
        exact = d.name == "F64" or (d.name in ("F32", "C64") and self.marker == 0xCA)
        if kind == "float" and exact:
            # The seed's float32 (and float64 into F64): exact, nothing to check. The common case.
            with np.errstate(invalid="ignore"):
                out[...] = values
            return out
        for a in range(0, n, _VCHUNK):
            out[a : a + _VCHUNK] = _convert(values[a : a + _VCHUNK], kind, d, where)
        return out

    def _mixed(self, out: np.ndarray[Any, Any], d: DType, where: str) -> None:
        # Every element is a number or a boolean (scan checked each marker), so msgpack builds
        # one chunk of Python numbers at C speed and nothing else.
        buf = self.reader.buf
        for k, (a, b) in enumerate(zip(self.bounds, self.bounds[1:])):
            count = min(_CHUNK, self.count - k * _CHUNK)
            chunk = msgpack.unpackb(b"\xdd" + count.to_bytes(4, "big") + bytes(buf[a:b]))
            out[k * _CHUNK : k * _CHUNK + count] = _flat(chunk, d, where)


def _scalar_run(
    buf: memoryview, start: int, n: int, widths: bytes = _NUMBER_WIDTH
) -> tuple[str, int, int] | None:
    """``(layout, marker, end)`` when the ``n`` elements at ``start`` are numbers or booleans in
    one of the vectorised layouts ("uniform": one fixed-width marker; "tiny": one byte each),
    found without a Python step per element; None otherwise. ``widths`` gives each marker's
    width (:data:`_SKIP_WIDTH` also takes every other one-byte value, for skipping)."""
    first = int(buf[start])
    width = widths[first]
    if width > 1 and start + n * width <= len(buf):
        markers = np.frombuffer(buf, dtype=np.uint8, count=n * width, offset=start)[::width]
        if bool((markers == first).all()):
            return "uniform", first, start + n * width
    if width == 1 and start + n <= len(buf):
        raw = np.frombuffer(buf, dtype=np.uint8, count=n, offset=start)
        if bool((np.frombuffer(widths, dtype=np.uint8)[raw] == 1).all()):
            return "tiny", 0, start + n
    return None


def _convert(values: np.ndarray[Any, Any], kind: str, d: DType, where: str) -> np.ndarray[Any, Any]:
    """Numbers decoded vectorised (``kind``: "int", "float" or "bool", as the Python values
    :func:`_flat` would see) as ``d``, under the same rules."""
    name = d.name
    if name == "BOOL":
        _need(kind in ("int", "bool"), f"{where}: boolean values must be 0 or 1")
        _need(
            not bool(((values != 0) & (values != 1)).any()),
            f"{where}: boolean values must be 0 or 1",
        )
        return values.astype(np.bool_)
    if name in _INTS:
        _need(kind == "int", f"{where}: {name} values must be integers")
        if values.size:
            info = np.iinfo(d.numpy)
            _need(
                info.min <= int(values.min()) and int(values.max()) <= info.max,
                f"{where}: a value lies outside the range of {name}",
            )
        return values.astype(d.numpy)
    _need(kind in ("int", "float"), f"{where}: {name} values must be numbers")
    with np.errstate(invalid="ignore"):  # a signalling NaN widens quietly, as Python does
        wide = values.astype(np.float64)
    return _narrow(wide, d, where)
