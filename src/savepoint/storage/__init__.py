"""Where bytes go: the one protocol every layer above uses, and its backends.

- :mod:`~savepoint.storage.base`: the :class:`~savepoint.storage.base.Store` protocol: its required
  core with the call order, and the optional capabilities tied to their flags;
- :mod:`~savepoint.storage.local`: the local filesystem (O_DIRECT, mmap, directory descriptors,
  renameat2, flock);
- :mod:`~savepoint.storage.memory`: the in-memory store (``memory://``), also in object-store mode;
- :mod:`~savepoint.storage.objectstore`: S3, GCS and Azure through obstore (the ``s3``, ``gcs`` and
  ``azure`` extras);
- :mod:`~savepoint.storage.fsspecstore`: every other filesystem fsspec knows (the ``fsspec``
  extra), with the weaker create-only guarantee it can give;
- :mod:`~savepoint.storage.lease`: the lock of stores without locks (a lease object);
- :mod:`~savepoint.storage.faults`: a wrapper that injects failures into any store (tests);
- :mod:`~savepoint.storage.paths`: path arguments and URLs to a store and a path in it.

Public (docs/api.md): the names of this package's ``__all__`` (the protocol, the backends, the
fault injector, ``resolve``), and the modules :mod:`~savepoint.storage.base` (for backend
authors) and :mod:`~savepoint.storage.faults` (for users' own fault tests). The other modules
are implementation.
"""

from savepoint._lazy import exports as _exports

# The public names of the storage layer (docs/api.md), each imported from its module on first
# use: importing ``savepoint.storage.base`` (a backend author's protocol) loads no backend.
_LAZY: dict[str, str] = {
    "BlobReader": "savepoint.storage.base",
    "BlobWriter": "savepoint.storage.base",
    "Capabilities": "savepoint.storage.base",
    "FaultyStore": "savepoint.storage.faults",
    "FsspecStore": "savepoint.storage.fsspecstore",
    "LocalStore": "savepoint.storage.local",
    "Location": "savepoint.storage.paths",
    "MemoryStore": "savepoint.storage.memory",
    "ObjectStore": "savepoint.storage.objectstore",
    "Stat": "savepoint.storage.base",
    "Store": "savepoint.storage.base",
    "resolve": "savepoint.storage.paths",
}


__getattr__, __dir__ = _exports(globals(), _LAZY)
__all__ = sorted(_LAZY)
