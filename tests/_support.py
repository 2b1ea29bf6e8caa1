"""Small helpers several test modules share (not collected: no ``test_`` prefix)."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def load_generator(script: Path, name: str) -> Any:
    """Import a golden-file generator script (``tests/golden/.../make_golden.py``) as a module."""
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stable_id(value: Any) -> str:
    """``repr(value)`` without memory addresses, as a test id: pytest-xdist's workers must collect
    the same ids (``<function f at 0x7f...>`` differs from one process to the next)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def in_thread(fn: Any, timeout: float = 10.0) -> Any:
    """``fn()``'s result or exception, from a thread; fails the test if it blocks."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["value"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the read blocked"
    return box["value"]


@contextlib.contextmanager
def one_rank_world() -> Iterator[Any]:
    """torch.distributed initialised in this process as a world of one rank (gloo, in-memory
    store), for code that needs a real ``ProcessGroup``; yields ``torch.distributed``, destroys
    the group after. Skips the test without torch.distributed."""
    import pytest

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    assert not dist.is_initialized(), "torch.distributed is already initialised"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def encode_manifest(doc: dict[str, Any]) -> bytes:
    """A manifest document serialised as ``manifest.dumps`` lays one out (one member per line),
    with a valid checksum trailer: how tests forge manifests the parser must judge on their
    content, not their checksum."""
    import json

    from savepoint.codecs import checksum

    members = ",\n".join(
        f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'), ensure_ascii=True)}"
        for k, v in doc.items()
    )
    head = ("{\n" + members).encode("ascii")
    return head + f',\n "manifest_xxh3": "{checksum.digest(head)}"\n}}\n'.encode("ascii")


def run_doc_snippets(doc: Path, cwd: Path) -> None:
    """Run the ```python blocks of ``doc`` in order, as one script in ``cwd`` (warnings are
    errors); it must succeed and print "ok"."""
    text = doc.read_text(encoding="utf-8")
    blocks = re.findall(r"^```python[^\n]*\n(.*?)^```", text, re.M | re.S)
    assert blocks, f"{doc} has no python block"
    script = cwd / "snippets.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout
