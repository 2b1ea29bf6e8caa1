"""boostr checkpoints through the writer process (issue 27): ``save_boostr`` and
``save_distributed`` of ``AsyncCheckpointer(writer="process")`` write the same bytes as the
thread writer, from the shared staging arena; the state saved is the state at the call; errors
cross with their class; a ``save_boostr`` handed over commits even if the trainer then exits by
``os._exit``. (2-rank ``save_distributed``: ``tests/distributed/test_boostr_distributed.py``.)
"""

from __future__ import annotations

import errno
import filecmp
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.formats import boostr

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="checks processes through /proc"
)


def tensors(seed: int) -> tuple[dict[str, Any], dict[str, Any], boostr.TrainingState]:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    model = {
        "layers.0.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "layers.0.bias": np.arange(7, dtype=np.int64) * seed,
        "empty": np.zeros((0, 3)),
        "half": np.full(5, seed, ml_dtypes.bfloat16),
    }
    optimizer = {"layers.0.weight.m": rng.standard_normal((64, 32)).astype(np.float32)}
    state = boostr.TrainingState(step=seed, epoch=1, learning_rate=0.1, metadata={"a": "b"})
    return model, optimizer, state


def same_tree(a: Path, b: Path) -> None:
    names = sorted(os.path.relpath(os.path.join(d, f), a) for d, _, fs in os.walk(a) for f in fs)
    assert names == sorted(
        os.path.relpath(os.path.join(d, f), b) for d, _, fs in os.walk(b) for f in fs
    )
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


def test_save_boostr_writes_the_thread_writers_bytes_from_the_arena(tmp_path: Path) -> None:
    model, optimizer, state = tensors(1)
    infos = {}
    for writer in ("thread", "process"):
        with sp.AsyncCheckpointer(writer=writer) as ck:  # type: ignore[arg-type]
            infos[writer] = ck.save_boostr(tmp_path / writer, model, optimizer, state).wait()
            ck.save_boostr(tmp_path / f"{writer}-model", model).wait()  # no optimizer file
            if writer == "process":
                assert ck._process.arena.capacity > 0  # staged in the shared arena
                with open(f"/proc/{ck._process.pid}/maps", encoding="ascii") as f:
                    assert "torch" not in f.read()
    same_tree(tmp_path / "thread", tmp_path / "process")
    same_tree(tmp_path / "thread-model", tmp_path / "process-model")
    assert not (tmp_path / "process-model" / "optimizer.safetensors").exists()
    assert infos["process"] == boostr.inspect(tmp_path / "process")
    assert str(infos["process"]) == str(infos["thread"]).replace("thread", "process")


def test_what_save_boostr_saves_is_the_state_at_the_call(tmp_path: Path) -> None:
    model, optimizer, state = tensors(2)
    want = {k: v.copy() for k, v in model.items()}
    with sp.AsyncCheckpointer(writer="process") as ck:
        for i in range(3):
            pending = ck.save_boostr(tmp_path / str(i), model, optimizer, state)
            while not pending.done():
                model["layers.0.weight"] += 1.0
            pending.wait()
            got = boostr.load(tmp_path / str(i))
            assert all(np.array_equal(got.model[k], v) for k, v in want.items())
            want = {k: v.copy() for k, v in model.items()}


def test_a_save_boostr_error_crosses_with_its_class(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    model, _, _ = tensors(3)
    raised = {}
    for writer in ("thread", "process"):
        with sp.AsyncCheckpointer(writer=writer) as ck:  # type: ignore[arg-type]
            ck.save_boostr(blocker / "ckpt", model)
            with pytest.raises(sp.CheckpointError) as info:
                ck.wait()
            raised[writer] = info.value
            ck.save_boostr(tmp_path / writer, model).wait()  # the next save works
    assert type(raised["process"]) is type(raised["thread"])
    assert raised["process"].errno == raised["thread"].errno == errno.EEXIST
    assert str(raised["process"]) == str(raised["thread"])


def test_a_save_boostr_outlives_its_trainer(tmp_path: Path) -> None:
    """Handed over before ``save_boostr`` returned: committed although the trainer then leaves
    by ``os._exit`` (no exit hook runs), and the writer process exits after."""
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import savepoint as sp
        from test_process_writer_boostr import tensors
        model, optimizer, state = tensors(4)
        big = {{"big": __import__("numpy").ones(2_000_000, "float32"), **model}}
        c = sp.AsyncCheckpointer(writer="process")
        c.save_boostr(sys.argv[1], big, optimizer, state)
        print(c._process.pid, flush=True)
        os._exit(3)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "b")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 3, proc.stderr
    writer = int(proc.stdout.strip())
    from .test_process_writer import wait_gone

    assert wait_gone(writer), "the writer process outlived its trainer"
    model, _, state = tensors(4)
    got = boostr.load(tmp_path / "b")
    assert np.array_equal(got.model["big"], np.ones(2_000_000, np.float32))
    assert all(np.array_equal(got.model[k], v) for k, v in model.items())
    assert got.state == state


def test_save_distributed_writes_the_thread_writers_bytes(tmp_path: Path) -> None:
    """One rank (an in-process gloo group): the writer process writes ``rank_0/`` from the
    arena, the trainer's thread commits ``sharding_meta.json``; byte for byte the thread
    writer's checkpoint, and the state at the call."""
    from _support import one_rank_world

    model, optimizer, state = tensors(5)
    want = {k: v.copy() for k, v in model.items()}
    metas = {}
    with one_rank_world() as dist:
        for writer in ("thread", "process"):
            group = dist.group.WORLD
            with sp.AsyncCheckpointer(writer=writer, process_group=group) as ck:  # type: ignore[arg-type]
                pending = ck.save_distributed(tmp_path / writer, model, optimizer, state)
                model["layers.0.weight"] += 1.0  # after the call: not saved
                metas[writer] = pending.wait()
                model["layers.0.weight"][...] = want["layers.0.weight"]
    assert metas["process"] == metas["thread"]
    same_tree(tmp_path / "thread", tmp_path / "process")
    got = boostr.load_consolidated(tmp_path / "process")
    assert all(np.array_equal(got.model[k], v) for k, v in want.items())
