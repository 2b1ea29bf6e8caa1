"""torch module wrappers: ``torch.compile``, ``DistributedDataParallel`` and ``DataParallel``.

A wrapper's ``state_dict()`` prefixes every key of the model it wraps (``_orig_mod.`` for a
compiled module, ``module.`` for DDP and DataParallel), so a checkpoint saved from a wrapped model
would not load into the bare one. savepoint saves and loads the wrapped model instead
(:func:`unwrap`), so checkpoints hold the bare model's keys whatever form the training script used.

Key sets that still carry a wrapper prefix (checkpoints written before this rule, or a user's
``ddp.state_dict()`` saved as a plain dict) are matched by :func:`align`: when every key on one
side carries the same chain of wrapper prefixes and stripping it makes the two key sets agree, the
keys are renamed; otherwise nothing is renamed and the mismatch is reported key by key.

FSDP is not unwrapped: its ``state_dict()`` already removes its own wrapper names, and its
parameters are flat shards that the inner module's ``state_dict()`` would not describe.
Nothing here imports torch: a wrapper can only exist once its module is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from typing import Any

__all__ = [
    "PREFIXES",
    "align",
    "common_prefix",
    "unwrap",
]

PREFIXES = ("module.", "_orig_mod.")
# (module that defines the class, class name, attribute holding the wrapped model)
_WRAPPERS = (
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
)


def _inner_attribute(obj: Any) -> str | None:
    for module_name, class_name, attribute in _WRAPPERS:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if isinstance(cls, type) and isinstance(obj, cls):
            return attribute
    return None


def unwrap(obj: Any) -> Any:
    """The model inside any number of compile/DDP/DataParallel wrappers, or ``obj`` itself."""
    seen = 0
    while (attribute := _inner_attribute(obj)) is not None and seen < 64:
        obj = getattr(obj, attribute)
        seen += 1
    return obj


def common_prefix(keys: Collection[Any]) -> str:
    """The longest chain of wrapper prefixes (``"module."``, ``"_orig_mod.module."``...) that
    every key starts with and none consists of alone; ``""`` if there is none or a key is not a str."""
    if not keys or not all(isinstance(k, str) for k in keys):
        return ""
    chain = ""
    while True:
        for p in PREFIXES:
            longer = chain + p
            if all(k.startswith(longer) and len(k) > len(longer) for k in keys):
                chain = longer
                break
        else:
            return chain


def align(saved: Collection[Any], target: Collection[Any], *, exact: bool) -> dict[Any, Any] | None:
    """A renaming of ``saved`` keys onto ``target`` keys that differ only by wrapper prefixes.

    ``exact``: the renamed key sets must be equal (a module's ``load_state_dict`` is strict);
    otherwise every target key must be among the renamed saved keys (a partial restore). Returns
    None when the keys already fit, or when no uniform prefix change makes them fit (the caller
    then reports the missing and unexpected keys as they are: nothing is guessed).
    """

    def fits(s: Collection[Any], t: Collection[Any]) -> bool:
        return set(s) == set(t) if exact else set(t) <= set(s)

    if fits(saved, target):
        return None
    ps, pt = common_prefix(saved), common_prefix(target)
    if ps == pt:
        return None
    stripped = {k[len(ps) :]: k for k in saved} if ps else {k: k for k in saved}
    wanted = {k[len(pt) :] for k in target} if pt else set(target)
    if not fits(stripped, wanted):
        return None
    return {o: pt + b if isinstance(b, str) else b for b, o in stripped.items()}
