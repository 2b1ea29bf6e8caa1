"""``savepoint export CKPT OUT.safetensors``: a model's weights as one Hugging Face-style
safetensors file (dotted names, one copy per tied group), which ``safetensors`` and
``transformers`` load directly. The rules live in :mod:`savepoint.formats.export`."""

from __future__ import annotations

import time

import click

from savepoint.cli._common import command, echo_json, fail_read, local, progress, shown
from savepoint.cli._runs import is_run, step_path
from savepoint.cli._text import size as _size
from savepoint.errors import CheckpointError

__all__ = ["export_cmd"]


@command(
    "export",
    short="Write a model's weights as one Hugging Face safetensors file.",
    json_help="Print what was written as JSON (see docs/cli.md).",
)
@click.argument("src", type=click.Path(path_type=str))
@click.argument("out", type=click.Path(path_type=str, dir_okay=False))
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
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def export_cmd(
    src: str,
    out: str,
    subtree: str | None,
    sep: str,
    step: str | None,
    duplicate_tied: bool,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Write the model weights of the checkpoint SRC as one safetensors file OUT that
    safetensors.torch.load_file / load_model and transformers' from_pretrained read directly.

    Tensors are named by their keys below the subtree joined with '.', tied weights are stored
    once, and __metadata__ holds {"format": "pt"} and the checkpoint's metadata (as strings;
    values over 1 KiB are left out). Plain values (step counters, configs) and everything
    outside the subtree (the optimizer) are left out by design and listed: no --lossy needed.

    SRC is any checkpoint savepoint reads (a local path or URL of a savepoint checkpoint, or a
    local file or directory of another format), or a run directory: its latest checkpoint, or
    --step N|latest|best. OUT is a local file.

    \b
    Examples:
      savepoint export runs/demo model.safetensors
      savepoint export runs/demo/checkpoints/step-0000000100 model.safetensors --subtree model
      savepoint export pytorch_model.bin model.safetensors --subtree ''
    """
    from savepoint.formats.export import export

    if not sep:
        raise click.BadParameter("must not be empty", param_hint="'--sep'")
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
            report = export(
                src,
                local(out, "output file"),
                subtree=subtree,
                sep=sep,
                overwrite=overwrite,
                duplicate_tied=duplicate_tied,
                progress=update,
            )
    except CheckpointError as exc:
        fail_read(exc, src, any_format=True)
    elapsed = time.perf_counter() - start
    if as_json:
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
                "seconds": round(elapsed, 3),
            },
            format="safetensors",
            version=None,
        )
        return
    step_note = f" (step {chosen} of the run)" if chosen is not None else ""
    part = f"'{report.subtree}'" if report.subtree else "the whole state"
    click.echo(
        f"exported {part} of {shown(src)}{step_note} -> {report.destination}: "
        f"{report.tensors} tensors, {_size(report.bytes)} in {elapsed:.2f} s"
    )
    if report.tied:
        click.echo(f"tied ({len(report.tied)}), stored once; loaders re-tie them from the model:")
        for name, kept in report.tied.items():
            click.echo(f"  - {name} = {kept}")
    if report.dropped:
        click.echo(f"left out ({len(report.dropped)}):")
        for item in report.dropped:
            click.echo(f"  - {item}")
