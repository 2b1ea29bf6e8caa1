"""Hugging Face ``transformers.Trainer`` on savepoint: checkpoints and exact resume.

::

    from savepoint.integrations.transformers import SavepointCallback, SavepointTrainer

    trainer = SavepointTrainer(model=model, args=args, train_dataset=ds)   # a Trainer
    trainer.train()                                   # output_dir/checkpoint-<step>: savepoint
    trainer.train(resume_from_checkpoint=True)        # later, new process: exact resume

    # or keep your Trainer class and add the callback:
    trainer = Trainer(..., callbacks=[SavepointCallback()])
    trainer.train()
    SavepointCallback.resume(trainer)                 # = trainer.train(resume_from_checkpoint=...)

Each Trainer save event (``save_steps``, ``save_strategy``, best-model saves) writes one savepoint
checkpoint, ``output_dir/checkpoint-<global_step>``, the directory Trainer would have written,
holding what Trainer's own checkpoint holds for a resume::

    model/...            the model's state_dict (tied weights stored once, restored tied)
    optimizer/...        the optimizer (torch's state_dict layout)
    scheduler/...        the LR scheduler
    scaler/...           the GradScaler, with fp16 mixed precision
    rng/process_0/...    Python ``random``, NumPy, torch CPU and CUDA generators (``sp.RNGState``)
    trainer_state        ``TrainerState`` as the JSON text of Trainer's ``trainer_state.json``:
                         global_step, epoch, log_history, best metric and checkpoint, stateful
                         callbacks' states

plus the model's config and the TrainingArguments as JSON in the manifest's metadata
(``metadata["transformers"]``). With ``save_only_model=True`` only the model and the trainer state
are saved, as Trainer does. Nothing is pickled (Trainer pickles the optimizer, scheduler, RNG state
and ``training_args.bin``): every array is a checksummed tensor, every other value JSON.
Retention (``save_total_limit``), the best checkpoint (``load_best_model_at_end``) and
``get_last_checkpoint`` keep working: they only look at the ``checkpoint-<step>`` names.

Why a Trainer subclass, and what the callback does alone. A ``TrainerCallback`` runs after
Trainer has written its own checkpoint and cannot stop it, nor change how Trainer resumes (which
reads fixed file names). So:

- :class:`SavepointTrainer` (a ``Trainer``; put it first in the bases of your own Trainer
  subclass: ``class MyTrainer(SavepointTrainer, SFTTrainer)``) writes the savepoint checkpoint
  *instead of* Trainer's files, and its ``train(resume_from_checkpoint=...)`` takes savepoint
  checkpoints (a path or URL, or True for the newest one in ``output_dir``), and Trainer's own
  checkpoints as before.
- :class:`SavepointCallback` on a plain ``Trainer`` replaces, at each save event, the directory
  Trainer just wrote with the savepoint checkpoint (Trainer's files are moved aside, the savepoint
  checkpoint committed in their place, then the old files deleted), so the output directory is
  the same; Trainer's own write still costs its time. The usual resume works on such a trainer:
  importing this module wraps ``Trainer.train`` so that, on a trainer carrying a
  ``SavepointCallback`` (however it was added), ``train(resume_from_checkpoint=True)`` takes the
  newest savepoint checkpoint of ``output_dir`` and ``train(resume_from_checkpoint=path_or_url)``
  a savepoint checkpoint, through the same reads as :class:`SavepointTrainer`; every other trainer
  and every other argument go to Trainer's ``train`` unchanged. (Trainer finds and opens its
  checkpoint inside ``train``, before any callback event, and reads fixed file names: a callback
  alone cannot take part.) :meth:`SavepointCallback.resume` does the same explicitly.

A savepoint checkpoint is not a ``from_pretrained`` directory (``from_pretrained`` needs
``config.json`` and ``model.safetensors``, which would be a second copy of the weights in every
checkpoint): :func:`export_pretrained` writes that directory from any checkpoint of this module
(the model config recorded in its metadata and the weights, tied ones once, as
``save_pretrained`` does).

Resuming goes through Trainer's own resume logic, so it is exactly Trainer's: the trainer state is
restored, the data loader skips the batches already trained on in the current epoch, and the RNG
states are restored after that skip. savepoint supplies the reads: the model, optimizer,
scheduler, scaler and RNG state come from the savepoint checkpoint (read in place, checksums
verified), and the trainer state is handed to Trainer as a ``trainer_state.json`` in a temporary
directory that stands for the checkpoint during ``train`` (Trainer reads that file by name). With
``seed``, ``data_seed`` and ``dataloader_num_workers=0`` the resumed run's parameters, optimizer
state and losses equal the uninterrupted run's bit for bit.

Single process only: DeepSpeed, FSDP and multi-process (DDP) Trainer runs are refused with
``sp.UnsupportedStateError`` (their checkpoints are written by other engines, or per rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from savepoint.checkpoint import inspect as sp_inspect
from savepoint.checkpoint import load as sp_load
from savepoint.checkpoint import save as sp_save
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)
from savepoint.info import CheckpointInfo
from savepoint.state.rng import RNGState
from savepoint.storage.paths import PathArg

__all__ = [
    "SavepointCallback",
    "SavepointTrainer",
    "export_pretrained",
    "is_savepoint_checkpoint",
    "last_checkpoint",
]

TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_RNG = "process_0"


# -- what a checkpoint holds ---------------------------------------------------------------------


def _check_supported(args: Any, trainer: Any = None) -> None:
    why = []
    if getattr(args, "world_size", 1) > 1:
        why.append(f"{args.world_size} processes (every rank has its own RNG state)")
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        why.append("DeepSpeed (its engine writes its own checkpoint)")
    if getattr(args, "fsdp", None) or getattr(trainer, "is_fsdp_enabled", False):
        why.append("FSDP (sharded state, written through torch.distributed.checkpoint)")
    if why:
        raise UnsupportedStateError(
            "savepoint's Trainer integration saves single-process runs; this run uses "
            + " and ".join(why)
        )


def _trainer_state_json(state: Any) -> str:
    """``TrainerState`` exactly as Trainer writes ``trainer_state.json``."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _json_or_none(to_json: Any) -> Any:
    try:
        return json.loads(to_json())
    except (TypeError, ValueError, AttributeError):
        return None


def _write(
    path: PathArg,
    *,
    args: Any,
    state: Any,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    metadata: Mapping[str, Any] | None,
    options: Mapping[str, Any],
) -> CheckpointInfo:
    tree: dict[str, Any] = {"model": model}
    if not args.save_only_model:
        if optimizer is not None:
            tree["optimizer"] = optimizer
        if scheduler is not None:
            tree["scheduler"] = scheduler
        if scaler is not None:
            tree["scaler"] = scaler
        tree["rng"] = {_RNG: RNGState()}
    tree["trainer_state"] = _trainer_state_json(state)
    import transformers

    config = getattr(model, "config", None)
    meta = dict(metadata or {})
    meta["transformers"] = {
        "version": transformers.__version__,
        "global_step": int(state.global_step),
        "epoch": state.epoch,
        "model_class": type(model).__name__,
        "config": _json_or_none(getattr(config, "to_json_string", None)),
        "training_args": _json_or_none(getattr(args, "to_json_string", None)),
        "contents": sorted(tree),
    }
    return sp_save(path, tree, metadata=meta, **options)


def is_savepoint_checkpoint(path: PathArg) -> bool:
    """Whether ``path`` holds a committed savepoint checkpoint (written by this module or not):
    not another format ``sp.inspect`` reads too (Trainer's own checkpoint directory holds a
    ``model.safetensors``, which makes it a Hugging Face model directory)."""
    try:
        return sp_inspect(path).format == "savepoint"
    except (CheckpointError, OSError):
        return False


def last_checkpoint(output_dir: str) -> str | None:
    """The ``checkpoint-<step>`` directory of ``output_dir`` with the highest step that holds a
    savepoint checkpoint (Trainer-format directories are skipped), or None."""
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return None
    steps = sorted(
        ((int(m.group(1)), name) for name in names if (m := _CHECKPOINT.match(name))),
        reverse=True,
    )
    for _, name in steps:
        path = os.path.join(output_dir, name)
        if is_savepoint_checkpoint(path):
            return path
    return None


def _contents(path: PathArg) -> set[str]:
    meta = sp_inspect(path).metadata.get("transformers")
    if not isinstance(meta, Mapping) or not isinstance(meta.get("contents"), list):
        raise IncompatibleCheckpointError(
            f"{path}: not a savepoint checkpoint of a transformers Trainer (no "
            "metadata['transformers']); write it with SavepointTrainer or SavepointCallback",
            path=str(path),
        )
    return set(meta["contents"])


# -- resuming through Trainer's own resume logic -------------------------------------------------


@contextlib.contextmanager
def _resuming(trainer: Any, source: PathArg) -> Iterator[str]:
    """Make ``trainer.train(resume_from_checkpoint=<the yielded directory>)`` resume from the
    savepoint checkpoint ``source``.

    Trainer reads ``trainer_state.json`` from the checkpoint directory by name, so the trainer
    state is written there, in a temporary directory; the model, optimizer, scheduler, scaler and
    RNG state are read from ``source`` by the trainer's loading methods, replaced on this instance
    for the duration (the class is untouched)."""
    _check_supported(trainer.args, trainer)
    contents = _contents(source)
    text = sp_load(source, keys=["trainer_state"])["trainer_state"]
    if not isinstance(text, str):
        raise IncompatibleCheckpointError(
            f"{source}: trainer_state is {type(text).__name__}, not JSON text", path=str(source)
        )
    local = tempfile.mkdtemp(prefix="savepoint-resume-")
    with open(os.path.join(local, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
        f.write(text)

    def load_model(checkpoint: str, model: Any = None) -> None:
        sp_load(source, into={"model": trainer.model if model is None else model})

    def load_optimizer_and_scheduler(checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        into = {}
        if "optimizer" in contents:
            into["optimizer"] = trainer.optimizer
        if "scheduler" in contents:
            into["scheduler"] = trainer.lr_scheduler
        if into:
            sp_load(source, into=into)

    def load_scaler(checkpoint: str | None) -> None:
        scaler = getattr(trainer.accelerator, "scaler", None)
        if checkpoint is not None and scaler is not None and "scaler" in contents:
            sp_load(source, into={"scaler": scaler})

    def load_rng_state(checkpoint: str | None) -> None:
        if checkpoint is not None and "rng" in contents:
            sp_load(source, into={"rng": {_RNG: RNGState()}})

    patches = {
        "_load_from_checkpoint": load_model,
        "_load_optimizer_and_scheduler": load_optimizer_and_scheduler,
        "_load_scaler": load_scaler,
        "_load_rng_state": load_rng_state,
    }
    trainer.__dict__.update(patches)
    try:
        yield local
    finally:
        for name in patches:
            trainer.__dict__.pop(name, None)
        shutil.rmtree(local, ignore_errors=True)


def _none_found(output_dir: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"No savepoint checkpoint found in output directory ({output_dir}), and no Trainer "
        "checkpoint either: train first, or pass resume_from_checkpoint=<a checkpoint's path>",
        path=str(output_dir),
    )


def _resume_source(trainer: Any, checkpoint: Any) -> PathArg:
    if checkpoint is None or checkpoint is True:
        found = last_checkpoint(trainer.args.output_dir)
        if found is None:
            raise _none_found(trainer.args.output_dir)
        return found
    return checkpoint  # type: ignore[no-any-return]


def _train(trainer: Any, train: Any, resume: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
    """``train(resume_from_checkpoint=resume, *args, **kwargs)`` of Trainer, with savepoint
    checkpoints for ``resume``: True takes the newest savepoint checkpoint of ``output_dir`` (the
    newest Trainer checkpoint when there is none), a path or URL of a savepoint checkpoint is
    read through :func:`_resuming`, a Trainer-format directory goes to Trainer as it is."""
    if resume is None or resume is False:
        return train(None, *args, **kwargs)
    if resume is True:
        found = last_checkpoint(trainer.args.output_dir)
        if found is None:
            if _trainer_checkpoint(trainer.args.output_dir) is None:
                raise _none_found(trainer.args.output_dir)
            return train(True, *args, **kwargs)
        source: PathArg = found
    else:
        source = resume
        if (
            isinstance(source, (str, os.PathLike))
            and os.path.isdir(source)
            and not is_savepoint_checkpoint(source)
        ):
            # A Trainer-format checkpoint: Trainer reads it.
            return train(os.fspath(source), *args, **kwargs)
    with _resuming(trainer, source) as local:
        return train(local, *args, **kwargs)


def _trainer_checkpoint(output_dir: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    try:
        found = get_last_checkpoint(output_dir)  # type: ignore[no-untyped-call]
    except OSError:
        return None
    return None if found is None else str(found)


def _has_callback(trainer: Any) -> bool:
    handler = getattr(trainer, "callback_handler", None)
    return any(isinstance(cb, SavepointCallback) for cb in getattr(handler, "callbacks", ()))


def _wrap_trainer_train() -> None:
    """Route ``Trainer.train(resume_from_checkpoint=...)`` of trainers carrying a
    :class:`SavepointCallback` through :func:`_train` (see the module docstring); idempotent."""
    original = Trainer.train
    if getattr(original, "_savepoint_wrapped", False):
        return

    @functools.wraps(original)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, SavepointTrainer) or not _has_callback(self):
            return original(self, resume_from_checkpoint, *args, **kwargs)
        return _train(self, functools.partial(original, self), resume_from_checkpoint, args, kwargs)

    train._savepoint_wrapped = True  # type: ignore[attr-defined]
    Trainer.train = train  # type: ignore[method-assign]


def export_pretrained(
    checkpoint: PathArg, directory: str | os.PathLike[str], *, overwrite: bool = False
) -> str:
    """Write a ``from_pretrained`` directory (``config.json`` and ``model.safetensors``) from a
    savepoint checkpoint written by :class:`SavepointTrainer` or :class:`SavepointCallback`
    (any path or URL): the model config recorded in the checkpoint's metadata, and the weights of
    its ``model`` part under their ``state_dict`` names, tied weights stored once as
    ``save_pretrained`` does (``from_pretrained`` re-ties them). Returns the directory.

    Raises ``IncompatibleCheckpointError`` for a checkpoint without a recorded model config
    (not written through this module), ``CheckpointWriteError`` when ``model.safetensors`` exists
    and not ``overwrite``; nothing is written then."""
    from savepoint.formats.export import export

    meta = sp_inspect(checkpoint).metadata.get("transformers")
    config = meta.get("config") if isinstance(meta, Mapping) else None
    if not isinstance(config, Mapping):
        raise IncompatibleCheckpointError(
            f"{checkpoint}: no model config in the checkpoint's metadata['transformers'] (it was "
            "not written by SavepointTrainer or SavepointCallback); export the weights with "
            "`savepoint export CKPT model.safetensors` and add the model's config.json yourself",
            path=str(checkpoint),
        )
    from savepoint.commit.atomic import replace_file
    from savepoint.commit.transaction import write_error
    from savepoint.storage.local import STORE

    out = os.path.abspath(os.fspath(directory))
    export(checkpoint, os.path.join(out, "model.safetensors"), subtree="model", overwrite=overwrite)
    target = os.path.join(out, "config.json")
    try:
        replace_file(target, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise write_error(STORE, target, exc, what="config.json") from exc
    return out


def _load_best(model: Any, best: str) -> bool:
    """Load the model of the savepoint checkpoint ``best`` into ``model``; False if ``best`` is
    not a savepoint checkpoint."""
    if not is_savepoint_checkpoint(best):
        return False
    sp_load(best, into={"model": model})
    return True


# -- the callback --------------------------------------------------------------------------------


class SavepointCallback(TrainerCallback):
    """Write a savepoint checkpoint at each of Trainer's save events, into
    ``output_dir/checkpoint-<global_step>``.

    On a plain ``Trainer`` the callback runs after Trainer has written its own checkpoint there
    and replaces it: Trainer's files are moved aside, the savepoint checkpoint is committed in
    their place (atomic: a crash leaves the savepoint checkpoint complete or absent), and the old
    files are deleted. With :class:`SavepointTrainer` Trainer writes nothing and the callback's
    checkpoint is the only write. With ``load_best_model_at_end`` the callback loads the best
    checkpoint's model at the end of training (a plain Trainer cannot read it).

    ``metadata`` (JSON) is stored in each manifest next to ``metadata["transformers"]``;
    ``options`` are ``sp.save``'s (``max_file_bytes``, ``writers``, ``direct``, ``progress``).
    Resume with :meth:`resume`, or ``SavepointTrainer.train(resume_from_checkpoint=...)``.
    """

    def __init__(self, *, metadata: Mapping[str, Any] | None = None, **options: Any) -> None:
        self.metadata = dict(metadata or {})
        self.options = dict(options)
        self.last_info: CheckpointInfo | None = None
        self._trainer_wrote = False  # SavepointTrainer wrote this save event's checkpoint
        self._best_loaded: str | None = None  # and loaded this best model

    def write(
        self,
        path: PathArg,
        *,
        args: Any,
        state: Any,
        model: Any,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        scaler: Any = None,
    ) -> CheckpointInfo:
        """Write one checkpoint of this training state to ``path`` (any path or URL)."""
        _check_supported(args)
        if scaler is None:
            scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer
        info = _write(
            path,
            args=args,
            state=state,
            model=model,
            optimizer=optimizer,
            scheduler=lr_scheduler,
            scaler=scaler,
            metadata=self.metadata,
            options=self.options,
        )
        self.last_info = info
        return info

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _check_supported(args)

    def on_save(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        if self._trainer_wrote:
            self._trainer_wrote = False
            return
        if not args.should_save:
            return
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        aside = None
        if os.path.isdir(path) and not is_savepoint_checkpoint(path):
            # Trainer's own files: make room for the savepoint checkpoint.
            aside = os.path.join(
                args.output_dir, f".{os.path.basename(path)}.trainer-{uuid.uuid4().hex[:8]}"
            )
            os.rename(path, aside)
        try:
            self.write(
                path,
                args=args,
                state=state,
                model=model,
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
            )
        except BaseException:
            if aside is not None and not os.path.exists(path):
                os.rename(aside, path)
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        best = state.best_model_checkpoint
        if (
            args.load_best_model_at_end
            and best is not None
            and model is not None
            and self._best_loaded != best
        ):
            _load_best(model, best)
        self._best_loaded = None

    @staticmethod
    def resume(trainer: Any, checkpoint: PathArg | bool | None = None, **train_kwargs: Any) -> Any:
        """Resume ``trainer`` (any ``Trainer``) from a savepoint checkpoint and train on: the
        newest one in ``output_dir`` by default, or ``checkpoint`` (a path or URL). Returns what
        ``trainer.train`` returns; ``train_kwargs`` go to it (``trial``,
        ``ignore_keys_for_eval``)."""
        source = _resume_source(trainer, checkpoint)
        with _resuming(trainer, source) as local:
            # The trainer's own train() (a subclass may override it); to it, ``local`` is a
            # Trainer-format directory, and the loading methods are already replaced.
            return trainer.train(resume_from_checkpoint=local, **train_kwargs)


# -- the Trainer ---------------------------------------------------------------------------------


class SavepointTrainer(Trainer):
    """A ``Trainer`` whose checkpoints are savepoint checkpoints (see the module docstring).

    It adds a :class:`SavepointCallback` if ``callbacks`` has none (pass your own to set
    ``metadata`` or save options). ``train(resume_from_checkpoint=...)`` takes a savepoint
    checkpoint (path or URL), True for the newest savepoint checkpoint in ``output_dir``, or a
    Trainer-format checkpoint directory, which is read by Trainer as before.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.savepoint_callback is None:
            self.add_callback(SavepointCallback())

    @property
    def savepoint_callback(self) -> SavepointCallback | None:
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, SavepointCallback):
                return cb
        return None

    def train(
        self, resume_from_checkpoint: PathArg | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        return _train(self, super().train, resume_from_checkpoint, args, kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Trainer's checkpoint bookkeeping, with one savepoint checkpoint for all its files."""
        _check_supported(self.args, self)
        callback = self.savepoint_callback
        if callback is None:
            callback = SavepointCallback()
            self.add_callback(callback)
        step = self.state.global_step
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        strategies = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        if self.args.save_strategy in strategies and self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if self.state.best_global_step == step or os.path.exists(best):
                self.state.best_model_checkpoint = best
        stateful: Any = self.state.stateful_callbacks  # a dict once TrainerState is built
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name, cb_state = cb.__class__.__name__, cb.state()
                if isinstance(stateful[name], list):
                    stateful[name].append(cb_state)
                else:
                    stateful[name] = cb_state
        if self.args.should_save:
            callback.write(
                output_dir,
                args=self.args,
                state=self.state,
                model=self.model,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                scaler=getattr(self.accelerator, "scaler", None),
            )
            callback._trainer_wrote = True
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is not None and _load_best(self.model, best):
            callback = self.savepoint_callback
            if callback is not None:
                callback._best_loaded = best
            return
        super()._load_best_model()


_wrap_trainer_train()
