"""Open multipart uploads (S3) that a run's garbage collection aborts: those under the run's
prefix initiated more than ``grace`` seconds ago (:mod:`savepoint.storage.uploads`; without boto3
the report says they were not checked)."""

from __future__ import annotations

import datetime as dt

from savepoint.commit import names
from savepoint.runs._gc_report import AbortedUpload, Skipped
from savepoint.runs._sweep import Sweep, age_text, generation_time

__all__ = ["abort_uploads"]


def abort_uploads(sweep: Sweep) -> None:
    """Open multipart uploads under the collected prefix (S3), initiated more than the grace
    period ago and, for an upload into a generation, of an attempt started more than that ago:
    aborted (see :mod:`savepoint.runs.gc`); recorded in ``sweep``."""
    from savepoint.storage import uploads

    store = sweep.store
    if not (store.capabilities.durable and not store.capabilities.atomic_rename):
        return  # no multipart uploads on this store (a disk, memory)
    try:
        client = uploads.client_for(store)
    except uploads.UploadsUnavailable as exc:
        sweep.notes.append(f"open multipart uploads were not checked: {exc}")
        return
    parts = sweep.where.path.lstrip("/").split("/", 1)
    bucket, key = parts[0], (parts[1] if len(parts) > 1 else "")
    prefix = key.rstrip("/") + "/" if key else ""
    try:
        try:
            found = uploads.list_open(client, bucket, prefix)
        except Exception as exc:
            sweep.notes.append(f"open multipart uploads could not be listed: {_first_line(exc)}")
            return
        sweep.uploads_checked = True
        for upload in sorted(found, key=lambda u: (u.key, u.initiated)):
            shown = store.url(f"/{bucket}/{upload.key}")
            # An upload into a generation is no older than that attempt (by either clock).
            started = max(
                [upload.initiated.timestamp()]
                + [generation_time(p) for p in upload.key.split("/") if names.is_generation(p)]
            )
            age = sweep.now - started
            if age < sweep.grace:
                sweep.skipped.append(
                    Skipped(
                        shown,
                        f"open multipart upload {upload.upload_id}, initiated "
                        f"{age_text(age).replace(' old', ' ago')}: younger than the grace "
                        "period",
                    )
                )
                continue
            if not sweep.dry_run:
                try:
                    uploads.abort(client, upload)
                except Exception as exc:
                    sweep.failures.append(
                        Skipped(
                            shown,
                            f"aborting open multipart upload {upload.upload_id} failed: "
                            f"{_first_line(exc)}",
                        )
                    )
                    continue
            initiated = upload.initiated.astimezone(dt.timezone.utc)
            sweep.aborted.append(
                AbortedUpload(shown, upload.upload_id, initiated.isoformat().replace("+00:00", "Z"))
            )
    finally:
        uploads.close(client)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
