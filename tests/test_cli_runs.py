"""The run commands of the CLI: ls, diff, report (with a plot), on real run directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
from savepoint.cli import main


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def make_run(directory: Path, lr: float, steps: int = 30) -> sp.CheckpointManager:
    mgr = sp.CheckpointManager(
        directory,
        keep_last=2,
        keep_best=1,
        best_metric="val",
        keep_every=20,
        variant=directory.name,
    )
    w = np.zeros(8, np.float32)
    for step in range(1, steps + 1):
        w += lr
        mgr.log(step, loss=1.0 / (step * lr))
        if step % 5 == 0:
            mgr.save(step, {"w": w, "step": step}, metrics={"val": abs(step * lr - 3.0)})
    mgr.close()
    return mgr


@pytest.fixture
def run(tmp_path: Path) -> Path:
    make_run(tmp_path / "small", 0.1)
    return tmp_path / "small"


def test_ls_shows_steps_tags_and_policies(run: Path) -> None:
    result = invoke("ls", str(run))
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].startswith("run small")
    rows = {line.split()[0]: line for line in lines[2:]}
    # keep_last=2 -> 25, 30; keep_every=20 -> 20; best (val=0 at step 30) -> 30
    assert set(rows) == {"20", "25", "30"}
    assert "every-20" in rows["20"]
    assert "last-2" in rows["25"]
    assert "latest,best" in rows["30"]
    assert "best-1-val" in rows["30"]


def test_ls_json(run: Path) -> None:
    result = invoke("ls", str(run), "--json")
    doc = json.loads(result.output)
    steps = {c["step"]: c for c in doc["checkpoints"]}
    assert sorted(steps) == [20, 25, 30]
    assert steps[30]["tags"] == ["latest", "best"]
    assert steps[30]["metrics"] == {"val": 0.0}
    assert steps[20]["kept_by"] == ["every-20"]
    assert all(c["bytes"] > 0 for c in doc["checkpoints"])


def test_ls_refuses_a_non_run(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["ls", str(tmp_path)])
    assert result.exit_code == 1
    assert "not a savepoint run directory" in result.output


def test_diff_two_steps_of_a_run(run: Path) -> None:
    result = invoke("diff", str(run), "25", "latest")
    assert result.exit_code == 1  # they differ
    assert "~ step: 25 -> 30" in result.output
    row = next(line for line in result.output.splitlines() if line.startswith("w "))
    cells = row.split()
    assert cells[1] == "F32"
    assert float(cells[3]) == pytest.approx(0.5, rel=1e-5)  # 3.0 - 2.5
    assert float(cells[4]) == pytest.approx(0.5 / 2.5, rel=1e-5)  # |a-b| / |a|


def test_diff_identical_checkpoints_exits_zero(run: Path) -> None:
    result = invoke("diff", str(run / "latest"), str(run / "best"))
    assert result.exit_code == 0
    assert "1 tensors compared, 1 identical" in result.output


def test_diff_keys_added_removed_and_changed(tmp_path: Path) -> None:
    sp.save(tmp_path / "a", {"w": np.ones(3), "gone": np.zeros(2), "shape": np.zeros(2)})
    sp.save(tmp_path / "b", {"w": np.ones(3), "new": np.zeros(2), "shape": np.zeros(3)})
    result = invoke("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    doc = json.loads(result.output)
    assert result.exit_code == 1
    assert doc["removed"] == ["gone"]
    assert doc["added"] == ["new"]
    assert doc["changed"] == [{"key": "shape", "a": "F64[2]", "b": "F64[3]"}]
    assert doc["tensors"][0]["equal"] is True


def test_diff_reports_corrupt_input(run: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["diff", str(run / "latest"), str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert "error:" in result.output


def test_report_run_with_plot(run: Path, tmp_path: Path) -> None:
    png = tmp_path / "run.png"
    result = invoke("report", str(run), "--plot", str(png))
    assert result.exit_code == 0
    assert "best         step 30" in result.output
    assert "checkpoints  30, 25, 20" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_report_shows_a_continuous_runs_achieved_intervals(tmp_path: Path) -> None:
    policy = sp.policies.Continuous(min_interval=0.0, target_interval=0.001)
    with sp.CheckpointManager(tmp_path / "c", save_policy=policy) as mgr:
        for step in range(3):
            mgr.save(step, {"w": np.zeros(4, np.float32)})
    result = invoke("report", str(tmp_path / "c"))
    assert result.exit_code == 0
    line = next(x for x in result.output.splitlines() if x.startswith("saving "))
    assert "3 saves (continuous: min 0 s, target 0.001 s); interval " in line
    assert " s max; durable after " in line and "intervals behind the target" in line


def test_report_sweep_ranks_runs_and_plots(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    make_run(sweep / "slow", 0.05)  # val never reaches 0 within 30 steps: best 1.5
    make_run(sweep / "fast", 0.1)  # reaches 0 at step 30
    png = tmp_path / "sweep.png"
    result = invoke("report", str(sweep), "--plot", str(png))
    assert result.exit_code == 0
    ranked = [line.split()[:2] for line in result.output.splitlines()[2:4]]
    assert ranked == [["1", "fast"], ["2", "slow"]]
    assert json.loads((sweep / "comparison.json").read_text())["runs"][0]["name"] == "fast"
    assert png.stat().st_size > 10_000


def test_report_refuses_other_directories(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 1


def test_verify_a_run_directory(run: Path) -> None:
    result = invoke("verify", str(run))
    assert result.exit_code == 0
    assert "3 checkpoint(s) verified" in result.output
    assert "latest/ = step 30, best/ = step 30" in result.output
    assert json.loads(invoke("ls", str(run), "--json").output)["problems"] == []


def test_run_commands_report_unreadable_files_without_a_traceback(run: Path) -> None:
    (run / "report.json").unlink()
    (run / "report.json").mkdir()  # not a file: refused with a reason, never a traceback
    for command in ("ls", "report", "verify"):
        result = CliRunner().invoke(main, [command, str(run)])
        assert result.exit_code == 1, (command, result.output)
        assert isinstance(result.exception, SystemExit), (command, result.exception)
        assert "not a regular file" in result.output, (command, result.output)
