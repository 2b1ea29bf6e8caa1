"""SIGKILL at arbitrary moments of a save: the path always holds the previous checkpoint or the
new one, complete and verifiable; leftovers are hidden temporary directories only, and the next
save removes those of dead processes.

A child process (the venv's python running _kill_child.py) saves two known states, A and B, to
one path, and is killed after a seeded random delay, or just after it announces a chosen step of
the save, or by itself at one precise step (deterministic hooks).
"""

from __future__ import annotations

import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest

import savepoint as sp
from _torture import campaign
from savepoint.commit import names
from savepoint.storage import local

from ._kill_child import MAX_FILE_BYTES, make_state, metadata
from ._util import assert_same

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals, Linux renames"),
]

CHILD = Path(__file__).with_name("_kill_child.py")
STATES = {w: make_state(w) for w in "AB"}
NAME = "ckpt"


def save(path: Path, which: str) -> None:
    sp.save(path, STATES[which], metadata=metadata(which), max_file_bytes=MAX_FILE_BYTES)


class Child:
    """The child process, with a line reader over its stdout that never blocks past a timeout."""

    def __init__(self, path: Path, mode: str, first: str, hook: str = "", **env: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(path), mode, first, hook],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **env},
        )
        self.buf = b""
        self.lines: list[str] = []
        self.stderr = ""

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()

    def _read(self, timeout: float) -> bool:
        """Read what is available within ``timeout``; False at end of file."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(timeout, 0))
        if not ready:
            return True
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return False
        self.buf += chunk
        *complete, self.buf = self.buf.split(b"\n")
        self.lines += [c.decode() for c in complete]
        return True

    def wait_for(self, line: str, timeout: float = 60.0) -> None:
        """Consume output until ``line`` has been printed."""
        end = time.monotonic() + timeout
        seen = len(self.lines)
        while True:
            if line in self.lines[seen:]:
                return
            if time.monotonic() > end:
                raise AssertionError(
                    f"child did not print {line!r} in {timeout} s: {self.lines[-5:]}"
                )
            if not self._read(end - time.monotonic()):
                self.proc.wait()
                raise AssertionError(
                    f"child exited ({self.proc.returncode}) before printing {line!r}:\n"
                    + self.proc.stderr.read().decode()  # type: ignore[union-attr]
                )

    def kill(self) -> int:
        if self.proc.returncode is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            # Reap it: only then is its pid free, which is how clean_stale tells it is dead.
            self.proc.wait()
            while self._read(5.0):
                pass
            self.stderr = self.proc.stderr.read().decode()  # type: ignore[union-attr]
        return self.proc.returncode

    def last_phase(self) -> str:
        phases = [line.split(" ", 1)[1] for line in self.lines if line.startswith("phase ")]
        return phases[-1] if phases else "before-first-save"


def only_hidden_leftovers(parent: Path) -> list[str]:
    """Everything in ``parent`` but the checkpoint must be a hidden temporary of this checkpoint."""
    hidden = []
    for entry in sorted(os.listdir(parent)):
        if entry == NAME:
            continue
        assert entry.startswith(f".{NAME}.") and (
            names.TMP_TAG in entry or names.OLD_TAG in entry
        ), f"a kill left {entry!r} next to the checkpoint (only hidden temporaries may remain)"
        hidden.append(entry)
    return hidden


def committed_state(path: Path) -> str:
    """Load and verify the checkpoint at ``path``; it must be exactly state A or state B."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sp.load(path)
        info = sp.verify(path)
    for w in caught:
        # Only the documented one: an interrupted fallback replace left the old one hidden.
        assert "interrupted replace" in str(w.message), str(w.message)
        assert not path.exists(), "warned about an interrupted replace, yet the path exists"
    which = got.get("which") if isinstance(got, dict) else None
    assert which in STATES, f"loaded something that is neither A nor B: {which!r}"
    assert_same(got, STATES[which])
    assert info.metadata == metadata(which)
    return which


def save_and_expect_tidy(path: Path, which: str) -> None:
    """A save from this process must remove every leftover of dead processes."""
    save(path, which)
    left = sorted(os.listdir(path.parent))
    assert left == [NAME], f"after a new save, leftovers of dead processes remain: {left}"
    assert committed_state(path) == which


@pytest.fixture(scope="module")
def save_seconds(tmp_path_factory: pytest.TempPathFactory) -> float:
    """How long one save of A or B takes here (median of warm saves): the kill delays scale to it."""
    path = tmp_path_factory.mktemp("calibrate") / NAME
    times = []
    for which in "ABABAB":
        start = time.perf_counter()
        save(path, which)
        times.append(time.perf_counter() - start)
    return max(statistics.median(times[1:]), 0.002)


def exchange_supported(directory: Path) -> bool:
    a, b = directory / "xa", directory / "xb"
    a.mkdir()
    b.mkdir()
    try:
        return local.STORE.exchange(str(a), str(b))
    finally:
        a.rmdir()
        b.rmdir()


# ---------------------------------------------------------------------------------------------
# random kills while replacing an existing checkpoint
# ---------------------------------------------------------------------------------------------

# make test: 12 random kills + one aimed at each phase (17); make torture: (44 + 5 * 4) * scale.
RANDOM_KILLS = campaign(12, 44)
AIMED = ("data", "manifest", "commit", "exchange", "cleanup")
AIMED_EACH = campaign(1, 4)


def test_sigkill_at_random_moments_while_replacing(tmp_path: Path, save_seconds: float) -> None:
    rng = random.Random(0x5A7E)
    parent = tmp_path / "dir"
    parent.mkdir()
    path = parent / NAME
    save(path, "A")
    plan: list[str | None] = [None] * RANDOM_KILLS + [p for p in AIMED for _ in range(AIMED_EACH)]
    rng.shuffle(plan)
    phases: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    stale_seen = 0
    for i, aim in enumerate(plan):
        with Child(path, "loop", rng.choice("AB")) as child:
            child.wait_for("ready")
            if aim is None:
                # Up to ~2.5 saves in: every phase of the first save, some of the second.
                time.sleep(rng.uniform(0, 2.5 * save_seconds))
            else:
                child.wait_for(f"phase {aim}", timeout=30)
                time.sleep(rng.uniform(0, 0.003))
            rc = child.kill()
        assert rc == -signal.SIGKILL, f"the child ended by itself ({rc}):\n{child.stderr}"
        phases[child.last_phase()] += 1
        hidden = only_hidden_leftovers(parent)
        stale_seen += len(hidden)
        outcomes[committed_state(path)] += 1
        if i % 4 == 3:
            save_and_expect_tidy(path, rng.choice("AB"))
    save_and_expect_tidy(path, "B")
    assert len(plan) >= campaign(17, 64)
    # The kills were spread: they left partial saves behind and hit several steps of a save.
    assert stale_seen > 0, "no kill ever interrupted a save"
    assert len(phases) >= 3, f"kills landed in too few phases: {dict(phases)}"
    assert set(outcomes) == {"A", "B"}, f"never saw both states after a kill: {dict(outcomes)}"


# ---------------------------------------------------------------------------------------------
# the very first save
# ---------------------------------------------------------------------------------------------

FIRST_SAVE_KILLS = campaign(6, 16)  # every 4th aimed at the commit


def test_sigkill_during_first_save(tmp_path: Path, save_seconds: float) -> None:
    rng = random.Random(0xF1257)
    outcomes: Counter[str] = Counter()
    for i in range(FIRST_SAVE_KILLS):
        parent = tmp_path / f"run{i}"
        parent.mkdir()
        path = parent / NAME
        with Child(path, "once", "A") as child:
            child.wait_for("ready")
            if i % 4 == 3:
                child.wait_for("phase commit", timeout=30)
                time.sleep(rng.uniform(0, 0.002))
            else:
                time.sleep(rng.uniform(0, 1.5 * save_seconds))
            rc = child.kill()
        assert rc in (0, -signal.SIGKILL), f"the child failed ({rc}):\n{child.stderr}"
        only_hidden_leftovers(parent)
        if path.exists():
            assert committed_state(path) == "A"
            outcomes["complete"] += 1
        else:
            with pytest.raises(sp.CheckpointNotFoundError):
                sp.load(path)
            with pytest.raises(sp.CheckpointNotFoundError):
                sp.verify(path)
            outcomes["absent"] += 1
        save_and_expect_tidy(path, "B")
    assert outcomes["absent"] > 0, f"no kill interrupted a first save: {dict(outcomes)}"


# ---------------------------------------------------------------------------------------------
# a kill at each precise step of a replace
# ---------------------------------------------------------------------------------------------

HOOKS = {
    # hook: the state the path must hold afterwards (A was there, the child was saving B)
    "mid-data": "A",
    "mid-manifest": "A",
    "before-commit": "A",
    "after-exchange": "B",
    "mid-cleanup": "B",
    "fallback-between-renames": "A",
    "fallback-after-renames": "B",
}


@pytest.mark.parametrize("hook", list(HOOKS))
def test_sigkill_at_each_step_of_a_replace(tmp_path: Path, hook: str) -> None:
    parent = tmp_path / "dir"
    parent.mkdir()
    path = parent / NAME
    if hook in ("after-exchange", "mid-cleanup") and not exchange_supported(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this filesystem")
    save(path, "A")
    with Child(path, "once", "B", hook) as child:
        child.proc.wait(timeout=60)
        rc = child.kill()
    assert rc == -signal.SIGKILL, f"the hook {hook!r} did not fire ({rc}):\n{child.stderr}"
    hidden = only_hidden_leftovers(parent)
    assert hidden, "a save killed half-way must have left its hidden directory"
    if hook == "fallback-between-renames":
        assert not path.exists()
        assert any(names.OLD_TAG in h for h in hidden)
    assert committed_state(path) == HOOKS[hook]
    # The next save replaces whatever is there and tidies every leftover of the dead child.
    save_and_expect_tidy(path, "B")
    save_and_expect_tidy(path, "A")
