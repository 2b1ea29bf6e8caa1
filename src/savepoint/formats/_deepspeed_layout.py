"""Where each parameter of a DeepSpeed ZeRO checkpoint lies in the ranks' flat fp32 partitions:
DeepSpeed's ``zero_to_fp32.py`` reconstruction, as element runs instead of concatenated tensors.

- ZeRO 1 and 2 (``single_partition_of_fp32_groups``): for each parameter group, the ranks'
  partitions, concatenated in rank order, are the group's flat vector; its parameters follow
  one another in ``param_shapes`` order, each followed by its alignment padding
  (``param_alignment_paddings``, when recorded). Checked as ``zero_to_fp32`` checks it: the
  elements consumed and those available agree once both are rounded up to ``2 * world_size``.
- ZeRO 3 (``fp32_flat_groups``): each rank's groups, concatenated, are its flat vector; every
  parameter (in ``param_shapes`` order, groups merged) takes ``ceil(numel / world_size)``
  elements of every rank's flat vector at the same offset; its value is those pieces in rank
  order, cut to ``numel``. Checked: every rank's flat vector is consumed exactly.

A *run* is ``(source, start, count)``: ``count`` elements from element ``start`` of the
``source``-th flat tensor (an index into the list the caller gave). Nothing here reads data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "LayoutError",
    "Run",
    "Slot",
    "zero2",
    "zero3",
]

Run = tuple[int, int, int]


class LayoutError(ValueError):
    """The partitions do not hold what the shapes need (worded for the message)."""


@dataclass(frozen=True)
class Slot:
    """One parameter: its name, shape and the runs holding its elements in C order."""

    name: str
    shape: tuple[int, ...]
    runs: tuple[Run, ...]


def _take(lengths: Sequence[int], first: int, start: int, count: int) -> list[Run]:
    """``count`` elements from ``start`` of the concatenation of the tensors ``first, first+1,
    ...`` whose lengths are ``lengths`` (indices into them offset by ``first``)."""
    runs: list[Run] = []
    index, at = 0, start
    while count > 0:
        while index < len(lengths) and at >= lengths[index]:
            at -= lengths[index]
            index += 1
        if index >= len(lengths):
            raise LayoutError("a parameter runs past the end of the partitions")
        n = min(count, lengths[index] - at)
        runs.append((first + index, at, n))
        count -= n
        at += n
    return runs


def zero2(
    shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
    partitions: Sequence[Sequence[int]],
    paddings: Sequence[Sequence[int]] | None,
) -> list[Slot]:
    """ZeRO 1/2: ``shapes[g]`` the (name, shape) of group ``g``'s parameters in order;
    ``partitions[r][g]`` the length of rank ``r``'s partition of group ``g``; the flat tensors
    are numbered rank by rank (``r * groups + g``)."""
    world = len(partitions)
    groups = len(shapes)
    if any(len(p) != groups for p in partitions):
        raise LayoutError(f"ranks hold {[len(p) for p in partitions]} groups, the shapes {groups}")
    if paddings is not None and len(paddings) != groups:
        raise LayoutError("param_alignment_paddings does not have one entry per group")
    align = 2 * world
    slots: list[Slot] = []
    for g, named in enumerate(shapes):
        lengths = [partitions[r][g] for r in range(world)]
        ids = [r * groups + g for r in range(world)]
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(named):
            raise LayoutError(f"group {g}: {len(pads)} paddings for {len(named)} parameters")
        offset = 0
        for i, (name, shape) in enumerate(named):
            numel = math.prod(shape)
            runs = _take(lengths, 0, offset, numel)
            slots.append(Slot(name, shape, tuple((ids[s], a, n) for s, a, n in runs)))
            offset += numel + (pads[i] if pads is not None else 0)
        avail = sum(lengths)
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise LayoutError(f"group {g}: consumed {offset} elements out of {avail}")
    return slots


def zero3(
    shapes: Sequence[tuple[str, tuple[int, ...]]], partitions: Sequence[Sequence[int]]
) -> list[Slot]:
    """ZeRO 3: ``shapes`` every parameter in order (groups merged); ``partitions[r][g]`` the
    length of rank ``r``'s flat group ``g``, numbered rank by rank (``r * groups + g``)."""
    world = len(partitions)
    groups = len(partitions[0]) if partitions else 0
    if any(list(p) != list(partitions[0]) for p in partitions):
        raise LayoutError("the ranks' flat groups differ in length")
    slots: list[Slot] = []
    offset = 0
    for name, shape in shapes:
        numel = math.prod(shape)
        part = math.ceil(numel / world) if world else 0
        runs: list[Run] = []
        for r in range(world):
            runs += _take(partitions[r], r * groups, offset, part)
        slots.append(Slot(name, shape, tuple(_cut(runs, numel))))
        offset += part
    available = sum(partitions[0]) if partitions else 0
    if offset != available:
        raise LayoutError(f"consumed {offset} elements of each rank's {available}")
    return slots


def _cut(runs: list[Run], count: int) -> list[Run]:
    """The first ``count`` elements of ``runs``."""
    out: list[Run] = []
    for source, start, n in runs:
        if count <= 0:
            break
        out.append((source, start, min(n, count)))
        count -= min(n, count)
    return out
