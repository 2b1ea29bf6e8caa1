"""The public surface of ``savepoint``: __all__, the error hierarchy, pickling of errors."""

from __future__ import annotations

import errno
import inspect as pyinspect
import pickle
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp

ERRORS: dict[str, tuple[type[BaseException], ...]] = {
    "CheckpointNotFoundError": (FileNotFoundError,),
    "IncompleteCheckpointError": (FileNotFoundError,),
    "CorruptCheckpointError": (ValueError,),
    "IncompatibleCheckpointError": (ValueError,),
    "StateMismatchError": (ValueError, sp.IncompatibleCheckpointError),
    "UnsupportedStateError": (TypeError,),
    "CheckpointWriteError": (OSError,),
    "DistributedCheckpointError": (RuntimeError,),
    "MissingCheckpointError": (ValueError, sp.CorruptCheckpointError),
    "RunMismatchError": (ValueError, sp.IncompatibleCheckpointError),
    "UnsupportedStorageError": (ValueError,),
    "CheckpointArgumentError": (TypeError, ValueError),
}


def test_all_is_sorted_and_complete() -> None:
    assert sp.__all__ == sorted(sp.__all__)
    assert len(sp.__all__) == len(set(sp.__all__))
    # Public names are imported on first use (savepoint/__init__.py): dir() lists them all.
    public = {
        name
        for name in dir(sp)
        if (not name.startswith("_") or name == "__version__")
        and not isinstance(getattr(sp, name), types.ModuleType)
    }
    assert set(sp.__all__) == public
    for name in sp.__all__:
        assert getattr(sp, name) is not None


def test_version_is_a_string() -> None:
    assert isinstance(sp.__version__, str) and sp.__version__[0].isdigit()


def test_entry_points_are_documented_callables() -> None:
    for name in ("save", "load", "verify", "inspect"):
        fn = getattr(sp, name)
        assert callable(fn) and fn.__doc__, name
    documented = {"path", "into", "keys", "verify", "framework", "device", "mmap"}
    assert documented <= set(pyinspect.signature(sp.load).parameters)
    for name, param in pyinspect.signature(sp.load).parameters.items():
        if name != "path":
            assert param.kind is pyinspect.Parameter.KEYWORD_ONLY, name


def test_stateful_protocol_is_runtime_checkable() -> None:
    class Thing:
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: Any) -> None:
            pass

    assert isinstance(Thing(), sp.Stateful)
    assert not isinstance(object(), sp.Stateful)


def _instance(name: str) -> sp.CheckpointError:
    cls = getattr(sp, name)
    if name == "StateMismatchError":
        return cls(
            [("model/w", "shape [2] in the checkpoint, [3] in the target"), ("", "x")], path="/ck"
        )
    if name == "UnsupportedStateError":
        return cls("a/b: cannot store a value of type builtins.object", key="a/b")
    if name == "CorruptCheckpointError":
        return cls("/ck: checksum mismatch in tensor 'w'", path="/ck", key="w")
    if name == "UnsupportedStorageError":
        return cls("s3:// is not supported yet", path=Path("/ck"), scheme="s3")
    return cls(f"{name} happened at /ck", path=Path("/ck"))


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_hierarchy(name: str) -> None:
    cls = getattr(sp, name)
    assert name in sp.__all__
    assert issubclass(cls, sp.CheckpointError)
    assert issubclass(sp.CheckpointError, Exception)
    for base in ERRORS[name]:
        assert issubclass(cls, base), f"{name} should subclass {base.__name__}"
    err = _instance(name)
    assert hasattr(err, "path")
    if name != "UnsupportedStateError":
        assert err.path == "/ck"  # a PathLike is stored as a str
    else:
        assert err.path is None and err.key == "a/b"
    assert str(err) == err.message
    with pytest.raises(ERRORS[name][0]):
        raise err


@pytest.mark.parametrize("name", [*ERRORS, "CheckpointError"])
def test_errors_survive_pickle(name: str) -> None:
    err = _instance(name) if name != "CheckpointError" else sp.CheckpointError("base", path="/ck")
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err)
    assert str(copy) == str(err)
    assert copy.message == err.message
    assert copy.path == err.path
    assert copy.args == err.args
    for attr in ("key", "problems", "scheme"):
        if hasattr(err, attr):
            assert getattr(copy, attr) == getattr(err, attr)


def test_real_errors_carry_path_and_pickle(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(sp.CheckpointNotFoundError) as excinfo:
        sp.load(missing)
    err = excinfo.value
    assert err.path == str(missing)
    copy = pickle.loads(pickle.dumps(err))
    assert copy.path == str(missing) and str(copy) == str(err)

    ckpt = tmp_path / "c"
    sp.save(ckpt, {"a": np.zeros(2)})
    with pytest.raises(sp.StateMismatchError) as mismatch:
        sp.load(ckpt, into={"a": np.zeros(3)})
    copy = pickle.loads(pickle.dumps(mismatch.value))
    assert (
        copy.problems
        == mismatch.value.problems
        == [("a", "shape [2] in the checkpoint, [3] in the target")]
    )
    assert copy.path == str(ckpt)


def test_write_error_pickles_with_errno(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(sp.CheckpointWriteError) as excinfo:
        sp.save(target, {"a": 1})
    err = excinfo.value
    assert isinstance(err, OSError) and err.path == str(target)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is sp.CheckpointWriteError
    assert str(copy) == str(err) and copy.path == err.path

    # save() reports a failed write with the OSError's errno (ENOSPC, EDQUOT, ...) set on the
    # CheckpointWriteError, so `except OSError as e: if e.errno == errno.ENOSPC` works; a copy sent
    # through pickle (multiprocessing, concurrent.futures) must keep it.
    full = sp.CheckpointWriteError("saving /ck failed: No space left on device", path="/ck")
    full.errno = errno.ENOSPC
    copy = pickle.loads(pickle.dumps(full))
    assert copy.path == "/ck" and str(copy) == str(full)
    assert copy.errno == errno.ENOSPC


# Errors that lived next to the code raising them until every public error moved to errors.py:
# their constructors, messages and pickling are unchanged; each is exported from savepoint.
MOVED: dict[str, tuple[tuple[type[BaseException], ...], Any, str]] = {
    "SymlinkError": (
        (sp.CorruptCheckpointError,),
        lambda: sp.SymlinkError("/real/ck/a", "/ck/a"),
        "/ck/a is a symlink; refusing to follow it",
    ),
    "NotRegularFileError": (
        (sp.CorruptCheckpointError,),
        lambda: sp.NotRegularFileError("/real/ck/a", "/ck/a"),
        "/ck/a is not a regular file (a FIFO, socket, device or directory); refusing to read it",
    ),
    "ConversionError": (
        (sp.UnsupportedStateError, TypeError),
        lambda: sp.ConversionError("shrew-v1", ["a: bool"], label=".shrew v1"),
        "cannot convert to .shrew v1 without losing data; 1 part(s) it cannot hold:\n  - a: bool\n",
    ),
    "OptimizerStateError": (
        (sp.IncompatibleCheckpointError,),
        lambda: sp.OptimizerStateError("cannot load", ["x", "y"]),
        "cannot load, 2 problem(s):\n  - x\n  - y",
    ),
    "DataStateError": (
        (sp.IncompatibleCheckpointError,),
        lambda: sp.DataStateError("cannot restore", ["x"]),
        "cannot restore, 1 problem(s):\n  - x",
    ),
    "RNGStateError": (
        (sp.IncompatibleCheckpointError,),
        lambda: sp.RNGStateError(["x"]),
        "cannot restore the random generators, 1 problem(s); no generator was changed:\n  - x\n",
    ),
    "ArtifactMismatchError": (
        (sp.RunMismatchError,),
        lambda: sp.ArtifactMismatchError("mismatch", path="/ck"),
        "mismatch",
    ),
    "MissingBestValidationArtifact": (
        (sp.MissingCheckpointError,),
        lambda: sp.MissingBestValidationArtifact("missing", path="/ck"),
        "missing",
    ),
}


@pytest.mark.parametrize("name", list(MOVED))
def test_moved_errors_are_public_and_pickle(name: str) -> None:
    import savepoint.errors

    bases, make, message = MOVED[name]
    cls = getattr(sp, name)
    assert name in sp.__all__ and name in savepoint.errors.__all__
    assert cls.__module__ == "savepoint.errors"
    assert all(issubclass(cls, base) for base in bases)
    err = make()
    assert str(err).startswith(message)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is cls and str(copy) == str(err) and copy.path == err.path
    for attr in ("problems", "target", "filename", "errno", "strerror"):
        if hasattr(err, attr):
            assert getattr(copy, attr) == getattr(err, attr), attr


def test_every_error_class_is_in_errors_and_exported() -> None:
    import savepoint.errors

    defined = {
        name
        for name, value in vars(savepoint.errors).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == "savepoint.errors"
    }
    assert defined == set(savepoint.errors.__all__)
    assert defined <= set(sp.__all__)
