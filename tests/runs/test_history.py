"""Issue 16: the run's history log, the small report, and the background step of a save.

- the log is crash-safe: a torn last record (a kill in the middle of an append, simulated by
  cutting the log at every byte offset of its last record) is ignored by every reader and cut
  off by the next writing open, never a corrupt run;
- a version 1 ``report.json`` (the whole history inline, ``golden/report_v1``, written by the
  tree before the log) is read as it is and migrated by the first report a writer writes;
- object stores: segments put create-only, compacted, read in order, a compaction cut short;
- a save costs the same bookkeeping after many logged steps as after none, in fsyncs and bytes;
- the background step: verification before any pruning, its failure raised by the next save,
  ``wait()`` or ``close()`` and recorded, and a checkpoint that failed never kept in a good
  one's place.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
import savepoint.checkpoint
from savepoint.cli import main
from savepoint.runs import history, layout
from savepoint.runs.gc import collect
from savepoint.runs.report import load_report, read_report
from savepoint.storage.faults import FaultyStore
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location

from ._util import full_report, read, read_log, state

GOLDEN = Path(__file__).with_name("golden") / "report_v1"
# What golden/report_v1/report.json holds (written by the tree before issue 16).
GOLDEN_LOSS = [
    (1, 10.0),
    (2, 5.0),
    (3, 10.0 / 3),
    (4, 2.5),
    (5, 0.2),
    (6, float("nan")),
    (7, 1.0 / 7),
    (8, 0.125),
]
GOLDEN_METRICS = {
    1: {"lr": 0.1},
    2: {"lr": 0.1, "val": 0.2},
    3: {"lr": 0.1},
    4: {"lr": 0.1, "val": 0.0},
    7: {"val": 0.05, "acc": 0.5},
}


def same_loss(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a == b or (np.isnan(a) and np.isnan(b)), (a, b)


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def write_run(run: Path, steps: int = 6) -> None:
    """A run whose log ends with a batch of several records (the close after the last save)."""
    with sp.CheckpointManager(run, keep_last=2, best_metric="val") as m:
        for step in range(1, steps + 1):
            m.log(step, loss=1.0 / step, lr=0.01 * step)
            if step % 2 == 0:
                m.save(step, state(step), {"val": 1.0 / step})
        m.log(steps + 1, loss=0.5)
        m.log(steps + 2, loss=0.25, note="last")


# -- crash safety of the log ------------------------------------------------------------------------


def test_a_torn_last_record_is_ignored_by_readers_and_cut_by_the_next_writer(
    tmp_path: Path,
) -> None:
    """The log is cut at every byte offset inside its last record (a kill in the middle of the
    append that wrote it): readers see the history without that record, never an error; the
    next writing open cuts the torn bytes off, and what it appends is read back whole."""
    base = tmp_path / "base"
    write_run(base)
    data = (base / history.HISTORY_FILE).read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1  # where the last record begins
    assert json.loads(data[start:]) == {"step": 8, "loss": 0.25, "metrics": {"note": "last"}}
    whole = full_report(base)
    assert whole["loss_history"][-1] == [8, 0.25]
    without = dict(whole, loss_history=whole["loss_history"][:-1])
    without["metric_history"] = {k: v for k, v in whole["metric_history"].items() if k != "8"}
    for cut in range(start, len(data)):
        run = tmp_path / f"cut-{cut}"
        shutil.copytree(base, run)
        with open(run / history.HISTORY_FILE, "r+b") as f:
            f.truncate(cut)
        # Readers: report, view, CLI, read-only manager.
        assert full_report(run) == without, cut
        with sp.open_run(run) as view:
            assert view.report is not None and view.report.to_json() == without
            assert view.problems() == []
        code, out = cli("report", str(run), "--json")
        assert code == 0 and json.loads(out)["loss_history"] == without["loss_history"], cut
        reader = sp.CheckpointManager(run, read_only=True)
        assert reader.report.loss_history[-1] == (7, 0.5)
        reader.close()
        assert len((run / history.HISTORY_FILE).read_bytes()) == cut  # readers write nothing
        # The next writer cuts the torn bytes off at its open, then appends whole records.
        with sp.CheckpointManager(run, keep_last=2, best_metric="val") as m:
            assert (run / history.HISTORY_FILE).read_bytes() == data[:start]
            m.log(9, loss=0.125)
        assert read_log(run)[-1] == {"step": 9, "loss": 0.125}
        after = full_report(run)
        assert after["loss_history"] == [*without["loss_history"], [9, 0.125]], cut
        assert after["metric_history"] == without["metric_history"], cut
        shutil.rmtree(run)


def test_a_torn_record_left_after_an_open_is_cut_before_appending(tmp_path: Path) -> None:
    """A writer that finds the log torn after its open (it cannot happen with one writer, but
    the file is not trusted) cuts the tail before appending, so no record is ever glued to a
    fragment."""
    run = tmp_path / "run"
    m = sp.CheckpointManager(run)
    m.log(1, loss=1.0)
    m.save(1, state(1))
    with open(run / history.HISTORY_FILE, "ab") as f:
        f.write(b'{"step": 2, "lo')
    m.log(2, loss=0.5)
    m.close()
    assert read_log(run) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]


@pytest.mark.parametrize(
    ("line", "what"),
    [
        (b"not json\n", "not JSON"),
        (b"[1, 2]\n", "not a JSON object"),
        (b'{"loss": 1.0}\n', "without a valid step"),
        (b'{"step": -1, "loss": 1.0}\n', "without a valid step"),
        (b'{"step": 3, "loss": "low"}\n', "not a number"),
        (b'{"step": 3, "metrics": [1]}\n', "not a JSON object"),
        (b'{"resumed_from": true}\n', "resume marker"),
        (b"[" * 100_000 + b"\n", "not JSON"),
    ],
)
def test_a_damaged_complete_record_is_corrupt_naming_the_line(
    tmp_path: Path, line: bytes, what: str
) -> None:
    """Damage that no kill can cause (a complete line that is not a record) is
    CorruptCheckpointError naming the log, the record and the way out; the checkpoints still
    load."""
    run = tmp_path / "run"
    write_run(run)
    with open(run / history.HISTORY_FILE, "ab") as f:
        f.write(line)
    with pytest.raises(sp.CorruptCheckpointError) as info:
        load_report(run)
    message = str(info.value)
    assert history.HISTORY_FILE in message and what in message and "checkpoints" in message
    assert load_report(run, history=False) is not None  # the report alone still reads
    with pytest.raises(sp.CorruptCheckpointError):
        sp.open_run(run)  # as for a damaged report.json: the message says what to do
    same_state(sp.load(layout.step_path(str(run), 6)), state(6))


def test_lines_of_nul_bytes_are_skipped(tmp_path: Path) -> None:
    """A crash can leave zeroes where a filesystem had allocated but not written the tail."""
    run = tmp_path / "run"
    write_run(run)
    before = full_report(run)
    with open(run / history.HISTORY_FILE, "ab") as f:
        f.write(b"\x00" * 100 + b"\n" + b"\x00" * 50)
    assert full_report(run) == before


def test_a_failed_first_save_leaves_no_log_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log a save creates goes with the save when it is undone (the inode and pages it took
    are given back), and its records come back when the run is written next."""
    from savepoint.runs import books as books_module

    run = tmp_path / "run"
    real = books_module.stage_json
    failures = [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run / "report.json"))]

    def stage_json(path: Any, doc: Any) -> Any:  # (a save stages its report)
        if failures and str(path).endswith("report.json"):
            raise failures.pop()
        return real(path, doc)

    monkeypatch.setattr(books_module, "stage_json", stage_json)
    m = sp.CheckpointManager(run)
    m.log(1, loss=2.0)
    with pytest.raises(sp.CheckpointWriteError) as info:
        m.save(1, state(1), {"val": 0.5})
    assert info.value.errno == errno.ENOSPC
    assert not (run / history.HISTORY_FILE).exists()
    assert layout.committed_steps(str(run)) == []
    m.close()
    assert read_log(run) == [{"step": 1, "loss": 2.0}]
    assert full_report(run)["metric_history"] == {}


# -- old runs ---------------------------------------------------------------------------------------


@pytest.fixture
def old_run(tmp_path: Path) -> Path:
    run = tmp_path / "report_v1"
    shutil.copytree(GOLDEN, run)
    assert read(run / "report.json")["version"] == 1
    assert not (run / history.HISTORY_FILE).exists()
    return run


def test_an_old_report_is_read_as_it_is(old_run: Path) -> None:
    report, version = read_report(old_run)
    assert version == 1 and report is not None
    same_loss(report.loss_history, GOLDEN_LOSS)
    assert report.metric_history == GOLDEN_METRICS
    assert report.checkpoints == [7, 6, 4] and report.best is not None and report.best["step"] == 4
    assert [c["changes"] for c in report.config_changes] == [
        [{"key": "lr", "old": 0.1, "new": 0.05}]
    ]
    with sp.open_run(old_run) as view:
        assert view.report is not None
        same_loss(view.report.loss_history, GOLDEN_LOSS)
        assert view.steps() == [4, 6, 7] and view.best_step() == 4
        assert view.problems() == []
    code, out = cli("report", str(old_run), "--json")
    assert code == 0
    doc = json.loads(out)
    assert [s for s, _ in doc["loss_history"]] == [s for s, _ in GOLDEN_LOSS]
    assert cli("verify", str(old_run))[0] == 0
    rows = sp.Sweep(old_run.parent, metric="val").compare()
    assert rows[0]["final_loss"] == 0.125 and rows[0]["best_step"] == 4
    # Reading (and restoring without resuming) writes nothing: no migration, no log.
    before = (old_run / "report.json").read_bytes()
    with sp.CheckpointManager(old_run) as m:
        same_loss(m.report.loss_history, GOLDEN_LOSS)
        assert m.restore(blank_small(), resume=False) == 7
    assert (old_run / "report.json").read_bytes() == before
    assert not (old_run / history.HISTORY_FILE).exists()


def blank_small() -> dict[str, Any]:
    return {"w": np.zeros((4, 3), np.float32), "step": -1}


def test_an_old_run_is_migrated_by_its_next_writer(old_run: Path) -> None:
    with sp.CheckpointManager(old_run, keep_last=2, best_metric="val") as m:
        assert m.restore(blank_small(), step=6) == 6  # resume: history after 6 is forgotten
        m.log(7, loss=0.75)
        m.save(7, {"w": np.full((4, 3), 70, np.float32), "step": 7}, {"val": 0.01})
        assert (old_run / history.HISTORY_FILE).exists()
        doc = read(old_run / "report.json")
        assert doc["version"] == 2 and "loss_history" not in doc
    report, version = read_report(old_run)
    assert version == 2 and report is not None
    want = [(s, v) for s, v in GOLDEN_LOSS if s <= 6] + [(7, 0.75)]
    same_loss(report.loss_history, want)
    assert report.metric_history == {
        **{s: m for s, m in GOLDEN_METRICS.items() if s <= 6},
        7: {"val": 0.01},
    }
    assert [e["resumed_from"] for e in report.lineage] == [4, 6]
    assert len(report.config_changes) == 1 and report.name == "report_v1"
    with sp.CheckpointManager(old_run) as again:  # and it reopens as it was left
        same_loss(again.report.loss_history, want)
        assert again.best_step() == 4  # val 0.0, as before


def test_a_migration_cut_short_leaves_the_old_report_in_charge(
    old_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log is written before the report that points readers at it: a failure (or a kill) in
    between leaves the version 1 report, which readers follow (the log beside it is ignored), and
    the next writer writes the log again, without duplicating a record."""
    from savepoint.runs import books as books_module

    real = books_module.write_json
    calls = []

    def failing(path: Any, doc: Any, **options: Any) -> None:
        calls.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    m = sp.CheckpointManager(old_run)
    m.log(9, loss=0.0625)
    monkeypatch.setattr(books_module, "write_json", failing)
    with pytest.raises(sp.CheckpointWriteError):
        m.close()
    monkeypatch.setattr(books_module, "write_json", real)
    assert calls and (old_run / history.HISTORY_FILE).exists()
    assert read(old_run / "report.json")["version"] == 1
    report = load_report(old_run)
    assert report is not None
    same_loss(report.loss_history, GOLDEN_LOSS)  # the old report, not the log
    with sp.CheckpointManager(old_run) as again:
        again.log(9, loss=0.0625)
    report = load_report(old_run)
    assert report is not None
    same_loss(report.loss_history, [*GOLDEN_LOSS, (9, 0.0625)])
    assert report.metric_history == GOLDEN_METRICS


# -- object stores: segments ------------------------------------------------------------------------


def segment_names(run: Location) -> list[str]:
    return run.store.list(run.join(history.SEGMENTS_DIR).path)


def test_segments_on_an_object_store_are_compacted_and_read_in_order() -> None:
    store = MemoryStore(atomic_rename=False)
    run = store.at("/run")
    want: list[tuple[int, float]] = []
    with sp.CheckpointManager(run, keep_last=1, best_metric="val") as m:
        for save in range(1, 41):
            for k in range(25):
                step = save * 100 + k
                m.log(step, loss=float(step))
                want.append((step, float(step)))
            m.save(save * 100 + 24, state(save), {"val": 1.0 / save})
            m.wait()
            assert len(segment_names(run)) <= 2 * history.FANOUT, segment_names(run)
    assert not (run.store.stat(run.join(history.HISTORY_FILE).path))
    report = load_report(run)
    assert report is not None and report.loss_history == want
    assert len(report.metric_history) == 40
    # Records are rewritten by compaction a bounded number of times: the segments hold each
    # record once.
    total = sum(
        len(history.decode(store.read_small(run.join("history", n).path, cap=None), n))
        for n in segment_names(run)
    )
    assert total == len(want) + 40


def test_a_compaction_cut_short_leaves_duplicates_nobody_reads() -> None:
    store = MemoryStore(atomic_rename=False)
    run = store.at("/run")
    with sp.CheckpointManager(run) as m:
        for step in range(1, 4):
            m.log(step, loss=float(step))
            m.save(step, state(step))
    names = segment_names(run)
    assert names == [f"{n:012d}-{n:012d}.jsonl" for n in (1, 2, 3, 4)][: len(names)]
    before = load_report(run)
    # A merged segment was put, its parts were not deleted yet (a kill in between).
    parts = [store.read_small(run.join("history", n).path, cap=None) for n in names[:2]]
    store.put(run.join("history", f"{1:012d}-{2:012d}.jsonl").path, b"".join(parts))
    assert load_report(run) == before
    # The next writer removes what the merged segment covers.
    with sp.CheckpointManager(run) as m:
        assert m.report.loss_history == before.loss_history  # type: ignore[union-attr]
    assert f"{1:012d}-{1:012d}.jsonl" not in segment_names(run)
    assert load_report(run) == before


def test_gc_removes_segments_a_compaction_left_behind() -> None:
    store = MemoryStore(atomic_rename=False)
    run = store.at("/run")
    with sp.CheckpointManager(run) as m:
        for step in range(1, 3):
            m.log(step, loss=float(step))
            m.save(step, state(step))
    names = segment_names(run)
    merged = f"{1:012d}-{len(names):012d}.jsonl"
    parts = [store.read_small(run.join("history", n).path, cap=None) for n in names]
    store.put(run.join("history", merged).path, b"".join(parts))
    before = load_report(run)
    report = collect(run, grace=0)
    assert sorted(r.path.rsplit("/", 1)[1] for r in report.removed) == names
    assert segment_names(run) == [merged] and load_report(run) == before
    assert collect(run, grace=0).removed == ()


def test_the_records_round_trip() -> None:
    """Whatever log() and save() take is read back as they left it (non-finite losses as
    strings in the log, floats again in the report)."""
    records: list[Any] = [
        (1, 0.1, None),
        (2, float("nan"), None),
        (3, float("-inf"), {"lr": 1e-7}),
        (4, None, {"acc": 0.5, "name": "x"}),
        (5, 3.0, None),
        {"step": 6, "metrics": {"val": 0.25}},
        {"resumed_from": 4},
        (5, 2.5, None),
    ]
    decoded = history.decode(history.encode(records), "log")
    loss: list[tuple[int, float]] = []
    metrics: dict[int, dict[str, Any]] = {}
    history.apply(decoded, loss, metrics)
    same_loss(loss, [(1, 0.1), (2, float("nan")), (3, float("-inf")), (5, 2.5)])
    assert metrics == {3: {"lr": 1e-7}, 4: {"acc": 0.5, "name": "x"}}


def test_a_failed_save_on_an_object_store_takes_its_segment_back() -> None:
    faulty = FaultyStore(MemoryStore(atomic_rename=False))
    run = faulty.at("/run")
    m = sp.CheckpointManager(run, best_metric="val")
    m.save(1, state(1), {"val": 0.5})
    names = segment_names(run)
    faulty.fail("put", path="*/report.json")
    with pytest.raises(sp.CheckpointWriteError):
        m.save(2, state(2), {"val": 0.4})
    assert segment_names(run) == names
    m.save(2, state(2), {"val": 0.4})
    m.close()
    report = load_report(run)
    assert report is not None and report.metric_history == {1: {"val": 0.5}, 2: {"val": 0.4}}


def test_a_reader_racing_a_compaction_lists_again(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(atomic_rename=False)
    run = store.at("/run")
    with sp.CheckpointManager(run) as m:
        for step in range(1, 4):
            m.log(step, loss=float(step))
            m.save(step, state(step))
    want = load_report(run)
    real = store.read_small
    hits = []

    def vanishing(path: str, *, cap: int | None) -> bytes:
        if "/history/" in path and not hits:
            hits.append(path)
            raise FileNotFoundError(errno.ENOENT, "compacted meanwhile", path)
        return real(path, cap=cap)

    monkeypatch.setattr(store, "read_small", vanishing)
    assert load_report(run) == want and hits


# -- the cost of a save does not grow with the history ---------------------------------------------


class Syncs:
    """Counts os.fsync and os.fdatasync calls, by thread name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.by_thread: Counter[str] = Counter()
        real_fsync, real_fdatasync = os.fsync, os.fdatasync
        lock = threading.Lock()

        def count(real: Any) -> Any:
            def counted(fd: int) -> None:
                with lock:
                    name = threading.current_thread().name
                    self.by_thread[
                        name.split("_")[0] if name.startswith("savepoint-") else name
                    ] += 1
                real(fd)

            return counted

        monkeypatch.setattr(os, "fsync", count(real_fsync))
        monkeypatch.setattr(os, "fdatasync", count(real_fdatasync))

    def take(self) -> Counter[str]:
        out, self.by_thread = self.by_thread, Counter()
        return out


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> Syncs:
    return Syncs(monkeypatch)


def test_fsyncs_of_a_managed_save(tmp_path: Path, syncs: Syncs) -> None:
    """A plain sp.save syncs 4 times (data, manifest, staging directory, parent). A managed save
    that moves latest/ and best/ syncs once more before it returns (report.json's new bytes,
    under a temporary name; its rename and the aliases' are synced by the background step), and
    its background step at most 5 times (the run directory, the history log, the report naming
    the checkpoint retention drops and its directory, the deletion); before issue 16 a managed
    save synced 13 times before returning. Logging syncs nothing, and none of this grows with the
    history."""
    big = {"w": np.zeros((256, 256), np.float32)}
    sp.save(tmp_path / "plain", big)
    syncs.take()
    sp.save(tmp_path / "plain2", big)
    plain = sum(syncs.take().values())
    assert plain == 4
    m = sp.CheckpointManager(tmp_path / "run", keep_last=2, best_metric="val")
    counts = []
    for step in range(1, 9):
        if step == 5:
            for k in range(20_000):
                m.log(k, loss=1.0)
            assert sum(syncs.take().values()) == 0  # log() is in memory until the next save
        m.save(step, big, {"val": 1.0 / step})  # a new best: both aliases move
        # The caller's syncs, and the data files' (run beside the manifest's by the finishing
        # pool, waited for before the save commits).
        foreground = sum(
            n for name, n in syncs.take().items() if name in ("MainThread", "savepoint-finish")
        )
        m.wait()
        background = sum(syncs.take().values())
        counts.append((step, foreground, background))
    m.close()
    for _, foreground, background in counts[2:]:  # pruning from step 3 on
        assert foreground == plain + 1, counts
        assert background <= 5, counts


def test_report_and_log_writes_do_not_grow_with_the_history(tmp_path: Path) -> None:
    """After 50,000 logged steps a save writes as many bytes of bookkeeping as after none: the
    report's size does not depend on the history, and the log grows by the records since the
    last save only."""
    run = tmp_path / "run"
    tiny = {"w": np.zeros(4, np.float32)}
    with sp.CheckpointManager(run, keep_last=2, best_metric="val") as m:
        m.save(1, tiny, {"val": 1.0})
        size_at_0 = (run / "report.json").stat().st_size
        for step in range(2, 50_002):
            m.log(step, loss=1.0 / step)
        m.save(50_002, tiny, {"val": 0.5})
        log_size = (run / history.HISTORY_FILE).stat().st_size
        m.log(50_003, loss=0.1)
        m.save(50_004, tiny, {"val": 0.25})
        grown = (run / history.HISTORY_FILE).stat().st_size - log_size
        size_at_50k = (run / "report.json").stat().st_size
    assert grown == len(history.encode([{"step": 50_003, "loss": 0.1}])) + len(
        history.encode([{"step": 50_004, "metrics": {"val": 0.25}}])
    )
    assert abs(size_at_50k - size_at_0) < 64, (size_at_0, size_at_50k)
    report = load_report(run)
    assert report is not None and len(report.loss_history) == 50_001


# -- the background step: verify, then prune ---------------------------------------------------------


def test_nothing_is_pruned_before_the_new_checkpoint_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save returns while its checkpoint is being verified; until the verification has
    passed, every older checkpoint stays on disk and in the report."""
    run = tmp_path / "run"
    real = savepoint.checkpoint.verify
    entered, release = threading.Event(), threading.Event()
    events: list[str] = []

    def slow_verify(path: Any, **kwargs: Any) -> Any:
        entered.set()
        assert release.wait(30)
        out = real(path, **kwargs)
        events.append(f"verified {os.path.basename(str(path))}")
        return out

    from savepoint.runs import books as books_module

    real_discard = books_module.discard

    def recording_discard(store: Any, path: str) -> None:
        events.append(f"deleted {os.path.basename(path)}")
        real_discard(store, path)

    m = sp.CheckpointManager(run, keep_last=1)
    m.save(1, state(1))
    monkeypatch.setattr(savepoint.checkpoint, "verify", slow_verify)
    monkeypatch.setattr(books_module, "discard", recording_discard)
    pending = m.save(2, state(2))
    assert entered.wait(30) and not pending.done()
    assert layout.committed_steps(str(run)) == [1, 2]
    assert read(run / "report.json")["checkpoints"] == [2, 1]
    assert read(run / "report.json")["discarding"] == []
    assert events == []
    release.set()
    pending.wait()
    assert events == ["verified step-0000000002", "deleted step-0000000001"]
    assert m.steps() == [2] and layout.committed_steps(str(run)) == [2]
    m.close()


@pytest.fixture
def bad_verify(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """checkpoint.verify fails for the steps in ``bad["steps"]``."""
    real = savepoint.checkpoint.verify
    bad: dict[str, Any] = {"steps": set(), "calls": []}

    def verify(path: Any, **kwargs: Any) -> Any:
        step = int(os.path.basename(str(path)).split("-")[1])
        bad["calls"].append(step)
        if step in bad["steps"]:
            raise sp.CorruptCheckpointError(f"injected damage in step {step}", path=str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(savepoint.checkpoint, "verify", verify)
    return bad


def test_a_failed_verification_is_raised_once_by_the_next_save_and_recorded(
    tmp_path: Path, bad_verify: dict[str, Any]
) -> None:
    run = tmp_path / "run"
    m = sp.CheckpointManager(run, keep_last=2, best_metric="val")
    m.save(1, state(1), {"val": 0.5})
    m.save(2, state(2), {"val": 0.4})
    bad_verify["steps"].add(3)
    pending = m.save(3, state(3), {"val": 0.1})  # the best metric, but damaged
    with pytest.raises(sp.CorruptCheckpointError, match="did not verify"):
        pending.wait()
    with pytest.raises(sp.CorruptCheckpointError) as info:
        m.save(4, state(4), {"val": 0.3})  # raised before saving: nothing saved by this call
    assert "checkpoint 3" in str(info.value) and "injected damage" in str(info.value)
    assert layout.committed_steps(str(run)) == [1, 2, 3]
    doc = read(run / "report.json")
    assert [f["step"] for f in doc["verify_failures"]] == [3]
    assert "injected damage" in doc["verify_failures"][0]["error"]
    assert doc["best"]["step"] == 2  # never the one that failed
    assert m.best_step() == 2 and held_step(run, "best") == 2
    m.wait()  # raised once only
    m.save(4, state(4), {"val": 0.3})
    m.wait()
    # keep_last=2 counts 2 and 4: the damaged 3 never takes a good checkpoint's place.
    assert m.steps() == [2, 4] and m.best_step() == 4
    same_state(sp.load(m.step_path(2)), state(2))
    m.close()
    with sp.CheckpointManager(run, keep_last=2, best_metric="val") as again:
        assert again.best_step() == 4 and again.steps() == [2, 4]


def held_step(run: Path, alias: str) -> int | None:
    from savepoint.runs import aliases

    return aliases.recorded_step(str(run), alias)


def same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert np.array_equal(got[k], v), k


def test_a_failed_verification_is_raised_by_close(
    tmp_path: Path, bad_verify: dict[str, Any]
) -> None:
    run = tmp_path / "run"
    m = sp.CheckpointManager(run, keep_last=1)
    m.save(1, state(1))
    bad_verify["steps"].add(2)
    m.save(2, state(2))
    with pytest.raises(sp.CorruptCheckpointError, match="checkpoint 2"):
        m.close()
    assert layout.committed_steps(str(run)) == [1, 2]
    assert read(run / "report.json")["verify_failures"][0]["step"] == 2
    m.close()  # once


def test_a_keep_best_never_keeps_a_checkpoint_that_failed(
    tmp_path: Path, bad_verify: dict[str, Any]
) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(run, keep_last=1, keep_best=1, best_metric="val") as m:
        m.save(1, state(1), {"val": 0.5})
        bad_verify["steps"].add(2)
        m.save(2, state(2), {"val": 0.1})
        with pytest.raises(sp.CorruptCheckpointError):
            m.wait()
        m.save(3, state(3), {"val": 0.9})
        m.wait()
        assert m.steps() == [1, 3] and m.best_step() == 1


# -- messages ---------------------------------------------------------------------------------------


def test_a_refused_report_on_an_object_store_keeps_the_stores_message() -> None:
    """An object store refusing report.json (403): the message is the store's own, and the advice
    is about credentials, not the permissions of a directory."""
    faulty = FaultyStore(MemoryStore(atomic_rename=False))
    run = faulty.at("/run")
    m = sp.CheckpointManager(run)
    m.save(1, state(1))
    faulty.fail("put", path="*/report.json", code=errno.EACCES)
    with pytest.raises(sp.CheckpointWriteError) as info:
        m.save(2, state(2))
    message = str(info.value)
    assert info.value.errno == errno.EACCES
    assert "(injected)" in message  # the store's own words
    assert "credentials" in message and "permissions of the run directory" not in message
    m.close()


def test_a_missing_best_metric_warns_once(tmp_path: Path) -> None:
    with sp.CheckpointManager(tmp_path / "run", best_metric="val_loss") as m:
        with pytest.warns(UserWarning, match="'val_loss'") as caught:
            m.save(1, state(1), {"val": 0.5})  # a misspelt name
        assert len(caught) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m.save(2, state(2), {"val": 0.4})  # said once per manager
            m.save(3, state(3))  # no metrics at all: a deliberate unranked save, no warning
            m.save(4, state(4), {"val_loss": 0.1})
        assert m.best_step() == 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_background_step_does_not_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background step holds the manager's lock while it decides what to prune; a child
    forked then must not wait for a lock no thread of its own will release."""
    import select

    from savepoint.runs import settle as settle_module

    run = tmp_path / "run"
    m = sp.CheckpointManager(run, keep_last=1)
    m.save(1, state(1))
    m.wait()
    inside, release = threading.Event(), threading.Event()
    real = settle_module.Settle.doomed

    def slow_doomed(self: Any, newest: int, live: list[int]) -> set[int]:
        inside.set()
        assert release.wait(30)
        return real(self, newest, live)

    monkeypatch.setattr(settle_module.Settle, "doomed", slow_doomed)
    m.save(2, state(2))
    assert inside.wait(30)  # the background step now holds the lock
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read_end)
        try:
            m.save(3, state(3))
            outcome = "saved"
        except sp.RunLockedError:
            outcome = "refused"
        except BaseException as exc:
            outcome = f"other: {exc!r}"
        with contextlib.suppress(BaseException):
            m.close()
        os.write(write_end, outcome.encode())
        os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 30)
        outcome = os.read(read_end, 1000).decode() if ready else "hung"
    finally:
        os.close(read_end)
        release.set()
        if outcome == "hung":
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert outcome == "refused"
    m.wait()
    assert m.steps() == [2]
    m.close()
