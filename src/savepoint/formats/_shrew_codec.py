"""Byte-level reading and writing of ``.shrew`` files; the format and its rules are specified in
:mod:`savepoint.formats.shrew`, which is the public interface.

Reading goes through :class:`Input`, which checks every length against what is left of the input
before reading or allocating; :func:`parse` reads a whole file, eagerly (data into arrays) or not
(data skipped, offsets recorded). Writing validates everything (keys, dtypes, sizes, counts)
before the first byte, then streams each tensor through one bounded buffer.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from savepoint.errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)
from savepoint.formats import _files
from savepoint.formats._files import LazyTensor
from savepoint.state import arrays, dtypes
from savepoint.state.arrays import TensorSource
from savepoint.state.dtypes import DType
from savepoint.state.optimizer import OptimizerState

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
_U32 = 1 << 32
_U64 = 1 << 64
_F64 = dtypes.from_name("F64")

Tensors = Mapping[str, Any] | Iterable[tuple[str, Any]]


class Input:
    """A bounded reader: every length is checked against what is left before it is read."""

    def __init__(self, stream: BinaryIO, name: str) -> None:
        self.stream = stream
        self.name = name
        self.pos = 0
        self.size: int | None = None
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

    def _ended(self, what: str, missing: int) -> CorruptCheckpointError:
        return self.corrupt(f"the input ends {missing} bytes into {what} (truncated file)")

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        if n == 0:
            return b""
        parts: list[bytes] = []
        got = 0
        while got < n:
            chunk = self.stream.read(min(n - got, _files.CHUNK))
            if not chunk:
                raise self._ended(what, got)
            parts.append(chunk)
            got += len(chunk)
        self.pos += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_array(self, n: int, what: str) -> np.ndarray[Any, Any]:
        """``n`` bytes into a new writable uint8 array (allocated only once ``n`` is known to fit)."""
        self.need(n, what)
        readinto = getattr(self.stream, "readinto", None)
        if self.size is None or readinto is None:
            return np.frombuffer(bytearray(self.read(n, what)), dtype=np.uint8)
        out = np.empty(n, dtype=np.uint8)
        view = out.data
        got = 0
        while got < n:
            k = readinto(view[got : got + _files.CHUNK])
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
            left -= len(self.read(min(left, _files.CHUNK), what))

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


@dataclass
class Record:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    data: np.ndarray[Any, Any] | None  # uint8 bytes when read eagerly

    def array(self) -> np.ndarray[Any, Any]:
        assert self.data is not None
        return self.data.view(self.dtype.numpy).reshape(self.shape)


@dataclass
class Parsed:
    version: int
    tensors: list[Record]
    optimizer: tuple[str, list[tuple[str, float]], list[Record]] | None = None
    epoch: int = 0
    global_step: int = 0
    best_loss: float = math.inf
    loss_history: list[float] = field(default_factory=list)


def read_header(inp: Input) -> int:
    magic = inp.read(4, "the magic number")
    if magic != MAGIC:
        raise inp.corrupt(f"not a .shrew file: magic {magic!r}, expected {MAGIC!r}")
    version = inp.u32("the version")
    if version not in (VERSION_TENSORS, VERSION_TRAINING):
        raise IncompatibleCheckpointError(
            f"{inp.name}: .shrew version {version} is not supported (savepoint reads versions 1 "
            "and 2)",
            path=inp.name,
        )
    return version


def _tensor(inp: Input, eager: bool, seen: set[str]) -> Record:
    name = inp.string("tensor key")
    if name in seen:
        raise inp.corrupt(f"tensor key {name!r} appears twice", key=name)
    seen.add(name)
    tag = inp.u8(f"the dtype of {name!r}")
    dtype_name = DTYPE_TAGS.get(tag)
    if dtype_name is None:
        raise inp.corrupt(f"tensor {name!r}: unknown dtype tag {tag}", key=name)
    d = dtypes.from_name(dtype_name)
    ndim = inp.u32(f"the ndim of {name!r}")
    shape = struct.unpack(f"<{ndim}I", inp.read(4 * ndim, f"the dims of {name!r}"))
    if ndim > MAX_NDIM:
        raise IncompatibleCheckpointError(
            f"{inp.name}: tensor {name!r} has {ndim} dimensions; numpy holds at most {MAX_NDIM}",
            path=inp.name,
        )
    data_len = inp.u64(f"the data length of {name!r}")
    expected = math.prod(shape) * d.itemsize
    if data_len != expected:
        raise inp.corrupt(
            f"tensor {name!r}: data length {data_len} disagrees with shape {list(shape)} of "
            f"{dtype_name} ({expected} bytes)",
            key=name,
        )
    offset = inp.pos
    what = f"the data of {name!r}"
    if eager:
        data: np.ndarray[Any, Any] | None = inp.read_array(data_len, what)
    else:
        inp.skip(data_len, what)
        data = None
    return Record(name, d, tuple(shape), offset, data_len, data)


def _tensors(inp: Input, eager: bool) -> list[Record]:
    count = inp.u32("the tensor count")
    seen: set[str] = set()
    return [_tensor(inp, eager, seen) for _ in range(count)]


def _optimizer(inp: Input, eager: bool) -> tuple[str, list[tuple[str, float]], list[Record]]:
    kind = inp.string("the optimizer type")
    scalars: list[tuple[str, float]] = []
    names: set[str] = set()
    for _ in range(inp.u32("the optimizer scalar count")):
        key = inp.string("an optimizer scalar key")
        if key in names:
            raise inp.corrupt(f"optimizer scalar {key!r} appears twice", key=key)
        names.add(key)
        scalars.append((key, inp.f64(f"optimizer scalar {key!r}")))
    buffers: list[Record] = []
    names = set()
    for _ in range(inp.u32("the optimizer buffer count")):
        key = inp.string("an optimizer buffer key")
        if key in names:
            raise inp.corrupt(f"optimizer buffer {key!r} appears twice", key=key)
        names.add(key)
        n = inp.u64(f"the length of optimizer buffer {key!r}")
        offset = inp.pos
        what = f"optimizer buffer {key!r}"
        if eager:
            data: np.ndarray[Any, Any] | None = inp.read_array(8 * n, what)
        else:
            inp.skip(8 * n, what)
            data = None
        buffers.append(Record(key, _F64, (n,), offset, 8 * n, data))
    return kind, scalars, buffers


def parse(inp: Input, *, eager: bool) -> Parsed:
    version = read_header(inp)
    if version == VERSION_TENSORS:
        parsed = Parsed(version, _tensors(inp, eager))
    else:
        parsed = Parsed(version, [])
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
                raw = inp.read(8 * n, "the loss history")
                parsed.loss_history = np.frombuffer(raw, dtype="<f8").tolist()
        for tag in (TAG_MODEL, TAG_METADATA):
            if tag not in seen:
                raise inp.corrupt(f"the {SECTION_NAMES[tag]} section is missing")
    if not inp.at_end():
        where = "the last tensor" if version == VERSION_TENSORS else "the end tag"
        raise inp.corrupt(f"unexpected bytes after {where} (offset {inp.pos})")
    return parsed


def pairs(tensors: Tensors) -> list[tuple[Any, Any]]:
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    pairs = []
    for item in tensors:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise UnsupportedStateError(
                f"expected (name, tensor) pairs, got {type(item).__name__}; pass a mapping or a "
                "sequence of pairs"
            )
        pairs.append(item)
    return pairs


def key_bytes(key: Any, what: str) -> bytes:
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


def as_source(value: Any, key: str) -> TensorSource:
    if isinstance(value, LazyTensor):
        return value
    source = arrays.make_source(value, key)
    if source is None:
        raise UnsupportedStateError(
            f"{key}: a {type(value).__module__}.{type(value).__qualname__} is not a numpy array "
            "or torch tensor; .shrew holds tensors only",
            key=key,
        )
    return source


def check_source(key: str, source: TensorSource) -> None:
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


def checked_items(tensors: Tensors) -> list[tuple[bytes, TensorSource]]:
    items: list[tuple[bytes, TensorSource]] = []
    seen: set[str] = set()
    for key, value in pairs(tensors):
        raw = key_bytes(key, "tensor key")
        if key in seen:
            raise UnsupportedStateError(
                f"tensor key {key!r} appears twice; a .shrew file holds each key once", key=key
            )
        seen.add(key)
        source = as_source(value, key)
        check_source(key, source)
        items.append((raw, source))
    if len(items) >= _U32:
        raise UnsupportedStateError(f"{len(items)} tensors do not fit .shrew's u32 count")
    return items


class _Output:
    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def raw(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while len(view):
            n = self.stream.write(view)
            if n is None or n >= len(view):
                return
            view = view[n:]

    def pack(self, fmt: str, *values: Any) -> None:
        self.raw(struct.pack("<" + fmt, *values))

    def string(self, raw: bytes) -> None:
        self.pack("I", len(raw))
        self.raw(raw)

    def tensors(self, items: list[tuple[bytes, TensorSource]]) -> None:
        self.pack("I", len(items))
        for raw, source in items:
            self.string(raw)
            self.pack("BI", TAG_OF[source.dtype.name], len(source.shape))
            self.pack(f"{len(source.shape)}I", *source.shape)
            self.pack("Q", source.nbytes)
            self.data(source)

    def data(self, source: TensorSource) -> None:
        # A function scope, so the chunk buffer is freed before the next tensor's is made.
        for chunk in _files.chunks(source):
            self.raw(chunk)


@dataclass
class OptimizerSection:
    """An optimizer section ready to write: scalars and buffers in file order, buffers as F64
    sources (any shape; written flattened)."""

    optimizer_type: str
    scalars: list[tuple[str, float]]
    buffers: list[tuple[str, TensorSource]]

    @classmethod
    def of(cls, state: OptimizerState) -> OptimizerSection:
        if not isinstance(state, OptimizerState):
            raise UnsupportedStateError(
                f"optimizer_state must be an sp.OptimizerState or None, got "
                f"{type(state).__name__} (sp.optimizer_state_from_torch converts a torch optimizer)"
            )
        return cls(
            state.optimizer_type,
            sorted(state.scalars.items()),
            [(k, arrays.NumpySource(v, k)) for k, v in sorted(state.buffers.items())],
        )

    def check(self) -> tuple[bytes, list[tuple[bytes, float]], list[tuple[bytes, TensorSource]]]:
        kind = key_bytes(self.optimizer_type, "optimizer type")
        scalars = [(key_bytes(k, "optimizer scalar key"), float(v)) for k, v in self.scalars]
        buffers = []
        for k, source in self.buffers:
            if source.dtype.name != "F64":
                raise UnsupportedStateError(f"optimizer buffer {k!r} is not float64", key=k)
            buffers.append((key_bytes(k, "optimizer buffer key"), source))
        for what, keys in (
            ("scalar", [k for k, _ in self.scalars]),
            ("buffer", [k for k, _ in self.buffers]),
        ):
            if len(set(keys)) != len(keys):
                raise UnsupportedStateError(f"an optimizer {what} key appears twice")
            if len(keys) >= _U32:
                raise UnsupportedStateError(f"too many optimizer {what}s for .shrew's u32 count")
        return kind, scalars, buffers


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


def write_tensors(stream: BinaryIO, tensors: Tensors) -> None:
    """Write a v1 file to ``stream``; everything is checked before the first byte is written."""
    items = checked_items(tensors)
    out = _Output(stream)
    out.raw(MAGIC)
    out.pack("I", VERSION_TENSORS)
    out.tensors(items)


def write_training(
    stream: BinaryIO,
    model: Tensors,
    optimizer: OptimizerSection | None,
    *,
    epoch: int,
    global_step: int,
    best_loss: float,
    loss_history: Iterable[float],
) -> None:
    """Write a v2 file to ``stream``; everything is checked before the first byte is written."""
    items = checked_items(model)
    opt = optimizer.check() if optimizer is not None else None
    epoch = _count(epoch, "epoch")
    global_step = _count(global_step, "global_step")
    best = _real(best_loss, "best_loss")
    history = [_real(v, "loss_history value") for v in loss_history]
    if len(history) >= _U32:
        raise UnsupportedStateError("the loss history is too long for .shrew's u32 count")
    out = _Output(stream)
    out.raw(MAGIC)
    out.pack("I", VERSION_TRAINING)
    out.pack("B", TAG_MODEL)
    out.tensors(items)
    if opt is not None:
        kind, scalars, buffers = opt
        out.pack("B", TAG_OPTIMIZER)
        out.string(kind)
        out.pack("I", len(scalars))
        for raw, value in scalars:
            out.string(raw)
            out.pack("d", value)
        out.pack("I", len(buffers))
        for raw, source in buffers:
            out.string(raw)
            out.pack("Q", source.nbytes // 8)
            out.data(source)
    out.pack("B", TAG_METADATA)
    out.pack("QQdI", epoch, global_step, best, len(history))
    out.raw(np.asarray(history, dtype="<f8").tobytes())
    out.pack("B", TAG_EOF)
