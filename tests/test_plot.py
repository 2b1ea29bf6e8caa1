"""``savepoint report --plot`` (``savepoint.runs.plot``), checked on the figure itself (issue 25,
item 20): log axes where losses span orders of magnitude, markers only on sparse series,
``--log-y`` for loss-like panels only, the best step's star drawn on top, one legend; and
``print(sp.inspect(path))`` printing the table ``savepoint inspect`` prints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
from savepoint.cli import main
from savepoint.runs.plot import LOG_SPAN, SPARSE, STAR_Z, figure
from savepoint.runs.report import Report

pytest.importorskip("matplotlib")


def report(name: str = "demo", *, steps: int = 200, every: int = 20, spike: float = 50.0) -> Report:
    """A run whose training loss falls from ``spike`` to about 0.05, evaluated every ``every``
    steps (val_loss, acc), best at the last evaluation."""
    r = Report(name)
    r.loss_history = [(s, spike * math.exp(-s / 15) + 0.05) for s in range(1, steps + 1)]
    for s in range(every, steps + 1, every):
        r.metric_history[s] = {"val_loss": 40 * math.exp(-s / 15) + 0.08, "acc": s / steps}
    last = max(r.metric_history)
    r.best = {"metric": "val_loss", "mode": "min", "step": last, "metrics": r.metric_history[last]}
    r.lineage = [{"resumed_from": 120, "at": "2026-01-01T00:00:00Z"}]
    return r


def axes(fig: Any) -> dict[str, Any]:
    return {
        ("loss" if ax.get_title().startswith("loss") else ax.get_title()): ax for ax in fig.axes
    }


def lines(ax: Any) -> list[Any]:
    """The curves of a panel (not the star, not the resume marks)."""
    return [ln for ln in ax.get_lines() if ln.get_marker() != "*" and ln.get_linestyle() != ":"]


def test_a_loss_spanning_orders_of_magnitude_gets_a_log_axis_by_default() -> None:
    panels = axes(figure([report()], "demo"))
    assert panels["loss"].get_yscale() == "log"
    assert panels["loss"].get_ylabel() == "loss (log scale)"
    assert panels["acc"].get_yscale() == "linear"
    # A loss within one order of magnitude stays linear; --linear-y keeps every axis linear.
    flat = report(spike=0.2)
    assert max(v for _, v in flat.loss_history) < LOG_SPAN * 0.05
    flat.metric_history = {s: {"acc": m["acc"]} for s, m in flat.metric_history.items()}
    flat.best = None
    assert axes(figure([flat], "flat"))["loss"].get_yscale() == "linear"
    assert axes(figure([report()], "demo", log_y=False))["loss"].get_yscale() == "linear"


def test_log_y_is_for_loss_like_panels_only() -> None:
    r = report()
    for m in r.metric_history.values():
        m["perplexity"] = math.exp(m["val_loss"])
    panels = axes(figure([r], "demo", log_y=True))
    assert panels["loss"].get_yscale() == "log"
    assert panels["perplexity"].get_yscale() == "log"
    assert panels["acc"].get_yscale() == "linear" and panels["acc"].get_ylabel() == "acc"
    # A loss-like panel holding a value <= 0 stays linear and says why.
    r.loss_history[-1] = (r.loss_history[-1][0], 0.0)
    loss = axes(figure([r], "demo", log_y=True))["loss"]
    assert loss.get_yscale() == "linear" and "values <= 0" in loss.get_title()


def test_markers_only_on_sparse_series() -> None:
    r = report(steps=300, every=2)  # 150 evaluations: dense too
    sparse = report()
    for ax in axes(figure([r], "dense")).values():
        assert all(ln.get_marker() in (None, "None", "") for ln in lines(ax)), ax.get_title()
    panels = axes(figure([sparse], "sparse"))
    assert len(sparse.metric_history) <= SPARSE < len(sparse.loss_history)
    assert len(lines(panels["loss"])) == 2  # the training loss (dense), val_loss (sparse)
    for ln in lines(panels["loss"]) + lines(panels["acc"]):
        dense = len(ln.get_xdata()) > SPARSE
        assert (ln.get_marker() in (None, "None", "")) == dense, len(ln.get_xdata())


def test_the_best_step_is_a_star_on_top_of_its_metrics_panel() -> None:
    r = report()
    assert r.best is not None
    fig = figure([r], "demo")
    loss = axes(fig)["loss"]
    stars = [ln for ln in loss.get_lines() if ln.get_marker() == "*"]
    assert len(stars) == 1, "the best val_loss is starred on the loss panel"
    (star,) = stars
    step = r.best["step"]
    assert list(star.get_xdata()) == [step]
    assert list(star.get_ydata()) == [r.metric_history[step]["val_loss"]]
    assert star in loss.get_children() and star.get_visible() and not star.get_clip_on()
    assert star.get_zorder() == STAR_Z
    assert all(a.get_zorder() < STAR_Z for a in loss.get_children() if a is not star)
    assert "best val_loss (step 200)" in fig.legends[0].get_texts()[2].get_text()
    # A best metric with its own panel is starred there.
    r.best = {"metric": "acc", "mode": "max", "step": 100}
    acc = axes(figure([r], "demo"))["acc"]
    (star,) = [ln for ln in acc.get_lines() if ln.get_marker() == "*"]
    assert list(star.get_xdata()) == [100] and list(star.get_ydata()) == [0.5]


def test_one_legend_for_the_whole_figure() -> None:
    fig = figure([report()], "demo")
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts == ["train loss", "val_loss", "best val_loss (step 200)", "resumed from"]
    sweep = figure([report("a"), report("b", spike=20.0)], "sweep")
    assert len(sweep.legends) == 1 and all(ax.get_legend() is None for ax in sweep.axes)
    texts = [t.get_text() for t in sweep.legends[0].get_texts()]
    assert texts == [
        "a: train loss",
        "a: val_loss",
        "b: train loss",
        "b: val_loss",
        "best",
        "resumed from",
    ]
    # Each run keeps one colour and line style on every panel.
    for ax in sweep.axes:
        styles = {(ln.get_color(), ln.get_linestyle()) for ln in lines(ax)}
        assert len(styles) == 2, ax.get_title()


def test_report_cli_takes_log_y_and_linear_y(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = {"w": np.zeros(2, np.float32)}
    with sp.CheckpointManager(run, keep_last=2, best_metric="val_loss") as mgr:
        for step in range(1, 41):
            mgr.log(step, loss=100.0 / step**2)
            if step % 10 == 0:
                mgr.save(step, state, metrics={"val_loss": 50.0 / step**2, "acc": step / 40})
    for flag in ("--log-y", "--linear-y", None):
        out = tmp_path / f"{flag}.png"
        argv = ["report", str(run), "--plot", str(out)] + ([flag] if flag else [])
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 0, result.output
        assert out.read_bytes().startswith(b"\x89PNG")


def test_print_inspect_shows_the_cli_table(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sp.save(
        path,
        {"model": {"w": np.zeros((2, 3), np.float32), "b": np.ones(3, np.int64)}, "step": 7},
        metadata={"run": "demo"},
    )
    info = sp.inspect(path)
    text = str(info)
    assert text.splitlines()[0] == f"checkpoint  {path}"
    assert "key      dtype  shape   size  file" in text
    assert "model/w  F32    (2, 3)  24 B  data-00000.safetensors" in text
    assert 'metadata    {"run": "demo"}' in text and "step  7" in text
    cli = CliRunner().invoke(main, ["inspect", str(path)])
    assert cli.exit_code == 0 and cli.output == text + "\n"
    assert repr(info).startswith("CheckpointInfo(path=")  # repr() stays the dataclass's
