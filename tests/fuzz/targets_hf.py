"""Fuzz targets for Hugging Face model directories (``savepoint.formats.huggingface``): the index
(``model.safetensors.index.json``) of a real three-shard export replaced by the input, and one
shard of it replaced by the input (the index then checks it against its name map).

Each input goes through what a user calls on a directory: detection, ``inspect_any``,
``verify_any`` and ``sp.load``, plus the index parser on the bytes alone. Only CheckpointError may
escape; memory is bounded by the harness (24 x input + 32 MiB traced).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import savepoint as sp
from fuzz._harness import Target, register
from savepoint.formats import detect, huggingface
from savepoint.formats.export import export

INDEX = huggingface.INDEX
SHARD = "model-00002-of-00003.safetensors"

HF_TOKENS = (
    b'"weight_map"',
    b'"metadata"',
    b'"total_size"',
    b'"total_parameters"',
    b'"model-00001-of-00003.safetensors"',
    b'"model-00003-of-00003.safetensors"',
    b'"../model.safetensors"',
    b'"/dev/zero"',
    b'"."',
    b'""',
    b'"__metadata__"',
    b"null",
    b"-1",
    b"18446744073709551616",
)


def _repo(scratch: Path) -> Path:
    """A three-shard export in ``scratch/repo`` (made once per campaign, and restored)."""
    repo = scratch / "repo"
    if not (repo / INDEX).exists() or not (repo / "pristine").exists():
        rng = np.random.default_rng(11)
        state = {
            "model": {
                "embed.weight": rng.standard_normal((32, 8)).astype(np.float32),
                "layers.0.weight": rng.standard_normal((8, 8)).astype(np.float16),
                "layers.0.bias": np.arange(8, dtype=np.int64),
                "norm": np.ones(8, dtype=np.float64),
                "head.weight": rng.standard_normal((32, 8)).astype(np.float32),
            }
        }
        sp.save(scratch / "ckpt", state)
        export(scratch / "ckpt", repo, hf=True, max_shard_size=1100, overwrite=True)
        pristine = repo / "pristine"
        pristine.mkdir()
        for name in (INDEX, SHARD):
            (pristine / name).write_bytes((repo / name).read_bytes())
    return repo


def _restore(repo: Path, name: str) -> None:
    (repo / name).write_bytes((repo / "pristine" / name).read_bytes())


def _read(repo: Path) -> None:
    assert detect.detect(repo) == "huggingface"
    detect.inspect_any(repo)
    detect.verify_any(repo)
    sp.load(repo)


def _index_seeds(scratch: Path) -> list[bytes]:
    raw = (_repo(scratch) / INDEX).read_bytes()
    bare = raw.replace(b'"total_parameters"', b'"other"')  # an index without total_parameters
    return [raw, bare, b'{"weight_map": {}}']


def _parse_index(data: bytes, scratch: Path) -> None:
    repo = _repo(scratch)
    _restore(repo, SHARD)
    huggingface.parse_index(data, "<fuzz>")
    (repo / INDEX).write_bytes(data)
    _read(repo)


def _shard_seeds(scratch: Path) -> list[bytes]:
    return [(_repo(scratch) / SHARD).read_bytes()]


def _parse_shard(data: bytes, scratch: Path) -> None:
    repo = _repo(scratch)
    _restore(repo, INDEX)
    (repo / SHARD).write_bytes(data)
    _read(repo)


register(Target("hf_index", _index_seeds, _parse_index, tokens=HF_TOKENS, text=True))
register(Target("hf_index:shard", _shard_seeds, _parse_shard, tokens=HF_TOKENS, text=True))
