"""The ``Stateful`` protocol: anything with ``state_dict()`` and ``load_state_dict(d)``."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Stateful",
    "is_stateful",
]


@runtime_checkable
class Stateful(Protocol):
    """An object whose state is saved through ``state_dict()`` and restored by ``load_state_dict``.

    torch modules, optimizers, LR schedulers and ``GradScaler`` already satisfy it; so can any user
    class. ``state_dict()`` returns a tree savepoint can store (dicts, lists, tuples, tensors, plain
    values). On ``sp.load(path, into=obj)`` savepoint calls ``obj.state_dict()`` to find tensors it
    can fill in place, reads the checkpoint into them, then calls ``obj.load_state_dict(tree)``
    with the saved tree, so the object's own validation runs.
    """

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def is_stateful(obj: Any) -> bool:
    # isinstance against a runtime Protocol is slow and matches classes too; check the instance.
    return (
        not isinstance(obj, type)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )
