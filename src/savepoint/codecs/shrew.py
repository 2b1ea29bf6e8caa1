"""The ``.shrew`` byte codec: parsing a file from a binary stream, and laying one out.

The layout and every rule the reader enforces are specified in :mod:`savepoint.formats.shrew`,
the format's public interface; this module is the part with no file I/O and no knowledge of
tensors beyond ``dtype``, ``shape`` and ``nbytes``:

- Reading: :class:`Input` wraps any binary stream (a file, ``io.BytesIO``, a one-way pipe) and
  checks every length against what is left before it reads or allocates; :func:`parse` reads a
  whole file, eagerly (data into arrays) or not (data skipped, offsets recorded).
- Writing: :func:`key_bytes`, :func:`check_source`, :func:`checked_training` validate everything
  a file will hold before its first byte exists; :func:`tensors_layout` and
  :func:`training_layout` then give the file as a list of pieces, each either the bytes to write
  or a tensor whose raw bytes go there (the caller streams those from wherever they are).
"""

from __future__ import annotations

import math
import os
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Generic, Protocol, TypeVar

import numpy as np

from savepoint.codecs import dtypes
from savepoint.codecs.dtypes import DType
from savepoint.errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)

__all__ = [
    "BUDGET_FACTOR",
    "BUDGET_SLACK",
    "CheckedOptimizer",
    "DTYPE_TAGS",
    "Input",
    "MAGIC",
    "MAX_NDIM",
    "MAX_NOMINAL_BYTES",
    "Optimizer",
    "Parsed",
    "Record",
    "SECTION_NAMES",
    "TAG_EOF",
    "TAG_METADATA",
    "TAG_MODEL",
    "TAG_OF",
    "TAG_OPTIMIZER",
    "Tensor",
    "Training",
    "VERSION_TENSORS",
    "VERSION_TRAINING",
    "check_source",
    "checked_optimizer",
    "checked_training",
    "key_bytes",
    "parse",
    "read_header",
    "tensors_layout",
    "training_layout",
]

MAGIC = b"SHRW"
VERSION_TENSORS = 1
VERSION_TRAINING = 2
TAG_MODEL = 0x01
TAG_OPTIMIZER = 0x02
TAG_METADATA = 0x03
TAG_EOF = 0xFF
SECTION_NAMES = {TAG_MODEL: "model", TAG_OPTIMIZER: "optimizer", TAG_METADATA: "metadata"}
DTYPE_TAGS: dict[int, str] = {0: "F32", 1: "F64", 2: "U8", 3: "U32", 4: "I64", 5: "F16", 6: "BF16"}
TAG_OF: dict[str, int] = {name: tag for tag, name in DTYPE_TAGS.items()}
MAX_NDIM = 64
MAX_NOMINAL_BYTES = 1 << 62  # product of the dims (zeros counted as 1) x itemsize
# What parsing may build for a file's structure, as a multiple of the file's size plus a constant:
# every record is charged what it and its later forms cost (key strings, a record, an array or
# lazy tensor, an inspect entry), so a file of 100,000 empty optimizer buffers with one-letter
# non-ASCII names is refused instead of costing 30 x its size. Real files, whose records hold
# data, use a small fraction of it.
BUDGET_FACTOR = 16
BUDGET_SLACK = 16 << 20
_RECORD_COST = 256  # Record, dict slots, array or lazy tensor, inspect entry (measured: <= 200)
_SCALAR_COST = 96  # dict slots, float, inspect value slot
_READ_CHUNK = 4 << 20  # bytes per read call: a hostile length never becomes one huge read
_U32 = 1 << 32
_U64 = 1 << 64
_F64 = dtypes.from_name("F64")


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


class Input:
    """A bounded reader: every length is checked against what is left before it is read."""

    def __init__(self, stream: BinaryIO, name: str) -> None:
        self.stream = stream
        self.name = name
        self.pos = 0
        self.size: int | None = None
        # One tuple per distinct shape: 100,000 empty buffers share one (0,), not 100,000.
        self.shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.charged = 0
        try:
            if stream.seekable():
                here = stream.tell()
                self.size = stream.seek(0, os.SEEK_END) - here
                stream.seek(here)
        except (OSError, ValueError, AttributeError):
            self.size = None

    def corrupt(self, message: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.name}: {message}", path=self.name, key=key)

    def need(self, n: int, what: str) -> None:
        if self.size is not None and n > self.size - self.pos:
            raise self.corrupt(
                f"{what} needs {n} bytes at offset {self.pos} but only {self.size - self.pos} "
                "remain (truncated or corrupt file)"
            )

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` of objects against the budget (:data:`BUDGET_FACTOR`); the size of
        an unsized stream is what has been read of it so far."""
        self.charged += nbytes
        size = self.size if self.size is not None else self.pos
        if self.charged > BUDGET_FACTOR * size + BUDGET_SLACK:
            raise self.corrupt(
                f"{size} bytes describe more records than savepoint builds for a file that size "
                f"({BUDGET_FACTOR} x its size + {BUDGET_SLACK >> 20} MiB of objects): millions "
                "of tiny tensors, buffers or scalars (a hostile file?)"
            )

    def _ended(self, what: str, missing: int) -> CorruptCheckpointError:
        return self.corrupt(f"the input ends {missing} bytes into {what} (truncated file)")

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        if n == 0:
            return b""
        parts: list[bytes] = []
        got = 0
        while got < n:
            chunk = self.stream.read(min(n - got, _READ_CHUNK))
            if not chunk:
                raise self._ended(what, got)
            parts.append(chunk)
            got += len(chunk)
        self.pos += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_array(
        self, n: int, what: str, dtype: np.dtype[Any], shape: tuple[int, ...]
    ) -> np.ndarray[Any, Any]:
        """``n`` bytes into a new writable array of ``dtype`` and ``shape`` (allocated only once
        ``n`` is known to fit; one array object, no base, per tensor)."""
        self.need(n, what)
        readinto = getattr(self.stream, "readinto", None)
        if self.size is None or readinto is None:
            raw = self.read(n, what)
            copied: np.ndarray[Any, Any] = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
            return copied
        out = np.empty(shape, dtype=dtype)
        view = out.reshape(-1).view(np.uint8).data
        got = 0
        while got < n:
            k = readinto(view[got : got + _READ_CHUNK])
            if not k:
                raise self._ended(what, got)
            got += k
        self.pos += n
        return out

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        if self.size is not None:
            self.stream.seek(n, os.SEEK_CUR)
            self.pos += n
            return
        left = n
        while left:
            left -= len(self.read(min(left, _READ_CHUNK), what))

    def at_end(self) -> bool:
        if self.size is not None:
            return self.pos == self.size
        return not self.stream.read(1)

    def u8(self, what: str) -> int:
        return self.read(1, what)[0]

    def u32(self, what: str) -> int:
        return int(struct.unpack("<I", self.read(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack("<Q", self.read(8, what))[0])

    def f64(self, what: str) -> float:
        return float(struct.unpack("<d", self.read(8, what))[0])

    def string(self, what: str) -> str:
        n = self.u32(f"{what} length")
        raw = self.read(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.corrupt(
                f"{what} at offset {self.pos - n} is not valid UTF-8 ({exc})"
            ) from None


@dataclass(slots=True)
class Record:
    # slots: a file of 100,000 one-byte tensors makes 100,000 of these.
    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    data: np.ndarray[Any, Any] | None  # the array, when read eagerly

    def array(self) -> np.ndarray[Any, Any]:
        assert self.data is not None
        return self.data


# An optimizer section: (type, scalars by key, buffers by key), in file order.
Optimizer = tuple[str, dict[str, float], dict[str, Record]]


@dataclass
class Parsed:
    version: int
    tensors: dict[str, Record]  # by key, in file order
    optimizer: Optimizer | None = None
    epoch: int = 0
    global_step: int = 0
    best_loss: float = math.inf
    loss_history: list[float] = field(default_factory=list)


def _key_cost(key: str) -> int:
    # The key, and the longer keys inspect and conversion make from it ("model/...").
    return 3 * sys.getsizeof(key) + 64


def read_header(inp: Input) -> int:
    magic = inp.read(4, "the magic number")
    if magic != MAGIC:
        raise inp.corrupt(
            f"Invalid checkpoint: expected magic {list(MAGIC)}, got {list(magic)} (not a .shrew "
            f"file: magic {magic!r}, expected {MAGIC!r})"
        )
    version = inp.u32("the version")
    if version not in (VERSION_TENSORS, VERSION_TRAINING):
        raise IncompatibleCheckpointError(
            f"{inp.name}: Unsupported checkpoint version: {version} (.shrew version {version} is "
            "not supported; savepoint reads versions 1 and 2)",
            path=inp.name,
        )
    return version


def _tensor(inp: Input, eager: bool, seen: dict[str, Record]) -> Record:
    name = inp.string("tensor key")
    if name in seen:
        raise inp.corrupt(f"tensor key {name[:200]!r} appears twice", key=name)
    inp.charge(_RECORD_COST + _key_cost(name))
    tag = inp.u8(f"the dtype of {name!r}")
    dtype_name = DTYPE_TAGS.get(tag)
    if dtype_name is None:
        raise inp.corrupt(f"tensor {name!r}: unknown dtype tag {tag}", key=name)
    d = dtypes.from_name(dtype_name)
    ndim = inp.u32(f"the ndim of {name!r}")
    if ndim > MAX_NDIM:
        # Passed over, never unpacked: a hostile ndim makes no tuple of a billion ints. A file
        # too short for its dims is corrupt; one that holds them is valid but not for numpy.
        inp.skip(4 * ndim, f"the dims of {name!r}")
        raise IncompatibleCheckpointError(
            f"{inp.name}: tensor {name!r} has {ndim} dimensions; numpy holds at most {MAX_NDIM}",
            path=inp.name,
        )
    dims = struct.unpack(f"<{ndim}I", inp.read(4 * ndim, f"the dims of {name!r}"))
    shape = inp.shapes.setdefault(dims, dims)
    data_len = inp.u64(f"the data length of {name!r}")
    expected = math.prod(shape) * d.itemsize
    if data_len != expected:
        raise inp.corrupt(
            f"tensor {name!r}: data length {data_len} disagrees with shape {list(shape)} of "
            f"{dtype_name} ({expected} bytes)",
            key=name,
        )
    if not expected and math.prod(max(s, 1) for s in shape) * d.itemsize >= MAX_NOMINAL_BYTES:
        # No elements, but dims whose product numpy cannot even describe (2**32 x 2**32 x 0).
        raise IncompatibleCheckpointError(
            f"{inp.name}: tensor {name!r} has shape {list(shape)}, too large for numpy to hold "
            "even without elements",
            path=inp.name,
        )
    offset = inp.pos
    what = f"the data of {name!r}"
    if eager:
        data: np.ndarray[Any, Any] | None = inp.read_array(data_len, what, d.numpy, shape)
    else:
        inp.skip(data_len, what)
        data = None
    return Record(name, d, shape, offset, data_len, data)


def _tensors(inp: Input, eager: bool) -> dict[str, Record]:
    count = inp.u32("the tensor count")
    records: dict[str, Record] = {}
    for _ in range(count):
        record = _tensor(inp, eager, records)
        records[record.name] = record
    return records


def _optimizer(inp: Input, eager: bool) -> Optimizer:
    kind = inp.string("the optimizer type")
    scalars: dict[str, float] = {}
    for _ in range(inp.u32("the optimizer scalar count")):
        key = inp.string("an optimizer scalar key")
        if key in scalars:
            raise inp.corrupt(f"optimizer scalar {key[:200]!r} appears twice", key=key)
        inp.charge(_SCALAR_COST + _key_cost(key))
        scalars[key] = inp.f64(f"optimizer scalar {key!r}")
    buffers: dict[str, Record] = {}
    for _ in range(inp.u32("the optimizer buffer count")):
        key = inp.string("an optimizer buffer key")
        if key in buffers:
            raise inp.corrupt(f"optimizer buffer {key[:200]!r} appears twice", key=key)
        inp.charge(_RECORD_COST + _key_cost(key))
        n = inp.u64(f"the length of optimizer buffer {key!r}")
        offset = inp.pos
        what = f"optimizer buffer {key!r}"
        if eager:
            data: np.ndarray[Any, Any] | None = inp.read_array(8 * n, what, _F64.numpy, (n,))
        else:
            inp.skip(8 * n, what)
            data = None
        shape = inp.shapes.setdefault((n,), (n,))
        buffers[key] = Record(key, _F64, shape, offset, 8 * n, data)
    return kind, scalars, buffers


def parse(inp: Input, *, eager: bool) -> Parsed:
    version = read_header(inp)
    if version == VERSION_TENSORS:
        parsed = Parsed(version, _tensors(inp, eager))
    else:
        parsed = Parsed(version, {})
        seen: set[int] = set()
        while True:
            tag = inp.u8("a section tag (the end tag 0xFF is missing)")
            if tag == TAG_EOF:
                break
            if tag not in SECTION_NAMES:
                raise inp.corrupt(f"unknown section tag 0x{tag:02X} at offset {inp.pos - 1}")
            if tag in seen:
                raise inp.corrupt(f"the {SECTION_NAMES[tag]} section appears twice")
            seen.add(tag)
            if tag == TAG_MODEL:
                parsed.tensors = _tensors(inp, eager)
            elif tag == TAG_OPTIMIZER:
                parsed.optimizer = _optimizer(inp, eager)
            else:
                parsed.epoch = inp.u64("the epoch")
                parsed.global_step = inp.u64("the global step")
                parsed.best_loss = inp.f64("the best loss")
                n = inp.u32("the loss history length")
                inp.need(8 * n, "the loss history")
                inp.charge(48 * n)  # a float and two list slots each (the history, its copy)
                raw = inp.read(8 * n, "the loss history")
                parsed.loss_history = np.frombuffer(raw, dtype="<f8").tolist()
        for tag in (TAG_MODEL, TAG_METADATA):
            if tag not in seen:
                raise inp.corrupt(f"the {SECTION_NAMES[tag]} section is missing")
    if not inp.at_end():
        where = "the last tensor" if version == VERSION_TENSORS else "the end tag"
        raise inp.corrupt(f"unexpected bytes after {where} (offset {inp.pos})")
    return parsed


# ---------------------------------------------------------------------------------------------
# writing: checks, then the layout as pieces
# ---------------------------------------------------------------------------------------------


class Tensor(Protocol):
    """What the layout needs of a tensor; its bytes are the caller's to stream."""

    @property
    def dtype(self) -> DType: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...


_S = TypeVar("_S", bound=Tensor)


def key_bytes(key: Any, what: str) -> bytes:
    """``key`` as the UTF-8 a ``str`` field holds; UnsupportedStateError if it cannot be one."""
    if not isinstance(key, str):
        raise UnsupportedStateError(f"{what} {key!r} is not a str", key=str(key))
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedStateError(
            f"{what} {key!r} is not valid UTF-8 (a lone surrogate); .shrew keys are UTF-8", key=key
        ) from None
    if len(raw) >= _U32:
        raise UnsupportedStateError(
            f"{what} {key[:40]!r}... is longer than 2**32 - 1 bytes", key=key
        )
    return raw


def check_source(key: str, source: Tensor) -> None:
    """Raise UnsupportedStateError if ``source`` cannot be stored in .shrew."""
    if source.dtype.name not in TAG_OF:
        raise UnsupportedStateError(
            f"{key}: dtype {source.dtype.name} ({source.dtype.torch_name}) cannot be stored in "
            f".shrew, which holds {', '.join(TAG_OF)}; convert the tensor first (e.g. to int64 "
            "or float32)",
            key=key,
        )
    if len(source.shape) >= _U32 or any(s >= _U32 for s in source.shape):
        raise UnsupportedStateError(
            f"{key}: shape {source.shape} does not fit .shrew's u32 dimensions", key=key
        )


def _count(value: Any, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise UnsupportedStateError(f"{what} must be an integer, got {type(value).__name__}")
    if not 0 <= int(value) < _U64:
        raise UnsupportedStateError(f"{what} {int(value)} does not fit .shrew's u64 field")
    return int(value)


def _real(value: Any, what: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise UnsupportedStateError(f"{what} must be a real number, got {type(value).__name__}")
    out = float(value)
    if isinstance(value, (int, np.integer)) and int(out) != int(value):
        raise UnsupportedStateError(f"{what} {int(value)} is not exactly representable as f64")
    return out


@dataclass(frozen=True)
class CheckedOptimizer(Generic[_S]):
    """An optimizer section whose keys and buffers passed the checks: UTF-8 type name, scalars
    ``(key, value)`` and F64 buffers ``(key, tensor)`` (written flattened), in file order."""

    kind: bytes
    scalars: list[tuple[bytes, float]]
    buffers: list[tuple[bytes, _S]]


@dataclass(frozen=True)
class Training:
    """The v2 metadata section, checked: counts in ``[0, 2**64)``, exact f64 values."""

    epoch: int
    global_step: int
    best_loss: float
    loss_history: list[float]


def checked_optimizer(
    optimizer_type: str, scalars: Sequence[tuple[str, float]], buffers: Sequence[tuple[str, _S]]
) -> CheckedOptimizer[_S]:
    """Check an optimizer section (keys, F64 buffers, no key twice, counts that fit a u32)."""
    kind = key_bytes(optimizer_type, "optimizer type")
    raw_scalars = [(key_bytes(k, "optimizer scalar key"), float(v)) for k, v in scalars]
    raw_buffers = []
    for k, source in buffers:
        if source.dtype.name != "F64":
            raise UnsupportedStateError(f"optimizer buffer {k!r} is not float64", key=k)
        raw_buffers.append((key_bytes(k, "optimizer buffer key"), source))
    for what, keys in (("scalar", [k for k, _ in scalars]), ("buffer", [k for k, _ in buffers])):
        if len(set(keys)) != len(keys):
            raise UnsupportedStateError(f"an optimizer {what} key appears twice")
        if len(keys) >= _U32:
            raise UnsupportedStateError(f"too many optimizer {what}s for .shrew's u32 count")
    return CheckedOptimizer(kind, raw_scalars, raw_buffers)


def checked_training(
    epoch: Any, global_step: Any, best_loss: Any, loss_history: Iterable[Any]
) -> Training:
    """Check the metadata section's fields (UnsupportedStateError naming the first bad one)."""
    checked = Training(
        _count(epoch, "epoch"),
        _count(global_step, "global_step"),
        _real(best_loss, "best_loss"),
        [_real(v, "loss_history value") for v in loss_history],
    )
    if len(checked.loss_history) >= _U32:
        raise UnsupportedStateError("the loss history is too long for .shrew's u32 count")
    return checked


def _string(raw: bytes) -> bytes:
    return struct.pack("<I", len(raw)) + raw


def _tensor_pieces(items: Sequence[tuple[bytes, _S]]) -> list[bytes | _S]:
    if len(items) >= _U32:
        raise UnsupportedStateError(f"{len(items)} tensors do not fit .shrew's u32 count")
    pieces: list[bytes | _S] = [struct.pack("<I", len(items))]
    for raw, source in items:
        shape = source.shape
        tag = TAG_OF[source.dtype.name]
        head = struct.pack(f"<BI{len(shape)}IQ", tag, len(shape), *shape, source.nbytes)
        pieces += [_string(raw) + head, source]
    return pieces


def tensors_layout(items: Sequence[tuple[bytes, _S]]) -> list[bytes | _S]:
    """A v1 file as pieces: bytes to write, or a tensor whose raw bytes go there.

    ``items`` are ``(key_bytes(key), tensor)`` with every tensor passed by :func:`check_source`.
    """
    return [MAGIC + struct.pack("<I", VERSION_TENSORS), *_tensor_pieces(items)]


def training_layout(
    model: Sequence[tuple[bytes, _S]], optimizer: CheckedOptimizer[_S] | None, training: Training
) -> list[bytes | _S]:
    """A v2 file as pieces (see :func:`tensors_layout`): model, optimizer when given, metadata,
    end, in the seed's section order."""
    pieces: list[bytes | _S] = [MAGIC + struct.pack("<IB", VERSION_TRAINING, TAG_MODEL)]
    pieces += _tensor_pieces(model)
    if optimizer is not None:
        head = struct.pack("<B", TAG_OPTIMIZER) + _string(optimizer.kind)
        head += struct.pack("<I", len(optimizer.scalars))
        head += b"".join(_string(raw) + struct.pack("<d", v) for raw, v in optimizer.scalars)
        pieces.append(head + struct.pack("<I", len(optimizer.buffers)))
        for raw, source in optimizer.buffers:
            pieces += [_string(raw) + struct.pack("<Q", source.nbytes // 8), source]
    history = training.loss_history
    pieces.append(
        struct.pack(
            "<BQQdI",
            TAG_METADATA,
            training.epoch,
            training.global_step,
            training.best_loss,
            len(history),
        )
        + np.asarray(history, dtype="<f8").tobytes()
        + struct.pack("<B", TAG_EOF)
    )
    return pieces
