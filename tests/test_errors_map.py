"""Issue 26: one table maps OS and object-store failures to savepoint's errors, one home per hint.

The table is checked entry by entry, and an AST scan holds that no module outside
``savepoint.errors_map`` builds a CheckpointWriteError or CheckpointPermissionError from an
OSError by hand (``errno=exc.errno``), nor writes a hint of the table again.
"""

from __future__ import annotations

import ast
import errno
from pathlib import Path

import pytest

from savepoint import errors_map
from savepoint.errors import CheckpointError, CheckpointPermissionError, CheckpointWriteError

SRC = Path(__file__).resolve().parents[1] / "src" / "savepoint"
ALLOWED = {SRC / "errors_map.py", SRC / "errors.py"}
BUILT = {"CheckpointWriteError", "CheckpointPermissionError"}


@pytest.mark.parametrize(
    ("code", "scheme", "hint"),
    [
        (errno.ENOSPC, "file", "free disk space and save again"),
        (errno.EDQUOT, "file", "free quota and save again"),
        (errno.EROFS, "file", "the filesystem is read-only"),
        (errno.EACCES, "file", "check the permissions of the parent directory"),
        (errno.EPERM, "fsspec+file", "check the permissions of the parent directory"),
        (errno.EACCES, "s3", errors_map.HINTS["refused_remote"]),
        (errno.EIO, "file", "see the cause below"),
    ],
)
def test_write_error_table(code: int, scheme: str, hint: str) -> None:
    exc = OSError(code, "boom", "/d/f")
    error = errors_map.write_error(exc, "/d", "saving /d failed", tail="; x", scheme=scheme)
    assert type(error) is CheckpointWriteError and error.errno == code and error.path == "/d"
    assert str(error) == f"saving /d failed: boom (/d/f); x; {hint}"


def test_write_error_without_errno_or_chained_cause() -> None:
    refused = errors_map.write_error(PermissionError("no"), "p", "h", where="", scheme="gs")
    assert str(refused).endswith("check the credentials and the bucket's access policy")
    plain = errors_map.write_error(OSError("odd"), "p", "h", where="", cause=False)
    assert str(plain) == "h: odd" and plain.errno is None


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM])
def test_read_error_refusal_is_permission_error(code: int) -> None:
    local = errors_map.read_error(OSError(code, "Permission denied", "/a"), "/a")
    assert isinstance(local, CheckpointPermissionError) and local.errno == code
    assert str(local).startswith("/a: permission denied (Permission denied); the checkpoint")
    assert "read it as one who may" in str(local)
    remote = errors_map.read_error(PermissionError(errno.EACCES, "get refused"), "s3://b/k")
    assert "check the credentials and the bucket's policy" in str(remote)


def test_read_error_other_and_passthrough() -> None:
    other = errors_map.read_error(OSError(errno.EIO, "Input/output error"), "/a", tail="; t")
    assert type(other) is CheckpointError and str(other) == "cannot read /a: Input/output error; t"
    mine = CheckpointWriteError("already", path="/a")
    assert errors_map.read_error(mine, "/a") is mine


def test_object_store_kinds() -> None:
    assert {k: c for k, (c, _) in errors_map.OBJECT_STORE.items()} == {
        "missing": FileNotFoundError,
        "exists": FileExistsError,
        "refused": PermissionError,
        "failed": OSError,
    }
    failed = errors_map.store_error("failed", "put of s3://b/k failed", "s3://b/k", side="write")
    assert isinstance(failed, CheckpointWriteError) and failed.errno == errno.EIO
    read = errors_map.store_error("failed", "get failed", "s3://b/k", side="read")
    assert type(read) is CheckpointError
    refused = errors_map.store_error("refused", "get refused", "s3://b/k", side="read")
    assert isinstance(refused, CheckpointPermissionError)
    raw = errors_map.store_error("missing", "No such object", "s3://b/k")
    assert type(raw) is FileNotFoundError and raw.errno == errno.ENOENT


def test_mapped_context_manager() -> None:
    with pytest.raises(CheckpointWriteError) as info:
        with errors_map.mapped("/d", "writing /d failed"):
            raise OSError(errno.ENOSPC, "No space left on device", "/d/x")
    assert info.value.errno == errno.ENOSPC and "free disk space" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(CheckpointPermissionError):
        with errors_map.mapped("/d", "reading /d failed", read=True):
            raise PermissionError(errno.EACCES, "Permission denied", "/d")
    mine = CheckpointError("kept")
    with pytest.raises(CheckpointError) as kept:
        with errors_map.mapped("/d", "h"):
            raise mine
    assert kept.value is mine


def _from_oserror(node: ast.expr) -> bool:
    """Whether ``node`` reads an exception's errno (``exc.errno``)."""
    return any(isinstance(sub, ast.Attribute) and sub.attr == "errno" for sub in ast.walk(node))


def test_no_error_is_built_from_an_oserror_by_hand() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in BUILT:
                continue
            for kw in node.keywords:
                if kw.arg == "errno" and _from_oserror(kw.value):
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not offenders, f"build these through savepoint.errors_map: {offenders}"


def test_each_hint_is_written_once() -> None:
    repeated = []
    for path in sorted(SRC.rglob("*.py")):
        if path in ALLOWED:
            continue
        text = path.read_text()
        for hint in errors_map.HINTS.values():
            if hint in text:
                repeated.append(f"{path.relative_to(SRC)}: {hint!r}")
    assert not repeated, f"use savepoint.errors_map.HINTS: {repeated}"
