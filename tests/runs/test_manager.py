"""CheckpointManager: run-directory layout, retention, save policies, restore with fallback,
consistency checks at open, verification before pruning, stale temporaries, and SIGKILL safety."""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
import savepoint.checkpoint
from _compare import same
from _torture import campaign
from savepoint.commit import names, transaction
from savepoint.runs import aliases, layout
from savepoint.runs.report import config_diff
from savepoint.storage import local

from . import _kill_manager_child as child
from ._util import full_report, read_log, snapshot

# -- helpers ----------------------------------------------------------------------------------------


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((32, 16)).astype(np.float32),
        "b": np.full(5, step, dtype=np.int64),
        "step": step,
    }


def blank() -> dict[str, Any]:
    return {"w": np.zeros((32, 16), np.float32), "b": np.zeros(5, np.int64), "step": -1}


def read(path: Path | str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def data_files(directory: Path | str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n != "manifest.json")


def hidden(directory: Path | str) -> list[str]:
    return sorted(e for e in os.listdir(directory) if e.startswith("."))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


# -- layout -----------------------------------------------------------------------------------------


def test_layout_on_disk(run_dir: Path) -> None:
    m = sp.CheckpointManager(
        run_dir, best_metric="val", variant="v1", config={"lr": 0.1, "depth": 3}, num_params=42
    )
    m.save(10, state(10), {"val": 0.5})
    m.save(20, state(20), {"val": 0.7})
    m.wait()  # the background step removes the previous aliases (hidden until then)

    assert sorted(os.listdir(run_dir)) == [
        ".writer.lock",  # the writer lock (runs.lock)
        "best",
        "checkpoints",
        "history.jsonl",  # the loss and metric history (runs.history)
        "latest",
        "report.json",
        "run.json",
    ]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step-0000000010", "step-0000000020"]
    assert m.steps() == [10, 20] and m.latest_step() == 20 and m.best_step() == 10
    assert m.step_path(10) == str(run_dir / "checkpoints" / "step-0000000010")

    same(sp.load(run_dir / "latest"), state(20))
    same(sp.load(run_dir / "best"), state(10))
    sp.verify(run_dir / "latest")
    sp.verify(run_dir / "best")
    for alias, step in (("best", 10), ("latest", 20)):
        step_dir = run_dir / "checkpoints" / layout.step_name(step)
        assert sorted(os.listdir(run_dir / alias)) == sorted(os.listdir(step_dir))
        assert data_files(step_dir)
        for name in os.listdir(step_dir):  # hard links: same inode
            assert os.stat(run_dir / alias / name).st_ino == os.stat(step_dir / name).st_ino

    run = read(run_dir / "run.json")
    assert run["format"] == "savepoint-run" and run["version"] == 1
    assert (run["name"], run["variant"], run["config"], run["num_params"]) == (
        "run",
        "v1",
        {"lr": 0.1, "depth": 3},
        42,
    )
    report = read(run_dir / "report.json")
    assert report["format"] == "savepoint-report" and report["version"] == 2
    assert report["latest_step"] == 20 and report["checkpoints"] == [20, 10]
    assert report["steps_completed"] == 20
    assert report["best"] == {"metric": "val", "mode": "min", "step": 10, "metrics": {"val": 0.5}}
    assert "metric_history" not in report and "loss_history" not in report  # in the log
    assert read_log(run_dir) == [
        {"step": 10, "metrics": {"val": 0.5}},
        {"step": 20, "metrics": {"val": 0.7}},
    ]
    assert full_report(run_dir)["metric_history"] == {"10": {"val": 0.5}, "20": {"val": 0.7}}
    assert (report["variant"], report["config"], report["num_params"]) == ("v1", run["config"], 42)
    meta = sp.inspect(m.step_path(20)).metadata["savepoint_run"]
    assert meta == {"step": 20, "epoch": None, "metrics": {"val": 0.7}}

    # A better step moves best/ to it.
    m.save(30, state(30), {"val": 0.1})
    same(sp.load(run_dir / "best"), state(30))
    for name in data_files(m.step_path(30)):
        assert (
            os.stat(run_dir / "best" / name).st_ino == os.stat(Path(m.step_path(30)) / name).st_ino
        )
    m.close()


def test_aliases_survive_the_step_directory(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir, best_metric="val") as m:
        m.save(1, state(1), {"val": 0.2})
        m.save(2, state(2), {"val": 0.9})
    # Delete the best step's directory the way retention does: best/ keeps the files alive.
    transaction.discard(local.STORE, str(run_dir / "checkpoints" / layout.step_name(1)))
    assert layout.committed_steps(str(run_dir)) == [2]
    same(sp.load(run_dir / "best"), state(1))
    sp.verify(run_dir / "best")
    transaction.discard(local.STORE, str(run_dir / "checkpoints" / layout.step_name(2)))
    same(sp.load(run_dir / "latest"), state(2))


def test_retention_keeps_aliases_loadable(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir, keep_last=1, best_metric="val") as m:
        for step, val in [(1, 0.5), (2, 0.4), (3, 0.9), (4, 0.3), (5, 0.8)]:
            m.save(step, state(step), {"val": val})
            same(sp.load(run_dir / "latest"), state(step))
            same(sp.load(run_dir / "best"), state(m.best_step()))
        assert m.steps() == [4, 5]


def test_no_aliases(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir, aliases=False, best_metric="val") as m:
        m.save(1, state(1), {"val": 1.0})
    assert sorted(os.listdir(run_dir)) == [
        ".writer.lock",
        "checkpoints",
        "history.jsonl",
        "report.json",
        "run.json",
    ]


def test_layout_names() -> None:
    assert layout.step_name(0) == "step-0000000000"
    assert layout.step_name(123) == "step-0000000123"
    assert layout.step_name(12345678901) == "step-12345678901"
    with pytest.raises(ValueError):
        layout.step_name(-1)


def test_committed_steps_ignores_everything_else(run_dir: Path) -> None:
    assert layout.committed_steps(str(run_dir)) == []
    with sp.CheckpointManager(run_dir) as m:
        m.save(12345678901, state(1))
        m.save(7, state(7))
    ck = run_dir / "checkpoints"
    (ck / "step-0000000003").mkdir()  # no manifest: not committed
    (ck / "step-12").mkdir()  # too few digits
    (ck / "notes.txt").write_text("x")
    (ck / ".step-0000000009.savepoint-tmp-h-1-abc").mkdir()
    (ck / ".step-0000000009.savepoint-tmp-h-1-abc" / "manifest.json").write_text("{}")
    assert layout.committed_steps(str(run_dir)) == [7, 12345678901]


@pytest.mark.parametrize("bad", [-1, True, 1.0, "3", None])
def test_save_rejects_bad_steps(run_dir: Path, bad: Any) -> None:
    with sp.CheckpointManager(run_dir) as m:
        with pytest.raises(ValueError):
            m.save(bad, state(1))
        assert m.steps() == []


def test_invalid_manager_arguments(run_dir: Path) -> None:
    with pytest.raises(ValueError):
        sp.CheckpointManager(run_dir, keep_best=2)  # no metric to rank by
    with pytest.raises(ValueError):
        sp.CheckpointManager(run_dir, best_metric="val", best_mode="lowest")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        sp.CheckpointManager(run_dir, keep_last=-1)
    with pytest.raises(ValueError):
        sp.CheckpointManager(run_dir, keep_every=0)


# -- retention --------------------------------------------------------------------------------------

# val for steps 1..20: ties (5/7, 13/15), missing values (4, 11, 18).
VALS: dict[int, float | None] = {
    1: 0.9, 2: 0.7, 3: 0.8, 4: None, 5: 0.5, 6: 0.65, 7: 0.5, 8: 0.95, 9: 0.6, 10: 0.45,
    11: None, 12: 0.7, 13: 0.3, 14: 0.55, 15: 0.3, 16: 0.9, 17: 0.35, 18: None, 19: 0.85, 20: 0.4,
}  # fmt: skip


def metrics_of(step: int) -> dict[str, float]:
    v = VALS[step]
    return {"loss": 1.0 / step} if v is None else {"val": v, "loss": 1.0 / step}


def reference(
    keep_last: int | None,
    keep_best: int | None,
    keep_every: int | None,
    best_metric: str | None,
    mode: str,
) -> list[list[int]]:
    """Steps on disk after each save of steps 1..20, computed independently of savepoint."""
    on_disk: list[int] = []
    out = []
    for step in range(1, 21):
        on_disk.append(step)
        scored = [(VALS[s], s) for s in on_disk if VALS[s] is not None]
        sign = 1 if mode == "min" else -1
        ranked = [s for _, s in sorted(scored, key=lambda vs: (sign * vs[0], -vs[1]))]
        rules = [keep_last, keep_best, keep_every]
        if all(r is None for r in rules):
            keep = set(on_disk)
        else:
            keep = set()
            if keep_last:
                keep |= set(sorted(on_disk)[-keep_last:])
            if keep_best:
                keep |= set(ranked[:keep_best])
            if keep_every:
                keep |= {s for s in on_disk if s % keep_every == 0}
        keep.add(step)
        if best_metric is not None and ranked:
            keep.add(ranked[0])
        on_disk = [s for s in on_disk if s in keep]
        out.append(sorted(on_disk))
    return out


# keep_last=2, keep_best=1 (min), keep_every=5, worked out by hand.
HAND = [
    [1], [1, 2], [2, 3], [2, 3, 4], [4, 5], [5, 6], [5, 6, 7], [5, 7, 8], [5, 7, 8, 9],
    [5, 9, 10], [5, 10, 11], [5, 10, 11, 12], [5, 10, 12, 13], [5, 10, 13, 14], [5, 10, 14, 15],
    [5, 10, 15, 16], [5, 10, 15, 16, 17], [5, 10, 15, 17, 18], [5, 10, 15, 18, 19],
    [5, 10, 15, 19, 20],
]  # fmt: skip


def test_reference_model_matches_hand_computation() -> None:
    assert reference(2, 1, 5, "val", "min") == HAND


@pytest.mark.parametrize(
    ("keep_last", "keep_best", "keep_every", "best_metric", "mode"),
    [
        (2, 1, 5, "val", "min"),
        (1, None, None, None, "min"),
        (1, None, None, "val", "min"),  # the best is protected without keep_best
        (1, None, None, "val", "max"),
        (3, None, None, None, "min"),
        (None, 2, None, "val", "min"),
        (None, 3, None, "val", "max"),
        (None, None, 4, None, "min"),
        (None, None, 4, "val", "max"),
        (2, 2, None, "val", "max"),
        (1, None, 3, None, "min"),
        (0, None, None, None, "min"),  # keep nothing: only the newest survives
        (None, None, None, None, "min"),  # no rule: keep everything
        (None, None, None, "val", "min"),
    ],
)
def test_retention_table(
    run_dir: Path,
    keep_last: int | None,
    keep_best: int | None,
    keep_every: int | None,
    best_metric: str | None,
    mode: Any,
) -> None:
    expected = reference(keep_last, keep_best, keep_every, best_metric, mode)
    if (keep_last, keep_best, keep_every, best_metric, mode) == (2, 1, 5, "val", "min"):
        assert expected == HAND
    m = sp.CheckpointManager(
        run_dir,
        keep_last=keep_last,
        keep_best=keep_best,
        keep_every=keep_every,
        best_metric=best_metric,
        best_mode=mode,
    )
    tiny = {"x": np.zeros(2, np.float32)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 21):
            m.save(step, tiny, metrics_of(step))
            assert m.steps() == expected[step - 1], f"after saving step {step}"
            assert read(run_dir / "report.json")["checkpoints"] == expected[step - 1][::-1]
    # Some saves give only a loss: when the run ranks by "val", that is said once, not per save.
    unranked = [w for w in caught if "is never ranked as the best" in str(w.message)]
    assert len(unranked) == (1 if best_metric is not None else 0), [str(w.message) for w in caught]
    assert len(caught) == len(unranked)
    m.close()
    # Reopening recomputes the same best from the checkpoints' metadata.
    with sp.CheckpointManager(run_dir, best_metric=best_metric, best_mode=mode) as again:
        assert again.best_step() == m.best_step()
        assert again.metrics(20) == metrics_of(20)


def test_custom_retention_policy_object(run_dir: Path) -> None:
    class Odd:
        def keep(self, entries: Any) -> set[int]:
            return {e.step for e in entries if e.step % 2}

    with sp.CheckpointManager(run_dir, retention=Odd(), keep_last=1) as m:
        for step in range(1, 7):
            m.save(step, {"x": np.zeros(1)})
        assert m.steps() == [1, 3, 5, 6]


def test_best_and_resumed_from_are_never_pruned(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir, keep_last=1, best_metric="val") as m:
        for step, val in [(1, 0.5), (2, 0.1), (3, 0.9), (4, 0.8)]:
            m.save(step, state(step), {"val": val})
        assert m.steps() == [2, 4]
        m.save(5, state(5))  # no metric: the best stays
        m.save(6, state(6), {"val": 0.05})
        assert m.steps() == [6]

    other = run_dir.parent / "resumed"
    with sp.CheckpointManager(other, keep_last=2) as m:
        for step in range(1, 5):
            m.save(step, state(step))
        assert m.steps() == [3, 4]
        into = blank()
        assert m.restore(into, 3) == 3
        same(into, state(3))
        for step in (4, 5, 6, 7):
            m.save(step, state(step))
            assert m.steps() == sorted({3, step - 1, step})
        same(sp.load(m.step_path(3)), state(3))


def test_resume_false_does_not_protect(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir, keep_last=2) as m:
        for step in range(1, 5):
            m.save(step, state(step))
        assert m.restore(blank(), 3, resume=False) == 3
        m.save(5, state(5))
        m.save(6, state(6))
        assert m.steps() == [5, 6]


# -- save policies ----------------------------------------------------------------------------------


def test_save_every_skips_and_force_overrides(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir, save_every=5) as m:
        written = []
        for step in range(1, 13):
            report = run_dir / "report.json"
            report_before = report.read_bytes() if report.exists() else None
            pending = m.save(step, state(step), {"val": float(step)})
            # A save is done once its background step (verification, retention) is.
            assert isinstance(pending, sp.PendingSave) and (pending.done() or not step % 5)
            pending.wait()
            assert pending.done()
            assert pending.step == step
            if step % 5:
                assert pending.skipped and pending.path is None
                assert not os.path.exists(m.step_path(step))
                assert pending.wait() is None
                if report_before is not None:
                    assert (run_dir / "report.json").read_bytes() == report_before
                assert m.metrics(step) == {}
            else:
                assert not pending.skipped and pending.path == m.step_path(step)
                assert isinstance(pending.wait(), sp.CheckpointInfo)
                written.append(step)
            assert m.steps() == written
            if step < 5:  # no report is written for a skipped step
                assert not report.exists()
        forced = m.save(7, state(7), force=True)
        assert not forced.skipped
        assert m.steps() == [5, 7, 10]
        same(sp.load(m.step_path(7)), state(7))


def test_save_policy_object(run_dir: Path) -> None:
    seen: list[tuple[int, int | None]] = []

    class Record:
        def should_save(self, step: int, last_saved: int | None) -> bool:
            seen.append((step, last_saved))
            return step in (2, 3)

    with sp.CheckpointManager(run_dir, save_policy=Record()) as m:
        for step in range(1, 5):
            m.save(step, state(step))
        m.save(9, state(9), force=True)  # not asked
        assert m.steps() == [2, 3, 9]
    assert seen == [(1, None), (2, None), (3, 2), (4, 3)]


def test_save_every_seconds_through_manager(run_dir: Path) -> None:
    now = [0.0]
    policy = sp.policies.SaveEverySeconds(60, clock=lambda: now[0])
    with sp.CheckpointManager(run_dir, save_policy=policy) as m:
        for step, t in [(1, 0.0), (2, 30.0), (3, 59.0), (4, 60.0), (5, 100.0), (6, 125.0)]:
            now[0] = t
            m.save(step, {"x": np.zeros(1)})
        assert m.steps() == [1, 4, 6]


# -- restore ----------------------------------------------------------------------------------------


def test_restore_latest_numpy(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
        into = blank()
        assert m.restore(into) == 3
        same(into, state(3))
    with sp.CheckpointManager(run_dir) as m:  # a new process
        into = blank()
        assert m.restore(into, "latest") == 3
        same(into, state(3))
        into = blank()
        assert m.restore(into, 2) == 2
        same(into, state(2))


def test_restore_best(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir, best_metric="acc", best_mode="max") as m:
        for step, acc in [(1, 0.5), (2, 0.75), (3, 0.6)]:
            m.save(step, state(step), {"acc": acc})
        into = blank()
        assert m.restore(into, "best") == 2
        same(into, state(2))


@pytest.mark.torch
def test_restore_torch_module_and_optimizer(run_dir: Path) -> None:
    torch = pytest.importorskip("torch")

    def make(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, opt = make(0)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6)).pow(2).sum().backward()
        opt.step()
    with sp.CheckpointManager(run_dir) as m:
        m.save(3, {"model": model, "opt": opt, "step": 3})
        model2, opt2 = make(1)
        target = {"model": model2, "opt": opt2, "step": 0}
        assert m.restore(target) == 3
    assert target["step"] == 3
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k])
    # Training continues identically.
    x = torch.randn(4, 6)
    for mm, oo in ((model, opt), (model2, opt2)):
        oo.zero_grad()
        mm(x).pow(2).sum().backward()
        oo.step()
    for v1, v2 in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(v1, v2)


def test_restore_empty_run_returns_none(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        into = blank()
        assert m.restore(into) is None
        same(into, blank())
        assert m.report.lineage == []


def test_restore_latest_skips_corrupt_newest(run_dir: Path, flip_byte: Callable[..., None]) -> None:
    with sp.CheckpointManager(run_dir) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
    flip_byte(run_dir / "checkpoints" / layout.step_name(3), "w", 17)
    with sp.CheckpointManager(run_dir) as m:
        into = blank()
        with pytest.warns(UserWarning, match="failed verification") as record:
            assert m.restore(into) == 2
        assert len(record) == 1 and "checkpoint 3" in str(record[0].message)
        same(into, state(2))
        assert m.report.lineage[-1]["resumed_from"] == 2


def test_restore_latest_skips_checkpoint_with_missing_data_file(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        m.save(1, state(1))
        m.save(2, state(2))
        for name in data_files(m.step_path(2)):
            os.unlink(os.path.join(m.step_path(2), name))
        into = blank()
        with pytest.warns(UserWarning, match="failed verification"):
            assert m.restore(into) == 1
        same(into, state(1))


def test_restore_latest_without_manifest_is_not_a_step(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        m.save(1, state(1))
        m.save(2, state(2))
    os.unlink(run_dir / "checkpoints" / layout.step_name(2) / "manifest.json")
    with sp.CheckpointManager(run_dir) as m:
        assert m.steps() == [1]
        into = blank()
        assert m.restore(into) == 1  # not committed, so nothing to warn about
        same(into, state(1))


def test_restore_all_corrupt_raises(run_dir: Path, flip_byte: Callable[..., None]) -> None:
    with sp.CheckpointManager(run_dir) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
        for step in (1, 2, 3):
            flip_byte(Path(m.step_path(step)), "b")
        report_before = (run_dir / "report.json").read_bytes()
        with pytest.warns(UserWarning, match="failed verification") as record:
            with pytest.raises(sp.CorruptCheckpointError) as info:
                m.restore(blank())
        assert len(record) == 3
        assert "no intact checkpoint" in str(info.value)
        assert (run_dir / "report.json").read_bytes() == report_before  # not resumed


def test_restore_best_or_number_never_substitutes(
    run_dir: Path, flip_byte: Callable[..., None]
) -> None:
    with sp.CheckpointManager(run_dir, best_metric="val") as m:
        m.save(1, state(1), {"val": 0.9})
        m.save(2, state(2), {"val": 0.1})
        m.save(3, state(3), {"val": 0.5})
        flip_byte(Path(m.step_path(2)), "w")
        with pytest.raises(sp.CorruptCheckpointError):
            m.restore(blank(), "best")
        with pytest.raises(sp.CorruptCheckpointError):
            m.restore(blank(), 2)
        assert m.report.lineage == []
        into = blank()
        assert m.restore(into) == 3  # "latest" is intact
        same(into, state(3))


def test_restore_missing_steps(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        with pytest.raises(sp.MissingCheckpointError):
            m.restore(blank(), "best")  # no best_metric
        m.save(5, state(5))
        with pytest.raises(sp.CheckpointNotFoundError) as info:
            m.restore(blank(), 4)
        assert isinstance(info.value, FileNotFoundError)
        with pytest.raises(sp.MissingCheckpointError):
            m.restore(blank(), "best")
        for bad in ("newest", True, 2.0, None):
            with pytest.raises(ValueError):
                m.restore(blank(), bad)  # type: ignore[arg-type]
    with sp.CheckpointManager(run_dir.parent / "other", best_metric="val") as m:
        with pytest.warns(UserWarning, match="'val'.*never ranked as the best"):
            m.save(1, state(1), {"loss": 3.0})  # never reports "val"
        with pytest.raises(sp.MissingCheckpointError):
            m.restore(blank(), "best")


def test_restore_mismatched_state_is_not_skipped(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        m.save(1, state(1))
        m.save(2, state(2))
        wrong = blank()
        wrong["w"] = np.zeros((3, 3), np.float32)
        with pytest.raises(sp.StateMismatchError):
            m.restore(wrong)


def _history_run(m: sp.CheckpointManager) -> None:
    for step in range(1, 7):
        m.log(step, loss=10.0 - step, lr=0.1 * step)
        if step % 2 == 0:
            m.save(step, state(step), {"val": 1.0 / step})


def test_restore_resume_false_leaves_report_alone(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        _history_run(m)
        before = (run_dir / "report.json").read_bytes()
        history, metrics = list(m.report.loss_history), dict(m.report.metric_history)
        into = blank()
        assert m.restore(into, 4, resume=False) == 4
        same(into, state(4))
        assert m.restore(blank(), "latest", resume=False) == 6
        assert (run_dir / "report.json").read_bytes() == before
        assert m.report.loss_history == history and m.report.metric_history == metrics
        assert m.report.lineage == [] and m.report.steps_completed == 6


def test_restore_resume_truncates_history(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        _history_run(m)
        assert [s for s, _ in m.report.loss_history] == [1, 2, 3, 4, 5, 6]
        assert m.restore(blank(), 4) == 4
        assert m.report.loss_history == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0)]
        assert sorted(m.report.metric_history) == [1, 2, 3, 4]
        assert m.report.metric_history[4] == {"lr": pytest.approx(0.4), "val": 0.25}
        assert m.report.steps_completed == 4
        (entry,) = m.report.lineage
        assert entry["resumed_from"] == 4 and entry["steps_completed_before"] == 6
        assert isinstance(entry["at"], str) and entry["at"]
        # restore() writes nothing (it must work on read-only media): the next save does.
        assert read(run_dir / "report.json")["lineage"] == []
        # The resumed run logs the replayed steps again.
        m.log(5, loss=4.5)
        m.save(6, state(6), {"val": 0.2})
        on_disk = full_report(run_dir)
        assert on_disk["loss_history"] == [[1, 9.0], [2, 8.0], [3, 7.0], [4, 6.0], [5, 4.5]]
        assert sorted(on_disk["metric_history"], key=int) == ["1", "2", "3", "4", "6"]
        assert on_disk["lineage"] == m.report.lineage and on_disk["steps_completed"] == 6
    with sp.CheckpointManager(run_dir) as m:
        assert m.report.loss_history[-1] == (5, 4.5)
        assert m.restore(blank()) == 6
        assert [e["resumed_from"] for e in m.report.lineage] == [4, 6]


# -- consistency at open ----------------------------------------------------------------------------

IDENTITY: dict[str, Any] = {
    "name": "exp",
    "variant": "wide",
    "config": {"lr": 0.1, "sizes": [64, 32], "opt": {"beta": 0.9}},
    "num_params": 1000,
}


def _make_run(run_dir: Path, **extra: Any) -> None:
    with sp.CheckpointManager(run_dir, best_metric="val", **IDENTITY, **extra) as m:
        m.save(1, state(1), {"val": 0.3})
        m.save(2, state(2), {"val": 0.5})


@pytest.mark.parametrize(
    "change",
    [
        {"variant": "narrow"},
        {"config": {"lr": 0.2, "sizes": [64, 32], "opt": {"beta": 0.9}}},
        {"config": {}},
        {"config": {"lr": 0.1, "sizes": [64, 32], "opt": {"beta": 0.99}}},
        {"num_params": 1001},
        {"name": "other"},
    ],
)
def test_reopen_with_different_identity(run_dir: Path, change: dict[str, Any]) -> None:
    _make_run(run_dir)
    before = snapshot(run_dir), read(run_dir / "run.json")
    with pytest.raises(sp.RunMismatchError) as info:
        sp.CheckpointManager(run_dir, **{**IDENTITY, **change}, strict_config=True)
    assert info.value.path == str(run_dir)
    assert isinstance(info.value, sp.IncompatibleCheckpointError)
    if "config" in change:  # the message names the keys that changed
        changed = [c["key"] for c in config_diff(IDENTITY["config"], change["config"])]
        assert changed and all(key in str(info.value) for key in changed)
    assert (snapshot(run_dir), read(run_dir / "run.json")) == before


def test_config_change_on_resume_is_recorded_and_warned(run_dir: Path) -> None:
    """A different config warns naming the keys, becomes the run's config, and report.json keeps
    the history: keys (dotted), old and new values, and the latest committed step at that open."""
    _make_run(run_dir)
    new = {"lr": 0.05, "sizes": [64, 32], "opt": {"beta": 0.99, "eps": 1e-8}}
    with pytest.warns(UserWarning, match=r"lr, opt\.beta, opt\.eps") as caught:
        m = sp.CheckpointManager(run_dir, **{**IDENTITY, "config": new})
    assert len(caught) == 1
    assert m.run.config == new and m.steps() == [1, 2]
    expected = [
        {"key": "lr", "old": 0.1, "new": 0.05},
        {"key": "opt.beta", "old": 0.9, "new": 0.99},
        {"key": "opt.eps", "new": 1e-8},
    ]
    doc = read(run_dir / "report.json")
    (change,) = doc["config_changes"]
    assert change["step"] == 2 and change["changes"] == expected and change["at"]
    assert doc["config"] == new
    assert read(run_dir / "run.json")["config"] == new
    m.save(3, state(3), {"val": 0.2})
    m.close()
    with sp.CheckpointManager(run_dir, **{**IDENTITY, "config": new}) as again:  # no warning
        assert again.report.config_changes[0]["changes"] == expected
    with pytest.warns(UserWarning, match="lr"):
        back = sp.CheckpointManager(run_dir, config=IDENTITY["config"])
    back.close()
    changes = read(run_dir / "report.json")["config_changes"]
    assert [c["step"] for c in changes] == [2, 3]
    assert changes[1]["changes"][0] == {"key": "lr", "old": 0.05, "new": 0.1}


def test_config_change_survives_a_kill_before_run_json(run_dir: Path) -> None:
    """report.json is written before run.json: a run.json left behind (killed in between) is not
    a mismatch, and the next writer brings it up to date."""
    _make_run(run_dir)
    old_run = (run_dir / "run.json").read_bytes()
    new = {**IDENTITY["config"], "lr": 0.3}
    with pytest.warns(UserWarning, match="lr"):
        sp.CheckpointManager(run_dir, config=new).close()
    (run_dir / "run.json").write_bytes(old_run)  # as if killed between the two writes
    assert sp.open_run(run_dir).problems() == []
    with sp.CheckpointManager(run_dir, config=new) as m:  # the same config: no new change
        assert m.run.config == new and len(m.report.config_changes) == 1
    assert read(run_dir / "run.json")["config"] == new


def test_strict_config_compares_with_a_run_json_caught_up_after_a_kill(run_dir: Path) -> None:
    _make_run(run_dir)
    old_run = (run_dir / "run.json").read_bytes()
    new = {**IDENTITY["config"], "lr": 0.3}
    with pytest.warns(UserWarning, match="lr"):
        sp.CheckpointManager(run_dir, config=new).close()
    (run_dir / "run.json").write_bytes(old_run)  # as if killed between the two writes
    with sp.CheckpointManager(run_dir, config=new, strict_config=True) as m:
        assert m.run.config == new and len(m.report.config_changes) == 1
    assert read(run_dir / "run.json")["config"] == new
    with pytest.raises(sp.RunMismatchError, match="lr"):
        sp.CheckpointManager(run_dir, config=IDENTITY["config"], strict_config=True)


def test_read_only_manager_only_warns_about_a_config_change(run_dir: Path) -> None:
    _make_run(run_dir)
    before = snapshot(run_dir), read(run_dir / "run.json")
    with pytest.warns(UserWarning, match="records nothing"):
        m = sp.CheckpointManager(run_dir, config={"lr": 1.0}, read_only=True)
    m.close()
    assert (snapshot(run_dir), read(run_dir / "run.json")) == before


def test_reopen_with_same_or_no_identity(run_dir: Path) -> None:
    _make_run(run_dir)
    with sp.CheckpointManager(run_dir, **IDENTITY) as m:
        assert m.steps() == [1, 2]
    with sp.CheckpointManager(run_dir) as m:
        assert (m.run.name, m.run.variant, m.run.config, m.run.num_params) == tuple(
            IDENTITY.values()
        )
    with sp.CheckpointManager(run_dir, variant="wide") as m:
        assert m.run.num_params == 1000


def test_reopen_with_same_config_holding_numpy_scalars(run_dir: Path) -> None:
    config = {"lr": np.float32(0.5), "steps": np.int64(10), "nested": {"wd": np.float64(0.25)}}
    with sp.CheckpointManager(run_dir, config=config) as m:
        m.save(1, state(1))
    assert read(run_dir / "run.json")["config"] == {"lr": 0.5, "steps": 10, "nested": {"wd": 0.25}}
    with sp.CheckpointManager(run_dir, config=config) as m:
        assert m.steps() == [1]


def test_reopen_with_same_config_holding_tuples(run_dir: Path) -> None:
    """The same config, given the same way, reopens the run (JSON stores tuples as lists)."""
    config = {"sizes": (64, 32), "name": "mlp"}
    with sp.CheckpointManager(run_dir, config=config) as m:
        m.save(1, state(1))
    assert read(run_dir / "run.json")["config"] == {"sizes": [64, 32], "name": "mlp"}
    with sp.CheckpointManager(run_dir, config=config) as m:
        assert m.steps() == [1]


@pytest.mark.parametrize(
    ("field", "value"),
    [("variant", "narrow"), ("config", {"lr": 0.2}), ("num_params", 5), ("variant", None)],
)
def test_edited_report_is_a_mismatch(run_dir: Path, field: str, value: Any) -> None:
    _make_run(run_dir)
    path = run_dir / "report.json"
    doc = read(path)
    doc[field] = value
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(sp.RunMismatchError):
        sp.CheckpointManager(run_dir)


def test_edited_run_json_is_a_mismatch(run_dir: Path) -> None:
    _make_run(run_dir)
    path = run_dir / "run.json"
    doc = read(path)
    doc["num_params"] = 7
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(sp.RunMismatchError):
        sp.CheckpointManager(run_dir)


def test_missing_best_checkpoint_at_open(run_dir: Path) -> None:
    _make_run(run_dir)
    assert read(run_dir / "report.json")["best"]["step"] == 1
    shutil.rmtree(run_dir / "checkpoints" / layout.step_name(1))
    with pytest.raises(sp.MissingCheckpointError) as info:
        sp.CheckpointManager(run_dir)
    assert "step 1" in str(info.value)


def test_missing_other_checkpoint_is_fine(run_dir: Path) -> None:
    _make_run(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / layout.step_name(2))
    with sp.CheckpointManager(run_dir, best_metric="val") as m:
        assert m.steps() == [1] and m.best_step() == 1


def test_garbage_run_files(run_dir: Path) -> None:
    _make_run(run_dir)
    (run_dir / "report.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(sp.CorruptCheckpointError):
        sp.CheckpointManager(run_dir)
    other = run_dir.parent / "other"
    other.mkdir()
    (other / "run.json").write_text('{"format": "something-else"}', encoding="utf-8")
    with pytest.raises(sp.CorruptCheckpointError):
        sp.CheckpointManager(other)


# -- verification before pruning --------------------------------------------------------------------


def test_verify_failure_prunes_nothing(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    injected = sp.CorruptCheckpointError("injected", path="x")

    def failing_verify(path: Any, **kwargs: Any) -> Any:
        calls.append(os.fspath(path))
        raise injected

    m = sp.CheckpointManager(run_dir, keep_last=1)
    monkeypatch.setattr(savepoint.checkpoint, "verify", failing_verify)
    m.save(1, state(1))
    assert calls == []  # nothing to prune, nothing to verify
    m.save(2, state(2))  # verified in the background: the next save, wait() or close() raises
    with pytest.raises(sp.CorruptCheckpointError) as info:
        m.wait()
    assert info.value.__cause__ is injected or info.value is injected
    assert "did not verify" in str(info.value) and "nothing was pruned" in str(info.value)
    assert calls == [m.step_path(2)]
    assert m.steps() == [1, 2]
    m.wait()  # raised once
    same(sp.load(m.step_path(1)), state(1))
    monkeypatch.undo()
    m.save(3, state(3))
    assert m.steps() == [3]  # 2 is not counted by keep_last=1, and goes once 3 verifies
    m.close()


def test_real_verification_catches_damage_before_pruning(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, flip_byte: Callable[..., None]
) -> None:
    real_verify = savepoint.checkpoint.verify

    def damage_then_verify(path: Any, **kwargs: Any) -> Any:
        flip_byte(Path(path), "w", 3)
        return real_verify(path, **kwargs)

    with sp.CheckpointManager(run_dir, keep_last=1) as m:
        m.save(1, state(1))
        monkeypatch.setattr(savepoint.checkpoint, "verify", damage_then_verify)
        m.save(2, state(2))
        with pytest.raises(sp.CorruptCheckpointError):
            m.save(3, state(3))  # raised by the next save, which saves nothing
        assert m.steps() == [1, 2]
        same(sp.load(m.step_path(1)), state(1))


def test_verify_is_skipped_when_disabled(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_verify(path: Any, **kwargs: Any) -> Any:
        raise AssertionError("verify must not run")

    monkeypatch.setattr(savepoint.checkpoint, "verify", failing_verify)
    with sp.CheckpointManager(run_dir, keep_last=1, verify_before_prune=False) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
        assert m.steps() == [3]


# -- stale temporaries ------------------------------------------------------------------------------


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return proc.pid
    pytest.skip("the pid of a reaped child was reused at once")


def tmp_name(name: str, pid: int, host: str = names.HOST) -> str:
    return f".{name}{names.TMP_TAG}{host}-{pid}-0123abcd"


def test_stale_checkpoint_temporaries_removed_at_open(run_dir: Path, dead_pid: int) -> None:
    with sp.CheckpointManager(run_dir) as m:
        m.save(1, state(1))
        m.save(2, state(2))
    ck = run_dir / "checkpoints"
    staging = ck / tmp_name(layout.step_name(3), dead_pid)  # an interrupted save
    staging.mkdir()
    (staging / "data-00000.safetensors").write_bytes(b"\0" * 100)
    discarded = ck / tmp_name(layout.step_name(1), dead_pid)  # an interrupted prune
    shutil.copytree(ck / layout.step_name(1), discarded)
    alias = run_dir / tmp_name("latest", dead_pid)  # an interrupted alias update
    shutil.copytree(run_dir / "latest", alias)
    live = ck / tmp_name(layout.step_name(4), os.getpid())  # a save in progress here
    live.mkdir()
    foreign = ck / tmp_name(layout.step_name(5), dead_pid, host="otherhost")
    foreign.mkdir()

    with sp.CheckpointManager(run_dir) as m:
        assert not staging.exists() and not discarded.exists() and not alias.exists()
        assert live.exists() and foreign.exists()
        assert m.steps() == [1, 2]
        same(sp.load(m.step_path(1)), state(1))


def test_stale_report_temporary_removed_at_open(run_dir: Path, dead_pid: int) -> None:
    """A report.json or run.json write interrupted by a kill leaves a hidden temporary *file*;
    opening the run removes it like any other temporary of a dead process."""
    with sp.CheckpointManager(run_dir) as m:
        m.save(1, state(1))
    stale = [run_dir / tmp_name("report.json", dead_pid), run_dir / tmp_name("run.json", dead_pid)]
    for path in stale:
        path.write_bytes(b'{"format": "savepoint-report"')
    with sp.CheckpointManager(run_dir) as m:
        assert m.steps() == [1]
        assert [p.name for p in stale if p.exists()] == []


# -- metrics, log, wall time, lifecycle -------------------------------------------------------------


def test_numpy_metrics_stored_as_plain_numbers(run_dir: Path) -> None:
    metrics = {
        "val": np.float32(0.5),
        "acc": np.float64(0.25),
        "n": np.int64(3),
        "flag": np.bool_(True),
        "zero_d": np.array(1.5),
    }
    want = {"val": 0.5, "acc": 0.25, "n": 3, "flag": True, "zero_d": 1.5}
    with sp.CheckpointManager(run_dir, best_metric="val") as m:
        m.save(1, state(1), metrics)
        m.log(1, loss=np.float32(2.5), lr=np.float64(0.125))
        got = m.metrics(1)
        assert got == want
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}
        assert m.best_step() == 1
    meta = sp.inspect(run_dir / "checkpoints" / layout.step_name(1)).metadata
    assert meta["savepoint_run"]["metrics"] == want
    report = full_report(run_dir)
    assert report["metric_history"]["1"] == {**want, "lr": 0.125}
    assert report["loss_history"] == [[1, 2.5]]
    assert report["best"]["metrics"] == want
    with sp.CheckpointManager(run_dir, best_metric="val") as m:
        assert m.metrics(1) == want and type(m.metrics(1)["n"]) is int


@pytest.mark.torch
def test_torch_metrics_stored_as_plain_numbers(run_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    with sp.CheckpointManager(run_dir, best_metric="val") as m:
        m.save(1, state(1), {"val": torch.tensor(0.25), "n": torch.tensor(4)})
        m.log(1, loss=torch.tensor(1.5), acc=torch.tensor(0.75))
        assert m.metrics(1) == {"val": 0.25, "n": 4}
        assert type(m.metrics(1)["val"]) is float and type(m.metrics(1)["n"]) is int
    report = full_report(run_dir)
    assert report["metric_history"]["1"] == {"val": 0.25, "n": 4, "acc": 0.75}
    assert report["loss_history"] == [[1, 1.5]]


def test_non_finite_metric_does_not_stop_the_save(run_dir: Path) -> None:
    """A diverged evaluation (NaN) must not cost the checkpoint; such a step is never the best
    (the policies' rule for non-finite values)."""
    with sp.CheckpointManager(run_dir, best_metric="val") as m:
        m.save(1, state(1), {"val": 0.5})
        m.save(2, state(2), {"val": float("nan")})
        assert m.steps() == [1, 2]
        assert m.best_step() == 1
    with sp.CheckpointManager(run_dir, best_metric="val") as m:
        assert m.steps() == [1, 2] and m.best_step() == 1


def test_log_builds_history(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        m.log(1, loss=2.0)
        m.log(2, loss=1.5, acc=0.5)
        m.log(3, acc=0.7)
        m.log(3, top5=0.9)
        assert m.report.loss_history == [(1, 2.0), (2, 1.5)]
        assert m.report.metric_history == {2: {"acc": 0.5}, 3: {"acc": 0.7, "top5": 0.9}}
        assert m.report.steps_completed == 3
        m.log(2, loss=1.4)  # an older step does not lower the count
        assert m.report.steps_completed == 3
        m.save(3, state(3), {"val": 0.1}, epoch=2)
        assert m.report.metric_history[3] == {"acc": 0.7, "top5": 0.9, "val": 0.1}
        assert m.report.epoch == 2
    report = full_report(run_dir)
    assert report["loss_history"] == [[1, 2.0], [2, 1.5], [2, 1.4]]
    assert report["epoch"] == 2 and report["steps_completed"] == 3
    assert sp.inspect(run_dir / "latest").metadata["savepoint_run"]["epoch"] == 2


def test_wall_time_grows(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        m.save(1, state(1))
        first = read(run_dir / "report.json")["wall_time_s"]
        time.sleep(0.05)
        m.save(2, state(2))
        second = read(run_dir / "report.json")["wall_time_s"]
        assert second >= first + 0.04
    closed = read(run_dir / "report.json")["wall_time_s"]
    assert closed >= second
    with sp.CheckpointManager(run_dir) as m:  # a resumed process adds to it once it saves
        assert m.restore(blank()) == 2
        time.sleep(0.05)
        m.save(3, state(3))
    assert read(run_dir / "report.json")["wall_time_s"] >= closed + 0.04


@pytest.mark.parametrize("how", ["open", "restore", "peek", "resume", "resume-best"])
def test_reading_a_run_does_not_rewrite_its_report(run_dir: Path, how: str) -> None:
    """Opening a run, restoring (resuming or not: an evaluation script) or peeking leave
    report.json and history.jsonl as they were, byte for byte. (HEAD rewrote the report at
    close() with a new wall time; and a resuming restore then close() set steps_completed back
    to the step restored and appended a resumed_from record: issue 25, item 15.)"""
    with sp.CheckpointManager(run_dir, best_metric="val") as m:
        for step, val in ((1, 0.5), (2, 0.3), (3, 0.4)):
            m.log(step, loss=1.0 / step)
            m.save(step, state(step), {"val": val})
    files = [run_dir / "report.json", run_dir / "history.jsonl"]
    before = [(f.read_bytes(), os.stat(f).st_mtime_ns) for f in files]
    time.sleep(0.02)
    with sp.CheckpointManager(run_dir) as m:
        if how == "restore":
            assert m.restore(blank(), resume=False) == 3
            assert m.restore(blank(), "best", resume=False) == 2
        elif how == "peek":
            assert m.peek(["step"]) == {"step": 3}
        elif how == "resume":
            assert m.restore(blank()) == 3
        elif how == "resume-best":
            assert m.restore(blank(), "best") == 2
            assert m.report.steps_completed == 2  # the resumed run, in memory
    after = [(f.read_bytes(), os.stat(f).st_mtime_ns) for f in files]
    assert after == before
    assert read(run_dir / "report.json")["steps_completed"] == 3


def test_a_resume_is_recorded_by_the_next_log_or_save(run_dir: Path) -> None:
    """The resume an evaluation never records is recorded by the first write that follows it,
    ahead of that write's own records: the history then forgets the abandoned steps."""
    with sp.CheckpointManager(run_dir, best_metric="val") as m:
        for step in (1, 2, 3):
            m.log(step, loss=float(step))
            m.save(step, state(step), {"val": 1.0 / step})
    with sp.CheckpointManager(run_dir) as m:
        assert m.restore(blank(), 2) == 2
        m.log(3, loss=30.0)  # the replayed step, logged again
    report = full_report(run_dir)
    assert report["loss_history"] == [[1, 1.0], [2, 2.0], [3, 30.0]]
    assert [e["resumed_from"] for e in report["lineage"]] == [2]
    assert report["lineage"][0]["steps_completed_before"] == 3
    with sp.CheckpointManager(run_dir) as m:
        assert m.restore(blank(), 1) == 1
        m.save(2, state(2))
    report = full_report(run_dir)
    assert report["loss_history"] == [[1, 1.0]]
    assert [e["resumed_from"] for e in report["lineage"]] == [2, 1]


def test_context_manager_closes(run_dir: Path) -> None:
    with sp.CheckpointManager(run_dir) as m:
        m.log(1, loss=3.0)
        assert not (run_dir / "report.json").exists()
    assert full_report(run_dir)["loss_history"] == [[1, 3.0]]
    with pytest.raises(RuntimeError):
        m.save(2, state(2))
    with pytest.raises(RuntimeError):
        m.restore(blank())
    m.close()  # idempotent
    assert "CheckpointManager(" in repr(m)
    assert m.steps() == []


def test_close_writes_report_even_on_error(run_dir: Path) -> None:
    def train() -> None:
        with sp.CheckpointManager(run_dir) as m:
            m.log(1, loss=1.0)
            raise KeyError("boom")

    with pytest.raises(KeyError):
        train()
    assert full_report(run_dir)["loss_history"] == [[1, 1.0]]


# -- SIGKILL during saves ---------------------------------------------------------------------------

CHILD = Path(child.__file__)


def _read_lines(proc: subprocess.Popen[bytes], until: str, timeout: float) -> list[str]:
    """Lines the child printed until ``until`` (or end of output / timeout)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf, lines = b"", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        buf += chunk
        *done, buf = buf.split(b"\n")
        lines += [d.decode() for d in done]
        if until in lines:
            break
    return lines


def _drain(proc: subprocess.Popen[bytes]) -> list[str]:
    assert proc.stdout is not None
    return proc.stdout.read().decode().splitlines()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
def test_sigkill_during_saves_leaves_a_usable_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rng = random.Random(20261121)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    mid_save = 0
    newest_seen = 0
    unpruned = 0  # saves whose retention may not have run yet
    kills = campaign(8, 15)  # make torture: 15 * SAVEPOINT_TORTURE_SCALE
    started = time.monotonic()
    for i in range(kills):
        proc = subprocess.Popen(
            [sys.executable, "-W", "error", str(CHILD), str(run)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        try:
            lines = _read_lines(proc, "ready", timeout=60)
            assert "ready" in lines, (lines, proc.stderr.read().decode() if proc.poll() else "")
            time.sleep(rng.uniform(0.0, 0.6))
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL, proc.stderr.read().decode()
            lines += _drain(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()
            proc.stderr.close()
        saving = [int(x.split()[1]) for x in lines if x.startswith("saving ")]
        saved = [int(x.split()[1]) for x in lines if x.startswith("saved ")]
        if saving and (not saved or saving[-1] != saved[-1]):
            mid_save += 1
        # Retention runs in each save's background step, which the next save joins before it
        # commits: a child that got two saves through pruned everything before its last ones;
        # a child killed sooner may leave each of its saves unpruned (the next prune catches up).
        if len(saved) >= 2:
            unpruned = len(saving) - len(saved) + 1
        else:
            unpruned += len(saving)

        # The newest committed step is exactly what was saved for it; every committed one verifies.
        steps = layout.committed_steps(str(run))
        if saved:
            assert steps and steps[-1] >= saved[-1]
        if not steps:
            continue
        newest = steps[-1]
        assert newest >= newest_seen  # nothing committed is ever lost
        newest_seen = newest
        same(sp.load(run / "checkpoints" / layout.step_name(newest)), child.make_state(newest))
        for step in steps:
            sp.verify(run / "checkpoints" / layout.step_name(step))
        for alias in ("latest", "best"):
            if (run / alias).exists():
                sp.verify(run / alias)

        # The manager reopens cleanly and tidies what the killed process left behind: it
        # finishes the deletions the report announced, and makes the aliases agree with it.
        before = read(run / "report.json") if (run / "report.json").exists() else {}
        leaving = set(before.get("discarding", [])) - set(before.get("checkpoints", []))
        with sp.CheckpointManager(run, **child.RUN_OPTIONS) as m:
            steps = [s for s in steps if s not in leaving]
            assert m.steps() == steps
            assert layout.committed_steps(str(run)) == steps
            assert aliases.run_problems(str(run), m.report, steps) == [], f"kill {i}"
            assert hidden(run / "checkpoints") == [], f"kill {i}"
            # Alias temporaries are directories; the report.json temporary file a kill can leave
            # is checked deterministically by test_stale_report_temporary_removed_at_open.
            assert [h for h in hidden(run) if (run / h).is_dir()] == [], f"kill {i}"
            # keep_last, the best, the step the child resumed from, and the saves not yet pruned
            assert len(steps) <= child.KEEP_LAST + 2 + max(1, unpruned), (steps, unpruned)
            best = m.best_step()
            assert best in steps
            report = read(run / "report.json")
            if report["best"] is not None:
                assert report["best"]["step"] in steps

    assert newest_seen >= 3, "the child never got far enough to test anything"
    assert mid_save >= 1, "no kill landed during a save"
    with sp.CheckpointManager(run, **child.RUN_OPTIONS) as m:
        into = child.blank_state()
        assert m.restore(into) == newest_seen
        same(into, child.make_state(newest_seen))
    assert time.monotonic() - started < 60


def test_saving_a_lower_step_after_a_resume_keeps_the_resumed_checkpoint(tmp_path: Path) -> None:
    # A step counter that restarts after a resume must not wipe the run: only checkpoints past
    # the one resumed from are the abandoned timeline.
    run = tmp_path / "run"
    m = sp.CheckpointManager(run, keep_last=3)
    for step in (100, 200, 300):
        m.save(step, {"w": np.full(3, step)})
    m.close()
    m = sp.CheckpointManager(run, keep_last=3)
    state = {"w": np.zeros(3, np.int64)}
    assert m.restore(state, step=200) == 200
    m.save(50, {"w": np.full(3, 50)})
    assert m.steps() == [50, 100, 200]  # 300 was the abandoned timeline; 100 is kept by keep_last
    m.close()
