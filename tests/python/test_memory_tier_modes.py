"""The memory tier (issue #19) in distributed and multistep mode: a job
killed once every rank's segment holds its newest commit restarts from
memory on every rank and trains on bit-identically; when one rank's segment
cannot be used, every rank reads its disk (never a mix) and resumes the same
step. Every child runs under a hard timeout (dist_launch.run_ranks,
crash_harness.run_child); the kills happen at a point the children report,
never by chance."""
import glob
import os
import shutil
import sys

import pytest
import torch

from conftest import needs_engine

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import crash_harness as ch  # noqa: E402
import nonstop  # noqa: E402
from dist_launch import run_ranks  # noqa: E402

STEPS, EVERY, SETTLE = 12, 3, 8  # checkpoints after steps 2, 5, 8, 11; killed after 8's
TIMEOUT = 150


def _launch(d, out, shm, *extra):
    # The ranks find tests/python (memwait) themselves; CI's PYTHONPATH lacks it.
    env = {"NONSTOP_SHM_DIR": shm,
           "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    return run_ranks(2, [os.path.join(HERE, "dist_train.py"), d, str(STEPS), str(EVERY), "ddp",
                         out, "--tier", "memory", *extra], timeout=TIMEOUT, env=env)


def _ok(res):
    for rank, (rc, _, err) in enumerate(res):
        assert rc == 0, f"rank {rank} exited {rc}: {err[-2000:]}"


def _start(res):
    return [next(l for l in lines if l["event"] == "start") for _, lines, _ in res]


def _finals(out):
    import json
    got = []
    for r in range(2):
        with open(f"{out}.rank-{r}.json") as f:
            got.append(json.load(f))
    return [[g[k] for k in ("params", "buffers", "optim", "rng", "samples", "lr")] for g in got]


def _killed_once_settled(tmp_path, name):
    d, out, shm = (str(tmp_path / f"{name}-ckpt"), str(tmp_path / f"{name}-run"),
                   str(tmp_path / f"{name}-shm"))
    killed = _launch(d, out, shm, "--settle-kill-at", str(SETTLE))
    for rank, (rc, lines, err) in enumerate(killed):
        assert rc == -9, f"rank {rank} exited {rc}: {err[-2000:]}"
    # Killed by the launcher when the other rank went first, or by itself.
    assert any(l["event"] == "settled" for _, lines, _ in killed for l in lines)
    return d, out, shm


@needs_engine
@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_two_ranks_killed_restart_from_memory_or_all_from_disk(tmp_path):
    ref = str(tmp_path / "ref")
    _ok(_launch(str(tmp_path / "ref-ckpt"), ref, str(tmp_path / "ref-shm")))
    want = _finals(ref)

    # Both segments hold step 8, the newest step committed on every rank.
    d, out, shm = _killed_once_settled(tmp_path, "mem")
    assert len(glob.glob(os.path.join(shm, "*-rank-0000[01].nsck"))) == 2
    # What the kill left (disk and memory), for the second case: one killed
    # job serves both restarts.
    snap = tmp_path / "at-the-kill"
    for name, src in (("disk", d), ("shm", shm)):
        shutil.copytree(src, snap / name, symlinks=True)
    resumed = _launch(d, out, shm)
    _ok(resumed)
    starts = _start(resumed)
    assert [s["restored"] for s in starts] == [SETTLE, SETTLE]
    assert [s["restored_from"] for s in starts] == ["memory", "memory"], starts
    # replicas= by default: both ranks on one host, so no partner (the peer tier says why)
    assert all(s["peer"]["peer_replicas"] == 0 and "one host" in s["peer"]["peer_note"]
               for s in starts), starts
    assert _finals(out) == want

    # The same kill, then rank 1's segment is gone: both ranks read their
    # disk, the same step.
    for name, dst in (("disk", d), ("shm", shm)):
        shutil.rmtree(dst)
        shutil.copytree(snap / name, dst, symlinks=True)
    out = str(tmp_path / "gone-run")
    (seg,) = glob.glob(os.path.join(shm, "*-rank-00001.nsck"))
    os.unlink(seg)
    resumed = _launch(d, out, shm)
    _ok(resumed)
    starts = _start(resumed)
    assert [s["restored"] for s in starts] == [SETTLE, SETTLE]
    assert [s["restored_from"] for s in starts] == ["disk", "disk"], starts
    for s in starts:
        assert s["memory_unused_because"].startswith("rank 1: "), s
    assert _finals(out) == want


KILL_STEPS, KILL_EVERY = 26, 5


@needs_engine
@pytest.mark.skipif(nonstop._core is None or not hasattr(nonstop._core, "Multistep"),
                    reason="this build of nonstop._core has no Multistep")
def test_multistep_killed_restarts_from_memory_bit_identically(tmp_path_factory, tmp_path):
    reference = ch.reference(tmp_path_factory, KILL_STEPS)
    d, final = str(tmp_path / "ck"), str(tmp_path / "final")
    options = {"mode": "multistep", "parts": 4, "medium": "buffered", "block_bytes": 4096,
               "tier": "memory"}
    env = {"NONSTOP_SHM_DIR": str(tmp_path / "shm")}
    # Checkpoints due after steps 4, 9 land at versions 7, 12 (the window of
    # the one due after 9 closes at step 13): killed after step 13 once the
    # segment holds version 12.
    ch.run(d, KILL_STEPS, KILL_EVERY, final, options=dict(options, settle_after=13), env=env,
           kills_itself=True)
    events = ch.run(d, KILL_STEPS, KILL_EVERY, final, options=options, env=env)
    assert events[0]["event"] == "start"
    assert events[0]["restored"] == 12
    assert events[0]["restored_from"] == "memory", events[0]
    ch.assert_same_final(reference, final)
