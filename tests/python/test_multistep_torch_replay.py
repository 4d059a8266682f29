"""mode="multistep" with replay="torch" (docs/MULTISTEP.md, "Replay"): the
checkpoint holds each part at the version it was copied at, the gradient log
and C++'s replay plan; restore() replays the plan with the training optimizer
itself on the device it restores to. Here the device is the CPU and torch's
CPU optimizer is the replay engine (the GPU run is tests/gpu/test_gpu_torch.py):
the restored state must equal the live state at the checkpoint's version bit
for bit, for AdamW and SGD (momentum, dampening, nesterov), foreach True and
False, K = 2..4, with state that appears mid-window; a SIGKILLed run must
resume to the uninterrupted run's final state; and every case where the
replay's assumptions cannot hold is refused in one line."""
import pytest
import torch
from conftest import needs_engine

import crash_harness as ch
import nonstop
from crash_harness import bits
from test_multistep import multistep_core, state_of


class Net(torch.nn.Module):
    # `late` comes first (part 1) and gets its first gradient inside the
    # window: its optimizer state appears mid-window (fresh in the plan).
    # With 4 KiB blocks the ~25K parameters make ~25 blocks, so every part
    # holds data and tensors straddle part boundaries.
    def __init__(self):
        super().__init__()
        self.late = torch.nn.Linear(13, 3)
        self.a = torch.nn.Linear(13, 97)
        self.b = torch.nn.Linear(97, 211)
        self.c = torch.nn.Linear(211, 3)
        self.unused = torch.nn.Linear(5, 5)  # never gets a gradient

    def forward(self, x, step):
        out = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return out + self.late(x) if step >= LATE else out


EVERY, LATE = 5, 6  # the first window begins after step 4; `late` joins at step 6

OPTIMIZERS = {
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, foreach=fe),
    "sgd_momentum": lambda ps, fe: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1,
                                                   weight_decay=1e-4, foreach=fe),
    "sgd_nesterov": lambda ps, fe: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                                   foreach=fe),
}


@pytest.fixture
def small_blocks(monkeypatch):
    from nonstop import _multistep
    monkeypatch.setattr(_multistep, "BLOCK_BYTES", 4 << 10)


def make(name, foreach):
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[name](list(model.parameters()), foreach)
    # A warm-up schedule: every replayed step has its own learning rate.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 12))
    return model, opt, sched


def checkpointer(d, model, opt, sched, parts, **kw):
    return nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": sched},
                                every=EVERY, mode="multistep", parts=parts, medium="buffered",
                                **kw)


def train(d, name, foreach, parts, steps, **kw):
    """Trains with replay='torch'; returns the live state after every step."""
    model, opt, sched = make(name, foreach)
    ckpt = checkpointer(d, model, opt, sched, parts, replay="torch", **kw)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 13, generator=g), torch.randn(32, 3, generator=g)
    truth = {}
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x + 0.01 * s, s), y).backward()
        opt.step()
        sched.step()
        ckpt.step(s)
        truth[s] = state_of(model, opt)
    ckpt.wait()
    stats = ckpt.stats()
    ckpt.close()
    assert [w["error"] for w in stats["recent"]] == [""] * len(stats["recent"])
    return truth


def restored(d, name, foreach, parts, step):
    model, opt, sched = make(name, foreach)
    ckpt = checkpointer(d, model, opt, sched, parts)
    try:
        assert ckpt.restore(step) == step
    finally:
        ckpt.close()
    return state_of(model, opt)


def differing(got, want):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return [k for k, w in want.items() if not torch.equal(bits(got[k]), bits(w))]


@needs_engine
@multistep_core
@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_restore_replays_to_the_live_state_bitwise(tmp_path, small_blocks, name, foreach, parts):
    d = str(tmp_path / "ck")
    version = EVERY - 1 + parts - 1  # the window begun after step 4
    truth = train(d, name, foreach, parts, steps=version + 2)
    assert differing(restored(d, name, foreach, parts, version), truth[version]) == []


@needs_engine
@multistep_core
def test_the_replay_is_what_makes_it_exact(tmp_path, small_blocks, monkeypatch):
    # Without the replay the restored tensors of parts 1..K-1 are the
    # versions they were copied at: the test above would fail.
    from nonstop import _multistep
    d, parts = str(tmp_path / "ck"), 3
    version = EVERY - 1 + parts - 1
    truth = train(d, "adamw", True, parts, steps=version + 2)
    monkeypatch.setattr(_multistep.MultistepMode, "restored", lambda *a: None)
    bad = differing(restored(d, "adamw", True, parts, version), truth[version])
    assert "model/a.weight" in bad and "optim/state/1/exp_avg" in bad, bad
    assert "model/c.weight" not in bad  # part K: copied at the version itself


@needs_engine
@multistep_core
def test_auto_picks_the_replay(tmp_path):
    model, opt, sched = make("adamw", None)
    ck = checkpointer(str(tmp_path / "a"), model, opt, sched, 2)
    assert ck.driver.replay == "host"  # CPU, single-tensor: src/optim's kernels
    ck.close()
    model, opt, sched = make("adamw", True)
    ck = checkpointer(str(tmp_path / "b"), model, opt, sched, 2)
    assert ck.driver.replay == "torch"
    ck.close()
    with pytest.raises(nonstop.CheckpointMismatchError, match="foreach"):
        checkpointer(str(tmp_path / "c"), model, opt, sched, 2, replay="host")
    with pytest.raises(nonstop.CheckpointMismatchError, match="replay= applies"):
        nonstop.Checkpointer(str(tmp_path / "d"), {"model": model}, replay="torch")
    # A flag that leaves the host's path later (as load_state_dict sets the
    # saved ones) is refused when the next window begins.
    model, opt, sched = make("adamw", None)
    ck = checkpointer(str(tmp_path / "e"), model, opt, sched, 2)
    try:
        opt.param_groups[0]["foreach"] = True
        model(torch.randn(4, 13), 0).sum().backward()
        opt.step()
        with pytest.raises(nonstop.CheckpointMismatchError, match="foreach=True"):
            ck.step(EVERY - 1)  # due: the window begins
    finally:
        ck.close()


# ---- refusals: where the replay's assumptions cannot hold ---------------------

def one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


@needs_engine
@multistep_core
def test_a_different_torch_device_or_optimizer_at_restore_is_refused(tmp_path, small_blocks,
                                                                      monkeypatch):
    d, parts = str(tmp_path / "ck"), 3
    version = EVERY - 1 + parts - 1
    train(d, "adamw", True, parts, steps=version + 2)

    def refused(foreach, *words, opt_of=None):
        model, opt, sched = make("adamw", foreach) if opt_of is None else opt_of()
        before = state_of(model, opt)
        ck = checkpointer(d, model, opt, sched, parts)
        try:
            with pytest.raises(nonstop.CheckpointMismatchError) as e:
                ck.restore()
            one_line(e, *words)
        finally:
            ck.close()
        assert differing(state_of(model, opt), before) == []  # nothing changed

    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "2.0.0+other")
        refused(True, "torch '2.13", "'2.0.0+other'", "restore it where it was trained")
    with monkeypatch.context() as m:
        m.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "OTHER")
        refused(True, "device", "cpu/OTHER")

    def sgd():
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    refused(None, "optimizer 'AdamW'", "'SGD'", opt_of=sgd)
    # Another mode cannot replay it; nonstop export refuses to write it as is.
    model, opt, sched = make("adamw", True)
    ck = nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": sched})
    try:
        with pytest.raises(nonstop.CheckpointMismatchError) as e:
            ck.restore()
        one_line(e, "restore it with mode='multistep'")
    finally:
        ck.close()
    with pytest.raises(nonstop.CheckpointMismatchError) as e:
        nonstop.export(d, str(tmp_path / "out.safetensors"))
    one_line(e, "replay='torch'")


@needs_engine
@multistep_core
def test_the_flags_are_the_checkpoints(tmp_path, small_blocks):
    # load_state_dict gives each group the saved foreach/fused flags before
    # the replay runs: an optimizer built with other flags replays (and goes
    # on training) with the ones training used.
    d, parts = str(tmp_path / "ck"), 3
    version = EVERY - 1 + parts - 1
    truth = train(d, "sgd_nesterov", True, parts, steps=version + 2)
    model, opt, sched = make("sgd_nesterov", False)
    ck = checkpointer(d, model, opt, sched, parts, replay="torch")
    try:
        assert ck.restore() == version
    finally:
        ck.close()
    assert opt.param_groups[0]["foreach"] is True
    assert differing(state_of(model, opt), truth[version]) == []


@needs_engine
@multistep_core
def test_what_the_torch_replay_cannot_reproduce_is_refused(tmp_path):
    torch.manual_seed(0)
    model = Net()

    def refused(opt, *words):
        with pytest.raises(nonstop.CheckpointMismatchError) as e:
            nonstop.Checkpointer(str(tmp_path / "x"), {"model": model, "optim": opt},
                                 mode="multistep", replay="torch")
        one_line(e, *words)

    refused(torch.optim.RMSprop(model.parameters()), "RMSprop", "mode='concurrent'")
    refused(torch.optim.Adagrad(model.parameters()), "Adagrad")
    refused(torch.optim.AdamW(model.parameters(), differentiable=True), "differentiable=True")
    refused(torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3)), "lr as a tensor")
    meta = Net().to("meta")
    refused(torch.optim.AdamW(meta.parameters(), foreach=True), "is on meta",
            "copies CPU and CUDA tensors")


@needs_engine
@multistep_core
def test_fused_with_grad_scaler_is_refused(tmp_path, small_blocks):
    # GradScaler steps a fused optimizer itself: its kernel unscales and
    # skips overflow steps inside, after the pre-hook logged them.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    ck = nonstop.Checkpointer(str(tmp_path / "a"), {"model": model, "optim": opt}, every=1,
                              mode="multistep", parts=2)
    assert ck.driver.replay == "torch"
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(8, 13)
    try:
        scaler.scale(model(x, 0).sum()).backward()
        with pytest.raises(nonstop.CheckpointMismatchError) as e:
            scaler.step(opt)
        one_line(e, "fused=False with GradScaler")
        scaler.unscale_(opt)  # unscaled first: GradScaler still steps it itself (found_inf)
        with pytest.raises(nonstop.CheckpointMismatchError):
            scaler.step(opt)
    finally:
        ck.close()


# ---- kill -9 mid-window and resume ---------------------------------------------

# dim 64: ~6.5K parameters, 7 blocks of 4 KiB, so parts 1 and 2 hold data
# and are replayed (the default dim fits in one block: only part 3 would).
KILL_STEPS, KILL_EVERY, KILL_DIM = 24, 5, 64


@pytest.fixture(scope="module")
def foreach_reference(tmp_path_factory):
    final = str(tmp_path_factory.mktemp("ref_foreach") / "final")
    ch.run("-", KILL_STEPS, 1, final, options={"foreach": 1, "dim": KILL_DIM})
    return final


@needs_engine
@multistep_core
@pytest.mark.parametrize("kill_after", [13, 16])
def test_kill_mid_window_and_resume_is_bitwise(foreach_reference, tmp_path, kill_after):
    # parts=3, every 5: windows begin after steps 4, 9, 14, 19 and land at
    # versions 6, 11, 16, 21. kill_after=16 kills inside the window begun
    # after step 14 (its parts 1..2 copied, part 3 not); 13 between windows.
    d, final = str(tmp_path / "ck"), str(tmp_path / "final")
    got = ch.kill_then_resume(d, KILL_STEPS, KILL_EVERY, final, kill_after, pace=0.03,
                              options={"mode": "multistep", "parts": 3, "medium": "buffered",
                                       "block_bytes": 4096, "replay": "torch", "foreach": 1,
                                       "dim": KILL_DIM})
    assert got is not None and (got - 6) % KILL_EVERY == 0 and got < kill_after, got
    ch.assert_same_final(foreach_reference, final)
