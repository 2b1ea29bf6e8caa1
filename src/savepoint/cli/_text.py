"""Plain-text formatting shared by the command-line modules."""

from __future__ import annotations

from collections.abc import Sequence


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
