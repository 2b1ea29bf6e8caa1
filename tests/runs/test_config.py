"""``ManagerConfig.of``: every check of ``CheckpointManager``'s arguments, alone (no run directory),
and what the checked configuration holds. The manager raises exactly what the config raises."""

from __future__ import annotations

import dataclasses
import importlib.util
import signal
import threading
import uuid
from typing import Any

import pytest

import savepoint as sp
from savepoint.blobs import BlobPolicy, Compression
from savepoint.errors import CheckpointArgumentError, IncompatibleCheckpointError
from savepoint.runs import policies
from savepoint.runs.config import ManagerConfig, PreemptionPolicy, seconds
from savepoint.runs.preemption import DEFAULT_GRACE, DEFAULT_SIGNALS
from savepoint.storage import memory

HAS_ZSTD = importlib.util.find_spec("zstandard") is not None

# (arguments, the error, its message): each argument wrong alone.
BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"writers": 0}, ValueError, r"writers"),
    ({"max_file_size": 1}, TypeError, r"'max_file_size'"),
    ({"options": {"writers": 2}}, TypeError, r"options"),
    ({"async_save": "yes"}, TypeError, r"^async_save must be a bool, not str \('yes'\)$"),
    ({"verify_before_prune": 1}, TypeError, r"^verify_before_prune must be a bool, not int"),
    ({"aliases": None}, TypeError, r"^aliases must be a bool, not NoneType"),
    ({"strict_config": 0}, TypeError, r"^strict_config must be a bool"),
    ({"incremental": "no"}, TypeError, r"^incremental must be a bool"),
    ({"read_only": "yes"}, TypeError, r"^read_only must be None, True or False, not str"),
    ({"keep_best": 2}, ValueError, r"^keep_best needs best_metric"),
    ({"frozen": ("model/base",)}, ValueError, r"^frozen is given without incremental=True$"),
    ({"frozen": ["", "x"], "incremental": True}, ValueError, r"frozen"),
    ({"frozen": 3, "incremental": True}, TypeError, r"frozen"),
    ({"blob_policy": BlobPolicy()}, ValueError, r"^blob_policy is given without incremental"),
    ({"blob_policy": {}, "incremental": True}, TypeError, r"^blob_policy must be a savepoint"),
    ({"compression": "zstd"}, ValueError, r"^compression is given without incremental=True"),
    ({"compression": "lz4", "incremental": True}, ValueError, r"not 'lz4' \(for another zstd"),
    ({"compression": 3, "incremental": True}, TypeError, r"not int \(3\)"),
    ({"best_mode": "up"}, ValueError, r"^best_mode must be 'min' or 'max', not 'up'$"),
    ({"keep_last": "2"}, TypeError, r"^keep_last='2': "),
    ({"keep_last": -1}, ValueError, r"^keep_last=-1: "),
    ({"keep_best": "1", "best_metric": "val"}, TypeError, r"^keep_best='1': "),
    ({"keep_every": 0}, ValueError, r"^keep_every=0: "),
    ({"save_every": 0}, ValueError, r"^save_every=0: "),
    ({"preemption": "SIGTERM"}, TypeError, r"^preemption must be True or a list of signals"),
    ({"preemption": ["SIGNOPE"]}, ValueError, r"^preemption: 'SIGNOPE' is not a signal$"),
    ({"preemption": [signal.SIGKILL]}, ValueError, r"^preemption: SIGKILL cannot be caught$"),
    ({"preemption": []}, ValueError, r"^preemption: no signal given$"),
    ({"tiers": "s3://b/run"}, TypeError, r"^tiers must be a list of sp.Tier, not 's3://b/run'$"),
    ({"tiers": ["s3://b/run"]}, TypeError, r"^tiers must be a list of sp.Tier, not one holding"),
    ({"preemption_grace": "5"}, TypeError, r"^preemption_grace must be a number of seconds, not"),
    ({"preemption_grace": True}, TypeError, r"^preemption_grace must be a number of seconds"),
    ({"preemption_grace": 0}, ValueError, r"^preemption_grace must be a positive number"),
    ({"preemption_grace": float("inf")}, ValueError, r"^preemption_grace must be a positive"),
    ({"preemption_every": 0}, ValueError, r"^preemption_every must be a positive integer, not 0$"),
    ({"preemption_every": True}, ValueError, r"^preemption_every must be a positive integer"),
    # What a new user types: a misspelt writer, a policy's name or its class for the policy.
    ({"writer": "proces", "async_save": True}, CheckpointArgumentError, r"mean 'process'\?\)$"),
    ({"writer_priority": "lowest"}, CheckpointArgumentError, r"did you mean 'low'\?\)$"),
    ({"writer_priority": "idle"}, CheckpointArgumentError, r"^writer_priority='idle' is given wi"),
    ({"save_policy": "continuous"}, CheckpointArgumentError, r"not str \('continuous'\): give"),
    ({"save_policy": policies.Continuous}, CheckpointArgumentError, r"the class Continuous: "),
]


@pytest.mark.parametrize(("arguments", "error", "pattern"), BAD, ids=repr)
def test_each_wrong_argument_is_named(
    arguments: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        ManagerConfig.of(**arguments)


@pytest.mark.parametrize(("arguments", "error", "pattern"), BAD[::4], ids=repr)
def test_the_manager_raises_what_the_config_raises_and_touches_nothing(
    arguments: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error) as config:
        ManagerConfig.of(**arguments)
    url = f"memory://config-test/{uuid.uuid4().hex}"
    with pytest.raises(error) as manager:
        sp.CheckpointManager(url, **arguments)
    assert str(manager.value) == str(config.value)
    assert memory.shared().stat(url.removeprefix("memory:/")) is None


def test_the_first_wrong_argument_is_the_one_named() -> None:
    """The order is the manager's: save options, flags, read_only, the metric, frozen, the blob
    policy, the mode, the retention rules, the save policy, preemption's signals, the tiers,
    the grace budget, preemption_every."""
    with pytest.raises(TypeError, match="async_save"):
        ManagerConfig.of(keep_last="2", async_save="yes")
    with pytest.raises(ValueError, match="writers"):
        ManagerConfig.of(async_save="yes", writers=0)
    with pytest.raises(ValueError, match="best_mode"):
        ManagerConfig.of(keep_last=-1, best_mode="up")
    with pytest.raises(TypeError, match="tiers"):
        ManagerConfig.of(tiers="x", preemption_grace=0)
    with pytest.raises(TypeError, match="preemption must"):
        ManagerConfig.of(tiers="x", preemption="SIGTERM")


def test_preemption_outside_the_main_thread_is_refused() -> None:
    raised: list[BaseException] = []

    def make() -> None:
        try:
            ManagerConfig.of(preemption=True)
        except BaseException as exc:
            raised.append(exc)
        ManagerConfig.of(preemption=False, preemption_grace=3)  # (no handlers: allowed)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError)
    assert "main thread" in str(raised[0])


def test_the_defaults() -> None:
    config = ManagerConfig.of()
    assert repr(config.retention) == "AnyOf(KeepAll())"
    assert isinstance(config.save_policy, policies.SaveAlways)
    assert config.preemption == PreemptionPolicy(None, DEFAULT_GRACE, 1)
    assert config.save_options == sp.SaveOptions()
    assert (config.tiers, config.frozen, config.blob_policy) == ((), None, None)
    assert (config.verify_before_prune, config.aliases, config.async_save) == (True, True, False)
    assert (config.read_only, config.incremental, config.strict_config) == (None, False, False)


def test_what_it_holds() -> None:
    keep = policies.KeepEvery(100)
    tier = sp.Tier("memory://config-test/tier")
    config = ManagerConfig.of(
        keep_last=2,
        keep_best=1,
        best_metric="loss",
        best_mode="max",
        retention=keep,
        save_every=5,
        preemption=["TERM", signal.SIGUSR1, "SIGTERM"],
        preemption_grace=7,
        preemption_every=3,
        tiers=[tier],
        incremental=True,
        frozen=(p for p in ["model/base"]),  # a generator: read once
        name="n",
        config={"lr": 1},
        writers=2,
    )
    assert config.retention.policies == (
        policies.KeepLatest(2),
        policies.KeepBest(1, "loss", "max"),
        keep,
    )
    assert config.save_policy == policies.SaveEvery(5)
    assert config.preemption == PreemptionPolicy((signal.SIGTERM, signal.SIGUSR1), 7.0, 3)
    assert config.tiers == (tier,)
    assert config.frozen == ("model/base",)
    assert (config.best_metric, config.best_mode, config.name) == ("loss", "max", "n")
    assert config.config == {"lr": 1} and config.save_options.writers == 2
    assert ManagerConfig.of(preemption=True).preemption.signals == DEFAULT_SIGNALS
    # A save policy given wins over save_every (as it always has).
    assert isinstance(
        ManagerConfig.of(save_every=5, save_policy=policies.SaveAlways()).save_policy,
        policies.SaveAlways,
    )


def test_it_is_frozen() -> None:
    config = ManagerConfig.of()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.aliases = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.preemption.grace = 1.0  # type: ignore[misc]


@pytest.mark.skipif(not HAS_ZSTD, reason="needs zstandard")
def test_compression_goes_into_the_blob_policy() -> None:
    zstd = BlobPolicy.of("zstd").compression
    assert ManagerConfig.of(incremental=True, compression="zstd").blob_policy == BlobPolicy(
        compression=zstd
    )
    mine = BlobPolicy(min_blob_bytes=1)
    merged = ManagerConfig.of(incremental=True, compression="zstd", blob_policy=mine)
    assert merged.blob_policy == dataclasses.replace(mine, compression=zstd)
    other = BlobPolicy(compression=Compression(level=9))
    with pytest.raises(ValueError, match="conflicts with blob_policy's compression"):
        ManagerConfig.of(incremental=True, compression="zstd", blob_policy=other)


def test_seconds() -> None:
    assert seconds(2, "grace") == 2.0
    with pytest.raises(ValueError, match=r"^grace must be a positive number of seconds, not -1$"):
        seconds(-1, "grace")
    with pytest.raises(TypeError, match=r"^grace must be a number of seconds, not NoneType$"):
        seconds(None, "grace")


def test_compression_without_zstandard(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else real(name)
    )
    with pytest.raises(IncompatibleCheckpointError, match="pip install zstandard"):
        ManagerConfig.of(incremental=True, compression="zstd")
