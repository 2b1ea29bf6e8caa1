"""Fixtures shared by the sharded-load tests of this folder."""

from __future__ import annotations

from typing import Any

import pytest

from savepoint.storage import _local_read


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The index files read through the local store, in order."""
    names: list[str] = []
    real = _local_read.LocalPinned.read_small

    def read_small(self: Any, name: str, *, cap: int | None) -> bytes:
        if name.startswith("index-"):
            names.append(name)
        return real(self, name, cap=cap)

    monkeypatch.setattr(_local_read.LocalPinned, "read_small", read_small)
    return names
