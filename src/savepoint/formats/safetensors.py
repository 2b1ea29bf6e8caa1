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
- ``N`` is capped (100 MB, like safetensors) and must fit in the file;
- duplicate names, unknown dtypes, negative or non-integer dims are errors;
- ``e - b`` must equal ``prod(shape) * itemsize`` (Python integers: no overflow); 0-d tensors have
  ``shape == []`` and one element; empty tensors have ``b == e``;
- the offsets, sorted, must tile ``[0, len(data))`` exactly: no gap, no overlap, nothing after.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from savepoint.formats import _json
from savepoint.state import dtypes

MAX_HEADER_BYTES = 100_000_000
PRODUCER = {"producer": "savepoint"}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class HeaderError(ValueError):
    """Raised by :func:`parse_header`; callers turn it into a CorruptCheckpointError with a path."""


def layout(tensors: Sequence[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list[Entry]]:
    """Header bytes (length prefix included) and entries for ``(name, dtype, shape, nbytes)``.

    Entries come back in file order (largest itemsize first, otherwise as given).
    """
    order = sorted(tensors, key=lambda t: -dtypes.from_name(t[1]).itemsize)
    header: dict[str, Any] = {"__metadata__": PRODUCER}
    offset = 0
    spans = []
    for name, dtype, shape, nbytes in order:
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved in safetensors headers")
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
    """Validate header JSON ``raw`` (without its length prefix) for a file of ``file_size`` bytes."""
    base = 8 + len(raw)
    header = _json.loads(raw, HeaderError, "header")
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise HeaderError("__metadata__ must map strings to strings")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise HeaderError(
                f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets"
            )
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in dtypes.BY_NAME:
            raise HeaderError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
            raise HeaderError(f"tensor {name!r}: shape must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise HeaderError(f"tensor {name!r}: data_offsets must be two non-negative integers")
        begin, end = offsets
        expected = math.prod(shape) * dtypes.BY_NAME[dtype].itemsize
        if end - begin != expected:
            raise HeaderError(
                f"tensor {name!r}: {end - begin} bytes for shape {shape} of {dtype} ({expected} needed)"
            )
        entries.append(Entry(name, dtype, tuple(shape), base + begin, base + end))
    position = base
    for e in sorted(entries, key=lambda e: (e.start, e.end)):
        if e.start != position:
            raise HeaderError(f"tensor {e.name!r}: data does not tile the buffer (gap or overlap)")
        position = e.end
    if position != file_size:
        raise HeaderError(
            f"data buffer ends at byte {position} but the file is {file_size} bytes long"
        )
    return entries, metadata


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
