"""What is at a path that savepoint's reader could not open as a checkpoint: the one classifier
behind the errors of ``sp.load``, ``sp.inspect`` and ``sp.verify`` (:mod:`savepoint.checkpoint`)
and of the commands (:mod:`savepoint.cli`).

:func:`classify` looks (a few ``stat`` and ``list`` calls, never a data file) and names one of
:data:`KINDS`; :func:`described` is the sentence both front ends open with ("X is a savepoint run
directory ..., not a checkpoint"), and :func:`library_message` adds what to call. The commands
word their own advice (which commands to run) after the same sentence.

======================  ======================================================================
kind                    what is there
======================  ======================================================================
``run``                 a run directory (``run.json``, or the ``report.json`` a lost one
                        leaves) made by ``sp.CheckpointManager``
``run-folder``          a run's ``checkpoints/`` folder
``sweep``               a directory of run directories (``sp.Sweep``)
``uncommitted``         a save that did not commit: a step or alias directory of a run without
                        a manifest, a directory of manifest-less generations, or savepoint data
                        files without their manifest
``format``              a checkpoint of another format savepoint reads (``format``: its name
                        as :func:`savepoint.formats.detect.detect` gives it, a DCP checkpoint
                        of DCP's own ``FileSystemWriter`` included; ``remote``: at a URL, where
                        those formats are not read)
``artifact-sweep``      a sweep of training artifacts (``comparison.json``)
``empty``               an empty directory
``directory``           a directory holding none of the above (``entries``: some of its names)
``file``                a file that is no checkpoint savepoint knows (``error``: why not)
======================  ======================================================================

A savepoint checkpoint, or nothing at all, is no kind: :func:`classify` returns None, and so it
does when the store cannot be asked (the reader's own error then stands).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from savepoint.codecs import manifest as mf
from savepoint.commit import names
from savepoint.errors import CheckpointError
from savepoint.storage.paths import Location

__all__ = ["Found", "KINDS", "SHOWN_ENTRIES", "classify", "described", "library_message"]

KINDS = (
    "run",
    "run-folder",
    "sweep",
    "uncommitted",
    "format",
    "artifact-sweep",
    "empty",
    "directory",
    "file",
)
SHOWN_ENTRIES = 5  # names of a plain directory a message lists
_SWEEP_LOOKS = 1000  # entries of a directory looked at for run directories (a stat each)
_DATA_FILE = re.compile(r"data-(?:r\d+-)?\d{5,}\.safetensors")  # savepoint's (and its DCP writer's)
_ARTIFACT_SWEEP = "training_comparison.json"  # training_artifact.COMPARISON_FILE
# The other formats by file name (at a URL, where their readers do not go) and the
# marker files of the directory formats.
_SUFFIXES = {
    ".safetensors": "safetensors",
    ".shrew": "shrew",
    ".mpk": "burn",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".ckpt": "torch",
}


@dataclass(frozen=True)
class Found:
    """What :func:`classify` found at ``path`` (as messages name it): ``kind`` (one of
    :data:`KINDS`) and what the messages need: the run's committed ``steps`` (``run``,
    ``run-folder``), the ``run`` a ``checkpoints/`` folder belongs to, the ``runs`` of a sweep,
    the ``format`` of another format's checkpoint, some
    ``entries`` of a plain directory, and the ``error`` detection gave for an unknown file.
    ``remote``: at a URL (not on the local disk), where the other formats are not read."""

    kind: str
    path: str
    steps: tuple[int, ...] = ()
    run: str = ""
    runs: tuple[str, ...] = ()
    format: str = ""
    remote: bool = False
    entries: tuple[str, ...] = ()  # at most SHOWN_ENTRIES + 1 (the last says there are more)
    error: CheckpointError | None = None

    @property
    def label(self) -> str:
        """The other format's name as a sentence names one ("safetensors file")."""
        from savepoint.formats import detect  # only once a path was found not to be ours

        return detect.LABELS.get(self.format, self.format)


def classify(where: Location) -> Found | None:
    """What is at ``where``, when it is not a savepoint checkpoint (see the module docstring);
    None for a savepoint checkpoint, for nothing at all, and when the store cannot say."""
    try:
        return _classify(where)
    except (OSError, CheckpointError):
        return None


def _classify(where: Location) -> Found | None:
    from savepoint.runs import layout

    store, shown = where.store, str(where)
    found = store.stat(store.realpath(where.path))
    if found is None:
        return None
    if found.kind != "dir":
        return _file(where)
    entries = sorted(store.list(where.path))
    # A training artifact holds a manifest.json of its own: it is looked for first.
    other = _directory_format(where, entries)
    if other is not None:
        return other
    if layout.committed(where):
        return None
    if layout.is_run(where) or layout.lost_run_file(where):
        return Found("run", shown, steps=_steps(where))
    name = store.basename(where.path)
    parent = _parent(where)
    if parent is not None and layout.is_run(parent):
        if name == layout.CHECKPOINTS:
            return Found("run-folder", shown, steps=_steps(parent), run=str(parent))
        if name in (layout.LATEST, layout.BEST):
            return Found("uncommitted", shown)  # an alias an interrupted save left empty
    grand = None if parent is None else _parent(parent)
    if (
        parent is not None
        and grand is not None
        and store.basename(parent.path) == layout.CHECKPOINTS
        and layout.is_run(grand)
    ):
        return Found("uncommitted", shown)  # a step directory
    runs = tuple(e for e in entries[:_SWEEP_LOOKS] if layout.is_run(where.join(e)))
    if runs:
        return Found("sweep", shown, runs=runs)
    if _ARTIFACT_SWEEP in entries:
        return Found("artifact-sweep", shown)
    if not entries:
        return Found("empty", shown)
    if all(names.is_generation(e) for e in entries) or any(
        _DATA_FILE.fullmatch(e) for e in entries
    ):
        return Found("uncommitted", shown)
    visible = [e for e in entries if not e.startswith(".")] or entries
    return Found("directory", shown, entries=tuple(visible[: SHOWN_ENTRIES + 1]))


def _parent(where: Location) -> Location | None:
    store = where.store
    parent = store.parent(where.path)
    return None if parent == where.path else Location(store, parent)


def _steps(run: Location) -> tuple[int, ...]:
    from savepoint.runs import layout

    try:
        return tuple(layout.committed_steps(run))
    except CheckpointError:
        return ()


def _file(where: Location) -> Found:
    """A file (or a FIFO, a device...): another format's, or nothing savepoint knows."""
    shown = str(where)
    if not where.is_local:
        suffix = os.path.splitext(where.path)[1].lower()
        return Found("file", shown, format=_SUFFIXES.get(suffix, ""), remote=True)
    from savepoint.formats import detect

    try:
        kind = detect.detect(where.path)
    except CheckpointError as exc:
        return Found("file", shown, error=exc)
    return Found("format", shown, format=kind)


def _directory_format(where: Location, entries: list[str]) -> Found | None:
    """A directory of another format (a boostr checkpoint, a training artifact or a sweep of
    them, a Hugging Face model directory, another system's checkpoint directory:
    ``formats.foreign``), by its marker files."""
    from savepoint.formats import boostr, detect, huggingface, training_artifact

    shown = str(where)
    if training_artifact.REPORT_FILE in entries:
        return Found("format", shown, format="training-artifact", remote=not where.is_local)
    if boostr.SHARDING in entries:
        return Found("format", shown, format="boostr-distributed", remote=not where.is_local)
    if boostr.STATE in entries:
        return Found("format", shown, format="boostr", remote=not where.is_local)
    if huggingface.SINGLE in entries or huggingface.INDEX in entries:
        return Found("format", shown, format="huggingface", remote=not where.is_local)
    other = detect.by_entries(entries)
    if other is not None:
        return Found("format", shown, format=other, remote=not where.is_local)
    return None


def described(found: Found) -> str:
    """The sentence that says what is at the path and that it is not a savepoint checkpoint."""
    p = found.path
    kind = found.kind
    if kind == "run":
        return f"{p} is a savepoint run directory (made by sp.CheckpointManager), not a checkpoint"
    if kind == "run-folder":
        return f"{p} is the checkpoints/ folder of the run {found.run}, not a checkpoint"
    if kind == "sweep":
        shown = ", ".join(found.runs[:SHOWN_ENTRIES]) + (
            ", ..." if len(found.runs) > SHOWN_ENTRIES else ""
        )
        return f"{p} is a sweep of {len(found.runs)} run(s) ({shown}), not a checkpoint"
    if kind == "uncommitted":
        return (
            f"{p} has no {mf.NAME}: the save that created it did not commit (or its manifest was "
            "removed)"
        )
    if kind == "format":
        where = " at a URL" if found.remote else ""
        return f"{p} is a {found.label}{where}, not a savepoint checkpoint"
    if kind == "artifact-sweep":
        return f"{p} is a sweep of training artifacts, not a checkpoint"
    if kind == "empty":
        return f"{p} is an empty directory, not a checkpoint: nothing was saved there"
    if kind == "directory":
        listed = ", ".join(found.entries[:SHOWN_ENTRIES])
        more = ", ..." if len(found.entries) > SHOWN_ENTRIES else ""
        return (
            f"{p} is a directory without {mf.NAME} (it holds {listed}{more}): not a savepoint "
            "checkpoint"
        )
    if found.error is not None:
        return str(found.error)
    if found.format:
        return f"{p} is a file (a {found.label}?) at a URL, not a savepoint checkpoint"
    return f"{p} is a file, not a savepoint checkpoint (a directory)"


def library_message(found: Found, call: str = "sp.load") -> str:
    """:func:`described`, then what to call instead (``call``: the function that was given the
    path, ``"sp.load"``, ``"sp.inspect"`` or ``"sp.verify"``)."""
    p = found.path.rstrip("/")
    kind = found.kind
    head = described(found)
    if kind == "run":
        held = (
            f"it holds the checkpoints of step(s) {_listed(found.steps)}"
            if found.steps
            else "it holds no checkpoint yet"
        )
        return (
            f"{head} ({held}): {call}('{p}/latest') takes its newest checkpoint ('{p}/best', "
            f"'{p}/checkpoints/step-N' the others), sp.open_run('{p}').load(step) "
            'chooses one as a resume does ("latest", "best" or a number; into= as sp.load), '
            f"and sp.CheckpointManager('{p}').restore(state) resumes training from it"
            + (
                f"; `savepoint verify {p}` checks every checkpoint of the run"
                if call == "sp.verify"
                else ""
            )
        )
    if kind == "run-folder":
        step = found.steps[-1] if found.steps else 1
        from savepoint.runs import layout

        return (
            f"{head}: name one of its steps ({call}('{p}/{layout.step_name(step)}')), or open "
            f"the run: sp.open_run('{found.run}').load(step)"
        )
    if kind == "sweep":
        first = found.runs[0]
        return (
            f"{head}: {call}('{p}/{first}/latest') reads one run's newest checkpoint, "
            f"sp.open_run('{p}/{first}') opens a run, sp.Sweep('{p}').compare() ranks them"
        )
    if kind == "uncommitted":
        return f"{head}; use an earlier checkpoint"
    if kind == "format":
        return (
            f"{head}: savepoint reads it from a local path; copy it to one and {call} the copy"
            if found.remote
            else head
        )
    if kind == "artifact-sweep":
        return (
            f"{head}: name one of its variant directories, or read it with "
            "savepoint.formats.training_artifact.load_sweep"
        )
    if kind in ("empty", "directory"):
        return f"{head}; {call} takes a checkpoint directory written by sp.save"
    if kind == "file" and found.remote and found.format:
        return (
            f"{head}: other formats are read from local files only: copy it to a local path and "
            f"{call} the copy"
        )
    return head


def _listed(steps: tuple[int, ...]) -> str:
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ..., {steps[-2]}, {steps[-1]}"
