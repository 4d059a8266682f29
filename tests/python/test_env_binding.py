"""nonstop._core.Directory, the Env seam for the Python side: files are
created O_EXCL|O_NOFOLLOW relative to the directory fd, a symlink is refused,
never followed, and failures are nonstop's one-line errors."""
import os

import pytest

import nonstop
from nonstop.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                            IncompatibleCheckpointError)

core = nonstop._core


def test_write_atomic_and_writer_commit(tmp_path):
    d = core.Directory(str(tmp_path / "job"), create=True)
    d.write_atomic("REC", b"hello")
    assert (tmp_path / "job" / "REC").read_bytes() == b"hello"
    d.write_atomic("REC", b"again")  # replaces
    assert (tmp_path / "job" / "REC").read_bytes() == b"again"
    sub = d.subdir("remote", create=True)
    with sub.create("part.tmp") as w:
        w.write(b"abc")
        w.write(memoryview(b"xdefx")[1:4])
        assert w.written == 6
        w.commit("part")
    assert (tmp_path / "job" / "remote" / "part").read_bytes() == b"abcdef"
    assert not (tmp_path / "job" / "remote" / "part.tmp").exists()
    assert d.list() == [("REC", "file"), ("remote", "dir")]
    assert sub.stat("part") == ("file", 6)
    assert sub.stat("missing") is None
    sub.rename("part", "moved")
    sub.sync()
    assert sub.list() == [("moved", "file")]
    assert sub.unlink("moved") is True
    assert sub.unlink("moved", missing_ok=True) is False
    with pytest.raises(CheckpointNotFoundError):
        sub.unlink("moved")


def test_writer_aborts_on_error(tmp_path):
    d = core.Directory(str(tmp_path), create=False)
    with pytest.raises(ValueError):
        with d.create("x.tmp") as w:
            w.write(b"partial")
            raise ValueError("boom")
    assert not (tmp_path / "x.tmp").exists()  # removed, nothing left behind
    with pytest.raises(CheckpointError, match="already committed or aborted"):
        w.write(b"more")


def test_existing_tmp_is_refused_not_truncated(tmp_path):
    (tmp_path / "x.tmp").write_bytes(b"someone else's")
    d = core.Directory(str(tmp_path))
    with pytest.raises(IncompatibleCheckpointError, match="already exists") as e:
        d.create("x.tmp")
    assert "\n" not in str(e.value)
    assert (tmp_path / "x.tmp").read_bytes() == b"someone else's"


def test_symlinks_are_refused_never_followed(tmp_path):
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious bytes")
    job = tmp_path / "job"
    job.mkdir()
    os.symlink(precious, job / "OUT")
    os.symlink(precious, job / "T.tmp")
    d = core.Directory(str(job))
    with pytest.raises(IncompatibleCheckpointError, match="symlink"):
        d.write_atomic("OUT", b"overwritten?")
    with pytest.raises(IncompatibleCheckpointError):
        d.create("T.tmp")  # O_EXCL|O_NOFOLLOW: a link at the temp name
    with d.create("W.tmp") as w:
        w.write(b"overwritten?")
        with pytest.raises(IncompatibleCheckpointError, match="symlink"):
            w.commit("OUT")  # rename over a planted link: refused
    assert not (job / "W.tmp").exists()
    assert precious.read_bytes() == b"precious bytes"
    assert d.stat("OUT")[0] == "symlink"
    os.symlink(job, tmp_path / "link")
    with pytest.raises(CheckpointError):
        d.subdir("OUT")
    with pytest.raises(CheckpointError):
        core.Directory(str(tmp_path / "link"))  # the last component a symlink


def test_names_are_one_component(tmp_path):
    d = core.Directory(str(tmp_path))
    for bad in ("a/b", "..", ".", ""):
        with pytest.raises(CheckpointError):
            d.write_atomic(bad, b"x")
    assert d.list() == []


def test_lightning_marker_goes_through_the_seam(tmp_path):
    pytest.importorskip("lightning")
    from nonstop import lightning
    job = tmp_path / "ck"
    job.mkdir()
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious bytes")
    os.symlink(precious, job / "m.ckpt")
    with pytest.raises(IncompatibleCheckpointError):
        lightning._write_atomically(str(job / "m.ckpt"), "{}")
    assert precious.read_bytes() == b"precious bytes"
    lightning._write_atomically(str(job / "n.ckpt"), '{"a": 1}')
    assert (job / "n.ckpt").read_text() == '{"a": 1}'
    assert sorted(os.listdir(job)) == ["m.ckpt", "n.ckpt"]


def test_open_read_and_read_small_never_follow_links(tmp_path):
    d = core.Directory(str(tmp_path / "job"), create=True)
    d.write_atomic("part", bytes(range(256)) * 40)  # 10240 bytes
    with d.open("part") as f:
        assert f.size == 10240
        assert f.read(10) == bytes(range(10))
        assert f.tell() == 10
        assert f.seek(-6, 2) == 10234 and f.read() == bytes(range(250, 256))
        assert f.read(5) == b""  # at the end: empty, never an error
        f.seek(256)
        assert f.read(3) == bytes(range(3))
    with pytest.raises(CheckpointError, match="already closed"):
        f.read(1)
    assert d.read("part", 10240) == bytes(range(256)) * 40
    assert d.read("missing", 10) is None
    with pytest.raises(CorruptCheckpointError):
        d.read("part", 10239)  # larger than the caller's bound: refused before reading
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious bytes")
    os.symlink(precious, tmp_path / "job" / "link")
    with pytest.raises(IncompatibleCheckpointError, match="symlink"):
        d.open("link")
    with pytest.raises(IncompatibleCheckpointError, match="symlink"):
        d.read("link", 100)
    with pytest.raises(CheckpointNotFoundError):
        d.open("missing")


def test_remove_tree_removes_links_never_what_they_name(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"precious bytes")
    job = tmp_path / "job"
    (job / "staged" / "sub").mkdir(parents=True)
    (job / "staged" / "a").write_bytes(b"a")
    os.symlink(outside / "precious", job / "staged" / "file-link")
    os.symlink(outside, job / "staged" / "sub" / "dir-link")
    os.symlink(outside, job / "linked-step")
    d = core.Directory(str(job))
    assert d.remove_tree("staged") is True
    assert d.remove_tree("linked-step") is True  # the link itself, not the folder it names
    assert d.remove_tree("staged") is False  # missing_ok by default
    with pytest.raises(CheckpointNotFoundError):
        d.remove_tree("staged", missing_ok=False)
    assert d.list() == []
    assert sorted(os.listdir(outside)) == ["precious"]
    assert (outside / "precious").read_bytes() == b"precious bytes"
    d.subdir("empty", create=True)
    d.subdir("full", create=True).write_atomic("x", b"x")
    d.remove_dir("empty")
    with pytest.raises(CheckpointError):
        d.remove_dir("full")  # not empty: an error, nothing removed
    assert d.list() == [("full", "dir")]
