"""The parts of the deadlines in one process (``savepoint.distributed.deadlines``): the verdict
and its error, naming the ranks behind on a board, and the watch that publishes what a late
rank is doing. The gloo sessions are in ``test_deadlines.py``."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import savepoint as sp
from savepoint.distributed import deadlines
from savepoint.distributed.deadlines import Board, Verdict, Watch, give_up, working_on


class FakeStore:
    """The few calls of a torch.distributed Store the board makes, over a dict. Once ``gone``
    (the process hosting it exited) every call raises, as a TCPStore client's would."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.gone = False

    def _up(self) -> None:
        if self.gone:
            raise ConnectionError("Connection reset by peer")

    def set(self, key: str, value: str) -> None:
        self._up()
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        self._up()
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self._up()
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._up()
        return [self.data[k] for k in keys]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._up()
        with self.lock:
            if key not in self.data and expected == "":
                self.data[key] = desired.encode()
            return self.data[key]

    def add(self, key: str, n: int) -> int:
        self._up()
        with self.lock:
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            return value


class SlowStore:
    """A store as a rank on a loaded machine reaches it: every call takes ``delay`` more."""

    def __init__(self, store: FakeStore, delay: float) -> None:
        self.store, self.delay = store, delay

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.store, name)

        def slow(*args: Any) -> Any:
            time.sleep(self.delay)
            return call(*args)

        return slow


def verdict(**fields: Any) -> Verdict:
    base: dict[str, Any] = {
        "phase": "save: write",
        "obj": "/ckpt/step-100",
        "timeout": 30.0,
        "by": 0,
        "world": 4,
        "report": "Timed out waiting 30000ms for recv operation to complete",
        "timed_out": True,
    }
    return Verdict(**{**base, **fields})


def test_the_error_names_the_rank_the_phase_the_object_and_the_file() -> None:
    v = verdict(stalled={3: "writing data-r00003-00000.safetensors"})
    err = Verdict.from_json(v.to_json()).error("saving", "/ckpt/step-100", {1: "OSError: boom"})
    text = str(err)
    assert text.startswith(
        "saving /ckpt/step-100 failed: rank 3 did not finish its part of 'save: write' of "
        "/ckpt/step-100 (writing data-r00003-00000.safetensors) within 30 s; savepoint's "
        "process group reported on rank 0 of 4: Timed out"
    ), text
    assert err.phase == "save: write" and err.stalled == {3: "save: write"}
    assert err.ranks == (1, 3) and err.errors[1] == "OSError: boom"
    assert err.errors[3].startswith("did not finish its part of 'save: write'")
    assert isinstance(err, sp.CheckpointError) and err.path == "/ckpt/step-100"


def test_several_ranks_a_death_and_nobody_named() -> None:
    two = verdict(stalled={2: "", 5: "writing b"}, errors={0: "ValueError: x"}, timed_out=False)
    text = str(two.error("saving", "/c"))
    assert "ranks 2, 5 did not finish their part of 'save: write' of /ckpt/step-100" in text
    assert (
        "(rank 5: writing b) (died, or stuck)" in text and "; rank 0 failed: ValueError: x" in text
    )
    nobody = verdict()
    err = nobody.error("loading", "/c")
    assert "a rank died or stopped answering in 'save: write'" in str(err)
    assert err.stalled == {} and err.errors == {}


def test_after_a_timeout_the_ranks_behind_are_named_at_once() -> None:
    store = FakeStore()
    board = Board(lambda: store)
    for rank, point in ((0, 7), (1, 7), (2, 6)):  # rank 3 never recorded anything
        board.done(rank, point)
    board.note(2, "writing data-r00002-00000.safetensors")
    start = time.monotonic()
    found = give_up(board, 7, verdict(by=1), range(4), grace=5)
    assert time.monotonic() - start < 1  # no grace after a timeout
    assert found.stalled == {2: "writing data-r00002-00000.safetensors", 3: ""}
    # The first verdict written stands: another rank giving up adopts it.
    again = give_up(board, 7, verdict(by=0, report="other"), range(4), grace=5)
    assert again == found and board.verdict(7) == found


def test_after_a_death_a_slower_rank_gets_the_grace_to_show_it_is_alive() -> None:
    store = FakeStore()
    board = Board(lambda: store)
    board.done(0, 3)
    timer = threading.Timer(0.2, lambda: board.done(1, 3))  # slower, alive
    timer.start()
    found = give_up(board, 3, verdict(timed_out=False), range(3), grace=0.6)
    timer.join()
    assert set(found.stalled) == {2} and not found.timed_out  # rank 2 died
    assert "(died, or stuck)" in str(found.error("saving", "/c"))


def test_a_store_lost_during_the_grace_does_not_erase_the_rank_already_known_behind() -> None:
    store = FakeStore()
    board = Board(lambda: store)
    for rank, point in ((0, 3), (1, 1), (2, 3)):  # rank 1 died before point 3
        board.done(rank, point)
    timer = threading.Timer(0.2, lambda: setattr(store, "gone", True))  # rank 0 exited
    timer.start()
    found = give_up(board, 3, verdict(by=2, timed_out=False), range(3), grace=0.5)
    timer.join()
    assert set(found.stalled) == {1} and found.by == 2  # not "a rank died", naming nobody
    assert list(found.error("saving", "/c").ranks) == [1]


def test_the_rank_hosting_the_store_leaves_once_the_others_giving_up_have_the_verdict() -> None:
    """Rank 0 (whose process hosts the store, and exits once it raised) and rank 2, slowed by
    a loaded machine, give up on point 3 together after rank 1 died: one verdict on both."""
    store = FakeStore()
    for rank, point in ((0, 3), (1, 1), (2, 3)):
        Board(lambda: store).done(rank, point)
    found: dict[int, Verdict] = {}

    def rank0() -> None:
        found[0] = give_up(Board(lambda: store), 3, verdict(by=0, timed_out=False), range(3), 0.3)
        store.gone = True  # rank 0 raised and its process exited

    slow = SlowStore(store, 0.06)
    thread = threading.Thread(target=rank0)
    thread.start()
    found[2] = give_up(Board(lambda: slow), 3, verdict(by=2, timed_out=False), range(3), 0.3)
    thread.join()
    assert found[0] == found[2] and set(found[0].stalled) == {1}, found
    # Nobody else gave up on the point: no wait.
    board = Board(lambda: FakeStore())
    start = time.monotonic()
    give_up(board, 5, verdict(by=0), range(2), grace=5)
    assert time.monotonic() - start < 1


def test_a_board_without_its_store_names_nobody_and_never_raises() -> None:
    def gone() -> Any:
        raise ConnectionError("rank 0 is gone")

    board = Board(gone)
    board.done(0, 1)
    assert board.behind(1, [0, 1]) == [] and board.verdict(1) is None and board.doing(1) == ""
    assert board.known_behind(1, [0, 1]) is None and board.count("read/1") is None
    mine = verdict()
    assert board.publish(1, mine) is mine


def test_a_watch_publishes_what_a_late_rank_is_doing_then_clears_it() -> None:
    published: list[str] = []
    late = sp.DistributedCheckpointError("they gave up")
    with Watch(published.append, lambda: late, after=0.1, every=0.1) as watch:
        assert deadlines.abandoned() is None  # not before half the deadline
        with working_on("writing data-r00001-00000.safetensors"):
            deadline = time.monotonic() + 5
            while not published and time.monotonic() < deadline:
                time.sleep(0.02)
            assert published == ["writing data-r00001-00000.safetensors"]
            assert deadlines.abandoned() is late
        assert watch.text() == ""
    assert published[-1] == ""  # cleared at the end: no stale note
    assert deadlines.abandoned() is None  # no watch any more
    with working_on("anything"):  # outside a watched phase: nothing noted
        pass


def test_a_phase_that_ends_in_time_publishes_nothing() -> None:
    published: list[str] = []
    for _ in range(100):
        with Watch(published.append, lambda: None, after=30, every=30), working_on("f"):
            pass
    assert published == []


@pytest.mark.parametrize("text", ["Timed out waiting 2000ms", "Wait timeout"])
def test_timeouts_are_told_from_deaths(text: str) -> None:
    assert Verdict.of("p", "o", 2.0, 0, 2, RuntimeError(text)).timed_out
    assert not Verdict.of("p", "o", 2.0, 0, 2, RuntimeError("Connection closed by peer")).timed_out
