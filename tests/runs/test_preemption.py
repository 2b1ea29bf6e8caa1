"""Preemption notices: flag-only handlers, chaining, restoring, and one answer across ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from savepoint.runs.preemption import DEFAULT_SIGNALS, Preemption, signals_of


def test_a_signal_sets_the_flag_and_the_process_lives_on() -> None:
    with Preemption() as p:
        assert not p.requested() and not p.poll() and p.elapsed() == 0.0
        os.kill(os.getpid(), signal.SIGTERM)  # the default action would end this process
        assert p.requested() and p.poll() and p.signum == signal.SIGTERM
        assert p.elapsed() >= 0.0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


def test_a_previous_python_handler_is_still_called_and_restored() -> None:
    seen: list[int] = []

    def mine(signum: int, frame: Any) -> None:
        seen.append(signum)

    before = signal.signal(signal.SIGUSR1, mine)
    try:
        with Preemption(["USR1"]) as p:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert p.requested() and seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_signal_specs() -> None:
    assert signals_of(True) == DEFAULT_SIGNALS == (signal.SIGTERM, signal.SIGUSR1)
    assert signals_of(["SIGINT", "usr2", 15, signal.SIGINT]) == (
        signal.SIGINT,
        signal.SIGUSR2,
        signal.SIGTERM,
    )
    for bad, error in [
        (False, TypeError),
        ("SIGTERM", TypeError),
        (["SIGNOPE"], ValueError),
        ([signal.SIGKILL], ValueError),
        ([], ValueError),
    ]:
        with pytest.raises(error):
            signals_of(bad)
    with pytest.raises(ValueError, match="every"):
        Preemption(every=0)


def test_handlers_are_installed_from_the_main_thread_only() -> None:
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            Preemption()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert isinstance(box["error"], RuntimeError) and "main thread" in str(box["error"])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


RANKS = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch.distributed as dist
    from savepoint.runs.preemption import Preemption
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    p = Preemption(process_group=True, every=2)
    stopped = None
    for step in range(1, 50):
        if rank == 1 and step == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is told
        if p.poll():
            stopped = step
            break
    print("stopped", rank, stopped, p.requested())
    dist.destroy_process_group()
    """
)


def test_ranks_agree_on_the_step_to_stop(tmp_path: Path) -> None:
    import socket

    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    lines = [next(line for line in out.splitlines() if line.startswith("stopped")) for out in outs]
    # rank 1 saw the signal at step 7; the all-reduce every 2nd poll makes both stop at step 8
    assert lines == ["stopped 0 8 False", "stopped 1 8 True"], outs
