"""burn's named MessagePack records: the byte codec.

The layout and every rule the reader enforces are specified in :mod:`savepoint.formats.burn`,
the format's public interface; this package is the part with no file I/O and no knowledge of
tensors beyond ``dtype``, ``shape`` and ``nbytes``:

- Reading (``_read``): :func:`parse` reads one record from a uint8 array (a mapping of the file,
  or bytes), checking every length against what is left before it reads or allocates; the
  tensors it finds are made by the caller (:class:`Tensors`: views of the array, never copies).
- Writing (``_write``): :func:`layout` gives a record tree's file as a list of pieces, each
  either the bytes to write or a tensor whose raw bytes go there (the caller streams those from
  wherever they are; :class:`Sources` says which values are tensors).
- The parts both share (``_record``): :class:`Metadata`, :class:`Param`, :class:`Data`, the
  dtypes burn names and the reader's limits.
"""

from savepoint.codecs.burn._read import Bin, Parsed, parse
from savepoint.codecs.burn._record import (
    BURN_VERSION,
    DTYPES,
    FLOATS,
    MAX_DEPTH,
    MAX_VALUES,
    Data,
    Metadata,
    Param,
    Sources,
    Tensor,
    Tensors,
    encode_id,
    param_id,
)
from savepoint.codecs.burn._write import layout, source_of

__all__ = [
    "BURN_VERSION",
    "Bin",
    "DTYPES",
    "Data",
    "FLOATS",
    "MAX_DEPTH",
    "MAX_VALUES",
    "Metadata",
    "Param",
    "Parsed",
    "Sources",
    "Tensor",
    "Tensors",
    "encode_id",
    "layout",
    "param_id",
    "parse",
    "source_of",
]
