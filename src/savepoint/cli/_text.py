"""Plain-text formatting shared by the command-line modules (and by the library's own text, such
as ``str(sp.inspect(path))``: the functions live in :mod:`savepoint._text`)."""

from __future__ import annotations

from savepoint._text import size, table

__all__ = ["size", "table"]
