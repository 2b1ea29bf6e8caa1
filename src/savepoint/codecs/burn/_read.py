"""Reading a burn record: one pass over its MessagePack value, every length checked against what
is left before anything is read or allocated (see :mod:`savepoint.formats.burn` for the rules)."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from savepoint.codecs import dtypes
from savepoint.codecs.burn._record import (
    FROM_BURN,
    MAX_DEPTH,
    MAX_VALUES,
    U64,
    Data,
    Metadata,
    Param,
    Tensors,
)
from savepoint.errors import CorruptCheckpointError, IncompatibleCheckpointError

_MAX_DIMS = 64
_BOOL_STORES = {"Native": 1, "U8": 1, "U32": 4}


class _Bad(Exception):
    """Malformed input; the caller raises CorruptCheckpointError naming the file."""


class _Unsupported(Exception):
    """A well-formed record savepoint cannot represent; IncompatibleCheckpointError."""


@dataclass
class Bin:
    """A MessagePack bin that is not a tensor's data: where it lies in the parsed array."""

    start: int
    length: int


class _Parser:
    """One pass over the MessagePack value in ``data`` (a uint8 array: a mapping or bytes)."""

    def __init__(
        self, data: np.ndarray[Any, Any], tensors: Tensors, max_depth: int, max_values: int
    ) -> None:
        self.data = data
        self.buf = data.data.cast("B")
        self.pos = 0
        self.end = len(data)
        self.values = 0
        self.tensors = tensors
        self.max_depth = max_depth
        self.max_values = max_values

    # -- primitives --------------------------------------------------------------------------

    def need(self, n: int) -> None:
        if n > self.end - self.pos:
            raise _Bad(
                f"a value needs {n} bytes at offset {self.pos} but only {self.end - self.pos} "
                "remain (truncated?)"
            )

    def uint(self, nbytes: int) -> int:
        self.need(nbytes)
        value = int.from_bytes(self.buf[self.pos : self.pos + nbytes], "big")
        self.pos += nbytes
        return value

    def count(self) -> None:
        self.values += 1
        if self.values > self.max_values:
            raise _Bad(
                f"more than {self.max_values} values (millions of tiny containers?); a module record "
                "holds a few per parameter"
            )

    def text(self, n: int) -> str:
        self.need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"a string at offset {self.pos - n} is not valid UTF-8") from None

    def at_array(self) -> bool:
        if self.pos >= self.end:
            return False
        m = self.buf[self.pos]
        return 0x90 <= m <= 0x9F or m in (0xDC, 0xDD)

    def key(self, where: str) -> str:
        self.need(1)
        m = self.buf[self.pos]
        if 0xA0 <= m <= 0xBF or m in (0xD9, 0xDA, 0xDB):
            self.count()
            self.pos += 1
            n = m & 0x1F if m <= 0xBF else self.uint({0xD9: 1, 0xDA: 2, 0xDB: 4}[m])
            return self.text(n)
        raise _Unsupported(
            f"{where}: a map key at offset {self.pos} is not a string; savepoint reads named "
            "records (NamedMpkFileRecorder), whose keys are field names"
        )

    # -- values ------------------------------------------------------------------------------

    def value(self, depth: int, where: tuple[str, ...]) -> Any:
        if depth > self.max_depth:
            raise _Bad(f"nested deeper than {self.max_depth} levels (offset {self.pos})")
        self.need(1)
        m = self.buf[self.pos]
        self.count()
        self.pos += 1
        if m <= 0x7F:
            return m
        if m >= 0xE0:
            return m - 0x100
        if m <= 0x8F:
            return self.map(m & 0x0F, depth, where)
        if m <= 0x9F:
            return self.array(m & 0x0F, depth, where)
        if m <= 0xBF:
            return self.text(m & 0x1F)
        if m == 0xC0:
            return None
        if m in (0xC2, 0xC3):
            return m == 0xC3
        if m in (0xC4, 0xC5, 0xC6):
            n = self.uint({0xC4: 1, 0xC5: 2, 0xC6: 4}[m])
            self.need(n)
            self.pos += n
            return Bin(self.pos - n, n)
        if m == 0xCA:
            self.need(4)
            (f32,) = struct.unpack_from(">f", self.buf, self.pos)
            self.pos += 4
            return np.float32(f32)
        if m == 0xCB:
            self.need(8)
            (f64,) = struct.unpack_from(">d", self.buf, self.pos)
            self.pos += 8
            return float(f64)
        if 0xCC <= m <= 0xCF:
            return self.uint(1 << (m - 0xCC))
        if 0xD0 <= m <= 0xD3:
            n = 1 << (m - 0xD0)
            raw = self.uint(n)
            return raw - (1 << (8 * n)) if raw >> (8 * n - 1) else raw
        if m in (0xD9, 0xDA, 0xDB):
            return self.text(self.uint({0xD9: 1, 0xDA: 2, 0xDB: 4}[m]))
        if m in (0xDC, 0xDD):
            return self.array(self.uint(2 if m == 0xDC else 4), depth, where)
        if m in (0xDE, 0xDF):
            return self.map(self.uint(2 if m == 0xDE else 4), depth, where)
        what = "an extension value" if m != 0xC1 else "the reserved byte 0xc1"
        raise _Bad(f"{what} at offset {self.pos - 1} (burn records hold none)")

    def array(self, n: int, depth: int, where: tuple[str, ...]) -> list[Any]:
        self.need(n)  # every element takes at least one byte
        return [self.value(depth + 1, (*where, str(i))) for i in range(n)]

    def map(self, n: int, depth: int, where: tuple[str, ...]) -> Any:
        self.need(2 * n)
        out: dict[str, Any] = {}
        start = self.pos
        for _ in range(n):
            k = self.key(_dotted(where))
            if k in out:
                raise _Bad(f"{_dotted(where)}: key {k!r} appears twice in one map")
            # Names are relative to the item, as flatten() gives them.
            inner = () if depth == 0 and k == "item" else (*where, k)
            if k == "value" and self.at_array():
                numbers = self.numbers()
                out[k] = numbers if numbers is not None else self.value(depth + 1, inner)
            else:
                out[k] = self.value(depth + 1, inner)
        return self.recognize(out, where, start)

    def numbers(self) -> np.ndarray[Any, Any] | None:
        """A legacy ``value`` array of numbers, decoded in bulk; None (nothing consumed) when its
        elements are not all float32, all float64, all booleans or all integers."""
        begin = self.pos
        m = self.buf[self.pos]
        self.pos += 1
        n = m & 0x0F if m <= 0x9F else self.uint(2 if m == 0xDC else 4)
        self.need(n)
        if n == 0:
            return np.empty(0, np.float32)
        first = self.buf[self.pos]
        for marker, width, code in ((0xCA, 5, ">f4"), (0xCB, 9, ">f8")):
            if first == marker and n * width <= self.end - self.pos:
                seg = self.data[self.pos : self.pos + n * width].reshape(n, width)
                if bool((seg[:, 0] == marker).all()):
                    self.pos += n * width
                    values: np.ndarray[Any, Any] = seg[:, 1:].copy().view(code).reshape(n)
                    return values.astype(code.replace(">", "<"))
        if first in (0xC2, 0xC3):
            seg = self.data[self.pos : self.pos + n]
            if bool(((seg == 0xC2) | (seg == 0xC3)).all()):
                self.pos += n
                flags: np.ndarray[Any, Any] = seg == 0xC3
                return flags
        seg = self.data[self.pos : self.pos + n]
        if bool(((seg <= 0x7F) | (seg >= 0xE0)).all()):  # every value a one-byte fixint
            self.pos += n
            return seg.view(np.int8).astype(np.int64)
        # Integers of mixed widths: one Python int each, so each counts against the values limit.
        out: list[int] = []
        try:
            for _ in range(n):
                m = self.buf[self.pos] if self.pos < self.end else -1
                if not (0 <= m <= 0x7F or m >= 0xE0 or 0xCC <= m <= 0xD3):
                    raise _Bad("not an integer")
                out.append(self.value(0, ()))
        except _Bad:
            self.pos = begin
            return None
        if min(out) >= -(1 << 63) and max(out) < (1 << 63):
            return np.array(out, dtype=np.int64)
        if min(out) >= 0:
            return np.array(out, dtype=np.uint64)
        self.pos = begin
        return None

    # -- tensors -----------------------------------------------------------------------------

    def recognize(self, node: dict[str, Any], where: tuple[str, ...], start: int) -> Any:
        keys = set(node)
        if keys == {"bytes", "shape", "dtype"}:
            return Data(self.tensor_data(node, where))
        if keys == {"value", "shape"} and isinstance(node["value"], (np.ndarray, list)):
            return Data(self.legacy(node, where))
        if keys == {"id", "param"} and isinstance(node["param"], Data):
            if not isinstance(node["id"], str):
                raise _Bad(f"{_dotted(where)}: a Param's id is not a string")
            return Param(node["param"].value, node["id"])
        values = node.get("value")
        if isinstance(values, np.ndarray):
            # Not a legacy tensor after all (a record field named "value" holding numbers): the
            # bulk-decoded array goes back to the list value() builds, each element counted, so
            # the tree says what the file says and writes back as the same numbers, not a tensor.
            self.values += len(values) - 1
            self.count()
            node["value"] = list(values) if values.dtype == np.float32 else values.tolist()
        return node

    def shape(self, node: dict[str, Any], where: tuple[str, ...]) -> tuple[int, ...]:
        shape = node["shape"]
        ok = isinstance(shape, list) and all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < U64 for d in shape
        )
        if not ok:
            raise _Bad(f"{_dotted(where)}: shape {shape!r} is not a list of unsigned integers")
        if len(shape) > _MAX_DIMS:
            raise _Unsupported(
                f"{_dotted(where)}: {len(shape)} dimensions; numpy holds at most {_MAX_DIMS}"
            )
        return tuple(shape)

    def tensor_data(self, node: dict[str, Any], where: tuple[str, ...]) -> Any:
        name = _dotted(where)
        raw, spelled = node["bytes"], node["dtype"]
        if not isinstance(raw, Bin):
            raise _Bad(f"{name}: 'bytes' is not a MessagePack bin")
        shape = self.shape(node, where)
        width = 0
        if isinstance(spelled, str):
            burn_name = spelled
        elif isinstance(spelled, dict) and len(spelled) == 1:
            ((burn_name, inner),) = spelled.items()
            if burn_name == "Bool" and isinstance(inner, str) and inner in _BOOL_STORES:
                width = _BOOL_STORES[inner]
            elif burn_name == "QFloat":
                raise _Unsupported(
                    f"{name}: a quantized tensor (QFloat); savepoint reads unquantized tensors "
                    "only: dequantize it in burn before saving"
                )
            elif inner is not None:
                raise _Unsupported(f"{name}: dtype {spelled!r} is not one savepoint knows")
        else:
            raise _Bad(f"{name}: dtype {spelled!r} is not a burn DType")
        if burn_name not in FROM_BURN:
            if burn_name == "QFloat":
                raise _Unsupported(f"{name}: a quantized tensor (QFloat) needs its scheme")
            raise _Unsupported(f"{name}: dtype {burn_name!r} is not one savepoint knows")
        dtype = dtypes.from_name(FROM_BURN[burn_name])
        if dtype.name == "BOOL" and width == 0:
            width = 1
        size = width or dtype.itemsize
        want = math.prod(shape) * size
        if raw.length != want:
            raise _Bad(
                f"{name}: {raw.length} bytes of data for shape {list(shape)} of {spelled!r} "
                f"({want} expected)"
            )
        view = self.data[raw.start : raw.start + raw.length]
        return self.tensors.stored(view, dtype, shape, width, name)

    def legacy(self, node: dict[str, Any], where: tuple[str, ...]) -> Any:
        name = _dotted(where)
        values = node["value"]
        if isinstance(values, list):
            raise _Unsupported(
                f"{name}: a burn <= 0.13 tensor whose values are not all float32, all float64, "
                "all integers or all booleans"
            )
        shape = self.shape(node, where)
        if math.prod(shape) != len(values):
            raise _Bad(f"{name}: {len(values)} values for shape {list(shape)}")
        return self.tensors.array(values.reshape(shape), name)


def _dotted(where: Sequence[str]) -> str:
    return ".".join(where) or "<item>"


@dataclass
class Parsed:
    """A record: its tree (:class:`Param` and :class:`Data` leaves holding the tensors the
    caller made) and its metadata."""

    item: Any
    metadata: Metadata


def parse(
    data: np.ndarray[Any, Any],
    path: str,
    tensors: Tensors,
    *,
    max_depth: int = MAX_DEPTH,
    max_values: int = MAX_VALUES,
) -> Parsed:
    """The record in ``data`` (a uint8 array holding exactly one MessagePack value), checked.

    ``path`` names it in messages; ``tensors`` makes its tensors; at most ``max_depth`` levels of
    nesting and ``max_values`` decoded values. Raises CorruptCheckpointError (malformed) or
    IncompatibleCheckpointError (gzip-compressed, or well-formed but not representable)."""
    if len(data) >= 2 and bytes(data[:2]) == b"\x1f\x8b":
        raise IncompatibleCheckpointError(
            f"{path} is gzip-compressed (NamedMpkGzFileRecorder, burn's default before 0.12): "
            "decompress it (gunzip) and read the result",
            path=path,
        )
    parser = _Parser(data, tensors, max_depth, max_values)
    try:
        if not len(data):
            raise _Bad("the file is empty")
        top = parser.value(0, ())
        if parser.pos != parser.end:
            raise _Bad(f"{parser.end - parser.pos} bytes follow the record")
        if not isinstance(top, dict) or "item" not in top or "metadata" not in top:
            raise _Bad("not a burn record: a map with 'metadata' and 'item' was expected")
        meta = top["metadata"]
        fields = ("float", "int", "format", "version", "settings")
        if not isinstance(meta, dict) or not all(isinstance(meta.get(f), str) for f in fields):
            raise _Bad(f"'metadata' must map {', '.join(fields)} to strings")
        if top.get("_b", []) not in ([], None):
            raise _Bad("'_b' (the backend marker) must be [] or nil")
    except _Bad as exc:
        raise CorruptCheckpointError(f"{path}: {exc}", path=path) from None
    except _Unsupported as exc:
        raise IncompatibleCheckpointError(f"{path}: {exc}", path=path) from None
    metadata = Metadata(*(meta[f] for f in fields))
    return Parsed(top["item"], metadata)
