"""How hard the long campaigns push: ``make test`` runs a bounded slice, ``make torture`` the rest.

``SAVEPOINT_TORTURE_SCALE`` (default 1) multiplies the number of kills, races and free-space steps
in the fault tests; ``SAVEPOINT_TORTURE_SECONDS`` (default 0: each test's own short default) sets
how long the timed races run. ``make torture`` sets both.
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
