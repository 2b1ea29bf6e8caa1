"""savepoint.commit.atomic: committing a staging directory, replacing, resolving, cleaning up
(the rename strategy on local paths; the exchange primitive of the local store)."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from savepoint.commit import atomic, names
from savepoint.storage import local

HOST = names.HOST


def make_dir(path: Path, label: str, *, manifest: bool = True) -> Path:
    path.mkdir()
    (path / "data-00000.safetensors").write_text(f"data {label}")
    if manifest:
        (path / "manifest.json").write_text(f"manifest {label}")
    return path


def label_of(path: Path) -> str:
    return (path / "data-00000.safetensors").read_text().removeprefix("data ")


def staged(target: Path, label: str) -> Path:
    return make_dir(Path(atomic.staging_path(str(target))), label)


def hidden_siblings(target: Path) -> list[str]:
    return sorted(e for e in os.listdir(target.parent) if e.startswith(f".{target.name}."))


def exchange_supported(tmp_path: Path) -> bool:
    """Whether this filesystem supports renameat2(RENAME_EXCHANGE) (ext4, xfs, btrfs, tmpfs do)."""
    a, b = tmp_path / ".probe-a", tmp_path / ".probe-b"
    a.mkdir()
    b.mkdir()
    try:
        return local.STORE.exchange(str(a), str(b))
    finally:
        a.rmdir()
        b.rmdir()


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    for _ in range(20):
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            return proc.pid
    raise AssertionError("could not obtain a dead pid")  # pragma: no cover


def no_exchange(self: local.LocalStore, a: str, b: str) -> bool:
    """A filesystem without RENAME_EXCHANGE: the fallback with two renames."""
    return False


# ---------------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------------


def test_staging_path_is_a_hidden_sibling_naming_host_and_pid(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    a = atomic.staging_path(str(target))
    b = atomic.staging_path(str(target))
    assert a != b
    for p in (a, b):
        assert os.path.dirname(p) == str(tmp_path)
        m = re.fullmatch(
            rf"\.ckpt\.savepoint-tmp-{re.escape(HOST)}-{os.getpid()}-[0-9a-f]{{8}}",
            os.path.basename(p),
        )
        assert m, p
    assert "-" not in HOST and HOST


def test_relative_paths_are_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert os.path.dirname(atomic.staging_path("ckpt")) == str(tmp_path)


# ---------------------------------------------------------------------------------------------
# commit
# ---------------------------------------------------------------------------------------------


def test_commit_into_an_absent_path(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    staging = staged(target, "new")
    atomic.commit(str(staging), str(target))
    assert label_of(target) == "new"
    assert (target / "manifest.json").read_text() == "manifest new"
    assert not staging.exists()
    assert os.listdir(tmp_path) == ["ckpt"]


def test_commit_into_an_empty_directory(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    staging = staged(target, "new")
    atomic.commit(str(staging), str(target))
    assert label_of(target) == "new"
    assert os.listdir(tmp_path) == ["ckpt"]


def test_commit_exchanges_with_an_existing_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    real = local.LocalStore.exchange

    def spy(self: local.LocalStore, a: str, b: str) -> bool:
        calls.append(real(self, a, b))
        return calls[-1]

    supported = exchange_supported(tmp_path)
    monkeypatch.setattr(local.LocalStore, "exchange", spy)
    target = make_dir(tmp_path / "ckpt", "old")
    (target / "data-00001.safetensors").write_text("only in old")
    staging = staged(target, "new")
    atomic.commit(str(staging), str(target))
    assert calls == [supported]  # the atomic swap is used wherever the filesystem has it
    assert label_of(target) == "new"
    assert sorted(os.listdir(target)) == ["data-00000.safetensors", "manifest.json"]
    assert not staging.exists()
    assert os.listdir(tmp_path) == ["ckpt"]


def test_fallback_replace_when_exchange_is_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local.LocalStore, "exchange", no_exchange)
    removed: list[str] = []
    real_remove = local.LocalStore.remove_tree

    def spy(self: local.LocalStore, path: str) -> None:
        removed.append(path)
        real_remove(self, path)

    monkeypatch.setattr(local.LocalStore, "remove_tree", spy)
    target = make_dir(tmp_path / "ckpt", "old")
    staging = staged(target, "new")
    atomic.commit(str(staging), str(target))
    assert label_of(target) == "new"
    assert os.listdir(tmp_path) == ["ckpt"]
    # the old checkpoint went through a ".savepoint-old-" name before it was deleted
    assert len(removed) == 1
    assert re.fullmatch(
        rf"\.ckpt\.savepoint-old-{re.escape(HOST)}-{os.getpid()}-[0-9a-f]{{8}}",
        os.path.basename(removed[0]),
    )


@pytest.mark.parametrize("use_exchange", [True, False], ids=["exchange", "two-renames"])
def test_commit_over_a_symlink_to_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_exchange: bool
) -> None:
    # "latest -> step-1" is a common layout. Replacing it must not fail after the new checkpoint
    # is already in place, nor leave the displaced symlink behind under a hidden name.
    if not use_exchange:
        monkeypatch.setattr(local.LocalStore, "exchange", no_exchange)
    real = make_dir(tmp_path / "step-1", "old")
    target = tmp_path / "latest"
    target.symlink_to("step-1")
    staging = staged(target, "new")
    atomic.commit(str(staging), str(target))
    assert label_of(target) == "new"
    assert hidden_siblings(target) == []
    assert label_of(real) in ("old", "new")  # the link's directory: kept, or replaced in place


def test_remove_tree_removes_a_symlink_not_its_target(tmp_path: Path) -> None:
    real = make_dir(tmp_path / "real", "keep")
    link = tmp_path / "link"
    link.symlink_to(real)
    atomic.remove_tree(str(link))
    assert not os.path.lexists(link)
    assert label_of(real) == "keep"


def test_crash_between_fallback_renames_leaves_the_old_checkpoint_findable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local.LocalStore, "exchange", no_exchange)
    target = make_dir(tmp_path / "ckpt", "old")
    staging = staged(target, "new")
    real_rename = local.LocalStore.rename

    def rename(self: local.LocalStore, src: str, dst: str) -> None:
        # The second rename fails, and so does commit's attempt to undo the first: the state a
        # crash between the two renames leaves.
        if src == str(staging) or ".savepoint-old-" in src:
            raise OSError(errno.EIO, "simulated crash before the second rename")
        real_rename(self, src, dst)

    monkeypatch.setattr(local.LocalStore, "rename", rename)
    with pytest.raises(OSError, match="simulated crash"):
        atomic.commit(str(staging), str(target))
    monkeypatch.undo()

    assert not target.exists()
    found = atomic.resolve(str(target))
    assert found is not None
    assert os.path.basename(found).startswith(".ckpt.savepoint-old-")
    assert label_of(Path(found)) == "old"
    assert staging.exists()

    # while nothing is at the target, the old copy is the only one: clean_stale keeps it even
    # for a dead owner (here the owner is this live process anyway)
    assert atomic.clean_stale(str(target)) == []
    assert Path(found).exists()

    # the next save commits normally
    atomic.commit(str(staged(target, "newer")), str(target))
    assert label_of(target) == "newer"
    assert atomic.resolve(str(target)) == str(target)


# ---------------------------------------------------------------------------------------------
# exchange
# ---------------------------------------------------------------------------------------------


def test_exchange_swaps_two_directories(tmp_path: Path) -> None:
    if not exchange_supported(tmp_path):  # pragma: no cover - ext4/xfs/btrfs/tmpfs support it
        pytest.skip("this filesystem has no RENAME_EXCHANGE")
    a = make_dir(tmp_path / "a", "A")
    b = make_dir(tmp_path / "b", "B")
    assert local.STORE.exchange(str(a), str(b)) is True
    assert label_of(a) == "B"
    assert label_of(b) == "A"


def test_exchange_with_a_missing_path_raises(tmp_path: Path) -> None:
    a = make_dir(tmp_path / "a", "A")
    with pytest.raises(FileNotFoundError):
        local.STORE.exchange(str(a), str(tmp_path / "missing"))
    assert label_of(a) == "A"


def two_dirs(tmp_path: Path) -> tuple[str, str]:
    return str(make_dir(tmp_path / "a", "A")), str(make_dir(tmp_path / "b", "B"))


def test_exchange_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "_renameat2", lambda: None)
    assert local.STORE.exchange(*two_dirs(tmp_path)) is False


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP])
def test_exchange_unsupported_errno_means_false(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def fake(*args: Any) -> int:
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(local, "_renameat2", lambda: fake)
    assert local.STORE.exchange(*two_dirs(tmp_path)) is False


def test_exchange_other_errors_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(*args: Any) -> int:
        ctypes.set_errno(errno.EACCES)
        return -1

    monkeypatch.setattr(local, "_renameat2", lambda: fake)
    with pytest.raises(PermissionError) as info:
        local.STORE.exchange(*two_dirs(tmp_path))
    assert info.value.errno == errno.EACCES


# ---------------------------------------------------------------------------------------------
# resolve
# ---------------------------------------------------------------------------------------------


def test_resolve(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    assert atomic.resolve(str(target)) is None

    old1 = make_dir(tmp_path / f".ckpt{atomic.OLD_TAG}{HOST}-1-aaaaaaaa", "old1")
    old2 = make_dir(tmp_path / f".ckpt{atomic.OLD_TAG}{HOST}-2-bbbbbbbb", "old2")
    make_dir(tmp_path / f".ckpt{atomic.OLD_TAG}{HOST}-3-cccccccc", "partial", manifest=False)
    make_dir(tmp_path / f".ckpt{atomic.TMP_TAG}{HOST}-4-dddddddd", "staging")
    make_dir(tmp_path / f".other{atomic.OLD_TAG}{HOST}-5-eeeeeeee", "other")
    os.utime(old1, (1_000_000, 2_000_000))
    os.utime(old2, (1_000_000, 1_000_000))
    assert atomic.resolve(str(target)) == str(old1)  # the newest old copy with a manifest
    os.utime(old2, (1_000_000, 3_000_000))
    assert atomic.resolve(str(target)) == str(old2)

    target.mkdir()  # something is at the target, but not a checkpoint
    assert atomic.resolve(str(target)) is None
    (target / "manifest.json").write_text("m")
    assert atomic.resolve(str(target)) == str(target)


def test_resolve_survives_a_sibling_vanishing_between_listing_and_stat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old1 = make_dir(tmp_path / f".ckpt{atomic.OLD_TAG}{HOST}-1-aaaaaaaa", "old1")
    old2 = make_dir(tmp_path / f".ckpt{atomic.OLD_TAG}{HOST}-2-bbbbbbbb", "old2")
    os.utime(old1, (1_000_000, 3_000_000))  # the newest, but gone when its time is looked up
    real = local.LocalStore.stat

    def racing(self: local.LocalStore, path: str) -> Any:
        if path == str(old1):
            return None  # tidied by the next save
        return real(self, path)

    monkeypatch.setattr(local.LocalStore, "stat", racing)
    assert atomic.resolve(str(tmp_path / "ckpt")) == str(old2)


def test_resolve_in_an_unlistable_parent_finds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.listdir

    def refuse(path: Any = ".") -> list[str]:
        if os.fspath(path) == str(tmp_path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", refuse)
    assert atomic.resolve(str(tmp_path / "ckpt")) is None


def test_resolve_ignores_staging_directories(tmp_path: Path) -> None:
    make_dir(tmp_path / f".ckpt{atomic.TMP_TAG}{HOST}-4-dddddddd", "staging")
    assert atomic.resolve(str(tmp_path / "ckpt")) is None


# ---------------------------------------------------------------------------------------------
# clean_stale
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def live_pid() -> Any:
    """The pid of a running child process (ours, so signal 0 is always permitted)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_clean_stale_removes_only_dead_processes_of_this_host(
    tmp_path: Path, live_pid: int
) -> None:
    target = make_dir(tmp_path / "ckpt", "current")
    dead = dead_pid()
    live = live_pid
    names = {
        "tmp-dead": f".ckpt{atomic.TMP_TAG}{HOST}-{dead}-00000001",
        "old-dead": f".ckpt{atomic.OLD_TAG}{HOST}-{dead}-00000002",
        "tmp-live": f".ckpt{atomic.TMP_TAG}{HOST}-{live}-00000003",
        "old-live": f".ckpt{atomic.OLD_TAG}{HOST}-{live}-00000004",
        "tmp-self": f".ckpt{atomic.TMP_TAG}{HOST}-{os.getpid()}-00000005",
        "tmp-other-host": f".ckpt{atomic.TMP_TAG}{HOST}x-{dead}-00000006",
        "old-other-host": f".ckpt{atomic.OLD_TAG}other_{HOST}-{dead}-00000007",
        "malformed-pid": f".ckpt{atomic.TMP_TAG}{HOST}-abc-00000008",
        "malformed-parts": f".ckpt{atomic.TMP_TAG}{HOST}-{dead}-0-9",
        "malformed-short": f".ckpt{atomic.TMP_TAG}{HOST}",
        "huge-pid": f".ckpt{atomic.TMP_TAG}{HOST}-{2**70}-0000000a",
        "other-checkpoint": f".ckpt2{atomic.TMP_TAG}{HOST}-{dead}-0000000b",
        "unrelated": f"ckpt{atomic.TMP_TAG}{HOST}-{dead}-0000000c",
    }
    for label, name in names.items():
        make_dir(tmp_path / name, label)

    removed = atomic.clean_stale(str(target))

    expected = {str(tmp_path / names["tmp-dead"]), str(tmp_path / names["old-dead"])}
    assert set(removed) == expected
    assert len(removed) == 2
    left = set(os.listdir(tmp_path))
    assert left == {"ckpt"} | {n for k, n in names.items() if k not in ("tmp-dead", "old-dead")}
    assert label_of(target) == "current"


def test_clean_stale_keeps_old_copies_when_no_checkpoint_is_committed(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    dead = dead_pid()
    tmp = make_dir(tmp_path / f".ckpt{atomic.TMP_TAG}{HOST}-{dead}-00000001", "tmp")
    old = make_dir(tmp_path / f".ckpt{atomic.OLD_TAG}{HOST}-{dead}-00000002", "old")
    assert atomic.clean_stale(str(target)) == [str(tmp)]
    assert old.exists()
    assert atomic.resolve(str(target)) == str(old)

    # a directory without a manifest at the target does not count as a checkpoint either
    target.mkdir()
    assert atomic.clean_stale(str(target)) == []
    assert old.exists()


def test_clean_stale_with_a_missing_parent(tmp_path: Path) -> None:
    assert atomic.clean_stale(str(tmp_path / "nope" / "ckpt")) == []
    assert atomic.resolve(str(tmp_path / "nope" / "ckpt")) is None


def test_remove_tree_tolerates_missing_paths(tmp_path: Path) -> None:
    atomic.remove_tree(str(tmp_path / "missing"))
    d = make_dir(tmp_path / "d", "x")
    atomic.remove_tree(str(d))
    assert not d.exists()


# ---------------------------------------------------------------------------------------------
# link_tree (the run aliases latest/ and best/): now savepoint.runs.aliases.link_tree on a store
# (these belong with the runs tests; kept here so that what they assert stays covered)
# ---------------------------------------------------------------------------------------------


def link_tree(source: Path, staging: Path) -> None:
    from savepoint.runs import aliases

    staging.mkdir()
    aliases.link_tree(local.STORE, str(source), str(staging))


def test_link_tree_hard_links_every_file(tmp_path: Path) -> None:
    source = make_dir(tmp_path / "step", "a")
    staging = tmp_path / ".alias.tmp"
    link_tree(source, staging)
    assert sorted(os.listdir(staging)) == sorted(os.listdir(source))
    for name in os.listdir(source):
        assert os.path.samefile(source / name, staging / name)


@pytest.mark.parametrize("code", [errno.EPERM, errno.EXDEV, errno.EMLINK, errno.EOPNOTSUPP])
def test_link_tree_copies_where_hard_links_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def no_links(src: Any, dst: Any, **kwargs: Any) -> None:
        raise OSError(code, os.strerror(code), str(dst))

    monkeypatch.setattr(os, "link", no_links)
    source = make_dir(tmp_path / "step", "a")
    staging = tmp_path / ".alias.tmp"
    link_tree(source, staging)
    for name in os.listdir(source):
        assert not os.path.samefile(source / name, staging / name)
        assert (staging / name).read_bytes() == (source / name).read_bytes()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_link_tree_raises_a_full_disk_instead_of_copying(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    # A link that fails for want of an inode or a directory block is no reason to copy the whole
    # file (which needs more of what ran out): the error is the caller's, as it is.
    copies: list[Any] = []
    real_create = local.LocalStore.create_blob

    def create_blob(self: local.LocalStore, path: str, **kwargs: Any) -> Any:
        copies.append(path)
        return real_create(self, path, **kwargs)

    def full(src: Any, dst: Any, **kwargs: Any) -> None:
        raise OSError(code, os.strerror(code), str(dst))

    monkeypatch.setattr(os, "link", full)
    monkeypatch.setattr(local.LocalStore, "create_blob", create_blob)
    source = make_dir(tmp_path / "step", "a")
    with pytest.raises(OSError) as info:
        link_tree(source, tmp_path / ".alias.tmp")
    assert info.value.errno == code
    assert copies == []
