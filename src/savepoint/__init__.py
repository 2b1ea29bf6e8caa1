"""savepoint: atomic, checksummed, fast checkpoints for PyTorch and NumPy state.

::

    import savepoint as sp

    sp.save("ckpt/step-100", {"model": model, "optimizer": opt, "step": 100})
    sp.load("ckpt/step-100", into={"model": model, "optimizer": opt})
    sp.verify("ckpt/step-100")
    print(sp.inspect("ckpt/step-100"))

``import savepoint`` never imports torch or jax; torch support switches on when you pass torch
objects or ask for torch output.
"""

from savepoint._version import __version__
from savepoint.async_.checkpointer import AsyncCheckpointer
from savepoint.async_.pending import PendingSave
from savepoint.checkpoint import inspect, load, save, verify
from savepoint.distributed import FlatShard, Partitioned, Shard
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
from savepoint.formats.convert import ConversionReport, convert
from savepoint.formats.diff import DiffReport, diff
from savepoint.formats.export import ExportReport, export
from savepoint.inference import InferenceSnapshot, SnapshotHistory, SnapshotMetadata
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.options import SaveOptions
from savepoint.runs import policies as policies
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
