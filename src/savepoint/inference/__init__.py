"""Snapshots of inference state (hidden states, input history, step count) and rollback.

::

    import savepoint as sp

    snap = sp.InferenceSnapshot(states=layer_states, history=inputs, step_count=step)
    history = sp.SnapshotHistory(8)               # or SnapshotHistory(8, directory="snaps/")
    history.take(states=layer_states, history=inputs, step_count=step)
    history.rollback().restore_into(layer_states, inputs)

See :mod:`savepoint.inference.snapshot` (fields, encodings) and
:mod:`savepoint.inference.history` (the bounded ring, buffer reuse, directories).
"""

from savepoint.inference.history import SnapshotHistory
from savepoint.inference.snapshot import InferenceSnapshot, SnapshotMetadata

__all__ = ["InferenceSnapshot", "SnapshotHistory", "SnapshotMetadata"]
