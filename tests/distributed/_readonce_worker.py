"""One rank of the read-once sessions (launched by ``test_readonce.py`` through ``_launch``).

Usage: python _readonce_worker.py SCENARIO RANK WORLD PORT WORKDIR

Every load reads through ``FaultyStore(LocalStore(), views=False)``: no zero-copy views, so every
byte a rank takes from a data file is a recorded ``read`` (its file, offset and length), which the
rank writes to its result for the test to count. Results as in ``_worker.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import _worker

import savepoint as sp
from savepoint.distributed import FlatShard, Shard
from savepoint.errors import DistributedCheckpointError
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore

ROWS, COLS = 1000, 1024  # the sharded tensor: 1000 rows of 4 KiB (16 rows to a 64 KiB block)
GOLDEN = Path(__file__).parents[1] / "golden"


def replicated() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(512, 1024, generator=g),  # 2 MiB
        "e": torch.randn(300, 700, generator=g).to(torch.bfloat16),  # 410 KiB
        "b": torch.randn(1000, generator=g),  # 4 KB: under the read-once threshold
        "flags": torch.randn(70000, generator=g) > 0,  # BOOL, 68 KiB
    }


def sharded_full() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(8))


def load_rows(rank: int, world: int) -> tuple[int, int]:
    """The rows a rank restores: the save's split moved 37 rows on, so no boundary lands on a
    block boundary or a shard boundary."""
    cuts = [0] + [min(ROWS, (r + 1) * (ROWS // world) + 37) for r in range(world - 1)] + [ROWS]
    return cuts[rank], cuts[rank + 1]


def reads(store: FaultyStore) -> list[list[Any]]:
    """``[file name, offset, bytes]`` of every data-file read since the last call."""
    found = [
        [os.path.basename(c.path), c.offset, c.nbytes]
        for c in store.calls
        if c.kind == "read" and c.path.endswith(".safetensors")
    ]
    store.calls.clear()
    return found


def counted(s: _worker.Session, label: str, store: FaultyStore, fn: Callable[[], Any]) -> None:
    def run() -> None:
        store.calls.clear()
        fn()
        s.data[label] = reads(store)

    s.check(label, run)


def scenario_readonce(s: _worker.Session) -> None:
    world, rank = s.world, s.rank
    pg = dist.group.WORLD
    store = FaultyStore(LocalStore(), views=False)
    rep = replicated()
    s.check("save replicated", lambda: sp.save(s.path("rep"), rep, process_group=pg))

    def into_replicated(read_once: bool, verify: Any = True) -> None:
        targets = {k: torch.zeros_like(v) for k, v in rep.items()}
        sp.load(
            store.at(s.path("rep")),
            into=targets,
            process_group=pg,
            read_once=read_once,
            verify=verify,
        )
        for k, v in rep.items():
            assert torch.equal(targets[k], v), k

    def whole() -> None:
        tree = sp.load(store.at(s.path("rep")), process_group=pg)
        for k, v in rep.items():
            assert torch.equal(tree[k], v), k

    counted(s, "replicated read once", store, lambda: into_replicated(True))
    counted(s, "replicated each rank", store, lambda: into_replicated(False))
    counted(s, "replicated first", store, lambda: into_replicated(True, "first"))
    counted(s, "replicated unverified", store, lambda: into_replicated(True, False))
    counted(s, "replicated whole", store, whole)

    full = sharded_full()
    a, b = FlatShard.bounds(ROWS, rank, world)
    saved = {"w": Shard.split(full[a:b].clone(), 0, rank, world, size=ROWS)}
    for name in ("rows", "rows-bad", "rows-bad-first"):
        s.check(f"save {name}", lambda name=name: sp.save(s.path(name), saved, process_group=pg))
    lo, hi = load_rows(rank, world)

    def resharded(name: str, read_once: bool, verify: Any = True) -> None:
        local = torch.zeros(hi - lo, COLS)
        sp.load(
            store.at(s.path(name)),
            into={"w": Shard(local, (ROWS, COLS), (lo, 0))},
            process_group=pg,
            read_once=read_once,
            verify=verify,
        )
        assert torch.equal(local, full[lo:hi])

    counted(s, "resharded each rank", store, lambda: resharded("rows", False))
    counted(s, "resharded read once", store, lambda: resharded("rows", True))
    s.data["needed rows"] = [lo, hi]

    s.check("old versions", lambda: old_versions(s, pg))
    damaged(s, pg, store, resharded)


def old_versions(s: _worker.Session, pg: Any) -> None:
    """Golden checkpoints of manifest versions 1, 2 and 3 load whole on every rank, read once
    (version 2 has no block checksums: its shards are checked whole, by one rank each)."""
    for version in ("v1", "v2", "v3"):
        alone = sp.load(GOLDEN / version, framework="numpy")
        together = sp.load(GOLDEN / version, process_group=pg, framework="numpy")
        assert alone.keys() == together.keys(), version
        for key in alone:
            try:
                _same(alone[key], together[key])
            except AssertionError:
                raise AssertionError(
                    f"{version} {key}: {together[key]!r} != {alone[key]!r}"
                ) from None


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    else:
        assert a == b or (a != a and b != b), (a, b)  # NaN is NaN


def damaged(
    s: _worker.Session, pg: Any, store: FaultyStore, resharded: Callable[..., None]
) -> None:
    """A flipped byte in row 160, in the second saved shard (rows 125-250): inside its block of
    rows 157-173, which holds the end of rank 0's part and the start of rank 1's (loads
    resharded as above). The ranks that read that byte, and only they, report it."""
    if s.rank == 0:
        for name in ("rows-bad", "rows-bad-first"):
            (found,) = [f for f in os.listdir(s.path(name)) if f.startswith("data-r00001")]
            path = os.path.join(s.path(name), found)
            with open(path, "rb") as f:
                header = 8 + int.from_bytes(f.read(8), "little")
            offset = header + (160 - 125) * COLS * 4 + 5
            with open(path, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))
            s.data[f"flipped {name}"] = [found, offset]
    dist.barrier()
    for label, name, read_once, verify in (
        ("damaged each rank", "rows-bad", False, True),
        ("damaged read once", "rows-bad", True, True),
        ("damaged first", "rows-bad-first", True, "first"),
    ):

        def run(
            label: str = label, name: str = name, read_once: bool = read_once, verify: Any = verify
        ) -> None:
            store.calls.clear()
            try:
                resharded(name, read_once, verify)
            except DistributedCheckpointError as exc:
                s.data[label + " ranks"] = list(exc.ranks)
                s.data[label + " message"] = str(exc)
            else:
                raise AssertionError("no DistributedCheckpointError")
            finally:
                s.data[label] = reads(store)

        s.check(label, run)
    if s.rank == 0:
        for name in ("rows-bad", "rows-bad-first"):
            shutil.rmtree(s.path(name))


if __name__ == "__main__":
    _worker.main(globals())
