"""The peer-memory tier: copies of each checkpoint in the memory of other nodes, for recovery in
seconds after a lost node, onto any world size (docs/peers.md).

``sp.Tier.peers(replicas=1, node=None, memory_dir=None, budget=None)`` in a manager's ``tiers``
(:class:`PeerTier`). After every committed save (sync, async, a preemption save) each rank of the
manager's process group keeps its part of the checkpoint (the data files it wrote, the
manifest, and of a manifest version 7 its index file) in its node's memory, a folder under
``memory_dir`` (``/dev/shm/savepoint-peers`` by default: a tmpfs, which outlives the training
processes), and sends it to ``replicas`` ranks on other nodes, which keep it in theirs (:mod:`savepoint.runs._peer_replicate`). This runs on a
thread of its own: ``save`` does not wait for it; the next ``save``, ``wait()`` and ``close()``
do, and raise (once) what failed, as CheckpointWriteError naming the step and the ranks.

A node is a host (``node`` defaults to the host name; the environment variable
``SAVEPOINT_NODE`` overrides that default): on one machine, give each group of ranks its own to
simulate several. The node's folder is ``<memory_dir>/<run id>/<node>/``.

``restore()`` and ``peek()`` (called on every rank) read peer memory first: the ranks tell each
other which copies their nodes hold, the newest step whose every part has a verified copy on a
live node is restored (each rank fetches the files its load needs from its own node's memory or
from a rank on a node holding them, each file checked against the XXH3-64 its copy recorded,
then the same loader as a disk load reads them: any world size), and ``mgr.restored_from`` is
``"peer memory"``. A copy that does not verify, or a rank that does not answer within
``timeout``, makes the restore take another copy, or the next source (the run directory, the
tiers), with a warning naming it (:mod:`savepoint.runs._peer_restore`).

Memory: each node keeps its copies within ``budget`` bytes, deleting the oldest first, never the
newest step known to be complete (``budget=None``: only that one, and a newer one being
replicated). ``savepoint ls`` shows what each node folder it can see holds (:func:`usage`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from savepoint.errors import (
    CheckpointArgumentError,
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from savepoint.runs._peer_folder import NodeFolder, PartRecord
from savepoint.runs._peer_replicate import Outcome, Replication
from savepoint.runs._peer_wire import Wire
from savepoint.storage.paths import PathArg

__all__ = ["NODE_ENV", "PEER_MEMORY", "PeerMemory", "PeerTier", "default_memory_dir", "usage"]

log = logging.getLogger("savepoint.runs.peers")

NODE_ENV = "SAVEPOINT_NODE"
PEER_MEMORY = "peer memory"  # restored_from, and what messages call the tier


def default_memory_dir() -> str:
    """``/dev/shm/savepoint-peers`` (a tmpfs on Linux), else one under the temporary folder."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) else tempfile.gettempdir()
    return os.path.join(base, "savepoint-peers")


@dataclasses.dataclass(frozen=True)
class PeerTier:
    """The peer-memory tier (see the module docstring): ``replicas`` copies of each part on
    other nodes; ``node``: this process's node (None: ``$SAVEPOINT_NODE``, else the host name);
    ``memory_dir``: where nodes keep their copies (None: :func:`default_memory_dir`);
    ``budget``: bytes each node may keep (None: the newest complete step only); ``timeout``:
    seconds a rank that shows no sign of life is waited for."""

    replicas: int = 1
    node: str | None = None
    memory_dir: str | None = None
    budget: int | None = None
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise TypeError(f"Tier.peers replicas must be an int, not {self.replicas!r}")
        if self.replicas < 0:
            raise ValueError(f"Tier.peers replicas must be 0 or more, not {self.replicas}")
        if self.node is not None:
            _check_node(self.node, "node")
        if self.memory_dir is not None:
            if not isinstance(self.memory_dir, (str, os.PathLike)):
                raise TypeError(f"Tier.peers memory_dir must be a path, not {self.memory_dir!r}")
            object.__setattr__(self, "memory_dir", os.fspath(self.memory_dir))
            _check_memory_dir(self.memory_dir)
        if self.budget is not None and (
            isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1
        ):
            raise ValueError(
                f"Tier.peers budget must be a positive int (bytes), not {self.budget!r}"
            )
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
            raise TypeError(f"Tier.peers timeout must be a number of seconds, not {self.timeout!r}")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"Tier.peers timeout must be positive, not {self.timeout!r}")

    @property
    def label(self) -> str:
        return PEER_MEMORY

    def node_name(self) -> str:
        """This process's node: ``node``, else ``$SAVEPOINT_NODE``, else the host name."""
        if self.node is not None:
            return self.node
        env = os.environ.get(NODE_ENV)
        if env:
            return _check_node(env, NODE_ENV)
        return _check_node(socket.gethostname() or "host", "the host name")

    def root(self) -> str:
        return self.memory_dir if self.memory_dir is not None else default_memory_dir()


def _check_memory_dir(path: str) -> None:
    """A local folder (the node's memory: a tmpfs), not a URL or a file: either would fail only
    when the first save is replicated."""
    if "://" in path:
        raise CheckpointArgumentError(
            f"Tier.peers memory_dir must be a local directory (a tmpfs, /dev/shm/...), not the "
            f"URL {path!r}: put a store's URL in an sp.Tier(...)",
            path=path,
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointArgumentError(
            f"Tier.peers memory_dir {path!r} is a file, not a directory", path=path
        )


def _check_node(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name or name.startswith(".") or "/" in name or "\0" in name:
        raise ValueError(
            f"Tier.peers {what} must name a node (a non-empty name without '/' that does not "
            f"start with '.'), not {name!r}"
        )
    return name


class PeerMemory:
    """The tier at work for one manager on this rank (see the module docstring): ``tier`` as
    asked, the manager's ``process_group`` (None: one process), ``run_id``: the run's id as this
    rank knows it (rank 0's is the one used)."""

    def __init__(self, tier: PeerTier, process_group: Any, run_id: str | None) -> None:
        self.tier = tier
        self.node = tier.node_name()
        self.wire = Wire(process_group, float(tier.timeout))
        self.run_id = run_id
        self.folder: NodeFolder | None = None
        self.replication: Replication | None = None
        self.last: Outcome | None = None  # the last replication's outcome
        self._lock = threading.Lock()
        self._hello_lock = threading.Lock()
        self._pending: set[int] = set()
        self._errors: list[CheckpointWriteError] = []
        self._futures: list[Future[None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._restore: Any = None

    # -- the first contact -------------------------------------------------------------------

    def ready(self) -> NodeFolder:
        """The node folder, once the ranks told each other their nodes and rank 0 the run's id
        (the first session of the tier: every rank at once)."""
        with self._hello_lock:
            if self.folder is not None:
                return self.folder
            with self.wire.session():
                mine = {"node": self.node, "run": self.run_id if self.wire.rank == 0 else None}
                hello = self.wire.gather("hello", mine)
            if hello.missing:
                raise CheckpointError(
                    f"{PEER_MEMORY}: {', '.join(f'rank {r}' for r in hello.missing)} did not "
                    f"answer within {self.tier.timeout:g} s (call restore() and save() on every "
                    "rank of the manager's process group)"
                )
            self.wire.nodes = [doc["node"] for doc in hello.values]
            run = hello.values[0]["run"] or "run"
            self.run_id = run
            folder = NodeFolder(os.path.join(self.tier.root(), run, self.node), self.node)
            folder.ensure(run, self.tier.budget)
            folder.clean()
            self.replication = Replication(self.wire, folder, self.tier.replicas, self.tier.budget)
            self.folder = folder
            return folder

    # -- replication (every committed save) --------------------------------------------------

    def submit(self, step: int, source: PathArg) -> None:
        """Replicate the committed checkpoint ``source`` of ``step``, in the background (every
        rank submits the same steps in the same order)."""
        with self._lock:
            self._pending.add(step)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="savepoint-peers")
            future = self._executor.submit(self._replicate, step, source)
            self._futures = [f for f in self._futures if not f.done()] + [future]

    def _replicate(self, step: int, source: PathArg) -> None:
        started = time.perf_counter()
        try:
            self.ready()
            assert self.replication is not None
            outcome = self.replication.run(step, source)
            # (until the outcome was agreed: the eviction of older copies that follows is
            # housekeeping, as a run directory's retention is not part of its save's time)
            outcome.seconds = outcome.agreed - started
            self.last = outcome
            if outcome.errors or not outcome.complete:
                self._fail(step, "; ".join(outcome.errors) or "not every part has a copy")
            else:
                log.info(
                    "%s: step %d replicated in %.3f s (copies: %s)",
                    PEER_MEMORY,
                    step,
                    outcome.seconds,
                    {p: nodes for p, nodes in sorted(outcome.copies.items())},
                )
        except BaseException as exc:  # kept, and raised by the manager's next call
            self._fail(step, f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._pending.discard(step)

    def _fail(self, step: int, why: str) -> None:
        error = CheckpointWriteError(
            f"{PEER_MEMORY}: step {step} was not replicated: {why}; the checkpoint is committed "
            "in the run directory, and the next save is replicated as usual"
        )
        log.warning("%s", error)
        with self._lock:
            self._errors.append(error)

    def pending_steps(self) -> set[int]:
        """Steps being replicated: the run directory must keep them until then."""
        with self._lock:
            return set(self._pending)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the replications submitted so far (at most ``timeout`` seconds): whether
        they are all done."""
        from concurrent.futures import wait as wait_for

        with self._lock:
            futures = list(self._futures)
        return not wait_for(futures, timeout=timeout).not_done

    def raise_error(self) -> None:
        """Raise (once) the first replication failure not yet reported."""
        with self._lock:
            if not self._errors:
                return
            error, self._errors = self._errors[0], []
        raise error

    def close(self) -> None:
        """Wait for the replications, then stop the worker thread."""
        self.wait()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self.wire.close()

    # -- restore -----------------------------------------------------------------------------

    def survey(self) -> set[int]:
        """The steps complete in peer memory (every rank at once; see the module docstring)."""
        from savepoint.runs._peer_restore import PeerRestore

        try:
            self.ready()
        except CheckpointError as exc:  # (every rank alike: rank 0's answer says who is missing)
            log.warning("%s is not read: %s", PEER_MEMORY, exc)
            return set()
        if self._restore is None:
            self._restore = PeerRestore(self)
        complete: set[int] = self._restore.survey()
        return complete

    def load(self, step: int, options: dict[str, Any]) -> Any:
        """Load step ``step`` from peer memory with ``sp.load``'s ``options`` (after
        :meth:`survey`; every rank at once)."""
        assert self._restore is not None
        return self._restore.load(step, options)


def usage(memory_dir: str, run_id: str) -> list[dict[str, Any]]:
    """What each node folder of run ``run_id`` under ``memory_dir`` holds (those this host can
    see): ``[{"node", "budget", "bytes", "steps": [{"step", "parts", "bytes"}]}]``."""
    from savepoint.codecs import bounded_json

    base = os.path.join(memory_dir, run_id)
    try:
        nodes = sorted(e for e in os.listdir(base) if not e.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for node in nodes:
        folder = NodeFolder(os.path.join(base, node), node)
        budget = None
        try:
            with open(os.path.join(folder.root, "node.json"), "rb") as f:
                doc = bounded_json.loads(f.read(1 << 16), CorruptCheckpointError, "node.json")
            budget = doc.get("budget") if isinstance(doc, dict) else None
        except (OSError, CorruptCheckpointError):
            pass
        parts: dict[int, dict[int, PartRecord]] = folder.parts()
        steps = [
            {"step": s, "parts": sorted(p), "bytes": sum(r.nbytes for r in p.values())}
            for s, p in sorted(parts.items())
        ]
        total = sum(int(s["bytes"]) for s in steps)  # type: ignore[call-overload]
        found.append({"node": node, "budget": budget, "bytes": total, "steps": steps})
    return found
