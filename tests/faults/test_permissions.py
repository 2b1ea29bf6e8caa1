"""Unreadable checkpoints and read-only media.

A checkpoint whose manifest, data file or directory this user may not read raises
CheckpointPermissionError (also a PermissionError) naming the file and carrying the errno, from
``sp.load``, ``sp.verify``, ``sp.inspect`` and the ``savepoint inspect`` / ``verify`` commands:
never a raw PermissionError, never "corrupt" or "incomplete". Root ignores modes, so the reads run
as ``nobody`` in a child process (tests/_privileges.py) when the tests run as root.

A checkpoint on read-only media loads, verifies and inspects: readers never write. As root a
small tmpfs is mounted and remounted read-only; otherwise the checkpoint is made unwritable by
mode.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tqdm  # noqa: F401 - savepoint verify imports it lazily; see the import of savepoint.cli

import savepoint as sp
import savepoint.cli  # imported here: the unprivileged child may not read the library itself
from _privileges import call_unprivileged, is_root, make_readable, unreadable, workspace

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX modes")

STATE = {
    "a": np.arange(4096, dtype=np.float32),
    "b": np.arange(4096, dtype=np.int64),
    "lr": 0.5,
}
MAX_FILE_BYTES = 8 << 10  # "a" and "b" in two data files


@pytest.fixture
def shared() -> Iterator[Path]:
    with workspace() as root:
        yield root


@pytest.fixture
def ckpt(shared: Path) -> Path:
    path = shared / "ckpt"
    sp.save(path, STATE, metadata={"run": "perm"}, max_file_bytes=MAX_FILE_BYTES)
    make_readable(path)
    return path


def data_file(path: Path, key: str) -> Path:
    with open(path / "manifest.json", encoding="utf-8") as f:
        return path / json.load(f)["tensors"][key]["file"]


def reader_mode(bits: int) -> int:
    """A mode giving the reader (nobody when root: "other"; else the owner) ``bits`` (0-7)."""
    return 0o700 | bits if is_root() else bits << 6


def victim(path: Path, which: str) -> Path:
    return {
        "manifest": path / "manifest.json",
        "data": data_file(path, "b"),
        "directory": path,
    }[which]


# Each returns a small JSON value describing what it read, so the child can report it.
def do_load(path: str) -> Any:
    return sorted(sp.load(path))


def do_load_keys(path: str) -> Any:
    return sorted(sp.load(path, keys="a"))  # "a" lives in the readable data file


def do_load_mmap(path: str) -> Any:
    return sorted(sp.load(path, mmap=True))


def do_load_into(path: str) -> Any:
    into = {"a": np.zeros(4096, np.float32), "b": np.zeros(4096, np.int64), "lr": 0.0}
    sp.load(path, into=into)
    return float(into["a"][5])


def do_verify(path: str) -> Any:
    return sp.verify(path).metadata


def do_inspect(path: str) -> Any:
    return sp.inspect(path).metadata


OPS: dict[str, Callable[[str], Any]] = {
    "load": do_load,
    "load(keys=)": do_load_keys,
    "load(mmap=True)": do_load_mmap,
    "load(into=)": do_load_into,
    "verify": do_verify,
    "inspect": do_inspect,
}

# What each op reads: an op that does not touch the unreadable file succeeds.
READS = {
    "manifest": set(OPS),
    "directory": set(OPS),
    "data": set(OPS) - {"load(keys=)", "inspect"},
}


@pytest.mark.parametrize("which", ["manifest", "data", "directory"])
def test_unreadable_file_raises_checkpoint_permission_error(ckpt: Path, which: str) -> None:
    # Before the fix: a raw PermissionError (manifest, data file), or "has no manifest.json"
    # (IncompleteCheckpointError) for a directory that cannot be searched.
    target = victim(ckpt, which)
    with unreadable(target):
        outcomes = {name: call_unprivileged(op, str(ckpt)) for name, op in OPS.items()}
    for name, got in outcomes.items():
        if name not in READS[which]:
            assert got.ok, f"{name} does not read the {which} yet failed: {got}"
            continue
        assert got.raised(sp.CheckpointPermissionError), f"{name}: {got}"
        assert got.raised(PermissionError) and got.raised(sp.CheckpointError), got.classes
        assert got.errno == errno.EACCES, f"{name}: errno {got.errno}"
        assert got.path == str(target), f"{name}: path {got.path!r}, expected {target}"
        assert "permission denied" in got.message.lower(), got.message
    # Nothing was wrong with the checkpoint itself: with the mode back, everything reads.
    for name, op in OPS.items():
        got = call_unprivileged(op, str(ckpt))
        assert got.ok, f"{name}: {got}"


def cli(*args: str) -> dict[str, Any]:
    """``savepoint ARGS`` in this process (the interpreter may not be executable by nobody):
    exit status, stdout and stderr. An exception escaping the command is the test's failure."""
    import contextlib
    import io

    from savepoint.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main.main(args=list(args), prog_name="savepoint", standalone_mode=True)
        except SystemExit as exc:
            code = exc.code
    return {"returncode": code or 0, "stdout": out.getvalue(), "stderr": err.getvalue()}


@pytest.mark.parametrize("which", ["manifest", "data", "directory"])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_cli_on_unreadable_file_reports_permission(ckpt: Path, which: str, command: str) -> None:
    target = victim(ckpt, which)
    with unreadable(target):
        got = call_unprivileged(cli, command, str(ckpt))
    assert got.ok, str(got)  # no exception escaped the command
    done = got.value
    if command == "inspect" and which == "data":
        assert done["returncode"] == 0, done  # inspect reads the manifest only
        return
    if which == "directory" and done["returncode"] == 2:
        # click's own check of PATH (``click.Path(readable=True)``) answers first: a usage
        # error naming the path, still no traceback.
        assert f"'{ckpt}' is not readable" in done["stderr"], done
        return
    assert done["returncode"] == 1, done
    assert "permission denied" in done["stderr"].lower(), done
    assert str(target) in done["stderr"], done


def test_unreadable_parent_directory(shared: Path) -> None:
    # The parent cannot be listed or searched: transaction.resolve's stat and list fail.
    parent = shared / "runs"
    path = parent / "ckpt"
    sp.save(path, STATE)
    make_readable(parent)
    for name, op in (("load", do_load), ("inspect", do_inspect), ("verify", do_verify)):
        for bits in (0, 0o1):  # nothing; search without listing is a different code path
            with unreadable(parent, reader_mode(bits)):
                got = call_unprivileged(op, str(path))
            if bits == 0:
                assert got.raised(sp.CheckpointPermissionError), f"{name}: {got}"
                assert got.errno == errno.EACCES
            else:
                assert got.ok, f"{name} needs no listing of the parent: {got}"
    missing = str(parent / "other")
    with unreadable(parent):
        got = call_unprivileged(do_load, missing)
    assert got.raised(sp.CheckpointPermissionError), got


# ---------------------------------------------------------------------------------------------
# read-only media
# ---------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_MS_RDONLY, _MS_REMOUNT, _MNT_DETACH = 1, 32, 2


def _mount(target: Path, flags: int, options: str) -> None:
    if _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", flags, options.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


def read_everything(path: str) -> Any:
    """Every read path; returns what it saw (checked by the caller)."""
    tree = sp.load(path)
    mapped = sp.load(path, mmap=True)
    into = {"a": np.zeros(4096, np.float32), "b": np.zeros(4096, np.int64), "lr": 0.0}
    sp.load(path, into=into)
    first = sp.load(path, verify="first", keys="b")
    return {
        "same": bool(
            np.array_equal(tree["a"], STATE["a"])
            and np.array_equal(mapped["b"], STATE["b"])
            and np.array_equal(into["a"], STATE["a"])
            and np.array_equal(first["b"], STATE["b"])
            and tree["lr"] == 0.5
        ),
        "verify": sp.verify(path).metadata,
        "inspect": sp.inspect(path).metadata,
    }


def listing(path: Path) -> list[tuple[str, int, int]]:
    out = []
    for dirpath, _, filenames in os.walk(path.parent):
        for name in filenames:
            st = os.stat(os.path.join(dirpath, name))
            out.append((os.path.join(dirpath, name), st.st_size, st.st_mtime_ns))
    return sorted(out)


def test_read_only_media(shared: Path) -> None:
    mnt = shared / "ro"
    mnt.mkdir()
    path = mnt / "ckpt"
    mounted = False
    if is_root():
        try:
            _mount(mnt, 0, "size=8m,mode=0755")
            mounted = True
        except OSError:
            pass
    try:
        sp.save(path, STATE, metadata={"run": "ro"}, max_file_bytes=MAX_FILE_BYTES)
        make_readable(path)
        before = listing(path)
        if mounted:
            _mount(mnt, _MS_REMOUNT | _MS_RDONLY, "")
            with pytest.raises(OSError) as info:
                (mnt / "probe").touch()
            assert info.value.errno == errno.EROFS
            result: Any = read_everything(str(path))  # as root: the mount itself refuses writes
            commands = [cli(c, str(path)) for c in ("inspect", "verify")]
        else:
            # No mount here: take write permission away instead, and read as a user it binds.
            os.chmod(path, 0o555)
            os.chmod(mnt, 0o555)
            got = call_unprivileged(read_everything, str(path))
            assert got.ok, str(got)
            result = got.value
            commands = []
            for c in ("inspect", "verify"):
                done = call_unprivileged(cli, c, str(path))
                assert done.ok, str(done)
                commands.append(done.value)
        assert result == {"same": True, "verify": {"run": "ro"}, "inspect": {"run": "ro"}}
        for done in commands:
            assert done["returncode"] == 0, done
        assert listing(path) == before, "a reader wrote to the checkpoint"
    finally:
        if mounted and _libc.umount2(os.fsencode(mnt), 0) != 0:
            _libc.umount2(os.fsencode(mnt), _MNT_DETACH)
