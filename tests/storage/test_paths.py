"""Path arguments: local paths and file:// URLs work; URLs of schemes without a backend (object
stores without the obstore extra installed, https, ...) are refused before anything exists, and so
are object-store URLs given to what reads and writes local files only (the foreign formats).

At the parent commit ``sp.save("s3://b/x")`` wrote ``./s3:/b/x`` (os.path collapses the ``//``),
so every refusal test below also asserts that the working directory stays empty.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
from savepoint.cli import main
from savepoint.distributed.consolidate import consolidate
from savepoint.formats import boostr, burn, detect, diff, shrew, training_artifact
from savepoint.inference import InferenceSnapshot
from savepoint.storage import paths
from savepoint.storage.paths import local_path

# memory:// is not refused: it names the in-memory store (tests/storage/test_resolve.py).
URLS = ["s3://bucket/x", "gs://b/x", "az://c/x", "https://h/x"]

STATE = {"w": np.arange(4, dtype=np.float32)}


def _snapshot() -> InferenceSnapshot:
    return InferenceSnapshot(
        states=[np.zeros((2, 3), np.float32)], history=[np.ones(1, np.float32)], step_count=1
    )


def _async_save(url: str) -> Any:
    with sp.AsyncCheckpointer() as saver:
        return saver.save(url, STATE)


def _async_save_boostr(url: str) -> Any:
    with sp.AsyncCheckpointer() as saver:
        return saver.save_boostr(url, STATE)


# Each takes the URL; "missing" is a relative path that does not exist (nothing may create it).
ENTRY_POINTS: dict[str, Callable[[str], Any]] = {
    "sp.save": lambda u: sp.save(u, STATE),
    "sp.load": lambda u: sp.load(u),
    "sp.verify": lambda u: sp.verify(u),
    "sp.inspect": lambda u: sp.inspect(u),
    "formats.diff.diff a": lambda u: diff.diff(u, "missing"),
    "formats.diff.diff b": lambda u: diff.diff("missing", u),
    "sp.convert source": lambda u: sp.convert(u, "missing"),
    "sp.convert target": lambda u: sp.convert("missing", u),
    "AsyncCheckpointer.save": _async_save,
    "AsyncCheckpointer.save_boostr": _async_save_boostr,
    "CheckpointManager": lambda u: sp.CheckpointManager(u),
    "sp.open_run": lambda u: sp.open_run(u),
    "sp.Sweep": lambda u: sp.Sweep(u),
    "SnapshotHistory": lambda u: sp.SnapshotHistory(2, directory=u),
    "InferenceSnapshot.save": lambda u: _snapshot().save(u),
    "InferenceSnapshot.load": lambda u: InferenceSnapshot.load(u),
    "InferenceSnapshot.save_json": lambda u: _snapshot().save_json(u),
    "InferenceSnapshot.load_json": lambda u: InferenceSnapshot.load_json(u),
    "InferenceSnapshot.save_msgpack": lambda u: _snapshot().save_msgpack(u),
    "InferenceSnapshot.load_msgpack": lambda u: InferenceSnapshot.load_msgpack(u),
    "shrew.save": lambda u: shrew.save(u, STATE),
    "shrew.load": lambda u: shrew.load(u, dict(STATE)),
    "shrew.save_tensors": lambda u: shrew.save_tensors(u, STATE),
    "shrew.load_tensors": lambda u: shrew.load_tensors(u),
    "shrew.save_training": lambda u: shrew.save_training(u, shrew.TrainingCheckpoint(STATE)),
    "shrew.load_training": lambda u: shrew.load_training(u),
    "shrew.save_parts": lambda u: shrew.save_parts(u, STATE, None),
    "shrew.read_version": lambda u: shrew.read_version(u),
    "shrew.inspect": lambda u: shrew.inspect(u),
    "shrew.verify": lambda u: shrew.verify(u),
    "boostr.save": lambda u: boostr.save(u, STATE),
    "boostr.load": lambda u: boostr.load(u),
    "boostr.inspect": lambda u: boostr.inspect(u),
    "boostr.verify": lambda u: boostr.verify(u),
    "boostr.save_distributed": lambda u: boostr.save_distributed(
        u, [boostr.BoostrCheckpoint(dict(STATE))]
    ),
    "boostr.load_distributed": lambda u: boostr.load_distributed(u, 0),
    "boostr.load_consolidated": lambda u: boostr.load_consolidated(u),
    "boostr.consolidate source": lambda u: boostr.consolidate(u, "missing"),
    "boostr.consolidate target": lambda u: boostr.consolidate("missing", u),
    "burn.save_record": lambda u: burn.save_record(u, STATE),
    "burn.write_record": lambda u: burn.write_record(u, {"w": STATE["w"]}),
    "burn.load_record": lambda u: burn.load_record(u),
    "burn.open_record": lambda u: burn.open_record(u),
    "burn.inspect": lambda u: burn.inspect(u),
    "burn.verify": lambda u: burn.verify(u),
    "training_artifact.save": lambda u: training_artifact.save(u, STATE, {}),
    "training_artifact.load": lambda u: training_artifact.load(u),
    "training_artifact.load_checkpoint": lambda u: training_artifact.load_checkpoint(u),
    "training_artifact.inspect": lambda u: training_artifact.inspect(u),
    "training_artifact.verify": lambda u: training_artifact.verify(u),
    "training_artifact.save_comparison": lambda u: training_artifact.save_comparison(u, {}),
    "training_artifact.load_comparison": lambda u: training_artifact.load_comparison(u),
    "training_artifact.save_sweep": lambda u: training_artifact.save_sweep(u, {}, {}),
    "training_artifact.load_sweep": lambda u: training_artifact.load_sweep(u),
    "detect.detect": lambda u: detect.detect(u),
    "detect.inspect_any": lambda u: detect.inspect_any(u),
    "detect.verify_any": lambda u: detect.verify_any(u),
    "distributed.consolidate source": lambda u: consolidate(u, "missing"),
    "distributed.consolidate target": lambda u: consolidate("missing", u),
}


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory, on a machine without the object-store and fsspec extras
    installed."""
    monkeypatch.setattr(paths, "_has_obstore", lambda: False)
    monkeypatch.setattr(paths, "_has_fsspec", lambda: False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


EXTRAS = {"s3": "s3", "gs": "gcs", "az": "azure"}


def _refused_message(text: str, scheme: str) -> None:
    assert f"no backend for {scheme}:// URLs" in text
    assert "mount" in text and "local path" in text
    # It names the extra that will carry the backend, and says this version does not have it.
    assert f"savepoint[{EXTRAS.get(scheme, 'fsspec')}]" in text and "not have" in text


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_urls_are_refused_and_create_nothing(entry: str, url: str, empty_cwd: Path) -> None:
    with pytest.raises(sp.UnsupportedStorageError) as excinfo:
        ENTRY_POINTS[entry](url)
    err = excinfo.value
    assert isinstance(err, ValueError) and isinstance(err, sp.CheckpointError)
    assert err.scheme == url.split(":", 1)[0] and err.path == url
    _refused_message(str(err), err.scheme)
    assert os.listdir(empty_cwd) == []


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "{u}"],
        ["verify", "{u}"],
        ["ls", "{u}"],
        ["report", "{u}"],
        ["report", "missing", "--plot", "{u}"],
        ["diff", "{u}", "missing"],
        ["diff", "missing", "{u}"],
        ["convert", "{u}", "missing"],
        ["convert", "missing", "{u}"],
        ["consolidate", "{u}", "missing"],
        ["consolidate", "missing", "{u}"],
    ],
    ids=lambda a: "-".join(a).replace("{u}", "URL"),
)
def test_cli_refuses_urls_with_exit_1(args: list[str], empty_cwd: Path) -> None:
    result = CliRunner().invoke(main, [a.replace("{u}", "s3://bucket/x") for a in args])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # a message, not a traceback
    assert result.stderr.startswith("error: ")
    _refused_message(result.stderr, "s3")
    assert os.listdir(empty_cwd) == []


# What reads and writes local files only: the foreign formats and their detection.
LOCAL_ONLY = [
    e
    for e in ENTRY_POINTS
    if e.split(".")[0] in ("shrew", "boostr", "burn", "training_artifact", "detect")
    or e == "AsyncCheckpointer.save_boostr"
]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_object_store_urls_reach_the_store_or_a_local_only_refusal(
    entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With obstore installed, s3:// URLs go to the object store everywhere savepoint's own
    formats are read or written (no network here: the store is replaced by a tripwire), and
    the foreign formats, which are local files, refuse them before anything exists."""
    pytest.importorskip("obstore")
    from savepoint.storage import objectstore

    class Reached(Exception):
        pass

    def tripwire(scheme: str) -> Any:
        raise Reached(scheme)

    monkeypatch.setattr(objectstore, "shared", tripwire)
    monkeypatch.chdir(tmp_path)
    if entry in LOCAL_ONLY:
        with pytest.raises(sp.UnsupportedStorageError, match="local files only") as excinfo:
            ENTRY_POINTS[entry]("s3://bucket/x")
        assert excinfo.value.scheme == "s3"
    else:
        with pytest.raises((Reached, sp.CheckpointNotFoundError)):
            ENTRY_POINTS[entry]("s3://bucket/x")
    assert os.listdir(tmp_path) == []


def test_file_url_saves_and_loads_the_local_path(tmp_path: Path) -> None:
    where = tmp_path / "a dir" / "ck"
    url = "file://" + quote(str(where))
    sp.save(url, STATE)
    assert (where / "manifest.json").is_file()  # percent-escapes decoded, no "file:" directory
    np.testing.assert_array_equal(sp.load(url)["w"], STATE["w"])
    np.testing.assert_array_equal(sp.load(where)["w"], STATE["w"])
    assert sp.verify(f"file://localhost{quote(str(where))}").path == str(where)
    assert sp.inspect(url).path == str(where)


def test_local_path_mapping(tmp_path: Path) -> None:
    assert local_path("runs/a:b") == "runs/a:b"  # a colon later in a relative path is fine
    assert local_path("a:b/c") == "a:b/c"  # no "//": not a URL
    assert local_path("s3:/bucket") == "s3:/bucket"
    assert local_path("1s://x") == "1s://x"  # a scheme starts with a letter
    assert local_path(tmp_path) == str(tmp_path)
    assert local_path("file:///abs/p%20q") == "/abs/p q"
    assert local_path("FILE://localhost/abs") == "/abs"


@pytest.mark.parametrize(
    ("url", "scheme"),
    [
        ("S3://bucket/x", "s3"),
        ("git+ssh://h/x", "git+ssh"),
        ("a.b-c://x", "a.b-c"),
        ("file://otherhost/abs", "file"),
        ("file://relative/path", "file"),
        ("file:///abs?q=1", "file"),
    ],
)
def test_local_path_refusals(url: str, scheme: str) -> None:
    with pytest.raises(sp.UnsupportedStorageError) as excinfo:
        local_path(url, what="checkpoint path")
    assert excinfo.value.scheme == scheme
    assert str(excinfo.value).startswith(f"checkpoint path {url!r}: ")


def test_refusal_pickles_with_scheme(empty_cwd: Path) -> None:  # (without obstore)
    with pytest.raises(sp.UnsupportedStorageError) as excinfo:
        sp.save("gs://b/x", STATE)
    copy = pickle.loads(pickle.dumps(excinfo.value))
    assert type(copy) is sp.UnsupportedStorageError
    assert (copy.scheme, copy.path, str(copy)) == ("gs", "gs://b/x", str(excinfo.value))
