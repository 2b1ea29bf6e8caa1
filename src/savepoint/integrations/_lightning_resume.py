"""Exact resume under Lightning: :class:`ExactResume`, a callback (re-exported by
:mod:`savepoint.integrations.lightning`; see its docstring and ``docs/integrations.md``).

Lightning's checkpoints hold the weights, the optimizers, the loops' counters, but neither the
random generators nor where the training data loader is in its epoch: a run resumed from a
checkpoint saved mid-epoch restarts the epoch's batches, and every dropout mask, shuffle and
augmentation after a resume differs from the run that never stopped. This callback adds both to
every checkpoint (through Lightning's callback state, so with any ``CheckpointIO``) and puts them
back when the resumed fit starts:

- the random generators (``sp.RNGState``: Python, NumPy, torch CPU and CUDA, and the
  ``torch.Generator`` of each training loader and of its sampler, if it has one), as they are
  when the checkpoint is taken;
- the position of each training loader whose sampler is an ``sp.ResumableSampler`` (its order
  depends only on ``(seed, epoch)``): the samples trained on in the epoch in progress, counted
  from Lightning's batch counter (not from the sampler, which a loader with workers runs ahead).

Timing, which is what makes the resume exact. The checkpoint's positions are checked and the
samplers restored in ``on_train_start`` of the resumed fit (a loader that cannot resume raises
there, before any training); the generators are restored immediately before the first batch is
fetched, after everything Lightning does when a fit resumes (when the checkpoint was followed by
a validation, Lightning skips it but still creates the validation loader's iterator, which draws
a seed from torch's generator). Mid-epoch, the training loader's iterator (created by Lightning
when the fit started) is created again first when the loader has workers, which took indices
from the sampler before its position was back; between epochs the generators are restored first
and the iterator created after them, as the run that never stopped created it. And validation
inside ``fit`` leaves the generators as it found them (as Lightning already does for its sanity
check): the run that never stopped validates after a checkpoint that Lightning's resume then
skips, so its draws would otherwise be in one run and not in the other. (So with the callback
the training batches after a validation draw other random numbers than without it: validation
no longer shifts them.)
"""

from __future__ import annotations

import warnings
from typing import Any

from savepoint.errors import DataStateError, UnsupportedStateError
from savepoint.state.data import ResumableSampler
from savepoint.state.rng import RNGState

__all__ = ["ExactResume", "lightning_classes"]

_VERSION = 1


def lightning_classes(name: str, unified: str, standalone: str) -> tuple[type, ...]:
    """Class ``name`` from each installed Lightning package (``unified``: its module in the
    ``lightning`` package, ``standalone``: in ``pytorch_lightning``/``lightning_fabric``), so
    savepoint's classes work with either; ImportError naming what to install if neither is."""
    import importlib

    found: list[type] = []
    for module in (unified, standalone):
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError:
            continue
        if cls not in found:
            found.append(cls)
    if not found:
        raise ImportError(
            "savepoint.integrations.lightning needs Lightning: pip install lightning "
            "(or pytorch-lightning)"
        )
    return tuple(found)


def _callback_bases() -> tuple[type, ...]:
    return lightning_classes(
        "Callback", "lightning.pytorch.callbacks", "pytorch_lightning.callbacks"
    )


def _loaders(trainer: Any) -> list[Any]:
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return list(combined.flattened) if combined is not None else []


def _stateful(loader: Any) -> bool:
    """A loader Lightning saves and restores itself (torchdata's ``StatefulDataLoader``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def _sampler(loader: Any) -> ResumableSampler | None:
    for sampler in (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        if isinstance(sampler, ResumableSampler):
            return sampler
    return None


def _batch_size(loader: Any) -> int | None:
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _generators(loaders: list[Any]) -> dict[str, Any]:
    import torch

    found: dict[str, Any] = {}
    for i, loader in enumerate(loaders):
        for name, gen in (
            (f"loader_{i}", getattr(loader, "generator", None)),
            (f"sampler_{i}", getattr(getattr(loader, "sampler", None), "generator", None)),
        ):
            if isinstance(gen, torch.Generator):
                found[name] = gen
    return found


def _position(trainer: Any) -> tuple[int, int, int]:
    """(epoch in progress, batches of it trained, batches per epoch) as Lightning counts them."""
    epoch = int(trainer.fit_loop.epoch_progress.current.processed)
    done = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
    per_epoch = trainer.num_training_batches
    total = int(per_epoch) if per_epoch != float("inf") else -1
    return epoch, done, total


def _as_tensors(tree: Any) -> Any:
    """NumPy arrays as torch tensors: Lightning's own ``TorchCheckpointIO`` loads with
    ``torch.load(weights_only=True)``, which takes tensors but not NumPy arrays."""
    import numpy as np
    import torch

    if isinstance(tree, dict):
        return {k: _as_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_as_tensors(v) for v in tree]
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(tree))
    return tree


def _mid_epoch(done: int, total: int) -> bool:
    return done > 0 and (total < 0 or done < total)


class ExactResume(*_callback_bases()):  # type: ignore[misc]
    """A Lightning callback that makes a resumed ``fit`` continue exactly as the run that never
    stopped: the random generators and the training loader's position go into every checkpoint
    and come back when a fit resumes from one (see the module docstring).

    ::

        loader = DataLoader(dataset, batch_size=32, sampler=sp.ResumableSampler(dataset, seed=0))
        trainer = Trainer(plugins=[SavepointCheckpointIO()],
                          callbacks=[ModelCheckpoint(every_n_train_steps=500), ExactResume()])

    Mid-epoch resume needs a training loader whose position can be restored: an
    ``sp.ResumableSampler`` (as ``sampler=``, or under a ``batch_sampler``), or a loader
    Lightning restores itself (one with ``state_dict``/``load_state_dict``, torchdata's
    ``StatefulDataLoader``). Resuming mid-epoch with any other loader raises
    ``sp.DataStateError`` when the fit starts (Lightning would silently replay the epoch's first
    batches); checkpoints saved between epochs resume exactly with any sampler. Single-process
    runs only (each rank of a multi-process run has its own generators).
    """

    def __init__(self) -> None:
        self._trainer: Any = None
        self._pending: dict[str, Any] | None = None
        self._before_validation: dict[str, Any] | None = None
        self._warned = False

    @property
    def state_key(self) -> str:
        return "savepoint.ExactResume"

    # -- saving ------------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if int(getattr(trainer, "world_size", 1)) > 1:
            raise UnsupportedStateError(
                f"ExactResume saves one process's random generators; this run has "
                f"{trainer.world_size} processes"
            )
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None:
            return {}
        loaders = _loaders(trainer)
        epoch, done, total = _position(trainer)
        samplers: dict[str, Any] = {}
        unresumable: list[str] = []
        mid = _mid_epoch(done, total)
        for i, loader in enumerate(loaders):
            sampler, size = _sampler(loader), _batch_size(loader)
            if sampler is not None and size is not None:
                state = sampler.state_dict()
                if mid:
                    state["epoch"] = epoch
                    state["index"] = min(done * size, sampler.num_samples)
                samplers[str(i)] = state
            elif mid and not _stateful(loader):
                unresumable.append(str(i))
        if unresumable and not self._warned:
            self._warned = True
            warnings.warn(
                f"ExactResume: a checkpoint taken mid-epoch (batch {done} of epoch {epoch}) of a "
                f"training loader whose position cannot be restored (loader(s) "
                f"{', '.join(unresumable)}: use sampler=sp.ResumableSampler(dataset, ...)); a fit "
                "resumed from it will be refused",
                stacklevel=2,
            )
        return {
            "version": _VERSION,
            "rng": _as_tensors(RNGState(generators=_generators(loaders)).state_dict()),
            "position": {"epoch": epoch, "batches": done, "epoch_batches": total},
            "samplers": samplers,
        }

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        # What a validation after this batch must leave behind (about 0.3 ms: only with one).
        if getattr(trainer, "enable_validation", True):
            self._before_validation = RNGState().state_dict()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        saved, self._before_validation = self._before_validation, None
        fitting = str(getattr(trainer.state.fn, "value", trainer.state.fn)) == "fit"
        if saved is not None and fitting and not trainer.sanity_checking:
            RNGState().load_state_dict(saved)

    # -- resuming ----------------------------------------------------------------------------

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("callbacks") or {}
        if self.state_key not in states:
            warnings.warn(
                "ExactResume: this checkpoint was saved without ExactResume (no random "
                "generators, no loader position); the fit resumes as Lightning alone does, not "
                "exactly",
                stacklevel=2,
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _VERSION:
            raise DataStateError(
                "cannot resume exactly",
                [
                    f"ExactResume state version {state_dict.get('version')!r}; this savepoint "
                    f"reads version {_VERSION}"
                ],
            )
        self._pending = dict(state_dict)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        state, self._pending = self._pending, None
        if state is None:
            return
        loaders = _loaders(trainer)
        position = state["position"]
        done, total = int(position["batches"]), int(position["epoch_batches"])
        mid = _mid_epoch(done, total)
        samplers = state.get("samplers") or {}
        problems: list[str] = []
        restore: list[tuple[ResumableSampler, Any]] = []
        for i, loader in enumerate(loaders):
            sampler = _sampler(loader)
            if sampler is not None and str(i) in samplers:
                restore.append((sampler, samplers[str(i)]))
            elif mid and not _stateful(loader):
                problems.append(
                    f"training loader {i}: the checkpoint was taken at batch {done} of "
                    f"{total} of epoch {position['epoch']}, and its sampler "
                    f"({type(getattr(loader, 'sampler', None)).__name__}) cannot start there; "
                    "use sampler=sp.ResumableSampler(dataset, shuffle=..., seed=...) in both "
                    "runs, or resume from a checkpoint taken between epochs"
                )
        if problems:
            raise DataStateError("cannot resume exactly mid-epoch", problems)
        rng = RNGState(generators=_generators(loaders))
        saved_rng = state["rng"]
        rng.load_state_dict(saved_rng)  # checked (and applied) now; again at the first fetch
        for sampler, saved in restore:
            sampler.load_state_dict(saved)
        if any(_stateful(dl) for dl in loaders):
            recreate = False  # Lightning restored it into the iterator it created
        elif mid:
            # The workers took indices from the sampler when Lightning created the iterator.
            recreate = any(getattr(dl, "num_workers", 0) for dl in loaders)
        else:
            recreate = True  # the epoch's iterator, created after the restored state

        def first_fetch(fetcher: Any) -> None:
            if mid:
                if recreate:
                    _recreate(fetcher)
                rng.load_state_dict(saved_rng)
            else:
                rng.load_state_dict(saved_rng)
                if recreate:
                    _recreate(fetcher)

        if not _before_first_fetch(trainer, first_fetch):
            fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
            if fetcher is not None:
                first_fetch(fetcher)


def _recreate(fetcher: Any) -> None:
    """Create the training data fetcher's iterator again, keeping Lightning's counts (the
    iterator's own length may have changed: a restored ``ResumableSampler`` counts what is left)."""
    fetched, length = fetcher.fetched, fetcher.length
    iter(fetcher)
    fetcher.fetched, fetcher.length, fetcher.done = fetched, length, length == 0


def _before_first_fetch(trainer: Any, action: Any) -> bool:
    """Run ``action(fetcher)`` immediately before the training loop fetches its next batch:
    after everything Lightning does when a fit starts or resumes (when it resumes from a
    checkpoint taken before a validation, it skips that validation but still creates its loader's
    iterator, which draws from torch's generator). False if this Lightning has no such point."""
    loop = trainer.fit_loop.epoch_loop
    original = getattr(loop, "_on_before_fetch", None)
    if original is None or getattr(trainer.fit_loop, "_data_fetcher", None) is None:
        return False

    def hook() -> None:
        loop.__dict__.pop("_on_before_fetch", None)
        fetcher = trainer.fit_loop._data_fetcher
        fetcher._start_profiler = original
        action(fetcher)
        original()

    loop._on_before_fetch = hook  # the epoch loop hands it to the fetcher when it starts
    return True
