"""Writing a burn record: its bytes as rmp-serde writes them (shortest encodings), in pieces
between which the caller streams the tensors' raw bytes."""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import numpy as np

from savepoint.codecs.burn._record import (
    MAX_DEPTH,
    TO_BURN,
    U64,
    Data,
    Metadata,
    Param,
    Sources,
    Tensor,
    param_id,
)
from savepoint.errors import UnsupportedStateError

_S = TypeVar("_S", bound=Tensor)


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
        if v < U64:
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


def source_of(sources: Sources[_S], value: Any, where: str) -> _S:
    """``sources.source(value, where)``; raises UnsupportedStateError if it is not a tensor."""
    source = sources.source(value, where)
    if source is None:
        raise UnsupportedStateError(
            f"{where or '<root>'}: {type(value).__name__} is not a tensor (a numpy array or "
            "torch tensor)",
            key=where,
        )
    return source


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


class _Encoder(Generic[_S]):
    """Builds the byte pieces of a record: structure bytes and tensor sources, in file order."""

    def __init__(self, bool_store: bool, sources: Sources[_S], max_depth: int) -> None:
        self.pieces: list[bytes | _S] = []
        self.buf = bytearray()
        self.bool_store = bool_store
        self.sources = sources
        self.max_depth = max_depth

    def finish(self) -> list[bytes | _S]:
        if self.buf:
            self.pieces.append(bytes(self.buf))
            self.buf = bytearray()
        return self.pieces

    def tensor(self, value: Any, where: str) -> None:
        source = source_of(self.sources, value, where)
        burn = TO_BURN.get(source.dtype.name)
        store = "Native"
        wide = self.sources.u32_bools(value) if self.bool_store else None
        if wide is not None:
            # burn 0.21's U32 bool store, read from a file: written back as it was.
            source = wide
            store = "U32"
        if burn is None:
            raise UnsupportedStateError(
                f"{where or '<root>'}: dtype {source.dtype.name} has no burn DType (burn holds "
                f"{', '.join(sorted(TO_BURN))})",
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
        if depth > self.max_depth:
            raise UnsupportedStateError(f"{name}: nested deeper than {self.max_depth} levels")
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
        elif self.sources.source(node, name) is not None:
            self.value(Param(node), where, depth)
        else:
            raise UnsupportedStateError(
                f"{name or '<root>'}: a {type(node).__name__} has no place in a burn record",
                key=name,
            )


def layout(
    item: Any, metadata: Metadata, sources: Sources[_S], *, max_depth: int = MAX_DEPTH
) -> list[bytes | _S]:
    """The file of the record tree ``item`` (see :func:`savepoint.formats.burn.write_record`) as
    pieces in file order: bytes, and the tensors ``sources`` found, whose raw bytes go there.
    Raises UnsupportedStateError for a tree burn cannot hold, before any byte is written."""
    enc = _Encoder(_version(metadata.version) >= (0, 21), sources, max_depth)
    enc.buf += _map_header(3) + _str("metadata", "metadata") + _map_header(5)
    for k, v in metadata.to_dict().items():
        if not isinstance(v, str):
            raise UnsupportedStateError(f"metadata {k!r} must be a str")
        enc.buf += _str(k, "metadata") + _str(v, f"metadata.{k}")
    enc.buf += _str("item", "item")
    enc.value(item, (), 0)
    enc.buf += _str("_b", "_b") + _array_header(0)
    return enc.finish()
