"""One rank of a peer-memory test session (launched by ``tests/distributed/_launch.py`` with
``worker=`` this file, never collected).

Usage: python _peers_worker.py SCENARIO RANK WORLD PORT WORKDIR

The environment says how the session is laid out: ``PEERS_NODES`` the node of each rank
(``a,a,b,b``: set as ``SAVEPOINT_NODE``, so two groups of ranks on one machine are two nodes),
``PEERS_TIMEOUT`` the tier's timeout, ``PEERS_STEPS`` the steps to save, ``PEERS_GRID=1`` a regular
state's rows (saved as manifest version 7 with ``PEERS_NO_FLAT=1``, which also makes a restore
receive every tensor straight into its target unless ``PEERS_STRAIGHT=0``), ``PEERS_KEYS=rep``
a restore of the replicated tensor alone, ``PEERS_GUESS_NONE`` a rank that fetches no index of a
version 7 checkpoint before it plans (as if the grid's writer rule failed). The run directory is
``WORKDIR/run``, the nodes' memory ``WORKDIR/mem``. Each scenario writes
``WORKDIR/SCENARIO-rank<RANK>.json`` (checks and data, as ``_worker.py`` does). The state of
each step is built from a seed and the step, so a restore is compared exactly with what that
step saved, and a checkpoint mixing two steps cannot pass.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))

import _worker as dw

import savepoint as sp
from savepoint.distributed import FlatShard, Shard
from savepoint.distributed.layout import Grid

STRAIGHT: list[int] = []  # per restore from peer memory: how many targets it filled straight
BARE: list[bool] = []  # (non-empty: this rank restores the step alone, no tensor)
INDEXES: list[str] = []  # every index file a restore from peer memory fetched (or linked)


def global_tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "rows": torch.randn(12, 6, generator=g) + step,
        "flat": torch.randn(40, generator=g) * (step + 1),
        "rep": torch.randn(5, generator=g) - step,
    }


def state(step: int, rank: int, world: int, *, empty: bool = False) -> dict[str, Any]:
    """This rank's part of step ``step``'s state (``empty``: zero-filled targets)."""
    g = global_tensors(step)

    def fill(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t.clone()

    rows = Shard.split(fill(dw.piece(g["rows"], 0, rank, world)), 0, rank, world, size=12)
    if os.environ.get("PEERS_GRID") == "1":  # a DTensor's Shard(0) on a 1-d mesh: a regular state
        grid = Grid((world,), (rank,), (0,))
        rows = Shard(rows.local, rows.global_shape, rows.offsets, grid=grid)
    start, stop = dw.bounds(40, rank, world)
    if os.environ.get("PEERS_NO_FLAT") == "1":  # (every tensor can be received straight)
        return {"model": {"rows": rows, "rep": fill(g["rep"])}, "step": -1 if empty else step}
    return {
        "model": {
            "rows": rows,
            "flat": FlatShard(fill(g["flat"][start:stop]), (40,), start),
            "rep": fill(g["rep"]),
        },
        "step": -1 if empty else step,
    }


def check(loaded: dict[str, Any], step: int, rank: int, world: int) -> None:
    """``loaded`` is exactly this rank's part of step ``step``."""
    want = state(step, rank, world)
    assert loaded["step"] == step, loaded["step"]
    for name in ("rows", "flat") if "flat" in want["model"] else ("rows",):
        got, expected = loaded["model"][name].local, want["model"][name].local
        assert torch.equal(got, expected), f"{name} differs from step {step}"
    assert torch.equal(loaded["model"]["rep"], want["model"]["rep"]), "rep"


def tier() -> Any:
    return sp.Tier.peers(
        memory_dir=os.environ["PEERS_MEM"],
        timeout=float(os.environ.get("PEERS_TIMEOUT", "10")),
        replicas=int(os.environ.get("PEERS_REPLICAS", "1")),
        budget=int(os.environ["PEERS_BUDGET"]) if "PEERS_BUDGET" in os.environ else None,
    )


def manager(s: dw.Session, **kwargs: Any) -> sp.CheckpointManager:
    return sp.CheckpointManager(
        s.path("run"),
        name="peers",
        tiers=[tier()],
        process_group=dist.group.WORLD,
        timeout=60,
        **kwargs,
    )


def restore(s: dw.Session, mgr: sp.CheckpointManager, label: str) -> None:
    """Restore the latest step into empty targets (``PEERS_KEYS=rep``: the replicated tensor
    only); record it, where from, the warnings, the index files fetched."""
    targets = state(0, s.rank, s.world, empty=True)
    if os.environ.get("PEERS_KEYS") == "rep":
        targets = {"model": {"rep": targets["model"]["rep"]}}
    if BARE:  # (no tensor: no index, no data file)
        targets = {"step": -1}
    started, before = time.monotonic(), len(INDEXES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = mgr.restore(targets, process_group=dist.group.WORLD, timeout=60, resume=False)
    assert step is not None
    if BARE:
        assert targets["step"] == step, targets
    elif os.environ.get("PEERS_KEYS") == "rep":
        assert torch.equal(targets["model"]["rep"], state(step, s.rank, s.world)["model"]["rep"])
    else:
        check(targets, step, s.rank, s.world)
    s.data[label] = {
        "step": step,
        "from": mgr.restored_from,
        "straight": STRAIGHT[-1] if STRAIGHT else 0,  # targets the last restore filled straight
        "seconds": time.monotonic() - started,
        "warnings": [str(w.message) for w in caught],
        "indexes": INDEXES[before:],
    }


# -- scenarios -----------------------------------------------------------------------------------


def scenario_save(s: dw.Session) -> None:
    """Save ``PEERS_STEPS`` and wait for their replication."""

    def run() -> None:
        t0 = time.monotonic()
        with manager(s, async_save=os.environ.get("PEERS_ASYNC") == "1") as mgr:
            for step in map(int, os.environ.get("PEERS_STEPS", "1,2").split(",")):
                mgr.save(step, state(step, s.rank, s.world))
            mgr.wait()
            last = mgr._saver.settle.peers.last  # (the outcome every rank agreed on)
            s.data["outcome"] = {
                "step": last.step,
                "complete": last.complete,
                "copies": last.copies,
                "seconds": last.seconds,
            }
            s.data["t"] = time.monotonic() - t0

    s.check("save", run)


def scenario_restore(s: dw.Session) -> None:
    """Restore the latest step (the test checks where from). ``PEERS_STALE=1``: first as the
    attempt torchrun then kills (a whole restore, its keys left in the job's store, which
    torchrun keeps across elastic restarts), then as the restarted attempt
    (``TORCHELASTIC_RESTART_COUNT=1``, savepoint's per-process state as a new process has it):
    the second must not read the first's documents and addresses."""
    if os.environ.get("PEERS_STALE") == "1":
        from savepoint.distributed import channels
        from savepoint.runs import _peer_wire

        def killed_attempt() -> None:
            mgr = manager(s, read_only=True)
            restore(s, mgr, "first attempt")
            mgr.close()
            dist.barrier()
            _peer_wire._wires.clear()  # (a new process: nothing counted, no channel)
            channels._channels.clear()
            channels._created.clear()
            os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"

        s.check("first attempt", killed_attempt)
    s.check("restore", lambda: restore(s, manager(s, read_only=True), "restored"))


def scenario_corrupt(s: dw.Session) -> None:
    """Restore twice: the test damaged copies in between (``PEERS_DAMAGE`` files, one line per
    restore, written by the test before each: rank 0 does the damage)."""

    def run() -> None:
        mgr = manager(s, read_only=True)
        for i, label in enumerate(("one copy damaged", "every copy damaged")):
            if s.rank == 0:  # (into a new file: the copy may be a link to the run directory's)
                for path in json.loads(os.environ["PEERS_DAMAGE"])[i]:
                    data = bytearray(Path(path).read_bytes())
                    data[-1] ^= 0xFF
                    Path(path + ".new").write_bytes(data)
                    os.replace(path + ".new", path)
            dist.barrier()
            restore(s, mgr, label)

    s.check("corrupt", run)


def scenario_stall(s: dw.Session) -> None:
    """A rank of ``PEERS_STALL`` stops answering: its sends hang (its process lives)."""
    from savepoint.runs import _peer_wire

    if s.rank == int(os.environ["PEERS_STALL"]):
        _peer_wire.Wire._send = lambda *_: time.sleep(3600)  # type: ignore[method-assign]
    s.check("stall", lambda: restore(s, manager(s, read_only=True), "restored"))


def scenario_garble(s: dw.Session) -> None:
    """Rank 0's first send of a data file has one byte flipped on the way (its file is intact):
    the receiver must refuse that copy, rank 0's own copy must still verify (its marker's digest
    hashed from the file, as no receiver vouched for those bytes), and the next step replicates
    whole."""
    from savepoint.runs import _peer_folder

    if s.rank == 0:
        chunk, flipped = _peer_folder.BlobSource.chunk, []

        def garbled(self: Any, start: int, end: int) -> Any:
            got = chunk(self, start, end)
            if not flipped and end - start > 64:
                flipped.append(start)
                got = got.copy()
                got[(end - start) // 2] ^= 0x10
            return got

        _peer_folder.BlobSource.chunk = garbled  # type: ignore[method-assign]

    def run() -> None:
        with manager(s) as mgr:
            mgr.save(1, state(1, s.rank, s.world))
            try:
                mgr.wait()
                s.data["error"] = None
            except sp.CheckpointError as exc:
                s.data["error"] = str(exc)
            last = mgr._saver.settle.peers.last
            s.data["copies"] = {str(p): sorted(n) for p, n in last.copies.items()}
            folder = mgr._saver.settle.peers.folder
            s.data["bad"] = {
                str(p): folder.verify(r, r.files) for p, r in folder.parts([1]).get(1, {}).items()
            }
            mgr.save(2, state(2, s.rank, s.world))
            mgr.wait()
            last = mgr._saver.settle.peers.last
            s.data["then"] = [last.step, last.complete, sorted(map(int, last.copies))]

    s.check("garble", run)


def scenario_garble_index(s: dw.Session) -> None:
    """Rank 0's first send of its index has one byte flipped after it was read and checked (its
    own copy is written from the same bytes): no copy of part 0 may be kept, and the next step
    replicates whole."""
    from savepoint.runs import _peer_folder

    if s.rank == 0:
        chunk, flipped = _peer_folder.BytesSource.chunk, []

        def garbled(self: Any, start: int, end: int) -> Any:
            got = chunk(self, start, end)
            if not flipped and bytes(got[:10]) == b'{"shards":':
                flipped.append(start)
                got = got.copy()
                got[len(got) // 2] ^= 0x01
            return got

        _peer_folder.BytesSource.chunk = garbled  # type: ignore[method-assign]

    def run() -> None:
        with manager(s) as mgr:
            for step in (1, 2):
                mgr.save(step, state(step, s.rank, s.world))
                try:
                    mgr.wait()
                    error = None
                except sp.CheckpointError as exc:
                    error = str(exc)
                last = mgr._saver.settle.peers.last
                copies = {str(p): sorted(n) for p, n in last.copies.items()}
                s.data[f"step {step}"] = [error, last.complete, copies]

    s.check("garble_index", run)


def scenario_garble_restore(s: dw.Session) -> None:
    """Restore twice (node a lost): rank 0 receives its files straight into its targets; the
    second time rank 1 flips one byte of the first data file it serves (its copy is intact).
    Records whether rank 0 received into targets, and each restore."""
    from savepoint.runs import _peer_folder, _peer_restore

    places = []
    place = _peer_restore._Into.place

    def counted(self: Any, at: int, n: int) -> Any:
        got = place(self, at, n)
        places.append(got[0] is not None)
        return got

    _peer_restore._Into.place = counted  # type: ignore[method-assign]

    def run() -> None:
        mgr = manager(s, read_only=True)
        restore(s, mgr, "clean")
        s.data["into targets"] = any(places)
        if s.rank == 1:
            chunk, flipped = _peer_folder.FileSource.chunk, []

            def garbled(self: Any, start: int, end: int) -> Any:
                got = chunk(self, start, end)
                data = os.path.basename(self.file.name).startswith("data-")
                if data and not flipped and end - start > 64:
                    flipped.append(start)
                    got = got.copy()
                    got[(end - start) // 2] ^= 0x10
                return got

            _peer_folder.FileSource.chunk = garbled  # type: ignore[method-assign]
        restore(s, mgr, "garbled")
        mgr.close()

    s.check("garble_restore", run)


def scenario_hostile(s: dw.Session) -> None:
    """Restore once per entry of ``PEERS_PLAN`` (JSON: ``label``; ``stall``: [rank, phase], that
    rank's sends hang in that fetch phase, ``indexes`` or ``files-again``; ``guess_none``: a rank
    that predicts no index; ``bare``: a rank that restores ``step`` alone; ``straight``: every
    target that can be received straight is; ``replace``: [folder,
    destination] pairs rank 0 copies first; ``damage``: files rank 0 damages first). Records each restore, and
    the fetch phases each went through."""
    from savepoint.runs import _peer_indexes, _peer_restore, _peer_wire

    now: dict[str, Any] = {"phase": "", "stall": None, "guess": False}
    send, fetch = _peer_wire.Wire._send, _peer_restore.PeerRestore._fetch
    predicted, average = _peer_indexes.Indexes._predicted, _peer_restore.DIRECT_AVERAGE
    phases: list[str] = []

    def stalling(self: Any, *args: Any) -> Any:
        if now["stall"] is not None and now["phase"].startswith(now["stall"]):
            time.sleep(3600)
        return send(self, *args)

    def noted(self: Any, choice: Any, wanted: Any, base: Any, what: str, *a: Any, **k: Any) -> Any:
        now["phase"] = what
        phases.append(what)
        return fetch(self, choice, wanted, base, what, *a, **k)

    def guess(self: Any) -> Any:
        return set() if now["guess"] else predicted(self)

    _peer_wire.Wire._send = stalling  # type: ignore[method-assign]
    _peer_restore.PeerRestore._fetch = noted  # type: ignore[method-assign]
    _peer_indexes.Indexes._predicted = guess  # type: ignore[method-assign]

    def run() -> None:
        mgr = manager(s, read_only=True)
        for entry in json.loads(os.environ["PEERS_PLAN"]):
            stall = entry.get("stall")
            now["stall"] = stall[1] if stall and stall[0] == s.rank else None
            now["guess"] = entry.get("guess_none") == s.rank
            BARE[:] = [True] if entry.get("bare") == s.rank else []
            _peer_restore.DIRECT_AVERAGE = 0 if entry.get("straight") else average
            if s.rank == 0:
                for src, dst in entry.get("replace", ()):  # (a folder prepared by the test)
                    shutil.rmtree(dst, ignore_errors=True)
                    shutil.copytree(src, dst)
                for path in entry.get("damage", ()):
                    data = bytearray(Path(path).read_bytes())
                    data[len(data) // 2] ^= 0xFF
                    Path(path + ".new").write_bytes(data)
                    os.replace(path + ".new", path)
            dist.barrier()
            del phases[:]
            restore(s, mgr, entry["label"])
            s.data[entry["label"]]["phases"] = list(phases)
        mgr.close()

    s.check("hostile", run)


def scenario_churn(s: dw.Session) -> None:
    """Save a new step every moment until killed (rank 0 marks each replicated step)."""
    with manager(s) as mgr:
        for step in range(1, 10_000):
            mgr.save(step, state(step, s.rank, s.world))
            mgr.wait()
            if s.rank == 0:
                Path(s.path(f"replicated-{step}")).touch()


def main() -> None:
    scenario, rank, world, port, workdir = sys.argv[1:6]
    torch.set_num_threads(1)
    r, w = int(rank), int(world)
    os.environ["SAVEPOINT_NODE"] = os.environ["PEERS_NODES"].split(",")[r]
    os.environ.setdefault("PEERS_MEM", os.path.join(workdir, "mem"))
    if os.environ.get("PEERS_NO_FLAT") == "1":  # (tiny tensors land straight in the targets too)
        from savepoint.runs import _peer_restore

        if os.environ.get("PEERS_STRAIGHT") != "0":  # ("0": the loader reads them, as by default)
            _peer_restore.DIRECT_AVERAGE = 0
        sinks = _peer_restore._sinks

        def counted(direct: Any) -> Any:
            STRAIGHT.append(len(direct))
            return sinks(direct)

        _peer_restore._sinks = counted
    from savepoint.runs import _peer_restore

    fetch = _peer_restore.PeerRestore._fetch

    def counted_fetch(self: Any, choice: Any, wanted: list[str], *args: Any, **kw: Any) -> Any:
        INDEXES.extend(n for n in wanted if n.startswith("index-r"))  # (any round: "files" too)
        return fetch(self, choice, wanted, *args, **kw)

    _peer_restore.PeerRestore._fetch = counted_fetch  # type: ignore[method-assign]
    if os.environ.get("PEERS_GUESS_NONE") == rank:  # (as if the grid's writer rule failed here)
        from savepoint.runs import _peer_indexes

        _peer_indexes.Indexes._predicted = lambda self: set()  # type: ignore[method-assign]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=w)
    s = dw.Session(scenario, r, w, workdir)
    try:
        globals()[f"scenario_{scenario}"](s)
    except BaseException:
        s.checks["scenario"] = "FAIL " + traceback.format_exc()
    s.write()
    dist.barrier()  # (rank 0 hosts the store: it leaves last)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
