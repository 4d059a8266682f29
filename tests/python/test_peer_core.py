"""The peer tier's core from Python (issue #27; docs/TIERS.md "The peer
tier"): a real Checkpointer's memory segment replicated by the C++
replicator to a peer server over loopback TCP, listed, fetched back and read
bit for bit; a damaged replica and a missing one are the error classes a
restart falls back on; a client or server without the job's secret gets
nothing; the default budget. The multi-host wiring is test_peer_tier.py's."""
import os
import time

import pytest
import torch

import nonstop
from nonstop import _core, _peer
from nonstop.errors import (CheckpointIOError, CheckpointMismatchError,
                            CheckpointNotFoundError, CorruptCheckpointError)
from peer_loopback import loopback_server, memory_checkpointer

JOB = "job-peer-core"
SECRET = os.urandom(32)


def test_replicate_list_fetch_bitwise(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    ck = memory_checkpointer(tmp_path, {"model": model}, monkeypatch)
    srv, ep = loopback_server(tmp_path, JOB, SECRET)
    assert srv.endpoint == ep
    rep = None
    try:
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.step(step)
        ck.wait()
        seg = ck.stats()["memory_segment"]
        assert seg
        rep = _core.PeerReplicator(JOB, SECRET, 0, seg, [ep], poll_s=0.05)
        # The segment copy may lag, and drain() returns at once while the
        # segment holds nothing newer to push: wait on the clock, not on a
        # count of drains (a loaded box ran 100 of them in no time).
        deadline = time.monotonic() + 60
        while rep.stats()["last_step"] != 2 and time.monotonic() < deadline:
            rep.drain(5.0)
            time.sleep(0.05)
        st = rep.stats()
        assert st["last_step"] == 2, st
        assert st["replicated"] >= 1 and st["failures"] == 0, st
        held = srv.list()
        assert [(h["source_rank"], h["step"]) for h in held] == [(0, 2)]
        assert _core.peer_list(ep, JOB, SECRET) == held
        assert os.path.exists(tmp_path / "shm-peer" / _core.peer_replica_name(JOB, 1, 0))

        d = _core.peer_fetch(ep, JOB, SECRET, 0, 1, str(tmp_path / "local"))
        assert d == _core.peer_step_dir(str(tmp_path / "local"), 2)
        got = nonstop.load(d)
        assert torch.equal(got.tensors["model/weight"], model.weight.detach())
        assert torch.equal(got.tensors["model/bias"], model.bias.detach())
        assert srv.stats()["fetches_served"] == 1

        # Missing: another rank, another step, another job.
        with pytest.raises(CheckpointNotFoundError):
            _core.peer_fetch(ep, JOB, SECRET, 5, 8, str(tmp_path / "local"))
        with pytest.raises(CheckpointNotFoundError):
            _core.peer_fetch(ep, JOB, SECRET, 0, 1, str(tmp_path / "local"), step=1)
        with pytest.raises(nonstop.errors.IncompatibleCheckpointError):
            _core.peer_list(ep, "another-job", SECRET)
        # Without the job's secret: nothing listed, fetched or pushed.
        other = os.urandom(32)
        with pytest.raises(nonstop.errors.IncompatibleCheckpointError, match="authentication"):
            _core.peer_list(ep, JOB, other)
        with pytest.raises(nonstop.errors.IncompatibleCheckpointError, match="authentication"):
            _core.peer_fetch(ep, JOB, other, 0, 1, str(tmp_path / "stranger"))
        with pytest.raises(nonstop.errors.IncompatibleCheckpointError, match="authentication"):
            _core.peer_push(ep, JOB, other, seg)
        assert not os.path.exists(tmp_path / "stranger" / "peer")
        for _ in range(1000):  # the server counts them on its own threads
            if srv.stats()["auth_failures"] >= 4:
                break
            time.sleep(0.01)
        assert srv.stats()["auth_failures"] == 4  # the other job's list, then these 3
        assert srv.stats()["handshake_timeouts"] == 0  # every client above finished in time

        # A flipped byte in the held replica: refused at fetch, nothing written.
        path = tmp_path / "shm-peer" / _core.peer_replica_name(JOB, 1, 0)
        blob = bytearray(path.read_bytes())
        at = blob.find(model.weight.detach().numpy().tobytes()[:256])
        assert at > 0
        blob[at + 7] ^= 0xFF
        path.write_bytes(bytes(blob))
        with pytest.raises(CorruptCheckpointError):
            _core.peer_fetch(ep, JOB, SECRET, 0, 1, str(tmp_path / "other"))
        assert not os.path.exists(tmp_path / "other" / "peer" / "step-2" / "rank-00000.nsck")
    finally:
        if rep is not None:
            rep.close()
        srv.close()
        ck.close()
    # Closed: unreachable is an I/O error, fast.
    with pytest.raises(CheckpointIOError):
        _core.peer_list(ep, JOB, SECRET, timeout_s=2.0)


def test_a_paced_push_keeps_the_bytes_and_says_its_age(tmp_path, monkeypatch):
    # bps= (peer_bps): the push's connection paced by the kernel; the replica
    # is the same bytes, it takes about its bytes / bps, and the stats say how
    # old the checkpoint was when its partner held it (peer_lag_s).
    torch.manual_seed(1)
    model = torch.nn.Linear(256, 256)  # 257 KiB of data
    ck = memory_checkpointer(tmp_path, {"model": model}, monkeypatch)
    srv, ep = loopback_server(tmp_path, JOB, SECRET)
    rep = None
    try:
        ck.step(0)
        ck.wait()
        seg = ck.stats()["memory_segment"]
        deadline = time.monotonic() + 60  # the segment copy may lag the commit: on the clock
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        t0 = time.monotonic()
        rep = _core.PeerReplicator(JOB, SECRET, 0, seg, [ep], poll_s=0.05, bps=nbytes)
        while rep.stats()["last_step"] != 0 and time.monotonic() < deadline:
            rep.drain(5.0)
            time.sleep(0.05)
        secs = time.monotonic() - t0
        st = rep.stats()
        assert st["last_step"] == 0 and st["failures"] == 0, st
        assert st["bytes"] >= nbytes
        assert secs >= 0.6, secs  # paced: most of the second its bytes take at bps
        assert st["lag_s_last"] >= 0.6 and st["lag_s_max"] == st["lag_s_last"], st
        got = nonstop.load(_core.peer_fetch(ep, JOB, SECRET, 0, 1, str(tmp_path / "local")))
        assert torch.equal(got.tensors["model/weight"], model.weight.detach())
        assert torch.equal(got.tensors["model/bias"], model.bias.detach())
    finally:
        if rep is not None:
            rep.close()
        srv.close()
        ck.close()
    with pytest.raises(TypeError):  # bytes a second: an int >= 0 (the option's check is check_peer_option)
        _core.PeerReplicator(JOB, SECRET, 0, seg, [ep], bps=-1)


def test_arguments_and_partners():
    with pytest.raises(CheckpointMismatchError):
        _core.peer_list("no-port", JOB, SECRET)
    with pytest.raises(CheckpointMismatchError):
        _core.PeerServer("", SECRET)
    with pytest.raises(CheckpointMismatchError):  # a secret of 8 bytes
        _core.PeerServer(JOB, b"12345678")
    with pytest.raises(TypeError):  # bytes only
        _core.PeerServer(JOB, "a str is not a secret, bytes are")
    assert _core.choose_partners(["a", "a", "b", "b"], 1) == [[2], [3], [0], [1]]
    assert _core.choose_partners(["a", "a"], 1) == [[], []]


def test_default_budget_is_a_share_of_free_space(tmp_path):
    d = tmp_path / "shm-peer"
    srv = _core.PeerServer(JOB, SECRET, bind_host="127.0.0.1", dir=str(d), budget_share=4)
    try:
        st = os.statvfs(d)
        free = st.f_bavail * st.f_frsize
        got = srv.stats()["budget_bytes"]
        assert 0.8 * free / 8 < got < 1.2 * free / 8, (got, free)
    finally:
        srv.close()
    srv = _core.PeerServer(JOB, SECRET, bind_host="127.0.0.1", dir=str(d), budget_bytes=1 << 20)
    try:
        assert srv.stats()["budget_bytes"] == 1 << 20
    finally:
        srv.close()
    srv = _core.PeerServer(JOB, SECRET, bind_host="127.0.0.1", dir=str(d))
    try:
        assert srv.stats()["budget_bytes"] == 0  # none
    finally:
        srv.close()


def test_the_secret_is_agreed(monkeypatch):
    """The secret's checks and agreement are C++'s (tier/peer_options.h): the
    bindings _peer calls, as the ranks' first exchange feeds them."""
    monkeypatch.delenv("NONSTOP_PEER_SECRET", raising=False)
    assert _core.peer_env_secret() is None
    made = os.urandom(32)
    # Nobody set it: rank 0's 32 bytes.
    assert _core.peer_agree_secret(["", ""], made.hex(), b"") == made
    monkeypatch.setenv("NONSTOP_PEER_SECRET", "ab" * 32)
    mine = _core.peer_env_secret()
    assert mine == b"\xab" * 32
    fp = _core.peer_secret_fingerprint(mine)
    assert mine.hex() not in fp
    assert _core.peer_agree_secret([fp, fp], "", mine) == mine
    with pytest.raises(CheckpointMismatchError, match="differs"):
        _core.peer_agree_secret([fp, _core.peer_secret_fingerprint(b"x" * 32)], "", mine)
    with pytest.raises(CheckpointMismatchError, match="only"):
        _core.peer_agree_secret([fp, ""], "", mine)
    for bad in ("zz" * 32, "ab" * 8):
        monkeypatch.setenv("NONSTOP_PEER_SECRET", bad)
        with pytest.raises(CheckpointMismatchError):
            _core.peer_env_secret()
    with pytest.raises(CheckpointMismatchError):
        _core.check_peer_option("peer_budget_bytes", -1)
    assert _core.check_peer_option("peer_budget_bytes", None) is None
    assert _core.check_peer_option("peer_budget_bytes", 0) == 0


def _rank_on_host_a(rank: int, ep: str, held: dict):
    """Rank `rank`'s Peers (of 3 ranks: 0 and 1 on host "a", 2 on host "b",
    whose server at `ep` holds `held`, a replica of another world size), as
    its construction leaves it, without a server or replicator of its own."""
    p = _peer.Peers.__new__(_peer.Peers)
    p.rank, p.world, p.job, p.hosts = rank, 3, JOB, ["a", "a", "b"]
    p.local, p.other = [], [(2, dict(held, kind="replica"))]
    p.endpoints, p._secret = ["", "", ep], SECRET
    p.server = p.replicator = p.prefetched = p._lease = None
    p.reshard_files = []
    return p


def test_a_hosts_shared_reshard_copy_stays_until_its_last_rank_is_done(tmp_path, monkeypatch):
    """Two ranks of one host reshard from one copy fetched once for the host
    (FetchOncePerHost): the rank done first (its reshard read it, or failed
    on that rank alone: _distributed._reshard's finally) must not remove the
    copy the other still reads; the last one removes it."""
    ck = nonstop.Checkpointer(str(tmp_path / "old"), {"w": torch.arange(1000.0)}, every=1,
                              tier="disk")
    ck.step(4)
    ck.wait()
    ck.close()
    srv, ep = loopback_server(tmp_path, JOB, SECRET)
    try:
        assert _core.peer_push(ep, JOB, SECRET, str(tmp_path / "old" / "rank-00000.nsck")) == "stored"
        (held,) = srv.list()
        assert (held["world_size"], held["source_rank"], held["step"]) == (1, 0, 4)
        monkeypatch.setenv("NONSTOP_SHM_DIR", str(tmp_path / "shm-host"))
        a, b = _rank_on_host_a(0, ep, held), _rank_on_host_a(1, ep, held)
        (tmp_path / "new").mkdir()
        for p in (a, b):
            p.gather_old_shards(str(tmp_path / "new"))
            assert p.reshard_missing == "", p.reshard_missing
        shared = tmp_path / "shm-host" / _core.peer_shared_reshard_dir(JOB)
        (_, _, path), = b.reshard_files
        assert a.reshard_files == b.reshard_files and path.startswith(str(shared) + "/")
        shares = [p.reshard_stats["peer_reshard_shared"] for p in (a, b)]
        assert shares == [0, 1]  # fetched once, by rank 0
        assert srv.stats()["fetches_served"] == 1
        a.drop_reshard()  # rank 0 done first: rank 1 still reads the copy
        _core.peer_verify_local(path, 0, 4)
        assert nonstop.load(os.path.dirname(path)).tensors["w"].equal(torch.arange(1000.0))
        b.close()  # the last one: the host's copies go
        assert not shared.exists()
        a.close()
    finally:
        srv.close()
