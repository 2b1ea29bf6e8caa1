"""What every ``savepoint`` command shares: failing with exit status 1, path arguments (local
paths and the URLs of every store savepoint reaches), JSON output, the progress bar, and telling
savepoint's own checkpoints (at any of those) from the other formats it reads (local files only:
see :func:`fail_read`)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click

from savepoint.codecs import manifest as mf
from savepoint.commit import transaction
from savepoint.errors import CheckpointError, CheckpointNotFoundError, IncompatibleCheckpointError
from savepoint.formats import boostr, burn, detect, training_artifact
from savepoint.storage.paths import Location, local_path, resolve


def fail(exc: CheckpointError) -> NoReturn:
    """Print ``exc`` as ``error: ...`` on stderr and exit 1 (the checkpoint's problem, not usage)."""
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


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


def echo_json(doc: Any, *, default: Callable[[Any], Any] | None = None) -> None:
    """Print ``doc`` as JSON indented by two spaces, the form every ``--json`` option prints."""
    click.echo(json.dumps(doc, indent=2, default=default))


@contextmanager
def progress(label: str) -> Iterator[Callable[[int, int], None]]:
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
}
_FOREIGN_FORMATS = ".safetensors, .shrew, burn .mpk, boostr, training artifacts"


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


def fail_read(exc: CheckpointError, *paths: str) -> NoReturn:
    """Exit 1 after savepoint's reader failed with ``exc`` on ``paths``; when one of them is a
    URL naming a checkpoint of another format, saying that no savepoint checkpoint is there and
    that the other formats are read from local files only (:func:`foreign_at_url`), instead of
    the native reader's complaint."""
    for path in paths:
        if foreign_url(path):
            fail(foreign_at_url(path))
    fail(exc)


def foreign_at_url(path: str) -> CheckpointError:
    """Why the command cannot read the URL ``path``, which :func:`foreign_url` found naming no
    savepoint checkpoint but a file, a directory of another format or nothing: what is there,
    and that the other formats are read from local files only (copy it to one). Not the library's
    refusal of a URL (``this reads and writes local files only``): the commands do read URLs,
    of savepoint's own checkpoints."""
    where = location(path)
    store = where.store
    context = click.get_current_context(silent=True)
    command = f"savepoint {context.info_name}" if context and context.info_name else "savepoint"
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
        what = "it is a file, and a savepoint checkpoint is a directory"
    return IncompatibleCheckpointError(
        f"no savepoint checkpoint at {path} (no {mf.NAME} under it): {what}. Checkpoints of "
        f"other formats ({_FOREIGN_FORMATS}) are read from local files only: copy it to a "
        f"local path and run `{command}` on the copy",
        path=path,
    )
