"""What users of other tools meet first at the facade (issue 25, items 12-14): paths that are
not checkpoints named for what they are (one classifier for the library and the CLI), files of
other formats read by sp.load, sp.save refusing single-file names, and torch habits answered
with the savepoint argument to use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
from savepoint.cli import main
from savepoint.formats import shrew


class Box:
    """A Stateful that is not a torch module (a stand-in for a model)."""

    def __init__(self, n: int = 3) -> None:
        self.w = np.zeros(n, np.float32)
        self.b = np.zeros(1, np.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "b": self.b}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w, self.b = state["w"], state["b"]


def make_run(run: Path) -> None:
    with sp.CheckpointManager(run, keep_last=2) as m:
        for step in (1, 2):
            m.save(step, {"model": {"w": np.full(3, step, np.float32)}})


# -- item 12: what a path is, and what to call --------------------------------------------------


def _run(tmp: Path) -> tuple[Path, tuple[str, ...]]:
    make_run(tmp / "run")
    r = tmp / "run"
    return r, ("is a savepoint run directory", f"sp.open_run('{r}')", f"'{r}/latest'", "2")


def _sweep(tmp: Path) -> tuple[Path, tuple[str, ...]]:
    make_run(tmp / "sweep" / "a")
    s = tmp / "sweep"
    return s, ("is a sweep of 1 run(s) (a)", f"'{s}/a/latest'", f"sp.Sweep('{s}')")


def _folder(tmp: Path) -> tuple[Path, tuple[str, ...]]:
    make_run(tmp / "run")
    f = tmp / "run" / "checkpoints"
    return f, ("is the checkpoints/ folder of the run", f"'{f}/step-0000000002'")


def _plain(tmp: Path) -> tuple[Path, tuple[str, ...]]:
    d = tmp / "plain"
    d.mkdir()
    (d / "notes.txt").write_text("x")
    return d, ("a directory without manifest.json (it holds notes.txt)", "not a savepoint")


def _empty(tmp: Path) -> tuple[Path, tuple[str, ...]]:
    (tmp / "empty").mkdir()
    return tmp / "empty", ("is an empty directory", "nothing was saved there")


KINDS: dict[str, Callable[[Path], tuple[Path, tuple[str, ...]]]] = {
    "run": _run,
    "sweep": _sweep,
    "run-folder": _folder,
    "plain": _plain,
    "empty": _empty,
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_path_that_is_no_checkpoint_says_what_it_is(tmp_path: Path, kind: str) -> None:
    path, needles = KINDS[kind](tmp_path)
    for call, fn in (("sp.load", sp.load), ("sp.inspect", sp.inspect), ("sp.verify", sp.verify)):
        with pytest.raises(sp.IncompleteCheckpointError) as info:
            fn(path)
        text = str(info.value)
        assert "did not commit" not in text and "earlier checkpoint" not in text, text
        for needle in needles:
            assert needle in text, (call, needle, text)
        assert info.value.path == str(path)
    if kind == "run":
        with pytest.raises(sp.IncompleteCheckpointError, match="`savepoint verify"):
            sp.verify(path)


def test_a_save_that_did_not_commit_still_says_so(tmp_path: Path) -> None:
    make_run(tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "step-0000000009"
    step.mkdir()
    copy = tmp_path / "copy"  # a checkpoint whose manifest is gone
    sp.save(copy, {"w": np.ones(2)})
    (copy / "manifest.json").unlink()
    for path in (step, copy):
        with pytest.raises(sp.IncompleteCheckpointError, match="did not commit"):
            sp.load(path)


@pytest.mark.parametrize("kind", ["plain", "empty", "run"])
def test_the_cli_names_them_with_the_same_classifier(tmp_path: Path, kind: str) -> None:
    path, needles = KINDS[kind](tmp_path)
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 1, result.output
    assert "did not commit" not in result.stderr
    first = needles[0] if kind != "run" else "is a savepoint run directory"
    assert first in result.stderr, result.stderr
    assert "sp.load" not in result.stderr  # the commands' own advice, not the library's


# -- item 13: files of other formats ------------------------------------------------------------


def test_load_reads_a_safetensors_file(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    f = tmp_path / "model.safetensors"
    w, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7], np.int64)
    save_file({"w": w, "b": b}, str(f))
    got = sp.load(f)
    assert set(got) == {"w", "b"} and np.array_equal(got["w"], w) and got["b"].dtype == np.int64
    got["w"][0, 0] = 99  # a fresh, writable copy
    assert sp.load(f, keys="w")["w"][0, 0] == 0 and set(sp.load(f, keys="w")) == {"w"}
    box = Box()
    box.w = np.zeros((2, 3), np.float32)
    box.b = np.zeros(1, np.int64)
    target = box.w
    assert sp.load(f, into=box) is box
    assert np.array_equal(box.w, w) and np.array_equal(box.b, b)
    into = {"w": np.zeros((2, 3), np.float32)}  # part of it, in place
    assert sp.load(f, into=into)["w"] is into["w"] and np.array_equal(into["w"], w)
    assert target is not None
    assert sp.inspect(f).format == "safetensors" and sp.verify(f).format == "safetensors"
    seen: list[tuple[int, int]] = []
    sp.load(f, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (w.nbytes + b.nbytes, w.nbytes + b.nbytes)


def test_load_reads_a_shrew_file_and_refuses_a_mismatch_before_writing(tmp_path: Path) -> None:
    f = tmp_path / "m.shrew"
    shrew.save_tensors(str(f), {"w": np.ones(3, np.float32)})
    assert np.array_equal(sp.load(f)["w"], np.ones(3, np.float32))
    into = {"w": np.zeros(4, np.float32)}
    with pytest.raises(sp.StateMismatchError, match="shape"):
        sp.load(f, into=into)
    assert not into["w"].any()


def test_load_reads_a_torch_file(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    got = sp.load(tmp_path / "m.pt")
    assert isinstance(got["weight"], torch.Tensor) and torch.equal(got["weight"], model.weight)
    sp.load(tmp_path / "m.pt", into=other)
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".pth", ".bin", ".shrew", ".mpk"])
def test_save_refuses_a_single_file_name(tmp_path: Path, suffix: str) -> None:
    target = tmp_path / f"model{suffix}"
    with pytest.raises(sp.CheckpointArgumentError) as info:
        sp.save(target, {"w": np.ones(2)})
    assert isinstance(info.value, (TypeError, ValueError))
    text = str(info.value)
    assert "is a directory" in text and "sp.save('model'" in text
    writer = {".safetensors": "sp.export", ".shrew": "shrew.save_tensors", ".mpk": "save_record"}
    assert writer.get(suffix, "torch.save") in text
    assert list(tmp_path.iterdir()) == []


def test_save_keeps_saving_where_a_checkpoint_already_has_such_a_name(tmp_path: Path) -> None:
    sp.save(tmp_path / "old", {"w": np.ones(2)})
    (tmp_path / "old").rename(tmp_path / "old.pt")  # saved there by an earlier version
    sp.save(tmp_path / "old.pt", {"w": np.zeros(2)})
    assert not sp.load(tmp_path / "old.pt")["w"].any()
    sp.save(tmp_path / "last.ckpt", {"w": np.ones(2)})  # Lightning's names stay directories
    assert (tmp_path / "last.ckpt").is_dir()


# -- item 14: torch habits ----------------------------------------------------------------------


def _refused(fn: Callable[[], Any], *needles: str) -> None:
    with pytest.raises(sp.CheckpointArgumentError) as info:
        fn()
    assert isinstance(info.value, TypeError)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_torch_habits_get_the_savepoint_argument(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    state = {"model": Box()}
    _refused(lambda: sp.save(state, ckpt), "path first", f"sp.save('{ckpt}', state)")  # type: ignore[arg-type]
    _refused(lambda: sp.save(ckpt, state, {"note": 1}), "keyword-only", "metadata=")  # type: ignore[call-arg]
    _refused(lambda: sp.save(ckpt, state, pickle_protocol=4), "no pickle")  # type: ignore[call-arg]
    assert not ckpt.exists()
    sp.save(ckpt, state)
    _refused(lambda: sp.load(ckpt, Box()), "into=", "sp.load(path, into=model)")  # type: ignore[call-arg]
    _refused(lambda: sp.load(ckpt, "cpu"), "device=")  # type: ignore[call-arg]
    _refused(lambda: sp.load(ckpt, map_location="cpu"), "device=")  # type: ignore[call-arg]
    _refused(lambda: sp.load(ckpt, weights_only=True), "weights-only")  # type: ignore[call-arg]
    _refused(lambda: sp.load(ckpt, strict=False), "into=")  # type: ignore[call-arg]
    _refused(lambda: sp.load(ckpt, devcie="cpu"), "did you mean device=?")  # type: ignore[call-arg]
    _refused(lambda: sp.verify(ckpt, progres=print), "did you mean progress=?")  # type: ignore[call-arg]
    _refused(lambda: sp.inspect({"a": 1}), "first argument is the checkpoint path")  # type: ignore[arg-type]


def test_into_one_level_off_gets_the_into_that_fits(tmp_path: Path) -> None:
    weights = {"w": np.ones(3, np.float32), "b": np.ones(1, np.float32)}
    sp.save(tmp_path / "wrapped", {"model": weights})
    with pytest.raises(sp.StateMismatchError) as info:
        sp.load(tmp_path / "wrapped", into={k: np.zeros_like(v) for k, v in weights.items()})
    assert "into={'model': <the dict>}" in str(info.value) and info.value.hints
    sp.save(tmp_path / "bare", weights)
    with pytest.raises(sp.StateMismatchError) as info:
        sp.load(
            tmp_path / "bare", into={"model": {k: np.zeros_like(v) for k, v in weights.items()}}
        )
    assert "into=<the dict> itself" in str(info.value)


def test_into_a_torch_model_saved_under_a_key(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(3, 2)
    sp.save(tmp_path / "c", {"model": model, "step": 3})
    with pytest.raises(sp.StateMismatchError) as info:
        sp.load(tmp_path / "c", into=model)
    assert "restore it with into={'model': <the Linear>}" in str(info.value)
    other = torch.nn.Linear(3, 2)
    sp.load(tmp_path / "c", into={"model": other})  # the hint's advice works
    assert torch.equal(other.weight, model.weight)


def test_typos_get_the_nearest_key(tmp_path: Path) -> None:
    sp.save(tmp_path / "c", {"model": {"weight": np.ones(2)}, "step": 3})
    with pytest.raises(sp.IncompatibleCheckpointError, match=r"'modle' \(did you mean 'model'\?\)"):
        sp.load(tmp_path / "c", keys="modle")
    with pytest.raises(sp.IncompatibleCheckpointError, match="did you mean 'model/weight'"):
        sp.load(tmp_path / "c", keys=["step", "model/wieght"])
    with pytest.raises(sp.StateMismatchError) as info:
        sp.load(tmp_path / "c", into={"model": {"wieght": np.zeros(2)}})
    assert info.value.problems == [("model/wieght", "not in the checkpoint")]
    assert info.value.hints == [
        "'model/wieght' is not in the checkpoint, which has 'model/weight' (a typo?)"
    ]
