"""The engine below the facade: what single-process, async and sharded saves and loads share.

- :mod:`~savepoint.engine.plan`: save plans as plain data (which tensors in which file, where);
- :mod:`~savepoint.engine.pipeline`: the write pipeline (copy and hash into aligned staging
  buffers while a writer thread hands the previous buffer to the store's blob writer);
- :mod:`~savepoint.engine.save`: the one writer of savepoint's format (plan, write, manifest,
  commit), configured by its sinks for a synchronous, staged (async) or incremental save; its
  manifest builder and commit point, which a sharded save's rank 0 uses too;
- :mod:`~savepoint.engine.sinks`: where the writer's bytes go (data files from live tensors or
  the async arena's images, the blob store); the data-file writer sharded saves share;
- :mod:`~savepoint.engine.read`: the read engine (pin one generation, check sizes and headers,
  copy with fused checksums, assemble shards), on ``BlobReader.view`` or reads into buffers; its
  jobs are private modules over the pinned generation: ``_pin`` (pin and re-read), ``_checks``,
  ``_copies`` (whole and ranged copies), ``_shards`` (shard assembly), ``_blobreads``;
- :mod:`~savepoint.engine.load`: an unsharded load and ``verify``, and the helpers sharded loads
  share;
- :mod:`~savepoint.engine.parallel`: the process-wide thread pool for copies and checksums.

The engine talks to a :class:`~savepoint.storage.base.Store` only, so every backend gets the same
checks and the same speed paths where its capabilities allow them.

Implementation, not public API (docs/api.md): no compatibility promise across releases; import
what you need from ``savepoint`` itself.
"""

__all__: list[str] = []
