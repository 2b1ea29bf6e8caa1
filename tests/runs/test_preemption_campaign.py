"""The preemption campaign: SIGTERM at random moments, then an exact resume.

Each trial trains a small torch model with dropout (AdamW, RNG state captured) in real processes
(_preempt_worker.py): one process, or two gloo ranks on 127.0.0.1 whose manager has the process
group. SIGTERM arrives at a random moment from this test (to a random rank), or from the worker
itself inside a chosen phase: while an async save writes, while retention deletes, while a
checkpoint is read back before pruning; one variant slows the async writer so that the save in
flight cannot commit within a short grace budget and must be abandoned. Every trial must end with:

- every rank exiting with 143 (128 + SIGTERM) at the same step, the commit within the budget
  counted from the first notice (the test's own clock for the signals it sends);
- that step committed, verified, listed as the run's latest; nothing half-written left; a save
  abandoned is not part of the run;
- a resumed run (new processes) restoring exactly that step, whose next 10 losses are
  bit-identical to an uninterrupted run's (and the interrupted run's losses before it too); its
  first save applies the retention the preemption save deferred.

``make test`` runs a bounded slice (2 trials: two ranks with a random signal, one process
signalled while retention deletes); ``SAVEPOINT_TORTURE=1`` (``make torture``) runs 50.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import _torture
import savepoint as sp
from savepoint.runs import layout

from ._util import leftovers

pytest.importorskip("torch")

WORKER = Path(__file__).with_name("_preempt_worker.py")
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
}
RESUME_STEPS = 10
KEEP_LAST = 2


class Config(NamedTuple):
    world: int
    async_save: bool
    phase: str  # random (the test sends it), async-write, prune, verify (the worker sends it)
    slow: bool = False  # a slow async writer: the save in flight cannot finish in time
    grace: float = 25.0

    @property
    def name(self) -> str:
        kind = "async" if self.async_save else "sync"
        return f"{self.world}x-{kind}-{self.phase}{'-slow' if self.slow else ''}"


CONFIGS = [  # the first two are make test's slice
    Config(2, True, "random"),
    Config(1, False, "prune"),
    Config(1, True, "random"),
    Config(1, True, "async-write"),
    Config(1, True, "verify"),
    Config(1, False, "random"),
    Config(2, False, "prune"),
    Config(1, True, "async-write", slow=True, grace=6.0),
    Config(2, True, "async-write"),
    Config(1, False, "verify"),
    Config(2, True, "prune"),
    Config(2, True, "async-write", slow=True, grace=6.0),
    Config(2, False, "random"),
]
TRIALS = 50 if _torture.ENABLED else 2


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _launch(
    mode: str, run: Path, out: Path, cfg: Config, rank: int, port: str, at: int, log: Path
) -> subprocess.Popen[bytes]:
    args = [sys.executable, str(WORKER), mode, str(run), str(out)]
    args += ["--rank", str(rank), "--world", str(cfg.world), "--port", port]
    if mode == "train":
        args += ["--phase", cfg.phase, "--at", str(at), "--grace", str(cfg.grace)]
        args += ["--async"] if cfg.async_save else []
        args += ["--slow"] if cfg.slow else []
    with open(log, "wb") as err:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, env=ENV)


def _wait_all(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> list[int]:
    codes = []
    for proc in procs:
        try:
            proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a worker hung:\n" + "\n".join(x.read_text() for x in logs))
        codes.append(proc.returncode)
    return codes


def trial(tmp: Path, number: int, cfg: Config) -> dict[str, Any]:
    rng = random.Random(20261127 + number)
    run = tmp / f"run-{number}"
    ranks = range(cfg.world)
    outs = [tmp / f"train-{number}-{r}.json" for r in ranks]
    logs = [tmp / f"train-{number}-{r}.log" for r in ranks]
    at = 1 if cfg.slow else rng.randint(1, 60)  # slow: from the first file of the one save
    port = _port()
    procs = [_launch("train", run, outs[r], cfg, r, port, at, logs[r]) for r in ranks]
    for proc in procs:  # each prints "ready" once its manager is open
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == b"ready", [x.read_text() for x in logs]
    sent: float | None = None
    if cfg.phase == "random":
        time.sleep(rng.uniform(0.05, 1.5))
        targets = [rng.randrange(cfg.world)]
        if cfg.world > 1 and rng.random() < 0.3:
            targets = [targets[0], 1 - targets[0]]  # both, a moment apart
        for i, r in enumerate(targets):
            if i:
                time.sleep(rng.uniform(0.0, 0.05))
            now = time.monotonic()
            sent = now if sent is None else sent
            procs[r].send_signal(signal.SIGTERM)
    codes = _wait_all(procs, logs)
    docs = [json.loads(o.read_text()) if o.exists() else {} for o in outs]
    context = f"trial {number} ({cfg.name}, at={at}): {codes} {docs and docs[0].get('result')}"
    assert codes == [128 + signal.SIGTERM] * cfg.world, (
        context + "\n" + "\n".join(x.read_text() for x in logs)
    )
    results = [d["result"] for d in docs]
    step = results[0]["step"]
    assert [r["step"] for r in results] == [step] * cfg.world, context  # all ranks, one step
    assert all(r["exit_code"] == 143 and r["signum"] == signal.SIGTERM for r in results), context
    assert all(r["within_budget"] and r["errors"] == [] for r in results), context
    # The budget counts from the first notice: the test's clock for a signal it sent (the
    # handler runs a little later), else the worker's own (monotonic clocks agree across
    # processes on one machine).
    notices = [d["notice_at"] for d in docs if d["notice_at"] is not None]
    first = sent if sent is not None else min(notices)
    took = max(d["committed_at"] for d in docs) - first
    assert 0 <= took <= cfg.grace, context

    # The run on disk: that step committed, latest, intact; nothing half-written left.
    with sp.CheckpointManager(run, read_only=True) as view:
        steps = view.steps()
        assert steps and steps[-1] == step, (context, steps)
        sp.verify(view.step_path(step))
    assert leftovers(run) == [], context
    in_flight = results[0]["in_flight"]
    if in_flight == "abandoned":
        gone = results[0]["in_flight_step"]
        assert gone not in steps and not (run / "checkpoints" / layout.step_name(gone)).exists()
    if cfg.slow:
        assert in_flight == "abandoned", context  # a 5-10 s save cannot fit a 6 s budget

    # Resume in new processes: exactly that step, then 10 losses equal to an unbroken run's.
    resumed = [tmp / f"resume-{number}-{r}.json" for r in ranks]
    rlogs = [tmp / f"resume-{number}-{r}.log" for r in ranks]
    port = _port()
    procs = [_launch("resume", run, resumed[r], cfg, r, port, at, rlogs[r]) for r in ranks]
    codes = _wait_all(procs, rlogs)
    assert codes == [0] * cfg.world, context + "\n".join(x.read_text() for x in rlogs)
    for r in ranks:
        doc, train = json.loads(resumed[r].read_text()), docs[r]
        assert doc["restored"] == step, context
        ref = doc["reference"]
        after = {str(s): ref[str(s)] for s in range(step + 1, step + RESUME_STEPS + 1)}
        assert doc["resumed"] == after, (context, r)
        before = {str(s): ref[str(s)] for s in range(1, step + 1)}
        assert train["losses"] == before, (context, r)
    # the resumed run's first save applied the retention the preemption save had deferred
    assert json.loads(resumed[0].read_text())["steps"] == [step, step + RESUME_STEPS], context
    return {"config": cfg.name, "step": step, "took": took, "in_flight": in_flight}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
def test_preemption_campaign(tmp_path: Path) -> None:
    figures = []
    started = time.monotonic()
    for number in range(TRIALS):
        figures.append(trial(tmp_path, number, CONFIGS[number % len(CONFIGS)]))
    took = max(f["took"] for f in figures)
    fates = sorted({f["in_flight"] for f in figures})
    print(
        f"\npreemption campaign: {len(figures)} trials in {time.monotonic() - started:.0f} s; "
        f"longest notice-to-commit {took:.2f} s; saves in flight: {fates}"
    )
    for f in figures:
        print(f"  {f['config']:<28} step {f['step']:>4}  {f['took']:.3f} s  {f['in_flight']}")
