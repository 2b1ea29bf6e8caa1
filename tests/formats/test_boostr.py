"""savepoint.formats.boostr: single checkpoint directories and distributed consolidation."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from savepoint.errors import (
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)
from savepoint.formats import boostr


def same(a: Any, b: Any) -> None:
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def same_dict(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        same(got[k], want[k])


MODEL = {
    "layers.0.weight": np.arange(4, dtype=np.float32).reshape(2, 2),
    "layers.0.bias": np.array([0.5, -0.5], dtype=ml_dtypes.bfloat16),
    "steps": np.array([2**62 + 1], np.int64),
    "mask": np.array([True, False]),
}
OPT = {"layers.0.weight.m": np.full((2, 2), 0.01, np.float32)}


GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def _f64_rows() -> list[tuple[float, str]]:
    rows = []
    for line in (GOLDEN / "serde" / "floats.txt").read_text("ascii").splitlines():
        kind, bits, text = line.split(" ")
        if kind == "f64":
            rows.append((float(np.uint64(int(bits, 16)).view(np.float64)), text))
    return rows


@pytest.mark.parametrize(("value", "text"), _f64_rows())
def test_learning_rate_is_written_as_serde_writes_an_f64(value: float, text: str) -> None:
    # ryu's f64 text (1e-7, 1e20, 1e16, -0.0, 2.0, 5e-324), not Python's (1e-07, 1e+20).
    raw = boostr.TrainingState(step=1, learning_rate=value).to_json()
    assert f'  "learning_rate": {text},\n'.encode() in raw
    back = boostr.TrainingState.parse(json.loads(raw)).learning_rate
    assert np.float64(back).tobytes() == np.float64(value).tobytes()


@pytest.mark.parametrize(
    ("name", "state"),
    [
        (
            "training_state_1e-7.json",
            boostr.TrainingState(7, 1, 1e-7, {"note": "serde_json pretty, ryu f64 text"}),
        ),
        ("training_state_1e20.json", boostr.TrainingState(0, 0, 1e20, {})),
    ],
)
def test_training_state_golden_bytes(
    name: str, state: boostr.TrainingState, tmp_path: Path
) -> None:
    golden = (GOLDEN / "boostr" / name).read_bytes()
    assert state.to_json() == golden
    boostr.save(tmp_path / "ck", MODEL, None, state)
    assert (tmp_path / "ck" / "training_state.json").read_bytes() == golden
    assert boostr.load(tmp_path / "ck").state == state


def test_reads_the_old_spelling(tmp_path: Path) -> None:
    # What savepoint 0.1 wrote (Python's repr: 1e-07) still reads as the same value.
    doc = json.loads((GOLDEN / "boostr" / "training_state_1e-07_old.json").read_bytes())
    assert boostr.TrainingState.parse(doc).learning_rate == 1e-7


# ---------------------------------------------------------------------------------------------
# single checkpoints
# ---------------------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    state = boostr.TrainingState(step=1000, epoch=2, learning_rate=3e-4, metadata={"run": "é"})
    boostr.save(tmp_path / "ck", MODEL, OPT, state)
    assert sorted(os.listdir(tmp_path / "ck")) == [
        "model.safetensors",
        "optimizer.safetensors",
        "training_state.json",
    ]
    doc = (tmp_path / "ck" / "training_state.json").read_text("utf-8")
    assert doc == (
        '{\n  "version": 2,\n  "step": 1000,\n  "epoch": 2,\n  "learning_rate": 0.0003,\n'
        '  "metadata": {\n    "run": "é"\n  }\n}'
    )
    loaded = boostr.load(tmp_path / "ck")
    same_dict(loaded.model, MODEL)
    assert loaded.optimizer is not None
    same_dict(loaded.optimizer, OPT)
    assert loaded.state == state
    assert loaded.model["steps"].flags.writeable
    # The model file is a standard safetensors file.
    with safetensors.safe_open(str(tmp_path / "ck" / "model.safetensors"), "np") as f:
        assert f.get_tensor("steps").tolist() == [2**62 + 1]
        assert f.metadata() is None


def test_without_optimizer_no_file_is_written(tmp_path: Path) -> None:
    boostr.save(tmp_path / "a", {"w": np.ones(1, np.float32)})
    boostr.save(tmp_path / "b", {"w": np.ones(1, np.float32)}, {})
    for name in ("a", "b"):
        assert not (tmp_path / name / "optimizer.safetensors").exists()
        loaded = boostr.load(tmp_path / name)
        assert loaded.optimizer is None and loaded.state.step == 0


def _write_state(directory: Path, doc: Any) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, str(directory / "model.safetensors"))
    text = doc if isinstance(doc, str) else json.dumps(doc)
    (directory / "training_state.json").write_text(text)


def test_version_missing_means_1_and_defaults_apply(tmp_path: Path) -> None:
    # The seed's test_version_backward_compat.
    _write_state(tmp_path, {"step": 100, "epoch": 5, "learning_rate": 0.001, "metadata": {}})
    state = boostr.read_training_state(tmp_path)
    assert (state.version, state.step, state.epoch, state.learning_rate) == (1, 100, 5, 0.001)
    _write_state(tmp_path, {"step": 7, "future_field": [1, 2]})
    assert boostr.read_training_state(tmp_path) == boostr.TrainingState(
        step=7, epoch=0, learning_rate=0.0, metadata={}, version=1
    )
    # Written back, it becomes version 2.
    boostr.save(tmp_path / "out", boostr.load(tmp_path).model, state=boostr.load(tmp_path).state)
    assert json.loads((tmp_path / "out" / "training_state.json").read_text())["version"] == 2


@pytest.mark.parametrize(
    ("doc", "error", "message"),
    [
        ({"epoch": 1}, CorruptCheckpointError, "'step' is missing"),
        ({"step": -1}, CorruptCheckpointError, "'step' must be an integer"),
        ({"step": 2**64}, CorruptCheckpointError, "'step' must be an integer"),
        ({"step": 1.5}, CorruptCheckpointError, "'step' must be an integer"),
        ({"step": True}, CorruptCheckpointError, "'step' must be an integer"),
        ({"step": 1, "epoch": None}, CorruptCheckpointError, "'epoch' is null"),
        ({"step": 1, "learning_rate": "0.1"}, CorruptCheckpointError, "learning_rate"),
        ({"step": 1, "metadata": {"a": 1}}, CorruptCheckpointError, "metadata"),
        ({"step": 1, "version": 0}, CorruptCheckpointError, "version"),
        ({"step": 1, "version": 3}, IncompatibleCheckpointError, "version 3"),
        ('{"step": 1, "step": 2}', CorruptCheckpointError, "duplicate key"),
        ('{"step": 1, "learning_rate": NaN}', CorruptCheckpointError, "NaN"),
        ("[1]", CorruptCheckpointError, "not a JSON object"),
        ("{", CorruptCheckpointError, "not valid JSON"),
    ],
)
def test_training_state_is_validated(
    tmp_path: Path, doc: Any, error: type[Exception], message: str
) -> None:
    _write_state(tmp_path, doc)
    with pytest.raises(error, match=message):
        boostr.load(tmp_path)


def test_missing_files_and_bad_safetensors(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"training_state\.json is missing"):
        boostr.load(tmp_path)
    (tmp_path / "training_state.json").write_text('{"step": 1}')
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors is missing"):
        boostr.load(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CorruptCheckpointError, match="runs past the end"):
        boostr.load(tmp_path)


def test_writer_refuses_what_boostr_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedStateError, match="null"):
        boostr.save(tmp_path / "a", MODEL, state=boostr.TrainingState(learning_rate=float("nan")))
    with pytest.raises(UnsupportedStateError, match="strings to strings"):
        boostr.save(tmp_path / "a", MODEL, state=boostr.TrainingState(metadata={"a": 1}))  # type: ignore[dict-item]
    with pytest.raises(UnsupportedStateError, match="reserved"):
        boostr.save(tmp_path / "a", {"__metadata__": np.zeros(1)})
    assert not (tmp_path / "a").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointWriteError, match="not a boostr checkpoint"):
        boostr.save(tmp_path / "other", MODEL)
    # An existing checkpoint is replaced in one step; nothing temporary remains.
    boostr.save(tmp_path / "ck", MODEL)
    boostr.save(tmp_path / "ck", {"w": np.zeros(1, np.float32)})
    assert list(boostr.load(tmp_path / "ck").model) == ["w"]
    assert sorted(os.listdir(tmp_path)) == ["ck", "other"]


@pytest.mark.torch
def test_torch_tensors_in_and_out(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    model = {"w": torch.randn(3, 2).bfloat16(), "i": torch.tensor([2**60])}
    boostr.save(tmp_path / "ck", model)
    loaded = boostr.load(tmp_path / "ck", framework="torch")
    for k, t in model.items():
        assert torch.equal(loaded.model[k], t)


# ---------------------------------------------------------------------------------------------
# distributed checkpoints
# ---------------------------------------------------------------------------------------------


def _config(
    rank: int,
    world: int,
    strategy: Any,
    owned: list[str] | None = None,
    split: dict[str, int] | None = None,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "world_size": world,
        "rank": rank,
        "owned_params": owned or [],
        "strategy": strategy,
    }
    if split is not None:
        config["split_dims"] = split
    return config


def distributed(
    root: Path,
    ranks: list[tuple[dict[str, Any], dict[str, Any] | None]],
    configs: list[dict[str, Any]],
    *,
    step: int = 200,
) -> Path:
    for r, (model, opt) in enumerate(ranks):
        boostr.save(
            root / f"rank_{r}",
            model,
            opt,
            boostr.TrainingState(step=step, epoch=1, learning_rate=0.1),
        )
    meta = {"version": 2, "world_size": len(ranks), "shards": configs}
    (root / "sharding_meta.json").write_text(json.dumps(meta, indent=2))
    return root


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def test_replicated_takes_rank_0(tmp_path: Path) -> None:
    root = distributed(
        tmp_path,
        [({"w": f32(1, 2)}, {"w.m": f32(3, 4)}), ({"w": f32(9, 9)}, {"w.m": f32(9, 9)})],
        [_config(0, 2, "Replicated"), _config(1, 2, {"Replicated": None})],
    )
    out = boostr.load_consolidated(root)
    same_dict(out.model, {"w": f32(1, 2)})
    assert out.optimizer is not None
    same_dict(out.optimizer, {"w.m": f32(3, 4)})
    assert out.state.step == 200


def test_zero_partitioned_takes_each_owned_parameter_from_its_owner(tmp_path: Path) -> None:
    zero = {"ZeroPartitioned": {"stage": 1}}
    root = distributed(
        tmp_path,
        [
            ({"embed": f32(1, 2), "head": f32(0, 0)}, {"embed.m": f32(5, 5)}),
            ({"embed": f32(0, 0), "head": f32(3, 4)}, {"head.m": f32(6, 6), "head.v": f32(7, 7)}),
        ],
        [_config(0, 2, zero, ["embed"]), _config(1, 2, zero, ["head"])],
    )
    out = boostr.load_consolidated(root)
    same_dict(out.model, {"embed": f32(1, 2), "head": f32(3, 4)})
    assert out.optimizer is not None
    same_dict(out.optimizer, {"embed.m": f32(5, 5), "head.m": f32(6, 6), "head.v": f32(7, 7)})
    info = boostr.inspect(root)
    assert (
        info.format == "boostr-distributed"
        and info.values["strategy"] == "ZeroPartitioned (stage 1)"
    )
    assert {t.key: t.file for t in info.tensors}["model/head"] == "rank_1/model.safetensors"


def test_zero_partitioned_with_the_seeds_placeholder_configs(tmp_path: Path) -> None:
    # The seed's rank 0 writes empty owned_params for the other ranks: union, as the seed does.
    zero = {"ZeroPartitioned": {"stage": 3}}
    root = distributed(
        tmp_path,
        [({"embed.weight": f32(1, 2)}, None), ({"head.weight": f32(3, 4)}, None)],
        [_config(0, 2, zero, ["embed.weight"]), _config(1, 2, zero)],
    )
    out = boostr.load_consolidated(root)
    same_dict(out.model, {"embed.weight": f32(1, 2), "head.weight": f32(3, 4)})
    assert out.optimizer is None


def test_tensor_parallel_concatenates_along_split_dims(tmp_path: Path) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(6, 12, dtype=np.float32).reshape(2, 3)
    c = np.arange(4, dtype=np.float64).reshape(2, 2)
    d = np.arange(4, 8, dtype=np.float64).reshape(2, 2)
    split = {"wq": 0, "w1": 1}
    root = distributed(
        tmp_path,
        [
            (
                {"wq": a, "w1": c, "norm": f32(1, 1)},
                {"wq": a * 2, "w1.m": c * 3, "norm.m": f32(5, 5)},
            ),
            (
                {"wq": b, "w1": d, "norm": f32(9, 9)},
                {"wq": b * 2, "w1.m": d * 3, "norm.m": f32(9, 9)},
            ),
        ],
        [_config(0, 2, "TensorParallel", split=split), _config(1, 2, "TensorParallel")],
    )
    out = boostr.load_consolidated(root)
    same_dict(
        out.model,
        {"wq": np.concatenate([a, b], 0), "w1": np.concatenate([c, d], 1), "norm": f32(1, 1)},
    )
    assert out.optimizer is not None
    same_dict(
        out.optimizer,
        {
            "wq": np.concatenate([a, b], 0) * 2,
            "w1.m": np.concatenate([c, d], 1) * 3,
            "norm.m": f32(5, 5),
        },
    )
    # consolidate() writes the seed's single checkpoint, streaming.
    boostr.consolidate(root, tmp_path / "single")
    single = boostr.load(tmp_path / "single")
    same_dict(single.model, out.model)
    assert single.state.step == 200
    # One rank's shard, as the seed loads it.
    same_dict(boostr.load_distributed(root, 1).model, {"wq": b, "w1": d, "norm": f32(9, 9)})
    with pytest.raises(IncompatibleCheckpointError, match="out of range"):
        boostr.load_distributed(root, 2)
    total = sum(t.nbytes for t in [*out.model.values(), *out.optimizer.values()])
    assert boostr.verify(root).total_bytes == total == 240


def _tp(tmp_path: Path, **changes: Any) -> Path:
    models = changes.pop("models", [{"wq": f32(1, 2)}, {"wq": f32(3, 4)}])
    configs = changes.pop(
        "configs",
        [_config(r, 2, "TensorParallel", split={"wq": 0} if r == 0 else None) for r in range(2)],
    )
    return distributed(tmp_path, [(m, None) for m in models], configs)


def test_distributed_errors(tmp_path: Path) -> None:
    cases: list[tuple[str, Any, str]] = []

    def case(name: str, message: str, **kw: Any) -> None:
        cases.append((name, kw, message))

    tp = "TensorParallel"
    zero = {"ZeroPartitioned": {"stage": 1}}
    case("missing split_dims", "needs split_dims", configs=[_config(0, 2, tp), _config(1, 2, tp)])
    case(
        "config out of range",
        "rank 2, out of range for world_size 2",
        configs=[_config(0, 2, tp, split={"wq": 0}), _config(2, 2, tp)],
    )
    case("missing config", "rank 1 is missing", configs=[_config(0, 2, tp, split={"wq": 0})])
    case(
        "duplicate config",
        "two shard configs for rank 0",
        configs=[_config(0, 2, tp, split={"wq": 0}), _config(0, 2, tp)],
    )
    case(
        "world size mismatch",
        "says world_size 3",
        configs=[_config(0, 2, tp, split={"wq": 0}), _config(1, 3, tp)],
    )
    case(
        "mixed strategies",
        "different strategies",
        configs=[_config(0, 2, tp, split={"wq": 0}), _config(1, 2, "Replicated")],
    )
    case(
        "shape mismatch",
        "do not fit together along dimension 0",
        models=[{"wq": f32(1, 2)}, {"wq": np.zeros((1, 2), np.float32)}],
    )
    case("dtype mismatch", "do not fit together", models=[{"wq": f32(1, 2)}, {"wq": np.zeros(2)}])
    case(
        "split missing on a rank",
        "missing from rank 1",
        models=[{"wq": f32(1, 2)}, {"other": f32(1)}],
    )
    case(
        "split dim too big",
        "dimension 1, but it has 1",
        configs=[_config(0, 2, tp, split={"wq": 1}), _config(1, 2, tp)],
    )
    case(
        "split param nowhere",
        "'nope' is missing from rank 0",
        configs=[_config(0, 2, tp, split={"nope": 0}), _config(1, 2, tp)],
    )
    case(
        "stray tensor",
        "rank 1 holds 'extra'",
        models=[{"wq": f32(1, 2)}, {"wq": f32(3, 4), "extra": f32(1)}],
    )
    case(
        "two owners",
        "owned by ranks 0 and 1",
        configs=[_config(0, 2, zero, ["wq"]), _config(1, 2, zero, ["wq"])],
    )
    case(
        "owner lacks it",
        "rank 1 owns 'head' but",
        configs=[_config(0, 2, zero, ["wq"]), _config(1, 2, zero, ["head"])],
    )
    case(
        "zero shape mismatch",
        "'wq' is F32 [2] in rank 0 and F32 [3] in rank 1",
        models=[{"wq": f32(1, 2)}, {"wq": f32(1, 2, 3)}],
        configs=[_config(0, 2, zero), _config(1, 2, zero)],
    )
    case(
        "unknown strategy",
        "unknown strategy",
        configs=[_config(0, 2, "Sharded"), _config(1, 2, "Sharded")],
    )
    for i, (_name, kw, message) in enumerate(cases):
        root = _tp(tmp_path / str(i), **kw)
        with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
            boostr.load_consolidated(root)


def test_distributed_missing_and_extra_rank_directories(tmp_path: Path) -> None:
    root = _tp(tmp_path / "a")
    os.rename(root / "rank_1", root / "rank_2")
    with pytest.raises(CorruptCheckpointError, match="rank 1 is missing: no rank_1/ directory"):
        boostr.load_consolidated(root)
    root = _tp(tmp_path / "b")
    boostr.save(root / "rank_2", {"wq": f32(0, 0)})
    with pytest.raises(CorruptCheckpointError, match="rank_2/ is out of range for world_size 2"):
        boostr.load_consolidated(root)
    root = _tp(tmp_path / "c")
    boostr.save(root / "rank_1", {"wq": f32(3, 4)}, state=boostr.TrainingState(step=199))
    with pytest.raises(CorruptCheckpointError, match="rank 1 at step 199"):
        boostr.load_consolidated(root)
    root = _tp(tmp_path / "d")
    (root / "sharding_meta.json").write_text('{"version": 2, "world_size": 0, "shards": []}')
    with pytest.raises(CorruptCheckpointError, match="world_size 0"):
        boostr.load_consolidated(root)
    (root / "sharding_meta.json").write_text('{"version": 2, "world_size": 2}')
    with pytest.raises(CorruptCheckpointError, match="'shards' must be a list"):
        boostr.load_consolidated(root)
    os.remove(root / "sharding_meta.json")
    with pytest.raises(CorruptCheckpointError, match="not a distributed checkpoint"):
        boostr.load_consolidated(root)


# ---------------------------------------------------------------------------------------------
# numbers, as serde_json reads them; hostile documents; files that cannot be read
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # At HEAD: OverflowError (float() of a 400-digit integer).
        ('{"step": 1, "learning_rate": 1' + "0" * 400 + "}", "'learning_rate' is out of range"),
        # At HEAD: accepted as inf (Python reads 1e400 as inf; serde_json refuses it).
        ('{"step": 1, "learning_rate": 1e400}', "'learning_rate' is out of range"),
        ('{"step": 1, "learning_rate": -1e400}', "'learning_rate' is out of range"),
        ('{"step": 1, "learning_rate": Infinity}', "non-standard number Infinity"),
        ('{"step": 1, "learning_rate": -Infinity}', "non-standard number -Infinity"),
        ('{"step": 1, "learning_rate": true}', "'learning_rate' must be a number"),
        ('{"step": 1, "learning_rate": null}', "'learning_rate' must be a number"),
        # serde_json reads -0 as the float -0.0: not a u64 (at HEAD: accepted as 0).
        ('{"step": -0}', "'step' must be an integer"),
        ('{"step": 1, "epoch": -0}', "'epoch' must be an integer"),
        ('{"step": 1, "epoch": 2.0}', "'epoch' must be an integer"),
        ('{"step": 1, "epoch": 1e400}', "'epoch' must be an integer"),
        ('{"step": 1' + "0" * 400 + "}", "'step' must be an integer"),
        ('{"step": 18446744073709551616}', "'step' must be an integer"),
        ('{"step": 1, "version": 4294967296}', "'version' must be an integer"),
        ('{"step": ' + "9" * 5000 + "}", "not valid JSON"),
        ('{"step": 1, "metadata": {"k": 1e400}}', "'metadata' must map strings to strings"),
        ("[" * 100_000 + "]" * 100_000, "nested deeper than 512 levels"),
        ('{"step": 1, "x": ' + "[" * 1000 + "]" * 1000 + "}", "nested deeper than 512 levels"),
    ],
)
def test_every_number_as_serde_reads_it(tmp_path: Path, text: str, message: str) -> None:
    _write_state(tmp_path, text)
    with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
        boostr.load(tmp_path)


@pytest.mark.parametrize(
    ("text", "step", "learning_rate"),
    [
        ('{"step": 18446744073709551615, "learning_rate": 1}', 2**64 - 1, 1.0),
        ('{"step": 0, "learning_rate": -0}', 0, -0.0),  # serde: -0 is the float -0.0
        ('{"step": 0, "learning_rate": -0.0}', 0, -0.0),
        ('{"step": 0, "learning_rate": 1e-400}', 0, 0.0),
        ('{"step": 0, "learning_rate": 18446744073709551617}', 0, 18446744073709551616.0),
        ('{"step": 5, "unknown": 1e400, "other": [1, {"a": null}]}', 5, 0.0),  # serde skips these
    ],
)
def test_numbers_serde_accepts(tmp_path: Path, text: str, step: int, learning_rate: float) -> None:
    _write_state(tmp_path, text)
    state = boostr.load(tmp_path).state
    assert state.step == step
    assert state.learning_rate == learning_rate
    assert np.copysign(1.0, state.learning_rate) == np.copysign(1.0, learning_rate)


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ({"wq": 2**64}, "'wq' must be an integer"),  # at HEAD: accepted
        ({"wq": -0}, "'wq' must be an integer"),
        ({"wq": 1.0}, "'wq' must be an integer"),
        ({"wq": True}, "'wq' must be an integer"),
        ([0], "'split_dims' must map"),
    ],
)
def test_split_dims_are_usize(tmp_path: Path, split: Any, message: str) -> None:
    root = _tp(tmp_path)
    meta = json.loads((root / "sharding_meta.json").read_text())
    meta["shards"][0]["split_dims"] = split
    text = json.dumps(meta).replace('"wq": 0', '"wq": -0') if split == {"wq": -0} else None
    (root / "sharding_meta.json").write_text(text or json.dumps(meta))
    with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
        boostr.load_consolidated(root)


def test_dense_training_state_is_refused_within_the_memory_bound(tmp_path: Path) -> None:
    """8 MiB of ``{},`` in an ignored member: at HEAD parsed at about 25 x its size."""
    import tracemalloc

    text = '{"step": 1, "x": [' + "{}," * ((8 << 20) // 3) + "0]}"
    _write_state(tmp_path, text)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="too many values for its size"):
            boostr.load(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 24 * len(text) + (32 << 20)


def test_a_training_state_that_shrinks_while_read_is_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from savepoint.storage import _local_read  # (where read_small looks read_exact up)

    _write_state(tmp_path, {"step": 1})

    def short(fd: int, offset: int, length: int) -> bytes:
        raise EOFError(f"wanted {length} bytes at {offset}")

    monkeypatch.setattr(_local_read, "read_exact", short)
    with pytest.raises(CorruptCheckpointError, match="shrank while being read"):  # HEAD: EOFError
        boostr.read_training_state(tmp_path)


def test_special_and_unreadable_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from savepoint.errors import CheckpointPermissionError

    _write_state(tmp_path, {"step": 1})
    os.mkfifo(tmp_path / "sharding_meta.json")  # a FIFO never blocks the reader
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        boostr.read_sharding_meta(tmp_path)
    real_open = os.open

    def denied(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if str(path).endswith("training_state.json"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(CheckpointPermissionError):
        boostr.load(tmp_path)


def test_unlistable_distributed_directory_is_a_permission_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from savepoint.errors import CheckpointPermissionError

    root = _tp(tmp_path)
    real_listdir = os.listdir

    def denied(path: Any = ".") -> list[str]:
        if Path(path) == root:
            raise PermissionError(13, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", denied)
    with pytest.raises(CheckpointPermissionError):  # at HEAD: a raw PermissionError
        boostr.load_consolidated(root)
