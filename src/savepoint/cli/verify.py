"""``savepoint verify PATH``: is the checkpoint (or every checkpoint of a run) intact?

A savepoint checkpoint has its structure and every checksum checked; another format is checked as
far as it allows (structure and sizes, every byte read); a run directory has every checkpoint
verified and its report.json, checkpoints and latest/ and best/ aliases compared.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import click

from savepoint import checkpoint
from savepoint.cli._common import (
    command,
    echo_error_json,
    echo_json,
    fail,
    fail_read,
    is_foreign,
    local,
    location,
    named,
    progress,
    shown,
)
from savepoint.cli._runs import RUN_FORMAT, committed_steps, is_run, load_report, lost_run_file
from savepoint.cli._text import size as _size
from savepoint.errors import CheckpointError
from savepoint.formats import detect
from savepoint.info import CheckpointInfo

if TYPE_CHECKING:
    from savepoint.storage.paths import Location

__all__ = ["verify_cmd"]


@command(
    "verify",
    short="Check that a checkpoint (or every checkpoint of a run) is intact.",
    json_help="Print the outcome as JSON (see docs/cli.md).",
)
@click.argument("path", type=click.Path(path_type=str))
@click.option("-q", "--quiet", is_flag=True, help="Print nothing when the checkpoint is intact.")
def verify_cmd(path: str, quiet: bool, as_json: bool) -> None:
    """Check the structure and every checksum of the checkpoint at PATH.

    Exits 0 when it is intact, 1 (with the reason) otherwise. PATH may also be a .shrew file, a
    .safetensors file, a boostr directory, a burn record (.mpk), a training-artifact directory
    or a PyTorch file (checked as far as each format allows: structure and sizes, every byte
    read), or a run directory: then every checkpoint is verified, and report.json, the
    committed checkpoints and the latest/ and best/ aliases must agree (any disagreement is
    listed, exit status 1).

    PATH may be a local path or a URL (memory://, s3://, ...) of a savepoint checkpoint or run;
    the other formats are local files.

    \b
    Examples:
      savepoint verify runs/demo/latest
      savepoint verify runs/demo          # every checkpoint of the run
      savepoint verify model.safetensors --json
    """
    path = local(path)
    if is_run(path) or lost_run_file(path):
        _verify_run(path, quiet, as_json)
        return
    foreign = is_foreign(path)
    start = time.perf_counter()
    try:
        with progress("verifying") as update:
            if foreign:
                info = detect.verify_any(path, progress=update)
            else:
                info = checkpoint.verify(path, progress=update)
    except CheckpointError as exc:
        if foreign:
            fail(exc)
        fail_read(exc, path)
    elapsed = time.perf_counter() - start
    where = info.path if foreign else named(path, info.path)
    if as_json:
        echo_json(
            _checkpoint_doc(info, where, elapsed), format=info.format, version=info.format_version
        )
    elif quiet:
        return
    elif foreign:
        click.echo(
            f"ok: {where}: {info.label}, {len(info.tensors)} tensors, "
            f"{_size(info.total_bytes)} in {len(info.files)} file(s) checked in "
            f"{elapsed:.2f} s (the format has no checksums: structure and "
            "sizes were checked and every byte read)"
        )
    else:
        click.echo(
            f"ok: {where}: {len(info.tensors)} tensors, "
            f"{_size(info.total_bytes)} in {len(info.files)} file(s) verified in {elapsed:.2f} s"
        )


def _checkpoint_doc(info: CheckpointInfo, where: str, elapsed: float) -> dict[str, Any]:
    return {
        "path": where,
        "verified": True,
        "checked": "checksums" if info.format == "savepoint" else "structure and sizes",
        "tensor_count": len(info.tensors),
        "total_bytes": info.total_bytes,
        "files": info.files,
        "seconds": round(elapsed, 3),
        **({"notes": list(info.notes)} if info.notes else {}),
    }


def _verify_run(run_dir: str, quiet: bool, as_json: bool) -> None:
    """``verify RUN``: every checkpoint's checksums, and report, checkpoints and aliases agree."""
    from savepoint.runs import aliases, layout
    from savepoint.runs.report import REPORT_FILE, RUN_FILE, Report, RunInfo, read_json
    from savepoint.runs.view import run_problems

    start = time.perf_counter()
    problems: list[str] = []
    where = location(run_dir)
    has_report = _exists(where.join(REPORT_FILE))
    run_path = str(where.join(RUN_FILE))
    version = None
    try:
        doc = read_json(where.join(RUN_FILE))
        if doc is None:  # a run that lost it (lost_run_file): its report has the identity
            report = load_report(run_dir)
            run = RunInfo(report.name, report.variant, report.config, report.num_params)
            problems.append(
                f"{RUN_FILE} is missing; opening the run with a CheckpointManager rebuilds it "
                f"from {REPORT_FILE}"
            )
        else:
            run = RunInfo.from_json(doc, run_path)
            version = doc.get("version") if isinstance(doc, dict) else None
            report = load_report(run_dir) if has_report else Report.for_run(run)
    except CheckpointError as exc:
        fail(exc)
    steps = committed_steps(run_dir)
    problems += run_problems(run_dir, run, report, steps)
    leaving = set(report.discarding) - set(report.checkpoints)
    checked = [s for s in steps if s not in leaving]
    paths = [(f"step {s}", layout.step_path(run_dir, s)) for s in checked]
    paths += [
        (f"{a}/", str(aliases.path_of(where, a)))
        for a in aliases.NAMES
        if _exists(aliases.path_of(where, a))
    ]
    sizes: dict[str, int] = {}
    for what, ckpt in paths:
        try:
            sizes[what] = checkpoint.inspect(ckpt).total_bytes
        except (CheckpointError, OSError):
            sizes[what] = 0
    with progress("verifying run") as update:
        done, total = 0, sum(sizes.values())

        def advanced(n: int, _total: int) -> None:
            update(done + n, total)

        for what, ckpt in paths:
            try:
                checkpoint.verify(ckpt, progress=advanced)
            except (CheckpointError, OSError) as exc:
                problems.append(f"{what} does not verify: {exc}")
            done += sizes[what]
            update(done, total)
    held = {a: s for a, s in aliases.targets(report).items() if s is not None}
    if problems:
        for problem in problems:
            click.echo(f"error: {run_dir}: {problem}", err=True)
        click.echo(
            "(opening the run with a CheckpointManager repairs disagreements between report.json, "
            "the checkpoints and the aliases; it cannot repair a checkpoint that does not verify)",
            err=True,
        )
        echo_error_json(
            "RunProblems",
            f"{run_dir}: {len(problems)} problem(s): " + "; ".join(problems),
            shown(run_dir),
            format=RUN_FORMAT,
            version=version,
            details={"path": shown(run_dir), "verified": False, "problems": problems},
        )
        sys.exit(1)
    elapsed = time.perf_counter() - start
    if as_json:
        echo_json(
            {
                "path": shown(run_dir),
                "name": run.name,
                "verified": True,
                "checked": "checksums",
                "checkpoints": checked,
                "aliases": held,
                "problems": [],
                "seconds": round(elapsed, 3),
            },
            format=RUN_FORMAT,
            version=version,
        )
    elif not quiet:
        aliases_text = ", ".join(f"{a}/ = step {s}" for a, s in held.items())
        click.echo(
            f"ok: run {run.name}: {len(checked)} checkpoint(s) verified in "
            f"{elapsed:.2f} s; report.json agrees with them"
            + (f" and with {aliases_text}" if aliases_text else "")
        )


def _exists(where: Location) -> bool:
    """Whether anything (a dangling link too, as ``os.path.lexists``) is at ``where``; a store
    that cannot say counts it as there, so that reading it reports why."""
    try:
        return where.store.stat(where.path) is not None
    except OSError:
        return True
