"""One rank of a multi-process test session (launched by ``_launch.py``, never collected).

Usage: python _worker.py SCENARIO RANK WORLD PORT WORKDIR

Joins a gloo process group on 127.0.0.1:PORT, runs SCENARIO (a function below), and writes
``WORKDIR/SCENARIO-rank<RANK>.json``: ``{"checks": {name: "ok" | "FAIL ..."}, "data": {...}}``.
Each check runs independently so one failure does not hide the others; the parent test asserts
every check is "ok". The global tensors are rebuilt from a seed on every rank (and by the tests),
so every load is compared exactly against what was saved.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import savepoint as sp
from savepoint.distributed import FlatShard, Partitioned, Shard
from savepoint.errors import DistributedCheckpointError

ZERO_KEYS = [f"p{i}" for i in range(5)]


def global_tensors() -> dict[str, Any]:
    """Every tensor of the test state, whole (the same on every rank and in the tests)."""
    g = torch.Generator().manual_seed(1234)
    return {
        "rep": torch.randn(7, 5, generator=g),
        "rep_bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "scalar": torch.randn((), generator=g),
        "tp0": torch.randn(10, 6, generator=g),
        "tp1": torch.randn(4, 9, generator=g).to(torch.float64),
        "fsdp": torch.randn(5, 7, generator=g),
        "dt0": torch.randn(9, 3, generator=g),
        "dt1": torch.randn(3, 8, generator=g),
        "zero": {k: torch.randn(i + 2, 3, generator=g) for i, k in enumerate(ZERO_KEYS)},
    }


def bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    return FlatShard.bounds(n, rank, world)


def piece(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    start, stop = bounds(t.shape[dim], rank, world)
    return t.narrow(dim, start, stop - start).clone()


def state(rank: int, world: int, *, mesh: Any = None, empty: bool = False) -> dict[str, Any]:
    """This rank's part of the test state (``empty``: zero-filled load targets of the same
    layout). With a device ``mesh`` the dt* tensors are DTensors, otherwise Shards."""
    g = global_tensors()

    def fill(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t

    def split(name: str, dim: int) -> Any:
        t = g[name]
        return Shard.split(fill(piece(t, dim, rank, world)), dim, rank, world, size=t.shape[dim])

    def dtensor(name: str, dim: int) -> Any:
        if mesh is None:
            return split(name, dim)
        from torch.distributed.tensor import Shard as Placement
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(fill(g[name].clone()), mesh, [Placement(dim)])

    flat = g["fsdp"].reshape(-1)
    start, stop = bounds(flat.numel(), rank, world)
    return {
        "model": {
            "rep": fill(g["rep"].clone()),
            "rep_bf16": fill(g["rep_bf16"].clone()),
            "scalar": fill(g["scalar"].clone()),
            "tp0": split("tp0", 0),
            "tp1": split("tp1", 1),
            "fsdp": FlatShard(fill(flat[start:stop].clone()), g["fsdp"].shape, start),
            "dt0": dtensor("dt0", 0),
            "dt1": dtensor("dt1", 1),
        },
        "optim": Partitioned(
            {k: fill(g["zero"][k].clone()) for i, k in enumerate(ZERO_KEYS) if i % world == rank}
        ),
        "step": 0 if empty else 100,
        "name": "" if empty else "test-run",
    }


def local_of(target: Any) -> torch.Tensor:
    if isinstance(target, (Shard, FlatShard)):
        return target.local
    if type(target).__name__ == "DTensor":
        return target.to_local()
    return target


def check_state(loaded: dict[str, Any], rank: int, world: int) -> None:
    """``loaded`` (targets filled by a load) equals this rank's part of the saved state."""
    want = state(rank, world)
    for name, target in loaded["model"].items():
        got, expected = local_of(target), local_of(want["model"][name])
        if type(target).__name__ == "DTensor":
            dim = 0 if name == "dt0" else 1
            expected = piece(global_tensors()[name], dim, rank, world)
        assert got.dtype == expected.dtype, (name, got.dtype, expected.dtype)
        assert torch.equal(got, expected), f"{name}: differs"
    assert set(loaded["optim"].mapping) == set(want["optim"].mapping)
    for k, t in loaded["optim"].mapping.items():
        assert torch.equal(t, want["optim"].mapping[k]), f"optim/{k}"
    assert loaded["step"] == 100 and loaded["name"] == "test-run"


def check_whole(tree: dict[str, Any]) -> None:
    """A load without targets returns every tensor whole."""
    g = global_tensors()
    for name in ("rep", "rep_bf16", "scalar", "tp0", "tp1", "fsdp", "dt0", "dt1"):
        assert torch.equal(tree["model"][name], g[name]), name
    for k in ZERO_KEYS:
        assert torch.equal(tree["optim"][k], g["zero"][k]), k
    assert tree["step"] == 100


# ---------------------------------------------------------------------------------------------


class Session:
    def __init__(self, scenario: str, rank: int, world: int, workdir: str) -> None:
        self.scenario, self.rank, self.world, self.workdir = scenario, rank, world, workdir
        self.checks: dict[str, str] = {}
        self.data: dict[str, Any] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def check(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException:
            self.checks[name] = "FAIL " + traceback.format_exc()
        else:
            self.checks[name] = "ok"

    def write(self) -> None:
        out = os.path.join(self.workdir, f"{self.scenario}-rank{self.rank}.json")
        with open(out + ".tmp", "w") as f:
            json.dump({"checks": self.checks, "data": self.data}, f)
        os.replace(out + ".tmp", out)


def mesh_for(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def save_and_load(s: Session, pg: Any, ranks: list[int], name: str, mesh: Any = None) -> None:
    """Save the test state on the ranks of ``pg`` to checkpoint ``name``."""
    world, rank = len(ranks), ranks.index(dist.get_rank())
    info = sp.save(s.path(name), state(rank, world, mesh=mesh), process_group=pg, timeout=60)
    assert info.world_size == world, info.world_size
    s.data[f"saved {name}"] = info.total_bytes


def load_into(s: Session, pg: Any, ranks: list[int], name: str, mesh: Any = None) -> None:
    world, rank = len(ranks), ranks.index(dist.get_rank())
    targets = state(rank, world, mesh=mesh, empty=True)
    result = sp.load(s.path(name), into=targets, process_group=pg, timeout=60)
    assert result is targets
    check_state(targets, rank, world)


def expect_failure(
    fn: Callable[[], Any], *, ranks: list[int], words: list[str], within: float | None = None
) -> dict[str, Any]:
    start = time.monotonic()
    error: DistributedCheckpointError | None = None
    try:
        fn()
    except DistributedCheckpointError as exc:
        error = exc
    elapsed = time.monotonic() - start
    assert error is not None, "no DistributedCheckpointError was raised"
    assert list(error.ranks) == ranks, (error.ranks, str(error))
    for w in words:
        assert w in str(error), (w, str(error))
    if within is not None:
        assert elapsed < within, elapsed
    return {"elapsed": elapsed, "message": str(error)}


# -- scenarios ---------------------------------------------------------------------------------


def scenario_main2(s: Session) -> None:
    """World 2: save with every strategy, load 2 -> 2 (DTensors too) and 2 -> 1, manager and
    background saves, and failures that must reach every rank."""
    world, rank = s.world, s.rank
    everyone = list(range(world))
    mesh = mesh_for(world)
    pg = dist.group.WORLD
    s.check("save 2", lambda: save_and_load(s, pg, everyone, "ckpt2", mesh))
    s.check("load 2->2 dtensor", lambda: load_into(s, pg, everyone, "ckpt2", mesh))
    s.check("load 2->2 shards", lambda: load_into(s, pg, everyone, "ckpt2"))
    solo = [dist.new_group([r]) for r in everyone]  # every rank creates every group
    s.check("load 2->1", lambda: load_into(s, solo[rank], [rank], "ckpt2"))

    def whole() -> None:
        check_whole(sp.load(s.path("ckpt2"), process_group=pg, timeout=60))

    s.check("load whole with group", whole)

    def module() -> None:
        # A module whose parameters are DTensors (row-sharded weight, replicated bias), saved
        # and restored through its state_dict like any Stateful.
        from torch.distributed.tensor import Replicate, distribute_tensor
        from torch.distributed.tensor import Shard as Placement

        def build(seed: int) -> torch.nn.Module:
            torch.manual_seed(seed)
            m = torch.nn.Linear(4, 7)
            m.weight = torch.nn.Parameter(distribute_tensor(m.weight.data, mesh, [Placement(0)]))
            m.bias = torch.nn.Parameter(distribute_tensor(m.bias.data, mesh, [Replicate()]))
            return m

        saved = build(1)
        sp.save(s.path("module"), {"m": saved}, process_group=pg)
        fresh = build(2)
        sp.load(s.path("module"), into={"m": fresh}, process_group=pg)
        for name in ("weight", "bias"):
            a, b = getattr(saved, name), getattr(fresh, name)
            assert torch.equal(a.to_local(), b.to_local()), name
        whole = sp.load(s.path("module"))["m"]
        torch.manual_seed(1)
        reference = torch.nn.Linear(4, 7)
        assert torch.equal(whole["weight"], reference.weight.data)
        assert torch.equal(whole["bias"], reference.bias.data)
        stateful = sp.inspect(s.path("module")).stateful
        assert stateful == {"m": "torch.nn.modules.linear.Linear"}, stateful

    s.check("module with DTensor parameters", module)

    def manager() -> None:
        # Every rank saves its part in the background; rank 0 alone keeps the run's books
        # (report, latest/best aliases, retention).
        mgr = sp.CheckpointManager(
            s.path("run"), keep_last=2, process_group=pg, timeout=60, async_save=True
        )
        for step in (1, 2, 3):
            st = state(rank, world)
            st["step"] = 100
            mgr.save(step, st, metrics={"loss": 1.0 / step})
        mgr.close()
        dist.barrier()
        if rank == 0:
            with open(s.path("run/report.json")) as f:
                report = json.load(f)
            assert report["checkpoints"] == [3, 2], report["checkpoints"]
            assert sp.verify(s.path("run/latest")).metadata["savepoint_run"]["step"] == 3
        targets = state(rank, world, empty=True)
        restored = sp.CheckpointManager(s.path("run"), aliases=False, read_only=True).restore(
            targets, process_group=pg, timeout=60, resume=False
        )
        assert restored == 3, restored
        check_state(targets, rank, world)
        assert sorted(os.listdir(s.path("run/checkpoints"))) == [
            "step-0000000002",
            "step-0000000003",
        ]

    s.check("manager sync", manager)

    def tiers() -> None:
        # Every rank writes its part in the run directory; rank 0 copies each committed
        # checkpoint up to the tier. A new run directory of the same run restores from the tier
        # on every rank (the machine and its run directory lost).
        tier = sp.Tier(s.path("tier"), name="disk")
        with sp.CheckpointManager(
            s.path("tiered"), name="tiered", process_group=pg, timeout=60, tiers=[tier]
        ) as m:
            for step in (1, 2):
                m.save(step, state(rank, world))
        dist.barrier()  # rank 0's close() waited for the copy-ups
        targets = state(rank, world, empty=True)
        with sp.CheckpointManager(
            s.path("tiered-elsewhere"), name="tiered", process_group=pg, timeout=60, tiers=[tier]
        ) as fresh:
            restored = fresh.restore(targets, process_group=pg, timeout=60, resume=False)
            assert (restored, fresh.restored_from) == (2, "disk"), (restored, fresh.restored_from)
        check_state(targets, rank, world)

    s.check("manager with a tier", tiers)

    def background() -> None:
        live = state(rank, world)
        with sp.AsyncCheckpointer(process_group=pg, timeout=60) as ck:
            pending = ck.save(s.path("async"), live)
            for t in (live["model"]["rep"], local_of(live["model"]["tp0"])):
                t.add_(1000)  # training goes on; the snapshot must not see it
            pending.wait()
        targets = state(rank, world, empty=True)
        sp.load(s.path("async"), into=targets, process_group=pg)
        check_state(targets, rank, world)

    s.check("background save", background)

    # --- failures: the group survives them, every rank raises the same error -------------------
    before = os.listdir(s.workdir)

    def raising() -> None:
        from savepoint.distributed import save as dsave

        real = dsave.write_pieces

        def failing(*args: Any, **kwargs: Any) -> Any:
            if rank == 1:
                raise RuntimeError("injected write failure")
            return real(*args, **kwargs)

        dsave.write_pieces = failing  # type: ignore[assignment]
        try:
            s.data["raising"] = expect_failure(
                lambda: sp.save(s.path("ckpt2"), state(rank, world), process_group=pg),
                ranks=[1],
                words=["rank 1", "injected write failure"],
            )
        finally:
            dsave.write_pieces = real  # type: ignore[assignment]
        dist.barrier()
        check_whole(sp.load(s.path("ckpt2")))  # the previous checkpoint is intact
        assert sorted(os.listdir(s.workdir)) == sorted(before), "staging left behind"

    s.check("rank raising mid-save", raising)

    def missing_key() -> None:
        st = state(rank, world)
        if rank == 1:
            del st["model"]["rep"]
        s.data["missing key"] = expect_failure(
            lambda: sp.save(s.path("ckpt2"), st, process_group=pg),
            ranks=[1],
            words=["model/rep", "missing on rank 1"],
        )
        dist.barrier()
        check_whole(sp.load(s.path("ckpt2")))

    s.check("key missing on one rank", missing_key)

    def mismatched() -> None:
        st = state(rank, world)
        if rank == 1:
            st["model"]["rep"] = st["model"]["rep"].double()
        expect_failure(
            lambda: sp.save(s.path("bad"), st, process_group=pg),
            ranks=[1],
            words=["model/rep", "disagree", "F64"],
        )

    s.check("dtype differs between ranks", mismatched)

    def overlapping() -> None:
        st = state(rank, world)
        t = global_tensors()["tp0"]
        rows = (0, 6) if rank == 0 else (4, 10)  # rows 4 and 5 on both ranks
        st["model"]["tp0"] = Shard(t[rows[0] : rows[1]].clone(), t.shape, (rows[0], 0))
        expect_failure(
            lambda: sp.save(s.path("bad"), st, process_group=pg),
            ranks=[0, 1],
            words=["model/tp0", "overlap"],
        )

    s.check("overlapping shards", overlapping)

    def load_mismatch() -> None:
        targets = state(rank, world, empty=True)
        if rank == 0:
            targets["model"]["rep"] = torch.zeros(8, 5)
        expect_failure(
            lambda: sp.load(s.path("ckpt2"), into=targets, process_group=pg),
            ranks=[0],
            words=["model/rep", "shape [7, 5] in the checkpoint"],
        )
        # Nothing was modified on any rank.
        assert all(float(local_of(t).abs().sum()) == 0 for t in targets["model"].values())

    s.check("load mismatch on one rank", load_mismatch)


def scenario_main4(s: Session) -> None:
    """World 4 (after main2): save on 4 and on 3 ranks; load 4 -> 4, 2 -> 4, 4 -> 3, 2 -> 3,
    4 -> 2, 3 -> 2 and 4 -> 1 (subgroups of the world are real process groups)."""
    world, rank = s.world, s.rank
    everyone = list(range(world))
    mesh = mesh_for(world)
    pg = dist.group.WORLD
    g3, g2, g1 = dist.new_group([0, 1, 2]), dist.new_group([0, 1]), dist.new_group([0])
    s.check("save 4", lambda: save_and_load(s, pg, everyone, "ckpt4", mesh))
    s.check("load 4->4 dtensor", lambda: load_into(s, pg, everyone, "ckpt4", mesh))
    s.check("load 2->4 dtensor", lambda: load_into(s, pg, everyone, "ckpt2", mesh))
    if rank < 3:
        s.check("save 3", lambda: save_and_load(s, g3, [0, 1, 2], "ckpt3"))
        s.check("load 4->3", lambda: load_into(s, g3, [0, 1, 2], "ckpt4"))
        s.check("load 2->3", lambda: load_into(s, g3, [0, 1, 2], "ckpt2"))
    dist.barrier()
    if rank < 2:
        s.check("load 4->2", lambda: load_into(s, g2, [0, 1], "ckpt4"))
        s.check("load 3->2", lambda: load_into(s, g2, [0, 1], "ckpt3"))
    if rank == 0:
        s.check("load 4->1", lambda: load_into(s, g1, [0], "ckpt4"))
        s.check("load 3->1", lambda: load_into(s, g1, [0], "ckpt3"))
    dist.barrier()


def scenario_kill(s: Session) -> None:
    """World 3: a good save, then rank 1 dies in the middle of writing its files."""
    rank, world = s.rank, s.world
    pg = dist.group.WORLD
    s.check("previous save", lambda: save_and_load(s, pg, list(range(world)), "ckpt"))

    from savepoint.distributed import save as dsave

    real = dsave.write_pieces

    def dying(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            real(*args, **kwargs)  # its files are written: die before reporting
            s.write()
            os._exit(17)
        return real(*args, **kwargs)

    dsave.write_pieces = dying  # type: ignore[assignment]
    s.data["timeout"] = 20

    def killed() -> None:
        s.data["killed"] = expect_failure(
            lambda: sp.save(s.path("ckpt"), state(rank, world), process_group=pg, timeout=20),
            ranks=[1],
            words=["rank 1 did not finish its part", "within 20 s"],
            within=20 + 5,
        )

    s.check("rank killed mid-save", killed)


def scenario_hang(s: Session) -> None:
    """World 2: rank 1 stops answering in the middle of a save; rank 0 must give up in time."""
    rank = s.rank
    pg = dist.group.WORLD
    s.check("previous save", lambda: save_and_load(s, pg, [0, 1], "ckpt"))
    from savepoint.distributed import save as dsave

    real = dsave.write_pieces

    def hanging(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            s.write()
            time.sleep(60)
            os._exit(0)
        return real(*args, **kwargs)

    dsave.write_pieces = hanging  # type: ignore[assignment]

    def hung() -> None:
        s.data["hung"] = expect_failure(
            lambda: sp.save(s.path("ckpt"), state(rank, 2), process_group=pg, timeout=4),
            ranks=[1],
            words=["rank 1 did not finish its part", "within 4 s"],
            within=4 + 6,
        )

    s.check("rank hanging mid-save", hung)


def scenario_s3(s: Session) -> None:
    """World 2, every checkpoint in the moto S3 bucket named by SAVEPOINT_TEST_S3_ROOT: each rank
    uploads its own part, rank 0 puts the manifest last; loads 2 -> 2, 2 -> 1 and whole; a run
    with retention and pointer aliases; a background save; a rank whose uploads fail gives one
    error on every rank, and no manifest; incremental saves and a run with blobs in the bucket."""
    world, rank = s.world, s.rank
    root = os.environ["SAVEPOINT_TEST_S3_ROOT"]
    everyone = list(range(world))
    pg = dist.group.WORLD
    s.path = lambda name: f"{root}/{name}"  # type: ignore[method-assign]
    s.check("save 2", lambda: save_and_load(s, pg, everyone, "ckpt"))
    s.check("load 2->2 shards", lambda: load_into(s, pg, everyone, "ckpt"))
    solo = [dist.new_group([r]) for r in everyone]
    s.check("load 2->1", lambda: load_into(s, solo[rank], [rank], "ckpt"))
    s.check(
        "load whole with group",
        lambda: check_whole(sp.load(s.path("ckpt"), process_group=pg, timeout=60)),
    )

    def manager() -> None:
        with sp.CheckpointManager(s.path("run"), keep_last=2, process_group=pg, timeout=60) as m:
            for step in (1, 2, 3):
                m.save(step, state(rank, world))
        dist.barrier()  # rank 0 prunes after every rank has written its part
        if rank == 0:
            assert sp.open_run(s.path("run")).steps() == [2, 3]
        targets = state(rank, world, empty=True)
        restored = sp.CheckpointManager(s.path("run"), read_only=True).restore(
            targets, process_group=pg, timeout=60, resume=False
        )
        assert restored == 3, restored
        check_state(targets, rank, world)
        dist.barrier()
        if rank == 0:
            latest = sp.inspect(s.path("run/latest"))
            assert latest.metadata["savepoint_run"]["step"] == 3
            assert latest.world_size == world

    s.check("manager", manager)

    def background() -> None:
        # The thread writer, and the writer process (it makes the bucket's store from the URL
        # and the environment it inherits, and uploads this rank's pieces from the arena).
        for writer in ("thread", "process"):
            live = state(rank, world)
            with sp.AsyncCheckpointer(process_group=pg, timeout=60, writer=writer) as ck:
                pending = ck.save(s.path(f"async-{writer}"), live)
                live["model"]["rep"].add_(1000)  # training goes on; the snapshot must not see it
                pending.wait()
            targets = state(rank, world, empty=True)
            sp.load(s.path(f"async-{writer}"), into=targets, process_group=pg)
            check_state(targets, rank, world)

    s.check("background save", background)

    def failing_uploads() -> None:
        import errno

        from savepoint.storage import objectstore

        real = objectstore.ObjectStore.create_blob

        def failing(self: Any, path: str, **kwargs: Any) -> Any:
            if rank == 1:
                raise OSError(errno.EIO, "injected upload failure", path)
            return real(self, path, **kwargs)

        objectstore.ObjectStore.create_blob = failing  # type: ignore[method-assign]
        try:
            s.data["failing"] = expect_failure(
                lambda: sp.save(s.path("ckpt"), state(rank, world), process_group=pg, timeout=60),
                ranks=[1],
                words=["rank 1", "injected upload failure"],
            )
        finally:
            objectstore.ObjectStore.create_blob = real  # type: ignore[method-assign]
        dist.barrier()
        check_whole(sp.load(s.path("ckpt")))  # the previous checkpoint is intact
        store = objectstore.shared("s3")
        target = store.abspath(s.path("ckpt").split("://", 1)[1])
        generations = [n for n in store.list(target) if n.startswith("gen-")]
        assert len(generations) == 1, generations  # the failed attempt's prefix is gone

    s.check("rank failing its uploads", failing_uploads)

    def incremental() -> None:
        # Blobs in the bucket: each rank puts its pieces, the manifest commits as a create-only
        # put in a generation of the checkpoint; a second save writes only the changed chunk.
        from savepoint.blobs import BlobPolicy, BlobStore

        policy = BlobPolicy(**INC_POLICY_ARGS)
        store = BlobStore.open(s.path("blobs"))
        written = []
        for version in (1, 2):
            before = set(store.list())
            sp.save(
                s.path(f"inc-v{version}"),
                inc_state(rank, world, version),
                process_group=pg,
                timeout=60,
                blobs=s.path("blobs"),
                blob_policy=policy,
            )
            dist.barrier()
            written.append(len(set(store.list()) - before))
        assert written == [34, 1], written
        for version in (1, 2):
            targets = inc_state(rank, world, version, empty=True)
            sp.load(s.path(f"inc-v{version}"), into=targets, process_group=pg, timeout=60)
            inc_check(targets, rank, world, version)
        inc_check_whole(sp.load(s.path("inc-v2")), 2)
        with sp.CheckpointManager(
            s.path("inc-run"), incremental=True, blob_policy=policy, keep_last=1, process_group=pg
        ) as m:
            for step in (1, 2, 3):
                m.save(step, inc_state(rank, world, step))
        dist.barrier()
        targets = inc_state(rank, world, 3, empty=True)
        restored = sp.CheckpointManager(s.path("inc-run"), read_only=True).restore(
            targets, process_group=pg, timeout=60, resume=False
        )
        assert restored == 3, restored
        inc_check(targets, rank, world, 3)
        if rank == 0:
            run_blobs = BlobStore.open(s.path("inc-run/blobs"))
            assert len(set(run_blobs.list())) == 34  # step 3's chunks only
        dist.barrier()

    s.check("incremental saves", incremental)


# -- incremental (blob) saves --------------------------------------------------------------------

# Chunks only (row patches of sharded pieces are tested in test_incremental_local.py and by
# the "manager saves with row patches" check below).
INC_POLICY_ARGS = {"chunk_size": 4096, "min_blob_bytes": 4096, "workers": 1, "patches": False}
INC_ROWS = 128  # rows of "emb", 512 bytes each: a 4 KiB chunk holds 8 rows


def inc_tensors(version: int) -> dict[str, Any]:
    """The whole tensors of incremental save ``version`` (1, 2, ...): version v changes 2 rows of
    "emb" (in one 4 KiB chunk of rank 0's shard) and nothing else."""
    g = torch.Generator().manual_seed(99)
    emb = torch.randn(INC_ROWS, 128, generator=g)
    for v in range(2, version + 1):
        row = 8 * (v - 2) + 2  # rows 2-3 at v=2, 10-11 at v=3, ...: one chunk each
        emb[row : row + 2] += float(v)
    return {
        "emb": emb,  # row-sharded: 32 KiB per shard on 2 ranks
        "cols": torch.randn(48, 64, generator=g),  # column-sharded: 6 KiB per shard
        "flat": torch.randn(3000, generator=g).double(),  # FSDP-style flat ranges
        "rep": torch.randn(32, 64, generator=g),  # replicated (8 KiB): one rank writes it
        "bias": torch.randn(10, generator=g),  # small: stays in a data file
        "zero": {k: torch.randn(40, 32, generator=g) for k in ZERO_KEYS[:3]},
    }


def inc_state(rank: int, world: int, version: int, *, empty: bool = False) -> dict[str, Any]:
    g = inc_tensors(version)

    def fill(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t.clone()

    flat = g["flat"]
    start, stop = bounds(flat.numel(), rank, world)
    return {
        "emb": Shard.split(fill(piece(g["emb"], 0, rank, world)), 0, rank, world, size=INC_ROWS),
        "cols": Shard.split(fill(piece(g["cols"], 1, rank, world)), 1, rank, world, size=64),
        "flat": FlatShard(fill(flat[start:stop]), flat.shape, start),
        "rep": fill(g["rep"]),
        "bias": fill(g["bias"]),
        "zero": Partitioned(
            {k: fill(t) for i, (k, t) in enumerate(g["zero"].items()) if i % world == rank}
        ),
        "version": 0 if empty else version,
    }


def inc_check(loaded: dict[str, Any], rank: int, world: int, version: int) -> None:
    want = inc_state(rank, world, version)
    for name in ("emb", "cols", "flat", "rep", "bias"):
        got, expected = local_of(loaded[name]), local_of(want[name])
        assert got.dtype == expected.dtype and torch.equal(got, expected), f"{name} differs"
    assert set(loaded["zero"].mapping) == set(want["zero"].mapping)
    for k, t in loaded["zero"].mapping.items():
        assert torch.equal(t, want["zero"].mapping[k]), f"zero/{k}"
    assert loaded["version"] == version, loaded["version"]


def inc_check_whole(tree: dict[str, Any], version: int) -> None:
    g = inc_tensors(version)
    for name in ("emb", "cols", "flat", "rep", "bias"):
        assert torch.equal(tree[name], g[name]), name
    for k, t in g["zero"].items():
        assert torch.equal(tree["zero"][k], t), k
    assert tree["version"] == version


def blob_files(root: str) -> dict[str, int]:
    """Every blob in the store at ``root``: digest -> bytes on disk."""
    out = {}
    data = os.path.join(root, "data")
    for fan in os.listdir(data) if os.path.isdir(data) else ():
        for name in os.listdir(os.path.join(data, fan)):
            out[name] = os.path.getsize(os.path.join(data, fan, name))
    return out


def referenced(paths: list[str]) -> set[str]:
    from savepoint.codecs import manifest as mf

    found: set[str] = set()
    for path in paths:
        with open(os.path.join(path, "manifest.json"), "rb") as f:
            for recipe in mf.recipes(mf.parse(f.read())):
                found.update(recipe.names())
    return found


def scenario_incremental3(s: Session) -> None:
    """World 3: ranks 0 and 1 save incrementally twice into one blob store (the second save
    writes only the changed chunk); loads 2 -> 2, 2 -> 3 (uneven), 2 -> 1 and whole, verify and
    inspect; then a manager with keep_last and blobs on ranks 0 and 1."""
    from savepoint.blobs import BlobPolicy, SaveSession

    rank = s.rank
    pg2 = dist.new_group([0, 1])
    solo = [dist.new_group([r]) for r in range(s.world)]
    if rank == 1:
        # Rank 1 is slow to close its sessions: rank 0 must still find none open when its save
        # returns, and its collections (the manager's retention) must not be deferred by them.
        real_close = SaveSession.close

        def slow_close(self: SaveSession) -> None:
            if self._open:
                time.sleep(0.3)
            real_close(self)

        SaveSession.close = slow_close  # type: ignore[method-assign]
    policy = BlobPolicy(**INC_POLICY_ARGS)
    blobs = s.path("inc/blobs")

    def synced(fn: Callable[[], None]) -> Callable[[], None]:
        # Every rank passes the barrier after ``fn``, failed or not: the next check starts
        # together (a failed check never turns into a hang).
        def run() -> None:
            try:
                fn()
            finally:
                dist.barrier()

        return run

    def save(version: int) -> None:
        if rank < 2:
            st = inc_state(rank, 2, version)
            info = sp.save(
                s.path(f"inc/v{version}"),
                st,
                process_group=pg2,
                timeout=60,
                blobs=blobs,
                blob_policy=policy,
            )
            assert info.format_version == 4 and info.world_size == 2, info
            sessions = os.listdir(os.path.join(blobs, "sessions"))
            # Every rank's session is closed when save returns (on rank 0: all of them).
            assert rank != 0 or sessions == [], sessions

    before: dict[str, int] = {}

    def first() -> None:
        synced(lambda: save(1))()
        before.update(blob_files(blobs))
        s.data["first blobs"] = [len(before), sum(before.values())]

    def second() -> None:
        synced(lambda: save(2))()
        after = blob_files(blobs)
        new = {d: n for d, n in after.items() if d not in before}
        s.data["second blobs"] = [len(new), sum(new.values())]
        assert set(before) <= set(after)
        # Only the changed chunk of rank 0's "emb" shard was written: one 4 KiB blob (and its
        # 32-byte header).
        assert list(new.values()) == [4096 + 32], new
        with open(s.path("inc/v2/manifest.json")) as f:
            manifest = json.load(f)
        data = sum(f["size"] for f in manifest["files"].values())
        assert data < 1024, manifest["files"]  # only "bias" is in a data file

    s.check("incremental save 1", first)
    s.check("incremental save 2 writes only the changed chunk", second)

    def load_into(version: int, pg: Any, ranks: list[int]) -> None:
        if rank in ranks:
            world, r = len(ranks), ranks.index(rank)
            targets = inc_state(r, world, version, empty=True)
            sp.load(s.path(f"inc/v{version}"), into=targets, process_group=pg, timeout=60)
            inc_check(targets, r, world, version)

    s.check("load 2->2", synced(lambda: load_into(2, pg2, [0, 1])))
    s.check("load 2->3", synced(lambda: load_into(2, dist.group.WORLD, [0, 1, 2])))
    s.check("load 2->1", synced(lambda: load_into(2, solo[0], [0])))
    s.check("load first 2->3", synced(lambda: load_into(1, dist.group.WORLD, [0, 1, 2])))

    def whole() -> None:
        if rank == 2:
            for version in (1, 2):
                inc_check_whole(sp.load(s.path(f"inc/v{version}")), version)
                info = sp.verify(s.path(f"inc/v{version}"))
                assert info.world_size == 2 and info.format_version == 4
                shards = {t.key: t.shards for t in sp.inspect(s.path(f"inc/v{version}")).tensors}
                assert shards["emb"] == 2 and shards["rep"] == 1, shards

    s.check("whole, verify, inspect", synced(whole))

    def manager_checks(run: str, background: bool, label: str, pol: Any = policy) -> None:
        def manager_saves() -> None:
            if rank < 2:
                mgr = sp.CheckpointManager(
                    run,
                    incremental=True,
                    blob_policy=pol,
                    keep_last=2,
                    process_group=pg2,
                    timeout=60,
                    async_save=background,
                )
                for step in (1, 2, 3, 4):
                    mgr.save(step, inc_state(rank, 2, step), metrics={"loss": 1.0 / step})
                mgr.close()

        def manager_blobs() -> None:
            if rank == 0:
                steps = sorted(os.listdir(os.path.join(run, "checkpoints")))
                assert steps == ["step-0000000003", "step-0000000004"], steps
                kept = [os.path.join(run, "checkpoints", name) for name in steps]
                kept += [os.path.join(run, alias) for alias in ("latest", "best")]
                on_disk = set(blob_files(os.path.join(run, "blobs")))
                wanted = referenced([k for k in kept if os.path.isdir(k)])
                assert on_disk == wanted, (len(on_disk - wanted), len(wanted - on_disk))
                assert os.listdir(os.path.join(run, "blobs", "sessions")) == []
                s.data["run blobs"] = len(on_disk)

        def manager_restores() -> None:
            # Every retained checkpoint restores bit-exactly, on 2 ranks and whole on rank 2.
            for step in (3, 4):
                path = os.path.join(run, "checkpoints", f"step-{step:010d}")
                if rank < 2:
                    targets = inc_state(rank, 2, step, empty=True)
                    sp.load(path, into=targets, process_group=pg2, timeout=60)
                    inc_check(targets, rank, 2, step)
                else:
                    inc_check_whole(sp.load(path), step)
                    sp.verify(path)
            if rank < 2:
                targets = inc_state(rank, 2, 4, empty=True)
                restored = sp.CheckpointManager(run, read_only=True).restore(
                    targets, process_group=pg2, timeout=60, resume=False
                )
                assert restored == 4, restored
                inc_check(targets, rank, 2, 4)

        s.check("manager saves with blobs" + label, synced(manager_saves))
        s.check("manager keeps exactly the referenced blobs" + label, synced(manager_blobs))
        s.check("manager checkpoints restore" + label, synced(manager_restores))

    # A manager with the process group: synchronous saves, then background ones (async_save).
    manager_checks(s.path("inc/run"), False, "")
    manager_checks(s.path("inc/run-async"), True, " (async)")
    # Row patches of the pieces (rows 2-3 of "emb" change at every save), in the background.
    patching = BlobPolicy(**{**INC_POLICY_ARGS, "patches": True})
    manager_checks(s.path("inc/run-patches"), True, " (async, patches)", patching)

    def patched() -> None:
        from savepoint.codecs import manifest as mf

        if rank == 0:
            with open(
                os.path.join(s.path("inc/run-patches"), "latest", "manifest.json"), "rb"
            ) as f:
                m = mf.parse(f.read())
            assert m.format_version == mf.PATCHES, m.format_version
            assert any(r.patches for r in mf.recipes(m))

    s.check("manager saves row patches", synced(patched))

    # Last (rank 1 does not come back): rank 1 dies after putting its blobs, before it reports.
    from savepoint.distributed import save as dsave

    if rank == 1:
        real_put = dsave.put_pieces

        def dying(*args: Any, **kwargs: Any) -> Any:
            real_put(*args, **kwargs)
            s.write()
            os._exit(17)

        dsave.put_pieces = dying  # type: ignore[assignment]
        st = inc_state(rank, 2, 3)
        st["emb"].local[0] += 1  # a chunk only this save holds
        sp.save(s.path("inc/v2"), st, process_group=pg2, blobs=blobs, blob_policy=policy)
        return

    def killed() -> None:
        if rank != 0:
            return
        s.data["killed"] = expect_failure(
            lambda: sp.save(
                s.path("inc/v2"),
                inc_state(rank, 2, 3),
                process_group=pg2,
                timeout=20,
                blobs=blobs,
                blob_policy=policy,
            ),
            ranks=[1],
            words=["rank 1 did not finish its part"],
            within=20 + 5,
        )
        # Rank 0 closed its session; the dead rank's record stays and holds collections back
        # until it is stale; then a collection deletes the dead save's blobs and nothing that
        # a committed checkpoint names.
        sessions = os.listdir(os.path.join(blobs, "sessions"))
        assert len(sessions) == 1, sessions
        from savepoint.blobs import BlobStore

        store = BlobStore.open(blobs)
        kept = [s.path("inc/v1"), s.path("inc/v2")]
        held = store.collect(lambda: referenced(kept), grace=0)
        assert held.deferred and not held.deleted, held
        report = store.collect(lambda: referenced(kept), grace=0, session_stale_after=0)
        # rank 0's and rank 1's changed chunks, named by no manifest
        assert report.stale_sessions_removed == 1 and len(report.deleted) == 2, report
        assert set(blob_files(blobs)) == referenced(kept)
        for version in (1, 2):
            inc_check_whole(sp.load(s.path(f"inc/v{version}")), version)

    s.check("a rank killed mid-save", killed)


def scenario_continuous(s: Session) -> None:
    """sp.policies.Continuous with a process group: each rank's clock runs at its own pace (rank
    1's 1.6x rank 0's), yet both save the same steps, and no rank's interval is below its
    minimum; should_save and save agree."""
    now = [0.0]
    pace = 1.0 + 0.6 * s.rank
    policy = sp.policies.Continuous(min_interval=1.0, clock=lambda: now[0] * pace)
    shard = torch.full((4,), float(s.rank))

    def run() -> None:
        saved = []
        with sp.CheckpointManager(
            s.path("cont"), save_policy=policy, process_group=dist.group.WORLD
        ) as mgr:
            for step in range(24):
                now[0] = step * 0.25
                if mgr.should_save(step):
                    parts = sp.Shard(shard, offsets=(4 * s.rank,), global_shape=(4 * s.world,))
                    assert not mgr.save(step, {"w": parts}).skipped
                    saved.append(step)
                    # Durable before the loop's clock moves on: a loaded machine's slower
                    # background step must not change which steps are asked (the test's clock
                    # is fake, its background step real).
                    mgr.wait()
            s.data["saved"] = saved
            s.data["steps"] = mgr.steps()
        starts = [step * 0.25 * pace for step in saved]
        assert all(b - a >= 1.0 for a, b in itertools.pairwise(starts))

    s.check("continuous", run)


def main(scenarios: dict[str, Any] | None = None) -> None:
    """Run the scenario the command line names: a ``scenario_<name>`` function of
    ``scenarios`` (another worker module's globals), by default of this module."""
    scenario, rank, world, port, workdir = sys.argv[1:6]
    torch.set_num_threads(1)
    r, w = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=w)
    s = Session(scenario, r, w, workdir)
    try:
        (scenarios or globals())[f"scenario_{scenario}"](s)
    except BaseException:
        s.checks["scenario"] = "FAIL " + traceback.format_exc()
    s.write()
    sys.stdout.flush()
    sys.stderr.flush()
    # A failed group cannot be torn down cleanly (its peers are gone); leave at once.
    os._exit(0)


if __name__ == "__main__":
    main()
