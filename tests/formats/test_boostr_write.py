"""Writing boostr checkpoints: ``boostr.save_distributed`` from a list of per-rank states (every
strategy, world sizes 1-4, read back with load_distributed and consolidation), its atomic commit,
and ``AsyncCheckpointer.save_boostr`` (snapshot, one in flight, errors)."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from _support import one_rank_world
from savepoint.async_.checkpointer import AsyncCheckpointer
from savepoint.formats import _boostr_single, _boostr_write, boostr, detect

STATE = boostr.TrainingState(step=7, epoch=2, learning_rate=3e-4, metadata={"run": "x"})
SPLIT = {"w": 1, "emb": 0}


def full() -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, np.ndarray[Any, Any]]]:
    rng = np.random.default_rng(5)
    model = {
        "w": rng.standard_normal((3, 10)).astype(np.float32),
        "emb": rng.integers(0, 100, (9, 2)).astype(np.int64),
        "bias": rng.standard_normal(4).astype(np.float64),
        "p3": rng.standard_normal((2, 2)).astype(np.float16),
    }
    opt = {f"{k}.m": np.ones_like(v) * i for i, (k, v) in enumerate(model.items())}
    opt["step_count"] = np.array([7], dtype=np.int64)  # belongs to no parameter
    return model, opt


def shards(strategy: str, world: int, variant: str = "") -> list[boostr.BoostrCheckpoint]:
    """Per-rank checkpoints of :func:`full` laid out as ``strategy`` on ``world`` ranks."""
    model, opt = full()
    out = []
    for r in range(world):
        if strategy == "Replicated":
            m, o = dict(model), dict(opt)
        elif strategy == "ZeroPartitioned":
            mine = [k for i, k in enumerate(model) if i % world == r]
            # variant "zero1": every rank holds the whole model, the optimizer is partitioned
            m = dict(model) if variant == "zero1" else {k: model[k] for k in mine}
            o = {f"{k}.m": opt[f"{k}.m"] for k in mine}
            if r == 0:
                o["step_count"] = opt["step_count"]
        else:

            def cut(name: str, t: np.ndarray[Any, Any], r: int = r) -> np.ndarray[Any, Any]:
                param = name.removesuffix(".m")
                if param not in SPLIT:
                    return t
                return np.array_split(t, world, axis=SPLIT[param])[r].copy()

            m = {k: cut(k, v) for k, v in model.items()}
            o = {k: cut(k, v) for k, v in opt.items()}
        out.append(boostr.BoostrCheckpoint(m, o, STATE))
    return out


def same_tensors(got: dict[str, Any] | None, want: dict[str, Any]) -> None:
    assert got is not None and set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert np.array_equal(got[k], v), k


CASES = [
    ("Replicated", {}, ""),
    ("ZeroPartitioned", {"stage": 2}, ""),
    ("ZeroPartitioned", {"stage": 1}, "zero1"),
    ("TensorParallel", {"split_dims": SPLIT}, ""),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize(("strategy", "kwargs", "variant"), CASES)
def test_round_trip_from_a_list(
    tmp_path: Path, strategy: str, kwargs: dict[str, Any], variant: str, world: int
) -> None:
    ranks = shards(strategy, world, variant)
    meta = boostr.save_distributed(tmp_path / "ck", ranks, strategy=strategy, **kwargs)  # type: ignore[arg-type]
    assert meta == boostr.read_sharding_meta(tmp_path / "ck")
    assert meta.world_size == world and [s.rank for s in meta.shards] == list(range(world))
    assert {s.strategy for s in meta.shards} == {strategy}
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging directory left behind
    model, opt = full()
    whole = boostr.load_consolidated(tmp_path / "ck")
    same_tensors(whole.model, model)
    same_tensors(whole.optimizer, opt)
    assert whole.state.step == 7 and whole.state.metadata == {"run": "x"}
    for r in range(world):
        one = boostr.load_distributed(tmp_path / "ck", r)
        same_tensors(one.model, ranks[r].model)
        same_tensors(one.optimizer, ranks[r].optimizer or {})
    boostr.consolidate(tmp_path / "ck", tmp_path / "merged")
    same_tensors(boostr.load(tmp_path / "merged").model, model)
    assert detect.detect(tmp_path / "ck") == "boostr-distributed"
    boostr.verify(tmp_path / "ck")


def test_zero_owners_default_to_the_optimizer_state_holder(tmp_path: Path) -> None:
    boostr.save_distributed(
        tmp_path / "ck", shards("ZeroPartitioned", 2, "zero1"), strategy="ZeroPartitioned", stage=1
    )
    doc = json.loads((tmp_path / "ck" / "sharding_meta.json").read_text())
    assert doc["version"] == 2 and doc["world_size"] == 2
    assert doc["shards"][0]["strategy"] == {"ZeroPartitioned": {"stage": 1}}
    assert doc["shards"][0]["owned_params"] == ["w", "bias"]
    assert doc["shards"][1]["owned_params"] == ["emb", "p3"]


def test_explicit_owned_params_are_written(tmp_path: Path) -> None:
    ranks = shards("ZeroPartitioned", 2, "zero1")
    boostr.save_distributed(
        tmp_path / "ck",
        ranks,
        strategy="ZeroPartitioned",
        stage=3,
        owned_params=[["w", "bias"], ["emb", "p3"]],
    )
    meta = boostr.read_sharding_meta(tmp_path / "ck")
    assert [s.owned_params for s in meta.shards] == [("w", "bias"), ("emb", "p3")]
    assert meta.shards[1].stage == 3


def test_replicated_ranks_that_differ_are_refused(tmp_path: Path) -> None:
    ranks = shards("Replicated", 2)
    ranks[1].model["bias"] = ranks[1].model["bias"][:2]
    with pytest.raises(sp.CheckpointError, match="rank 1's model differs from rank 0's at 'bias'"):
        boostr.save_distributed(tmp_path / "ck", ranks)
    assert not (tmp_path / "ck").exists()


def test_shards_that_would_not_consolidate_commit_nothing(tmp_path: Path) -> None:
    boostr.save_distributed(tmp_path / "ck", shards("Replicated", 2))
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    ranks = shards("TensorParallel", 2)
    ranks[1].model["w"] = ranks[1].model["w"][:2]  # does not fit rank 0's slice
    with pytest.raises(sp.CheckpointError, match="do not fit together") as info:
        boostr.save_distributed(tmp_path / "ck", ranks, strategy="TensorParallel", split_dims=SPLIT)
    assert ".savepoint-tmp" not in str(info.value) and str(tmp_path / "ck") in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    assert boostr.read_sharding_meta(tmp_path / "ck").shards[0].strategy == "Replicated"


def test_a_failure_mid_write_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    boostr.save_distributed(tmp_path / "ck", shards("Replicated", 3))
    real = _boostr_write._Rank.write

    def failing(self: Any, staging: str) -> None:
        if self.rank == 2:
            raise OSError(errno.ENOSPC, "No space left on device", staging)
        real(self, staging)

    monkeypatch.setattr(_boostr_write._Rank, "write", failing)
    with pytest.raises(sp.CheckpointWriteError) as info:
        boostr.save_distributed(
            tmp_path / "ck", shards("ZeroPartitioned", 3), strategy="ZeroPartitioned", stage=2
        )
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert boostr.read_sharding_meta(tmp_path / "ck").shards[0].strategy == "Replicated"
    same_tensors(boostr.load_consolidated(tmp_path / "ck").model, full()[0])


def test_sharding_meta_is_written_after_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    real_rank, real_finish = _boostr_write._Rank.write, _boostr_write.finish

    def rank_write(self: Any, staging: str) -> None:
        real_rank(self, staging)
        order.append(f"rank_{self.rank}")

    def finish(tx: Any, meta: Any) -> None:
        assert sorted(os.listdir(tx.staging)) == ["rank_0", "rank_1"]
        order.append("meta")
        real_finish(tx, meta)

    monkeypatch.setattr(_boostr_write._Rank, "write", rank_write)
    monkeypatch.setattr(_boostr_write, "finish", finish)
    boostr.save_distributed(tmp_path / "ck", shards("Replicated", 2))
    assert order == ["rank_0", "rank_1", "meta"]


def test_a_foreign_directory_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    with pytest.raises(sp.CheckpointWriteError, match="not a boostr checkpoint"):
        boostr.save_distributed(tmp_path / "ck", shards("Replicated", 1))
    assert (tmp_path / "ck" / "notes.txt").read_text() == "mine"
    # a single boostr checkpoint may be replaced by a distributed one
    boostr.save(tmp_path / "single", full()[0])
    boostr.save_distributed(tmp_path / "single", shards("Replicated", 2))
    assert boostr.is_distributed(tmp_path / "single")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"strategy": "Sharded"}, "strategy must be one of"),
        ({"strategy": "ZeroPartitioned"}, "needs stage="),
        ({"strategy": "TensorParallel"}, "needs split_dims="),
        ({"strategy": "Replicated", "stage": 1}, "for ZeroPartitioned only"),
        ({"strategy": "Replicated", "split_dims": {"w": 0}}, "for TensorParallel only"),
        ({"owned_params": [["w"]]}, "one list of parameter names per rank"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        boostr.save_distributed(tmp_path / "ck", shards("Replicated", 2), **kwargs)
    assert not (tmp_path / "ck").exists()


def test_bad_shards(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="list every rank"):
        boostr.save_distributed(tmp_path / "ck", shards("Replicated", 1)[0])
    with pytest.raises(ValueError, match="empty"):
        boostr.save_distributed(tmp_path / "ck", [])
    bad = boostr.BoostrCheckpoint({"w": [1, 2]}, None, STATE)
    with pytest.raises(sp.UnsupportedStateError):
        boostr.save_distributed(tmp_path / "ck", [bad])
    assert not (tmp_path / "ck").exists()


# -- AsyncCheckpointer.save_boostr ---------------------------------------------------------------


class Gate:
    """Replaces ``boostr.write``: background boostr writes wait until ``open()``.

    Patched in the module that defines it too, whichever of the two the writer looks it up in.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: BaseException | None = None) -> None:
        self.real = boostr.write
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.fail = fail
        monkeypatch.setattr(boostr, "write", self)
        monkeypatch.setattr(_boostr_single, "write", self)

    def __call__(self, *args: Any) -> None:
        self.entered.set()
        assert self.opened.wait(20), "the test never opened the gate"
        if self.fail is not None:
            fail, self.fail = self.fail, None
            raise fail
        self.real(*args)

    def open(self) -> None:
        self.opened.set()


def test_async_boostr_save_is_the_state_when_save_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    model, opt = full()
    want_model = {k: v.copy() for k, v in model.items()}
    want_opt = {k: v.copy() for k, v in opt.items()}
    state = boostr.TrainingState(step=3, epoch=1, learning_rate=0.5, metadata={"a": "b"})
    ck = AsyncCheckpointer(writer="thread")
    try:
        pending = ck.save_boostr(tmp_path / "b", model, opt, state)
        assert gate.entered.wait(10) and not pending.done()
        for i in range(2000):  # training goes on while the write waits
            model["w"] += 1.0
            model["emb"][i % 9, :] = -i
            opt["w.m"] += 1.0
            state.metadata[f"k{i}"] = "v"
        state.step = 99
    finally:
        gate.open()
    info = pending.wait(timeout=20)
    ck.close()
    assert info.format == "boostr" and str(tmp_path / "b") == info.path
    back = boostr.load(tmp_path / "b")
    same_tensors(back.model, want_model)
    same_tensors(back.optimizer, want_opt)
    assert back.state.step == 3 and back.state.metadata == {"a": "b"}


def test_async_boostr_many_saves_with_in_place_mutation(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    model = {"w": rng.standard_normal((512, 512)).astype(np.float32)}
    copies = {}
    with AsyncCheckpointer(writer="thread") as ck:
        for i in range(12):
            ck.save_boostr(tmp_path / f"s{i}", model, None, boostr.TrainingState(step=i))
            copies[i] = model["w"].copy()
            model["w"] += 1.0
    for i, want in copies.items():
        back = boostr.load(tmp_path / f"s{i}")
        assert back.state.step == i and back.optimizer is None
        assert np.array_equal(back.model["w"], want)


@pytest.mark.torch
def test_async_boostr_torch_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    w = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    with AsyncCheckpointer(writer="thread") as ck:
        ck.save_boostr(tmp_path / "t", {"w": w})
        w.add_(100)
    back = boostr.load(tmp_path / "t", framework="torch")
    assert torch.equal(back.model["w"], torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))


def test_async_boostr_one_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    model = {"w": np.ones(3, np.float32)}
    with AsyncCheckpointer(writer="thread", on_busy="skip") as ck:
        first = ck.save_boostr(tmp_path / "a", model)
        assert gate.entered.wait(10)
        with pytest.warns(UserWarning, match="still writing"):
            skipped = ck.save_boostr(tmp_path / "b", model)
        assert skipped.skipped and skipped.done()
        gate.open()
        first.wait(timeout=20)
    assert (tmp_path / "a").is_dir() and not (tmp_path / "b").exists()


def test_async_boostr_waits_for_the_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    ck = AsyncCheckpointer(writer="thread")
    first = ck.save_boostr(tmp_path / "a", {"w": np.ones(3)})
    assert gate.entered.wait(10)
    threading.Timer(0.2, gate.open).start()
    second = ck.save_boostr(tmp_path / "b", {"w": np.zeros(3)})  # blocks until the first is done
    assert first.done()
    second.wait(timeout=20)
    ck.close()
    assert boostr.load(tmp_path / "a").model["w"][0] == 1


def test_async_boostr_errors_are_reported_once_with_errno(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch, fail=OSError(errno.ENOSPC, "No space left on device", "x"))
    gate.open()
    ck = AsyncCheckpointer(writer="thread")
    pending = ck.save_boostr(tmp_path / "a", {"w": np.ones(3)})
    with pytest.raises(sp.CheckpointWriteError) as info:
        pending.wait(timeout=20)
    assert info.value.errno == errno.ENOSPC and "free disk space" in str(info.value)
    with pytest.raises(sp.CheckpointWriteError):
        ck.save_boostr(tmp_path / "b", {"w": np.ones(3)})  # the next save reports it
    ck.save_boostr(tmp_path / "b", {"w": np.ones(3)}).wait(timeout=20)  # reported once only
    ck.close()
    assert not (tmp_path / "a").exists() and (tmp_path / "b").is_dir()


def test_async_boostr_real_write_error_keeps_its_errno(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("not a checkpoint")
    with AsyncCheckpointer(writer="thread") as ck:
        pending = ck.save_boostr(tmp_path / "taken", {"w": np.ones(3)})
        with pytest.raises(sp.CheckpointWriteError, match="not a boostr checkpoint"):
            pending.wait(timeout=20)
        with pytest.raises(sp.CheckpointWriteError):
            ck.wait()


def test_async_boostr_refuses_bad_state_in_the_caller(tmp_path: Path) -> None:
    with AsyncCheckpointer(writer="thread") as ck:
        with pytest.raises(sp.UnsupportedStateError, match="learning_rate"):
            ck.save_boostr(
                tmp_path / "a",
                {"w": np.ones(3)},
                None,
                boostr.TrainingState(step=1, learning_rate=float("nan")),
            )
        with pytest.raises(sp.UnsupportedStateError):
            ck.save_boostr(tmp_path / "a", {"w": "text"})
    assert not (tmp_path / "a").exists()


def test_async_boostr_refuses_a_process_group(tmp_path: Path) -> None:
    with (
        one_rank_world() as dist,
        AsyncCheckpointer(writer="thread", process_group=dist.group.WORLD) as ck,
    ):
        with pytest.raises(ValueError, match="save_distributed"):
            ck.save_boostr(tmp_path / "a", {"w": np.ones(3)})


def test_consolidate_replaces_a_distributed_checkpoint_in_place(tmp_path: Path) -> None:
    """A single checkpoint may replace a distributed one (and vice versa): both are boostr."""
    ranks = shards("Replicated", 2, "replicated")
    boostr.save_distributed(tmp_path / "ck", ranks, strategy="Replicated")
    boostr.save_distributed(tmp_path / "merged", ranks, strategy="Replicated")
    boostr.consolidate(tmp_path / "ck", tmp_path / "merged")
    assert detect.detect(tmp_path / "merged") == "boostr"
    same_tensors(boostr.load(tmp_path / "merged").model, full()[0])
