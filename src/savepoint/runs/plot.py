"""Plots of a run or a sweep: the loss curve and every metric curve, one line per run.

matplotlib is optional (``pip install 'savepoint[plot]'``) and used with the Agg backend, so no
display is needed. Curves come from the runs' ``report.json``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from savepoint.runs.report import Report

__all__ = ["plot_reports"]


def plot_reports(reports: Sequence[Report], out: str | os.PathLike[str], title: str) -> str:
    """Write a PNG with the loss curves (left) and the metric curves (right); returns its path."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - matplotlib is a dev dependency
        raise RuntimeError("plotting needs matplotlib: pip install 'savepoint[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = sorted({k for r in reports for values in r.metric_history.values() for k in values})
    panels = 1 + len(metrics)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    # Runs that match exactly would hide each other: each gets its own line style.
    styles = ["-", "--", ":", "-."]
    ax = axes[0][0]
    for i, r in enumerate(reports):
        if r.loss_history:
            steps, losses = zip(*r.loss_history)
            ax.plot(steps, losses, styles[i % 4], label=r.name, linewidth=1.4)
    ax.set_title("training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if any(r.loss_history for r in reports):
        ax.legend(fontsize=8)
    for ax, metric in zip(axes[0][1:], metrics):
        for i, r in enumerate(reports):
            points = [
                (s, float(v[metric]))
                for s, v in sorted(r.metric_history.items())
                if isinstance(v.get(metric), (int, float)) and not isinstance(v.get(metric), bool)
            ]
            if points:
                xs, ys = zip(*points)
                (line,) = ax.plot(
                    xs, ys, styles[i % 4], marker="o", markersize=3, label=r.name, linewidth=1.4
                )
                best = (r.best or {}) if (r.best or {}).get("metric") == metric else {}
                if best.get("step") is not None and best["step"] in r.metric_history:
                    ax.scatter(
                        [best["step"]],
                        [float(r.metric_history[best["step"]][metric])],
                        marker="*",
                        s=140,
                        zorder=3,
                        color=line.get_color(),
                    )
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = os.fspath(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
