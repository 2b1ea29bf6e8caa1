"""Save options: one validated, frozen SaveOptions, checked where the options are given.

Before, ``CheckpointManager(**save_options)`` handed the options to two different callees, so
``direct=False`` crashed at the first (synchronous) save and ``progress=`` in the constructor of an
``async_save=True`` manager, and a misspelt option surfaced minutes into a run. Now every option
is checked by the manager's constructor, which fails naming the option and writes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

import savepoint as sp
from _compare import same
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
