"""Which index files of a version 7 checkpoint a restore from peer memory fetches: those its load
reads, as a disk load reads them (:mod:`savepoint.codecs.manifest._v7_lazy`), not every rank's.

A sharded load (``into`` with a process group, or sharded targets) reads a version 7 manifest
lazily: the index of the rank that wrote each piece its plan meets, nothing else; any other load
reads every index. :meth:`Indexes.first` names the indexes the restore fetches before it plans:
for a lazy load, a dry run of the restore's planner (:func:`savepoint.distributed.needs.files_needed`)
over the manifest parsed lazily, each piece's record made up from the grid alone (no index read:
:class:`_Dry`), collects the index each piece asked for would be read from (the writer rule of
:meth:`savepoint.codecs.manifest.GridPieces.writer`); for any other load, every index.

:meth:`Indexes.parse` then parses the manifest with the indexes fetched (each read from the
assembly, where it landed verified against its copy's marker; the parse checks it against the
manifest's record again). An index the plan asks for that was not fetched (the writer rule
failed: ranks numbered otherwise than the mesh, a table reordered by hand, so the lazy reader
falls back to every index) is recorded, not read: :meth:`Indexes.rest` is then every index not
fetched yet, which the restore fetches in place of its data files; it then plans again and
fetches those in a second pass every rank joins (:mod:`savepoint.runs._peer_restore`: a flag in
the document each rank sends anyway, so a restore where no rank needs it gathers nothing more).
"""

from __future__ import annotations

import os
from typing import Any

from savepoint.codecs import manifest as mf

__all__ = ["Indexes", "reads_lazily"]


def reads_lazily(options: dict[str, Any]) -> bool:
    """Whether ``sp.load`` with ``options`` reads a version 7 manifest's indexes lazily (as
    :func:`savepoint.checkpoint.load` routes it: a sharded load into ``into``)."""
    into = options.get("into")
    if into is None:
        return False
    if options.get("process_group") is not None:
        return True
    from savepoint.distributed import shard

    return bool(shard.has_targets(into))


class _Missing(Exception):
    """An index asked for that was not fetched (recorded: see :meth:`Indexes.parse`)."""


class _Dry(mf.GridTensors):
    """The records of a lazily parsed version 7 manifest with each piece made up from the grid
    (its region; no file, no bytes): ``wanted`` collects the index each piece asked for would
    be read from (every index where its writer has none: the lazy reader falls back to all)."""

    def __init__(self, table: Any) -> None:
        super().__init__(table)
        self.wanted: set[str] = set()

    def piece(self, pieces: mf.GridPieces, i: int) -> mf.ShardRecord:
        name = mf.index_name(pieces.writer(i))
        if name in self.table.indices:
            self.wanted.add(name)
        else:
            self.wanted.update(self.table.indices)
        return mf.ShardRecord("", 0, 0, "", pieces.region(i))


class Indexes:
    """The index files of the version 7 manifest ``raw`` for one restore, whose fetched files
    land in ``directory`` (the assembly's checkpoint folder): see the module docstring."""

    def __init__(self, raw: bytes, directory: str, names: list[str], options: dict[str, Any]):
        self.raw, self.directory, self.names = raw, directory, names
        self.options = options
        self.lazy = reads_lazily(options)
        self.fetched: set[str] = set()
        self.missing: list[str] = []

    def first(self) -> list[str]:
        """The indexes to fetch before planning (every one unless the load reads them lazily)."""
        wanted = set(self.names)
        if self.lazy:
            wanted = self._predicted()
        self.fetched |= wanted
        return sorted(wanted)

    def _predicted(self) -> set[str]:
        from savepoint.distributed.needs import files_needed

        try:
            manifest = mf.parse(self.raw, columns=False, read_index=_unread, lazy=True)
            assert isinstance(manifest.tensors, mf.GridTensors)
            dry = _Dry(manifest.tensors.table)
            manifest.tensors = dry
            into, keys = self.options.get("into"), self.options.get("keys")
            files_needed(manifest, self.directory, into=into, keys=keys)
        except Exception:  # (a plan with problems, a malformed manifest: the load reports it)
            return set(self.names)
        return dry.wanted

    def parse(self) -> mf.Manifest:
        """The manifest, read (lazily, for a lazy load) with the indexes fetched: one not fetched
        is recorded in ``missing`` (its record raises meanwhile)."""
        self.missing = []
        return mf.parse(self.raw, columns=False, read_index=self._read, lazy=self.lazy)

    def _read(self, name: str, size: int) -> bytes:
        if name not in self.fetched:
            self.missing.append(name)
            raise _Missing(name)
        with open(os.path.join(self.directory, name), "rb") as f:
            return f.read(size + 1)

    def rest(self) -> list[str]:
        """The indexes still to fetch: every one not fetched yet where the last plan asked for
        one that was not (none otherwise)."""
        if not self.missing:
            return []
        rest = sorted(set(self.names) - self.fetched)
        self.fetched.update(rest)
        return rest


def _unread(name: str, size: int) -> bytes:
    raise _Missing(name)  # (a dry run reads no index: :class:`_Dry` makes every piece up)
