"""Restoring from peer memory, on every rank of the manager's process group at once.

:meth:`PeerRestore.survey` (one session of the wire): every rank lists the committed copies its
node's folder holds (their markers) and the lists are gathered; a step is *complete* when every
part of one save of it (one manifest digest) has a copy on a node that still has a live rank.
:meth:`PeerRestore.load` then restores one complete step, in rounds (one session):

1. **the manifest**: a rank whose node holds a copy of any part links its ``manifest.json`` into a
   private folder of its node (its *assembly*), others fetch it; each is checked against the
   digest the copies share. Of a manifest version 7, then the index files this rank's load
   reads the same way (:mod:`savepoint.runs._peer_indexes`: a sharded load's, those of the
   writers of the pieces its targets meet, found from the grid before any is fetched; any other
   load's, every one), after the copies whose marker records an index other than the one the
   manifest records are set aside (every rank alike: :func:`_agreeing`); the manifest is then
   parsed with them (each checked against the manifest's record again);
2. **what the load needs**: the data files this rank's load reads
   (:func:`savepoint.distributed.needs.files_needed`: its targets' regions, any world size); of
   a version 7 manifest, where that plan asks for an index not fetched (the grid's writer rule
   failed), the rank fetches every other index in step 3 in place of its files, and its files
   (all through the loader) in a second pass of step 3 that every rank joins;
3. **the files**: a file of a part its own node holds is hard-linked into the assembly and
   verified against that copy's marker; the others are requested, and each is sent by a rank of a
   node holding its part (spread over the holders), checked on arrival against the marker's
   XXH3-64. A copy that does not verify is set aside and the file requested again from another
   holder (another round); a rank that does not answer within ``timeout`` fails the restore from
   peer memory (IncompleteCheckpointError naming it), as does a part left without a verified
   copy (CorruptCheckpointError), on every rank alike: the restore goes on with the next source.
   **Straight into the targets** (:func:`savepoint.distributed.needs.direct_ranges`: tensors
   whose every stored shard lands whole in one contiguous run of a plain CPU target, from files
   no other read of this load needs): a received file's ranges are received into the targets'
   own memory (a sink with ``place``: :mod:`savepoint.runs._peer_wire`), hashed as they land;
   a file this node holds is checked against its marker on a thread while the first transfer
   runs, and copied into its targets only once it verified (a copy that does not verify is
   fetched from another node, as above). Not for ``verify="first"``, ``keys``, ``mmap``, a
   ``device``, blobs, or tensors averaging under :data:`DIRECT_AVERAGE` bytes;
4. **the load**: ``sp.load`` of the assembly with the caller's options (the same planner and
   loader as a disk load, which checks every checksum again), the targets filled in step 3
   taken out of their dicts meanwhile (a load into ``into`` reads what it covers) and put back
   after, in order; the assembly is removed after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from savepoint import checkpoint
from savepoint.codecs import manifest as mf
from savepoint.errors import CorruptCheckpointError, IncompleteCheckpointError
from savepoint.runs._peer_check import Check, Unit, units, verify_file
from savepoint.runs._peer_folder import (
    BLOBS,
    COMMON,
    FileSource,
    Landing,
    PartRecord,
    assembly,
    hash_file,
    place,
)
from savepoint.runs._peer_grid import Head, assembled_units, head, index_problem
from savepoint.runs._peer_indexes import Indexes
from savepoint.runs._peer_wire import Incoming, Outgoing, Wire

if TYPE_CHECKING:
    from savepoint.distributed.needs import Direct
    from savepoint.runs.peers import PeerMemory

__all__ = ["PeerRestore"]

log = logging.getLogger("savepoint.runs.peers")

_ROUNDS = 4  # fetch rounds per file set: each round sets aside the copies that did not verify
# Bytes a checkpoint's tensors must average for its files to land straight in the targets: the
# ranges cost about 40 us of planning a tensor (20,000 tensors of 1 KiB restored in 1.4-2.8 s
# that way, 0.8-2.1 s through the loader, on the loaded development machine)
DIRECT_AVERAGE = 256 << 10
_LABEL = "peer memory"


@dataclasses.dataclass
class _Choice:
    """One complete save of a step: its manifest digest, world, and who holds which part."""

    step: int
    digest: str
    world: int
    holders: dict[int, list[str]]  # part -> nodes holding a copy (live ones)
    records: dict[tuple[str, int], PartRecord]  # (node, part) -> that copy's marker

    owners: dict[str, int] = dataclasses.field(init=False, repr=False, default_factory=dict)

    def owner(self, name: str) -> int | None:
        """The part holding file ``name`` (None: the manifest, or the blob store's
        configuration, which every part holds)."""
        if name in COMMON:
            return None
        if not self.owners:  # (once: a version 7 restore asks for many parts' indexes)
            for (_, part), record in self.records.items():
                self.owners.update(dict.fromkeys(record.files, part))
        if name in self.owners:
            return self.owners[name]
        raise CorruptCheckpointError(
            f"{_LABEL}: no copy of step {self.step} holds {name}, which its manifest names",
            path=name,
        )


class PeerRestore:
    """Restores of one tier on this rank (see the module docstring)."""

    def __init__(self, memory: PeerMemory) -> None:
        self.memory = memory
        self.wire: Wire = memory.wire
        self.complete: dict[int, _Choice] = {}
        self.live: dict[str, list[int]] = {}  # node -> its ranks that answered
        self.local_failures: list[str] = []  # this rank's own node's copies that did not verify

    # -- which steps ------------------------------------------------------------------------

    def survey(self) -> set[int]:
        folder = self.memory.folder
        assert folder is not None
        held = {
            str(step): {str(p): r.to_json() for p, r in parts.items()}
            for step, parts in folder.parts().items()
        }
        with self.wire.session():
            got = self.wire.gather("inventory", {"node": self.memory.node, "parts": held})
        if got.missing:
            log.warning(
                "%s: %s did not answer within %g s: what their nodes hold is not used",
                _LABEL,
                ", ".join(self.wire.who(r) for r in got.missing),
                self.wire.timeout,
            )
        self.live = {}
        by_save: dict[tuple[int, str], dict[tuple[str, int], PartRecord]] = {}
        for rank, doc in enumerate(got.values):
            if doc is None:
                continue
            node = doc["node"]
            self.live.setdefault(node, []).append(rank)
            for step, parts in doc["parts"].items():
                for part, raw in parts.items():
                    try:
                        record = PartRecord.from_json(raw, f"{_LABEL} of node {node}")
                    except CorruptCheckpointError as exc:
                        log.warning("%s: %s", _LABEL, exc)
                        continue
                    if (record.step, record.part) != (int(step), int(part)):
                        continue
                    key = (record.step, record.manifest)
                    by_save.setdefault(key, {})[(node, record.part)] = record
        self.complete = {}
        for (step, digest), records in sorted(by_save.items()):
            world = min(r.world for r in records.values())
            holders: dict[int, list[str]] = {}
            for (node, part), record in sorted(records.items()):
                if record.world == world:
                    holders.setdefault(part, []).append(node)
            if all(holders.get(p) for p in range(world)):
                choice = _Choice(step, digest, world, holders, records)
                best = self.complete.get(step)
                if best is None or _copies(choice) > _copies(best):
                    self.complete[step] = choice
        return set(self.complete)

    # -- one step --------------------------------------------------------------------------

    def load(self, step: int, options: dict[str, Any]) -> Any:
        """Restore ``step`` (complete in the last survey) with ``sp.load``'s ``options``."""
        choice = self.complete[step]
        folder = self.memory.folder
        assert folder is not None
        base = folder.staging()
        try:
            with self.wire.session():
                self._fetch(choice, [mf.NAME], base, "manifest", _here)
                choice, manifest, directory, where, indexes = self._manifest(choice, base, options)
                wanted, direct = _wanted(choice, manifest, directory, options)
                rest = indexes.rest() if indexes is not None else []
                if rest:  # (the grid's writer rule failed: every other index in place of files)
                    wanted, direct = set(rest), []
                covered = _covered(manifest, directory, indexes)
                direct = [d for d in direct if all(covered(r[0]) for r in d.ranges)]
                sinks = {n: (r, covered(n) or []) for n, r in _sinks(direct).items()}
                again = self._fetch(choice, sorted(wanted), base, "files", where, sinks, bool(rest))
                if again:  # (a rank fetched indexes in place of its files: every rank once more)
                    wanted = set()
                    if rest:
                        assert indexes is not None
                        wanted = _wanted(choice, indexes.parse(), directory, options)[0]
                    self._fetch(choice, sorted(wanted), base, "files-again", where)
            with _set_aside(direct):  # (their bytes landed and verified: the rest is loaded)
                return checkpoint.load(directory, **options)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _manifest(
        self, choice: _Choice, base: str, options: dict[str, Any]
    ) -> tuple[_Choice, mf.Manifest, str, Any, Indexes | None]:
        """The fetched manifest (in ``base``) moved into the assembly and parsed: a version 7
        one after the indexes its load reads were fetched and verified (those its plan asks for:
        :mod:`savepoint.runs._peer_indexes`; the copies whose marker records an index other than
        the manifest's set aside first). The choice that is left, the manifest, the assembly's
        checkpoint folder, where each file goes, and (version 7) its indexes."""
        with open(os.path.join(base, mf.NAME), "rb") as f:
            raw = f.read()
        grid = head(raw)
        manifest = mf.parse(raw, columns=False) if grid is None else None
        blob_store = manifest.blob_store if manifest is not None else None
        where = functools.partial(place, step=choice.step, blob_store=blob_store)
        os.makedirs(os.path.dirname(os.path.join(base, where(mf.NAME))))
        os.rename(os.path.join(base, mf.NAME), os.path.join(base, where(mf.NAME)))
        directory = assembly(base, choice.step, blob_store)
        if manifest is not None:
            return choice, manifest, directory, where, None
        assert grid is not None
        choice = _agreeing(choice, grid)
        indexes = Indexes(raw, directory, sorted(grid.indices), options)
        self._fetch(choice, indexes.first(), base, "indexes", where)
        return choice, indexes.parse(), directory, where, indexes

    def _fetch(
        self,
        choice: _Choice,
        wanted: list[str],
        base: str,
        what: str,
        where: Callable[[str], str],
        sinks: dict[str, _Sink] | None = None,
        again: bool = False,
    ) -> bool:
        """Bring every file of ``wanted`` to ``base/where(name)`` (those of ``sinks``: into
        their targets, straight, or copied from this node's copy once it verified), verified
        (rounds: see the module docstring); raises on every rank alike when it cannot. Returns
        whether any rank said ``again`` (it fetches more after this: every rank then fetches
        once more, alike)."""
        bad: set[tuple[str, int]] = set()
        failures: list[str] = []  # the copies that did not verify, as the ranks found them
        deferred: list[_Held] = []  # this node's copies of files of ``sinks``, checked below
        need = self._local(choice, wanted, base, where, bad, sinks or {}, deferred)
        for round_ in range(_ROUNDS):
            mine = {"need": need, "bad": sorted(bad), "errors": self.local_failures, "again": again}
            self.local_failures = []
            asked = self.wire.gather(f"{what}-need-{round_}", mine)
            if asked.missing:
                self._give_up(choice, asked.missing, [], "answer")
            for doc in asked.values:
                bad.update((node, part) for node, part in doc["bad"])
                failures.extend(doc["errors"])
                again = again or doc["again"]
            plan, unplaced = self._plan(choice, [doc["need"] for doc in asked.values], bad)
            outgoing, incoming, landing = self._messages(choice, plan, base, where, sinks or {})
            checking = _Checking(deferred, sinks or {})  # (while the bytes travel)
            deferred = []
            try:
                errors = self.wire.transfer(outgoing, incoming)
            finally:
                landing.close()
                checking.join()
            lost = errors + [i.error for i in incoming if i.lost and i.error]
            parts = {send.message: send.record.part for send in plan}
            corrupt = [(self.wire.nodes[i.src], parts[i.message]) for i in incoming if i.corrupt]
            unverified = []
            for held, ok in zip(checking.held, checking.results):
                if ok:
                    continue
                log.warning(
                    "%s: the copy of %s on node %s does not verify", _LABEL, held.name, held.node
                )
                unverified.append(f"the copy of {held.name} on node {held.node} does not verify")
                corrupt.append((held.node, held.part))
            done = {
                "lost": lost,
                "bad": sorted(set(corrupt)),
                "errors": [i.error for i in incoming if i.corrupt and i.error] + unverified,
            }
            told = self.wire.gather(f"{what}-done-{round_}", done)
            lost_all = [e for doc in told.values if doc for e in doc["lost"]]
            if told.missing or lost_all:
                self.wire.reset()
                self._give_up(choice, told.missing, lost_all, "send what was asked")
            for doc in told.values:
                bad.update((node, part) for node, part in doc["bad"])
                failures.extend(doc["errors"])
            if unplaced:
                raise CorruptCheckpointError(
                    f"{_LABEL}: step {choice.step}: no verified copy left of "
                    + "; ".join(unplaced + sorted(set(failures))),
                    path=base,
                )
            need = [i.name for i in incoming if i.corrupt]
            need += [h.name for h, ok in zip(checking.held, checking.results) if not ok]
            if not any(doc["bad"] for doc in told.values):
                return again
        raise CorruptCheckpointError(
            f"{_LABEL}: step {choice.step}: copies kept failing verification ({_ROUNDS} rounds): "
            + "; ".join(sorted(set(failures))),
            path=base,
        )

    def _give_up(self, choice: _Choice, missing: list[int], lost: list[str], what: str) -> None:
        who = [f"{self.wire.who(r)} did not {what} within {self.wire.timeout:g} s" for r in missing]
        raise IncompleteCheckpointError(
            f"{_LABEL}: step {choice.step} could not be fetched: " + "; ".join(who + lost),
            path=self.memory.folder.root if self.memory.folder is not None else None,
        )

    def _local(
        self,
        choice: _Choice,
        wanted: Iterable[str],
        base: str,
        where: Callable[[str], str],
        bad: set[tuple[str, int]],
        sinks: dict[str, _Sink],
        deferred: list[_Held],
    ) -> list[str]:
        """Link the wanted files this node holds to ``base/where(name)``, verified (those of
        ``sinks``: listed in ``deferred``, checked during the first transfer); the others (and
        those whose copy here did not verify: set aside in ``bad``) are returned."""
        folder = self.memory.folder
        assert folder is not None
        node, need = self.memory.node, []
        for name in wanted:
            parts = _parts(choice, name)
            held = [p for p in parts if node in choice.holders[p] and (node, p) not in bad]
            if not held:
                need.append(name)
                continue
            record = choice.records[(node, held[0])]
            source = os.path.join(folder.path(choice.step, held[0]), name)
            target = os.path.join(base, where(name))
            try:
                if name in sinks:  # (copied into its targets once every file is there)
                    deferred.append(_Held(name, source, record.files[name], node, held[0]))
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.link(source, target)
                ok = hash_file(target) == record.files[name]
            except OSError as exc:
                log.warning("%s: cannot use %s: %s", _LABEL, source, exc)
                ok = False
            if not ok:
                log.warning("%s: the copy of %s on node %s does not verify", _LABEL, name, node)
                self.local_failures.append(f"the copy of {name} on node {node} does not verify")
                bad.add((node, held[0]))
                if os.path.lexists(target):
                    os.unlink(target)
                need.append(name)
        return need

    def _plan(
        self, choice: _Choice, needs: list[list[str]], bad: set[tuple[str, int]]
    ) -> tuple[list[_Send], list[str]]:
        """Who sends what to whom, for every file any rank needs (the same on every rank), and
        what no verified copy is left of."""
        nodes = self.wire.nodes
        plan: list[_Send] = []
        unplaced: list[str] = []
        for requester, names in enumerate(needs):
            for name in names:
                parts = _parts(choice, name)
                options = [
                    (node, p)
                    for p in parts
                    for node in choice.holders[p]
                    if node != nodes[requester] and (node, p) not in bad and node in self.live
                ]
                if not options:
                    unplaced.append(f"{name} (for {self.wire.who(requester)})")
                    continue
                node, part = options[requester % len(options)]
                ranks = self.live[node]
                record = choice.records[(node, part)]
                server = ranks[requester % len(ranks)]
                plan.append(_Send(len(plan), server, requester, name, record))
        return plan, unplaced

    def _messages(
        self,
        choice: _Choice,
        plan: list[_Send],
        base: str,
        where: Callable[[str], str],
        sinks: dict[str, _Sink],
    ) -> tuple[list[Outgoing], list[Incoming], Landing]:
        """This rank's side of ``plan``: what it serves from its node's copies, what it receives
        (to ``base/where(name)``, or into the targets of ``sinks``)."""
        folder = self.memory.folder
        assert folder is not None
        me = self.wire.rank
        outgoing, incoming = [], []
        landing = Landing(base)
        for send in plan:
            size, digest = send.record.files[send.name]
            if send.server == me:
                path = os.path.join(folder.path(choice.step, send.record.part), send.name)
                opener = _file_opener(path)  # (the requester checks it against the marker)
                outgoing.append(
                    Outgoing(send.message, [send.requester], size, send.name, opener, hashed=False)
                )
            if send.requester == me:
                into, covered = sinks.get(send.name, (None, None))
                lands = _into(into) if into else _lander(landing, where(send.name), size)
                verify = Check(covered) if covered else None  # (every file of sinks: covered)
                incoming.append(
                    Incoming(
                        send.message, send.server, size, send.name, lands, digest, verify=verify
                    )
                )
        return outgoing, incoming, landing


@dataclasses.dataclass(frozen=True)
class _Send:
    """One file of the fetch plan: ``server`` sends ``name`` of its node's copy ``record`` to
    ``requester``, as message ``message``."""

    message: int
    server: int
    requester: int
    name: str
    record: PartRecord


def _parts(choice: _Choice, name: str) -> list[int]:
    """The parts whose copies hold ``name`` (every part for the files they all hold)."""
    owner = choice.owner(name)
    return sorted(choice.holders) if owner is None else [owner]


def _agreeing(choice: _Choice, grid: Head) -> _Choice:
    """``choice`` without the copies whose marker records an index other than the one the
    manifest ``grid`` records for their part (the same on every rank: markers and manifest are
    shared): their pieces are not trusted."""
    holders: dict[int, list[str]] = {}
    for part, nodes in choice.holders.items():
        index = grid.index(part)
        holders[part] = [
            node
            for node in nodes
            if index is None
            or _index_agrees(choice.records[(node, part)], index, grid.indices[index], node)
        ]
    return dataclasses.replace(choice, holders=holders)


def _index_agrees(record: PartRecord, name: str, expect: mf.IndexRecord, node: str) -> bool:
    size, digest = record.files.get(name, (-1, ""))
    problem = index_problem(expect, size, digest)
    if problem is not None:
        log.warning("%s: the copy of %s on node %s is not used: %s", _LABEL, name, node, problem)
    return problem is None


def _here(name: str) -> str:
    return name


def _part(choice: _Choice, name: str) -> int:
    part = choice.owner(name)
    assert part is not None
    return part


def _copies(choice: _Choice) -> int:
    return sum(len(nodes) for nodes in choice.holders.values())


def _file_opener(path: str) -> Any:
    return lambda: FileSource(path)


def _lander(landing: Landing, name: str, size: int) -> Any:
    return lambda: landing.target(name, size)


def _needs(
    manifest: mf.Manifest, directory: str, options: dict[str, Any]
) -> tuple[set[str], list[Direct]]:
    """The data files this rank's load reads (every one, when its targets cannot be planned:
    the load reports why), and the targets they land in straight (step 3 of the module
    docstring): none for a load that checks everything first, maps, moves to a device,
    selects keys, or reads blobs, nor for a checkpoint of small tensors (under
    :data:`DIRECT_AVERAGE` bytes each on average: there the loader's per-tensor cost is lower
    than the planning of each tensor's ranges)."""
    from savepoint.distributed.needs import files_needed, needs_and_direct

    into, keys = options.get("into"), options.get("keys")
    plain = options.get("verify", True) is True and not options.get("mmap")
    plain = plain and keys is None and options.get("device") is None
    stored = sum(record.size for record in manifest.files.values())
    large = stored >= DIRECT_AVERAGE * max(1, len(manifest.tensors))
    if into is not None and plain and large and not manifest.has_blobs:
        try:
            return needs_and_direct(manifest, directory, into)
        except Exception as exc:  # (then as without: the load reports what is wrong)
            log.debug("%s: no target is received into straight: %s", _LABEL, exc)
    try:
        return files_needed(manifest, directory, into=into, keys=keys), []
    except Exception:  # (the load reports it)
        return set(manifest.files), []


def _wanted(
    choice: _Choice, manifest: mf.Manifest, directory: str, options: dict[str, Any]
) -> tuple[set[str], list[Direct]]:
    """:func:`_needs`, and of an incremental checkpoint every blob (see the module docstring)."""
    wanted, direct = _needs(manifest, directory, options)
    if manifest.has_blobs:
        wanted.add(COMMON[1])
        wanted.update(n for r in choice.records.values() for n in r.files if n.startswith(BLOBS))
    return wanted, direct


_Range = tuple[int, int, memoryview]  # bytes [start, end) of a file land in this memory
# A file received straight into targets: its ranges, and its checkpoint's checksums (the file's
# checksummed ranges: the bytes are checked against them as they land, not only against the
# copy's marker, which a copy of another save could carry: never a mixed checkpoint)
_Sink = tuple[list[_Range], list[Unit]]


def _covered(
    manifest: mf.Manifest, directory: str, indexes: Indexes | None
) -> Callable[[str], list[Unit] | None]:
    """The checksummed ranges of each data file (None: not covered whole; such a file is not
    received straight: the loader checks it)."""
    of: Callable[[str], list[Unit] | None]
    if indexes is None:
        of = functools.partial(units, manifest)
    else:
        grid = head(indexes.raw)  # (the manifest as fetched: not read again)
        of = (lambda name: None) if grid is None else assembled_units(grid, directory)
    return functools.cache(of)  # (asked once per target's range: tiled once per file)


def _sinks(direct: list[Direct]) -> dict[str, list[_Range]]:
    """file -> the ranges of it that land in targets, in file order."""
    found: dict[str, list[_Range]] = {}
    for d in direct:
        for name, start, end, offset in d.ranges:
            view = memoryview(d.memory[offset : offset + end - start])
            found.setdefault(name, []).append((start, end, view))
    return {name: sorted(ranges, key=lambda r: r[0]) for name, ranges in found.items()}


class _Into:
    """A fetched file received straight into targets (a sink of the wire with ``place``): the
    bytes of ``ranges`` land in their memory, the rest (the header, shards this rank does not
    load) are hashed and dropped."""

    def __init__(self, ranges: list[_Range]) -> None:
        self.ranges, self.i = ranges, 0

    def place(self, at: int, n: int) -> tuple[memoryview | None, int]:
        ranges = self.ranges
        while self.i < len(ranges) and ranges[self.i][1] <= at:
            self.i += 1
        if self.i == len(ranges):
            return None, n
        start, end, view = ranges[self.i]
        if at < start:
            return None, min(n, start - at)
        k = min(n, end - at)
        return view[at - start : at - start + k], k

    def write(self, chunk: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _into(ranges: list[_Range]) -> Any:
    return lambda: _Into(ranges)


@contextlib.contextmanager
def _set_aside(direct: list[Direct]) -> Iterator[None]:
    """The targets of ``direct`` taken out of their dicts while the loader fills the rest (a
    load into ``into`` reads what it covers), then put back where they were, in order."""
    before: dict[int, tuple[dict[Any, Any], list[tuple[Any, Any]]]] = {}
    for d in direct:
        if id(d.parent) not in before:
            before[id(d.parent)] = (d.parent, list(d.parent.items()))
    taken = {(id(d.parent), d.key) for d in direct}
    for d in direct:
        del d.parent[d.key]
    try:
        yield
    finally:
        for parent, items in before.values():
            now = dict(parent)
            parent.clear()
            for key, value in items:
                parent[key] = value if (id(parent), key) in taken else now.pop(key, value)
            parent.update(now)


def _copy_ranges(path: str, ranges: list[_Range]) -> None:
    """Copy the ranges of the file at ``path`` (a node's verified copy) into their targets."""
    with open(path, "rb") as f:
        for start, end, view in ranges:
            got = f.readinto(view) if f.seek(start) == start else 0
            if got != end - start:
                raise CorruptCheckpointError(
                    f"{_LABEL}: {path} ended before byte {end} (changed after it verified)",
                    path=path,
                )


@dataclasses.dataclass(frozen=True)
class _Held:
    """A file of this node's copy of ``part`` (at ``path``), to check against its marker."""

    name: str
    path: str
    expect: tuple[int, str]  # its size and XXH3-64
    node: str
    part: int


class _Checking:
    """The copies ``held`` checked against their markers on a thread of its own (XXH3 and the
    reads release the GIL), each copied into its targets (its ranges in ``sinks``) once it
    verified: ``results`` after :meth:`join`, whether each verified and was copied."""

    def __init__(self, held: list[_Held], sinks: dict[str, _Sink]) -> None:
        self.held, self.sinks, self.results = held, sinks, [False] * len(held)
        self._thread: threading.Thread | None = None
        if held:
            self._thread = threading.Thread(target=self._run, name="savepoint-peers-check")
            self._thread.start()

    def _run(self) -> None:
        for i, held in enumerate(self.held):
            try:
                ranges, covered = self.sinks[held.name]
                if verify_file(held.path, held.expect, covered):
                    _copy_ranges(held.path, ranges)
                    self.results[i] = True
            except (OSError, CorruptCheckpointError) as exc:
                log.warning("%s: cannot use %s: %s", _LABEL, held.path, exc)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
