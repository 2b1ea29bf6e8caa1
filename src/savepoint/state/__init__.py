"""What is saved: the user's state tree flattened into tensors and plain values
(:mod:`~savepoint.state.tree`), tensor sources for writers (:mod:`~savepoint.state.arrays`, torch
in :mod:`~savepoint.state.torch_tensors`, imported only when torch objects are present), restoring
in place (:mod:`~savepoint.state.restore`), and the training-state building blocks
(:mod:`~savepoint.state.optimizer`, :mod:`~savepoint.state.rng`, :mod:`~savepoint.state.data`,
:mod:`~savepoint.state.stateful`).

Implementation, not public API (docs/api.md): no compatibility promise across releases; import
what you need from ``savepoint`` itself.
"""

__all__: list[str] = []
