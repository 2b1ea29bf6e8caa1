"""The backends the storage contract suite runs against, by name (not collected).

Each is built fresh from its name, so a child process can build the same one
(``python -c "..."`` with :data:`CHILD_PRELUDE`) for the durability and lock tests.

``s3`` (with obstore and moto installed) is :class:`savepoint.storage.objectstore.ObjectStore` on
the session's moto server (:mod:`tests.storage._s3server`); the contract suite's root ``/contract``
is the bucket ``contract``, emptied by every ``make("s3")`` (a child process's ``make`` leaves it
as it is, so it sees what the test wrote).
"""

from __future__ import annotations

from savepoint.storage.base import Store
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore

from . import _s3server

PLAIN = ["local", "memory", "memory-object", *(["s3"] if _s3server.AVAILABLE else [])]
NAMES = [*PLAIN, *(f"faulty-{name}" for name in PLAIN)]
# Backends whose HTTP client closes its sockets asynchronously (the fd-leak check waits for it).
ASYNC_CLOSE = frozenset({"s3", "faulty-s3"})

# Small parts, so that the contract's blobs and the tests' big ones cross part boundaries
# without moving hundreds of MiB; no idle connection kept, so that no socket outlives a test (the
# contract suite counts file descriptors).
S3_OPTIONS: dict[str, object] = {"part_size": 5 * 1024 * 1024, "pool_max_idle_per_host": "0"}

if _s3server.AVAILABLE:
    # obstore's runtime (its threads, an epoll and an event descriptor) starts on first use and
    # lives as long as the process: start it now, so that no test's descriptor count includes it.
    import obstore
    import obstore.store

    obstore.put(obstore.store.MemoryStore(), "warm-up", b"")


def make(name: str) -> Store:
    """A fresh store: ``local``, ``memory``, ``memory-object`` (MemoryStore(atomic_rename=False)),
    ``s3`` (an ObjectStore on the moto server, bucket ``contract`` emptied) or
    ``faulty-<one of those>`` (a FaultyStore with no fault armed around it)."""
    if name.startswith("faulty-"):
        return FaultyStore(make(name.removeprefix("faulty-")))
    if name == "local":
        return LocalStore()
    if name == "memory":
        return MemoryStore()
    if name == "memory-object":
        return MemoryStore(atomic_rename=False)
    if name == "s3":
        from savepoint.storage.objectstore import ObjectStore

        server = _s3server.server()
        server.create_bucket("contract")  # already there (an earlier test's) is fine
        server.empty_bucket("contract")
        return ObjectStore("s3", **S3_OPTIONS)  # type: ignore[arg-type]
    raise ValueError(f"no backend {name!r}")


# What a child process runs first: ``make`` as above, from the installed package only (the
# environment, the s3 endpoint and credentials included, is inherited).
CHILD_PRELUDE = """
import sys
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore

def _s3():
    from savepoint.storage.objectstore import ObjectStore
    return ObjectStore("s3", part_size=5 * 1024 * 1024)

def make(name):
    if name.startswith("faulty-"):
        return FaultyStore(make(name[len("faulty-"):]))
    return {"local": LocalStore, "memory": MemoryStore,
            "memory-object": lambda: MemoryStore(atomic_rename=False), "s3": _s3}[name]()
"""
