"""No first-checkpoint spike (issue #19): the Checkpointer starts allocating
the state-sized staging in the background when it is built, so the first
save() takes the prepared pool instead of allocating on the training thread.
Checked through the engine's counters (stats()), not wall-clock times.
Also what else the first save() no longer does on the training thread: it
starts no thread (the handles' thread starts in the constructor) and adopts
the slot file the engine created in the background."""
import os
import threading
import time

import pytest
import torch

import nonstop

MiB = 1 << 20


def _model_and_adam(mb):
    # Parameters of `mb` MiB; Adam's two moments triple the state at its first step.
    rows = mb * MiB // 4 // 1024
    model = torch.nn.Sequential(torch.nn.Linear(1024, rows, bias=False))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def _train_step(model, opt):
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()


def _wait_prepared(ckpt, deadline_s=60.0):
    end = time.monotonic() + deadline_s
    while ckpt.stats()["staging_prepared_bytes"] == 0 and time.monotonic() < end:
        time.sleep(0.01)
    return ckpt.stats()["staging_prepared_bytes"]


def test_first_save_does_not_wait_for_staging_when_there_was_time(tmp_path):
    model, opt = _model_and_adam(100)  # 100 MiB of weights, 300 MiB with Adam's state
    ckpt = nonstop.Checkpointer(str(tmp_path / "job"), {"model": model, "optim": opt}, every=1)
    try:
        prepared = _wait_prepared(ckpt)
        # The estimate counts the Adam moments that do not exist yet.
        assert prepared >= 300 * MiB
        _train_step(model, opt)
        ckpt.step(0)
        ckpt.wait()
        s = ckpt.stats()
        state_bytes = s["recent"][-1]["bytes"]
        assert state_bytes >= 300 * MiB
        assert s["staging_bytes"] >= state_bytes  # the prepared pool, taken
        assert s["staging_alloc_waits"] == 0
        assert s["staging_alloc_wait_s"] == 0.0
        assert s["staging_wait_s_total"] == 0.0  # the whole state fit
        # The checkpoint went through the prepared pool intact.
        want = model[0].weight.detach().clone()
        with torch.no_grad():
            model[0].weight.zero_()
        ckpt.restore()
        assert torch.equal(model[0].weight, want)
    finally:
        ckpt.close()


def test_without_the_estimate_the_first_save_allocates_and_says_so(tmp_path, monkeypatch):
    from nonstop import _checkpointer
    monkeypatch.setattr(_checkpointer, "_state_bytes_estimate", lambda state: 0)
    model, opt = _model_and_adam(100)
    ckpt = nonstop.Checkpointer(str(tmp_path / "job"), {"model": model, "optim": opt}, every=1)
    try:
        time.sleep(0.2)
        assert ckpt.stats()["staging_prepared_bytes"] == 0
        _train_step(model, opt)
        ckpt.step(0)
        ckpt.wait()
        s = ckpt.stats()
        assert s["staging_alloc_waits"] == 1
        assert s["staging_alloc_wait_s"] > 0
        assert s["staging_bytes"] >= s["recent"][-1]["bytes"]
    finally:
        ckpt.close()


@pytest.mark.parametrize("staging_bytes", [64 * MiB])
def test_explicit_staging_bytes_is_kept(tmp_path, staging_bytes):
    model, opt = _model_and_adam(100)
    ckpt = nonstop.Checkpointer(str(tmp_path / "job"), {"model": model, "optim": opt}, every=1,
                                staging_bytes=staging_bytes)
    try:
        _train_step(model, opt)
        ckpt.step(0)
        ckpt.wait()
        s = ckpt.stats()
        assert s["staging_bytes"] == staging_bytes
        assert s["staging_prepared_bytes"] == 0 and s["staging_alloc_waits"] == 0
    finally:
        ckpt.close()


# ---- the slot file created in the background, the handles' thread

def _small_model_and_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def _train_small(model, opt):
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_the_first_save_starts_no_thread_and_adopts_the_prepared_slot_file(tmp_path, monkeypatch):
    d = str(tmp_path / "ck")
    model, opt = _small_model_and_adam()
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=100, tier="disk") as ckpt:
        _train_small(model, opt)  # Adam's moments appear: the estimate counted them
        started = []
        real_start = threading.Thread.start

        def start(self):
            started.append(self.name)
            return real_start(self)

        monkeypatch.setattr(threading.Thread, "start", start)
        h = ckpt.save(0)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert started == [], started
        assert h.wait(timeout=60)["committed"]
        s = ckpt.stats()
        # The slot file the engine created in the background was adopted.
        assert s["slot_file_prepared_bytes"] == os.path.getsize(os.path.join(d, "rank-00000.nsck"))
    assert not [t for t in threading.enumerate() if t.name == "nonstop-handles"]
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=100, tier="disk") as ckpt:
        assert ckpt.restore() == 0


def test_a_checkpointer_closed_before_any_save_leaves_no_checkpoint_and_no_thread(tmp_path):
    d = str(tmp_path / "ck")
    model, opt = _small_model_and_adam()
    ckpt = nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=100, tier="disk")
    assert [t for t in threading.enumerate() if t.name == "nonstop-handles"]
    ckpt.close()
    assert not [t for t in threading.enumerate() if t.name == "nonstop-handles"]
    # The slot file created in the background is there, empty: the next
    # job finds no checkpoint, restores nothing and saves.
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=100, tier="disk") as ckpt:
        assert ckpt.restore() is None
        _train_small(model, opt)
        assert ckpt.save(3).wait(timeout=60)["committed"]
        assert ckpt.latest() == 3
