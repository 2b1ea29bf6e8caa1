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
- ``process_group``: a ``torch.distributed.ProcessGroup`` for a sharded save (every rank calls),
  or None; torch.distributed is imported only to check a group that is given, and its default
  group must be initialised;
- ``timeout``: the deadline of each phase of a sharded save: seconds a rank waits for another
  to finish its part (None: 1800, as torch.distributed's default); positive and finite;
- ``grid``: a sharded save of a regular state (every rank holding the same DTensors on one
  mesh) is planned from its grid and written as manifest version 7 (a tensor table and one index
  file per rank: O(tensors + ranks)); False plans and lists every piece in the manifest, as for
  any other sharded state (for readers older than version 7).

:func:`check_load` checks the arguments of ``sp.load`` and ``sp.verify`` the same way, before
anything is read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from savepoint.errors import UnsupportedDeviceError

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_WRITERS",
    "Progress",
    "SaveOptions",
    "check_device",
    "check_load",
    "check_process_group",
]

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
    grid: bool = True

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
        if not isinstance(self.grid, bool):
            raise TypeError(_type_error("grid", "a bool", self.grid))
        _check_progress(self.progress, _SAVE)
        _check_timeout(self.timeout, _SAVE)
        if self.process_group is not None:
            check_process_group(self.process_group)

    @classmethod
    def of(cls, options: Mapping[str, Any], *, base: SaveOptions | None = None) -> SaveOptions:
        """``base`` (default: the defaults) with ``options`` (keyword arguments as given by a
        caller) applied; an unknown name is a TypeError naming it and the known ones."""
        if base is not None and not isinstance(base, SaveOptions):
            raise TypeError(
                f"options must be a savepoint.SaveOptions, not {type(base).__name__} ({base!r}); "
                "build one with savepoint.SaveOptions(writers=2, ...), or pass the options as "
                "keyword arguments"
            )
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


def check_load(
    *,
    keys: Any = None,
    verify: Any = True,
    framework: Any = "auto",
    mmap: Any = False,
    progress: Any = None,
    process_group: Any = None,
    timeout: Any = None,
    device: Any = None,
    read_once: Any = True,
    what: str = "load",
) -> str | list[str] | None:
    """Check the arguments of ``sp.load`` (``what``: the function, for messages; ``sp.verify``
    passes ``progress`` alone) before anything is read: a TypeError or ValueError naming the
    argument, its value and what is accepted. Returns ``keys`` as the load reads it (twice: to pin
    the files it needs, then to load): None, one key, or a list of keys."""
    label = f"{what} argument"
    if verify not in (True, False, "first"):
        raise ValueError(f"{label} verify must be True, False or 'first', not {verify!r}")
    if framework not in ("auto", "numpy", "torch"):
        raise ValueError(f"{label} framework must be 'auto', 'numpy' or 'torch', not {framework!r}")
    if not isinstance(mmap, bool):
        raise TypeError(_type_error("mmap", "a bool", mmap, label))
    if not isinstance(read_once, bool):
        raise TypeError(_type_error("read_once", "a bool", read_once, label))
    _check_progress(progress, label)
    if process_group is not None:
        check_process_group(process_group, label=label)
    _check_timeout(timeout, label)
    if device is not None:
        check_device(device, label)
    if keys is None or isinstance(keys, str):
        return keys
    wanted = "a key (str), an iterable of keys, or None"
    if isinstance(keys, (bytes, bytearray)) or not isinstance(keys, Iterable):
        raise TypeError(_type_error("keys", wanted, keys, label))
    listed = list(keys)
    for key in listed:
        if not isinstance(key, str):
            raise TypeError(
                f"{label} keys must be {wanted}; it holds {type(key).__name__} ({key!r})"
            )
    return listed


def check_device(device: Any, label: str = "load argument") -> None:
    """Refuse a ``device`` this process cannot put tensors on, before anything is read: a
    ValueError for what is no torch device at all, UnsupportedDeviceError (naming the reason and
    what to do) for a CUDA or MPS device that is not there."""
    try:
        import torch
    except ImportError:
        raise UnsupportedDeviceError(
            f"{label} device={device!r} needs torch, which is not installed; load without "
            "device= to get numpy arrays"
        ) from None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{label} device {device!r} is not a torch device ({exc})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch build has no CUDA support"
                if torch.version.cuda is None
                else "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
            )
            raise UnsupportedDeviceError(
                f"{label} device={device!r}: {why}; load with device=None (or 'cpu') and move "
                "the tensors afterwards"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise UnsupportedDeviceError(
                f"{label} device={device!r}: only {count} CUDA device(s) are visible "
                f"(cuda:0 to cuda:{count - 1})"
            )
    elif dev.type == "mps":
        backend = getattr(torch.backends, "mps", None)
        if backend is None or not backend.is_available():
            raise UnsupportedDeviceError(f"{label} device={device!r}: no MPS device here")


_SAVE = "save option"


def _check_progress(progress: object, label: str) -> None:
    if progress is not None and not callable(progress):
        raise TypeError(
            _type_error("progress", "a callable progress(done, total) or None", progress, label)
        )


def _check_timeout(timeout: object, label: str) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(_type_error("timeout", "a number of seconds or None", timeout, label))
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(
            f"{label} timeout must be a positive, finite number of seconds (or None), not {timeout}"
        )


def check_process_group(group: object, *, label: str = _SAVE) -> None:
    """``group`` is a ``torch.distributed.ProcessGroup`` and torch.distributed is initialised: a
    TypeError or ValueError saying what is wrong otherwise (``label`` names the argument's kind:
    "save option", "load argument"). Call it only for a group that is given: it imports
    torch.distributed (``import savepoint`` never imports torch)."""
    wanted = "a torch.distributed.ProcessGroup (dist.group.WORLD, dist.new_group(...)) or None"
    try:
        import torch.distributed as dist
    except ImportError:
        raise TypeError(
            _type_error("process_group", wanted, group, label) + "; torch is not installed"
        ) from None
    if not dist.is_available():
        raise ValueError(
            f"{label} process_group was given ({group!r}) but this build of torch has no "
            "torch.distributed; pass process_group=None"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(_type_error("process_group", wanted, group, label))
    if not dist.is_initialized():
        raise ValueError(
            f"{label} process_group was given ({group!r}) but torch.distributed is not "
            "initialised; call torch.distributed.init_process_group first (or pass "
            "process_group=None)"
        )


def _type_error(name: str, wanted: str, value: object, label: str = _SAVE) -> str:
    return f"{label} {name} must be {wanted}, not {type(value).__name__} ({value!r})"
