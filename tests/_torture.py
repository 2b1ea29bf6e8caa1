"""How hard the long campaigns push: ``make test`` runs a bounded slice, ``make torture`` the rest.

``SAVEPOINT_TORTURE_SCALE`` (default 1) multiplies the number of kills, races and free-space steps
in the fault tests; ``SAVEPOINT_TORTURE_SECONDS`` (default 0: each test's own short default) sets
how long the timed races run. ``make torture`` sets both.

A campaign sized with :func:`campaign` runs its small slice in ``make test`` (the suite must stay
within its time budget: docs/performance.md, "Test suite time") and its full size, times the
scale, under ``make torture``.
"""

from __future__ import annotations

import os

SCALE = max(1, int(os.environ.get("SAVEPOINT_TORTURE_SCALE", "1")))
SECONDS = float(os.environ.get("SAVEPOINT_TORTURE_SECONDS", "0"))
ENABLED = SCALE > 1 or SECONDS > 0 or os.environ.get("SAVEPOINT_TORTURE") == "1"


def scale(n: int) -> int:
    """``n`` in ``make test``; ``n * SAVEPOINT_TORTURE_SCALE`` in ``make torture``."""
    return n * SCALE


def seconds(default: float) -> float:
    """A timed race's duration: ``default`` in ``make test``, longer in ``make torture``."""
    return SECONDS if SECONDS > 0 else default


def campaign(quick: int, full: int) -> int:
    """A campaign's size: ``quick`` in ``make test``; ``full * SAVEPOINT_TORTURE_SCALE`` when the
    torture switch is on (``make torture``, or any of its variables set)."""
    return full * SCALE if ENABLED else quick
