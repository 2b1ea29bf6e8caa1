"""Regenerate the golden DeepSpeed ZeRO checkpoints in ``tests/golden/deepspeed/``: what
DeepSpeed 0.19.8 (``pip install deepspeed``, ``DS_BUILD_OPS=0``, torch 2.13, CPU, gloo) writes
for ``tests/integrations/_deepspeed_worker.py``'s model trained one step on 2 ranks.

Usage, from the repository root::

    .venv/bin/python tests/golden/make_golden_deepspeed.py

For ``zero2-bf16`` (bf16 training: ``bf16_zero_pp_rank_*`` optimizer files, a bf16 frozen layer,
a bf16 buffer that ``zero_to_fp32`` upcasts) and ``zero3``, it keeps the tag directory
``global_step1/`` and writes ``expected.safetensors``: DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` of it (tied weights stored once, under the first
name). About 50 KiB in all; ``tests/formats/test_deepspeed_golden.py`` reads them without
DeepSpeed or torch, and they seed the fuzz target ``deepspeed``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = HERE / "deepspeed"
PHASES = ("zero2-bf16", "zero3")


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    from distributed import _launch  # tests/distributed: starts the ranks

    worker = HERE.parent / "integrations" / "_deepspeed_worker.py"
    with tempfile.TemporaryDirectory() as tmp:
        for phase in PHASES:
            session = _launch.run(phase, 2, Path(tmp), worker=worker)
            if session.failures():
                raise SystemExit(session.failures())
        shutil.rmtree(TARGET, ignore_errors=True)
        for phase in PHASES:
            out = TARGET / phase
            shutil.copytree(Path(tmp) / phase / "global_step1", out / "global_step1")
            state = get_fp32_state_dict_from_zero_checkpoint(str(Path(tmp) / phase))
            seen: dict[int, str] = {}
            kept = {}
            for name, t in state.items():  # safetensors refuses shared memory: ties once
                if seen.setdefault(t.data_ptr(), name) == name:
                    kept[name] = t.contiguous()
            save_file(kept, str(out / "expected.safetensors"))
    print(f"wrote {TARGET}: {sorted(os.listdir(TARGET))}", torch.__version__)


if __name__ == "__main__":
    main()
