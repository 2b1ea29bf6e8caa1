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
newline), ``to_bytes`` writes it compact; savepoint writes both byte for byte. The seed's
MessagePack (``rmp_serde::encode::write``) holds the same values with every struct written as an
array of its fields in the order above
(``config`` included: ``[max_context, store_history, num_layers, hidden_dim, state_dim]``);
``rmp_serde`` reads structs from such arrays or from maps keyed by field name. The seed's readers
ignore unknown keys; its reader fails on a missing field, on a ``null``, a string or a boolean
where it wants a number, and on NaN/Infinity in JSON.

The seed's ``to_bytes`` / ``from_bytes`` are :func:`to_bytes` / :func:`from_bytes` here (the
compact JSON as UTF-8 bytes) and ``InferenceSnapshot.to_seed_bytes`` / ``from_seed_bytes``: not
``InferenceSnapshot.to_bytes``, which is savepoint's own binary encoding
(:mod:`savepoint.codecs.snapshot`). Its files are ``InferenceSnapshot.save_json`` /
``load_json`` / ``save_msgpack`` / ``load_msgpack``.

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

Numbers. JSON floats are written as serde_json writes them (:mod:`savepoint.codecs.serde_text`:
ryu's shortest text that reads back to the same value of the field's type): float32 values, and
the narrower floats widened to float32 (exact), as the seed's ``f32`` (``0.1``, ``1e-7``,
``1e20``, ``3.4028235e38``, ``1e-45``, ``-0.0``, ``100.0``); float64 arrays (an extension the seed
reads as f32) and floats in ``config`` as ``f64`` (``0.1``, ``1e300``, ``5e-324``). So a snapshot
the seed could have written gives the seed's bytes, compact and pretty, and every value comes
back bit for bit (savepoint parses float32 text to float64 and narrows, the path serde_json
itself takes). Integers (usize, u64, int64 and uint64 data) are exact in both directions.
Readers take either spelling: Python's ``repr`` text that savepoint 0.1 wrote
(``0.10000000149011612``, ``1e+300``) reads as before.

MessagePack numbers are fixed width by dtype: float32 (and the narrower floats, widened) as
``float 32`` (0xca), float64 as ``float 64`` (0xcb), integers as the int/uint family of their
width (0xcc-0xd3), booleans as positive fixints 0/1. Structs are written as the seed's
``save_msgpack`` (``rmp_serde::encode::write``) writes them: an array of their fields in
declaration order (the checkpoint's first byte is 0x96), so for the seed's plain case the bytes
are exactly the seed's. A struct carrying savepoint's extra keys (a state with ``dtype``, the
checkpoint with ``history_layout``, a config with other fields than the five of ContextConfig)
is written as a map keyed by field name instead, which rmp_serde also reads (ignoring the
unknown keys). Savepoint reads maps or arrays, at every level (what savepoint 0.1 wrote: maps).

The seed's reader also requires its ContextConfig fields in ``config``; savepoint writes the
snapshot's config verbatim, so give it those fields when the seed is to read the result.

Cost: both readers build Python lists before arrays (about 100 ms per MiB of float32 for JSON,
20 for MessagePack, on the development machine); :mod:`savepoint.codecs.snapshot` is the fast
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
- MessagePack is read by a reader that walks the known layout (``Reader`` in
  :mod:`savepoint.codecs._kizzasi_msgpack`, which states its contract), not by
  ``msgpack.unpackb``: numeric arrays go straight from the input into numpy arrays (vectorised
  for the layouts the seed and savepoint write), unknown keys are passed over without building
  anything, and everything built is charged to a budget. Peak traced memory <= 16 x input + 64 MiB
  (:data:`BUDGET_FACTOR`, :data:`BUDGET_SLACK`) + 1 MiB of conversion temporaries; a document
  that would need more (millions of empty containers, one-letter strings or tiny arrays packed a
  few bytes each: a numpy array costs about 150 bytes however small, so a history of more than
  about 300,000 one-value entries is refused) is a CorruptCheckpointError;
- JSON is parsed by :mod:`savepoint.codecs.bounded_json` (24 x input + 64 MiB, nesting <= 512) and what
  the parsed document becomes is held to :data:`JSON_BUDGET_FACTOR` (8) x input + 64 MiB, so peak
  <= 32 x input + 128 MiB.

Real snapshots are far from both limits: numbers as written here or by the seed cost about their
own size once decoded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from savepoint.codecs import bounded_json as _json
from savepoint.codecs import dtypes, serde_text
from savepoint.codecs._kizzasi_msgpack import (
    CHECKPOINT_FIELDS,
    CHECKPOINT_VERSION,
    CONTEXT_CONFIG_FIELDS,
    FLOAT_DTYPES,
    INT_DTYPES,
    MAX_DEPTH,
    METADATA_FIELDS,
    STATE_FIELDS,
    Budget,
    Malformed,
    NonFinite,
    Packed,
    Reader,
    flat_array,
    require,
)
from savepoint.codecs.dtypes import DType
from savepoint.codecs.snapshot import (
    KINDS,
    RecordError,
    SnapshotRecord,
    check_config,
    check_record,
    check_shape,
    is_count,
    show,
)
from savepoint.errors import CorruptCheckpointError, IncompatibleCheckpointError

__all__ = [
    "BUDGET_FACTOR",
    "BUDGET_SLACK",
    "CHECKPOINT_FIELDS",
    "CHECKPOINT_VERSION",
    "CONTEXT_CONFIG_FIELDS",
    "JSON_BUDGET_FACTOR",
    "MAX_DEPTH",
    "METADATA_FIELDS",
    "STATE_FIELDS",
    "decode_json",
    "decode_msgpack",
    "encode_json",
    "encode_msgpack",
    "from_bytes",
    "seed_dims",
    "to_bytes",
]

BUDGET_FACTOR = 16
JSON_BUDGET_FACTOR = 8
BUDGET_SLACK = 64 << 20
"""What decoding may build, in bytes of Python objects and arrays: ``BUDGET_FACTOR`` x the
input's size + ``BUDGET_SLACK`` for MessagePack (everything but the input), and
``JSON_BUDGET_FACTOR`` x the size + the slack for what a JSON document (already parsed by the
bounded :mod:`savepoint.codecs.bounded_json`) becomes. A real snapshot (numbers as the seed or savepoint
write them) uses about 1 x its size; only input that packs millions of tiny containers, strings
or arrays into a few bytes each reaches the limit. Read at each call (tests lower the slack)."""

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
        if name in INT_DTYPES or name in ("F32", "F64", "C64"):
            return self.flat.tolist()  # type: ignore[no-any-return]
        return self.flat.astype(np.float64).tolist()  # type: ignore[no-any-return]

    def to_json(self) -> list[Any]:
        """:meth:`to_list`, floats narrower than float64 marked to be written as the seed's f32."""
        values = self.to_list()
        return values if self.dtype.name == "F64" else serde_text.F32List(values)

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
    if d.name in FLOAT_DTYPES:
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
    return serde_text.dumps(_document(record, _Numbers.to_json), indent=indent)


def to_bytes(record: SnapshotRecord) -> bytes:
    """The seed's ``Checkpoint::to_bytes`` (``serde_json::to_vec``): the compact JSON document
    of ``record`` as UTF-8 bytes. ``InferenceSnapshot.to_seed_bytes`` calls this; the snapshot's
    own ``to_bytes`` is savepoint's binary encoding (:mod:`savepoint.codecs.snapshot`)."""
    return encode_json(record).encode("utf-8")


def from_bytes(data: bytes | bytearray | memoryview) -> SnapshotRecord:
    """The seed's ``Checkpoint::from_bytes``: the record held by JSON bytes (what
    :func:`to_bytes` or the seed wrote; the pretty layout too), read as :func:`decode_json`."""
    if isinstance(data, memoryview):
        data = bytes(data)
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"expected bytes, got {type(data).__name__}")
    return decode_json(data)


def encode_msgpack(record: SnapshotRecord) -> bytes:
    """The MessagePack bytes of ``record``: the JSON document with the seed's structs as
    positional arrays (:func:`_positional`), numbers fixed width."""
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

    pack(_positional(_document(record, lambda numbers: numbers)))
    return b"".join(out)


def _as_array(doc: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any] | list[Any]:
    """``doc`` as rmp_serde's positional struct when it holds exactly the struct's fields."""
    if len(doc) == len(fields) and set(doc) == set(fields):
        return [doc[k] for k in fields]
    return doc


def _positional(doc: dict[str, Any]) -> dict[str, Any] | list[Any]:
    """The document with every struct the seed could have written as ``rmp_serde::encode::write``
    writes it (an array of its fields in declaration order); a struct carrying savepoint's extra
    keys stays a map (rmp_serde reads either, and ignores the unknown keys of a map)."""
    config = doc["config"]
    doc = {
        **doc,
        "config": _as_array(config, CONTEXT_CONFIG_FIELDS) if isinstance(config, dict) else config,
        "states": [_as_array(state, STATE_FIELDS) for state in doc["states"]],
        "metadata": _as_array(doc["metadata"], METADATA_FIELDS),
    }
    return _as_array(doc, CHECKPOINT_FIELDS)


# ---------------------------------------------------------------------------------------------
# reading: the document (shared by JSON and MessagePack)
# ---------------------------------------------------------------------------------------------


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
    return _parse(doc, "kizzasi JSON", Budget(len(raw), JSON_BUDGET_FACTOR, BUDGET_SLACK))


def decode_msgpack(data: bytes | bytearray | memoryview) -> SnapshotRecord:
    """The record held by MessagePack ``data``: structs as arrays (the seed's layout, which
    savepoint writes) or as maps (rmp_serde's named layout, what savepoint 0.1 wrote).

    Bounded (see :mod:`savepoint.codecs._kizzasi_msgpack`): nesting deeper than :data:`MAX_DEPTH` levels, more decoded
    objects than :data:`BUDGET_FACTOR` x ``len(data)`` + :data:`BUDGET_SLACK` bytes, a length
    running past the end and trailing bytes are CorruptCheckpointError.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, got {type(data).__name__}")
    buf = memoryview(data).cast("B")
    reader = Reader(buf, Budget(len(buf), BUDGET_FACTOR, BUDGET_SLACK))
    try:
        doc = reader.document()
    except Malformed as exc:
        raise CorruptCheckpointError(f"kizzasi MessagePack: {exc}") from None
    return _parse(doc, "kizzasi MessagePack", reader.budget)


def _parse(doc: Any, what: str, budget: Budget) -> SnapshotRecord:
    try:
        return _parse_document(doc, budget)
    except (Malformed, RecordError) as exc:
        raise CorruptCheckpointError(f"{what}: {exc}") from None


def _is_values(x: Any) -> bool:
    return isinstance(x, (list, Packed))


def _parse_document(doc: Any, budget: Budget) -> SnapshotRecord:
    require(isinstance(doc, dict), "the document is not an object")
    require("version" in doc, "missing field version")
    version = doc["version"]
    if not is_count(version):
        raise Malformed(f"version must be a non-negative integer, got {show(version)}")
    if version != CHECKPOINT_VERSION:
        # Before anything else: another version may lay its fields out differently.
        raise IncompatibleCheckpointError(
            f"kizzasi checkpoint version {version}; savepoint reads version {CHECKPOINT_VERSION} "
            "(the only version the seed defines)"
        )
    missing = [f for f in CHECKPOINT_FIELDS if f not in doc]
    require(not missing, f"missing field(s) {', '.join(missing)}")
    require(isinstance(doc["config"], dict), "config must be an object")
    # The document was just decoded: check its config where it is, without a second copy.
    config = check_config(doc["config"], copy=False)
    metadata = doc["metadata"]
    require(isinstance(metadata, dict), "metadata must be an object")
    missing = [f for f in METADATA_FIELDS if f not in metadata]
    require(not missing, f"metadata: missing field(s) {', '.join(missing)}")
    require(isinstance(metadata["tags"], list), "metadata tags must be a list")
    raw_states, raw_history = doc["states"], doc["history"]
    require(isinstance(raw_states, list), "states must be a list")
    require(isinstance(raw_history, list), "history must be a list")

    states, state_kinds = [], []
    for i, entry in enumerate(raw_states):
        where = f"states[{i}]"
        require(isinstance(entry, dict), f"{where} is not an object")
        missing = [f for f in STATE_FIELDS if f not in entry]
        require(not missing, f"{where}: missing field(s) {', '.join(missing)}")
        hidden_dim, state_dim = entry["hidden_dim"], entry["state_dim"]
        require(
            is_count(hidden_dim) and is_count(state_dim),
            f"{where}: hidden_dim and state_dim must be non-negative integers",
        )
        require(isinstance(entry["updated"], bool), f"{where}: updated must be a boolean")
        array, kind = _array(entry["state_data"], entry, (hidden_dim, state_dim), where, budget)
        d = dtypes.from_numpy(array.dtype, where)
        require(
            seed_dims(tuple(array.shape), d) == (hidden_dim, state_dim),
            f"{where}: hidden_dim x state_dim {hidden_dim} x {state_dim} disagrees with shape "
            f"{list(array.shape)}",
        )
        states.append(array)
        state_kinds.append(kind)

    layout = doc.get("history_layout")
    if layout is None:
        layout = [None] * len(raw_history)
    require(
        isinstance(layout, list) and len(layout) == len(raw_history),
        "history_layout must be a list with one entry per history element",
    )
    history, history_kinds = [], []
    for i, (values, extras) in enumerate(zip(raw_history, layout)):
        where = f"history[{i}]"
        require(extras is None or isinstance(extras, dict), f"history_layout[{i}] is not an object")
        require(_is_values(values), f"{where} is not a list of numbers")
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
    budget: Budget,
) -> tuple[np.ndarray[Any, Any], str]:
    """One array from its flat values and its extra keys (dtype, shape, kind, nonfinite)."""
    name = extras.get("dtype", "F32")
    if not (isinstance(name, str) and name in dtypes.BY_NAME):
        raise Malformed(f"{where}: unknown dtype {show(name)}")
    d = dtypes.BY_NAME[name]
    shape = check_shape(extras["shape"], d.itemsize, where) if "shape" in extras else default_shape
    kind = extras.get("kind", "numpy")
    if kind not in KINDS:
        raise Malformed(f"{where}: kind must be 'numpy' or 'torch', got {show(kind)}")
    require(_is_values(values), f"{where}: values must be a list of numbers")
    pair = 2 if name == "C64" else 1
    expected = math.prod(shape) * pair
    require(
        len(values) == expected,
        f"{where}: {len(values)} values for shape {list(shape)} of {name} ({expected} needed)",
    )
    target = np.dtype(np.float32) if name == "C64" else np.dtype(d.numpy)
    budget.array(len(values), target.itemsize, len(shape))
    flat = values.decode(d, where) if isinstance(values, Packed) else flat_array(values, d, where)
    nonfinite = extras.get("nonfinite")
    if nonfinite is not None and not isinstance(nonfinite, NonFinite):
        nonfinite = NonFinite.of_list(nonfinite, where, budget)
    if nonfinite is not None and len(nonfinite):
        require(name in FLOAT_DTYPES, f"{where}: nonfinite values in an array of {name}")
        nonfinite.patch(flat, where)
    if name == "C64":
        flat = flat.view(np.complex64)
    array = flat.reshape(shape)
    array.flags.writeable = False
    return array, kind
