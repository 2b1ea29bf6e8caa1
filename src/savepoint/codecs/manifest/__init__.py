"""``manifest.json``: the record that makes a directory a checkpoint. This docstring is the format's
specification, versions 1 to 7 (:data:`VERSION`; version 7 in full in :mod:`._v7_grid`); the
modules of this package implement it.

Version 1 (every unsharded save that neither uses a blob store nor hashes on a device writes it,
byte for byte). A UTF-8 JSON object (ASCII in practice: non-ASCII is escaped), one top-level
member per line and each value compact::

    {
     "format": "savepoint",
     "format_version": 1,
     "writer": "savepoint 0.1.0",
     "created": "2026-11-21T07:30:00.123456Z",
     "checksum": "xxh3-64",
     "metadata": {...},                      # the caller's JSON metadata, verbatim
     "files": {"data-00000.safetensors": {"size": 4096, "header_size": 128, "header_xxh3": "..."}},
     "tensors": {"model/w": {"dtype": "F32", "shape": [2, 3], "file": "data-00000.safetensors",
                             "offsets": [128, 152], "xxh3": "..."}},
     "tree": {...},                          # structure, see "The tree" below
     "manifest_xxh3": "0123456789abcdef"
    }

``files`` names each data file of the checkpoint (a safetensors file beside the manifest; a plain
name of at most 200 characters from ``[A-Za-z0-9._-]``, starting with a letter or digit, without
``..``) with its ``size``, its ``header_size`` (the 8-byte length prefix and the header JSON) and
``header_xxh3`` (the XXH3-64 of those ``header_size`` bytes). ``tensors`` maps each tensor's name
(its path in the state, see :mod:`savepoint.state.tree`) to its ``dtype`` (a name of
:mod:`savepoint.codecs.dtypes`: ``F32``, ``BF16``, ``I64``, ``BOOL``, ...), ``shape``, the ``file``
holding it and the absolute byte positions ``[start, end)`` of its data there (``offsets``), and
the XXH3-64 of those bytes. Every digest is 16 lowercase hex digits. The last member is always
``manifest_xxh3``, written as the exact bytes ``,\\n "manifest_xxh3": "<16 hex>"\\n}\\n`` at the
end of the file (:data:`TRAILER_BYTES` of them); it is the XXH3-64 of every byte before that
trailer, so a flipped bit anywhere in the manifest is detected.

The tree. ``tree`` is the state's structure, as nested nodes (:mod:`savepoint.state.tree` writes
them), so any key survives exactly::

    {"t": "dict", "items": [[key, node], ...]}   key: a JSON string or integer, none repeated
    {"t": "list", "items": [node, ...]}          also "tuple"
    {"t": "tensor", "ref": name, "kind": k}      name: a key of "tensors";
                                                 k: "numpy" | "numpy_scalar" | "torch"
    {"t": "value", "v": json}                    null, a bool, an integer, a string, a finite float
    {"t": "float", "v": "nan" | "inf" | "-inf"}
    {"t": "bytes", "v": base64}                  standard alphabet, padded
    {"t": "stateful", "type": "module.Class", "state": node}

A reader ignores members of a node other than those above, and top-level members of the manifest
other than those this specification lists; it refuses a node of another type, a ``ref`` naming
no tensor, and an entry of ``files`` or ``tensors``, a shard or a ``blocks`` object with any
member this specification does not list for it.

Version 2: sharded checkpoints (written by ``save(..., process_group=...)``, one set of data files
per rank). A version 2 manifest has one more top-level member after ``checksum``,
``"world_size": 4`` (how many ranks saved it, in ``[1, 2**31)``), and each tensor entry gives the
global ``dtype`` and ``shape`` and where its pieces are::

     "tensors": {"model/w": {"dtype": "F32", "shape": [4, 6], "shards": [
         {"file": "data-r00000-00000.safetensors", "offsets": [128, 176], "xxh3": "...",
          "box": [[0, 2], [0, 6]]},
         {"file": "data-r00001-00000.safetensors", "offsets": [128, 176], "xxh3": "...",
          "box": [[2, 4], [0, 6]]}]}}

A shard holds either a ``box`` (``[start, stop)`` on every dimension, stored contiguously in C order
with shape ``stop - start``: tensor-parallel pieces, replicated tensors as the full box, ``[]`` for
a 0-d tensor) or a ``flat`` range ``[start, stop)`` of the tensor flattened in C order (stored as a
1-D run: FSDP-style flat shards). See :mod:`savepoint.codecs.boxes`. Rules checked by the parser:
every box lies inside the shape and has one ``[start, stop]`` per dimension; a tensor's shards are
all boxes or all flat ranges, none empty (a tensor without elements has exactly one shard), no two
share an element and together they hold every element; each shard's byte count is its element count
times the dtype's itemsize and lies inside the data of its file. In the data file the shard is an
ordinary safetensors tensor with the shard's own shape (box extents, or ``[stop - start]``) under a
name unique in that file (the tensor's key, plus ``@`` and the shard's start for partial shards:
:func:`shard_name`, :func:`shard_shape`).

Version 3 (what sharded saves write now; version 2 is still read): a version 2 manifest whose
shards (and whole-stored tensors) larger than 128 KiB may carry per-block checksums, so a rank
that needs part of a shard reads and checks only the blocks holding it::

         {"file": "data-r00000-00000.safetensors", "offsets": [128, 4194432], "xxh3": "...",
          "flat": [0, 1048576], "blocks": {"size": 65536, "xxh3": ["...", "...", ...]}}

``size`` is a power of two (at least 1 KiB); there are ``ceil(bytes / size)`` digests (at least
two), block ``i`` covering bytes ``[i * size, (i + 1) * size)`` of the shard; and the shard's
``xxh3`` is then :func:`savepoint.codecs.checksum.combine` of them (the parser checks that), not
the hash of the bytes. See :mod:`savepoint.codecs.checksum` for the writer's block sizes.

Version 4 (what an incremental save, ``save(..., blobs=...)``, writes; other saves still write
versions 1-3): an unsharded manifest whose tensors may live in a content-addressed blob store
(:mod:`savepoint.blobs`) instead of the data files. Two top-level members follow ``checksum``:
``"blob_store": "../blobs"`` (the store's directory relative to the checkpoint's: plain names,
after at most two leading ``..``; never absolute, never a URL, never further out:
:func:`check_blob_store`) and ``"blob_digest": "blake3"`` (the store's digest, ``blake3`` or
``xxh3-128``). A tensor entry is then either a version 1 entry or one naming a
:class:`savepoint.blobs.Recipe` instead of ``file`` and ``offsets``::

     "tensors": {"model/w": {"dtype": "F32", "shape": [1024, 1024], "xxh3": "...",
                             "blobs": {"digest": "blake3", "size": 4194304, "chunk": 4194304,
                                       "blobs": ["<64 hex>"], "xxh3": ["<16 hex>"]}}}

The parser checks the recipe completely (:meth:`savepoint.blobs.Recipe.from_json`), that its
``size`` is the tensor's shape x itemsize, its digest the store's, its chunk a power of two of at
least 1 KiB, and that ``xxh3`` is :meth:`savepoint.blobs.Recipe.checksum` of it (the per-chunk
checks are block checksums with the chunk as block), before anything is allocated.

A sharded incremental save (``save(..., blobs=..., process_group=...)``) writes version 4 with a
``world_size`` member too (after ``blob_digest``); every tensor entry is then a version 3 one
(``dtype``, ``shape``, ``shards``), and a shard may name a recipe instead of a file range::

         {"xxh3": "...", "box": [[0, 512], [0, 1024]], "blobs": {"digest": "blake3", ...}}

with the same checks as a tensor's recipe (its ``size`` is the shard's element count x
itemsize), and the rules of version 3 for the regions (they tile the tensor). Such a shard's
block checksums are the recipe's per-chunk checks: a rank needing part of it reads and checks
only the chunks holding that part.

Version 5 (an incremental save whose recipes carry row patches, :mod:`savepoint.blobs.patch`):
version 4, and a recipe may name patches: the recipe's chunks are then a base, and the tensor's
content is the base with each patch applied in order (the changed rows of an embedding, written
as one small blob instead of every chunk they touch)::

     "blobs": {"digest": "blake3", "size": 131072, "chunk": 65536, "blobs": ["<64 hex>", ...],
               "xxh3": ["<16 hex>", ...], "base_xxh3": ["<16 hex>", ...],
               "patches": [{"blob": "<64 hex>", "block": 512, "count": 3, "xxh3": "<16 hex>"}]}

``xxh3`` stays the checks of the content's chunks (what the entry's ``xxh3`` is made of),
``base_xxh3`` those of the base chunks; a patch blob holds ``count`` strictly increasing block
numbers and those blocks of ``block`` bytes (:class:`savepoint.codecs.recipe.Patch`), ``xxh3``
its XXH3-64. A version 4 manifest naming a patched recipe is refused.

Version 6 (an async save of a state on a GPU, whose tensors were hashed on the device while they
were staged): an unsharded manifest whose tensor entries are version 1 entries, each with either
``"xxh3"`` or, in its place, ``"mlh64": "<16 hex>"`` (:mod:`savepoint.codecs.devhash`: a
multilinear hash a GPU computes at memory speed and the host computes identically)::

     "tensors": {"model/w": {"dtype": "BF16", "shape": [4096, 4096],
                             "file": "data-00000.safetensors", "offsets": [128, 33554560],
                             "mlh64": "0123456789abcdef"}}

The ``blob_store`` and ``blob_digest`` members are optional from version 6 (present together,
for a version 4 entry set); a ``world_size`` makes it a sharded manifest read as version 4's (no
``mlh64`` in shards). Readers check each tensor with the algorithm its entry names (a record's
``xxh3`` holds the tagged digest ``"mlh64:<16 hex>"``). Saves that hash nothing on a device still
write versions 1-5, byte for byte as before.

Version 7 (a sharded save of a regular layout: every rank the same keys, each tensor split over
one device mesh): a tensor table (``dtype``, ``shape``, ``grid``), the ``mesh``, every rank's data
files and an ``indices`` table naming each rank's index file (``index-r<rank>.json``, its size and
XXH3-64), which lists that rank's pieces as version 3 shards; no piece is listed in the manifest,
so it grows with tensors + ranks. :func:`parse` reads the indexes through its ``read_index``
argument and returns version 3's records (the full specification opens :mod:`._v7_grid`); with
``lazy=True`` it reads none, and each record reads the indexes of the ranks that wrote the pieces
asked for (:mod:`._v7_lazy`: what a resharding load does).

Compatibility: readers accept every ``format_version`` up to their own and refuse newer ones with
an IncompatibleCheckpointError (:class:`ManifestVersionError`). Version 1 is the first
(:data:`UNSHARDED`); version 2 adds sharding (:data:`SHARDED`); version 3 block checksums
(:data:`BLOCKED`); version 4 blobs (:data:`BLOBS`); version 5 patches (:data:`PATCHES`); version
6 device checksums (:data:`DEVICE_CHECKS`); version 7 regular layouts (:data:`GRID`). The order
of the top-level members is the writer's, not a rule: a manifest whose members are reordered (with its trailer recomputed) reads the same.

A manifest is hostile input: :func:`parse` checks it completely (file names that could leave the
directory, ranges past the recorded file sizes, sizes that disagree with shape x dtype, unknown
tree nodes, dangling references, duplicate JSON keys) before any data file is opened, and raises
:class:`ManifestError` (a CorruptCheckpointError) naming the first problem. Its JSON is read by
the bounded reader of :mod:`savepoint.codecs.bounded_json`: at most 512 levels of nesting, and
peak memory at most 24 x the manifest's size + 32 MiB (a real manifest takes about 6.5 x); numbers
are JSON integers where integers belong (no bool, no ``2.0``; sizes and offsets below 2**63,
dimensions below 2**62, at most 64 dimensions), and floats are finite (``1e400``, NaN and
Infinity are refused).

:data:`MAX_MANIFEST_BYTES` stays 1 GiB: a 1,000,000-tensor unsharded manifest is about 250 MB, but
sharded ones grow with the shards (about 140 bytes each: a 91,000-tensor model saved 64-way
flat-sharded writes about 815 MB), and the memory a manifest can cost is bounded by its size.
:func:`dumps` refuses (UnsupportedStateError) any manifest a reader would refuse: over the cap,
too deep, or too dense, so a checkpoint that cannot be loaded is never written.

The modules: ``_records`` (the records :func:`parse` returns and :func:`dump` writes, and the
constants above), ``_encode`` (:func:`dump`, :func:`dumps`), ``_decode`` (:func:`parse`: the top
level of every version), one decoder per family of versions (``_v1``: the column fast path of
version 1 entries; ``_v2_sharded``: versions 2 and 3; ``_v4_blobs``: versions 4 and 5;
``_v6_device``: version 6; ``_v7_grid``: version 7; ``_v7_lazy``: version 7 read lazily) and ``_checks`` (the checks they share, the
tree's among them).
"""

from savepoint.codecs.manifest._checks import check_node as _check_node  # noqa: F401 (tests)
from savepoint.codecs.manifest._checks import check_tree as _check_tree  # noqa: F401 (tests)
from savepoint.codecs.manifest._decode import parse
from savepoint.codecs.manifest._encode import TRAILER_BYTES, dump, dumps, tree_pieces
from savepoint.codecs.manifest._records import (
    BLOBS,
    BLOCKED,
    DEVICE_CHECKS,
    FORMAT,
    GRID,
    MAX_MANIFEST_BYTES,
    NAME,
    PATCHES,
    SHARDED,
    UNSHARDED,
    VERSION,
    FileRecord,
    Manifest,
    ManifestError,
    ManifestVersionError,
    ShardRecord,
    TensorRecord,
    TensorTable,
    recipes,
    shard_name,
    shard_shape,
    whole,
)
from savepoint.codecs.manifest._records import PIECE_ENTRIES as _PIECE_ENTRIES  # noqa: F401
from savepoint.codecs.manifest._v1 import check_entry as _v1_record  # noqa: F401 (tests)
from savepoint.codecs.manifest._v4_blobs import MAX_UP, check_blob_store
from savepoint.codecs.manifest._v7_grid import IndexRecord, ReadIndex, index_bytes, index_name
from savepoint.codecs.manifest._v7_lazy import GridPieces, GridTensors

__all__ = [
    "BLOBS",
    "BLOCKED",
    "DEVICE_CHECKS",
    "FORMAT",
    "FileRecord",
    "GRID",
    "GridPieces",
    "GridTensors",
    "IndexRecord",
    "MAX_MANIFEST_BYTES",
    "MAX_UP",
    "Manifest",
    "ManifestError",
    "ManifestVersionError",
    "NAME",
    "PATCHES",
    "ReadIndex",
    "SHARDED",
    "ShardRecord",
    "TRAILER_BYTES",
    "TensorRecord",
    "TensorTable",
    "UNSHARDED",
    "VERSION",
    "check_blob_store",
    "dump",
    "dumps",
    "index_bytes",
    "index_name",
    "parse",
    "recipes",
    "shard_name",
    "shard_shape",
    "tree_pieces",
    "whole",
]
