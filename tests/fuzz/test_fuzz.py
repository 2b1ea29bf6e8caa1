"""A bounded slice of the fuzzing campaign (``make fuzz`` runs each target for longer, timed).

Every registered parser gets the same number of mutated inputs from a fixed seed, so a failure
here replays exactly; ``SAVEPOINT_FUZZ_ITERATIONS`` raises the count.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from ._harness import all_targets, describe, run, save_failures

TARGETS = all_targets()
ITERATIONS = int(os.environ.get("SAVEPOINT_FUZZ_ITERATIONS", "300"))


def test_every_parser_is_a_target() -> None:
    expected = {
        "manifest",
        "safetensors_header",
        "safetensors_file",
        "shrew_v1",
        "shrew_v2",
        "kizzasi_json",
        "kizzasi_msgpack",
        "snapshot_bytes",
        "boostr_json",
        "native_data_file",
        "detect",
        "burn",
        "training_artifact",
        "hf_index",  # a Hugging Face model directory's index, and its shards against it
        "dcp",  # issue 30: other systems' checkpoint directories
        "deepspeed",
        # savepoint's own JSON files besides manifests
        "run_json",  # report.json, run.json, history.jsonl
        "blob_store_json",
        "blob_record",  # blobs/sessions/, blobs/gc/
        "tier_json",
        "lease",
        "writer_lock_holder",
        "alias_pointer",
    }
    if importlib.util.find_spec("tensorstore") is not None:  # the orbax extra
        expected.add("orbax")
    missing = expected - {name.split(":")[0] for name in TARGETS}
    assert not missing, f"parsers without a fuzz target: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz(name: str, tmp_path: Path) -> None:
    result = run(TARGETS[name], tmp_path / "scratch", iterations=ITERATIONS, seed=0)
    if result.failures:
        save_failures(result, tmp_path / "crashes")
    assert not result.failures, describe(result)
