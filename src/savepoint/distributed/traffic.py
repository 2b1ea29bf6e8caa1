"""What savepoint's object collectives hand to gloo, per rank: the traffic model of
:mod:`savepoint.distributed.collectives`, for the world simulator.

Each function mirrors one helper of ``collectives`` (``_sizes``, ``_gather``, ``_broadcast``,
``_scatter``) and records, for every rank, the gloo operations it runs and the bytes of the
tensors it passes in (``sent``) and gets filled (``recv``): a gather pads every rank's payload to
the longest one (so rank 0 receives ``world x longest``), a broadcast sends its length first, a
scatter broadcasts every length first. The tests record the same quantities on real gloo ranks
(a proxy around savepoint's group) and compare them with these, operation by operation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Op", "Traffic"]

INT = 8  # an int64 length


@dataclass(frozen=True)
class Op:
    kind: str  # the gloo operation: allgather, gather, broadcast, scatter
    sent: int  # bytes of the tensors this rank passes in
    recv: int  # bytes of the tensors it gets filled by the others (its own slot included)


@dataclass
class Traffic:
    """Per rank, the gloo operations of savepoint's collectives, in order."""

    world: int
    ops: list[list[Op]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.ops:
            self.ops = [[] for _ in range(self.world)]

    # -- the helpers of collectives ------------------------------------------------------------

    def sizes(self) -> None:
        """``_sizes``: every rank's int64, all-gathered (also :meth:`Coordinator.all_flags`)."""
        for ops in self.ops:
            ops.append(Op("allgather", INT, INT * self.world))

    def gather(self, sizes: Sequence[int]) -> None:
        """``_gather`` of payloads of ``sizes`` bytes (index = rank) to rank 0."""
        self.sizes()
        padded = max(max(sizes), 1)
        for r, ops in enumerate(self.ops):
            ops.append(Op("gather", padded, padded * self.world if r == 0 else 0))

    def broadcast(self, size: int) -> None:
        """``_broadcast`` of a ``size``-byte payload from rank 0."""
        for n in (INT, max(size, 1)):
            for r, ops in enumerate(self.ops):
                ops.append(Op("broadcast", n, 0) if r == 0 else Op("broadcast", 0, n))

    def scatter(self, sizes: Sequence[int]) -> None:
        """``_scatter`` of one payload per rank (``sizes`` bytes) from rank 0."""
        lengths = INT * self.world
        padded = max(max(sizes), 1)
        for r, ops in enumerate(self.ops):
            ops.append(Op("broadcast", lengths, 0) if r == 0 else Op("broadcast", 0, lengths))
            ops.append(Op("scatter", padded * self.world if r == 0 else 0, padded))

    # -- totals ------------------------------------------------------------------------------

    def messages(self, rank: int) -> int:
        return len(self.ops[rank])

    def sent(self, rank: int) -> int:
        return sum(op.sent for op in self.ops[rank])

    def received(self, rank: int) -> int:
        return sum(op.recv for op in self.ops[rank])

    def mark(self) -> int:
        """How many operations rank 0 has run so far (for :meth:`since`)."""
        return len(self.ops[0])

    def since(self, mark: int) -> Traffic:
        """The operations after ``mark`` (every rank runs the same number)."""
        return Traffic(self.world, [ops[mark:] for ops in self.ops])
