"""FsspecStore: savepoint's checkpoints, runs and URLs on any filesystem fsspec knows.

The storage contract itself runs over fsspec's memory and local filesystems in
``test_contract.py``; here: whole saves, loads and runs through the store, the one warning where
exclusive creation is not atomic, the read path of large blobs, and URL resolution (no network:
``ftp://`` resolves without connecting, and a connection attempt is caught by a tripwire).
"""

from __future__ import annotations

import errno
import ftplib
import os
import re
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import known_implementations

import savepoint as sp
from savepoint.commit import pointer
from savepoint.errors import (
    CheckpointPermissionError,
    CorruptCheckpointError,
    UnsupportedStorageError,
)
from savepoint.runs import layout
from savepoint.storage import paths
from savepoint.storage.fsspecstore import FsspecStore, WeakCreateWarning
from savepoint.storage.paths import Location, local_path, resolve


def state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "b": np.arange(seed, seed + 7, dtype=np.int64),
        "step": seed,
        "nested": {"lr": 0.1 * seed, "name": f"s{seed}"},
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    np.testing.assert_array_equal(a["w"], b["w"])
    np.testing.assert_array_equal(a["b"], b["b"])
    assert a["step"] == b["step"] and a["nested"] == b["nested"]


def private_memory_fs() -> Any:
    """An fsspec memory filesystem of its own (not the process-wide one)."""
    return fsspec.filesystem("memory", global_store=False, skip_instance_cache=True)


def quiet(store: FsspecStore) -> FsspecStore:
    """Take the store's one WeakCreateWarning (if it has one) so that tests may write."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", WeakCreateWarning)
        store.makedirs("/")
    return store


@pytest.fixture(params=["memory", "global-memory", "local", "local-no-prefetch"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Location]:
    """A fresh directory in an FsspecStore: over a memory filesystem of its own, over fsspec's
    process-wide memory filesystem (a unique prefix, removed afterwards), over the local
    filesystem, and over it with every blob read through its open handle (no prefetch)."""
    if request.param == "memory":
        yield quiet(FsspecStore(private_memory_fs())).at("/runs")
    elif request.param == "global-memory":
        store = quiet(FsspecStore(fsspec.filesystem("memory")))
        where = store.at(f"/savepoint-test-{uuid.uuid4().hex}")
        yield where
        store.remove_tree(where.path)
        assert store.stat(where.path) is None
    else:
        prefetch = 0 if request.param == "local-no-prefetch" else 1 << 20
        yield FsspecStore(LocalFileSystem(), prefetch=prefetch).at(str(tmp_path / "runs"))


def test_capabilities() -> None:
    mem = FsspecStore(private_memory_fs())
    local = FsspecStore(LocalFileSystem())
    assert mem.scheme == "fsspec+memory" and local.scheme == "fsspec+file"
    for store in (mem, local):
        caps = store.capabilities
        assert not (caps.atomic_rename or caps.hard_links or caps.zero_copy or caps.locks)
    assert not mem.capabilities.create_only_put and not mem.capabilities.durable
    assert local.capabilities.create_only_put and local.capabilities.durable
    lazy = FsspecStore(protocol="ftp", storage_options={"host": "127.0.0.1"})
    assert lazy.scheme == "ftp" and lazy.capabilities.durable
    assert not lazy.capabilities.create_only_put


def test_save_load_verify_inspect_and_replace(root: Location) -> None:
    ckpt = root.join("ckpt")
    info = sp.save(ckpt, state(1), metadata={"epoch": 1})
    same(sp.load(ckpt), state(1))
    assert sp.verify(ckpt).path == info.path
    inspected = sp.inspect(ckpt)
    assert inspected.metadata == {"epoch": 1}
    assert {t.key for t in inspected.tensors} >= {"w", "b"}
    assert sp.load(ckpt, keys=["w"])["w"].shape == (64, 33)
    # No atomic rename: the checkpoint is committed manifest-last, in a generation of its own.
    store = root.store
    first = store.list(ckpt.path)
    assert len(first) == 1 and first[0].startswith("gen-")

    sp.save(ckpt, state(2), metadata={"epoch": 2})  # a replace
    same(sp.load(ckpt), state(2))
    assert sp.inspect(ckpt).metadata == {"epoch": 2}
    second = store.list(ckpt.path)
    assert len(second) == 1 and second != first  # the older generation is gone
    into = {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else v) for k, v in state(0).items()}
    sp.load(ckpt, into=into)
    np.testing.assert_array_equal(into["w"], state(2)["w"])


def test_a_damaged_blob_is_caught_by_verify(root: Location) -> None:
    ckpt = root.join("ckpt")
    sp.save(ckpt, state(3))
    store = root.store
    gen = store.join(ckpt.path, store.list(ckpt.path)[0])
    data_file = next(n for n in store.list(gen) if n != "manifest.json")
    path = store.join(gen, data_file)
    data = bytearray(store.read_small(path, cap=None))
    data[-1] ^= 0xFF
    store.remove(path)
    store.put(path, bytes(data))
    with pytest.raises(CorruptCheckpointError):
        sp.verify(ckpt)


def test_checkpoint_manager_run(root: Location) -> None:
    run = root.join("run")
    vals = {1: 0.5, 2: 0.1, 3: 0.4, 4: 0.3}
    with sp.CheckpointManager(run, keep_last=2, keep_best=1, best_metric="val") as m:
        for step, val in vals.items():
            m.save(step, state(step), {"val": val})
        assert m.steps() == [2, 3, 4]
        assert m.best_step() == 2 and m.latest_step() == 4
    assert layout.committed_steps(run) == [2, 3, 4]
    # No hard links: latest and best are pointer aliases.
    store = run.store
    for alias, step in (("latest", 4), ("best", 2)):
        target = pointer.target(store, run.join(alias).path)
        assert target is not None and layout.step_name(step) in target
    same(sp.load(run.join("latest")), state(4))
    same(sp.load(run.join("best")), state(2))
    with sp.CheckpointManager(run, read_only=True) as r:
        into = state(0)
        assert r.restore(into, "best", resume=False) == 2
        same(into, state(2))
    with sp.CheckpointManager(run, keep_last=2, keep_best=1, best_metric="val") as m:
        into = state(0)
        assert m.restore(into) == 4
        same(into, state(4))
        m.save(5, state(5), {"val": 0.05})
        assert m.best_step() == 5 and m.steps() == [4, 5]
    assert layout.committed_steps(run) == [4, 5]
    same(sp.load(run.join("best")), state(5))


def test_weak_create_warns_once_per_filesystem() -> None:
    fs = private_memory_fs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = FsspecStore(fs)
        sp.save(store.at("/a"), state(1))
        sp.save(store.at("/a"), state(2))
        sp.save(FsspecStore(fs).at("/b"), state(3))  # another store, the same filesystem
    weak = [w for w in caught if issubclass(w.category, WeakCreateWarning)]
    assert len(weak) == 1, [str(w.message) for w in caught]
    assert issubclass(weak[0].category, UserWarning)
    text = str(weak[0].message)
    assert "memory filesystem" in text and "two writers" in text and "single writer" in text
    # Reading a checkpoint of another filesystem warns nothing.
    other = private_memory_fs()
    other.pipe_file("/x", b"")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert FsspecStore(other).list("/") == ["x"]
    assert caught == []


def test_local_filesystem_has_atomic_create_and_no_warning(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = FsspecStore(LocalFileSystem())
        sp.save(store.at(str(tmp_path / "c")), state(1))
        store.put(str(tmp_path / "m"), b"one")
        with pytest.raises(FileExistsError):
            store.put(str(tmp_path / "m"), b"two")
    assert caught == []
    assert (tmp_path / "m").read_bytes() == b"one"
    assert sorted(os.listdir(tmp_path)) == ["c", "m"]  # no temporary left


def test_large_blob_reads_through_its_handle(tmp_path: Path) -> None:
    """Past ``prefetch`` a blob is read through the file it opened: a replace does not change
    what it reads, and a blob cut short under it is reported, not returned as zeros."""
    store = FsspecStore(LocalFileSystem(), prefetch=1024)
    path = str(tmp_path / "big")
    payload = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    store.put(path, payload)
    r = store.open_blob(path)
    try:
        assert r.size == len(payload)
        store.put(path, b"x" * len(payload), exclusive=False)  # replaced: a new file
        out = bytearray(5000)
        r.read(90_000, out)
        assert bytes(out) == payload[90_000:95_000]
    finally:
        r.close()
    store.remove(path)
    store.put(path, payload)
    r = store.open_blob(path)
    try:
        os.truncate(path, 50_000)  # cut short in place
        with pytest.raises(CorruptCheckpointError, match="ended at"):
            r.read(40_000, bytearray(20_000))
    finally:
        r.close()


# ---------------------------------------------------------------------------------------------
# URLs
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_ftp(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """A tripwire: any FTP connection attempt is recorded and refused."""
    attempts: list[tuple[str, int]] = []

    def connect(self: Any, host: str = "", port: int = 0, *args: Any, **kwargs: Any) -> str:
        attempts.append((host, port))
        raise ConnectionRefusedError("no network in tests")

    monkeypatch.setattr(ftplib.FTP, "connect", connect)
    return attempts


def test_ftp_url_resolves_without_connecting(no_ftp: list[tuple[str, int]]) -> None:
    location = resolve("ftp://user:secret@127.0.0.1:2121/data/run%201")
    store = location.store
    assert isinstance(store, FsspecStore)
    assert store.scheme == "ftp" and location.path == "/data/run 1"
    assert no_ftp == []  # nothing connected at resolve time
    # The same host and user: the same store; the URL it shows leaves the password out.
    assert resolve("ftp://user:secret@127.0.0.1:2121/other").store is store
    assert str(location) == "ftp://user@127.0.0.1:2121/data/run 1"
    assert resolve("ftp://127.0.0.1:2121/data").store is not store
    # First use connects (and the tripwire refuses it: an OSError naming the URL).
    with pytest.raises(OSError, match=re.escape("ftp://user@127.0.0.1:2121/")):
        store.stat(location.path)
    assert no_ftp == [("127.0.0.1", 2121)]


def test_fsspec_plus_scheme_names_fsspecs_own_filesystem() -> None:
    name = f"/savepoint-url-{uuid.uuid4().hex}"
    location = resolve(f"fsspec+memory:/{name}/ckpt")
    store = location.store
    assert isinstance(store, FsspecStore) and store.protocol == "memory"
    assert location.path == f"{name}/ckpt"
    assert str(location) == f"fsspec+memory:/{name}/ckpt"
    quiet(store)
    try:
        sp.save(str(location), state(7))
        same(sp.load(f"fsspec+memory:/{name}/ckpt"), state(7))
        assert resolve(str(location)).store is store
        assert fsspec.filesystem("memory").exists(f"{name}/ckpt")  # fsspec's memory, not ours
    finally:
        store.remove_tree(name)


@pytest.mark.parametrize("url", ["s3://bucket/x", "gs://bucket/x", "memory://x", "file:///tmp/x"])
@pytest.mark.parametrize("obstore", [True, False], ids=["obstore", "no-obstore"])
def test_savepoints_own_schemes_never_go_to_fsspec(
    url: str, obstore: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if obstore:
        pytest.importorskip("obstore")
    else:
        monkeypatch.setattr(paths, "_has_obstore", lambda: False)
    scheme = url.split(":")[0]
    if scheme in ("s3", "gs") and not obstore:  # refused naming its own extra, not fsspec
        with pytest.raises(UnsupportedStorageError, match=r"savepoint\[(s3|gcs)\]") as info:
            resolve(url)
        assert "fsspec" not in str(info.value)
        return
    assert not isinstance(resolve(url).store, FsspecStore)


def test_a_missing_implementation_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(
        known_implementations,
        "nosuchfs",
        {"class": "savepoint_no_such_module.FS", "err": "Install savepoint-no-such-package"},
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError) as info:
        resolve("nosuchfs://host/x", what="checkpoint path")
    text = str(info.value)
    assert "savepoint_no_such_module" in text and "Install savepoint-no-such-package" in text
    assert info.value.scheme == "nosuchfs" and "checkpoint path" in text
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("paramiko") is not None, reason="paramiko installed"
)
def test_sftp_without_paramiko_names_it() -> None:
    with pytest.raises(UnsupportedStorageError, match="paramiko") as info:
        resolve("sftp://host/x")
    assert info.value.scheme == "sftp"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("https://host/x", "read-only"),
        ("http://host/x", "read-only"),
        ("simplecache://x", "wrapper"),
        ("zip://x", "wrapper"),
    ],
)
def test_schemes_that_are_no_store_are_refused(url: str, words: str) -> None:
    with pytest.raises(UnsupportedStorageError, match=words) as info:
        resolve(url)
    assert "FsspecStore(fs).at(path)" in str(info.value)


def test_without_fsspec_the_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "_has_fsspec", lambda: False)
    for url in ("ftp://host/x", "hdfs://nn/x", "fsspec+memory://x"):
        with pytest.raises(UnsupportedStorageError, match=r"savepoint\[fsspec\]"):
            resolve(url)


def test_unknown_scheme_is_still_refused() -> None:
    with pytest.raises(UnsupportedStorageError, match="knows no such filesystem"):
        resolve("nosuchscheme-at-all://x")


def test_local_only_formats_refuse_fsspec_urls(no_ftp: list[tuple[str, int]]) -> None:
    with pytest.raises(UnsupportedStorageError, match="local files only"):
        local_path("ftp://127.0.0.1/x")
    assert no_ftp == []


def test_import_savepoint_does_not_import_fsspec() -> None:
    code = "import sys, savepoint; print('fsspec' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"


def test_a_refused_read_is_a_checkpoint_permission_error() -> None:
    """A filesystem that refuses to open a file (PermissionError, as s3fs or gcsfs say a 403):
    the load raises CheckpointPermissionError naming it, never a raw PermissionError."""

    class Refusing(MemoryFileSystem):  # type: ignore[misc]
        refuse = ""

        def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
            if "r" in mode and self.refuse and path.endswith(self.refuse):
                raise PermissionError(errno.EACCES, "Access Denied", path)
            return super()._open(path, mode, **kwargs)

    fs = Refusing(global_store=False, skip_instance_cache=True)
    ckpt = quiet(FsspecStore(fs)).at("/runs/ckpt")
    sp.save(ckpt, state(1))
    for name in ("manifest.json", ".safetensors"):
        fs.refuse = name
        with pytest.raises(CheckpointPermissionError) as info:
            sp.load(ckpt)
        assert name in str(info.value) and "permission denied" in str(info.value)
    fs.refuse = ""
    same(sp.load(ckpt), state(1))


def test_a_local_fsspec_url_names_its_absolute_path_again(tmp_path: Path) -> None:
    """``Store.url``'s promise: resolving the URL a store shows names the same store and path
    (for fsspec's local filesystem the path stays absolute: ``fsspec+file:///tmp/run``)."""
    location = resolve(f"fsspec+file://{tmp_path}/run")
    assert str(location) == f"fsspec+file://{tmp_path}/run"
    again = resolve(str(location))
    assert (again.store, again.path) == (location.store, str(tmp_path / "run"))
