"""A real S3-protocol server on loopback for the object-store tests: moto's ThreadedMotoServer.

The server runs in a child process (so its sockets and threads are not counted by the contract
suite's file-descriptor check, and it does not compete with the client for the GIL) on
127.0.0.1 and a free port; :func:`server` starts it once per test session and sets the
environment obstore reads (endpoint, dummy credentials, plain http), :func:`stop` ends it.
The fixture ``s3`` (session-scoped) and ``s3_bucket`` (a fresh bucket per test) are re-exported
by ``tests/conftest.py``. Everything is skipped when obstore or moto is not installed.

Buckets are created and emptied with boto3 clients that are closed after each use (a client's
connection pool would keep sockets open between tests).
"""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

AVAILABLE = all(importlib.util.find_spec(m) is not None for m in ("obstore", "moto", "flask"))
SKIP_REASON = "needs obstore and moto[server] (pip install -e '.[dev]')"

REGION = "us-east-1"
ENV = {
    "AWS_ACCESS_KEY_ID": "savepoint-test",
    "AWS_SECRET_ACCESS_KEY": "savepoint-test-secret",
    "AWS_REGION": REGION,
    "AWS_DEFAULT_REGION": REGION,
    "AWS_ALLOW_HTTP": "true",
}

_SERVE = """
import os, sys, time
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
parent = os.getppid()
while os.getppid() == parent:  # the test process is gone: stop
    time.sleep(0.2)
server.stop()
"""


@dataclass
class Server:
    endpoint: str
    process: subprocess.Popen[bytes]
    saved_env: dict[str, str | None]

    def client(self) -> Any:
        """A boto3 client of the server; close it after use (its pool keeps sockets open)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=ENV["AWS_SECRET_ACCESS_KEY"],
        )

    def create_bucket(self, name: str) -> None:
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        finally:
            client.close()

    def open_uploads(self, bucket: str) -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload still open in ``bucket``."""
        client = self.client()
        try:
            found = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
            return [(u["Key"], u["UploadId"]) for u in found]
        finally:
            client.close()

    def empty_bucket(self, bucket: str) -> None:
        """Delete every object and abort every open multipart upload of ``bucket``."""
        client = self.client()
        try:
            found = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
            for upload in found:
                client.abort_multipart_upload(
                    Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
            while True:
                keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
                if not keys:
                    return
                client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})
        finally:
            client.close()


_SERVER: Server | None = None
_names = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def server() -> Server:
    """The session's server, started on first use (the environment set for obstore)."""
    global _SERVER
    if _SERVER is not None:
        return _SERVER
    if not AVAILABLE:
        pytest.skip(SKIP_REASON)
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE, str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(endpoint + "/moto-api/", timeout=2):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("the moto server did not start") from None
            time.sleep(0.1)
    env = {**ENV, "AWS_ENDPOINT_URL": endpoint}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    _SERVER = Server(endpoint, process, saved)
    atexit.register(stop)
    return _SERVER


def stop() -> None:
    """Stop the server and restore the environment."""
    global _SERVER
    if _SERVER is None:
        return
    srv, _SERVER = _SERVER, None
    srv.process.terminate()
    try:
        srv.process.wait(10)
    except subprocess.TimeoutExpired:
        srv.process.kill()
        srv.process.wait()
    for name, value in srv.saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def fresh_bucket(prefix: str = "savepoint-test") -> str:
    """A new, empty bucket on the session's server."""
    name = f"{prefix}-{os.getpid()}-{next(_names)}"
    server().create_bucket(name)
    return name


@pytest.fixture(scope="session")
def s3() -> Iterator[Server]:
    """The moto server of the session; skips without obstore and moto."""
    yield server()
    stop()


@pytest.fixture
def s3_bucket(s3: Server) -> str:
    """A fresh bucket on the session's server."""
    return fresh_bucket()
