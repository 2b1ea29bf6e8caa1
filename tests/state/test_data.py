"""ResumableSampler and DataPosition: a restored data stream continues at exactly the next index."""

from __future__ import annotations

import itertools
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.errors import DataStateError
from savepoint.state.data import DataPosition, ResumableSampler, epoch_order

ROOT = Path(__file__).resolve().parents[2]


def test_epoch_order_is_a_deterministic_permutation_per_seed_and_epoch() -> None:
    a = epoch_order(1000, seed=3, epoch=0)
    assert a.dtype == np.int64 and sorted(a.tolist()) == list(range(1000))
    assert np.array_equal(a, epoch_order(1000, seed=3, epoch=0))
    assert not np.array_equal(a, epoch_order(1000, seed=3, epoch=1))
    assert not np.array_equal(a, epoch_order(1000, seed=4, epoch=0))
    assert not np.array_equal(a, np.arange(1000))
    # Pinned values: the order must not change between releases (or NumPy versions), or old
    # checkpoints would resume into a different order.
    assert epoch_order(10, seed=0, epoch=0).tolist() == GOLDEN_0_0
    assert epoch_order(0, seed=0, epoch=0).tolist() == []


GOLDEN_0_0 = [3, 2, 1, 8, 6, 0, 7, 4, 5, 9]


def test_iteration_walks_epochs_and_counts_the_position() -> None:
    s = ResumableSampler(range(5), seed=1)
    assert len(s) == 5 and s.num_samples == 5
    it = iter(s)
    first = [next(it), next(it)]
    assert (s.epoch, s.index, len(s)) == (0, 2, 3)
    rest = list(it)
    assert sorted(first + rest) == [0, 1, 2, 3, 4]
    assert first + rest == s.order(0).tolist()
    assert (s.epoch, s.index) == (1, 0)  # ran off the end: next epoch, new order
    assert list(s) == s.order(1).tolist()
    assert s.epoch == 2


def test_without_shuffle_the_order_is_sequential() -> None:
    s = ResumableSampler(4, shuffle=False)
    assert list(s) == [0, 1, 2, 3] and list(s) == [0, 1, 2, 3]
    assert s.epoch == 2


def test_set_epoch_keeps_the_position_only_within_the_same_epoch() -> None:
    s = ResumableSampler(6, seed=2)
    it = iter(s)
    next(it)
    s.set_epoch(0)
    assert s.index == 1  # same epoch: a restored position survives the usual set_epoch call
    s.set_epoch(3)
    assert (s.epoch, s.index) == (3, 0)
    next(it)  # the detached old iterator no longer moves the sampler
    assert (s.epoch, s.index) == (3, 0)
    assert list(s) == epoch_order(6, 2, 3).tolist()
    with pytest.raises(ValueError):
        s.set_epoch(-1)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("how", ["tree", "into"])
@pytest.mark.parametrize("stop", [0, 1, 7, 12, 13, 26])
def test_restore_continues_at_exactly_the_next_index(
    ckpt: Path, shuffle: bool, how: str, stop: int
) -> None:
    n = 13
    s = ResumableSampler(n, shuffle=shuffle, seed=5)
    stream = itertools.chain.from_iterable(iter(s) for _ in range(4))
    head = list(itertools.islice(stream, stop))
    sp.save(ckpt, {"sampler": s})
    expected_tail = list(stream)[: 2 * n]

    fresh = ResumableSampler(range(n), shuffle=not shuffle, seed=99)  # seed/shuffle come back
    if how == "tree":
        fresh.load_state_dict(sp.load(ckpt)["sampler"])
    else:
        sp.load(ckpt, into={"sampler": fresh})
    assert (fresh.seed, fresh.shuffle) == (5, shuffle)
    resumed = list(itertools.islice(itertools.chain(fresh, fresh, fresh), 2 * n))
    assert resumed == expected_tail
    assert len(head) == stop


def test_a_finished_epoch_resumes_with_an_empty_pass_then_the_next_epoch() -> None:
    s = ResumableSampler(3, seed=0)
    it = iter(s)
    taken = [next(it) for _ in range(3)]  # the last index handed out, the iterator not finished
    state = s.state_dict()
    assert state["index"] == 3 and state["epoch"] == 0
    fresh = ResumableSampler(3)
    fresh.load_state_dict(state)
    assert len(fresh) == 0 and list(fresh) == []
    assert fresh.epoch == 1 and list(fresh) == epoch_order(3, 0, 1).tolist()
    assert sorted(taken) == [0, 1, 2]


def test_consumed_overrides_the_handed_out_count() -> None:
    s = ResumableSampler(10, seed=0)
    it = iter(s)
    for _ in range(8):  # a prefetching loader ran ahead ...
        next(it)
    state = s.state_dict(consumed=4)  # ... of the 4 samples the loop trained on
    assert state["index"] == 4 and s.index == 8
    fresh = ResumableSampler(10)
    fresh.load_state_dict(state)
    assert list(fresh) == s.order(0).tolist()[4:]
    with pytest.raises(ValueError):
        s.state_dict(consumed=11)
    with pytest.raises(ValueError):
        s.state_dict(consumed=-1)


def test_restore_refuses_another_dataset_size_and_bad_values() -> None:
    s = ResumableSampler(10)
    with pytest.raises(DataStateError) as excinfo:
        s.load_state_dict(
            {"num_samples": 11, "shuffle": "yes", "seed": -1, "epoch": 1.5, "index": 2, "x": 1}
        )
    problems = excinfo.value.problems
    assert any("11 samples, this dataset has 10" in p for p in problems)
    assert any("shuffle must be a bool" in p for p in problems)
    assert any("seed must be a non-negative int" in p for p in problems)
    assert any("epoch must be a non-negative int" in p for p in problems)
    assert any("unexpected key(s): 'x'" in p for p in problems)
    assert isinstance(excinfo.value, sp.IncompatibleCheckpointError)
    assert (s.epoch, s.index, s.seed, s.shuffle) == (0, 0, 0, True)
    with pytest.raises(DataStateError, match="index 12 is beyond"):
        s.load_state_dict({"num_samples": 10, "shuffle": True, "seed": 0, "epoch": 0, "index": 12})
    with pytest.raises(DataStateError, match="missing key"):
        s.load_state_dict({"num_samples": 10})
    with pytest.raises(DataStateError):
        s.load_state_dict([1, 2])
    copy = pickle.loads(pickle.dumps(excinfo.value))
    assert copy.problems == problems


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(3, seed=-2)
    with pytest.raises(ValueError, match="epoch"):
        ResumableSampler(3, epoch=True)  # type: ignore[arg-type]
    assert ResumableSampler(np.int64(4)).num_samples == 4  # type: ignore[arg-type]
    assert "index=0" in repr(ResumableSampler(3))


def test_state_dict_is_plain_values(ckpt: Path) -> None:
    s = ResumableSampler(7, seed=3, epoch=2)
    assert s.state_dict() == {"num_samples": 7, "shuffle": True, "seed": 3, "epoch": 2, "index": 0}
    sp.save(ckpt, s)
    assert not sp.inspect(ckpt).tensors  # all plain values, in the manifest


# ---------------------------------------------------------------------------------------------
# DataPosition
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["tree", "into"])
def test_data_position_round_trip(ckpt: Path, how: str) -> None:
    pos = DataPosition()
    for _ in range(3):
        pos.advance(32)
    pos.next_epoch()
    pos.advance(16)
    assert pos.state_dict() == {"epoch": 1, "step": 4, "index": 16}
    sp.save(ckpt, {"data": pos})
    fresh = DataPosition()
    if how == "tree":
        fresh.load_state_dict(sp.load(ckpt)["data"])
    else:
        sp.load(ckpt, into={"data": fresh})
    assert fresh == pos and fresh is not pos
    assert "step=4" in repr(fresh)


@pytest.mark.parametrize(
    "bad",
    [
        {"epoch": 0, "step": 0},
        {"epoch": 0, "step": 0, "index": -1},
        {"epoch": "0", "step": 0, "index": 0},
        {"epoch": 0, "step": 0, "index": 0, "extra": 1},
        [0, 0, 0],
    ],
)
def test_data_position_refuses_bad_states(bad: Any) -> None:
    pos = DataPosition(1, 2, 3)
    with pytest.raises(DataStateError):
        pos.load_state_dict(bad)
    assert pos == DataPosition(1, 2, 3)
    with pytest.raises(ValueError):
        DataPosition(step=-1)
    with pytest.raises(ValueError):
        pos.advance(-3)


# ---------------------------------------------------------------------------------------------
# torch DataLoader
# ---------------------------------------------------------------------------------------------


@pytest.mark.torch
def test_dataloader_resumes_mid_epoch(ckpt: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(30))

    def ids(loader: Any, n: int | None = None) -> list[list[int]]:
        return [b[0].tolist() for b in itertools.islice(loader, n)]

    sampler = ResumableSampler(data, seed=8)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    assert len(loader) == 8
    first = ids(loader, 3)
    sp.save(ckpt, {"sampler": sampler})
    expected = ids(loader)  # a new iteration picks up where the first stopped
    assert sorted(i for batch in first + expected for i in batch) == list(range(30))

    sampler2 = ResumableSampler(data)
    loader2 = DataLoader(data, batch_size=4, sampler=sampler2)
    sp.load(ckpt, into={"sampler": sampler2})
    assert len(loader2) == 5  # 18 samples left: 4 full batches and one of 2
    assert ids(loader2) == expected
    assert sampler2.epoch == 1 and ids(loader2) == ids(DataLoader(data, 4, sampler=sampler))


@pytest.mark.torch
def test_example_runs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "resumable_data.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical" in result.stdout and "DIFFERENT" not in result.stdout


@pytest.mark.torch
def test_training_state_doc_snippets_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    doc = (ROOT / "docs" / "training-state.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python[^\n]*\n(.*?)^```", doc, re.M | re.S)
    assert len(blocks) >= 6
    script = tmp_path / "snippets.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed at step 3" in result.stdout
