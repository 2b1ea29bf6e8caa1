"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3), read as ``zero_to_fp32.py`` consolidates them:
the fp32 weights, streaming, without torch and without unpickling DeepSpeed's objects.

A checkpoint is the tag directory ``engine.save_checkpoint(save_dir, tag)`` writes
(``save_dir/global_step100/``), or ``save_dir`` itself, whose ``latest`` file names the tag:

- ``mp_rank_00_model_states.pt`` (ZeRO 1/2; ZeRO 3: ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  per rank): the module's state dict (ZeRO 3: empty placeholders), ``param_shapes`` (per
  parameter group, each parameter's name and shape in order), ``buffer_names``,
  ``shared_params``, ``frozen_param_shapes``/``frozen_param_fragments``, ``ds_version``...;
- ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank: its flat fp32
  partitions (``single_partition_of_fp32_groups``, ZeRO 3: ``fp32_flat_groups``), ``zero_stage``,
  ``partition_count``, ``param_alignment_paddings``, the base optimizer's state, a loss scaler.

Each is a ``torch.save`` archive, read by :mod:`savepoint.formats._torch_archive`: its zip
parsed, ``data.pkl`` unpickled through an allow-list (torch's tensor rebuilders, ``torch.Size``,
DeepSpeed's ``ZeroStageEnum`` as its number and ``fragment_address`` as a tuple); any other
class it names (DeepSpeed's ``LossScaler``, a client state's objects) becomes an inert
placeholder that is never imported, and listed in ``inspect``'s notes; where savepoint needs a
value and finds such an object, it refuses, naming it.

The tree is ``zero_to_fp32``'s state dict, in its order: buffers (floating ones as float32, as
``zero_to_fp32`` gives them), frozen parameters, the trainable parameters reconstructed from the
ranks' fp32 partitions (:mod:`savepoint.formats._deepspeed_layout`), and the shared
(tied) parameters as the same tensor under both names. Each parameter is a lazy tensor over runs
of the mapped partitions: nothing is concatenated or held in memory (``zero_to_fp32`` holds the
model twice for ZeRO 2). The first read of each storage record checks its CRC-32; ``verify``
checks every record of every file. The optimizer's moments, the loss scaler and the client
state are not part of the tree (``zero_to_fp32`` drops them too): ``inspect``'s notes say so.
Not read: tensor or pipeline parallel checkpoints (``mp_rank_01``...; DeepSpeed's
``ds_to_universal`` is for those), ZeRO stage 0.
"""

from __future__ import annotations

import bisect
import contextlib
import importlib.util
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from savepoint.codecs.dtypes import DType
from savepoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from savepoint.formats import _deepspeed_layout as layout
from savepoint.formats._files import LazyTensor, Materialized
from savepoint.formats._progress import Progress, Tally
from savepoint.formats._torch_archive import (
    TENSOR_GLOBALS,
    Archive,
    Buildable,
    Opaque,
    Record,
    TensorRef,
    crc32,
)
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.state import tree as tree_mod
from savepoint.storage import local
from savepoint.storage.paths import local_path

__all__ = [
    "DeepSpeedCheckpoint",
    "LABEL",
    "is_deepspeed",
    "open_checkpoint",
]

LABEL = "DeepSpeed ZeRO checkpoint"
LATEST = "latest"
_SCRIPT = "zero_to_fp32.py"
_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_PICKLE_CAP = 256 << 20


def is_deepspeed(entries: Iterable[str]) -> bool:
    """Whether a directory holding ``entries`` is a DeepSpeed checkpoint: a tag directory (a
    ``*_model_states.pt`` file), or the save directory (``latest`` and ``zero_to_fp32.py``)."""
    names = set(entries)
    return any(_MODEL.fullmatch(n) for n in names) or {LATEST, _SCRIPT} <= names


def _number(value: Any = 0, *rest: Any) -> Any:
    return value  # ZeroStageEnum(2): the number


def _parameter(data: Any, *rest: Any) -> Any:
    return data  # torch._utils._rebuild_parameter(data, requires_grad, hooks): the tensor


class _Fragment(tuple, Buildable):  # type: ignore[type-arg]
    """DeepSpeed's ``fragment_address`` namedtuple (``numel``, ``start``), as a plain tuple."""

    __slots__ = ()

    def __new__(cls, *args: Any) -> _Fragment:
        return tuple.__new__(cls, args)

    def __setstate__(self, state: Any) -> None:
        pass


_GLOBALS: dict[tuple[str, str], Any] = {
    **TENSOR_GLOBALS,
    ("torch", "Size"): lambda value=(): tuple(value),
    ("torch", "device"): lambda *args: ":".join(map(str, args)),
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _number,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _Fragment,
}


class _Bad(Exception):
    """What is wrong with a file's contents, worded for the message."""


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise _Bad(why)


def _mapping(value: Any, what: str) -> Mapping[Any, Any]:
    if isinstance(value, Opaque):
        raise _Bad(f"{what} is a {value.global_name}, which savepoint does not read")
    _need(isinstance(value, Mapping), f"{what} is not a mapping")
    found: Mapping[Any, Any] = value
    return found


def _list(value: Any, what: str) -> list[Any]:
    if isinstance(value, Opaque):
        raise _Bad(f"{what} is a {value.global_name}, which savepoint does not read")
    _need(isinstance(value, list), f"{what} is not a list")
    return list(value)


def _count(value: Any, what: str) -> int:
    _need(
        isinstance(value, int) and not isinstance(value, bool) and value >= 0, f"{what}: {value!r}"
    )
    return int(value)


def _shape(value: Any, what: str) -> tuple[int, ...]:
    _need(isinstance(value, (tuple, list)) and len(value) <= 64, f"{what} is not a shape")
    dims = tuple(_count(v, what) for v in value)
    _need(math.prod(dims) < 1 << 60, f"{what} is {list(dims)}: more elements than any file holds")
    return dims


class _PtFile:
    """One ``torch.save`` file of the checkpoint: mapped, its ``data.pkl`` read through the
    allow-list, each storage record CRC-checked once before its bytes are used."""

    def __init__(self, directory: str, name: str) -> None:
        self.where = os.path.join(directory, name)
        try:
            fd = local.open_read(self.where)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where} is missing", path=directory) from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise CorruptCheckpointError(f"{self.where} is empty", path=directory)
            self.map = local.MappedFile(fd, size)
        finally:
            os.close(fd)
        self.archive = Archive(self.map.array, 0, size, path=directory, what=self.where)
        self.opaque: set[str] = set()
        self.obj = self.archive.load(_GLOBALS, cap=_PICKLE_CAP, opaque=True, seen=self.opaque)
        self._checked: set[str] = set()

    def bytes_of(self, ref: Any, what: str) -> tuple[np.ndarray[Any, Any], Callable[[], None]]:
        """The bytes of the contiguous tensor ``ref`` (a view of the mapping) and the check of
        its storage record's CRC-32, run once, before its first use."""
        _need(isinstance(ref, TensorRef), f"{what} is not a tensor")
        assert isinstance(ref, TensorRef)
        if not ref.contiguous:
            raise IncompatibleCheckpointError(
                f"{self.where}: {what} is a strided view; savepoint reads contiguous tensors here",
                path=self.where,
            )
        record = self.archive.storage(ref)
        size = ref.dtype.itemsize
        start = record.start + ref.offset * size
        view = self.archive.buf[start : start + math.prod(ref.shape) * size]
        return view, lambda: self.check(record)

    def check(self, record: Record) -> None:
        if record.name not in self._checked:
            if not crc32(self.archive.buf, record, lambda n: None):
                raise CorruptCheckpointError(
                    f"{self.where}: CRC-32 mismatch in record {record.name!r}", path=self.where
                )
            self._checked.add(record.name)

    def check_all(self, tally: Tally) -> None:
        for record in self.archive.records.values():
            if record.name not in self._checked:
                if not crc32(self.archive.buf, record, tally.add):
                    raise CorruptCheckpointError(
                        f"{self.where}: CRC-32 mismatch in record {record.name!r}",
                        path=self.where,
                    )
                self._checked.add(record.name)
            else:
                tally.add(record.size)

    def close(self) -> None:
        self.map.close()


class _Runs(LazyTensor):
    """A tensor whose bytes, in C order, are consecutive pieces of mapped files."""

    def __init__(
        self,
        dtype: DType,
        shape: tuple[int, ...],
        pieces: list[tuple[np.ndarray[Any, Any], Callable[[], None]]],
        kind: str,
    ) -> None:
        super().__init__(dtype, shape, kind=kind)
        self._pieces = pieces
        self._ends = np.cumsum([len(v) for v, _ in pieces]).tolist()
        if (self._ends[-1] if self._ends else 0) != self.nbytes:
            raise _Bad(f"a tensor of {self.nbytes} bytes assembled from {self._ends[-1:]} bytes")

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        index = bisect.bisect_right(self._ends, start)
        done = 0
        while done < len(dst):
            view, check = self._pieces[index]
            check()
            at = start + done - (self._ends[index] - len(view))
            n = min(len(view) - at, len(dst) - done)
            np.copyto(dst[done : done + n], view[at : at + n])
            done += n
            index += 1


class _AsFloat32(Materialized):
    """A floating buffer stored narrower, as float32 (what ``zero_to_fp32`` gives): exact."""

    def __init__(self, inner: LazyTensor, f32: DType) -> None:
        super().__init__(f32, inner.shape, kind=inner.kind)
        self._inner = inner

    def make(self) -> np.ndarray[Any, Any]:
        out: np.ndarray[Any, Any] = self._inner.load().astype(np.float32).reshape(-1)
        return out.view(np.uint8)


def _tag_directory(path: str) -> tuple[str, str]:
    """(the tag directory, its tag) of ``path``: itself, or what its ``latest`` names."""
    names = os.listdir(path)
    if any(_MODEL.fullmatch(n) for n in names):
        return path, os.path.basename(path.rstrip("/"))
    try:
        tag = local.read_small(os.path.join(path, LATEST), cap=4096).decode("utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        raise CheckpointNotFoundError(
            f"{path} holds no *_model_states.pt and no readable {LATEST} file", path=path
        ) from None
    if not tag or tag in (".", "..") or any(c in tag for c in "/\\\0"):
        raise CorruptCheckpointError(f"{path}/{LATEST} names {tag!r}, not a tag", path=path)
    found = os.path.join(path, tag)
    if not os.path.isdir(found):
        raise CheckpointNotFoundError(f"{path}/{LATEST} names {tag}, which is not there", path=path)
    return found, tag


class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint opened for reading (see the module docstring): every file
    the reconstruction needs parsed and checked, its tensors lazy. Close it (or use
    :func:`open_checkpoint`) when done."""

    def __init__(self, path: str) -> None:
        self.path, self.tag = _tag_directory(path)
        self._files: dict[str, _PtFile] = {}
        self.tensors: dict[str, LazyTensor] = {}
        self.tied: dict[str, str] = {}
        self.kind = "torch" if importlib.util.find_spec("torch") is not None else "numpy"
        try:
            self._read()
        except (_Bad, layout.LayoutError) as exc:
            self.close()
            raise CorruptCheckpointError(f"{self.path}: {exc}", path=self.path) from None
        except BaseException:
            self.close()
            raise

    def _file(self, name: str) -> _PtFile:
        if name not in self._files:
            self._files[name] = _PtFile(self.path, name)
        return self._files[name]

    def _ranked(self, pattern: re.Pattern[str]) -> dict[int | None, str]:
        found: dict[int | None, str] = {}
        for name in sorted(os.listdir(self.path)):
            m = pattern.fullmatch(name)
            if m is None:
                continue
            if int(m.group(2)) != 0:
                raise IncompatibleCheckpointError(
                    f"{self.path} is a tensor or pipeline parallel checkpoint ({name}); savepoint "
                    "reads data parallel ZeRO checkpoints (mp_rank_00); DeepSpeed's "
                    "ds_to_universal.py consolidates the others",
                    path=self.path,
                )
            rank = None if m.group(1) is None else int(m.group(1))
            _need(rank not in found, f"two files for rank {rank}: {found.get(rank)} and {name}")
            found[rank] = name
        return found

    def _read(self) -> None:
        self._ranked(_MODEL)  # refuses mp_rank_01 and repeated ranks
        optim = self._ranked(_OPTIM)
        if not optim:
            raise IncompatibleCheckpointError(
                f"{self.path} holds no *_optim_states.pt: the fp32 weights are in the optimizer "
                "files (savepoint reads them as zero_to_fp32 does)",
                path=self.path,
            )
        world = len(optim)
        _need(set(optim) == set(range(world)), "the optimizer files' ranks are not 0..n-1")
        states = [self._optimizer_state(optim[r]) for r in range(world)]
        self.stage = _count(states[0].get("zero_stage"), "zero_stage")
        if self.stage not in (1, 2, 3):
            raise IncompatibleCheckpointError(
                f"{self.path}: ZeRO stage {self.stage}; savepoint reads stages 1, 2 and 3",
                path=self.path,
            )
        count = states[0].get("partition_count")
        count = max(count) if isinstance(count, list) and count else count
        _need(count == world, f"partition_count {count!r}, but {world} optimizer files")
        self.world = world
        key = "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups"
        flats: list[list[tuple[np.ndarray[Any, Any], Callable[[], None], DType]]] = []
        for r in range(world):
            groups = _list(states[r].get(key), f"rank {r}'s {key}")
            flats.append([self._flat(optim[r], ref, f"{key}[{g}]") for g, ref in enumerate(groups)])
        model = "mp_rank_00_model_states.pt"
        if self.stage == 3:
            model = "zero_pp_rank_0_mp_rank_00_model_states.pt"
        states0 = _mapping(self._file(model).obj, model)
        self.version = str(states0.get("ds_version", ""))
        steps = states0.get("global_steps")
        self.global_steps = steps if isinstance(steps, int) else None
        self._buffers(model, states0)
        self._frozen(model, states0)
        self._trainable(states0, flats, states[0].get("param_alignment_paddings"))
        shared = states0.get("shared_params") or {}
        for name, target in _mapping(shared, "shared_params").items():
            if target in self.tensors:
                self.tensors[str(name)] = self.tensors[target]
                self.tied[str(name)] = str(target)

    def _optimizer_state(self, name: str) -> Mapping[Any, Any]:
        found = _mapping(self._file(name).obj, name).get("optimizer_state_dict")
        return _mapping(found, f"{name}: optimizer_state_dict")

    def _flat(
        self, file: str, ref: Any, what: str
    ) -> tuple[np.ndarray[Any, Any], Callable[[], None], DType]:
        view, check = self._file(file).bytes_of(ref, what)
        _need(len(ref.shape) == 1, f"{file}: {what} is not a flat tensor")
        return view, check, ref.dtype

    def _buffers(self, model: str, states0: Mapping[Any, Any]) -> None:
        module = _mapping(states0.get("module"), "module")
        names = _list(states0.get("buffer_names") or [], "buffer_names")
        from savepoint.codecs import dtypes

        f32 = dtypes.from_name("F32")
        for name, ref in module.items():
            if name not in names:
                continue
            view, check = self._file(model).bytes_of(ref, f"module/{name}")
            t: LazyTensor = _Runs(ref.dtype, ref.shape, [(view, check)], self.kind)
            if ref.dtype.kind == "f" and ref.dtype.name != "F32":
                t = _AsFloat32(t, f32)
            self.tensors[str(name)] = t

    def _frozen(self, model: str, states0: Mapping[Any, Any]) -> None:
        shapes = states0.get("frozen_param_shapes") or {}
        for name, raw in _mapping(shapes, "frozen_param_shapes").items():
            shape = _shape(raw, f"frozen_param_shapes/{name}")
            files = [model]
            if self.stage == 3:
                files = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(self.world)]
            pieces = []
            dtype: DType | None = None
            for f in files:
                fragments = _mapping(self._file(f).obj, f).get("frozen_param_fragments") or {}
                ref = _mapping(fragments, f"{f}: frozen_param_fragments").get(name)
                view, check = self._file(f).bytes_of(ref, f"frozen_param_fragments/{name}")
                pieces.append((view, check))
                assert isinstance(ref, TensorRef)
                dtype = ref.dtype
            assert dtype is not None
            self.tensors[str(name)] = _Runs(
                dtype, shape, _cut(pieces, math.prod(shape) * dtype.itemsize), self.kind
            )

    def _trainable(self, states0: Mapping[Any, Any], flats: list[list[Any]], paddings: Any) -> None:
        raw = _list(states0.get("param_shapes"), "param_shapes")
        named = [
            [
                (str(n), _shape(s, f"param_shapes/{n}"))
                for n, s in _mapping(g, "param_shapes").items()
            ]
            for g in raw
        ]
        dtypes_ = {d.name for rank in flats for _, _, d in rank}
        _need(len(dtypes_) <= 1, f"flat partitions of several dtypes: {sorted(dtypes_)}")
        sources = [piece for rank in flats for piece in rank]
        lengths = [[len(v) // d.itemsize for v, _, d in rank] for rank in flats]
        if self.stage <= 2:
            if paddings is not None:
                _need(
                    isinstance(paddings, list)
                    and all(
                        isinstance(p, list) and all(isinstance(x, int) for x in p) for p in paddings
                    ),
                    "param_alignment_paddings is not a list of lists of integers",
                )
            slots = layout.zero2(named, lengths, paddings)
        else:
            slots = layout.zero3([s for group in named for s in group], lengths)
        for slot in slots:
            dtype = sources[slot.runs[0][0]][2] if slot.runs else sources[0][2]
            size = dtype.itemsize
            pieces = [
                (sources[i][0][a * size : (a + n) * size], sources[i][1]) for i, a, n in slot.runs
            ]
            self.tensors[slot.name] = _Runs(dtype, slot.shape, pieces, self.kind)

    @property
    def label(self) -> str:
        return f"deepspeed zero-{self.stage}"

    def tree(self) -> dict[str, LazyTensor]:
        """``zero_to_fp32``'s state dict (see the module docstring)."""
        return dict(self.tensors)

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def metadata(self) -> dict[str, Any]:
        return {
            "deepspeed": {
                "zero_stage": self.stage,
                "world_size": self.world,
                "version": self.version,
                "tag": self.tag,
                "global_steps": self.global_steps,
            }
        }

    def files(self) -> list[str]:
        """Every ``torch.save`` file of the tag directory."""
        return [
            n for n in sorted(os.listdir(self.path)) if _MODEL.fullmatch(n) or _OPTIM.fullmatch(n)
        ]

    def describe(self) -> CheckpointInfo:
        first: dict[int, str] = {}
        tensors = []
        for name, t in self.tensors.items():
            owner = first.setdefault(id(t), name)
            tied = self.tied.get(name) if owner != name else None
            tensors.append(
                TensorInfo.make(
                    tree_mod.join((name,)),
                    t.dtype.name,
                    t.shape,
                    t.nbytes,
                    f"{self.world} ranks",
                    owner,
                    tied,
                )
            )
        opaque = sorted({n for f in self._files.values() for n in f.opaque})
        notes = [
            f"DeepSpeed ZeRO stage {self.stage} on {self.world} rank(s), read as zero_to_fp32 "
            "consolidates it: the fp32 weights and the buffers; the optimizer's moments, the loss "
            "scaler and any client state are not part of the tree",
            "read without torch: each file's pickle through an allow-list; verify checks every "
            "record's CRC-32 (a load checks each record it uses first)",
        ]
        if opaque:
            notes.append(
                "objects of classes outside the allow-list, never imported: " + ", ".join(opaque)
            )
        sizes = {n: os.path.getsize(os.path.join(self.path, n)) for n in self.files()}
        return CheckpointInfo(
            path=self.path,
            format_version=None,
            writer=f"deepspeed {self.version}".strip(),
            created="",
            metadata=self.metadata(),
            tensors=tuple(tensors),
            values={},
            files=sizes,
            format="deepspeed",
            notes=tuple(notes),
        )

    def check(self, progress: Progress | None) -> None:
        """Every file of the tag directory parsed, every record's CRC-32 checked."""
        for name in self.files():
            self._file(name)
        tally = Tally(
            progress,
            sum(r.size for f in self._files.values() for r in f.archive.records.values()),
        )
        for f in self._files.values():
            f.check_all(tally)


def _cut(
    pieces: list[tuple[np.ndarray[Any, Any], Callable[[], None]]], nbytes: int
) -> list[tuple[np.ndarray[Any, Any], Callable[[], None]]]:
    """The first ``nbytes`` of the concatenation of ``pieces``."""
    out = []
    for view, check in pieces:
        if nbytes <= 0:
            break
        out.append((view[:nbytes], check))
        nbytes -= min(len(view), nbytes)
    return out


def _open(path: str | os.PathLike[str]) -> DeepSpeedCheckpoint:
    return DeepSpeedCheckpoint(os.path.abspath(local_path(path, what="DeepSpeed checkpoint")))


@contextlib.contextmanager
def open_checkpoint(path: str | os.PathLike[str]) -> Iterator[DeepSpeedCheckpoint]:
    """The DeepSpeed checkpoint at ``path`` (a tag directory or its save directory) for the
    length of a ``with`` block."""
    ck = _open(path)
    try:
        yield ck
    finally:
        ck.close()
