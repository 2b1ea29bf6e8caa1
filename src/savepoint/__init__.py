"""savepoint: atomic, checksummed, fast checkpoints for PyTorch and NumPy state.

::

    import savepoint as sp

    sp.save("ckpt/step-100", {"model": model, "optimizer": opt, "step": 100})
    sp.load("ckpt/step-100", into={"model": model, "optimizer": opt})
    sp.verify("ckpt/step-100")
    print(sp.inspect("ckpt/step-100"))

``import savepoint`` never imports torch or jax; torch support switches on when you pass torch
objects or ask for torch output. It imports nothing else either (not even numpy): each public
name below is imported from its module the first time it is used (``sp.save`` imports the save
path, ``sp.CheckpointManager`` the run machinery), so a worker, a writer or ``savepoint --help``
pays only for what it calls. The errors are the exception: ``savepoint.errors`` is small and
imported at once. ``benchmarks/bench_import.py`` measures it; ``tests/test_import_cost.py``
holds it.
"""

import importlib as _importlib
import typing as _typing

from savepoint._version import __version__
from savepoint.errors import (
    ArtifactMismatchError,
    CheckpointArgumentError,
    CheckpointError,
    CheckpointMemoryError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CheckpointWriteError,
    ConversionError,
    CorruptCheckpointError,
    DataStateError,
    DistributedCheckpointError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
    MissingBestValidationArtifact,
    MissingCheckpointError,
    NotRegularFileError,
    OptimizerStateError,
    ReplacedWhileReadingError,
    RNGStateError,
    RunLockedError,
    RunMismatchError,
    StateMismatchError,
    SymlinkError,
    UnsupportedDeviceError,
    UnsupportedStateError,
    UnsupportedStorageError,
)

if _typing.TYPE_CHECKING:
    from savepoint import policies as policies
    from savepoint.async_.checkpointer import AsyncCheckpointer
    from savepoint.async_.pending import PendingSave
    from savepoint.checkpoint import inspect, load, save, verify
    from savepoint.distributed import FlatShard, Partitioned, Shard
    from savepoint.formats.convert import ConversionReport, convert
    from savepoint.formats.diff import DiffReport, diff
    from savepoint.formats.export import ExportReport, export
    from savepoint.inference import InferenceSnapshot, SnapshotHistory, SnapshotMetadata
    from savepoint.info import CheckpointInfo, TensorInfo
    from savepoint.options import SaveOptions
    from savepoint.runs.gc import GcReport
    from savepoint.runs.manager import CheckpointManager
    from savepoint.runs.sweep import Sweep
    from savepoint.runs.tiers import Tier
    from savepoint.runs.view import RunView, open_run
    from savepoint.state.data import DataPosition, ResumableSampler
    from savepoint.state.optimizer import (
        OptimizerState,
        optimizer_state_from_torch,
        optimizer_state_to_torch,
    )
    from savepoint.state.rng import RNGState
    from savepoint.state.stateful import Stateful
    from savepoint.transfer import copy

# Each public name not imported above, and the module it comes from (imported on first use).
_LAZY: dict[str, str] = {
    "AsyncCheckpointer": "savepoint.async_.checkpointer",
    "CheckpointInfo": "savepoint.info",
    "CheckpointManager": "savepoint.runs.manager",
    "ConversionReport": "savepoint.formats.convert",
    "convert": "savepoint.formats.convert",
    "copy": "savepoint.transfer",
    "DataPosition": "savepoint.state.data",
    "diff": "savepoint.formats.diff",
    "DiffReport": "savepoint.formats.diff",
    "export": "savepoint.formats.export",
    "ExportReport": "savepoint.formats.export",
    "FlatShard": "savepoint.distributed",
    "GcReport": "savepoint.runs.gc",
    "InferenceSnapshot": "savepoint.inference",
    "inspect": "savepoint.checkpoint",
    "load": "savepoint.checkpoint",
    "open_run": "savepoint.runs.view",
    "optimizer_state_from_torch": "savepoint.state.optimizer",
    "optimizer_state_to_torch": "savepoint.state.optimizer",
    "OptimizerState": "savepoint.state.optimizer",
    "Partitioned": "savepoint.distributed",
    "PendingSave": "savepoint.async_.pending",
    "ResumableSampler": "savepoint.state.data",
    "RNGState": "savepoint.state.rng",
    "RunView": "savepoint.runs.view",
    "save": "savepoint.checkpoint",
    "SaveOptions": "savepoint.options",
    "Shard": "savepoint.distributed",
    "SnapshotHistory": "savepoint.inference",
    "SnapshotMetadata": "savepoint.inference",
    "Stateful": "savepoint.state.stateful",
    "Sweep": "savepoint.runs.sweep",
    "TensorInfo": "savepoint.info",
    "Tier": "savepoint.runs.tiers",
    "verify": "savepoint.checkpoint",
}


# Public names that are modules themselves.
_MODULES: dict[str, str] = {"policies": "savepoint.policies"}


def __getattr__(name: str) -> _typing.Any:
    if name in _MODULES:
        value = _importlib.import_module(_MODULES[name])
    elif name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'savepoint' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain attribute lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))


__all__ = [
    "ArtifactMismatchError",
    "AsyncCheckpointer",
    "CheckpointArgumentError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMemoryError",
    "CheckpointNotFoundError",
    "CheckpointPermissionError",
    "CheckpointWriteError",
    "ConversionError",
    "ConversionReport",
    "CorruptCheckpointError",
    "DataPosition",
    "DataStateError",
    "DiffReport",
    "DistributedCheckpointError",
    "ExportReport",
    "FlatShard",
    "GcReport",
    "IncompatibleCheckpointError",
    "IncompleteCheckpointError",
    "InferenceSnapshot",
    "MissingBestValidationArtifact",
    "MissingCheckpointError",
    "NotRegularFileError",
    "OptimizerState",
    "OptimizerStateError",
    "Partitioned",
    "PendingSave",
    "RNGState",
    "RNGStateError",
    "ReplacedWhileReadingError",
    "ResumableSampler",
    "RunLockedError",
    "RunMismatchError",
    "RunView",
    "SaveOptions",
    "Shard",
    "SnapshotHistory",
    "SnapshotMetadata",
    "StateMismatchError",
    "Stateful",
    "Sweep",
    "SymlinkError",
    "TensorInfo",
    "Tier",
    "UnsupportedDeviceError",
    "UnsupportedStateError",
    "UnsupportedStorageError",
    "__version__",
    "convert",
    "copy",
    "diff",
    "export",
    "inspect",
    "load",
    "open_run",
    "optimizer_state_from_torch",
    "optimizer_state_to_torch",
    "save",
    "verify",
]
