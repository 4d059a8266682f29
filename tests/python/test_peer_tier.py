"""The peer tier (issue #27) across hosts: 4 ranks on 2 hosts (network
namespaces, tests/python/netns_hosts.py; ranks 0, 1 on host 0, ranks 2, 3
on host 1), a tiny DDP job with replicas=1 (each rank's partner on the
other host). Every rank waits until its memory segment holds its newest
commit and its partner's server holds the replica of it, then all ranks
SIGKILL themselves (a node loss takes the job down); host 1 is lost (its
disk and memory directories wiped) and a replacement host 1 starts empty.

- The replacement's ranks restore from their partners' memory (verified
  replicas), the survivors from their own memory segments: every rank the
  same step, and the run ends bitwise equal to an uninterrupted one.
- With the replicas on host 0 corrupted (a byte flipped), the fetch fails
  its checksum, the restart falls back to the remote tier (a shared path
  here; its newest committed step, which follows the agreement and may be
  older than the replicas') on every rank and says so, and the run ends
  bitwise equal too.

Needs root for the namespaces (skipped with one line otherwise). Every rank
runs under a hard timeout (netns_hosts.wait_ranks)."""
import os
import shutil
import time

import pytest
import torch

import netns_hosts
from conftest import needs_engine
import nonstop
from nonstop import _remote

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "dist_train.py")
PLACE = [0, 0, 1, 1]             # rank -> host
STEPS, EVERY, SETTLE = 12, 3, 8  # checkpoints after steps 2, 5, 8, 11; all killed after 8's
TIMEOUT = 120

pytestmark = [needs_engine, pytest.mark.timeout(400),
              pytest.mark.skipif(not torch.distributed.is_available(),
                                 reason="no torch.distributed"),
              pytest.mark.skipif(nonstop._core is None or not hasattr(nonstop._core, "PeerServer"),
                                 reason="this build of nonstop._core has no peer tier")]


@pytest.fixture
def hs(tmp_path):
    with netns_hosts.hosts(2, tmp_path / "hosts") as h:
        yield h


def _start(hs, job, out, *extra):
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    return netns_hosts.start_ranks(
        hs, PLACE, lambda r: [TRAIN, os.path.join(hs[PLACE[r]].disk, job), str(STEPS),
                              str(EVERY), "ddp", out, "--tier", "memory", "--grad-sync",
                              "ddp-fixed", "--replicas", "1", *extra],
        f"{out}.log", env=env)


def _run(hs, job, out, *extra):
    netns_hosts.wait_ranks(_start(hs, job, out, *extra), TIMEOUT, f"{out}.log")


def _killed_once_settled(hs, job, out, *extra):
    """Runs until every rank's newest commit (step SETTLE) is in its memory
    segment and its partner's replica (and the remote, when given), then
    every rank SIGKILLs itself."""
    procs = _start(hs, job, out, "--settle-kill-at", str(SETTLE), *extra)
    deadline = time.monotonic() + TIMEOUT
    try:
        for rank, p in enumerate(procs):
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == -9, f"rank {rank} exited {rc}: " \
                f"{netns_hosts.read_log(f'{out}.log-{rank}')[-3000:]}"
    finally:
        hs.kill_all()
    assert len(netns_hosts.events(out, "settled", len(PLACE))) == len(PLACE)


def _replicas(hs, job, ranks):
    """The replica files host 0 holds of `ranks` of `job` (its job is named by
    rank 0's job directory)."""
    job = os.path.abspath(os.path.join(hs[0].disk, job))
    return [p for p in (os.path.join(hs[0].shm, nonstop._core.peer_replica_name(job, 4, r))
                        for r in ranks) if os.path.exists(p)]


def _flip_a_data_byte(path, rank, scratch):
    """Changes one byte inside the largest tensor's data of the replica at
    `path` (its header, table and commit record intact: it still lists as
    complete, and only the fetch's chunk checksums can find it)."""
    os.makedirs(scratch)
    shutil.copyfile(path, scratch / f"rank-{rank:05d}.nsck")  # read where the Reader looks
    info = nonstop._core.Reader(str(scratch), rank, verify_data=False).checkpoints[0]
    t = max(info["tensors"], key=lambda t: t["nbytes"])
    at = info["data_offset"] + t["data_offset"] + t["nbytes"] // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))


def _snapshot(hs, shared, to):
    """Copies what survives the loss of host 1 (host 0's disk and memory
    directories, the remote tier's shared path) to `to`."""
    for name, src in (("disk", hs[0].disk), ("shm", hs[0].shm), ("shared", shared)):
        shutil.copytree(src, os.path.join(to, name), symlinks=True)


def _back_to(hs, shared, snap):
    """Host 0 and the remote as they were at the loss; host 1 lost again."""
    hs[1].lose()
    for name, dst in (("disk", hs[0].disk), ("shm", hs[0].shm), ("shared", shared)):
        shutil.rmtree(dst)
        shutil.copytree(os.path.join(snap, name), dst, symlinks=True)


def test_host_lost_restores_from_partner_memory_or_falls_back(hs, tmp_path):
    ref = str(tmp_path / "ref")
    _run(hs, "ref", ref)
    want = netns_hosts.finals(ref, len(PLACE))
    ref_starts = netns_hosts.events(ref, "start", len(PLACE))
    assert all(e["peer"]["peer_replicas"] == 1 for e in ref_starts), ref_starts

    # Host 1 is lost once every replica holds step SETTLE (and the remote
    # tier, a shared path here, some committed step); the replacement
    # restores ranks 2, 3 from host 0's replicas.
    shared = str(tmp_path / "shared")
    _killed_once_settled(hs, "job", str(tmp_path / "run"), "--remote", shared)
    assert len(_replicas(hs, "job", [2, 3])) == 2, os.listdir(hs[0].shm)
    hs[1].lose()
    assert os.listdir(hs[1].disk) == [] and os.listdir(hs[1].shm) == []
    remote = nonstop._core.RemoteTier(_remote.open_store(shared, {}))
    remote_steps = [s for s, _ in remote.committed_steps()]
    assert remote_steps and max(remote_steps) <= SETTLE  # uploads follow the agreement
    snap = str(tmp_path / "at-the-loss")
    _snapshot(hs, shared, snap)
    out = str(tmp_path / "peer-resumed")
    _run(hs, "job", out)
    starts = netns_hosts.events(out, "start", len(PLACE))
    assert [s["restored"] for s in starts] == [SETTLE] * 4, starts
    assert [s["restored_from"] for s in starts] == ["memory", "memory", "peer", "peer"], starts
    assert all(s["restored_from_per_rank"] == ["memory", "memory", "peer", "peer"]
               for s in starts), starts
    assert netns_hosts.finals(out, len(PLACE)) == want
    # The replicas were fetched into host 1's memory directory, not its job
    # directories' disk, and removed there when the run closed.
    jobdir = os.path.join(hs[1].disk, "job")
    fetched = [s["peer"].get("peer_fetched_dir", "") for s in starts]
    assert [f.startswith(hs[1].shm + os.sep) for f in fetched] == [False, False, True, True], \
        fetched
    assert not os.path.exists(os.path.join(jobdir, "peer")), os.listdir(jobdir)
    assert not [n for n in os.listdir(hs[1].shm) if "-fetched-rank-" in n], os.listdir(hs[1].shm)

    # The same loss with host 0's replicas damaged (one byte of tensor
    # data): the fetch fails its checksum, says so, and every rank falls
    # back to the remote tier's copy of the same step.
    _back_to(hs, shared, snap)
    damaged = _replicas(hs, "job", [2, 3])
    assert len(damaged) == 2, os.listdir(hs[0].shm)
    for rank, path in zip([2, 3], damaged):
        _flip_a_data_byte(path, rank, tmp_path / f"look-{rank}")
    out = str(tmp_path / "bad-resumed")
    # (close() waits at most 10 s for the last upload: what is checked here is
    # the restore; the remote tier's own tests wait for its uploads.)
    _run(hs, "job", out, "--remote", shared, "--remote-close-s", "10")
    starts = netns_hosts.events(out, "start", len(PLACE))
    step = starts[0]["restored"]
    assert step in remote_steps and [s["restored"] for s in starts] == [step] * 4, starts
    assert all(s["restored_from_per_rank"] == ["remote"] * 4 for s in starts), starts
    for s in starts[2:]:
        assert "checksum" in s["peer"]["peer_unused_because"], s
        assert s["remote_restored_from"].endswith(f"step-{step:012d}"), s
    assert netns_hosts.finals(out, len(PLACE)) == want  # resumed from an older step, trained to the same end


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_a_bad_replicas_value_is_one_line(tmp_path, bad):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(nonstop.CheckpointMismatchError, match="replicas must be None or a "
                       "non-negative integer") as e:
        nonstop.Checkpointer(str(tmp_path / "job"), {"model": model}, every=1, replicas=bad)
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "job")  # refused before the directory is made


BAD_PEER = ([("peer_every", v, "peer_every must be an int >= 1") for v in (0, -1, 1.5, "2", True)]
            + [("peer_nice", v, "peer_nice must be an int from 0 to 19")
               for v in (-1, 20, 2.0, "5", "IDLE", True)]
            + [("peer_bps", v, "peer_bps must be 0") for v in (-1, 1.5, "1000000", True, 999_999, None)])


@pytest.mark.parametrize("key,bad,says", BAD_PEER)
def test_a_bad_peer_value_is_one_line(tmp_path, key, bad, says):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(nonstop.CheckpointMismatchError, match=says) as e:
        nonstop.Checkpointer(str(tmp_path / "job"), {"model": model}, every=1, **{key: bad})
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "job")  # refused before the directory is made


def test_peer_values_taken(tmp_path):
    model = torch.nn.Linear(2, 2)
    for i, (kw, want) in enumerate([
            ({"peer_every": 3}, {"peer_every": 3}),
            ({"peer_nice": "idle"}, {"peer_nice": nonstop._core.PEER_IDLE_NICE}),  # SCHED_IDLE
            ({"peer_bps": 10**8}, {"peer_bps": 10**8}),
            ({"peer_bps": "spread"}, {"peer_bps": "spread"}),  # over the commit interval
            ({}, {"peer_bps": 0, "peer_nice": 10})]):  # the defaults: unpaced, nice 10
        ck = nonstop.Checkpointer(str(tmp_path / f"ok{i}"), {"model": model}, every=1, **kw)
        assert {k: getattr(ck.options.dist, k) for k in want} == want
        ck.close()
    assert nonstop._core.PEER_IDLE_NICE == 20
