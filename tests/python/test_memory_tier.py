"""The memory tier from Python (issue #19): restore() reads the shared-memory
segment only when it holds exactly the newest committed checkpoint on disk;
a kill at any point, a stale segment or tier="disk" read the disk."""
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import torch

import nonstop
from memwait import wait_mirrored

CHILD = textwrap.dedent("""
    import signal, sys, time, torch, nonstop
    signal.alarm(120)  # hard limit for the child
    model = torch.nn.Linear(256, 256)
    tier, settle = sys.argv[2], sys.argv[3] == "settle"
    ckpt = nonstop.Checkpointer(sys.argv[1], {"model": model}, every=1, tier=tier)
    print("ready", flush=True)
    step = 0
    while True:
        with torch.no_grad():
            model.weight.fill_(float(step))
            model.bias.fill_(float(step))
        ckpt.step(step)
        step += 1
        if not settle and step == 1:  # the kill lands after a commit, never before any
            ckpt.wait()
            print("committed", flush=True)
        if settle and step >= 3:
            # Once the segment holds the newest commit, say so and wait to be
            # killed. "auto" may skip a commit (a copy running, its time
            # share spent): then the next step's commit is offered.
            ckpt.wait()
            while True:  # until the tier has copied or skipped every commit
                s = ckpt.stats()
                if s["memory_mirrored"] + s["memory_skipped"] + s["memory_failures"] >= \
                        s["committed"]:
                    break
                time.sleep(0.005)  # polls; the alarm bounds it
            if s["memory_counter"] == s["committed"]:
                print("mirrored", flush=True)
                while True:
                    time.sleep(1)
        time.sleep(0.05)  # training between checkpoints
""")


def _spawn(d, tier, settle):
    return subprocess.Popen([sys.executable, "-c", CHILD, d, tier,
                             "settle" if settle else "loop"],
                            stdout=subprocess.PIPE, env=dict(os.environ))


def _restore_newest(d, tier):
    newest = nonstop.load(d).step  # the disk's newest committed checkpoint
    model = _model()
    with nonstop.Checkpointer(d, {"model": model}, every=1, tier=tier) as ckpt:
        assert ckpt.restore() == newest
        source = ckpt.stats()["restored_from"]
        assert torch.all(model.weight == float(newest))
        assert torch.all(model.bias == float(newest))
    return newest, source


def _model():
    return torch.nn.Linear(256, 256)


def _save_mirrored(ckpt, step):
    """Saves `step` and waits until it is committed and in the segment;
    returns the segment's path."""
    ckpt.save(step)
    return wait_mirrored(ckpt)["memory_segment"]


def _job_with_segment(d, value, step):
    """A Checkpointer (tier="memory") of a Linear filled with `value` whose
    checkpoint of `step` is committed and in the segment: (ckpt, segment)."""
    model = _model()
    ckpt = nonstop.Checkpointer(d, {"model": model}, every=1, tier="memory")
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return ckpt, model, _save_mirrored(ckpt, step)


def test_kill_at_random_points_restores_the_newest_committed(tmp_path, monkeypatch):
    # Where a random kill lands is luck: this asserts only that the restart
    # gets the disk's newest committed checkpoint, from either source.
    shm = tmp_path / "shm"
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(shm))
    rng = random.Random(19)
    for round_, tier in enumerate(("memory", "auto")):
        d = str(tmp_path / f"job{round_}")
        p = _spawn(d, tier, settle=False)
        try:
            assert p.stdout.readline().strip() == b"ready"
            assert p.stdout.readline().strip() == b"committed"  # the child's alarm bounds this
            time.sleep(0.3 + rng.random() * 0.5)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        _, source = _restore_newest(d, tier)
        assert source in ("memory", "disk")


def test_kill_once_the_segment_is_complete_restores_from_memory(tmp_path, monkeypatch):
    # The child kills nothing by chance: it reports when the segment holds its
    # newest commit and then only waits, so the restart must read memory.
    shm = tmp_path / "shm"
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(shm))
    for tier in ("memory", "auto"):
        d = str(tmp_path / f"job-{tier}")
        p = _spawn(d, tier, settle=True)
        try:
            assert p.stdout.readline().strip() == b"ready"
            assert p.stdout.readline().strip() == b"mirrored"  # the child's alarm bounds this
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        _, source = _restore_newest(d, tier)
        assert source == "memory", tier


def test_stale_segment_and_tier_disk_read_the_disk(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(shm))
    d = str(tmp_path / "job")
    ckpt, model, seg = _job_with_segment(d, 1.0, 1)
    assert seg.startswith(str(shm))
    shutil.copy(seg, str(tmp_path / "aside"))  # the segment of step 1
    with torch.no_grad():
        model.weight.fill_(2.0)
    _save_mirrored(ckpt, 2)
    ckpt.close()
    assert not os.path.exists(seg)  # a clean close gives the memory back
    shutil.copy(str(tmp_path / "aside"), seg)  # stale: older than the disk
    model = _model()
    with nonstop.Checkpointer(d, {"model": model}, every=1) as ckpt:
        assert ckpt.restore() == 2
        s = ckpt.stats()
        assert s["restored_from"] == "disk"
        assert "disk's newest" in s["memory_unused_because"], s["memory_unused_because"]
        assert torch.all(model.weight == 2.0)
    # tier="disk" writes no segment and never reads one.
    d2 = str(tmp_path / "job2")
    model = _model()
    with nonstop.Checkpointer(d2, {"model": model}, every=1, tier="disk") as ckpt:
        ckpt.save(0)
        ckpt.wait()
        assert ckpt.stats()["memory_segment"] == ""
        assert ckpt.stats()["memory_tier"] == "disk"
    assert not any(n.endswith(".nsck") for n in os.listdir(shm)) if shm.exists() else True


def test_restore_from_memory_goes_through_the_cpp_restore_path(tmp_path, monkeypatch):
    """restore() from the memory tier reads the segment with the C++ restore
    path (ReadCheckpointInto, through Reader.read_into) into the live
    tensors, and says how much it read; it was tensor by tensor before."""
    shm = tmp_path / "shm"
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(shm))
    d = str(tmp_path / "job")
    model = torch.nn.Sequential(*[torch.nn.LayerNorm(64) for _ in range(200)])
    ckpt = nonstop.Checkpointer(d, {"model": model}, every=1, tier="memory")
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(float(i))
    seg = _save_mirrored(ckpt, 3)
    shutil.copy(seg, str(tmp_path / "aside"))
    ckpt.close()
    shutil.copy(str(tmp_path / "aside"), seg)  # as a crashed process would leave it
    model2 = torch.nn.Sequential(*[torch.nn.LayerNorm(64) for _ in range(200)])
    ptrs = [p.data_ptr() for p in model2.parameters()]
    with nonstop.Checkpointer(d, {"model": model2}, every=1, tier="memory") as ckpt:
        assert ckpt.restore() == 3
        s = ckpt.stats()
        assert s["restored_from"] == "memory", s.get("memory_unused_because")
        want = sum(p.numel() * p.element_size() for p in model2.parameters())
        assert s["restore_bytes"] >= want  # one read of the segment's data region
        assert s["restore_step"] == 3
    assert [p.data_ptr() for p in model2.parameters()] == ptrs  # written in place
    for i, p in enumerate(model2.parameters()):
        assert torch.all(p == float(i))


def test_a_damaged_data_chunk_in_the_segment_falls_back_to_the_disk(tmp_path, monkeypatch):
    """The segment's data is checksummed once, by the read (the open checks
    its header, record and table only): a segment whose table is intact but
    one of whose data bytes changed is found by that read, and restore()
    reads the disk into the same tensors."""
    shm = tmp_path / "shm"
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(shm))
    d = str(tmp_path / "job")
    ckpt, _, seg = _job_with_segment(d, 3.0, 3)
    data = bytearray(open(seg, "rb").read())
    ckpt.close()
    at = data.find(torch.full((16,), 3.0).numpy().tobytes())  # inside the weight's bytes
    assert at > 0
    data[at + 5] ^= 0x20
    with open(seg, "wb") as f:  # as a crashed process would leave it, one byte changed
        f.write(data)
    model2 = _model()
    ptr = model2.weight.data_ptr()
    with nonstop.Checkpointer(d, {"model": model2}, every=1, tier="memory") as ckpt:
        assert ckpt.restore() == 3
        s = ckpt.stats()
        assert s["restored_from"] == "disk"
        assert "checksum mismatch" in s["memory_unused_because"], s["memory_unused_because"]
    assert model2.weight.data_ptr() == ptr
    assert torch.all(model2.weight == 3.0) and torch.all(model2.bias == 3.0)


def test_the_segment_is_read_in_place_and_load_state_dict_is_skipped(tmp_path, monkeypatch, load_state_dict_calls):
    """restore() from the memory tier reads the segment straight into the
    live module's tensors (after prepare() checked them), so applying it
    calls no load_state_dict."""
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(tmp_path / "shm"))
    d = str(tmp_path / "job")
    ckpt, _, seg = _job_with_segment(d, 5.0, 2)
    shutil.copy(seg, str(tmp_path / "aside"))
    ckpt.close()
    shutil.copy(str(tmp_path / "aside"), seg)  # as a crashed process would leave it
    calls = load_state_dict_calls
    model = _model()
    with nonstop.Checkpointer(d, {"model": model}, every=1, tier="memory") as ckpt:
        assert ckpt.restore() == 2
        s = ckpt.stats()
        assert s["restored_from"] == "memory", s.get("memory_unused_because")
    assert calls == []
    assert torch.all(model.weight == 5.0) and torch.all(model.bias == 5.0)
