"""burn's named MessagePack records (``*.mpk``), read and written as burn lays them out.

Which burn. This follows **burn 0.20.1** (``burn-core/src/record/{recorder,file,tensor,primitive}.rs``,
``burn-backend/src/data/tensor.rs``, ``burn-std/src/tensor/dtype.rs``), whose ``DefaultRecorder``
is ``NamedMpkFileRecorder<FullPrecisionSettings>``: ``rmp_serde::encode::write_named`` (rmp-serde
1.3) into an uncompressed file whose extension the recorder sets to ``mpk`` (``Path::set_extension``:
the stem ``"model"`` becomes ``model.mpk``). burn 0.12 through 0.21 write the same layout; the
differences are listed under "Versions" below. burn 0.11 and earlier gzip the same bytes
(``.mpk.gz``): savepoint refuses those with a message saying to decompress them first.

Layout. The file is exactly one MessagePack value (nothing may follow it). Structs are maps keyed
by field name (that is what "named" means), in declaration order::

    BurnRecord = map(3) {
      "metadata": map(5) {"float": str, "int": str, "format": str, "version": str,
                          "settings": str},
      "item":     <the module's record>,
      "_b":       array(0)          PhantomData<Backend>, a unit struct: rmp-serde writes []
    }

    module record (derive(Module))  map {field name: record of the field}, declaration order
    Vec<M>, [M; N], tuples          array of records
    Option<M>                       nil (None) or the record (Some)
    constants, plain tensors,       nil (burn's ConstantRecord: a Tensor field that is not a
      dropout, activations          Param is not saved)
    enum modules                    map(1) {variant name: record}
    primitives (usize, f32, ...)    the MessagePack number, bool or str
    Param<Tensor>                   map(2) {"id": str, "param": TensorData}
    TensorData                      map(3) {"bytes": bin, "shape": array of uint, "dtype": DType}
    DType                           str, serde's unit variant: "F64" "F32" "Flex32" "F16" "BF16"
                                    "I64" "I32" "I16" "I8" "U64" "U32" "U16" "U8" "Bool";
                                    {"QFloat": scheme} for quantized tensors

``bytes`` holds the elements' raw little-endian bytes in C order: exactly product(shape) x the
dtype's size (``Flex32`` is stored as float32, ``Bool`` as one byte 0 or 1). ``id`` is burn's
``ParamId::serialize``: the u64 id's 8 little-endian bytes in BASE32_DNSSEC (alphabet
``0-9a-v``, no padding), 13 characters; burn panics on a string it cannot decode, so the writer
always writes that form. MessagePack lengths and unsigned integers use the shortest encoding
(fixmap/map16/map32, fixstr/str8/str16/str32, bin8/bin16/bin32, positive fixint/uint8-64), as
rmp-serde does, so savepoint's output for a record is byte-identical to burn's.

Versions (what the reader accepts besides the above):

- burn 0.21 spells a boolean dtype ``{"Bool": "Native" | "U8" | "U32"}`` (a ``BoolStore``): Native
  and U8 are one byte per element, U32 four (each 0 or 1). Writing with ``burn_version >= 0.21``
  gives ``{"Bool": "Native"}``; burn 0.21 cannot read 0.20's ``"Bool"`` and the reverse, so
  choose the version of the reader. Float and integer tensors are spelled the same in both.
- burn 0.12 and 0.13 store a tensor as ``map(2) {"value": array of numbers, "shape": array}``
  (``DataSerialize``), without a dtype: savepoint reads it as float32 (every value ``float 32``),
  float64 (``float 64``), bool, or int64 (any mix of integer markers; these files do not say the
  width: burn's FullPrecisionSettings wrote i32). It never writes that form.
- ``_b`` may be missing, nil or ``[]``; unknown top-level keys are ignored (serde ignores them).

What savepoint returns. :func:`load_record` gives ``{dotted name: numpy array}``: field names and
array indices joined with ``.`` (``layers.0.weight``), burn's own ``ModuleVisitor`` naming. Float
tensors keep their stored dtype (burn converts to the recorder's and the backend's precision on
load; savepoint never casts). :func:`open_record` gives the whole record as a tree (``dict``,
``list``, ``None``, numbers, strings, :class:`Param` and :class:`Data` leaves) without reading
tensor data; :func:`write_record` writes such a tree back byte for byte.

What the writer writes. :func:`save_record` takes ``{dotted name: tensor}`` (numpy arrays, torch
tensors or :class:`Param` for an explicit id) and nests it back: a name's components are map
keys, except that a node whose keys are all decimal indices (``0``, ``1``, ... without leading
zeros) becomes an array, holes filled with nil. Fields burn stores as nil (constants, ``None``
options) may be left out: burn's derived records read a missing ``Option`` or ``ConstantRecord``
field as nil. Param ids are taken from ``ids`` (as :meth:`RecordFile.ids` returns them) or
derived from the name (BLAKE2b of its UTF-8, 8 bytes), so equal inputs give equal bytes. dtypes
map one to one (float64 F64, float32 F32, float16 F16, bfloat16 BF16, int8-64 I8-I64, uint8-64
U8-U64, bool Bool); anything else (complex, float8) is an UnsupportedStateError. numpy scalars and
Python numbers in a tree are primitives (float32 as ``float 32``, Python float as ``float 64``);
numpy arrays, even 0-d, are tensors. A bin holds at most 2**32 - 1 bytes: a larger tensor cannot
be written (MessagePack's limit, hence burn's). Files are written atomically (temporary sibling,
fsync, rename, fsync of the directory).

What the reader enforces (hostile input: CorruptCheckpointError, or IncompatibleCheckpointError
for a well-formed record savepoint cannot represent):

- every length is checked against what is left of the file before anything is read or allocated;
  a bin is never copied (tensors are views of the read-only mapping until loaded);
- nesting deeper than :data:`MAX_DEPTH` and more than :data:`MAX_VALUES` decoded values (bulk
  legacy number arrays aside, which become numpy arrays) are refused, so memory stays within a
  small multiple of the file size and no input reaches Python's recursion limit;
- map keys must be strings and unique; extension types, the reserved byte ``0xc1`` and trailing
  bytes are errors;
- a map with exactly the keys ``bytes``/``shape``/``dtype`` (or the legacy ``value``/``shape``)
  is a tensor and must be a valid one: ``len(bytes)`` equals product(shape) x size, at most 64
  dimensions, a known dtype (quantized ``QFloat`` is IncompatibleCheckpointError); booleans must
  be 0 or 1 (checked when the data is read); a map ``{"id": str, "param": tensor}`` is a Param;
- two leaves with one dotted name (a map key that itself contains a ``.``) is an error.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from savepoint.codecs import dtypes
from savepoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)
from savepoint.formats import _files
from savepoint.formats._files import LazyTensor, MappedTensor
from savepoint.formats._progress import Progress, Tally
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.state import arrays
from savepoint.state.arrays import TensorSource
from savepoint.storage import local
from savepoint.storage.paths import local_path

__all__ = [
    "BURN_VERSION",
    "DTYPES",
    "Data",
    "EXTENSION",
    "Framework",
    "MAX_DEPTH",
    "MAX_VALUES",
    "Metadata",
    "Param",
    "RecordFile",
    "decode",
    "encode",
    "file_name",
    "flatten",
    "inspect",
    "load_record",
    "num_params",
    "open_record",
    "param_id",
    "save_record",
    "unflatten",
    "verify",
    "write_record",
]

BURN_VERSION = "0.20.1"
EXTENSION = "mpk"
MAX_DEPTH = 128
MAX_VALUES = 2_000_000
_RECORDER = "burn_core::record::file::NamedMpkFileRecorder<burn_core::record::settings::FullPrecisionSettings>"
_MAX_DIMS = 64
_MAX_HOLES = 1 << 20
_U64 = 1 << 64
_INDEX = re.compile(r"(0|[1-9][0-9]*)\Z", re.ASCII)
Framework = Literal["numpy", "torch"]

# burn's DType spelling <-> savepoint's dtype names. Flex32 is float32 storage.
_FROM_BURN = {
    "F64": "F64",
    "F32": "F32",
    "Flex32": "F32",
    "F16": "F16",
    "BF16": "BF16",
    "I64": "I64",
    "I32": "I32",
    "I16": "I16",
    "I8": "I8",
    "U64": "U64",
    "U32": "U32",
    "U16": "U16",
    "U8": "U8",
    "Bool": "BOOL",
}
_TO_BURN = {v: k for k, v in _FROM_BURN.items() if k != "Flex32"}
DTYPES = tuple(sorted(_TO_BURN))  # savepoint's names of the dtypes a burn record holds
_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})
_BOOL_STORES = {"Native": 1, "U8": 1, "U32": 4}


# ---------------------------------------------------------------------------------------------
# the record's parts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metadata:
    """``BurnMetadata``: what wrote the record. burn compares it only to explain a failed load."""

    float_elem: str = "f32"
    int_elem: str = "i32"
    format: str = _RECORDER
    version: str = BURN_VERSION
    settings: str = "FullPrecisionSettings"

    def to_dict(self) -> dict[str, str]:
        return {
            "float": self.float_elem,
            "int": self.int_elem,
            "format": self.format,
            "version": self.version,
            "settings": self.settings,
        }


@dataclass
class Param:
    """A module parameter (burn's ``ParamSerde {id, param}``): a tensor and its id.

    ``value`` is a numpy array, a torch tensor or (from a reader) a lazy tensor; ``id`` None
    means "derive it from the name" when written."""

    value: Any
    id: str | None = None


@dataclass
class Data:
    """A bare ``TensorData`` (no Param around it): rare in module records, kept for fidelity."""

    value: Any


def param_id(name: str) -> str:
    """The id savepoint writes for the parameter ``name``: BLAKE2b (8 bytes) of its UTF-8, as
    burn serializes a ``ParamId`` (BASE32_DNSSEC of the u64's little-endian bytes)."""
    raw = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return _encode_id(raw)


def _encode_id(raw8: bytes) -> str:
    return base64.b32hexencode(raw8).decode("ascii").rstrip("=").lower()


def file_name(stem: str) -> str:
    """The file name burn's file recorders use for ``stem``: Rust's ``Path::set_extension("mpk")``
    (the last ``.ext`` of the name is replaced: ``model`` -> ``model.mpk``, ``w.v1`` ->
    ``w.mpk``; a name starting with its only dot keeps it: ``.w`` -> ``.w.mpk``)."""
    if stem in ("", ".", "..") or "/" in stem or "\x00" in stem:
        raise ValueError(f"{stem!r} is not a file name")
    dot = stem.rfind(".")
    base = stem[:dot] if dot > 0 else stem
    return f"{base}.{EXTENSION}"


# ---------------------------------------------------------------------------------------------
# lazy tensors the reader makes
# ---------------------------------------------------------------------------------------------


class _BoolTensor(LazyTensor):
    """Booleans stored as bytes (Native/U8: 1, U32: 4 per element); values other than 0 and 1
    raise CorruptCheckpointError when copied."""

    def __init__(self, view: np.ndarray[Any, Any], shape: tuple[int, ...], width: int,
                 name: str, path: str) -> None:  # fmt: skip
        super().__init__(dtypes.from_name("BOOL"), shape)
        self.raw = view
        self.width = width
        self._name = name
        self._path = path

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        w = self.width
        raw = self.raw[start * w : (start + len(dst)) * w]
        values = raw if w == 1 else raw.view("<u4")
        if len(values) and int(values.max()) > 1:
            raise CorruptCheckpointError(
                f"{self._path}: bool tensor {self._name!r} holds a value other than 0 and 1",
                path=self._path,
                key=self._name,
            )
        np.copyto(dst, values, casting="unsafe")


def _array_tensor(array: np.ndarray[Any, Any], name: str) -> LazyTensor:
    return _files.ArrayTensor(arrays.NumpySource(array, name))


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


class _Bad(Exception):
    """Malformed input; the caller raises CorruptCheckpointError naming the file."""


class _Unsupported(Exception):
    """A well-formed record savepoint cannot represent; IncompatibleCheckpointError."""


@dataclass
class _Bin:
    start: int
    length: int


class _Parser:
    """One pass over the MessagePack value in ``data`` (a uint8 array: a mapping or bytes)."""

    def __init__(self, data: np.ndarray[Any, Any], path: str) -> None:
        self.data = data
        self.buf = data.data.cast("B")
        self.pos = 0
        self.end = len(data)
        self.values = 0
        self.path = path

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
        if self.values > MAX_VALUES:
            raise _Bad(
                f"more than {MAX_VALUES} values (millions of tiny containers?); a module record "
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
        if depth > MAX_DEPTH:
            raise _Bad(f"nested deeper than {MAX_DEPTH} levels (offset {self.pos})")
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
            return _Bin(self.pos - n, n)
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
        # Integers of mixed widths: one Python int each, so each counts against MAX_VALUES.
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
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _U64 for d in shape
        )
        if not ok:
            raise _Bad(f"{_dotted(where)}: shape {shape!r} is not a list of unsigned integers")
        if len(shape) > _MAX_DIMS:
            raise _Unsupported(
                f"{_dotted(where)}: {len(shape)} dimensions; numpy holds at most {_MAX_DIMS}"
            )
        return tuple(shape)

    def tensor_data(self, node: dict[str, Any], where: tuple[str, ...]) -> LazyTensor:
        name = _dotted(where)
        raw, spelled = node["bytes"], node["dtype"]
        if not isinstance(raw, _Bin):
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
        if burn_name not in _FROM_BURN:
            if burn_name == "QFloat":
                raise _Unsupported(f"{name}: a quantized tensor (QFloat) needs its scheme")
            raise _Unsupported(f"{name}: dtype {burn_name!r} is not one savepoint knows")
        dtype = dtypes.from_name(_FROM_BURN[burn_name])
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
        if dtype.name == "BOOL":
            return _BoolTensor(view, shape, width, name, self.path)
        return MappedTensor(view, dtype, shape, name=name, path=self.path)

    def legacy(self, node: dict[str, Any], where: tuple[str, ...]) -> LazyTensor:
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
        return _array_tensor(values.reshape(shape), name)


def _dotted(where: Sequence[str]) -> str:
    return ".".join(where) or "<item>"


@dataclass
class _Parsed:
    item: Any
    metadata: Metadata


def _parse(data: np.ndarray[Any, Any], path: str) -> _Parsed:
    if len(data) >= 2 and bytes(data[:2]) == b"\x1f\x8b":
        raise IncompatibleCheckpointError(
            f"{path} is gzip-compressed (NamedMpkGzFileRecorder, burn's default before 0.12): "
            "decompress it (gunzip) and read the result",
            path=path,
        )
    parser = _Parser(data, path)
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
    return _Parsed(top["item"], metadata)


# ---------------------------------------------------------------------------------------------
# the tree and its flat names
# ---------------------------------------------------------------------------------------------


def flatten(item: Any) -> dict[str, Param | Data]:
    """Every tensor leaf of a record tree by dotted name (fields and indices joined by ``.``).

    Raises IncompatibleCheckpointError when two leaves get one name (a key holding a ``.``)."""
    out: dict[str, Param | Data] = {}
    stack: list[tuple[tuple[str, ...], Any]] = [((), item)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, (Param, Data)):
            name = ".".join(where)
            if name in out:
                raise IncompatibleCheckpointError(
                    f"two tensors are named {name!r} (a field or key holding '.'?)"
                )
            out[name] = node
        elif isinstance(node, dict):
            stack.extend(((*where, str(k)), v) for k, v in reversed(node.items()))
        elif isinstance(node, (list, tuple)):
            stack.extend(((*where, str(i)), v) for i, v in reversed(list(enumerate(node))))
    return out


def _values(item: Any) -> dict[str, Any]:
    """Plain (non-tensor, non-nil) leaves by dotted name."""
    out: dict[str, Any] = {}
    stack: list[tuple[tuple[str, ...], Any]] = [((), item)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            stack.extend(((*where, str(k)), v) for k, v in reversed(node.items()))
        elif isinstance(node, (list, tuple)):
            stack.extend(((*where, str(i)), v) for i, v in reversed(list(enumerate(node))))
        elif node is not None and not isinstance(node, (Param, Data, _Bin)):
            out[".".join(where)] = node.item() if isinstance(node, np.generic) else node
    return out


def unflatten(tensors: Mapping[str, Any]) -> Any:
    """The record tree for ``{dotted name: leaf}``: components become map keys, and a node whose
    keys are all decimal indices becomes an array (holes filled with nil).

    Raises UnsupportedStateError for an empty name or component, or a name that is both a leaf
    and a prefix of another (``a`` and ``a.b``)."""
    root: dict[str, Any] = {}
    for name, leaf in tensors.items():
        if not isinstance(name, str):
            raise UnsupportedStateError(f"tensor name {name!r} is not a str")
        parts = name.split(".")
        if not all(parts):
            raise UnsupportedStateError(
                f"tensor name {name!r} has an empty component; burn names are field names and "
                "indices joined by '.'",
                key=name,
            )
        node = root
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UnsupportedStateError(
                    f"{'.'.join(parts[: i + 1])!r} is a tensor and a prefix of {name!r}", key=name
                )
            node = child
        if parts[-1] in node:
            raise UnsupportedStateError(f"{name!r} is a prefix of another tensor name", key=name)
        node[parts[-1]] = leaf
    return _arrays(root)


def _arrays(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {k: _arrays(v) for k, v in node.items()}
    if items and all(_INDEX.match(k) for k in items):
        length = max(int(k) for k in items) + 1
        if length - len(items) > _MAX_HOLES:
            raise UnsupportedStateError(
                f"indices up to {length - 1} with only {len(items)} present; refusing to write "
                f"an array with more than {_MAX_HOLES} holes"
            )
        out: list[Any] = [None] * length
        for k, v in items.items():
            out[int(k)] = v
        return out
    return items


def num_params(tensors: Mapping[str, Any]) -> int:
    """burn's ``Module::num_params``: the elements of the float tensors (int and bool excluded)."""
    total = 0
    for value in tensors.values():
        v = value.value if isinstance(value, (Param, Data)) else value
        source = _source(v, "")
        if source.dtype.name in _FLOATS:
            total += math.prod(source.shape)
    return total


# ---------------------------------------------------------------------------------------------
# opened records
# ---------------------------------------------------------------------------------------------


class RecordFile:
    """A burn record opened without reading tensor data: ``item`` (the tree, with
    :class:`Param` and :class:`Data` leaves holding lazy tensors), ``metadata``, ``size``.
    Close it (or use ``with``) when done; arrays from ``load()`` keep the mapping alive."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(local_path(path, what="burn record"))
        try:
            fd = local.open_read(self.path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"no burn record at {self.path}", path=self.path
            ) from None
        self._map: local.MappedFile | None = None
        try:
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise CorruptCheckpointError(f"{self.path}: the file is empty", path=self.path)
            self._map = local.MappedFile(fd, self.size)
        except OSError as exc:
            raise CorruptCheckpointError(
                f"{self.path} cannot be mapped: {exc.strerror or exc}", path=self.path
            ) from None
        finally:
            os.close(fd)
        try:
            parsed = _parse(self._map.array, self.path)
        except BaseException:
            self.close()
            raise
        self.item = parsed.item
        self.metadata = parsed.metadata

    def __enter__(self) -> RecordFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def tensors(self) -> dict[str, LazyTensor]:
        """Every tensor by dotted name, lazily (nothing is read until copied or loaded)."""
        return {name: leaf.value for name, leaf in flatten(self.item).items()}

    def ids(self) -> dict[str, str]:
        """Every parameter's id by dotted name (to write the record back with the same ids)."""
        leaves = flatten(self.item).items()
        return {n: p.id for n, p in leaves if isinstance(p, Param) and p.id is not None}

    def info(self) -> CheckpointInfo:
        name = os.path.basename(self.path)
        tensors = tuple(
            TensorInfo(k, t.dtype.name, t.shape, t.nbytes, name, k)
            for k, t in self.tensors().items()
        )
        return CheckpointInfo(
            path=self.path,
            format_version=None,
            writer=f"burn {self.metadata.version} ({self.metadata.format})",
            created="",
            metadata=self.metadata.to_dict(),
            tensors=tensors,
            values=_values(self.item),
            files={name: self.size},
            format="burn",
            notes=("burn records have no checksums: verify checks structure and sizes only",),
        )


def open_record(path: str | os.PathLike[str]) -> RecordFile:
    """Open the burn record at ``path`` (structure checked, no tensor data read)."""
    return RecordFile(path)


def _load(tensor: LazyTensor, framework: Framework) -> Any:
    array = np.array(tensor.load())  # a private, writable copy
    return _files.to_framework(array, tensor.dtype, framework)


def load_record(path: str | os.PathLike[str], *, framework: Framework = "numpy") -> dict[str, Any]:
    """``{dotted name: array}`` of the burn record at ``path`` (writable copies, stored dtypes;
    torch tensors with ``framework="torch"``)."""
    with open_record(path) as f:
        return {name: _load(t, framework) for name, t in f.tensors().items()}


def decode(data: bytes | bytearray | memoryview) -> tuple[Any, Metadata]:
    """The record tree (leaves hold numpy arrays) and metadata of a record held in memory."""
    buf = np.frombuffer(bytes(data), dtype=np.uint8)
    parsed = _parse(buf, "burn record")

    def materialize(node: Any) -> Any:
        if isinstance(node, Param):
            return Param(np.array(node.value.load()), node.id)
        if isinstance(node, Data):
            return Data(np.array(node.value.load()))
        if isinstance(node, dict):
            return {k: materialize(v) for k, v in node.items()}
        if isinstance(node, list):
            return [materialize(v) for v in node]
        return node

    return materialize(parsed.item), parsed.metadata


def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    with open_record(path) as f:
        return f.info()


def verify(path: str | os.PathLike[str], *, progress: Progress | None = None) -> CheckpointInfo:
    """Check the structure and read every data byte once (booleans checked to be 0 or 1);
    ``progress(done, total)`` is called in bytes as it reads."""
    with open_record(path) as f:
        tensors = list(f.tensors().values())
        tally = Tally.over(progress, tensors)
        for tensor in tensors:
            tally.drain(tensor)
        return f.info()


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x80 | n])
    return b"\xde" + struct.pack(">H", n) if n < 1 << 16 else b"\xdf" + struct.pack(">I", n)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + struct.pack(">H", n) if n < 1 << 16 else b"\xdd" + struct.pack(">I", n)


def _str(s: str, where: str) -> bytes:
    try:
        raw = s.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedStateError(f"{where}: {s!r} is not valid UTF-8", key=where) from None
    n = len(raw)
    if n < 32:
        return bytes([0xA0 | n]) + raw
    if n < 1 << 8:
        return b"\xd9" + bytes([n]) + raw
    return (b"\xda" + struct.pack(">H", n) if n < 1 << 16 else b"\xdb" + struct.pack(">I", n)) + raw


def _int(v: int, where: str) -> bytes:
    if v >= 0:
        if v < 0x80:
            return bytes([v])
        for marker, fmt, top in ((0xCC, ">B", 8), (0xCD, ">H", 16), (0xCE, ">I", 32)):
            if v < 1 << top:
                return bytes([marker]) + struct.pack(fmt, v)
        if v < _U64:
            return b"\xcf" + struct.pack(">Q", v)
    else:
        if v >= -32:
            return struct.pack(">b", v)
        for marker, fmt, top in ((0xD0, ">b", 7), (0xD1, ">h", 15), (0xD2, ">i", 31)):
            if v >= -(1 << top):
                return bytes([marker]) + struct.pack(fmt, v)
        if v >= -(1 << 63):
            return b"\xd3" + struct.pack(">q", v)
    raise UnsupportedStateError(f"{where}: {v} does not fit a 64-bit integer", key=where)


def _source(value: Any, where: str) -> TensorSource:
    if isinstance(value, LazyTensor):
        return value
    source = arrays.make_source(value, where) if not isinstance(value, np.generic) else None
    if source is None:
        raise UnsupportedStateError(
            f"{where or '<root>'}: {type(value).__name__} is not a tensor (a numpy array or "
            "torch tensor)",
            key=where,
        )
    return source


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


class _Encoder:
    """Builds the byte pieces of a record: structure bytes and tensor sources, in file order."""

    def __init__(self, bool_store: bool) -> None:
        self.pieces: list[bytes | TensorSource] = []
        self.buf = bytearray()
        self.bool_store = bool_store

    def finish(self) -> list[bytes | TensorSource]:
        if self.buf:
            self.pieces.append(bytes(self.buf))
            self.buf = bytearray()
        return self.pieces

    def tensor(self, value: Any, where: str) -> None:
        source = _source(value, where)
        burn = _TO_BURN.get(source.dtype.name)
        store = "Native"
        if isinstance(value, _BoolTensor) and value.width == 4 and self.bool_store:
            # burn 0.21's U32 bool store, read from a file: written back as it was.
            source = MappedTensor(value.raw, dtypes.from_name("U32"), value.shape)
            store = "U32"
        if burn is None:
            raise UnsupportedStateError(
                f"{where or '<root>'}: dtype {source.dtype.name} has no burn DType (burn holds "
                f"{', '.join(sorted(_TO_BURN))})",
                key=where,
            )
        n = source.nbytes
        if n >= 1 << 32:
            raise UnsupportedStateError(
                f"{where}: {n} bytes; a MessagePack bin (burn's tensor data) holds less than 4 GiB",
                key=where,
            )
        self.buf += _map_header(3) + _str("bytes", where)
        self.buf += (
            (b"\xc4" + bytes([n]))
            if n < 1 << 8
            else (b"\xc5" + struct.pack(">H", n) if n < 1 << 16 else b"\xc6" + struct.pack(">I", n))
        )
        if n:
            self.pieces.append(bytes(self.buf))
            self.buf = bytearray()
            self.pieces.append(source)
        self.buf += _str("shape", where) + _array_header(len(source.shape))
        for d in source.shape:
            self.buf += _int(int(d), where)
        self.buf += _str("dtype", where)
        if burn == "Bool" and self.bool_store:
            self.buf += _map_header(1) + _str("Bool", where) + _str(store, where)
        else:
            self.buf += _str(burn, where)

    def value(self, node: Any, where: tuple[str, ...], depth: int) -> None:
        name = ".".join(where)
        if depth > MAX_DEPTH:
            raise UnsupportedStateError(f"{name}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, Param):
            pid = node.id if node.id is not None else param_id(name)
            if not isinstance(pid, str):
                raise UnsupportedStateError(f"{name}: param id {pid!r} is not a str", key=name)
            self.buf += _map_header(2) + _str("id", name) + _str(pid, name)
            self.buf += _str("param", name)
            self.tensor(node.value, name)
        elif isinstance(node, Data):
            self.tensor(node.value, name)
        elif node is None:
            self.buf += b"\xc0"
        elif isinstance(node, (bool, np.bool_)):
            self.buf += b"\xc3" if node else b"\xc2"
        elif isinstance(node, (int, np.integer)):
            self.buf += _int(int(node), name)
        elif isinstance(node, np.float32):
            self.buf += b"\xca" + struct.pack(">f", float(node))
        elif isinstance(node, (float, np.floating)) and not isinstance(node, np.float16):
            self.buf += b"\xcb" + struct.pack(">d", float(node))
        elif isinstance(node, str):
            self.buf += _str(node, name)
        elif isinstance(node, Mapping):
            self.buf += _map_header(len(node))
            for k, v in node.items():
                if not isinstance(k, str):
                    raise UnsupportedStateError(
                        f"{name or '<root>'}: key {k!r} is not a str; burn records are named",
                        key=name,
                    )
                self.buf += _str(k, name)
                self.value(v, (*where, k), depth + 1)
        elif isinstance(node, (list, tuple)):
            self.buf += _array_header(len(node))
            for i, v in enumerate(node):
                self.value(v, (*where, str(i)), depth + 1)
        elif isinstance(node, LazyTensor) or (
            not isinstance(node, np.generic) and arrays.make_source(node, name) is not None
        ):
            self.value(Param(node), where, depth)
        else:
            raise UnsupportedStateError(
                f"{name or '<root>'}: a {type(node).__name__} has no place in a burn record",
                key=name,
            )


def _pieces(item: Any, metadata: Metadata) -> list[bytes | TensorSource]:
    enc = _Encoder(bool_store=_version(metadata.version) >= (0, 21))
    enc.buf += _map_header(3) + _str("metadata", "metadata") + _map_header(5)
    for k, v in metadata.to_dict().items():
        if not isinstance(v, str):
            raise UnsupportedStateError(f"metadata {k!r} must be a str")
        enc.buf += _str(k, "metadata") + _str(v, f"metadata.{k}")
    enc.buf += _str("item", "item")
    enc.value(item, (), 0)
    enc.buf += _str("_b", "_b") + _array_header(0)
    return enc.finish()


def encode(item: Any, metadata: Metadata | None = None) -> bytes:
    """The bytes of the record for the tree ``item`` (see :func:`write_record`)."""
    out = bytearray()
    for piece in _pieces(item, metadata or Metadata()):
        if isinstance(piece, bytes):
            out += piece
        else:
            for chunk in _files.chunks(piece):
                out += chunk
    return bytes(out)


def write_record(
    path: str | os.PathLike[str], item: Any, *, metadata: Metadata | None = None
) -> None:
    """Write the record tree ``item`` to ``path`` atomically (the exact name: add ``.mpk``
    yourself, or use :func:`file_name`). Tensors are streamed, never all in memory at once.

    ``item`` nests dicts (str keys: struct fields), lists/tuples (arrays), None (nil), numbers,
    strings, :class:`Param` / :class:`Data`, and bare arrays or tensors (written as Params with
    an id derived from their dotted name). ``metadata`` defaults to burn 0.20.1's
    ``DefaultRecorder``'s."""
    target = local_path(path, what="burn record")
    pieces = _pieces(item, metadata or Metadata())
    with _files.atomic_file(target) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
        try:
            for piece in pieces:
                for chunk in [memoryview(piece)] if isinstance(piece, bytes) else _chunks(piece):
                    while len(chunk):
                        chunk = chunk[os.write(fd, chunk) :]
            os.fsync(fd)
        finally:
            os.close(fd)


def _chunks(source: TensorSource) -> Iterator[memoryview]:
    for chunk in _files.chunks(source):
        yield memoryview(chunk).cast("B")


def save_record(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Any],
    *,
    ids: Mapping[str, str] | None = None,
    metadata: Metadata | None = None,
) -> None:
    """Write ``{dotted name: tensor}`` as a burn record that ``Module::load_file`` with burn's
    ``DefaultRecorder`` reads (names nested back as described in the module docstring).

    ``ids`` gives a parameter's id by name (as :meth:`RecordFile.ids` returns them); other
    parameters get :func:`param_id` of their name. A value may also be a :class:`Param`."""
    leaves: dict[str, Any] = {}
    for name, value in tensors.items():
        if isinstance(value, (Param, Data)):
            leaves[name] = value
        else:
            leaves[name] = Param(value, None if ids is None else ids.get(name))
    write_record(path, unflatten(leaves), metadata=metadata)
