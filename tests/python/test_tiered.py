"""The tiered cadence (disk_every=, docs/PYTHON.md): every checkpoint commits
to the memory tier at the training cadence and every N-th reaches the disk.
A SIGKILL (the process dies, the node lives) restores the newest memory
checkpoint bit for bit; with the segment directory wiped (the node is lost)
the newest disk checkpoint; the stats say which tiers hold each step."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import nonstop
from conftest import nonstop_cli
from nonstop.errors import CheckpointMismatchError

CHILD = textwrap.dedent("""
    import json, signal, sys, time, torch, nonstop
    signal.alarm(120)  # hard limit for the child
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ckpt = nonstop.Checkpointer(sys.argv[1], {"model": model}, every=1, tier="memory",
                                disk_every=3)
    for step in range(1, 8):
        with torch.no_grad():
            model.weight.copy_(torch.randn(64, 64, generator=torch.Generator().manual_seed(step)))
            model.bias.fill_(float(step))
        ckpt.save(step)
        ckpt.wait()
        # Memory commits #3 and #6 (steps 3 and 6) go to disk: each waited
        # for (a commit offered while the disk is busy would replace it).
        while step % 3 == 0 and ckpt.stats()["persisted_counter"] < step:
            time.sleep(0.005)  # the alarm bounds it
    s = ckpt.stats()
    print(json.dumps({"latest": s["latest"], "tiers": [r["tiers"] for r in s["recent"]],
                      "persisted": s["persisted"], "disk_every": s["disk_every"]}), flush=True)
    while True:
        time.sleep(1)  # killed here
""")


def _weights(step):
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(step))


def _killed_job(d):
    """Runs the child to step 7 and SIGKILLs it; returns what it printed."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, d], stdout=subprocess.PIPE,
                         env=dict(os.environ))
    try:
        line = p.stdout.readline()  # the child's alarm bounds this
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    assert line, "the child printed nothing"
    return json.loads(line)


def _restore(d):
    model = torch.nn.Linear(64, 64)
    with nonstop.Checkpointer(d, {"model": model}, every=1, tier="memory", disk_every=3) as ckpt:
        step = ckpt.restore()
        source = ckpt.stats()["restored_from"]
    return step, source, model


def test_stats_say_which_tiers_hold_each_step(tmp_path, monkeypatch):
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(tmp_path / "shm"))
    out = _killed_job(str(tmp_path / "job"))
    assert out["disk_every"] == 3
    assert out["persisted"] == 2
    assert out["tiers"] == ["memory", "memory", "memory+disk", "memory", "memory",
                            "memory+disk", "memory"]
    assert out["latest"] == {"counter": 7, "step": 7, "on_disk": False, "tiers": "memory"}


def test_sigkill_restores_the_newest_memory_step_bitwise(tmp_path, monkeypatch):
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(tmp_path / "shm"))
    d = str(tmp_path / "job")
    _killed_job(d)
    assert nonstop.load(d).step == 6  # the disk's newest: step 7 was never reported there
    cli = nonstop_cli()
    if cli is not None:  # `nonstop ls` names the memory-only one as such
        r = subprocess.run([cli, "ls", d, "--json"], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ))
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)
        assert [(x["step"], x["where"]) for x in rows[:2]] == [(7, "memory"), (6, "ring")]
    step, source, model = _restore(d)
    assert (step, source) == (7, "memory")
    assert torch.equal(model.weight, _weights(7))
    assert torch.all(model.bias == 7.0)


def test_a_lost_node_restores_the_newest_disk_step(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(shm))
    d = str(tmp_path / "job")
    _killed_job(d)
    shutil.rmtree(shm)  # the node's memory is gone
    step, source, model = _restore(d)
    assert (step, source) == (6, "disk")
    assert torch.equal(model.weight, _weights(6))


def test_a_clean_close_persists_the_newest(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(shm))
    d = str(tmp_path / "job")
    model = torch.nn.Linear(4, 4)
    with nonstop.Checkpointer(d, {"model": model}, every=1, tier="memory",
                              disk_every="auto") as ckpt:
        for step in range(1, 5):
            ckpt.save(step)
    assert nonstop.load(d).step == 4


@pytest.mark.parametrize("kw", [dict(disk_every=-1), dict(disk_every="x"),
                                dict(disk_every=2, tier="disk"),
                                dict(disk_every=2, mode="multistep")])
def test_bad_disk_every_is_refused(tmp_path, kw):
    with pytest.raises(CheckpointMismatchError):
        nonstop.Checkpointer(str(tmp_path / "job"), {"model": torch.nn.Linear(2, 2)}, **kw)
