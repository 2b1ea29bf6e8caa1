"""``savepoint ls RUN_DIR``: the checkpoints of a run (a local path or a URL), and which retention
rule keeps each."""

from __future__ import annotations

from typing import Any

import click

from savepoint import checkpoint
from savepoint.cli._common import command, echo_json, local, shown
from savepoint.cli._runs import (
    RUN_FORMAT,
    committed_steps,
    load_report,
    metrics_text,
    require_run,
    run_problems,
    run_version,
)
from savepoint.cli._text import size as _size
from savepoint.cli._text import table as _table
from savepoint.errors import CheckpointError

__all__ = ["ls_cmd"]


@command(
    "ls",
    short="List a run's checkpoints and why each is kept.",
    json_help="Print the listing as JSON (see docs/cli.md).",
    progress=False,
)
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option(
    "--peer-memory",
    "peer_memory",
    type=click.Path(path_type=str),
    default=None,
    help="Where the run's peer-memory tier keeps its node folders (its memory_dir; default: "
    "/dev/shm/savepoint-peers).",
)
def ls_cmd(run_dir: str, as_json: bool, peer_memory: str | None) -> None:
    """List the checkpoints of the run at RUN_DIR (a local path or a URL: memory://, s3://, ...):
    steps, sizes, metrics, and why each is kept; then what the node folders of its peer-memory
    tier that this machine sees hold (sizes per node and step, against each node's budget).

    RUN_DIR is a directory made by sp.CheckpointManager (it holds run.json, report.json and
    checkpoints/). For one checkpoint use `savepoint inspect`; for a sweep of runs,
    `savepoint report SWEEP`.

    \b
    Example:
      savepoint ls runs/demo
    """
    from savepoint.runs import layout, peers, policies

    run_dir = local(run_dir, "run directory")
    require_run(run_dir)
    report = load_report(run_dir)
    on_disk = committed_steps(run_dir)
    problems = run_problems(run_dir, report, on_disk)
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
        # An incremental checkpoint's tensors are in the run's shared blob store: its size is
        # theirs (what it restores), not its few data files'.
        blobs = (info.format_version or 0) >= 4
        size = info.total_bytes if blobs else sum(info.files.values())
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
    memory_dir = peer_memory if peer_memory is not None else peers.default_memory_dir()
    in_memory = peers.usage(memory_dir, report.run_id) if report.run_id else []
    if as_json:
        doc: dict[str, Any] = {
            "path": shown(run_dir),
            "run": shown(run_dir),
            "name": report.name,
            "variant": report.variant,
            "steps_completed": report.steps_completed,
            "checkpoints": rows_json,
            "problems": problems,
        }
        if in_memory:
            doc["peer_memory"] = {"dir": memory_dir, "nodes": in_memory}
        echo_json(doc, format=RUN_FORMAT, version=run_version(run_dir))
        return
    click.echo(
        f"run {report.name}"
        + (f" ({report.variant})" if report.variant else "")
        + f": {len(steps)} checkpoint(s), {report.steps_completed} steps completed"
    )
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)
    if rows_json:
        _checkpoints(rows_json)
    if in_memory:
        _peer_memory(memory_dir, in_memory)


def _checkpoints(rows_json: list[dict[str, Any]]) -> None:
    rows: list[tuple[str, ...]] = [("step", "size", "metrics", "tags", "kept by")]
    for r in rows_json:
        rows.append(
            (
                str(r["step"]),
                _size(r["bytes"]) if r["bytes"] is not None else "?",
                metrics_text(r["metrics"]) or "-",
                ",".join(r["tags"]) or "-",
                ",".join(r["kept_by"]) or "-",
            )
        )
    click.echo(_table(rows))


def _peer_memory(memory_dir: str, nodes: list[dict[str, Any]]) -> None:
    """What the run's node folders under ``memory_dir`` hold, per node and step."""
    click.echo(f"peer memory ({memory_dir}):")
    rows: list[tuple[str, ...]] = [("node", "step", "parts", "size", "budget")]
    for node in nodes:
        budget = _size(node["budget"]) if node["budget"] is not None else "newest complete"
        rows.append((node["node"], "all", "-", _size(node["bytes"]), budget))
        for step in node["steps"]:
            # "1 (#0)": how many parts, and which (bare "0" read as none held).
            parts = f"{len(step['parts'])} (" + ",".join(f"#{p}" for p in step["parts"]) + ")"
            rows.append(("", str(step["step"]), parts, _size(step["bytes"]), ""))
    click.echo(_table(rows))
