"""Strict JSON for hostile input: duplicate keys and NaN/Infinity are errors, not silently taken."""

from __future__ import annotations

import json
from typing import Any


class StrictJSONError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise StrictJSONError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise StrictJSONError(f"non-standard number {name}")


def loads(raw: bytes, error: type[ValueError], what: str) -> Any:
    """Parse UTF-8 JSON, raising ``error`` with a message naming ``what`` on any problem."""
    try:
        return json.loads(
            raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant
        )
    except StrictJSONError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
