"""The CLI's voice: errors that say what a path is and what to run, progress bars that use
tqdm's own options (stderr only, --progress/--no-progress), -v for the library's log records,
plots with labels, resume marks and a log scale, and --help that a new user can follow."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import savepoint as sp
from savepoint.cli import _common, main
from savepoint.formats import shrew
from savepoint.storage import memory


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def failed(result: Result, *needles: str, status: int = 1) -> None:
    assert result.exit_code == status, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def make_run(directory: Path, steps: range, resume: bool = False) -> None:
    state = {"model": {"w": np.zeros(3, np.float32)}, "step": 0}
    with sp.CheckpointManager(directory, keep_last=3, best_metric="val_loss") as mgr:
        if resume:
            mgr.restore(state)
        for step in steps:
            state["model"]["w"] += 1
            state["step"] = step
            mgr.log(step, loss=1.0 / step)
            if step % 2 == 0:
                mgr.save(step, state, metrics={"val_loss": 2.0 / step, "acc": step / 10})


@pytest.fixture
def run(tmp_path: Path) -> Path:
    make_run(tmp_path / "runs" / "demo", range(1, 5))
    return tmp_path / "runs" / "demo"


# -- errors that point the way ------------------------------------------------------------------


def test_a_run_directory_where_a_checkpoint_belongs(run: Path, tmp_path: Path) -> None:
    r = str(run)
    for argv in (
        ["inspect", r],
        ["diff", r, str(run / "latest")],
        ["consolidate", r, str(tmp_path / "out")],
        ["convert", r, str(tmp_path / "out")],
    ):
        result = invoke(*argv)
        failed(
            result,
            "is a savepoint run directory",
            f"savepoint ls {r}",
            f"savepoint verify {r}",
            f"savepoint report {r}",
        )
        assert "did not commit" not in result.stderr
    failed(invoke("inspect", r), f"`savepoint inspect {r}/latest`")
    failed(invoke("diff", r, str(run / "latest")), f"`savepoint diff {r} STEP STEP`")
    # verify takes the run itself.
    assert invoke("verify", r).exit_code == 0


def test_a_sweep_and_a_checkpoints_folder(run: Path) -> None:
    sweep = str(run.parent)
    for command in ("inspect", "verify"):
        failed(invoke(command, sweep), "is a sweep of 1 run(s) (demo)", f"savepoint report {sweep}")
    folder = str(run / "checkpoints")
    failed(
        invoke("inspect", folder),
        f"is the checkpoints/ folder of the run {run}",
        f"savepoint inspect {folder}/step-0000000004",
    )
    failed(invoke("ls", sweep), "it is a sweep of 1 run(s)", f"savepoint ls {sweep}/demo")


def test_a_checkpoint_where_a_run_belongs(run: Path) -> None:
    latest = str(run / "latest")
    failed(invoke("ls", latest), "it is a checkpoint", f"savepoint inspect {latest}")
    failed(invoke("report", latest), "it is a checkpoint", f"savepoint inspect {latest}")


def test_an_interrupted_save_still_says_so(run: Path) -> None:
    step = run / "checkpoints" / "step-0000000009"
    step.mkdir()
    failed(invoke("inspect", str(step)), "did not commit")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"garbage garbage", "it starts with b'garb'"),
        (b"", "it is empty"),
        (b"SH", "it ends after 2 byte(s), inside the magic"),
        (b"PK\x03\x04rest-of-a-zip", "a torch.save file? name it *.pt"),
    ],
    ids=["garbage", "empty", "short", "zip"],
)
def test_a_file_named_shrew_that_is_not_one(tmp_path: Path, content: bytes, why: str) -> None:
    bad = tmp_path / "bad.shrew"
    bad.write_bytes(content)
    sp.save(tmp_path / "ok", {"w": np.ones(2)})
    for argv in (
        ["inspect", str(bad)],
        ["verify", str(bad)],
        ["convert", str(bad), str(tmp_path / "out")],
        ["diff", str(bad), str(tmp_path / "ok")],
        ["consolidate", str(bad), str(tmp_path / "out")],
    ):
        result = invoke(*argv)
        failed(result, f"{bad} is not a valid .shrew file", why, "b'SHRW'")
        assert "not a checkpoint directory" not in result.stderr, argv


def test_a_garbage_shrew_object_at_a_url() -> None:
    url = "memory://cli-messages-shrew/x.shrew"
    store = memory.shared()
    store.makedirs("/cli-messages-shrew")
    store.put("/cli-messages-shrew/x.shrew", b"nonsense here", exclusive=False)
    try:
        failed(
            invoke("inspect", url),
            "it is a file, and a savepoint checkpoint is a directory",
            "nor is it a valid .shrew file: it starts with b'nons'",
        )
    finally:
        store.remove_tree("/cli-messages-shrew")


def test_another_format_given_to_a_savepoint_only_command(tmp_path: Path) -> None:
    v1 = tmp_path / "m.shrew"
    shrew.save_tensors(str(v1), {"w": np.ones(3, np.float32)})
    sp.save(tmp_path / "ok", {"w": np.ones(3, np.float32)})
    failed(
        invoke("copy", str(v1), str(tmp_path / "copied")),
        f"{v1} is a .shrew file, not a savepoint checkpoint",
        f"savepoint convert {v1} m-ckpt",
    )
    # diff reads every format: the same file is compared, not refused.
    assert invoke("diff", str(v1), str(tmp_path / "ok")).exit_code == 0


# -- report --plot ------------------------------------------------------------------------------


def test_plot_paths_are_checked_before_any_work(run: Path, tmp_path: Path) -> None:
    failed(
        invoke("report", str(run), "--plot", str(tmp_path / "no" / "x.png")),
        "does not exist",
        status=2,
    )
    failed(
        invoke("report", str(run), "--plot", str(tmp_path / "x.jpgg")),
        "matplotlib cannot write .jpgg files",
        ".png",
        status=2,
    )
    failed(invoke("report", str(run), "--plot", str(tmp_path / "x")), "has no extension", status=2)
    failed(invoke("report", str(run), "--plot", str(tmp_path)), status=2)  # a directory
    assert not list(tmp_path.glob("x*"))


def test_plot_without_matplotlib(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    failed(
        invoke("report", str(run), "--plot", str(tmp_path / "x.png")),
        "pip install 'savepoint[plot]'",
    )


def test_plot_labels_resumes_log_scale_and_one_loss_panel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    run = tmp_path / "resumed"
    make_run(run, range(1, 5))
    make_run(run, range(5, 9), resume=True)
    figures: list[Any] = []
    savefig = Figure.savefig

    def recorded(fig: Any, *args: Any, **kwargs: Any) -> Any:
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recorded)
    out = tmp_path / "run.svg"
    result = invoke("report", str(run), "--plot", str(out), "--log-y")
    assert result.exit_code == 0, result.output
    assert out.read_bytes().lstrip().startswith(b"<?xml")
    (fig,) = figures
    loss, acc = fig.axes
    (legend,) = fig.legends  # one legend, for every panel
    labels = [t.get_text() for t in legend.get_texts()]
    assert "train loss" in labels and "val_loss" in labels  # train and validation together
    assert "resumed from" in labels
    assert [line.get_xdata()[0] for line in loss.get_lines() if line.get_linestyle() == ":"] == [4]
    assert loss.get_yscale() == "log" and loss.get_ylabel() == "loss (log scale)"
    assert acc.get_title() == "acc" and acc.get_ylabel() == "acc"  # --log-y: losses only
    assert acc.get_yscale() == "linear"
    assert all(ax.get_xlabel() == "step" for ax in fig.axes)


# -- progress bars ------------------------------------------------------------------------------


LONG = ("verify", "diff", "convert", "export", "consolidate")


def test_long_commands_have_progress_options_and_every_command_json_and_verbose() -> None:
    for name, cmd in main.commands.items():
        options = {opt for p in cmd.params for opt in getattr(p, "opts", [])}
        secondary = {opt for p in cmd.params for opt in getattr(p, "secondary_opts", [])}
        assert {"--json", "-v", "--verbose"} <= options, name
        if name in LONG:
            assert "--progress" in options and "--no-progress" in secondary, name


def test_no_hand_written_progress_logic() -> None:
    source = Path(_common.__file__).read_text(encoding="utf-8")
    assert "time.monotonic" not in source and "isatty" not in source
    assert "delay=PROGRESS_DELAY" in source and "disable=None" in source


@pytest.fixture
def things(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    big = {"model": {f"w{i}": rng.standard_normal(20000).astype(np.float32) for i in range(4)}}
    sp.save(tmp_path / "a", big)
    big["model"]["w0"] = big["model"]["w0"] + 1
    sp.save(tmp_path / "b", big)
    sp.save(tmp_path / "sharded", {"w": sp.Shard(np.ones((64, 64), np.float32), (64, 64), (0, 0))})
    sp.convert(tmp_path / "a", tmp_path / "a.safetensors", lossy=True)
    return {"a": tmp_path / "a", "b": tmp_path / "b", "t": tmp_path}


def _long_commands(things: dict[str, Path]) -> list[list[str]]:
    a, b, t = str(things["a"]), str(things["b"]), things["t"]
    return [
        ["verify", a],
        ["verify", str(t / "a.safetensors")],
        ["diff", a, b],
        ["convert", a, str(t / "c.shrew"), "--overwrite"],
        ["export", a, str(t / "e.safetensors"), "--overwrite"],
        ["consolidate", str(t / "sharded"), str(t / "whole")],
    ]


def test_progress_bars_go_to_stderr_only(
    things: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_common, "PROGRESS_DELAY", 0.0)
    for argv in _long_commands(things):
        quiet = invoke(*argv, "--no-progress")
        assert quiet.exit_code in (0, 1), (argv, quiet.output)
        forced = invoke(*argv, "--progress")
        assert forced.exit_code == quiet.exit_code, (argv, forced.output)
        assert "B/s" in forced.stderr or "B [" in forced.stderr, (argv, forced.stderr)
        assert "B/s" not in forced.stdout and "%|" not in forced.stdout, argv
        assert "%|" not in quiet.stderr and "B/s" not in quiet.stderr, argv
        # The default: no bar when stderr is not a terminal (CliRunner's is not).
        plain = invoke(*argv)
        assert "%|" not in plain.stderr and "B/s" not in plain.stderr, argv


def test_progress_waits_for_the_delay(things: dict[str, Path]) -> None:
    result = invoke("verify", str(things["a"]), "--progress")  # well under a second
    assert result.exit_code == 0 and result.stderr == ""


# -- -v -----------------------------------------------------------------------------------------


def test_verbose_shows_the_library_log(things: dict[str, Path]) -> None:
    a, t = str(things["a"]), things["t"]
    loud = invoke("convert", a, str(t / "v1"), "-v")
    assert loud.exit_code == 0
    assert "savepoint.formats.convert: converted" in loud.stderr
    before = invoke("-v", "diff", a, str(things["b"]))
    assert "savepoint.formats.diff: diff" in before.stderr
    debug = invoke("diff", a, str(things["b"]), "-vv")
    assert "equal by stored checksum" in debug.stderr
    quiet = invoke("convert", a, str(t / "v2"))
    assert quiet.exit_code == 0 and quiet.stderr == ""


# -- --help -------------------------------------------------------------------------------------


def test_every_command_explains_itself() -> None:
    top = invoke("--help")
    assert top.exit_code == 0 and "savepoint ls RUN" in top.stdout and "--json" in top.stdout
    for name in main.commands:
        result = invoke(name, "--help")
        assert result.exit_code == 0, name
        assert "--json" in result.stdout and "docs/cli.md" in result.stdout, name
        assert "Example" in result.stdout, name
