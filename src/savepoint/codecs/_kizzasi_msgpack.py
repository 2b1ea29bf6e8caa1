"""Bounded reading for the kizzasi layout (see :mod:`savepoint.codecs.kizzasi`): the budget,
the checked number conversion shared by the JSON and MessagePack readers, and the MessagePack
walker.

Contract of the walker (:class:`Reader`), whatever the input:

- it walks the document's known layout and never calls ``msgpack.unpackb`` on the whole input:
  numeric arrays (``state_data``, history entries) are located and checked without building a
  Python object per value (:class:`Packed`) and converted straight into numpy arrays once
  their dtype is known (vectorised for the layouts the seed and savepoint write:
  :func:`_scalar_run`, :func:`_convert`); ``nonfinite`` lists go straight into integer arrays;
  unknown keys are passed over without building anything (:meth:`Reader.skip`, iterative);
- everything it builds is charged to the :class:`Budget` it is given (``BUDGET_FACTOR`` x the
  input's size + ``BUDGET_SLACK`` bytes, set in :mod:`savepoint.codecs.kizzasi`); conversion temporaries stay under 1 MiB (:data:`_CHUNK`,
  :data:`_VCHUNK`);
- nesting is counted (at most :data:`MAX_DEPTH` levels), so no input reaches Python's recursion
  limit; a length running past the end, trailing bytes, duplicate keys, non-string keys, invalid
  UTF-8 and extension values where a value is built are malformed;
- every failure is a :class:`Malformed` (a ValueError), which the public readers in
  :mod:`savepoint.codecs.kizzasi` turn into CorruptCheckpointError; nothing here is public.

The values it returns (plain dicts and lists, :class:`Packed`, :class:`NonFinite`) are then
checked against the layout by :func:`savepoint.codecs.kizzasi._parse_document`, the same code
that checks a JSON document.
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from savepoint.codecs.dtypes import DType
from savepoint.codecs.snapshot import MAX_CONFIG_DEPTH, is_count, show

# The layout's names (documented in savepoint.codecs.kizzasi, which re-exports them).

CHECKPOINT_VERSION = 1
CHECKPOINT_FIELDS = ("version", "config", "states", "history", "step_count", "metadata")
STATE_FIELDS = ("hidden_dim", "state_dim", "state_data", "updated")
METADATA_FIELDS = ("timestamp", "description", "model_id", "tags")
CONTEXT_CONFIG_FIELDS = ("max_context", "store_history", "num_layers", "hidden_dim", "state_dim")

FLOAT_DTYPES = {
    "F16",
    "BF16",
    "F32",
    "F64",
    "C64",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
}
INT_DTYPES = {"U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}
_HEX = re.compile(r"[0-9a-f]+")


# ---------------------------------------------------------------------------------------------
# the budget
# ---------------------------------------------------------------------------------------------

MAX_DEPTH = MAX_CONFIG_DEPTH + 8
"""Deepest nesting the MessagePack reader accepts, counted from the document (config's own
limit is 64 levels below its key)."""


class Malformed(ValueError):
    pass


class Budget:
    """Bytes of objects and arrays a decoder may still build: ``factor`` x the input's ``size``
    + ``slack`` (the limits are :mod:`savepoint.codecs.kizzasi`'s ``BUDGET_*`` constants)."""

    def __init__(self, size: int, factor: int, slack: int) -> None:
        self.size = size
        self.factor = factor
        self.slack = slack
        self.left = factor * size + slack

    def charge(self, nbytes: int) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise Malformed(
                f"the document decodes to more than {self.factor} x its {self.size} bytes "
                f"+ {self.slack >> 20} MiB of objects and arrays (millions of tiny containers, "
                "strings or arrays?)"
            )

    def array(self, count: int, itemsize: int, ndim: int = 1) -> None:
        """Charge one numpy array of ``count`` items (its object, shape and data)."""
        self.charge(128 + 16 * ndim + count * itemsize)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise Malformed(message)


def flat_array(values: list[Any], d: DType, where: str) -> np.ndarray[Any, Any]:
    """``values`` as a flat array of ``d`` (its float32 components for complex), checked."""
    types = set(map(type, values))
    name = d.name
    if name == "BOOL":
        require(types <= {int, bool}, f"{where}: boolean values must be 0 or 1")
        require(all(v in (0, 1) for v in values), f"{where}: boolean values must be 0 or 1")
        return np.array(values, dtype=np.uint8).astype(np.bool_)
    if name in INT_DTYPES:
        require(types <= {int}, f"{where}: {name} values must be integers")
        if values:
            info = np.iinfo(d.numpy)
            require(
                info.min <= min(values) and max(values) <= info.max,
                f"{where}: a value lies outside the range of {name}",
            )
        return np.array(values, dtype=d.numpy)
    require(types <= {int, float}, f"{where}: {name} values must be numbers")
    try:
        wide = np.array(values, dtype=np.float64)
    except (OverflowError, ValueError, TypeError):
        raise Malformed(f"{where}: a value is not a float64 number") from None
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
    require(
        not (~np.isfinite(check) & np.isfinite(wide)).any(),
        f"{where}: a value lies outside the range of {d.name}",
    )
    return narrow


class NonFinite:
    """An array's ``nonfinite`` list, ``[[index, hex bits], ...]``, as two integer arrays."""

    def __init__(self, indices: np.ndarray[Any, Any], bits: np.ndarray[Any, Any], digits: int):
        self.indices = indices
        self.bits = bits
        self.digits = digits  # hex digits of every entry (0 when there is none)

    def __len__(self) -> int:
        return len(self.indices)

    @classmethod
    def of_list(cls, entries: Any, where: str, budget: Budget) -> NonFinite:
        require(isinstance(entries, list), f"{where}: nonfinite must be a list of [index, bits]")
        budget.array(len(entries), 16)
        indices = np.empty(len(entries), dtype=np.int64)
        bits = np.empty(len(entries), dtype=np.uint64)
        digits = 0
        for i, entry in enumerate(entries):
            require(
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
        require(
            self.digits == 2 * width and bool((self.indices < flat.size).all()),
            f"{where}: a nonfinite entry is not [index < {flat.size}, {2 * width} hex digits]",
        )
        require(
            len(np.unique(self.indices)) == len(self.indices),
            f"{where}: a nonfinite index repeats",
        )
        unsigned = np.dtype(f"<u{width}")
        patch = self.bits.astype(unsigned).view(flat.dtype)
        with np.errstate(invalid="ignore"):
            wide = patch if patch.dtype in (np.float32, np.float64) else patch.astype(np.float32)
        require(not np.isfinite(wide).any(), f"{where}: a nonfinite entry holds a finite value")
        flat.view(unsigned)[self.indices] = patch.view(unsigned)


def _hex_bits(text: str, digits: int, where: str) -> int:
    require(
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
_PACKED_COST = 96  # a Packed (slots) and its slot in a list: 88 bytes measured
_NO_BOUNDS: list[int] = []  # shared by every array that is not on the mixed path
# str 8/16/32 and bin 8/16/32: the size of their length field.
_LENGTH_BYTES = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4, 0xD4: -1, 0xD5: -2, 0xD6: -4, 0xD7: -8, 0xD8: -16}


class Reader:
    """A MessagePack reader for the kizzasi document that never builds more than its budget.

    ``msgpack.unpackb`` builds every value before a caller can look at it: 8 MiB of ``0x90``
    (empty arrays) become 8 million lists, about 500 MiB. This reader walks the document's
    known layout instead: numeric arrays (``state_data``, history entries) are located and
    checked without building a Python object per value and decoded straight into numpy arrays
    once their dtype is known (:class:`Packed`); ``nonfinite`` lists go straight into integer
    arrays; unknown keys are skipped without building anything; every other value (config,
    metadata, the small fields) is built and charged to a budget. Nesting depth is counted, so
    no input reaches Python's recursion limit.
    """

    def __init__(self, buf: memoryview, budget: Budget) -> None:
        self.buf = buf
        self.pos = 0
        self.end = len(buf)
        self.budget = budget
        self.charge = self.budget.charge

    # -- primitives --------------------------------------------------------------------------

    def need(self, n: int) -> None:
        if n > self.end - self.pos:
            raise Malformed(
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
                raise Malformed(f"a string at offset {self.pos - n} is not valid UTF-8") from None
        if m in (0xC4, 0xC5, 0xC6):
            return bytes(self.take(self.uint(_LENGTH_BYTES[m])))
        if m in _EXT:
            raise Malformed(f"an extension value at offset {self.pos - 1} (not in the layout)")
        raise Malformed(f"byte 0x{m:02x} at offset {self.pos - 1} does not start a value")

    def take(self, n: int) -> memoryview:
        self.need(n)
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def value(self, depth: int) -> Any:
        """Any value, built and charged to the budget."""
        if depth > MAX_DEPTH:
            raise Malformed(f"nested deeper than {MAX_DEPTH} levels (offset {self.pos})")
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
                raise Malformed(f"duplicate key {show(key)}")
            out[key] = self.value(depth + 1)
        return out

    def key(self) -> str:
        if self.container() is not None:
            raise Malformed(f"a map key at offset {self.pos} is not a string")
        key = self.scalar()
        if not isinstance(key, str):
            raise Malformed(f"a map key at offset {self.pos} is not a string, got {show(key)}")
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
                raise Malformed(f"nested deeper than {MAX_DEPTH} levels (offset {self.pos})")
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
                    raise Malformed(f"byte 0x{m:02x} at offset {self.pos} does not start a value")
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
            require(
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
            raise Malformed(f"{self.end - self.pos} bytes after the document")
        return doc

    def fields(self, n: int, depth: int, read: Any) -> dict[str, Any]:
        """A map's entries: ``read(key)`` gives a known key's value, or None to skip it."""
        out: dict[str, Any] = {}
        seen: set[str] = set()
        self.charge(64 + 48 * n)
        for _ in range(n):
            key = self.key()
            if key in seen:
                raise Malformed(f"duplicate key {show(key)}")
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

    def array_length(self) -> int | None:
        """Consume an array header and return its length; None (position unchanged) for any
        other value, which the caller then builds as it is for the layout check to report."""
        start = self.pos
        header = self.container()
        if header is None or header[0] != "array":
            self.pos = start
            return None
        return header[1]

    def listed(self, item: Callable[[int], Any]) -> Any:
        n = self.array_length()
        if n is None:
            return self.value(1)
        self.charge(64 + 8 * n)
        return [item(i) for i in range(n)]

    def state(self, where: str) -> Any:
        header = self.container()
        if header is None:
            return self.value(2)
        kind, n = header
        if kind == "array":
            require(
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
        """A numeric array, located and checked without building its values (:class:`Packed`)."""
        n = self.array_length()
        if n is None:
            return self.value(3)
        self.charge(_PACKED_COST)
        packed = Packed(self, self.pos, n)
        self.pos = packed.scan(where)
        return packed

    def nonfinite(self, where: str) -> Any:
        n = self.array_length()
        if n is None:
            return self.value(3)
        self.need(5 * n)  # [index, "hex"] takes at least 5 bytes
        self.budget.array(n, 16)
        indices = np.empty(n, dtype=np.int64)
        bits = np.empty(n, dtype=np.uint64)
        digits = 0
        for i in range(n):
            entry = self.container()
            require(
                entry == ("array", 2),
                f"{where}: a nonfinite entry is not [index, hex digits]",
            )
            index, text = self.scalar(), self.scalar()
            require(
                is_count(index, 1 << 62) and isinstance(text, str),
                f"{where}: a nonfinite entry is not [index, hex digits]",
            )
            indices[i], bits[i], digits = index, _hex_bits(text, digits, where), len(text)
        return NonFinite(indices, bits, digits)


_SKIP: Any = object()


def _struct(value: Any, fields: tuple[str, ...], what: str) -> Any:
    """rmp_serde's positional form of a struct (an array of its fields) as the named form."""
    if isinstance(value, list):
        require(
            len(value) == len(fields),
            f"{what} as an array must have {len(fields)} fields ({', '.join(fields)}), "
            f"got {len(value)}",
        )
        return dict(zip(fields, value))
    return value


class Packed:
    """A MessagePack array of numbers, located in the input but not yet decoded.

    :meth:`scan` checks every element is a number (or a boolean) and finds the end; once the
    dtype is known, :meth:`decode` converts the elements straight into a numpy array. The
    common layouts (every element one fixed-width type, as the seed and savepoint write them;
    every element one byte) are converted vectorised; any other mix goes through Python values
    ``_CHUNK`` at a time, so temporaries stay bounded either way.
    """

    __slots__ = ("bounds", "count", "layout", "marker", "reader", "start")

    def __init__(self, reader: Reader, start: int, count: int) -> None:
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
                    raise Malformed(f"{where}: values must be numbers")
                pos += width
        except IndexError:
            raise Malformed(f"{where}: the values run past the end (truncated)") from None
        if pos > len(buf):
            raise Malformed(f"{where}: the values run past the end (truncated)")
        bounds.append(pos)
        self.bounds = bounds
        return pos

    def decode(self, d: DType, where: str) -> np.ndarray[Any, Any]:
        """The elements as a flat array of ``d`` (its float32 components for complex), checked
        as :func:`flat_array` checks a JSON list."""
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
            out[k * _CHUNK : k * _CHUNK + count] = flat_array(chunk, d, where)


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
    :func:`flat_array` would see) as ``d``, under the same rules."""
    name = d.name
    if name == "BOOL":
        require(kind in ("int", "bool"), f"{where}: boolean values must be 0 or 1")
        require(
            not bool(((values != 0) & (values != 1)).any()),
            f"{where}: boolean values must be 0 or 1",
        )
        return values.astype(np.bool_)
    if name in INT_DTYPES:
        require(kind == "int", f"{where}: {name} values must be integers")
        if values.size:
            info = np.iinfo(d.numpy)
            require(
                info.min <= int(values.min()) and int(values.max()) <= info.max,
                f"{where}: a value lies outside the range of {name}",
            )
        return values.astype(d.numpy)
    require(kind in ("int", "float"), f"{where}: {name} values must be numbers")
    with np.errstate(invalid="ignore"):  # a signalling NaN widens quietly, as Python does
        wide = values.astype(np.float64)
    return _narrow(wide, d, where)
