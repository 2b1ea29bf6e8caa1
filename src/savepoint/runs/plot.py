"""Plots of a run or a sweep from the runs' ``report.json``: what ``savepoint report --plot``
draws. Implemented in :mod:`savepoint.runs._plot` (whose docstring says what each panel shows, when an
axis is logarithmic, which series get markers, where the best step's star and the legend go)."""

from __future__ import annotations

from savepoint.runs._plot import (
    FORMATS,
    LOG_SPAN,
    SPARSE,
    STAR_Z,
    check_output,
    figure,
    plot_reports,
)

__all__ = ["FORMATS", "LOG_SPAN", "SPARSE", "STAR_Z", "check_output", "figure", "plot_reports"]
