"""Run directories on read-only media, and run files this process may not read.

Read-only for real: as root, the run is built on a freshly mounted tmpfs that is then remounted
read-only; as another user, its directories lose their write permission (root ignores modes).
Unreadable files: a mode-0 run.json or report.json, read by a child that cannot bypass file modes
(user 65534 when the tests run as root).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import savepoint as sp
from _compare import same
from savepoint.cli import main

from ._util import blank, read_only_media, run_as_unprivileged, shared_tmpdir, snapshot, state

OPTIONS = {"keep_last": 2, "best_metric": "val", "name": "ro"}


def _build(run: Path) -> None:
    with sp.CheckpointManager(run, **OPTIONS) as m:
        for step, val in ((1, 0.5), (2, 0.1), (3, 0.4), (4, 0.3)):
            m.log(step, loss=1.0 / step)
            m.save(step, state(step), {"val": val})
        assert m.steps() == [2, 3, 4] and m.best_step() == 2


def test_restore_on_read_only_media(tmp_path: Path) -> None:
    with read_only_media(tmp_path / "media") as media:
        run = media.root / "run"
        _build(run)
        before = snapshot(run)
        listing = sorted(os.listdir(run))
        media.freeze()

        m = sp.CheckpointManager(run, **OPTIONS)
        assert m.read_only, media.how
        assert m.read_only_reason
        assert m.steps() == [2, 3, 4] and m.latest_step() == 4 and m.best_step() == 2
        into = blank()
        assert m.restore(into) == 4  # resume=True: the lineage waits for a save that never comes
        same(into, state(4))
        assert m.restore(into, "best") == 2
        same(into, state(2))
        assert m.restore(into, 3, resume=False) == 3
        same(into, state(3))
        with pytest.raises(sp.CheckpointWriteError) as info:
            m.save(5, state(5), {"val": 0.0})
        assert "read-only" in str(info.value) and "nothing was written" in str(info.value)
        assert info.value.errno == errno.EROFS
        m.close()  # writes nothing, raises nothing
        with sp.CheckpointManager(run, async_save=True) as again:  # any number of readers
            assert again.read_only and again.restore(blank()) == 4
        same(sp.load(run / "best"), state(2))
        assert snapshot(run) == before and sorted(os.listdir(run)) == listing


def test_cli_reads_read_only_media(tmp_path: Path) -> None:
    with read_only_media(tmp_path / "media") as media:
        run = media.root / "run"
        _build(run)
        media.freeze()
        runner = CliRunner()
        for args in (["ls", str(run)], ["report", str(run)], ["verify", str(run)]):
            result = runner.invoke(main, args, catch_exceptions=False)
            assert result.exit_code == 0, (args, result.output)
        assert "3 checkpoint(s) verified" in runner.invoke(main, ["verify", str(run)]).output


def test_explicitly_read_only_next_to_a_live_writer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    writer = sp.CheckpointManager(run, **OPTIONS)
    writer.save(1, state(1), {"val": 0.5})
    before = snapshot(run)
    reader = sp.CheckpointManager(run, read_only=True)  # takes no lock: the writer holds it
    assert reader.read_only and reader.read_only_reason == "opened with read_only=True"
    assert reader.best_step() == 1  # ranks by the metric the run's report names
    assert reader.restore(blank()) == 1
    reader.close()
    assert snapshot(run) == before
    writer.save(2, state(2), {"val": 0.4})
    writer.close()


def test_read_only_false_on_read_only_media_is_an_error(tmp_path: Path) -> None:
    with read_only_media(tmp_path / "media") as media:
        run = media.root / "run"
        _build(run)
        media.freeze()
        with pytest.raises(sp.CheckpointWriteError) as info:
            sp.CheckpointManager(run, read_only=False)
        assert info.value.errno in (errno.EROFS, errno.EACCES)


UNREADABLE = r"""
import json, sys
import savepoint as sp
out = {}
try:
    sp.CheckpointManager(sys.argv[1])
    out["manager"] = "opened"
except BaseException as exc:
    out["manager"] = [type(exc).__name__, isinstance(exc, sp.CheckpointPermissionError),
                      getattr(exc, "errno", None), str(exc)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", ["run.json", "report.json"])
def test_unreadable_run_files_are_permission_errors(name: str) -> None:
    with shared_tmpdir() as shared:
        run = shared / "run"
        _build(run)
        for directory, _, files in os.walk(shared):
            os.chmod(directory, 0o755)
            for f in files:
                os.chmod(os.path.join(directory, f), 0o644)
        os.chmod(run / name, 0)
        proc = run_as_unprivileged(UNREADABLE, str(run))
        assert proc.returncode == 0, proc.stderr
        kind, is_permission, code, message = json.loads(proc.stdout)["manager"]
        assert (kind, is_permission) == ("CheckpointPermissionError", True), message
        assert code == errno.EACCES and name in message
        cli = run_as_unprivileged(
            "import sys; from savepoint.cli import main; main(sys.argv[1:])", "verify", str(run)
        )
        assert cli.returncode == 1 and "permission denied" in cli.stderr, cli.stderr
        assert "Traceback" not in cli.stderr
