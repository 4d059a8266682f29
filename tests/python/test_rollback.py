"""Invariant 9 through the Python front end: the checkpoint a job restored
from stays intact until a newer one commits, and a rollback is final."""
import os

import pytest
import torch

import nonstop
from conftest import needs_engine, warned

pytestmark = needs_engine


def _job(d, every=1, max_in_flight=1):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=every,
                                             max_in_flight=max_in_flight, medium="buffered")


def _train(model, opt, ck, steps, settle=False):
    """settle: each checkpoint committed before the next starts. Otherwise,
    with max_in_flight > 1, one that finishes writing after a newer one is
    superseded (never committed; docs/ENGINE.md "Commit"), as under load."""
    for s in steps:
        opt.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        with torch.no_grad():
            model.weight.fill_(float(s))  # the step is readable from the weights
        ck.step(s)
        if settle:
            ck.wait()
    ck.wait()


def _corrupt_newest_data(d):
    """Flips a byte in the data of the newest committed checkpoint."""
    info = nonstop.load(d).info
    with open(os.path.join(d, "rank-00000.nsck"), "r+b") as f:
        f.seek(info["data_offset"] + 8)
        b = f.read(1)
        f.seek(info["data_offset"] + 8)
        f.write(bytes([b[0] ^ 0xFF]))


def test_restore_of_an_older_step_is_final(tmp_path):
    d = str(tmp_path / "job")
    model, opt, ck = _job(d, max_in_flight=2)
    _train(model, opt, ck, range(10), settle=True)  # slots (N+1 = 3) hold steps 7, 8 and 9
    ck.close()
    assert [s for _, s in _committed(d)] == [7, 8, 9], _committed(d)
    model, opt, ck = _job(d, max_in_flight=2)
    assert ck.restore(step=7) == 7  # roll back from 8 and 9
    _train(model, opt, ck, [8])     # a new step 8 of the restored lineage; one of
    ck.close()                      # the old 8 and 9 is still on disk
    # The new step-8 checkpoint is damaged (a crash during its commit): the
    # job must resume the step it restored (7), never a checkpoint it rolled
    # back from.
    _corrupt_newest_data(d)
    model, opt, ck = _job(d, max_in_flight=2)
    with pytest.warns(UserWarning) as rec:
        step = ck.restore()
    assert step == 7, f"restored {step}; {warned(rec)}"
    assert float(model.weight[0, 0].detach()) == 7.0
    ck.close()


def test_fallback_keeps_the_restored_checkpoint(tmp_path):
    d = str(tmp_path / "job")
    model, opt, ck = _job(d)
    _train(model, opt, ck, range(10))  # steps 8 and 9 in the two slots
    ck.close()
    _corrupt_newest_data(d)  # step 9 damaged
    model, opt, ck = _job(d)
    with pytest.warns(UserWarning) as rec:
        step = ck.restore()
    assert step == 8, f"restored {step}; {warned(rec)}"
    _train(model, opt, ck, [9])  # must not overwrite step 8's slot
    ck.close()
    _corrupt_newest_data(d)  # the new checkpoint is damaged too
    model, opt, ck = _job(d)
    with pytest.warns(UserWarning) as rec:
        step = ck.restore()
    assert step == 8, f"restored {step}; {warned(rec)}"
    ck.close()


multistep_core = pytest.mark.skipif(
    nonstop._core is None or not hasattr(nonstop._core, "Multistep"),
    reason="this build of nonstop._core has no Multistep")


def _multistep_job(d):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=2,
                                             mode="multistep", parts=2, max_in_flight=1,
                                             medium="buffered")


def _committed(d):
    """(counter, step) of every committed, non-abandoned record of rank 0
    (data not verified), oldest first."""
    jd = nonstop._core.JobDir.open_for_read(d)
    return sorted((c["counter"], c["step"]) for c in jd.list(0) if c["state"] == "committed")


@multistep_core
def test_multistep_fallback_keeps_the_restored_checkpoint(tmp_path):
    # mode="multistep" adopts what restore() read (Engine::AdoptRestored
    # through the Multistep), as concurrent mode does: after a fallback past
    # a damaged newest checkpoint, the next checkpoint must not overwrite the
    # restored one's slot.
    d = str(tmp_path / "job")
    model, opt, ck = _multistep_job(d)
    _train(model, opt, ck, range(12))
    ck.close()
    held = _committed(d)
    assert len(held) == 2, held  # max_in_flight 1: two slots
    older, newest = held
    _corrupt_newest_data(d)
    model, opt, ck = _multistep_job(d)
    with pytest.warns(UserWarning) as rec:
        step = ck.restore()
    assert step == older[1], f"restored {step}; {warned(rec)}"
    s = older[1] + 1
    while max(_committed(d))[0] <= newest[0]:
        _train(model, opt, ck, [s])  # until one new checkpoint commits
        s += 1
        assert s < older[1] + 20, _committed(d)
    ck.close()
    assert older in _committed(d), f"the restored checkpoint was overwritten: {_committed(d)}"
    _corrupt_newest_data(d)  # the new checkpoint is damaged too
    model, opt, ck = _multistep_job(d)
    with pytest.warns(UserWarning) as rec:
        step = ck.restore()
    assert step == older[1], f"restored {step}; {warned(rec)}"
    ck.close()
