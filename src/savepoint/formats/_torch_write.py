"""Writing what ``torch.save`` writes, without torch: the archive of one contiguous tensor (its
bytes streamed from a source, chunk by chunk) or of an object without tensors (its pickle given),
as :mod:`savepoint.formats._torch_archive` reads them and ``torch.load`` (and DCP's
``FileSystemReader``) reads them.

The archive is a stored zip whose records are torch 2.13's: ``data.pkl``, ``.format_version``,
``.storage_alignment``, ``byteorder``, ``data/0`` (aligned to 64 bytes through torch's own
``FB`` padding field) and ``version``, each with its CRC-32 (the data record's is written into its
header once its bytes are through), zip64 end records always. ``data.pkl`` for a tensor is
written opcode by opcode (protocol 2): ``torch._utils._rebuild_tensor_v2`` over a typed storage
class, or ``_rebuild_tensor_v3`` over ``UntypedStorage`` with the dtype for the dtypes that have
no storage class (uint16/32/64, the float8s), exactly as ``torch.save`` names them.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable
from typing import Any, BinaryIO

from savepoint.codecs.dtypes import DType
from savepoint.formats._torch_archive import (
    CENTRAL,
    EOCD,
    LOCAL,
    STORAGE_CLASS,
    Z64_EOCD,
    Z64_LOCATOR,
)

__all__ = [
    "tensor_pickle",
    "write_bytes_archive",
    "write_tensor_archive",
]

_U32 = 0xFFFFFFFF
_SMALL = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))


def _pickle_str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _pickle_int(n: int) -> bytes:
    if 0 <= n < 1 << 31:
        return b"J" + struct.pack("<i", n)  # BININT
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _pickle_tuple(items: Iterable[int]) -> bytes:
    return b"(" + b"".join(_pickle_int(i) for i in items) + b"t"  # MARK ... TUPLE


def tensor_pickle(dtype: DType, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of ``torch.save`` of a contiguous tensor whose storage is record ``0``:
    ``_rebuild_tensor_v2`` over a typed storage, or ``_v3`` over an untyped one for the dtypes
    without a storage class (as torch 2.13 writes them)."""
    numel = math.prod(shape)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    typed = STORAGE_CLASS.get(dtype.torch_name)
    storage = f"ctorch\n{typed}\n" if typed else "ctorch.storage\nUntypedStorage\n"
    out = b"\x80\x02ctorch._utils\n_rebuild_tensor_v" + (b"2\n" if typed else b"3\n")
    out += b"((" + _pickle_str("storage") + storage.encode() + _pickle_str("0")
    out += _pickle_str("cpu") + _pickle_int(numel if typed else numel * dtype.itemsize) + b"tQ"
    out += _pickle_int(0) + _pickle_tuple(shape) + _pickle_tuple(stride)
    out += b"\x89ccollections\nOrderedDict\n)R"  # requires_grad False, no backward hooks
    if not typed:
        out += f"ctorch\n{dtype.torch_name}\n".encode()
    return out + b"tR."


class _ZipWriter:
    """A stored zip archive written from ``f``'s position (offsets relative to it), zip64 end
    records always, as torch's writer does."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.base = f.tell()
        self.central: list[bytes] = []

    def add(self, name: str, chunks: Iterable[Any], size: int, align: int = 0) -> None:
        offset = self.f.tell() - self.base
        raw = name.encode("utf-8")
        big = size >= _U32
        extra = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        if align:
            pad = -(offset + 30 + len(raw) + len(extra) + 4) % align
            extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad  # torch's alignment field
        shown = _U32 if big else size
        head = LOCAL + struct.pack(
            "<HHHHHIIIHH", 45, 0x800, 0, 0, 0, 0, shown, shown, len(raw), len(extra)
        )
        self.f.write(head + raw + extra)
        crc, written = 0, 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)
            written += len(chunk)
            self.f.write(chunk)
        if written != size:
            raise ValueError(f"record {name!r}: wrote {written} bytes, expected {size}")
        end = self.f.tell()
        self.f.seek(self.base + offset + 14)
        self.f.write(struct.pack("<I", crc))
        self.f.seek(end)
        z64 = [v for v in (size, size) if big] + ([offset] if offset >= _U32 else [])
        cextra = (
            struct.pack("<HH", 1, 8 * len(z64)) + struct.pack(f"<{len(z64)}Q", *z64) if z64 else b""
        )
        entry = CENTRAL + struct.pack(
            "<HHHHHHIIIHHHHHII",
            45,
            45,
            0x800,
            0,
            0,
            0,
            crc,
            shown,
            shown,
            len(raw),
            len(cextra),
            0,
            0,
            0,
            0,
            min(offset, _U32),
        )
        self.central.append(entry + raw + cextra)

    def finish(self) -> int:
        """Write the central directory and end records; the archive's length."""
        cd_offset = self.f.tell() - self.base
        directory = b"".join(self.central)
        n = len(self.central)
        z64_at = cd_offset + len(directory)
        tail = Z64_EOCD + struct.pack(
            "<QHHIIQQQQ", 44, 45, 45, 0, 0, n, n, len(directory), cd_offset
        )
        tail += Z64_LOCATOR + struct.pack("<IQI", 0, z64_at, 1)
        tail += EOCD + struct.pack(
            "<HHHHIIH",
            0,
            0,
            min(n, 0xFFFF),
            min(n, 0xFFFF),
            min(len(directory), _U32),
            min(cd_offset, _U32),
            0,
        )
        self.f.write(directory + tail)
        return self.f.tell() - self.base


def write_tensor_archive(
    f: BinaryIO, dtype: DType, shape: tuple[int, ...], chunks: Iterable[Any]
) -> int:
    """Write at ``f``'s position the archive ``torch.save`` writes for a contiguous tensor of
    ``dtype`` and ``shape`` whose bytes are ``chunks`` (in order); returns its length. ``f``
    must be seekable: the data record's CRC-32 goes into its header after the bytes."""
    return _archive(f, tensor_pickle(dtype, shape), (chunks, math.prod(shape) * dtype.itemsize))


def write_bytes_archive(f: BinaryIO, pickled: bytes) -> int:
    """Write at ``f``'s position the archive ``torch.save`` writes for an object without
    tensors, whose pickle is ``pickled``; returns its length."""
    return _archive(f, pickled, None)


def _archive(f: BinaryIO, pickled: bytes, data: tuple[Iterable[Any], int] | None) -> int:
    """The records torch 2.13 writes, in its order (its ``.data/serialization_id`` aside)."""
    z = _ZipWriter(f)
    z.add("archive/data.pkl", [pickled], len(pickled))
    for name, value in _SMALL:
        z.add(f"archive/{name}", [value], len(value))
    if data is not None:
        z.add("archive/data/0", data[0], data[1], align=64)
    z.add("archive/version", [b"3\n"], 2)
    return z.finish()
