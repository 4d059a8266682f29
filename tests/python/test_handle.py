"""Per-checkpoint handles: save()/step() return one; it settles once its
checkpoint is committed (readable from disk by then) or has failed."""
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import nonstop
from conftest import needs_engine
from nonstop._handle import CheckpointHandle
from nonstop.errors import CheckpointError, CheckpointIOError

pytestmark = needs_engine


def _train(model, opt):
    opt.zero_grad()
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()


def test_step_returns_handles_that_settle_after_commit(tmp_path):
    """Every due step() returns a handle that settles: committed (and then
    readable from disk in its callback), or superseded (PCcheck: with two
    checkpoints in flight, an older one that finishes after a newer one has
    claimed the slot order is dropped, never committed; under load that
    happens to step 1 or 3 here, which once failed this test when it
    demanded three commits). The newest always commits."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    seen, on_disk, threads = [], {}, []

    def on_commit(stats):
        seen.append(stats)

    def check_on_disk(h):
        # Called once settled: a committed checkpoint must be readable now.
        threads.append(threading.get_ident())
        if h.exception() is None:
            on_disk[h.step] = nonstop.load(str(tmp_path / "ck"), step=h.step).tensors["model/weight"]

    ckpt = nonstop.Checkpointer(str(tmp_path / "ck"), {"model": model, "optim": opt}, every=2,
                                on_commit=on_commit)
    handles, weights = [], {}
    for step in range(6):
        _train(model, opt)
        h = ckpt.step(step)
        if (step + 1) % 2:
            assert h is None, "a step() that is not due returns None"
            continue
        assert isinstance(h, nonstop.CheckpointHandle) and h.step == step
        weights[step] = model.weight.detach().clone()
        h.add_done_callback(check_on_disk)
        handles.append(h)
    committed = []
    for h in handles:
        err = h.exception(timeout=60)
        assert h.done()
        if err is not None:
            assert isinstance(err, CheckpointError) and "superseded" in str(err), err
            assert h.stats is not None and not h.stats["committed"]
            continue
        committed.append(h.step)
        stats = h.wait(timeout=60)
        assert stats["committed"] and stats["step"] == h.step and stats["counter"] == h.counter
        assert stats["bytes"] > 0 and stats["persist_s"] >= 0
    ckpt.close()
    assert committed[-1] == 5, "the newest checkpoint is never superseded"
    assert sorted(on_disk) == committed
    for step, w in on_disk.items():
        assert torch.equal(w, weights[step])
    # on_commit sees every checkpoint once it settles, a superseded one too
    # (committed False; it may settle after a newer one committed)
    assert sorted(s["step"] for s in seen) == [h.step for h in handles]
    assert [s["step"] for s in seen if s["committed"]] == committed
    assert all(s["committed"] == (s["step"] in committed) for s in seen)
    assert len(threads) == len(handles)
    # a callback added after the fact runs at once, on the caller's thread
    late = []
    handles[0].add_done_callback(lambda h: late.append(threading.get_ident()))
    assert late == [threading.get_ident()]


def test_save_returns_a_handle(tmp_path):
    model = torch.nn.Linear(4, 4)
    with nonstop.Checkpointer(str(tmp_path / "ck"), {"model": model}, every=100) as ckpt:
        h = ckpt.save(41)
        assert h.wait(timeout=60)["step"] == 41
        assert ckpt.latest() == 41
        assert "committed" in repr(h)


def test_a_handle_is_a_future_that_cancel_leaves_alone():
    """CheckpointHandle on its own (a concurrent.futures.Future): cancel()
    must not cancel a pending handle (the watcher settles it later), a wait
    that times out says which step, and a callback that raises warns."""
    h = CheckpointHandle(3, 7)
    assert not h.cancel() and not h.done()
    with pytest.raises(TimeoutError, match="checkpoint of step 3 not finished after 0.01 s"):
        h.wait(timeout=0.01)
    h.add_done_callback(lambda h: 1 / 0)
    with pytest.warns(UserWarning, match="callback raised ZeroDivisionError"):
        h._settle({"counter": 7, "step": 3, "committed": True}, None)
    assert h.wait() == {"counter": 7, "step": 3, "committed": True} == h.stats
    failed = CheckpointHandle(4, 8)
    failed._settle({"committed": False}, CheckpointIOError("checkpoint of step 4: EIO"))
    assert isinstance(failed.exception(), CheckpointIOError) and not failed.stats["committed"]
    with pytest.raises(CheckpointIOError, match="step 4"):
        failed.wait()
    assert "failed: checkpoint of step 4" in repr(failed)


def test_failed_checkpoint_settles_its_handle_with_the_error_while_training_goes_on(tmp_path):
    """A real failure after the data is written: the state grew, so the engine
    writes a new, larger slot file and renames it over the old one at the
    first commit. Something put a directory where the slot file lives, so the
    rename fails (EISDIR) in the background: that checkpoint is not
    committed, its handle says why, training is not blocked, and the
    training thread sees the error at its next save()."""
    torch.manual_seed(0)
    d = str(tmp_path / "ck")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"buf": torch.zeros(4)}
    failed = []
    ckpt = nonstop.Checkpointer(d, {"model": model, "optim": opt, "extra": extra}, every=1,
                                on_commit=lambda s: failed.append(s) if not s["committed"] else 0)
    _train(model, opt)
    first = ckpt.step(0)
    assert first.wait(timeout=60)["committed"]
    slot = os.path.join(d, "rank-00000.nsck")
    shutil.move(slot, str(tmp_path / "aside.nsck"))  # the engine keeps its open file
    os.makedirs(os.path.join(slot, "in-the-way"))
    # a larger registration: a new slot file (larger than the slot file the
    # Checkpointer prepared from its estimate: that has 4 MiB of room)
    extra["buf"] = torch.zeros(1 << 22)
    _train(model, opt)
    h = ckpt.step(1)
    err = h.exception(timeout=60)
    assert isinstance(err, CheckpointIOError), err
    assert "step 1" in str(err)
    with pytest.raises(CheckpointIOError):
        h.wait(timeout=1)
    assert not h.stats["committed"] and h.stats["error"]
    assert [s["step"] for s in failed] == [1]
    # Training went on meanwhile (nothing waited on the failed checkpoint);
    # the training thread is told too, at its next call into nonstop: the
    # handle does not swallow the error.
    surfaced = False
    try:
        for _ in range(3):
            _train(model, opt)
        ckpt.save(4)
    except CheckpointError as e:
        surfaced = "step 1" in str(e)
    assert surfaced
    try:
        ckpt.close()
    except CheckpointError:
        pass
    # the committed checkpoint of step 0 is intact
    shutil.rmtree(slot)
    shutil.move(str(tmp_path / "aside.nsck"), slot)
    assert nonstop.load(d).step == 0


def test_a_script_that_never_closes_exits_cleanly_with_checkpoints_in_flight(tmp_path):
    """The watcher thread waits in the engine's watch (C++) with the GIL
    released. A script that ends without close() while checkpoints are in
    flight: the thread must leave the watch before the interpreter
    finalizes (atexit), or its return into Python then ends in
    "terminate called without an active exception" (SIGABRT)."""
    code = textwrap.dedent(f"""
        import torch, nonstop
        model = torch.nn.Linear(1024, 1024)
        done = []
        ckpt = nonstop.Checkpointer({str(tmp_path / "ck")!r}, {{"model": model}}, every=1,
                                    on_commit=done.append)
        for step in range(4):
            with torch.no_grad():
                model.weight.add_(1.0)
            ckpt.save(step)
        print("saved", flush=True)
    """)
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
        assert "terminate called" not in p.stderr, p.stderr[-3000:]
        assert p.returncode == 0 and "saved" in p.stdout, (p.returncode, p.stderr[-3000:])
