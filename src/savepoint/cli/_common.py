"""What every ``savepoint`` command shares: the options every command has (``--json``,
``--progress/--no-progress``, ``-v``), the one JSON shape every ``--json`` prints, failing with
exit status 1 (as text on stderr, and as a JSON error object on stdout under ``--json``), path
arguments (local paths and the URLs of every store savepoint reaches), the progress bar, and
telling savepoint's own checkpoints (at any of those) from the other formats it reads (local
files only: see :func:`fail_read`) and from run and sweep directories (see :func:`not_a_checkpoint`).

The JSON shape (``docs/cli.md``): one object per command, whose first keys are always
``savepoint_cli`` (the version of this shape, :data:`JSON_VERSION`), ``command``, ``format`` and
``version`` (the format of what the command read or wrote, and that format's version, null where
it has none); an error adds ``error: {type, message, path}`` and exits nonzero.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import click

from savepoint import pathkind
from savepoint.codecs import manifest as mf
from savepoint.commit import transaction
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
)
from savepoint.formats import boostr, burn, dcp_import, detect, huggingface, training_artifact
from savepoint.storage.paths import Location, local_path, resolve

JSON_VERSION = 1  # the version of the --json shape; bumped only when a key changes meaning
PROGRESS_DELAY = 1.0  # seconds an operation runs before its progress bar appears

_JSON = "savepoint.json"  # ctx.meta keys
_PROGRESS = "savepoint.progress"
_VERBOSE = "savepoint.verbose"

F = TypeVar("F", bound=Callable[..., Any])


# ---------------------------------------------------------------------------------------------
# commands and their shared options
# ---------------------------------------------------------------------------------------------


class Command(click.Command):
    """A savepoint command: under ``--json`` a usage error (exit 2) also prints a JSON error
    object on stdout, as every other failure does."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        wants_json = "--json" in args[: args.index("--")] if "--" in args else "--json" in args
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            if wants_json:
                _echo_error_json(info_name or self.name or "", "UsageError", exc.format_message())
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            if ctx.meta.get(_JSON):
                _echo_error_json(ctx.info_name or "", "UsageError", exc.format_message())
            raise


def command(
    name: str, *, short: str, json_help: str, progress: bool = True
) -> Callable[[F], Command]:
    """``click.command`` for a savepoint command (``short``: its line in ``savepoint --help``),
    adding the shared options after its own:
    ``--json`` (passed on as ``as_json``, with ``json_help``), ``--progress/--no-progress``
    (where the command can take long; read back by :func:`progress`) and ``-v/--verbose``
    (log records of the ``savepoint`` loggers on stderr)."""

    def decorate(f: F) -> Command:
        @functools.wraps(f)
        def callback(**kwargs: Any) -> Any:
            ctx = click.get_current_context()
            ctx.meta[_JSON] = bool(kwargs.get("as_json"))
            if progress:
                ctx.meta[_PROGRESS] = kwargs.pop("show_progress")
            verbose = kwargs.pop("verbose") + ctx.meta.get(_VERBOSE, 0)
            if verbose:
                setup_logging(ctx, verbose)
            return f(**kwargs)

        cmd = click.command(name, cls=Command, short_help=short)(callback)
        cmd.params.append(click.Option(["--json", "as_json"], is_flag=True, help=json_help))
        if progress:
            cmd.params.append(
                click.Option(
                    ["--progress/--no-progress", "show_progress"],
                    default=None,
                    help="Show a progress bar on stderr (default: when stderr is a terminal and "
                    f"the work takes over {PROGRESS_DELAY:g} s).",
                )
            )
        cmd.params.append(
            click.Option(
                ["-v", "--verbose"],
                count=True,
                help="Log what the library does on stderr (-vv: debug detail).",
            )
        )
        assert isinstance(cmd, Command)
        return cmd

    return decorate


def set_verbose(ctx: click.Context, verbose: int) -> None:
    """Remember the group's ``-v`` count for the command's own (they add up)."""
    ctx.meta[_VERBOSE] = verbose


def setup_logging(ctx: click.Context, verbose: int) -> None:
    """Send the ``savepoint`` loggers' records to stderr for the rest of the command: INFO with
    one ``-v``, DEBUG with two."""
    logger = logging.getLogger("savepoint")
    if any(getattr(h, "_savepoint_cli", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler._savepoint_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(levelname).1s %(name)s: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)

    def restore() -> None:
        logger.removeHandler(handler)
        logger.setLevel(level)

    ctx.call_on_close(restore)


# ---------------------------------------------------------------------------------------------
# output: JSON, failures, progress
# ---------------------------------------------------------------------------------------------


def json_mode() -> bool:
    """Whether the running command was given ``--json``."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get(_JSON))


def envelope(format: str | None, version: int | None, command: str | None = None) -> dict[str, Any]:
    """The keys that open every JSON document the commands print."""
    if command is None:
        ctx = click.get_current_context(silent=True)
        command = ctx.info_name if ctx and ctx.info_name else ""
    return {"savepoint_cli": JSON_VERSION, "command": command, "format": format, "version": version}


def echo_json(
    doc: Mapping[str, Any],
    *,
    format: str | None,
    version: int | None,
    default: Callable[[Any], Any] | None = None,
) -> None:
    """Print ``doc`` under the shared keys (:func:`envelope`) as JSON indented by two spaces,
    the form every ``--json`` option prints."""
    head = envelope(format, version)
    out = {**head, **{k: v for k, v in doc.items() if k not in head}}
    click.echo(json.dumps(out, indent=2, default=default, allow_nan=False))


def _echo_error_json(
    command: str,
    kind: str,
    message: str,
    path: str | None = None,
    *,
    format: str | None = None,
    version: int | None = None,
    details: Mapping[str, Any] | None = None,
) -> None:
    doc = envelope(format, version, command)
    doc.update(details or {})
    doc["error"] = {"type": kind, "message": message, "path": path}
    click.echo(json.dumps(doc, indent=2, default=str))


def echo_error_json(
    kind: str,
    message: str,
    path: str | None,
    *,
    format: str | None = None,
    version: int | None = None,
    details: Mapping[str, Any] | None = None,
) -> None:
    """Under ``--json``, print the JSON error object (with ``details`` beside ``error``) on
    stdout; for a command that prints its own ``error:`` lines on stderr and exits itself."""
    if json_mode():
        ctx = click.get_current_context()
        _echo_error_json(
            ctx.info_name or "",
            kind,
            message,
            path,
            format=format,
            version=version,
            details=details,
        )


def fail(exc: CheckpointError | str, *, path: str | None = None) -> NoReturn:
    """Print ``exc`` as ``error: ...`` on stderr and exit 1 (the checkpoint's problem, not
    usage); under ``--json`` also print the JSON error object on stdout."""
    message = str(exc)
    click.echo(f"error: {message}", err=True)
    if json_mode():
        kind = type(exc).__name__ if isinstance(exc, CheckpointError) else "CheckpointError"
        where = exc.path if isinstance(exc, CheckpointError) else path
        ctx = click.get_current_context()
        _echo_error_json(ctx.info_name or "", kind, message, where)
    sys.exit(1)


class Progress:
    """A progress callback ``(done, total)`` in bytes for the library, drawing a tqdm bar on
    stderr; :meth:`echo` prints a line of output without tearing the bar."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def __call__(self, done: int, total: int) -> None:
        bar = self._bar
        if bar.total != total:
            bar.total = total
        if done != bar.n:
            bar.update(done - bar.n)

    def echo(self, text: str) -> None:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stdout):
            click.echo(text)


@contextmanager
def progress(label: str, total: int | None = None) -> Iterator[Progress]:
    """A byte-count progress bar labelled ``label``, drawn by tqdm on stderr (stdout stays
    clean for ``--json``) once the operation has run :data:`PROGRESS_DELAY` seconds, and removed
    when it ends. Shown when stderr is a terminal, always with ``--progress``, never with
    ``--no-progress``."""
    from tqdm import tqdm

    ctx = click.get_current_context(silent=True)
    wanted = ctx.meta.get(_PROGRESS) if ctx else None
    bar = tqdm(
        total=total,
        desc=label,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        delay=PROGRESS_DELAY,
        disable=None if wanted is None else not wanted,
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    try:
        yield Progress(bar)
    finally:
        bar.close()


# ---------------------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------------------


def local(path: str, what: str = "path") -> str:
    """``path`` as the commands pass it on: a local path (a ``file://`` URL mapped to one), or
    the URL as given when it names a store savepoint reaches (``memory://``, ``s3://``, ...; see
    :mod:`savepoint.storage.paths`). A URL savepoint cannot use exits 1 with the library's
    reason (the extra to install, a malformed URL, ...)."""
    try:
        return local_path(path, what=what)
    except CheckpointError:
        pass  # a URL: usable if it resolves to a store
    try:
        resolve(path, what=what)
    except CheckpointError as exc:
        fail(exc)
    return path


def local_file(path: str, what: str = "path") -> str:
    """``path`` as a local path, for what only local files can be (a plot); any URL other than
    ``file://`` exits 1 with the library's refusal."""
    try:
        return local_path(path, what=what)
    except CheckpointError as exc:
        fail(exc)


def location(path: str, what: str = "path") -> Location:
    """The store and path that ``path`` (as :func:`local` returned it) names."""
    try:
        return resolve(path, what=what)
    except CheckpointError as exc:
        fail(exc)


def shown(path: str) -> str:
    """How output names ``path``: a local path made absolute, a URL as the store writes it."""
    return str(location(path))


def named(path: str, described: str) -> str:
    """How output names the checkpoint the user gave as ``path`` and the library ``described``
    (as ``CheckpointInfo.path`` or a diff names it): on the local disk what the library says,
    as always; elsewhere the URL as given, not the generation prefix an object store keeps the
    checkpoint under (nor, for a run's alias, the step its pointer names)."""
    return described if location(path).is_local else shown(path)


def is_foreign(path: str) -> bool:
    """True when ``path`` holds a checkpoint in a format other than savepoint's own, or is an
    existing non-directory that detection refuses (a FIFO, a device, an unknown file) or a sweep
    of training artifacts: its reason is the one to report, not the native reader's "not a
    checkpoint directory". Always False for a URL (the other formats are local files; see
    :func:`fail_read`), which is decided without touching the filesystem."""
    if not location(path).is_local:
        return False
    try:
        return detect.detect(path) != "savepoint"
    except CheckpointError:
        # A sweep of training artifacts: detection's message (name a variant) is the useful one.
        return (os.path.lexists(path) and not os.path.isdir(path)) or training_artifact.is_sweep(
            path
        )


# What names a checkpoint of another format on a store: a file name of a single-file format, or
# the file that marks a boostr checkpoint or a training artifact (and what it marks).
_FOREIGN_SUFFIXES = (".shrew", ".safetensors", "." + burn.EXTENSION)
_FOREIGN_MARKERS = {
    boostr.STATE: "a boostr checkpoint",
    boostr.SHARDING: "a distributed boostr checkpoint",
    training_artifact.REPORT_FILE: "a training artifact",
    training_artifact.COMPARISON_FILE: "a sweep of training artifacts",
    huggingface.INDEX: "a Hugging Face model directory",
    huggingface.SINGLE: "a Hugging Face model directory",
    dcp_import.METADATA: "a torch.distributed.checkpoint checkpoint",
}
_FOREIGN_FORMATS = (
    ".safetensors, .shrew, burn .mpk, boostr, training artifacts, Hugging Face model directories, "
    "DCP, DeepSpeed and Orbax directories"
)


def foreign_url(path: str) -> bool:
    """True when ``path`` is a URL that names a checkpoint of another format (a ``.shrew``,
    ``.safetensors`` or ``.mpk`` name, any file: savepoint's checkpoints are directories, or a
    directory with a boostr or training-artifact marker file); those formats are local files."""
    where = location(path)
    if where.is_local:
        return False
    if where.path.lower().endswith(_FOREIGN_SUFFIXES):
        return True
    try:
        found = where.store.stat(where.path)
        if found is None:
            return False
        return found.kind != "dir" or _marker(where) is not None
    except OSError:
        return False


def _marker(where: Location) -> str | None:
    """The marker file of another format in the directory ``where`` (raises OSError)."""
    store = where.store
    for name in _FOREIGN_MARKERS:
        if store.stat(store.join(where.path, name)) is not None:
            return name
    return None


def fail_read(exc: CheckpointError, *paths: str, any_format: bool = False) -> NoReturn:
    """Exit 1 after savepoint's reader failed with ``exc`` on ``paths``; when one of them is a
    URL naming a checkpoint of another format, saying that no savepoint checkpoint is there and
    that the other formats are read from local files only (:func:`foreign_at_url`), instead of
    the native reader's complaint; and when one is a run or sweep directory, a run's
    checkpoints/ folder or a local file of another format, saying so and what to run
    (:func:`not_a_checkpoint`; ``any_format``: the command reads every format, so a file of
    another format is no mistake)."""
    for path in paths:
        if foreign_url(path):
            fail(foreign_at_url(path))
    if isinstance(exc, (IncompleteCheckpointError, IncompatibleCheckpointError)):
        for path in paths:
            if _about(exc, path):
                better = not_a_checkpoint(path, any_format=any_format)
                if better is not None:
                    fail(better)
    fail(exc)


def _about(exc: CheckpointError, path: str) -> bool:
    """Whether ``exc`` is about ``path`` (or names no path)."""
    if exc.path is None:
        return True
    try:
        if location(path).is_local:
            return os.path.abspath(exc.path) == os.path.abspath(local_path(path))
    except CheckpointError:
        pass
    return exc.path.rstrip("/") == path.rstrip("/")


def foreign_at_url(path: str) -> CheckpointError:
    """Why the command cannot read the URL ``path``, which :func:`foreign_url` found naming no
    savepoint checkpoint but a file, a directory of another format or nothing: what is there,
    and that the other formats are read from local files only (copy it to one). Not the library's
    refusal of a URL (``this reads and writes local files only``): the commands do read URLs,
    of savepoint's own checkpoints."""
    where = location(path)
    store = where.store
    command = _command_name()
    try:
        found = store.stat(where.path)
        marker = _marker(where) if found is not None and found.kind == "dir" else None
    except OSError:
        found, marker = None, None
    if found is None:
        return CheckpointNotFoundError(
            f"no checkpoint at {path}: nothing is there (checkpoints of other formats, "
            f"{_FOREIGN_FORMATS}, are read from local files only: `{command}` reads a copy on a "
            "local path)",
            path=path,
        )
    if marker is not None:
        what = f"it is a directory holding {marker} ({_FOREIGN_MARKERS[marker]})"
    elif store.basename(where.path) == mf.NAME and transaction.resolve(
        store, store.parent(where.path), strict=False
    ):
        parent = path.rstrip("/").rpartition("/")[0]
        return IncompatibleCheckpointError(
            f"no savepoint checkpoint at {path}: it is the {mf.NAME} of the checkpoint {parent} "
            "(a checkpoint is a directory): pass that directory",
            path=path,
        )
    else:
        what = "it is a file, and a savepoint checkpoint is a directory" + _not_shrew_either(where)
    return IncompatibleCheckpointError(
        f"no savepoint checkpoint at {path} (no {mf.NAME} under it): {what}. Checkpoints of "
        f"other formats ({_FOREIGN_FORMATS}) are read from local files only: copy it to a "
        f"local path and run `{command}` on the copy",
        path=path,
    )


def _not_shrew_either(where: Location) -> str:
    """For an object named ``*.shrew`` that does not start with the magic: that it is not a
    .shrew file either (copying it to a local path would not help)."""
    from savepoint.formats import shrew

    if not where.path.lower().endswith(".shrew"):
        return ""
    try:
        blob = where.store.open_blob(where.path)
        try:
            head = bytearray(min(len(shrew.MAGIC), blob.size))
            blob.read(0, head)
        finally:
            blob.close()
    except (OSError, EOFError, ValueError):
        return ""
    if bytes(head) == shrew.MAGIC:
        return ""
    found = f"starts with {bytes(head)!r}" if head else "is empty"
    return f"; nor is it a valid .shrew file: it {found}, and a .shrew file starts with {shrew.MAGIC!r}"


# ---------------------------------------------------------------------------------------------
# what is there instead of a checkpoint
# ---------------------------------------------------------------------------------------------


def _command_name() -> str:
    ctx = click.get_current_context(silent=True)
    return f"savepoint {ctx.info_name}" if ctx and ctx.info_name else "savepoint"


def sweep_runs(where: Location) -> list[str]:
    """The names of the run directories directly under ``where`` (a sweep), sorted; empty when
    ``where`` is no directory or holds no run (raises OSError when the store cannot say)."""
    from savepoint.runs import layout

    if not layout.is_dir(where):
        return []
    store = where.store
    return sorted(e for e in store.list(where.path) if layout.is_run(where.join(e)))


def not_a_checkpoint(path: str, *, any_format: bool = False) -> CheckpointError | None:
    """What the command should say when ``path``, given where a savepoint checkpoint belongs,
    holds something else :func:`savepoint.pathkind.classify` (the library's classifier, behind
    ``sp.load``'s errors too) can name: a run directory, a sweep of runs, a run's
    ``checkpoints/`` folder (each with the commands that read it), an empty or
    plain directory, or a local file or directory of another format (the reason its format's
    reader gives, or which format it is and how to convert it; not with ``any_format``). None
    when there is nothing better to say than the reader's own error (a save that did not
    commit, say)."""
    command = _command_name()
    found = pathkind.classify(location(path))
    if found is None:
        return None
    kind, base = found.kind, path.rstrip("/")
    if kind in ("file", "format"):
        if any_format or found.remote:
            return None  # the command reads it; URLs of other formats: see fail_read
        if found.error is not None:
            return found.error  # its format's reason: a bad .shrew magic, ...
        return _foreign(path, found, command)
    if kind == "run":
        return IncompatibleCheckpointError(_run_hint(path, command), path=path)
    if kind == "sweep":
        return IncompatibleCheckpointError(_sweep_hint(path, list(found.runs), command), path=path)
    if kind == "run-folder":
        from savepoint.runs import layout

        parent = base.rpartition("/")[0] or "."
        example = f"{base}/{layout.step_name(found.steps[-1] if found.steps else 1)}"
        return IncompatibleCheckpointError(
            f"{path} is the checkpoints/ folder of the run {parent}, not a checkpoint: name "
            f"one of its steps (`{command} {example}`), or list them with "
            f"`savepoint ls {parent}`",
            path=path,
        )
    said = pathkind.described(dataclasses.replace(found, path=path))
    if kind == "artifact-sweep":
        return IncompatibleCheckpointError(
            f"{said}: name one of its variant directories (`{command} {base}/VARIANT`)",
            path=path,
        )
    if kind in ("empty", "directory"):
        return IncompatibleCheckpointError(
            f"{said}; `{command}` takes a savepoint checkpoint (a directory holding "
            f"{mf.NAME}), a run's RUN/latest or RUN/checkpoints/step-N",
            path=path,
        )
    return None


def _run_hint(path: str, command: str) -> str:
    base = path.rstrip("/")
    steps = (
        f"; `savepoint diff {base} STEP STEP` compares two of its steps (a number, latest or best)"
        if command == "savepoint diff"
        else ""
    )
    return (
        f"{path} is a savepoint run directory (made by sp.CheckpointManager), not a checkpoint: "
        f"its checkpoints are {base}/latest, {base}/best and {base}/checkpoints/step-N, so try "
        f"`{command} {base}/latest`{steps}. `savepoint ls {base}` lists its checkpoints, "
        f"`savepoint verify {base}` checks them all, `savepoint report {base}` summarises the run"
    )


def _sweep_hint(path: str, runs: list[str], command: str) -> str:
    base = path.rstrip("/")
    shown_runs = ", ".join(runs[:5]) + (", ..." if len(runs) > 5 else "")
    return (
        f"{path} is a sweep of {len(runs)} run(s) ({shown_runs}), not a checkpoint: "
        f"`savepoint report {base}` ranks them, `savepoint ls {base}/{runs[0]}` lists one run's "
        f"checkpoints, and `{command} {base}/{runs[0]}/latest` reads its newest"
    )


def _foreign(path: str, found: pathkind.Found, command: str) -> CheckpointError:
    """A local file or directory of another format given to a command that reads savepoint
    checkpoints."""
    stem = os.path.splitext(os.path.basename(path.rstrip("/")))[0] or "checkpoint"
    return IncompatibleCheckpointError(
        f"{path} is a {found.label}, not a savepoint checkpoint: `{command}` reads savepoint "
        f"checkpoints; convert it first with `savepoint convert {path} {stem}-ckpt`",
        path=path,
    )
