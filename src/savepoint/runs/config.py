"""What a :class:`~savepoint.runs.manager.CheckpointManager` was asked for, checked.

:meth:`ManagerConfig.of` takes the manager's keyword arguments and checks every one of them
before anything is touched (no directory is resolved, no file read): a wrong type is a TypeError,
a wrong value a ValueError, each naming the argument; every save option is checked here too
(:meth:`savepoint.options.SaveOptions.of`), not at the first save. ``compression="zstd"``
without the zstandard package is IncompatibleCheckpointError, and ``preemption=`` outside the
main thread is a RuntimeError (Python runs signal handlers there). The result is frozen: the
retention rules as one :class:`~savepoint.runs.policies.AnyOf`, the save policy, the preemption
policy (:class:`PreemptionPolicy`), the incremental settings, the save options, the tiers, the
flags and the run's identity as asked (compared with the run's own at open:
:mod:`savepoint.runs.opening`).
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from savepoint.async_.checkpointer import (
    Writer,
    WriterPriority,
    check_writer,
    check_writer_priority,
)
from savepoint.errors import CheckpointArgumentError, IncompatibleCheckpointError
from savepoint.options import SaveOptions
from savepoint.runs import policies
from savepoint.runs.peers import PeerTier
from savepoint.runs.policies import AnyOf, Mode, RetentionPolicy, SavePolicy
from savepoint.runs.preemption import DEFAULT_GRACE, signals_of
from savepoint.runs.tiers import Tier

__all__ = ["ManagerConfig", "PreemptionPolicy", "seconds"]


@dataclasses.dataclass(frozen=True)
class PreemptionPolicy:
    """``signals``: those whose handlers the open installs (None: no handlers); ``grace``:
    the seconds ``save_on_preemption`` has from the notice; ``every``: ``preempted()`` asks the
    ranks of a process group every that many calls."""

    signals: tuple[signal.Signals, ...] | None = None
    grace: float = DEFAULT_GRACE
    every: int = 1


@dataclasses.dataclass(frozen=True, eq=False)
class ManagerConfig:
    """A manager's checked arguments (see the module docstring); build it with :meth:`of`."""

    save_options: SaveOptions
    retention: AnyOf
    save_policy: SavePolicy
    best_metric: str | None = None
    best_mode: Mode = "min"
    preemption: PreemptionPolicy = PreemptionPolicy()
    # Incremental saves: the blob policy (None: the default one) and the key prefixes the
    # caller says never change (None: none).
    incremental: bool = False
    blob_policy: Any = None
    frozen: tuple[str, ...] | None = None
    tiers: tuple[Tier, ...] = ()
    peers: PeerTier | None = None  # the peer-memory tier (runs.peers), if asked for
    async_save: bool = False
    # Who writes async saves: "thread", "process", or None (the writer process, the thread
    # writer where it cannot write: AsyncCheckpointer's default).
    writer: Writer | None = None
    writer_priority: WriterPriority | None = None  # the writer process's (AsyncCheckpointer)
    verify_before_prune: bool = True
    aliases: bool = True
    read_only: bool | None = None
    strict_config: bool = False
    # The run's identity as asked (None: whatever the run has).
    name: str | None = None
    variant: str | None = None
    config: Mapping[str, Any] | None = None
    num_params: int | None = None

    @classmethod
    def of(
        cls,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: Mode = "min",
        keep_every: int | None = None,
        save_every: int | None = None,
        async_save: bool = False,
        writer: Writer | None = None,
        writer_priority: WriterPriority | None = None,
        retention: RetentionPolicy | None = None,
        save_policy: SavePolicy | None = None,
        name: str | None = None,
        variant: str | None = None,
        config: Mapping[str, Any] | None = None,
        num_params: int | None = None,
        verify_before_prune: bool = True,
        aliases: bool = True,
        read_only: bool | None = None,
        strict_config: bool = False,
        preemption: bool | Iterable[int | str | signal.Signals] | None = None,
        preemption_grace: float = DEFAULT_GRACE,
        preemption_every: int = 1,
        tiers: Sequence[Tier | PeerTier] | None = None,
        incremental: bool = False,
        blob_policy: Any = None,
        frozen: Iterable[str] | None = None,
        compression: Any = None,
        options: SaveOptions | None = None,
        **save_options: Any,
    ) -> ManagerConfig:
        """Check the arguments of ``CheckpointManager(directory, ...)`` (all but the directory)
        in the order the manager always has, so that the first wrong one is the one named."""
        checked = SaveOptions.of(save_options, base=options)
        _flags(
            async_save=async_save,
            verify_before_prune=verify_before_prune,
            aliases=aliases,
            strict_config=strict_config,
            incremental=incremental,
        )
        _read_only(read_only)
        if keep_best is not None and best_metric is None:
            raise ValueError("keep_best needs best_metric (the metric to rank checkpoints by)")
        _writer(writer, async_save, writer_priority)
        frozen = _frozen(frozen, incremental, checked)
        blob_policy = _blob_policy(blob_policy, compression, incremental)
        rules = _rules(keep_last, keep_best, best_metric, best_mode, keep_every)
        rules += [] if retention is None else [retention]
        save_policy = _save_policy(save_policy, save_every)
        signals = None if preemption is None or preemption is False else signals_of(preemption)
        tier_list, peers = _tiers(tiers)
        return cls(
            save_options=checked,
            retention=policies.AnyOf(*rules) if rules else policies.AnyOf(policies.KeepAll()),
            save_policy=policies.SaveAlways() if save_policy is None else save_policy,
            best_metric=best_metric,
            best_mode=best_mode,
            preemption=_preemption(signals, preemption_grace, preemption_every),
            incremental=incremental,
            blob_policy=blob_policy,
            frozen=frozen,
            tiers=tier_list,
            peers=peers,
            async_save=async_save,
            writer=writer,
            writer_priority=writer_priority,
            verify_before_prune=verify_before_prune,
            aliases=aliases,
            read_only=read_only,
            strict_config=strict_config,
            name=name,
            variant=variant,
            config=config,
            num_params=num_params,
        )


def _writer(writer: Any, async_save: bool, priority: Any = None) -> None:
    """``writer=``: "thread" or "process", the latter for async saves (sharded ones too); None
    (the default) is the process writer where it can write (async saves only). And
    ``writer_priority=``."""
    if priority is not None:
        check_writer_priority(priority)
        if not async_save:
            raise CheckpointArgumentError(
                f"writer_priority={priority!r} is given without async_save=True (it is the "
                "writer process's priority; a synchronous save is written by the caller)"
            )
    check_writer(writer)
    if writer == "process" and not async_save:
        raise ValueError(
            "writer='process' is given without async_save=True (the writer process writes "
            "background saves; a synchronous save is written by the caller)"
        )


def _save_policy(policy: Any, save_every: Any) -> SavePolicy | None:
    """``save_policy=`` checked: None or a policy object (``should_save(step, last_saved)``), not
    its class or a name (those would fail only at the first save); else ``save_every``'s."""
    every: SavePolicy | None = None
    if save_every is not None:
        every = _policy("save_every", policies.SaveEvery, save_every)
    if policy is None:
        return every
    if not isinstance(policy, type) and callable(getattr(policy, "should_save", None)):
        given_policy: SavePolicy = policy
        return given_policy  # a policy given wins over save_every (as it always has)
    if isinstance(policy, type):
        given, hint = f"the class {policy.__name__}", f"{policy.__name__}()"
    else:
        given, hint = f"{type(policy).__name__} ({policy!r})", "sp.policies.Continuous()"
    raise CheckpointArgumentError(
        f"save_policy must be a save policy object (one with should_save(step, last_saved)), "
        f"not {given}: give an instance (save_policy={hint}, say)"
    )


def _flags(**flags: Any) -> None:
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, not {type(value).__name__} ({value!r})")


def _read_only(read_only: Any) -> None:
    if read_only is not None and not isinstance(read_only, bool):
        raise TypeError(
            f"read_only must be None, True or False, not {type(read_only).__name__} ({read_only!r})"
        )


def _rules(
    keep_last: Any, keep_best: Any, best_metric: str | None, best_mode: Mode, keep_every: Any
) -> list[RetentionPolicy]:
    """The retention rules the ``keep_*`` arguments ask for, each checked (and ``best_mode``)."""
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
    rules: list[RetentionPolicy] = []
    if keep_last is not None:
        rules.append(_policy("keep_last", policies.KeepLatest, keep_last))
    if keep_best is not None and best_metric is not None:
        rules.append(_policy("keep_best", policies.KeepBest, keep_best, best_metric, best_mode))
    if keep_every is not None:
        rules.append(_policy("keep_every", policies.KeepEvery, keep_every))
    return rules


def seconds(value: Any, name: str) -> float:
    """A grace budget in seconds: a positive finite number (``name`` is the argument's)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def _preemption(
    signals: tuple[signal.Signals, ...] | None, grace: Any, every: Any
) -> PreemptionPolicy:
    checked = seconds(grace, "preemption_grace")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"preemption_every must be a positive integer, not {every!r}")
    if signals is not None and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "preemption=: signal handlers can only be installed from the main thread (Python "
            "runs them there): create the CheckpointManager in the main thread, or leave "
            "preemption off and call save_on_preemption() when your own handler says so"
        )
    return PreemptionPolicy(signals=signals, grace=checked, every=every)


def _frozen(frozen: Any, incremental: bool, options: SaveOptions) -> tuple[str, ...] | None:
    """The ``frozen=`` key prefixes, checked (read once: a generator, say)."""
    if frozen is None:
        return None
    from savepoint.blobs.patch import frozen_keys

    if not incremental:
        raise ValueError("frozen is given without incremental=True")
    if options.process_group is not None:
        raise ValueError("frozen is not supported with a process group (sharded saves)")
    if not isinstance(frozen, str) and hasattr(frozen, "__iter__"):
        frozen = tuple(frozen)
    frozen_keys(frozen)  # checks them
    return frozen  # type: ignore[no-any-return]


def _blob_policy(policy: Any, compression: Any, incremental: bool) -> Any:
    """The ``blob_policy=`` and ``compression=`` arguments, checked, as one BlobPolicy (None:
    the default policy)."""
    if policy is not None:
        from savepoint.blobs import BlobPolicy

        if not incremental:
            raise ValueError("blob_policy is given without incremental=True")
        if not isinstance(policy, BlobPolicy):
            raise TypeError("blob_policy must be a savepoint.blobs.BlobPolicy")
    if compression is None:
        return policy
    if not incremental:
        raise ValueError(
            "compression is given without incremental=True (only the blobs of "
            "incremental saves are compressed)"
        )
    return _compressed(policy, compression)


def _policy(argument: str, make: Callable[..., Any], n: Any, *more: Any) -> Any:
    """``make(n, *more)``, its TypeError or ValueError naming the manager's ``argument`` (the
    policy checks ``n``: an int, at least its minimum)."""
    try:
        return make(n, *more)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{argument}={n!r}: {exc}") from None


def _compressed(policy: Any, compression: Any) -> Any:
    """The blob policy of ``CheckpointManager(..., compression=)``: ``"zstd"`` or a
    :class:`savepoint.blobs.Compression`, merged into ``policy`` (a BlobPolicy or None); a policy
    that names another compression is a ValueError."""
    import importlib.util

    from savepoint.blobs import BlobPolicy, Compression

    if isinstance(compression, str):
        if compression != "zstd":
            raise ValueError(
                f"compression must be None, 'zstd' or a savepoint.blobs.Compression, not "
                f"{compression!r} (for another zstd level: compression=Compression(level=3))"
            )
        chosen = BlobPolicy.of(compression).compression
    elif isinstance(compression, Compression):
        chosen = compression
    else:
        raise TypeError(
            "compression must be None, 'zstd' or a savepoint.blobs.Compression, not "
            f"{type(compression).__name__} ({compression!r})"
        )
    if importlib.util.find_spec("zstandard") is None:
        raise IncompatibleCheckpointError(
            "compression='zstd' needs the zstandard package: pip install zstandard "
            "(or pip install 'savepoint[zstd]')"
        )
    if policy is None:
        return BlobPolicy(compression=chosen)
    if policy.compression is None:
        return dataclasses.replace(policy, compression=chosen)
    if policy.compression != chosen:
        raise ValueError(
            f"compression={compression!r} conflicts with blob_policy's compression "
            f"({policy.compression!r}): give one of them"
        )
    return policy


def _tiers(value: Any) -> tuple[tuple[Tier, ...], PeerTier | None]:
    """The ``tiers=`` argument: None or a sequence of :class:`~savepoint.runs.tiers.Tier` and
    at most one ``sp.Tier.peers(...)`` (:class:`~savepoint.runs.peers.PeerTier`): the storage
    tiers, and the peer tier."""
    if value is None:
        return (), None
    if isinstance(value, (str, bytes, Tier, PeerTier)) or not isinstance(value, Sequence):
        raise TypeError(f"tiers must be a list of sp.Tier, not {value!r}")
    peers = [tier for tier in value if isinstance(tier, PeerTier)]
    for tier in value:
        if not isinstance(tier, (Tier, PeerTier)):
            raise TypeError(f"tiers must be a list of sp.Tier, not one holding {tier!r}")
    if len(peers) > 1:
        raise ValueError("tiers holds more than one sp.Tier.peers(...): give one")
    return tuple(t for t in value if isinstance(t, Tier)), (peers[0] if peers else None)
