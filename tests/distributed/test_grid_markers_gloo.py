"""Repeated sharded saves on a real gloo group (4 ranks on 127.0.0.1, ``_markers_worker.py``):
coordinates swapped, rank 0 restarted, the async writer's thread, a new group over the same
processes with the ranks reversed; each save commits what a fresh plan commits."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import _launch

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("_markers_worker.py")


@pytest.mark.distributed
def test_repeated_saves_on_a_real_group(tmp_path: Path) -> None:
    s = _launch.run("markers", 4, tmp_path, timeout=150, worker=WORKER)
    assert s.failures() == "", s.failures()
