"""``torch.save`` archives read without torch and without running anything a pickle names.

A ``torch.save`` file (and each tensor item of a DCP ``.distcp`` file, which is one such archive
at an offset) is a zip archive of *stored* (uncompressed) records: ``<prefix>/data.pkl`` (a
pickle of the object, whose tensors refer to storages by persistent ids), ``<prefix>/data/<key>``
(each storage's raw bytes), ``<prefix>/byteorder`` and a few version records. Each record has a
CRC-32 in the archive's central directory.

- :func:`read_index` parses the central directory of the archive occupying ``buf[base:base +
  length]`` (zip64 included: torch writes it always): every record's name, where its bytes start,
  its size and CRC-32, each checked to lie inside the archive, stored, and named once.
- :func:`unpickle` reads ``data.pkl`` through a (pure-Python: see :class:`_Unpickler`)
  ``pickle`` unpickler whose ``find_class`` admits
  only the ``(module, name)`` pairs a caller lists, each mapped to an inert stand-in of savepoint's
  (nothing is imported; no callable of the pickle's choosing runs), and whose persistent ids
  become :class:`Storage` descriptions. torch's tensor rebuilders become :class:`TensorRef`
  records (storage, dtype, offset, shape, stride), checked to stay inside their storage.
  A global outside the list raises :class:`~savepoint.errors.IncompatibleCheckpointError`
  naming it; any other malformation a :class:`~savepoint.errors.CorruptCheckpointError`.
- writing such archives: :mod:`savepoint.formats._torch_write`.

:data:`TENSOR_GLOBALS` are what ``torch.save`` of plain tensors references (torch 1.6 to 2.13):
``torch._utils._rebuild_tensor_v2`` / ``_v3``, the typed storage classes, ``UntypedStorage``,
dtypes and ``collections.OrderedDict`` (the empty backward hooks); and for a tensor carrying
Python attributes, ``torch._tensor._rebuild_from_type_v2`` with ``torch.Tensor`` (or
``nn.Parameter``) as its type: read as the plain tensor, the attributes dropped.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from savepoint.codecs import dtypes
from savepoint.codecs.dtypes import DType
from savepoint.errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)

__all__ = [
    "Archive",
    "Buildable",
    "Opaque",
    "CENTRAL",
    "DTYPE_NAMES",
    "DTypeName",
    "EOCD",
    "LOCAL",
    "Record",
    "STORAGE_CLASS",
    "Storage",
    "TENSOR_GLOBALS",
    "TensorRef",
    "Z64_EOCD",
    "Z64_LOCATOR",
    "crc32",
    "read_index",
    "unpickle",
]

EOCD = b"PK\x05\x06"
Z64_LOCATOR = b"PK\x06\x07"
Z64_EOCD = b"PK\x06\x06"
CENTRAL = b"PK\x01\x02"
LOCAL = b"PK\x03\x04"
_U32 = 0xFFFFFFFF
_CRC_BLOCK = 8 << 20

# torch's dtype attribute names (torch 2.13), as a pickle names a dtype: ``torch.<name>``.
_DTYPE_TEXT = (
    "bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 "
    "complex32 complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn "
    "float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 "
    "int32 int4 int5 int6 int64 int7 int8 long qint32 qint8 quint2x4 quint4x2 quint8 short uint1 "
    "uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8"
)
DTYPE_NAMES = frozenset(_DTYPE_TEXT.split())
_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "chalf": "complex32",
    "int": "int32",
    "long": "int64",
    "short": "int16",
}
# The typed storage classes torch.save names (torch.storage._dtype_to_storage_type_map()).
_STORAGES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}
STORAGE_CLASS = {dtype: name for name, dtype in _STORAGES.items()}  # torch name -> class name


class _Refused(Exception):
    """A global outside the allow-list (module, name)."""


class _Bad(Exception):
    """A structural problem, worded for the message."""


@dataclass(frozen=True)
class Record:
    """One stored record of an archive: its bytes are ``buf[start:start + size]``."""

    name: str
    start: int
    size: int
    crc: int


@dataclass(frozen=True)
class DTypeName:
    """``torch.<name>`` as a pickle named it (a marker: torch is never imported)."""

    name: str

    def dtype(self) -> DType | None:
        """savepoint's dtype of this name, None where savepoint has none."""
        try:
            return dtypes.from_torch(self, "")
        except UnsupportedStateError:
            return None

    def __str__(self) -> str:
        return f"torch.{_ALIASES.get(self.name, self.name)}"


@dataclass(frozen=True)
class _StorageType:
    """A storage class: ``torch.FloatStorage`` (typed) or ``torch.storage.UntypedStorage``."""

    dtype: DTypeName | None


_MEMO = 4096  # distinct pickles an Archive.load memo keeps


@dataclass(frozen=True)
class Storage:
    """A persistent id: the storage ``key`` (its record ``data/<key>``), its element dtype (None:
    untyped, counted in bytes) and its size in elements (bytes when untyped)."""

    key: str
    dtype: DTypeName | None
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor as torch's rebuilders describe it: a view of ``storage``."""

    storage: Storage
    dtype: DType
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        """Whether the view is the C-order run of elements from ``offset`` (size-1 dims aside)."""
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.stride)):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise _Bad(f"{what} is not a tuple of non-negative integers")
    return tuple(value)


def _rebuild(
    storage: Any, offset: Any, shape: Any, stride: Any, dtype: DTypeName | None
) -> TensorRef:
    if not isinstance(storage, Storage):
        raise _Bad("a tensor whose storage is not a persistent storage")
    name = dtype if dtype is not None else storage.dtype
    if not isinstance(name, DTypeName):
        raise _Bad("a tensor without a dtype")
    found = name.dtype()
    if found is None:
        raise _Unsupported(f"a tensor of dtype {name}, which savepoint does not hold")
    if storage.dtype is not None and storage.dtype.dtype() != found:
        raise _Bad(f"a {found.name} tensor over a {storage.dtype} storage")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise _Bad("a tensor's storage offset is not a non-negative integer")
    size, strides = _ints(shape, "a tensor's size"), _ints(stride, "a tensor's stride")
    if len(size) != len(strides):
        raise _Bad("a tensor's size and stride differ in length")
    elements = storage.numel
    if storage.dtype is None:
        if storage.numel % found.itemsize:
            raise _Bad(f"an untyped storage of {storage.numel} bytes holds no whole {found.name}")
        elements = storage.numel // found.itemsize
    if math.prod(size) and offset + sum((n - 1) * s for n, s in zip(size, strides)) >= elements:
        raise _Bad(f"a tensor of size {list(size)} reaches past its storage of {elements}")
    return TensorRef(storage, found, offset, size, strides)


class _Unsupported(Exception):
    """Well formed, but not something savepoint holds (a dtype)."""


def _rebuild_v2(
    storage: Any,
    offset: Any,
    shape: Any,
    stride: Any,
    requires_grad: Any = False,
    hooks: Any = None,
    metadata: Any = None,
) -> TensorRef:
    return _rebuild(storage, offset, shape, stride, None)


def _rebuild_v3(
    storage: Any,
    offset: Any,
    shape: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> TensorRef:
    if not isinstance(dtype, DTypeName):
        raise _Bad("_rebuild_tensor_v3 without a dtype")
    return _rebuild(storage, offset, shape, stride, dtype)


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any = None) -> TensorRef:
    """``torch._tensor._rebuild_from_type_v2``: a tensor with Python attributes (or of a
    subclass) is its plain tensor here; the attributes are dropped."""
    if func not in (_rebuild_v2, _rebuild_v3) or not isinstance(args, tuple):
        raise _Bad("_rebuild_from_type_v2 of something other than a tensor")
    found: TensorRef = func(*args)
    return found


class _Dict(dict):  # type: ignore[type-arg]
    """``collections.OrderedDict`` (a state dict, the backward hooks): a dict; the state a
    pickle gives it (a state dict's ``_metadata`` of module versions) is dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


_TENSOR_TYPE = ("a tensor type",)  # torch.Tensor, nn.Parameter as _rebuild_from_type_v2 names them

TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): _TENSOR_TYPE,
    ("torch.nn.parameter", "Parameter"): _TENSOR_TYPE,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    ("collections", "OrderedDict"): _Dict,
    **{("torch", n): _StorageType(DTypeName(d)) for n, d in _STORAGES.items()},
    **{("torch", n): DTypeName(n) for n in DTYPE_NAMES},
}


def _persistent(pid: Any) -> Storage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise _Bad("a persistent id that is not a storage")
    _, kind, key, _location, numel = pid
    if not isinstance(kind, _StorageType):
        raise _Bad("a storage of no storage class")
    if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
        raise _Bad("a storage with a malformed key or size")
    return Storage(key, kind.dtype, numel)


class Buildable:
    """Base of the stand-ins a pickle may give state to (its ``BUILD`` opcode); any other
    object it tries to ``BUILD`` (an allow-listed marker shared by every read, a function, a
    result of a rebuilder) is refused, so one file cannot change what the next one reads."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise NotImplementedError


class Opaque(Buildable):
    """An object of a class outside the allow-list, where a reader admits them (DeepSpeed's
    client state): the class is never imported; only what the pickle hands the object is kept
    (its arguments, its state, the items added to it). ``global_name`` is the class's name."""

    __slots__ = ("args", "items", "state")
    global_name: ClassVar[str] = ""
    args: tuple[Any, ...]
    items: list[Any]
    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        obj = object.__new__(cls)
        obj.args, obj.items, obj.state = args, [], None
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, value: Any) -> None:
        self.items.append(value)

    def extend(self, values: Any) -> None:
        self.items.extend(values)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append((key, value))


def _build(self: Any) -> None:
    state = self.stack.pop()
    inst = self.stack[-1]
    if not isinstance(inst, (Buildable, _Dict)):
        raise _Bad(f"state given to a {type(inst).__name__}")
    inst.__setstate__(state)


def _bytearray8(self: Any) -> None:
    """``BYTEARRAY8`` reading its bytes before making the bytearray: the pure-Python unpickler's
    own allocates (and zero-fills) the length the pickle claims first, so 20 bytes of hostile
    pickle made it take a gigabyte per 2**30 claimed."""
    (n,) = struct.unpack("<Q", self.read(8))
    data = self.read(n)  # at most what the pickle holds
    if len(data) != n:
        raise _Bad("a BYTEARRAY8 longer than the pickle")
    self.append(bytearray(data))


_STOP: type[Exception] = getattr(pickle, "_Stop")  # noqa: B009 (private, untyped)


def _frame(self: Any) -> None:
    """``FRAME`` announces a length; the whole pickle is in memory already (see ``load``)."""
    if len(self.read(8)) != 8:
        raise EOFError


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler, not the C one: the C one allocates what a length field
    claims (``BINBYTES8``, ``BYTEARRAY8``) and grows its memo to what an index claims
    (``LONG_BINPUT``) before reading, so 2 KiB of hostile pickle could make it allocate
    gigabytes; this one reads first (``BYTEARRAY8`` made to: :func:`_bytearray8`) and keeps its
    memo in a dict. ``BUILD`` is guarded (:class:`Buildable`). Every opcode reads straight from
    the in-memory pickle (``io.BytesIO``'s C methods, which never return more than the pickle
    holds) instead of through pickle's Python frame reader: half the time (a DCP ``.metadata``
    of 2,000 entries: 0.32 -> 0.16 s on the development machine). Before that it was about 2.4
    times slower than the C one (6 s for an 18 MB ``.metadata`` of 128,000 chunks, where
    torch's own ``pickle.load`` of it takes 6.6 s)."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = {
        **pickle._Unpickler.dispatch,
        pickle.BUILD[0]: _build,
        pickle.BYTEARRAY8[0]: _bytearray8,
        pickle.FRAME[0]: _frame,
    }

    def __init__(
        self, data: bytes, allowed: Mapping[tuple[str, str], Any], storages: bool, opaque: bool
    ) -> None:
        self._stream = io.BytesIO(data)
        super().__init__(self._stream)
        self._allowed = allowed
        self._storages = storages
        self.opaque: dict[str, type[Opaque]] | None = {} if opaque else None

    def load(self) -> Any:
        """``pickle._Unpickler.load`` with ``read``/``readline`` bound to the in-memory
        stream's C methods (no per-opcode Python frame reader)."""
        self.read = self._stream.read
        self.readline = self._stream.readline
        self.readinto = self._stream.readinto
        self.metastack: list[Any] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read = self.read
        dispatch = self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except _STOP as stop:  # the STOP opcode ends the pickle with its value
            return stop.value  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if self.opaque is None:
            raise _Refused(f"{module}.{name}")
        named = f"{module}.{name}"
        if named not in self.opaque:
            if len(self.opaque) >= 1000:
                raise _Bad("more than 1000 classes outside the allow-list")
            attrs = {"__slots__": (), "global_name": named}
            self.opaque[named] = type("Opaque", (Opaque,), attrs)
        return self.opaque[named]

    def persistent_load(self, pid: Any) -> Any:
        if not self._storages:
            raise _Bad("a persistent id where none belongs")
        return _persistent(pid)


def unpickle(
    data: bytes,
    allowed: Mapping[tuple[str, str], Any],
    *,
    path: str,
    what: str,
    storages: bool = True,
    hint: str = "",
    opaque: bool = False,
    seen: set[str] | None = None,
) -> Any:
    """The object the pickle ``data`` describes, every global mapped through ``allowed`` (see
    the module docstring); ``what`` names the pickle in messages (``"x/.metadata"``). With
    ``opaque``, a global outside ``allowed`` becomes an :class:`Opaque` placeholder (nothing is
    imported) instead of an error, and its name is added to ``seen``."""
    unpickler = _Unpickler(data, allowed, storages, opaque)
    try:
        found = unpickler.load()
        if seen is not None and unpickler.opaque is not None:
            seen.update(unpickler.opaque)
        return found
    except _Refused as exc:
        raise IncompatibleCheckpointError(
            f"{what} refers to the global {exc}, which savepoint does not admit (its pickles are "
            f"read through an allow-list; nothing was imported or run){hint}",
            path=path,
        ) from None
    except _Unsupported as exc:
        raise IncompatibleCheckpointError(f"{what} holds {exc}", path=path) from None
    except RecursionError:
        raise CorruptCheckpointError(f"{what} is nested too deeply", path=path) from None
    except Exception as exc:  # UnpicklingError, EOFError, TypeError, ... from hostile bytes
        reason = str(exc) if isinstance(exc, _Bad) else f"{type(exc).__name__}: {exc}"
        raise CorruptCheckpointError(f"{what} is not a valid pickle: {reason}", path=path) from None


# ---------------------------------------------------------------------------------------------
# zip archives
# ---------------------------------------------------------------------------------------------


def _eocd(buf: np.ndarray[Any, Any], base: int, length: int) -> tuple[int, int, int]:
    """(records, central directory size, its offset) from the end records."""
    if length < 22:
        raise _Bad("too short for a zip archive")
    window = min(length, 22 + 0xFFFF)
    tail = buf[base + length - window : base + length].tobytes()
    at = tail.rfind(EOCD)
    if at < 0 or at + 22 > len(tail):
        raise _Bad("no end of central directory record (not a torch.save archive)")
    _, _, n_here, count, size, offset, _ = struct.unpack_from("<HHHHIIH", tail, at + 4)
    if count != n_here:
        raise _Bad("a multi-disk zip archive")
    if _U32 not in (size, offset) and count != 0xFFFF:
        return count, size, offset
    eocd_at = length - window + at
    if eocd_at < 20:
        raise _Bad("zip64 sizes without a zip64 locator")
    locator = buf[base + eocd_at - 20 : base + eocd_at].tobytes()
    if not locator.startswith(Z64_LOCATOR):
        raise _Bad("zip64 sizes without a zip64 locator")
    (z64,) = struct.unpack_from("<Q", locator, 8)
    if z64 + 56 > eocd_at:
        raise _Bad("the zip64 end record lies outside the archive")
    record = buf[base + z64 : base + z64 + 56].tobytes()
    if not record.startswith(Z64_EOCD):
        raise _Bad("no zip64 end of central directory record where its locator points")
    n_here64, count64, size64, offset64 = struct.unpack_from("<QQQQ", record, 24)
    if count64 != n_here64:
        raise _Bad("a multi-disk zip archive")
    return count64, size64, offset64


def _zip64(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    """(uncompressed size, compressed size, local header offset), each 0xFFFFFFFF replaced from
    the zip64 extra field (which holds, in this order, those that are saturated)."""
    wanted = [usize == _U32, csize == _U32, offset == _U32]
    if not any(wanted):
        return usize, csize, offset
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + n]
        pos += 4 + n
        if tag != 1:
            continue
        values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
        if len(values) < sum(wanted):
            raise _Bad("a zip64 field shorter than its record needs")
        out = [values.pop(0) if need else v for need, v in zip(wanted, (usize, csize, offset))]
        return out[0], out[1], out[2]
    raise _Bad("a record with zip64 sizes and no zip64 field")


def read_index(buf: np.ndarray[Any, Any], base: int, length: int) -> dict[str, Record]:
    """Every record of the stored zip archive at ``buf[base:base + length]`` (a uint8 array);
    raises ``_Bad`` (callers word it with :class:`Archive`)."""
    count, size, offset = _eocd(buf, base, length)
    if offset + size > length or count > size // 46:
        raise _Bad("the central directory lies outside the archive")
    cd = buf[base + offset : base + offset + size].tobytes()
    records: dict[str, Record] = {}
    pos = 0
    for _ in range(count):
        if not cd.startswith(CENTRAL, pos) or pos + 46 > len(cd):
            raise _Bad("a malformed central directory entry")
        fields = struct.unpack_from("<HHHHHHIIIHHHHHII", cd, pos + 4)
        method, crc, csize, usize = fields[3], fields[6], fields[7], fields[8]
        n_name, n_extra, n_comment, local = fields[9], fields[10], fields[11], fields[15]
        end = pos + 46 + n_name + n_extra + n_comment
        if end > len(cd):
            raise _Bad("a central directory entry runs past the directory")
        try:
            name = cd[pos + 46 : pos + 46 + n_name].decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad("a record name that is not UTF-8") from None
        extra = cd[pos + 46 + n_name : pos + 46 + n_name + n_extra]
        pos = end
        usize, csize, local = _zip64(extra, usize, csize, local)
        if method != 0 or csize != usize:
            raise _Bad(f"record {name!r} is compressed (torch.save stores records)")
        if local + 30 > length:
            raise _Bad(f"record {name!r} starts outside the archive")
        head = buf[base + local : base + local + 30].tobytes()
        if not head.startswith(LOCAL):
            raise _Bad(f"no local header for record {name!r}")
        n1, n2 = struct.unpack_from("<HH", head, 26)
        start = local + 30 + n1 + n2
        if start + usize > length:
            raise _Bad(f"record {name!r} runs past the end of the archive")
        if name in records:
            raise _Bad(f"record {name!r} appears twice")
        records[name] = Record(name, base + start, usize, crc)
    return records


def crc32(buf: np.ndarray[Any, Any], record: Record, progress: Callable[[int], None]) -> bool:
    """Whether ``record``'s bytes match its CRC-32 (read in blocks, each reported)."""
    value = 0
    for pos in range(record.start, record.start + record.size, _CRC_BLOCK):
        piece = buf[pos : min(pos + _CRC_BLOCK, record.start + record.size)]
        value = zlib.crc32(piece.data, value)
        progress(len(piece))
    return value == record.crc


class Archive:
    """A ``torch.save`` archive at ``buf[base:base + length]``: its records, ``data.pkl``
    unpickled through an allow-list, its storages' bytes. ``what`` names it in messages."""

    def __init__(
        self, buf: np.ndarray[Any, Any], base: int, length: int, *, path: str, what: str
    ) -> None:
        self.buf = buf
        self.path = path
        self.what = what
        try:
            self.records = read_index(buf, base, length)
        except _Bad as exc:
            raise CorruptCheckpointError(
                f"{what} is not a torch.save archive: {exc}", path=path
            ) from None
        pickles = [n for n in self.records if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise CorruptCheckpointError(f"{what} has no single data.pkl record", path=path)
        self.prefix = pickles[0][: -len("data.pkl")]
        order = self.records.get(self.prefix + "byteorder")
        if order is not None and buf[order.start : order.start + order.size].tobytes() != b"little":
            raise IncompatibleCheckpointError(
                f"{what} was written on a big-endian machine; savepoint reads little-endian "
                "archives only",
                path=path,
            )

    def load(
        self,
        allowed: Mapping[tuple[str, str], Any],
        *,
        cap: int,
        hint: str = "",
        opaque: bool = False,
        seen: set[str] | None = None,
        memo: dict[bytes, TensorRef] | None = None,
    ) -> Any:
        """``data.pkl`` through the allow-list ``allowed`` (at most ``cap`` bytes of pickle;
        ``opaque`` and ``seen``: as :func:`unpickle`). ``memo``: a :class:`TensorRef` (frozen)
        read before from the same bytes is reused (the many archives of a DCP checkpoint repeat a
        few pickles: one per dtype, shape and stride); other results are not kept."""
        record = self.records[self.prefix + "data.pkl"]
        if record.size > cap:
            raise CorruptCheckpointError(
                f"{self.what}: its data.pkl is {record.size} bytes, over the {cap} savepoint reads",
                path=self.path,
            )
        data = self.buf[record.start : record.start + record.size].tobytes()
        if memo is not None and data in memo:
            return memo[data]
        found = unpickle(
            data, allowed, path=self.path, what=self.what, hint=hint, opaque=opaque, seen=seen
        )
        if memo is not None and type(found) is TensorRef and len(memo) < _MEMO:
            memo[data] = found
        return found

    def storage(self, ref: TensorRef) -> Record:
        """The record holding ``ref``'s storage, checked to be exactly the storage's size."""
        record = self.records.get(f"{self.prefix}data/{ref.storage.key}")
        if record is None:
            raise CorruptCheckpointError(
                f"{self.what} has no record for storage {ref.storage.key!r}", path=self.path
            )
        unit = 1 if ref.storage.dtype is None else ref.dtype.itemsize
        if record.size != ref.storage.numel * unit:
            raise CorruptCheckpointError(
                f"{self.what}: storage {ref.storage.key!r} is {record.size} bytes, its pickle "
                f"says {ref.storage.numel * unit}",
                path=self.path,
            )
        return record
