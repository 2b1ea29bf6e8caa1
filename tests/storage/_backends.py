"""The backends the storage contract suite runs against, by name (not collected).

Each is built fresh from its name, so a child process can build the same one
(``python -c "..."`` with :data:`CHILD_PRELUDE`) for the durability and lock tests.
"""

from __future__ import annotations

from savepoint.storage.base import Store
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore

PLAIN = ["local", "memory", "memory-object"]
NAMES = [*PLAIN, *(f"faulty-{name}" for name in PLAIN)]


def make(name: str) -> Store:
    """A fresh store: ``local``, ``memory``, ``memory-object`` (MemoryStore(atomic_rename=False))
    or ``faulty-<one of those>`` (a FaultyStore with no fault armed around it)."""
    if name.startswith("faulty-"):
        return FaultyStore(make(name.removeprefix("faulty-")))
    if name == "local":
        return LocalStore()
    if name == "memory":
        return MemoryStore()
    if name == "memory-object":
        return MemoryStore(atomic_rename=False)
    raise ValueError(f"no backend {name!r}")


# What a child process runs first: ``make`` as above, from the installed package only.
CHILD_PRELUDE = """
import sys
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore

def make(name):
    if name.startswith("faulty-"):
        return FaultyStore(make(name[len("faulty-"):]))
    return {"local": LocalStore, "memory": MemoryStore,
            "memory-object": lambda: MemoryStore(atomic_rename=False)}[name]()
"""
