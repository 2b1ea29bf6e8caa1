"""The staging arena behind async saves: isolation from training, reuse, layout, exit handling."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

import savepoint as sp
from _compare import same
from savepoint.async_ import staging
from savepoint.async_.staging import StagingArena
from savepoint.codecs import checksum
from savepoint.state import tree


def state_of(rng: np.random.Generator, scale: int = 1) -> dict:  # type: ignore[type-arg]
    return {
        "big": rng.standard_normal((256 * scale, 1024)).astype(np.float32),  # 1 MiB per scale
        "f64": rng.standard_normal((128, 128)),
        "strided": rng.standard_normal((200, 300)).astype(np.float32)[:, ::3],
        "ints": rng.integers(0, 2**62, size=1000, dtype=np.int64),
        "step": 0,
    }


def test_mutating_every_tensor_thousands_of_times_never_reaches_a_checkpoint(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(0)
    state = state_of(rng, scale=4)
    expected = {}
    mutations = 0
    with sp.AsyncCheckpointer() as ck:
        for i in range(30):
            state["step"] = i
            pending = ck.save(tmp_path / f"s{i:02d}", state)
            expected[i] = copy.deepcopy(state)
            # Hammer every tensor while the background write is (most likely) in flight.
            while not pending.done() or mutations < (i + 1) * 100:
                state["big"] += 1.0
                state["f64"] *= -1.0
                state["strided"][...] = mutations
                state["ints"] ^= 0x5555
                mutations += 1
    assert mutations >= 3000
    for i, want in expected.items():
        same(sp.load(tmp_path / f"s{i:02d}"), want)


def test_async_files_are_byte_identical_to_a_sync_save(tmp_path: Path) -> None:
    state = state_of(np.random.default_rng(1))
    sp.save(tmp_path / "sync", state, max_file_bytes=1 << 20)
    with sp.AsyncCheckpointer(max_file_bytes=1 << 20) as ck:
        ck.save(tmp_path / "async", state).wait()
    names = sorted(p.name for p in (tmp_path / "sync").iterdir() if p.name != "manifest.json")
    assert len(names) >= 2  # several files, each starting on its own 4 KiB boundary in the arena
    assert names == sorted(
        p.name for p in (tmp_path / "async").iterdir() if p.name != "manifest.json"
    )
    for name in names:
        assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "async" / name).read_bytes()
    a = sp.inspect(tmp_path / "sync")
    b = sp.verify(tmp_path / "async")
    assert [(t.key, t.ref, t.file) for t in a.tensors] == [
        (t.key, t.ref, t.file) for t in b.tensors
    ]


def test_arena_is_reused_and_grows_only_when_the_state_does() -> None:
    rng = np.random.default_rng(2)
    arena = StagingArena()
    small = tree.flatten(state_of(rng))
    arena.stage(small, 1 << 30)
    first, capacity = arena._keep, arena.capacity
    total = sum(s.nbytes for s in small.tensors.values())
    assert total <= capacity <= total + (2 << 20) + 4096 * 8  # the state's size, rounded
    for _ in range(3):
        arena.stage(tree.flatten(state_of(rng)), 1 << 30)
        assert arena._keep is first  # reused, not reallocated
    arena.stage(tree.flatten(state_of(rng, scale=8)), 1 << 30)
    assert arena._keep is not first and arena.capacity > capacity  # grown once...
    grown = arena._keep
    arena.stage(tree.flatten(state_of(rng, scale=8)), 1 << 30)
    arena.stage(tree.flatten(state_of(rng)), 1 << 30)
    assert arena._keep is grown  # ...and never shrunk


def test_arena_is_touched_at_allocation() -> None:
    statm = Path("/proc/self/statm")
    if not statm.exists():
        pytest.skip("no /proc on this platform")
    page = 4096

    def resident() -> int:
        return int(statm.read_text().split()[1]) * page

    arena = StagingArena()
    before = resident()
    arena._reserve(16 << 20, pinned=False)  # allocation alone, no copy into it yet
    # Every page is resident right after allocation: saves never pay first touches.
    assert resident() - before >= 15 << 20
    assert arena.capacity % page == 0


def test_host_tensors_are_hashed_as_they_are_staged() -> None:
    flat = tree.flatten(state_of(np.random.default_rng(3)))
    staged = StagingArena().stage(flat, 1 << 30)
    checks = staged.checks()
    images = {e.name: f.image[e.start : e.end] for f in staged.files for e in f.entries}
    assert set(checks) == {n for n, image in images.items() if len(image)}
    for name, digest in checks.items():
        assert digest == checksum.digest(images[name])  # the staged bytes' XXH3
    assert StagingArena().stage(flat, 1 << 30, hash_host=False).checks() == {}


def _jobs(*sizes: int) -> list:  # type: ignore[type-arg]
    # Views of any length over one byte: the split looks only at sizes.
    one = np.zeros(1, np.uint8)
    views = [np.lib.stride_tricks.as_strided(one, shape=(n,), strides=(0,)) for n in sizes]
    return [(f"t{i}", None, v) for i, v in enumerate(views)]


def test_only_tensors_that_would_leave_a_core_idle_are_copied_in_pieces_unhashed() -> None:
    MiB = 1 << 20

    def whole(jobs: list, workers: int = 2) -> set[str]:  # type: ignore[type-arg]
        units = staging._units(jobs, workers, hashed=True)
        names = {t[0] for unit in units for t in unit}
        assert sum(len(t[2]) for unit in units for t in unit) == sum(len(j[2]) for j in jobs)
        return {n for n in names if n is not None}

    # Equal big tensors (model and moments) spread evenly: all hashed while copied.
    assert whole(_jobs(*[164 * MiB] * 6)) == {f"t{i}" for i in range(6)}
    # One tensor dwarfing the rest would leave a core idle: it is cut, the rest stay whole.
    assert whole(_jobs(1024 * MiB, *[MiB] * 10)) == {f"t{i}" for i in range(1, 11)}
    assert whole(_jobs(100 * MiB, 60 * MiB, 60 * MiB)) == {"t0", "t1", "t2"}  # 100 | 120
    assert whole(_jobs(100 * MiB, 30 * MiB)) == {"t1"}
    assert whole(_jobs(100 * MiB, 30 * MiB), workers=1) == {"t0", "t1"}
    # Without hashing every tensor is cut into 16 MiB pieces, as before.
    units = staging._units(_jobs(100 * MiB, 3 * MiB), 2, hashed=False)
    assert {t[0] for unit in units for t in unit} == {None}
    assert max(len(t[2]) for unit in units for t in unit) == 16 * MiB


POISON = "0123456789abcdef"


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_the_writer_takes_the_digests_computed_while_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """The writer (thread or process) records the digests staging computed instead of hashing
    those tensors again: digests poisoned while staging reach the manifest; with
    HASH_WHILE_STAGING off the writer hashes everything and the poison has no effect."""
    state = state_of(np.random.default_rng(4))
    with sp.AsyncCheckpointer(writer=writer) as ck:  # type: ignore[arg-type]
        for name, hashing in (("poisoned", True), ("writer-hashed", False)):
            with monkeypatch.context() as m:  # (staging's hashing only, not the writer's)
                poisoned = types.SimpleNamespace(new=checksum.new, hexdigest=lambda _: POISON)
                m.setattr(staging, "checksum", poisoned)
                m.setattr(staging, "HASH_WHILE_STAGING", hashing)
                ck.save(tmp_path / name, state).wait()
    manifest = json.loads((tmp_path / "poisoned" / "manifest.json").read_text())
    assert manifest["tensors"]["big"]["xxh3"] == POISON
    with pytest.raises(sp.CorruptCheckpointError):
        sp.verify(tmp_path / "poisoned")
    sp.verify(tmp_path / "writer-hashed")
    same(sp.load(tmp_path / "writer-hashed"), state)


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_interpreter_exit_finishes_the_pending_save(tmp_path: Path) -> None:
    proc = _run(
        """
        import numpy as np, savepoint as sp
        ck = sp.AsyncCheckpointer()
        # several tensors: checksums then run on the thread pool, which the interpreter's
        # shutdown hook has already closed by the time the exit hook finishes the save
        ck.save("ckpt", {f"w{i}": np.arange(2 << 20, dtype=np.float32) + i for i in range(8)})
        # exit at once, without wait() or close()
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = sp.load(tmp_path / "ckpt")
    for i in range(8):
        assert np.array_equal(out[f"w{i}"], np.arange(2 << 20, dtype=np.float32) + i)


def test_a_failure_of_a_dropped_checkpointer_is_still_reported(tmp_path: Path) -> None:
    proc = _run(
        """
        import gc, time
        import numpy as np, savepoint as sp
        open("afile", "w").close()
        def fire_and_forget():
            sp.AsyncCheckpointer().save("afile/ckpt", {"w": np.zeros(4)})  # fails: parent is a file
        fire_and_forget()
        time.sleep(0.5)
        gc.collect()
        """,
        tmp_path,
    )
    assert "savepoint: a background save failed at exit" in proc.stderr


def test_a_save_failing_at_exit_is_reported_not_dropped(tmp_path: Path) -> None:
    proc = _run(
        """
        import numpy as np, savepoint as sp
        from savepoint.engine import save
        def fail(*args, **kwargs):
            raise OSError(28, "No space left on device")
        save.save_staged = fail
        ck = sp.AsyncCheckpointer(writer="thread")
        ck.save("ckpt", {"w": np.zeros(4)})
        """,
        tmp_path,
    )
    assert "savepoint: a background save failed at exit" in proc.stderr
    assert "No space left on device" in proc.stderr
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_sharded_save_is_staged_into_the_reused_arena(tmp_path: Path, writer: str) -> None:
    """A sharded save (``process_group=``) is copied into the checkpointer's one arena, reused by
    every save, by either writer (issue 27: the thread writer copied each tensor into fresh
    memory, one after another); what is saved is the state when ``save()`` returned, however
    the state is hammered while the save writes."""
    from _support import one_rank_world
    from savepoint.distributed import FlatShard

    rng = np.random.default_rng(3)
    local = rng.standard_normal(300_000).astype(np.float32)
    state = {"flat": FlatShard(local, (600, 500), 0), "rep": rng.standard_normal((64, 64))}
    expected = {}
    with (
        one_rank_world() as dist,
        sp.AsyncCheckpointer(
            process_group=dist.group.WORLD,
            writer=writer,  # type: ignore[arg-type]
        ) as ck,
    ):
        buffers = set()
        for i in range(4):
            pending = ck.save(tmp_path / f"s{i}", state)
            buffers.add(id(ck._arena._keep))
            assert ck._arena.capacity >= local.nbytes + state["rep"].nbytes
            expected[i] = {"flat": local.reshape(600, 500).copy(), "rep": state["rep"].copy()}
            while not pending.done():
                local += 1.0
                state["rep"] *= -1.0
            pending.wait()
            local += 1.0
    assert len(buffers) == 1  # one arena, reused: not a fresh copy per save
    for i, want in expected.items():
        same(sp.load(tmp_path / f"s{i}"), want)
