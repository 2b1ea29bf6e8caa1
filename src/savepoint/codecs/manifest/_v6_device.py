"""Version 6 tensor entries: device checksums.

An async save of a state on a GPU hashes its tensors on the device while they are staged
(:mod:`savepoint.codecs.devhash`). Such a tensor's entry is a version 1 entry with ``"mlh64":
"<16 hex>"`` in place of ``"xxh3"``; its record holds the tagged digest ``"mlh64:<16 hex>"`` in
``xxh3``, and readers check the tensor with the algorithm the tag names.
"""

from __future__ import annotations

from typing import Any

from savepoint.codecs.manifest._checks import is_digest, require
from savepoint.codecs.manifest._records import FileRecord, TensorRecord, set_xxh3
from savepoint.codecs.manifest._v1 import check_entry

KEYS = frozenset(("dtype", "shape", "file", "offsets", "mlh64"))  # an entry's members


def device_record(name: str, t: dict[str, Any], files: dict[str, FileRecord]) -> TensorRecord:
    """One tensor entry with the members :data:`KEYS`, checked as a version 1 entry; its record's
    ``xxh3`` is the tagged digest."""
    require(is_digest(t["mlh64"]), f"tensor {name!r}: bad mlh64 checksum")
    plain = {k: v for k, v in t.items() if k != "mlh64"}
    plain["xxh3"] = t["mlh64"]
    record = check_entry(name, plain, files)
    set_xxh3(record, "mlh64:" + t["mlh64"])
    return record
