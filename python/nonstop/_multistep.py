"""mode="multistep": GoCkpt's multi-step overlapped checkpoints for a torch.optim
AdamW / Adam / SGD. The schedule, the replay plan and what the mode accepts are
C++ (_core.Multistep, ChooseMultistep: include/nonstop/multistep.h); this module
describes the optimizer, drives the paper's hooks from its step pre/post-hooks
and zero_grad, and runs replay="torch" at restore with the training optimizer.
docs/MULTISTEP.md: the hooks, skipped steps, the window's versions, both replays."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

try:  # torch's own rule for foreach=None (a private function of torch)
    from torch.optim.optimizer import _default_to_fused_or_foreach
except ImportError:
    _default_to_fused_or_foreach = None

from . import _ext, _state
from ._session import Driver
from .errors import CheckpointMismatchError

BLOCK_BYTES = 4 << 20  # parameter bytes per block (GoCkpt's); tests lower it
_ADAM = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # the states a window copies
_ROLES = {"sgd": ("momentum_buffer",), "adam": _ADAM, "adamw": _ADAM}
# Hyperparameters the plan sets per step (as torch's param_groups name them).
_HYPER = ("lr", "weight_decay", "maximize", "betas", "eps", "momentum", "dampening", "nesterov")


def _describe(opt) -> tuple:
    """The optimizer as plain values for ChooseMultistep (nonstop/multistep.h)."""
    groups = []
    for g in opt.param_groups:
        held = [k for k in _HYPER if isinstance(g.get(k), torch.Tensor) or (
            isinstance(g.get(k), tuple) and any(isinstance(x, torch.Tensor) for x in g[k]))]
        foreach = g.get("foreach")
        groups.append((bool(g.get("fused")), bool(g.get("capturable")),
                       bool(g.get("differentiable")), foreach,
                       foreach is None and _torch_picks_foreach(g["params"]),
                       bool(g.get("amsgrad")), bool(g.get("decoupled_weight_decay")),
                       held[0] if held else ""))
    params = [p for g in opt.param_groups for p in g["params"]]
    tensors = [(i, "", str(p.device), str(p.dtype).replace("torch.", ""), p.is_contiguous())
               for i, p in enumerate(params)]  # the parameters, then their states
    tensors += [(i, key, str(v.device), "", True) for i, p in enumerate(params)
                for key, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)]
    torch_class = type(opt) in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
    return type(opt).__name__, torch_class, groups, tensors


def _arithmetic(opt, dev: torch.device) -> dict:
    """What a replay with the training optimizer depends on: torch, the device
    (the GPU's model, or the CPU kernels' instruction set), the optimizer's class."""
    name = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
            else f"cpu/{torch.backends.cpu.get_cpu_capability()}")
    return {"torch": torch.__version__, "device": dev.type, "device_name": name,
            "optimizer": type(opt).__name__}


def _torch_picks_foreach(params: list) -> bool:
    """Whether torch runs the foreach kernel for a group built with foreach=None
    over `params` (torch's own rule: never for CPU tensors)."""
    if _default_to_fused_or_foreach is None:  # another torch: decide by device, as torch 2.x does
        return any(p.device.type != "cpu" for p in params)
    return bool(_default_to_fused_or_foreach(list(params), False, False)[1])


class MultistepMode(Driver):
    """Drives nonstop._core.Multistep, the session's engine (wait_copied,
    wait_committed, latest, adopt_restored, stats, close)."""

    handles = False  # step() returns the step a window began at; save() None

    def __init__(self, session, o):
        super().__init__(session)
        m = o.mode
        opts = [x for x in session.state.values() if isinstance(x, torch.optim.Optimizer)]
        if len(opts) != 1:
            raise CheckpointMismatchError("mode='multistep' needs exactly one torch.optim "
                                          f"optimizer in state, found {len(opts)}")
        if not isinstance(m.parts, int) or not 1 <= m.parts <= 64:
            raise CheckpointMismatchError(f"parts must be an integer in 1..64, got {m.parts!r}")
        self.opt = opts[0]
        self._check(m.replay)  # and the replay= value (ChooseMultistep)
        self.parts, self.overlap = m.parts, bool(m.overlap_gradients)
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(self.opt.param_groups) for _ in g["params"]]
        # gradients being copied (GoCkpt-O), the optimizer's hooks, its zero_grad
        self._held, self._hooks, self._orig_zero_grad = [], [], None

    def open_engine(self, kw: dict):
        """The Multistep core (self.core), which owns its Engine."""
        # torch's own fp32 sqrt (MKL vmsSqrt) for a bitwise Adam replay; 0 if absent
        lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        sqrt = _ext.core().optim.find_mkl_vms_sqrt(lib) if os.path.exists(lib) else 0
        # (engine options it does not take yet are refused there unless unset)
        self.core = _ext.core().Multistep(dir=self.session.dir, parts=self.parts,
                                          overlap_gradients=self.overlap, block_bytes=BLOCK_BYTES,
                                          replay="restore" if self._cuda else "host",
                                          mkl_vms_sqrt=sqrt, **kw)
        self._replaying = False  # restore's replay: the hooks stand aside
        self._hooks = [self.opt.register_step_pre_hook(self._pre),
                       self.opt.register_step_post_hook(self._post)]
        if self.overlap:
            self._orig_zero_grad = self.opt.zero_grad
            self.opt.zero_grad = self._zero_grad  # instance attribute; removed by detach()
        return self.core

    def _check(self, replay: str) -> None:
        """ChooseMultistep (C++) over the optimizer now: the replay, algorithm,
        amsgrad and device, or one line (again at each window's start)."""
        self.replay, self.algorithm, self.amsgrad, device = _ext.core().multistep_choose(
            *_describe(self.opt), replay)
        self._cuda = self.replay == "torch"
        self.device = torch.device(device)

    def _stream(self) -> int:
        """The CUDA stream the optimizer updates on: the copies wait for it."""
        cuda = self.device.type == "cuda"
        return torch.cuda.current_stream(self.device).cuda_stream if cuda else 0

    # ---------------------------------------------------------------- hooks

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.session.visible_stall_s += time.perf_counter() - t0

    def _pre(self, optimizer, args, kwargs):
        if self._replaying:
            return
        # One optimizer.step() per ckpt.step() while a window is open; GradScaler
        # stepping a fused optimizer itself is refused for replay="torch" (C++).
        self.core.count_update(getattr(optimizer, "found_inf", None) is not None
                               or getattr(optimizer, "grad_scale", None) is not None
                               or "grad_scaler" in kwargs)
        self._release_copied()
        if not self.core.active:
            return
        grads, held = [], []
        clone = self._cuda and self.overlap
        for p in self.params:
            g = p.grad
            if g is None:
                grads.append((0, 7))
                continue
            if g.is_sparse or not g.is_contiguous():
                raise CheckpointMismatchError("mode='multistep' needs dense contiguous gradients")
            if clone:
                # torch's foreach kernels may change gradients in place during the update (SGD
                # nesterov: _foreach_add_(grads, bufs)); the overlapped copy reads a snapshot taken
                # before it (on CUDA a device-to-device copy on the optimizer's stream).
                g = g.detach().clone()
            grads.append((g.data_ptr(), _state.torch_dtype_code(g.dtype)))
            held.append(g)
        # the groups' hyperparameters as the optimizer is about to use them
        self._timed(self.core.on_update_begin, self.core.next_step, self.opt.param_groups, False,
                    grads, str(self.device), self._stream())
        if self.overlap:
            self._held.append(held)

    def _post(self, optimizer, args, kwargs):
        if self.core.active and not self._replaying:
            refreshed = self._tensors() if self.core.needs_refresh else None
            self._timed(self.core.on_update_end, self.core.next_step, refreshed)

    def _zero_grad(self, set_to_none: bool = True):
        # set_to_none=True drops the optimizer's reference (ours keeps the memory alive until
        # copied): nothing waits. Zeroing in place waits for the copies (on_backward_begin).
        if self._held and not set_to_none:
            self._timed(self.core.on_backward_begin)
            self._held.clear()
        return self._orig_zero_grad(set_to_none)

    def _release_copied(self):
        if self._held and not self.core.gradient_copies_pending():
            self._held.clear()

    # --------------------------------------------------------------- per step

    def step(self, step: int) -> Optional[int]:
        """ckpt.step(step): after the update of `step` (or its skip); every
        step drives the window (C++ MarkStep: skipped steps, when one begins)."""
        t0, due = time.perf_counter(), self.session.due_after(step)
        started = step if self.core.mark_step(step, due) else None
        if started is not None:
            self._begin(step)
        if self.core.outputs_due:
            self._set_outputs(step)
        self._release_copied()
        self.session.visible_stall_s += time.perf_counter() - t0
        return started

    def save(self, step: int) -> None:
        """ckpt.save(step): begins a window now (or when the open one closes);
        the checkpoint is of version step + parts - 1."""
        t0 = time.perf_counter()
        if self.core.request_checkpoint():  # else when the open window closes
            self._begin(step)
            if self.core.outputs_due:
                self._set_outputs(step)
        self.session.visible_stall_s += time.perf_counter() - t0

    def _tensors(self) -> list:
        self._check(self.replay)
        out = []
        for i, p in enumerate(self.params):
            st = self.opt.state.get(p, {})
            ptr = {k: v.data_ptr() for k, v in st.items() if isinstance(v, torch.Tensor)}
            step = st.get("step")  # Adam's (a CUDA counter: synchronises)
            out.append((f"param{i}", p.numel(), self._group_of[i], str(self.device), p.data_ptr(),
                        ptr.get("exp_avg", 0), ptr.get("exp_avg_sq", 0),
                        ptr.get("max_exp_avg_sq", 0) if self.amsgrad else 0,
                        ptr.get("momentum_buffer", 0), 0.0 if step is None else float(step)))
        return out

    def _begin(self, step: int) -> None:
        self.core.begin(step, self.algorithm, self.amsgrad, self._tensors(), self._stream())
        self.session.saves += 1

    def _set_outputs(self, step: int) -> None:
        """The checkpoint of version `step`: C++ (SetOutputs) points the optimizer's
        tensors at the reconstructed buffers and copies the rest now."""
        tensors: dict = {}
        meta = self.session.meta(step, tensors)  # metrics=: step(step, metrics=) of this version
        if self._cuda:  # what restore's replay must find again (replay_check)
            meta["multistep"] = dict(_arithmetic(self.opt, self.device), replay="torch", groups=[
                {k: g[k] for k in ("foreach", "fused", "capturable", "amsgrad",
                                   "decoupled_weight_decay") if k in g}
                for g in self.opt.param_groups])
        outputs, keep = [], []  # keep: contiguous copies, alive until copied
        for name, t in tensors.items():  # each tensor's device checked by set_outputs
            t = t.contiguous()
            keep.append(t)
            nbytes = t.numel() * t.element_size()
            outputs.append((name, _state.torch_dtype_code(t.dtype), list(t.shape), nbytes,
                            t.data_ptr() if nbytes else 0, str(t.device)))
        self.core.set_outputs(outputs, _state.dumps(meta), self._stream())

    # ---------------------------------------------------------- restoring

    def emergency(self, step: int) -> None:
        return None  # a window cannot be cut short: what is in flight is kept

    def wait(self) -> None:
        self.session.wait(committed=True, take=False)

    def replay_check(self, meta: dict, tensors: dict, where: str) -> None:
        """Before restore() changes anything: whether this run can replay a
        checkpoint whose parts are at their own versions (CheckMultistepRestore;
        docs/MULTISTEP.md, "How restore replays")."""
        _ext.core().multistep_restore_check(
            _state.dumps(meta.get("multistep")), _state.dumps(meta.get("multistep_plan")),
            **_arithmetic(self.opt, self.device), groups=len(self.opt.param_groups),
            param_numel=[p.numel() for p in self.params],
            tensors={n: t.numel() for n, t in tensors.items() if isinstance(t, torch.Tensor)},
            where=where)

    def restored(self, loaded) -> None:
        """Brings a loaded checkpoint's parts at their own versions (its
        "multistep_plan") to its version with the training optimizer."""
        if "multistep_plan" not in loaded.meta:
            return
        opt, params = self.opt, self.params
        groups = [{k: g[k] for k in _HYPER if k in g} for g in opt.param_groups]
        grads = [p.grad for p in params]
        counters = [(st["step"], st["step"].clone())
                    for st in (opt.state.get(p, {}) for p in params)
                    if isinstance(st.get("step"), torch.Tensor)]
        self._replaying = True
        try:
            with torch.no_grad():
                for step in loaded.meta["multistep_plan"]["steps"]:
                    if not step["skipped"] and step["updates"]:
                        self._replay_step(step, loaded.tensors)
        finally:
            self._replaying = False
            for g, h in zip(opt.param_groups, groups):
                g.update(h)
            for p, g in zip(params, grads):
                p.grad = g
            for counter, saved in counters:  # the saved step counters
                counter.copy_(saved)

    def _replay_step(self, step: dict, tensors: dict) -> None:
        opt, params, roles = self.opt, self.params, _ROLES[self.algorithm]
        for g, h in zip(opt.param_groups, step["groups"]):
            for k, v in ((k, v) for k, v in h.items() if k in g):
                if k == "betas":  # JSON writes 0.0 as 0: the types torch saw in training
                    v = tuple(type(o)(x) for o, x in zip(g[k], v))
                elif isinstance(g[k], float) and not isinstance(v, bool):
                    v = float(v)
                g[k] = v
        for p in params:
            p.grad = None
        after = []  # (tensor, elements kept, their values), put back after the step
        fresh = []  # SGD: (param, buffer) whose momentum did not exist yet
        for u in step["updates"]:
            p, n = params[u["tensor"]], u["elements"]
            logged = tensors[u["gradient"]]
            p.grad = torch.zeros(p.shape, dtype=logged.dtype, device=p.device)
            p.grad.view(-1)[:n].copy_(logged.reshape(-1))
            st = opt.state[p]
            for t in [p] + [st[r] for r in roles if isinstance(st.get(r), torch.Tensor)]:
                if n < t.numel():
                    after.append((t, n, t.view(-1)[n:].clone()))
            if isinstance(st.get("step"), torch.Tensor):
                st["step"].fill_(u["count"])
            if u["fresh"] and isinstance(st.get("momentum_buffer"), torch.Tensor):
                fresh.append((p, n, st.pop("momentum_buffer")))
        opt.step()
        for t, n, kept in after:
            t.view(-1)[n:].copy_(kept)
        for p, n, buf in fresh:  # torch made a new buffer (a clone of the gradient)
            buf.view(-1)[:n].copy_(opt.state[p]["momentum_buffer"].view(-1)[:n])
            opt.state[p]["momentum_buffer"] = buf

    def add_stats(self, s: dict) -> None:
        s.update(mode="multistep", parts=self.parts, overlap_gradients=self.overlap)

    def detach(self) -> None:  # the core (the session's engine) is closed by Session.shut
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._orig_zero_grad is not None:
            self.opt.__dict__.pop("zero_grad", None)  # the class's zero_grad again
            self._orig_zero_grad = None
        self._held.clear()
