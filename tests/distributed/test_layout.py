"""Regular (grid) layouts (:mod:`savepoint.distributed.layout`): planned in O(tensors + ranks).

The world simulator runs the real protocol; a regular state's plan step sends a digest and a
coordinate per rank whatever the tensor count, merges nothing, and saves what the piece-by-piece
path saves; a rank that differs sends everything again and the merge decides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import manifest as mf
from savepoint.distributed import Shard, layout, plan, simulate
from savepoint.errors import UnsupportedStateError


def small(rank: int, world: int, tensors: int = 40, regular: bool = True) -> Any:
    return simulate.model_state(
        rank, world, tensors, tp=2, data=True, hidden=64, experts=4, expert_ffn=32, regular=regular
    )


def read_manifest(path: Path) -> mf.Manifest:
    return mf.parse(
        (path / mf.NAME).read_bytes(), read_index=lambda name, size: (path / name).read_bytes()
    )


def plan_step_recv(sim: simulate.SimResult) -> int:
    return sum(op.recv for op in sim.save_traffic(0).ops[0][:4])


def test_regular_save_merges_nothing_and_matches_the_merged_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    merges = []
    merge = plan.merge
    monkeypatch.setattr(plan, "merge", lambda plans: merges.append(1) or merge(plans))
    sim = simulate.simulate_save(4, small, str(tmp_path / "a"), writer="real")
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert merges == []
    simulate.simulate_save(
        4, lambda r, w: small(r, w, regular=False), str(tmp_path / "b"), writer="real"
    )
    assert merges == [1]
    a, b = (sp.load(tmp_path / n, framework="numpy") for n in ("a", "b"))
    assert a["model"].keys() == b["model"].keys()
    for key, value in b["model"].items():
        np.testing.assert_array_equal(a["model"][key], value)
    sp.verify(tmp_path / "a")
    # Every piece written once: the shards of each tensor tile it (the parser checks) and the
    # replicated ones (norms, router over the tp dimension) are spread over their holders.
    regular, merged = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert (regular.format_version, merged.format_version) == (mf.GRID, mf.BLOCKED)
    assert regular.tensors.keys() == merged.tensors.keys()
    writers = {s.file[:11] for t in regular.tensors.values() for s in t.layout()}
    assert len(writers) == 4
    assert regular.mesh == (2, 2) and regular.indices is not None and len(regular.indices) == 4


def test_plan_step_bytes_do_not_grow_with_tensors(tmp_path: Path) -> None:
    few, many = (
        simulate.simulate_save(
            8, lambda r, w, n=n: simulate.model_state(r, w, n), str(tmp_path / f"c{n:04d}")
        )
        for n in (30, 300)
    )
    # the same but for the byte counts' digits
    assert (
        abs(plan_step_recv(few) - plan_step_recv(many)) <= 8 * 8 and plan_step_recv(many) < 8 * 250
    )
    merged = simulate.simulate_save(
        8, lambda r, w: simulate.model_state(r, w, 300, regular=False), str(tmp_path / "d")
    )
    assert plan_step_recv(merged) > 50 * plan_step_recv(many)


def test_one_rank_not_regular_falls_back_to_the_merge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    merges = []
    merge = plan.merge
    monkeypatch.setattr(plan, "merge", lambda plans: merges.append(1) or merge(plans))
    sim = simulate.simulate_save(
        4, lambda r, w: small(r, w, regular=r != 2), str(tmp_path / "a"), writer="real"
    )
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert merges == [1]
    assert [sim.save_traffic(0).messages(r) for r in range(4)] == [12] * 4  # RESEND: 3 steps
    sp.verify(tmp_path / "a")


def test_writes_spread_replicas_and_check_finds_holes() -> None:
    lay = layout.Layout(
        {},
        (2, 3),
        ["a", "b", "c", "d"],
        ["F32"] * 4,
        [(6,)] * 4,
        [(0, None), (0, None), (0, None), (None, None)],
    )
    got = {c: layout.writes(lay, c) for c in np.ndindex(2, 3)}
    for i in range(3):  # sharded over dim 0 of the mesh, replicated over dim 1: one writer per row
        for row in range(2):
            assert sum(i in got[(row, col)] for col in range(3)) == 1
    assert sum(3 in w for w in got.values()) == 1  # replicated everywhere: one writer
    assert {c for c, w in got.items() if w} == set(got)  # spread over the columns
    sent = [layout.Compact(lay.digest, c, 0) for c in np.ndindex(2, 3)]
    assert layout.check(sent, lay) == []
    sent[4] = layout.Compact(lay.digest, (0, 0), 0)
    assert "share coordinate" in layout.check(sent, lay)[0][1]
    sent[4] = layout.Compact("0" * 16, (1, 1), 0)
    assert "different layout" in layout.check(sent, lay)[0][1]


def test_a_grid_must_give_the_shards_box() -> None:
    grid = layout.Grid((4,), (1,), (0,))
    Shard(np.zeros((2, 3), np.float32), (8, 3), (2, 0), grid=grid)
    with pytest.raises(UnsupportedStateError, match="grid"):
        Shard(np.zeros((2, 3), np.float32), (8, 3), (4, 0), grid=grid)
    assert layout.parse_grid(layout.Grid((8, 2), (3, 1), (0, None)).text()) == layout.Grid(
        (8, 2), (3, 1), (0, None)
    )


def test_a_sharded_tensor_without_elements_is_written_once(tmp_path: Path) -> None:
    odd = np.arange(6, dtype=np.float32).reshape(3, 2)

    def state(rank: int, world: int) -> Any:
        got = small(rank, world)["model"]  # on a (2, 2) mesh
        coord = (rank // 2, rank % 2)
        grid = layout.Grid((2, 2), coord, (0, None))
        got["empty"] = Shard(np.zeros((0, 3), np.float32), (0, 3), (0, 0), grid=grid)
        box = layout.grid_box((3, 2), (2, 2), coord, (0, None))  # rows 0-1, then row 2
        piece = odd[box[0][0] : box[0][1]]
        got["odd"] = Shard(piece, (3, 2), (box[0][0], 0), grid=grid)
        return {"model": got}

    sim = simulate.simulate_save(4, state, str(tmp_path / "a"), writer="real")
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    out = sp.load(tmp_path / "a", framework="numpy")
    assert out["model"]["empty"].shape == (0, 3)
    np.testing.assert_array_equal(out["model"]["odd"], odd)
    m = read_manifest(tmp_path / "a")
    assert m.format_version == mf.GRID and len(m.tensors["model/empty"].layout()) == 1
