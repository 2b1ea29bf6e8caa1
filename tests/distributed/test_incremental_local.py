"""Sharded incremental saves (``blobs=`` with sharded state) within one process.

``save_ranks`` runs the real sharded save (:mod:`savepoint.distributed.save`, every step) on N
threads of this process, one per rank, joined by :class:`ThreadGroup`, a coordinator with the
protocol of the torch one (local parts, rank 0 combines, one answer or one error for all), so
the session ordering, the failures and the loads are tested fast; ``test_incremental_sessions``
runs the same on real gloo process groups.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.blobs import BlobPolicy, BlobStore, SaveSession
from savepoint.codecs import manifest as mf
from savepoint.distributed import FlatShard, Partitioned, Shard, collectives
from savepoint.distributed import save as dsave
from savepoint.errors import DistributedCheckpointError

# Chunks only: these tests count the chunks a save writes (row patches: see the end).
POLICY = BlobPolicy(chunk_size=4096, min_blob_bytes=4096, workers=1, patches=False)
ROWS = 96  # rows of E, 512 bytes each: a 4 KiB chunk holds 8 rows
E = np.arange(ROWS * 128, dtype=np.float32).reshape(ROWS, 128) / 7
C = (np.arange(40 * 64, dtype=np.float64).reshape(40, 64) * 1.5) % 17
F = np.sin(np.arange(3000, dtype=np.float64))
R = np.arange(32 * 64, dtype=np.float32).reshape(32, 64) - 5
B = np.arange(10, dtype=np.float32)  # small: stays in a data file
M = np.arange(9 * 128, dtype=np.float32).reshape(9, 128) * 3  # shards on both sides of 4 KiB
Z = {f"p{i}": np.full((40, 32), i + 0.5, dtype=np.float32) for i in range(3)}


def tensors(version: int = 1) -> dict[str, Any]:
    """The whole tensors of save ``version``: each version changes rows 2-3 of E by one more."""
    e = E.copy()
    e[2:4] += version - 1
    return {"emb": e, "cols": C, "flat": F, "rep": R, "bias": B, "mixed": M, "zero": Z}


def rank_state(rank: int, world: int, version: int = 1, empty: bool = False) -> dict[str, Any]:
    g = tensors(version)

    def fill(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return np.zeros_like(a) if empty else a.copy()

    a, b = FlatShard.bounds(ROWS, rank, world)
    ca, cb = FlatShard.bounds(64, rank, world)
    fa, fb = FlatShard.bounds(F.size, rank, world)
    # "mixed": rank 0 holds rows 0-7 (4 KiB: a blob), rank 1 row 8 (512 bytes: a data file), the
    # others nothing; alone, rank 0 holds all 9 rows.
    ma, mb = (0, 9) if world == 1 else {0: (0, 8), 1: (8, 9)}.get(rank, (9, 9))
    return {
        "emb": Shard.split(fill(g["emb"][a:b]), 0, rank, world, size=ROWS),
        "cols": Shard(fill(np.ascontiguousarray(C[:, ca:cb])), C.shape, (0, ca)),
        "flat": FlatShard(fill(F[fa:fb]), F.shape, fa),
        "rep": fill(R),
        "bias": fill(B),
        "mixed": Shard(fill(M[ma:mb]), M.shape, (ma, 0)),
        "zero": Partitioned(
            {k: fill(v) for i, (k, v) in enumerate(Z.items()) if i % world == rank}
        ),
        "version": 0 if empty else version,
    }


def check(st: dict[str, Any], rank: int, world: int, version: int = 1) -> None:
    want = rank_state(rank, world, version)
    for key in ("emb", "cols", "flat", "mixed"):
        np.testing.assert_array_equal(st[key].local, want[key].local, err_msg=key)
    np.testing.assert_array_equal(st["rep"], R)
    np.testing.assert_array_equal(st["bias"], B)
    assert set(st["zero"].mapping) == set(want["zero"].mapping)
    for k, v in st["zero"].mapping.items():
        np.testing.assert_array_equal(v, Z[k])
    assert st["version"] == version


# -- N ranks as threads of this process --------------------------------------------------------


class ThreadGroup:
    """The ranks of one simulated process group: threads meeting at a barrier each step."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[Any] = [None] * world
        self.answer: Any = None
        self.local = threading.local()


class ThreadCoordinator(collectives.Coordinator):
    """:class:`~savepoint.distributed.collectives.Coordinator` of one thread of a
    :class:`ThreadGroup`: the protocol of the torch coordinator, without torch."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world

    def exclusive(self) -> Any:
        return contextlib.nullcontext()

    def step(
        self,
        what: str,
        path: str,
        local: Callable[[], Any],
        combine: Callable[[list[Any]], Any] | None = None,
        *,
        each: bool = False,
        cleanup: Callable[[], None] | None = None,
        phase: str | None = None,
        combine_phase: str | None = None,
    ) -> Any:
        g = self.group
        try:
            g.slots[self.rank] = (True, local())
        except Exception as exc:
            g.slots[self.rank] = (False, f"{type(exc).__name__}: {exc}")
        g.barrier.wait()
        if self.rank == 0:
            errors = {r: v for r, (ok, v) in enumerate(g.slots) if not ok}
            if not errors and combine is not None:
                try:
                    g.answer = combine([v for _, v in g.slots])
                except Exception as exc:
                    errors = {0: f"{type(exc).__name__}: {exc}"}
            elif not errors:
                g.answer = [None] * g.world if each else None
            if errors:
                if cleanup is not None:
                    cleanup()
                g.answer = errors
        g.barrier.wait()
        answer = g.answer
        g.barrier.wait()  # everyone has read it before the next step writes
        if isinstance(answer, dict):
            raise DistributedCheckpointError(
                f"{what} {path} failed: {answer}", path=path, errors=answer
            )
        return answer[self.rank] if each else answer


@contextlib.contextmanager
def threads_as_ranks(monkeypatch: pytest.MonkeyPatch, world: int) -> Iterator[ThreadGroup]:
    group = ThreadGroup(world)

    def coordinator(process_group: Any, timeout: Any) -> collectives.Coordinator:
        rank = getattr(group.local, "rank", None)
        if rank is None:  # a load, say: one process
            return collectives.LocalCoordinator()
        return ThreadCoordinator(group, rank)

    monkeypatch.setattr(collectives, "coordinator", coordinator)
    yield group


def on_ranks(group: ThreadGroup, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` on every rank's thread; each result, or the exception it raised."""
    results: list[Any] = [None] * group.world

    def run(rank: int) -> None:
        group.local.rank = rank
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # handed back to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(group.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def save_ranks(
    monkeypatch: pytest.MonkeyPatch,
    path: Path,
    world: int,
    version: int = 1,
    blobs: Callable[[int], Any] | None = None,
) -> list[Any]:
    with threads_as_ranks(monkeypatch, world) as group:
        return on_ranks(
            group,
            lambda r: sp.save(
                path,
                rank_state(r, world, version),
                blobs=blobs(r) if blobs else path.parent / "blobs",
                blob_policy=POLICY,
            ),
        )


def blob_files(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / "data").glob("*/*")}


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ckpt"
    results = save_ranks(monkeypatch, path, 3)
    assert all(isinstance(r, sp.CheckpointInfo) for r in results), results
    return path


# -- tests -------------------------------------------------------------------------------------


def test_the_manifest_names_a_recipe_per_large_shard(saved: Path) -> None:
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["format_version"] == 4 and manifest["world_size"] == 3
    assert manifest["blob_store"] == "../blobs" and manifest["blob_digest"] == "blake3"
    emb = manifest["tensors"]["emb"]["shards"]
    assert [s["box"] for s in emb] == [
        [[0, 32], [0, 128]],
        [[32, 64], [0, 128]],
        [[64, 96], [0, 128]],
    ]
    assert all(set(s) == {"xxh3", "box", "blobs"} for s in emb)
    assert [len(s["blobs"]["blobs"]) for s in emb] == [4, 4, 4]  # 16 KiB each, 4 KiB chunks
    assert set(manifest["tensors"]["bias"]["shards"][0]) == {"file", "offsets", "xxh3", "box"}
    assert len(manifest["tensors"]["rep"]["shards"]) == 1  # replicated: one writer
    mixed = manifest["tensors"]["mixed"]["shards"]
    assert ["blobs" in s for s in mixed] == [True, False]  # 4 KiB in blobs, 512 bytes in a file
    # Only "bias" and a row of "mixed" are in data files; every rank's session is closed.
    data = sum(f["size"] - f["header_size"] for f in manifest["files"].values())
    assert data == B.nbytes + M[8].nbytes
    assert list((saved.parent / "blobs" / "sessions").iterdir()) == []
    parsed = mf.parse((saved / "manifest.json").read_bytes())
    assert parsed.sharded and parsed.has_blobs and parsed.world_size == 3
    # emb, cols, flat, rep, mixed, zero
    assert sum(1 for _ in mf.recipes(parsed)) == 3 + 3 + 3 + 1 + 1 + 3


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_reshard_into_any_layout(saved: Path, world: int) -> None:
    for rank in range(world):
        st = rank_state(rank, world, empty=True)
        assert sp.load(saved, into=st) is st
        check(st, rank, world)
        st = rank_state(rank, world, empty=True)
        sp.load(saved, into=st, verify="first")
        check(st, rank, world)
        st = rank_state(rank, world, empty=True)
        sp.load(saved, into=st, verify=False)
        check(st, rank, world)


def test_whole_load_verify_inspect_consolidate(saved: Path, tmp_path: Path) -> None:
    out = sp.load(saved)
    for key, value in tensors().items():
        if key != "zero":
            np.testing.assert_array_equal(out[key], value, err_msg=key)
    assert {k: v.tolist() for k, v in out["zero"].items()} == {k: v.tolist() for k, v in Z.items()}
    mapped = sp.load(saved, mmap=True, keys=["emb", "bias"])
    np.testing.assert_array_equal(mapped["emb"], E)
    info = sp.verify(saved)
    assert info.format_version == 4 and info.world_size == 3
    shards = {t.key: t.shards for t in sp.inspect(saved).tensors}
    assert shards["emb"] == 3 and shards["rep"] == 1 and shards["zero/p0"] == 1
    from savepoint.distributed import consolidate

    consolidate.consolidate(saved, tmp_path / "whole")
    whole = sp.load(tmp_path / "whole")
    np.testing.assert_array_equal(whole["emb"], E)
    np.testing.assert_array_equal(whole["flat"], F)
    assert sp.inspect(tmp_path / "whole").format_version == 1


def test_copy_next_to_itself_and_convert(saved: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    sp.copy(saved, tmp_path / "sibling")  # the same blob store, at the same relative place
    np.testing.assert_array_equal(sp.load(tmp_path / "sibling")["emb"], E)
    sp.copy(saved, tmp_path / "far" / "away" / "ckpt")  # its blobs go to far/away/blobs
    np.testing.assert_array_equal(sp.load(tmp_path / "far" / "away" / "ckpt")["emb"], E)
    assert (tmp_path / "far" / "away" / "blobs" / "store.json").is_file()
    sp.convert(saved, tmp_path / "out.safetensors", lossy=True)
    out = load_file(str(tmp_path / "out.safetensors"))
    assert out["emb"].tobytes() == E.tobytes() and out["flat"].tobytes() == F.tobytes()


def test_a_second_save_writes_only_the_changed_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_ranks(monkeypatch, tmp_path / "v1", 2)
    before = blob_files(tmp_path / "blobs")
    assert len(before) == 12 + 6 + 6 + 2 + 1 + 6, len(before)  # emb, cols, flat, rep, mixed, zero
    results = save_ranks(monkeypatch, tmp_path / "v2", 2, version=2)
    assert all(isinstance(r, sp.CheckpointInfo) for r in results), results
    new = {d: n for d, n in blob_files(tmp_path / "blobs").items() if d not in before}
    assert list(new.values()) == [4096 + 32]  # rows 2-3 of E: chunk 0 of rank 0's shard
    st = rank_state(0, 1, empty=True)
    sp.load(tmp_path / "v2", into=st)
    check(st, 0, 1, version=2)
    sp.load(tmp_path / "v1", into=st)
    check(st, 0, 1, version=1)


def test_rank_0_returns_after_every_session_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_close = SaveSession.close
    closed: list[float] = []

    def slow_close(self: SaveSession) -> None:
        if getattr(threading.current_thread(), "slow", False) and self._open:
            time.sleep(0.2)
        real_close(self)
        closed.append(time.monotonic())

    monkeypatch.setattr(SaveSession, "close", slow_close)
    sessions = tmp_path / "blobs" / "sessions"
    seen: dict[int, list[str]] = {}

    def save(rank: int) -> None:
        threading.current_thread().slow = rank == 2  # type: ignore[attr-defined]
        sp.save(
            tmp_path / "ckpt", rank_state(rank, 3), blobs=tmp_path / "blobs", blob_policy=POLICY
        )
        if rank == 0:
            seen[rank] = sorted(p.name for p in sessions.iterdir())

    with threads_as_ranks(monkeypatch, 3) as group:
        results = on_ranks(group, save)
    assert results == [None, None, None], results
    assert seen == {0: []}  # rank 2 was slow to close, yet rank 0 found no session open
    assert len(closed) == 3


def test_a_failure_on_one_rank_commits_nothing_and_closes_every_session(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = dsave.put_pieces

    def failing(*args: Any, **kwargs: Any) -> Any:
        if getattr(group.local, "rank", None) == 1:
            raise OSError(5, "injected blob write failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(dsave, "put_pieces", failing)
    with threads_as_ranks(monkeypatch, 3) as group:
        results = on_ranks(
            group,
            lambda r: sp.save(
                saved, rank_state(r, 3, 2), blobs=saved.parent / "blobs", blob_policy=POLICY
            ),
        )
    assert all(isinstance(r, DistributedCheckpointError) for r in results), results
    assert "injected blob write failure" in str(results[0])
    assert list((saved.parent / "blobs" / "sessions").iterdir()) == []
    assert sorted(p.name for p in saved.parent.iterdir()) == ["blobs", "ckpt"]  # no staging
    st = rank_state(0, 1, empty=True)
    sp.load(saved, into=st)
    check(st, 0, 1, version=1)  # the previous checkpoint


def test_ranks_naming_different_blob_stores_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = save_ranks(monkeypatch, tmp_path / "ckpt", 2, blobs=lambda r: tmp_path / f"blobs-{r}")
    assert all(isinstance(r, DistributedCheckpointError) for r in results), results
    assert "different blob stores" in str(results[0])
    assert not (tmp_path / "ckpt").exists()
    for r in (0, 1):
        assert list((tmp_path / f"blobs-{r}" / "sessions").iterdir()) == []


def test_a_blob_store_out_of_reach_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = save_ranks(
        monkeypatch, tmp_path / "a" / "b" / "c" / "ckpt", 2, blobs=lambda r: tmp_path / "blobs"
    )
    assert all(isinstance(r, DistributedCheckpointError) for r in results), results
    assert "at most 2 levels above" in str(results[0])


def _blob_of(path: Path, key: str, shard: int, chunk: int) -> Path:
    manifest = json.loads((path / "manifest.json").read_text())
    digest = manifest["tensors"][key]["shards"][shard]["blobs"]["blobs"][chunk]
    return path.parent / "blobs" / "data" / digest[:2] / digest


def test_a_damaged_blob_is_caught_by_whoever_reads_it(saved: Path) -> None:
    blob = _blob_of(saved, "emb", 1, 2)  # rows 48-55
    raw = bytearray(blob.read_bytes())
    raw[32 + 100] ^= 0x40
    blob.chmod(0o644)
    blob.write_bytes(bytes(raw))
    touching = {"emb": Shard(np.zeros((4, 128), np.float32), E.shape, (50, 0))}
    with pytest.raises(
        sp.CorruptCheckpointError, match=r"'emb' \(shard 2 of 3, \[32:64, 0:128\] in blobs\)"
    ):
        sp.load(saved, into=touching)
    with pytest.raises(sp.CorruptCheckpointError, match="emb"):
        sp.load(saved)
    with pytest.raises(sp.CorruptCheckpointError, match="emb"):
        sp.verify(saved)
    first = {"emb": Shard(np.zeros((16, 128), np.float32), E.shape, (40, 0))}
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(saved, into=first, verify="first")
    assert not first["emb"].local.any()  # nothing modified
    # Chunks that are intact are read and checked alone: rows 32-47 and 56-95 load.
    for start, stop in ((32, 48), (56, 96)):
        part = {"emb": Shard(np.zeros((stop - start, 128), np.float32), E.shape, (start, 0))}
        sp.load(saved, into=part)
        np.testing.assert_array_equal(part["emb"].local, E[start:stop])


def test_a_missing_blob_is_a_clear_error(saved: Path) -> None:
    _blob_of(saved, "flat", 2, 0).unlink()
    with pytest.raises(sp.CorruptCheckpointError, match=r"'flat'.*in blobs"):
        sp.load(saved, into={"flat": FlatShard(np.zeros(100), F.shape, 2500)})
    with pytest.raises(sp.CorruptCheckpointError, match="flat"):
        sp.verify(saved)


def test_a_part_of_a_shard_reads_only_the_chunks_holding_it(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[int] = []
    real_read, real_range = BlobStore.read, BlobStore.read_range

    def counting_read(self: BlobStore, digest: str, **kw: Any) -> Any:
        out = real_read(self, digest, **kw)
        read.append(len(out))
        return out

    def counting_range(self: BlobStore, digest: str, start: int, end: int, **kw: Any) -> Any:
        read.append(end - start)
        return real_range(self, digest, start, end, **kw)

    monkeypatch.setattr(BlobStore, "read", counting_read)
    monkeypatch.setattr(BlobStore, "read_range", counting_range)
    part = {"emb": Shard(np.zeros((3, 128), np.float32), E.shape, (41, 0))}  # in one chunk
    sp.load(saved, into=part)
    assert read == [4096], read  # its chunk, whole, to check it
    np.testing.assert_array_equal(part["emb"].local, E[41:44])
    read.clear()
    sp.load(saved, into=part, verify=False)
    assert read == [3 * 512], read  # unchecked: only its bytes


def test_hostile_blob_shards_are_refused(saved: Path) -> None:
    good = json.loads((saved / "manifest.json").read_text())

    def parse(edit: Callable[[dict[str, Any]], Any]) -> None:
        from savepoint.codecs import checksum

        doc = json.loads(json.dumps(good))
        doc.pop("manifest_xxh3")
        edit(doc)
        body = json.dumps(doc, indent=1)
        text = body[: -len("\n}")].encode()
        mf.parse(text + f',\n "manifest_xxh3": "{checksum.digest(text)}"\n}}\n'.encode())

    parse(lambda d: None)  # the helper writes what the parser reads

    def shard(d: dict[str, Any]) -> dict[str, Any]:
        return d["tensors"]["emb"]["shards"][1]  # type: ignore[no-any-return]

    cases: list[tuple[Callable[[dict[str, Any]], Any], str]] = [
        (lambda d: shard(d).update(box=[[32, 63], [0, 128]]), "blobs hold 16384 bytes"),
        (lambda d: shard(d).update(xxh3="0" * 16), "does not match its blobs' checks"),
        (lambda d: shard(d).update(file="data-r00000-00000.safetensors"), "blob shard must have"),
        (lambda d: shard(d).pop("box"), "blob shard must have"),
        (lambda d: d.update(format_version=3), "entry must have file, offsets"),
        (lambda d: shard(d)["blobs"].update(digest="xxh3-128"), "tensor 'emb' shard 1"),
        (lambda d: d.update(world_size=0), "world_size must be"),
        (lambda d: d["tensors"]["emb"]["shards"].pop(2), "do not tile"),
    ]
    for edit, words in cases:
        with pytest.raises(mf.ManifestError, match=words):
            parse(edit)


def test_manager_with_sharded_state_and_blobs_keeps_referenced_blobs(tmp_path: Path) -> None:
    """A one-process manager saving a state of Shards (a one-rank sharded save): retention
    and collection count the shards' recipes."""
    run = tmp_path / "run"
    with sp.CheckpointManager(run, incremental=True, blob_policy=POLICY, keep_last=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, rank_state(0, 1, step))
    manifest = mf.parse((run / "latest" / "manifest.json").read_bytes())
    assert manifest.world_size == 1
    wanted = {d for r in mf.recipes(manifest) for d in r.names()}
    assert set(blob_files(run / "blobs")) == wanted
    st = rank_state(0, 1, empty=True)
    sp.load(run / "latest", into=st)
    check(st, 0, 1, version=3)


def test_verify_checks_every_blob_against_its_name(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[int] = []
    real = BlobStore.verify_recipe

    def counting(self: BlobStore, recipe: Any) -> None:
        checked.append(len(recipe.digests))
        real(self, recipe)

    monkeypatch.setattr(BlobStore, "verify_recipe", counting)
    sp.verify(saved)
    manifest = mf.parse((saved / "manifest.json").read_bytes())
    assert sorted(checked) == sorted(len(r.digests) for r in mf.recipes(manifest))
    assert sum(checked) == 12 + 6 + 6 + 2 + 1 + 6


def test_ranks_on_an_object_like_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rename: the manifest is a create-only put, blobs appear whole when their upload
    completes; loads read byte ranges of blobs (no zero-copy views of object stores)."""
    from savepoint.storage.memory import MemoryStore

    store = MemoryStore(atomic_rename=False)
    blobs = BlobStore(store, "/run/blobs")
    for version in (1, 2):
        with threads_as_ranks(monkeypatch, 3) as group:
            results = on_ranks(
                group,
                lambda r, v=version: sp.save(  # type: ignore[misc]
                    store.at(f"/run/v{v}"), rank_state(r, 3, v), blobs=blobs, blob_policy=POLICY
                ),
            )
        assert all(isinstance(r, sp.CheckpointInfo) for r in results), results
    assert store.list("/run/blobs/sessions") == []
    for version in (1, 2):
        for rank in range(2):
            st = rank_state(rank, 2, empty=True)
            sp.load(store.at(f"/run/v{version}"), into=st)
            check(st, rank, 2, version)
        sp.verify(store.at(f"/run/v{version}"))


def test_a_collection_between_the_puts_and_the_commit_deletes_nothing(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process collects after every rank has put its blobs and before rank 0 commits
    the manifest naming them (the moment a save is most exposed): every rank's session is still
    open, so the collection defers; once the save has returned, a collection keeps every blob
    the new checkpoint names and frees the old checkpoint's."""
    root = saved.parent / "blobs"
    outsider = BlobStore.open(root)  # another process's view of the store

    def committed() -> set[str]:
        return {
            d
            for path in saved.parent.iterdir()
            if (path / "manifest.json").exists()
            for r in mf.recipes(mf.parse((path / "manifest.json").read_bytes()))
            for d in r.names()
        }

    reports: list[Any] = []
    real_commit = dsave._Save.commit

    def commit(self: Any, results: Any) -> Any:
        reports.append(outsider.collect(committed, grace=0))
        return real_commit(self, results)

    monkeypatch.setattr(dsave._Save, "commit", commit)
    results = save_ranks(monkeypatch, saved.parent / "v2", 3, version=5)
    assert all(isinstance(r, sp.CheckpointInfo) for r in results), results
    (report,) = reports
    assert report.deferred and len(report.live_sessions) == 3 and not report.deleted
    st = rank_state(0, 1, empty=True)
    sp.load(saved.parent / "v2", into=st)
    check(st, 0, 1, version=5)
    # With the first checkpoint deleted, a collection frees its chunks of E (rows 2-3 changed)
    # and nothing the second names.
    import shutil

    shutil.rmtree(saved)
    after = outsider.collect(committed, grace=0)
    assert not after.deferred and len(after.deleted) == 1, after
    assert set(blob_files(root)) == committed()
    sp.verify(saved.parent / "v2")


def test_materialize_writes_the_shards_as_plain_data(saved: Path, tmp_path: Path) -> None:
    sp.copy(saved, tmp_path / "plain", materialize=True)
    assert sp.verify(tmp_path / "plain").format_version < 4
    out = sp.load(tmp_path / "plain")
    np.testing.assert_array_equal(out["emb"], E)
    np.testing.assert_array_equal(out["flat"], F)


# -- row patches of sharded pieces ------------------------------------------------------------

PATCHING = BlobPolicy(chunk_size=4096, min_blob_bytes=4096, workers=1)


def test_a_manager_patches_the_changed_rows_of_sharded_pieces(tmp_path: Path) -> None:
    """A one-process manager saving Shards with row patches on (the default policy): rows 2-3
    of "emb" change at every save, so from the second save on its piece is its first recipe
    plus a patch (a version 5 manifest); retention keeps the patch blobs and their base."""
    run = tmp_path / "run"
    with sp.CheckpointManager(run, incremental=True, blob_policy=PATCHING, keep_last=2) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, rank_state(0, 1, step))
    manifest = mf.parse((run / "latest" / "manifest.json").read_bytes())
    assert manifest.format_version == mf.PATCHES and manifest.world_size == 1
    emb = [s.recipe for s in manifest.tensors["emb"].shards] or [manifest.tensors["emb"].recipe]
    assert [len(r.patches) for r in emb] == [3]
    assert all(p.count == 2 for p in emb[0].patches)  # rows 2 and 3, one 512-byte block each
    wanted = {d for r in mf.recipes(manifest) for d in r.names()}
    for step in (3,):
        m = mf.parse((run / "checkpoints" / f"step-{step:010d}" / "manifest.json").read_bytes())
        wanted |= {d for r in mf.recipes(m) for d in r.names()}
    assert set(blob_files(run / "blobs")) == wanted
    for world in (1, 2, 3):
        for rank in range(world):
            st = rank_state(rank, world, empty=True)
            sp.load(run / "latest", into=st)
            check(st, rank, world, version=4)
    sp.verify(run / "latest")


def test_ranks_patch_their_own_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks (threads), each with its own tracker as each process has: the second save
    patches each rank's piece of "emb"; loads on 1 and 3 ranks are bit-exact."""
    from savepoint.blobs import FastMemo
    from savepoint.blobs.patch import PatchTracker
    from savepoint.checkpoint import DEFAULT_MAX_FILE_BYTES, save_incremental

    memos = [FastMemo(), FastMemo()]
    trackers = [PatchTracker(), PatchTracker()]
    blobs = tmp_path / "blobs"
    for version in (1, 2):
        with threads_as_ranks(monkeypatch, 2) as group:
            results = on_ranks(
                group,
                lambda r: save_incremental(
                    tmp_path / f"v{version}",  # noqa: B023
                    rank_state(r, 2, version),  # noqa: B023
                    None,
                    blobs,
                    PATCHING,
                    DEFAULT_MAX_FILE_BYTES,
                    1,
                    False,
                    None,
                    memo=memos[r],
                    tracker=trackers[r],
                ),
            )
        assert all(isinstance(r, sp.CheckpointInfo) for r in results), results
    m = mf.parse((tmp_path / "v2" / "manifest.json").read_bytes())
    assert m.format_version == mf.PATCHES
    pieces = m.tensors["emb"].shards
    assert [len(s.recipe.patches) for s in pieces] == [1, 0]  # rows 2-3 are rank 0's
    for world in (1, 3):
        for rank in range(world):
            st = rank_state(rank, world, empty=True)
            sp.load(tmp_path / "v2", into=st)
            check(st, rank, world, version=2)
    sp.verify(tmp_path / "v2")


def test_a_tier_keeps_the_blobs_of_the_sharded_checkpoints_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tier retention counts the blobs of every shard (a tensor of several shards has no recipe
    of its own): after keep=1 deleted step 1 there, step 2 still verifies and loads."""
    from savepoint.runs import layout
    from savepoint.runs.tiers import Tier, TierCopier

    home = tmp_path / "home"
    for version in (1, 2):
        path = Path(layout.step_path(home, version))
        results = save_ranks(monkeypatch, path, 2, version=version, blobs=lambda r: home / "blobs")
        assert all(isinstance(r, sp.CheckpointInfo) for r in results), results
    tier = tmp_path / "tier"
    copier = TierCopier([Tier(str(tier), keep=1)], {"name": "t", "created": "2026-11-27T00:00Z"})
    for step in (1, 2):
        copier.submit(step, layout.step_path(home, step))
        copier.wait()
        copier.raise_error()
    copier.close()
    assert layout.committed_steps(tier) == [2]
    sp.verify(layout.step_path(tier, 2))
    for rank in range(3):
        st = rank_state(rank, 3, empty=True)
        sp.load(layout.step_path(tier, 2), into=st)
        check(st, rank, 3, version=2)
    manifest = mf.parse((Path(layout.step_path(tier, 2)) / "manifest.json").read_bytes())
    assert set(blob_files(tier / "blobs")) == {d for r in mf.recipes(manifest) for d in r.names()}


def test_frozen_is_refused_for_sharded_saves(tmp_path: Path) -> None:
    with pytest.raises(sp.UnsupportedStateError, match="frozen= is not supported"):
        sp.save(tmp_path / "ck", rank_state(0, 1), blobs=tmp_path / "blobs", frozen=["emb"])
    assert not (tmp_path / "ck").exists()


def test_a_ranks_write_step_and_its_records_cross_as_json(tmp_path: Path) -> None:
    """What the writer process of ``AsyncCheckpointer(writer="process")`` runs for a sharded save:
    ``write_rank`` from plain data (the staging directory, the rank's pieces, their sources),
    here with blobs; the pieces and the records (Flat regions, block checksums and recipes
    included) come back from JSON exactly as they were."""
    from savepoint.codecs import boxes
    from savepoint.distributed import pieces, plan
    from savepoint.state import tree

    target = str(tmp_path / "ckpt")
    described = [dsave.describe(tree.flatten(rank_state(r, 2)), target) for r in range(2)]
    items = plan.merge([d[0] for d in described]).writes[0]
    assert {type(i.region) for i in items} == {boxes.Flat, tuple}
    assert pieces.items_from_json(json.loads(json.dumps(pieces.items_json(items)))) == items
    (tmp_path / "staging").mkdir()
    policy = BlobPolicy(chunk_size=4096, min_blob_bytes=8192, workers=1, patches=False)
    assert {policy.wants(i.nbytes) for i in items} == {True, False}  # blobs and a data file
    blobs = dsave.RankSession(BlobStore.open(tmp_path / "blobs").session(), policy)
    records = dsave.write_rank(
        target,
        str(tmp_path / "staging"),
        0,
        items,
        described[0][1],
        max_file_bytes=1 << 30,
        writers=1,
        direct=False,
        progress=None,
        blobs=blobs,
    )
    blobs.close(committed=True)
    files, shards = records
    assert files and {s.recipe is None for _, s in shards} == {True, False}
    back = pieces.records_from_json(json.loads(json.dumps(pieces.records_json(records))))
    assert back == records
