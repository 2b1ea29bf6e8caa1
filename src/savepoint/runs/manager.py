"""``CheckpointManager``: a run directory whose checkpoints survive crashes and retention.

Sequence of ``save(step, state, metrics)``:

1. the save policy decides whether this step is written (``force=True`` always writes);
2. the checkpoint is written with the foundation's protocol to ``checkpoints/step-<step>``
   (synchronously, or snapshotted and written in the background with ``async_save=True``);
3. once committed: after a resume, checkpoints newer than this step (the abandoned timeline) are
   deleted; the report is updated (``report.json``, atomic), ``latest`` and ``best`` are
   re-linked, and retention runs. Before retention deletes anything, the new checkpoint is read
   back and verified (manifest and every checksum); if that fails nothing is deleted and the
   error is raised. Retention never deletes the newest verified checkpoint, the current best, or
   the checkpoint this run resumed from.

``restore(into, step="latest")`` tries the newest checkpoint first; one that fails verification
is skipped with a warning and the next older one is tried. It returns the step restored, or None
when the run has no checkpoint at all (a fresh start: the only case that returns None). If
checkpoints exist but none is intact, it raises CorruptCheckpointError rather than start over.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from savepoint import checkpoint
from savepoint.async_.checkpointer import AsyncCheckpointer
from savepoint.async_.pending import PendingSave
from savepoint.commit import atomic
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MissingCheckpointError,
    RunMismatchError,
)
from savepoint.runs import layout, policies
from savepoint.runs.policies import Entry, Mode, RetentionPolicy, SavePolicy
from savepoint.runs.report import (
    REPORT_FILE,
    RUN_FILE,
    Report,
    RunInfo,
    check_consistent,
    now_iso,
    plain_value,
    read_json,
    write_json,
)

StepSpec = int | Literal["latest", "best"]


class CheckpointManager:
    """Saves, restores and prunes the checkpoints of one training run in ``directory``.

    Retention (a step is kept if any rule wants it; with no rule, every checkpoint is kept):
    ``keep_last`` newest steps, ``keep_best`` best by ``best_metric`` (``best_mode`` "min" or
    "max", ties to the later step), ``keep_every`` multiples of that step, or any ``retention``
    policy object from :mod:`savepoint.runs.policies`. ``save_every`` (or a ``save_policy``)
    makes ``save`` skip steps. ``name``, ``variant``, ``config`` and ``num_params`` describe the
    run in ``run.json``; opening an existing run with different values is a RunMismatchError.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: Mode = "min",
        keep_every: int | None = None,
        save_every: int | None = None,
        async_save: bool = False,
        retention: RetentionPolicy | None = None,
        save_policy: SavePolicy | None = None,
        name: str | None = None,
        variant: str | None = None,
        config: Mapping[str, Any] | None = None,
        num_params: int | None = None,
        verify_before_prune: bool = True,
        aliases: bool = True,
        **save_options: Any,
    ) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        if keep_best is not None and best_metric is None:
            raise ValueError("keep_best needs best_metric (the metric to rank checkpoints by)")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
        self.best_metric = best_metric
        self.best_mode: Mode = best_mode
        rules: list[RetentionPolicy] = []
        if keep_last is not None:
            rules.append(policies.KeepLatest(keep_last))
        if keep_best is not None and best_metric is not None:
            rules.append(policies.KeepBest(keep_best, best_metric, best_mode))
        if keep_every is not None:
            rules.append(policies.KeepEvery(keep_every))
        if retention is not None:
            rules.append(retention)
        self.retention: RetentionPolicy = (
            policies.AnyOf(*rules) if rules else policies.AnyOf(policies.KeepAll())
        )
        if save_policy is None:
            save_policy = policies.SaveEvery(save_every) if save_every else policies.SaveAlways()
        self.save_policy = save_policy
        self.verify_before_prune = verify_before_prune
        self.aliases = aliases
        self.save_options = save_options
        # With a process group every rank saves its part; the run's bookkeeping (report, aliases,
        # retention) is done by rank 0 alone, so no two processes rewrite the same files.
        self._leader = _rank(save_options.get("process_group")) == 0
        self._lock = threading.RLock()
        self._async = AsyncCheckpointer(**save_options) if async_save else None
        self._closed = False
        self._started = time.monotonic()
        self._resumed_from: int | None = None
        self._verified: set[int] = set()
        self._last_saved: int | None = None

        os.makedirs(os.path.join(self.directory, layout.CHECKPOINTS), exist_ok=True)
        atomic.clean_stale_in(os.path.join(self.directory, layout.CHECKPOINTS))
        atomic.clean_stale_in(self.directory)
        self.run = self._open_run(name, variant, config, num_params)
        self.report = self._open_report()
        self._wall_before = self.report.wall_time_s
        self._metrics: dict[int, dict[str, Any]] = {}
        for step in layout.committed_steps(self.directory):
            self._metrics[step] = self._read_metrics(step)

    # -- opening -----------------------------------------------------------------------------

    def _open_run(
        self,
        name: str | None,
        variant: str | None,
        config: Mapping[str, Any] | None,
        num_params: int | None,
    ) -> RunInfo:
        path = os.path.join(self.directory, RUN_FILE)
        doc = read_json(path)
        wanted = RunInfo(
            name=name or os.path.basename(self.directory),
            variant=variant,
            config=_plain(dict(config or {})),
            num_params=num_params,
        )
        if doc is None:
            write_json(path, wanted.to_json())
            return wanted
        run = RunInfo.from_json(doc, path)
        problems = []
        if name is not None and name != run.name:
            problems.append(f"name {name!r} (run.json has {run.name!r})")
        if variant is not None and variant != run.variant:
            problems.append(f"variant {variant!r} (run.json has {run.variant!r})")
        if config is not None and wanted.config != run.config:
            problems.append("a different config")
        if num_params is not None and num_params != run.num_params:
            problems.append(f"num_params {num_params} (run.json has {run.num_params})")
        if problems:
            raise RunMismatchError(
                f"{self.directory} is an existing run, opened with {'; '.join(problems)}; use "
                "another directory for a different run",
                path=self.directory,
            )
        return run

    def _open_report(self) -> Report:
        path = os.path.join(self.directory, REPORT_FILE)
        doc = read_json(path)
        if doc is None:
            return Report.for_run(self.run)
        report = Report.from_json(doc, path)
        check_consistent(self.directory, self.run, report, layout.committed_steps(self.directory))
        return report

    def _read_metrics(self, step: int) -> dict[str, Any]:
        try:
            meta = checkpoint.inspect(layout.step_path(self.directory, step)).metadata
        except CheckpointError:
            return {}
        run_meta = meta.get("savepoint_run")
        return dict(run_meta.get("metrics") or {}) if isinstance(run_meta, dict) else {}

    # -- queries -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending."""
        return layout.committed_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best step by ``best_metric`` among the checkpoints on disk, or None."""
        if self.best_metric is None:
            return None
        best = policies.best_entries(self._entries(), self.best_metric, self.best_mode)
        return best[0].step if best else None

    def step_path(self, step: int) -> str:
        return layout.step_path(self.directory, step)

    def metrics(self, step: int) -> dict[str, Any]:
        return dict(self._metrics.get(step, {}))

    def _entries(self) -> list[Entry]:
        return [Entry(s, self._metrics.get(s, {})) for s in self.steps()]

    # -- saving --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
        epoch: int | None = None,
    ) -> PendingSave:
        """Save ``state`` as checkpoint ``step`` (unless the save policy skips it)."""
        self._check_open()
        if self._async is not None:
            self._async._raise_background_error()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        if not force and not self.save_policy.should_save(step, self._last_saved):
            return PendingSave.finished(None, step, skipped=True)
        clean = _plain(dict(metrics or {}))
        path = self.step_path(step)
        meta = {"savepoint_run": {"step": step, "epoch": epoch, "metrics": clean}}
        self._last_saved = step

        def committed(info: checkpoint.CheckpointInfo) -> None:
            self._after_commit(step, clean, epoch)

        if self._async is not None:
            pending = self._async.save(path, state, metadata=meta, on_commit=committed)
            pending.step = step
            return pending
        info = checkpoint.save(path, state, metadata=meta, **self.save_options)
        committed(info)
        return PendingSave.finished(path, step, info)

    def log(self, step: int, loss: float | None = None, **metrics: Any) -> None:
        """Record a training step's loss (the report's loss curve) and any other values."""
        with self._lock:
            if loss is not None:
                self.report.loss_history.append((int(step), float(loss)))
            if metrics:
                self.report.metric_history.setdefault(int(step), {}).update(_plain(metrics))
            self.report.steps_completed = max(self.report.steps_completed, int(step))

    def _after_commit(self, step: int, metrics: dict[str, Any], epoch: int | None) -> None:
        with self._lock:
            self._metrics[step] = metrics
            if not self._leader:
                return
            self._verified.discard(step)
            if metrics:
                self.report.metric_history.setdefault(step, {}).update(metrics)
            self.report.steps_completed = max(self.report.steps_completed, step)
            if epoch is not None:
                self.report.epoch = epoch
            if self._resumed_from is not None:
                # After a resume, checkpoints past this step belong to the abandoned timeline (a
                # rollback, or newer checkpoints that failed verification): now that the new
                # timeline has a committed checkpoint, they go, or a restart would undo the resume.
                # (The checkpoint resumed from is never one of them, even if steps restarted.)
                horizon = max(step, self._resumed_from)
                for later in [s for s in self.steps() if s > horizon]:
                    atomic.discard(self.step_path(later))
                    self._metrics.pop(later, None)
            self._write_report()
            if self.aliases:
                self._publish(layout.LATEST, self.latest_step())
                self._publish(layout.BEST, self.best_step())
            self._prune(step)
            self._write_report()

    def _publish(self, alias: str, step: int | None) -> None:
        target = os.path.join(self.directory, alias)
        if step is None:
            return
        staging = atomic.staging_path(target)
        try:
            atomic.link_tree(self.step_path(step), staging)
            atomic.commit(staging, target)
        except BaseException:
            atomic.remove_tree(staging)
            raise

    def _prune(self, newest: int) -> None:
        entries = self._entries()
        keep = self.retention.keep(entries)
        keep |= {s for s in (newest, self.best_step(), self._resumed_from) if s is not None}
        doomed = [e.step for e in entries if e.step not in keep]
        if not doomed:
            return
        if self.verify_before_prune and newest not in self._verified:
            try:
                checkpoint.verify(self.step_path(newest))
            except CheckpointError as exc:
                raise CorruptCheckpointError(
                    f"checkpoint {newest} did not verify after saving ({exc}); nothing was pruned",
                    path=self.step_path(newest),
                ) from exc
            self._verified.add(newest)
        for step in doomed:
            atomic.discard(self.step_path(step))
            self._metrics.pop(step, None)

    def _write_report(self) -> None:
        if not self._leader:
            return
        r = self.report
        r.wall_time_s = self._wall_before + (time.monotonic() - self._started)
        r.checkpoints = self.steps()[::-1]
        r.retention = policies.to_spec(self.retention)
        r.latest_step = r.checkpoints[0] if r.checkpoints else None
        best = self.best_step()
        r.best = (
            None
            if best is None
            else {
                "metric": self.best_metric,
                "mode": self.best_mode,
                "step": best,
                "metrics": self._metrics.get(best, {}),
            }
        )
        write_json(os.path.join(self.directory, REPORT_FILE), r.to_json())

    # -- restoring -----------------------------------------------------------------------------

    def restore(
        self, into: Any, step: StepSpec = "latest", *, resume: bool = True, **load_options: Any
    ) -> int | None:
        """Restore checkpoint ``step`` ("latest", "best" or a number) into ``into``.

        Returns the step restored. With ``resume`` (the default) the run continues from that step:
        the report forgets history after it (the resumed run logs those steps again), records the
        lineage, and retention protects that checkpoint; ``resume=False`` only loads. With "latest", a checkpoint that fails verification is
        skipped (with a warning) for the next older one; None means the run has no checkpoint
        at all. "best" and explicit steps are never substituted: missing or corrupt is an error.
        """
        self._check_open()
        self.wait()
        steps = self.steps()
        if step == "latest":
            if not steps:
                return None
            failures = []
            for candidate in reversed(steps):
                try:
                    checkpoint.load(self.step_path(candidate), into=into, **load_options)
                except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
                    failures.append(f"step {candidate}: {exc}")
                    warnings.warn(
                        f"checkpoint {candidate} of {self.directory} failed verification, trying "
                        f"an older one: {exc}",
                        stacklevel=2,
                    )
                    continue
                return self._resumed(candidate) if resume else candidate
            raise CorruptCheckpointError(
                f"{self.directory}: no intact checkpoint among {len(steps)}: "
                + "; ".join(failures),
                path=self.directory,
            )
        if step == "best":
            best = self.best_step()
            if best is None:
                raise MissingCheckpointError(
                    f"{self.directory}: no best checkpoint (best_metric={self.best_metric!r})",
                    path=self.directory,
                )
            target = best
        elif isinstance(step, int) and not isinstance(step, bool):
            target = step
        else:
            raise ValueError(f"step must be 'latest', 'best' or an int, not {step!r}")
        if target not in steps:
            raise CheckpointNotFoundError(
                f"{self.directory} has no checkpoint for step {target} (it has {steps})",
                path=self.step_path(target),
            )
        checkpoint.load(self.step_path(target), into=into, **load_options)
        return self._resumed(target) if resume else target

    def _resumed(self, step: int) -> int:
        with self._lock:
            self._resumed_from = step
            self._last_saved = step
            self.report.truncate_after(step)
            self.report.lineage.append(
                {
                    "resumed_from": step,
                    "at": now_iso(),
                    "steps_completed_before": self.report.steps_completed,
                }
            )
            self.report.steps_completed = step
            self._write_report()
        return step

    # -- lifecycle -----------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until any background save is committed; raise its error if it failed."""
        if self._async is not None:
            self._async.wait()

    def close(self) -> None:
        """Finish pending saves and write the final report."""
        if self._closed:
            return
        try:
            if self._async is not None:
                self._async.close()
        finally:
            self._closed = True
            with self._lock:
                self._write_report()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the CheckpointManager for {self.directory} is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, retention={self.retention!r})"


def _rank(process_group: Any) -> int:
    if process_group is None:
        return 0
    import torch.distributed as dist

    return int(dist.get_rank(group=process_group))


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """Metrics and configs as the JSON values a reader gets back: numpy and torch scalars become
    Python numbers, tuples lists, and non-finite floats the strings "nan", "inf", "-inf" (not
    numbers, so retention and ranking never pick them, and the files stay standard JSON)."""
    return {str(k): plain_value(v) for k, v in values.items()}
