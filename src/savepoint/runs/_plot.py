"""Plots of a run or a sweep from the runs' ``report.json`` (``savepoint report --plot``; the
public names are in :mod:`savepoint.runs.plot`).

Panels. The first holds the losses: the training loss (``mgr.log(step, loss=...)``) and every
logged metric whose name contains "loss" (``val_loss``, ``eval_loss``), so training and validation
are compared at a glance. Every other metric gets a panel of its own. Every panel labels its axes
(x: "step") and marks with a dotted vertical line each step a run resumed from.

Scales. Loss-like panels (the loss panel, and a metric named like a loss: ``perplexity``, ``ppl``,
``nll``, ``mse``, ``rmse``, ``mae``) are drawn on a log y axis when their values are all positive
and span at least one order of magnitude (largest / smallest >= :data:`LOG_SPAN`, 10): a loss
falling from 10 to 0.05 is a flat line at zero on a linear axis. (Clipping the first steps' spike
instead would hide real values; a log axis shows them all.) ``log_y=True`` (``--log-y``) puts
every loss-like panel on a log axis whatever its span; ``log_y=False`` (``--linear-y``) keeps every
axis linear. Other metrics (accuracy, learning rate, ...) are always linear. A panel that would be
logarithmic but holds a value <= 0 stays linear (with ``log_y=True`` its title says so). A log
axis's label ends in "(log scale)".

Markers. A series of at most :data:`SPARSE` (30) points (evaluations at each save, say) gets a
marker per point; a denser one (the training loss of every step) is a plain line.

The best step. Each run's best checkpoint (``report.best``: its metric and step) is a star on the
panel of its metric (the loss panel for ``val_loss``), drawn above every line (z-order
:data:`STAR_Z`) and not clipped at the axes' edge.

Legend. One, for the whole figure, outside the panels on the right, each label once. A single
run: each series in its own colour ("train loss", "val_loss", "best val_loss (step N)",
"resumed from"); the figure's title names the run. A sweep: each run in its own colour and line
style throughout, labelled in the loss panel ("run: train loss", "run: val_loss"), or at its first
line elsewhere when it logged no loss.

matplotlib is optional (``pip install 'savepoint[plot]'``) and used through
``matplotlib.figure.Figure`` with the Agg canvas (no pyplot state, no display).
:func:`check_output` says, before any work, whether a path can be written (its folder exists,
matplotlib knows its extension).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from savepoint.runs.report import Report

__all__ = ["FORMATS", "LOG_SPAN", "SPARSE", "STAR_Z", "check_output", "figure", "plot_reports"]

# What the Agg backend writes (matplotlib's own list, for messages when it is not installed).
FORMATS = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "tif", "tiff", "webp", "eps", "ps")
LOG_SPAN = 10.0  # a loss-like panel whose values span this factor is drawn on a log axis
SPARSE = 30  # a series of at most this many points gets a marker per point
STAR_Z = 10  # the best step's star is drawn above every line (which are at z-order 2)
_MISSING = "plotting needs matplotlib: pip install 'savepoint[plot]'"
_LOSS_WORDS = frozenset({"perplexity", "ppl", "nll", "mse", "rmse", "mae"})
_STYLES = ("-", "--", ":", "-.")
_MARKERS = "os^vD"


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError(_MISSING) from None
    return matplotlib


def check_output(out: str | os.PathLike[str]) -> str | None:
    """Why a plot cannot be written to ``out`` (None when it can): matplotlib missing, a folder
    that does not exist, a path that is a directory, or an extension matplotlib cannot write."""
    path = os.fspath(out)
    try:
        _matplotlib()
    except ImportError as exc:
        return str(exc)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a directory; name the image file (for example {path}/run.png)"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist (create it first)"
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    known = sorted(FigureCanvasAgg(Figure()).get_supported_filetypes())
    if not ext:
        return f"{path} has no extension; name the format with one of .{', .'.join(known)}"
    if ext not in known:
        return f"matplotlib cannot write .{ext} files; use one of .{', .'.join(known)}"
    return None


def _in_loss_panel(metric: str) -> bool:
    return "loss" in metric.lower()


def _loss_like(metric: str) -> bool:
    """Drawn on a log axis when it spans orders of magnitude: losses, perplexity, errors."""
    words = set(re.split(r"[^a-z0-9]+", metric.lower()))
    return _in_loss_panel(metric) or bool(words & _LOSS_WORDS)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _points(report: Report, metric: str) -> list[tuple[int, float]]:
    return [
        (s, float(v[metric]))
        for s, v in sorted(report.metric_history.items())
        if _number(v.get(metric))
    ]


def _resumes(report: Report) -> list[int]:
    return sorted(
        {
            int(item["resumed_from"])
            for item in report.lineage
            if isinstance(item.get("resumed_from"), int)
            and not isinstance(item.get("resumed_from"), bool)
        }
    )


def _best(report: Report) -> tuple[str, int, float] | None:
    """(metric, step, value) of the run's best checkpoint, when the report says which."""
    best = report.best or {}
    metric, step = best.get("metric"), best.get("step")
    if not isinstance(metric, str) or not isinstance(step, int) or isinstance(step, bool):
        return None
    for value in (
        report.metric_history.get(step, {}).get(metric),
        (best.get("metrics") or {}).get(metric),
    ):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return metric, step, float(value)
    return None


def _scale(values: list[float], loss_like: bool, log_y: bool | None) -> tuple[str, str | None]:
    """("log" or "linear", a note for the title) for a panel holding ``values``."""
    if not loss_like or log_y is False or not values:
        return "linear", None
    positive = min(values) > 0
    if log_y is True:
        return ("log", None) if positive else ("linear", "linear: values <= 0")
    return ("log", None) if positive and max(values) >= LOG_SPAN * min(values) else ("linear", None)


def figure(reports: Sequence[Report], title: str, *, log_y: bool | None = None) -> Any:
    """The curves of ``reports`` as a ``matplotlib.figure.Figure`` (see the module docstring
    for what it shows; ``log_y``: None chooses per panel, True logs every loss-like panel,
    False none). Raises ImportError without matplotlib."""
    _matplotlib()
    from matplotlib.figure import Figure

    colors = [f"C{i}" for i in range(10)]  # matplotlib's default colour cycle
    metrics = sorted({k for r in reports for v in r.metric_history.values() for k in v})
    # A metric only ever logged as a non-number (a tag, a path) has no curve.
    metrics = [m for m in metrics if any(_points(r, m) for r in reports)]
    losses = [m for m in metrics if _in_loss_panel(m)]
    others = [m for m in metrics if not _in_loss_panel(m)]
    names = ["loss", *others]
    fig = Figure(figsize=(5.2 * len(names) + 1.8, 4.2), layout="constrained")
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    panel = dict(zip(names, axes))
    drawn: dict[str, list[float]] = {n: [] for n in names}
    several = len(reports) > 1
    legend: dict[str, Any] = {}  # label -> handle, first one wins

    def line(ax: Any, name: str, xs: Sequence[int], ys: Sequence[float], **style: Any) -> None:
        label = style.pop("label", None)
        if len(xs) <= SPARSE:
            style.setdefault("marker", "o")
            style.setdefault("markersize", 3.5)
        else:
            style["marker"] = None
        (handle,) = ax.plot(xs, ys, **style)
        drawn[name] += list(ys)
        if label is not None:
            legend.setdefault(label, handle)

    for i, r in enumerate(reports):
        run_color, run_style = colors[i % len(colors)], _STYLES[i % len(_STYLES)]
        labelled = False
        prefix = f"{r.name}: " if several else ""
        if r.loss_history:
            steps, values = zip(*r.loss_history)
            line(
                panel["loss"],
                "loss",
                steps,
                [float(v) for v in values],
                color=run_color if several else colors[0],
                linestyle=run_style if several else "-",
                linewidth=1.4,
                label=f"{prefix}train loss",
            )
            labelled = True
        for j, metric in enumerate(losses):
            points = _points(r, metric)
            if points:
                xs, ys = zip(*points)
                line(
                    panel["loss"],
                    "loss",
                    xs,
                    ys,
                    color=run_color if several else colors[(j + 1) % len(colors)],
                    linestyle=run_style if several else "--",
                    marker=_MARKERS[j % len(_MARKERS)],
                    linewidth=1.2,
                    label=f"{prefix}{metric}",
                )
                labelled = True
        for metric in others:
            points = _points(r, metric)
            if points:
                xs, ys = zip(*points)
                # A sweep's run that logged no loss is named at its first line.
                label = r.name if several and not labelled else None
                labelled = True
                line(
                    panel[metric],
                    metric,
                    xs,
                    ys,
                    color=run_color if several else colors[0],
                    linestyle=run_style if several else "-",
                    linewidth=1.4,
                    label=label,
                )
        best = _best(r)
        if best is not None:
            metric, step, value = best
            ax = panel["loss" if _in_loss_panel(metric) else metric] if metric in metrics else None
            if ax is not None:
                (star,) = ax.plot(
                    [step],
                    [value],
                    linestyle="none",
                    marker="*",
                    markersize=15,
                    markerfacecolor=run_color if several else "gold",
                    markeredgecolor="black",
                    markeredgewidth=0.8,
                    zorder=STAR_Z,
                    clip_on=False,
                )
                label = "best" if several else f"best {metric} (step {step})"
                legend.setdefault(label, star)
    for name, ax in panel.items():
        for i, r in enumerate(reports):
            for step in _resumes(r):
                mark = ax.axvline(
                    step,
                    linestyle=":",
                    linewidth=1.0,
                    color=colors[i % len(colors)] if several else "0.4",
                )
                legend.setdefault("resumed from", mark)
        loss_like = name == "loss" or _loss_like(name)
        scale, note = _scale(drawn[name], loss_like, log_y)
        ax.set_title(
            ("loss (train and validation)" if name == "loss" and losses else name)
            + (f" ({note})" if note else "")
        )
        ax.set_ylabel(name)
        if scale == "log":
            ax.set_yscale("log")
            ax.set_ylabel(f"{name} (log scale)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if legend:
        # The series first, in the order drawn; then the best step and the resume marks.
        last = [k for k in legend if k == "resumed from" or k.startswith("best")]
        order = [k for k in legend if k not in last] + last
        fig.legend([legend[k] for k in order], order, loc="outside right upper", fontsize=8)
    fig.suptitle(title)
    return fig


def plot_reports(
    reports: Sequence[Report],
    out: str | os.PathLike[str],
    title: str,
    *,
    log_y: bool | None = None,
) -> str:
    """Write the curves of ``reports`` to ``out`` (any format matplotlib writes, by extension;
    see :func:`figure` and the module docstring); returns its path. Raises ImportError without
    matplotlib and OSError when the file cannot be written."""
    fig = figure(reports, title, log_y=log_y)
    path = os.fspath(out)
    fig.savefig(path, dpi=110)
    return path
