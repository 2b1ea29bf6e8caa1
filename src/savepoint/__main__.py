"""``python -m savepoint``: the ``savepoint`` command line."""

from __future__ import annotations

from savepoint.cli import main

if __name__ == "__main__":
    main()
