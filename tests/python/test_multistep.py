"""mode="multistep" (GoCkpt): the checkpoint is reconstructed on the CPU from
parts copied at different versions plus the gradients and hyperparameters of
the steps in between. It must equal the true training state at its version
bit for bit; a killed run resumed from it must finish bit-identically to an
uninterrupted run; skipped (GradScaler overflow) steps must not be applied."""
import pytest
import torch
from conftest import needs_engine

import crash_harness as ch
import nonstop
from crash_harness import bits

multistep_core = pytest.mark.skipif(
    nonstop._core is None or not hasattr(nonstop._core, "Multistep"),
    reason="this build of nonstop._core has no Multistep")


class Net(torch.nn.Module):
    # ~90K parameters: with 16 KiB blocks, ~22 blocks, so all 7 parts hold
    # data and several tensors straddle part boundaries.
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(13, 211)
        self.b = torch.nn.Linear(211, 397)
        self.bn = torch.nn.BatchNorm1d(397)
        self.c = torch.nn.Linear(397, 3)
        self.unused = torch.nn.Linear(5, 5)  # never gets a gradient

    def forward(self, x):
        return self.c(self.bn(torch.tanh(self.b(torch.tanh(self.a(x))))))


OPTIMIZERS = {
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3), None),
    "adamw_warmup_wd": (lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
                        lambda o: torch.optim.lr_scheduler.LambdaLR(
                            o, lambda s: min(1.0, (s + 1) / 8))),
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                                weight_decay=1e-4), None),
    "adam_amsgrad_two_groups": (
        lambda ps: torch.optim.Adam([{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-4}],
                                    lr=1e-3, weight_decay=0.01, amsgrad=True), None),
}


@pytest.fixture
def small_blocks(monkeypatch):
    from nonstop import _multistep
    monkeypatch.setattr(_multistep, "BLOCK_BYTES", 16 << 10)


def state_of(model, opt):
    """Every tensor of the model and the optimizer, cloned, by name."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"optim/state/{pid}/{k}"] = v.detach().clone()
    return out


def train(d, name, *, parts, overlap, every, steps, skip=(), scaler=False, zero_to_none=True,
          medium="buffered"):
    """Trains with a multistep Checkpointer; returns (truth by step, ckpt stats)."""
    torch.manual_seed(0)
    model = Net()
    factory, sched_factory = OPTIMIZERS[name]
    opt = factory(list(model.parameters()))
    sched = sched_factory(opt) if sched_factory else None
    state = {"model": model, "optim": opt}
    if sched is not None:
        state["sched"] = sched
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    # keep=1: every window's checkpoint is one a retention rule keeps, so it
    # is never superseded. Without it, with two in flight, a window that
    # completes a few fast steps later may commit first and supersede the
    # older one (the counter rule, docs/ENGINE.md "Commit"), which the tests
    # then cannot load. (max_in_flight=1 would leave two slots: too few.)
    ckpt = nonstop.Checkpointer(d, state, every=every, mode="multistep", parts=parts,
                                overlap_gradients=overlap, medium=medium, keep=1)
    x = torch.randn(32, 13)
    y = torch.randn(32, 3)
    truth = {}
    for s in range(steps):
        opt.zero_grad(set_to_none=zero_to_none)
        loss = torch.nn.functional.mse_loss(model(x + 0.01 * torch.randn_like(x)), y)
        if gs is not None:
            gs.scale(loss).backward()
            if s in skip:
                model.a.weight.grad[0, 0] = float("inf")  # GradScaler will skip this step
            gs.step(opt)
            gs.update()
        else:
            loss.backward()
            if s not in skip:  # as GradScaler does on overflow: no optimizer.step()
                opt.step()
        if sched is not None:
            sched.step()
        ckpt.step(s)
        truth[s] = state_of(model, opt)
    ckpt.wait()
    stats = ckpt.stats()
    ckpt.close()
    return truth, stats


def assert_checkpoint_is_truth(d, truth, step):
    got = nonstop.load(d, step=step)
    want = truth[step]
    assert set(want) <= set(got.tensors), sorted(set(want) - set(got.tensors))
    for name, w in want.items():
        g = got.tensors[name]
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), name
        assert torch.equal(bits(g), bits(w)), f"{name} at step {step} differs"


@needs_engine
@multistep_core
@pytest.mark.parametrize("overlap", [True, False], ids=["gockpt_o", "gockpt"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_reconstruction_is_bitwise_identical(tmp_path, small_blocks, name, overlap):
    parts, every = 7, 10
    d = str(tmp_path / "ck")
    truth, stats = train(d, name, parts=parts, overlap=overlap, every=every, steps=2 * every + 8)
    # Due after steps 9 and 19: versions 9 + 6 and 19 + 6.
    versions = [w["version"] for w in stats["recent"]]
    assert versions == [15, 25]
    assert all(w["error"] == "" for w in stats["recent"])
    assert all(w["grad_bytes"] > 0 and w["state_bytes"] > 0 for w in stats["recent"])
    for v in versions:
        assert_checkpoint_is_truth(d, truth, v)


@needs_engine
@multistep_core
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_few_parts_and_async_o(tmp_path, small_blocks, parts):
    # parts=1 is Async-O: the whole state copied during one step, no replay.
    d = str(tmp_path / "ck")
    truth, stats = train(d, "adamw_warmup_wd", parts=parts, overlap=True, every=4, steps=14)
    # A window closes at the update after its version; the last may stay open.
    done = [w["version"] for w in stats["recent"] if w["version"] < 13]
    assert len(done) >= 2
    for v in done:
        assert_checkpoint_is_truth(d, truth, v)


@needs_engine
@multistep_core
@pytest.mark.parametrize("medium", ["buffered", "direct"])
def test_the_replayed_buffers_are_written_as_they_are(tmp_path, small_blocks, medium):
    # The state buffers are the checkpoint's staging (docs/MULTISTEP.md): the
    # engine writes them as they are (b.weight and its states are 4 KiB-aligned
    # large tensors, written straight out of them, O_DIRECT included), and its
    # staging pool is not sized for them: it keeps its smallest size (a few
    # chunks; it used to be sized for the state, 256 MiB at the least).
    d = str(tmp_path / "ck")
    truth, stats = train(d, "adamw", parts=3, overlap=True, every=4, steps=12, medium=medium)
    done = [w["version"] for w in stats["recent"] if w["version"] < 11]
    assert len(done) >= 2 and all(w["error"] == "" for w in stats["recent"])
    assert 0 < stats["staging_bytes"] < 256 << 20, stats
    for v in done:
        assert_checkpoint_is_truth(d, truth, v)


@needs_engine
@multistep_core
@pytest.mark.parametrize("scaler", [False, True], ids=["no_step", "grad_scaler"])
def test_skipped_steps_are_not_applied(tmp_path, small_blocks, scaler):
    d = str(tmp_path / "ck")
    # Window after step 4: steps 5..11; 6, 7 and 9 overflow.
    truth, stats = train(d, "adamw", parts=7, overlap=True, every=5, steps=12,
                         skip=(6, 7, 9), scaler=scaler)
    w = stats["recent"][0]
    assert w["version"] == 10 and w["skipped_steps"] == 3
    assert_checkpoint_is_truth(d, truth, 10)
    # The skipped steps really did nothing: the parameters did not move.
    assert torch.equal(truth[6]["model/a.weight"], truth[5]["model/a.weight"])


@needs_engine
@multistep_core
def test_zero_grad_in_place_waits_for_gradient_copies(tmp_path, small_blocks):
    d = str(tmp_path / "ck")
    truth, stats = train(d, "sgd_momentum", parts=5, overlap=True, every=3, steps=12,
                         zero_to_none=False)
    done = [w["version"] for w in stats["recent"] if w["version"] < 11]
    assert done
    for v in done:
        assert_checkpoint_is_truth(d, truth, v)


@needs_engine
@multistep_core
def test_unsupported_optimizer_is_named(tmp_path):
    model = Net()
    opt = torch.optim.RMSprop(model.parameters())
    with pytest.raises(nonstop.CheckpointMismatchError, match="RMSprop"):
        nonstop.Checkpointer(str(tmp_path / "a"), {"model": model, "optim": opt},
                             mode="multistep")
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    with pytest.raises(nonstop.CheckpointMismatchError, match="foreach"):
        nonstop.Checkpointer(str(tmp_path / "b"), {"model": model, "optim": opt},
                             mode="multistep", replay="host")
    with pytest.raises(nonstop.CheckpointMismatchError, match="exactly one"):
        nonstop.Checkpointer(str(tmp_path / "c"), {"model": model}, mode="multistep")


# ---- replay="host": tensors off the CPU are refused (docs/MULTISTEP.md, "Replay");
# replay="torch" takes CUDA tensors (test_multistep_torch_replay.py, tests/gpu) -----

def _one_line_refusal(excinfo, where):
    msg = str(excinfo.value)
    assert "\n" not in msg
    assert where in msg and "use replay='torch'" in msg, msg


@needs_engine
@multistep_core
def test_parameters_off_the_cpu_are_refused(tmp_path):
    # `meta` is a real non-CPU device here; CUDA takes the same branch (the
    # guard is "not on the CPU"): the CPU kernels' replay would be wrong.
    model = Net().to("meta")
    for foreach in (None, False):
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
        with pytest.raises(nonstop.CheckpointMismatchError) as e:
            nonstop.Checkpointer(str(tmp_path / f"a{foreach}"), {"model": model, "optim": opt},
                                 mode="multistep", replay="host")
        _one_line_refusal(e, "parameter 0 of the optimizer is on meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(nonstop.CheckpointMismatchError) as e:
        nonstop.Checkpointer(str(tmp_path / "b"), {"model": model, "optim": opt}, mode="multistep",
                             replay="host")
    _one_line_refusal(e, "on meta")


@needs_engine
@multistep_core
def test_optimizer_state_off_the_cpu_is_refused(tmp_path, small_blocks):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    p = next(model.parameters())
    # State that is already there (e.g. loaded) is checked by the constructor.
    opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(p.shape, device="meta"),
                    "exp_avg_sq": torch.zeros(p.shape)}
    with pytest.raises(nonstop.CheckpointMismatchError) as e:
        nonstop.Checkpointer(str(tmp_path / "a"), {"model": model, "optim": opt}, mode="multistep",
                             replay="host")
    _one_line_refusal(e, "optimizer state 'exp_avg' of parameter 0 is on meta")
    # State moved after the constructor is checked when a window begins.
    opt.state.clear()
    ck = nonstop.Checkpointer(str(tmp_path / "b"), {"model": model, "optim": opt},
                              mode="multistep", every=2, parts=2, replay="host")
    try:
        x = torch.randn(8, 13)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        ck.step(0)
        model(x).sum().backward()
        opt.step()
        opt.state[p]["exp_avg_sq"] = opt.state[p]["exp_avg_sq"].to("meta")
        with pytest.raises(nonstop.CheckpointMismatchError) as e:
            ck.step(1)  # due: the window begins here
        _one_line_refusal(e, "optimizer state 'exp_avg_sq' of parameter 0 is on meta")
    finally:
        ck.close()


@needs_engine
@multistep_core
def test_engine_options_the_window_does_not_take_are_refused(tmp_path):
    # The binding gets the engine's whole set of options
    # (_options.engine_kwargs): those it does not take yet must be unset.
    with pytest.raises(nonstop.CheckpointMismatchError,
                       match="mode='multistep' does not support layer_copy yet"):
        nonstop._core.Multistep(dir=str(tmp_path), layer_copy="device")
    nonstop._core.Multistep(dir=str(tmp_path), layer_copy="", extra_slots=0,
                            small_initial_staging=True).close()


@needs_engine
@multistep_core
def test_other_state_off_the_cpu_is_refused(tmp_path, small_blocks):
    # A tensor of the state that is not the optimizer's (here a holder's) is
    # copied as it is when the window's outputs are set: checked there.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = nonstop.Checkpointer(str(tmp_path / "a"), {"model": model, "optim": opt,
                                                    "extra": {"t": torch.zeros(3, device="meta")}},
                              mode="multistep", every=1, parts=1, replay="host")
    try:
        model(torch.randn(8, 13)).sum().backward()
        opt.step()
        with pytest.raises(nonstop.CheckpointMismatchError) as e:
            ck.step(0)  # due: the window (one part) begins and its outputs are set
        _one_line_refusal(e, "tensor 'extra/t' of the state is on meta")
    finally:
        ck.close()


def test_torch_picks_no_foreach_kernel_for_cpu_tensors():
    # The rule the guard relies on: foreach=None runs the single-tensor
    # kernel (the one replay matches) for CPU tensors; a device with foreach
    # kernels (CUDA) gets foreach, and is refused by the device guard first.
    from nonstop._multistep import _torch_picks_foreach
    assert not _torch_picks_foreach([torch.zeros(3), torch.zeros(2, 2)])
    if torch.cuda.is_available():
        assert _torch_picks_foreach([torch.zeros(3, device="cuda")])


# ---- kill -9 and resume ------------------------------------------------------

# dim 64: ~6.5K parameters, 7 blocks of 4 KiB, so parts 1..3 hold data and
# are replayed (tiny.make's default width fits in one block: only part 4 would).
KILL_STEPS, KILL_EVERY, KILL_DIM = 26, 5, 64


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    final = str(tmp_path_factory.mktemp("ref_dim64") / "final")
    ch.run("-", KILL_STEPS, 1, final, options={"dim": KILL_DIM})
    return final


@needs_engine
@multistep_core
@pytest.mark.parametrize("kill_after", [9, 14, 21])
def test_kill_and_resume_is_bitwise_identical(reference, tmp_path, kill_after):
    d, final = str(tmp_path / "ck"), str(tmp_path / "final")
    restored = ch.kill_then_resume(d, KILL_STEPS, KILL_EVERY, final, kill_after, pace=0.03,
                                   options={"mode": "multistep", "parts": 4,
                                            "medium": "buffered", "block_bytes": 4096,
                                            "dim": KILL_DIM})
    # Checkpoints due after steps 4, 9, 14, ... land at versions 7, 12, 17, ...
    assert restored is None or (restored - 7) % KILL_EVERY == 0
    assert restored is None or restored < kill_after
    ch.assert_same_final(reference, final)
