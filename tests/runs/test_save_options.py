"""Save options: one validated, frozen SaveOptions, checked where the options are given.

Before, ``CheckpointManager(**save_options)`` handed the options to two different callees, so
``direct=False`` crashed at the first (synchronous) save and ``progress=`` in the constructor of an
``async_save=True`` manager, and a misspelt option surfaced minutes into a run. Now every option
is checked by the manager's constructor, which fails naming the option and writes nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import savepoint as sp
from _compare import same
from _support import one_rank_world
from savepoint.options import DEFAULT_MAX_FILE_BYTES, DEFAULT_WRITERS, SaveOptions

from ._util import state

# (option, bad value, the error it raises)
BAD: list[tuple[str, Any, type[Exception]]] = [
    ("max_file_bytes", 0, ValueError),
    ("max_file_bytes", -4096, ValueError),
    ("max_file_bytes", 1.5, TypeError),
    ("max_file_bytes", "1GiB", TypeError),
    ("max_file_bytes", True, TypeError),
    ("writers", 0, ValueError),
    ("writers", 2.0, TypeError),
    ("writers", None, TypeError),
    ("direct", "no", TypeError),
    ("direct", 0, TypeError),
    ("progress", "print", TypeError),
    ("progress", 3, TypeError),
    ("timeout", 0, ValueError),
    ("timeout", -1.0, ValueError),
    ("timeout", math.inf, ValueError),
    ("timeout", math.nan, ValueError),
    ("timeout", "60", TypeError),
    ("timeout", True, TypeError),
]


def test_defaults() -> None:
    options = SaveOptions()
    assert options.max_file_bytes == DEFAULT_MAX_FILE_BYTES and options.writers == DEFAULT_WRITERS
    assert options.direct is True and options.progress is None
    assert options.process_group is None and options.timeout is None
    assert options.changed() == {}
    assert SaveOptions(writers=3, direct=False).changed() == {"writers": 3, "direct": False}


@pytest.mark.parametrize(("name", "value", "error"), BAD, ids=lambda v: repr(v)[:20])
def test_each_bad_option_fails_at_construction(name: str, value: Any, error: type) -> None:
    with pytest.raises(error, match=name):
        SaveOptions(**{name: value})
    with pytest.raises(error, match=name):
        SaveOptions().of({name: value})


@pytest.mark.parametrize(("name", "value", "error"), BAD[::3], ids=lambda v: repr(v)[:20])
def test_the_manager_checks_its_options_before_touching_the_directory(
    tmp_path: Path, name: str, value: Any, error: type
) -> None:
    run = tmp_path / "run"
    for async_save in (False, True):
        with pytest.raises(error, match=name):
            sp.CheckpointManager(run, async_save=async_save, **{name: value})
    assert not run.exists()


def test_unknown_options_are_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(TypeError, match="'max_file_size'") as info:
        sp.CheckpointManager(run, max_file_size=1 << 20)
    assert "max_file_bytes" in str(info.value)  # the options there are
    with pytest.raises(TypeError, match="'compress', 'verify'"):
        SaveOptions.of({"verify": True, "compress": "zstd"})
    assert not run.exists()


def test_options_are_frozen() -> None:
    options = SaveOptions(writers=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.writers = 3  # type: ignore[misc]
    assert SaveOptions.of({"writers": 4}, base=options) == SaveOptions(writers=4)
    assert options.writers == 2


def test_the_manager_takes_an_options_object(tmp_path: Path) -> None:
    options = SaveOptions(max_file_bytes=4096, writers=2)
    with sp.CheckpointManager(tmp_path / "run", options=options, direct=False) as m:
        assert m.save_options == SaveOptions(max_file_bytes=4096, writers=2, direct=False)
        m.save(1, state(1))
    same(sp.load(tmp_path / "run" / "latest"), state(1))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_direct_false_saves(tmp_path: Path, async_save: bool) -> None:
    with sp.CheckpointManager(tmp_path / "run", async_save=async_save, direct=False) as m:
        m.save(1, state(1)).wait()
        m.save(2, state(2)).wait()
        assert m.steps() == [1, 2]
    same(sp.load(tmp_path / "run" / "latest"), state(2))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_progress_is_reported(tmp_path: Path, async_save: bool) -> None:
    calls: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        calls.append((done, total))

    with sp.CheckpointManager(tmp_path / "run", async_save=async_save, progress=progress) as m:
        m.save(1, state(1)).wait()
    assert calls, "progress was never called"
    done, total = calls[-1]
    assert done == total >= state(1)["w"].nbytes


# -- process_group --------------------------------------------------------------------------------


def test_a_process_group_that_is_not_one_fails_where_it_is_given(tmp_path: Path) -> None:
    """Before, ``AsyncCheckpointer`` accepted any value (it failed at the first background save),
    ``sp.save`` raised a CheckpointError and the manager let torch's error through."""
    pattern = r"process_group must be a torch\.distributed\.ProcessGroup.*not str \('nope'\)"
    with pytest.raises(TypeError, match=pattern):
        SaveOptions(process_group="nope")
    with pytest.raises(TypeError, match=pattern):
        sp.AsyncCheckpointer(process_group="nope")
    with pytest.raises(TypeError, match=pattern):
        sp.AsyncCheckpointer(options=SaveOptions(), process_group="nope")
    with pytest.raises(TypeError, match=pattern):
        sp.save(tmp_path / "ckpt", state(1), process_group="nope")
    with pytest.raises(TypeError, match=pattern):
        sp.CheckpointManager(tmp_path / "run", process_group="nope")
    with pytest.raises(TypeError, match=r"process_group must be .*, not object \(<object"):
        sp.CheckpointManager(tmp_path / "run", async_save=True, process_group=object())
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "run").exists()


def test_a_process_group_needs_torch_distributed_initialised(tmp_path: Path) -> None:
    with one_rank_world() as dist:
        group = dist.group.WORLD
        assert SaveOptions(process_group=group).process_group is group
        with sp.AsyncCheckpointer(process_group=group) as ck:
            assert ck.process_group is group
    # A real ProcessGroup, but its world is gone: the message says what to do.
    assert not dist.is_initialized()
    pattern = r"save option process_group .* not initialised; call .*init_process_group"
    with pytest.raises(ValueError, match=pattern):
        SaveOptions(process_group=group)
    with pytest.raises(ValueError, match=pattern):
        sp.AsyncCheckpointer(process_group=group)
    with pytest.raises(ValueError, match=pattern):
        sp.CheckpointManager(tmp_path / "run", process_group=group)
    assert not (tmp_path / "run").exists()


def test_options_without_a_process_group_do_not_import_torch() -> None:
    code = (
        "import sys, savepoint as sp; "
        "sp.SaveOptions(writers=2); sp.AsyncCheckpointer(writers=2).close(); "
        "sp.save('memory://options/ckpt', {'x': 1}); sp.load('memory://options/ckpt'); "
        "assert 'torch' not in sys.modules"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr


# -- options= must be a SaveOptions ---------------------------------------------------------------


@pytest.mark.parametrize("options", [{"writers": 2}, 2, "writers=2"], ids=repr)
def test_options_must_be_a_save_options(tmp_path: Path, options: Any) -> None:
    """Before: "replace() should be called on dataclass instances" (or an AttributeError)."""
    pattern = r"options must be a savepoint\.SaveOptions, not .*savepoint\.SaveOptions\(writers"
    with pytest.raises(TypeError, match=pattern):
        sp.CheckpointManager(tmp_path / "run", options=options)
    with pytest.raises(TypeError, match=pattern):
        sp.AsyncCheckpointer(options=options)
    with pytest.raises(TypeError, match=pattern):
        SaveOptions.of({}, base=options)
    assert not (tmp_path / "run").exists()


# -- the manager's other arguments ----------------------------------------------------------------

# (argument, bad value, the error it raises); each checked before the directory is touched.
BAD_MANAGER: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"keep_last": "2"}, TypeError, r"keep_last='2': .*needs an int n >= 0, not str"),
    ({"keep_last": 2.0}, TypeError, r"keep_last=2\.0"),
    ({"keep_last": True}, TypeError, r"keep_last=True"),
    ({"keep_last": -1}, ValueError, r"keep_last=-1: .*n >= 0"),
    ({"keep_best": "1", "best_metric": "val"}, TypeError, r"keep_best='1'"),
    ({"keep_every": 0}, ValueError, r"keep_every=0: .*n >= 1"),
    ({"keep_every": 2.5}, TypeError, r"keep_every=2\.5"),
    ({"save_every": 0}, ValueError, r"save_every=0: .*n >= 1, not 0"),
    ({"save_every": -3}, ValueError, r"save_every=-3"),
    ({"save_every": "10"}, TypeError, r"save_every='10'"),
    ({"async_save": "yes"}, TypeError, r"async_save must be a bool, not str \('yes'\)"),
    ({"async_save": 1}, TypeError, r"async_save must be a bool"),
    ({"aliases": None}, TypeError, r"aliases must be a bool"),
    ({"verify_before_prune": "no"}, TypeError, r"verify_before_prune must be a bool"),
    ({"strict_config": 0}, TypeError, r"strict_config must be a bool"),
    ({"read_only": "yes"}, TypeError, r"read_only must be None, True or False, not str"),
]


@pytest.mark.parametrize(("arguments", "error", "pattern"), BAD_MANAGER, ids=repr)
def test_the_manager_checks_its_arguments_before_touching_the_directory(
    tmp_path: Path, arguments: dict[str, Any], error: type, pattern: str
) -> None:
    """Before: ``keep_last="2"`` failed at the first prune ("'<' not supported"), ``save_every=0``
    meant "save always", and ``async_save="yes"`` was accepted."""
    run = tmp_path / "run"
    with pytest.raises(error, match=pattern):
        sp.CheckpointManager(run, **arguments)
    assert not run.exists()


def test_the_manager_accepts_its_arguments(tmp_path: Path) -> None:
    with sp.CheckpointManager(
        tmp_path / "run", keep_last=0, keep_every=2, save_every=2, read_only=False, aliases=False
    ) as m:
        assert m.save(1, state(1)).skipped
        assert not m.save(2, state(2)).skipped
        assert m.steps() == [2]
