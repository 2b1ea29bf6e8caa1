"""A training process for the preemption campaign (test_preemption_campaign.py); not collected.

``python _preempt_worker.py train RUN OUT [options]`` trains a small torch model with dropout
(AdamW, the global torch RNG captured by ``RNGState``) under a ``CheckpointManager(...,
preemption=True)`` until ``mgr.preempted()``, then calls ``save_on_preemption`` and exits with its
``exit_code``. The SIGTERM comes from the test (at a random moment) or from this process itself at
a chosen phase: ``--phase async-write`` (from the async writer, while it writes a save),
``prune`` (as retention deletes a checkpoint), ``verify`` (as a checkpoint is read back before
pruning). ``--slow`` slows the async writer (1 s a file, one save at step 5) so that the save in
flight cannot finish within a short ``--grace``: it is abandoned.

``python _preempt_worker.py resume RUN OUT`` restores the run's latest checkpoint, trains 10 more
steps, saves once (the retention the preemption save deferred), then trains an uninterrupted
reference run from scratch to the same step in the same process: the test compares the losses.

With ``--world 2`` it is one of two gloo ranks (``--rank``, ``--port``): gradients are averaged with
an all-reduce, each rank's RNG state is its own (``Partitioned``), and the manager gets the
process group. Output: one JSON document in OUT (losses as float.hex strings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from typing import Any

SAVE_EVERY = 5
KEEP_LAST = 2
MAX_STEPS = 20000
RESUME_STEPS = 10


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "resume"])
    parser.add_argument("run")
    parser.add_argument("out")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--port", default="0")
    parser.add_argument("--async", dest="async_", action="store_true")
    parser.add_argument("--phase", default="random")
    parser.add_argument("--at", type=int, default=1)
    parser.add_argument("--grace", type=float, default=25.0)
    parser.add_argument("--slow", action="store_true")
    a = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    pg = None
    if a.world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world
        )
        pg = dist.group.WORLD
    doc = train(a, pg) if a.mode == "train" else resume(a, pg)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    sys.stdout.flush()
    # (torch.distributed's teardown aborts now and then: leave without it)
    os._exit(int(doc.get("exit_code", 0)))


def build(rank: int, world: int) -> dict[str, Any]:
    import torch

    from savepoint.distributed import Partitioned
    from savepoint.state.rng import RNGState

    torch.manual_seed(1234)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1000 + rank)  # each rank's own dropout stream
    rng: Any = RNGState()
    return {
        "model": model,
        "optimizer": opt,
        "rng": Partitioned({f"rank{rank}": rng}) if world > 1 else rng,
        "step": 0,
    }


def train_step(state: dict[str, Any], step: int, rank: int, world: int) -> str:
    import torch

    model, opt = state["model"], state["optimizer"]
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(64, 32, generator=g)
    y = 2 * x[:, :1] - x[:, 1:2] + 0.1 * torch.randn(64, 1, generator=g)
    model.train()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    if world > 1:
        import torch.distributed as dist

        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(world)
    opt.step()
    state["step"] = step
    return float(loss.item()).hex()


def _arm(phase: str, at: int, rank: int, world: int) -> Any:
    """Deliver SIGTERM to this process from inside ``phase``; returns the progress callback."""
    import savepoint.checkpoint
    import savepoint.runs.books as books  # (retention deletes through the books)

    fired = threading.Event()

    def fire() -> None:
        if not fired.is_set():
            fired.set()
            os.kill(os.getpid(), signal.SIGTERM)

    writes = {"n": 0}

    def progress(done: int, total: int) -> None:
        writer = threading.current_thread() is not threading.main_thread()
        if phase == "async-write" and writer and (world == 1 or rank == at % world):
            writes["n"] += 1  # the at-th file an async save writes (saves write about 20 each)
            if writes["n"] >= at:
                fire()
        if SLOW["on"] and writer:
            time.sleep(1.0)

    if phase == "prune":
        discard = vars(books)["discard"]

        def discarding(store: Any, path: str) -> None:
            fire()
            discard(store, path)

        vars(books)["discard"] = discarding
    if phase == "verify":
        verify = savepoint.checkpoint.verify

        def verifying(*args: Any, **kwargs: Any) -> Any:
            fire()
            return verify(*args, **kwargs)

        vars(savepoint.checkpoint)["verify"] = verifying
    return progress


SLOW = {"on": False}


def train(a: argparse.Namespace, pg: Any) -> dict[str, Any]:
    import savepoint as sp

    SLOW["on"] = a.slow
    progress = _arm(a.phase, a.at, a.rank, a.world)
    state = build(a.rank, a.world)
    losses: dict[int, str] = {}
    extra: dict[str, Any] = {} if pg is None else {"process_group": pg}
    with sp.CheckpointManager(
        a.run,
        keep_last=KEEP_LAST,
        async_save=a.async_,
        preemption=True,
        preemption_grace=a.grace,
        max_file_bytes=4096,  # 13 files a save: many moments inside a write
        progress=progress,
        **extra,
    ) as mgr:
        print("ready", flush=True)
        step = 0
        result = None
        while step < MAX_STEPS:
            step += 1
            losses[step] = train_step(state, step, a.rank, a.world)
            mgr.log(step, loss=float.fromhex(losses[step]))
            if mgr.preempted():
                result = mgr.save_on_preemption(step, state)
                committed = time.monotonic()
                break
            # (slow: one save, so that the loop is not held in save() by the slow writer)
            if step % SAVE_EVERY == 0 and (not a.slow or step == SAVE_EVERY):
                mgr.save(step, state)
        if result is None:
            return {"error": f"no preemption notice within {MAX_STEPS} steps", "exit_code": 3}
        signals = mgr.preemption.count if mgr.preemption is not None else 0
    return {
        "result": dataclasses.asdict(result),
        "committed_at": committed,
        "notice_at": committed - result.since_notice if result.since_notice is not None else None,
        "losses": losses,
        "signals": signals,
        "exit_code": result.exit_code,
    }


def resume(a: argparse.Namespace, pg: Any) -> dict[str, Any]:
    import savepoint as sp

    state = build(a.rank, a.world)
    extra: dict[str, Any] = {} if pg is None else {"process_group": pg}
    with sp.CheckpointManager(a.run, keep_last=KEEP_LAST, **extra) as mgr:
        restored = mgr.restore(state)
        assert restored is not None and state["step"] == restored, (restored, state["step"])
        resumed = {
            s: train_step(state, s, a.rank, a.world)
            for s in range(restored + 1, restored + RESUME_STEPS + 1)
        }
        mgr.save(restored + RESUME_STEPS, state)
        mgr.wait()
        steps = mgr.steps()
    reference_state = build(a.rank, a.world)
    reference = {
        s: train_step(reference_state, s, a.rank, a.world)
        for s in range(1, restored + RESUME_STEPS + 1)
    }
    return {"restored": restored, "resumed": resumed, "reference": reference, "steps": steps}


if __name__ == "__main__":
    main()
