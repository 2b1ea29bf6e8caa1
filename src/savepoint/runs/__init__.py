"""Training runs: which checkpoints a run directory holds, and which of them to keep.

- :mod:`~savepoint.runs.manager`: :class:`~savepoint.runs.manager.CheckpointManager` (save,
  restore, retention, aliases, the writer lock);
- :mod:`~savepoint.runs.policies`: retention and save policies;
- :mod:`~savepoint.runs.gc`: garbage collection of what failed or interrupted saves left;
- :mod:`~savepoint.runs.report`, :mod:`~savepoint.runs.view`, :mod:`~savepoint.runs.sweep`,
  :mod:`~savepoint.runs.plot`: a run's books, read-only views of runs, sweeps and plots;
- :mod:`~savepoint.runs.aliases`, :mod:`~savepoint.runs.layout`, :mod:`~savepoint.runs.lock`:
  ``latest/`` and ``best/``, the directory layout, the writer lock.

Public (docs/api.md): this package's ``__all__`` (run garbage collection, reading a report,
the consistency check, plots); the modules themselves are implementation.
"""

from savepoint._lazy import exports as _exports

# The public functions of the runs layer (docs/api.md), imported on first use (the manager and
# the plots are heavy). The manager, the view and the policies are public at the root
# (``sp.CheckpointManager``, ``sp.open_run``, ``sp.policies``).
_LAZY: dict[str, str] = {
    "collect": "savepoint.runs.gc",
    "figure": "savepoint.runs.plot",
    "load_report": "savepoint.runs.report",
    "plot_reports": "savepoint.runs.plot",
    "run_problems": "savepoint.runs.view",
}


__getattr__, __dir__ = _exports(globals(), _LAZY)
__all__ = sorted(_LAZY)
