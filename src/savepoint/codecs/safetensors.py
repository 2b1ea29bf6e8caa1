"""safetensors data files: the byte layout savepoint writes, and a reader that trusts nothing.

Layout (https://github.com/huggingface/safetensors, section "Format")::

    u64 LE   N             length of the JSON header
    N bytes  header        UTF-8 JSON object, padded with spaces to a multiple of 8 bytes
    rest     data buffer   tensors back to back, no holes

The header maps each tensor name to ``{"dtype": "F32", "shape": [..], "data_offsets": [b, e]}``
with offsets relative to the start of the data buffer, and may hold ``"__metadata__"``, a
str -> str map. savepoint writes tensors largest itemsize first: with the header padded to 8 bytes,
every tensor then starts at a multiple of its own itemsize, so mmap'd views are aligned.

Edge cases, as the reader enforces them:
- ``N`` is capped (100 MB, like safetensors) and must fit in the file; the JSON is read by the
  bounded reader of :mod:`savepoint.codecs.bounded_json` (512 levels of nesting at most, peak memory at
  most 24 x ``N`` + 32 MiB);
- duplicate names, unknown dtypes, negative or non-integer dims (a bool or ``2.0`` too) are
  errors; a shape has at most 64 dimensions, each below 2**62, and at most 2**62 bytes;
- ``e - b`` must equal ``prod(shape) * itemsize`` (Python integers: no overflow); 0-d tensors have
  ``shape == []`` and one element; empty tensors have ``b == e``;
- the offsets, sorted, must tile ``[0, len(data))`` exactly: no gap, no overlap, nothing after.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

from savepoint.codecs import bounded_json as _json
from savepoint.codecs import dtypes
from savepoint.errors import CorruptCheckpointError

__all__ = [
    "Entry",
    "HeaderError",
    "MAX_HEADER_BYTES",
    "PRODUCER",
    "header",
    "header_length",
    "layout",
    "ordered_layout",
    "parse_header",
]

MAX_HEADER_BYTES = 100_000_000
PRODUCER = {"producer": "savepoint"}


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


# Entries are made per tensor of a save: :func:`layout` sets their slots directly (the frozen
# dataclass ``__init__`` goes through ``object.__setattr__`` field by field, twice the cost).
_new_object = object.__new__
_SET_NAME, _SET_DTYPE, _SET_SHAPE, _SET_START, _SET_END = (
    Entry.__dict__[name].__set__ for name in ("name", "dtype", "shape", "start", "end")
)


class HeaderError(CorruptCheckpointError):
    """Raised by :func:`header_length` and :func:`parse_header` (a CorruptCheckpointError, so a
    ValueError too); callers that know the file add its path to the message."""


def layout(tensors: Sequence[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list[Entry]]:
    """Header bytes (length prefix included) and entries for ``(name, dtype, shape, nbytes)``.

    Entries come back in file order (largest itemsize first, otherwise as given).
    """
    itemsize = _ITEMSIZE
    try:
        order = sorted(tensors, key=lambda t: -itemsize[t[1]])
    except KeyError:
        for t in tensors:
            dtypes.from_name(t[1])  # raises naming the unknown dtype
        raise
    names = {t[0] for t in order}
    if "__metadata__" in names:
        raise ValueError("'__metadata__' is reserved in safetensors headers")
    if len(names) != len(order):
        return _layout_generic(order)  # repeated names: a dict keeps one, as it always did
    prefix = header(order)
    entries = []
    offset = len(prefix)
    for name, dtype, shape, nbytes in order:
        entry = _new_object(Entry)
        _SET_NAME(entry, name)
        _SET_DTYPE(entry, dtype)
        _SET_SHAPE(entry, shape)
        _SET_START(entry, offset)
        offset += nbytes
        _SET_END(entry, offset)
        entries.append(entry)
    return prefix, entries


def header(ordered: Sequence[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """The header bytes (length prefix included) :func:`layout` writes for ``(name, dtype,
    shape, nbytes)`` already in file order, with distinct names, none ``__metadata__``.

    Written member by member with the encoder ``json.dumps`` uses for strings: byte for byte
    what ``json.dumps(header, separators=(",", ":"), ensure_ascii=True)`` gives for the dict
    (``tests/formats/test_scale_paths.py`` holds them equal). Building a dict per tensor and
    encoding it cost a 100,000-tensor save about a second."""
    shapes: dict[tuple[int, ...], str] = {}
    encoded: dict[str, str] = {}  # dtypes repeat
    parts = [json.dumps({"__metadata__": PRODUCER}, separators=(",", ":"))[:-1]]
    offset = 0
    for name, dtype, shape, nbytes in ordered:
        shape_text = shapes.get(shape)
        if shape_text is None:
            shape_text = shapes[shape] = json.dumps(list(shape), separators=(",", ":"))
        dtype_text = encoded.get(dtype)
        if dtype_text is None:
            dtype_text = encoded[dtype] = _encode(dtype)
        end = offset + nbytes
        parts.append(
            f',{_encode(name)}:{{"dtype":{dtype_text},"shape":{shape_text},'
            f'"data_offsets":[{offset},{end}]}}'
        )
        offset = end
    parts.append("}")
    raw = "".join(parts).encode("ascii")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _layout_generic(
    order: Sequence[tuple[str, str, tuple[int, ...], int]],
) -> tuple[bytes, list[Entry]]:
    """:func:`layout` of tensors already in file order, through a dict and ``json.dumps``."""
    header: dict[str, Any] = {"__metadata__": PRODUCER}
    offset = 0
    spans = []
    for name, dtype, shape, nbytes in order:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        spans.append((name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    base = len(prefix)
    return prefix, [Entry(n, d, s, base + b, base + e) for n, d, s, b, e in spans]


def ordered_layout(
    tensors: Sequence[tuple[str, str, tuple[int, ...], int]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for ``(name, dtype, shape, nbytes)`` listed in the
    given order, with ``metadata`` as ``__metadata__`` when given, and the data order as indices
    into ``tensors``.

    For files other tools read (a conversion keeps its source's tensor order in the header); the
    data is laid out largest itemsize first (stable), so with the 8-byte-padded header every
    tensor is aligned to its itemsize. ValueError for a name that is reserved or repeated.
    """
    order = sorted(range(len(tensors)), key=lambda i: -dtypes.from_name(tensors[i][1]).itemsize)
    offsets: dict[int, tuple[int, int]] = {}
    position = 0
    for i in order:
        n = tensors[i][3]
        offsets[i] = (position, position + n)
        position += n
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for i, (name, dtype, shape, _) in enumerate(tensors):
        if name == "__metadata__" or name in header:
            raise ValueError(f"tensor name {name!r} is reserved or repeated")
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets[i])}
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def header_length(prefix: bytes, file_size: int) -> int:
    if len(prefix) < 8:
        raise HeaderError(f"file is {file_size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > file_size:
        raise HeaderError(f"header length {n} runs past the end of the {file_size}-byte file")
    return int(n)


def parse_header(raw: bytes, file_size: int) -> tuple[list[Entry], dict[str, str]]:
    """Validate header JSON ``raw`` (without its length prefix) for a file of ``file_size`` bytes.

    The JSON is read by the bounded reader of :mod:`savepoint.codecs.bounded_json` (nesting, memory
    per byte of header); every number must be a JSON integer (no bool, no ``2.0``), shapes have
    at most 64 dimensions whose product times the itemsize stays below 2**62.
    """
    base = 8 + len(raw)
    header = _json.loads(raw, HeaderError, "header")
    if type(header) is not dict:
        raise HeaderError("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
        raise HeaderError("__metadata__ must map strings to strings")
    entries = []
    for name, info in header.items():
        if type(info) is not dict or info.keys() != _ENTRY:
            raise HeaderError(
                f"tensor {_show(name)}: entry must have exactly dtype, shape, data_offsets"
            )
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None
        if itemsize is None:
            raise HeaderError(f"tensor {_show(name)}: unknown dtype {_show(dtype)}")
        if type(shape) is not list or len(shape) > 64 or not all(map(_is_count, shape)):
            raise HeaderError(
                f"tensor {_show(name)}: shape must be a list of at most 64 non-negative integers"
            )
        # Bounding each dimension first keeps the product of hostile ones cheap.
        if max(shape, default=0) >= 2**62 or math.prod([d or 1 for d in shape]) * itemsize >= 2**62:
            raise HeaderError(f"tensor {_show(name)}: shape {_show(shape)} is too large")
        if not (type(offsets) is list and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise HeaderError(
                f"tensor {_show(name)}: data_offsets must be two non-negative integers"
            )
        begin, end = offsets
        expected = math.prod(shape) * itemsize
        if end - begin != expected:
            raise HeaderError(
                f"tensor {_show(name)}: {_show(end - begin)} bytes for shape {shape} of {dtype} "
                f"({expected} needed)"
            )
        entries.append(Entry(name, dtype, tuple(shape), base + begin, base + end))
    position = base
    for e in sorted(entries, key=lambda e: (e.start, e.end)):
        if e.start != position:
            raise HeaderError(
                f"tensor {_show(e.name)}: data does not tile the buffer (gap or overlap)"
            )
        position = e.end
    if position != file_size:
        raise HeaderError(
            f"data buffer ends at byte {_show(position)} but the file is {file_size} bytes long"
        )
    return entries, metadata


_ENTRY = frozenset(("dtype", "shape", "data_offsets"))
_ITEMSIZE = {name: d.itemsize for name, d in dtypes.BY_NAME.items()}
# What ``json.dumps(..., ensure_ascii=True)`` writes for a string (the C encoder where built).
_encode = encode_basestring_ascii


def _is_count(x: Any) -> bool:
    """A JSON integer >= 0 (not a bool, not a float such as ``2.0``)."""
    return type(x) is int and x >= 0


def _show(x: Any) -> str:
    """``repr(x)``, shortened: hostile names and numbers can be megabytes long."""
    text = repr(x)
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"
