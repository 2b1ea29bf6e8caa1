"""The ``savepoint`` command line (also ``python -m savepoint``): the group :data:`main`, with one
module per command beside it.

Exit status: 0 success; 1 the checkpoint is missing, incomplete, corrupt or incompatible (the
reason is printed on stderr, and under ``--json`` as a JSON error object on stdout); 2 a usage
error. Every command takes ``--json`` (one documented shape: ``docs/cli.md``) and ``-v``; those
that can take long show a progress bar on stderr (``--progress/--no-progress``).

A command's module (and what it needs of the library: numpy, the formats, the engine) is imported
only when that command runs or is asked for (``main.commands[name]``, ``savepoint NAME --help``):
``savepoint --help`` lists the commands from :data:`COMMANDS` and imports none of them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from typing import Any

import click

from savepoint._version import __version__

__all__ = ["COMMANDS", "main"]

# name -> (the click command's attribute in savepoint.cli.<name>, its line in ``savepoint
# --help``). The line is the command's own ``short`` (tests/test_cli_messages.py checks that
# ``savepoint --help`` prints the same with every command loaded).
COMMANDS: dict[str, tuple[str, str]] = {
    "consolidate": ("consolidate_cmd", "Write a sharded checkpoint as an unsharded one."),
    "convert": (
        "convert_cmd",
        "Convert a checkpoint between formats (savepoint, .shrew, safetensors, boostr, burn, .pt).",
    ),
    "copy": ("copy_cmd", "Copy a checkpoint to another place, verified and committed atomically."),
    "diff": ("diff_cmd", "Show how two checkpoints (or two steps of a run) differ."),
    "export": (
        "export_cmd",
        "Write a model's weights as a Hugging Face safetensors file, or a sharded directory.",
    ),
    "gc": ("gc_cmd", "Remove what failed or interrupted saves left in a run."),
    "inspect": ("inspect_cmd", "Describe what a checkpoint holds (any format savepoint reads)."),
    "ls": ("ls_cmd", "List a run's checkpoints and why each is kept."),
    "report": ("report_cmd", "Summarise a run or rank a sweep; plot the curves."),
    "verify": (
        "verify_cmd",
        "Check that a checkpoint (or every checkpoint of a run) is intact.",
    ),
}


class _Commands(MutableMapping[str, click.Command]):
    """The group's commands, each imported from its module when first looked up."""

    def __init__(self) -> None:
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        cmd = self._loaded.get(name)
        if cmd is None:
            if name not in COMMANDS:
                raise KeyError(name)
            module = importlib.import_module(f"{__name__}.{name}")
            cmd = self._loaded[name] = getattr(module, COMMANDS[name][0])
        return cmd

    def __setitem__(self, name: str, cmd: click.Command) -> None:
        self._loaded[name] = cmd

    def __delitem__(self, name: str) -> None:
        raise TypeError("savepoint's commands cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(COMMANDS) | set(self._loaded)))

    def __len__(self) -> int:
        return len(set(COMMANDS) | set(self._loaded))


class _Group(click.Group):
    """A click group whose ``--help`` lists the commands without importing them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands()

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in sorted(COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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
    from savepoint.cli._common import set_verbose

    set_verbose(ctx, verbose)
