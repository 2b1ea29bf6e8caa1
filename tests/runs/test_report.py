"""run.json and report.json: JSON round trips, history truncation, consistency with run.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.runs import report as R
from savepoint.runs.report import Report, RunInfo


def full_report() -> Report:
    return Report(
        name="exp",
        variant="wide",
        config={"lr": 0.1, "layers": [1, 2], "nested": {"a": None}},
        num_params=1234,
        steps_completed=500,
        epoch=3,
        wall_time_s=12.5,
        loss_history=[(1, 2.5), (2, 2.25), (10, 0.125)],
        metric_history={10: {"val": 0.5, "acc": 0.75}, 2: {"val": 0.9}},
        best={"metric": "val", "mode": "min", "step": 10, "metrics": {"val": 0.5}},
        latest_step=10,
        checkpoints=[10, 2],
        lineage=[{"resumed_from": 2, "at": "2026-01-01T00:00:00Z", "steps_completed_before": 7}],
    )


def through_json(doc: Any) -> Any:
    return json.loads(json.dumps(doc))


def test_run_info_round_trip() -> None:
    run = RunInfo(name="exp", variant="v1", config={"lr": 1e-3, "depth": 4}, num_params=99)
    doc = run.to_json()
    assert doc["format"] == "savepoint-run" and doc["version"] == 1
    assert doc["savepoint_version"] == sp.__version__
    assert doc["created"].endswith("Z")
    assert RunInfo.from_json(through_json(doc), "run.json") == run
    bare = RunInfo(name="x")
    assert RunInfo.from_json(through_json(bare.to_json()), "run.json") == bare


def test_report_round_trip() -> None:
    report = full_report()
    doc = report.to_json()
    assert doc["format"] == "savepoint-report" and doc["version"] == 1
    assert doc["loss_history"] == [[1, 2.5], [2, 2.25], [10, 0.125]]
    assert list(doc["metric_history"]) == ["2", "10"]  # string keys, in step order
    back = Report.from_json(through_json(doc), "report.json")
    assert back == report
    assert back.loss_history == [(1, 2.5), (2, 2.25), (10, 0.125)]
    assert all(type(s) is int and type(v) is float for s, v in back.loss_history)
    assert set(back.metric_history) == {2, 10}


def test_the_file_report_holds_no_history() -> None:
    """report.json (version 2) is what the run is now: the history is in the log
    (runs.history), so its size does not grow with the steps logged."""
    report = full_report()
    doc = report.to_file_json()
    assert doc["format"] == "savepoint-report" and doc["version"] == 2
    assert "loss_history" not in doc and "metric_history" not in doc
    assert doc["history"] == {"file": "history.jsonl", "segments": "history/"}
    back = Report.from_json(through_json(doc), "report.json")
    assert back.loss_history == [] and back.metric_history == {}
    assert back.checkpoints == report.checkpoints and back.lineage == report.lineage
    report.loss_history.extend((s, 1.0) for s in range(11, 10_000))
    assert report.to_file_json() == doc  # a longer history, the same report
    newer = {**doc, "version": 3}
    with pytest.raises(sp.IncompatibleCheckpointError):
        Report.from_json(newer, "report.json")


def test_report_round_trip_through_files(tmp_path: Path) -> None:
    path = str(tmp_path / "report.json")
    R.write_json(path, full_report().to_json())
    assert Report.from_json(R.read_json(path), path) == full_report()
    assert R.read_json(str(tmp_path / "absent.json")) is None


def test_for_run_copies_identity() -> None:
    run = RunInfo(name="exp", variant="v", config={"a": 1}, num_params=5)
    r = Report.for_run(run)
    assert (r.name, r.variant, r.config, r.num_params) == ("exp", "v", {"a": 1}, 5)
    assert r.loss_history == [] and r.best is None and r.steps_completed == 0


@pytest.mark.parametrize(
    "doc",
    [
        None,
        [],
        "report",
        {"format": "savepoint-run", "name": "x"},
        {"name": "x"},
        {"format": "savepoint-report"},  # no name
        {"format": "savepoint-report", "name": "x", "steps_completed": "many"},
        {"format": "savepoint-report", "name": "x", "steps_completed": None},
        {"format": "savepoint-report", "name": "x", "wall_time_s": "long"},
        {"format": "savepoint-report", "name": "x", "loss_history": [[1, 2, 3]]},
        {"format": "savepoint-report", "name": "x", "loss_history": [[1, "low"]]},
        {"format": "savepoint-report", "name": "x", "loss_history": 5},
        {"format": "savepoint-report", "name": "x", "metric_history": {"one": {}}},
        {"format": "savepoint-report", "name": "x", "metric_history": {"1": 5}},
        {"format": "savepoint-report", "name": "x", "metric_history": []},
        {"format": "savepoint-report", "name": "x", "checkpoints": ["ten"]},
        {"format": "savepoint-report", "name": "x", "lineage": 3},
    ],
)
def test_malformed_report(doc: Any) -> None:
    with pytest.raises(sp.CorruptCheckpointError):
        Report.from_json(doc, "report.json")


@pytest.mark.parametrize("best", [5, "step 3", [3]])
def test_malformed_best_is_corrupt_not_a_crash(tmp_path: Path, best: Any) -> None:
    """``best`` is an object or null; anything else is a malformed report.json, reported as such
    (at parse time or by the consistency check), never as an AttributeError."""
    doc = {**Report(name="x").to_json(), "best": best}
    run = RunInfo(name="x")

    def open_report() -> None:
        R.check_consistent(str(tmp_path), run, Report.from_json(doc, "report.json"), [])

    with pytest.raises(sp.CorruptCheckpointError):
        open_report()


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        (None, sp.CorruptCheckpointError),
        ({"format": "savepoint-report", "name": "x"}, sp.CorruptCheckpointError),
        ({"format": "savepoint-run", "version": 1}, sp.CorruptCheckpointError),  # no name
        ({"format": "savepoint-run", "version": 2, "name": "x"}, sp.IncompatibleCheckpointError),
        ({"format": "savepoint-run", "version": "1", "name": "x"}, sp.CorruptCheckpointError),
        (
            {"format": "savepoint-run", "version": 1, "name": "x", "config": 7},
            sp.CorruptCheckpointError,
        ),
    ],
)
def test_malformed_run_info(doc: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        RunInfo.from_json(doc, "run.json")


def test_read_json_rejects_garbage(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_bytes(b'{"format": "savepoint-report", "name": ')
    with pytest.raises(sp.CorruptCheckpointError):
        R.read_json(str(path))
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(sp.CorruptCheckpointError):
        R.read_json(str(path))


# -- truncate_after -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "losses", "metric_steps"),
    [
        (100, [1, 2, 10], [2, 10]),
        (10, [1, 2, 10], [2, 10]),
        (9, [1, 2], [2]),
        (2, [1, 2], [2]),
        (1, [1], []),
        (0, [], []),
    ],
)
def test_truncate_after(step: int, losses: list[int], metric_steps: list[int]) -> None:
    r = full_report()
    r.truncate_after(step)
    assert [s for s, _ in r.loss_history] == losses
    assert sorted(r.metric_history) == metric_steps
    # Nothing else is touched.
    assert r.lineage == full_report().lineage and r.best == full_report().best


# -- check_consistent -----------------------------------------------------------------------------


RUN = RunInfo(
    name="exp",
    variant="wide",
    config={"lr": 0.1, "layers": [1, 2], "nested": {"a": None}},
    num_params=1234,
)


@pytest.mark.parametrize(
    ("change", "steps", "error"),
    [
        ({}, [10, 2], None),
        ({}, [10], None),  # only the best checkpoint needs to exist
        ({"best": None}, [], None),
        ({"best": {"metric": "val", "step": None}}, [], None),
        ({}, [2], sp.MissingCheckpointError),
        ({}, [], sp.MissingCheckpointError),
        ({"variant": "narrow"}, [10], sp.RunMismatchError),
        ({"variant": None}, [10], sp.RunMismatchError),
        ({"config": {"lr": 0.2, "layers": [1, 2]}}, [10], sp.RunMismatchError),
        ({"config": {}}, [10], sp.RunMismatchError),
        ({"num_params": 1235}, [10], sp.RunMismatchError),
        ({"num_params": None}, [10], sp.RunMismatchError),
        ({"variant": "narrow"}, [], sp.RunMismatchError),  # mismatch is reported first
        ({"name": "renamed"}, [10], None),  # the name is not part of the check
    ],
)
def test_check_consistent(
    tmp_path: Path, change: dict[str, Any], steps: list[int], error: type[Exception] | None
) -> None:
    report = full_report()
    for k, v in change.items():
        setattr(report, k, v)
    if error is None:
        R.check_consistent(str(tmp_path), RUN, report, steps)
    else:
        with pytest.raises(error) as info:
            R.check_consistent(str(tmp_path), RUN, report, steps)
        assert type(info.value) is error
        assert info.value.path == str(tmp_path)


def test_check_consistent_lists_every_problem(tmp_path: Path) -> None:
    report = full_report()
    report.variant, report.num_params, report.config = "narrow", 1, {}
    with pytest.raises(sp.RunMismatchError) as info:
        R.check_consistent(str(tmp_path), RUN, report, [10])
    message = str(info.value)
    assert "variant" in message and "config" in message and "num_params" in message


def test_check_consistent_accepts_any_iterable(tmp_path: Path) -> None:
    R.check_consistent(str(tmp_path), RUN, full_report(), iter([1, 10]))
    R.check_consistent(str(tmp_path), RUN, full_report(), (s for s in [10]))


# -- write_json -----------------------------------------------------------------------------------


def test_write_json_one_member_per_line(tmp_path: Path) -> None:
    doc = full_report().to_json()
    path = tmp_path / "report.json"
    R.write_json(str(path), doc)
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == through_json(doc)
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and text.endswith("}\n")
    members = lines[1:-1]
    assert len(members) == len(doc)
    for i, (line, key) in enumerate(zip(members, doc)):
        assert line.endswith(",") == (i < len(members) - 1)
        one = json.loads("{" + line.rstrip(",") + "}")
        assert list(one) == [key]
        assert one[key] == through_json(doc[key])
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]  # no temporaries


def test_write_json_plain_values_and_replace(tmp_path: Path) -> None:
    path = str(tmp_path / "x.json")
    R.write_json(path, {"a": 1})
    R.write_json(
        path,
        {
            "f32": np.float32(0.5),
            "i64": np.int64(7),
            "b": np.bool_(True),
            "t": (1, 2),
            "s": {3},
            "nested": {"x": [np.float64(1.5), None, "s"]},
            "empty": {},
        },
    )
    assert R.read_json(path) == {
        "f32": 0.5,
        "i64": 7,
        "b": True,
        "t": [1, 2],
        "s": [3],
        "nested": {"x": [1.5, None, "s"]},
        "empty": {},
    }
    assert sorted(os.listdir(tmp_path)) == ["x.json"]


def test_write_json_refuses_unknown_objects(tmp_path: Path) -> None:
    path = str(tmp_path / "x.json")
    R.write_json(path, {"keep": 1})
    with pytest.raises(TypeError):
        R.write_json(path, {"bad": object()})
    assert R.read_json(path) == {"keep": 1}  # the old file is intact
    assert sorted(os.listdir(tmp_path)) == ["x.json"]


@pytest.mark.torch
def test_write_json_torch_scalars(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = str(tmp_path / "x.json")
    R.write_json(path, {"loss": torch.tensor(0.25), "n": torch.tensor(3)})
    assert R.read_json(path) == {"loss": 0.25, "n": 3}
