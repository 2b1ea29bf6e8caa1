"""Other systems' checkpoints: one public module per format (:mod:`~savepoint.formats.shrew`,
:mod:`~savepoint.formats.boostr`, :mod:`~savepoint.formats.burn`,
:mod:`~savepoint.formats.training_artifact`; safetensors files through
:mod:`~savepoint.formats.detect`), each opening with its layout, plus detection
(:mod:`~savepoint.formats.detect`), conversion between any two (:mod:`~savepoint.formats.convert`)
and comparison of two checkpoints (:mod:`~savepoint.formats.diff`).
"""

__all__: list[str] = []
