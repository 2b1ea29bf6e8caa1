"""The collectives' boundary: whatever goes wrong on savepoint's own gloo group reaches the user as
the DistributedCheckpointError every rank raises, never as an internal or a torch error.

In one process: a one-rank world whose group is made to look like two ranks, so setting up
savepoint's gloo group waits for a rank that never comes and times out.
"""

from __future__ import annotations

import inspect

import pytest

import savepoint as sp
from _support import one_rank_world
from savepoint.distributed import collectives


def test_collectives_expose_no_error_class_of_their_own() -> None:
    """Every error a user can catch is in savepoint.errors (before: CollectiveError, a bare
    RuntimeError, was public here)."""
    own = [
        name
        for name, value in vars(collectives).items()
        if not name.startswith("_")
        and inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == collectives.__name__
    ]
    assert own == []
    assert not any(name.endswith("Error") for name in collectives.__all__)


def test_a_group_that_cannot_be_set_up_is_a_distributed_checkpoint_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with one_rank_world() as dist:
        monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
        coord = collectives.coordinator(dist.group.WORLD, 1.0)
        assert (coord.rank, coord.world_size) == (0, 2)
        cleaned: list[bool] = []
        with pytest.raises(sp.DistributedCheckpointError) as info:
            coord.step(
                "saving",
                "ckpt",
                lambda: 1,
                lambda values: values,
                cleanup=lambda: cleaned.append(True),
            )
        assert cleaned == [True]  # rank 0 cleaned up
    error = info.value
    assert "could not set up savepoint's gloo group of 2 ranks" in str(error)
    assert error.ranks == (1,) and error.path == "ckpt"
    assert isinstance(error, sp.CheckpointError)


def test_a_coordinator_checks_its_process_group() -> None:
    """``boostr.save_distributed`` and the sharded load reach the coordinator directly."""
    with pytest.raises(TypeError, match=r"process_group must be a torch\.distributed\.Process"):
        collectives.coordinator("nope", None)
    with one_rank_world() as dist:
        group = dist.group.WORLD
    with pytest.raises(ValueError, match=r"not initialised; call .*init_process_group"):
        collectives.coordinator(group, None)


def test_waiting_for_another_operation_on_the_same_ranks_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One save or load at a time per process and ranks: the next waits for the lock at most
    ``timeout`` seconds (a background save stuck on a dead mount must not hang a load)."""
    import threading
    import time

    with one_rank_world() as dist:
        monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
        first = collectives.coordinator(dist.group.WORLD, 0.5)
        second = collectives.coordinator(dist.group.WORLD, 0.5)
        held, release = threading.Event(), threading.Event()

        def background() -> None:
            with first.exclusive():
                held.set()
                release.wait(10)

        thread = threading.Thread(target=background)
        thread.start()
        try:
            assert held.wait(10)
            start = time.monotonic()
            with pytest.raises(
                sp.DistributedCheckpointError, match=r"has not finished within 0.5 s"
            ):
                with second.exclusive():
                    pass
            assert 0.4 < time.monotonic() - start < 3
        finally:
            release.set()
            thread.join()
        with second.exclusive():  # free again
            pass
