"""The ``savepoint`` command line (also ``python -m savepoint``): the group :data:`main`, with one
module per command beside it.

Exit status: 0 success; 1 the checkpoint is missing, incomplete, corrupt or incompatible (the
reason is printed on stderr); 2 a usage error.
"""

from __future__ import annotations

import click

from savepoint._version import __version__
from savepoint.cli import consolidate, convert, diff, gc, inspect, ls, report, verify

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="savepoint")
def main() -> None:
    """Inspect, verify and compare savepoint checkpoints and run directories; collect their
    garbage."""


main.add_command(consolidate.consolidate_cmd)
main.add_command(convert.convert_cmd)
main.add_command(diff.diff_cmd)
main.add_command(gc.gc_cmd)
main.add_command(inspect.inspect_cmd)
main.add_command(ls.ls_cmd)
main.add_command(report.report_cmd)
main.add_command(verify.verify_cmd)
