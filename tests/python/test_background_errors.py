"""Background errors (a failed keep= copy, a failed write) are never raised
inside optimizer.step() and never skip an update; they are reported once,
at the next step()/save()/wait()/close(), and one transient error costs
only the checkpoint that failed: the next due checkpoint commits.

The failure is real: a regular file planted where the engine makes the
keep folder of one step (DIR/keep/step-N/), so that one copy fails.
"""
import os
import time

import pytest

torch = pytest.importorskip("torch")
import nonstop  # noqa: E402
from nonstop.errors import CheckpointError  # noqa: E402

STEPS = 12
EVERY = 2          # checkpoints after steps 1, 3, 5, ...
FAIL_AT = (3, 7)   # the keep copies of these steps fail


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g)


def update(model, opt, step):
    model(batch(step)).pow(2).mean().backward()
    opt.step()  # an exception here fails the test: it is raised inside optimizer.step()
    opt.zero_grad()


def keep_name(step):
    return f"step-{step:012d}"


def wait_finished(ckpt, step, timeout=60):
    """Until the checkpoint of `step` is finished (its keep copy tried), so
    its error is queued before the training thread calls the engine again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c["step"] == step and c["committed"] for c in ckpt.session.engine.stats()["recent"]):
            return
        time.sleep(0.01)
    raise AssertionError(f"checkpoint of step {step} did not commit")


def step_reporting(ckpt, step):
    """ckpt.step(step), which starts the checkpoint whose keep copy fails.
    On a loaded box that copy can fail before step() returns, and step()
    then reports it (its check of the engine's errors comes after the
    checkpoint started): the error, checked to be that copy's, or None."""
    try:
        ckpt.step(step)
    except CheckpointError as e:
        assert keep_name(step) in str(e), e
        return e
    return None


def plant(d, *steps):
    """A file where the keep folder of each step must go: that copy fails."""
    (d / "keep").mkdir(exist_ok=True)
    for s in steps:
        (d / "keep" / keep_name(s)).write_text("in the way")


def test_a_failed_keep_copy_skips_no_update_and_costs_one_checkpoint(tmp_path):
    ref_model, ref_opt = make()
    for s in range(STEPS):
        update(ref_model, ref_opt, s)

    d = tmp_path / "ck"
    model, opt = make()
    surfaced = []
    ckpt = nonstop.Checkpointer(str(d), {"model": model, "optim": opt}, every=EVERY, keep=1,
                                rng=False, on_preempt=False)
    plant(d, *FAIL_AT)
    try:
        for s in range(STEPS):
            update(model, opt, s)
            try:
                ckpt.step(s)
            except CheckpointError as e:
                surfaced.append((s, str(e)))
            # The failing checkpoint and the next one are let finish before
            # training goes on: the next one must commit (not merely be
            # superseded by a newer one, which the engine may do).
            if s in FAIL_AT or s - EVERY in FAIL_AT:
                wait_finished(ckpt, s)
        try:
            ckpt.wait()
        except CheckpointError as e:
            surfaced.append(("wait", str(e)))
        latest = ckpt.latest()
        stats = ckpt.stats()["recent"]
    finally:
        try:
            ckpt.close()
        except CheckpointError as e:
            surfaced.append(("close", str(e)))

    # Every update happened: the weights equal a run without checkpoints.
    for a, b in zip(model.state_dict().values(), ref_model.state_dict().values()):
        assert torch.equal(a, b)
    # Each failure surfaced exactly once, naming its step, at a step()/wait().
    for s in FAIL_AT:
        hits = [w for w, msg in surfaced if keep_name(s) in msg]
        assert len(hits) == 1, surfaced
        # Never before the failing checkpoint started; at its own step() when
        # the copy already failed by the time that call took the queued errors.
        assert hits[0] != "close" and (hits[0] == "wait" or hits[0] >= s), surfaced
    assert len(surfaced) == len(FAIL_AT), surfaced
    # The checkpoint due right after each failure was started and committed.
    kept = sorted(os.listdir(d / "keep"))
    for s in FAIL_AT:
        assert keep_name(s + EVERY) in kept, (kept, surfaced, stats)
        assert any(c["step"] == s + EVERY and c["committed"] for c in stats), stats
        assert nonstop.load(str(d / "keep" / keep_name(s + EVERY))).step == s + EVERY
    assert latest == STEPS - 1
    assert nonstop.load(str(d)).step == STEPS - 1


def test_a_failed_keep_copy_is_reported_by_wait_and_close(tmp_path):
    d = tmp_path / "ck"
    model, opt = make()
    ckpt = nonstop.Checkpointer(str(d), {"model": model, "optim": opt}, every=EVERY, keep=1,
                                rng=False, on_preempt=False)
    plant(d, 1)
    update(model, opt, 0)
    ckpt.step(0)
    update(model, opt, 1)
    early = step_reporting(ckpt, 1)
    wait_finished(ckpt, 1)
    update(model, opt, 2)  # its pre-hook meets the error: it must not raise it
    if early is None:
        with pytest.raises(CheckpointError, match=keep_name(1)):
            ckpt.wait()
    ckpt.wait()  # reported once
    ckpt.close()

    d2 = tmp_path / "ck2"
    ckpt = nonstop.Checkpointer(str(d2), {"model": model, "optim": opt}, every=EVERY, keep=1,
                                rng=False, on_preempt=False)
    plant(d2, 1)
    update(model, opt, 0)
    ckpt.step(0)
    update(model, opt, 1)
    early = step_reporting(ckpt, 1)
    wait_finished(ckpt, 1)
    update(model, opt, 2)
    if early is None:
        with pytest.raises(CheckpointError, match=keep_name(1)):
            ckpt.close()
    ckpt.close()  # idempotent, and the error is not repeated


def test_save_after_a_failed_checkpoint_still_starts_its_own(tmp_path):
    """The error is queued before save() calls the engine (no optimizer step
    in between): save() starts its checkpoint, then reports the error."""
    d = tmp_path / "ck"
    model, opt = make()
    ckpt = nonstop.Checkpointer(str(d), {"model": model, "optim": opt}, every=1000, keep=1,
                                rng=False, on_preempt=False)
    plant(d, 1)
    update(model, opt, 0)
    ckpt.save(1)
    wait_finished(ckpt, 1)
    with pytest.raises(CheckpointError, match=keep_name(1)):
        ckpt.save(2)
    ckpt.wait()  # nothing more to report
    assert ckpt.latest() == 2
    ckpt.close()
    assert nonstop.load(str(d / "keep" / keep_name(2))).step == 2
