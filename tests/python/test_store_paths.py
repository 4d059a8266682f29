"""Against the real engine and store: damaged checkpoints, foreign files,
load without a model, export to safetensors, stats."""
import os

import pytest
import torch
from conftest import needs_engine, warned

import nonstop
import tiny

pytestmark = needs_engine


def train_and_save(d, steps=4, every=1, settle=False):
    """Trains `steps` steps, a checkpoint every `every`. Up to max_in_flight
    (2) checkpoints are in flight at once, and one that finishes writing after
    a newer one is superseded, never committed (PCcheck's counter rule,
    docs/ENGINE.md "Commit"): under load any but the newest may be missing.
    settle: each checkpoint committed before the next starts, so every one
    commits (a test that needs given steps on disk)."""
    model, opt, sched = tiny.make()
    with nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": sched},
                              every=every) as ck:
        for s in range(steps):
            tiny.train_step(model, opt, sched, s)
            ck.step(s)
            if settle:
                ck.wait()
        ck.wait()
        stats = ck.stats()
        assert ck.latest() == steps - 1
    if settle:
        assert stats["superseded"] == 0 and stats["committed"] == steps // every, stats
    return model, opt, stats


def committed_steps(d):
    return sorted(c["step"] for c in nonstop.list(d) if c["state"] == "committed")


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_damaged_newest_checkpoint_warns_and_falls_back(tmp_path):
    d = str(tmp_path / "ck")
    # Settled: unsettled, step 2's checkpoint was superseded by step 3's once
    # on CI (session 15), and the fallback rightly went on to step 1.
    train_and_save(d, steps=4, settle=True)
    assert committed_steps(d) == [1, 2, 3]  # the 3-slot ring; step 3 reused step 0's slot
    newest = nonstop.load(d)
    assert newest.step == 3
    flip_byte(newest.path, newest.info["data_offset"] + 8)
    with pytest.warns(UserWarning, match="falling back") as rec:
        got = nonstop.load(d)
    assert got.step == 2, f"{got}; {warned(rec)}"
    assert "checkpoint #4 (step 3) is damaged" in warned(rec), warned(rec)
    with pytest.raises(nonstop.CorruptCheckpointError, match="step 3 .* is damaged: "):
        nonstop.load(d, step=3)
    model, opt, sched = tiny.make(seed=5)
    with nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": sched}) as ck:
        with pytest.warns(UserWarning, match="falling back") as rec:
            step = ck.restore()
        assert step == 2, f"restored {step}; {ck.stats().get('restored_from')}; {warned(rec)}"
    # The fallback restore rolled back past step 3, durably at once (issue 23).
    with pytest.raises(nonstop.CheckpointNotFoundError):
        nonstop.load(d, step=3)


def test_every_checkpoint_damaged_is_an_error(tmp_path):
    d = str(tmp_path / "ck")
    train_and_save(d, steps=2, settle=True)  # unsettled, step 0's may be superseded
    for step in (0, 1):
        c = nonstop.load(d, step=step)
        flip_byte(c.path, c.info["data_offset"] + 8)
    with pytest.raises(nonstop.CorruptCheckpointError):
        with pytest.warns(UserWarning):
            nonstop.load(d)


def test_foreign_slot_file(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "rank-00000.nsck").write_bytes(b"not a nonstop file" * 300)
    with pytest.raises(nonstop.CheckpointError) as e:
        nonstop.load(str(d))
    assert "\n" not in str(e.value)


def test_load_without_a_model_and_export(tmp_path):
    from safetensors.torch import load_file
    d = str(tmp_path / "ck")
    model, opt, stats = train_and_save(d, steps=3)
    c = nonstop.load(d)
    assert c.step == 2 and c.meta["format"] == "nonstop.torch/1"
    assert torch.equal(c.tensors["model/fc.weight"], model.fc.weight)
    assert c.state["optim"]["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]
    n = nonstop.load(d, as_numpy=True)
    assert (n.tensors["model/fc.weight"] == model.fc.weight.detach().numpy()).all()

    out = str(tmp_path / "model.safetensors")
    r = nonstop.export(d, out, include="model/*", strip="model/")
    assert r["step"] == 2
    fresh = tiny.TinyNet()
    sd = load_file(out)
    sd["head.weight"] = sd["emb.weight"]  # tied, stored once
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.bn.running_var, model.bn.running_var)
    everything = load_file(nonstop.export(d, str(tmp_path / "all.safetensors"))["path"])
    assert "optim/state/0/exp_avg" in everything
    # Under load a late older checkpoint is superseded by a newer one (the
    # counter rule): every save ends committed or superseded, none failed.
    assert stats["saves"] == 3 and stats["failed"] == 0 and stats["visible_stall_s"] > 0
    assert stats["committed"] + stats["superseded"] == 3 and stats["committed"] >= 1


def test_blocking_calls_release_the_gil(tmp_path):
    """A Python thread keeps running while the training thread waits in C++."""
    import threading
    big = torch.zeros(16 << 20, dtype=torch.uint8)  # 16 MiB, copied at checkpoint
    ticks, stop, waited_ticks = [0], threading.Event(), 0

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        with nonstop.Checkpointer(str(tmp_path / "ck"), {"big": big}, rng=False) as ck:
            for s in range(3):
                ck.save(s)
                before = ticks[0]
                ck.wait()
                waited_ticks += ticks[0] - before
    finally:
        stop.set()
        t.join()
    assert waited_ticks > 0
