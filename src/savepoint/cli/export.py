"""``savepoint export CKPT OUT.safetensors``: a model's weights as one Hugging Face-style
safetensors file (dotted names, one copy per tied group), which ``safetensors`` and
``transformers`` load directly; ``savepoint export CKPT OUT_DIR --hf``: a Hugging Face model
directory (shards and their index, as ``save_pretrained`` writes it). The rules live in
:mod:`savepoint.formats.export`."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import click

from savepoint.cli._common import command, echo_json, fail_read, local, progress, shown
from savepoint.cli._runs import is_run, step_path
from savepoint.cli._text import size as _size
from savepoint.errors import CheckpointError

if TYPE_CHECKING:
    from savepoint.formats.export import ExportReport

__all__ = ["export_cmd"]


@command(
    "export",
    short="Write a model's weights as a Hugging Face safetensors file, or a sharded directory.",
    json_help="Print what was written as JSON (see docs/cli.md).",
)
@click.argument("src", type=click.Path(path_type=str))
@click.argument("out", type=click.Path(path_type=str))
@click.option(
    "--subtree",
    metavar="PATH",
    help="The part of the state to export, keys joined by '/' (default: 'model' when the "
    "state has one, else everything; '' or '/' for everything).",
)
@click.option(
    "--sep",
    default=".",
    show_default=True,
    help="What joins the keys below the subtree into tensor names.",
)
@click.option(
    "--step",
    metavar="STEP",
    help="With a run directory: the step to export (a number, 'latest' or 'best'; default latest).",
)
@click.option(
    "--duplicate-tied",
    is_flag=True,
    help="Store a copy of a tied tensor under every name (default: once, under the first "
    "name, as transformers' save_pretrained does; its loaders re-tie them).",
)
@click.option(
    "--hf",
    is_flag=True,
    help="Write OUT as a Hugging Face model directory: model.safetensors, or shards "
    "model-0000i-of-0000n.safetensors and model.safetensors.index.json (from_pretrained reads it).",
)
@click.option(
    "--max-shard-size",
    metavar="SIZE",
    help="With --hf: the largest shard, as save_pretrained takes it ('5GB', '500MB', '2GiB', "
    "bytes; default 5GB). A larger tensor goes alone in its shard.",
)
@click.option(
    "--config",
    "config",
    metavar="PATH",
    type=click.Path(path_type=str, dir_okay=False),
    help="With --hf: a config.json to write beside the weights (default: the model config a "
    "SavepointTrainer checkpoint records, if any).",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def export_cmd(src: str, out: str, step: str | None, as_json: bool, **options: Any) -> None:
    """Write the model weights of the checkpoint SRC as one safetensors file OUT that
    safetensors.torch.load_file / load_model and transformers' from_pretrained read directly,
    or with --hf as a Hugging Face model directory OUT of shards and their index.

    Tensors are named by their keys below the subtree joined with '.', tied weights are stored
    once, and __metadata__ holds {"format": "pt"} and the checkpoint's metadata (as strings;
    values over 1 KiB are left out). Plain values (step counters, configs) and everything
    outside the subtree (the optimizer) are left out by design and listed: no --lossy needed.

    SRC is any checkpoint savepoint reads (a local path or URL of a savepoint checkpoint, or a
    local file or directory of another format), or a run directory: its latest checkpoint, or
    --step N|latest|best. OUT is a local file (with --hf, a directory, written whole and
    atomically).

    \b
    Examples:
      savepoint export runs/demo model.safetensors
      savepoint export runs/demo hf-model --hf --max-shard-size 2GB --config config.json
      savepoint export pytorch_model.bin model.safetensors --subtree ''
    """
    from savepoint.formats.export import export

    _check(out, options)
    src = local(src, "source")
    chosen = None
    if is_run(src):
        chosen, src = step_path(src, step or "latest")
    elif step is not None:
        raise click.BadParameter(
            f"{src} is not a run directory; --step picks a step of a run", param_hint="'--step'"
        )
    start = time.perf_counter()
    try:
        with progress("exporting") as update:
            report = export(src, local(out, "output"), progress=update, **options)
    except CheckpointError as exc:
        fail_read(exc, src, any_format=True)
    elapsed = time.perf_counter() - start
    if as_json:
        _json(report, src, chosen, elapsed)
    else:
        _text(report, src, chosen, elapsed)


def _check(out: str, options: dict[str, Any]) -> None:
    """Usage errors (exit status 2): the options that go with --hf, --sep, OUT's kind."""
    if not options["sep"]:
        raise click.BadParameter("must not be empty", param_hint="'--sep'")
    hf = options["hf"]
    for name, value in (
        ("--max-shard-size", options["max_shard_size"]),
        ("--config", options["config"]),
    ):
        if value is not None and not hf:
            raise click.BadParameter(
                "goes with --hf (a directory of shards)", param_hint=f"'{name}'"
            )
    if options["max_shard_size"] is not None:
        from savepoint.formats import huggingface

        try:
            huggingface.parse_size(options["max_shard_size"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--max-shard-size'") from None
    if not hf and os.path.isdir(out):
        raise click.BadParameter(
            f"{out} is a directory: name a .safetensors file, or pass --hf to write a Hugging "
            "Face model directory",
            param_hint="'OUT'",
        )


def _json(report: ExportReport, src: str, chosen: int | None, elapsed: float) -> None:
    echo_json(
        {
            "path": report.destination,
            "source": {
                "path": shown(src),
                "format": report.source_format,
                "version": report.source_version,
                "step": chosen,
            },
            "destination": report.destination,
            "subtree": report.subtree,
            "tensors": report.tensors,
            "bytes": report.bytes,
            "tied": report.tied,
            "dropped": list(report.dropped),
            "metadata": report.metadata,
            "files": list(report.files),
            "max_shard_size": report.max_shard_size,
            "config": report.config or None,
            "seconds": round(elapsed, 3),
        },
        format="huggingface" if report.max_shard_size is not None else "safetensors",
        version=None,
    )


def _text(report: ExportReport, src: str, chosen: int | None, elapsed: float) -> None:
    step_note = f" (step {chosen} of the run)" if chosen is not None else ""
    part = f"'{report.subtree}'" if report.subtree else "the whole state"
    into = (
        f" in {len(report.files)} file(s) ({', '.join(report.files)})"
        if report.max_shard_size is not None
        else ""
    )
    click.echo(
        f"exported {part} of {shown(src)}{step_note} -> {report.destination}: "
        f"{report.tensors} tensors, {_size(report.bytes)}{into} in {elapsed:.2f} s"
    )
    if report.config:
        click.echo(f"config.json from {report.config}")
    if report.tied:
        click.echo(f"tied ({len(report.tied)}), stored once; loaders re-tie them from the model:")
        for name, kept in report.tied.items():
            click.echo(f"  - {name} = {kept}")
    if report.dropped:
        click.echo(f"left out ({len(report.dropped)}):")
        for item in report.dropped:
            click.echo(f"  - {item}")
