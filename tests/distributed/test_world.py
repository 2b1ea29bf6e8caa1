"""The world simulator (:mod:`savepoint.distributed.simulate`) against real gloo ranks, and alone.

On 8 and 16 real gloo ranks (``_world_worker.py``) a sharded save of a small FSDP x TP MoE state
records every operation savepoint's group runs; the simulator, saving the same state with the
same (real) writer, must predict them exactly: per rank, the same operations in the same order
with the same bytes in and out, and the same manifest (but for its creation time). Then the
simulator alone, fast: its saves load back exactly, a failing rank is named on every rank, and
its traffic has the shape of the real protocol (rank 0 receives world x the longest plan).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.commit import names
from savepoint.distributed import Shard, plan, plancache, simulate
from savepoint.errors import DistributedCheckpointError

from . import _launch

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("_world_worker.py")


def _worker_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_world_worker_mod", WORKER)
    assert spec is not None and spec.loader is not None
    import sys

    sys.path.insert(0, str(WORKER.parent))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
@pytest.mark.parametrize("world", [8, pytest.param(16, marks=pytest.mark.slow)])
def test_simulator_predicts_real_gloo(
    world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _launch.run("world", world, tmp_path, timeout=240, worker=WORKER)
    assert s.failures() == "", s.failures()
    w = _worker_module()
    monkeypatch.setattr(names, "_owner", lambda: w.OWNER)
    sims = [
        simulate.simulate_save(
            world, fn, str(tmp_path / a), writer="real", paths=[str(tmp_path / b)]
        )
        for fn, a, b in ((w.state, "ck-simu", "ck-sim2"), (w.irregular, "ck-sir1", "ck-sir2"))
    ]
    for sim in sims:
        assert all(not isinstance(r, BaseException) for r in sim.results), sim.results[0]
    for rank in range(world):
        real = [tuple(op) for op in s.results[rank]["data"]["ops"]]
        predicted = [(op.kind, op.sent, op.recv) for sim in sims for op in sim.traffic.ops[rank]]
        assert real == predicted, f"rank {rank}"
    names_ = ("ck-simu", "ck-sim2", "ck-sir1", "ck-sir2")
    simulated = [w.manifest(str(tmp_path / name)) for name in names_]
    assert simulated == s.results[0]["data"]["manifests"]
    assert sims[0].traffic.messages(0) == 16  # two saves of two steps of four gloo operations
    # The regular state's plans are compact (a digest and a coordinate), its first save's too;
    # the irregular state's second save reused the first one's plan (a marker).
    assert sims[0].manifest is not None and sims[0].manifest.format_version == 7
    assert sims[1].manifest is not None and sims[1].manifest.format_version == 3
    # The regular (version 7) checkpoint loads onto half as many real ranks (another mesh).
    if world == 8:
        again = _launch.run("world_reload", 4, tmp_path, timeout=240, worker=WORKER)
        assert again.failures() == "", again.failures()
        assert all(r["data"]["leaves"] == 39 for r in again.results.values())
    gathers = [sim.save_traffic(i).ops[0][1] for sim in sims for i in (0, 1)]
    assert all(g.kind == "gather" for g in gathers)
    assert gathers[0].sent < 200 and gathers[1].sent < 200
    assert gathers[3].sent < 200 < gathers[2].sent


# ---------------------------------------------------------------------------------------------
# the simulator alone
# ---------------------------------------------------------------------------------------------


def small(rank: int, world: int, regular: bool = True) -> Any:
    return simulate.model_state(
        rank, world, 40, tp=2, data=True, hidden=64, experts=4, expert_ffn=32, regular=regular
    )


def by_offsets(rank: int, world: int) -> Any:
    """``small`` without grids: planned piece by piece (plan.merge), the plan cache at work."""
    return small(rank, world, regular=False)


def test_simulated_save_loads_back(tmp_path: Path) -> None:
    world = 4
    sim = simulate.simulate_save(world, small, str(tmp_path / "ck"), writer="real")
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    loaded = sp.load(tmp_path / "ck", framework="numpy")
    pieces = [small(r, world) for r in range(world)]
    for key, value in loaded["model"].items():
        for r in range(world):
            mine = pieces[r]["model"][key]
            if isinstance(mine, Shard):
                box = tuple(slice(a, a + n) for a, n in zip(mine.offsets, mine.local.shape))
                np.testing.assert_array_equal(value[box], mine.local)
            else:
                np.testing.assert_array_equal(value, mine)
    assert loaded["optim"]["step"] == 1000
    assert sim.manifest is not None and len(sim.manifest.tensors) == 39


def test_simulated_records_without_writing(tmp_path: Path) -> None:
    sim = simulate.simulate_save(
        8, lambda r, w: simulate.model_state(r, w, 30), str(tmp_path / "c")
    )
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["manifest.json"]
    t = sim.traffic
    assert [t.messages(r) for r in range(8)] == [8] * 8
    gathers = [op for op in t.ops[0] if op.kind == "gather"]
    assert len(gathers) == 2 and all(op.recv == 8 * op.sent for op in gathers)
    assert all(op.recv == 0 for r in range(1, 8) for op in t.ops[r] if op.kind == "gather")
    shares = sim.per_rank_plan_s()
    assert len(shares) == 8 and all(s > 0 for s in shares) and sim.rank0_plan_s() > 0


def test_failing_rank_named_on_every_rank(tmp_path: Path) -> None:
    def state(rank: int, world: int) -> Any:
        got = simulate.model_state(rank, world, 10)
        if rank == 5:
            got["model"]["extra"] = np.zeros(3, np.float32)  # a key the others lack
        return got

    sim = simulate.simulate_save(8, state, str(tmp_path / "c"))
    assert all(isinstance(r, DistributedCheckpointError) for r in sim.results)
    assert {tuple(r.ranks) for r in sim.results} == {(0, 1, 2, 3, 4, 6, 7)} or all(
        "model.extra" in str(r) for r in sim.results
    )
    assert not (tmp_path / "c").exists()


def test_repeated_save_reuses_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    merges = []
    merge = plan.merge
    monkeypatch.setattr(plan, "merge", lambda plans: merges.append(1) or merge(plans))
    paths = [str(tmp_path / n) for n in ("b", "c")]
    sim = simulate.simulate_save(8, by_offsets, str(tmp_path / "a"), writer="real", paths=paths)
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert len(merges) == 1  # the first save's; the others reused its plan
    first, second = sim.save_traffic(0), sim.save_traffic(2)
    assert [second.messages(r) for r in range(8)] == [8] * 8
    plan_step = [sum(op.recv for op in t.ops[0][:4]) for t in (first, second)]
    assert plan_step[1] < 2000 < 30000 < plan_step[0]  # markers instead of plans
    assert sim.manifests[0].tensors.keys() == sim.manifests[2].tensors.keys()
    a, c = (sp.load(tmp_path / n, framework="numpy") for n in ("a", "c"))
    for key, value in a["model"].items():
        np.testing.assert_array_equal(c["model"][key], value)
    sp.verify(tmp_path / "c")  # raises if a byte is wrong


def test_changed_plan_is_merged_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    merges = []
    merge = plan.merge
    monkeypatch.setattr(plan, "merge", lambda plans: merges.append(1) or merge(plans))
    calls = {"n": 0}

    def state(rank: int, world: int) -> Any:
        got = by_offsets(rank, world)
        calls["n"] += 1
        if calls["n"] > world:  # the second save: every rank has one more tensor
            got["model"]["new"] = np.full(5, 2.0, np.float32)
        return got

    sim = simulate.simulate_save(
        4, state, str(tmp_path / "a"), writer="real", paths=[str(tmp_path / "b")]
    )
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert len(merges) == 2
    np.testing.assert_array_equal(sp.load(tmp_path / "b", framework="numpy")["model"]["new"], 2.0)


def test_rank0_without_the_plan_asks_every_rank_again(tmp_path: Path) -> None:
    """A marker naming a plan rank 0 no longer holds: RESEND, then a full plan step."""
    calls = {"n": 0}

    def state(rank: int, world: int) -> Any:
        calls["n"] += 1
        if calls["n"] == world + 1:  # rank 0, second save: its memo lost (as after a failure)
            plancache._roots.clear()
        return by_offsets(rank, world)

    sim = simulate.simulate_save(
        4, state, str(tmp_path / "a"), writer="real", paths=[str(tmp_path / "b")]
    )
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert [sim.save_traffic(1).messages(r) for r in range(4)] == [12] * 4  # three steps
    sp.verify(tmp_path / "b")


def test_bench_world_prints_its_json_line() -> None:
    """``benchmarks/bench_world.py``: tests outside the project read these names."""
    row = _bench_world("--ranks", "4", "--tensors", "20", "--dcp")
    for key in ("rank0_plan_s", "per_rank_plan_s", "manifest_bytes", "rank0_recv_bytes"):
        assert row[key] > 0, key
    assert (row["ranks"], row["tensors"]) == (4, 20)
    assert row["dcp_plan_s"] >= 0


def test_bench_world_samples_ranks_over_max_items() -> None:
    """Over ``--max-items`` a regular state is measured on a sample of ranks, rank 0's share
    on every rank's message, and the real version 7 manifest."""
    row = _bench_world("--ranks", "256", "--tensors", "40", "--max-items", "1000", "--sample", "3")
    assert (row["ranks"], row["tensors"], row["manifest_version"]) == (256, 40, 7)
    for key in ("rank0_plan_s", "per_rank_plan_s", "manifest_bytes", "rank0_recv_bytes"):
        assert row[key] > 0, key
    assert 4 <= row["sampled_ranks"] <= 7
    # what rank 0 receives: a message per rank in each step, not one per piece
    assert row["rank0_recv_bytes"] < 256 * 2000


def test_saves_without_a_group_are_not_cached(tmp_path: Path) -> None:
    from savepoint.distributed import collectives

    assert plancache.key(collectives.LocalCoordinator()) is None
    state = {"w": Shard(np.ones((4, 2), np.float32), (4, 2), (0, 0))}
    # Earlier tests in this process may have left memos of their own groups: compare, not empty.
    before = (dict(plancache._ranks), dict(plancache._roots))
    for name in ("a", "b"):
        sp.save(tmp_path / name, state)
    assert (plancache._ranks, plancache._roots) == before
    np.testing.assert_array_equal(sp.load(tmp_path / "b", framework="numpy")["w"], 1.0)


def _bench_world(*args: str) -> dict[str, Any]:
    """``benchmarks/bench_world.py`` run with ``args``: its last line, the JSON row."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_world.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row
