"""CPU optimizer replay (nonstop._core.optim) against torch's own optimizers.

Trains small models on CPU with torch.optim, snapshots the state at step v,
records every later step's gradients and hyperparameters (with skipped steps
as GradScaler would skip them), replays the log from the snapshot with the C++
kernels and asserts the result is bitwise identical to torch's state at v+k.
"""
import os

import pytest

torch = pytest.importorskip("torch")
core = pytest.importorskip("nonstop._core")
optim_core = core.optim

# torch's x86 wheels take fp32 sqrt from MKL (vmsSqrt, not correctly rounded);
# replay calls that same function when torch exports it.
TORCH_SQRT = optim_core.find_mkl_vms_sqrt(
    os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))


def bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.int32),
                                              b.contiguous().view(torch.int32))


def max_ulp(a, b):
    ia = a.contiguous().view(torch.int32).to(torch.int64)
    ib = b.contiguous().view(torch.int32).to(torch.int64)
    # Map sign-magnitude to a monotone integer line.
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


class Model(torch.nn.Module):
    # Sizes chosen so no parameter is a multiple of the vector widths, and one
    # is larger than ATen's 32768-element grain (it splits across threads).
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(13, 211)
        self.b = torch.nn.Linear(211, 197)
        self.c = torch.nn.Linear(197, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def algorithm_of(opt):
    if isinstance(opt, torch.optim.AdamW):
        return "adamw"
    if isinstance(opt, torch.optim.Adam):
        return "adamw" if opt.param_groups[0].get("decoupled_weight_decay") else "adam"
    if isinstance(opt, torch.optim.SGD):
        return "sgd"
    raise AssertionError(type(opt))


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = []
    for p in model.parameters():
        st = opt.state.get(p, {})
        state.append({k: (v.detach().clone() if torch.is_tensor(v) else v)
                      for k, v in st.items()})
    return params, state


def part_state(algorithm, param, st, amsgrad):
    """Host buffers (fp32, contiguous) for one parameter's part, from a snapshot."""
    zeros = lambda: torch.zeros_like(param)  # noqa: E731
    bufs = {"param": param.clone()}
    if algorithm in ("adam", "adamw"):
        bufs["exp_avg"] = st["exp_avg"].clone() if "exp_avg" in st else zeros()
        bufs["exp_avg_sq"] = st["exp_avg_sq"].clone() if "exp_avg_sq" in st else zeros()
        if amsgrad:
            bufs["max_exp_avg_sq"] = (st["max_exp_avg_sq"].clone() if "max_exp_avg_sq" in st
                                      else zeros())
        step = float(st["step"].item()) if "step" in st else 0.0
        has_buf = False
    else:
        mb = st.get("momentum_buffer")
        bufs["momentum_buffer"] = mb.clone() if mb is not None else zeros()
        has_buf = mb is not None
        step = 0.0
    view = {k: v.data_ptr() for k, v in bufs.items()}
    view.update(numel=param.numel(), step=step, has_momentum_buffer=has_buf)
    return bufs, view


def train(opt_factory, *, warm_steps, replay_steps, skip=(), grad_dtype=None,
          sched_factory=None, seed=0):
    """Runs warm_steps, snapshots, runs replay_steps while logging; returns all."""
    torch.manual_seed(seed)
    model = Model()
    opt = opt_factory(model.parameters())
    sched = sched_factory(opt) if sched_factory else None
    x = torch.randn(64, 13)
    y = torch.randn(64, 3)

    def one_step(log=None, skipped=False):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x + 0.01 * torch.randn_like(x)), y)
        loss.backward()
        low = None
        if grad_dtype is not None:
            # Mixed precision with fp32 master weights: the optimizer consumes
            # the exact upcast of a low-precision gradient.
            low = [p.grad.to(grad_dtype) for p in model.parameters()]
            for p, g in zip(model.parameters(), low):
                p.grad = g.float()
        if log is not None:
            group = opt.param_groups[0]
            entry = {k: group[k] for k in ("lr", "weight_decay", "maximize")}
            if "betas" in group:
                entry.update(betas=tuple(float(b) for b in group["betas"]), eps=group["eps"])
            else:
                entry.update(momentum=group["momentum"], dampening=group["dampening"],
                             nesterov=group["nesterov"])
            entry["skipped"] = skipped
            grads = low if low is not None else [p.grad.detach().clone()
                                                 for p in model.parameters()]
            log.append((entry, grads))
        if skipped:
            # GradScaler found an inf: it skips optimizer.step() entirely.
            for p in model.parameters():
                p.grad.fill_(float("inf"))
        else:
            opt.step()
        if sched is not None:
            sched.step()

    for _ in range(warm_steps):
        one_step()
    snap = snapshot(model, opt)
    log = []
    for i in range(replay_steps):
        one_step(log, skipped=i in skip)
    return model, opt, snap, log


def replay_and_compare(model, opt, snap, log, *, num_threads=0, block_elements=8192,
                       require_bitwise=True):
    algorithm = algorithm_of(opt)
    amsgrad = bool(opt.param_groups[0].get("amsgrad", False))
    params0, states0 = snap
    worst = 0
    for idx, (p_true, p0, st0) in enumerate(zip(model.parameters(), params0, states0)):
        bufs, view = part_state(algorithm, p0, st0, amsgrad)
        steps = []
        for entry, grads in log:
            g = grads[idx]
            steps.append(dict(entry, grad=g.data_ptr(), grad_dtype=str(g.dtype)[6:]))
        out = optim_core.replay(algorithm, view, steps, amsgrad=amsgrad,
                                num_threads=num_threads, block_elements=block_elements,
                                mkl_vms_sqrt=TORCH_SQRT)
        st_true = opt.state[p_true]
        pairs = [("param", p_true.detach())]
        if algorithm == "sgd":
            if st_true.get("momentum_buffer") is not None:
                assert out["has_momentum_buffer"]
                pairs.append(("momentum_buffer", st_true["momentum_buffer"]))
        else:
            if require_bitwise:
                assert out["step"] == st_true["step"].item()
            pairs += [("exp_avg", st_true["exp_avg"]), ("exp_avg_sq", st_true["exp_avg_sq"])]
            if amsgrad:
                pairs.append(("max_exp_avg_sq", st_true["max_exp_avg_sq"]))
        for name, want in pairs:
            got = bufs[name]
            worst = max(worst, max_ulp(got, want))
            if require_bitwise:
                assert bits_equal(got, want), (
                    f"param {idx} {name}: max {max_ulp(got, want)} ULP from torch")
    return worst


CONFIGS = {
    "adamw": dict(factory=lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "adamw_warmup_wd": dict(
        factory=lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
        sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 5))),
    "adam_l2_amsgrad": dict(
        factory=lambda ps: torch.optim.Adam(ps, lr=2e-3, weight_decay=0.01, amsgrad=True)),
    "adam_maximize_small_beta1": dict(
        factory=lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.3, 0.99), maximize=True)),
    "adamw_amsgrad_cosine": dict(
        factory=lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05, amsgrad=True),
        sched=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7)),
    "sgd_momentum_nesterov_wd": dict(
        factory=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                           weight_decay=1e-4)),
    "sgd_dampening_maximize": dict(
        factory=lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.8, dampening=0.1,
                                           maximize=True, weight_decay=1e-3)),
    "sgd_plain_step_lr": dict(
        factory=lambda ps: torch.optim.SGD(ps, lr=0.1),
        sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_replay_is_bitwise_identical_to_torch(name):
    cfg = CONFIGS[name]
    model, opt, snap, log = train(cfg["factory"], warm_steps=3, replay_steps=7, skip=(2, 5),
                                  sched_factory=cfg.get("sched"))
    assert replay_and_compare(model, opt, snap, log) == 0


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum_nesterov_wd"])
def test_replay_from_fresh_state(name):
    # Version 0: no optimizer state yet (Adam's moments are zero, step 0; SGD's
    # momentum buffer is None and the first step copies the gradient).
    cfg = CONFIGS[name]
    model, opt, snap, log = train(cfg["factory"], warm_steps=0, replay_steps=4, skip=(0,))
    assert replay_and_compare(model, opt, snap, log) == 0


@pytest.mark.parametrize("threads,block", [(1, 0), (2, 1000), (3, 33), (2, 0)])
def test_thread_and_block_splits_match_torch(threads, block):
    cfg = CONFIGS["adamw_warmup_wd"]
    model, opt, snap, log = train(cfg["factory"], warm_steps=2, replay_steps=5, skip=(1,),
                                  sched_factory=cfg["sched"])
    assert replay_and_compare(model, opt, snap, log, num_threads=threads,
                              block_elements=block) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients(dtype):
    model, opt, snap, log = train(lambda ps: torch.optim.AdamW(ps, lr=1e-3), warm_steps=2,
                                  replay_steps=4, skip=(3,), grad_dtype=dtype)
    assert replay_and_compare(model, opt, snap, log) == 0


def test_skipped_steps_are_not_applied():
    cfg = CONFIGS["adamw"]
    model, opt, snap, log = train(cfg["factory"], warm_steps=2, replay_steps=4, skip=(1, 2))
    # Replaying the skipped steps as if applied must differ from torch.
    # (finite gradients in place of what GradScaler saw as inf)
    forced = [(dict(entry, skipped=False),
               [g.clone().normal_() for g in grads] if entry["skipped"] else grads)
              for entry, grads in log]
    worst = replay_and_compare(model, opt, snap, forced, require_bitwise=False)
    assert worst > 0
    # Skipping them, as logged, matches torch bit for bit.
    assert replay_and_compare(model, opt, snap, log) == 0
    # Only skipped steps: nothing changes, the step count stays.
    params0, states0 = snap
    bufs, view = part_state("adamw", params0[0], states0[0], False)
    out = optim_core.replay("adamw", view, [dict(log[1][0], grad=None)])
    assert out["step"] == states0[0]["step"].item()
    assert bits_equal(bufs["param"], params0[0])


@pytest.mark.parametrize("numel", [1, 7, 16, 31, 32, 33, 63, 65, 1000, 32769, 100003])
@pytest.mark.parametrize("opt_name", ["adamw", "adam_l2", "sgd"])
def test_single_step_tails_and_bodies(numel, opt_name):
    """ATen's vectorised body and scalar tail must both be matched."""
    gen = torch.Generator().manual_seed(numel)
    p = torch.nn.Parameter(torch.randn(numel, generator=gen))
    if opt_name == "sgd":
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    elif opt_name == "adam_l2":
        opt = torch.optim.Adam([p], lr=0.01, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.01)
    grads = [torch.randn(numel, generator=gen) * 3 for _ in range(3)]
    p.grad = grads[0]
    opt.step()
    snap = ([p.detach().clone()], [{k: v.clone() if torch.is_tensor(v) else v
                                    for k, v in opt.state[p].items()}])
    log = []
    for g in grads[1:]:
        p.grad = g
        group = opt.param_groups[0]
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["skipped"] = False
        log.append((entry, [g]))
        opt.step()

    class One:
        def parameters(self):
            return [p]
    assert replay_and_compare(One(), opt, snap, log) == 0


def test_bad_input_raises_and_leaves_buffers():
    p = torch.randn(10)
    m = torch.zeros(10)
    v = torch.zeros(10)
    view = dict(numel=10, param=p.data_ptr(), exp_avg=m.data_ptr(), exp_avg_sq=v.data_ptr(),
                step=4.0)
    before = p.clone()
    with pytest.raises(ValueError, match="gradient is null"):
        optim_core.replay("adamw", view, [dict(lr=1e-3)])
    with pytest.raises(ValueError, match="step count"):
        g = torch.randn(10)
        optim_core.replay("adamw", view, [dict(lr=1e-3, grad=g.data_ptr(), step=9)])
    with pytest.raises(ValueError, match="algorithm"):
        optim_core.replay("lion", view, [])
    assert bits_equal(p, before)
    assert optim_core.kernel_isa() in ("avx512", "avx2", "generic")
