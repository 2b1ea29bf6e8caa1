"""Running part of a test as an unprivileged user, so file modes are enforced.

Root ignores file modes (``CAP_DAC_OVERRIDE``): a mode-0 file is readable to it. Tests that need
a mode to bite run the reading part through :func:`call_unprivileged` (a Python callable, in a
forked child) or :func:`run_unprivileged` (a command), which drop to ``nobody`` (uid and gid
65534, no supplementary groups) when the test runs as root and run as the current user
otherwise, where a plain ``chmod`` already works. :func:`drop_problem` says why privileges cannot
be dropped here (None when they can); tests skip with that reason.

The checkpoint must be reachable by that user: create it under :func:`shared_tmpdir` (world
traversable, unlike pytest's ``tmp_path``) and make only the file under test unreadable
(:func:`unreadable`); :func:`workspace` does both checks and skips the test where either fails.

Not collected (the name does not start with ``test_``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NOBODY = 65534


def is_root() -> bool:
    return os.geteuid() == 0


def _drop() -> None:
    """In a child of a root process: become nobody for good (real, effective and saved ids)."""
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)


@dataclass
class Outcome:
    """What a callable did in the child: returned ``value`` (JSON), or raised ``error``.

    ``classes`` are the names of every class in the exception's MRO, so a test can ask whether
    it was, say, a CheckpointPermissionError and a PermissionError at once.
    """

    value: Any = None
    error: str | None = None
    classes: list[str] = field(default_factory=list)
    message: str = ""
    errno: int | None = None
    path: str | None = None
    traceback: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    def raised(self, cls: type[BaseException]) -> bool:
        return cls.__name__ in self.classes

    def __str__(self) -> str:
        if self.ok:
            return f"returned {self.value!r}"
        return f"raised {self.error}: {self.message}\n{self.traceback}"


def _capture(fn: Callable[..., Any], args: Sequence[Any]) -> Outcome:
    try:
        value = fn(*args)
        json.dumps(value)  # must travel back over the pipe
        return Outcome(value=value)
    except BaseException as exc:  # everything the callable did is the outcome
        return Outcome(
            error=type(exc).__name__,
            classes=[c.__name__ for c in type(exc).__mro__],
            message=str(exc),
            errno=getattr(exc, "errno", None),
            path=getattr(exc, "path", None),
            traceback="".join(traceback.format_exception(exc)),
        )


def call_unprivileged(fn: Callable[..., Any], *args: Any, timeout: float = 120) -> Outcome:
    """``fn(*args)`` as an unprivileged user: in a forked child that drops to nobody when this
    process is root, in this process otherwise. Its return value must be JSON-serialisable.

    Import what ``fn`` needs before calling this: nobody may not be able to read the interpreter's
    library (a Python installed under ``/root``), so a module imported first in the child can
    fail with ModuleNotFoundError."""
    if not is_root():
        return _capture(fn, args)
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() in a process with threads (savepoint's copy pool):
        # the child only runs ``fn`` and savepoint resets its pools after a fork.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns into the test runner
        code = 0
        try:
            os.close(read_end)
            try:
                _drop()
            except OSError as exc:
                outcome = Outcome(error="DropFailed", message=str(exc))
            else:
                outcome = _capture(fn, args)
            data = json.dumps(outcome.__dict__, default=repr).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(write_end, view) :]
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"the unprivileged child did not finish within {timeout} s")
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    if not chunks:
        raise RuntimeError("the unprivileged child died without reporting")
    return Outcome(**json.loads(b"".join(chunks)))


def run_unprivileged(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv)`` as nobody when root, as this user otherwise (text, captured).

    The executable must be reachable by nobody: an interpreter under a private home directory
    is not (prefer :func:`call_unprivileged` for Python code)."""
    if is_root():
        kwargs.update(user=NOBODY, group=NOBODY, extra_groups=[])
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 120)
    return subprocess.run(list(argv), check=False, **kwargs)


def _probe() -> bool:
    return os.geteuid() != 0 or not os.access("/", os.W_OK)


@functools.lru_cache(maxsize=1)
def drop_problem() -> str | None:
    """Why modes cannot be enforced on a reader here (None when they can), found by trying."""
    if not hasattr(os, "fork") or not hasattr(os, "setresuid"):
        return "no fork/setresuid on this platform"
    if not is_root():
        return None
    try:
        outcome = call_unprivileged(_probe, timeout=30)
    except (OSError, RuntimeError) as exc:
        return f"cannot start an unprivileged child: {exc}"
    if not outcome.ok:
        return f"cannot drop privileges to uid {NOBODY}: {outcome.message}"
    if outcome.value is not True:
        return f"uid {NOBODY} still bypasses file modes here"
    return None


def _traversable(path: Path) -> bool:
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in (path, *path.parents))


@contextlib.contextmanager
def shared_tmpdir(prefix: str = "savepoint-shared-") -> Iterator[Path]:
    """A fresh directory every user may traverse and read (mode 0755, like its parents), removed
    afterwards, modes restored first. Raises RuntimeError when the temp root is not
    traversable by others (a test skips then)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        os.chmod(root, 0o755)
        if not _traversable(root):
            raise RuntimeError(f"{root.parent} is not traversable by other users")
        yield root
    finally:
        for dirpath, dirnames, _ in os.walk(root):
            for d in dirnames:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(dirpath, d), 0o755)
        os.chmod(root, 0o755)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def workspace() -> Iterator[Path]:
    """:func:`shared_tmpdir` for a test that needs modes enforced on a reader; skips the test
    (``pytest.skip``, with the reason) where privileges cannot be dropped or the temp root is
    private."""
    import pytest

    why = drop_problem()
    if why is not None:
        pytest.skip(why)
    try:
        shared = shared_tmpdir()
        root = shared.__enter__()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        yield root
    finally:
        shared.__exit__(None, None, None)


def make_readable(path: Path) -> None:
    """Give everyone read (and, for directories, search) access to ``path`` and below."""
    for dirpath, dirnames, filenames in os.walk(path):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o755)


@contextlib.contextmanager
def unreadable(path: Path, mode: int = 0) -> Iterator[Path]:
    """``path`` with ``mode`` (no access by default) for the block; the old mode comes back."""
    old = stat.S_IMODE(os.lstat(path).st_mode)
    os.chmod(path, mode)
    try:
        yield path
    finally:
        os.chmod(path, old)
