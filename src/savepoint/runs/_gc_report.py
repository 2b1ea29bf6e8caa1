"""What a run's garbage collection reports (:func:`savepoint.runs.gc.collect`, re-exported
there): each thing removed, kept or aborted, and the report of one collection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AbortedUpload", "GcReport", "Removed", "Skipped"]


@dataclass(frozen=True)
class Removed:
    """A directory or blob removed (or, in a dry run, to be removed): its URL, why it was
    garbage, and its size in bytes where known."""

    path: str
    reason: str
    bytes: int | None = None


@dataclass(frozen=True)
class Skipped:
    """Something that looks like a leftover but was kept (or could not be removed), and why."""

    path: str
    reason: str


@dataclass(frozen=True)
class AbortedUpload:
    """An open multipart upload aborted (or, in a dry run, to be aborted)."""

    path: str  # s3://bucket/key
    upload_id: str
    initiated: str  # ISO 8601, UTC


@dataclass(frozen=True)
class GcReport:
    """What :func:`collect` (or ``CheckpointManager.gc``) removed from ``directory``.

    ``removed``: what was removed (in a dry run: what would be); ``aborted_uploads``: open
    multipart uploads aborted; ``skipped``: leftovers kept, and why (too young, a live process's,
    the only copy, listed by the report); ``failures``: what could not be removed (the error);
    ``uploads_checked``: whether open multipart uploads were looked for; ``notes``: what the
    caller should know (why uploads were not checked, that the store has no writer lock)."""

    directory: str
    grace: float
    dry_run: bool
    removed: tuple[Removed, ...] = ()
    aborted_uploads: tuple[AbortedUpload, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    failures: tuple[Skipped, ...] = ()
    uploads_checked: bool = False
    notes: tuple[str, ...] = ()

    @property
    def bytes_freed(self) -> int:
        """Bytes of the removed items whose size is known."""
        return sum(r.bytes for r in self.removed if r.bytes is not None)

    @property
    def paths(self) -> tuple[str, ...]:
        """The URLs of everything removed."""
        return tuple(r.path for r in self.removed)

    @property
    def ok(self) -> bool:
        """Whether everything found to remove was removed."""
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON values."""
        return {
            "directory": self.directory,
            "grace": self.grace,
            "dry_run": self.dry_run,
            "removed": [vars(r) for r in self.removed],
            "bytes_freed": self.bytes_freed,
            "aborted_uploads": [vars(u) for u in self.aborted_uploads],
            "skipped": [vars(s) for s in self.skipped],
            "failures": [vars(f) for f in self.failures],
            "uploads_checked": self.uploads_checked,
            "notes": list(self.notes),
        }
