"""How one blob's bytes are laid out: a 32-byte header, then the payload.

::

    offset  size  field
    0       4     magic b"SPBL"
    4       1     version (1)
    5       1     codec: 0 raw, 1 zstd
    6       1     shuffle: 0, or the item size (2, 4, 8) whose byte planes were split before
                  compressing (bytes 0 of every item, then bytes 1, ...; a tail shorter than an
                  item is kept as it is, after the planes)
    7       1     reserved, 0
    8       8     raw size: bytes of the content (little-endian)
    16      8     stored size: bytes of the payload that follows the header
    24      8     XXH3-64 of bytes 0-23 (little-endian)
    32      ...   payload: the content itself (raw), or one zstd frame

A blob is named by the digest of its *content* (the raw bytes), whatever its codec, so the same
tensor bytes dedupe whether or not a save compressed them. A raw blob's content starts at byte 32
of the blob: ranges are read in place, and a mapped local blob gives a zero-copy view of it.

Readers treat a header as hostile: wrong magic or version, a header checksum that fails, sizes
that disagree with the blob's size or with the size the caller expects, a zstd payload larger
than zstd's bound for its content (:func:`compress_bound`), an unknown codec: each is a
CorruptCheckpointError before anything is allocated. A zstd payload is decompressed straight into
the caller's buffer (:func:`decode`), once its frame header was found to claim exactly the
header's content size (:func:`check_frame`); running out of memory there is
CheckpointMemoryError, never "corrupt".
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from savepoint.errors import (
    CheckpointError,
    CheckpointMemoryError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)

__all__ = [
    "Compression",
    "HEADER",
    "Header",
    "MAGIC",
    "RAW",
    "ZSTD",
    "check_frame",
    "compress_bound",
    "decode",
    "encode",
    "pack_header",
    "parse_header",
]

MAGIC = b"SPBL"
VERSION = 1
HEADER = 32
RAW = 0
ZSTD = 1
CODECS = {"zstd": ZSTD}
_PREFIX = struct.Struct("<4sBBBBQQ")
_SUFFIX = struct.Struct("<Q")
_PROBE = 64 << 10  # bytes compressed first, to skip incompressible chunks cheaply


@dataclass(frozen=True)
class Compression:
    """A compression policy (off unless a caller passes one).

    ``codec``: ``"zstd"``. ``level``: zstd's level (1-22). 1 by default: on float weights and
    optimizer moments, with the shuffle, levels 3 and 9 saved no more than 1 percentage point
    over level 1 and compressed 1.5-6x slower (``docs/blobs.md``). ``min_saving``: a blob is stored
    compressed only if that saves at least this fraction of its bytes (otherwise raw: reads stay
    zero-copy and cost no decompression). ``shuffle``: split the byte planes of items of the
    tensor's item size before compressing (the high byte of floats compresses far better on its
    own). ``probe``: compress the first 64 KiB first and store raw at once when that does not save
    half of ``min_saving`` (random-looking data costs little CPU then)."""

    codec: str = "zstd"
    level: int = 1
    min_saving: float = 0.05
    shuffle: bool = True
    probe: bool = True

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"unknown compression {self.codec!r} (known: {', '.join(CODECS)})")
        if not 1 <= self.level <= 22:
            raise ValueError(f"zstd level must be between 1 and 22, not {self.level}")
        if not 0.0 <= self.min_saving < 1.0:
            raise ValueError(f"min_saving must be in [0, 1), not {self.min_saving}")


@dataclass(frozen=True)
class Header:
    codec: int
    shuffle: int
    raw_size: int
    stored_size: int


def pack_header(codec: int, shuffle: int, raw_size: int, stored_size: int) -> bytes:
    head = _PREFIX.pack(MAGIC, VERSION, codec, shuffle, 0, raw_size, stored_size)
    return head + _SUFFIX.pack(xxhash.xxh3_64_intdigest(head))


def parse_header(
    data: bytes | bytearray,
    *,
    shown: str,
    blob_size: int | None = None,
    expect_size: int | None = None,
) -> Header:
    """The header of a blob (its first 32 bytes); ``blob_size``: the whole blob's size, checked
    against the stored size; ``expect_size``: the content size the caller expects."""
    if len(data) < HEADER:
        raise CorruptCheckpointError(
            f"blob {shown} is truncated: {len(data)} bytes, shorter than its header", path=shown
        )
    magic, version, codec, shuffle, reserved, raw_size, stored_size = _PREFIX.unpack_from(data)
    (check,) = _SUFFIX.unpack_from(data, _PREFIX.size)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"{shown} is not a savepoint blob (bad magic)", path=shown)
    if check != xxhash.xxh3_64_intdigest(bytes(data[: _PREFIX.size])):
        raise CorruptCheckpointError(f"blob {shown} has a damaged header", path=shown)
    if version != VERSION:
        raise IncompatibleCheckpointError(
            f"blob {shown} has format version {version}; this savepoint reads version {VERSION}. "
            "Upgrade savepoint to read it.",
            path=shown,
        )
    if codec not in (RAW, ZSTD) or reserved or shuffle not in (0, 1, 2, 4, 8):
        raise CorruptCheckpointError(f"blob {shown} has an unknown codec or flags", path=shown)
    if codec == RAW and stored_size != raw_size:
        raise CorruptCheckpointError(f"blob {shown}: raw blob with two sizes", path=shown)
    if codec == ZSTD and stored_size > compress_bound(raw_size):
        raise CorruptCheckpointError(
            f"blob {shown}: a zstd payload of {stored_size} bytes for {raw_size} bytes of content "
            "(larger than zstd ever makes it)",
            path=shown,
        )
    if blob_size is not None and HEADER + stored_size != blob_size:
        raise CorruptCheckpointError(
            f"blob {shown} is {blob_size} bytes; its header says {HEADER + stored_size} "
            "(truncated or overwritten)",
            path=shown,
        )
    if expect_size is not None and raw_size != expect_size:
        raise CorruptCheckpointError(
            f"blob {shown} holds {raw_size} bytes; {expect_size} were expected", path=shown
        )
    return Header(codec, shuffle, raw_size, stored_size)


def compress_bound(size: int) -> int:
    """The largest zstd payload of ``size`` content bytes (zstd's ``ZSTD_COMPRESSBOUND``): a
    compressed blob's stored size is refused beyond it, so a reader never allocates a payload
    bigger than the content its recipe accounts for (about 1/256 more)."""
    return size + (size >> 8) + (((128 << 10) - size) >> 11 if size < 128 << 10 else 0)


_local = threading.local()


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - depends on the environment
        raise IncompatibleCheckpointError(
            "zstd-compressed blobs need the zstandard package: pip install zstandard"
        ) from None
    return zstandard


def _compressor(level: int) -> Any:
    cache: dict[int, Any] | None = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    found = cache.get(level)
    if found is None:
        found = cache[level] = _zstd().ZstdCompressor(level=level)
    return found


def _decompressor() -> Any:
    found = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = _zstd().ZstdDecompressor()
    return found


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _shuffle(view: memoryview, itemsize: int) -> np.ndarray[Any, Any]:
    """The byte planes of ``view``'s items (plane ``k``: byte ``k`` of every item), then the
    tail shorter than an item. Shifts on whole items: 2-3x faster than a transposed copy."""
    n = len(view) - len(view) % itemsize
    arr = np.frombuffer(view, dtype=np.uint8)
    items = arr[:n].view(_UINT[itemsize])  # little-endian, as the planes are defined
    if items.dtype.byteorder == ">":  # pragma: no cover - big-endian hosts
        items = items.byteswap()
    out = np.empty(len(view), np.uint8)
    planes = out[:n].reshape(itemsize, -1)
    for k in range(itemsize):
        np.copyto(planes[k], items >> (8 * k), casting="unsafe")
    out[n:] = arr[n:]
    return out


def encode(view: memoryview, policy: Compression | None, itemsize: int = 1) -> tuple[int, int, Any]:
    """``(codec, shuffle, payload)`` for the content ``view`` under ``policy`` (None: raw). The
    payload of a raw blob is ``view`` itself (no copy)."""
    if policy is None or len(view) == 0:
        return RAW, 0, view
    n = len(view)
    shuffle = itemsize if policy.shuffle and itemsize in (2, 4, 8) else 0
    compressor = _compressor(policy.level)
    limit = n * (1.0 - policy.min_saving)
    if policy.probe and n > 4 * _PROBE:
        sample = view[:_PROBE]
        packed = compressor.compress(_shuffle(sample, shuffle) if shuffle else sample)
        if len(packed) > _PROBE * (1.0 - policy.min_saving / 2):
            return RAW, 0, view
    source: Any = _shuffle(view, shuffle) if shuffle else view
    payload = compressor.compress(source)
    if len(payload) > limit:
        return RAW, 0, view
    return ZSTD, shuffle, payload


_PIECE = 64 << 10  # decompressed bytes a shuffled blob's planes are scattered from at a time


def _memory_error(exc: BaseException) -> bool:
    """Whether a decompression failure is the machine running out of memory (a MemoryError, or
    zstd's own allocation failure), not bad bytes."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return "allocat" in text or "not enough memory" in text or "out of memory" in text


def _fill(reader: Any, out: memoryview, *, shown: str, raw_size: int, done: int) -> int:
    """Decompress into all of ``out`` (``done`` bytes of the content came before it) and
    return the content bytes decompressed so far; CorruptCheckpointError when the frame ends
    first."""
    pos = 0
    while pos < len(out):
        n = reader.readinto(out[pos:])
        if not n:
            raise CorruptCheckpointError(
                f"blob {shown} decompresses to {done + pos} bytes, not {raw_size}", path=shown
            )
        pos += n
    return done + pos


def check_frame(header: Header, payload: Any, *, shown: str) -> None:
    """Refuse a compressed payload whose zstd frame does not claim exactly ``header.raw_size``
    bytes of content (from the frame header alone: nothing is decompressed or allocated).
    savepoint's writer always records the content size, so a frame without one is refused too:
    its decompression could not be bounded in advance."""
    zstd = _zstd()
    try:
        claimed = zstd.frame_content_size(payload)
    except zstd.ZstdError:
        raise CorruptCheckpointError(
            f"blob {shown} does not decompress: its payload is not a zstd frame", path=shown
        ) from None
    if claimed != header.raw_size:
        what = "does not record its content size" if claimed < 0 else f"claims {claimed} bytes"
        raise CorruptCheckpointError(
            f"blob {shown} does not decompress: its zstd frame {what}, its header "
            f"{header.raw_size}",
            path=shown,
        )


def decode(header: Header, payload: Any, out: np.ndarray[Any, Any], *, shown: str) -> None:
    """Fill ``out`` (uint8, ``header.raw_size`` long) with the content of a compressed payload,
    decompressed straight into it (a shuffled payload through a 64 KiB scratch buffer, its planes
    scattered into place): no copy of the content is ever held besides ``out``.

    The zstd frame must record its content size, and that size must be ``header.raw_size``
    (which the caller checked against what its recipe accounts for): a frame claiming more is
    refused before anything is decompressed. Running out of memory is CheckpointMemoryError;
    anything else wrong is CorruptCheckpointError naming ``shown``."""
    check_frame(header, payload, shown=shown)
    try:
        with _decompressor().stream_reader(payload, read_across_frames=False) as reader:
            if header.shuffle:
                done = _unshuffle_from(reader, header.shuffle, out, shown=shown)
            else:
                done = _fill(reader, out.data, shown=shown, raw_size=header.raw_size, done=0)
            if reader.readinto(bytearray(1)):
                raise CorruptCheckpointError(
                    f"blob {shown} decompresses to more than {header.raw_size} bytes", path=shown
                )
    except CheckpointError:
        raise
    except Exception as exc:
        if _memory_error(exc):
            raise CheckpointMemoryError(
                f"blob {shown}: out of memory while decompressing its {header.raw_size} bytes "
                f"({exc or type(exc).__name__}); the blob itself was not found damaged. Free "
                "memory and load again",
                path=shown,
            ) from None
        raise CorruptCheckpointError(
            f"blob {shown} does not decompress: {exc or type(exc).__name__}", path=shown
        ) from exc
    assert done == header.raw_size


def _unshuffle_from(reader: Any, itemsize: int, out: np.ndarray[Any, Any], *, shown: str) -> int:
    """Decompress a shuffled content into ``out``: plane ``k`` (byte ``k`` of every item, as
    the planes are defined) is scattered into column ``k`` of ``out`` seen as rows of items,
    64 KiB at a time, then the tail shorter than an item is decompressed into place."""
    size = out.size
    n = size - size % itemsize
    rows = n // itemsize
    items = out[:n].reshape(rows, itemsize)
    scratch = np.empty(min(_PIECE, max(rows, 1)), np.uint8)
    done = 0
    for k in range(itemsize):
        column = items[:, k]
        for pos in range(0, rows, scratch.size):
            piece = scratch[: min(scratch.size, rows - pos)]
            done = _fill(reader, piece.data, shown=shown, raw_size=size, done=done)
            column[pos : pos + piece.size] = piece
    return _fill(reader, out[n:].data, shown=shown, raw_size=size, done=done)
