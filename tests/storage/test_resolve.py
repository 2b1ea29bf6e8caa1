"""savepoint.storage.paths.resolve: which store and path a path argument names.

(That every public entry point refuses object-store URLs before creating anything is checked in
test_paths.py.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from savepoint.errors import UnsupportedStorageError
from savepoint.storage import local, memory, paths
from savepoint.storage.faults import FaultyStore
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location, local_path, resolve


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("memory://run/ckpt", "/run/ckpt"),
        ("memory:///run/ckpt", "/run/ckpt"),
        ("memory://run/./a/../ckpt/", "/run/ckpt"),
        ("MEMORY://run", "/run"),
        ("memory://", "/"),
        ("memory://run/step%201%3F%23%25", "/run/step 1?#%"),
        ("memory://[odd/name", "/[odd/name"),
    ],
)
def test_memory_urls(url: str, path: str) -> None:
    location = resolve(url)
    assert location.store is memory.shared()
    assert location.path == path
    assert not location.is_local


@pytest.mark.parametrize("name", ["/run/plain", "/run/step 1", "/r/100%", "/r/what?", "/r/#1"])
def test_memory_urls_round_trip(name: str) -> None:
    store = memory.shared()
    url = store.url(name)
    assert str(store.at(name)) == url
    assert resolve(url).path == name


@pytest.mark.parametrize("url", ["memory://run?x=1", "memory://run#frag"])
def test_memory_urls_take_no_query(url: str) -> None:
    with pytest.raises(UnsupportedStorageError, match="no query or fragment") as info:
        resolve(url)
    assert isinstance(info.value, ValueError) and info.value.scheme == "memory"


def test_local_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for arg, want in [
        ("ckpt", str(tmp_path / "ckpt")),
        ("runs/a:b", str(tmp_path / "runs" / "a:b")),
        ("a/../b/", str(tmp_path / "b")),
        (Path("sub") / "x", str(tmp_path / "sub" / "x")),
        (str(tmp_path / "abs"), str(tmp_path / "abs")),
        (f"file://{tmp_path}/f%20x", str(tmp_path / "f x")),
        (f"file://localhost{tmp_path}/y", str(tmp_path / "y")),
    ]:
        location = resolve(arg)
        assert location.store is local.STORE, arg
        assert location.path == want, arg
        assert location.is_local
        assert str(location) == want
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url", ["file://host/x", "file://relative", "file:///x?q", "file:///x#f"])
def test_bad_file_urls(url: str) -> None:
    with pytest.raises(UnsupportedStorageError, match="absolute path on this machine"):
        resolve(url)


def test_location_passes_through() -> None:
    store = FaultyStore(MemoryStore())
    location = resolve(Location(store, "run/x/../ckpt"))
    assert location.store is store and location.path == "/run/ckpt"
    assert resolve(store.at("/run")) == Location(store, "/run")
    assert store.at("/run").join("a", "b").path == "/run/a/b"
    assert not FaultyStore(local.STORE).at("/tmp").is_local  # only the real thing is local


@pytest.mark.parametrize(
    ("url", "extra"),
    [
        ("s3://bucket/run", "s3"),
        ("S3://bucket/run", "s3"),
        ("s3a://bucket/run", "s3"),
        ("gs://bucket/run", "gcs"),
        ("gcs://bucket/run", "gcs"),
        ("az://container/run", "azure"),
        ("abfs://container/run", "azure"),
        ("abfss://container/run", "azure"),
    ],
)
def test_object_store_urls_name_their_extra(
    url: str, extra: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without obstore installed (the s3, gcs and azure extras), an object-store URL is refused
    naming the extra to install."""
    monkeypatch.setattr(paths, "_has_obstore", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError) as info:
        resolve(url, what="checkpoint path")
    message = str(info.value)
    assert f"savepoint[{extra}]" in message and "checkpoint path" in message, message
    assert url in message and info.value.path == url
    assert info.value.scheme == url.split(":")[0].lower()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url", ["https://host/x", "hdfs://nn/x", "webdav://h/x"])
def test_other_schemes_point_at_fsspec(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without fsspec installed (the fsspec extra), other schemes are refused naming the extra
    (with it: tests/storage/test_fsspecstore.py)."""
    monkeypatch.setattr(paths, "_has_fsspec", lambda: False)
    with pytest.raises(UnsupportedStorageError, match=r"savepoint\[fsspec\]") as info:
        resolve(url)
    assert info.value.scheme == url.split(":")[0]


def test_local_path_refuses_other_stores() -> None:
    with pytest.raises(UnsupportedStorageError, match="local files only"):
        local_path("memory://x")
    with pytest.raises(UnsupportedStorageError, match="local files only"):
        local_path(MemoryStore().at("/x"))
    with pytest.raises(UnsupportedStorageError, match="local files only"):
        local_path(FaultyStore(local.STORE).at("/tmp/x"))
    assert local_path(local.STORE.at("/tmp/x")) == "/tmp/x"
    with pytest.raises(TypeError):
        local_path(b"/tmp/x")  # type: ignore[arg-type]


def test_a_store_made_by_hand_has_urls_that_name_it_and_no_other() -> None:
    """A MemoryStore made by hand is not the shared memory:// store: its URLs (in messages,
    CheckpointInfo.path, step_path) resolve back to it while it lives, never to the shared store,
    and are refused once it is gone."""
    import gc

    import numpy as np

    import savepoint as sp
    from savepoint.storage import memory as memory_mod

    mine = MemoryStore(atomic_rename=False)
    info = sp.save(mine.at("/x/c"), {"a": np.arange(3)})
    sp.save("memory://x/c", {"a": np.arange(5)})
    assert info.path.startswith(f"memory+{mine.number}://x/c/")
    assert resolve(info.path).store is mine
    assert list(sp.load(info.path)["a"]) == [0, 1, 2]
    assert list(sp.load(str(mine.at("/x/c")))["a"]) == [0, 1, 2]
    assert list(sp.load("memory://x/c")["a"]) == [0, 1, 2, 3, 4]
    assert memory_mod.shared().url("/x/c") == "memory://x/c"
    url = str(mine.at("/x/c"))
    del mine, info
    gc.collect()
    with pytest.raises(UnsupportedStorageError, match="no longer exists"):
        resolve(url)
    with pytest.raises(UnsupportedStorageError, match="no longer exists"):
        resolve("memory+x://a/b")
    memory_mod.shared().remove_tree("/x")
