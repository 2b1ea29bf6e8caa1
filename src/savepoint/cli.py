"""The ``savepoint`` command line (also ``python -m savepoint``).

Exit status: 0 success; 1 the checkpoint is missing, incomplete, corrupt or incompatible (the
reason is printed on stderr); 2 a usage error.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import click

from savepoint import _cli_formats, checkpoint
from savepoint._text import size as _size
from savepoint._text import table as _table
from savepoint._version import __version__
from savepoint.distributed.cli import consolidate_cmd
from savepoint.errors import CheckpointError
from savepoint.storage.paths import local_path


@contextmanager
def _progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A progress callback; the bar appears only once the operation has run for a second."""
    from tqdm import tqdm

    bar: Any = None
    start = time.monotonic()

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            if time.monotonic() - start < 1.0 or not sys.stderr.isatty():
                return
            bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


def _fail(exc: CheckpointError) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


def _local(path: str, what: str = "path") -> str:
    """``path`` as a local path (file:// mapped); a URL savepoint cannot use exits 1 with why."""
    try:
        return local_path(path, what=what)
    except CheckpointError as exc:
        _fail(exc)
        raise  # unreachable: _fail exits


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="savepoint")
def main() -> None:
    """Inspect, verify and compare savepoint checkpoints and run directories."""


main.add_command(_cli_formats.convert_cmd)
main.add_command(consolidate_cmd)


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
def inspect_cmd(path: str, as_json: bool) -> None:
    """List the tensors, values and metadata of the checkpoint at PATH (reads no tensor data).

    PATH may be a savepoint checkpoint, a .shrew file, a .safetensors file, a boostr directory
    (single or distributed), a burn record (.mpk) or a seed-001 training-artifact directory.
    """
    path = _local(path)
    if _cli_formats.handles(path):
        _cli_formats.inspect_other(path, as_json)
        return
    try:
        info = checkpoint.inspect(path)
    except CheckpointError as exc:
        _fail(exc)
        return
    if as_json:
        click.echo(json.dumps(info.to_dict(), indent=2, sort_keys=False))
        return
    click.echo(f"checkpoint  {info.path}")
    click.echo(f"written by  {info.writer}, format {info.format_version}, {info.created}")
    click.echo(
        f"data        {_size(info.total_bytes)} in {len(info.tensors)} tensors, "
        f"{len(info.files)} file(s)"
    )
    if info.metadata:
        click.echo(f"metadata    {json.dumps(info.metadata, sort_keys=True)}")
    for key, kind in info.stateful.items():
        click.echo(f"stateful    {key or '<root>'}: {kind}")
    if info.tensors:
        rows: list[tuple[str, ...]] = [("key", "dtype", "shape", "size", "file")]
        for t in info.tensors:
            shape = "(" + ", ".join(map(str, t.shape)) + ("," if len(t.shape) == 1 else "") + ")"
            note = f"{t.file}" + (f" (tied to {t.tied_to})" if t.tied_to else "")
            rows.append((t.key, t.dtype, shape, _size(t.nbytes), note))
        click.echo("")
        click.echo(_table(rows))
    if info.values:
        click.echo("")
        values: list[tuple[str, ...]] = [("key", "value")]
        values += [
            (k, repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "...")
            for k, v in info.values.items()
        ]
        click.echo(_table(values))


@main.command("verify")
@click.argument("path", type=click.Path(path_type=str))
@click.option("-q", "--quiet", is_flag=True, help="Print nothing when the checkpoint is intact.")
def verify_cmd(path: str, quiet: bool) -> None:
    """Check the structure and every checksum of the checkpoint at PATH.

    Exits 0 when it is intact, 1 (with the reason) otherwise. PATH may also be a .shrew file, a
    .safetensors file, a boostr directory, a burn record (.mpk) or a training-artifact directory
    (checked as far as each format allows), or a run
    directory: then every checkpoint is verified, and report.json, the committed checkpoints and
    the latest/ and best/ aliases must agree (any disagreement is listed, exit status 1).
    """
    from savepoint.runs import layout

    path = _local(path)
    if layout.is_run(path) or layout.lost_run_file(path):
        _verify_run(path, quiet)
        return
    if _cli_formats.handles(path):
        _cli_formats.verify_other(path, quiet)
        return
    start = time.perf_counter()
    try:
        with _progress("verifying") as progress:
            info = checkpoint.verify(path, progress=progress)
    except CheckpointError as exc:
        _fail(exc)
        return
    if not quiet:
        elapsed = time.perf_counter() - start
        click.echo(
            f"ok: {info.path}: {len(info.tensors)} tensors, {_size(info.total_bytes)} in "
            f"{len(info.files)} file(s) verified in {elapsed:.2f} s"
        )


def _run_dir(path: str) -> str:
    from savepoint.runs import layout

    if not layout.is_run(path):
        hint = (
            "; it has a report.json: opening it with a CheckpointManager rebuilds run.json"
            if layout.lost_run_file(path)
            else ""
        )
        click.echo(f"error: {path} is not a savepoint run directory (no run.json){hint}", err=True)
        sys.exit(1)
    return path


def _load_report(path: str) -> Any:
    from savepoint.runs.report import load_report

    try:
        report = load_report(path)
        if report is not None:
            return report
    except CheckpointError as exc:
        _fail(exc)
    click.echo(f"error: {path} has no report.json yet", err=True)
    sys.exit(1)


def _committed_steps(run_dir: str) -> list[int]:
    from savepoint.runs import layout

    try:
        return layout.committed_steps(run_dir)
    except CheckpointError as exc:
        _fail(exc)
        raise  # unreachable: _fail exits


def _run_problems(run_dir: str, report: Any, steps: list[int]) -> list[str]:
    """The view's consistency check (runs.view.run_problems), as ``ls`` and ``report`` print it."""
    import os

    from savepoint.runs.report import RUN_FILE, RunInfo, read_json
    from savepoint.runs.view import run_problems

    try:
        doc = read_json(os.path.join(run_dir, RUN_FILE))
        run = RunInfo.from_json(doc, os.path.join(run_dir, RUN_FILE))
    except CheckpointError as exc:
        _fail(exc)
        raise  # unreachable: _fail exits
    return run_problems(run_dir, run, report, steps)


def _verify_run(run_dir: str, quiet: bool) -> None:
    """``verify RUN``: every checkpoint's checksums, and report, checkpoints and aliases agree."""
    import os

    from savepoint.runs import aliases, layout
    from savepoint.runs.report import REPORT_FILE, RUN_FILE, Report, RunInfo, read_json
    from savepoint.runs.view import run_problems

    start = time.perf_counter()
    problems: list[str] = []
    has_report = os.path.lexists(os.path.join(run_dir, REPORT_FILE))
    run_path = os.path.join(run_dir, RUN_FILE)
    try:
        doc = read_json(run_path)
        if doc is None:  # a run that lost it (lost_run_file): its report has the identity
            report = _load_report(run_dir)
            run = RunInfo(report.name, report.variant, report.config, report.num_params)
            problems.append(
                f"{RUN_FILE} is missing; opening the run with a CheckpointManager rebuilds it "
                f"from {REPORT_FILE}"
            )
        else:
            run = RunInfo.from_json(doc, run_path)
            report = _load_report(run_dir) if has_report else Report.for_run(run)
    except CheckpointError as exc:
        _fail(exc)
        return
    steps = _committed_steps(run_dir)
    problems += run_problems(run_dir, run, report, steps)
    leaving = set(report.discarding) - set(report.checkpoints)
    checked = [s for s in steps if s not in leaving]
    paths = [(f"step {s}", layout.step_path(run_dir, s)) for s in checked]
    paths += [
        (f"{a}/", os.path.join(run_dir, a))
        for a in aliases.NAMES
        if os.path.lexists(os.path.join(run_dir, a))
    ]
    for what, ckpt in paths:
        try:
            checkpoint.verify(ckpt)
        except (CheckpointError, OSError) as exc:
            problems.append(f"{what} does not verify: {exc}")
    if problems:
        for problem in problems:
            click.echo(f"error: {run_dir}: {problem}", err=True)
        click.echo(
            "(opening the run with a CheckpointManager repairs disagreements between report.json, "
            "the checkpoints and the aliases; it cannot repair a checkpoint that does not verify)",
            err=True,
        )
        sys.exit(1)
    if not quiet:
        held = ", ".join(
            f"{a}/ = step {s}" for a, s in aliases.targets(report).items() if s is not None
        )
        click.echo(
            f"ok: run {run.name}: {len(checked)} checkpoint(s) verified in "
            f"{time.perf_counter() - start:.2f} s; report.json agrees with them"
            + (f" and with {held}" if held else "")
        )


def _metrics_text(values: dict[str, Any]) -> str:
    return " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(values.items())
    )


@main.command("ls")
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the listing as JSON.")
def ls_cmd(run_dir: str, as_json: bool) -> None:
    """List the checkpoints of the run at RUN_DIR: steps, sizes, metrics, and why each is kept."""
    import os

    from savepoint.runs import layout, policies

    run_dir = _local(run_dir, "run directory")
    _run_dir(run_dir)
    report = _load_report(run_dir)
    on_disk = _committed_steps(run_dir)
    problems = _run_problems(run_dir, report, on_disk)
    leaving = set(report.discarding) - set(report.checkpoints)
    steps = [s for s in on_disk if s not in leaving]
    entries: list[tuple[int, int | None, dict[str, Any], str]] = []
    for step in steps:
        try:
            info = checkpoint.inspect(layout.step_path(run_dir, step))
        except (CheckpointError, OSError) as exc:
            entries.append((step, None, {}, f"unreadable: {exc}"))
            continue
        meta = info.metadata.get("savepoint_run") or {}
        size = sum(info.files.values())
        entries.append((step, size, dict(meta.get("metrics") or {}), info.created))
    policy = policies.from_spec(report.retention)
    reasons = policies.explain(policy, [policies.Entry(s, m) for s, _, m, _ in entries])
    latest = steps[-1] if steps else None
    best = (report.best or {}).get("step")
    resumed = {item.get("resumed_from") for item in report.lineage}
    rows_json: list[dict[str, Any]] = []
    for step, nbytes, metrics, created in entries:
        tags = []
        if step == latest:
            tags.append("latest")
        if step == best:
            tags.append("best")
        if step in resumed:
            tags.append("resumed-from")
        rows_json.append(
            {
                "step": step,
                "bytes": nbytes,
                "metrics": metrics,
                "created": created,
                "tags": tags,
                "kept_by": reasons.get(step, []),
            }
        )
    if as_json:
        doc = {"run": os.path.abspath(run_dir), "checkpoints": rows_json, "problems": problems}
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(
        f"run {report.name}"
        + (f" ({report.variant})" if report.variant else "")
        + f": {len(steps)} checkpoint(s), {report.steps_completed} steps completed"
    )
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)
    if not rows_json:
        return
    rows: list[tuple[str, ...]] = [("step", "size", "metrics", "tags", "kept by")]
    for r in rows_json:
        rows.append(
            (
                str(r["step"]),
                _size(r["bytes"]) if r["bytes"] is not None else "?",
                _metrics_text(r["metrics"]) or "-",
                ",".join(r["tags"]) or "-",
                ",".join(r["kept_by"]) or "-",
            )
        )
    click.echo(_table(rows))


def _resolve_step(run_dir: str, spec: str) -> str:
    from savepoint.runs import layout

    _run_dir(run_dir)
    if spec in ("latest", "best"):
        report = _load_report(run_dir)
        step = report.latest_step if spec == "latest" else (report.best or {}).get("step")
        if step is None:
            click.echo(f"error: {run_dir} has no {spec} checkpoint", err=True)
            sys.exit(1)
    else:
        try:
            step = int(spec)
        except ValueError:
            raise click.BadParameter(f"{spec!r} is not a step number, 'latest' or 'best'") from None
    return layout.step_path(run_dir, int(step))


@main.command("diff")
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=str)
@click.argument("c", type=str, required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option("--all", "show_all", is_flag=True, help="List identical tensors too.")
def diff_cmd(a: str, b: str, c: str | None, as_json: bool, show_all: bool) -> None:
    """Compare two checkpoints: `diff CKPT_A CKPT_B`, or two steps of a run: `diff RUN STEP STEP`
    (a step may be a number, 'latest' or 'best'). Exit status 0 when identical, 1 otherwise."""
    from savepoint.diff import diff

    a, b = _local(a), (b if c is not None else _local(b))
    if c is not None:
        a, b = _resolve_step(a, b), _resolve_step(a, c)
    try:
        report = diff(a, b)
    except CheckpointError as exc:
        _fail(exc)
        return
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, default=str))
        sys.exit(0 if report.identical else 1)
    click.echo(f"a: {report.a}\nb: {report.b}")
    for key in report.removed:
        click.echo(f"- {key}")
    for key in report.added:
        click.echo(f"+ {key}")
    for key, x, y in report.changed:
        click.echo(f"~ {key}: {x} -> {y}")
    for key, x, y in report.values:
        click.echo(f"~ {key}: {x!r} -> {y!r}")
    shown = [t for t in report.tensors if show_all or not t.equal]
    if shown:
        rows: list[tuple[str, ...]] = [("tensor", "dtype", "shape", "max abs diff", "rel L2 diff")]
        for t in shown:
            rows.append((t.key, t.dtype, str(list(t.shape)), f"{t.max_abs:.4g}", f"{t.rel_l2:.4g}"))
        click.echo(_table(rows))
    same = sum(t.equal for t in report.tensors)
    click.echo(
        f"{len(report.tensors)} tensors compared, {same} identical; {len(report.added)} added, "
        f"{len(report.removed)} removed, {len(report.changed)} changed type/shape, "
        f"{len(report.values)} values differ"
    )
    sys.exit(0 if report.identical else 1)


@main.command("report")
@click.argument("path", type=click.Path(path_type=str))
@click.option(
    "--plot", "plot_path", type=click.Path(path_type=str), help="Write a PNG of the curves."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report (or comparison) as JSON.")
def report_cmd(path: str, plot_path: str | None, as_json: bool) -> None:
    """Summarise a run (RUN_DIR) or a sweep (a directory of runs), optionally plotting the curves."""
    import os

    from savepoint.runs import layout
    from savepoint.runs.sweep import Sweep

    path, plot_path = _local(path), (_local(plot_path, "plot path") if plot_path else None)
    if layout.is_run(path):
        reports = [_load_report(path)]
        r = reports[0]
        for problem in _run_problems(path, r, _committed_steps(path)):
            click.echo(f"warning: {problem}", err=True)
        if as_json:
            click.echo(json.dumps(r.to_json(), indent=2))
        else:
            click.echo(f"run          {r.name}" + (f" ({r.variant})" if r.variant else ""))
            click.echo(
                f"steps        {r.steps_completed}"
                + (f", epoch {r.epoch}" if r.epoch is not None else "")
            )
            click.echo(f"wall time    {r.wall_time_s:.1f} s")
            if r.loss_history:
                first, last = r.loss_history[0], r.loss_history[-1]
                click.echo(
                    f"loss         {first[1]:.6g} (step {first[0]}) -> {last[1]:.6g} (step {last[0]})"
                )
            if r.best:
                click.echo(
                    f"best         step {r.best['step']}: {_metrics_text(r.best.get('metrics') or {})}"
                )
            click.echo(f"checkpoints  {', '.join(map(str, r.checkpoints)) or 'none'}")
            for item in r.lineage:
                click.echo(f"resumed      from step {item.get('resumed_from')} at {item.get('at')}")
    elif os.path.isdir(path) and Sweep(path).runs():
        sweep = Sweep(path)
        names = sweep.runs()
        reports = [_load_report(os.path.join(path, n)) for n in names]
        metric = next((r.best.get("metric") for r in reports if r.best), None)
        mode: Literal["min", "max"] = (
            "max" if any((r.best or {}).get("mode") == "max" for r in reports) else "min"
        )
        rows_data = Sweep(path, metric=metric, mode=mode).compare()
        if as_json:
            click.echo(json.dumps(rows_data, indent=2))
        else:
            click.echo(
                f"sweep {os.path.abspath(path)}: {len(rows_data)} runs ranked by {metric} ({mode})"
            )
            rows: list[tuple[str, ...]] = [
                ("rank", "run", "best", "best step", "final loss", "steps", "wall s")
            ]
            for row in rows_data:
                rows.append(
                    (
                        str(row["rank"]),
                        row["name"],
                        "-" if row["best_metric"] is None else f"{row['best_metric']:.6g}",
                        str(row["best_step"]) if row["best_step"] is not None else "-",
                        "-" if row["final_loss"] is None else f"{row['final_loss']:.6g}",
                        str(row["steps"]),
                        f"{row['wall_time_s']:.1f}",
                    )
                )
            click.echo(_table(rows))
    else:
        hint = (
            " (its run.json is missing: opening it with a CheckpointManager rebuilds it)"
            if layout.lost_run_file(path)
            else ""
        )
        click.echo(f"error: {path} is neither a run directory nor a sweep of runs{hint}", err=True)
        sys.exit(1)
    if plot_path:
        from savepoint.runs.plot import plot_reports

        title = (
            reports[0].name
            if len(reports) == 1
            else f"sweep: {os.path.basename(os.path.abspath(path))}"
        )
        written = plot_reports(reports, plot_path, title)
        click.echo(f"plot written to {written}", err=as_json)
