"""The remote tier against a real S3 server (SeaweedFS, tests/python/s3_server.py)
and a plain path: upload after a local commit, restore on a node whose local
directory is gone, and the faults: the server stopped during an upload, a
deleted part, a flipped bit. Nothing is mocked."""
import json
import os
import subprocess
import sys
import shutil
import threading
import time
import warnings

import pytest
import torch

import nonstop
import tiny
from conftest import needs_engine
from nonstop import _ext, _remote
from nonstop.errors import CheckpointIOError, CorruptCheckpointError
from s3_server import SeaweedS3, _one_s3_server, s3_server, shared_s3  # noqa: F401 -- the fixtures

pytestmark = [needs_engine, pytest.mark.timeout(300)]


def _train(dir, steps, remote, options, every=2, start_from=None, big=0):
    model, opt, sched = tiny.make()
    state = {"model": model, "optim": opt, "sched": sched}
    if big:
        state["blob"] = torch.arange(big, dtype=torch.float32)
    ckpt = nonstop.Checkpointer(dir, state, every=every, remote=remote, remote_options=options)
    start = ckpt.restore()
    first = 0 if start is None else start + 1
    for step in range(first, steps):
        tiny.train_step(model, opt, sched, step)
        if big:
            state["blob"].add_(1.0)
        ckpt.step(step)
    return ckpt, state, start


def _params(state):
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _remote_url(kind, s3, tmp_path):
    if kind == "s3":
        return s3.url("job"), s3.options
    return str(tmp_path / "shared"), {}


def _wait_uploaded(store, step, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s == step for s, _ in nonstop._core.RemoteTier(store).committed_steps()):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} never committed remotely")


@pytest.fixture(params=["s3", "path"])
def remote(request, tmp_path):
    if request.param == "s3":  # the session's server, under a prefix of this test's own
        srv = request.getfixturevalue("shared_s3")
        return _remote_url("s3", srv, tmp_path) + (srv,)
    return _remote_url("path", None, tmp_path) + (None,)


def test_upload_then_restore_after_local_dir_is_lost(tmp_path, remote):
    url, opts, _ = remote
    d = str(tmp_path / "local")
    ckpt, state, _ = _train(d, 10, url, opts)
    ckpt.close()  # waits for the newest upload
    st = ckpt.stats()["remote"] if False else None  # noqa: F841 -- closed
    store = _remote.open_store(url, opts)
    steps = [s for s, _ in nonstop._core.RemoteTier(store).committed_steps()]
    assert steps[0] == 9
    assert len(steps) <= 2  # max_to_keep=2 by default
    want = _params(state)
    # the replaced node: an empty local directory
    shutil.rmtree(d)
    model, opt, sched = tiny.make(seed=123)
    state2 = {"model": model, "optim": opt, "sched": sched}
    ck2 = nonstop.Checkpointer(d, state2, every=2, remote=url, remote_options=opts)
    assert ck2.restore() == 9
    _same(want, _params(state2))
    assert ck2.stats()["remote"]["restored_from"].endswith("step-000000000009")
    # and training goes on bit-identically: compare with an uninterrupted run
    for step in range(10, 14):
        tiny.train_step(model, opt, sched, step)
        ck2.step(step)
    ck2.close()
    ref, _, _ = _train(str(tmp_path / "ref"), 14, None, None)
    ref_state = ref.state
    ref.close()
    _same(_params(ref_state), _params(state2))


def test_local_newer_than_remote_wins(tmp_path, remote):
    url, opts, _ = remote
    d = str(tmp_path / "local")
    ckpt, state, _ = _train(d, 6, url, opts)
    ckpt.close()
    # a newer local checkpoint that never reached the remote
    ck, st, start = _train(d, 10, None, None)
    assert start == 5
    ck.close()
    model, opt, sched = tiny.make(seed=5)
    ck3 = nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": sched}, every=2,
                               remote=url, remote_options=opts)
    assert ck3.restore() == 9
    assert ck3.stats()["remote"]["restored_from"] is None
    ck3.close()


def _two_remote_steps(tmp_path, url, opts):
    d = str(tmp_path / "local")
    ckpt, state, _ = _train(d, 4, url, opts, every=4)  # step 3
    ckpt.close()
    ckpt, state, start = _train(d, 8, url, opts, every=4)  # step 7
    assert start == 3
    ckpt.close()
    store = _remote.open_store(url, opts)
    assert [s for s, _ in nonstop._core.RemoteTier(store).committed_steps()] == [7, 3]
    ref3, _, _ = _train(str(tmp_path / "ref3"), 4, None, None)
    want3 = _params(ref3.state)
    ref3.close()
    shutil.rmtree(d)
    return d, store, want3


def _fresh(d, url, opts):
    model, opt, sched = tiny.make(seed=77)
    state = {"model": model, "optim": opt, "sched": sched}
    return nonstop.Checkpointer(d, state, every=4, remote=url, remote_options=opts), state


def test_deleted_remote_part_falls_back(tmp_path, remote):
    url, opts, _ = remote
    d, store, want3 = _two_remote_steps(tmp_path, url, opts)
    store.delete([_ext.core().remote_layout.part_key(7, 0)])
    ck, state = _fresh(d, url, opts)
    with pytest.warns(UserWarning, match="remote step 7: .*part is missing"):
        assert ck.restore() == 3
    _same(want3, _params(state))
    ck.close()


def _flip(store, key, at):
    size, chunks = store.get_chunks(key)
    data = bytearray(b"".join(bytes(c) for c in chunks))
    data[at] ^= 0x10
    store.put_bytes(key, bytes(data))
    return size


@pytest.mark.parametrize("where", ["data", "manifest-ok-bit-in-copy"])
def test_flipped_bit_in_remote_part_falls_back(tmp_path, remote, where):
    url, opts, _ = remote
    d, store, want3 = _two_remote_steps(tmp_path, url, opts)
    key = _ext.core().remote_layout.part_key(7, 0)
    probe = str(tmp_path / "probe")
    got = nonstop._core.RemoteTier(store).fetch(7, 0, probe)
    info = nonstop._core.Reader(got, rank=0).checkpoints[0]
    shutil.rmtree(probe)
    _flip(store, key, info["data_offset"] + info["data_bytes"] // 2)  # inside a tensor
    if where != "data":
        # rewrite the manifest to match the damaged bytes: the transfer
        # checksums pass, and nonstop's own chunk crc32c must catch it
        import json
        import zlib
        man = json.loads(store.get_bytes(_ext.core().remote_layout.manifest_key(7, 0), 1 << 20))
        _, chunks = store.get_chunks(key)
        blob = b"".join(bytes(c) for c in chunks)
        p = man["part_bytes"]
        man["part_crc32"] = [zlib.crc32(blob[i:i + p]) for i in range(0, len(blob), p)]
        store.put_bytes(_ext.core().remote_layout.manifest_key(7, 0), json.dumps(man).encode())
    ck, state = _fresh(d, url, opts)
    with pytest.warns(UserWarning, match="remote step 7"):
        assert ck.restore() == 3
    _same(want3, _params(state))
    ck.close()
    # with no older remote step left: a clear error, never wrong data
    store.delete([_ext.core().remote_layout.marker_key(3)])
    shutil.rmtree(d)
    ck, state = _fresh(d, url, opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CorruptCheckpointError, match="no remote checkpoint .* verifies"):
            ck.restore()
    ck.close()


def test_server_stopped_during_upload_then_restarted(tmp_path, s3_server):  # noqa: F811
    srv = s3_server
    url, opts = srv.url("job"), dict(srv.options, bandwidth_bps=20e6, retry_max_s=1.0)
    d = str(tmp_path / "local")
    big = 24 << 20  # 96 MiB of float32: about 5 s at 20 MB/s
    ckpt, state, _ = _train(d, 2, url, opts, every=2, big=big)
    ckpt.wait()
    deadline = time.monotonic() + 60
    while ckpt.stats()["remote"]["uploading_step"] != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ckpt.stats()["remote"]["uploading_step"] == 1
    time.sleep(0.5)
    srv.stop()  # mid-upload
    # Down until the uploader saw it fail: the store client retries a short
    # outage itself, so a fixed pause could end before any attempt failed
    # (a loaded host: retries 0 with the step uploaded).
    deadline = time.monotonic() + 120
    while ckpt.stats()["remote"]["retries"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ckpt.stats()["remote"]["retries"] >= 1, ckpt.stats()["remote"]
    store = _remote.open_store(url, opts)
    assert ckpt.stats()["remote"]["uploaded_step"] is None
    srv.start()
    # nothing partial was committed while the server was gone
    assert [s for s, _ in nonstop._core.RemoteTier(store).committed_steps()] in ([], [1])
    _wait_uploaded(store, 1, timeout=180)
    # The marker is visible before the uploader records the step (retention
    # and the manifest come in between): wait for the record too.
    deadline = time.monotonic() + 60
    while ckpt.stats()["remote"]["uploaded_step"] != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    s = ckpt.stats()["remote"]
    assert s["retries"] >= 1 and s["uploaded_step"] == 1, s
    want = state["blob"].clone()
    ckpt.close()
    shutil.rmtree(d)
    model, opt, sched = tiny.make(seed=9)
    st2 = {"model": model, "optim": opt, "sched": sched,
           "blob": torch.zeros(big, dtype=torch.float32)}
    ck2 = nonstop.Checkpointer(d, st2, every=2, remote=url, remote_options=opts)
    assert ck2.restore() == 1
    assert torch.equal(st2["blob"], want)
    ck2.close()


def test_restart_with_the_store_down_is_bounded_and_says_so(tmp_path, s3_server):  # noqa: F811
    """A restart never hangs on a dead store: with a local checkpoint it
    warns and restores that; with none (a replaced node) it raises one line
    instead of starting from scratch; nonstop.load of the URL raises too.
    Each within obstore's retry bound (seconds), never a raw client error."""
    srv = s3_server
    url, opts = srv.url("job"), dict(srv.options, close_timeout_s=5.0)
    d = str(tmp_path / "local")
    ckpt, state, _ = _train(d, 6, url, opts)
    ckpt.close()
    srv.stop()
    model, opt, sched = tiny.make(seed=3)
    ck = nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": sched}, every=2,
                              remote=url, remote_options=opts)
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match=r"cannot be listed .*restoring the newest local "
                                         r"checkpoint \(step 5\)"):
        assert ck.restore() == 5
    assert time.monotonic() - t0 < 30
    _same(_params(state), {k: v.detach() for k, v in model.state_dict().items()})
    ck.close()
    shutil.rmtree(d)
    ck = nonstop.Checkpointer(d, dict(zip(("model", "optim", "sched"), tiny.make(seed=4))),
                              every=2, remote=url, remote_options=opts)
    t0 = time.monotonic()
    with pytest.raises(CheckpointIOError, match="cannot be listed .*no local checkpoint") as e:
        ck.restore()
    assert time.monotonic() - t0 < 30 and "\n" not in str(e.value)
    ck.close()
    with pytest.raises(CheckpointIOError, match="listing") as e:
        nonstop.load(url, remote_options=opts)
    assert "\n" not in str(e.value)


def test_load_reads_a_remote_url(tmp_path, remote):
    url, opts, _ = remote
    ckpt, state, _ = _train(str(tmp_path / "local"), 4, url, opts)
    ckpt.close()
    got = nonstop.load(url, remote_options=opts)
    assert got.step == 3
    want = _params(state)
    loaded = {k[len("model/"):]: v for k, v in got.tensors.items() if k.startswith("model/")}
    assert "fc.weight" in loaded
    for k, v in loaded.items():
        assert torch.equal(v, want[k]), k


def test_retention_keeps_the_newest(tmp_path):  # the default: max_to_keep from remote_options
    url = str(tmp_path / "shared")
    opts = {"max_to_keep": 1}
    ckpt, _, _ = _train(str(tmp_path / "local"), 12, url, opts, every=2)
    ckpt.close()
    store = _remote.open_store(url, opts)
    assert [s for s, _ in nonstop._core.RemoteTier(store).committed_steps()] == [11]
    dirs = sorted(d for d in os.listdir(url) if d != _ext.core().remote_layout.job_key())
    assert dirs == ["step-000000000011"], dirs
    # local staging keeps at most the newest uploaded copy
    assert os.listdir(str(tmp_path / "local" / "remote")) == ["step-000000000011"]


def test_uploads_never_block_local_checkpoints(tmp_path):
    """The remote is a path that hangs (a FIFO in place of the step
    directory would block; here: bandwidth 1 byte/s): local checkpoints go on
    committing at full speed, and close() gives up after close_timeout_s."""
    url = str(tmp_path / "slow")
    opts = {"bandwidth_bps": 1000.0, "close_timeout_s": 1.0}
    t0 = time.monotonic()
    ckpt, state, _ = _train(str(tmp_path / "local"), 20, url, opts, every=2)
    ckpt.wait()
    assert ckpt.latest() == 19
    assert ckpt.stats()["remote"]["uploaded_step"] is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.close()
    assert time.monotonic() - t0 < 60
    store = _remote.open_store(url, opts)
    assert nonstop._core.RemoteTier(store).committed_steps() == []


def _cli():
    here = os.path.join(os.path.dirname(sys.executable), "nonstop")
    return os.environ.get("NONSTOP_CLI") or (here if os.access(here, os.X_OK) else None) \
        or shutil.which("nonstop")


@pytest.mark.skipif(_cli() is None, reason="the nonstop CLI is not built")
def test_cli_verify_inspect_export_a_remote_url(tmp_path, remote):
    """`nonstop verify|inspect|export URL` (tools/remote_cli.h -> python -m
    nonstop._remote_cli): the same output as on a local directory, the
    download checked; a flipped bit is "damaged" (exit 1) for verify and a
    fallback to the older step for export, never wrong bytes."""
    import json
    import subprocess
    url, opts, _ = remote
    d, store, _ = _two_remote_steps(tmp_path, url, opts)  # remote steps 7 and 3
    cli_url = url if "://" in url else "file://" + url
    env = dict(os.environ, NONSTOP_REMOTE_OPTIONS=json.dumps(opts), NONSTOP_PYTHON=sys.executable)

    def run(*args):
        p = subprocess.run([_cli(), *args], capture_output=True, text=True, env=env, timeout=300)
        return p.returncode, p.stdout, p.stderr

    rc, out, err = run("inspect", "--json", cli_url)
    assert rc == 0, err
    doc = json.loads(out)
    assert [(s["step"], s["committed"], s["ranks"]) for s in doc["steps"]] == \
        [(7, True, [0]), (3, True, [0])]
    rc, out, err = run("verify", cli_url)
    assert rc == 0 and "OK: step 7 verified on 1 rank" in out, (out, err)
    rc, out, err = run("verify", cli_url, "--step", "99")
    assert rc == 2 and "no committed remote checkpoint at step 99" in err
    # the export of the remote step is byte for byte the export of the same
    # checkpoint read locally (its one-slot copy, fetched by the tier itself)
    rc, out, err = run("export", cli_url, "-o", str(tmp_path / "r7.safetensors"))
    assert rc == 0, err
    ref = str(tmp_path / "ref7")
    subprocess.run([_cli(), "export", nonstop._core.RemoteTier(store).fetch(7, 0, ref), "-o",
                    str(tmp_path / "l7.safetensors")], check=True, capture_output=True)
    assert open(tmp_path / "r7.safetensors", "rb").read() == \
        open(tmp_path / "l7.safetensors", "rb").read()
    # damage step 7's part: first the download's check catches it, then (the
    # manifest rewritten to match) the file's own chunk crc32c
    probe = str(tmp_path / "probe")
    got = nonstop._core.RemoteTier(store).fetch(7, 0, probe)
    info = nonstop._core.Reader(got, rank=0).checkpoints[0]
    key = _ext.core().remote_layout.part_key(7, 0)
    _flip(store, key, info["data_offset"] + info["data_bytes"] // 2)
    for where in ("download", "file"):
        if where == "file":
            import zlib
            man = json.loads(store.get_bytes(_ext.core().remote_layout.manifest_key(7, 0), 1 << 20))
            _, chunks = store.get_chunks(key)
            blob = b"".join(bytes(c) for c in chunks)
            p = man["part_bytes"]
            man["part_crc32"] = [zlib.crc32(blob[i:i + p]) for i in range(0, len(blob), p)]
            store.put_bytes(_ext.core().remote_layout.manifest_key(7, 0), json.dumps(man).encode())
        rc, out, err = run("verify", cli_url)
        assert rc == 1, (where, rc, out, err)
        assert ("crc mismatch" in err) if where == "download" else \
            ("checksum mismatch" in out + err), (where, out, err)
        # export takes the newest step that is intact: step 3
        out_file = str(tmp_path / f"r-{where}.safetensors")
        rc, out, err = run("export", cli_url, "-o", out_file)
        assert rc == 0 and "remote step 7" in err and "(step 3)" in out, (where, rc, out, err)
        rc, out, err = run("export", cli_url, "--step", "7", "-o", out_file + ".7")
        assert rc == 1 and not os.path.exists(out_file + ".7"), (where, rc, out, err)


def _train_paced(dir, steps, url, opts, **kw):
    """One checkpoint per step, each committed remotely before the next step
    (so which steps reach the remote does not depend on timing)."""
    model, opt, sched = tiny.make()
    state = {"model": model, "optim": opt, "sched": sched}
    ckpt = nonstop.Checkpointer(dir, state, every=1, remote=url, remote_options=opts, **kw)
    store = _remote.open_store(url, opts)
    counters = {}
    for step in range(steps):
        tiny.train_step(model, opt, sched, step)
        ckpt.step(step)
        ckpt.wait()
        _wait_uploaded(store, step)
        counters[step] = dict(nonstop._core.RemoteTier(store).committed_steps())[step]["counter"]
    ckpt.close()
    return store, counters


def _step_dirs(store):
    # The prefix's JOB document (the job's identity) is no step's object.
    job = _ext.core().remote_layout.job_key()
    return sorted({k.split("/")[0] for k, _ in store.list("") if k != job})


def test_retention_applies_keep_and_max_to_keep_remotely(tmp_path, remote):
    """keep=3, max_to_keep=2 and remote max_to_keep=1: the remote holds the
    newest step and the newest two steps whose counter is a multiple of 3,
    nothing else (no object of a deleted step is left)."""
    url, opts, _ = remote
    opts = dict(opts, max_to_keep=1)
    store, counters = _train_paced(str(tmp_path / "local"), 10, url, opts, keep=3, max_to_keep=2)
    assert [counters[s] for s in range(10)] == list(range(1, 11))  # one checkpoint per step
    periodic = [s for s in range(10) if counters[s] % 3 == 0]      # steps 2, 5, 8
    want = sorted({9} | set(periodic[-2:]), reverse=True)
    assert want == [9, 8, 5]
    assert [s for s, _ in nonstop._core.RemoteTier(store).committed_steps()] == want
    assert _step_dirs(store) == [_ext.core().remote_layout.step_dir(s) for s in sorted(want)]


def test_retention_without_keep_keeps_the_newest_remote_steps(tmp_path, remote):
    url, opts, _ = remote
    store, _ = _train_paced(str(tmp_path / "local"), 6, url, dict(opts, max_to_keep=3))
    assert [s for s, _ in nonstop._core.RemoteTier(store).committed_steps()] == [5, 4, 3]
    assert _step_dirs(store) == [_ext.core().remote_layout.step_dir(s) for s in (3, 4, 5)]


class _CutShort:
    """The real store, whose deletions fail after the first (a rank killed,
    or the store gone, in the middle of retention)."""

    def __init__(self, store):
        self.store, self.url, self.deletes = store, store.url, 0

    def list(self, prefix=""):
        return self.store.list(prefix)

    def get_bytes(self, key, limit):
        return self.store.get_bytes(key, limit)

    def delete(self, keys):
        self.deletes += 1
        if self.deletes > 1:
            raise CheckpointIOError("the store went away")
        self.store.delete(keys)


def test_retention_cut_short_leaves_no_half_committed_step(tmp_path, remote):
    """Retention deletes the marker first: cut short after it, the step is
    no longer committed for any reader (never a marker with missing parts),
    and the next retention deletes what is left of it."""
    url, opts, _ = remote
    store, _ = _train_paced(str(tmp_path / "local"), 3, url, dict(opts, max_to_keep=10))
    assert [s for s, _ in nonstop._core.RemoteTier(store).committed_steps()] == [2, 1, 0]
    cut = _CutShort(store)
    with pytest.raises(CheckpointIOError):
        nonstop._core.RemoteTier(cut).retain(2)
    assert cut.deletes == 2
    # step 0 lost its marker, and only its marker: uncommitted, never read
    assert [s for s, _ in nonstop._core.RemoteTier(store).committed_steps()] == [2, 1]
    assert any(k.startswith("step-000000000000/rank-") for k, _ in store.list(""))
    with pytest.raises(nonstop.errors.CheckpointNotFoundError):
        nonstop.load(url, step=0, remote_options=opts)
    assert nonstop._core.RemoteTier(store).retain(2) == 1
    assert _step_dirs(store) == [_ext.core().remote_layout.step_dir(s) for s in (1, 2)]
    assert nonstop.load(url, remote_options=opts).step == 2


def test_list_a_remote(tmp_path, remote):
    """nonstop.list(URL) and `nonstop ls URL` (and a plain directory used
    as a remote, recognised without options): the remote's steps, newest
    first; an upload without a marker is listed as uncommitted."""
    url, opts, _ = remote
    store, counters = _train_paced(str(tmp_path / "local"), 3, url, dict(opts, max_to_keep=10))
    # an upload under way: a part without its manifest or marker
    store.put_bytes(_ext.core().remote_layout.part_key(5, 0), b"x" * 100)
    rows = nonstop.list(url, remote_options=opts)
    assert [(r["step"], r["state"], r["where"]) for r in rows] == [
        (5, "uncommitted", "remote"), (2, "committed", "remote"), (1, "committed", "remote"),
        (0, "committed", "remote")]
    assert [r["counter"] for r in rows[1:]] == [counters[2], counters[1], counters[0]]
    assert all(r["bytes"] > 0 and r["time"] is not None for r in rows[1:])
    if not url.startswith("s3://"):
        assert nonstop.list(url) == rows  # a plain path, no options: recognised as a remote
    assert nonstop.list(str(tmp_path / "local"))[0]["where"] != "remote"
    cli = _cli()
    if cli is None:
        return
    env = dict(os.environ, NONSTOP_REMOTE_OPTIONS=json.dumps(opts))
    p = subprocess.run([cli, "ls", url], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()  # a local ls's table (engine/job_view.h LsText)
    assert out[0].startswith("job ") and out[1].split()[:3] == ["step", "where", "state"], out
    lines = [ln.split() for ln in out[2:]]
    assert [(ln[0], ln[1], ln[2]) for ln in lines] == [
        ("5", "remote", "uncommitted"), ("2", "remote", "committed"),
        ("1", "remote", "committed"), ("0", "remote", "committed")]
    p = subprocess.run([cli, "ls", url, "--json"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in json.loads(p.stdout)] == [5, 2, 1, 0]


@pytest.mark.parametrize("damage", ["huge size", "short list", "other rank", "not json"])
def test_hostile_remote_manifest_is_refused(tmp_path, damage):
    """A manifest that lies (a size needing 2^50 checksums, a list one
    short, another rank's, not JSON) is refused by C++ before anything is
    downloaded or allocated: load() of that step is one CorruptCheckpointError,
    restore falls back to the older step."""
    url = str(tmp_path / "shared")
    store, _ = _train_paced(str(tmp_path / "local"), 2, url, {"max_to_keep": 10})
    key = _ext.core().remote_layout.manifest_key(1, 0)
    man = json.loads(store.get_bytes(key, 1 << 20))
    if damage == "huge size":
        man["bytes"] = 1 << 62
    elif damage == "short list":
        man["part_crc32"] = man["part_crc32"][:-1]
    elif damage == "other rank":
        man["rank"] = 3
    store.put_bytes(key, b"{not json" if damage == "not json" else json.dumps(man).encode())
    with pytest.raises(CorruptCheckpointError) as e:
        nonstop.load(url, step=1, remote_options={})
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "local" / "remote" / "step-000000000001"
                              / "rank-00000.nsck.fetch")
    with pytest.warns(UserWarning, match="remote step 1"):
        assert nonstop.load(url, remote_options={}).step == 0


def _restore_refused(d, url, options) -> str:
    """The one line of restore()'s CheckpointIOError for a new job in `d`."""
    ck = nonstop.Checkpointer(str(d), {"w": torch.ones(4)}, every=1, remote=url,
                              remote_options=options)
    try:
        with pytest.raises(CheckpointIOError) as e:
            ck.restore()
    finally:
        ck.close()
    msg = str(e.value)
    assert "\n" not in msg and "<?xml" not in msg, msg
    return msg


def test_a_missing_bucket_denied_credentials_and_an_unreachable_store_are_three_messages(
        tmp_path, shared_s3):  # noqa: F811
    """A first start that cannot list the remote (nothing local to fall
    back to) is refused with one line that says which of the three it is,
    against the real SeaweedFS server: the bucket missing (404), the
    credentials refused (403), no server at the endpoint; and without
    credentials, what to give, never the cloud metadata address the client
    tried."""
    fast = dict(shared_s3.options, connect_timeout="1s", timeout="3s")

    def refused(url, options):
        return _restore_refused(tmp_path / f"job{len(list(tmp_path.iterdir()))}", url, options)

    # A Checkpointer writes its prefix's JOB document first, and this server
    # makes a missing bucket on a write (-s3.autoCreateBucket): the listing
    # of a missing bucket is asked of the store directly.
    with pytest.raises(CheckpointIOError) as e:
        _remote.open_store("s3://no-such-bucket/p", fast).list("")
    missing = "x: listing: " + str(e.value).split(": listing: ")[1]
    assert "the bucket does not exist (404" in missing and "<?xml" not in missing, missing
    assert getattr(e.value, "kind", None) == "bucket_missing"
    denied = refused(shared_s3.url("p"), dict(fast, secret="wrong"))
    assert "access denied (403)" in denied and "fix the remote" in denied
    down = refused(shared_s3.url("p"), dict(fast, endpoint="http://127.0.0.1:1"))
    assert "the store is unreachable (http://127.0.0.1:1)" in down
    assert "once the store is reachable" in down
    assert len({m.split(": listing: ")[1][:20] for m in (missing, denied, down)}) == 3
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("AWS_")}
    try:
        none = refused("s3://some-bucket/p", {"connect_timeout": "1s", "timeout": "3s"})
    finally:
        os.environ.update(saved)
    assert "no credentials: give remote_options key= and secret=" in none
    assert "169.254" not in none


@pytest.mark.parametrize("n", [1, 3])
def test_remote_every_uploads_each_selected_checkpoint(tmp_path, shared_s3, n):  # noqa: F811
    """remote_every=1: every committed checkpoint reaches the bucket (without
    it the uploader takes the newest one whenever it is free, skipping the
    rest); remote_every=3: every third (counters 3, 6, ...: steps 2, 5, ...)."""
    url, opts = shared_s3.url("every"), dict(shared_s3.options, max_to_keep=100)
    model, opt, sched = tiny.make()
    state = {"model": model, "optim": opt, "sched": sched,
             "blob": torch.zeros(1 << 20)}  # 4 MiB: uploads slower than steps
    ckpt = nonstop.Checkpointer(str(tmp_path / "d"), state, every=1, remote=url,
                                remote_options=opts, remote_every=n)
    for step in range(9):
        tiny.train_step(model, opt, sched, step)
        state["blob"].add_(1.0)
        ckpt.step(step)
    ckpt.close()  # waits for the uploader
    store = _remote.open_store(url, opts)
    got = sorted(s for s, _ in nonstop._core.RemoteTier(store).committed_steps())
    assert got == [s for s in range(9) if (s + 1) % n == 0]
    # each one is that step's state
    for s in got:
        loaded = nonstop.load(url, step=s, remote_options=opts)
        assert loaded.step == s and float(loaded.tensors["blob"][0]) == s + 1.0


def test_remote_every_is_checked_at_construction(tmp_path):
    state = {"w": torch.zeros(2)}
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(nonstop.errors.CheckpointMismatchError, match="remote_every"):
            nonstop.Checkpointer(str(tmp_path / "d"), state, remote=str(tmp_path / "r"),
                                 remote_every=bad)
    with pytest.raises(nonstop.errors.CheckpointMismatchError, match="needs remote="):
        nonstop.Checkpointer(str(tmp_path / "d"), state, remote_every=1)


def test_create_bucket_on_request(tmp_path):
    """Against a SeaweedFS that does not make buckets on a write (as AWS S3):
    a missing bucket is refused with the one-line missing-bucket message,
    unless remote_options={'create_bucket': True}, which makes it; then the
    job uploads and restores from it. A second job with the option finds it
    there."""
    srv = SeaweedS3(tmp_path / "seaweedfs", bucket="made", auto_create_bucket=False)
    srv.start()
    try:
        opts = dict(srv.options, connect_timeout="1s", timeout="5s")
        msg = _restore_refused(tmp_path / "a", srv.url("job"), opts)
        assert "the bucket does not exist (404" in msg and "{'create_bucket': True}" in msg, msg
        with pytest.raises(nonstop.errors.CheckpointMismatchError, match="create_bucket"):
            nonstop.Checkpointer(str(tmp_path / "p"), {"w": torch.ones(4)},
                                 remote=str(tmp_path / "shared"),
                                 remote_options={"create_bucket": True})
        made = dict(opts, create_bucket=True)
        for d in ("b", "c"):  # c: the bucket is there already
            state = {"w": torch.zeros(4)}
            ck = nonstop.Checkpointer(str(tmp_path / d), state, every=1,
                                      remote=srv.url(d), remote_options=made)
            assert ck.restore() is None
            state["w"].add_(3.0)
            ck.step(0)
            ck.close()
            got = nonstop.load(srv.url(d), remote_options=opts)
            assert got.step == 0 and torch.equal(got.tensors["w"], torch.full((4,), 3.0))
    finally:
        srv.stop()


def test_object_store_options_are_sorted_out_and_a_bad_one_is_one_line():
    """_core.store_options (C++, tier/s3_request.h SortStoreOptions): the
    tier's own options never reach obstore; an endpoint given through
    client_kwargs is used (http allowed for it); a client_kwargs that is not
    a dict is one line, not an AttributeError."""
    c = nonstop._core.store_options("s3://b/p/", {"client_kwargs": {"endpoint_url": "http://h:1"},
                                                  "key": "k", "max_to_keep": 3})
    assert (c["bucket"], c["prefix"], c["kw"]["endpoint"]) == ("b", "p", "http://h:1")
    assert c["client"]["allow_http"] and c["kw"]["access_key_id"] == "k"
    assert "max_to_keep" not in c["kw"] and "client_kwargs" not in c["kw"]
    with pytest.raises(nonstop.CheckpointMismatchError, match="client_kwargs must be a dict"):
        nonstop._core.store_options("s3://b", {"client_kwargs": "x"})
