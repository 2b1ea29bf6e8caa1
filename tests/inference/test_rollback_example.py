"""examples/rollback.py: after a violation and a rollback, the run continues exactly as a run that
never took the bad path."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rollback.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("savepoint_rollback_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


ex = _load()


@pytest.mark.parametrize(("every", "keep", "back_to"), [(10, 4, 130), (7, 2, 133), (1, 3, 137)])
def test_continuation_equals_the_run_that_never_took_the_bad_path(
    every: int, keep: int, back_to: int
) -> None:
    stream = ex.make_stream()
    rolled = ex.serve(stream, every=every, keep=keep)
    clean = ex.serve(stream, every=every, keep=keep, clamp={ex.GLITCH})
    assert rolled.rollbacks == [(ex.GLITCH, back_to)]
    assert clean.rollbacks == []
    assert sorted(rolled.outputs) == list(range(len(stream)))
    assert rolled.outputs == clean.outputs  # exact floats, every step
    assert ex.same_state(rolled.model, clean.model)
    # The bad path was real: without the clamp the glitch step breaks the constraint.
    model = ex.RecurrentModel()
    for t in range(ex.GLITCH):
        model.step(stream[t])
    assert abs(model.step(stream[ex.GLITCH])) >= ex.LIMIT


def test_rollback_through_a_restarted_history(tmp_path: Path) -> None:
    stream = ex.make_stream()
    rolled = ex.serve(stream, persist=str(tmp_path / "snaps"))
    clean = ex.serve(stream, clamp={ex.GLITCH})
    assert rolled.rollbacks == [(ex.GLITCH, 130)]
    assert rolled.outputs == clean.outputs and ex.same_state(rolled.model, clean.model)
    assert len(list((tmp_path / "snaps").iterdir())) == 4  # the bound held on disk


@pytest.mark.parametrize("args", [[], ["--persist", "tmp"]])
def test_the_script_runs(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rolled back to the snapshot of step 130" in result.stdout
    assert "continuation matches the run that never took the bad path: True" in result.stdout
