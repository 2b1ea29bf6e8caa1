"""latest/ and best/ always agree with report.json when a manager opens or a reader asks.

A SIGKILL between the report write and the alias update left them naming an older checkpoint; an
abandoned timeline that took the best checkpoint with it left best/ holding deleted data. Opening
a (writable) manager repairs both; restore() never reads the alias directories; ``savepoint ls``
and ``savepoint verify RUN`` report any disagreement (verify exits 1).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import savepoint as sp
from _compare import same
from savepoint.cli import main
from savepoint.runs import aliases, layout
from savepoint.runs.report import Report

from . import _kill_manager_child as child
from ._util import blank, leftovers, read, run_kill_child, state


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def report_of(run: Path) -> Report:
    return Report.from_json(read(run / "report.json"), str(run / "report.json"))


def held(run: Path, alias: str) -> int | None:
    return aliases.recorded_step(str(run), alias)


def test_kill_between_alias_update_and_report_is_repaired_at_open(tmp_path: Path) -> None:
    """The aliases are swapped just before report.json is replaced (one sync of the run
    directory makes all three durable): a kill in between leaves latest/ ahead of the report."""
    run = tmp_path / "run"
    run_kill_child(run, "report:3")
    # The window was hit: latest/ already holds step 3, the report still says step 2.
    assert read(run / "report.json")["latest_step"] == 2
    assert held(run, "latest") == 3
    code, out = cli("verify", str(run))
    assert code == 1 and "latest/ is a copy of step 3, but report.json says step 2" in out
    _, out = cli("ls", str(run))
    assert "warning: latest/ is a copy of step 3" in out
    assert cli("ls", str(run), "--json")[1].count("latest/ is a copy of step 3") == 1

    # A read-only reader resolves "latest" through the checkpoints, not the stale alias.
    reader = sp.CheckpointManager(run, read_only=True)
    into = child.blank_state()
    assert reader.restore(into) == 3
    same(into, child.make_state(3))
    reader.close()

    with sp.CheckpointManager(run, **child.RUN_OPTIONS) as m:  # opening repairs
        assert held(run, "latest") == 3 and m.latest_step() == 3
        assert held(run, "best") == m.best_step() == report_of(run).best["step"]  # type: ignore[index]
    same(sp.load(run / "latest"), child.make_state(3))
    assert cli("verify", str(run))[0] == 0
    assert leftovers(run) == []


def test_kill_after_commit_before_the_report_is_adopted_at_open(tmp_path: Path) -> None:
    """A checkpoint committed by a save killed before its books (here as its aliases were about
    to be swapped) is kept (nothing committed is lost) and listed by the next open, aliases
    included."""
    run = tmp_path / "run"
    run_kill_child(run, "alias:3")
    assert held(run, "latest") == 2
    assert layout.committed_steps(str(run)) == [1, 2, 3]
    assert read(run / "report.json")["checkpoints"] == [2, 1]
    code, out = cli("verify", str(run))
    assert code == 1 and "step 3 committed but not listed in report.json" in out
    with sp.CheckpointManager(run, **child.RUN_OPTIONS) as m:
        assert m.steps() == [1, 2, 3]
        report = read(run / "report.json")
        assert report["checkpoints"] == [3, 2, 1] and report["latest_step"] == 3
        assert held(run, "latest") == 3
    assert cli("verify", str(run))[0] == 0


def test_kill_while_deleting_is_finished_at_open(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_kill_child(run, "discard:3")  # keep_last=2 with step 2 the best: step 1 goes
    assert layout.committed_steps(str(run)) == [1, 2, 3]
    report = read(run / "report.json")
    assert report["checkpoints"] == [3, 2] and report["discarding"] == [1]
    assert cli("verify", str(run))[0] == 1
    reader = sp.CheckpointManager(run, read_only=True)
    assert reader.steps() == [2, 3]  # readers ignore what is being deleted
    reader.close()
    with sp.CheckpointManager(run, **child.RUN_OPTIONS) as m:
        assert m.steps() == [2, 3] and layout.committed_steps(str(run)) == [2, 3]
    assert read(run / "report.json")["discarding"] == []
    assert cli("verify", str(run))[0] == 0


def test_abandoned_timeline_takes_best_with_it(tmp_path: Path) -> None:
    """Resuming from step 2 abandons 3-5; the best (step 3) was among them and no remaining step
    reports the metric, so the report has no best, and best/ must not keep step 3's data."""
    run = tmp_path / "run"
    with sp.CheckpointManager(run, best_metric="val") as m:
        for step in (1, 2, 3, 4, 5):
            m.save(step, state(step), {"val": 0.1 * step} if step >= 3 else {})
        assert m.best_step() == 3 and held(run, "best") == 3
    with sp.CheckpointManager(run, best_metric="val") as m:
        assert m.restore(blank(), 2) == 2
        m.save(3, state(103))  # the new timeline: 3-5 of the old one go
        assert m.steps() == [1, 2, 3] and m.best_step() is None
        assert read(run / "report.json")["best"] is None
        assert not (run / "best").exists()
        same(sp.load(run / "latest"), state(103))
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(run / "best")
    assert cli("verify", str(run))[0] == 0


def test_abandoned_timeline_moves_best_to_an_older_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(run, best_metric="val") as m:
        for step, val in ((1, 0.5), (2, 0.4), (3, 0.3), (4, 0.1)):
            m.save(step, state(step), {"val": val})
        assert m.restore(blank(), 2) == 2
        m.save(3, state(103), {"val": 0.9})
        assert m.steps() == [1, 2, 3] and m.best_step() == 2
    same(sp.load(run / "best"), state(2))
    assert cli("verify", str(run))[0] == 0


def _stale_aliases(run: Path) -> None:
    """Steps 1-3 saved; then latest/ is made a copy of step 1, best/ of step 3 (wrong twice)."""
    with sp.CheckpointManager(run, best_metric="val") as m:
        for step, val in ((1, 0.3), (2, 0.1), (3, 0.2)):
            m.save(step, state(step), {"val": val})
    aliases.publish(str(run), "latest", 1)
    aliases.publish(str(run), "best", 3)


def test_stale_aliases_are_repaired_at_open(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _stale_aliases(run)
    code, out = cli("verify", str(run))
    assert code == 1
    assert "latest/ is a copy of step 1, but report.json says step 3" in out
    assert "best/ is a copy of step 3, but report.json says step 2" in out
    reader = sp.CheckpointManager(run, read_only=True)  # readers repair nothing ...
    into = blank()
    assert reader.restore(into, "best") == 2  # ... but never read through the aliases
    same(into, state(2))
    assert reader.restore(into, "latest") == 3
    same(into, state(3))
    reader.close()
    assert held(run, "latest") == 1
    sp.CheckpointManager(run).close()  # no options: the report's metric still names the best
    assert (held(run, "latest"), held(run, "best")) == (3, 2)
    assert read(run / "report.json")["best"]["step"] == 2
    assert cli("verify", str(run))[0] == 0


def test_alias_without_a_report_entry_is_removed_at_open(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(run) as m:
        m.save(1, state(1))
    shutil.copytree(run / "latest", run / "best")  # the report has no best
    assert cli("verify", str(run))[0] == 1
    sp.CheckpointManager(run).close()
    assert not (run / "best").exists() and held(run, "latest") == 1


def test_aliases_off_removes_only_disagreeing_aliases(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _stale_aliases(run)
    aliases.publish(str(run), "best", 2)  # best/ agrees again; latest/ does not
    with sp.CheckpointManager(run, aliases=False) as m:
        assert not (run / "latest").exists() and held(run, "best") == 2
        m.save(4, state(4), {"val": 0.05})  # a new best: best/ would disagree, so it goes
        assert not (run / "best").exists()
    assert cli("verify", str(run))[0] == 0


def test_ls_and_verify_of_a_healthy_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(run, best_metric="val", keep_last=1) as m:
        for step, val in ((1, 0.2), (2, 0.5), (3, 0.4)):
            m.save(step, state(step), {"val": val})
    code, out = cli("verify", str(run))
    assert code == 0 and "ok: run run: 2 checkpoint(s) verified" in out
    assert "latest/ = step 3, best/ = step 1" in out
    code, out = cli("ls", str(run))
    assert code == 0 and "warning" not in out
    assert '"problems": []' in cli("ls", str(run), "--json")[1]


def test_verify_run_reports_a_damaged_checkpoint(
    tmp_path: Path, flip_byte: Callable[..., None]
) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(run) as m:
        m.save(1, state(1))
        m.save(2, state(2))
    flip_byte(run / "checkpoints" / layout.step_name(1), "w")
    code, out = cli("verify", str(run))
    assert code == 1 and "step 1 does not verify" in out
    os.unlink(run / "latest" / "manifest.json")
    code, out = cli("verify", str(run))
    assert "latest/ is not a copy of any step" in out
