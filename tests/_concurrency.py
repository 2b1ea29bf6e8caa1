"""A memory store that measures how many blobs are being written at once (not collected)."""

from __future__ import annotations

import threading
import time
from typing import Any

from savepoint.storage.memory import MemoryStore


class CountingStore(MemoryStore):
    """Every blob writer holds a slot from its first write to its finish; each write waits a
    little, so concurrent writers overlap. ``most`` is the largest number of slots held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.active = 0
        self.most = 0
        self.direct: list[bool] = []  # what each create_blob asked for
        self._count = threading.Lock()

    def create_blob(self, path: str, *, size: int | None = None, direct: bool = True) -> Any:
        self.direct.append(direct)
        return _Counted(self, super().create_blob(path, size=size, direct=direct))

    def enter(self) -> None:
        with self._count:
            self.active += 1
            self.most = max(self.most, self.active)

    def leave(self) -> None:
        with self._count:
            self.active -= 1


class _Counted:
    def __init__(self, store: CountingStore, inner: Any) -> None:
        self.store = store
        self.inner = inner
        self.alignment = inner.alignment
        self.started = False

    def write(self, data: memoryview) -> None:
        if not self.started:
            self.started = True
            self.store.enter()
        time.sleep(0.02)
        self.inner.write(data)

    def finish(self) -> None:
        try:
            self.inner.finish()
        finally:
            self._done()

    def abort(self) -> None:
        self.inner.abort()
        self._done()

    def _done(self) -> None:
        if self.started:
            self.started = False
            self.store.leave()
