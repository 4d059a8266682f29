"""The remote tier's file work goes through the Env seam (_core.Directory):
a symlink planted in a staged step directory or in a path remote is removed
as a link or refused, never followed; and `nonstop export URL --include`
is forwarded to the same filter as a local export (SeaweedFS). Nothing is
mocked."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

import nonstop
import tiny
from conftest import needs_engine
from nonstop import _ext, _remote
from s3_server import _one_s3_server, shared_s3  # noqa: F401 -- the fixtures
from test_remote import _cli, _params, _same, _train, _two_remote_steps

pytestmark = [needs_engine, pytest.mark.timeout(300)]


def _outside(tmp_path):
    """A folder outside every directory nonstop is given, with a file in it."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "precious").write_bytes(b"precious bytes")
    return out


def _intact(out):
    assert sorted(os.listdir(out)) == ["precious"]
    assert (out / "precious").read_bytes() == b"precious bytes"


def test_a_link_in_a_path_remote_is_never_followed(tmp_path):
    """step 7's part replaced by a link to the very same bytes outside the
    remote: a reader refuses it (falls back to step 3 with a warning), never
    reads through it. The old PathStore opened it by path and restored
    step 7 from outside the remote."""
    url = str(tmp_path / "shared")
    d, store, want3 = _two_remote_steps(tmp_path, url, {})
    out = _outside(tmp_path)
    part = os.path.join(url, *_ext.core().remote_layout.part_key(7, 0).split("/"))
    shutil.move(part, out / "part")
    os.symlink(out / "part", part)
    model, opt, sched = tiny.make(seed=77)
    state = {"model": model, "optim": opt, "sched": sched}
    ck = nonstop.Checkpointer(d, state, every=4, remote=url, remote_options={})
    with pytest.warns(UserWarning, match="remote step 7: .*symlink"):
        assert ck.restore() == 3
    _same(want3, _params(state))
    ck.close()
    assert os.path.islink(part)  # left as it is: neither followed nor overwritten
    # a link planted as a whole step directory, and one beside the parts: a
    # listing skips both, and retention never deletes through them
    os.symlink(out, os.path.join(url, "step-000000000099"))
    os.symlink(out / "precious", os.path.join(url, "step-000000000003", "rank-00001.nsck"))
    assert [k for k, _ in store.list("") if "99" in k or "rank-00001" in k] == []
    assert [s for s, _ in nonstop._core.RemoteTier(store).committed_steps()] == [7, 3]
    store.delete([_ext.core().remote_layout.part_key(3, 1), "step-000000000099/precious"])
    assert (out / "precious").read_bytes() == b"precious bytes"
    assert sorted(os.listdir(out)) == ["part", "precious"]


def test_links_planted_in_staged_steps_are_removed_never_followed(tmp_path):
    """The uploader stages parts in job/remote/step-N/ and removes the older
    steps' folders through the seam: a staged step folder that is a link,
    and links inside one (to a file, to a folder), are removed as links;
    what they point to is untouched. A link at the very name of the staged
    part is removed too and the part staged again. (The old shutil.rmtree
    left a linked step folder behind for good.)"""
    url = str(tmp_path / "shared")
    d = str(tmp_path / "local")
    ck, state, _ = _train(d, 4, url, {}, every=4)  # step 3, committed locally and remotely
    ck.close()
    out = _outside(tmp_path)
    staged = os.path.join(d, _ext.core().remote_layout.LOCAL_DIR)
    part = os.path.join(staged, "step-000000000003", "rank-00000.nsck")
    os.unlink(part)
    os.symlink(out / "precious", part)  # at the staged part's own name
    os.symlink(out, os.path.join(staged, "step-000000000001"))  # a step folder that is a link
    inner = os.path.join(staged, "step-000000000002")
    os.makedirs(os.path.join(inner, "sub"))
    os.symlink(out / "precious", os.path.join(inner, "rank-00000.nsck"))
    os.symlink(out, os.path.join(inner, "sub", "folder-link"))
    counter = next(c["counter"] for c in nonstop._core.Reader(d, rank=0).checkpoints
                   if c["committed"] and c["step"] == 3)
    up = _ext.core().RemoteUploader.from_options(
        _ext.core().RemoteTier(_remote.open_store(url, {})), lambda: (counter, 3), d, 0, 1, {},
        0, 0, 0, "")
    up.close()  # uploads (here: finds step 3 committed remotely) before it returns
    stats = up.stats()
    assert stats["skipped_existing"] == 1 and stats["last_error"] is None, stats
    _intact(out)
    assert sorted(os.listdir(staged)) == ["step-000000000003"]
    assert not os.path.islink(part)  # staged again: a verified one-slot copy
    info = nonstop._core.Reader(os.path.dirname(part), rank=0).checkpoints[0]
    assert info["committed"] and info["step"] == 3 and info["counter"] == counter


def test_remote_temp_dir_removal_never_follows_links(tmp_path):
    out = _outside(tmp_path)
    with _remote.temp_dir() as tmp:  # removed at the end of the block
        assert oct(os.stat(tmp).st_mode & 0o777) == oct(0o700)
        os.makedirs(os.path.join(tmp, "remote", "step-000000000001"))
        os.symlink(out, os.path.join(tmp, "remote", "step-000000000001", "link"))
        os.symlink(out / "precious", os.path.join(tmp, "file-link"))
    assert not os.path.lexists(tmp)
    _intact(out)


@pytest.mark.skipif(_cli() is None, reason="the nonstop CLI is not built")
def test_cli_export_include_on_a_remote_url(tmp_path, shared_s3):  # noqa: F811
    """`nonstop export s3://... --include GLOB` (repeatable) writes what the
    same export of the local checkpoint writes; no match, or --format dcp,
    is a one-line usage error (exit 2). It was refused for URLs before."""
    from safetensors.torch import load_file
    url, opts = shared_s3.url("job"), shared_s3.options
    d, store, _ = _two_remote_steps(tmp_path, url, opts)  # remote steps 7 and 3
    env = dict(os.environ, NONSTOP_REMOTE_OPTIONS=json.dumps(opts), NONSTOP_PYTHON=sys.executable)

    def run(*args):
        return subprocess.run([_cli(), *args], capture_output=True, text=True, env=env,
                              timeout=300)

    got = str(tmp_path / "r.safetensors")
    r = run("export", url, "-o", got, "--include", "model/fc.*", "--include", "*head*")
    assert r.returncode == 0, r.stderr
    ref = str(tmp_path / "ref")
    want = str(tmp_path / "l.safetensors")
    subprocess.run([_cli(), "export", nonstop._core.RemoteTier(store).fetch(7, 0, ref), "-o", want,
                    "--include", "model/fc.*", "--include", "*head*"], check=True,
                   capture_output=True, timeout=300)
    assert open(got, "rb").read() == open(want, "rb").read()
    assert set(load_file(got)) == {"model/fc.weight", "model/fc.bias", "model/head.weight"}
    r = run("export", url, "-o", str(tmp_path / "n.safetensors"), "--include", "nothing/*")
    assert r.returncode == 2 and "matches --include" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    r = run("export", url, "-o", str(tmp_path / "dcp"), "--format", "dcp", "--include", "m*")
    assert r.returncode == 2 and "--include" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_obstore_workers_run_at_the_upload_priority(tmp_path, shared_s3):  # noqa: F811
    """restore() uses obstore on the training thread first; obstore's worker
    threads (its HTTP transfers) inherit the priority of the thread that
    made them, so the tier makes them from a thread at nice +10 before that.
    Checked in a fresh process (its first use of obstore), from /proc."""
    code = (
        "import glob, nonstop, tiny\n"
        "m, o, s = tiny.make()\n"
        f"ck = nonstop.Checkpointer({str(tmp_path / 'job')!r}, {{'model': m, 'optim': o}},\n"
        f"    remote={shared_s3.url('p')!r}, remote_options={shared_s3.options!r})\n"
        "ck.restore()\n"
        "seen = {}\n"
        "for t in glob.glob('/proc/self/task/*'):\n"
        "    f = open(t + '/stat').read().rsplit(')', 1)[1].split()\n"
        "    seen.setdefault(open(t + '/comm').read().strip(), set()).add(int(f[16]))\n"
        "ck.close()\n"
        "import json; print(json.dumps([sorted(seen.get('tokio-rt-worker', [])),\n"
        "                               sorted(seen['python'])]))\n")
    # `tiny` lives beside this file; the child finds it on PYTHONPATH
    path = os.pathsep.join(p for p in (os.path.dirname(os.path.abspath(__file__)),
                                       os.environ.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=240, env=dict(os.environ, PYTHONPATH=path))
    assert r.returncode == 0, r.stderr
    workers, main = json.loads(r.stdout.strip().splitlines()[-1])
    base = min(main)  # the training thread's
    assert workers and all(w == min(19, base + 10) for w in workers), (workers, main)


def test_remote_every_retries_a_failed_upload_and_never_skips_it(tmp_path):
    """remote_every=1 on a path remote whose first step cannot be written
    (a file sits where its step folder goes): the upload of step 0 fails and
    is retried with backoff until the folder can be made; meanwhile the next
    save() waits for it (training slows to the upload's pace), and every
    step reaches the remote, step 0 included. The Python loop dropped a
    selected checkpoint whose upload failed once it was staged, and went on
    with the next one: step 0 never reached the remote."""
    url, d = str(tmp_path / "shared"), str(tmp_path / "local")
    os.makedirs(url)
    blocker = os.path.join(url, _ext.core().remote_layout.step_dir(0))
    with open(blocker, "wb") as f:
        f.write(b"in the way")
    model, opt, sched = tiny.make()
    state = {"model": model, "optim": opt, "sched": sched}
    ck = nonstop.Checkpointer(d, state, every=1, remote=url, remote_every=1,
                              remote_options={"max_to_keep": 10, "retry_max_s": 0.2})
    seen = []

    def unblock():  # once step 0 failed (before the first save: no counters yet)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                s = ck.stats()["remote"]
                if s.get("retries", 0) >= 1:
                    seen.append(s["last_error"])
                    break
                time.sleep(0.02)
        finally:
            os.unlink(blocker)
    t = threading.Thread(target=unblock)
    t.start()
    try:
        for step in range(3):
            tiny.train_step(model, opt, sched, step)
            ck.step(step)
    finally:
        t.join()
        ck.close()
    assert seen and seen[0].startswith("step 0: "), seen
    s = ck.stats()["remote"]
    remote = nonstop._core.RemoteTier(_remote.open_store(url, {}))
    steps = sorted(st for st, _ in remote.committed_steps())
    assert steps == [0, 1, 2], s
    assert s["committed"] == 3 and s["failures"] == 0 and s["given_up"] == 0, s


@pytest.mark.timeout(60)
def test_a_paced_file_reader_stops_once_aborted(tmp_path):
    """Directory.open(name, bps=, abort=): the FileReader an object store's
    upload reads through keeps to bandwidth_bps in C++ (tier/pacer.h, the
    path transport's pace too), and once abort (the store's Event, set when
    close_timeout_s passed) is set, a read ahead of the pace raises at once
    instead of waiting."""
    d = nonstop._core.Directory(str(tmp_path))
    d.write_atomic("part", b"x" * 4096)
    aborted = threading.Event()
    with d.open("part", bps=1e9, abort=aborted) as f:
        assert f.read(1024) == b"x" * 1024 and f.read() == b"x" * 3072
    aborted.set()
    with d.open("part", bps=1.0, abort=aborted) as f:  # 4096 s of pace
        with pytest.raises(nonstop.CheckpointError, match=r"^upload aborted \(close_timeout_s"):
            f.read()
    with d.open("part", abort=aborted) as f:  # no limit: not paced, never aborted
        assert len(f.read()) == 4096
