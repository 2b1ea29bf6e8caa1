"""The shipped examples (examples/demo.py, README code blocks) keep working."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _readme_blocks() -> list[str]:
    if not README.exists():
        return []
    return re.findall(
        r"^```python[^\n]*\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S
    )


@pytest.mark.torch
def test_demo_runs_and_resumes_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bit-exact" in result.stdout
    assert "DIFFERENT" not in result.stdout
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("savepoint-demo-")]
    assert leftovers == []  # the demo cleans up its checkpoint directory


def test_readme_python_blocks_run(tmp_path: Path) -> None:
    blocks = _readme_blocks()
    if not blocks:
        pytest.skip("README.md is absent or has no ```python blocks")
    # Blocks run in order in one namespace, like a reader following along, in a scratch directory.
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
