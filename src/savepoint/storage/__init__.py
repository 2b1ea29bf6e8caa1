"""Where bytes go: the one protocol every layer above uses, and its backends.

- :mod:`~savepoint.storage.base`: the :class:`~savepoint.storage.base.Store` protocol, its call
  order and its capability flags;
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
"""

__all__: list[str] = []
