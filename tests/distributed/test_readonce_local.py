"""Read-once loads with ranks as threads of this process (fast, every shard kind).

The coordinator is ``test_incremental_local``'s thread coordinator plus the three data
collectives (broadcast, rank-to-rank exchange, flags) over shared memory, so the planner and
the rounds of :mod:`savepoint.distributed._fetch` run as they do on gloo ranks
(``test_readonce`` runs them there). The read-once threshold is lowered to one byte so the small
tensors of the incremental tests' state (box shards along both dimensions, flat shards, a
replicated tensor, ZeRO entries; in data files and as blob recipes) all go through it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import manifest as mf
from savepoint.distributed import collectives, readonce
from savepoint.distributed import load as dload
from savepoint.errors import DistributedCheckpointError
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore

from .test_incremental_local import (
    POLICY,
    R,
    ThreadCoordinator,
    ThreadGroup,
    check,
    on_ranks,
    rank_state,
    tensors,
)


class DataThreads(ThreadCoordinator):
    """A thread rank with the data collectives: buffers handed over in shared memory."""

    moves_data = True

    def all_flags(self, flag: int, *, phase: str | None = None) -> list[int]:
        g = self.group
        g.slots[self.rank] = flag
        g.barrier.wait()
        out = list(g.slots)
        g.barrier.wait()
        return out

    def broadcast_bytes(self, buf: Any, root: int) -> None:
        g = self.group
        if self.rank == root:
            g.shared = buf
        g.barrier.wait()
        if self.rank != root:
            buf[...] = g.shared
        g.barrier.wait()

    def exchange_bytes(
        self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]], tag: int
    ) -> None:
        g = self.group
        with g.lock:
            for rank, buf in sends:
                g.mail[(self.rank, rank, tag)] = buf.copy()
        g.barrier.wait()
        with g.lock:
            for rank, buf in recvs:
                buf[...] = g.mail.pop((rank, self.rank, tag))
        g.barrier.wait()


@contextlib.contextmanager
def data_threads(monkeypatch: pytest.MonkeyPatch, world: int) -> Iterator[ThreadGroup]:
    group = ThreadGroup(world)
    group.lock = threading.Lock()  # type: ignore[attr-defined]
    group.mail = {}  # type: ignore[attr-defined]

    def coordinator(process_group: Any, timeout: Any) -> collectives.Coordinator:
        rank = getattr(group.local, "rank", None)
        if rank is None:
            return collectives.LocalCoordinator()
        return DataThreads(group, rank)

    monkeypatch.setattr(collectives, "coordinator", coordinator)
    yield group


@pytest.fixture(autouse=True, params=["one round", "a round per chunk"])
def share_everything(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Every shard read once; in one round, or each chunk in a round of its own (so the next
    round is read while one travels, and a failure can come in any round)."""
    monkeypatch.setattr(readonce, "MIN_SAVING", 1)
    if request.param == "a round per chunk":
        monkeypatch.setattr(readonce, "ROUND", 1)


def save(monkeypatch: pytest.MonkeyPatch, path: Path, world: int, blobs: bool) -> None:
    with data_threads(monkeypatch, world) as group:
        results = on_ranks(
            group,
            lambda r: sp.save(
                path,
                rank_state(r, world),
                **({"blobs": path.parent / "blobs", "blob_policy": POLICY} if blobs else {}),
            ),
        )
    assert not any(isinstance(x, BaseException) for x in results), results


def counts(store: FaultyStore, path: Path) -> dict[str, np.ndarray[Any, Any]]:
    """How many times each byte of each data file was read (every thread, every call)."""
    manifest = mf.parse((path / mf.NAME).read_bytes())
    out = {name: np.zeros(rec.size, np.int32) for name, rec in manifest.files.items()}
    for c in store.calls:
        if c.kind == "read" and c.path.endswith(".safetensors"):
            out[c.path.rsplit("/", 1)[1]][c.offset : c.offset + c.nbytes] += 1
    store.calls.clear()
    return out


@pytest.mark.parametrize("blobs", [False, True])
@pytest.mark.parametrize(("saved", "loaded"), [(2, 3), (3, 2), (3, 3)])
@pytest.mark.parametrize("verify", [True, False, "first"])
def test_read_once_loads_reshard_exactly(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    blobs: bool,
    saved: int,
    loaded: int,
    verify: Any,
) -> None:
    path = tmp_path / "ckpt"
    save(monkeypatch, path, saved, blobs)
    store = FaultyStore(LocalStore(), views=False)
    seen: list[list[int]] = [[] for _ in range(loaded)]
    with data_threads(monkeypatch, loaded) as group:

        def load(rank: int) -> Any:
            st = rank_state(rank, loaded, empty=True)
            dload.load(
                store.at(str(path)),
                into=st,
                verify=verify,
                progress=lambda done, total: seen[rank].append(done - total),
            )
            return st

        results = on_ranks(group, load)
    for rank, st in enumerate(results):
        assert not isinstance(st, BaseException), st
        check(st, rank, loaded)
        assert seen[rank][-1] == 0  # progress reached the total
    if not blobs:
        manifest = mf.parse((path / mf.NAME).read_bytes())
        rep = manifest.tensors["rep"].layout()[0]  # replicated: every rank needs all of it
        found = counts(store, path)[rep.file][rep.start : rep.end]
        assert set(found.tolist()) == {2 if verify == "first" else 1}


def test_a_whole_load_without_into_reads_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    save(monkeypatch, path, 3, blobs=False)
    store = FaultyStore(LocalStore(), views=False)
    with data_threads(monkeypatch, 4) as group:
        results = on_ranks(group, lambda r: dload.load(store.at(str(path)), framework="numpy"))
    want = tensors()
    for tree in results:
        assert not isinstance(tree, BaseException), tree
        for key in ("emb", "cols", "flat", "rep", "bias", "mixed"):
            np.testing.assert_array_equal(tree[key], want[key], err_msg=key)
    manifest = mf.parse((path / mf.NAME).read_bytes())
    found = counts(store, path)
    for ref in ("emb", "cols", "flat", "rep", "mixed"):
        for s in manifest.tensors[ref].layout():
            assert set(found[s.file][s.start : s.end].tolist()) == {1}, ref


def test_read_once_false_reads_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    save(monkeypatch, path, 2, blobs=False)
    store = FaultyStore(LocalStore(), views=False)
    with data_threads(monkeypatch, 3) as group:
        results = on_ranks(
            group,
            lambda r: dload.load(
                store.at(str(path)), into={"rep": np.zeros_like(R)}, keys="rep", read_once=False
            ),
        )
    for st in results:
        np.testing.assert_array_equal(st["rep"], R)
    rep = mf.parse((path / mf.NAME).read_bytes()).tensors["rep"].layout()[0]
    assert set(counts(store, path)[rep.file][rep.start : rep.end].tolist()) == {3}


def test_a_damaged_chunk_fails_only_its_reader(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The replicated tensor's bytes, read once: its one reader names the mismatch; the other
    ranks stop with no error of their own, and every rank raises."""
    path = tmp_path / "ckpt"
    save(monkeypatch, path, 2, blobs=False)
    rep = mf.parse((path / mf.NAME).read_bytes()).tensors["rep"].layout()[0]
    with open(path / rep.file, "r+b") as f:
        f.seek(rep.start + 100)
        byte = f.read(1)
        f.seek(rep.start + 100)
        f.write(bytes([byte[0] ^ 1]))
    with data_threads(monkeypatch, 3) as group:
        results = on_ranks(
            group, lambda r: dload.load(path, into={"rep": np.zeros_like(R)}, keys="rep")
        )
    assert all(isinstance(x, DistributedCheckpointError) for x in results), results
    (ranks,) = {tuple(x.ranks) for x in results}
    assert len(ranks) == 1
    assert "checksum mismatch in tensor 'rep'" in str(results[0].errors[ranks[0]])
