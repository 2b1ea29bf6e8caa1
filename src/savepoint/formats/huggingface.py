"""Hugging Face model directories: the weights layout ``save_pretrained`` writes and
``from_pretrained`` reads, as a source savepoint reads and a target ``export(hf=True)`` writes.

Layout (``transformers`` 5.x, ``huggingface_hub``'s ``split_torch_state_dict_into_shards``)::

    model.safetensors                       everything, when it fits in one shard; no index
    model-00001-of-00003.safetensors        or shards, ``-{i:05d}-of-{n:05d}``, numbered from 1,
    model-00002-of-00003.safetensors        each a plain safetensors file
    model-00003-of-00003.safetensors
    model.safetensors.index.json            {"metadata": {"total_parameters": P,
                                             "total_size": S}, "weight_map": {name: shard}}

The index is ``json.dumps(index, indent=2, sort_keys=True) + "\\n"``, as ``save_pretrained``
writes it; ``total_size`` is the bytes of the tensors stored, ``total_parameters`` their
elements. Tied weights are stored once (see :mod:`savepoint.formats.export`).

Shard assignment (:func:`plan_shards`), as ``huggingface_hub`` does it: the tensors in order; a
tensor larger than the limit goes alone into a shard of its own, made when it is met (the shard
being filled stays open, so it comes later in the numbering); otherwise a new shard starts when
the next tensor would take the current one over the limit. Sizes are decimal as the Hub writes
them (:func:`parse_size`: ``"5GB"`` is 5 * 10**9 bytes; ``KiB``/``MiB``/``GiB``/``TiB`` are
binary, a bare integer is bytes).

Reading (format ``"huggingface"`` for :func:`savepoint.formats.detect.detect`): a directory
holding ``model.safetensors`` (read first, as ``from_pretrained`` does) or
``model.safetensors.index.json``, or the path of any ``*.safetensors.index.json`` (a variant such
as ``model.fp16.safetensors.index.json``); files may be symlinks (the Hugging Face cache is made of
them). Its tree is ``{name: tensor}`` in the order of the bytes: the shards in the order of
their names (their numbers), each one's tensors by data offset (for a savepoint export of one
dtype, the checkpoint's order; ``save_pretrained``'s shards are sorted by name); its metadata is
the ``__metadata__`` of its first shard. ``config.json``, tokenizers and every other
file of the directory are not read; nor are shards the index does not name.

The index is hostile input: read with a cap (:data:`MAX_INDEX_BYTES`) by the bounded JSON reader
(nesting, memory per byte), then checked before any shard is opened: ``weight_map`` an object of
tensor names to plain file names (no directory part, no ``..``), ``total_size`` (when present) a
non-negative integer. Each shard is opened as any safetensors file (every header rule, byte
ranges that tile the file), then the index and the shards must agree exactly: every tensor the
index names is in the shard it names, and every tensor of a shard is named by the index for that
shard. Any disagreement is a CorruptCheckpointError; nothing but CheckpointError subclasses
escapes. ``verify`` checks, besides, that ``total_size`` equals the bytes of the tensors listed,
and reads every byte (the format has no checksums).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from savepoint.codecs import bounded_json
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from savepoint.formats._files import MappedTensor, SafetensorsFile
from savepoint.formats._progress import Progress, Tally
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.storage import local

__all__ = [
    "INDEX",
    "INDEX_SUFFIX",
    "Index",
    "MAX_INDEX_BYTES",
    "Repository",
    "SINGLE",
    "index_bytes",
    "inspect",
    "is_repository",
    "open_repository",
    "parse_index",
    "parse_size",
    "plan_shards",
    "shard_names",
    "verify",
]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # a model of a million tensors has an index of about 60 MB
_UNITS = {
    "TB": 10**12,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
    "TIB": 1 << 40,
    "GIB": 1 << 30,
    "MIB": 1 << 20,
    "KIB": 1 << 10,
    "B": 1,
}
_NOTE = (
    "Hugging Face model directories have no checksums: verify checks the index against the "
    "shards (each tensor where the index says, total_size), each shard's header and byte "
    "ranges, and reads every byte"
)


# ---------------------------------------------------------------------------------------------
# the layout: sizes, shards, names, the index
# ---------------------------------------------------------------------------------------------


def parse_size(value: int | str) -> int:
    """Bytes for a shard size limit: an integer, or a number with a unit, as ``save_pretrained``
    takes it (``"5GB"``, ``"500MB"``, ``"1.5GB"``: decimal; ``"2GiB"``: binary; ``"4096"`` or
    ``"4096B"``: bytes). Raises ValueError for anything else, or a size that is not positive."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"a shard size is an integer or a string like '5GB', not {value!r}")
    if isinstance(value, int):
        size = value
    else:
        text = value.strip().upper()
        digits = text.rstrip("ABGIKMT ")
        unit = text[len(digits) :].strip() or "B"
        if unit not in _UNITS or not digits:
            raise ValueError(
                f"cannot read {value!r} as a size: a number and one of KB, MB, GB, TB (decimal, "
                "as the Hub writes them), KiB, MiB, GiB, TiB or B"
            )
        try:
            number = float(digits)
        except ValueError:
            raise ValueError(f"cannot read {value!r} as a size: {digits!r} is no number") from None
        if number != number or number in (float("inf"), float("-inf")):
            raise ValueError(f"cannot read {value!r} as a size")
        size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a shard size must be positive, not {value!r}")
    return size


def plan_shards(sizes: Sequence[int], max_shard_size: int) -> list[list[int]]:
    """The shards (lists of indices into ``sizes``) that ``huggingface_hub`` makes for tensors
    of these byte sizes, in this order, under ``max_shard_size`` (module docstring)."""
    shards: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if size > max_shard_size:
            shards.append([i])
            continue
        if filled + size > max_shard_size:
            shards.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """The file names of ``count`` shards: ``model.safetensors`` alone, else numbered."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_bytes(weight_map: dict[str, str], total_size: int, total_parameters: int) -> bytes:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it."""
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": weight_map,
    }
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------------
# the index, read
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Index:
    """A checked ``*.safetensors.index.json``: ``weight_map`` (tensor name -> shard file name,
    in the document's order), ``files`` (each shard once, in order of first mention),
    ``total_size`` (None when absent) and the whole ``metadata`` object."""

    weight_map: dict[str, str]
    files: tuple[str, ...]
    total_size: int | None
    metadata: dict[str, Any]


def _plain_name(name: str) -> bool:
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )


def parse_index(raw: bytes, shown: str) -> Index:
    """The index in ``raw`` (the bytes of the file ``shown``), checked (module docstring).
    Raises CorruptCheckpointError naming ``shown``."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{shown}: {why}", path=shown)

    doc = bounded_json.loads(raw, CorruptCheckpointError, shown)
    if type(doc) is not dict:
        raise bad("not a JSON object (an index holds metadata and weight_map)")
    weight_map = doc.get("weight_map")
    if type(weight_map) is not dict:
        raise bad("no weight_map object (tensor name -> shard file)")
    metadata = doc.get("metadata", {})
    if metadata is None:
        metadata = {}
    if type(metadata) is not dict:
        raise bad("metadata is not a JSON object")
    total = metadata.get("total_size")
    if total is not None and (type(total) is not int or total < 0):
        raise bad(f"total_size is not a non-negative integer ({_shorten(total)})")
    files: dict[str, None] = {}
    for name, file in weight_map.items():
        if type(file) is not str or not _plain_name(file):
            raise bad(
                f"tensor {_shorten(name)} is mapped to {_shorten(file)}, not a file name in "
                "the directory (a shard is named without a directory part)"
            )
        files.setdefault(file)
    return Index(dict(weight_map), tuple(files), total, dict(metadata))


def _shorten(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def _read_index(path: str) -> Index:
    try:
        raw = local.read_small(os.path.realpath(path), cap=MAX_INDEX_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no file at {path}", path=path) from None
    return parse_index(raw, path)


# ---------------------------------------------------------------------------------------------
# the directory, opened
# ---------------------------------------------------------------------------------------------


def is_repository(path: str) -> bool:
    """Whether the directory ``path`` holds ``model.safetensors`` or its index (files, or links
    to files)."""
    return os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX))


def _locate(path: str) -> tuple[str, str | None]:
    """The directory and the index file (None: a single ``model.safetensors``) of ``path``."""
    p = os.path.abspath(path)
    if os.path.isdir(p):
        if os.path.isfile(os.path.join(p, SINGLE)):
            return p, None
        if os.path.isfile(os.path.join(p, INDEX)):
            return p, os.path.join(p, INDEX)
        raise IncompatibleCheckpointError(
            f"{p} holds neither {SINGLE} nor {INDEX}: not a Hugging Face model directory", path=p
        )
    if p.endswith(INDEX_SUFFIX):
        return os.path.dirname(p), p
    raise IncompatibleCheckpointError(
        f"{p} is not a Hugging Face model directory nor a *{INDEX_SUFFIX} file", path=p
    )


class Repository:
    """A Hugging Face model directory opened for reading: the index checked, every shard's
    header checked and mapped, and the two found to agree (module docstring). Close it (or use
    ``with``) when done."""

    def __init__(self, path: str) -> None:
        self.shown = os.path.abspath(path)  # as given: the directory, or an index file
        self.directory, self.index_path = _locate(path)
        self.path = self.index_path or os.path.join(self.directory, SINGLE)
        self.index: Index | None = None
        self.files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}  # tensor name -> shard file name
        try:
            if self.index_path is None:
                self._open(SINGLE)
            else:
                self.index = _read_index(self.index_path)
                for file in self.index.files:
                    self._open(file)
                self._agree(self.index)
        except BaseException:
            self.close()
            raise
        # The order of the bytes: shards by name (their numbers), each by data offset.
        for file in sorted(self.files):
            for e in sorted(self.files[file].entries, key=lambda e: e.start):
                self._where[e.name] = file

    def _open(self, file: str) -> SafetensorsFile:
        shown = os.path.join(self.directory, file)
        try:
            st = SafetensorsFile(os.path.realpath(shown))
        except CheckpointNotFoundError:
            if self.index_path is None:
                raise
            raise CorruptCheckpointError(
                f"{self.index_path} names the shard {file}, which is not in {self.directory} "
                "(an interrupted download or copy?)",
                path=self.index_path,
            ) from None
        self.files[file] = st
        return st

    def _agree(self, index: Index) -> None:
        """Every tensor of every shard where the index says, and the other way round."""
        shown = self.index_path
        for file, st in self.files.items():
            for e in st.entries:
                owner = index.weight_map.get(e.name)
                if owner != file:
                    said = "does not list it" if owner is None else f"puts it in {owner}"
                    raise CorruptCheckpointError(
                        f"{shown}: the shard {file} holds tensor {_shorten(e.name)}, but the "
                        f"index {said}",
                        path=shown,
                    )
        for name, file in index.weight_map.items():
            if name not in self.files[file]:
                raise CorruptCheckpointError(
                    f"{shown}: names tensor {_shorten(name)} in the shard {file}, which does not "
                    "hold it",
                    path=shown,
                )

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for st in self.files.values():
            st.close()

    def names(self) -> list[str]:
        """Every tensor name: the shards in the order of their names, each shard's tensors in
        the order of their bytes."""
        return list(self._where)

    def file_of(self, name: str) -> str:
        return self._where[name]

    def tensor(self, name: str) -> MappedTensor:
        return self.files[self._where[name]].tensor(name)

    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` of the first shard (``save_pretrained`` writes the same in all)."""
        return dict(self.files[min(self.files)].metadata) if self.files else {}

    def nbytes(self) -> int:
        total = 0
        for name, file in self._where.items():
            e = self.files[file].entry(name)
            total += e.end - e.start
        return total

    def describe(self) -> CheckpointInfo:
        tensors = []
        for name, file in self._where.items():
            e = self.files[file].entry(name)
            tensors.append(TensorInfo(name, e.dtype, e.shape, e.end - e.start, file, name))
        files = {file: st.size for file, st in self.files.items()}
        notes = [_NOTE]
        if self.index is not None and self.index_path is not None:
            files[os.path.basename(self.index_path)] = _size(self.index_path)
            total = self.index.total_size
            notes.append(
                f"index: {len(self._where)} tensors in {len(self.files)} shard(s)"
                + (f", total_size {total}" if total is not None else ", no total_size")
            )
        return CheckpointInfo(
            path=self.shown,
            format_version=None,
            writer="",
            created="",
            metadata=self.metadata,
            tensors=tuple(tensors),
            values={},
            files=files,
            format="huggingface",
            notes=tuple(notes),
        )


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


@contextlib.contextmanager
def open_repository(path: str) -> Iterator[Repository]:
    """The Hugging Face model directory (or index file) at ``path``, open (see
    :class:`Repository`)."""
    repo = Repository(path)
    try:
        yield repo
    finally:
        repo.close()


def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe the Hugging Face model directory at ``path`` from its index and shard headers
    (every structural rule checked, no tensor data read)."""
    with open_repository(os.fspath(path)) as repo:
        return repo.describe()


def verify(path: str | os.PathLike[str], *, progress: Progress | None = None) -> CheckpointInfo:
    """Check the Hugging Face model directory at ``path`` as far as the format allows (module
    docstring) and read every byte once; ``progress(done, total)`` in bytes. Raises a
    CheckpointError subclass on the first problem."""
    with open_repository(os.fspath(path)) as repo:
        info = repo.describe()
        total = repo.nbytes()
        index = repo.index
        if index is not None and index.total_size is not None and index.total_size != total:
            raise CorruptCheckpointError(
                f"{repo.index_path}: total_size is {index.total_size} but the tensors it lists "
                f"hold {total} bytes",
                path=repo.index_path,
            )
        tally = Tally(progress, total)
        try:
            for name in repo.names():
                tally.drain(repo.tensor(name))
        except OSError as exc:  # EIO under a mapping surfaces as SIGBUS, a read error as this
            if isinstance(exc, CheckpointError):
                raise
            raise CorruptCheckpointError(
                f"{repo.path} cannot be read: {exc}", path=repo.path
            ) from None
        return info
