"""Regenerate the golden regular-layout sharded checkpoint ``tests/golden/v7/`` (format version 7:
a tensor table with each tensor's grid, per-rank index files).

Usage, from the repository root::

    .venv/bin/python tests/golden/make_golden_grid.py

A save by 4 ranks on a 2 x 2 device mesh, run by the world simulator with the real writer
(:func:`savepoint.distributed.simulate.simulate_save`, ``writer="real"``), of
:func:`golden_state`: every rank's Shards carry their grid, so the save is planned from the
layout and writes version 7. ``created`` is fixed as in ``make_golden.py``. The large tensor's
pieces (192 KiB) get block checksums. Only regenerate when the format changes on purpose (then
as a new directory); ``tests/formats/test_golden_grid.py`` reads it and checks that the current
writer produces it byte for byte.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CREATED = "2025-01-01T00:00:00.000000Z"
METADATA: dict[str, Any] = {"step": 77, "run": "golden-grid"}
MESH = (2, 2)
WORLD = 4


def golden_arrays() -> dict[str, np.ndarray[Any, Any]]:
    return {
        "w": (np.arange(384 * 256, dtype=np.float32) / 8).reshape(384, 256),  # 384 KiB
        "b": np.arange(-40, 40, dtype=np.int16).reshape(8, 10),
        "r": np.array([1.5, -2.5, 3.5], dtype=np.float64),
    }


def golden_state(rank: int, world: int = WORLD) -> dict[str, Any]:
    """Rank ``rank``'s state: ``w`` split over the mesh's first dimension (replicated over the
    second), ``b`` over both, ``r`` replicated, ``step`` a plain value."""
    from savepoint.distributed import Shard, layout

    assert world == WORLD
    coord = (rank // MESH[1], rank % MESH[1])
    a = golden_arrays()

    def piece(name: str, dims: tuple[int | None, ...]) -> Shard:
        box = layout.grid_box(a[name].shape, MESH, coord, dims)
        local = a[name][tuple(slice(lo, hi) for lo, hi in box)].copy()
        grid = layout.Grid(MESH, coord, dims)
        return Shard(local, a[name].shape, tuple(lo for lo, _ in box), grid=grid)

    return {
        "model": {"w": piece("w", (0, None)), "b": piece("b", (0, 1))},
        "replicated": a["r"].copy(),
        "step": 77,
    }


def write(ckpt: str) -> None:
    """Save the golden state to ``ckpt`` (4 simulated ranks, the real writer)."""
    from savepoint.distributed import simulate

    sim = simulate.simulate_save(WORLD, golden_state, ckpt, writer="real", metadata=METADATA)
    failed = [r for r in sim.results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]


def main() -> int:
    if not any(p.endswith("src") for p in sys.path[:2]) and "PYTHONPATH" not in os.environ:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
    import savepoint as sp
    from savepoint.codecs import manifest as mf

    target = os.path.join(HERE, "v7")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "v7")
        write(ckpt)
        path = os.path.join(ckpt, mf.NAME)
        with open(path, "rb") as f:
            raw = f.read()

        def read_index(name: str, size: int) -> bytes:
            with open(os.path.join(ckpt, name), "rb") as f:
                return f.read()

        m = mf.parse(raw, read_index=read_index)
        if m.format_version != mf.GRID:
            raise SystemExit(f"this savepoint writes format version {m.format_version}")
        if mf.dumps(m) != raw:
            raise SystemExit("manifest does not re-serialise identically; refusing to rewrite it")
        m.created = CREATED
        with open(path, "wb") as f:
            f.write(mf.dumps(m))
        if os.path.exists(target):
            shutil.rmtree(target)
        shutil.copytree(ckpt, target)
    sp.verify(target)
    print(f"wrote {target}: format version {m.format_version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
