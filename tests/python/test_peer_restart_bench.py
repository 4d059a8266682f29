"""bench/peer_restart_bench.py's lean mode (issue #27 at 4 GB per rank):
the fetched copy verified through the C++ restore path without keeping the
tensors, the survivor's seed that drops its state, and the memory guard.
Small states, no network namespaces; no timing asserted."""
import os
import shutil
import sys

import pytest
import torch

import nonstop

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)

worker = pytest.importorskip("peer_restart_worker")
import peer_restart_bench as bench  # noqa: E402


def committed(tmp_path, n=3 << 16):
    d = str(tmp_path / "job")
    state = {"w": torch.arange(n, dtype=torch.float32), "b": torch.ones(7)}
    ck = nonstop.Checkpointer(d, state, every=1, tier="disk")
    ck.step(1)
    ck.close()
    return d, (n + 7) * 4


def test_verify_all_counts_every_byte_and_keeps_no_tensor(tmp_path):
    d, nbytes = committed(tmp_path)
    assert worker.verify_all(d) == nbytes == worker.load_all(d)


def test_verify_all_fails_on_a_damaged_chunk(tmp_path):
    d, nbytes = committed(tmp_path)
    f = os.path.join(d, "rank-00000.nsck")
    raw = bytearray(open(f, "rb").read())
    needle = torch.arange(3 << 16, dtype=torch.float32)[1000:1004].numpy().tobytes()
    at = raw.find(needle)
    assert at > 0
    raw[at] ^= 0xFF  # one byte of the tensor data: only its chunk's crc can tell
    with open(f, "r+b") as out:
        out.write(raw)
    with pytest.raises(Exception):
        worker.verify_all(d)


def test_lean_seed_drops_the_state_and_leaves_only_the_replicas(tmp_path, monkeypatch):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    os.makedirs(shm)
    os.makedirs(disk)
    monkeypatch.setenv("NONSTOP_SHM_DIR", shm)
    surv = worker.Survivor("127.0.0.1")
    remote = "file://" + str(tmp_path / "remote")
    got = surv.seed(bytes=4 << 20, url=remote, options=None, job="/bench/t", disk=disk, shm=shm,
                    lean=True)
    try:
        assert got["bytes"] == 4 << 20
        # In the memory directory: the memory replica only (no segment, no second link).
        assert sorted(os.listdir(shm)) == ["peer"]
        fetched = str(tmp_path / "fetched")
        for ep in (got["mem_ep"], got["disk_ep"]):
            os.makedirs(fetched)
            d = nonstop._core.peer_fetch(ep, "/bench/t", worker.SECRET, 0, 1, fetched)
            assert worker.verify_all(d) == 4 << 20
            shutil.rmtree(fetched)
        # The upload happened before the state was dropped.
        assert nonstop.load(remote).step == 1
    finally:
        surv.drop()
    assert sorted(os.listdir(shm)) == []


def test_the_memory_guard_refuses_in_one_line(monkeypatch):
    monkeypatch.setattr(bench, "mem_available", lambda: 8 << 30)
    full_mem, _ = bench.need_bytes([4.0], False)
    lean_mem, lean_shm = bench.need_bytes([1.0, 4.0], True)
    assert lean_mem < 13e9 < 20e9 < full_mem and lean_shm == 8e9
    why = bench.check_memory([4.0], True)
    assert why.startswith("peer_restart_bench: 4 GB per rank, lean, needs ") and "\n" not in why
    assert "MemAvailable is 8.0 GiB" in why
    assert "try --lean" in bench.check_memory([4.0], False)
    monkeypatch.setattr(bench, "mem_available", lambda: 64 << 30)
    assert bench.check_memory([0.001], True) == ""
