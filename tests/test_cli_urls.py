"""The ``savepoint`` commands on URLs: savepoint's own checkpoints and runs on ``memory://`` (the
process's in-memory store: the commands run in-process through click's CliRunner, so they see
what the test wrote) and on ``s3://`` (the moto server of ``tests/storage/_s3server.py``); the
other formats are local files: a URL naming one (or any plain object) says that no savepoint
checkpoint is there and that those formats are read from local files only."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import savepoint as sp
from savepoint.cli import _common, main
from savepoint.commit.transaction import resolve as committed_dir
from savepoint.formats import detect
from savepoint.storage import memory
from savepoint.storage.paths import resolve
from storage._s3server import fresh_bucket

REFUSAL = "this reads and writes local files only"
# What a command says of a URL naming something other than a savepoint checkpoint (a file of
# another format, any plain object, a boostr directory): not the library's REFUSAL, which would
# claim the command reads local files only.
FOREIGN = "are read from local files only: copy it to a local path and run `savepoint {command}`"


def invoke(*args: str) -> Result:
    """Run a command in-process; an exit status is fine, a traceback fails the test."""
    result = CliRunner().invoke(main, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def refused(result: Result, url: str) -> None:
    """``result`` is the library's refusal of the foreign-format ``url``: exit 1, no traceback."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and REFUSAL in result.stderr, result.stderr
    assert repr(url) in result.stderr


def not_savepoint(result: Result, url: str, command: str, *, as_json: bool = False) -> None:
    """``result`` says that ``url`` holds no savepoint checkpoint and that other formats are read
    from local copies: exit 1, no traceback, no claim that the command reads local files only
    (under ``--json`` the same error is a JSON object on stdout too)."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    if as_json:
        error = json.loads(result.stdout)["error"]
        assert error["message"] == result.stderr.removeprefix("error: ").rstrip("\n")
    else:
        assert result.stdout == ""
    assert result.stderr.startswith(
        f"error: no savepoint checkpoint at {url} (no manifest.json "
    ), result.stderr
    assert FOREIGN.format(command=command) in result.stderr, result.stderr
    assert REFUSAL not in result.stderr


@pytest.fixture
def root() -> Iterator[str]:
    """A fresh ``memory://`` directory, removed from the shared store afterwards."""
    name = f"cli-urls-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    store = memory.shared()
    if store.stat("/" + name) is not None:
        store.remove_tree("/" + name)


def make_run(where: str, lr: float, steps: int = 30) -> None:
    """The run of tests/test_cli_runs.py: steps 20, 25, 30 kept; best (val 0) at step 30 when
    ``lr`` is 0.1."""
    with sp.CheckpointManager(
        where, keep_last=2, keep_best=1, best_metric="val", keep_every=20, variant="small"
    ) as mgr:
        w = np.zeros(8, np.float32)
        for step in range(1, steps + 1):
            w += lr
            mgr.log(step, loss=1.0 / (step * lr))
            if step % 5 == 0:
                mgr.save(step, {"w": w, "step": step}, metrics={"val": abs(step * lr - 3.0)})


STATE = {"w": np.arange(6, dtype=np.float32), "b": np.ones(2), "name": "x"}


@pytest.fixture
def run(root: str) -> str:
    make_run(root + "/run", 0.1)
    return root + "/run"


@pytest.fixture
def ckpt(root: str) -> str:
    sp.save(root + "/ckpt", STATE, metadata={"epoch": 3})
    return root + "/ckpt"


def put_file(url: str, data: bytes) -> None:
    """Write ``data`` as the blob at ``url`` (any store)."""
    where = resolve(url)
    where.store.makedirs(where.store.parent(where.path))
    where.store.put(where.path, data, exclusive=False)


def read_file(url: str) -> bytes:
    where = resolve(url)
    return where.store.read_small(where.path, cap=None)


def remove_tree(url: str) -> None:
    where = resolve(url)
    where.store.remove_tree(where.path)


# -- the shared helpers --------------------------------------------------------------------------


def test_local_maps_file_urls_and_keeps_store_urls_as_given(tmp_path: Path) -> None:
    assert _common.local("file://" + str(tmp_path / "a b")) == str(tmp_path / "a b")
    assert _common.local("relative/dir") == "relative/dir"
    assert _common.local("memory://x/run/") == "memory://x/run/"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("memory://x/ck?y", "takes no query"),
        ("memory+987654://x/ck", "no longer exists"),
        ("file://host/x", "absolute path on this machine"),
        ("nosuchscheme://x/ck", "no backend for nosuchscheme://"),
    ],
)
def test_unusable_urls_exit_1_with_the_library_reason(url: str, why: str) -> None:
    for args in (["inspect", url], ["ls", url], ["verify", url], ["diff", url, url]):
        result = invoke(*args)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.startswith("error: ") and why in result.stderr, (args, result.stderr)


def test_is_foreign_is_false_for_urls_without_touching_the_filesystem(
    monkeypatch: pytest.MonkeyPatch, ckpt: str
) -> None:
    consulted: list[Any] = []

    def touched(*args: Any) -> Any:
        consulted.append(args)
        raise AssertionError(f"the filesystem was consulted for {args}")

    urls = (ckpt, "memory://nowhere/model.safetensors", "memory://nowhere/x.shrew")
    answers: list[Any] = []
    with monkeypatch.context() as patched:  # undone before pytest reports anything
        for name in ("lexists", "isdir", "isfile", "exists"):
            patched.setattr(os.path, name, touched)
        patched.setattr(os, "stat", touched)
        patched.setattr(os, "lstat", touched)
        patched.setattr(detect, "detect", touched)
        for url in urls:
            try:
                answers.append(_common.is_foreign(url))
            except (AssertionError, SystemExit) as exc:
                answers.append(exc)
    assert consulted == []
    assert answers == [False, False, False]


def test_is_foreign_still_detects_local_files(tmp_path: Path) -> None:
    sp.save(tmp_path / "c", STATE)
    sp.convert(tmp_path / "c", tmp_path / "m.safetensors", lossy=True)
    assert _common.is_foreign(str(tmp_path / "m.safetensors")) is True
    assert _common.is_foreign(str(tmp_path / "c")) is False


# -- ls, report ----------------------------------------------------------------------------------


def test_ls_a_memory_run(run: str) -> None:
    result = invoke("ls", run)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "run run (small): 3 checkpoint(s), 30 steps completed"
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {"20", "25", "30"}
    assert "every-20" in rows["20"] and "latest,best" in rows["30"]
    assert result.stderr == ""


def test_ls_json_names_the_run_by_its_url(run: str) -> None:
    result = invoke("ls", "--json", run)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["run"] == run
    assert [c["step"] for c in doc["checkpoints"]] == [20, 25, 30]
    assert doc["checkpoints"][2]["tags"] == ["latest", "best"]
    assert doc["problems"] == []


def test_ls_json_of_a_local_run_still_shows_the_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_run(str(tmp_path / "local"), 0.1)
    monkeypatch.chdir(tmp_path)
    doc = json.loads(invoke("ls", "--json", "local").stdout)
    assert doc["run"] == str(tmp_path / "local")
    doc = json.loads(invoke("ls", "--json", "file://" + str(tmp_path / "local")).stdout)
    assert doc["run"] == str(tmp_path / "local")


def test_ls_reports_what_is_not_a_run(root: str) -> None:
    sp.save(root + "/ckpt", STATE)
    for url in (root + "/ckpt", root + "/nothing"):
        result = invoke("ls", url)
        assert result.exit_code == 1
        assert f"error: {url} is not a savepoint run directory" in result.stderr


def test_ls_and_report_warn_about_a_disagreement(run: str) -> None:
    remove_tree(run + "/checkpoints/step-0000000030")  # the best, which report.json names
    for args in (["ls", run], ["report", run]):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        assert "warning: the report's best checkpoint (step 30) is missing" in result.stderr
    doc = json.loads(invoke("ls", "--json", run).stdout)
    assert [c["step"] for c in doc["checkpoints"]] == [20, 25]
    assert any("best checkpoint (step 30)" in p for p in doc["problems"]), doc["problems"]
    result = invoke("verify", run)
    assert result.exit_code == 1
    assert f"error: {run}: the report's best checkpoint (step 30) is missing" in result.stderr


def test_report_a_memory_run(run: str) -> None:
    result = invoke("report", run)
    assert result.exit_code == 0, result.output
    assert "run          run (small)" in result.stdout
    assert "best         step 30: val=0" in result.stdout
    assert "checkpoints  30, 25, 20" in result.stdout
    doc = json.loads(invoke("report", "--json", run).stdout)
    assert doc["name"] == "run" and doc["best"]["step"] == 30


def test_report_a_memory_run_plots_to_a_local_file(run: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    result = invoke("report", run, "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_refuses_a_plot_url(run: str, root: str) -> None:
    refused(invoke("report", run, "--plot", root + "/run.png"), root + "/run.png")


def test_report_a_memory_sweep(root: str) -> None:
    sweep = root + "/sweep"
    make_run(sweep + "/slow", 0.05)
    make_run(sweep + "/fast", 0.1)
    result = invoke("report", sweep)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"sweep {sweep}: 2 runs ranked by val (min)"
    assert [line.split()[:2] for line in lines[2:4]] == [["1", "fast"], ["2", "slow"]]
    doc = json.loads(invoke("report", "--json", sweep).stdout)
    assert (doc["format"], doc["version"], doc["metric"]) == ("savepoint-comparison", 1, "val")
    assert [r["name"] for r in doc["runs"]] == ["fast", "slow"]
    # comparison.json is written beside the runs, on the same store.
    assert json.loads(read_file(sweep + "/comparison.json"))["runs"][0]["name"] == "fast"


def test_report_refuses_what_is_neither_run_nor_sweep(ckpt: str, root: str) -> None:
    for url in (ckpt, root + "/nothing"):
        result = invoke("report", url)
        assert result.exit_code == 1
        assert f"error: {url} is neither a run directory nor a sweep of runs" in result.stderr


# -- verify, inspect -----------------------------------------------------------------------------


def corrupt(url: str) -> None:
    """Invert one data byte of the checkpoint at ``url`` (any store, either commit layout)."""
    where = resolve(url)
    directory = committed_dir(where.store, where.path)
    assert directory is not None, url
    at = where.store.at(directory)
    doc = json.loads(read_file(str(at.join("manifest.json"))))
    record = doc["tensors"][next(iter(doc["tensors"]))]
    name = str(at.join(record["file"]))
    data = bytearray(read_file(name))
    data[record["offsets"][0]] ^= 0xFF
    put_file(name, bytes(data))


def test_verify_a_memory_checkpoint(ckpt: str) -> None:
    result = invoke("verify", ckpt)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"ok: {ckpt}: 2 tensors, 40 B in 1 file(s) verified")
    assert invoke("verify", "-q", ckpt).output == ""
    corrupt(ckpt)
    result = invoke("verify", ckpt)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and "checksum" in result.stderr, result.stderr


def test_verify_a_memory_run(run: str) -> None:
    result = invoke("verify", run)
    assert result.exit_code == 0, result.output
    assert "ok: run run: 3 checkpoint(s) verified" in result.stdout
    assert "latest/ = step 30, best/ = step 30" in result.stdout
    corrupt(run + "/checkpoints/step-0000000020")
    result = invoke("verify", run)
    assert result.exit_code == 1
    assert f"error: {run}: step 20 does not verify" in result.stderr, result.stderr


def test_verify_a_memory_run_checks_its_aliases(run: str) -> None:
    corrupt(run + "/best")  # a new blob in place of the link: only best/ is damaged
    result = invoke("verify", run)
    assert result.exit_code == 1
    assert f"error: {run}: best/ does not verify" in result.stderr, result.stderr
    assert "latest/" not in result.stderr and "step 30" not in result.stderr


def test_verify_a_memory_run_that_lost_run_json(run: str) -> None:
    remove_tree(run + "/run.json")
    result = invoke("verify", run)
    assert result.exit_code == 1
    assert f"error: {run}: run.json is missing" in result.stderr, result.stderr


def test_verify_what_is_not_there(root: str) -> None:
    result = invoke("verify", root + "/nothing")
    assert result.exit_code == 1
    assert result.stderr == f"error: no checkpoint at {root}/nothing\n"


def test_inspect_a_memory_checkpoint(ckpt: str) -> None:
    result = invoke("inspect", ckpt)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"checkpoint  {ckpt}"
    assert lines[2] == "data        40 B in 2 tensors, 1 file(s)"
    assert '"epoch": 3' in result.stdout and "'x'" in result.stdout
    doc = json.loads(invoke("inspect", "--json", ckpt).stdout)
    assert doc["path"] == ckpt
    assert {t["key"]: t["shape"] for t in doc["tensors"]} == {"w": [6], "b": [2]}
    assert doc["values"] == {"name": "x"} and doc["metadata"] == {"epoch": 3}


def test_inspect_a_step_and_an_alias_of_a_memory_run(run: str) -> None:
    for url in (run + "/checkpoints/step-0000000025", run + "/best"):
        doc = json.loads(invoke("inspect", "--json", url).stdout)
        assert doc["path"] == url and [t["key"] for t in doc["tensors"]] == ["w"]
    assert json.loads(invoke("inspect", "--json", run + "/best").stdout)["values"]["step"] == 30


# -- diff ----------------------------------------------------------------------------------------


def test_diff_two_memory_checkpoints(root: str) -> None:
    a, b = root + "/a", root + "/b"
    sp.save(a, {"w": np.ones(3), "gone": np.zeros(2), "v": 1})
    sp.save(b, {"w": np.ones(3) * 2, "new": np.zeros(2), "v": 2})
    result = invoke("diff", a, b)
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[:2] == [f"a: {a}", f"b: {b}"]
    assert "- gone" in result.stdout and "+ new" in result.stdout and "~ v: 1 -> 2" in result.stdout
    doc = json.loads(invoke("diff", "--json", a, b).stdout)
    assert (doc["a"], doc["b"]) == (a, b)
    assert doc["removed"] == ["gone"] and doc["added"] == ["new"]
    assert doc["tensors"][0]["key"] == "w" and doc["tensors"][0]["equal"] is False
    same = invoke("diff", a, a)
    assert same.exit_code == 0 and "2 tensors compared, 2 identical" in same.stdout


def test_diff_a_memory_checkpoint_and_a_local_one(ckpt: str, tmp_path: Path) -> None:
    sp.save(tmp_path / "c", STATE)
    result = invoke("diff", "--json", ckpt, str(tmp_path / "c"))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["a"], doc["b"]) == (ckpt, str(tmp_path / "c"))


def test_diff_two_steps_of_a_memory_run(run: str) -> None:
    result = invoke("diff", run, "25", "latest")
    assert result.exit_code == 1
    assert result.stdout.splitlines()[:2] == [
        f"a: {run}/checkpoints/step-0000000025",
        f"b: {run}/checkpoints/step-0000000030",
    ]
    assert "~ step: 25 -> 30" in result.stdout
    doc = json.loads(invoke("diff", "--json", run, "latest", "best").stdout)
    assert doc["a"] == doc["b"] == f"{run}/checkpoints/step-0000000030"
    assert invoke("diff", run, "latest", "best").exit_code == 0


def test_diff_steps_of_what_is_not_a_run(ckpt: str) -> None:
    result = invoke("diff", ckpt, "1", "2")
    assert result.exit_code == 1
    assert f"error: {ckpt} is not a savepoint run directory" in result.stderr


# -- convert, consolidate ------------------------------------------------------------------------


def test_convert_between_stores(ckpt: str, root: str, tmp_path: Path) -> None:
    copy = root + "/copy"
    result = invoke("convert", ckpt, copy)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(
        f"converted {ckpt} (savepoint v1) -> {copy} (savepoint): 2 tensors, 40 B"
    )
    np.testing.assert_array_equal(sp.load(copy)["w"], STATE["w"])
    again = invoke("convert", ckpt, copy)
    assert again.exit_code == 1 and "already exists" in again.stderr
    assert invoke("convert", "--overwrite", ckpt, copy).exit_code == 0
    # savepoint's format from a store to a local directory, and back.
    back = invoke("convert", copy, str(tmp_path / "here"))
    assert back.exit_code == 0, back.output
    assert sp.load(tmp_path / "here")["name"] == "x"


def test_convert_from_memory_into_local_foreign_formats(ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    result = invoke("convert", "--lossy", ckpt, str(out))
    assert result.exit_code == 0, result.output
    assert f"-> {out} (safetensors)" in result.stdout and "left out (2):" in result.stdout
    doc = json.loads(invoke("inspect", "--json", str(out)).stdout)
    assert doc["format"] == "safetensors" and [t["key"] for t in doc["tensors"]] == ["w", "b"]


def test_convert_a_local_foreign_file_into_memory(ckpt: str, root: str, tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    assert invoke("convert", "--lossy", ckpt, str(out)).exit_code == 0
    result = invoke("convert", str(out), root + "/from-st")
    assert result.exit_code == 0, result.output
    assert f"{out} (safetensors) -> {root}/from-st (savepoint)" in result.stdout
    np.testing.assert_array_equal(sp.load(root + "/from-st")["w"], STATE["w"])


@pytest.mark.parametrize("name", ["out.safetensors", "out.shrew", "out.mpk"])
def test_convert_refuses_foreign_targets_on_a_store(ckpt: str, root: str, name: str) -> None:
    result = invoke("convert", "--lossy", ckpt, f"{root}/{name}")
    assert result.exit_code == 1
    assert isinstance(result.exception, SystemExit)
    assert "written to local paths only" in result.stderr, result.stderr
    assert resolve(f"{root}/{name}").store.stat(resolve(f"{root}/{name}").path) is None
    forced = invoke("convert", "--format", "safetensors", ckpt, f"{root}/plain")
    assert forced.exit_code == 1 and "written to local paths only" in forced.stderr


def test_consolidate_between_stores(root: str, tmp_path: Path) -> None:
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    sharded = root + "/sharded"
    sp.save(sharded, {"w": sp.Shard(full, (4, 6), (0, 0)), "step": 3})
    for dst in (root + "/whole", str(tmp_path / "whole")):
        result = invoke("consolidate", sharded, dst)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"ok: {dst}: 1 tensors, 96 B in 1 file(s)")
        np.testing.assert_array_equal(sp.load(dst)["w"], full)
        assert sp.inspect(dst).world_size is None
    missing = invoke("consolidate", root + "/nothing", root + "/out")
    assert missing.exit_code == 1 and missing.stderr.startswith("error: ")


def test_gc_a_memory_run(run: str) -> None:
    if "gc" not in main.commands:
        pytest.skip("no gc command in this tree")
    result = invoke("gc", "--dry-run", "--json", run)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["removed"] == []


# -- foreign formats are local files -------------------------------------------------------------


@pytest.fixture
def foreign(root: str, tmp_path: Path) -> dict[str, str]:
    """A safetensors file and a boostr directory copied onto the ``memory://`` store (the
    local originals are readable; the copies are refused)."""
    sp.save(tmp_path / "c", {"w": np.arange(6, dtype=np.float32)})
    sp.convert(tmp_path / "c", tmp_path / "m.safetensors")
    sp.convert(tmp_path / "c", tmp_path / "boostr", format="boostr")
    urls = {"safetensors": root + "/m.safetensors", "boostr": root + "/boostr"}
    put_file(urls["safetensors"], (tmp_path / "m.safetensors").read_bytes())
    for item in (tmp_path / "boostr").iterdir():
        put_file(f"{urls['boostr']}/{item.name}", item.read_bytes())
    assert invoke("inspect", str(tmp_path / "m.safetensors")).exit_code == 0
    assert invoke("verify", str(tmp_path / "boostr")).exit_code == 0
    return urls


@pytest.mark.parametrize("kind", ["safetensors", "boostr"])
def test_foreign_formats_at_memory_urls_are_refused(
    foreign: dict[str, str], kind: str, ckpt: str, tmp_path: Path
) -> None:
    url = foreign[kind]
    for args in (
        ["inspect", url],
        ["inspect", "--json", url],
        ["verify", url],
        ["diff", url, ckpt],
        ["diff", ckpt, url],
        ["convert", url, str(tmp_path / "out")],
        ["consolidate", url, str(tmp_path / "out")],
    ):
        not_savepoint(invoke(*args), url, args[0], as_json="--json" in args)
    assert not (tmp_path / "out").exists()


def test_a_missing_foreign_file_name_at_a_url_is_refused(root: str) -> None:
    for name in ("x.shrew", "x.safetensors", "x.mpk"):
        url = f"{root}/{name}"
        result = invoke("inspect", url)
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
        assert result.stderr.startswith(f"error: no checkpoint at {url}: nothing is there"), (
            result.stderr
        )
        assert "read from local files only" in result.stderr and REFUSAL not in result.stderr


@pytest.mark.parametrize(
    "name", ["model.safetensors", "weights.pt", "random-object", "step.mpk", "x.shrew"]
)
def test_a_url_naming_a_plain_object_says_no_savepoint_checkpoint_is_there(
    root: str, name: str
) -> None:
    """Before, ``verify``/``inspect`` of a URL naming an object (not a checkpoint directory) said
    "this reads and writes local files only", which the commands do not: they read savepoint's
    checkpoints at any URL. The reason is that no savepoint checkpoint is there, and that the
    other formats are read from local files (copy the object to one)."""
    url = f"{root}/{name}"
    put_file(url, b"\x00not a checkpoint of any format" * 10)
    for command in ("verify", "inspect"):
        result = invoke(command, url)
        not_savepoint(result, url, command)
        assert "it is a file, and a savepoint checkpoint is a directory" in result.stderr
    not_savepoint(invoke("inspect", "--json", url), url, "inspect", as_json=True)


def test_a_url_naming_a_checkpoints_manifest_names_the_checkpoint(ckpt: str) -> None:
    url = ckpt + "/manifest.json"
    for command in ("verify", "inspect"):
        result = invoke(command, url)
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
        assert result.stderr == (
            f"error: no savepoint checkpoint at {url}: it is the manifest.json of the checkpoint "
            f"{ckpt} (a checkpoint is a directory): pass that directory\n"
        )


# -- s3:// (the moto server) ---------------------------------------------------------------------


def test_s3_a_bucket_that_cannot_be_listed_exits_1(s3: Any) -> None:
    url = f"s3://savepoint-no-such-bucket-{uuid.uuid4().hex[:12]}/run"
    for args in (["ls", url], ["report", url], ["verify", url], ["inspect", url]):
        result = invoke(*args)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.startswith(f"error: cannot look at {url}"), (args, result.stderr)
        assert "NoSuchBucket" in result.stderr


@pytest.fixture
def s3_run(s3_bucket: str) -> str:
    """The run of ``make_run`` on S3, for a test that changes it or writes beside it."""
    make_run(f"s3://{s3_bucket}/run", 0.1)
    return f"s3://{s3_bucket}/run"


@pytest.fixture(scope="module")
def s3_read_run(s3: Any) -> str:
    """The same run, alone in its bucket, built once for the tests that only read it (ls, report,
    inspect, diff): each build is six saves on the moto server."""
    bucket = fresh_bucket()
    make_run(f"s3://{bucket}/run", 0.1)
    return f"s3://{bucket}/run"


def test_s3_ls_and_report(s3_read_run: str) -> None:
    result = invoke("ls", s3_read_run)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == "run run (small): 3 checkpoint(s), 30 steps completed"
    assert result.stderr == ""
    doc = json.loads(invoke("ls", "--json", s3_read_run).stdout)
    assert doc["run"] == s3_read_run
    assert [(c["step"], c["tags"]) for c in doc["checkpoints"]] == [
        (20, []),
        (25, []),
        (30, ["latest", "best"]),
    ]
    assert doc["problems"] == []
    report = invoke("report", s3_read_run)
    assert report.exit_code == 0 and "checkpoints  30, 25, 20" in report.stdout
    sweep = invoke("report", s3_read_run.rsplit("/", 1)[0])
    assert sweep.exit_code == 0, sweep.output
    assert sweep.stdout.startswith(f"sweep {s3_read_run.rsplit('/', 1)[0]}: 1 runs ranked by val")


def test_s3_inspect(s3_read_run: str) -> None:
    step = s3_read_run + "/checkpoints/step-0000000025"
    result = invoke("inspect", step)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"checkpoint  {step}"
    doc = json.loads(invoke("inspect", "--json", s3_read_run + "/latest").stdout)
    assert doc["path"] == s3_read_run + "/latest" and doc["values"] == {"step": 30}
    missing = invoke("inspect", s3_read_run + "/checkpoints/step-0000000001")
    assert missing.exit_code == 1 and "no checkpoint at" in missing.stderr


def test_s3_verify_a_checkpoint_and_a_run(s3_run: str) -> None:
    step = s3_run + "/checkpoints/step-0000000020"
    result = invoke("verify", step)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"ok: {step}: 1 tensors, 32 B in 1 file(s) verified")
    result = invoke("verify", s3_run)
    assert result.exit_code == 0, result.output
    assert "ok: run run: 3 checkpoint(s) verified" in result.stdout
    assert "latest/ = step 30, best/ = step 30" in result.stdout  # pointers on S3
    corrupt(step)
    result = invoke("verify", s3_run)
    assert result.exit_code == 1
    assert f"error: {s3_run}: step 20 does not verify" in result.stderr, result.stderr
    assert invoke("verify", step).exit_code == 1


def test_s3_diff_two_steps(s3_read_run: str) -> None:
    result = invoke("diff", s3_read_run, "20", "30")
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[:3] == [
        f"a: {s3_read_run}/checkpoints/step-0000000020",
        f"b: {s3_read_run}/checkpoints/step-0000000030",
        "~ step: 20 -> 30",
    ]
    doc = json.loads(invoke("diff", "--json", s3_read_run, "latest", "best").stdout)
    assert doc["a"] == doc["b"] == f"{s3_read_run}/checkpoints/step-0000000030"
    assert doc["tensors"][0]["equal"] is True


def test_s3_convert_to_a_local_safetensors_file(s3_run: str, tmp_path: Path) -> None:
    out = tmp_path / "best.safetensors"
    result = invoke("convert", "--lossy", s3_run + "/best", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(
        f"converted {s3_run}/best (savepoint v1) -> {out} (safetensors): 1 tensors, 32 B"
    )
    doc = json.loads(invoke("inspect", "--json", str(out)).stdout)
    assert doc["format"] == "safetensors" and doc["tensors"][0]["shape"] == [8]
    # And savepoint's own format back onto the store, then consolidated there.
    copy = s3_run.rsplit("/", 1)[0] + "/copy"
    assert invoke("convert", str(out), copy).exit_code == 0
    whole = s3_run.rsplit("/", 1)[0] + "/whole"
    result = invoke("consolidate", copy, whole)
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(sp.load(whole)["w"], sp.load(s3_run + "/best")["w"])


def test_s3_foreign_formats_are_refused(s3_bucket: str, tmp_path: Path) -> None:
    sp.save(tmp_path / "c", {"w": np.arange(6, dtype=np.float32)})
    sp.convert(tmp_path / "c", tmp_path / "m.safetensors")
    url = f"s3://{s3_bucket}/m.safetensors"
    put_file(url, (tmp_path / "m.safetensors").read_bytes())
    for args in (["inspect", url], ["verify", url], ["convert", url, str(tmp_path / "out")]):
        not_savepoint(invoke(*args), url, args[0])
    plain = f"s3://{s3_bucket}/some/object"
    put_file(plain, b"not a checkpoint")
    for command in ("inspect", "verify"):
        not_savepoint(invoke(command, plain), plain, command)
    result = invoke("convert", str(tmp_path / "c"), f"s3://{s3_bucket}/out.safetensors")
    assert result.exit_code == 1 and "written to local paths only" in result.stderr
