"""Repeated saves of a regular (grid) state: markers instead of Compacts, and the fallbacks.

A rank whose description rank 0 accepted sends a marker naming its layout on the next save of
the same state; rank 0, holding that layout's plan checked with these ranks, answers at once
(``savepoint.distributed.save``: GRID, REGRID). Rank 0 without the plan asks for Compacts; a
changed state is described and checked again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import manifest as mf
from savepoint.distributed import layout, save, simulate

WORLD = 4


def grid_state(rank: int, world: int) -> Any:
    return simulate.model_state(
        rank, world, 20, tp=2, hidden=16, experts=2, expert_ffn=8, data=True
    )


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    check = layout.check

    def counted(sent: Any, lay: Any) -> Any:
        calls.append(len(sent))
        return check(sent, lay)

    monkeypatch.setattr(layout, "check", counted)
    return calls


def _same(a: Path, b: Path) -> None:
    left, right = (sp.load(p, framework="numpy") for p in (a, b))
    for key, value in left["model"].items():
        np.testing.assert_array_equal(right["model"][key], value)
    sp.verify(b)


def test_a_repeated_save_sends_markers_and_is_not_checked_again(
    tmp_path: Path, checks: list[int]
) -> None:
    paths = [str(tmp_path / n) for n in ("b", "c")]
    sim = simulate.simulate_save(WORLD, grid_state, str(tmp_path / "a"), writer="real", paths=paths)
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert checks == [WORLD]  # the first save's Compacts; the others sent markers
    assert [sim.manifests[i].format_version for i in range(3)] == [mf.GRID] * 3
    first, second = sim.save_traffic(0), sim.save_traffic(1)
    assert [second.messages(r) for r in range(WORLD)] == [first.messages(r) for r in range(WORLD)]
    _same(tmp_path / "a", tmp_path / "c")


def test_rank0_without_the_layout_asks_for_compacts(tmp_path: Path, checks: list[int]) -> None:
    calls = {"n": 0}

    def state(rank: int, world: int) -> Any:
        calls["n"] += 1
        if calls["n"] == world + 1:  # the second save: rank 0's plan lost, the ranks' kept
            save._implied.clear()
        return grid_state(rank, world)

    sim = simulate.simulate_save(
        WORLD, state, str(tmp_path / "a"), writer="real", paths=[str(tmp_path / "b")]
    )
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert checks == [WORLD, WORLD]  # REGRID: the Compacts of every rank, checked again
    first, second = sim.save_traffic(0), sim.save_traffic(1)
    assert [second.messages(r) for r in range(WORLD)] == [
        first.messages(r) + 4 for r in range(WORLD)
    ]  # one plan step more
    assert sim.manifests[1].format_version == mf.GRID
    _same(tmp_path / "a", tmp_path / "b")


def test_a_changed_state_is_described_and_checked_again(tmp_path: Path, checks: list[int]) -> None:
    calls = {"n": 0}

    def state(rank: int, world: int) -> Any:
        got = grid_state(rank, world)
        calls["n"] += 1
        if calls["n"] > world:  # the second save: every rank has one more (replicated) tensor
            got["model"]["extra"] = np.full(3, 7.0, np.float32)
        return got

    sim = simulate.simulate_save(
        WORLD, state, str(tmp_path / "a"), writer="real", paths=[str(tmp_path / "b")]
    )
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert checks == [WORLD, WORLD]
    np.testing.assert_array_equal(sp.load(tmp_path / "b", framework="numpy")["model"]["extra"], 7.0)
    sp.verify(tmp_path / "b")
