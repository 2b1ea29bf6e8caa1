"""One rank of the repeated-save checks on a real gloo group (launched by
``test_grid_markers_gloo.py``, never collected).

Usage: python _markers_worker.py SCENARIO RANK WORLD PORT WORKDIR

Every save after the first may be planned from markers (the memos of a real group: its key
names the group's global ranks, this rank and the timeout); each is compared, on rank 0, with
a save of the same state after every rank forgot its memos (a fresh plan): the same manifest,
the same contents.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import _worker
from test_grid_markers import grid_state, manifest, typed

import savepoint as sp
from savepoint.distributed import channels, collectives, plancache, save

TIMEOUT = 30
DIFFER: list[str] = []  # rank 0: the checkpoints that are not what a fresh save commits


def forget(pg: Any = None) -> None:
    """This rank's memos for ``pg`` (None: the world group) gone (as in a new process)."""
    key = plancache.key(collectives.coordinator(pg or dist.group.WORLD, TIMEOUT))
    save.forget(key)
    plancache.forget(key)


def same_as_fresh(s: _worker.Session, name: str, state: Any, *others: str, pg: Any = None) -> None:
    """``name`` and ``others`` (saved with the memos) are what a save of ``state`` with none
    commits (on ``pg``, None: the world group)."""
    forget(pg)
    pg = pg or dist.group.WORLD
    sp.save(s.path(name + "-fresh"), state, process_group=pg, timeout=TIMEOUT)
    if s.rank == 0:  # recorded, not raised: the ranks stay in step for the next saves
        fresh = Path(s.path(name + "-fresh"))
        for got in (Path(s.path(n)) for n in (name, *others)):
            if manifest(got) != manifest(fresh):
                DIFFER.append(f"{got.name}: the manifest differs from a fresh save's")
            elif typed(sp.load(got, framework="numpy")) != typed(sp.load(fresh, framework="numpy")):
                DIFFER.append(f"{got.name}: the contents differ from a fresh save's")
            sp.verify(got)


def swapped(rank: int) -> int:
    return {1: 2, 2: 1}.get(rank, rank)


def expect(s: _worker.Session, name: str, fill: float) -> None:
    """Rank 0: ``name`` holds the arrays of ``fill`` (recorded in DIFFER if not)."""
    if s.rank == 0:
        got = sp.load(s.path(name), framework="numpy")
        want = np.arange(24, dtype=np.float32).reshape(8, 3) + np.float32(fill)
        if not np.array_equal(got["model"]["w"], want) or not np.array_equal(
            got["model"]["b"], np.full(3, 2.0 + fill, np.float32)
        ):
            DIFFER.append(f"{name}: not the arrays saved")


def scenario_markers(s: _worker.Session) -> None:
    r, w, pg = s.rank, s.world, dist.group.WORLD

    def saved(name: str, state: Any) -> None:
        sp.save(s.path(name), state, process_group=pg, timeout=TIMEOUT)

    def repeated() -> None:
        saved("g0", grid_state(r, w))
        saved("g1", grid_state(r, w))  # markers
        state = grid_state(r, w, coord=swapped(r), fill=1.0, step=True)  # swapped, new bytes
        saved("g2", state)
        same_as_fresh(s, "g2", state)
        saved("g2b", state)  # markers again, then rank 0 restarts (its memos gone)
        if r == 0:
            forget()
        state = grid_state(r, w, coord=swapped(r), fill=2.0)
        saved("g3", state)
        same_as_fresh(s, "g3", state)

    s.check("repeated saves", repeated)

    def background() -> None:
        """The async writer's thread runs the saves (and touches the memos) while the trainer
        changes its live state: each checkpoint holds its own snapshot."""
        live = [grid_state(r, w, fill=f, coord=swapped(r) if f == 5 else None) for f in (3, 4, 5)]
        with sp.AsyncCheckpointer(process_group=pg, timeout=TIMEOUT, writer="thread") as ck:
            for i, state in enumerate(live):
                pending = ck.save(s.path(f"a{i}"), state)
                state["model"]["b"] += 1000  # training goes on; the snapshot must not see it
                state["model"]["w"].local[...] += 1000
                pending.wait()
        for i, fill in enumerate((3, 4, 5)):
            expect(s, f"a{i}", fill)

    s.check("async saves", background)

    def subgroup() -> None:
        """Saves on the world group and on a group of ranks 0 and 1 in turn (the same keys,
        another world size: another memo key), each as a fresh save."""
        pair = dist.new_group([0, 1])
        for i in range(2):  # the second time round: markers on both groups
            saved(f"w{i}", grid_state(r, w, fill=float(i)))
            if r < 2:
                state = grid_state(r, 2, fill=10.0 + i)
                sp.save(s.path(f"p{i}"), state, process_group=pair, timeout=TIMEOUT)
        if r < 2:
            same_as_fresh(s, "p1", grid_state(r, 2, fill=11.0), pg=pair)
        same_as_fresh(s, "w1", grid_state(r, w, fill=1.0))

    s.check("a subgroup between", subgroup)

    groups: list[int] = []

    def regroup(rank: int) -> int:
        """A new world group over the same processes, this process at ``rank`` in it; returns
        the old group's id."""
        before = id(dist.group.WORLD)
        dist.destroy_process_group()
        groups.append(rank)
        init = "file://" + s.path(f"pg-store-{len(groups)}")
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=w)
        s.rank = dist.get_rank()
        return before

    def twice(name: str, fill: float) -> None:
        """Two saves of this rank's state (markers the second time), each as a fresh one."""
        state = grid_state(s.rank, w, fill=fill)
        for n in (name, name + "b"):
            sp.save(s.path(n), state, process_group=dist.group.WORLD, timeout=TIMEOUT)
            expect(s, n, fill)
        same_as_fresh(s, name, state, name + "b")
        sp.save(s.path(name + "c"), state, process_group=dist.group.WORLD, timeout=TIMEOUT)

    def new_group() -> None:
        """Ranks reversed: every process's memo key names another rank."""
        twice("m", 6.0)  # memos on every rank
        before = regroup(w - 1 - s.rank)
        twice("n", 6.0)
        # Nothing of the destroyed world is kept: its channels (gloo groups) and memo keys.
        assert all(k[0] == id(dist.group.WORLD) for k in channels._channels), "old channel"
        assert all(k[1] != before for k in plancache._used), "old memo key"

    s.check("a new group", new_group)

    def reused_key() -> None:
        """Ranks 1 and 2 swap processes, and the new group's memo keys are the old group's (as
        when the new group object takes the address of the old one): ranks 0 and 3 keep their
        memos (markers), 1 and 2 find none of theirs."""
        twice("o", 8.0)
        old = regroup({1: 2, 2: 1}.get(s.rank, s.rank))
        real = plancache.key

        def key(coord: Any) -> Any:
            k = real(coord)
            return (k[0], old, *k[2:]) if k is not None and k[0] == "torch" else k

        plancache.key = key  # type: ignore[assignment]
        try:
            twice("p", 8.0)
        finally:
            plancache.key = real  # type: ignore[assignment]

    s.check("a new group, the memo keys reused", reused_key)

    def compared() -> None:
        assert not DIFFER, DIFFER

    s.check("every checkpoint as a fresh save's", compared)


if __name__ == "__main__":
    _worker.main(globals())
