"""Resumable data position: where in which epoch the data stream is, saved with the checkpoint.

Restoring the model and optimizer is not enough for an exact resume: the run must also see the
same remaining samples in the same order. Two tools:

``ResumableSampler``
    An index sampler for map-style datasets. Its order in each epoch is a permutation that
    depends only on ``(seed, epoch)``; it counts the indices it has handed out, and its
    ``state_dict()`` (epoch, index, seed, shuffle, dataset size) lets a fresh sampler continue at
    exactly the next index. It has ``__iter__`` and ``__len__``, which is all
    ``torch.utils.data.DataLoader(sampler=...)`` needs, and never imports torch.

``DataPosition``
    A small Stateful ``(epoch, step, index)`` for loops that feed data themselves (streaming
    readers, tf.data, a file list): save it, and on resume skip to it.

Prefetching: a DataLoader with ``num_workers > 0`` draws indices ahead of the training loop, so
the sampler's ``index`` runs ahead of what was trained on. Save ``sampler.state_dict(consumed=n)``
with ``n`` the number of samples the loop actually consumed in this epoch (``batches *
batch_size``); with ``num_workers=0`` the default, the count handed out, is already exact at every
batch boundary.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import numpy as np

from savepoint.errors import DataStateError

__all__ = ["DataPosition", "ResumableSampler", "epoch_order"]


def _count(value: Any, name: str, problems: list[str]) -> int:
    """A non-negative int (numpy and 0-d array ints too), or a problem noted and 0."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, (bool, np.bool_)):
        problems.append(f"{name} must be a non-negative int, got {value!r}")
        return 0
    try:
        n = operator.index(value)
    except TypeError:
        problems.append(f"{name} must be a non-negative int, got {type(value).__name__}")
        return 0
    if n < 0:
        problems.append(f"{name} must be a non-negative int, got {n}")
        return 0
    return n


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The shuffled order of ``range(num_samples)`` for ``(seed, epoch)``.

    Sorts raw 64-bit draws of a PCG64 seeded with ``SeedSequence([seed, epoch])``. NumPy
    promises that SeedSequence and the raw PCG64 stream never change between versions (unlike
    ``Generator.permutation``, whose algorithm may), so a checkpoint resumes in the same order
    after a NumPy upgrade. Ties between equal draws (vanishingly rare) are broken by index.
    """
    bits = np.random.PCG64(np.random.SeedSequence([seed, epoch]))
    keys = bits.random_raw(num_samples)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


class ResumableSampler:
    """Yields dataset indices epoch after epoch, and resumes at exactly the next one.

    ``data_source`` is the dataset (anything with ``len``) or its size. With ``shuffle`` (the
    default) epoch ``e`` yields ``epoch_order(n, seed, e)``, else ``0..n-1``. ``seed`` is a
    non-negative int fixed for the run.

    State: ``epoch`` and ``index``, the number of indices of that epoch already handed out.
    Iterating yields the epoch's indices from ``index`` on, advancing ``index`` as it goes; when an
    iteration runs to the end of the epoch, ``epoch`` goes up by one and ``index`` back to 0, so a
    plain ``for epoch in ...: for batch in loader:`` loop gets a new order every epoch.
    ``set_epoch(e)`` (the ``DistributedSampler`` convention) moves to the start of epoch ``e``,
    unless the sampler is already in epoch ``e``: after a restore, ``set_epoch(restored_epoch)``
    keeps the position. ``len(sampler)`` is the number of indices the next iteration will yield.

    One iteration at a time: starting a new iteration, ``set_epoch`` to another epoch, or
    ``load_state_dict`` detaches any earlier iterator, which then still yields its own order but
    no longer moves the sampler's position.
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
    ) -> None:
        problems: list[str] = []
        size = len(data_source) if isinstance(data_source, Sized) else data_source
        self._num_samples = _count(size, "the dataset size", problems)
        self.seed = _count(seed, "seed", problems)
        self.epoch = _count(epoch, "epoch", problems)
        if problems:
            raise ValueError("; ".join(problems))
        self.shuffle = bool(shuffle)
        self.index = 0
        self._generation = 0
        self._cache: tuple[tuple[int, bool, int], np.ndarray[Any, np.dtype[np.int64]]] | None = None

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def __repr__(self) -> str:
        return (
            f"ResumableSampler(num_samples={self._num_samples}, shuffle={self.shuffle}, "
            f"seed={self.seed}, epoch={self.epoch}, index={self.index})"
        )

    def order(self, epoch: int | None = None) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The full index order of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        key = (epoch, self.shuffle, self.seed)
        if self._cache is None or self._cache[0] != key:
            if self.shuffle:
                order = epoch_order(self._num_samples, self.seed, epoch)
            else:
                order = np.arange(self._num_samples, dtype=np.int64)
            self._cache = (key, order)
        return self._cache[1]

    def __len__(self) -> int:
        return max(self._num_samples - self.index, 0)

    def __iter__(self) -> Iterator[int]:
        self._generation += 1
        # The order and start are fixed now, when the iteration begins.
        return self._run(self._generation, self.order(), self.index)

    def _run(
        self, generation: int, order: np.ndarray[Any, np.dtype[np.int64]], start: int
    ) -> Iterator[int]:
        for i in range(start, self._num_samples):
            if self._generation == generation:
                self.index = i + 1
            yield int(order[i])
        if self._generation == generation:
            self.epoch += 1
            self.index = 0

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; no change if already in ``epoch`` (keeps the position)."""
        problems: list[str] = []
        epoch = _count(epoch, "epoch", problems)
        if problems:
            raise ValueError(problems[0])
        if epoch != self.epoch:
            self._generation += 1
            self.epoch, self.index = epoch, 0

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """``{"num_samples", "shuffle", "seed", "epoch", "index"}`` as plain values.

        ``consumed`` overrides ``index`` with the number of samples of the current epoch the
        training loop has actually used (for a prefetching DataLoader); it must be at most
        ``num_samples``.
        """
        index = self.index
        if consumed is not None:
            problems: list[str] = []
            index = _count(consumed, "consumed", problems)
            if problems or index > self._num_samples:
                raise ValueError(
                    f"consumed must be an int in 0..{self._num_samples}, got {consumed!r}"
                )
        return {
            "num_samples": self._num_samples,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "index": index,
        }

    def load_state_dict(self, state_dict: Any) -> None:
        """Continue from a saved position: the next index yielded is the one after it.

        ``num_samples`` must equal this sampler's dataset size (a different dataset would make the
        saved position meaningless); ``seed`` and ``shuffle`` are taken from the checkpoint, as
        they define the order being resumed. Every problem is reported in one DataStateError and
        the sampler is left unchanged.
        """
        problems: list[str] = []
        if not isinstance(state_dict, Mapping):
            raise DataStateError(
                "cannot restore the sampler", [f"expected a mapping, got {type(state_dict)}"]
            )
        expected = ("num_samples", "shuffle", "seed", "epoch", "index")
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if missing:
            problems.append(f"missing key(s): {', '.join(map(repr, missing))}")
        if unexpected:
            problems.append(f"unexpected key(s): {', '.join(map(repr, unexpected))}")
        n = _count(state_dict.get("num_samples", self._num_samples), "num_samples", problems)
        seed = _count(state_dict.get("seed", 0), "seed", problems)
        epoch = _count(state_dict.get("epoch", 0), "epoch", problems)
        index = _count(state_dict.get("index", 0), "index", problems)
        shuffle = state_dict.get("shuffle", True)
        if not isinstance(shuffle, (bool, np.bool_)):
            problems.append(f"shuffle must be a bool, got {shuffle!r}")
        if n != self._num_samples:
            problems.append(
                f"the checkpoint was taken over {n} samples, this dataset has "
                f"{self._num_samples}; the saved position does not apply to it"
            )
        elif index > n:
            problems.append(f"index {index} is beyond the epoch's {n} samples")
        if problems:
            raise DataStateError("cannot restore the sampler", problems)
        self._generation += 1
        self.shuffle, self.seed, self.epoch, self.index = bool(shuffle), seed, epoch, index


class DataPosition:
    """Where a hand-written data loop is: ``epoch``, global ``step``, ``index`` within the epoch.

    ``advance(samples)`` after each batch adds one step and ``samples`` to the index;
    ``next_epoch()`` moves to index 0 of the next epoch. ``state_dict()`` is
    ``{"epoch", "step", "index"}``; ``load_state_dict`` checks all three are non-negative ints and
    raises DataStateError otherwise, leaving the position unchanged. What "index" counts (samples,
    records, files, bytes) is up to the loop; skip that many on resume.
    """

    def __init__(self, epoch: int = 0, step: int = 0, index: int = 0) -> None:
        problems: list[str] = []
        self.epoch = _count(epoch, "epoch", problems)
        self.step = _count(step, "step", problems)
        self.index = _count(index, "index", problems)
        if problems:
            raise ValueError("; ".join(problems))

    def __repr__(self) -> str:
        return f"DataPosition(epoch={self.epoch}, step={self.step}, index={self.index})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DataPosition):
            return NotImplemented
        return (self.epoch, self.step, self.index) == (other.epoch, other.step, other.index)

    __hash__ = None  # type: ignore[assignment]

    def advance(self, samples: int = 1) -> None:
        problems: list[str] = []
        n = _count(samples, "samples", problems)
        if problems:
            raise ValueError(problems[0])
        self.step += 1
        self.index += n

    def next_epoch(self) -> None:
        self.epoch += 1
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "index": self.index}

    def load_state_dict(self, state_dict: Any) -> None:
        problems: list[str] = []
        if not isinstance(state_dict, Mapping):
            raise DataStateError(
                "cannot restore the data position", [f"expected a mapping, got {type(state_dict)}"]
            )
        expected = ("epoch", "step", "index")
        values = {}
        for key in expected:
            if key not in state_dict:
                problems.append(f"missing key {key!r}")
            else:
                values[key] = _count(state_dict[key], key, problems)
        unexpected = [k for k in state_dict if k not in expected]
        if unexpected:
            problems.append(f"unexpected key(s): {', '.join(map(repr, unexpected))}")
        if problems:
            raise DataStateError("cannot restore the data position", problems)
        self.epoch, self.step, self.index = values["epoch"], values["step"], values["index"]
