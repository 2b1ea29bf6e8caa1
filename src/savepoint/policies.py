"""Which checkpoints to write, and which to keep: the policies of ``CheckpointManager``
(``sp.policies``; their home is :mod:`savepoint.runs.policies`, whose names this public module
holds: import them from here, ``from savepoint.policies import KeepLatest, KeepBest``)."""

from savepoint.runs import policies as _policies
from savepoint.runs.policies import *  # noqa: F403  (exactly the names of its __all__)

__all__ = list(_policies.__all__)
