"""Helpers shared by the run-directory tests: small states, what a run looks like on disk, the kill
child, and a read-only filesystem. Not collected (the name does not start with ``test_``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from . import _kill_manager_child as child

CHILD = Path(child.__file__)
CHILD_ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


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


def read_log(run: Path) -> list[dict[str, Any]]:
    """The records of the run's ``history.jsonl``, one per line (complete lines only)."""
    text = (run / "history.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def full_report(run: Any) -> dict[str, Any]:
    """The run's whole report as one document: ``report.json`` (version 2) with the loss and
    metric history of the history log put back in (what ``savepoint report --json`` prints)."""
    from savepoint.runs.report import load_report

    report = load_report(run)
    assert report is not None, f"{run} has no report.json"
    return report.to_json()


def snapshot(run: Path) -> dict[str, bytes | None]:
    """What a reader of the run sees: report.json and the aliases' manifests (None: absent)."""
    out: dict[str, bytes | None] = {}
    for name in ("report.json", "latest/manifest.json", "best/manifest.json"):
        path = run / name
        out[name] = path.read_bytes() if path.exists() else None
    return out


def leftovers(run: Path) -> list[str]:
    """Hidden temporary directories (staging, backups, alias copies) under the run."""
    found = []
    for where in (run, run / "checkpoints"):
        if where.is_dir():
            found += [e for e in os.listdir(where) if e.startswith(".") and (where / e).is_dir()]
    return sorted(found)


def run_kill_child(run: Path, hook: str, timeout: float = 120) -> list[str]:
    """Run the kill child on ``run`` with a kill hook; returns its output lines. It must die by
    SIGKILL at the hook."""
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(CHILD), str(run), hook],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=CHILD_ENV,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stdout.splitlines()
    assert lines[-1] == f"killed {hook.replace(':', ' ')}", lines
    return lines


# -- read-only media ------------------------------------------------------------------------------


def _mount(*args: str) -> str | None:
    """Run mount(8); None on success, else why not."""
    if shutil.which("mount") is None:
        return "no mount command"
    proc = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"mount {args} failed")


class ReadOnly:
    """Makes a directory tree read-only for this process, the real way where possible.

    Where this process may mount (root): ``root`` is a freshly mounted 32 MiB tmpfs and
    :meth:`freeze` remounts it read-only (``mount -o remount,ro``), which binds root too.
    Elsewhere :meth:`freeze` removes the write permission of every directory, and skips the test
    if that does not stop this process from writing (root with CAP_DAC_OVERRIDE but no mount
    rights). ``how`` says which."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounted = False
        self.frozen: list[Path] = []
        root.mkdir(parents=True, exist_ok=True)
        self.how = "directories without write permission"
        if os.geteuid() == 0:
            problem = _mount("-t", "tmpfs", "-o", "size=32m,mode=0755", "tmpfs", str(root))
            if problem is None:
                self.mounted = True
                self.how = "tmpfs remounted read-only"

    def freeze(self) -> None:
        if self.mounted:
            problem = _mount("-o", "remount,ro", str(self.root))
            if problem is not None:
                pytest.skip(f"cannot remount the tmpfs read-only: {problem}")
            return
        for directory, _, _ in os.walk(self.root):
            self.frozen.append(Path(directory))
        for directory in self.frozen:
            mode = stat.S_IMODE(os.stat(directory).st_mode)
            os.chmod(directory, mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        probe = self.root / ".probe"
        try:
            probe.write_bytes(b"")
        except OSError:
            return
        probe.unlink()
        pytest.skip(
            "this process can neither mount a tmpfs nor be stopped by file modes (root with "
            "CAP_DAC_OVERRIDE but without mount rights)"
        )

    def close(self) -> None:
        if self.mounted:
            if _mount("-o", "remount,rw", str(self.root)) is not None:
                pass  # unmounting below discards it all the same
            if subprocess.run(["umount", str(self.root)], check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(self.root)], check=False)
            self.mounted = False
        for directory in self.frozen:
            with contextlib.suppress(OSError):
                os.chmod(directory, 0o755)


@contextlib.contextmanager
def read_only_media(root: Path) -> Iterator[ReadOnly]:
    media = ReadOnly(root)
    try:
        yield media
    finally:
        media.close()


# -- another user -----------------------------------------------------------------------------------

NOBODY = 65534


@contextlib.contextmanager
def shared_tmpdir() -> Iterator[Path]:
    """A directory another user can reach (pytest's own tmp_path is private to its owner)."""
    path = Path(tempfile.mkdtemp(prefix="savepoint-perm-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_as_unprivileged(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run Python ``code`` in a child that cannot bypass file modes.

    As root: still root, but without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (``setpriv``), so
    mode bits bind it like anyone else; where ``setpriv`` is missing, as user 65534 instead. As
    another user: that same user. Skips when no such child can be started."""
    command = [sys.executable, "-W", "error", "-c", code, *args]
    extra: dict[str, Any] = {}
    if os.geteuid() == 0:
        if shutil.which("setpriv"):
            command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *command]
        else:
            extra = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    try:
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd="/",
            env={**CHILD_ENV, "HOME": "/"},
            **extra,
        )
    except PermissionError as exc:  # user 65534 may not run this interpreter
        pytest.skip(f"cannot start an unprivileged child here: {exc}")
