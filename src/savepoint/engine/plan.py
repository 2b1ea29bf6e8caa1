"""Save plans as data: which tensors go into which data file, at which offsets.

A plan is computed from tensor descriptions alone (names, dtypes, shapes, byte counts), before any
byte is copied or any file created, so the synchronous writer, the async staging arena and every
rank of a sharded save lay files out the same way.

Split rule: tensors are assigned to files in the order they were found (the state's order), a new
file starting when the current one would pass ``max_file_bytes``; a tensor larger than that gets a
file of its own. Inside a file the tensors are ordered as the safetensors layout puts them
(:func:`savepoint.codecs.safetensors.layout`).
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii

from savepoint.codecs import safetensors
from savepoint.state.arrays import TensorSource

__all__ = [
    "FileLayout",
    "FilePlan",
    "STREAM_ENTRIES",
    "data_file_name",
    "lay_out",
    "plan_files",
]


@dataclass(frozen=True)
class FilePlan:
    """One data file: its name, its header bytes and where each tensor lies in it.

    ``entries`` are in file order with absolute byte offsets; ``size`` is the file's length."""

    name: str
    header: bytes
    entries: tuple[safetensors.Entry, ...]

    @property
    def size(self) -> int:
        return self.entries[-1].end if self.entries else len(self.header)

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)


def data_file_name(index: int) -> str:
    """The name of an unsharded checkpoint's ``index``-th data file."""
    return f"data-{index:05d}.safetensors"


def plan_files(
    tensors: Mapping[str, TensorSource],
    max_file_bytes: int,
    name: Callable[[int], str] = data_file_name,
) -> list[FilePlan]:
    """The files that hold ``tensors`` (in their order), named ``name(0)``, ``name(1)``, ..."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, source in tensors.items():
        if groups[-1] and size + source.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += source.nbytes
    plans = []
    for i, group in enumerate(groups):
        header, entries = safetensors.layout(
            [(n, tensors[n].dtype.name, tensors[n].shape, tensors[n].nbytes) for n in group]
        )
        plans.append(FilePlan(name(i), header, tuple(entries)))
    return plans


class FileLayout:
    """One data file of an unsharded save, laid out compactly (no object per tensor): its
    name and size, its header's size (length prefix included), and for each tensor in file
    order its position in the state (``order``: a ``range`` where that is the state's order),
    its start offset (``starts``, from the end of
    the header: add ``header_size`` for the position in the file) and its shape
    (``shapes[shape_of[j]]``). A million tensors cost about 20 MB here, where
    :class:`FilePlan`'s entries cost about 180 MB and its header 75 MB.

    The header (:meth:`header_pieces`) is byte for byte the one :func:`plan_files` makes. A
    file of more than :data:`STREAM_ENTRIES` tensors does not keep it: it is made again, a few
    thousand entries at a time, while it is written, its size known beforehand from the
    lengths of its parts."""

    __slots__ = ("header", "header_size", "name", "order", "shape_of", "shapes", "size", "starts")

    def __init__(
        self,
        name: str,
        header: bytes | None,
        header_size: int,
        order: Sequence[int],
        starts: array[int],
        shape_of: array[int],
        shapes: list[tuple[int, ...]],
    ) -> None:
        self.name = name
        self.header = header
        self.header_size = header_size
        self.order = order
        self.starts = starts
        self.shape_of = shape_of
        self.shapes = shapes
        self.size = header_size + (starts[-1] if starts else 0)

    def header_pieces(
        self, names: Sequence[str], tensors: Mapping[str, TensorSource]
    ) -> Iterator[bytes]:
        """The header, whole or a few thousand entries at a time (``names`` and ``tensors`` as
        given to :func:`lay_out`; the sources of this file must still be there). A header kept
        whole is given up here: it is written once."""
        if self.header is not None:
            header, self.header = self.header, None
            yield header
            return
        yield struct.pack("<Q", self.header_size - 8) + _OPENING
        written = 8 + len(_OPENING)
        for piece in _entries(self, names, tensors):
            written += len(piece)
            yield piece
        pad = self.header_size - written - 1
        if not 0 <= pad < 8:  # the lengths measured by lay_out disagree: never expected
            raise RuntimeError(
                f"{self.name}: header of {written} bytes, {self.header_size} planned"
            )
        yield b"}" + b" " * pad


# Files of more tensors than this make their header twice (once measured, once written)
# rather than keep it (about 75 bytes a tensor) while their data is written.
STREAM_ENTRIES = 1 << 17


def _entries(
    layout: FileLayout, names: Sequence[str], tensors: Mapping[str, TensorSource]
) -> Iterator[bytes]:
    """The header's entries, ',"name":{...}' each, a few thousand to a piece."""
    shape_texts = [json.dumps(list(shape), separators=(",", ":")) for shape in layout.shapes]
    encoded: dict[str, str] = {}
    parts: list[str] = []
    starts, shape_of = layout.starts, layout.shape_of
    for j, i in enumerate(layout.order):
        key = names[i]
        source = tensors[key]
        dtype = source.dtype.name
        dtype_text = encoded.get(dtype)
        if dtype_text is None:
            dtype_text = encoded[dtype] = _encode(dtype)
        offset = starts[j]
        parts.append(
            f',{_encode(key)}:{{"dtype":{dtype_text},"shape":{shape_texts[shape_of[j]]},'
            f'"data_offsets":[{offset},{starts[j + 1]}]}}'
        )
        if len(parts) == _PIECE:
            yield "".join(parts).encode("ascii")
            parts.clear()
    if parts:
        yield "".join(parts).encode("ascii")


def lay_out(
    names: Sequence[str],
    tensors: Mapping[str, TensorSource],
    max_file_bytes: int,
    name: Callable[[int], str] = data_file_name,
) -> list[FileLayout]:
    """The files :func:`plan_files` plans for ``tensors`` (``names``: their keys, in order),
    with the same headers, laid out without an object per tensor (see :class:`FileLayout`)."""
    groups: list[tuple[int, int]] = []
    begin = size = 0
    for i, key in enumerate(names):
        nbytes = tensors[key].nbytes
        if i > begin and size + nbytes > max_file_bytes:
            groups.append((begin, i))
            begin, size = i, 0
        size += nbytes
    groups.append((begin, len(names)))
    return [_layout(name(g), names, tensors, lo, hi) for g, (lo, hi) in enumerate(groups)]


def _layout(
    file: str, names: Sequence[str], tensors: Mapping[str, TensorSource], lo: int, hi: int
) -> FileLayout:
    sizes = [tensors[names[i]].dtype.itemsize for i in range(lo, hi)]
    order: Sequence[int] = range(lo, hi)  # the state's order, unless itemsizes differ
    if len(set(sizes)) > 1:
        # Largest itemsize first, otherwise in state order (safetensors.layout's rule).
        order = array("q", sorted(order, key=lambda i: -sizes[i - lo]))
    sizes.clear()  # (8 MB at a million tensors)
    shape_codes: dict[tuple[int, ...], int] = {}
    shapes: list[tuple[int, ...]] = []
    shape_of = array("I")
    starts = array("q")  # one more than tensors: the end of the data last
    offset = 0
    for i in order:
        source = tensors[names[i]]
        shape = source.shape
        code = shape_codes.get(shape)
        if code is None:
            code = shape_codes[shape] = len(shapes)
            shapes.append(shape)
        shape_of.append(code)
        starts.append(offset)
        offset += source.nbytes
    starts.append(offset)
    layout = FileLayout(file, None, 0, order, starts, shape_of, shapes)
    if hi - lo <= STREAM_ENTRIES:
        head = b"".join([_OPENING, *_entries(layout, names, tensors), b"}"])
        head += b" " * (-len(head) % 8)
        layout.header = struct.pack("<Q", len(head)) + head
        layout.header_size = len(layout.header)
    else:
        # The header's length, part by part as _entries writes them: ',"name":{"dtype":D,
        # "shape":S,"data_offsets":[a,b]}' per tensor, then '}' and spaces to a multiple of 8.
        fixed = len(',:{"dtype":,"shape":,"data_offsets":[,]}')
        shape_lengths = [len(json.dumps(list(shape), separators=(",", ":"))) for shape in shapes]
        dtype_lengths: dict[str, int] = {}
        length = len(_OPENING) + 1
        for j, i in enumerate(order):
            key = names[i]
            dtype = tensors[key].dtype.name
            dtype_length = dtype_lengths.get(dtype)
            if dtype_length is None:
                dtype_length = dtype_lengths[dtype] = len(_encode(dtype))
            length += (
                fixed
                + len(_encode(key))
                + dtype_length
                + shape_lengths[shape_of[j]]
                + len(str(starts[j]))
                + len(str(starts[j + 1]))
            )
        layout.header_size = 8 + length + (-length % 8)
    layout.size = layout.header_size + offset
    return layout


_OPENING = json.dumps({"__metadata__": safetensors.PRODUCER}, separators=(",", ":"))[:-1].encode(
    "ascii"
)
_PIECE = 4096
_encode = encode_basestring_ascii
