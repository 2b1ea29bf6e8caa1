"""The ``savepoint`` command line (also ``python -m savepoint``): the group :data:`main`, with one
module per command beside it.

Exit status: 0 success; 1 the checkpoint is missing, incomplete, corrupt or incompatible (the
reason is printed on stderr, and under ``--json`` as a JSON error object on stdout); 2 a usage
error. Every command takes ``--json`` (one documented shape: ``docs/cli.md``) and ``-v``; those
that can take long show a progress bar on stderr (``--progress/--no-progress``).
"""

from __future__ import annotations

import click

from savepoint._version import __version__
from savepoint.cli import (
    consolidate,
    convert,
    copy,
    diff,
    export,
    gc,
    inspect,
    ls,
    report,
    verify,
)
from savepoint.cli._common import set_verbose

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="savepoint")
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="Log what the library does on stderr (-vv: debug detail); each command takes it too.",
)
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """Inspect, verify, compare, convert and export savepoint checkpoints (and the other formats
    savepoint reads); list, report on and clean up run directories.

    Every command takes --json (one JSON object on stdout, shape in docs/cli.md) and -v. Exit
    status: 0 success, 1 the checkpoint or run has a problem (the reason on stderr), 2 a usage
    error. `savepoint COMMAND --help` explains each.

    \b
    Start with:
      savepoint ls RUN              the checkpoints of a run directory
      savepoint inspect CKPT        what a checkpoint holds
      savepoint verify CKPT|RUN     is it intact?
    """
    set_verbose(ctx, verbose)


main.add_command(consolidate.consolidate_cmd)
main.add_command(convert.convert_cmd)
main.add_command(copy.copy_cmd)
main.add_command(diff.diff_cmd)
main.add_command(export.export_cmd)
main.add_command(gc.gc_cmd)
main.add_command(inspect.inspect_cmd)
main.add_command(ls.ls_cmd)
main.add_command(report.report_cmd)
main.add_command(verify.verify_cmd)
