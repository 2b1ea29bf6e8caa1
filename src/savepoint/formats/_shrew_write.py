"""Writing ``.shrew`` files to a binary stream: the tensors a caller gives (numpy arrays, torch
tensors, lazy tensors of another checkpoint) made into sources, checked by
:mod:`savepoint.codecs.shrew`, and streamed in the layout it gives, each tensor through one
bounded buffer. Everything is checked before the first byte is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from savepoint.codecs import shrew as codec
from savepoint.errors import UnsupportedStateError
from savepoint.formats import _files
from savepoint.formats._files import LazyTensor
from savepoint.state import arrays
from savepoint.state.arrays import TensorSource
from savepoint.state.optimizer import OptimizerState

Tensors = Mapping[str, Any] | Iterable[tuple[str, Any]]


def pairs(tensors: Tensors) -> list[tuple[Any, Any]]:
    """``(name, tensor)`` pairs of a mapping or a sequence of pairs."""
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    out = []
    for item in tensors:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise UnsupportedStateError(
                f"expected (name, tensor) pairs, got {type(item).__name__}; pass a mapping or a "
                "sequence of pairs"
            )
        out.append(item)
    return out


def as_source(value: Any, key: str) -> TensorSource:
    """``value`` as a tensor source; UnsupportedStateError when it is not a tensor."""
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


def _checked_items(tensors: Tensors) -> list[tuple[bytes, TensorSource]]:
    items: list[tuple[bytes, TensorSource]] = []
    seen: set[str] = set()
    for key, value in pairs(tensors):
        raw = codec.key_bytes(key, "tensor key")
        if key in seen:
            raise UnsupportedStateError(
                f"tensor key {key!r} appears twice; a .shrew file holds each key once", key=key
            )
        seen.add(key)
        source = as_source(value, key)
        codec.check_source(key, source)
        items.append((raw, source))
    return items


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

    def check(self) -> codec.CheckedOptimizer[TensorSource]:
        return codec.checked_optimizer(self.optimizer_type, self.scalars, self.buffers)


def _stream(stream: BinaryIO, pieces: Sequence[bytes | TensorSource]) -> None:
    for piece in pieces:
        if isinstance(piece, bytes):
            _write_all(stream, piece)
        else:
            for chunk in _files.chunks(piece):
                _write_all(stream, chunk)


def _write_all(stream: BinaryIO, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while len(view):
        n = stream.write(view)
        if n is None or n >= len(view):
            return
        view = view[n:]


def write_tensors(stream: BinaryIO, tensors: Tensors) -> None:
    """Write a v1 file to ``stream``; everything is checked before the first byte is written."""
    _stream(stream, codec.tensors_layout(_checked_items(tensors)))


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
    items = _checked_items(model)
    opt = optimizer.check() if optimizer is not None else None
    training = codec.checked_training(epoch, global_step, best_loss, loss_history)
    _stream(stream, codec.training_layout(items, opt, training))
