"""One replication of a committed checkpoint into peer memory, on every rank of the manager's
process group at once: a job of the tier's worker thread (:mod:`savepoint.runs.peers`).

In order, on each rank (one session of the wire, :mod:`savepoint.runs._peer_wire`):

1. **its part**: the manifest of the committed checkpoint (read from the run directory), of a
   manifest version 7 this rank's index file (``index-r<rank>.json``, checked against the
   manifest's record of it: :mod:`savepoint.runs._peer_grid`; no other rank's index is read),
   and the data files this rank wrote (``data-r<rank>-*``; every file for a checkpoint saved
   without a process group); an incremental checkpoint's part also holds every ``world``-th
   blob its manifest names (``blobs/...``, whole copies: peer memory keeps no blob store of its
   own, so each step's copy holds all its blobs, changed or not) and the blob store's
   configuration; every rank's part (file names, sizes, the manifest's digest) is gathered;
2. **where copies go** (:func:`ring`): each rank sends its part to ``replicas`` ranks on the
   next nodes of a ring (nodes in the order of their first rank), never its own node: to the
   rank at its own index on that node (modulo the ranks there), so the load spreads;
3. **room**: each node's ranks work out the bytes landing there (its own parts and the copies
   it receives), delete the copies of later steps (a run that saves an earlier step went back
   to it: those belong to a timeline it abandoned) and the oldest copies the budget no longer
   holds
   (:func:`savepoint.runs._peer_folder.evictions`: never the newest complete step), and if it
   still does not fit, keep no copy of this step (received bytes are dropped);
4. **the bytes**: each rank reads its files once, piece by piece, writing its own node's copy
   (a hard link instead, where the run directory is on the node memory's file system: a RAM
   disk) and sending them to its targets; receivers land the bytes in a staging folder. A data
   file its manifest's checksums cover whole (a savepoint one) is checked by each receiver
   against those checksums as it arrives (:mod:`savepoint.runs._peer_check`), and the XXH3-64
   the receiver computed in that pass comes back to the sender for its own copy's marker: the
   sender never reads it to hash it (a version 7 part's: against its index, checked against the
   manifest first). Other files (the manifest, an index, blobs) the sender hashes, and the
   receivers check them against its XXH3-64 (the manifest against the digest every rank agreed
   on, an index against the manifest's record of it, as its sender read it);
5. **commit**: each copy (its marker last, then a rename: :class:`NodeFolder`);
6. **the outcome**, gathered: the step is *complete* in peer memory when every part has at least
   one committed copy; a failure anywhere (a rank that died or stopped answering, a file that did
   not arrive whole, a full memory) is known to every rank, which then drops the wire's group;
7. **eviction**: once the step is complete it is the node's anchor, and older copies go as the
   budget asks (all of them with no budget).

A kill at any moment leaves staging folders (removed once their process is gone) and committed
copies, each whole; a restore only takes steps whose every part has a committed copy of the same
save (the manifest's digest), so it never mixes two checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import resolve as resolve_committed
from savepoint.runs._peer_check import Check, Unit, units
from savepoint.runs._peer_folder import (
    BLOBS,
    COMMON,
    BlobSource,
    BytesSource,
    CopyWriter,
    Landing,
    NodeFolder,
    PartRecord,
    blob_home,
    evictions,
)
from savepoint.runs._peer_grid import check_index, head
from savepoint.runs._peer_wire import Gathered, Incoming, Outgoing, Wire
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = ["Outcome", "Replication", "fewer_copies", "part_files", "ring"]

log = logging.getLogger("savepoint.runs.peers")


@dataclasses.dataclass
class Outcome:
    """What one replication achieved, the same on every rank."""

    step: int
    complete: bool
    copies: dict[int, list[str]]  # part -> the nodes holding a committed copy
    errors: list[str]
    seconds: float = 0.0  # from the job's start until every rank agreed on the outcome
    agreed: float = 0.0  # time.perf_counter() then (the eviction of older steps follows)


def ring(nodes: list[str], replicas: int) -> list[list[int]]:
    """For each rank (``nodes[rank]`` its node), the ranks it sends its part to (see the module
    docstring). Fewer than ``replicas`` when there are not that many other nodes."""
    order: list[str] = []
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in by_node:
            order.append(node)
        by_node.setdefault(node, []).append(rank)
    targets = []
    for rank, node in enumerate(nodes):
        i, local = order.index(node), by_node[node].index(rank)
        mine = []
        for k in range(1, min(replicas, len(order) - 1) + 1):
            there = by_node[order[(i + k) % len(order)]]
            mine.append(there[local % len(there)])
        targets.append(mine)
    return targets


def fewer_copies(nodes: list[str], replicas: int) -> str | None:
    """What to tell the user when the ranks are on fewer than ``replicas + 1`` nodes (all ranks
    on one machine, say: the ring then makes fewer copies than asked, see :func:`ring`)."""
    others = len(set(nodes)) - 1
    if replicas <= others:
        return None
    return (
        f"peer memory: replicas={replicas}, but the ranks are on {others + 1} node(s): each "
        f"part gets {others} copies on other nodes"
        + (", so none outlives its node" if others == 0 else "")
        + "; to simulate nodes on one machine give groups of ranks their own node "
        f"(Tier.peers(node=...) or SAVEPOINT_NODE), or ask for replicas={others}"
    )


_WARNED: set[tuple[int, int]] = set()  # (nodes, replicas) said once per process


def part_files(manifest: mf.Manifest, part: int) -> list[str]:
    """The data files of part ``part``: those rank ``part`` wrote (a sharded checkpoint), or
    every one (part 0 of a checkpoint saved by one process). (An incremental checkpoint's part
    also holds its share of the blobs: see :func:`_blob_files`.)"""
    if not manifest.sharded:
        return sorted(manifest.files) if part == 0 else []
    prefix = f"data-r{part:05d}-"
    return sorted(name for name in manifest.files if name.startswith(prefix))


@dataclasses.dataclass
class _Part:
    """This rank's part of the checkpoint being replicated."""

    store: Any
    small: dict[str, bytes]  # the manifest (and a version 7 part's index): the bytes read
    digest: str
    world: int
    files: list[tuple[str, int]]  # name, size (manifest.json first, then an index)
    paths: dict[str, str]  # name -> where the store holds it (its data files and blobs)
    local: bool  # the store is this machine's file system (paths are file paths)
    units: Callable[[str], list[Unit] | None] | None = None  # a data file's checksummed ranges
    expect: dict[str, str] = dataclasses.field(default_factory=dict)  # small's digests, checked

    def __post_init__(self) -> None:
        for name, data in self.small.items():
            self.expect[name] = self.digest if name == mf.NAME else checksum.digest(data)


class Replication:
    """Replication jobs of one tier on this rank: ``wire`` to the other ranks, ``folder`` this
    node's memory, ``replicas`` copies of each part on other nodes, ``budget`` bytes per node
    (None: no limit, only the newest complete step kept). ``anchor``: the newest step known to
    be complete (kept from job to job)."""

    def __init__(self, wire: Wire, folder: NodeFolder, replicas: int, budget: int | None) -> None:
        self.wire, self.folder = wire, folder
        self.replicas, self.budget = replicas, budget
        self.anchor: int | None = None

    def run(self, step: int, source: PathArg) -> Outcome:
        """Replicate the committed checkpoint ``source`` of ``step`` (every rank at once)."""
        wire = self.wire
        with wire.session():
            part, error = self._read_part(source)
            doc: dict[str, Any] = {"error": error}
            if part is not None:
                doc.update(manifest=part.digest, world=part.world, files=part.files)
                doc["small"] = part.expect  # (the manifest and an index are checked against)
            parts = wire.gather("parts", doc)
            problems = _problems(wire, parts, "describe its part")
            copies: list[tuple[int, str]] = []
            if not problems:
                assert part is not None
                copies, problems = self._copy(step, part, parts.values)
            done = wire.gather("done", {"copies": copies, "errors": problems})
        return self._outcome(step, parts, done)

    def _read_part(self, source: PathArg) -> tuple[_Part | None, str | None]:
        """This rank's part of the committed checkpoint at ``source``, or why it cannot be."""
        try:
            where: Location = resolve(source, what="checkpoint")
            store = where.store
            directory = resolve_committed(store, where.path)
            if directory is None:
                return None, f"no committed checkpoint at {where}"
            raw = store.read_small(store.join(directory, mf.NAME), cap=mf.MAX_MANIFEST_BYTES)
            grid = head(raw)  # (version 7: read without the other ranks' indexes)
            manifest: Any = mf.parse(raw, columns=False) if grid is None else grid
            world = manifest.world_size or 1
            if world != self.wire.world:
                return None, f"the checkpoint was saved by {world} ranks, not {self.wire.world}"
            rank = self.wire.rank
            paths = {n: store.join(directory, n) for n in part_files(manifest, rank)}
            files = [(mf.NAME, len(raw))]
            small = {mf.NAME: raw}
            covers: Callable[[str], list[Unit] | None] = _uncovered
            if grid is None:
                covers = functools.partial(units, manifest)
            index = grid.index(rank) if grid is not None else None
            if grid is not None and index is not None:  # its index: read, checked, sent whole
                cap = grid.indices[index].size
                data = store.read_small(store.join(directory, index), cap=cap)
                check_index(grid, index, data)
                small[index] = data
                files.append((index, len(data)))
                covers = grid.units(data)
            files += [(n, manifest.files[n].size) for n in paths]
            if grid is None and manifest.has_blobs:
                files += _blob_files(store, directory, manifest, rank, paths)
            digest = checksum.digest(raw)
            part = _Part(store, small, digest, world, files, paths, where.is_local, covers)
            return part, None
        except Exception as exc:  # reported to every rank through the gather
            return None, f"{self.wire.who(self.wire.rank)}: cannot read its part: {exc}"

    def _copy(
        self, step: int, part: _Part, parts: list[Any]
    ) -> tuple[list[tuple[int, str]], list[str]]:
        """Steps 2-5: this rank's copies committed (part, node) and what failed here."""
        wire, node = self.wire, self.folder.node
        targets = ring(wire.nodes, self.replicas)
        short = fewer_copies(wire.nodes, self.replicas)
        if short and wire.rank == 0 and (len(set(wire.nodes)), self.replicas) not in _WARNED:
            _WARNED.add((len(set(wire.nodes)), self.replicas))
            log.warning("%s", short)
        outgoing, incoming = [], []
        landing: dict[int, Landing] = {}
        manifests: dict[int, Callable[[str], Any]] = {}
        message = 0
        need = 0
        for rank, doc in enumerate(parts):
            here = wire.nodes[rank] == node
            for name, size in doc["files"]:
                dsts = targets[rank]
                if rank == wire.rank:
                    send = Outgoing(message, dsts, size, name, _opener(part, name))
                    # (the receivers check a data file against the manifest: no hashing here)
                    send.checked = bool(dsts) and _covered(part, name)
                    outgoing.append(send)
                elif wire.rank in dsts:
                    # (the manifest and an index: against the digests the manifest gives them)
                    expect = doc["small"].get(name)
                    check = _checker(landing, manifests, rank, name)
                    incoming.append(Incoming(message, rank, size, name, None, expect, check=check))
                need += size * (int(here) + sum(wire.nodes[d] == node for d in dsts))
                message += 1
        full = self._make_room(step, need)
        keep = full is None
        own = self.folder.staging() if keep else None
        writers: dict[str, CopyWriter] = {}
        try:
            if own is not None:
                for out in outgoing:
                    if not _linked(part, out.name, os.path.join(own, out.name)):
                        writers[out.name] = w = CopyWriter(os.path.join(own, out.name))
                        out.on_chunk = w.write
            if keep:
                for into in incoming:
                    if into.src not in landing:
                        landing[into.src] = Landing(self.folder.staging())
                    into.into = _lander(landing[into.src], into.name, into.size)
            errors = wire.transfer(outgoing, incoming)
            errors += [i.error for i in incoming if i.error is not None and keep]
            errors += [full] if full is not None else []
            for w in writers.values():
                w.close()
            return self._commit(step, part, parts, own, outgoing, incoming, landing), errors
        finally:
            for w in writers.values():
                w.close()
            for land in landing.values():
                land.close()
                shutil.rmtree(land.folder, ignore_errors=True)  # (committed ones were renamed)
            if own is not None:
                shutil.rmtree(own, ignore_errors=True)

    def _make_room(self, step: int, need: int) -> str | None:
        """Step 3: evict what the budget no longer holds; None if ``need`` more bytes for
        ``step`` fit, else why this node keeps no copy of it. Copies of later steps go first: a
        save of ``step`` means the run went back to an earlier step (a resume), so they belong
        to a timeline the run abandoned and must never be restored."""
        sizes = self.folder.step_bytes()
        abandoned = sorted(s for s in sizes if s > step)
        if abandoned:
            self.folder.evict(abandoned)
            sizes = {s: b for s, b in sizes.items() if s <= step}
            if self.anchor is not None and self.anchor > step:
                self.anchor = None
        gone = evictions(sizes, self.budget, self.anchor, need)
        self.folder.evict(gone)
        left = sum(b for s, b in sizes.items() if s not in gone)
        if self.budget is None or left + need <= self.budget:
            return None
        return (
            f"node {self.folder.node} cannot hold its {need} bytes of this step within its "
            f"budget of {self.budget} bytes (it holds {left} bytes it must keep): it keeps no "
            "copy of it; give the tier a larger budget"
        )

    def _commit(
        self,
        step: int,
        part: _Part,
        parts: list[Any],
        own: str | None,
        outgoing: list[Outgoing],
        incoming: list[Incoming],
        landing: dict[int, Landing],
    ) -> list[tuple[int, str]]:
        """Step 5: commit this rank's own copy and every part received whole."""
        node, rank = self.folder.node, self.wire.rank
        committed: list[tuple[int, str]] = []
        # (the manifest and an index as sent: the digest every rank agreed on, the manifest's)
        sent = all(item.digest == part.expect.get(item.name, item.digest) for item in outgoing)
        if own is not None and sent and all(item.digest is not None for item in outgoing):
            files = {item.name: (item.size, item.digest or "") for item in outgoing}
            self.folder.commit(own, PartRecord(step, rank, part.world, part.digest, files, node))
            committed.append((rank, node))
        by_src: dict[int, list[Incoming]] = {}
        for item in incoming:
            by_src.setdefault(item.src, []).append(item)
        for src, items in by_src.items():
            if src not in landing or any(i.error is not None or i.digest is None for i in items):
                continue
            doc = parts[src]
            files = {i.name: (i.size, i.digest or "") for i in items}
            record = PartRecord(step, src, doc["world"], doc["manifest"], files, node)
            landing[src].close()
            self.folder.commit(landing[src].folder, record)
            committed.append((src, node))
        return committed

    def _outcome(self, step: int, parts: Gathered, done: Gathered) -> Outcome:
        """Step 6 and 7: what every rank agrees happened; eviction once complete."""
        wire = self.wire
        errors = _problems(wire, done, "finish its copies")
        copies: dict[int, list[str]] = {}
        for doc in done.values:
            if doc is None:
                continue
            errors.extend(doc["errors"])
            for part, node in doc["copies"]:
                copies.setdefault(part, []).append(node)
        world = wire.world
        complete = not done.missing and all(copies.get(p) for p in range(world))
        agreed = time.perf_counter()
        if errors:
            wire.reset()  # the connections are not trusted after a failure (every rank knows)
        if complete:
            self.anchor = step
            with contextlib.suppress(OSError):
                self.folder.evict(evictions(self.folder.step_bytes(), self.budget, step))
        return Outcome(step, complete, copies, sorted(set(errors)), agreed=agreed)


def _problems(wire: Wire, gathered: Gathered, what: str) -> list[str]:
    """What a gather says failed: ranks that did not answer, errors they reported."""
    found = [
        f"{wire.who(r)} did not {what} within {wire.timeout:g} s (died, or stopped answering)"
        for r in gathered.missing
    ]
    for doc in gathered.values:
        if isinstance(doc, dict) and doc.get("error"):
            found.append(str(doc["error"]))
    return found


def _blob_files(
    store: Any, directory: str, manifest: mf.Manifest, rank: int, paths: dict[str, str]
) -> list[tuple[str, int]]:
    """The blob files of part ``rank`` of an incremental checkpoint (each blob the manifest
    names goes to one part, in turn, ``blobs/<its path in the store>``) and the store's
    configuration (every part's), their store paths added to ``paths``."""
    from savepoint.blobs import BlobStore

    blob_home(manifest.blob_store)  # (one a copy can hold)
    root = store.abspath(store.join(directory, manifest.blob_store or ""))
    blobs = BlobStore(store, root, create=False)
    digests = sorted({name for recipe in mf.recipes(manifest) for name in recipe.names()})
    wanted = [COMMON[1]] + [
        BLOBS + blobs.path(d)[len(root) + 1 :] for d in digests[rank :: manifest.world_size or 1]
    ]
    found = []
    for name in wanted:
        path = store.join(root, name[len(BLOBS) :])
        info = store.stat(path)
        if info is None:
            raise FileNotFoundError(f"{path}: a blob the checkpoint names is not there")
        paths[name] = path
        found.append((name, info.size))
    return found


def _linked(part: _Part, name: str, target: str) -> bool:
    """Whether this rank's own copy of ``name`` could be a hard link to the committed file (a
    run directory on the same file system as the node's memory, a RAM disk say: no bytes
    copied). A committed file is never written again, only deleted, which a link outlives."""
    if not part.local or name not in part.paths:
        return False
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.link(part.paths[name], target)
    except OSError:
        return False
    return True


def _opener(part: _Part, name: str) -> Any:
    if name in part.small:  # the very bytes read (and checked) above
        return lambda: BytesSource(part.small[name])
    store, path = part.store, part.paths[name]
    return lambda: BlobSource(store, path)


def _covered(part: _Part, name: str) -> bool:
    return name in part.paths and part.units is not None and part.units(name) is not None


def _checker(
    landing: dict[int, Landing], manifests: dict[int, Callable[[str], Any]], src: int, name: str
) -> Any:
    """What a data file from ``src`` is checked against as it arrives: its part's manifest (a
    version 7 one: its part's index, checked against the manifest), received (and checked
    against the digest every rank agreed on) before it."""

    def check() -> Check | None:
        if src not in landing:
            return None  # (this node keeps no copy of this step: nothing to check)
        if src not in manifests:
            manifests[src] = _units_of(landing[src].folder, src)
        found = manifests[src](name)
        return None if found is None else Check(found)

    return check


def _units_of(folder: str, src: int) -> Callable[[str], list[Unit] | None]:
    """The checksummed ranges of part ``src``'s data files, from its copy landed in ``folder``."""
    with open(os.path.join(folder, mf.NAME), "rb") as f:
        raw = f.read(mf.MAX_MANIFEST_BYTES + 1)
    grid = head(raw)
    if grid is None:
        return functools.partial(units, mf.parse(raw, columns=False))
    index = grid.index(src)
    if index is None:
        return _uncovered
    with open(os.path.join(folder, index), "rb") as f:
        data = f.read(mf.MAX_MANIFEST_BYTES + 1)
    check_index(grid, index, data)  # (a damaged index: no file of its part is kept)
    return grid.units(data)


def _uncovered(name: str) -> None:
    """(No data file of a version 7 part without an index is checked on arrival.)"""


def _lander(landing: Landing, name: str, size: int) -> Any:
    return lambda: landing.target(name, size)
