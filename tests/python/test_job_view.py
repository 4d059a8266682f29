"""`nonstop ls` and nonstop.list() show every tier of each step (issues #23,
#27; docs/TIERS.md "Which tiers hold a step"): a real job with the memory
tier, the disk, a remote on a real S3 server (SeaweedFS, s3_server.py) and a
partner's memory (a real peer server and replicator over loopback TCP, as
test_peer_core.py does). The remote and peer holdings come from the job
manifest the C++ uploader and replicator write (no Python in between); a
damaged manifest is listed as damage, never hidden."""
import json
import os
import subprocess
import time

import pytest
import torch

import nonstop
from conftest import nonstop_cli
from nonstop import _core, _remote
from peer_loopback import loopback_server, memory_checkpointer
from s3_server import _one_s3_server, shared_s3  # noqa: F401 -- the fixtures

JOB = "job-view"
SECRET = os.urandom(32)
KEYS = {"step", "counter", "where", "path", "state", "reason", "bytes", "metrics", "tiers", "job"}


def _wait(cond, what, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"never: {what}")


def _tiers(row):
    return {t["tier"]: t["where"] for t in row["tiers"]}


def test_ls_and_list_show_disk_memory_remote_and_peer(tmp_path, monkeypatch, shared_s3):
    d = str(tmp_path / "job")
    url, opts = shared_s3.url("job"), dict(shared_s3.options, max_to_keep=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    ck = memory_checkpointer(tmp_path, {"model": model}, monkeypatch, remote=url,
                             remote_options=dict(opts, job="the-job"))
    srv, ep = loopback_server(tmp_path, JOB, SECRET)
    store = _remote.open_store(url, opts)
    rep = None
    try:
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.step(step)
            ck.wait()
            _wait(lambda: any(s == step for s, _ in _core.RemoteTier(store).committed_steps()),
                  f"step {step} committed remotely")
        rep = _core.PeerReplicator(JOB, SECRET, 0, ck.stats()["memory_segment"], [ep], poll_s=0.05,
                                   job_dir=d)
        want = {"disk", "memory", "remote", "peer"}
        rows = _wait(lambda: (lambda r: r if set(_tiers(r[0])) == want else None)(nonstop.list(d)),
                     "step 2 on every tier")
        top = rows[0]
        assert (top["step"], top["where"], top["state"]) == (2, "ring", "committed")
        assert _tiers(top) == {"disk": "rank-00000.nsck", "memory": ck.stats()["memory_segment"],
                               "remote": store.url, "peer": ep}
        assert {t["tier"]: t["recorded"] for t in top["tiers"]} == {
            "disk": False, "memory": False, "remote": True, "peer": True}
        assert top["job"] == "the-job"  # the remote's JOB identity, noted by the uploader
        # Remote max_to_keep=2: step 0 left the remote (the uploader's note after
        # retention says so); the ring still holds it.
        assert [(r["step"], sorted(_tiers(r))) for r in rows] == [
            (2, ["disk", "memory", "peer", "remote"]), (1, ["disk", "remote"]), (0, ["disk"])]
        assert set(rows[0]) >= KEYS

        cli = nonstop_cli()
        if cli is not None:
            r = subprocess.run([cli, "ls", d, "--json"], capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0, r.stderr
            js = json.loads(r.stdout)
            assert len(js) == len(rows)
            for x, y in zip(js, rows):
                for k in KEYS:
                    assert x[k] == y[k], (k, x[k], y[k])
            r = subprocess.run([cli, "ls", d], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            lines = r.stdout.splitlines()
            assert lines[0] == "job the-job"
            assert lines[1].split()[:3] == ["step", "where", "state"]
            assert lines[2].split()[:3] == ["2", "ring", "committed"]
            assert f"disk+memory+remote+peer peer@{ep}" in lines[2]
            # The remote itself, in the same columns and keys.
            env = dict(os.environ, NONSTOP_REMOTE_OPTIONS=json.dumps(opts))
            r = subprocess.run([cli, "ls", url, "--json"], capture_output=True, text=True,
                               env=env, timeout=300)
            assert r.returncode == 0, r.stderr
            rj = json.loads(r.stdout)
            assert [(x["step"], x["where"], x["state"], [t["tier"] for t in x["tiers"]])
                    for x in rj] == [(2, "remote", "committed", ["remote"]),
                                     (1, "remote", "committed", ["remote"])]
            assert set(rj[0]) >= KEYS
        remote_rows = nonstop.list(url, remote_options=opts)
        assert set(remote_rows[0]) >= KEYS
        assert {r["job"] for r in remote_rows} == {"the-job"}  # the prefix's JOB document
        assert [(r["step"], r["counter"]) for r in remote_rows] == [
            (r["step"], r["counter"]) for r in rows if "remote" in _tiers(r)]

        # A damaged manifest: listed as damage (exit 1), the disk still listed.
        man = os.path.join(d, "manifest-rank-00000.json")
        with open(man, "r+b") as f:
            f.seek(5)
            f.write(b"\x00")
        rows = nonstop.list(d)
        bad = [r for r in rows if r["where"] == "manifest"]
        assert len(bad) == 1 and bad[0]["state"] == "damaged", rows
        assert "crc32c mismatch" in bad[0]["reason"] and "manifest-rank-00000.json" in bad[0]["reason"]
        assert [r["step"] for r in rows if r["where"] == "ring"] == [2, 1, 0]
        assert all("remote" not in _tiers(r) for r in rows)
        if cli is not None:
            r = subprocess.run([cli, "ls", d], capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and "crc32c mismatch" in r.stderr, (r.stdout, r.stderr)
            assert r.stderr.count("\n") == 1
            assert " manifest " in r.stdout and "damaged" in r.stdout
    finally:
        if rep is not None:
            rep.close()
        srv.close()
        ck.close()
