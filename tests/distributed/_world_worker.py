"""One rank of the simulator's check against real gloo (launched by ``test_world.py``).

Usage: python _world_worker.py SCENARIO RANK WORLD PORT WORKDIR

Saves :func:`savepoint.distributed.simulate.model_state` (small, with data) with ``sp.save``
over a real gloo group, recording every operation savepoint's group runs (a proxy around it:
the operation, the bytes of the tensors passed in and of those filled), so the test can compare
them with what the simulator predicts, operation by operation. The staging directory's owner tag
is fixed (``OWNER``), as the simulator's is, so both send payloads of the same length. Rank 0
records the committed manifest (without its creation time).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import _worker

import savepoint as sp
from savepoint.commit import names
from savepoint.distributed import channels, simulate

OWNER = "host-00000-0123abcd"
SIZES = {"hidden": 64, "experts": 4, "expert_ffn": 32}  # a few KiB per tensor
TENSORS = 40


def state(rank: int, world: int, regular: bool = True) -> Any:
    return simulate.model_state(rank, world, TENSORS, tp=2, data=True, regular=regular, **SIZES)


def irregular(rank: int, world: int) -> Any:
    return state(rank, world, regular=False)


# The simulator saves to paths as long ("ck-simu", "ck-sim2", "ck-sir1", "ck-sir2"): the
# regular state (planned compactly) twice, then the same state by offsets alone (merged) twice.
NAMES = ("ck-real", "ck-rea2", "ck-irr1", "ck-irr2")


def manifest(path: str) -> Any:
    found = json.loads(Path(path, "manifest.json").read_text())
    found.pop("created", None)
    found.pop("manifest_xxh3", None)  # covers the creation time
    return found


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Recording:
    """savepoint's gloo group, every operation recorded as (kind, sent, recv)."""

    def __init__(self, group: Any, rank: int, ops: list[list[Any]]) -> None:
        self.group, self.rank, self.ops = group, rank, ops

    def allgather(self, outputs: Any, inputs: Any) -> Any:
        self.ops.append(["allgather", nbytes(inputs), sum(nbytes(o) for o in outputs)])
        return self.group.allgather(outputs, inputs)

    def gather(self, outputs: Any, inputs: Any, opts: Any) -> Any:
        self.ops.append(["gather", nbytes(inputs), sum(nbytes(o) for o in outputs)])
        return self.group.gather(outputs, inputs, opts)

    def broadcast(self, tensors: Any, opts: Any) -> Any:
        n = nbytes(tensors)
        root = self.rank == opts.rootRank
        self.ops.append(["broadcast", n if root else 0, 0 if root else n])
        return self.group.broadcast(tensors, opts)

    def scatter(self, outputs: Any, inputs: Any, opts: Any) -> Any:
        self.ops.append(["scatter", sum(nbytes(i) for i in inputs), nbytes(outputs)])
        return self.group.scatter(outputs, inputs, opts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)


def scenario_world(s: _worker.Session) -> None:
    ops: list[list[Any]] = []
    names._owner = lambda: OWNER  # type: ignore[assignment]
    make = channels.Channel.group

    def group(self: Any, rank: int, size: int) -> Any:
        return Recording(make(self, rank, size), rank, ops)

    channels.Channel.group = group  # type: ignore[method-assign]

    def save() -> None:
        for i, name in enumerate(NAMES):  # the fourth save reuses the third one's plan
            got = state(s.rank, s.world, regular=i < 2)
            sp.save(s.path(name), got, process_group=dist.group.WORLD)
        s.data["ops"] = ops
        if s.rank == 0:
            s.data["manifests"] = [manifest(s.path(name)) for name in NAMES]

    s.check("save", save)


def scenario_world_reload(s: _worker.Session) -> None:
    """The regular (version 7) checkpoint ``ck-real``, saved by another number of ranks, loaded
    onto this world's layout (a resharding load, verified); each piece compared with the same
    box of the whole tensor as a plain load reads it."""
    import numpy as np

    from savepoint.distributed import Shard

    targets = state(s.rank, s.world)
    whole = sp.load(s.path("ck-real"), framework="numpy")
    leaves: list[tuple[Any, Any]] = []

    def pair(got: Any, full: Any) -> None:
        if isinstance(got, dict):
            for k in got:
                pair(got[k], full[k])
        elif isinstance(got, Shard):
            got.local[...] = 0
            box = tuple(slice(o, o + n) for o, n in zip(got.offsets, got.local.shape))
            leaves.append((got.local, full[box]))
        elif isinstance(got, np.ndarray):
            got[...] = 0
            leaves.append((got, full))

    pair(targets, whole)

    def load() -> None:
        sp.load(s.path("ck-real"), into=targets, process_group=dist.group.WORLD)
        for got, expected in leaves:
            assert np.array_equal(got, expected)
        s.data["leaves"] = len(leaves)

    s.check("reload", load)


if __name__ == "__main__":
    _worker.main(globals())
