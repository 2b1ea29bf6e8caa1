"""Collectives that turn a failure on any rank into one error on every rank.

Every distributed step is :meth:`Coordinator.step`: each rank runs its local part and keeps the
result or the exception; rank 0 gathers them all; if every rank succeeded, rank 0 combines the
results (builds the global plan, commits the manifest...); then rank 0 sends each rank its answer,
or the list of failures, and every rank returns the answer or raises the same
DistributedCheckpointError naming the failing ranks. A rank that dies makes the collective fail
on the others (gloo notices a closed connection at once); a rank that hangs makes it time out
after ``timeout`` seconds. Either way the others raise instead of hanging, and rank 0 runs the
step's cleanup (removing a half-written staging directory) first.

Deadlines: each step names its phase (``phase=``, ``combine_phase=`` for rank 0's combining)
and its object (``path``); a rank waits at most ``timeout`` seconds at each point where the ranks
meet, and the first to give up writes the verdict every rank raises, naming the ranks that had
not reached the point (:mod:`savepoint.distributed.deadlines`).

Transport: a gloo process group created for savepoint alone, over the same ranks as the caller's
group, so these collectives can never interleave with the training's own (NCCL or gloo) ones. It is
a ``ProcessGroupGloo`` built directly on a prefix of the default store, not ``dist.new_group``:
``new_group`` either needs every rank of the world to call it (ranks outside a subgroup never call
``save``) or, with ``use_local_synchronization``, names groups by how many each process has
created, which desynchronises later groups once a subgroup got one. Objects travel pickled in
memory between the ranks of one job (torch's own object collectives do the same); nothing is ever
pickled to disk.

Without a process group (a single process, e.g. loading a sharded checkpoint whole) the
:class:`LocalCoordinator` runs the same steps in process and lets the original exception through.
"""

from __future__ import annotations

import abc
import pickle
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from savepoint.distributed import channels
from savepoint.distributed.deadlines import Verdict, give_up, watch
from savepoint.distributed.plan import PlanError
from savepoint.engine import collector
from savepoint.errors import CheckpointError, DistributedCheckpointError, UnsupportedStateError
from savepoint.options import check_process_group

__all__ = [
    "Coordinator",
    "DEFAULT_TIMEOUT",
    "LocalCoordinator",
    "NAMING_GRACE",
    "TorchCoordinator",
    "coordinator",
    "describe",
    "encoded",
    "gc_paused",
]

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_TIMEOUT = 1800.0  # seconds, as torch.distributed's default process group timeout
NAMING_GRACE = 3.0  # seconds a slower rank gets to show it finished, before it is named as failed


class _CollectiveError(RuntimeError):
    """A collective on savepoint's group failed (a peer died, closed, or timed out), or the group
    could not be set up. Internal: :meth:`TorchCoordinator.step`, the only way in, turns it into
    the DistributedCheckpointError every rank raises, so users never see it."""


class _Failed:
    __slots__ = ("combining", "errors")

    def __init__(self, errors: dict[int, str], combining: bool = False) -> None:
        self.errors = errors
        self.combining = combining  # rank 0's combine failed (not a rank's local part)


def describe(exc: BaseException) -> str:
    if isinstance(exc, CheckpointError):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{type(exc).__name__}: {exc.strerror}{where}"
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()


class Coordinator(abc.ABC):
    """The ranks taking part in one save or load. ``rank`` and ``world_size`` are relative to
    the caller's process group."""

    rank: int = 0
    world_size: int = 1
    timeout: float = DEFAULT_TIMEOUT

    def exclusive(self) -> AbstractContextManager[Any]:
        """Held for a whole save or load: within one process, the steps of two operations on
        the same group (a background save and a load, say) never interleave."""
        return gc_paused()

    @abc.abstractmethod
    def step(
        self,
        what: str,
        path: str,
        local: Callable[[], T],
        combine: Callable[[list[T]], Any] | None = None,
        *,
        each: bool = False,
        cleanup: Callable[[], None] | None = None,
        phase: str | None = None,
        combine_phase: str | None = None,
    ) -> Any:
        """Run ``local`` on every rank, then ``combine`` on rank 0 with every rank's result.

        ``combine`` returns the answer for every rank (``each=False``: one answer, broadcast) or
        a list with one answer per rank (``each=True``: scattered). Without ``combine`` every
        rank gets None. ``cleanup`` runs on rank 0 when the step failed anywhere. ``phase``
        names the local part in errors ("save: write"; default ``what``), ``combine_phase``
        rank 0's combining ("save: commit"; default ``phase``); ``path`` is their object.
        """

    # -- data collectives (read-once loads): uint8 buffers as tensors, never pickled ----------

    moves_data: bool = False  # whether the three below exist beyond one rank

    def all_flags(self, flag: int, *, phase: str | None = None) -> list[int]:
        """Every rank's ``flag`` (a small integer), in rank order, on every rank: a point where
        the ranks meet, ``phase`` naming what each did before it (default: the step's)."""
        if self.world_size == 1:
            return [flag]
        raise NotImplementedError(f"{type(self).__name__} moves no data between ranks")

    def broadcast_bytes(self, buf: Any, root: int) -> None:
        """Fill ``buf`` (a contiguous, writable uint8 numpy array of the same length on every
        rank) with what rank ``root`` holds in its ``buf``."""
        if self.world_size == 1:
            return
        raise NotImplementedError(f"{type(self).__name__} moves no data between ranks")

    def exchange_bytes(
        self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]], tag: int
    ) -> None:
        """Send each ``(rank, buf)`` of ``sends`` to its rank and fill each ``(rank, buf)`` of
        ``recvs`` from its rank (at most one message per pair and ``tag``; uint8 numpy arrays,
        the receiver's the sender's length); all are posted before any is waited for."""
        if not sends and not recvs:
            return
        raise NotImplementedError(f"{type(self).__name__} moves no data between ranks")


class LocalCoordinator(Coordinator):
    """One process, no process group: the step runs in place; exceptions pass through."""

    def step(
        self,
        what: str,
        path: str,
        local: Callable[[], T],
        combine: Callable[[list[T]], Any] | None = None,
        *,
        each: bool = False,
        cleanup: Callable[[], None] | None = None,
        phase: str | None = None,
        combine_phase: str | None = None,
    ) -> Any:
        try:
            value = local()
            if combine is None:
                return None
            try:
                answer = combine([value])
            except PlanError as exc:
                raise UnsupportedStateError(f"{path}: {exc}") from None
            return answer[0] if each else answer
        except BaseException:
            if cleanup is not None:
                cleanup()
            raise


class TorchCoordinator(Coordinator):
    """The ranks of a torch.distributed process group, talking over savepoint's own gloo group."""

    def __init__(self, process_group: Any, timeout: float | None) -> None:
        check_process_group(process_group, label="argument")
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(process_group))
        me = dist.get_rank()
        if me not in ranks:
            raise CheckpointError(
                f"this process (global rank {me}) is not a member of the process group it passed"
            )
        self.rank = ranks.index(me)
        self.world_size = len(ranks)
        self.timeout = float(timeout) if timeout is not None else DEFAULT_TIMEOUT
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, not {timeout!r}")
        self._ranks = ranks
        self._channel = channels.channel(ranks, self.timeout) if self.world_size > 1 else None

    # -- the dedicated group ----------------------------------------------------------------

    def _ensure_group(self) -> Any:
        assert self._channel is not None
        try:
            return self._channel.group(self.rank, len(self._ranks))
        except Exception as exc:
            raise _CollectiveError(
                f"could not set up savepoint's gloo group of {len(self._ranks)} ranks: "
                f"{_short(exc)}"
            ) from exc

    # -- object collectives (rank 0 is the root) ----------------------------------------------

    def _call(self, fn: Callable[[], R]) -> R:
        try:
            result = fn()
            self._synced_at = time.monotonic()
            return result
        except _CollectiveError:
            raise
        except Exception as exc:  # gloo raises RuntimeError / DistBackendError subclasses
            channels.forget(self._ranks, self.timeout)
            raise _CollectiveError(_short(exc)) from exc

    def _gather_objects(self, obj: Any) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        return self._call(lambda: _gather(self._ensure_group(), obj, self.rank, self.world_size))

    def _broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        return self._call(lambda: _broadcast(self._ensure_group(), obj, self.rank))

    def _scatter_objects(self, objs: Sequence[Any] | None) -> Any:
        if self.world_size == 1:
            assert objs is not None
            return objs[0]
        return self._call(lambda: _scatter(self._ensure_group(), objs, self.rank, self.world_size))

    # -- data collectives ---------------------------------------------------------------------

    moves_data = True

    def all_flags(self, flag: int, *, phase: str | None = None) -> list[int]:
        if self.world_size == 1:
            return [flag]
        channel = self._channel
        assert channel is not None
        self._data_phase = phase or self._op[2]
        self._point = point = channel.next_step()
        self._arrive(point)
        try:
            return self._call(lambda: _sizes(self._ensure_group(), flag, self.world_size))
        except _CollectiveError as exc:
            raise self._broke(
                self._give_up(point, self._data_phase, self._everyone(), exc)
            ) from exc

    def broadcast_bytes(self, buf: Any, root: int) -> None:
        if self.world_size == 1 or not len(buf):
            return
        import torch
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = root
        tensor = torch.from_numpy(buf)
        self._data(lambda: self._ensure_group().broadcast([tensor], opts).wait())

    def exchange_bytes(
        self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]], tag: int
    ) -> None:
        import torch

        def run() -> None:
            group = self._ensure_group()
            works = [group.send([torch.from_numpy(b)], r, tag) for r, b in sends if len(b)]
            works += [group.recv([torch.from_numpy(b)], r, tag) for r, b in recvs if len(b)]
            for work in works:
                work.wait()

        if sends or recvs:
            self._data(run)

    def _data(self, fn: Callable[[], None]) -> None:
        """A data collective between two points (every rank has reached the last one)."""
        try:
            self._call(fn)
        except _CollectiveError as exc:
            raise self._broke(self._give_up(self._point, self._data_phase, [], exc)) from exc

    def _broke(self, verdict: Verdict) -> DistributedCheckpointError:
        """The error of a data collective that failed: the step it runs in raises it as is."""
        what, path, _ = self._op
        self._broken = verdict.error(what, path)
        return self._broken

    # -- the step protocol -------------------------------------------------------------------

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        lock = self._channel.lock if self._channel is not None else None
        if lock is not None and not lock.acquire(timeout=self.timeout):
            raise DistributedCheckpointError(
                f"another sharded save or load over these ranks in this process has not finished "
                f"within {self.timeout:g} s (timeout=): this one cannot start"
            )
        try:
            with gc_paused():
                yield
        finally:
            if lock is not None:
                lock.release()

    def step(
        self,
        what: str,
        path: str,
        local: Callable[[], T],
        combine: Callable[[list[T]], Any] | None = None,
        *,
        each: bool = False,
        cleanup: Callable[[], None] | None = None,
        phase: str | None = None,
        combine_phase: str | None = None,
    ) -> Any:
        phase = phase or what
        combine_phase = combine_phase or phase
        self._begin(what, path, phase, cleanup)
        own: BaseException | None = None
        with self._watch():
            try:
                outcome: tuple[bool, Any] = (True, local())
            except Exception as exc:
                broken = self._broken
                if broken is not None:  # a data collective of this step failed: the group is gone
                    if self.rank == 0 and cleanup is not None:
                        cleanup()
                    if exc is broken:
                        raise
                    raise broken from exc
                own = exc
                outcome = (False, describe(exc))
        channel = self._channel
        number = channel.next_step() if channel is not None else 0
        answered = 0  # the point rank 0's answer is waited for at, once every rank reported
        try:
            self._arrive(number, own)
            gathered = self._gather_objects(outcome)
            answered = channel.next_step() if channel is not None else 0
            reply: Any = None
            if self.rank == 0:
                assert gathered is not None
                self._op = (what, path, combine_phase)
                with self._watch(answered):
                    reply = self._combine(gathered, combine, each)
                if isinstance(reply, _Failed) and cleanup is not None:
                    cleanup()
                self._arrive(answered, own)
            if each:
                replies = None
                if self.rank == 0:
                    replies = [reply] * self.world_size if isinstance(reply, _Failed) else reply
                answer = self._scatter_objects(replies)
            else:
                answer = self._broadcast_object(reply)
        except _CollectiveError as exc:
            if self.rank == 0 and cleanup is not None:
                cleanup()
            if not answered:
                verdict = self._give_up(number, phase, self._everyone(), exc, own)
            else:  # waiting for rank 0's answer (rank 0: a rank died after the gather)
                waited_for = [0] if self.rank != 0 else []
                verdict = self._give_up(answered, combine_phase, waited_for, exc, own)
            mine = {self.rank: describe(own)} if own is not None else None
            raise verdict.error(what, path, mine) from (own or exc)
        if isinstance(answer, _Failed):
            failed = combine_phase if answer.combining else phase
            raise self._failed(what, path, answer.errors, failed) from own
        return answer

    def _failed(
        self, what: str, path: str, errors: dict[int, str], phase: str
    ) -> DistributedCheckpointError:
        """The error of a step in which ranks reported errors of their own."""
        failing = sorted(errors)
        by_message: dict[str, list[int]] = {}
        for r in failing:
            by_message.setdefault(errors[r], []).append(r)
        if len(by_message) == 1:
            details = "\n" + _indent(next(iter(by_message)))
        else:
            details = "".join(
                f"\n  {_ranks(rs)}:\n{_indent(message, 4)}" for message, rs in by_message.items()
            )
        return DistributedCheckpointError(
            f"{what} {path} failed on {_ranks(failing)} of {self.world_size}:{details}",
            path=path,
            errors=errors,
            phase=phase,
        )

    # -- points and verdicts -----------------------------------------------------------------

    _op: tuple[str, str, str] = ("", "", "")  # what, path and phase of the step running
    _broken: DistributedCheckpointError | None = None  # set when a data collective failed
    _cleanup: Callable[[], None] | None = None
    _point = 0  # the last point a data collective met at
    _synced_at: float | None = None  # when this rank's last collective completed
    _data_phase = ""

    def _begin(self, what: str, path: str, phase: str, cleanup: Callable[[], None] | None) -> None:
        self._op, self._broken, self._cleanup = (what, path, phase), None, cleanup

    def _everyone(self) -> list[int]:
        return list(range(self.world_size))

    def _watch(self, waited_at: int = 0) -> AbstractContextManager[Any]:
        """This rank's part of the phase running, watched; the others wait for it at point
        ``waited_at`` (0: the next point)."""
        channel = self._channel
        if channel is None:
            return nullcontext()
        point = (lambda: waited_at) if waited_at else (lambda: channel.steps + 1)
        return watch(channel.board, self.rank, point, *self._op[:2], self.timeout)

    def _arrive(self, point: int, own: BaseException | None = None) -> None:
        """Record that this rank reached ``point``; if the others gave up on it already (this
        rank is late), raise their verdict's error at once instead of joining the collective."""
        channel = self._channel
        if channel is None:
            return
        channel.board.done(self.rank, point)
        # The others wait at most ``timeout`` from about when this rank left the last point:
        # a verdict can only be there if that was long ago (or at an operation's first point).
        synced = self._synced_at
        if synced is not None and time.monotonic() - synced < self.timeout / 2:
            return
        verdict = channel.board.verdict(point)
        if verdict is None:
            return
        channels.forget(self._ranks, self.timeout)
        if self.rank == 0 and self._cleanup is not None:
            self._cleanup()
        what, path, _ = self._op
        mine = {self.rank: describe(own)} if own is not None else None
        raise self._broke(verdict) if mine is None else verdict.error(what, path, mine)

    def _give_up(
        self,
        point: int,
        phase: str,
        waited_for: Sequence[int],
        exc: BaseException,
        own: BaseException | None = None,
    ) -> Verdict:
        """The verdict on ``point``, whose collective failed here with ``exc`` (see
        :func:`.deadlines.give_up`)."""
        mine = Verdict.of(phase, self._op[1], self.timeout, self.rank, self.world_size, exc)
        if own is not None:
            mine.errors[self.rank] = describe(own)
        channel, grace = self._channel, min(NAMING_GRACE, self.timeout / 2)
        return mine if channel is None else give_up(channel.board, point, mine, waited_for, grace)

    def _combine(
        self, gathered: list[tuple[bool, Any]], combine: Callable[[list[T]], Any] | None, each: bool
    ) -> Any:
        errors = {r: v for r, (ok, v) in enumerate(gathered) if not ok}
        if errors:
            return _Failed(errors)
        if combine is None:
            return [None] * self.world_size if each else None
        try:
            return combine([v for _, v in gathered])
        except PlanError as exc:
            return _Failed({r: str(exc) for r in (exc.ranks or [0])}, combining=True)
        except Exception as exc:
            return _Failed({0: describe(exc)}, combining=True)


def _short(exc: BaseException) -> str:
    """gloo's message without its source location and boilerplate advice."""
    text = (str(exc).splitlines() or [repr(exc)])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(" This is typically caused", 1)[0].rstrip(". ")


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _indent(text: str, by: int = 2) -> str:
    return "\n".join(" " * by + line for line in text.splitlines())


def gc_paused() -> AbstractContextManager[None]:
    """The cyclic garbage collector paused for one save or load (``engine.collector.paused``:
    nested and thread-safe, so a background save's pause and the trainer's own never re-enable
    the collector under each other).

    Planning allocates thousands of small containers; in a training process holding millions of
    objects that can trigger a full collection in the middle of a save (a 160 ms pause was
    measured on a 1 GiB save of about 0.35 s, on the rank whose result everyone waits for). The
    plan data is acyclic, so nothing is lost: collection resumes when the operation returns.
    """
    return collector.paused()


def coordinator(process_group: Any, timeout: float | None) -> Coordinator:
    if process_group is None:
        return LocalCoordinator()
    return TorchCoordinator(process_group, timeout)


def encoded(obj: Any) -> bytes:
    """The payload an object collective sends for ``obj`` (also :mod:`.simulate`'s)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _encode(obj: Any) -> Any:
    import torch

    data = encoded(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)


def _decode(t: Any, n: int) -> Any:
    # In-memory transport between the ranks of one job, never a file.
    return pickle.loads(t[:n].numpy().tobytes())


def _sizes(group: Any, n: int, world: int) -> list[int]:
    import torch

    mine = torch.tensor([n], dtype=torch.int64)
    out = [[torch.zeros(1, dtype=torch.int64) for _ in range(world)]]
    group.allgather(out, [mine]).wait()
    return [int(t.item()) for t in out[0]]


def _padded(t: Any, size: int) -> Any:
    import torch

    out = torch.zeros(max(size, 1), dtype=torch.uint8)
    out[: t.numel()] = t
    return out


def _gather(group: Any, obj: Any, rank: int, world: int) -> list[Any] | None:
    import torch
    import torch.distributed as dist

    data = _encode(obj)
    sizes = _sizes(group, data.numel(), world)
    longest = max(sizes)
    opts = dist.GatherOptions()
    opts.rootRank = 0
    outputs = (
        [[torch.empty(max(longest, 1), dtype=torch.uint8) for _ in range(world)]]
        if rank == 0
        else []
    )
    group.gather(outputs, [_padded(data, longest)], opts).wait()
    if rank != 0:
        return None
    return [_decode(t, n) for t, n in zip(outputs[0], sizes)]


def _broadcast(group: Any, obj: Any, rank: int) -> Any:
    import torch
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    data = _encode(obj) if rank == 0 else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
    group.broadcast([size], opts).wait()
    n = int(size.item())
    buf = _padded(data, n) if data is not None else torch.empty(max(n, 1), dtype=torch.uint8)
    group.broadcast([buf], opts).wait()
    return _decode(buf, n)


def _scatter(group: Any, objs: Sequence[Any] | None, rank: int, world: int) -> Any:
    import torch
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    sizes = torch.zeros(world, dtype=torch.int64)
    encoded: list[Any] = []
    if rank == 0:
        assert objs is not None and len(objs) == world
        once: dict[int, Any] = {}  # an answer repeated (a reused plan's) is encoded once
        encoded = [
            once[id(o)] if id(o) in once else once.setdefault(id(o), _encode(o)) for o in objs
        ]
        sizes = torch.tensor([e.numel() for e in encoded], dtype=torch.int64)
    group.broadcast([sizes], opts).wait()
    longest = int(sizes.max().item())
    out = torch.empty(max(longest, 1), dtype=torch.uint8)
    sopts = dist.ScatterOptions()
    sopts.rootRank = 0
    inputs = [[_padded(e, longest) for e in encoded]] if rank == 0 else []
    group.scatter([out], inputs, sopts).wait()
    return _decode(out, int(sizes[rank].item()))
