"""Start the ranks of a multi-process test session on 127.0.0.1 and collect their results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Session:
    scenario: str
    world: int
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    returncodes: dict[int, int | None] = field(default_factory=dict)
    output: dict[int, str] = field(default_factory=dict)
    elapsed: float = 0.0

    def checks(self) -> dict[tuple[int, str], str]:
        return {
            (rank, name): outcome
            for rank, result in self.results.items()
            for name, outcome in result["checks"].items()
        }

    def failures(self) -> str:
        lines = [
            f"rank {rank} {name}: {outcome}"
            for (rank, name), outcome in self.checks().items()
            if outcome != "ok"
        ]
        for rank in range(self.world):
            if rank not in self.results:
                lines.append(f"rank {rank} wrote no result; output:\n{self.output.get(rank, '')}")
        return "\n".join(lines)


def run(
    scenario: str,
    world: int,
    workdir: Path,
    *,
    timeout: float = 120,
    done_when: list[int] | None = None,
    worker: Path | None = None,
    env: dict[str, str] | None = None,
) -> Session:
    """Run ``scenario`` of ``worker`` (by default :data:`WORKER`, read at the call) on ``world``
    ranks, with ``env`` added to their environment. With ``done_when``, the session ends once those ranks
    have exited; the other ranks (a deliberately hung one) are then killed."""
    port = free_port()
    worker = WORKER if worker is None else worker
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), scenario, str(r), str(world), str(port), str(workdir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    session = Session(scenario, world)
    try:
        watched = done_when if done_when is not None else list(range(world))
        for r in watched:
            remaining = max(1.0, timeout - (time.monotonic() - start))
            try:
                out, _ = procs[r].communicate(timeout=remaining)
                session.output[r] = out
            except subprocess.TimeoutExpired:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for r, p in enumerate(procs):
            out, _ = p.communicate()
            session.output[r] = session.output.get(r, "") + (out or "")
            session.returncodes[r] = p.returncode
    session.elapsed = time.monotonic() - start
    for r in range(world):
        path = workdir / f"{scenario}-rank{r}.json"
        if path.exists():
            session.results[r] = json.loads(path.read_text())
    return session
