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

Where the code is. The byte codec (reading a record from an array, laying one out as pieces) is
:mod:`savepoint.codecs.burn`, with no file I/O; this module opens, maps and writes the files, makes
the lazy tensors, and maps a record's tree to and from dotted names.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import numpy as np

from savepoint.codecs import burn as codec
from savepoint.codecs import dtypes
from savepoint.codecs.burn import (
    BURN_VERSION,
    DTYPES,
    MAX_DEPTH,
    MAX_VALUES,
    Bin,
    Data,
    Metadata,
    Param,
    param_id,
)
from savepoint.codecs.burn import encode_id as _encode_id  # noqa: F401 (tests check ids with it)
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

EXTENSION = "mpk"
_MAX_HOLES = 1 << 20
_INDEX = re.compile(r"(0|[1-9][0-9]*)\Z", re.ASCII)
Framework = Literal["numpy", "torch"]


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


class _Lazy:
    """The reader's tensors: views of the file's mapping, copied when loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def stored(
        self,
        view: np.ndarray[Any, Any],
        dtype: dtypes.DType,
        shape: tuple[int, ...],
        width: int,
        name: str,
    ) -> LazyTensor:
        if dtype.name == "BOOL":
            return _BoolTensor(view, shape, width, name, self.path)
        return MappedTensor(view, dtype, shape, name=name, path=self.path)

    def array(self, values: np.ndarray[Any, Any], name: str) -> LazyTensor:
        return _array_tensor(values, name)


def _parse(data: np.ndarray[Any, Any], path: str) -> codec.Parsed:
    """The record in ``data`` (:func:`savepoint.codecs.burn.parse`), its tensors lazy, within
    this module's :data:`MAX_DEPTH` and :data:`MAX_VALUES`."""
    return codec.parse(data, path, _Lazy(path), max_depth=MAX_DEPTH, max_values=MAX_VALUES)


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
        elif node is not None and not isinstance(node, (Param, Data, Bin)):
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
        if source.dtype.name in codec.FLOATS:
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


class _Sources:
    """The writer's tensors: numpy arrays, torch tensors and a reader's lazy tensors."""

    def source(self, value: Any, where: str) -> TensorSource | None:
        if isinstance(value, LazyTensor):
            return value
        return arrays.make_source(value, where) if not isinstance(value, np.generic) else None

    def u32_bools(self, value: Any) -> TensorSource | None:
        if isinstance(value, _BoolTensor) and value.width == 4:
            return MappedTensor(value.raw, dtypes.from_name("U32"), value.shape)
        return None


_SOURCES = _Sources()


def _source(value: Any, where: str) -> TensorSource:
    return codec.source_of(_SOURCES, value, where)


def _pieces(item: Any, metadata: Metadata) -> list[bytes | TensorSource]:
    return codec.layout(item, metadata, _SOURCES, max_depth=MAX_DEPTH)


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
