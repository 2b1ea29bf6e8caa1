"""``AsyncCheckpointer(writer="process")`` on stores other than the local disk (issue 27): the
writer process makes the store from the save's URL and the environment it inherits
(``async_/_place.py``). S3 is moto on loopback (``tests/storage/_s3server.py``); a refused
request comes from the fault proxy in front of it. ``memory://`` and stores made by hand are
refused in ``save()``, before anything is written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from _compare import same
from savepoint.blobs import BlobPolicy

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the writer process needs memfd or a tmp file"
)


def state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((256, 1024)).astype(np.float32),  # 1 MiB
        "nested": {"ids": np.arange(5000, dtype=np.int64) * seed, "half": np.ones(7, np.float16)},
        "empty": np.zeros((0, 3), np.float64),
        "step": seed,
    }


def _s3() -> Any:
    from storage import _s3server

    if not _s3server.AVAILABLE:
        pytest.skip(_s3server.SKIP_REASON)
    return _s3server


def test_a_save_to_s3_through_the_writer_process_loads_bit_exactly(s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/ckpt"
    with sp.AsyncCheckpointer(writer="process", max_file_bytes=512 << 10) as ck:
        first = ck.save(f"{root}/a", state(1), metadata={"step": 1})
        pid = ck._process.pid
        info = first.wait()
        ck.save(f"{root}/b", state(2)).wait()
        assert ck._process.pid == pid  # one writer process for both saves
    assert pid is not None
    same(sp.load(f"{root}/a"), state(1))
    same(sp.load(f"{root}/b"), state(2))
    assert info == sp.inspect(f"{root}/a")
    assert len(info.files) >= 2
    assert sp.verify(f"{root}/a").metadata == {"step": 1}


def test_an_incremental_run_on_s3_through_the_writer_process(s3_bucket: str) -> None:
    """A managed, incremental run (blob store on S3 too): the writer process opens the blob
    store from its URL; the second save puts only what changed."""
    run = f"s3://{s3_bucket}/run"
    policy = BlobPolicy(chunk_size=64 << 10, min_blob_bytes=4096)
    saved = {}
    with sp.CheckpointManager(
        run, async_save=True, writer="process", incremental=True, blob_policy=policy
    ) as m:
        for step in (1, 2):
            s = state(1)
            s["step"] = step
            s["w"][0, :8] = step  # one chunk changes
            m.save(step, s)
            saved[step] = s
    for step, s in saved.items():
        same(sp.open_run(run).load(step), s)
        sp.verify(f"{run}/checkpoints/step-{step:010d}")


def test_a_refused_write_is_the_thread_writers_error(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket policy refusing the data files' PUTs (403 from the fault proxy): the writer
    process's error is the thread writer's (class, errno, the refused object named); nothing
    is committed."""
    _s3server = _s3()
    from storage._faultproxy import FaultProxy

    proxy = FaultProxy(s3.endpoint).start()
    try:
        # Both the trainer's store (a new bucket: a new client) and the writer process (started
        # after this) read the endpoint from the environment: every request goes to the proxy.
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        bucket = _s3server.fresh_bucket()
        rule = proxy.fail("PUT", r"/gen-[^/]+/data-\d+\.safetensors", "403", times=None)
        errors = {}
        for writer in ("thread", "process"):
            with sp.AsyncCheckpointer(writer=writer) as ck:  # type: ignore[arg-type]
                pending = ck.save(f"s3://{bucket}/{writer}", state(1))
                with pytest.raises(sp.CheckpointError) as info:
                    pending.wait()
                errors[writer] = info.value
                with pytest.raises(type(info.value)):
                    ck.wait()  # ...and once at the next wait(), as any background failure
        proxy.clear()
        for writer in ("thread", "process"):
            with pytest.raises(sp.CheckpointNotFoundError):
                sp.load(f"s3://{bucket}/{writer}")  # nothing committed
    finally:
        proxy.stop()
    assert rule.fired >= 2
    thread, process = errors["thread"], errors["process"]
    assert type(process) is type(thread)  # a CheckpointWriteError, as for the thread writer
    assert (process.errno, process.path) == (thread.errno, thread.path.replace("thread", "process"))
    for writer, error in errors.items():
        assert "403 Forbidden (AccessDenied)" in str(error)
        assert f"s3://{bucket}/{writer}/gen-" in str(error)  # the refused object


def test_an_fsspec_url_through_the_writer_process(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    url = f"fsspec+file://{tmp_path}/ckpt"
    with sp.AsyncCheckpointer(writer="process") as ck:
        info = ck.save(url, state(3)).wait()
    same(sp.load(url), state(3))
    assert info == sp.inspect(url)


def test_stores_the_writer_process_cannot_reach_are_refused_in_save(tmp_path: Path) -> None:
    """The memory of this process (savepoint's memory://, fsspec's memory filesystem) and stores
    made by hand: refused in ``save()`` naming why and what to use, nothing written, the
    checkpointer still usable."""
    from savepoint.storage.faults import FaultyStore
    from savepoint.storage.local import LocalStore

    refused = {
        "memory://x/p": "an in-memory store lives in this process",
        LocalStore().at(str(tmp_path / "local")): None,  # the local disk: accepted
        FaultyStore(LocalStore()).at(
            str(tmp_path / "faulty")
        ): "cannot be made again from that URL",
    }
    if pytest.importorskip("fsspec"):
        refused["fsspec+memory://x/p"] = "an in-memory store lives in this process"
    with sp.AsyncCheckpointer(writer="process") as ck:
        for where, why in refused.items():
            if why is None:
                ck.save(where, state(1)).wait()
                continue
            with pytest.raises(sp.UnsupportedStorageError, match=why) as info:
                ck.save(where, state(1))
            assert isinstance(info.value, ValueError)
            assert "writer='thread'" in str(info.value)
        faulty = FaultyStore(LocalStore())
        with pytest.raises(sp.UnsupportedStorageError, match=r"blob store .*cannot be made again"):
            ck.save(faulty.at(str(tmp_path / "p")), state(1), blobs=faulty.at(str(tmp_path / "b")))
        ck.save(tmp_path / "after", state(2)).wait()
    assert not (tmp_path / "faulty").exists() and not (tmp_path / "p").exists()
    same(sp.load(tmp_path / "local"), state(1))
    same(sp.load(tmp_path / "after"), state(2))
