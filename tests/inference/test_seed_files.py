"""Seed 003's remaining API: its ``to_bytes``/``from_bytes`` encoding under names that do not
collide with savepoint's snapshot bytes, the file helpers (``save_json``/``load_json``/
``save_msgpack``/``load_msgpack``: atomic writes, non-blocking checked reads) and the metadata
builders (``with_description``/``with_model_id``/``with_tag``) that share the arrays."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from _privileges import call_unprivileged, workspace
from savepoint.codecs import kizzasi
from savepoint.commit import atomic
from savepoint.inference import InferenceSnapshot, SnapshotMetadata

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "kizzasi"
SAVE_LOAD = [
    (InferenceSnapshot.save_json, InferenceSnapshot.load_json),
    (InferenceSnapshot.save_msgpack, InferenceSnapshot.load_msgpack),
]
IDS = ["json", "msgpack"]


def _snapshot() -> InferenceSnapshot:
    rng = np.random.default_rng(0)
    return InferenceSnapshot(
        states=[
            rng.standard_normal((2, 3)).astype(np.float32),
            np.array([np.nan, -np.inf, 1.5], dtype=np.float64),
            np.array([[1, -2]], dtype=np.int64),
        ],
        history=[np.arange(3, dtype=np.float32), np.array([True, False])],
        step_count=9,
        config={"max_context": 8192, "store_history": True, "num_layers": 3},
        metadata={"timestamp": 1_700_000_000, "description": "d", "model_id": "m"},
    )


def _litter(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if atomic.TMP_TAG in p.name)


# -- the seed's to_bytes / from_bytes ---------------------------------------------------------


def test_seed_bytes_are_the_seeds_compact_json() -> None:
    golden = (GOLDEN / "seed_v1_compact.json").read_bytes()
    snap = InferenceSnapshot.from_seed_bytes(golden)
    assert snap.to_seed_bytes() == golden  # byte for byte what the seed's to_bytes gives
    assert snap == InferenceSnapshot.from_json(golden)
    assert InferenceSnapshot.from_seed_bytes(bytearray(golden)) == snap
    assert InferenceSnapshot.from_seed_bytes(memoryview(golden)) == snap
    # The module-level names are the seed's, on records.
    assert kizzasi.to_bytes(kizzasi.from_bytes(golden)) == golden


def test_seed_bytes_and_savepoint_bytes_do_not_collide() -> None:
    snap = _snapshot()
    seed, own = snap.to_seed_bytes(), snap.to_bytes()
    assert seed != own and seed == snap.to_json().encode("utf-8")
    assert InferenceSnapshot.from_seed_bytes(seed) == snap
    assert InferenceSnapshot.from_bytes(own) == snap
    # Each reader refuses the other's bytes with a CheckpointError, never a guess.
    with pytest.raises(sp.CorruptCheckpointError):
        InferenceSnapshot.from_seed_bytes(own)
    with pytest.raises(sp.CorruptCheckpointError, match="from_seed_bytes") as info:
        InferenceSnapshot.from_bytes(seed)
    assert "JSON" in str(info.value)  # names what the bytes are and what reads them
    with pytest.raises(sp.CorruptCheckpointError, match="from_seed_bytes"):
        InferenceSnapshot.from_bytes(b"\n  " + (GOLDEN / "seed_v1_compact.json").read_bytes())
    with pytest.raises(sp.CorruptCheckpointError, match="not a snapshot"):
        InferenceSnapshot.from_bytes(b"garbage garbage garbage")


def test_from_seed_bytes_refuses_text() -> None:
    with pytest.raises(TypeError):
        InferenceSnapshot.from_seed_bytes("{}")  # type: ignore[arg-type]


# -- files ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("save", "load"), SAVE_LOAD, ids=IDS)
def test_files_round_trip_exactly(save: Any, load: Any, tmp_path: Path) -> None:
    snap = _snapshot()
    path = tmp_path / "snap"
    assert save(snap, path) is None
    assert load(path, framework="numpy") == snap
    assert load(str(path)) == snap
    assert _litter(tmp_path) == []


def test_save_json_is_the_seeds_pretty_file(tmp_path: Path) -> None:
    snap = InferenceSnapshot.from_seed_bytes((GOLDEN / "seed_v1_compact.json").read_bytes())
    snap.save_json(tmp_path / "c.json")
    assert (tmp_path / "c.json").read_bytes() == (
        GOLDEN / "seed_v1_compact_pretty.json"
    ).read_bytes()
    snap.save_msgpack(tmp_path / "c.msgpack")
    # The seed's save_msgpack (rmp_serde::encode::write): structs as positional arrays.
    assert (tmp_path / "c.msgpack").read_bytes() == (
        GOLDEN / "seed_v1_positional.msgpack"
    ).read_bytes()


@pytest.mark.parametrize(
    ("name", "load"),
    [
        ("seed_v1_pretty.json", InferenceSnapshot.load_json),
        ("seed_v1_compact.json", InferenceSnapshot.load_json),
        ("seed_v1_positional.msgpack", InferenceSnapshot.load_msgpack),
        ("seed_v1_named.msgpack", InferenceSnapshot.load_msgpack),
    ],
)
def test_loads_the_seeds_files(name: str, load: Any) -> None:
    snap = load(GOLDEN / name)
    assert snap.version == 1 and snap.step_count >= 2


@pytest.mark.parametrize(("save", "load"), SAVE_LOAD, ids=IDS)
def test_save_replaces_atomically(
    save: Any, load: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure at the rename (after the temporary was written and fsynced) leaves the old
    file byte for byte, no temporary, and a CheckpointWriteError carrying the errno."""
    path = tmp_path / "snap"
    save(_snapshot(), path)
    before = path.read_bytes()

    def fail(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "injected I/O error", str(dst))

    monkeypatch.setattr(atomic.os, "replace", fail)
    with pytest.raises(sp.CheckpointWriteError) as info:
        save(_snapshot().with_description("new"), path)
    monkeypatch.undo()
    assert info.value.errno == errno.EIO
    assert path.read_bytes() == before
    assert _litter(tmp_path) == []
    assert load(path) == _snapshot()


@pytest.mark.parametrize(("save", "load"), SAVE_LOAD, ids=IDS)
def test_full_disk_is_a_write_error_with_enospc(
    save: Any, load: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the write of the temporary runs out of space (the same failure a full
    disk gives; a real full filesystem is exercised below where a tmpfs can be mounted)."""
    path = tmp_path / "snap"
    save(_snapshot(), path)
    before = path.read_bytes()
    real_write = os.write

    def full(fd: int, data: Any) -> int:
        if atomic.TMP_TAG in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(sp.CheckpointWriteError) as info:
        save(_snapshot().with_tag("x"), path)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert "free disk space" in str(info.value)
    assert path.read_bytes() == before and _litter(tmp_path) == []


@pytest.mark.parametrize(("save", "load"), SAVE_LOAD, ids=IDS)
def test_full_tmpfs_is_a_write_error_with_enospc(save: Any, load: Any, tmp_path: Path) -> None:
    from faults import _tmpfs

    why = _tmpfs.mount_problem()
    if why is not None:
        pytest.skip(f"cannot mount a tmpfs here ({why}); the injection test above covers it")
    with _tmpfs.mounted(tmp_path / "fs", 1 << 20) as fs:
        path = fs.root / "snap"
        save(_snapshot(), path)
        before = path.read_bytes()
        fs.set_free(0)
        with pytest.raises(sp.CheckpointWriteError) as info:
            save(_snapshot().with_tag("x"), path)
        assert info.value.errno == errno.ENOSPC
        assert path.read_bytes() == before
        assert _litter(fs.root) == []
        fs.release()
        assert load(path) == _snapshot()


@pytest.mark.parametrize(("save", "load"), SAVE_LOAD, ids=IDS)
def test_save_into_a_missing_directory_is_a_write_error(
    save: Any, load: Any, tmp_path: Path
) -> None:
    with pytest.raises(sp.CheckpointWriteError) as info:
        save(_snapshot(), tmp_path / "missing" / "snap")
    assert info.value.errno == errno.ENOENT


@pytest.mark.parametrize(("save", "load"), SAVE_LOAD, ids=IDS)
def test_load_refuses_what_is_not_a_regular_file(save: Any, load: Any, tmp_path: Path) -> None:
    with pytest.raises(sp.CheckpointNotFoundError):
        load(tmp_path / "missing")
    with pytest.raises(sp.CorruptCheckpointError):
        load(tmp_path)  # a directory
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            load(fifo)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock it before failing, so the test run does not hang
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("loading a FIFO blocked")
    assert isinstance(outcome[0], sp.CorruptCheckpointError)


@pytest.mark.parametrize(("save", "load"), SAVE_LOAD, ids=IDS)
def test_load_follows_a_symlink_the_user_names(save: Any, load: Any, tmp_path: Path) -> None:
    save(_snapshot(), tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert load(tmp_path / "link") == _snapshot()


@pytest.mark.parametrize(("save", "load"), SAVE_LOAD, ids=IDS)
def test_load_of_garbage_is_corrupt(save: Any, load: Any, tmp_path: Path) -> None:
    for data in (b"", b"\xff" * 7, b"[" * 100_000, b'{"version":1}'):
        (tmp_path / "bad").write_bytes(data)
        with pytest.raises(sp.CorruptCheckpointError):
            load(tmp_path / "bad")


def _load_unreadable(kind: str, path: str) -> None:
    (InferenceSnapshot.load_json if kind == "json" else InferenceSnapshot.load_msgpack)(path)


@pytest.mark.parametrize(("save", "load"), SAVE_LOAD, ids=IDS)
def test_unreadable_file_is_a_permission_error(save: Any, load: Any) -> None:
    with workspace() as root:
        path = root / "snap"
        save(_snapshot(), path)
        os.chmod(path, 0o200)  # write-only: nobody else may read it
        kind = "json" if load == InferenceSnapshot.load_json else "msgpack"
        outcome = call_unprivileged(_load_unreadable, kind, str(path))
    assert outcome.raised(sp.CheckpointPermissionError), str(outcome)
    assert outcome.raised(PermissionError) and outcome.errno == errno.EACCES


# -- metadata builders -------------------------------------------------------------------------


def test_builders_share_the_arrays() -> None:
    snap = _snapshot()
    built = snap.with_description("rollback point").with_model_id("mamba").with_tag("v1")
    built = built.with_tag("v2")
    assert built.metadata == SnapshotMetadata(
        1_700_000_000, "rollback point", "mamba", ("v1", "v2")
    )
    assert snap.metadata == SnapshotMetadata(1_700_000_000, "d", "m", ())  # unchanged
    assert built.step_count == snap.step_count and built.config == snap.config
    assert len(built.states) == len(snap.states) and len(built.history) == len(snap.history)
    for new, old in zip(built.states + built.history, snap.states + snap.history):
        assert new is old and np.shares_memory(new, old)
        assert not new.flags.writeable
    assert built != snap and built.with_metadata(snap.metadata) == snap


def test_builders_share_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    snap = InferenceSnapshot(states=[torch.ones(2, 3)], history=[torch.arange(3)])
    built = snap.with_model_id("m")
    assert built.states[0].data_ptr() == snap.states[0].data_ptr()
    assert built.history[0].data_ptr() == snap.history[0].data_ptr()


def test_builders_check_their_arguments() -> None:
    snap = _snapshot()
    for bad in (
        lambda: snap.with_description(3),
        lambda: snap.with_model_id(None),
        lambda: snap.with_tag(b"x"),
        lambda: snap.with_tag("\udc80"),  # a lone surrogate no encoding can write
    ):
        with pytest.raises(sp.UnsupportedStateError):
            bad()


def test_a_built_snapshot_is_never_refilled_by_a_history() -> None:
    """A history reuses the buffers of a snapshot only it can see; a snapshot made by a builder
    shares arrays with one the caller holds, so its buffers must never be handed back."""
    live = [np.zeros((2, 2), np.float32)]
    history = sp.SnapshotHistory(1)
    history.take(states=live, step_count=1)
    first = history.latest()
    assert first is not None
    tagged = first.with_tag("kept")
    history.push(tagged)
    live[0][...] = 7
    history.take(states=live, step_count=2)
    assert float(first.states[0].sum()) == 0 and float(tagged.states[0].sum()) == 0
