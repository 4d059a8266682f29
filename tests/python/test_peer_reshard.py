"""Resharding from peers' memory (issue #27) across hosts: 4 ranks on 2 hosts
(network namespaces, tests/python/netns_hosts.py; ranks 0, 1 on host 0,
ranks 2, 3 on host 1) train a tiny DDP job with replicas=1 until every
memory segment and every partner's replica holds step SETTLE, then all
SIGKILL themselves; host 1 is lost (its disk and memory wiped). The job
restarts with world size 2: new rank 0 on host 0, new rank 1 on a
replacement host 1 that holds nothing.

- Each new rank gathers the old ranks' files its job directory lacks from
  the surviving server on host 0: old ranks 0, 1 from host 0's own memory
  segments (new rank 1), old ranks 2, 3 from host 0's replicas of them
  (both), and the existing reshard runs: every rank restores step SETTLE,
  and the run ends bitwise equal to the same world-2 job resharded by the
  existing disk path from a full directory (all four old rank files).
- With host 0's replica of old rank 2 damaged (a byte of tensor data), its
  fetch fails its checksum, no other server holds it, and the restart
  raises one line on every rank that says so.

Needs root for the namespaces (skipped with one line otherwise). Every rank
runs under a hard timeout."""
import os
import shutil
import subprocess
import time

import pytest
import torch

import netns_hosts
from conftest import needs_engine
import nonstop

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "dist_train.py")
OLD = [0, 0, 1, 1]   # rank -> host, the world of 4
NEW = [0, 1]         # the world of 2: rank 1 on the replacement host
STEPS, EVERY, SETTLE = 12, 3, 8
TIMEOUT = 120

pytestmark = [needs_engine, pytest.mark.timeout(500),
              pytest.mark.skipif(not torch.distributed.is_available(),
                                 reason="no torch.distributed"),
              pytest.mark.skipif(nonstop._core is None or
                                 not hasattr(nonstop._core, "peer_fetch_into"),
                                 reason="this build of nonstop._core has no peer reshard")]


@pytest.fixture
def hs(tmp_path):
    with netns_hosts.hosts(2, tmp_path / "hosts") as h:
        yield h


def _argv(dir_of, out, *extra):
    return lambda r: [TRAIN, dir_of(r), str(STEPS), str(EVERY), "ddp", out, "--tier", "memory",
                      "--grad-sync", "ddp-fixed", *extra]


def _env(**kw):
    return dict({"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}, **kw)


def _full_copy(hs, to):
    """One directory with all four old rank files (and their records), as a
    shared file system would hold them: what the existing disk reshard reads.
    The memory records stay behind (the reference run has no segments)."""
    os.makedirs(to)
    for h in (hs[0], hs[1]):
        src = os.path.join(h.disk, "job")
        for name in os.listdir(src):
            if name.startswith(".nonstop.memory-") or os.path.exists(os.path.join(to, name)):
                continue
            p = os.path.join(src, name)
            if os.path.isfile(p) and not os.path.islink(p):
                shutil.copyfile(p, os.path.join(to, name))


def _flip_a_data_byte(path, rank, scratch):
    """One byte inside the largest tensor's data of the replica at `path`
    (its table and commit record intact: only the chunk checksums find it)."""
    os.makedirs(scratch)
    shutil.copyfile(path, os.path.join(scratch, f"rank-{rank:05d}.nsck"))
    info = nonstop._core.Reader(str(scratch), rank, verify_data=False).checkpoints[0]
    t = max(info["tensors"], key=lambda t: t["nbytes"])
    at = info["data_offset"] + t["data_offset"] + t["nbytes"] // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))


def test_restart_with_another_world_size_reshards_from_peers_memory(hs, tmp_path):
    job = lambda h: os.path.join(hs[h].disk, "job")  # noqa: E731
    env = _env()
    # The world of 4 runs until every segment and replica holds step SETTLE.
    run = str(tmp_path / "run")
    procs = netns_hosts.start_ranks(
        hs, OLD, _argv(lambda r: job(OLD[r]), run, "--replicas", "1",
                       "--settle-kill-at", str(SETTLE)), f"{run}.log", env=env)
    deadline = time.monotonic() + TIMEOUT
    try:
        for rank, p in enumerate(procs):
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == -9, f"rank {rank} exited {rc}: " \
                f"{netns_hosts.read_log(f'{run}.log-{rank}')[-3000:]}"
    finally:
        hs.kill_all()
    assert len(netns_hosts.events(run, "settled", 4)) == 4
    full = str(tmp_path / "full")
    _full_copy(hs, full)

    # Host 1 is lost; what survives on host 0 is kept to start again from.
    hs[1].lose()
    snap = str(tmp_path / "at-the-loss")
    for name, src in (("disk", hs[0].disk), ("shm", hs[0].shm)):
        shutil.copytree(src, os.path.join(snap, name), symlinks=True)
    job_key = os.path.abspath(job(0))
    replicas = [os.path.join(hs[0].shm, nonstop._core.peer_replica_name(job_key, r))
                for r in (2, 3)]
    assert all(os.path.exists(p) for p in replicas), os.listdir(hs[0].shm)

    # The world of 2 reshards from host 0's memory.
    out = str(tmp_path / "peer")
    netns_hosts.wait_ranks(netns_hosts.start_ranks(
        hs, NEW, _argv(lambda r: job(NEW[r]), out, "--replicas", "1"), f"{out}.log", env=env),
        TIMEOUT, f"{out}.log")
    starts = netns_hosts.events(out, "start", 2)
    assert [s["restored"] for s in starts] == [SETTLE, SETTLE], starts
    src = [s["peer"].get("peer_reshard_from", {}) for s in starts]
    assert all(s["peer"].get("peer_reshard_missing") == "" for s in starts), starts
    # New rank 0 (host 0) read old ranks 0, 1 from its own disk, 2, 3 from the replicas.
    assert [src[0][f"4/{r}"].split(" on ")[0] for r in range(4)] == \
        ["disk", "disk", "peer replica", "peer replica"], src
    # New rank 1 (the replacement host) fetched all four: 0, 1 from host 0's segments.
    assert [src[1][f"4/{r}"].split(" on ")[0] for r in range(4)] == \
        ["peer segment", "peer segment", "peer replica", "peer replica"], src
    assert all(f"step {SETTLE}" in v for v in src[1].values()), src
    assert starts[1]["peer"]["peer_reshard_bytes"] > starts[0]["peer"]["peer_reshard_bytes"] > 0
    print("reshard from peers' memory: " + ", ".join(
        f"rank {s['rank']}: {s['peer']['peer_reshard_bytes']} bytes in "
        f"{s['peer']['peer_reshard_s']:.3f} s" for s in starts))

    # The reference: the same world-2 job resharded by the disk path from a
    # full directory (both ranks on host 0, no segments, no peers).
    ref = str(tmp_path / "ref")
    netns_hosts.wait_ranks(netns_hosts.start_ranks(
        hs, [0, 0], _argv(lambda r: full, ref, "--replicas", "0"), f"{ref}.log",
        env=_env(NONSTOP_SHM_DIR=str(tmp_path / "ref-shm"))), TIMEOUT, f"{ref}.log")
    assert [s["restored"] for s in netns_hosts.events(ref, "start", 2)] == [SETTLE, SETTLE]
    assert netns_hosts.finals(out, 2) == netns_hosts.finals(ref, 2)

    # Again from the loss, with host 0's replica of old rank 2 damaged: no
    # surviving server holds a good copy of it; every rank says so in one line.
    hs[1].lose()
    for name, dst in (("disk", hs[0].disk), ("shm", hs[0].shm)):
        shutil.rmtree(dst)
        shutil.copytree(os.path.join(snap, name), dst, symlinks=True)
    _flip_a_data_byte(replicas[0], 2, str(tmp_path / "look"))
    bad = str(tmp_path / "bad")
    procs = netns_hosts.start_ranks(
        hs, NEW, _argv(lambda r: job(NEW[r]), bad, "--replicas", "1"), f"{bad}.log", env=env)
    deadline = time.monotonic() + TIMEOUT
    try:
        for rank, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            assert rc not in (0, None), f"rank {rank}: {rc}"
    finally:
        hs.kill_all()
    for r in range(2):
        log = netns_hosts.read_log(f"{bad}.log-{r}")
        # (torch prefixes a rank's traceback lines with "[rankN]: ")
        last = [ln.split("]: ", 1)[-1] for ln in log.splitlines()
                if ln.split("]: ", 1)[-1].startswith("nonstop.errors.")]
        assert last, log[-3000:]
        assert all(f"rank {n}: old rank 2 of world size 4" in last[-1] for n in (0, 1)) \
            and "checksum mismatch" in last[-1], \
            last[-1]
