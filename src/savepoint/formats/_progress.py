"""Progress reports for the readers of every format: ``progress(done, total)`` in bytes, as
``sp.verify`` and ``sp.load`` call it, from readers that drain or copy lazy tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from savepoint.formats import _files
from savepoint.formats._files import LazyTensor
from savepoint.state.arrays import TensorSource

__all__ = ["Counted", "Progress", "Tally"]

Progress = Callable[[int, int], None]


class Tally:
    """Bytes done out of ``total``, reported to ``progress`` (which may be None) as they grow."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0

    @classmethod
    def over(cls, progress: Progress | None, sources: Iterable[TensorSource]) -> Tally:
        """A tally over the bytes of ``sources`` (each distinct object counted once)."""
        unique = {id(s): s for s in sources}
        return cls(progress, sum(s.nbytes for s in unique.values()))

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(min(self.done, self.total), self.total)

    def drain(self, source: TensorSource) -> None:
        """Read every byte of ``source`` once (as ``_files.drain``), counting them."""
        for chunk in _files.chunks(source):
            self.add(len(chunk))


class Counted(LazyTensor):
    """``inner`` behind the same interface, adding the bytes each copy moves to ``tally``."""

    def __init__(self, inner: LazyTensor, tally: Tally) -> None:
        super().__init__(inner.dtype, inner.shape, kind=inner.kind)
        self.inner = inner
        self._tally = tally

    def identity(self) -> tuple[Any, ...] | None:
        return self.inner.identity()

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        self.inner.copy_to(dst, start)
        self._tally.add(len(dst))

    def release(self) -> None:
        self.inner.release()

    def load(self) -> np.ndarray[Any, Any]:
        out = self.inner.load()
        self._tally.add(self.nbytes)
        return out
