"""boostr checkpoints through the writer process: ``AsyncCheckpointer(writer="process")``'s
``save_boostr`` and ``save_distributed``, both ends.

The trainer's end (``save()``'s thread): the boostr arguments are checked as the thread writer
checks them (names, types, the training state), the model's and optimizer's tensors are copied
into the shared staging arena in parallel (:meth:`~savepoint.async_.staging.StagingArena.snapshot`,
as a native save's; the thread writer copies them one after another into memory of their own),
and the writer process is sent where each tensor is in the arena (a ``boostr`` message).

- ``save_boostr``: handed over before ``save_boostr`` returns (once CUDA copies have landed, for
  a state on a GPU); the writer process writes the directory with
  :func:`savepoint.formats.boostr.write` (the thread writer's own) from the arena, so the save
  commits even if the trainer is then killed; the trainer's background thread waits for the
  answer and describes what was committed (``boostr.inspect``).
- ``save_distributed``: the collectives of :func:`savepoint.formats.boostr.prepare_distributed`
  stay in the trainer's background thread (the writer process is in no process group); its
  rank writer sends the writer process the staging directory and this rank's number, and the
  writer process writes ``rank_{r}/`` with :func:`savepoint.formats.boostr.write_rank` (the
  thread writer's own step). As a sharded native save, it does not outlive its trainer.

The writer process's end (:func:`write`): the tensors as numpy arrays over its mapping of the
arena (no copy), then the same writer functions. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from savepoint import info
from savepoint.async_.staging import ArenaSource, Staged, on_cuda
from savepoint.formats import boostr
from savepoint.state.tree import Flat

if TYPE_CHECKING:
    from savepoint.async_.process import ProcessWriter

__all__ = ["prepare_distributed", "stage_single", "write"]

# A tensor's entry in a boostr message: name, dtype name, shape, offset in the arena.
Entry = list[Any]


def stage_single(
    process: ProcessWriter,
    target: str,
    model: Mapping[str, Any],
    optimizer: Mapping[str, Any] | None,
    state: boostr.TrainingState | None,
) -> Callable[[], info.CheckpointInfo]:
    """``save_boostr``'s blocking part (see the module docstring); the returned function waits
    for the writer process's answer and describes the checkpoint."""
    given = state if state is not None else boostr.TrainingState()
    document = given.to_json()  # refuse what cannot be written now, in the caller
    process.ensure()  # its start-up overlaps the copy
    staged = _stage(process, model, optimizer)
    message = {
        "op": "boostr",
        "path": target,
        "arena_size": process.arena.capacity,
        **staged.entries(),
        "state": document.decode(),
    }

    def answer() -> info.CheckpointInfo:
        process.receive(target, None)
        return boostr.inspect(target)

    if staged.cuda:  # handed over once the copies have landed
        return functools.partial(_hand_over_then, process, staged.staged, message, answer)
    process.hand_over(message)
    return answer


def prepare_distributed(
    process: ProcessWriter,
    target: str,
    model: Mapping[str, Any],
    optimizer: Mapping[str, Any] | None,
    state: boostr.TrainingState | None,
    **options: Any,
) -> Callable[[], boostr.ShardingMeta]:
    """``save_distributed``'s blocking part: ``boostr.prepare_distributed`` (every check) over
    the tensors staged in the arena, with a rank writer that has the writer process write
    ``rank_{r}/`` (see the module docstring). ``options``: ``prepare_distributed``'s."""
    process.ensure()  # its start-up overlaps the copy
    staged = _stage(process, model, optimizer)

    def write_rank(staging: str, rank: int, document: bytes) -> None:
        staged.staged.wait()  # CUDA copies land (they overlapped the plan step)
        message = {
            "op": "boostr",
            "path": target,
            "staging": staging,
            "rank": rank,
            "arena_size": process.arena.capacity,
            **staged.entries(),
            "state": document.decode(),
        }
        process.hand_over(message)
        process.receive(target, None)

    # Every check of the thread writer's, on the staged arrays (the tensors' names, dtypes and
    # shapes are theirs), which are not copied again.
    return boostr.prepare_distributed(
        target,
        {name: array for (name, *_), array in staged.model},
        None if optimizer is None else {name: array for (name, *_), array in staged.optimizer},
        state,
        copy=False,
        rank_writer=write_rank,
        **options,
    )


def _stage(
    process: ProcessWriter, model: Mapping[str, Any], optimizer: Mapping[str, Any] | None
) -> _Staged:
    """The tensors checked and copied into the arena."""
    named = [("model", n, s) for n, s in boostr.tensor_sources(model, "model")]
    if optimizer is not None:
        named += [("optimizer", n, s) for n, s in boostr.tensor_sources(optimizer, "optimizer")]
    flat = Flat({"t": "dict", "items": []}, {str(i): s for i, (_, _, s) in enumerate(named)})
    staged, copies = process.arena.snapshot(flat, 1 << 62)
    out = _Staged(staged, any(on_cuda(s) for _, _, s in named))
    for i, (what, name, source) in enumerate(named):
        copy = copies.tensors[str(i)]
        assert isinstance(copy, ArenaSource)
        entry = [name, source.dtype.name, list(source.shape), process.arena.offset(copy.view)]
        array = copy.view.view(source.dtype.numpy).reshape(source.shape)
        (out.model if what == "model" else out.optimizer).append((entry, array))
    return out


@dataclasses.dataclass
class _Staged:
    """boostr tensors staged in the arena: each one's entry (for the writer process) and array
    (a view of the arena, for the trainer's checks), model and optimizer apart."""

    staged: Staged
    cuda: bool
    model: list[tuple[Entry, np.ndarray[Any, Any]]] = dataclasses.field(default_factory=list)
    optimizer: list[tuple[Entry, np.ndarray[Any, Any]]] = dataclasses.field(default_factory=list)

    def entries(self) -> dict[str, list[Entry]]:
        return {"model": [e for e, _ in self.model], "optimizer": [e for e, _ in self.optimizer]}


def _hand_over_then(
    process: ProcessWriter,
    staged: Staged,
    message: dict[str, Any],
    answer: Callable[[], info.CheckpointInfo],
) -> info.CheckpointInfo:
    staged.wait()
    process.hand_over(message)
    return answer()


def _arrays(arena: np.ndarray[Any, Any], entries: Sequence[Entry]) -> list[tuple[str, Any]]:
    """The staged tensors as (name, numpy array over the arena) pairs, in order."""
    from savepoint.codecs.dtypes import BY_NAME

    out = []
    for name, dtype_name, shape, offset in entries:
        dtype = BY_NAME[dtype_name]
        n = math.prod(shape) * dtype.itemsize
        view = arena[int(offset) : int(offset) + n]
        out.append((str(name), view.view(dtype.numpy).reshape(tuple(int(s) for s in shape))))
    return out


def write(message: dict[str, Any], arena: np.ndarray[Any, Any]) -> dict[str, Any]:
    """The writer process's end: a ``boostr`` message written from the arena (a single
    checkpoint, or with ``staging`` one rank's ``rank_{r}/`` of a distributed one); answered
    ``done``."""
    models = _arrays(arena, message["model"])
    optimizers = _arrays(arena, message["optimizer"])
    if "staging" in message:
        document = str(message["state"]).encode()
        model_sources = boostr.tensor_sources(models, "model")
        optimizer_sources = boostr.tensor_sources(optimizers, "optimizer")
        staging, rank = str(message["staging"]), int(message["rank"])
        boostr.write_rank(staging, rank, model_sources, optimizer_sources, document)
    else:
        state = boostr.TrainingState.parse(json.loads(message["state"]))
        boostr.write(str(message["path"]), models, optimizers, state)
    return {"op": "done"}
