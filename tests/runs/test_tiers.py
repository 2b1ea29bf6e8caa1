"""Tiers: background copy-up of committed checkpoints to slower places, per-tier interval and
retention (after the new copy verifies there), failures named by tier, restore candidates."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
import savepoint.runs.tiers
import savepoint.transfer
from _compare import same
from savepoint.runs import layout
from savepoint.runs.tiers import Tier, TierCopier

RUN = {"name": "t", "created": "2026-11-27T00:00:00Z"}


def state(step: int) -> dict[str, Any]:
    return {"w": np.full((64, 64), step, np.float32), "step": step}


def saved(tmp_path: Path, step: int) -> str:
    path = layout.step_path(tmp_path / "home", step)
    sp.save(path, state(step))
    return path


def test_a_tier_gets_every_nth_step_and_keeps_the_newest(tmp_path: Path) -> None:
    disk = Tier(str(tmp_path / "disk"), every=2, keep=2)
    mem = Tier("memory://tiers-a/run", every=1)
    copier = TierCopier([disk, mem], RUN)
    for step in range(1, 8):
        copier.submit(step, saved(tmp_path, step))
    copier.close()
    copier.raise_error()
    assert layout.committed_steps(tmp_path / "disk") == [5, 7]  # 1, 3, 5, 7 copied; 2 kept
    assert layout.committed_steps("memory://tiers-a/run") == list(range(1, 8))
    same(sp.load(layout.step_path(tmp_path / "disk", 7)), state(7))
    candidates = copier.candidates()
    assert [t.label for t, _ in candidates[7]] == [disk.label, mem.label]  # fastest first
    assert [t.label for t, _ in candidates[3]] == [mem.label]


def test_the_interval_continues_after_a_restart(tmp_path: Path) -> None:
    tier = Tier(str(tmp_path / "disk"), every=10)
    copier = TierCopier([tier], RUN)
    copier.submit(10, saved(tmp_path, 10))
    copier.close()
    again = TierCopier([tier], RUN)
    assert again.due(15) == [] and again.due(20) == [tier]


def test_a_failed_copy_up_is_raised_once_naming_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = Tier(str(tmp_path / "disk"), name="scratch")
    copier = TierCopier([tier], RUN)
    real = savepoint.transfer._stream

    def full(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(savepoint.transfer, "_stream", full)
    copier.submit(1, saved(tmp_path, 1))
    copier.wait()
    assert copier.pending_steps() == set()
    with pytest.raises(sp.CheckpointWriteError, match="step 1 to tier 'scratch'") as caught:
        copier.raise_error()
    assert caught.value.errno == 28 and "No space left" in str(caught.value)
    copier.raise_error()  # once
    monkeypatch.setattr(savepoint.transfer, "_stream", real)
    copier.submit(2, saved(tmp_path, 2))
    copier.close()
    copier.raise_error()
    assert layout.committed_steps(tmp_path / "disk") == [2]
    assert os.listdir(tmp_path / "disk" / "checkpoints") == ["step-0000000002"]


def test_pruning_waits_for_the_new_copy_to_verify_and_spares_the_resumed_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = Tier(str(tmp_path / "disk"), keep=1)
    copier = TierCopier([tier], RUN, protected=lambda: {1})
    for step in (1, 2, 3):
        copier.submit(step, saved(tmp_path, step))
    copier.wait()
    assert layout.committed_steps(tmp_path / "disk") == [1, 3]  # 1: the resumed-from step
    real = savepoint.transfer.copy

    def damaging(src: Any, dst: Any, **kw: Any) -> Any:
        info = real(src, dst, **kw)
        data = next(p for p in Path(str(dst)).iterdir() if p.suffix == ".safetensors")
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
        return info

    monkeypatch.setattr(savepoint.transfer, "copy", damaging)
    copier.submit(4, saved(tmp_path, 4))
    copier.close()
    with pytest.raises(sp.CheckpointWriteError, match="step 4"):
        copier.raise_error()
    assert layout.committed_steps(tmp_path / "disk") == [1, 3, 4]  # nothing pruned for it


def test_a_tier_of_another_run_is_refused(tmp_path: Path) -> None:
    TierCopier([Tier(str(tmp_path / "disk"))], RUN)
    with pytest.raises(sp.RunMismatchError, match="another run"):
        TierCopier([Tier(str(tmp_path / "disk"))], {**RUN, "name": "other"})


def test_tier_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="every"):
        Tier("/x", every=0)
    with pytest.raises(ValueError, match="keep"):
        Tier("/x", keep=0)
    with pytest.raises(TypeError, match="url"):
        Tier(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="distinct"):
        TierCopier([Tier("memory://d/a"), Tier("memory://d/a")], RUN)


# -- CheckpointManager(..., tiers=[...]) ------------------------------------------------------


def test_a_manager_copies_up_and_a_lost_run_directory_restores_from_a_tier(
    tmp_path: Path,
) -> None:
    tier = sp.Tier("memory://tiers-m1/run", every=2, keep=2, name="object store")
    with sp.CheckpointManager(tmp_path / "ram", name="run-7", keep_last=1, tiers=[tier]) as mgr:
        for step in range(1, 7):
            mgr.save(step, state(step))
        mgr.wait()
        assert mgr.steps() == [6]
    assert layout.committed_steps("memory://tiers-m1/run") == [3, 5]  # 1, 3, 5 copied; keep 2
    # The machine (and its RAM disk) is gone: a new run directory of the run, the same tier.
    with pytest.raises(sp.RunMismatchError, match="another run"):
        sp.CheckpointManager(tmp_path / "other-run", tiers=[tier])
    with sp.CheckpointManager(tmp_path / "new-ram", name="run-7", tiers=[tier]) as fresh:
        target = state(0)
        assert fresh.restore(target) == 5
        assert fresh.restored_from == "object store"
        same(target, state(5))
        assert fresh.restore(target, step=3) == 3
        with pytest.raises(sp.CheckpointNotFoundError, match="tiers have"):
            fresh.restore(target, step=4)


def test_async_saves_are_copied_up_after_they_commit(tmp_path: Path) -> None:
    tier = sp.Tier(str(tmp_path / "disk"))
    with sp.CheckpointManager(tmp_path / "run", async_save=True, tiers=[tier]) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
        mgr.wait()
        assert layout.committed_steps(tmp_path / "disk") == [1, 2, 3]
        assert mgr.restore(state(0)) == 3 and mgr.restored_from == "run directory"


def test_the_run_keeps_a_checkpoint_until_its_copy_up_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    release = threading.Event()
    real = savepoint.transfer.copy

    def slow(*args: Any, **kw: Any) -> Any:
        assert release.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(savepoint.transfer, "copy", slow)
    tier = sp.Tier(str(tmp_path / "disk"), every=1)
    with sp.CheckpointManager(tmp_path / "run", keep_last=1, tiers=[tier]) as mgr:
        mgr.save(1, state(1)).wait()
        mgr.save(2, state(2)).wait()  # retention would delete 1: its copy-up is not done
        assert mgr.steps() == [1, 2]
        release.set()
        mgr.wait()
        mgr.save(3, state(3)).wait()
        assert mgr.steps() == [3]
    assert layout.committed_steps(tmp_path / "disk") == [1, 2, 3]


def test_a_failed_copy_up_is_raised_by_the_next_save_naming_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    tier = sp.Tier(str(tmp_path / "disk"), name="scratch")
    mgr = sp.CheckpointManager(tmp_path / "run", tiers=[tier])
    monkeypatch.setattr(savepoint.transfer, "_stream", full)
    mgr.save(1, state(1)).wait()
    mgr._tiers.wait()  # type: ignore[union-attr]
    with pytest.raises(sp.CheckpointWriteError, match="tier 'scratch'"):
        mgr.save(2, state(2))
    monkeypatch.undo()
    mgr.save(2, state(2))
    mgr.close()
    assert mgr.steps() == [1, 2]
    assert layout.committed_steps(tmp_path / "disk") == [2]


def test_a_damaged_checkpoint_is_read_from_its_copy_on_a_tier(
    tmp_path: Path, flip_byte: Any
) -> None:
    tier = sp.Tier(str(tmp_path / "disk"), name="disk")
    with sp.CheckpointManager(tmp_path / "run", tiers=[tier]) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    flip_byte(Path(layout.step_path(tmp_path / "run", 2)), "w", 8)
    with sp.CheckpointManager(tmp_path / "run", tiers=[tier]) as mgr:
        target = state(0)
        with pytest.warns(UserWarning, match="another copy"):
            assert mgr.restore(target) == 2
        assert mgr.restored_from == "disk"
        same(target, state(2))
        assert mgr.restore(target, step=2) == 2  # an explicit step: its copy, never another step
        assert mgr.restored_from == "disk"


def test_a_preemption_save_is_copied_to_the_first_tier_within_the_budget(tmp_path: Path) -> None:
    tiers = [sp.Tier(str(tmp_path / "disk"), every=100, name="disk"), sp.Tier("memory://p/r")]
    with sp.CheckpointManager(tmp_path / "ram", tiers=tiers) as mgr:
        mgr.save(100, state(100))
        mgr.wait()
        result = mgr.save_on_preemption(101, state(101))
    assert result.copied_to == ("disk",) and result.saved
    assert layout.committed_steps(tmp_path / "disk") == [100, 101]


def test_a_read_only_manager_restores_from_tiers_and_writes_nothing(tmp_path: Path) -> None:
    tier = sp.Tier(str(tmp_path / "disk"))
    with sp.CheckpointManager(tmp_path / "run", tiers=[tier]) as mgr:
        mgr.save(1, state(1))
    before = sorted(p.name for p in (tmp_path / "disk").iterdir())
    import shutil

    shutil.rmtree(layout.step_path(tmp_path / "run", 1))  # lost from the run directory
    with sp.CheckpointManager(tmp_path / "run", read_only=True, tiers=[tier]) as ro:
        assert ro.restore(state(0), resume=False) == 1
        assert ro.restored_from == tier.label
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == before
    with pytest.raises(TypeError, match="tiers"):
        sp.CheckpointManager(tmp_path / "x", tiers="s3://b/r")  # type: ignore[arg-type]


# -- ownership: one run per tier (issue 25, item 1) --------------------------------------------


def run_id(run: Path) -> str:
    import json

    found = json.loads((run / "run.json").read_text())["run_id"]
    assert isinstance(found, str) and len(found) == 32
    return found


def tier_doc(tier: Path) -> dict[str, Any]:
    import json

    doc = json.loads((tier / "tier.json").read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_two_runs_of_one_name_never_share_a_tier(tmp_path: Path, where: str) -> None:
    # Two run directories with the same name (two jobs from one config; a restarted job whose
    # old process still runs): the second is refused while the first writes the tier, and a run
    # of its own after it too. Before run ids and the tier's lock both copied up to it, each
    # overwriting the other's steps, and a restore from it returned the other run's state.
    url = str(tmp_path / "tier") if where == "disk" else f"memory://own-{tmp_path.name}/tier"
    tier = sp.Tier(url, name="shared")
    with sp.CheckpointManager(tmp_path / "b", name="job") as b:
        b.save(1, state(101))  # a run of its own, with the same name
    with sp.CheckpointManager(tmp_path / "a", name="job", tiers=[tier]) as a:
        a.save(1, state(1))
        a.wait()
        for other in ("b", "new"):  # an existing run; a run directory made by this open
            with pytest.raises(sp.RunMismatchError, match="being written by another run"):
                sp.CheckpointManager(tmp_path / other, name="job", tiers=[tier])
        a.save(2, state(2))
    assert layout.committed_steps(url) == [1, 2]
    with pytest.raises(sp.RunMismatchError, match="another run"):
        sp.CheckpointManager(tmp_path / "b", name="job", tiers=[tier])
    with pytest.raises(sp.RunMismatchError, match="another run"):
        sp.CheckpointManager(tmp_path / "b", name="job", tiers=[tier], read_only=True)
    assert layout.committed_steps(url) == [1, 2]
    same(sp.load(layout.step_path(url, 2)), state(2))
    # a itself opens it again, and restores its own state from it.
    with sp.CheckpointManager(tmp_path / "a", name="job", tiers=[tier]) as again:
        for step in (1, 2):
            __import__("shutil").rmtree(layout.step_path(tmp_path / "a", step))
        target = state(0)
        assert again.restore(target) == 2 and again.restored_from == "shared"
        same(target, state(2))


def test_a_new_run_directory_continues_the_run_its_tiers_belong_to(tmp_path: Path) -> None:
    tier = sp.Tier(str(tmp_path / "tier"))
    with sp.CheckpointManager(tmp_path / "ram", name="run-7", tiers=[tier]) as old:
        old.save(1, state(1))
    owner = run_id(tmp_path / "ram")
    assert tier_doc(tmp_path / "tier")["run"] == {"name": "run-7", "variant": None, "id": owner}
    # The machine is gone with its RAM disk: a run directory made by this open takes the run's id.
    with sp.CheckpointManager(tmp_path / "new-ram", name="run-7", tiers=[tier]) as new:
        assert new.restore(state(0)) == 1
        new.save(2, state(2))
    assert run_id(tmp_path / "new-ram") == owner
    assert layout.committed_steps(tmp_path / "tier") == [1, 2]
    # A run directory that is not new (it has a run of its own) is refused.
    with sp.CheckpointManager(tmp_path / "elsewhere", name="run-7") as other:
        other.save(1, state(1))
    with pytest.raises(sp.RunMismatchError, match="another run"):
        sp.CheckpointManager(tmp_path / "elsewhere", name="run-7", tiers=[tier])


def test_a_tier_of_a_savepoint_before_run_ids_is_adopted_by_its_first_writer(
    tmp_path: Path,
) -> None:
    import json

    tier = sp.Tier(str(tmp_path / "tier"))
    (tmp_path / "tier" / "checkpoints").mkdir(parents=True)
    legacy = {"format": "savepoint-tier", "version": 1, "run": {"name": "job", "variant": None}}
    (tmp_path / "tier" / "tier.json").write_text(json.dumps(legacy))

    # A run made before run ids (its run.json has none) gets one from its writer, then claims it.
    def made_before_run_ids(run: Path) -> None:
        for name in ("run.json", "report.json"):
            doc = json.loads((run / name).read_text())
            del doc["run_id"]
            (run / name).write_text(json.dumps(doc))

    with sp.CheckpointManager(tmp_path / "a", name="job") as a:
        a.save(1, state(1))
    made_before_run_ids(tmp_path / "a")
    with sp.CheckpointManager(tmp_path / "a", name="job", tiers=[tier]) as a:
        a.save(2, state(2))
    owner = run_id(tmp_path / "a")
    assert tier_doc(tmp_path / "tier")["run"]["id"] == owner
    assert tier_doc(tmp_path / "tier")["version"] == 2
    with sp.CheckpointManager(tmp_path / "b", name="job") as b:
        b.save(1, state(1))
    with pytest.raises(sp.RunMismatchError, match="another run"):
        sp.CheckpointManager(tmp_path / "b", name="job", tiers=[tier])
    # Another run directory made before run ids: only its name can be compared, and it matches.
    with sp.CheckpointManager(tmp_path / "c", name="job") as c:
        c.save(3, state(3))
    made_before_run_ids(tmp_path / "c")
    with sp.CheckpointManager(tmp_path / "c", name="job", tiers=[tier]) as c:
        assert c.steps() == [3]
    assert run_id(tmp_path / "c") == owner


def test_a_failed_read_of_tier_json_is_not_a_missing_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import errno

    from savepoint.storage.faults import FaultyStore
    from savepoint.storage.memory import MemoryStore

    store = FaultyStore(MemoryStore())
    monkeypatch.setattr(savepoint.runs.tiers, "resolve_path", lambda url, what: store.at("/t"))
    TierCopier([Tier("memory://t")], {**RUN, "id": "a" * 32}).close()
    before = store.inner.read_small("/t/tier.json", cap=None)
    store.fail("read_small", path="*/tier.json", code=errno.EIO)
    with pytest.raises(sp.CheckpointError, match=r"cannot read .*tier\.json"):
        TierCopier([Tier("memory://t")], {**RUN, "id": "b" * 32}, inherit=True)
    assert store.inner.read_small("/t/tier.json", cap=None) == before  # not claimed over
    # (and its lock was released: the owner opens it again)
    TierCopier([Tier("memory://t")], {**RUN, "id": "a" * 32}).close()


def test_a_tier_that_cannot_be_listed_fails_the_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: skipped with a log record, so a new run directory whose only tier failed to
    # answer restored nothing (None: "a fresh start") and trained over the tier's run.
    tier = sp.Tier(str(tmp_path / "tier"), name="t")
    with sp.CheckpointManager(tmp_path / "ram", name="r", tiers=[tier]) as mgr:
        mgr.save(1, state(1))
    with sp.CheckpointManager(tmp_path / "new", name="r", tiers=[tier]) as new:
        real = layout.committed_steps

        def failing(directory: Any, expected: Any = ()) -> list[int]:
            if str(directory).endswith("/tier"):
                raise sp.CheckpointError("cannot list it (injected)")
            return real(directory, expected)

        monkeypatch.setattr(layout, "committed_steps", failing)
        with pytest.raises(sp.CheckpointError, match=r"tier 't' .* cannot be listed"):
            new.restore(state(0))
        monkeypatch.undo()
        assert new.restore(state(0)) == 1


def test_a_resume_leaves_the_abandoned_timeline_on_the_tiers_too(tmp_path: Path) -> None:
    """After a resume from step 2, the tier's copy of step 4 (the old timeline) is never
    "latest": the copy-up of the new step 3 deletes it, and a copy left there (a crash before
    that copy-up, a failed one) is passed over by restore("latest"), as the run directory's are."""
    import shutil

    tier = sp.Tier(str(tmp_path / "disk"))

    def renewed(step: int) -> dict[str, Any]:
        return {"w": np.full((64, 64), 100 + step, np.float32), "step": step}

    with sp.CheckpointManager(tmp_path / "ram", name="run-9", keep_last=1, tiers=[tier]) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(step))
    assert layout.committed_steps(tmp_path / "disk") == [1, 2, 3, 4]
    old_four = tmp_path / "old-step-4"
    shutil.copytree(layout.step_path(tmp_path / "disk", 4), old_four)

    with sp.CheckpointManager(tmp_path / "ram", name="run-9", keep_last=1, tiers=[tier]) as mgr:
        target = state(0)
        assert mgr.restore(target, step=2) == 2  # (from the tier: the run directory holds 4)
        mgr.save(3, renewed(3))  # the new timeline
        mgr.wait()
        assert layout.committed_steps(tmp_path / "disk") == [1, 2, 3]
        assert mgr.restore(target) == 3
        same(target, renewed(3))
        # The old step 4 back on the tier (as if the copy-up had not run): still not "latest".
        shutil.copytree(old_four, layout.step_path(tmp_path / "disk", 4))
        assert mgr.restore(target, resume=False) == 3
        assert mgr.restored_from == "run directory"
        same(target, renewed(3))
    with sp.CheckpointManager(tmp_path / "ram", name="run-9", tiers=[tier], read_only=True) as ro:
        target = state(0)
        assert ro.restore(target, resume=False) == 3
        same(target, renewed(3))


def test_which_copies_belong_to_an_abandoned_timeline() -> None:
    from savepoint.runs.restoring import abandoned

    lineage = [{"resumed_from": 2, "steps_completed_before": 6, "at": "..."}]
    copies: dict[int, list[Any]] = {s: [] for s in (1, 2, 3, 5, 6, 7)}
    assert abandoned([3], copies, lineage) == {5, 6}  # 7: never reached by the old timeline
    assert abandoned([3], copies, []) == set()  # never resumed
    assert abandoned([], copies, lineage) == set()  # a new run directory: the tiers know best
    assert abandoned([6], copies, lineage) == set()  # no checkpoint of the new timeline yet


def test_a_copy_up_deletes_the_abandoned_timeline_then_the_oldest_beyond_keep() -> None:
    from savepoint.runs.tiers import _doomed

    gone, kept = "abandoned timeline", "keep=2"
    assert _doomed([1, 2, 3], 3, None, set()) == []
    assert _doomed([1, 2, 3, 4, 5], 5, 2, set()) == [(1, kept), (2, kept), (3, kept)]
    assert _doomed([1, 2, 3, 4, 5], 3, None, {2}) == [(4, gone), (5, gone)]  # resumed from 2
    assert _doomed([1, 2, 3, 4, 5], 3, 2, {1}) == [(4, gone), (5, gone), (2, kept)]
    assert _doomed([1, 2, 5, 6], 3, None, {5}) == [(6, gone)]  # (resumed from 5, then saved 3)
