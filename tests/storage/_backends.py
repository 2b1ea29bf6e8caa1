"""The backends the storage contract suite runs against, by name (not collected).

Each is built fresh from its name, so a child process can build the same one
(``python -c "..."`` with :data:`CHILD_PRELUDE`) for the durability and lock tests.

``s3`` (with obstore and moto installed) is :class:`savepoint.storage.objectstore.ObjectStore` on
the session's moto server (:mod:`tests.storage._s3server`); the contract suite's root ``/contract``
is the bucket ``contract``, emptied by every ``make("s3")`` (a child process's ``make`` leaves it
as it is, so it sees what the test wrote).

``dict`` is :class:`tests.storage._dictstore.DictStore`, the example backend of the required
core alone (``docs/storage.md``).

``fsspec-memory`` is :class:`savepoint.storage.fsspecstore.FsspecStore` over fsspec's in-memory
filesystem, which is global to the process: each test gets a root of its own (:func:`root`) and
removes it afterwards (:func:`cleanup`). ``fsspec-local`` is the same store over fsspec's
LocalFileSystem, rooted in the test's ``tmp_path`` as ``local`` is.
"""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path

from savepoint.storage.base import Store
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore

from . import _s3server
from ._dictstore import DictStore

PLAIN = [
    "local",
    "memory",
    "memory-object",
    "dict",
    "fsspec-memory",
    "fsspec-local",
    *(["s3"] if _s3server.AVAILABLE else []),
]
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
    ``dict`` (the core alone),
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
    if name == "dict":
        return DictStore()
    if name in ("fsspec-memory", "fsspec-local"):
        import fsspec

        from savepoint.storage.fsspecstore import FsspecStore, WeakCreateWarning

        store = FsspecStore(fsspec.filesystem(name.removeprefix("fsspec-")))
        with warnings.catch_warnings():
            # The one warning at the filesystem's first write (tests/storage/test_fsspecstore.py
            # checks it): taken here, so that the suite's warnings-as-errors does not fail on it.
            warnings.simplefilter("ignore", WeakCreateWarning)
            store.makedirs("/")
        return store
    if name == "s3":
        from savepoint.storage.objectstore import ObjectStore

        server = _s3server.server()
        server.create_bucket("contract")  # already there (an earlier test's) is fine
        server.empty_bucket("contract")
        return ObjectStore("s3", **S3_OPTIONS)  # type: ignore[arg-type]
    raise ValueError(f"no backend {name!r}")


def root(name: str, tmp_path: Path) -> str:
    """The contract suite's root directory in backend ``name`` (made by the suite)."""
    plain = name.removeprefix("faulty-")
    if plain in ("local", "fsspec-local"):
        return str(tmp_path / "root")
    if plain == "fsspec-memory":  # one filesystem for the whole process: a root of its own
        return f"/contract-{uuid.uuid4().hex}"
    return "/contract"


def cleanup(name: str, store: Store, root: str) -> None:
    """Remove what a test left in a backend that outlives it (fsspec's memory filesystem)."""
    if name.removeprefix("faulty-") == "fsspec-memory":
        store.remove_tree(root)


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

def _fsspec(protocol):
    import warnings
    import fsspec
    from savepoint.storage.fsspecstore import FsspecStore
    warnings.simplefilter("ignore")
    return FsspecStore(fsspec.filesystem(protocol))

def _dict():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_dictstore", DICT_STORE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DictStore()

def make(name):
    if name.startswith("faulty-"):
        return FaultyStore(make(name[len("faulty-"):]))
    return {"local": LocalStore, "memory": MemoryStore, "dict": _dict,
            "memory-object": lambda: MemoryStore(atomic_rename=False), "s3": _s3,
            "fsspec-memory": lambda: _fsspec("memory"),
            "fsspec-local": lambda: _fsspec("file")}[name]()
"""
CHILD_PRELUDE += f"\nDICT_STORE_FILE = {str(Path(__file__).with_name('_dictstore.py'))!r}\n"
