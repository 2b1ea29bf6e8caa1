"""Every error savepoint raises on purpose.

::

    CheckpointError                      base; .path is the checkpoint (or file) concerned
    ├── CheckpointNotFoundError          (also FileNotFoundError) nothing at that path
    ├── IncompleteCheckpointError        (also FileNotFoundError) a directory without a committed manifest
    ├── CorruptCheckpointError           (also ValueError) checksum, truncation, bad header or manifest
    │   ├── MissingCheckpointError       a checkpoint a run relies on (its best) is not on disk
    │   │   └── MissingBestValidationArtifact  a training artifact's best_validation/ is missing
    │   ├── SymlinkError                 a checkpoint file is a symlink (never followed)
    │   └── NotRegularFileError          a FIFO, socket, device or directory where a file belongs
    ├── IncompatibleCheckpointError      (also ValueError) format version, shape or dtype disagreement
    │   ├── StateMismatchError           ``load(into=...)`` found keys, shapes or dtypes that disagree
    │   ├── RunMismatchError             run.json, report.json and the caller disagree about a run
    │   │   └── ArtifactMismatchError    a training artifact's report and manifest disagree
    │   ├── OptimizerStateError          an OptimizerState cannot be loaded as asked
    │   ├── DataStateError               a DataPosition / ResumableSampler cannot be restored
    │   └── RNGStateError                random generator states cannot be restored
    ├── CheckpointPermissionError        (also PermissionError) a file or directory cannot be read
    ├── CheckpointArgumentError          (also TypeError, ValueError) a call given what it does not
    │                                    take (torch.save's argument order, map_location=, ...)
    ├── UnsupportedStateError            (also TypeError) a leaf or key savepoint cannot store
    │   └── ConversionError              ``convert`` target cannot hold part of the source
    ├── CheckpointMemoryError            (also MemoryError) the memory a load needs for a tensor
    │                                    cannot be allocated
    ├── ReplacedWhileReadingError        a writer kept replacing the checkpoint while it was read
    ├── UnsupportedStorageError          (also ValueError) a URL savepoint cannot read or write
    │                                    here (no backend, or its extra is not installed)
    ├── UnsupportedDeviceError           (also ValueError) ``device=`` names a device this process
    │                                    cannot use
    ├── CheckpointWriteError             (also OSError) the save failed (disk full, fsync error, ...)
    │   └── RunLockedError               another process holds the run directory's writer lock
    └── DistributedCheckpointError       (also RuntimeError) a sharded save or load failed on some
                                         rank(s) or one stopped answering; raised on every rank

Each error subclasses the built-in a caller would naturally catch, so ``except FileNotFoundError`` or
``except ValueError`` keeps working. Messages say what went wrong and what to do next.
"""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ArtifactMismatchError",
    "CheckpointArgumentError",
    "CheckpointError",
    "CheckpointMemoryError",
    "CheckpointNotFoundError",
    "CheckpointPermissionError",
    "CheckpointWriteError",
    "ConversionError",
    "CorruptCheckpointError",
    "DataStateError",
    "DistributedCheckpointError",
    "IncompatibleCheckpointError",
    "IncompleteCheckpointError",
    "MissingBestValidationArtifact",
    "MissingCheckpointError",
    "NotRegularFileError",
    "OptimizerStateError",
    "RNGStateError",
    "ReplacedWhileReadingError",
    "RunLockedError",
    "RunMismatchError",
    "StateMismatchError",
    "SymlinkError",
    "UnsupportedDeviceError",
    "UnsupportedStateError",
    "UnsupportedStorageError",
]


class CheckpointError(Exception):
    """Base of every error savepoint raises on purpose. ``path`` names the checkpoint or file."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path: str | None = os.fspath(path) if path is not None else None

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only constructors do not survive the default exception pickling used by
        # multiprocessing; rebuild from the message and path instead.
        state = dict(self.__dict__)
        if isinstance(self, OSError):
            state["errno"] = self.errno  # a slot of OSError, not in __dict__
        return (_rebuild, (type(self), self.message, self.path, state))


def _rebuild(
    cls: type[CheckpointError], message: str, path: str | None, state: dict[str, Any]
) -> Any:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    for key, value in state.items():
        setattr(err, key, value)
    err.message, err.path = message, path
    return err


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing exists at the given path."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """The path exists but holds no committed manifest (an interrupted or foreign directory)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Bytes on disk disagree with what was committed: checksum, truncation, malformed header."""

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.key = key


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint is intact but cannot be used as asked (format version, shape, dtype)."""


class MissingCheckpointError(CorruptCheckpointError):
    """A checkpoint the run's report relies on (its best, say) is not on disk."""


class MissingBestValidationArtifact(MissingCheckpointError):
    """A training artifact's report has a best validation that is not the last step, and
    ``best_validation/`` has no manifest (the seed's ``MissingBestValidationArtifact``); ``path``
    is that directory."""


class SymlinkError(CorruptCheckpointError):
    """A checkpoint file was a symlink, which savepoint refuses to follow (a checkpoint's files are
    never links).

    ``filename``, ``errno`` (``ELOOP``) and ``strerror`` are kept for callers that word their own
    message; ``path`` is the file as shown to the user."""

    def __init__(self, filename: str, shown: str) -> None:
        super().__init__(f"{shown} is a symlink; refusing to follow it", path=shown)
        self.filename = filename
        self.errno = _errno.ELOOP
        self.strerror = "is a symlink"


class NotRegularFileError(CorruptCheckpointError):
    """Something that is not a regular file was found where a file belongs: a FIFO (whose open
    would block until a writer appears), a socket, a device or a directory. It is refused without
    being opened for a blocking read; ``errno`` is ``EINVAL``."""

    def __init__(self, filename: str, shown: str) -> None:
        super().__init__(
            f"{shown} is not a regular file (a FIFO, socket, device or directory); refusing to "
            "read it",
            path=shown,
        )
        self.filename = filename
        self.errno = _errno.EINVAL
        self.strerror = "is not a regular file"


class RunMismatchError(IncompatibleCheckpointError):
    """What a run directory claims (run.json, report.json, the caller) does not agree."""


class ArtifactMismatchError(RunMismatchError):
    """A training artifact's report and its manifest (or ``best_validation/``'s manifest)
    disagree (the seed's ``ArtifactMismatch``)."""


def _problem_lines(problems: Sequence[str]) -> str:
    return "\n".join(f"  - {p}" for p in problems)


class OptimizerStateError(IncompatibleCheckpointError):
    """An optimizer state cannot be loaded as asked; ``problems`` lists every reason."""

    def __init__(self, what: str, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"{what}, {len(self.problems)} problem(s):\n{_problem_lines(problems)}")


class DataStateError(IncompatibleCheckpointError):
    """A data position cannot be restored as asked; ``problems`` lists every reason."""

    def __init__(self, what: str, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"{what}, {len(self.problems)} problem(s):\n{_problem_lines(problems)}")


class RNGStateError(IncompatibleCheckpointError):
    """Random generator states cannot be restored as asked; ``problems`` lists every reason."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(
            f"cannot restore the random generators, {len(self.problems)} problem(s); no generator "
            f"was changed:\n{_problem_lines(problems)}\n(RNGState(strict=False) restores what it "
            "can)"
        )


class StateMismatchError(IncompatibleCheckpointError):
    """``load(into=...)`` found problems; ``problems`` lists every one (key, what is wrong), and
    ``hints`` what to pass instead where that can be told (``into`` given one level too high or
    too low: ``into=model`` for a checkpoint saved as ``{"model": model}``)."""

    def __init__(
        self,
        problems: Sequence[tuple[str, str]],
        *,
        path: str | os.PathLike[str] | None = None,
        hints: Sequence[str] = (),
    ) -> None:
        self.problems = list(problems)
        self.hints = list(hints)
        lines = "\n".join(f"  {key or '<root>'}: {what}" for key, what in self.problems)
        advice = "".join(f"\nhint: {h}" for h in self.hints)
        super().__init__(
            f"cannot restore into the given state, {len(self.problems)} problem(s); nothing was "
            f"modified:\n{lines}{advice}",
            path=path,
        )


class CheckpointPermissionError(CheckpointError, PermissionError):
    """A checkpoint file or directory exists but this process may not read it (mode, ACL, owner).

    Nothing is wrong with the checkpoint itself: fix the permissions (or run as a user who may read
    it) and load again. ``errno`` is ``errno.EACCES`` or ``errno.EPERM``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.errno = errno


class CheckpointArgumentError(CheckpointError, TypeError, ValueError):
    """A call was given arguments it does not take: ``sp.save(state, path)`` (torch.save's
    order), ``sp.load(path, model)`` or ``map_location=`` (torch.load's), a misspelt keyword, a
    path naming a single-file format (``model.safetensors``) where ``sp.save`` writes a
    checkpoint directory. The message names the savepoint argument or call to use instead.
    Nothing was read or written. Also a TypeError (what Python raises for a bad call) and a
    ValueError (a path of the wrong form)."""


class UnsupportedStateError(CheckpointError, TypeError):
    """A leaf, key or metadata value savepoint cannot store; ``key`` is its path in the tree."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ConversionError(UnsupportedStateError):
    """``convert`` cannot write part of the source in the ``target`` format without losing it;
    ``problems`` lists every part (all of them, found before anything is written).

    ``label`` is how the message names the target (``".shrew v1"``); the target's name otherwise.
    ``hint`` replaces the closing advice (``convert``'s ``--lossy``) where it does not apply
    (``export``, which takes no ``--lossy``).
    """

    def __init__(
        self,
        target: str,
        problems: list[str],
        *,
        label: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.target = target
        self.problems = list(problems)
        shown = self.problems[:25]
        more = len(self.problems) - len(shown)
        lines = _problem_lines(shown) + (f"\n  ... and {more} more" if more else "")
        if hint is None:
            hint = (
                "Convert with lossy=True (savepoint convert --lossy) to leave them out, or choose "
                "a format that holds them (savepoint's own format holds everything)."
            )
        super().__init__(
            f"cannot convert to {label or target} without losing data; "
            f"{len(self.problems)} part(s) it cannot hold:\n{lines}\n{hint}"
        )


class CheckpointMemoryError(CheckpointError, MemoryError):
    """The memory a load needs for a tensor (the size its checkpoint records) cannot be
    allocated. The message names the tensor and the bytes; a checkpoint that claims more than
    its files or blobs hold (hostile or damaged) is caught here when the claim is too big to
    allocate, and by the reads otherwise."""


class ReplacedWhileReadingError(CheckpointError):
    """A checkpoint was replaced or deleted by a writer while it was being read, on a store that
    keeps no bytes for open readers (object stores), or replaced while the blobs only it named
    were collected (incremental checkpoints, any store). Nothing is wrong with either checkpoint:
    ``sp.load`` and ``sp.verify`` start again on the checkpoint now at the path, and raise this
    only when that keeps happening (a writer replacing it faster than it can be read)."""


class UnsupportedStorageError(CheckpointError, ValueError):
    """A path argument is a URL savepoint cannot read or write here.

    ``scheme`` is the URL's scheme, lowercased (``"s3"``); ``path`` is the URL as given. Raised for
    a scheme with no backend, for one whose backend's extra is not installed (``s3``, ``gs`` and
    ``az`` need ``savepoint[s3]`` / ``[gcs]`` / ``[azure]``; other fsspec schemes
    ``savepoint[fsspec]`` and the scheme's own package), and for an object-store URL given to
    what reads and writes local files only (the foreign formats). The message names the extra or
    the reason. Nothing was created anywhere.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        scheme: str | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.scheme = scheme


class UnsupportedDeviceError(CheckpointError, ValueError):
    """``device=`` names a device this process cannot use (``"cuda"`` on a torch build without
    CUDA, or with no CUDA device visible; an index past the devices present; ``"mps"`` where there
    is none). Raised before anything is read."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing failed (disk full, fsync error, permission); the previous checkpoint is intact.

    ``errno`` is the failing call's error number (``errno.ENOSPC`` for a full disk) when known.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.errno = errno


class RunLockedError(CheckpointWriteError):
    """Another process is the writer of this run directory (``holder`` says which, when known).

    A run directory has one writer at a time: a second ``CheckpointManager`` on the same directory
    would let one process's retention delete the other's checkpoints. Readers (``sp.load``,
    ``sp.open_run``, ``savepoint ls``) never need the lock. Stop the other process, or give this one
    its own directory.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        holder: str | None = None,
    ) -> None:
        super().__init__(message, path=path, errno=_errno.EWOULDBLOCK)
        self.holder = holder


class DistributedCheckpointError(CheckpointError, RuntimeError):
    """A sharded save or load (``process_group=...``) failed. Every rank raises this same error.

    ``errors`` maps each rank that failed to what went wrong there (``ranks`` lists them, sorted);
    a rank that died or stopped answering shows up as a failed collective on the others. On a
    rank whose own step failed, that exception is the ``__cause__``. A failed save commits
    nothing: the previous checkpoint at the path is intact.

    ``phase`` names the phase that failed (``"save: plan"``, ``"save: write"``, ``"save:
    commit"``, ``"load: plan"``, ``"load: read"``, ``"load: read-once round 2"``...; None where
    unknown). ``stalled`` maps each rank that did not finish its part of that phase within the
    deadline (``timeout=``), or died in it, to the phase: ``{3: "save: write"}``; it is empty
    when every failing rank reported an error of its own. ``errors[r]`` of such a rank says what
    it was doing, where known (the data file it was writing).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        errors: Mapping[int, str] | None = None,
        phase: str | None = None,
        stalled: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.errors: dict[int, str] = dict(errors or {})
        self.phase = phase
        self.stalled: dict[int, str] = dict(stalled or {})

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.errors))
