"""The world simulator (:mod:`savepoint.distributed.simulate`) against real gloo ranks, and alone.

On 8 and 16 real gloo ranks (``_world_worker.py``) a sharded save of a small FSDP x TP MoE state
records every operation savepoint's group runs; the simulator, saving the same state with the
same (real) writer, must predict them exactly: per rank, the same operations in the same order
with the same bytes in and out, and the same manifest (but for its creation time). Then the
simulator alone, fast: its saves load back exactly, a failing rank is named on every rank, and
its traffic has the shape of the real protocol (rank 0 receives world x the longest plan).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.commit import names
from savepoint.distributed import Shard, simulate
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
    sim = simulate.simulate_save(world, w.state, str(tmp_path / "ck-simu"), writer="real")
    assert all(not isinstance(r, BaseException) for r in sim.results), sim.results[0]
    for rank in range(world):
        real = [tuple(op) for op in s.results[rank]["data"]["ops"]]
        predicted = [(op.kind, op.sent, op.recv) for op in sim.traffic.ops[rank]]
        assert real == predicted, f"rank {rank}"
    manifest = json.loads((tmp_path / "ck-simu" / "manifest.json").read_text())
    manifest.pop("created", None)
    manifest.pop("manifest_xxh3", None)  # covers the creation time
    assert manifest == s.results[0]["data"]["manifest"]
    assert sim.traffic.messages(0) == 8  # two steps of four gloo operations


# ---------------------------------------------------------------------------------------------
# the simulator alone
# ---------------------------------------------------------------------------------------------


def small(rank: int, world: int) -> Any:
    return simulate.model_state(
        rank, world, 40, tp=2, data=True, hidden=64, experts=4, expert_ffn=32
    )


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
