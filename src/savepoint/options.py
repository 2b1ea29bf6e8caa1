"""How a checkpoint is written: one validated, frozen options object for every save path.

:class:`SaveOptions` holds what ``sp.save``, ``AsyncCheckpointer`` and ``CheckpointManager``
accept about *how* bytes are written (not *what* is saved or *where*). Every field is checked when
the object is built, so a bad option fails where it is given (the manager's constructor, say), not
at the first save minutes into a run; an unknown option name is a TypeError naming it and the
options there are.

Fields:

- ``max_file_bytes``: data files are split at this size (a bigger tensor gets a file of its own);
  a positive int;
- ``writers``: threads writing data files concurrently; an int of at least 1;
- ``direct``: False asks for buffered writes (plus fsync) even where ``O_DIRECT`` works;
- ``progress``: ``progress(done, total)`` called with byte counts as data is written, or None;
- ``process_group``: a ``torch.distributed`` group for a sharded save (every rank calls), or None
  (not checked here: that would import torch);
- ``timeout``: seconds a sharded save waits for a rank that stopped answering (None: no limit);
  positive and finite.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DEFAULT_MAX_FILE_BYTES", "DEFAULT_WRITERS", "Progress", "SaveOptions"]

DEFAULT_MAX_FILE_BYTES = 1 << 30
DEFAULT_WRITERS = 1
Progress = Callable[[int, int], None]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How a checkpoint is written (see the module docstring); immutable, checked when built."""

    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    writers: int = DEFAULT_WRITERS
    direct: bool = True
    progress: Progress | None = None
    process_group: Any = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_file_bytes):
            raise TypeError(_type_error("max_file_bytes", "an int", self.max_file_bytes))
        if self.max_file_bytes <= 0:
            raise ValueError(
                f"save option max_file_bytes must be positive, not {self.max_file_bytes}"
            )
        if not _is_int(self.writers):
            raise TypeError(_type_error("writers", "an int", self.writers))
        if self.writers < 1:
            raise ValueError(f"save option writers must be at least 1, not {self.writers}")
        if not isinstance(self.direct, bool):
            raise TypeError(_type_error("direct", "a bool", self.direct))
        if self.progress is not None and not callable(self.progress):
            raise TypeError(
                _type_error("progress", "a callable progress(done, total)", self.progress)
            )
        if self.timeout is not None:
            if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
                raise TypeError(_type_error("timeout", "a number of seconds or None", self.timeout))
            if not (math.isfinite(self.timeout) and self.timeout > 0):
                raise ValueError(
                    f"save option timeout must be a positive, finite number of seconds (or None), "
                    f"not {self.timeout}"
                )

    @classmethod
    def of(cls, options: Mapping[str, Any], *, base: SaveOptions | None = None) -> SaveOptions:
        """``base`` (default: the defaults) with ``options`` (keyword arguments as given by a
        caller) applied; an unknown name is a TypeError naming it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            names = ", ".join(repr(name) for name in unknown)
            raise TypeError(
                f"unknown save option{'s' if len(unknown) > 1 else ''} {names}; the save options "
                f"are {', '.join(sorted(known))}"
            )
        return dataclasses.replace(base or cls(), **options)

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as keyword arguments (what a caller set;
        for callees that take the options one by one)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not f.default and getattr(self, f.name) != f.default
        }


def _type_error(name: str, wanted: str, value: object) -> str:
    return f"save option {name} must be {wanted}, not {type(value).__name__} ({value!r})"
