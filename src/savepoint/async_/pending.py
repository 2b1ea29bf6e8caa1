"""``PendingSave``: the handle every save returns, finished or not.

A synchronous save returns a handle that is already done. A background save resolves it when the
checkpoint is committed (or has failed); ``wait()`` re-raises the failure. A skipped save (the
manager's save policy said no) is done, with ``skipped`` set and no path.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

__all__ = ["PendingSave"]


class PendingSave:
    def __init__(self, path: str | None, step: int | None = None, *, skipped: bool = False) -> None:
        self.path = path
        self.step = step
        self.skipped = skipped
        self._future: Future[Any] = Future()

    @classmethod
    def finished(
        cls, path: str | None, step: int | None = None, result: Any = None, *, skipped: bool = False
    ) -> PendingSave:
        p = cls(path, step, skipped=skipped)
        p._future.set_result(result)
        return p

    def set_result(self, result: Any) -> None:
        self._future.set_result(result)

    def set_exception(self, exc: BaseException) -> None:
        self._future.set_exception(exc)

    def done(self) -> bool:
        """True once the save has committed or failed (never blocks)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the save is durable; re-raise its error if it failed."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error, or None if it succeeded (blocks like ``wait``)."""
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ("done" if self.done() else "pending")
        return f"PendingSave(step={self.step}, path={self.path!r}, {state})"
