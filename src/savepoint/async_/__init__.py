"""When saving happens: background saves that barely pause training.

- :mod:`~savepoint.async_.checkpointer`: ``AsyncCheckpointer`` (one save in flight, errors never
  lost);
- :mod:`~savepoint.async_.staging`: the staging arena a state is copied into, laid out as its files;
- :mod:`~savepoint.async_.pending`: ``PendingSave``, the handle every save returns.

Implementation, not public API (docs/api.md): no compatibility promise across releases; import
what you need from ``savepoint`` itself.
"""

__all__: list[str] = []
