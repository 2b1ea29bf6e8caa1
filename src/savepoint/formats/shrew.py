"""``.shrew`` files, the seed framework's binary checkpoints, read and written as the seed lays them out.

Layout. Integers are unsigned little-endian; ``str`` is a ``u32`` byte length then that many
bytes of UTF-8; ``f64`` is an IEEE 754 double, little-endian::

    v1 (named tensors)
      magic     4 bytes     b"SHRW"
      version   u32         1
      count     u32         number of tensors
      count x tensor

    tensor
      key       str         e.g. "graph/param"
      dtype     u8          0 F32, 1 F64, 2 U8, 3 U32, 4 I64, 5 F16, 6 BF16
      ndim      u32
      dims      ndim x u32  C order; ndim 0 is a scalar (one element)
      data_len  u64         bytes of data: product(dims) x itemsize
      data      data_len bytes, the values in C order, little-endian

    v2 (training checkpoint)
      magic     4 bytes     b"SHRW"
      version   u32         2
      sections, each a u8 tag and a body, until the end tag:
        0x01 model       count u32; count x tensor
        0x02 optimizer   type str; n_scalars u32; n_scalars x (key str, value f64);
                         n_buffers u32; n_buffers x (key str, len u64, len x f64)
        0x03 metadata    epoch u64; global_step u64; best_loss f64; n u32; n x f64 (loss history)
        0xFF end of file

The seed's functions have their namesakes here: ``write_checkpoint`` / ``read_checkpoint`` and
``write_training_checkpoint`` / ``read_training_checkpoint`` (binary streams), ``save_tensors`` /
``load_tensors``, ``save`` / ``load`` (a model: ``load`` updates only the parameters the file and
the model share and returns their count), ``save_training`` / ``load_training``, ``to_bytes`` /
``from_bytes``, ``training_to_bytes`` / ``training_from_bytes``, and ``TrainingCheckpoint`` with
its defaults and builders (``with_optimizer_state``, ``with_epoch``, ``with_global_step``,
``with_best_loss``, ``with_loss_history``: each returns a copy). Errors carry the seed's texts
("Invalid checkpoint: expected magic [83, 72, 82, 87], got [...]", "Unsupported checkpoint
version: 3 ...", "Unsupported training checkpoint version: 1 (expected 2)") inside savepoint's
messages.

What this module writes:
- tensor data is the raw little-endian bytes of the stored dtype. (The seed goes through f64 on
  both sides, which is exact for every dtype but I64 beyond 2**53; savepoint never converts.)
- v2 sections in the seed's order: model, optimizer (only when there is an optimizer state),
  metadata, end. The seed writes optimizer scalars and buffers in HashMap order, which is
  arbitrary; savepoint writes each list sorted by key (code point order), so equal states give
  equal bytes. Model tensors keep the caller's order.
- dtypes the format has no tag for (bool, int8, int32, float8, complex...) raise
  UnsupportedStateError naming the key and the dtype: nothing is cast silently. So do keys that
  are not valid UTF-8, repeated keys, and sizes beyond the u32 / u64 fields.

What the reader enforces, where the seed's reader is looser (every rule raises
CorruptCheckpointError, or IncompatibleCheckpointError for a valid file savepoint cannot hold):
- the magic; versions 1 and 2 only (others: IncompatibleCheckpointError);
- every length (key, dims, data, buffer, loss history) is checked against what is left of the
  input before anything is allocated or read, so a hostile length fails fast and small;
- ``data_len`` must equal product(dims) x itemsize (Python integers: no overflow); at most 64
  dims (numpy's limit: IncompatibleCheckpointError);
- unknown dtype tags and unknown section tags are errors; a section may appear at most once;
  the model and metadata sections and the end tag are required (the seed always writes them);
  sections are accepted in any order, optimizer scalars and buffers too;
- a key repeated within the model section, the scalars or the buffers is an error;
- keys must be valid UTF-8; nothing may follow the last tensor (v1) or the end tag (v2);
- more than 64 dims, or a zero-element shape whose dims numpy cannot describe
  (2**32 x 2**32 x 0), is IncompatibleCheckpointError;
- what a file's structure may cost is bounded: every tensor, buffer and scalar record is charged
  what it and its later forms (keys, arrays, inspect entries) cost, and a file whose records
  would need more than 16 x its size + 16 MiB is a CorruptCheckpointError (only files of hundreds
  of thousands of near-empty records with one-letter keys come near it). Peak traced memory for
  any reader here <= 16 x the file's size + 16 MiB + the data itself.

A path is opened without ever blocking (``O_NONBLOCK``, then ``fstat``): a FIFO, socket, device or
directory is refused with a CheckpointError instead of hanging; symlinks to regular files are
followed.

Reading gives numpy arrays of the stored dtype (bfloat16 from ``ml_dtypes``) or, with
``framework="torch"``, torch tensors. Paths are written atomically (temporary sibling, fsync,
rename, fsync of the directory); streams are written from their current position.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal

import numpy as np

from savepoint.codecs.shrew import (
    DTYPE_TAGS,
    MAGIC,
    TAG_OF,
    VERSION_TENSORS,
    VERSION_TRAINING,
    Input,
    Parsed,
    Record,
    check_source,
    parse,
    read_header,
)
from savepoint.errors import (
    IncompatibleCheckpointError,
    StateMismatchError,
)
from savepoint.formats import _files
from savepoint.formats._files import FileRangeTensor, LazyTensor, open_file
from savepoint.formats._progress import Progress, Tally
from savepoint.formats._shrew_write import (
    OptimizerSection,
    Tensors,
    as_source,
    pairs,
    write_tensors,
    write_training,
)
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.state import arrays
from savepoint.state.optimizer import OptimizerState
from savepoint.storage.paths import local_path

__all__ = [
    "DTYPE_TAGS",
    "Framework",
    "MAGIC",
    "OptimizerSection",
    "PathOrStream",
    "ShrewFile",
    "TAG_OF",
    "TrainingCheckpoint",
    "check_source",
    "from_bytes",
    "inspect",
    "load",
    "load_params",
    "load_tensors",
    "load_training",
    "read_checkpoint",
    "read_training_checkpoint",
    "read_version",
    "save",
    "save_parts",
    "save_tensors",
    "save_training",
    "to_bytes",
    "training_from_bytes",
    "training_to_bytes",
    "verify",
    "write_checkpoint",
    "write_tensors",
    "write_training",
    "write_training_checkpoint",
]

Framework = Literal["numpy", "torch"]
PathOrStream = str | os.PathLike[str] | BinaryIO


# ---------------------------------------------------------------------------------------------
# the training checkpoint
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainingCheckpoint:
    """A v2 file's content, with the seed's fields and defaults.

    ``model_params`` maps names to arrays or tensors (a sequence of ``(name, tensor)`` pairs is
    accepted too when writing); loading gives an insertion-ordered dict. ``optimizer_state`` is an
    :class:`~savepoint.OptimizerState` or None (then the file has no optimizer section).
    ``epoch`` and ``global_step`` are integers in ``[0, 2**64)``.
    """

    model_params: Mapping[str, Any] = field(default_factory=dict)
    optimizer_state: OptimizerState | None = None
    epoch: int = 0
    global_step: int = 0
    best_loss: float = math.inf
    loss_history: list[float] = field(default_factory=list)

    @classmethod
    def from_torch(
        cls,
        model: Any,
        optimizer: Any = None,
        *,
        epoch: int = 0,
        global_step: int = 0,
        best_loss: float = math.inf,
        loss_history: Sequence[float] = (),
    ) -> TrainingCheckpoint:
        """A checkpoint of a torch module's ``state_dict()`` (shared, not copied: the writer
        copies) and, when given, ``optimizer_state_from_torch(optimizer)``."""
        from savepoint.state.optimizer import optimizer_state_from_torch

        return cls(
            model_params=dict(model.state_dict()),
            optimizer_state=None if optimizer is None else optimizer_state_from_torch(optimizer),
            epoch=epoch,
            global_step=global_step,
            best_loss=best_loss,
            loss_history=list(loss_history),
        )

    # The seed's builders: each returns a copy with one field set (this one is unchanged).

    def with_optimizer_state(self, state: OptimizerState) -> TrainingCheckpoint:
        return dataclasses.replace(self, optimizer_state=state)

    def with_epoch(self, epoch: int) -> TrainingCheckpoint:
        return dataclasses.replace(self, epoch=epoch)

    def with_global_step(self, step: int) -> TrainingCheckpoint:
        return dataclasses.replace(self, global_step=step)

    def with_best_loss(self, loss: float) -> TrainingCheckpoint:
        return dataclasses.replace(self, best_loss=loss)

    def with_loss_history(self, history: Iterable[float]) -> TrainingCheckpoint:
        return dataclasses.replace(self, loss_history=list(history))

    def restore(self, model: Any, optimizer: Any = None) -> int:
        """Copy the parameters present here into ``model`` (see :func:`load_params`) and, when
        ``optimizer`` is given, this optimizer state into it (``optimizer_state_to_torch``).
        Returns the number of parameters loaded."""
        if optimizer is not None and self.optimizer_state is None:
            raise IncompatibleCheckpointError(
                "this training checkpoint has no optimizer state to restore; restore the model "
                "alone (optimizer=None)"
            )
        count = load_params(model, dict(pairs(self.model_params)))
        if optimizer is not None:
            from savepoint.state.optimizer import optimizer_state_to_torch

            assert self.optimizer_state is not None
            optimizer_state_to_torch(self.optimizer_state, optimizer)
        return count


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


@contextmanager
def _input(source: PathOrStream | bytes | bytearray | memoryview) -> Iterator[Input]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        yield Input(io.BytesIO(bytes(source)), "<bytes>")
        return
    if isinstance(source, (str, os.PathLike)):
        path = local_path(source, what="shrew file")
        with open_file(path) as f:
            yield Input(f, path)
        return
    if not callable(getattr(source, "read", None)):
        raise TypeError(f"expected a path, bytes or a binary stream, got {type(source).__name__}")
    yield Input(source, str(getattr(source, "name", "<stream>")))


def read_version(source: PathOrStream | bytes) -> int:
    """The version in a .shrew header (1 or 2), reading only the first 8 bytes."""
    with _input(source) as inp:
        return read_header(inp)


def _wrong_version(inp: Input, found: int, wanted: int) -> IncompatibleCheckpointError:
    hint = (
        "read it with load_training (or load(path, model) for its parameters)"
        if found == VERSION_TRAINING
        else "read it with load_tensors"
    )
    seed = "training checkpoint" if wanted == VERSION_TRAINING else "checkpoint"
    return IncompatibleCheckpointError(
        f"Unsupported {seed} version: {found} (expected {wanted}): {inp.name} is a .shrew "
        f"v{found} file, not v{wanted}; {hint}",
        path=inp.name,
    )


def _read(source: PathOrStream | bytes, version: int | None) -> Parsed:
    with _input(source) as inp:
        parsed = parse(inp, eager=True)
        if version is not None and parsed.version != version:
            raise _wrong_version(inp, parsed.version, version)
        return parsed


def _tensor_dict(records: dict[str, Record], framework: str) -> dict[str, Any]:
    return {k: _files.to_framework(r.array(), r.dtype, framework) for k, r in records.items()}


def load_tensors(source: PathOrStream, *, framework: Framework = "numpy") -> dict[str, Any]:
    """Named tensors of a v1 file (path or binary stream), in file order."""
    return _tensor_dict(_read(source, VERSION_TENSORS).tensors, framework)


def from_bytes(
    data: bytes | bytearray | memoryview, *, framework: Framework = "numpy"
) -> dict[str, Any]:
    """``load_tensors`` for a v1 file image in memory."""
    return _tensor_dict(_read(bytes(data), VERSION_TENSORS).tensors, framework)


def _training(parsed: Parsed, framework: str, name: str) -> TrainingCheckpoint:
    state = None
    if parsed.optimizer is not None:
        kind, scalars, buffers = parsed.optimizer
        if not kind or "" in scalars or "" in buffers:
            raise IncompatibleCheckpointError(
                f"{name}: the optimizer section has an empty "
                f"{'type name' if not kind else 'key'}; sp.OptimizerState needs non-empty names",
                path=name,
            )
        state = OptimizerState(kind)
        state.scalars = scalars
        state.buffers = {k: b.array() for k, b in buffers.items()}
    return TrainingCheckpoint(
        model_params=_tensor_dict(parsed.tensors, framework),
        optimizer_state=state,
        epoch=parsed.epoch,
        global_step=parsed.global_step,
        best_loss=parsed.best_loss,
        loss_history=parsed.loss_history,
    )


def load_training(source: PathOrStream, *, framework: Framework = "numpy") -> TrainingCheckpoint:
    """The training checkpoint in a v2 file (path or binary stream)."""
    return _load_training(source, framework)


def _load_training(source: PathOrStream | bytes, framework: str) -> TrainingCheckpoint:
    with _input(source) as inp:
        parsed = parse(inp, eager=True)
        if parsed.version != VERSION_TRAINING:
            raise _wrong_version(inp, parsed.version, VERSION_TRAINING)
        return _training(parsed, framework, inp.name)


def training_from_bytes(
    data: bytes | bytearray | memoryview, *, framework: Framework = "numpy"
) -> TrainingCheckpoint:
    """``load_training`` for a v2 file image in memory."""
    return _load_training(bytes(data), framework)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def _write(target: PathOrStream, write: Any) -> None:
    if isinstance(target, (str, os.PathLike)):
        path = local_path(target, what="shrew file")
        with _files.atomic_file(path) as tmp, open(tmp, "xb") as f:
            write(f)
            _files.fsync_file(f)
    elif callable(getattr(target, "write", None)):
        write(target)
    else:
        raise TypeError(f"expected a path or a binary stream, got {type(target).__name__}")


def save_tensors(target: PathOrStream, tensors: Tensors) -> None:
    """Write named tensors (a mapping, or a sequence of ``(name, tensor)`` pairs) as a v1 file."""
    _write(target, lambda f: write_tensors(f, tensors))


def to_bytes(tensors: Tensors) -> bytes:
    buf = io.BytesIO()
    write_tensors(buf, tensors)
    return buf.getvalue()


def _write_checkpoint(stream: BinaryIO, ckpt: TrainingCheckpoint) -> None:
    if not isinstance(ckpt, TrainingCheckpoint):
        raise TypeError(f"expected a TrainingCheckpoint, got {type(ckpt).__name__}")
    write_training(
        stream,
        ckpt.model_params,
        None if ckpt.optimizer_state is None else OptimizerSection.of(ckpt.optimizer_state),
        epoch=ckpt.epoch,
        global_step=ckpt.global_step,
        best_loss=ckpt.best_loss,
        loss_history=ckpt.loss_history,
    )


def write_checkpoint(writer: BinaryIO, tensors: Tensors) -> None:
    """The seed's ``write_checkpoint``: named tensors as a v1 file, written to a binary stream
    from its position (:func:`save_tensors` writes a path atomically)."""
    write_tensors(writer, tensors)


def read_checkpoint(reader: BinaryIO, *, framework: Framework = "numpy") -> dict[str, Any]:
    """The seed's ``read_checkpoint``: the named tensors of the v1 file a binary stream holds."""
    return load_tensors(reader, framework=framework)


def write_training_checkpoint(writer: BinaryIO, ckpt: TrainingCheckpoint) -> None:
    """The seed's ``write_training_checkpoint``: ``ckpt`` as a v2 file, written to a binary
    stream from its position (:func:`save_training` writes a path atomically)."""
    _write_checkpoint(writer, ckpt)


def read_training_checkpoint(
    reader: BinaryIO, *, framework: Framework = "numpy"
) -> TrainingCheckpoint:
    """The seed's ``read_training_checkpoint``: the v2 file a binary stream holds."""
    return _load_training(reader, framework)


def save_training(target: PathOrStream, ckpt: TrainingCheckpoint) -> None:
    """Write a training checkpoint as a v2 file (path: atomically; stream: from its position)."""
    _write(target, lambda f: _write_checkpoint(f, ckpt))


def save_parts(
    target: PathOrStream,
    model: Tensors,
    optimizer: OptimizerSection | None,
    *,
    epoch: int = 0,
    global_step: int = 0,
    best_loss: float = math.inf,
    loss_history: Iterable[float] = (),
) -> None:
    """``save_training`` from parts: tensors may be lazy and the optimizer a prepared section
    (used by conversion, which streams every tensor and buffer)."""
    _write(
        target,
        lambda f: write_training(
            f,
            model,
            optimizer,
            epoch=epoch,
            global_step=global_step,
            best_loss=best_loss,
            loss_history=loss_history,
        ),
    )


def training_to_bytes(ckpt: TrainingCheckpoint) -> bytes:
    buf = io.BytesIO()
    _write_checkpoint(buf, ckpt)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------


def save(target: PathOrStream, model: Any) -> None:
    """Save a model's parameters as a v1 file: a torch module's ``state_dict()`` or a mapping."""
    params = model.state_dict() if callable(getattr(model, "state_dict", None)) else model
    save_tensors(target, params)


def load_params(model: Any, params: Mapping[str, Any]) -> int:
    """Copy each of ``params`` into the same-named entry of ``model`` (a torch module's
    ``state_dict()`` entries, or a mapping of arrays/tensors), in place. Entries the model lacks are
    skipped, as the seed does; the model's entries missing from ``params`` keep their values.

    Every name present on both sides must agree in shape and dtype; all disagreements are reported
    in one StateMismatchError before anything is modified. Returns the number of entries loaded.
    """
    targets = model.state_dict() if callable(getattr(model, "state_dict", None)) else model
    if not isinstance(targets, Mapping):
        raise TypeError(f"cannot load into a {type(model).__name__}: not a module or a mapping")
    problems: list[tuple[str, str]] = []
    pairs: list[tuple[str, Any, Any]] = []
    for name, value in params.items():
        if name not in targets:
            continue
        source = as_source(value, name)
        found = arrays.describe(targets[name])
        want = (source.dtype.name, source.shape)
        if found is None:
            problems.append((name, f"the target is a {type(targets[name]).__name__}, not a tensor"))
        elif found != want:
            problems.append(
                (name, f"{want[0]} {list(want[1])} in the file, {found[0]} {list(found[1])} here")
            )
        else:
            pairs.append((name, targets[name], value))
    if problems:
        raise StateMismatchError(problems)
    for name, target, value in pairs:
        if isinstance(target, np.ndarray):
            if not target.flags.writeable:
                raise IncompatibleCheckpointError(f"cannot load {name!r} into a read-only array")
            np.copyto(target, _host(value, name), casting="no")
        else:
            import torch

            from savepoint.state import torch_tensors

            if arrays.is_torch_tensor(value):
                with torch.no_grad():
                    target.copy_(value)
            else:
                torch_tensors.copy_into(target, _host(value, name), as_source(value, name).dtype)
    return len(pairs)


def _host(value: Any, key: str) -> np.ndarray[Any, Any]:
    """``value`` as a host numpy array of its own dtype (arrays as they are, others copied)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, LazyTensor):
        return value.load()
    source = as_source(value, key)
    out = np.empty(source.nbytes, dtype=np.uint8)
    try:
        for pos in range(0, source.nbytes, _files.CHUNK):
            source.copy_to(out[pos : pos + _files.CHUNK], pos)
    finally:
        source.release()
    return out.view(source.dtype.numpy).reshape(source.shape)


def load(source: PathOrStream, model: Any) -> int:
    """Load the parameters of a .shrew file (v1, or a v2 file's model section) into ``model``
    (see :func:`load_params`); returns how many were loaded."""
    parsed = _read(source, None)
    return load_params(model, {k: r.array() for k, r in parsed.tensors.items()})


# ---------------------------------------------------------------------------------------------
# streaming access (conversion, inspect, verify)
# ---------------------------------------------------------------------------------------------


class ShrewFile:
    """A .shrew file opened without reading its data: the whole structure is checked on open,
    tensors and optimizer buffers are :class:`FileRangeTensor` objects read on demand.

    ``tensors`` (the model section for v2) and the optimizer's ``buffers`` are in file order,
    made when first asked for (``inspect`` never makes them: one small record per tensor is all
    it holds).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = local_path(path, what="shrew file")
        self._file = open_file(self.path)
        try:
            inp = Input(self._file, self.path)
            parsed = parse(inp, eager=False)
        except BaseException:
            self._file.close()
            raise
        self.size = inp.pos
        self.version = parsed.version
        self._records = parsed.tensors
        self._buffer_records: dict[str, Record] = {}
        self._tensors: dict[str, FileRangeTensor] | None = None
        self._buffers: dict[str, FileRangeTensor] | None = None
        self.optimizer_type: str | None = None
        self.scalars: dict[str, float] = {}
        if parsed.optimizer is not None:
            self.optimizer_type, self.scalars, self._buffer_records = parsed.optimizer
        self.epoch = parsed.epoch
        self.global_step = parsed.global_step
        self.best_loss = parsed.best_loss
        self.loss_history = parsed.loss_history

    def _lazy(self, r: Record) -> FileRangeTensor:
        return FileRangeTensor(self._file.fileno(), r.offset, r.dtype, r.shape, path=self.path)

    @property
    def tensors(self) -> dict[str, FileRangeTensor]:
        if self._tensors is None:
            self._tensors = {k: self._lazy(r) for k, r in self._records.items()}
        return self._tensors

    @property
    def buffers(self) -> dict[str, FileRangeTensor]:
        if self._buffers is None:
            self._buffers = {k: self._lazy(r) for k, r in self._buffer_records.items()}
        return self._buffers

    def drain(self, progress: Progress | None = None) -> None:
        """Read every data byte once (tensors, then buffers), one lazy tensor at a time;
        ``progress(done, total)`` is called in bytes as it goes."""
        records = [*self._records.values(), *self._buffer_records.values()]
        tally = Tally(progress, sum(r.nbytes for r in records))
        for r in records:
            tally.drain(self._lazy(r))

    def __enter__(self) -> ShrewFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def tree(self) -> dict[str, Any]:
        """The content as a state tree, the shape ``sp.save`` would store: v1 ``{name: tensor}``;
        v2 ``{"model": {...}, "optimizer": OptimizerState.state_dict() layout (when present),
        "epoch", "global_step", "best_loss", "loss_history"}``. Tensors are lazy."""
        if self.version == VERSION_TENSORS:
            return dict(self.tensors)
        tree: dict[str, Any] = {"model": dict(self.tensors)}
        if self.optimizer_type is not None:
            tree["optimizer"] = {
                "optimizer_type": self.optimizer_type,
                "scalars": dict(self.scalars),
                "buffers": dict(self.buffers),
            }
        tree.update(
            epoch=self.epoch,
            global_step=self.global_step,
            best_loss=self.best_loss,
            loss_history=list(self.loss_history),
        )
        return tree

    def info(self) -> CheckpointInfo:
        name = os.path.basename(self.path)
        prefix = "" if self.version == VERSION_TENSORS else "model/"
        entries = [
            TensorInfo(prefix + k, r.dtype.name, r.shape, r.nbytes, name, prefix + k)
            for k, r in self._records.items()
        ]
        entries += [
            TensorInfo(
                f"optimizer/buffers/{k}", "F64", r.shape, r.nbytes, name, f"optimizer/buffers/{k}"
            )
            for k, r in self._buffer_records.items()
        ]
        values: dict[str, Any] = {}
        if self.version == VERSION_TRAINING:
            if self.optimizer_type is not None:
                values["optimizer/optimizer_type"] = self.optimizer_type
                values.update({f"optimizer/scalars/{k}": v for k, v in self.scalars.items()})
            values.update(
                epoch=self.epoch,
                global_step=self.global_step,
                best_loss=self.best_loss,
                loss_history=list(self.loss_history),
            )
        return CheckpointInfo(
            path=self.path,
            format_version=self.version,
            writer="",
            created="",
            metadata={},
            tensors=tuple(entries),
            values=values,
            files={name: self.size},
            format="shrew",
            notes=("the .shrew format has no checksums: verify checks structure and sizes only",),
        )


def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    with ShrewFile(path) as f:
        return f.info()


def verify(path: str | os.PathLike[str], *, progress: Progress | None = None) -> CheckpointInfo:
    """Check the whole structure and read every data byte (the format has no checksums);
    ``progress(done, total)`` is called in bytes as it reads."""
    with ShrewFile(path) as f:
        f.drain(progress)
        return f.info()
