"""Sweep: one managed run per variant under a directory, ranked in comparison.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.runs.sweep import COMPARISON_FILE, Sweep


def tiny(step: int) -> dict[str, Any]:
    return {"x": np.full(4, step, np.float32)}


def train(sweep: Sweep, name: str, vals: dict[int, float | None], losses: list[float]) -> None:
    """Log a loss per step and save at every step of ``vals`` (None: no metric that step)."""
    with sweep.run(name) as m:
        for step, loss in enumerate(losses, start=1):
            m.log(step, loss=loss)
            if step in vals:
                v = vals[step]
                m.save(step, tiny(step), {} if v is None else {"val": v, "other": 1.0})


def make_sweep(tmp_path: Path, mode: Any) -> Sweep:
    sweep = Sweep(tmp_path / "sweep", metric="val", mode=mode)
    train(sweep, "a", {1: 0.5, 2: 0.3, 3: 0.4}, [3.0, 2.0, 1.0])
    train(sweep, "b", {1: 0.2, 2: 0.25}, [5.0, 4.0])
    train(sweep, "c", {1: None, 2: None}, [9.0, 8.0, 7.0, 6.0])  # never reports "val"
    train(sweep, "d", {2: 0.2, 4: 0.9}, [1.0, 1.0, 1.0, 0.5])  # ties with b in min mode
    return sweep


def test_run_creates_managed_run(tmp_path: Path) -> None:
    sweep = Sweep(tmp_path / "sweep", metric="val", mode="max")
    with sweep.run("wide", keep_last=1) as m:
        assert isinstance(m, sp.CheckpointManager)
        assert m.directory == str(tmp_path / "sweep" / "wide")
        assert (m.run.name, m.run.variant) == ("wide", "wide")
        assert (m.best_metric, m.best_mode) == ("val", "max")
        for step, v in [(1, 0.9), (2, 0.1), (3, 0.2)]:
            m.save(step, tiny(step), {"val": v})
        assert m.steps() == [1, 3]  # keep_last=1 plus the best (max)
    run_json = json.loads((tmp_path / "sweep" / "wide" / "run.json").read_text())
    assert (run_json["name"], run_json["variant"]) == ("wide", "wide")
    with sweep.run("wide") as again:  # reopening is the same run
        assert again.steps() == [1, 3]
    with sweep.run("narrow", variant="v2", best_metric="acc", best_mode="min") as m:
        assert (m.run.variant, m.best_metric, m.best_mode) == ("v2", "acc", "min")
    with pytest.raises(sp.RunMismatchError):
        sweep.run("wide", variant="other")
    assert Sweep(tmp_path / "plain").run("x").best_metric is None


@pytest.mark.parametrize("name", ["", ".hidden", "..", "a/b", "../escape"])
def test_run_names_are_plain(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        Sweep(tmp_path).run(name)


def test_invalid_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Sweep(tmp_path, metric="val", mode="best")  # type: ignore[arg-type]


def test_runs_lists_only_run_directories(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path, "min")
    root = tmp_path / "sweep"
    (root / "notes.txt").write_text("x")
    (root / "empty").mkdir()
    (root / "not-a-run").mkdir()
    (root / "not-a-run" / "report.json").write_text("{}")
    sweep.compare()
    assert (root / COMPARISON_FILE).is_file()
    assert sweep.runs() == ["a", "b", "c", "d"]
    assert Sweep(tmp_path / "new").runs() == []


EXPECTED_ROWS = {
    # name: (best_metric min, best_step min, best_metric max, best_step max, final_loss, steps)
    "a": (0.3, 2, 0.5, 1, 1.0, 3),
    "b": (0.2, 1, 0.25, 2, 4.0, 2),
    "c": (None, None, None, None, 6.0, 4),
    "d": (0.2, 2, 0.9, 4, 0.5, 4),
}


@pytest.mark.parametrize(
    ("mode", "order"),
    [("min", ["b", "d", "a", "c"]), ("max", ["d", "a", "b", "c"])],
)
def test_compare_ranks_and_writes_comparison(tmp_path: Path, mode: Any, order: list[str]) -> None:
    sweep = make_sweep(tmp_path, mode)
    rows = sweep.compare()
    assert [r["name"] for r in rows] == order
    assert [r["rank"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        bmin, smin, bmax, smax, final, steps = EXPECTED_ROWS[r["name"]]
        best, step = (bmin, smin) if mode == "min" else (bmax, smax)
        assert r["best_metric"] == best and r["best_step"] == step, r
        assert r["final_loss"] == final and r["steps"] == steps
        assert r["variant"] == r["name"]
        report = json.loads((tmp_path / "sweep" / r["name"] / "report.json").read_text())
        assert r["wall_time_s"] == report["wall_time_s"] > 0
    doc = json.loads((tmp_path / "sweep" / COMPARISON_FILE).read_text())
    assert doc["format"] == "savepoint-comparison" and doc["version"] == 1
    assert (doc["metric"], doc["mode"]) == ("val", mode)
    assert doc["runs"] == rows
    for row in doc["runs"]:
        assert set(row) == {
            "rank", "name", "variant", "best_metric", "best_step", "final_loss", "steps",
            "wall_time_s", "num_params",
        }  # fmt: skip


def test_compare_counts_logged_metrics_and_ties_go_to_later_steps(tmp_path: Path) -> None:
    sweep = Sweep(tmp_path / "sweep", metric="acc", mode="max")
    with sweep.run("x") as m:
        m.log(1, acc=0.5)
        m.log(2, acc=0.8)
        m.log(3, acc=0.8)  # a tie: the later step
        m.log(4, acc=True)  # not a number
        m.log(5, acc="0.99")
        for step in range(1, 6):  # the comparison names only steps with a checkpoint
            m.save(step, tiny(step))
    with sweep.run("y") as m:
        m.log(1, acc=0.6)
        m.save(1, tiny(1))
    rows = sweep.compare()
    assert [(r["name"], r["best_metric"], r["best_step"]) for r in rows] == [
        ("x", 0.8, 3),
        ("y", 0.6, 1),
    ]
    assert rows[0]["final_loss"] is None and rows[0]["steps"] == 5


def test_compare_ignores_non_finite_values(tmp_path: Path) -> None:
    """Like the manager's best, a sweep's best is a finite value: a diverged evaluation (inf) is
    never a run's best, and comparison.json stays strict JSON."""
    sweep = Sweep(tmp_path / "sweep", metric="score", mode="max")
    with sweep.run("diverged") as m:
        m.log(1, score=0.3)
        m.log(2, score=float("inf"))
        m.log(3, score=float("nan"))
        for step in (1, 2, 3):
            m.save(step, tiny(step))
    with sweep.run("steady") as m:
        m.log(1, score=0.5)
        m.save(1, tiny(1))
    rows = sweep.compare()
    assert [(r["name"], r["best_metric"], r["best_step"]) for r in rows] == [
        ("steady", 0.5, 1),
        ("diverged", 0.3, 1),
    ]

    def no_constants(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    json.loads((tmp_path / "sweep" / COMPARISON_FILE).read_text(), parse_constant=no_constants)


def test_compare_without_sweep_metric_uses_each_runs_best_metric(tmp_path: Path) -> None:
    sweep = Sweep(tmp_path / "sweep")  # no metric: each run's own best metric, mode min
    with sweep.run("p", best_metric="val") as m:
        m.save(1, tiny(1), {"val": 0.7})
        m.save(2, tiny(2), {"val": 0.4})
    with sweep.run("q", best_metric="val") as m:
        m.save(1, tiny(1), {"val": 0.1})
    with sweep.run("r") as m:  # no best metric at all
        m.save(1, tiny(1), {"val": 0.0})
    rows = sweep.compare()
    assert [(r["name"], r["best_metric"], r["best_step"]) for r in rows] == [
        ("q", 0.1, 1),
        ("p", 0.4, 2),
        ("r", None, None),
    ]
    doc = json.loads((tmp_path / "sweep" / COMPARISON_FILE).read_text())
    assert doc["metric"] is None and doc["mode"] == "min"


def test_comparison_json_one_member_per_line(tmp_path: Path) -> None:
    make_sweep(tmp_path, "min").compare()
    lines = (tmp_path / "sweep" / COMPARISON_FILE).read_text().splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    assert [json.loads("{" + line.rstrip(",") + "}").popitem()[0] for line in lines[1:-1]] == [
        "format",
        "version",
        "metric",
        "mode",
        "runs",
    ]
    assert not [e for e in os.listdir(tmp_path / "sweep") if e.startswith(".")]


def test_comparison_names_only_steps_with_a_checkpoint(tmp_path: Path) -> None:
    """A metric logged at a step that was never saved (or was pruned) is not the run's best:
    best_step is always a checkpoint one can load (HEAD ranked every logged step)."""
    sweep = Sweep(tmp_path / "sweep", metric="val")
    with sweep.run("a", keep_last=1, keep_best=None) as m:
        m.log(1, loss=1.0, val=0.01)  # logged only: no checkpoint of step 1
        m.save(2, tiny(2), {"val": 0.5})
        m.save(3, tiny(3), {"val": 0.2})
        m.save(4, tiny(4), {"val": 0.7})  # keep_last=1 keeps 4 and the best, 3: 2 is pruned
    with sweep.run("a") as m:
        assert m.steps() == [3, 4]
    (row,) = sweep.compare()
    assert (row["best_step"], row["best_metric"]) == (3, 0.2)
    assert sp.load(sp.open_run(tmp_path / "sweep" / "a").checkpoint_path(row["best_step"]))


def test_num_params_is_derived_from_the_state(tmp_path: Path) -> None:
    """Without num_params a run records the element count of its first saved state (of its
    "model" entry when it has one), in run.json, report.json and the comparison."""
    sweep = Sweep(tmp_path / "sweep", metric="val")
    with sweep.run("plain") as m:
        m.save(1, {"w": np.zeros((3, 4), np.float32), "b": np.zeros(5), "step": 1}, {"val": 1.0})
        assert m.run.num_params == 17
    with sweep.run("model") as m:
        state = {"model": {"w": np.zeros((2, 2))}, "optimizer": {"m": np.zeros((2, 2))}}
        m.save(1, state, {"val": 2.0})
    with sweep.run("given", num_params=99) as m:
        m.save(1, tiny(1), {"val": 3.0})
    counts = {r["name"]: r["num_params"] for r in sweep.compare()}
    assert counts == {"plain": 17, "model": 4, "given": 99}
    for name, count in counts.items():
        run_dir = tmp_path / "sweep" / name
        assert json.loads((run_dir / "run.json").read_text())["num_params"] == count
        assert json.loads((run_dir / "report.json").read_text())["num_params"] == count
        with sweep.run(name, num_params=count) as again:  # the same run: no mismatch
            assert again.steps() == [1]
