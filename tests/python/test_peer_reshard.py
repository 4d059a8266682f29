"""Resharding from peers' memory (issue #27) across hosts: 4 ranks on 2 hosts
(network namespaces, tests/python/netns_hosts.py; ranks 0, 1 on host 0,
ranks 2, 3 on host 1) train a tiny DDP job with replicas=1 and a remote
tier (a shared path) until every memory segment, every partner's replica
and the remote hold step SETTLE (or the first later checkpoint the ranks
agreed on, under load), then all SIGKILL themselves; host 1 is
lost (its disk and memory wiped). Each restart below starts from that loss
(host 0's disk and memory, and the remote, as they were) and is compared
bitwise with the same world-2 job resharded by the existing disk path from
a full directory (all four old rank files).

- World 2, new rank 1 on a replacement host that holds nothing: new rank 0
  reads old ranks 0, 1 from its disk and 2, 3 in place from host 0's
  memory directory (the replicas it holds); new rank 1 fetches old ranks
  0, 1 from host 0's segments and 2, 3 from its replicas into its own
  memory directory (tmpfs), gone once read; its job directory gets no
  copy of them.
- World 2 with both ranks on host 0 (no peer server starts: one host): the
  old ranks 2, 3 are read from host 0's replicas in place.
- After a graceful close (the state a clean close() leaves: each memory
  segment removed, MemoryTierWriter::Close(remove_segment), the disk
  holding its newest checkpoint, the partners' replicas kept), world 3
  with new ranks 1, 2 both on the replacement host: old ranks 0, 1 come
  from host 0's job directory rank files (served read-only by its peer
  servers), 2, 3 from its replicas, each fetched once for the host (one
  rank fetches, the other takes its copy, and the stats say who).
- Host 0's replica of old rank 2 damaged (a byte of tensor data): the
  restart with the remote tier takes old rank 2's part from the object
  store (every rank), and says so; without the remote tier no surviving
  copy of it is good and every rank raises one line that says so.

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


def _restart(hs, name, placement, tmp_path, snap, *extra, ok=True, before=None):
    """Host 0, its memory directory and the remote as at the loss, host 1
    lost again (then `before()`); world len(placement) started and waited
    for (ok=False: every rank must fail)."""
    hs[1].lose()
    for sub, dst in (("disk", hs[0].disk), ("shm", hs[0].shm), ("remote", str(tmp_path / "remote"))):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(os.path.join(snap, sub), dst, symlinks=True)
    if before is not None:
        before()
    out = str(tmp_path / name)
    job = lambda h: os.path.join(hs[h].disk, "job")  # noqa: E731
    procs = netns_hosts.start_ranks(hs, placement, _argv(lambda r: job(placement[r]), out,
                                                         "--replicas", "1", *extra),
                                    f"{out}.log", env=_env())
    if ok:
        netns_hosts.wait_ranks(procs, TIMEOUT, f"{out}.log")
        return out
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
    return out


def _sources(starts):
    """Per new rank: the first word of where each old rank's file came from
    (disk, own, peer, remote) and the kind."""
    return [[s["peer"]["peer_reshard_from"][f"4/{r}"].split(" (")[0].split(" on ")[0]
             for r in range(4)] for s in starts]


def test_restart_with_another_world_size_reshards_from_peers_memory(hs, tmp_path):
    job = lambda h: os.path.join(hs[h].disk, "job")  # noqa: E731
    env = _env()
    remote = str(tmp_path / "remote")
    # The world of 4 runs until every segment, replica and the remote hold step SETTLE.
    run = str(tmp_path / "run")
    procs = netns_hosts.start_ranks(
        hs, OLD, _argv(lambda r: job(OLD[r]), run, "--replicas", "1", "--remote", remote,
                       "--settle-remote-step", "--settle-kill-at", str(SETTLE)),
        f"{run}.log", env=env)
    deadline = time.monotonic() + TIMEOUT
    try:
        for rank, p in enumerate(procs):
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == -9, f"rank {rank} exited {rc}: " \
                f"{netns_hosts.read_log(f'{run}.log-{rank}')[-3000:]}"
    finally:
        hs.kill_all()
    settled = netns_hosts.events(run, "settled", 4)
    assert len(settled) == 4
    # SETTLE, or a later checkpoint when a loaded box left SETTLE unagreed
    # (dist_train.py agreed_everywhere): the step every copy holds.
    settle = settled[0]["step"]
    assert all(e["step"] == settle for e in settled) and settle >= SETTLE, settled
    full = str(tmp_path / "full")
    _full_copy(hs, full)
    full3 = str(tmp_path / "full3")  # the world-3 reference's (each reference writes its own)
    shutil.copytree(full, full3)

    # Host 1 is lost; what survives on host 0 (and the remote) is kept to start again from.
    hs[1].lose()
    snap = str(tmp_path / "at-the-loss")
    for name, src in (("disk", hs[0].disk), ("shm", hs[0].shm), ("remote", remote)):
        shutil.copytree(src, os.path.join(snap, name), symlinks=True)
    job_key = os.path.abspath(job(0))
    replicas = [os.path.join(hs[0].shm, nonstop._core.peer_replica_name(job_key, 4, r))
                for r in (2, 3)]
    assert all(os.path.exists(p) for p in replicas), os.listdir(hs[0].shm)

    # The reference: the same world-2 job resharded by the disk path from a
    # full directory (both ranks on host 0, no segments, no peers).
    ref = str(tmp_path / "ref")
    netns_hosts.wait_ranks(netns_hosts.start_ranks(
        hs, [0, 0], _argv(lambda r: full, ref, "--replicas", "0"), f"{ref}.log",
        env=_env(NONSTOP_SHM_DIR=str(tmp_path / "ref-shm"))), TIMEOUT, f"{ref}.log")
    assert [s["restored"] for s in netns_hosts.events(ref, "start", 2)] == [settle, settle]

    # The world of 2 reshards from host 0's memory; new rank 1 on the replacement host.
    out = _restart(hs, "peer", NEW, tmp_path, snap)
    starts = netns_hosts.events(out, "start", 2)
    assert [s["restored"] for s in starts] == [settle, settle], starts
    assert all(s["peer"].get("peer_reshard_missing") == "" for s in starts), starts
    assert _sources(starts) == [["disk", "disk", "own memory replica", "own memory replica"],
                                ["peer segment", "peer segment", "peer replica", "peer replica"]], \
        starts
    src = [s["peer"]["peer_reshard_from"] for s in starts]
    assert all(f"step {settle}" in v for v in src[1].values()), src
    # New rank 0 read host 0's replicas in place (nothing fetched); new rank 1
    # fetched into its host's memory directory, removed once read, and its
    # job directory holds no copy of an old rank.
    assert starts[0]["peer"]["peer_reshard_bytes"] == 0 and starts[0]["peer"]["peer_reshard_dir"] == ""
    assert starts[1]["peer"]["peer_reshard_bytes"] > 0
    fetched = starts[1]["peer"]["peer_reshard_dir"]
    assert os.path.dirname(fetched) == hs[1].shm and not os.path.exists(fetched), fetched
    assert not os.path.exists(os.path.join(job(1), "world-4")), os.listdir(job(1))
    print("reshard from peers' memory: " + ", ".join(
        f"rank {s['rank']}: {s['peer']['peer_reshard_bytes']} bytes in "
        f"{s['peer']['peer_reshard_s']:.3f} s" for s in starts))
    assert netns_hosts.finals(out, 2) == netns_hosts.finals(ref, 2)

    # A graceful close removed host 0's segments; world 3 with two new ranks on
    # the replacement host, compared with world 3 resharded from the full
    # directory.
    def closed():
        for _, name in nonstop._core.memory_segments(job(0), hs[0].shm):
            for n in (name, name + ".tmp", name[:-len(".nsck")] + ".lock"):
                if os.path.lexists(os.path.join(hs[0].shm, n)):
                    os.unlink(os.path.join(hs[0].shm, n))
        assert not nonstop._core.memory_segments(job(0), hs[0].shm)
    ref3 = str(tmp_path / "ref3")
    netns_hosts.wait_ranks(netns_hosts.start_ranks(
        hs, [0, 0, 0], _argv(lambda r: full3, ref3, "--replicas", "0"), f"{ref3}.log",
        env=_env(NONSTOP_SHM_DIR=str(tmp_path / "ref3-shm"))), TIMEOUT, f"{ref3}.log")
    grace = _restart(hs, "graceful", [0, 1, 1], tmp_path, snap, before=closed)
    assert [s["restored"] for s in netns_hosts.events(ref3, "start", 3)] == [settle] * 3
    starts = netns_hosts.events(grace, "start", 3)
    assert [s["restored"] for s in starts] == [settle] * 3, starts
    assert all(s["peer"].get("peer_reshard_missing") == "" for s in starts), starts
    assert _sources(starts) == [["disk", "disk", "own memory replica", "own memory replica"]] + \
        [["peer rank file", "peer rank file", "peer replica", "peer replica"]] * 2, starts
    # One fetch per host: each old rank's copy fetched by one of new ranks 1,
    # 2 and taken by the other, which says who fetched it.
    src = [s["peer"]["peer_reshard_from"] for s in starts[1:]]
    for r in range(4):
        by = [" fetched by rank " in v[f"4/{r}"] for v in src]
        assert sorted(by) == [False, True], src
    assert sum(s["peer"]["peer_reshard_shared"] for s in starts[1:]) == 4, starts
    assert starts[0]["peer"]["peer_reshard_shared"] == 0
    assert netns_hosts.finals(grace, 3) == netns_hosts.finals(ref3, 3)

    # Every new rank on host 0: no peer server starts (one host), and the old
    # ranks 2, 3 are read from host 0's memory directory.
    one = _restart(hs, "one-host", [0, 0], tmp_path, snap)
    starts = netns_hosts.events(one, "start", 2)
    assert [s["restored"] for s in starts] == [settle, settle], starts
    assert all("one host" in s["peer"]["peer_note"] for s in starts), starts
    assert _sources(starts) == [["disk", "disk", "own memory replica", "own memory replica"]] * 2, \
        starts
    assert netns_hosts.finals(one, 2) == netns_hosts.finals(ref, 2)

    # Host 0's replica of old rank 2 damaged: no surviving peer holds a good
    # copy; the remote tier does, and every rank takes old rank 2 from it.
    damage = lambda: _flip_a_data_byte(replicas[0], 2, str(tmp_path / f"look{time.time_ns()}"))  # noqa: E731
    rem = _restart(hs, "remote", NEW, tmp_path, snap, "--remote", remote, before=damage)
    starts = netns_hosts.events(rem, "start", 2)
    assert [s["restored"] for s in starts] == [settle, settle], starts
    assert all(s["peer"].get("peer_reshard_missing") == "" for s in starts), starts
    assert _sources(starts) == [["disk", "disk", "remote", "own memory replica"],
                                ["peer segment", "peer segment", "remote", "peer replica"]], starts
    assert netns_hosts.finals(rem, 2) == netns_hosts.finals(ref, 2)

    # The same without the remote tier: every rank says in one line that no
    # surviving copy of old rank 2 is good.
    bad = _restart(hs, "bad", NEW, tmp_path, snap, before=damage, ok=False)
    for r in range(2):
        log = netns_hosts.read_log(f"{bad}.log-{r}")
        # (torch prefixes a rank's traceback lines with "[rankN]: ")
        last = [ln.split("]: ", 1)[-1] for ln in log.splitlines()
                if ln.split("]: ", 1)[-1].startswith("nonstop.errors.")]
        assert last, log[-3000:]
        assert all(f"rank {n}: old rank 2 of world size 4" in last[-1] for n in (0, 1)) \
            and "checksum mismatch" in last[-1], \
            last[-1]
