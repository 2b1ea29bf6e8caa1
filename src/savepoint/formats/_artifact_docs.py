"""The documents of seed 001's training artifacts: ``manifest.json`` and ``training_report.json``.

Read through the bounded JSON reader and written as serde_json's ``to_string_pretty`` writes them
(:mod:`savepoint.codecs.serde_text`: two-space indents, no trailing newline, floats in ryu's f64
text such as ``1e-7``); the manifest's fields, the report fields savepoint checks, and the seed's
three consistency checks with its messages. :mod:`savepoint.formats.training_artifact` is the
public module (its docstring describes the layout); this one holds what its reading and writing
share.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from savepoint.codecs import bounded_json as _json
from savepoint.codecs import serde_text
from savepoint.errors import ArtifactMismatchError, CorruptCheckpointError, UnsupportedStateError
from savepoint.formats import burn
from savepoint.storage import local

__all__ = [
    "CheckpointManifest",
    "MANIFEST_FILE",
    "MAX_JSON_BYTES",
    "REPORT_FILE",
    "Report",
    "WEIGHTS_STEM",
    "check",
    "check_stem",
    "mismatch",
    "pretty",
    "read_json",
    "report_fields",
    "slug_of",
    "uint",
]

MANIFEST_FILE = "manifest.json"
WEIGHTS_STEM = "model"
REPORT_FILE = "training_report.json"
MAX_JSON_BYTES = 64 << 20
_U64 = 1 << 64


def read_json(path: str, what: str) -> dict[str, Any]:
    try:
        raw = local.read_small(path, cap=MAX_JSON_BYTES)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing ({what})", path=path) from None
    try:
        doc = _json.loads(raw, CorruptCheckpointError, path)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(str(exc), path=path) from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path} is not a JSON object", path=path)
    return doc


def pretty(doc: Any) -> bytes:
    """``serde_json::to_string_pretty``, floats as ryu writes an f64 (``codecs/serde_text.py``)."""
    try:
        return serde_text.dumps(doc, indent=2).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise UnsupportedStateError(f"cannot be written as JSON: {exc}") from None
    except UnicodeEncodeError:
        raise UnsupportedStateError("cannot be written as JSON: a string is not UTF-8") from None


def uint(doc: Mapping[str, Any], key: str, *, optional: bool = False) -> int | None:
    value = doc.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U64:
        state = "missing" if key not in doc else f"{value!r}"
        raise ValueError(f"{key!r} must be an unsigned integer, got {state}")
    return value


def check_stem(stem: Any) -> str:
    if not isinstance(stem, str) or stem in ("", ".", "..") or "/" in stem or "\x00" in stem:
        raise ValueError(
            f"'weights_stem' {stem!r} is not a plain file name (a manifest may not point "
            "outside its directory)"
        )
    return stem


@dataclass(frozen=True)
class CheckpointManifest:
    """``manifest.json``: the variant and config (JSON values), the parameter count and the
    stem of the weights file."""

    variant: Any
    config: Any
    num_params: int
    weights_stem: str = WEIGHTS_STEM

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> CheckpointManifest:
        """Validate a parsed document (ValueError with the reason)."""
        for key in ("variant", "config"):
            if key not in doc:
                raise ValueError(f"{key!r} is missing")
        num = uint(doc, "num_params")
        assert num is not None
        return cls(doc["variant"], doc["config"], num, check_stem(doc.get("weights_stem")))

    @property
    def weights_file(self) -> str:
        """The weights file's name: burn's recorder sets the stem's extension to ``mpk``."""
        return burn.file_name(self.weights_stem)

    def to_json(self) -> bytes:
        return pretty(
            {
                "variant": self.variant,
                "config": self.config,
                "num_params": self.num_params,
                "weights_stem": self.weights_stem,
            }
        )


@dataclass(frozen=True)
class Report:
    variant: Any
    config: Any
    num_params: int
    steps_completed: int
    has_best: bool
    best_step: int | None


def report_fields(doc: Mapping[str, Any]) -> Report:
    for key in ("variant", "config"):
        if key not in doc:
            raise ValueError(f"{key!r} is missing")
    num, steps = uint(doc, "num_params"), uint(doc, "steps_completed")
    assert num is not None and steps is not None
    return Report(
        doc["variant"],
        doc["config"],
        num,
        steps,
        doc.get("best_validation") is not None,
        uint(doc, "best_validation_step", optional=True),
    )


def mismatch(path: str, message: str) -> ArtifactMismatchError:
    return ArtifactMismatchError(
        f"training artifact is inconsistent: {message} ({path})", path=path
    )


def slug_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def check(path: str, report: Report, manifest: CheckpointManifest) -> None:
    """The seed's three checks, in its order, with its messages."""
    if report.variant != manifest.variant:
        raise mismatch(
            path,
            f"report variant {slug_of(report.variant)} does not match manifest variant "
            f"{slug_of(manifest.variant)}",
        )
    if report.config != manifest.config:
        raise mismatch(path, "report config does not match manifest config")
    if report.num_params != manifest.num_params:
        raise mismatch(
            path,
            f"report num_params {report.num_params} does not match manifest {manifest.num_params}",
        )
