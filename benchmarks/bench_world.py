"""Fleet scale, simulated: the planning and bookkeeping of a sharded save by N ranks, in one process.

Usage::

    .venv/bin/python benchmarks/bench_world.py --ranks N --tensors M [--tp T] [--dcp]
    .venv/bin/python benchmarks/bench_world.py --curve [--tensors M] [--max-ranks 8192] [--svg F]

Runs the real sharded save of ``savepoint.distributed`` for ``--ranks`` simulated ranks
(:mod:`savepoint.distributed.simulate`: every rank's describe and local plan, rank 0's merge,
the manifest and commit; collectives recorded, nothing written but the manifest) on the state of
a DeepSeek-V3-shaped MoE model with about ``--tensors`` tensors (parameters and Adam's moments,
FSDP over every rank; ``--tp`` adds tensor parallelism), and prints, as its last line, one JSON
object:

- ``ranks``, ``tensors``: the world and the state's tensor count;
- ``rank0_plan_s``: rank 0's global planning (the gathered plans decoded, merged, the answers
  encoded); ``rank0_commit_s``: its manifest building and commit;
- ``per_rank_plan_s``: a rank's local planning (flatten, describe, its plan encoded, its answer
  decoded), the median over the ranks (``per_rank_plan_max_s`` the slowest);
  ``per_rank_load_plan_s``: a resharding load's read planning on one rank of half the world
  (version 7: the manifest read lazily, then ``plan.record_reads`` of each piece it restores
  against the pieces its tensor's grid says meet it, the grid arithmetic timed; version 3:
  ``plan.plan_reads`` against every shard of its tensor; before 2026-12-02 night version 7 was
  timed as ``plan_reads`` against every grid box, precomputed untimed);
  ``per_rank_load_read_ops`` the reads it plans, ``per_rank_load_indexes`` the index files
  they need (version 7: the writers of the pieces read, the only indexes the load reads; it read
  all N before);
- ``manifest_bytes``: the committed manifest; ``rank0_recv_bytes`` / ``rank0_messages``: what
  rank 0's gloo operations receive over the whole save (padded as the real path pads);
- the states are regular (DTensor-like Shards carrying their grid): planned from the layout,
  manifest version 7 (``docs/distributed.md``, "Regular layouts"); ``--by-offsets`` saves the
  same state as Shards given by offsets alone, planned piece by piece (the merge, version 3);
- over ``--max-items`` (``ranks x tensors``, default 4,000,000: more pieces than one process
  can simulate rank by rank), a regular state is measured by :func:`run_sampled`: the real
  planning of ``--sample`` ranks (plus ranks 0, 1, N/2, N-1), rank 0's whole share of the plan
  step on N messages, the real version 7 manifest of N ranks (``rank0_commit_s`` its building
  and serialising), what rank 0 receives in both steps (``plan_step_rank0_recv_bytes``,
  ``write_step_rank0_recv_bytes``); ``per_rank_flatten_s`` (the flatten every save does) is
  not in ``per_rank_plan_s``, ``per_rank_describe_s`` (the walk over the state) is;
  ``per_rank_tree_walk_s`` is a floor: a bare recursive visit of every node of the flattened
  tree, doing nothing (what any planning that reads the state's description in Python pays);
  ``repeat_plan_s`` is the slowest sampled rank's plan step of the next save of the same state
  (a new flatten, then the description kept from the first save reused: not timed, as the
  flatten above) plus rank 0's share of that save (``repeat_rank0_plan_s``: every message
  decoded, the global plan kept from the first save reused), ``repeat_per_rank_plan_s`` the
  median rank's. ``--by-offsets`` (or
  ``--extrapolate``) instead measures the three largest worlds that fit and extrapolates by a
  power law in the ranks (``extrapolated``: true, the fits and the measurements included);
- with ``--dcp``, ``dcp_plan_s``: the same inputs through DCP's own planner
  (``WriteItem``s as ``create_local_plan`` makes them for each rank's DTensors, then
  ``DefaultSavePlanner.create_global_plan``: dedup, metadata, validation), timed on rank 0's
  side, ``dcp_local_plan_s`` a rank's side. When the world is too big for memory
  (``ranks x tensors`` over ``--max-items``) DCP is measured at halved worlds it can run and
  extrapolated by a power law fitted to them (``dcp_extrapolated``: the curve is printed);
  ``dcp_local_plan_s`` excludes making the state. ``--dcp-local`` measures that rank side
  alone (three ranks, the median: no global plan, so any world size), to set beside
  ``per_rank_flatten_s`` + ``per_rank_plan_s``: DCP's walk of the state is in its figure.

``--curve`` prints planning time, manifest size and rank-0 bytes for 8, 16, ... ``--max-ranks``
ranks at ``--tensors`` (sizes over ``--max-items`` are skipped) as a markdown table, and with
``--svg`` writes the plot (by hand: no matplotlib needed) for ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from savepoint.distributed import simulate

DEFAULT_MAX_ITEMS = 4_000_000  # ranks x tensors a run may hold in memory here


def state_fn(tensors: int, tp: int, regular: bool = True) -> Any:
    def state(rank: int, world: int) -> Any:
        return simulate.model_state(rank, world, tensors, tp=tp, regular=regular)

    return state


def run_sim(ranks: int, tensors: int, tp: int = 1, regular: bool = True) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix="sp-world-")
    path = os.path.join(workdir, "ckpt")
    try:
        t0 = time.perf_counter()
        again = os.path.join(workdir, "ckpt2")
        result = simulate.simulate_save(ranks, state_fn(tensors, tp, regular), path, paths=[again])
        wall = time.perf_counter() - t0
        failed = [r for r in result.results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        manifest_bytes = os.path.getsize(os.path.join(path, "manifest.json"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    load_s, load_ops, load_indexes = load_plan(result.manifests[0], ranks, tensors, tp)
    per_rank = result.per_rank_plan_s(0)
    repeat = result.save_traffic(1)
    return {
        "ranks": ranks,
        "tensors": tensors,
        "regular": regular,
        "state_tensors": len(result.manifests[0].tensors),
        "rank0_plan_s": round(result.rank0_plan_s(0), 4),
        "rank0_commit_s": round(result.share(0, "save: write", ("combine",), 0), 4),
        "per_rank_plan_s": round(statistics.median(per_rank), 4),
        "per_rank_plan_max_s": round(max(per_rank), 4),
        "manifest_bytes": manifest_bytes,
        "rank0_recv_bytes": result.save_traffic(0).received(0),
        "rank0_messages": result.save_traffic(0).messages(0),
        "critical_plan_s": round(result.critical_plan_s(0), 4),
        "repeat_plan_s": round(result.critical_plan_s(1), 4),
        "repeat_typical_plan_s": round(
            statistics.median(result.per_rank_plan_s(1)[1:] or [0.0]) + result.rank0_plan_s(1), 4
        ),
        "repeat_rank0_plan_s": round(result.rank0_plan_s(1), 4),
        "repeat_per_rank_plan_s": round(statistics.median(result.per_rank_plan_s(1)), 4),
        "repeat_plan_step_rank0_recv_bytes": sum(op.recv for op in repeat.ops[0][:4]),
        "per_rank_load_plan_s": round(load_s, 4),
        "per_rank_load_read_ops": load_ops,
        "per_rank_load_indexes": load_indexes,
        "wall_s": round(wall, 2),
    }


def load_plan(manifest: Any, ranks: int, tensors: int, tp: int) -> tuple[float, int, int]:
    """A resharding load's read planning on one rank (rank 1 of half the world, or rank 0 of
    one): the reads of every piece it restores, and the index files they need.

    Version 7: the manifest read as a sharded load reads it (``parse(lazy=True)``: no index
    read), then ``plan.record_reads`` of each piece against the pieces its grid says meet it,
    as the load plans (timed: the manifest's grid arithmetic included); the index files are
    those of the writers of the pieces read. Version 3: ``plan.plan_reads`` against every
    shard of the tensor (the index count is 0: none exist)."""
    from savepoint.codecs import boxes
    from savepoint.codecs import manifest as mf
    from savepoint.distributed import plan, save

    world = max(1, ranks // 2)
    rank = 1 if world > 1 else 0
    mine, _ = save.describe(save.flatten(simulate.model_state(rank, world, tensors, tp=tp)), "")
    ops = 0
    writers: set[int] = set()
    if manifest.grids is not None:  # version 7: the pieces are in the (unwritten) indexes

        def no_index(name: str, size: int) -> bytes:
            raise FileNotFoundError(name)  # none written; planning must not need one

        lazy = mf.parse(mf.dumps(manifest), read_index=no_index, lazy=True)
        t0 = time.perf_counter()
        for item in mine.items:
            record = lazy.tensors[item.key]
            found = plan.record_reads(record, item.region)
            ops += len(found)
            pieces = record.layout()
            writers.update(pieces.writer(op.shard) for op in found)
        return time.perf_counter() - t0, ops, len(writers)
    t0 = time.perf_counter()
    for item in mine.items:
        record = manifest.tensors[item.key]
        shards = [s.region for s in record.shards] or [boxes.full(record.shape)]
        ops += len(plan.plan_reads(record.shape, shards, item.region))
    return time.perf_counter() - t0, ops, 0


# ---------------------------------------------------------------------------------------------
# regular states at fleet scale: a sample of ranks, rank 0's whole share
# ---------------------------------------------------------------------------------------------


def sample_ranks(ranks: int, sample: int) -> list[int]:
    import random

    picked = {0, 1 % ranks, ranks // 2, ranks - 1}
    picked |= set(random.Random(0).sample(range(ranks), min(ranks, sample)))
    return sorted(picked)


def run_sampled(ranks: int, tensors: int, tp: int = 1, sample: int = 8) -> dict[str, Any]:
    """A regular state's save planned for ``ranks`` ranks without simulating each: the real
    per-rank planning (``SaveRun.plan_local``: describe, layout, digest, the pieces the layout
    gives it, its message encoded) on a sample of ranks, and rank 0's whole share (every rank's
    message decoded, ``plan_global``, the answer encoded) on ``ranks`` messages: the sampled
    ones as they were, the others as a rank at that coordinate sends them (the layout's digest,
    its coordinate, the sampled ranks' median byte count). The write step's records and the
    manifest come from the sampled ranks' records (see ``commit_share``)."""
    import gc

    was = gc.isenabled()
    gc.disable()  # as simulate_save: collections of the big states are no rank's planning
    try:
        return _sampled(ranks, tensors, tp, sample)
    finally:
        if was:
            gc.enable()


def _sampled(ranks: int, tensors: int, tp: int, sample: int) -> dict[str, Any]:
    import pickle
    import types

    from savepoint.distributed import collectives, layout, save
    from savepoint.distributed.traffic import Traffic
    from savepoint.options import SaveOptions
    from savepoint.storage.paths import resolve

    workdir = tempfile.mkdtemp(prefix="sp-world-")
    location = resolve(os.path.join(workdir, "ckpt"), what="checkpoint path")
    picks = sample_ranks(ranks, sample)
    payloads: dict[int, bytes] = {}
    per_rank, flatten_s, describe_s, walk_s, records = [], [], [], [], {}
    repeat_s = []  # each sampled rank's plan step of the next save of the same state
    run0: Any = None
    keyed0: Any = None
    repeat_payloads: dict[int, bytes] = {}
    options = SaveOptions()
    for r in picks:
        state = simulate.model_state(r, ranks, tensors, tp=tp)
        t0 = time.perf_counter()
        flat = save.flatten(state)
        flatten_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        bare_walk(flat.tree)
        walk_s.append(time.perf_counter() - t0)
        coord = types.SimpleNamespace(rank=r, world_size=ranks, memo_key=None)
        t0 = time.perf_counter()
        save.describe_layout(flat, "")  # its share of the planning below, timed alone
        describe_s.append(time.perf_counter() - t0)
        run = save.SaveRun(location, coord, lambda flat=flat: (flat, {}), None, None)
        t0 = time.perf_counter()
        sent = run.plan_local()
        payloads[r] = collectives.encoded(sent)
        per_rank.append(time.perf_counter() - t0)
        assert run.regular is not None, "not a regular state"
        items = run.regular[2]
        records[r] = simulate.SimWriter().write(location, "", r, items, run.sources, options)
        if r == 0:
            run0 = run
        # The next save of the same state by a rank of a process group: its description is
        # kept per group and rank (describe.describe_layout's memo_key) and reused.
        key = ("bench", r)
        coord_k = types.SimpleNamespace(rank=r, world_size=ranks, memo_key=key)
        first = save.SaveRun(location, coord_k, lambda flat=flat: (flat, {}), None, None)
        first.plan_local()
        first.take(("", save.OWN, ""))  # rank 0 accepted its description (a marker next time)
        again = save.flatten(state)  # (a new flatten: what the next save does first)
        rerun = save.SaveRun(location, coord_k, lambda again=again: (again, {}), None, None)
        t0 = time.perf_counter()
        repeat_sent = rerun.plan_local()
        repeat_payloads[r] = collectives.encoded(repeat_sent)
        repeat_s.append(time.perf_counter() - t0)
        if r == 0:  # rank 0's share of both saves is timed below, on every rank's message
            keyed0 = (first, rerun, key)
        else:
            save.forget(key)
        del state, flat, again
    lay, _, _ = run0.regular
    median_bytes = int(statistics.median(pickle.loads(p)[0].nbytes for p in payloads.values()))
    path = run0.local[0].path
    for r in range(ranks):
        if r not in payloads:
            coord_r = tuple(simulate._Mesh((ranks // tp, tp), r).coordinate)
            payloads[r] = collectives.encoded(
                (layout.Compact(lay.digest, coord_r, median_bytes), None, None, path)
            )
    ordered = [payloads[r] for r in range(ranks)]
    t0 = time.perf_counter()
    sent_all = [pickle.loads(p) for p in ordered]
    answers = run0.plan_global(sent_all)
    answer = collectives.encoded(answers[0])  # the same answer for every rank: encoded once
    rank0_plan = time.perf_counter() - t0
    assert answers[0] != "resend", "rank 0 did not accept the compact plans"
    # The repeated save on rank 0: the first keyed save's share (untimed: it keeps what the next
    # reuses), then the next one's, on the same messages (a repeat sends what the first sent).
    first0, rerun0, key0 = keyed0
    try:
        first0.plan_global([pickle.loads(p) for p in ordered])
        first0.abort()
        marker = pickle.loads(repeat_payloads[0])
        assert marker[0] is None and marker[2].startswith(save.GRID), "no marker was sent"
        again_ordered = [repeat_payloads.get(r) or repeat_payloads[0] for r in range(ranks)]
        t0 = time.perf_counter()
        again_all = [pickle.loads(p) for p in again_ordered]
        again_answers = rerun0.plan_global(again_all)
        assert again_answers[0][1] == save.OWN, again_answers[0]
        collectives.encoded(again_answers[0])
        rank0_repeat = time.perf_counter() - t0
        rerun0.abort()
    finally:
        save.forget(key0)
    traffic = Traffic(ranks)
    traffic.gather([len(p) for p in ordered])
    traffic.scatter([len(answer)] * ranks)
    plan_recv = traffic.received(0)
    repeat_recv = sum(len(repeat_payloads.get(r) or repeat_payloads[0]) for r in range(ranks))
    try:
        commit = commit_share(run0, records, ranks)
    finally:
        run0.abort()
        shutil.rmtree(workdir, ignore_errors=True)
    row = {
        "ranks": ranks,
        "tensors": tensors,
        "regular": True,
        "sampled_ranks": len(picks),
        "state_tensors": len(lay.keys),
        "rank0_plan_s": round(rank0_plan, 4),
        "per_rank_plan_s": round(statistics.median(per_rank), 4),
        "per_rank_plan_max_s": round(max(per_rank), 4),
        "per_rank_flatten_s": round(statistics.median(flatten_s), 4),
        "per_rank_describe_s": round(statistics.median(describe_s), 4),
        "per_rank_tree_walk_s": round(statistics.median(walk_s), 4),
        "repeat_plan_s": round(max(repeat_s) + rank0_repeat, 4),
        "repeat_rank0_plan_s": round(rank0_repeat, 4),
        "repeat_per_rank_plan_s": round(statistics.median(repeat_s), 4),
        "plan_step_rank0_recv_bytes": plan_recv,
        "repeat_plan_step_rank0_recv_bytes": repeat_recv,
    }
    row.update(commit)
    row["rank0_recv_bytes"] = plan_recv + commit["write_step_rank0_recv_bytes"]
    return row


def bare_walk(node: Any) -> int:
    """Every node of a flattened tree visited, nothing done: the floor of any per-rank planning
    that reads the state's description in Python (``per_rank_tree_walk_s``)."""
    items = node.get("items")
    if items is None:
        inner = node.get("state")
        return 1 if inner is None else 1 + bare_walk(inner)
    if node["t"] == "dict":
        return 1 + sum(bare_walk(child) for _, child in items)
    return 1 + sum(bare_walk(child) for child in items)


def commit_share(run0: Any, records: dict[int, Any], ranks: int) -> dict[str, Any]:
    """The write step as rank 0 sees it (manifest version 7): every rank's data files and index
    record gathered (padded to the longest: here the longest sampled), the manifest built and
    serialised (timed: ``rank0_commit_s``). The sampled ranks' index records are real (their
    pieces' records as ``SimWriter`` makes them, sealed as ``seal_index`` seals them, timed:
    ``per_rank_index_s``); the others' are a sampled rank's, renamed for their rank."""
    from savepoint.codecs import manifest as mf
    from savepoint.distributed import collectives, manifests, pieces
    from savepoint.distributed.traffic import Traffic

    sealed, index_s = {}, []
    for r, rec in records.items():
        t0 = time.perf_counter()
        sealed[r] = pieces.seal_index(None, "", r, rec, write=False)
        index_s.append(time.perf_counter() - t0)
    sample = sealed[max(sealed, key=lambda r: sealed[r][2].size)]
    results = []
    for r in range(ranks):
        if r in sealed:
            results.append(sealed[r])
            continue
        files = {pieces.file_name(r, i): f for i, f in enumerate(sample[0].values())}
        results.append((files, mf.index_name(r), sample[2]))
    sizes = [len(collectives.encoded(res)) for res in results]
    traffic = Traffic(ranks)
    traffic.gather(sizes)
    lay = run0.regular[0]
    t0 = time.perf_counter()
    manifest = manifests.grid_manifest(run0.plan, lay, results, {})
    raw = mf.dumps(manifest)
    commit_s = time.perf_counter() - t0
    return {
        "rank0_commit_s": round(commit_s, 4),
        "write_step_rank0_recv_bytes": traffic.received(0),
        "manifest_bytes": len(raw),
        "manifest_version": manifest.format_version,
        "per_rank_index_s": round(statistics.median(index_s), 4),
        "index_bytes_max": max(s[2].size for s in sealed.values()),
    }


# ---------------------------------------------------------------------------------------------
# DCP on the same inputs
# ---------------------------------------------------------------------------------------------


def dcp_local_plan(rank: int, world: int, tensors: int, tp: int) -> Any:
    """Rank ``rank``'s SavePlan as DefaultSavePlanner.create_local_plan makes it for its
    DTensors (``_create_write_items_for_dtensor``: one SHARD WriteItem per DTensor, from its
    local shape and offsets) and its plain values (the coordinator's)."""
    return dcp_plan_of(simulate.model_state(rank, world, tensors, tp=tp))


def dcp_plan_of(state: Any) -> Any:
    """:func:`dcp_local_plan` of a state already made (what is timed as DCP's rank side)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    from savepoint.distributed import shard

    items = []
    flat: dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            flat[prefix] = obj

    walk(state, "")
    for fqn, obj in flat.items():
        if isinstance(obj, shard.Shard):
            offsets = torch.Size(obj.offsets)
            sizes = torch.Size(obj.local.shape)
            size = torch.Size(obj.global_shape)
            kind = WriteItemType.SHARD
        elif hasattr(obj, "shape"):
            offsets, sizes = torch.Size([0] * obj.ndim), torch.Size(obj.shape)
            size, kind = sizes, WriteItemType.TENSOR
        else:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            continue
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=kind,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties(dtype=torch.float32),
                    size=size,
                ),
            )
        )
    return SavePlan(items)


def run_dcp(ranks: int, tensors: int, tp: int = 1) -> dict[str, float]:
    import pickle

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    plans = []
    local_times = []
    for r in range(ranks):
        state = simulate.model_state(r, ranks, tensors, tp=tp)
        t0 = time.perf_counter()  # the rank's side: its state walked, its plan pickled
        p = dcp_plan_of(state)
        data = pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)  # gathered as objects
        local_times.append(time.perf_counter() - t0)
        plans.append(data)
        del state
    planner = DefaultSavePlanner(flatten_state_dict=False)
    t0 = time.perf_counter()
    gathered = [pickle.loads(d) for d in plans]
    planner.create_global_plan(gathered)
    return {
        "dcp_plan_s": round(time.perf_counter() - t0, 4),
        "dcp_local_plan_s": round(statistics.median(local_times), 4),
        "dcp_recv_bytes": sum(len(d) for d in plans),
    }


def dcp_local_at(ranks: int, tensors: int, tp: int, sample: int = 3) -> dict[str, Any]:
    """DCP's rank side alone (``--dcp-local``): :func:`dcp_plan_of` and its pickling on
    ``sample`` ranks of ``ranks``, the median; cheap at any world (no global plan)."""
    import gc
    import pickle

    times = []
    for r in sample_ranks(ranks, sample)[:sample]:
        state = simulate.model_state(r, ranks, tensors, tp=tp)
        was = gc.isenabled()
        gc.disable()  # as run_sampled times savepoint's side
        try:
            t0 = time.perf_counter()
            pickle.dumps(dcp_plan_of(state), protocol=pickle.HIGHEST_PROTOCOL)
            times.append(time.perf_counter() - t0)
        finally:
            if was:
                gc.enable()
        del state
    return {"dcp_local_plan_s": round(statistics.median(times), 4)}


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of y = a * x**b, least squares in log space."""
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(max(y, 1e-9)) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(
        sum((x - mx) ** 2 for x in xs), 1e-12
    )
    return math.exp(my - b * mx), b


SCALED = (
    "rank0_plan_s",
    "rank0_commit_s",
    "per_rank_plan_s",
    "manifest_bytes",
    "rank0_recv_bytes",
    "critical_plan_s",
    "repeat_plan_s",
    "per_rank_load_plan_s",
)


def sim_extrapolated(
    ranks: int, tensors: int, tp: int, max_items: int, regular: bool = True
) -> dict[str, Any]:
    """Over ``max_items`` (a per-piece plan and manifest too big for this process): measured at
    the three largest worlds (halving) that fit, each figure extrapolated to ``ranks`` by a
    power law fitted to them; the measurements go to stderr and into ``measured``."""
    r = ranks
    while r * tensors > max_items and r > 8:
        r //= 2
    rows = []
    for size in sorted({max(8, r // 4), max(8, r // 2), r}):
        got = run_sim(size, tensors, tp, regular)
        print(f"measured at {size} ranks: {json.dumps(got)}", file=sys.stderr, flush=True)
        rows.append(got)
    out: dict[str, Any] = {"ranks": ranks, "tensors": tensors, "extrapolated": True}
    for key in SCALED:
        a, b = fit([(float(row["ranks"]), float(row[key])) for row in rows])
        value = a * ranks**b
        out[key] = int(value) if key.endswith("bytes") else round(value, 3)
        out[key + "_fit"] = f"{a:.3g} * ranks^{b:.2f}"
    out["measured"] = rows
    return out


def dcp_at(ranks: int, tensors: int, tp: int, max_items: int) -> dict[str, Any]:
    if ranks * tensors <= max_items:
        return run_dcp(ranks, tensors, tp)
    points = []
    r = ranks
    while r * tensors > max_items and r > 8:
        r //= 2
    for size in sorted({max(8, r // 4), max(8, r // 2), r}):
        got = run_dcp(size, tensors, tp)
        print(f"dcp at {size} ranks x {tensors} tensors: {got}", file=sys.stderr)
        points.append((float(size), got["dcp_plan_s"]))
    a, b = fit(points)
    return {
        "dcp_plan_s": round(a * ranks**b, 2),
        "dcp_extrapolated": True,
        "dcp_curve": [[int(x), y] for x, y in points],
        "dcp_fit": f"{a:.3g} * ranks^{b:.2f}",
    }


# ---------------------------------------------------------------------------------------------
# curve and plot
# ---------------------------------------------------------------------------------------------


def svg(rows: list[dict[str, Any]], path: str) -> None:
    """Three log-log panels (planning time, manifest MiB, rank-0 MiB) against ranks."""
    series = [
        ("rank-0 planning (s)", "rank0_plan_s"),
        ("per-rank planning (s)", "per_rank_plan_s"),
        ("manifest (MiB)", "manifest_bytes"),
        ("rank-0 received (MiB)", "rank0_recv_bytes"),
    ]
    w, h, pad = 260, 200, 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(series)}" height="{h + 30}">']
    xs = [math.log2(r["ranks"]) for r in rows]
    for i, (title, key) in enumerate(series):
        ox = i * w
        vals = [r[key] / (1 << 20) if "bytes" in key else r[key] for r in rows]
        ys = [math.log10(max(v, 1e-6)) for v in vals]
        x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

        def px(x: float, x0: float = x0, x1: float = x1, ox: int = ox) -> float:
            return ox + pad + (x - x0) / (x1 - x0) * (w - 2 * pad)

        def py(y: float, y0: float = y0, y1: float = y1) -> float:
            return 20 + (h - pad) - (y - y0) / (y1 - y0) * (h - pad - 20)

        out.append(f'<text x="{ox + pad}" y="14" font-size="12">{title}</text>')
        out.append(
            f'<line x1="{ox + pad}" y1="{h - 20}" x2="{ox + w - pad}" y2="{h - 20}" stroke="#888"/>'
        )
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
        out.append(f'<polyline points="{pts}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
        for x, y, v, r in zip(xs, ys, vals, rows):
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="#1f77b4"/>')
            out.append(f'<text x="{px(x) - 8:.1f}" y="{h - 5}" font-size="9">{r["ranks"]}</text>')
            out.append(
                f'<text x="{px(x) + 4:.1f}" y="{py(y) - 4:.1f}" font-size="9">{v:.3g}</text>'
            )
    out.append(
        f'<text x="10" y="{h + 25}" font-size="11">ranks (log scale); values log scale</text>'
    )
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def curve(tensors: int, max_ranks: int, tp: int, max_items: int, svg_path: str | None) -> None:
    rows = []
    ranks = 8
    print("| ranks | tensors | rank-0 plan s | per-rank plan s | manifest MiB | rank-0 recv MiB |")
    print("|---:|---:|---:|---:|---:|---:|")
    while ranks <= max_ranks:
        if ranks * tensors > max_items:
            print(f"| {ranks} | {tensors} | (over --max-items) | | | |")
        else:
            row = run_sim(ranks, tensors, tp)
            rows.append(row)
            print(
                f"| {ranks} | {row['tensors']} | {row['rank0_plan_s']:.3f} | "
                f"{row['per_rank_plan_s']:.4f} | {row['manifest_bytes'] / (1 << 20):.2f} | "
                f"{row['rank0_recv_bytes'] / (1 << 20):.2f} |",
                flush=True,
            )
        ranks *= 2
    if svg_path and len(rows) > 1:
        svg(rows, svg_path)
        print(f"wrote {svg_path}")
    print(json.dumps({"curve": rows}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dcp", action="store_true")
    ap.add_argument(
        "--dcp-local",
        action="store_true",
        help="DCP's rank side alone (its local plan of the same state, pickled): any world",
    )
    ap.add_argument("--curve", action="store_true")
    ap.add_argument("--max-ranks", type=int, default=8192)
    ap.add_argument("--max-items", type=int, default=DEFAULT_MAX_ITEMS)
    ap.add_argument("--svg", default=None)
    ap.add_argument(
        "--sample",
        type=int,
        default=8,
        help="over --max-items: the ranks whose planning is measured (rank 0's share is whole)",
    )
    ap.add_argument(
        "--by-offsets",
        action="store_true",
        help="Shards without their grid: planned piece by piece (the merge), as before",
    )
    ap.add_argument(
        "--extrapolate",
        action="store_true",
        help="over --max-items: simulate smaller worlds and extrapolate (default for --by-offsets)",
    )
    args = ap.parse_args()
    if args.curve:
        curve(args.tensors, args.max_ranks, args.tp, args.max_items, args.svg)
        return
    regular = not args.by_offsets
    if args.ranks * args.tensors <= args.max_items:
        row = run_sim(args.ranks, args.tensors, args.tp, regular)
    elif regular and not args.extrapolate:
        row = run_sampled(args.ranks, args.tensors, args.tp, args.sample)
    else:
        row = sim_extrapolated(args.ranks, args.tensors, args.tp, args.max_items, regular)
    if args.dcp:
        row.update(dcp_at(args.ranks, args.tensors, args.tp, args.max_items))
    if args.dcp_local and "dcp_local_plan_s" not in row:
        row.update(dcp_local_at(args.ranks, args.tensors, args.tp))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
