"""savepoint.formats.training_artifact: seed 001's directories, its fallback rules and errors."""

from __future__ import annotations

import filecmp
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _support import in_thread, load_generator
from savepoint.errors import (
    ArtifactMismatchError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MissingBestValidationArtifact,
    MissingCheckpointError,
    RunMismatchError,
    UnsupportedStateError,
)
from savepoint.formats import burn, detect
from savepoint.formats import training_artifact as ta

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "burn"


gen = load_generator(GOLDEN / "make_golden.py", "burn_golden")
IDS = {"embed.weight": gen.pid(11), "head.weight": gen.pid(12), "head.steps": gen.pid(13)}


def same(a: Any, b: Any, where: str = "") -> None:
    assert (a.dtype, a.shape) == (b.dtype, b.shape), where
    assert a.tobytes() == b.tobytes(), where


def same_flat(got: dict[str, Any] | None, want: dict[str, Any]) -> None:
    assert got is not None
    assert list(got) == list(want)
    for k in want:
        same(got[k], want[k], k)


MODEL = {
    "layers.0.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
    "layers.0.bias": np.zeros(3, np.float32),
    "layers.1.weight": np.ones((3, 1), np.float32),
    "counter": np.array([4], np.int64),
}
BEST = {k: v + 1 for k, v in MODEL.items()}


def report(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "variant": "baseline",
        "config": {"d_model": 3, "learning_rate": 0.01},
        "num_params": 12,
        "steps_completed": 10,
        "best_validation": {"loss": 0.5},
        "best_validation_step": 6,
        "history": [1.0, 0.5],
    }
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not ...}


def make(path: Path, **kwargs: Any) -> Path:
    kwargs.setdefault("report", report())
    kwargs.setdefault("best_validation_model", BEST)
    ta.save(path, kwargs.pop("model", MODEL), kwargs.pop("report"), **kwargs)
    return path


def edit_json(path: Path, **changes: Any) -> None:
    doc = json.loads(path.read_text("utf-8"))
    doc.update(changes)
    for k in [k for k, v in changes.items() if v is ...]:
        del doc[k]
    path.write_text(json.dumps(doc, indent=2), "utf-8")


def tree_state(root: Path) -> dict[str, tuple[int, int, bytes]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st_ = os.lstat(p)
            data = b"" if os.path.isdir(p) else Path(p).read_bytes()
            out[os.path.relpath(p, root)] = (st_.st_mtime_ns, st_.st_mode, data)
    return out


# ---------------------------------------------------------------------------------------------
# golden directories
# ---------------------------------------------------------------------------------------------


def test_golden_artifact_reads_exactly() -> None:
    a = ta.load(GOLDEN / "artifact")
    assert a.manifest == ta.CheckpointManifest(
        "ddl", {"d_model": 4, "learning_rate": 0.001, "layers": [2, 3]}, 9, "model"
    )
    assert a.report["final_loss"] == 0.5
    assert a.report["best_validation"] == {"step": 15, "loss": 0.25}
    same_flat(a.model, gen.artifact_model(1.0))
    same_flat(a.best_validation_model, gen.artifact_model(0.5))
    assert a.best_validation_source == "best_validation"
    assert a.optimizer_state == gen.OPTIMIZER_STATE


def test_golden_artifact_is_written_back_byte_for_byte(tmp_path: Path) -> None:
    a = ta.load(GOLDEN / "artifact")
    manifest = ta.save(
        tmp_path / "artifact",
        a.model,
        a.report,
        optimizer_state=a.optimizer_state or b"",
        best_validation_model=a.best_validation_model,
        ids=IDS,
    )
    assert manifest == a.manifest
    cmp = filecmp.dircmp(GOLDEN / "artifact", tmp_path / "artifact")
    assert not cmp.left_only and not cmp.right_only and not cmp.diff_files
    assert not cmp.subdirs["best_validation"].diff_files
    for rel in gen.artifact_files():
        if rel.startswith("artifact/"):
            assert (tmp_path / rel).read_bytes() == (GOLDEN / rel).read_bytes(), rel


def test_golden_sweep_reads_and_writes_back(tmp_path: Path) -> None:
    sweep = ta.load_sweep(GOLDEN / "sweep")
    assert sweep.comparison == {"variants": ["baseline"], "best": "baseline"}
    (slug, a), *rest = sweep.artifacts.items()
    assert not rest and slug == "baseline"
    assert a.best_validation_source == "model"  # best step 5 == steps_completed 5
    assert a.optimizer_state == b""
    assert a.best_validation_model is not None
    assert a.best_validation_model["w"] is a.model["w"]
    outcome = ta.Outcome(a.model, a.report, ids={"w": gen.pid(21)})
    ta.save_sweep(tmp_path / "sweep", sweep.comparison, {"baseline": outcome})
    for rel in gen.artifact_files():
        if rel.startswith("sweep/"):
            assert (tmp_path / rel).read_bytes() == (GOLDEN / rel).read_bytes(), rel


def test_inspect_and_verify_describe_the_artifact() -> None:
    info = ta.inspect(GOLDEN / "artifact")
    assert info.label == "training-artifact"
    assert [t.key for t in info.tensors] == [
        "model/embed.weight",
        "model/head.weight",
        "model/head.steps",
        "best_validation_model/embed.weight",
        "best_validation_model/head.weight",
        "best_validation_model/head.steps",
    ]
    assert info.tensors[3].file == os.path.join("best_validation", "model.mpk")
    assert info.values["steps_completed"] == 20
    assert info.values["best_validation_step"] == 15
    assert info.values["optimizer_state_bytes"] == len(gen.OPTIMIZER_STATE)
    assert info.metadata["config"]["layers"] == [2, 3]
    assert sorted(info.files) == sorted(
        rel.removeprefix("artifact/") for rel in gen.artifact_files() if rel.startswith("artifact/")
    )
    assert ta.verify(GOLDEN / "artifact").to_dict() == info.to_dict()
    json.dumps(info.to_dict())


# ---------------------------------------------------------------------------------------------
# the best-validation fallback rules
# ---------------------------------------------------------------------------------------------


def test_best_from_its_own_directory(tmp_path: Path) -> None:
    a = ta.load(make(tmp_path / "a"))
    same_flat(a.model, MODEL)
    same_flat(a.best_validation_model, BEST)
    assert a.best_validation_source == "best_validation"


def test_no_best_in_the_report_means_none_even_with_a_directory(tmp_path: Path) -> None:
    make(tmp_path / "a")
    edit_json(tmp_path / "a" / "training_report.json", best_validation=None)
    a = ta.load(tmp_path / "a")
    assert a.best_validation_model is None and a.best_validation_source is None
    edit_json(tmp_path / "a" / "training_report.json", best_validation=...)
    assert ta.load(tmp_path / "a").best_validation_model is None


def test_final_model_stands_in_when_the_best_step_is_the_last(tmp_path: Path) -> None:
    make(tmp_path / "a", report=report(best_validation_step=10), best_validation_model=None)
    assert not (tmp_path / "a" / "best_validation").exists()
    a = ta.load(tmp_path / "a")
    assert a.best_validation_source == "model"
    assert a.best_validation_model is not None
    assert all(a.best_validation_model[k] is a.model[k] for k in MODEL)


@pytest.mark.parametrize("best_step", [6, None])
def test_missing_best_directory_is_an_error(tmp_path: Path, best_step: int | None) -> None:
    make(tmp_path / "a")
    shutil.rmtree(tmp_path / "a" / "best_validation")
    edit_json(tmp_path / "a" / "training_report.json", best_validation_step=best_step)
    with pytest.raises(MissingBestValidationArtifact) as info:
        ta.load(tmp_path / "a")
    assert isinstance(info.value, MissingCheckpointError)
    assert isinstance(info.value, CorruptCheckpointError)
    assert info.value.path == str(tmp_path / "a" / "best_validation")
    assert "missing the best-validation checkpoint at" in str(info.value)


def test_best_directory_without_manifest_counts_as_missing(tmp_path: Path) -> None:
    make(tmp_path / "a")
    (tmp_path / "a" / "best_validation" / "manifest.json").unlink()
    with pytest.raises(MissingBestValidationArtifact):
        ta.load(tmp_path / "a")


# ---------------------------------------------------------------------------------------------
# consistency checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"variant": "ddl"},
            "training artifact is inconsistent: report variant ddl does not match manifest "
            "variant baseline",
        ),
        ({"config": {"d_model": 4}}, "report config does not match manifest config"),
        ({"num_params": 13}, "report num_params 13 does not match manifest 12"),
    ],
)
def test_report_and_manifest_must_agree(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    make(tmp_path / "a")
    edit_json(tmp_path / "a" / "training_report.json", **change)
    with pytest.raises(ArtifactMismatchError, match=message) as info:
        ta.load(tmp_path / "a")
    assert isinstance(info.value, RunMismatchError)


def test_checks_run_in_the_seeds_order(tmp_path: Path) -> None:
    make(tmp_path / "a")
    edit_json(tmp_path / "a" / "training_report.json", variant="x", num_params=1)
    with pytest.raises(ArtifactMismatchError, match="variant"):
        ta.load(tmp_path / "a")


def test_best_manifest_must_agree_with_the_main_one(tmp_path: Path) -> None:
    make(tmp_path / "a")
    edit_json(tmp_path / "a" / "best_validation" / "manifest.json", num_params=99)
    with pytest.raises(ArtifactMismatchError, match=r"best_validation/manifest\.json num_params"):
        ta.load(tmp_path / "a")


def test_verify_checks_the_report_copy(tmp_path: Path) -> None:
    make(tmp_path / "a")
    ta.verify(tmp_path / "a")
    edit_json(tmp_path / "a" / "best_validation" / "training_report.json", steps_completed=11)
    ta.load(tmp_path / "a")  # the seed's load does not read the copy
    with pytest.raises(ArtifactMismatchError, match="differs from the report"):
        ta.verify(tmp_path / "a")


# ---------------------------------------------------------------------------------------------
# error cases
# ---------------------------------------------------------------------------------------------


def test_missing_and_incomplete_directories(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        ta.load(tmp_path / "absent")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(CorruptCheckpointError, match="not a directory"):
        ta.load(tmp_path / "file")
    make(tmp_path / "a")
    (tmp_path / "a" / "training_report.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"training_report\.json"):
        ta.load(tmp_path / "a")
    make(tmp_path / "b")
    (tmp_path / "b" / "manifest.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"manifest\.json"):
        ta.load(tmp_path / "b")


@pytest.mark.parametrize(
    ("file", "content", "match"),
    [
        ("training_report.json", b"{", "training_report.json"),
        ("training_report.json", b"[1]", "not a JSON object"),
        ("training_report.json", b'{"a": 1, "a": 2}', "duplicate"),
        ("manifest.json", b"\xff", "manifest.json"),
    ],
)
def test_malformed_documents(tmp_path: Path, file: str, content: bytes, match: str) -> None:
    make(tmp_path / "a")
    (tmp_path / "a" / file).write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=match):
        ta.load(tmp_path / "a")


@pytest.mark.parametrize(
    ("file", "change", "match"),
    [
        ("training_report.json", {"steps_completed": -1}, "'steps_completed' must be"),
        ("training_report.json", {"steps_completed": ...}, "'steps_completed' must be .*missing"),
        ("training_report.json", {"num_params": True}, "'num_params' must be"),
        ("training_report.json", {"best_validation_step": "6"}, "'best_validation_step'"),
        ("training_report.json", {"variant": ...}, "'variant' is missing"),
        ("manifest.json", {"config": ...}, "'config' is missing"),
        ("manifest.json", {"num_params": 1.5}, "'num_params' must be"),
        ("manifest.json", {"weights_stem": "../../etc/model"}, "plain file name"),
        ("manifest.json", {"weights_stem": ".."}, "plain file name"),
        ("manifest.json", {"weights_stem": 3}, "plain file name"),
        ("manifest.json", {"weights_stem": "other"}, "other.mpk is missing"),
    ],
)
def test_bad_fields(tmp_path: Path, file: str, change: dict[str, Any], match: str) -> None:
    make(tmp_path / "a")
    edit_json(tmp_path / "a" / file, **change)
    with pytest.raises(CorruptCheckpointError, match=match):
        ta.load(tmp_path / "a")


def test_weights_stem_follows_set_extension(tmp_path: Path) -> None:
    make(tmp_path / "a", weights_stem="weights.v2")
    assert (tmp_path / "a" / "weights.mpk").is_file()
    assert ta.load(tmp_path / "a").manifest.weights_stem == "weights.v2"


def test_damaged_weights_are_corrupt(tmp_path: Path) -> None:
    make(tmp_path / "a")
    weights = tmp_path / "a" / "best_validation" / "model.mpk"
    weights.write_bytes(weights.read_bytes()[:-3])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        ta.load(tmp_path / "a")


def test_optimizer_state_is_optional(tmp_path: Path) -> None:
    make(tmp_path / "a", optimizer_state=b"\x00state")
    assert ta.load(tmp_path / "a").optimizer_state == b"\x00state"
    (tmp_path / "a" / "optimizer_state.bin").unlink()
    assert ta.load(tmp_path / "a").optimizer_state is None
    assert ta.inspect(tmp_path / "a").values["optimizer_state_bytes"] is None


@pytest.mark.parametrize(
    "name",
    [
        "training_report.json",
        "manifest.json",
        "model.mpk",
        "optimizer_state.bin",
        "best_validation/manifest.json",
    ],
)
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(tmp_path: Path, name: str) -> None:
    make(tmp_path / "a")
    (tmp_path / "a" / name).unlink()
    os.mkfifo(tmp_path / "a" / name)
    for op in (ta.load, ta.inspect, ta.verify):
        got = in_thread(lambda op=op: op(tmp_path / "a"))
        assert isinstance(got, CorruptCheckpointError), repr(got)
        assert "not a regular file" in str(got)


def test_symlinked_files_are_refused(tmp_path: Path) -> None:
    make(tmp_path / "a")
    real = tmp_path / "report.json"
    (tmp_path / "a" / "training_report.json").rename(real)
    (tmp_path / "a" / "training_report.json").symlink_to(real)
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        ta.load(tmp_path / "a")


def test_loading_writes_nothing(tmp_path: Path) -> None:
    make(tmp_path / "a")
    before = tree_state(tmp_path)
    ta.load(tmp_path / "a")
    ta.inspect(tmp_path / "a")
    ta.verify(tmp_path / "a")
    ta.load_checkpoint(tmp_path / "a" / "best_validation")
    assert tree_state(tmp_path) == before


def test_load_checkpoint_reads_a_manifest_and_its_weights(tmp_path: Path) -> None:
    make(tmp_path / "a")
    manifest, tensors = ta.load_checkpoint(tmp_path / "a" / "best_validation")
    assert manifest.num_params == 12
    same_flat(tensors, BEST)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def test_save_replaces_an_existing_best_validation(tmp_path: Path) -> None:
    make(tmp_path / "a")
    assert (tmp_path / "a" / "best_validation").is_dir()
    make(tmp_path / "a", report=report(best_validation_step=10), best_validation_model=None)
    assert not (tmp_path / "a" / "best_validation").exists()
    assert ta.load(tmp_path / "a").best_validation_source == "model"
    other = {k: v * 3 for k, v in BEST.items()}
    make(tmp_path / "a", best_validation_model=other)
    same_flat(ta.load(tmp_path / "a").best_validation_model, other)
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no temporaries left


def test_save_derives_num_params_and_refuses_a_disagreeing_report(tmp_path: Path) -> None:
    m = make(tmp_path / "a")
    assert ta.load(m).manifest.num_params == 12  # float elements only (the int64 one excluded)
    with pytest.raises(ArtifactMismatchError, match="report num_params 11"):
        make(tmp_path / "b", report=report(num_params=11))
    assert not (tmp_path / "b").exists()
    make(tmp_path / "c", report=report(num_params=16), num_params=16)
    assert ta.load(tmp_path / "c").manifest.num_params == 16


def test_save_refuses_an_artifact_that_would_not_load(tmp_path: Path) -> None:
    with pytest.raises(ArtifactMismatchError, match="could not be loaded"):
        make(tmp_path / "a", best_validation_model=None)
    with pytest.raises(UnsupportedStateError, match="'steps_completed'"):
        make(tmp_path / "a", report=report(steps_completed=...))
    with pytest.raises(UnsupportedStateError, match="plain file name"):
        make(tmp_path / "a", weights_stem="a/b")
    with pytest.raises(UnsupportedStateError, match="JSON"):
        make(tmp_path / "a", report=report(extra=float("nan")))
    with pytest.raises(UnsupportedStateError, match="bytes"):
        make(tmp_path / "a", optimizer_state="text")
    assert not (tmp_path / "a").exists()


def test_save_refuses_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointWriteError, match=r"notes\.txt"):
        make(tmp_path / "a")
    assert (tmp_path / "a" / "notes.txt").read_text() == "mine"
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointWriteError, match="not a directory"):
        make(tmp_path / "f")


def test_failed_save_leaves_the_previous_artifact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make(tmp_path / "a")
    before = tree_state(tmp_path / "a")
    real = burn.write_record
    calls = []

    def failing(path: Any, item: Any, **kw: Any) -> None:
        calls.append(path)
        if "best_validation" in os.fspath(path):
            raise OSError(28, "No space left on device")
        real(path, item, **kw)

    monkeypatch.setattr(burn, "write_record", failing)
    with pytest.raises(CheckpointWriteError, match="No space left") as info:
        make(tmp_path / "a", model={k: v * 0 for k, v in MODEL.items()})
    assert info.value.errno == 28
    assert len(calls) == 2
    assert tree_state(tmp_path / "a") == before
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_sweep_slugs_must_be_plain_names(tmp_path: Path) -> None:
    outcome = ta.Outcome(MODEL, report(), best_validation_model=BEST)
    with pytest.raises(UnsupportedStateError, match="slug"):
        ta.save_sweep(tmp_path / "s", {}, {"../x": outcome})
    ta.save_sweep(tmp_path / "s", {"n": 1}, {"baseline": outcome, "ddl": outcome})
    assert ta.is_sweep(tmp_path / "s") and ta.is_artifact(tmp_path / "s" / "ddl")
    sweep = ta.load_sweep(tmp_path / "s")
    assert sweep.comparison == {"n": 1} and sorted(sweep.artifacts) == ["baseline", "ddl"]
    with pytest.raises(IncompleteCheckpointError, match=r"training_comparison\.json"):
        ta.load_sweep(tmp_path / "s" / "ddl")


reports = st.fixed_dictionaries(
    {
        "variant": st.sampled_from(["baseline", "ddl", {"Ddl": {"rank": 2}}]),
        "config": st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5)),
        "steps_completed": st.integers(0, 2**64 - 1),
        "extra": st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=3),
    }
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(doc=reports, with_best=st.booleans(), opt=st.binary(max_size=40))
def test_round_trip(tmp_path: Path, doc: dict[str, Any], with_best: bool, opt: bytes) -> None:
    doc = dict(doc, num_params=12, best_validation={"loss": 1.0} if with_best else None)
    doc["best_validation_step"] = 0 if with_best else None
    if with_best and doc["steps_completed"] == 0:
        doc["steps_completed"] = 1
    ta.save(
        tmp_path / "rt",
        MODEL,
        doc,
        optimizer_state=opt,
        best_validation_model=BEST if with_best else None,
    )
    a = ta.load(tmp_path / "rt")
    assert a.report == doc
    assert a.optimizer_state == opt
    same_flat(a.model, MODEL)
    if with_best:
        same_flat(a.best_validation_model, BEST)
    else:
        assert a.best_validation_model is None
    ta.verify(tmp_path / "rt")


def test_every_public_entry_point_raises_checkpoint_errors_only(tmp_path: Path) -> None:
    make(tmp_path / "a")
    for rel in ("manifest.json", "training_report.json", "model.mpk", "optimizer_state.bin"):
        path = tmp_path / "a" / rel
        data = path.read_bytes()
        for cut in range(0, len(data), max(1, len(data) // 9)):
            path.write_bytes(data[:cut])
            for op in (ta.load, ta.inspect, ta.verify):
                try:
                    op(tmp_path / "a")
                except CheckpointError:
                    pass
        path.write_bytes(data)


# ---------------------------------------------------------------------------------------------
# inspect / verify / convert (once detect and conversion know the format)
# ---------------------------------------------------------------------------------------------

plugged = pytest.mark.skipif(
    "training-artifact" not in detect.FORMATS,
    reason="savepoint.formats.detect does not know training artifacts yet",
)


@plugged
def test_detect_inspect_verify_and_the_cli(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from savepoint.cli import main

    assert detect.detect(GOLDEN / "artifact") == "training-artifact"
    assert detect.detect(GOLDEN / "artifact" / "best_validation") == "training-artifact"
    assert detect.inspect_any(GOLDEN / "artifact") == ta.inspect(GOLDEN / "artifact")
    assert (
        detect.verify_any(GOLDEN / "sweep" / "baseline").values["best_validation_model"] == "model"
    )
    with pytest.raises(CheckpointError, match="sweep"):
        detect.detect(GOLDEN / "sweep")
    runner = CliRunner()
    result = runner.invoke(main, ["inspect", str(GOLDEN / "artifact")])
    assert result.exit_code == 0, result.output
    assert "best_validation_model/head.steps" in result.output
    result = runner.invoke(main, ["verify", str(GOLDEN / "artifact")])
    assert result.exit_code == 0 and result.output.startswith("ok:"), result.output
    make(tmp_path / "bad")
    edit_json(tmp_path / "bad" / "training_report.json", num_params=1)
    result = runner.invoke(main, ["verify", str(tmp_path / "bad")])
    assert result.exit_code == 1 and "report num_params 1" in result.output


@plugged
def test_convert_an_artifact_to_savepoint_and_its_model_to_burn(tmp_path: Path) -> None:
    import savepoint as sp
    from savepoint.errors import ConversionError
    from savepoint.formats.convert import convert

    convert(GOLDEN / "artifact", tmp_path / "native")
    tree = sp.load(tmp_path / "native")
    a = ta.load(GOLDEN / "artifact")
    same_flat({k: tree["model"][k] for k in a.model}, a.model)
    assert bytes(tree["optimizer_state"]) == a.optimizer_state
    assert tree["report"] == a.report
    with pytest.raises(ConversionError, match="outside 'model'"):
        convert(tmp_path / "native", tmp_path / "model.mpk")
    report = convert(tmp_path / "native", tmp_path / "model.mpk", lossy=True)
    assert report.destination_format == "burn" and report.tensors == 3
    same_flat(burn.load_record(tmp_path / "model.mpk"), a.model)


def test_public_names_and_errors_survive_pickling() -> None:
    import pickle

    for module in (ta, burn):
        assert module.__all__ == sorted(module.__all__)
        assert all(hasattr(module, name) for name in module.__all__)
    for err in (
        MissingBestValidationArtifact("missing", path="/run/best_validation"),
        ArtifactMismatchError("mismatch", path="/run"),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and (back.path, str(back)) == (err.path, str(err))


# ---------------------------------------------------------------------------------------------
# the seed's functions: load_manifest, save_checkpoint, save_training_report, load_training_report
# ---------------------------------------------------------------------------------------------

SERDE = GOLDEN.parent / "serde"


def test_seed_functions_write_serde_json_byte_for_byte(tmp_path: Path) -> None:
    # Floats as the seed's serde_json writes them: 1e-7 (not 1e-07), 1e16, 1e20, 0.00001, -0.0.
    want_manifest = (SERDE / "manifest.json").read_bytes()
    want_report = (SERDE / "training_report.json").read_bytes()
    doc = json.loads(want_report)
    manifest = ta.save_checkpoint(tmp_path / "a", MODEL, "ddl", doc["config"], num_params=9)
    assert (tmp_path / "a" / "manifest.json").read_bytes() == want_manifest
    assert sorted(os.listdir(tmp_path / "a")) == ["manifest.json", "model.mpk"]  # no report
    assert ta.load_manifest(tmp_path / "a") == manifest
    ta.save_training_report(tmp_path / "a", doc)
    assert (tmp_path / "a" / "training_report.json").read_bytes() == want_report
    back = ta.load_training_report(tmp_path / "a")
    assert back == doc and math.copysign(1.0, back["config"]["init_scale"]) < 0
    loaded = ta.load(tmp_path / "a")  # best step == last step: the final model stands in
    assert loaded.best_validation_source == "model" and loaded.manifest == manifest
    same_flat(loaded.model, MODEL)
    # The whole-artifact save writes the same documents.
    ta.save(tmp_path / "b", MODEL, doc, num_params=9)
    assert (tmp_path / "b" / "manifest.json").read_bytes() == want_manifest
    assert (tmp_path / "b" / "training_report.json").read_bytes() == want_report


def test_seed_functions_read_the_old_spelling(tmp_path: Path) -> None:
    # What savepoint 0.1 wrote (Python's json: 1e-07, 1e+16) still reads as the same values.
    make(tmp_path / "a")
    edit_json(tmp_path / "a" / "training_report.json", history=[1e-07, 1e16])
    text = (tmp_path / "a" / "training_report.json").read_text("utf-8")
    assert "1e-07" in text and "1e+16" in text
    assert ta.load_training_report(tmp_path / "a")["history"] == [1e-7, 1e16]
    assert ta.load_manifest(tmp_path / "a").num_params == 12


def test_seed_functions_refuse_what_would_not_load(tmp_path: Path) -> None:
    make(tmp_path / "a")
    before = tree_state(tmp_path / "a")
    with pytest.raises(ArtifactMismatchError, match="report variant baseline does not match"):
        ta.save_checkpoint(tmp_path / "a", MODEL, "ddl", report()["config"])
    with pytest.raises(ArtifactMismatchError, match="num_params"):
        ta.save_training_report(tmp_path / "a", report(num_params=13))
    with pytest.raises(UnsupportedStateError, match="steps_completed"):
        ta.save_training_report(tmp_path / "a", report(steps_completed=...))
    assert tree_state(tmp_path / "a") == before
    with pytest.raises(CheckpointNotFoundError):
        ta.load_manifest(tmp_path / "nope")
    with pytest.raises(IncompleteCheckpointError):
        ta.load_training_report(tmp_path)
    # A checkpoint that agrees with the report replaces the weights and the manifest.
    ta.save_checkpoint(tmp_path / "a", BEST, "baseline", report()["config"])
    same_flat(ta.load(tmp_path / "a").model, BEST)
