"""PyTorch Lightning: :class:`SavepointCheckpointIO`, a ``CheckpointIO`` plugin.

::

    from lightning.pytorch import Trainer            # or: from pytorch_lightning import Trainer
    from savepoint.integrations.lightning import SavepointCheckpointIO

    trainer = Trainer(plugins=[SavepointCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model)                               # ModelCheckpoint writes savepoint checkpoints
    trainer.fit(model, ckpt_path="last")             # and resumes from them

Every checkpoint Lightning asks for (``ModelCheckpoint``, ``trainer.save_checkpoint``) becomes a
savepoint checkpoint at the path Lightning chose (``epoch=0-step=100.ckpt`` is then a directory):
committed atomically (a kill mid-save leaves the previous file or none, never a torn one),
checksummed, written with O_DIRECT on local disks or to any URL savepoint takes (``s3://...``:
give ``ModelCheckpoint(dirpath="s3://...")``), loaded without pickle. The whole Lightning
checkpoint dict round-trips: weights, optimizer and scheduler states, ``global_step``, epoch, loop
and callback states, hyper-parameters that are plain values. Values savepoint cannot store
without pickle (arbitrary objects in ``hyper_parameters``, say) are refused with a clear
:class:`savepoint.UnsupportedStateError` naming the key.

``remove_checkpoint`` (``ModelCheckpoint``'s ``save_top_k`` pruning) deletes a checkpoint
atomically, and never the one this process resumed from (Lightning deletes it on remote paths
when it falls out of the top k; here it is kept and a log record says so).

Works under Lightning's ``AsyncCheckpointIO(SavepointCheckpointIO())`` (Lightning clones the
tensors on the training thread, savepoint writes them in Lightning's background thread).

Exact resume, mid-epoch too: add the :class:`ExactResume` callback (random generators and the
training loader's position in every checkpoint, restored when a fit resumes; the loader's
sampler must be an ``sp.ResumableSampler`` for mid-epoch checkpoints). Lightning alone restarts
the epoch's batches and keeps no generator state.

Loading a trained model the usual way: ``Model.load_from_checkpoint(path)`` calls Lightning's
``pl_load``, which opens ``path`` as one file (``torch.load`` of ``fsspec.open(path)``) and has
no extension point: on a savepoint checkpoint, a directory, it raises ``IsADirectoryError``.
Importing this module wraps ``pl_load`` (``lightning.pytorch.core.saving`` and
``pytorch_lightning.core.saving``): a path that holds a savepoint checkpoint is read with
``sp.load`` (checksums verified, no pickle; tensors on the CPU unless ``map_location`` names a
device), every other path goes to Lightning's function unchanged. So in any script that imports
``savepoint.integrations.lightning`` (or calls :func:`load_from_checkpoint`, the same call
spelled explicitly), ``Model.load_from_checkpoint(path)`` and
``DataModule.load_from_checkpoint(path)`` work on savepoint checkpoints, on any store.

Importing this module imports Lightning: ``lightning`` (the unified package) and/or
``pytorch_lightning``/``lightning_fabric``, whichever are installed; the plugin is an instance of
each one's ``CheckpointIO``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

import savepoint as sp
from savepoint.commit import transaction
from savepoint.commit.transaction import discard
from savepoint.errors import CheckpointError
from savepoint.integrations._lightning_resume import ExactResume, lightning_classes
from savepoint.storage.paths import resolve as resolve_path

__all__ = ["ExactResume", "SavepointCheckpointIO", "load_from_checkpoint"]

log = logging.getLogger(__name__)


def _bases() -> tuple[type, ...]:
    return lightning_classes(
        "CheckpointIO",
        "lightning.fabric.plugins.io.checkpoint_io",
        "lightning_fabric.plugins.io.checkpoint_io",
    )


def _key(path: Any) -> str:
    where = resolve_path(os.fspath(path) if not isinstance(path, str) else path)
    return where.store.url(where.store.abspath(where.path))


class SavepointCheckpointIO(*_bases()):  # type: ignore[misc]
    """Lightning ``CheckpointIO`` writing and reading savepoint checkpoints (see the module
    docstring). ``verify``: check checksums on load (default on); ``mmap``: map the tensors
    of a local checkpoint instead of reading them; keyword arguments of ``sp.save``
    (``max_file_bytes``, ``writers``, ``direct``, ``metadata``) go to every save."""

    def __init__(self, *, verify: bool = True, mmap: bool = False, **save_options: Any) -> None:
        super().__init__()
        self.verify = verify
        self.mmap = mmap
        self.save_options = save_options
        self._resumed_from: set[str] = set()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "SavepointCheckpointIO.save_checkpoint takes no storage_options (got "
                f"{storage_options!r}); pass sp.save options to SavepointCheckpointIO(...)"
            )
        info = sp.save(os.fspath(path), checkpoint, **self.save_options)
        log.info("saved %s (%d bytes of tensors)", info.path, info.total_bytes)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # ``weights_only`` is moot: savepoint never unpickles, whatever it is.
        device = map_location if isinstance(map_location, str) else None
        if map_location is not None and device is None:
            import torch

            if isinstance(map_location, torch.device):
                device = str(map_location)
        loaded = sp.load(os.fspath(path), verify=self.verify, mmap=self.mmap, device=device)
        if not isinstance(loaded, dict):
            raise sp.IncompatibleCheckpointError(
                f"{path} holds a {type(loaded).__name__}, not a Lightning checkpoint dict",
                path=str(path),
            )
        self._resumed_from.add(_key(path))
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        key = _key(path)
        if key in self._resumed_from:
            log.info("kept %s: this run resumed from it", key)
            return
        where = resolve_path(os.fspath(path))
        discard(where.store, where.path)
        log.info("removed %s", key)

    def teardown(self) -> None:
        pass


# -- Model.load_from_checkpoint on savepoint checkpoints -----------------------------------------

_SAVING = ("lightning.pytorch.core.saving", "pytorch_lightning.core.saving")


def _is_savepoint_checkpoint(path: Any) -> bool:
    """Whether ``path`` (as Lightning's ``pl_load`` gets it) names a savepoint checkpoint: a
    local directory (``sp.load`` says what is wrong if it is not one), or a path or URL where
    savepoint finds a committed checkpoint. Files, ``http(s)`` URLs and file objects are not."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    text = os.fspath(path)
    if not isinstance(text, str) or text.startswith("http"):
        return False
    if os.path.isfile(text):
        return False
    if os.path.isdir(text):
        return True
    try:
        where = resolve_path(text)
        return transaction.resolve(where.store, where.path, strict=False) is not None
    except (CheckpointError, OSError, ValueError):
        return False


def _wrap_pl_load(module: Any) -> None:
    original = getattr(module, "pl_load", None)
    if original is None or getattr(original, "_savepoint", False):
        return

    @functools.wraps(original)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if _is_savepoint_checkpoint(path_or_url):
            # weights_only is moot: savepoint never unpickles.
            return SavepointCheckpointIO().load_checkpoint(path_or_url, map_location)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._savepoint = True  # type: ignore[attr-defined]
    module.pl_load = pl_load


def _install_load_hook() -> None:
    for name in _SAVING:
        module = sys.modules.get(name)
        if module is not None:
            _wrap_pl_load(module)


def load_from_checkpoint(cls: Any, path: Any, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, **kwargs)`` (a ``LightningModule`` or
    ``LightningDataModule`` class) for a checkpoint written by :class:`SavepointCheckpointIO`, on
    any path or URL savepoint takes: Lightning's own classmethod (hyper-parameters, ``strict``,
    ``hparams_file``, keyword overrides, ``on_load_checkpoint``), with the checkpoint read by
    ``sp.load``. Importing this module already makes the classmethod itself read savepoint
    checkpoints; this function is the same call, spelled so that it works whatever the import
    order (it installs the hook on the Lightning packages imported by then)."""
    _install_load_hook()
    return cls.load_from_checkpoint(path, **kwargs)


_install_load_hook()
