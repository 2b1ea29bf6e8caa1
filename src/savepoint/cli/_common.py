"""What every ``savepoint`` command shares: failing with exit status 1, local paths, JSON output,
the progress bar, and telling savepoint's own checkpoints from the other formats it reads."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click

from savepoint.errors import CheckpointError
from savepoint.formats import detect, training_artifact
from savepoint.storage.paths import local_path


def fail(exc: CheckpointError) -> NoReturn:
    """Print ``exc`` as ``error: ...`` on stderr and exit 1 (the checkpoint's problem, not usage)."""
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


def local(path: str, what: str = "path") -> str:
    """``path`` as a local path (file:// mapped); a URL savepoint cannot use exits 1 with why."""
    try:
        return local_path(path, what=what)
    except CheckpointError as exc:
        fail(exc)


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
    checkpoint directory"."""
    try:
        return detect.detect(path) != "savepoint"
    except CheckpointError:
        # A sweep of training artifacts: detection's message (name a variant) is the useful one.
        return (os.path.lexists(path) and not os.path.isdir(path)) or training_artifact.is_sweep(
            path
        )
