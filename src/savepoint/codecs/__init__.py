"""Pure byte codecs: bytes in, values out (and back), with no file I/O.

Each module specifies one encoding and reads it as hostile input: the native manifest
(:mod:`~savepoint.codecs.manifest`), safetensors headers (:mod:`~savepoint.codecs.safetensors`),
``.shrew`` files (:mod:`~savepoint.codecs.shrew`), burn records (:mod:`~savepoint.codecs.burn`),
inference snapshots (:mod:`~savepoint.codecs.snapshot`, :mod:`~savepoint.codecs.kizzasi`), and
their building blocks: bounded JSON, shard boxes, checksums and dtypes. Codecs import nothing of savepoint but
:mod:`savepoint.errors` and each other.

Implementation, not public API (docs/api.md): no compatibility promise across releases; import
what you need from ``savepoint`` itself.
"""

__all__: list[str] = []
