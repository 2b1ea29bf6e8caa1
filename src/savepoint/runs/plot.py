"""Plots of a run or a sweep, one line style per run, from the runs' ``report.json``.

The first panel holds the losses: the training loss (``mgr.log(step, loss=...)``, solid) and,
on the same axes, every logged metric whose name contains "loss" (``val_loss``, ``eval_loss``:
dashed, with markers), so training and validation are compared at a glance. Every other metric
gets a panel of its own, its best step starred. Every panel labels its axes, and marks with a
dotted vertical line each step a run resumed from (``report.lineage``). ``log_y`` puts the
y axes on a log scale (a panel holding a value <= 0 stays linear and says so in its title).

matplotlib is optional (``pip install 'savepoint[plot]'``) and used with the Agg backend, so no
display is needed. :func:`check_output` says, before any work, whether a path can be written
(its folder exists, matplotlib knows its extension).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from savepoint.runs.report import Report

__all__ = ["FORMATS", "check_output", "plot_reports"]

# What the Agg backend writes (matplotlib's own list, for messages when it is not installed).
FORMATS = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "tif", "tiff", "webp", "eps", "ps")
_MISSING = "plotting needs matplotlib: pip install 'savepoint[plot]'"


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError(_MISSING) from None
    matplotlib.use("Agg")
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


def _is_loss(metric: str) -> bool:
    return "loss" in metric.lower()


def _points(report: Report, metric: str) -> list[tuple[int, float]]:
    return [
        (s, float(v[metric]))
        for s, v in sorted(report.metric_history.items())
        if isinstance(v.get(metric), (int, float)) and not isinstance(v.get(metric), bool)
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


def plot_reports(
    reports: Sequence[Report], out: str | os.PathLike[str], title: str, *, log_y: bool = False
) -> str:
    """Write the curves of ``reports`` to ``out`` (any format matplotlib writes, by extension;
    see the module docstring); returns its path. Raises ImportError without matplotlib and
    OSError when the file cannot be written."""
    _matplotlib()
    import matplotlib.pyplot as plt

    metrics = sorted({k for r in reports for values in r.metric_history.values() for k in values})
    losses = [m for m in metrics if _is_loss(m)]
    others = [m for m in metrics if not _is_loss(m)]
    panels = 1 + len(others)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    # Runs that match exactly would hide each other: each gets its own line style.
    styles = ["-", "--", ":", "-."]
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    several = len(reports) > 1
    ax = axes[0][0]
    drawn: list[list[float]] = [[] for _ in range(panels)]
    for i, r in enumerate(reports):
        color = colors[i % len(colors)]
        prefix = f"{r.name}: " if several else ""
        if r.loss_history:
            steps, values = zip(*r.loss_history)
            ax.plot(
                steps,
                values,
                styles[i % 4] if several else "-",
                color=color,
                label=f"{prefix}train loss",
                linewidth=1.4,
            )
            drawn[0] += [float(v) for v in values]
        for j, metric in enumerate(losses):
            points = _points(r, metric)
            if points:
                xs, ys = zip(*points)
                ax.plot(
                    xs,
                    ys,
                    "--",
                    marker="os^vD"[j % 5],
                    markersize=3,
                    color=color,
                    alpha=0.9,
                    label=f"{prefix}{metric}",
                    linewidth=1.2,
                )
                drawn[0] += list(ys)
    ax.set_title("loss" + (" (train and validation)" if losses else ""))
    ax.set_ylabel("loss")
    for panel, (ax, metric) in enumerate(zip(axes[0][1:], others), start=1):
        for i, r in enumerate(reports):
            points = _points(r, metric)
            if not points:
                continue
            xs, ys = zip(*points)
            (line,) = ax.plot(
                xs,
                ys,
                styles[i % 4],
                marker="o",
                markersize=3,
                color=colors[i % len(colors)],
                label=r.name,
                linewidth=1.4,
            )
            drawn[panel] += list(ys)
            best = (r.best or {}) if (r.best or {}).get("metric") == metric else {}
            if best.get("step") is not None and best["step"] in r.metric_history:
                ax.scatter(
                    [best["step"]],
                    [float(r.metric_history[best["step"]][metric])],
                    marker="*",
                    s=140,
                    zorder=3,
                    color=line.get_color(),
                    label=f"{r.name}: best" if several else "best",
                )
        ax.set_title(metric)
        ax.set_ylabel(metric)
    for panel, ax in enumerate(axes[0]):
        marked = False
        for i, r in enumerate(reports):
            for step in _resumes(r):
                ax.axvline(
                    step,
                    linestyle=":",
                    linewidth=1.0,
                    color=colors[i % len(colors)] if several else "0.4",
                    label=None if marked else "resumed from",
                )
                marked = True
        if log_y and drawn[panel]:
            if min(drawn[panel]) > 0:
                ax.set_yscale("log")
                ax.set_ylabel(f"{ax.get_ylabel()} (log scale)")
            else:
                ax.set_title(f"{ax.get_title()} (linear: values <= 0)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = os.fspath(out)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
