"""A real, size-limited filesystem for full-disk tests: a tmpfs mounted for one test.

- :func:`mounted` mounts a tmpfs of ``size`` bytes (and optionally ``inodes`` inodes) on a
  directory and always unmounts it afterwards, even when the test fails (a lazy detach if
  something still holds it).
- :class:`Tmpfs` sets the free space precisely: a filler file is grown (``posix_fallocate``) or
  shrunk (``ftruncate``) until exactly ``k`` bytes remain (page granular, as tmpfs allocates), and
  empty filler files leave exactly ``j`` free inodes.
- Mounting needs ``CAP_SYS_ADMIN`` in the mount namespace: root has it; an unprivileged user gets
  it in a new user + mount namespace. :func:`mount_problem` says why mounting here is impossible
  (None when it works); :func:`run_in_user_namespace` re-runs a pytest command in a fresh user +
  mount namespace (``os.unshare`` on Python 3.12+, ``unshare(2)`` through ctypes before that),
  where the process is root of its own namespace and its mounts vanish with it;
  :func:`namespace_problem` says why that is impossible. Where neither works the tests skip and
  the injection tests in ``test_disk_full.py`` remain the fallback.
- :class:`Sweeper` runs a :class:`Scenario` (one write operation) with every amount of free space
  (or free inodes) from none to past what it needs, and records what each attempt left.

Not collected (the name does not start with ``test_``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2
# Set in the pytest process that run_in_user_namespace starts.
NAMESPACE_ENV = "SAVEPOINT_TMPFS_NAMESPACE"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _check(rc: int, what: str, path: str) -> None:
    if rc != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}", path)


def _mount(target: str, options: str) -> None:
    _check(
        _libc.mount(
            b"tmpfs", os.fsencode(target), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()
        ),
        "mount tmpfs",
        target,
    )


def _umount(target: str) -> None:
    if _libc.umount2(os.fsencode(target), 0) == 0:
        return
    # Something still has it open (a leaked descriptor of a failed test): detach it now, the
    # kernel frees it once the last user goes; never leave it mounted under the test's tmp dir.
    _check(_libc.umount2(os.fsencode(target), _MNT_DETACH), "umount tmpfs", target)


def free_bytes(directory: str | os.PathLike[str]) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def free_inodes(directory: str | os.PathLike[str]) -> int:
    return os.statvfs(directory).f_favail


class Tmpfs:
    """A mounted tmpfs at ``root``; the filler lives in ``root/.filler`` (one file and a
    directory of empty files), so tests work in other directories of ``root``."""

    def __init__(self, root: Path, size: int, inodes: int | None) -> None:
        self.root = root
        self.size = size
        self.inodes = inodes
        self._filler_dir = root / ".filler"
        self._filler_dir.mkdir()
        self._filler = self._filler_dir / "blocks"
        self._fd = os.open(self._filler, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._filled = 0
        self._inode_fillers: list[Path] = []

    def free_bytes(self) -> int:
        return free_bytes(self.root)

    def free_inodes(self) -> int:
        return free_inodes(self.root)

    def set_free(self, k: int) -> None:
        """Grow or shrink the filler so that exactly ``k`` bytes are free (``k`` a multiple of
        the page size). Raises if ``k`` is more than the filler can give back."""
        if k % PAGE or k < 0:
            raise ValueError(f"free space must be a non-negative multiple of {PAGE}, not {k}")
        delta = self.free_bytes() - k
        if delta > 0:
            os.posix_fallocate(self._fd, self._filled, delta)
        elif delta < 0:
            if self._filled + delta < 0:
                raise ValueError(f"cannot free {k} bytes: only {self.free_bytes()} would be free")
            os.ftruncate(self._fd, self._filled + delta)
        self._filled += delta
        got = self.free_bytes()
        if got != k:
            raise AssertionError(f"asked for {k} free bytes, the filesystem has {got}")

    def set_free_inodes(self, j: int) -> None:
        """Create or remove empty filler files so that exactly ``j`` inodes are free."""
        delta = self.free_inodes() - j
        while delta > 0:
            path = self._filler_dir / f"inode-{len(self._inode_fillers)}"
            path.touch(exist_ok=False)
            self._inode_fillers.append(path)
            delta -= 1
        while delta < 0:
            if not self._inode_fillers:
                raise ValueError(f"cannot free {j} inodes: only {self.free_inodes()} are free")
            self._inode_fillers.pop().unlink()
            delta += 1
        got = self.free_inodes()
        if got != j:
            raise AssertionError(f"asked for {j} free inodes, the filesystem has {got}")

    def release(self) -> None:
        """Give back everything the fillers hold."""
        os.ftruncate(self._fd, 0)
        self._filled = 0
        while self._inode_fillers:
            self._inode_fillers.pop().unlink()

    def close(self) -> None:
        os.close(self._fd)


@contextlib.contextmanager
def mounted(directory: Path, size: int, inodes: int | None = None) -> Iterator[Tmpfs]:
    """Mount a tmpfs of ``size`` bytes (``inodes`` inodes) on ``directory`` (created if absent)
    for the duration of the block; it is unmounted afterwards whatever happens."""
    directory.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0700" + (f",nr_inodes={inodes}" if inodes else "")
    _mount(str(directory), options)
    fs: Tmpfs | None = None
    try:
        fs = Tmpfs(directory, size, inodes)
        yield fs
    finally:
        try:
            if fs is not None:
                fs.close()
        finally:
            _umount(str(directory))


@functools.lru_cache(maxsize=1)
def mount_problem() -> str | None:
    """Why a tmpfs cannot be mounted in this process (None when it can), found by trying."""
    if not sys.platform.startswith("linux"):
        return f"tmpfs is Linux only (this is {sys.platform})"
    with tempfile.TemporaryDirectory(prefix="savepoint-tmpfs-probe-") as probe:
        try:
            with mounted(Path(probe) / "mnt", 64 * PAGE) as fs:
                fs.set_free(PAGE)
        except OSError as exc:
            who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
            return f"cannot mount a tmpfs as {who}: {exc.strerror or exc}"
    return None


# Runs in the child: unshare into a new user + mount namespace, map this user to root there,
# keep mounts private, then exec the given command (argv[1:]).
_LAUNCHER = r"""
import ctypes, ctypes.util, os, sys
uid, gid = os.getuid(), os.getgid()
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
if hasattr(os, "unshare"):
    os.unshare(CLONE_NEWUSER | CLONE_NEWNS)
elif libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
    e = ctypes.get_errno()
    raise OSError(e, "unshare: " + os.strerror(e))
with open("/proc/self/setgroups", "w") as f:
    f.write("deny")
with open("/proc/self/uid_map", "w") as f:
    f.write(f"0 {uid} 1")
with open("/proc/self/gid_map", "w") as f:
    f.write(f"0 {gid} 1")
MS_REC, MS_PRIVATE = 0x4000, 0x40000
if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
    e = ctypes.get_errno()
    raise OSError(e, "making mounts private: " + os.strerror(e))
os.execv(sys.argv[1], sys.argv[1:])
"""


def namespace_command(argv: Sequence[str]) -> list[str]:
    """``argv`` (starting with an executable path) run in a new user + mount namespace."""
    return [sys.executable, "-c", _LAUNCHER, *argv]


@functools.lru_cache(maxsize=1)
def namespace_problem() -> str | None:
    """Why a tmpfs cannot be mounted in a new user namespace here (None when it can)."""
    if not sys.platform.startswith("linux"):
        return f"user namespaces are Linux only (this is {sys.platform})"
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import _tmpfs; "
        "p = _tmpfs.mount_problem(); print(p or 'ok')"
    )
    argv = [sys.executable, "-c", probe, str(Path(__file__).parent)]
    try:
        done = subprocess.run(
            namespace_command(argv), capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot start a process in a user namespace: {exc}"
    answer = done.stdout.strip()
    if done.returncode != 0 or answer != "ok":
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"cannot mount a tmpfs in a user namespace: {answer or last}"
    return None


def run_in_user_namespace(
    argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a new user + mount namespace, with ``NAMESPACE_ENV`` set."""
    child_env = dict(os.environ if env is None else env)
    child_env[NAMESPACE_ENV] = "1"
    return subprocess.run(
        namespace_command(argv),
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ---------------------------------------------------------------------------------------------
# sweeping an operation through every amount of free space
# ---------------------------------------------------------------------------------------------

BLOCKS = "blocks"  # free space, in pages
INODES = "inodes"  # free inodes (files, directories and hard links each take one on tmpfs)


class Scenario:
    """One write operation under test.

    ``prepare(work)`` builds what is already committed (with space to spare); ``act(work)`` is the
    operation; ``check_done`` / ``check_intact`` must hold after a success / a failure (raise
    AssertionError otherwise); ``recover`` runs after a failure once the space is back.
    ``phases[resource]`` maps a phase name to a regular expression that the failure site (see
    :func:`failure_site`) of at least one point of that sweep must match: the proof that the
    sweep failed the operation in that phase. ``post_commit`` and ``semantic_problems`` set apart
    what belongs to a contract being changed elsewhere (a managed save that failed after its
    checkpoint was committed)."""

    name = ""
    phases: dict[str, dict[str, str]]
    # A failure leaves no page or inode used (else: only what is visible under work/).
    keeps_nothing = True

    def prepare(self, work: Path) -> None:
        pass

    def act(self, work: Path) -> None:
        raise NotImplementedError

    def check_done(self, work: Path) -> None:
        raise NotImplementedError

    def check_intact(self, work: Path) -> None:
        raise NotImplementedError

    def recover(self, work: Path) -> None:
        self.act(work)
        self.check_done(work)

    def post_commit(self, work: Path) -> bool:
        return False

    def semantic_problems(self, work: Path, failed: bool) -> list[str]:
        return []

    def close(self) -> None:
        pass


@dataclass
class Point:
    free: int  # pages or inodes free when the operation ran
    visible: int = 0  # pages or inodes of the files under work/ then
    failed: bool = False
    site: str = ""
    problems: list[str] = field(default_factory=list)  # broken rules
    # What a managed save left after failing past its commit: judged by the run's contract.
    semantic: list[str] = field(default_factory=list)


@dataclass
class Sweep:
    scenario: str
    resource: str
    need: int  # the least free amount with which the operation succeeds
    net: int  # what a success leaves used (0 or less when it replaced something as big)
    points: list[Point]

    def sites(self) -> set[str]:
        return {p.site for p in self.points if p.failed}

    def missing_phases(self, phases: dict[str, str]) -> list[str]:
        return [
            name
            for name, pattern in phases.items()
            if not any(re.search(pattern, site) for site in self.sites())
        ]

    def problems(self) -> list[str]:
        return [f"{self.resource}={p.free}: {x}" for p in self.points for x in p.problems]

    def semantic(self) -> list[str]:
        return [f"{self.resource}={p.free}: {x}" for p in self.points for x in p.semantic]

    def describe(self) -> str:
        failed = sum(p.failed for p in self.points)
        sites = "\n  ".join(sorted(s[-160:] for s in self.sites()))
        return (
            f"{self.scenario}, {self.resource}: needs {self.need}, a success leaves {self.net} "
            f"used; {failed} of {len(self.points)} points failed, at\n  {sites}"
        )


def failure_site(exc: BaseException) -> str:
    """Where the root cause of ``exc`` was raised: the savepoint frames of its traceback,
    outermost first, as ``module.function`` joined by ``>`` (a writer thread's frames last)."""
    root = exc
    while (nxt := root.__cause__ or root.__context__) is not None:
        root = nxt
    frames = [
        f"{Path(f.filename).stem}.{f.name}"
        for f in traceback.extract_tb(root.__traceback__)
        if f"{os.sep}savepoint{os.sep}" in f.filename
    ]
    return ">".join(frames) or "?"


def litter(root: Path) -> list[str]:
    """Hidden temporaries of savepoint's commit protocol anywhere under ``root``."""
    from savepoint.commit import names as commit_names

    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            if commit_names.TMP_TAG in name or commit_names.OLD_TAG in name:
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def _problem(what: str, exc: BaseException) -> str:
    return f"{what}: {type(exc).__name__}: {exc}"[:500]


class Sweeper:
    """Runs one scenario on ``fs`` with every amount of free ``resource`` up to past its need."""

    def __init__(self, fs: Tmpfs, scenario: Scenario, resource: str) -> None:
        self.fs = fs
        self.sc = scenario
        self.resource = resource
        self.work = fs.root / "work"

    def free(self) -> int:
        return self.fs.free_bytes() // PAGE if self.resource == BLOCKS else self.fs.free_inodes()

    def visible(self) -> int:
        """Pages of the distinct files under work/ (tmpfs directories take none), or inodes:
        one per name, since tmpfs charges every hard link as well."""
        pages: dict[int, int] = {}
        names = 0
        for dirpath, dirnames, filenames in os.walk(self.work):
            names += len(dirnames) + len(filenames)
            for name in filenames:
                st = os.lstat(os.path.join(dirpath, name))
                pages[st.st_ino] = -(-st.st_blocks * 512 // PAGE)
        return sum(pages.values()) if self.resource == BLOCKS else names

    def limit(self, amount: int) -> None:
        if self.resource == BLOCKS:
            self.fs.set_free(amount * PAGE)
        else:
            self.fs.set_free_inodes(amount)

    def finish(self) -> None:
        """Give the space back, then let the scenario close what it holds (a manager writes its
        report when it closes)."""
        self.fs.release()
        self.sc.close()

    def fresh(self) -> None:
        self.finish()
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir()
        self.sc.prepare(self.work)

    def attempt(self, amount: int) -> Point:
        """Prepare with space to spare, leave exactly ``amount`` free, run the operation."""
        import savepoint as sp

        self.fresh()
        point = Point(amount)
        self.limit(amount)
        point.visible = self.visible()
        try:
            self.sc.act(self.work)
        except sp.CheckpointWriteError as exc:
            point.failed, point.site = True, failure_site(exc)
            if exc.errno != errno.ENOSPC:
                point.problems.append(_problem(f"errno {exc.errno}, not ENOSPC", exc))
        except Exception as exc:
            point.failed, point.site = True, failure_site(exc)
            point.problems.append(_problem("not a CheckpointWriteError", exc))
        return point

    def check(self, point: Point) -> None:
        """Check what the attempt left; after a failure, free the space and check that the
        operation succeeds then. What a failure after the scenario's commit point left is judged
        apart (``point.semantic``)."""
        problems = point.problems
        if point.failed and self.sc.post_commit(self.work):
            point.semantic, point.problems = point.problems, []
            problems = point.semantic
        if point.failed:
            taken = point.free - self.free()
            shown = self.visible() - point.visible
            if taken != shown:
                problems.append(f"failing took {taken} but files under work/ show {shown}: leaked")
            elif taken > 0 and self.sc.keeps_nothing:
                problems.append(f"failing kept {taken} (files under work/ changed)")
        if stray := litter(self.fs.root):
            problems.append(f"temporary litter left: {stray}")
        try:
            (self.sc.check_intact if point.failed else self.sc.check_done)(self.work)
        except Exception as exc:
            problems.append(_problem("after failing" if point.failed else "after succeeding", exc))
        try:
            point.semantic += self.sc.semantic_problems(self.work, point.failed)
        except Exception as exc:
            point.semantic.append(_problem("checking the run", exc))
        if not point.failed:
            return
        self.fs.release()
        try:
            self.sc.recover(self.work)
        except Exception as exc:
            point.problems.append(_problem("no recovery once space was freed", exc))
        if stray := litter(self.fs.root):
            point.problems.append(f"temporary litter after recovering: {stray}")

    def need(self) -> tuple[int, int]:
        """(the least free amount with which the operation succeeds, what a success leaves
        used), measured on this otherwise empty tmpfs: statvfs before and after one unhindered
        run, then bisection (which assumes more space never hurts; the sweep checks every
        point anyway)."""
        self.fresh()
        before = self.free()
        self.sc.act(self.work)
        net = before - self.free()
        lo, hi = -1, before  # the operation fails with lo free (or lo is -1), succeeds with hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.attempt(mid).failed:
                lo = mid
            else:
                hi = mid
        self.finish()
        return hi, net

    def sweep(self, past: int = 3) -> Sweep:
        """Every amount from 0 to ``past`` beyond the need, one page (or inode) at a time."""
        try:
            need, net = self.need()
            points = []
            for amount in range(need + past):
                point = self.attempt(amount)
                try:
                    self.check(point)
                finally:
                    self.finish()
                points.append(point)
            return Sweep(self.sc.name, self.resource, need, net, points)
        finally:
            self.finish()
