"""Hugging Face ``accelerate`` on savepoint: ``save_state``/``load_state`` as one checkpoint.

::

    from savepoint.integrations.accelerate import load_state, resume_dataloader, save_state

    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    save_state(accelerator, "s3://bucket/run/step-100", extra={"epoch": 3, "batch": 17})
    ...
    extra = load_state(accelerator, "s3://bucket/run/step-100")
    loader.set_epoch(extra["epoch"])
    for batch in resume_dataloader(accelerator, loader, extra["batch"]): ...

``save_state(accelerator, path)`` writes what ``accelerator.save_state(dir)`` writes, as one
savepoint checkpoint (atomic, every tensor checksummed, any path or URL savepoint takes)::

    models/<i>/...          every prepared model (the bare model's keys: DDP and torch.compile
                            wrappers are looked through, as everywhere in savepoint)
    optimizers/<i>/...      every prepared optimizer (torch's own state_dict layout)
    schedulers/<i>/...      every prepared LR scheduler
    scaler/...              the GradScaler, when the accelerator has one (fp16)
    dataloaders/<i>/...     every prepared DataLoader's position: ``iteration`` (its epoch
                            counter), a ``SeedableRandomSampler``'s ``epoch`` and ``initial_seed``,
                            a shuffling sampler's own ``torch.Generator`` state, a torchdata
                            ``StatefulDataLoader``'s ``state_dict()``
    custom/<i>/...          every object passed to ``accelerator.register_for_checkpointing``
    rng/process_<r>/...     Python ``random``, NumPy's global generator, torch CPU, and every CUDA
                            device's generator, per process (``sp.RNGState``: arrays and ints)
    accelerator/...         ``accelerator.step``, and how many objects of each kind were saved
    extra                   whatever the caller passes as ``extra=`` (loop counters, say)

No pickle: where accelerate pickles (optimizer and scheduler state, RNG tuples, samplers, custom
objects), savepoint stores the same values as tensors and plain values, and anything it cannot
store that way is an ``sp.UnsupportedStateError`` naming its key, raised before anything is
written. ``load_state`` reads everything back in place (tensors straight into the existing
parameters and optimizer state) after checking, before modifying anything, that the checkpoint
matches the prepared objects (counts, keys, shapes, dtypes).

:func:`accelerator_state` is the tree of live objects behind both, for ``sp.CheckpointManager``
runs or background saves: ``mgr.save(step, {"accelerate": accelerator_state(acc), ...})``.

With several processes (DDP over ``MULTI_GPU`` or ``MULTI_CPU``) every process calls the
function: the save is one sharded savepoint checkpoint over the default process group (replicated
models and optimizer state written once, each process's RNG state under its own key), and the
load restores each process's own RNG state. DeepSpeed, FSDP, Megatron-LM and XLA keep their own
checkpoint formats in accelerate and are refused (for FSDP, use ``savepoint.integrations.dcp``).

Exact mid-epoch resume needs the data order of the epoch in progress to be reproducible: prepare
with ``DataLoaderConfiguration(use_seedable_sampler=True)`` (the order of each epoch then depends
only on ``(seed, epoch)``), call ``loader.set_epoch(epoch)`` at the start of each epoch, save the
number of batches consumed in ``extra``, and resume with :func:`resume_dataloader` (which is
``accelerator.skip_first_batches`` with the random generators put back once the skipping loader
has started). See ``docs/integrations.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.data_loader import SeedableRandomSampler, get_sampler

from savepoint.checkpoint import load as sp_load
from savepoint.checkpoint import save as sp_save
from savepoint.engine.load import Verify
from savepoint.errors import DataStateError, StateMismatchError, UnsupportedStateError
from savepoint.info import CheckpointInfo
from savepoint.state.rng import RNGState
from savepoint.storage.paths import PathArg

__all__ = ["accelerator_state", "load_state", "resume_dataloader", "save_state"]

# Distributed types whose checkpoints accelerate delegates to another engine's own format.
_ENGINE_TYPES = {
    "DEEPSPEED": "DeepSpeed saves through its engine's save_checkpoint",
    "FSDP": "FSDP saves sharded state through torch.distributed.checkpoint "
    "(use savepoint.integrations.dcp's SavepointWriter/SavepointReader there)",
    "MEGATRON_LM": "Megatron-LM saves through its own save_checkpoint",
    "XLA": "XLA tensors and generators are saved through torch_xla",
}
# Device types whose generators accelerate saves but savepoint's RNGState does not hold.
_DEVICE_RNG = {"xpu", "mlu", "sdaa", "musa", "hpu", "npu", "neuron", "xla"}


def _distributed_type(accelerator: Any) -> str:
    kind = accelerator.distributed_type
    return str(getattr(kind, "value", kind))


def _check(accelerator: Any, ignore_hooks: bool) -> None:
    kind = _distributed_type(accelerator)
    if kind in _ENGINE_TYPES:
        raise UnsupportedStateError(
            f"accelerate with distributed_type={kind}: {_ENGINE_TYPES[kind]}; "
            "savepoint.integrations.accelerate saves single-process and DDP "
            "(MULTI_GPU, MULTI_CPU) runs"
        )
    device = torch.device(accelerator.device).type
    if device in _DEVICE_RNG:
        raise UnsupportedStateError(
            f"accelerate on a {device!r} device: its random generator would not be saved "
            "(sp.RNGState holds Python, NumPy, torch CPU and CUDA generators), so a resume "
            "could not be exact"
        )
    hooks = {
        "register_save_state_pre_hook": getattr(accelerator, "_save_model_state_pre_hook", None),
        "register_load_state_pre_hook": getattr(accelerator, "_load_model_state_pre_hook", None),
    }
    used = [name for name, registry in hooks.items() if registry]
    if used and not ignore_hooks:
        raise UnsupportedStateError(
            f"the accelerator has hooks from {' and '.join(used)}; accelerate runs them on a "
            "local output directory where they write (and read) files of their own, which a "
            "savepoint checkpoint cannot hold. Register what they save with "
            "accelerator.register_for_checkpointing(obj) instead, or pass ignore_hooks=True "
            "(every prepared model is saved either way)"
        )


def _process_group(accelerator: Any) -> Any:
    if accelerator.num_processes <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UnsupportedStateError(
            f"accelerate reports {accelerator.num_processes} processes but torch.distributed "
            "is not initialised; savepoint's sharded save needs the process group"
        )
    return dist.group.WORLD


_KINDS = ("models", "optimizers", "schedulers", "dataloaders", "custom")


def _objects(accelerator: Any) -> dict[str, list[Any]]:
    return {
        "models": list(accelerator._models),
        "optimizers": list(accelerator._optimizers),
        "schedulers": list(accelerator._schedulers),
        "dataloaders": list(accelerator._dataloaders),
        "custom": list(accelerator._custom_objects),
    }


class _Accelerator:
    """``accelerator.step`` (the gradient-accumulation counter), restored on load, and how many
    objects of each kind were saved (checked on load: a checkpoint with more models, say, than
    the accelerator has prepared is refused rather than partly restored)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        counts = {kind: len(objs) for kind, objs in _objects(self.accelerator).items()}
        return {"step": int(self.accelerator.step), "counts": counts}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


def _torch_generator(sampler: Any) -> Any:
    gen = getattr(sampler, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


class _LoaderState:
    """Where a prepared DataLoader is: what decides the order of its next batches.

    ``iteration`` is accelerate's epoch counter (``DataLoaderShard.set_epoch(iteration)`` runs at
    every ``__iter__``); accelerate itself does not save it, so a resumed run would replay epoch
    0's order. A ``SeedableRandomSampler``'s order depends on ``(initial_seed, epoch)`` only; a
    plain shuffling sampler with a generator of its own draws each epoch's order from that
    generator, whose state is saved. A ``StatefulDataLoader`` (torchdata) has a ``state_dict``.
    """

    def __init__(self, loader: Any, index: int) -> None:
        self.loader = loader
        self.index = index

    def _sampler(self) -> Any:
        try:
            return get_sampler(self.loader)
        except AttributeError:  # an iterable dataset: no sampler
            return None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        iteration = getattr(self.loader, "iteration", None)
        if isinstance(iteration, int):
            state["iteration"] = iteration
        sampler = self._sampler()
        if isinstance(sampler, SeedableRandomSampler):
            state["sampler"] = {
                "epoch": int(sampler.epoch),
                "initial_seed": int(sampler.initial_seed),
            }
        elif (gen := _torch_generator(sampler)) is not None:
            state["generator"] = gen.get_state()
        if getattr(self.loader, "use_stateful_dataloader", False):
            state["state"] = self.loader.state_dict()
        return state

    def problems(self, saved: Any) -> list[tuple[str, str]]:
        """What keeps ``saved`` from restoring into this dataloader: (key, reason) pairs."""
        where = f"dataloaders/{self.index}"
        if not isinstance(saved, Mapping):
            return [(where, f"saved as {type(saved).__name__}, not a dataloader position")]
        have, got = set(self.state_dict()), set(saved)
        out = [
            (f"{where}/{k}", f"saved, but this dataloader has no {_WHAT[k]}")
            for k in sorted(got - have)
            if k in _WHAT
        ]
        out += [
            (f"{where}/{k}", f"this dataloader has a {_WHAT[k]}, the checkpoint does not")
            for k in sorted(have - got)
        ]
        out += [(f"{where}/{k}", "unknown entry") for k in sorted(got - set(_WHAT))]
        return out

    def load_state_dict(self, saved: Any) -> None:
        problems = self.problems(saved)
        if problems:
            raise DataStateError(
                "cannot restore the dataloader position", [f"{k}: {why}" for k, why in problems]
            )
        if "iteration" in saved:
            self.loader.iteration = int(saved["iteration"])
        sampler = self._sampler()
        if "sampler" in saved:
            sampler.epoch = int(saved["sampler"]["epoch"])
            sampler.initial_seed = int(saved["sampler"]["initial_seed"])
        if "generator" in saved:
            value = saved["generator"]
            if not isinstance(value, torch.Tensor):
                value = torch.as_tensor(value)
            _torch_generator(sampler).set_state(value.to(torch.uint8).cpu())
        if "state" in saved:
            self.loader.load_state_dict(saved["state"])


_WHAT = {
    "iteration": "epoch counter (iteration)",
    "sampler": "SeedableRandomSampler",
    "generator": "shuffling sampler with its own torch.Generator",
    "state": "StatefulDataLoader state",
}


def accelerator_state(
    accelerator: Any, *, strict: bool = True, ignore_hooks: bool = False
) -> dict[str, Any]:
    """The tree of live objects ``save_state`` saves and ``load_state`` restores in place.

    Pass it to ``sp.save``/``sp.load(into=...)``, a ``CheckpointManager`` or an
    ``AsyncCheckpointer`` (alone or inside a bigger state). ``strict`` is ``RNGState``'s: with
    False a checkpoint saved with CUDA restores on a machine without it (the rest is restored).
    With several processes, save and load it with ``process_group=`` (``save_state`` does).
    """
    _check(accelerator, ignore_hooks)
    rng = RNGState(strict=strict)
    process = int(accelerator.process_index)
    rngs: Any = {f"process_{process}": rng}
    if accelerator.num_processes > 1:
        from savepoint.distributed import Partitioned

        rngs = Partitioned(rngs)
    # Dicts keyed by position rather than lists: a target with more objects than the checkpoint
    # is then a StateMismatchError (a list would be replaced wholesale).
    objects = _objects(accelerator)
    objects["dataloaders"] = [_LoaderState(dl, i) for i, dl in enumerate(objects["dataloaders"])]
    state: dict[str, Any] = {kind: dict(enumerate(objects[kind])) for kind in _KINDS}
    state["rng"] = rngs
    state["accelerator"] = _Accelerator(accelerator)
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    return state


def _metadata(accelerator: Any, user: Mapping[str, Any] | None) -> dict[str, Any]:
    accelerate = sys.modules["accelerate"]
    meta = dict(user or {})
    meta["accelerate"] = {
        "version": str(getattr(accelerate, "__version__", "?")),
        "distributed_type": _distributed_type(accelerator),
        "num_processes": int(accelerator.num_processes),
        "mixed_precision": str(accelerator.mixed_precision),
        "step": int(accelerator.step),
    }
    return meta


def save_state(
    accelerator: Any,
    path: PathArg,
    *,
    extra: Any = None,
    metadata: Mapping[str, Any] | None = None,
    ignore_hooks: bool = False,
    **options: Any,
) -> CheckpointInfo:
    """Save everything ``accelerator.save_state`` saves as one savepoint checkpoint at ``path``.

    ``extra`` (any tree savepoint stores: loop counters, a data position) is saved in the same
    commit and returned by :func:`load_state`. ``metadata`` goes into the manifest, with an
    ``"accelerate"`` entry added (version, distributed type, processes, step). ``options`` are
    ``sp.save``'s (``max_file_bytes``, ``writers``, ``direct``, ``progress``, ``timeout``).

    Raises ``sp.UnsupportedStateError`` before writing anything if a value cannot be stored
    without pickle (a scheduler or registered object whose ``state_dict()`` holds arbitrary
    objects), for DeepSpeed/FSDP/Megatron-LM/XLA runs, and if save/load-state hooks are
    registered (``ignore_hooks=True`` saves without running them).
    """
    state = accelerator_state(accelerator, ignore_hooks=ignore_hooks)
    state["extra"] = extra
    group = _process_group(accelerator)
    try:
        return sp_save(
            path, state, metadata=_metadata(accelerator, metadata), process_group=group, **options
        )
    except UnsupportedStateError as exc:
        if "pickle" in str(exc):
            raise
        raise UnsupportedStateError(
            f"{exc}\n(accelerate would pickle this value; savepoint stores tensors, arrays and "
            "plain values only, and never unpickles on load: make its state_dict() return those)",
            key=exc.key,
        ) from exc


def load_state(
    accelerator: Any,
    path: PathArg,
    *,
    strict: bool = True,
    verify: Verify = True,
    ignore_hooks: bool = False,
    timeout: float | None = None,
) -> Any:
    """Restore a checkpoint written by :func:`save_state` into the prepared objects; return the
    ``extra`` tree that was saved with it (None if none).

    Every model, optimizer, scheduler, scaler, dataloader position, registered object, the RNG
    states of this process and ``accelerator.step`` come back. The checkpoint must hold the same
    numbers of each as the accelerator has now; a mismatch (counts, keys, shapes, dtypes, a
    dataloader of another kind) is reported before anything is modified. ``strict=False``
    restores the RNG states that can be restored (a CUDA checkpoint on a CPU machine) instead of
    refusing. ``verify`` is ``sp.load``'s.
    """
    state = accelerator_state(accelerator, strict=strict, ignore_hooks=ignore_hooks)
    group = _process_group(accelerator)
    saved = sp_load(path, keys=["accelerator", "dataloaders", "extra"], verify=verify)
    problems: list[tuple[str, str]] = []
    counts = saved["accelerator"].get("counts", {})
    for kind in _KINDS:
        have = len(state[kind])
        if counts.get(kind, have) != have:
            problems.append(
                (kind, f"the checkpoint has {counts[kind]}, the accelerator has {have} prepared")
            )
    if not problems:
        for i, target in state["dataloaders"].items():
            problems += target.problems(saved["dataloaders"].get(i))
    if problems:
        raise StateMismatchError(problems, path=str(path))
    sp_load(path, into=state, verify=verify, process_group=group, timeout=timeout)
    return saved.get("extra")


class _Resumed:
    """``accelerator.skip_first_batches(loader, n)`` whose iteration puts the random generators
    back after the loader has started (see :func:`resume_dataloader`)."""

    def __init__(self, accelerator: Any, dataloader: Any, num_batches: int) -> None:
        self.dataloader = accelerator.skip_first_batches(dataloader, num_batches)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["dataloader"], name)

    def __iter__(self) -> Any:
        rng = RNGState()
        before = rng.state_dict()
        batches = iter(self.dataloader)
        try:
            first = next(batches)
        except StopIteration:
            return
        rng.load_state_dict(before)
        yield first
        yield from batches


def resume_dataloader(accelerator: Any, dataloader: Any, num_batches: int) -> Any:
    """The rest of an epoch a checkpoint was saved in the middle of: the ``dataloader``'s batches
    after the first ``num_batches``, with the random generators exactly where the saved run had
    them.

    ``accelerator.skip_first_batches`` alone is not exact: starting a DataLoader's iterator draws
    a seed from torch's global generator, which the saved run did at the start of the epoch,
    before the generator state the checkpoint holds. This iterable starts the skipping loader,
    then restores the generators as they were when its iteration began (after ``load_state``,
    the checkpoint's), so the next dropout masks, noise and shuffles match the run that never
    stopped (as ``transformers.Trainer`` does when it resumes). With ``num_batches=0`` the
    ``dataloader`` itself is returned. The data order of the epoch must be reproducible: prepare
    with ``DataLoaderConfiguration(use_seedable_sampler=True)`` and call
    ``dataloader.set_epoch(epoch)`` before each epoch. With ``num_workers > 0``, the workers'
    seeds derive from the drawn seed and differ from the saved run's.
    """
    if num_batches <= 0:
        return dataloader
    return _Resumed(accelerator, dataloader, num_batches)
