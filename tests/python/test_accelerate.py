"""Accelerate: prepared (wrapped) optimizers and schedulers work in a
Checkpointer's state, and a job killed at a random step resumes exactly."""
import pytest
import torch

import nonstop
from nonstop import _session
from conftest import needs_engine

accelerate = pytest.importorskip("accelerate")
pytestmark = needs_engine


def test_prepared_objects_checkpoint_and_hook_the_real_optimizer(tmp_path):
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    model, opt, sched = acc.prepare(model, opt, sched)
    assert type(opt).__name__ == "AcceleratedOptimizer"
    ckpt = nonstop.Checkpointer(str(tmp_path / "ck"), {"model": model, "optim": opt,
                                                       "sched": sched}, every=1)
    for step in range(3):
        opt.zero_grad()
        acc.backward(model(torch.randn(2, 4)).sum())
        opt.step()
        sched.step()
        h = ckpt.step(step)
    h.wait(timeout=60)
    # the pre-hook is on the optimizer that steps, and its state is zero-copy
    assert len(opt.optimizer._optimizer_step_pre_hooks) == 1
    owned = _session.optimizer_owned(ckpt.state)
    assert all(p.data_ptr() in owned for p in model.parameters())
    want = {k: v.clone() for k, v in opt.optimizer.state[model.weight].items()}
    ckpt.close()
    got = nonstop.load(str(tmp_path / "ck")).state
    assert got["sched"]["last_epoch"] == 3
    assert torch.equal(got["optim"]["state"][0]["exp_avg"], want["exp_avg"])


def test_accelerate_killed_in_epoch_2_resumes_exactly(tmp_path):
    from integration_harness import EPOCH2, kill_resume_compare
    kill_resume_compare("accelerate", tmp_path, **EPOCH2)


def test_plain_loop_killed_in_epoch_2_resumes_exactly(tmp_path):
    pytest.importorskip("torchdata")
    from integration_harness import EPOCH2, kill_resume_compare
    kill_resume_compare("plain", tmp_path, **EPOCH2)

