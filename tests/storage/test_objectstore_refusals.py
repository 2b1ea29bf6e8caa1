"""Refused requests on an object store (a bucket policy denying the request: S3 answers 403
AccessDenied, here from the fault proxy in front of moto): every read path of ``sp.load``,
``sp.verify`` and a run view raises CheckpointPermissionError (also a PermissionError) naming
the object, never a raw PermissionError, and never "corrupt" or "not found"."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from . import _s3server
from ._faultproxy import FaultProxy
from .test_objectstore_faults import LIST, proxied

pytestmark = pytest.mark.skipif(not _s3server.AVAILABLE, reason=_s3server.SKIP_REASON)

if _s3server.AVAILABLE:
    import savepoint as sp
    from savepoint.blobs import BlobPolicy
    from savepoint.storage.paths import Location

STEP = r"/run/checkpoints/step-0000000002/"
REFUSED = {  # what a policy refuses: (method, pattern of the request target)
    "GET manifest": ("GET", STEP + r"gen-[^/]+/manifest\.json$"),
    "GET data file": ("GET", STEP + r"gen-[^/]+/data-\d+\.safetensors"),
    "GET blob": ("GET", r"/run/blobs/data/"),
    "GET store.json": ("GET", r"/run/blobs/store\.json$"),
    "GET report.json": ("GET", r"/run/report\.json$"),
    "HEAD": ("HEAD", r"/run/"),
    "LIST": ("GET", LIST),
}


def _state(step: int) -> dict[str, Any]:
    return {"w": np.arange(4096, dtype=np.float32) + step, "b": np.arange(8) * step, "step": step}


def _load(run: Location) -> Any:
    return sp.load(run.join("checkpoints", "step-0000000002"))


def _verify(run: Location) -> Any:
    return sp.verify(run.join("checkpoints", "step-0000000002"))


def _steps(run: Location) -> Any:
    return sp.open_run(run).steps()


def _view_load(run: Location) -> Any:
    return sp.open_run(run).load(2)


OPS = {
    "sp.load": _load,
    "sp.verify": _verify,
    "open_run.steps": _steps,
    "open_run.load": _view_load,
}
# What each reads (a run view lists steps from the run's books and listings; the metrics it
# reads from manifests are best effort).
READS = {
    "sp.load": set(REFUSED) - {"GET report.json"},
    "sp.verify": set(REFUSED) - {"GET report.json"},
    "open_run.steps": {"GET report.json", "HEAD", "LIST"},
    "open_run.load": set(REFUSED),
}
CASES = [(op, refused) for op in sorted(OPS) for refused in sorted(READS[op])]


@pytest.fixture(scope="module")
def proxied_run(s3: _s3server.Server) -> Iterator[tuple[FaultProxy, Location]]:
    """An incremental run of two steps (a data file, blobs) on moto, behind a fault proxy."""
    proxy = FaultProxy(s3.endpoint).start()
    try:
        run = proxied(proxy).at(f"/{_s3server.fresh_bucket()}/run")
        policy = BlobPolicy(chunk_size=8192, min_blob_bytes=4096)
        with sp.CheckpointManager(run, incremental=True, blob_policy=policy) as m:
            for step in (1, 2):
                m.save(step, _state(step))
        yield proxy, run
    finally:
        proxy.stop()


@pytest.mark.parametrize(("op", "refused"), CASES)
def test_a_refused_read_is_a_permission_error(
    proxied_run: tuple[FaultProxy, Location], op: str, refused: str
) -> None:
    proxy, run = proxied_run
    method, pattern = REFUSED[refused]
    rule = proxy.fail(method, pattern, "403", times=None)
    try:
        with pytest.raises(sp.CheckpointPermissionError) as info:
            OPS[op](run)
    finally:
        proxy.clear()
    assert rule.fired >= 1
    assert isinstance(info.value, PermissionError) and run.path.split("/")[1] in str(info.value)
    OPS[op](run)  # nothing was damaged: it reads once allowed to
