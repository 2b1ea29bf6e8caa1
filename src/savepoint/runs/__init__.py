"""Training runs: which checkpoints a run directory holds, and which of them to keep.

- :mod:`~savepoint.runs.manager`: :class:`~savepoint.runs.manager.CheckpointManager` (save,
  restore, retention, aliases, the writer lock);
- :mod:`~savepoint.runs.policies`: retention and save policies;
- :mod:`~savepoint.runs.gc`: garbage collection of what failed or interrupted saves left;
- :mod:`~savepoint.runs.report`, :mod:`~savepoint.runs.view`, :mod:`~savepoint.runs.sweep`,
  :mod:`~savepoint.runs.plot`: a run's books, read-only views of runs, sweeps and plots;
- :mod:`~savepoint.runs.aliases`, :mod:`~savepoint.runs.layout`, :mod:`~savepoint.runs.lock`:
  ``latest/`` and ``best/``, the directory layout, the writer lock.
"""

__all__: list[str] = []
