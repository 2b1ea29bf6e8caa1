"""Plain-text formatting shared by the library's descriptions (``str(sp.inspect(path))``) and the
command line (``savepoint inspect``, ``ls``, ``report``...), so that both print the same."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def size(n: int) -> str:
    """``n`` bytes as "512 B", "1.5 KiB", "2.0 GiB"."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def table(rows: Sequence[Sequence[str]]) -> str:
    """Rows as left-aligned columns two spaces apart (the last column is not padded)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < len(row) - 1 else cell
            for i, (cell, w) in enumerate(zip(row, widths))
        )
        for row in rows
    )


def shape(dims: tuple[int, ...]) -> str:
    """A shape as Python writes a tuple: ``()``, ``(3,)``, ``(2, 3)``."""
    return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"


def value_rows(values: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """Plain values as a key/value table, each repr cut to 60 characters."""
    rows: list[tuple[str, ...]] = [("key", "value")]
    for key, value in values.items():
        text = repr(value)
        rows.append((key, text if len(text) <= 60 else text[:57] + "..."))
    return rows
