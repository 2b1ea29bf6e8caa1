"""When bytes become a checkpoint: one transaction, two strategies, and how to find the result.

- :mod:`~savepoint.commit.transaction`: :class:`~savepoint.commit.transaction.Transaction`
  (every save path commits through it), ``resolve`` (the committed checkpoint of a path, in either
  layout) and ``discard`` (a crash-safe delete);
- :mod:`~savepoint.commit.names`: the hidden and generation names, and who may tidy them;
- :mod:`~savepoint.commit.atomic`: the rename strategy by local path, for single files of the
  foreign formats (directories of every format go through the transaction).

Implementation, not public API (docs/api.md): no compatibility promise across releases; import
what you need from ``savepoint`` itself.
"""

__all__: list[str] = []
