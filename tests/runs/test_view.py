"""``sp.open_run``: the read-only view of a run, ``peek``, and the consistency check they share
with ``savepoint ls``, ``report`` and ``verify RUN``."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
from _compare import same
from _support import run_doc_snippets
from savepoint.cli import main
from savepoint.runs import layout

from ._util import blank, read, read_only_media, state

ROOT = Path(__file__).resolve().parents[2]
OPTIONS: dict[str, Any] = {"keep_last": 2, "best_metric": "val", "name": "exp", "variant": "v1"}


def _build(run: Path) -> None:
    with sp.CheckpointManager(run, config={"lr": 0.1}, **OPTIONS) as m:
        for step, val in ((1, 0.5), (2, 0.1), (3, 0.4), (4, 0.3)):
            m.log(step, loss=1.0 / step)
            m.save(step, state(step), {"val": val})


def _tree(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every entry under ``root``: its bytes (None for a directory) and its mtime."""
    out: dict[str, tuple[bytes | None, int]] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory, name)
            body = None if path.is_dir() else path.read_bytes()
            out[str(path.relative_to(root))] = (body, path.lstat().st_mtime_ns)
    return out


def _use_everything(view: sp.RunView) -> None:
    """Every query of the view, with the answers of the run _build makes."""
    assert (view.info.name, view.info.variant, view.info.config) == ("exp", "v1", {"lr": 0.1})
    assert view.info.num_params == 32 * 16 + 5  # derived from the state
    report = view.report
    assert report is not None and report.checkpoints == [4, 3, 2]
    assert view.steps() == [2, 3, 4]
    assert (view.latest_step(), view.best_step()) == (4, 2)
    assert view.metrics(3) == {"val": 0.4}
    same(view.load(), state(4))
    same(view.load("best"), state(2))
    into = blank()
    assert view.load(3, into=into) is into
    same(into, state(3))
    assert view.load(4, keys=["step"]) == {"step": 4}
    same(view.peek(["b", "step"], step="best"), {"b": state(2)["b"], "step": 2})
    assert view.checkpoint_path("best") == str(layout.step_path(view.directory, 2))
    same(sp.load(view.checkpoint_path()), state(4))
    with pytest.raises(sp.CheckpointNotFoundError):
        view.checkpoint_path(1)  # pruned
    with pytest.raises(sp.CheckpointNotFoundError):
        view.load(1)
    assert view.problems() == []
    view.check()


def test_open_run_reads_everything_and_writes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _build(run)
    before = _tree(run)
    with sp.open_run(run) as view:
        _use_everything(view)
        assert _tree(run) == before
    assert _tree(run) == before
    assert repr(view) == f"open_run({str(run)!r})"


def test_open_run_on_read_only_media(tmp_path: Path) -> None:
    """On a tmpfs remounted read-only (as root; directories without write permission otherwise),
    every call of the view works and the run's bytes and mtimes stay as they were."""
    with read_only_media(tmp_path / "media") as media:
        run = media.root / "run"
        _build(run)
        before = _tree(run)
        media.freeze()
        view = sp.open_run(run)
        _use_everything(view)
        view.close()
        assert _tree(run) == before


def test_open_run_refuses_what_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(sp.CheckpointNotFoundError, match="not a savepoint run"):
        sp.open_run(tmp_path)
    assert os.listdir(tmp_path) == []


def test_open_run_next_to_a_live_writer(tmp_path: Path) -> None:
    """The view takes no lock (the writer holds it) and follows what the writer does: pruned
    checkpoints leave its steps, new ones join, "latest" and "best" choose again."""
    run = tmp_path / "run"
    writer = sp.CheckpointManager(run, keep_last=1, best_metric="val")
    writer.save(1, state(1), {"val": 0.5})
    view = sp.open_run(run)
    assert view.steps() == [1] and view.best_step() == 1
    writer.save(2, state(2), {"val": 0.2})
    writer.save(3, state(3), {"val": 0.9})
    assert view.steps() == [2, 3] and (view.latest_step(), view.best_step()) == (3, 2)
    same(view.load(), state(3))
    same(view.load("best"), state(2))
    writer.close()


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (lambda run: _edit(run / "report.json", variant="v2"), "variant"),
        (lambda run: _edit(run / "report.json", config={"lr": 0.3}), r"keys: lr"),
        (lambda run: _edit(run / "run.json", num_params=7), "num_params"),
        (lambda run: _edit(run / "report.json", latest_step=2), "latest step is 2"),
        (lambda run: _swap_alias(run), "latest/ is a copy of step 3"),
        (lambda run: _drop_best(run), "best checkpoint .step 2. is missing"),
    ],
)
def test_problems_and_check(tmp_path: Path, edit: Callable[[Path], None], pattern: str) -> None:
    """An inconsistent run still opens; problems() lists what disagrees, check() raises, and
    `savepoint ls`, `report` and `verify RUN` print the same problems (HEAD's `report` printed
    none, and `ls` none of run.json's)."""
    run = tmp_path / "run"
    _build(run)
    edit(run)
    before = _tree(run)
    view = sp.open_run(run)
    problems = view.problems()
    assert any(re.search(pattern, p) for p in problems), problems
    with pytest.raises(sp.RunMismatchError, match=pattern):
        view.check()
    runner = CliRunner()
    for args in (["ls", str(run)], ["report", str(run)], ["verify", str(run)]):
        result = runner.invoke(main, args, catch_exceptions=False)
        assert re.search(pattern, result.output), (args, result.output)
    assert _tree(run) == before


def _edit(path: Path, **values: Any) -> None:
    doc = read(path)
    doc.update(values)
    path.write_text(json.dumps(doc), encoding="utf-8")


def _swap_alias(run: Path) -> None:
    latest = run / "latest"
    for name in os.listdir(latest):
        os.unlink(latest / name)
    for name in os.listdir(layout.step_path(str(run), 3)):
        os.link(Path(layout.step_path(str(run), 3), name), latest / name)


def _drop_best(run: Path) -> None:
    import shutil

    shutil.rmtree(layout.step_path(str(run), 2))


@pytest.mark.parametrize("reader", ["manager", "view"])
def test_peek_falls_back_past_a_corrupt_checkpoint(
    tmp_path: Path, flip_byte: Callable[..., None], reader: str
) -> None:
    """peek reads values without building the model, choosing the checkpoint as restore does:
    a newest one that fails verification is skipped, with a warning, for the next older one."""
    run = tmp_path / "run"
    with sp.CheckpointManager(run) as m:
        assert m.peek(["step"]) is None  # no checkpoint yet
        for step in (1, 2, 3):
            m.save(step, state(step))
    flip_byte(run / "checkpoints" / layout.step_name(3), "w", 17)
    source: Any = sp.CheckpointManager(run) if reader == "manager" else sp.open_run(run)
    with pytest.warns(UserWarning, match="checkpoint 3 .* failed verification"):
        values = source.peek(["w", "step"])
    assert values["step"] == 2
    np.testing.assert_array_equal(values["w"], state(2)["w"])
    with pytest.raises(sp.CorruptCheckpointError):
        source.peek(["w"], step=3)  # an explicit step is never substituted
    source.close()


def test_runs_doc_snippets_run(tmp_path: Path) -> None:
    run_doc_snippets(ROOT / "docs" / "runs.md", tmp_path)


def test_the_view_reads_each_checkpoints_metrics_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """open_run's view reads through its reader's catalog: the metrics its open read are not
    read again for best_step() (one manifest read per checkpoint, not two)."""
    from savepoint.runs import catalog

    run = tmp_path / "run"
    with sp.CheckpointManager(run, best_metric="loss") as mgr:
        for step in range(4):
            mgr.save(step, {"w": np.ones(2)}, metrics={"loss": 4 - step})
    reads = []
    inspect = catalog.checkpoint.inspect
    monkeypatch.setattr(catalog.checkpoint, "inspect", lambda p: reads.append(p) or inspect(p))
    view = sp.open_run(run)
    assert view.best_step() == 3
    assert len(reads) == 4
