"""mode="multistep": GoCkpt's multi-step overlapped checkpoints for a
torch.optim AdamW / Adam / SGD optimizer (docs/MULTISTEP.md).

The schedule lives in C++ (nonstop._core.Multistep, include/nonstop/multistep.h);
this module only finds the tensors and drives the paper's hooks:

* on_update_begin: the optimizer's step pre-hook. Gradients are final there
  (after GradScaler's unscale_ and any clipping), and the hyperparameters are
  read from optimizer.param_groups as the optimizer is about to use them.
* on_update_end: the step post-hook.
* on_backward_begin (GoCkpt-O): gradients are copied while the update and the
  next forward run. This module holds a reference to every gradient being
  copied, so zero_grad(set_to_none=True) (the default) cannot free its
  memory; optimizer.zero_grad() is wrapped so that zero_grad(set_to_none=False),
  which zeroes in place, first waits for the copies.
* Skipped steps: GradScaler does not call optimizer.step() when it finds
  inf/NaN, so neither hook runs. A step is therefore skipped when no
  optimizer.step() ran between two ckpt.step() calls; it is logged as
  skipped and replay applies nothing for it (torch's step count does not
  advance either). ckpt.step() must be called once per training step.

A checkpoint due after step N (every `every` steps, as in concurrent mode)
is copied during steps N+1..N+K and is the state at version N+K-1: its
tensors the optimizer owns (parameters and their optimizer states) are
brought to that version by a replay of the logged gradients; everything
else (buffers, schedulers, RNG, plain data, Adam's step counters) is
captured at the end of step N+K-1.

Two replays (replay=, docs/MULTISTEP.md "Replay"):

* "host": src/optim's CPU kernels in the background (bitwise torch's
  single-tensor CPU path): the checkpoint on disk is the plain state.
* "torch": at restore, with the training optimizer itself on the device it
  restores to (GPU training, foreach/fused kernels). The checkpoint holds the
  parts at their versions, the gradient log and C++'s replay plan
  ("multistep_plan"); restore() applies the plan (replay_restored).
"""
from __future__ import annotations

import functools
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
from .errors import CheckpointMismatchError, CorruptCheckpointError

REPLAYS = ("auto", "host", "torch")
# Parameter bytes per block (GoCkpt: 4 MiB). Tests lower it to get many parts
# out of a small model.
BLOCK_BYTES = 4 << 20
_ROLES_ADAM = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _mkl_vms_sqrt() -> int:
    """torch's own fp32 sqrt (MKL vmsSqrt) for bitwise Adam replay; 0 if absent."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    return _ext.core().optim.find_mkl_vms_sqrt(lib) if os.path.exists(lib) else 0


def algorithm_of(opt) -> str:
    """'adamw', 'adam' or 'sgd'; a one-line error for anything else."""
    name, algo = type(opt).__name__, _algorithm(opt)
    if algo is None:
        raise CheckpointMismatchError(
            f"mode='multistep' replays torch.optim.AdamW, Adam and SGD on the CPU; the optimizer "
            f"{name} is not supported: use mode='concurrent'")
    for i, g in enumerate(opt.param_groups):
        for flag in ("fused", "capturable", "differentiable"):
            if g.get(flag):
                raise CheckpointMismatchError(
                    f"mode='multistep': {name} param_groups[{i}] has {flag}=True; replay matches "
                    f"the single-tensor path only: construct it with {flag}=False")
        if g.get("foreach"):
            raise CheckpointMismatchError(
                f"mode='multistep': {name} param_groups[{i}] has foreach=True; replay matches the "
                f"single-tensor path only: construct it with foreach=False or None")
        if g.get("foreach") is None and _torch_picks_foreach(g["params"]):
            raise CheckpointMismatchError(
                f"mode='multistep': {name} param_groups[{i}] has foreach=None and torch picks "
                f"the foreach kernel for its tensors; replay matches the single-tensor path "
                f"only: use mode='concurrent' or mode='layerwise'")
        if algo != "sgd" and bool(g.get("amsgrad")) != bool(opt.param_groups[0].get("amsgrad")):
            raise CheckpointMismatchError(
                f"mode='multistep': {name} groups differ in amsgrad; use one setting")
        if algo != "sgd" and bool(g.get("decoupled_weight_decay")) != bool(
                opt.param_groups[0].get("decoupled_weight_decay")):
            raise CheckpointMismatchError(
                f"mode='multistep': {name} groups differ in decoupled_weight_decay")
    return algo


def _group_hyper(g: dict) -> dict:
    h = {"lr": float(g["lr"]), "weight_decay": float(g.get("weight_decay", 0.0)),
         "maximize": bool(g.get("maximize", False))}
    if "betas" in g:
        h["betas"] = (float(g["betas"][0]), float(g["betas"][1]))
        h["eps"] = float(g["eps"])
    else:
        h.update(momentum=float(g.get("momentum", 0.0)), dampening=float(g.get("dampening", 0.0)),
                 nesterov=bool(g.get("nesterov", False)))
    return h


def _device(t: torch.Tensor, what: str = "a parameter", cuda: bool = False):
    """The engine's (kind, index) of a tensor the schedule copies.

    replay="host" applies the CPU's single-tensor kernels (x86/MKL
    arithmetic, src/optim) to the state; for tensors a GPU updates, the CUDA
    kernels' results differ in the last bits, so it takes CPU tensors only.
    replay="torch" (`cuda`) replays with torch's own optimizer on the device
    at restore and takes CUDA tensors too (docs/MULTISTEP.md, "Replay")."""
    if t.device.type == "cuda" and cuda:
        return 1, t.device.index or 0
    if t.device.type != "cpu":
        if cuda:
            raise CheckpointMismatchError(
                f"mode='multistep' copies CPU and CUDA tensors, but {what} is on {t.device}: "
                f"use mode='concurrent'")
        raise CheckpointMismatchError(
            f"mode='multistep' with replay='host' replays the optimizer on the CPU and needs CPU "
            f"tensors, but {what} is on {t.device}: use replay='torch' (or 'auto') for GPU "
            f"training")
    return 0, 0


# Hyperparameters the plan sets per step (as torch's param_groups name them).
_HYPER = ("lr", "weight_decay", "maximize", "betas", "eps", "momentum", "dampening", "nesterov")


def torch_replay_check(opt) -> str:
    """replay="torch": 'adamw', 'adam' or 'sgd' where a replay through the
    training optimizer itself reproduces training bit for bit; a one-line
    error where it cannot (docs/MULTISTEP.md, "Why it is exact")."""
    name, algo = type(opt).__name__, _algorithm(opt)
    if algo is None:
        raise CheckpointMismatchError(
            f"mode='multistep' replays torch.optim.AdamW, Adam and SGD (elementwise, no "
            f"coupling between parameters); the optimizer {name} is not supported: use "
            f"mode='concurrent'")
    for i, g in enumerate(opt.param_groups):
        if g.get("differentiable"):
            raise CheckpointMismatchError(
                f"mode='multistep': {name} param_groups[{i}] has differentiable=True; the "
                f"replay runs under no_grad: construct it with differentiable=False")
        for key in _HYPER:
            v = g.get(key)
            if isinstance(v, torch.Tensor) or (isinstance(v, tuple) and any(
                    isinstance(x, torch.Tensor) for x in v)):
                raise CheckpointMismatchError(
                    f"mode='multistep': {name} param_groups[{i}] holds {key} as a tensor; the "
                    f"replay logs hyperparameters as numbers: use a float")
    return algo


def _algorithm(opt) -> Optional[str]:
    """'adamw' (AdamW, or Adam with decoupled_weight_decay), 'adam', 'sgd', or None."""
    if type(opt) is torch.optim.SGD:
        return "sgd"
    if type(opt) not in (torch.optim.AdamW, torch.optim.Adam):
        return None
    adamw = type(opt) is torch.optim.AdamW or opt.param_groups[0].get("decoupled_weight_decay")
    return "adamw" if adamw else "adam"


def _device_name(dev: torch.device) -> str:
    """What the replay's arithmetic depends on besides torch: the GPU model,
    or the CPU kernels' instruction set."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu/{torch.backends.cpu.get_cpu_capability()}"


def _flags(opt) -> list:
    return [{k: g.get(k) for k in ("foreach", "fused", "capturable", "amsgrad",
                                   "decoupled_weight_decay") if k in g}
            for g in opt.param_groups]


def _torch_picks_foreach(params: list) -> bool:
    """Whether torch runs the foreach kernel for an optimizer group built
    with foreach=None over `params` (torch's own rule: only for tensors on
    devices with foreach kernels, never for CPU tensors)."""
    if _default_to_fused_or_foreach is None:  # another torch: decide by device, as torch 2.x does
        return any(p.device.type != "cpu" for p in params)
    return bool(_default_to_fused_or_foreach(list(params), False, False)[1])


def _choose_replay(opt, replay: str) -> str:
    """replay="auto": "host" where its CPU kernels match training (CPU
    tensors, the single-tensor path of AdamW/Adam/SGD), else "torch"."""
    if replay != "auto":
        return replay
    try:
        for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
            _device(p, f"parameter {i} of the optimizer")
        algorithm_of(opt)
    except CheckpointMismatchError:
        return "torch"
    return "host"


def replay_check(opt, meta: dict, tensors: dict, where: str) -> None:
    """Before restore() changes anything: a checkpoint whose parts are at
    their own versions ("multistep_plan") can be brought to its version only
    by the optimizer class that trained it, in the same arithmetic: same
    torch, same device type and model. One line otherwise. (The flags,
    foreach/fused/capturable, need no check: load_state_dict sets each group's
    to the saved ones before the replay runs.)"""
    rec = meta.get("multistep")
    plan = meta.get("multistep_plan")
    if not isinstance(rec, dict) or not isinstance(plan, dict):
        raise CorruptCheckpointError(f"{where}: its multistep replay record is malformed")
    params = [p for g in opt.param_groups for p in g["params"]]
    dev = params[0].device if params else torch.device("cpu")
    now = {"torch": torch.__version__, "device": dev.type, "device_name": _device_name(dev),
           "optimizer": type(opt).__name__}
    for key, what in (("torch", "torch"), ("device", "device type"),
                      ("device_name", "device"), ("optimizer", "optimizer")):
        if rec.get(key) != now[key]:
            raise CheckpointMismatchError(
                f"{where} is replayed at restore with the training optimizer's own arithmetic; "
                f"it was saved with {what} {rec.get(key)!r}, this run has {now[key]!r}: restore "
                f"it where it was trained")
    steps = plan.get("steps")
    if not isinstance(steps, list):
        raise CorruptCheckpointError(f"{where}: its multistep plan has no steps")
    for s in steps:
        if not isinstance(s, dict) or len(s.get("groups", ())) not in (0, len(opt.param_groups)):
            raise CorruptCheckpointError(f"{where}: its multistep plan does not fit the optimizer")
        for u in s.get("updates", ()):
            t, n = u.get("tensor"), u.get("elements")
            if not (isinstance(t, int) and 0 <= t < len(params) and isinstance(n, int)
                    and 0 < n <= params[t].numel()):
                raise CorruptCheckpointError(
                    f"{where}: its multistep plan names elements the optimizer does not have")
            g = tensors.get(u.get("gradient"))
            if not isinstance(g, torch.Tensor) or g.numel() != n:
                raise CorruptCheckpointError(
                    f"{where}: its multistep gradient log lacks {u.get('gradient')!r}")


class MultistepMode(Driver):
    """Drives nonstop._core.Multistep for one Checkpointer. Stands in for the
    engine object of concurrent mode too (wait_copied, wait_committed,
    latest, adopt_restored, stats, close: its hooks are removed there)."""

    handles = False  # step() returns the step a window began at; save() None

    def __init__(self, session, o):
        super().__init__(session)
        parts, overlap_gradients, replay = o.mode.parts, o.mode.overlap_gradients, o.mode.replay
        opts = [x for x in session.state.values() if isinstance(x, torch.optim.Optimizer)]
        if len(opts) != 1:
            raise CheckpointMismatchError(
                f"mode='multistep' needs exactly one torch.optim optimizer in state, found "
                f"{len(opts)}")
        if not isinstance(parts, int) or not 1 <= parts <= 64:
            raise CheckpointMismatchError(f"parts must be an integer in 1..64, got {parts!r}")
        if replay not in REPLAYS:
            raise CheckpointMismatchError(
                f"replay must be one of {', '.join(REPLAYS)}, got {replay!r}")
        self.opt = opts[0]
        # StateApplier.prepare, before restore() changes anything
        self.replay_check = functools.partial(replay_check, self.opt)
        self.replay = _choose_replay(self.opt, replay)
        self._cuda = self.replay == "torch"
        # Device first: a GPU run gets the one line that says what to use.
        devices = set()
        for i, p in enumerate(p for g in self.opt.param_groups for p in g["params"]):
            _device(p, f"parameter {i} of the optimizer", self._cuda)
            devices.add(p.device)
        if len(devices) > 1:
            raise CheckpointMismatchError(
                f"mode='multistep' needs every parameter of the optimizer on one device, found "
                f"{', '.join(sorted(map(str, devices)))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self._check_state()
        self.algorithm = (torch_replay_check(self.opt) if self._cuda
                          else algorithm_of(self.opt))
        self.amsgrad = bool(self.opt.param_groups[0].get("amsgrad", False))
        self.parts = parts
        self.overlap = bool(overlap_gradients)
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(self.opt.param_groups) for _ in g["params"]]
        for i, p in enumerate(self.params):
            if p.dtype != torch.float32 or not p.is_contiguous():
                raise CheckpointMismatchError(
                    f"mode='multistep' needs contiguous float32 master parameters; parameter {i} "
                    f"of the optimizer is {str(p.dtype).replace('torch.', '')}"
                    f"{'' if p.is_contiguous() else ' (not contiguous)'}")
            _device(p, cuda=self._cuda)

    def open_engine(self, kw: dict):
        """The Multistep core (self.core); this object stands in for its engine."""
        kw = dict(kw, dir=self.session.dir)
        kw.pop("small_initial_staging", None)  # (the window's staging is its own)
        # Engine options the Multistep binding does not take yet must be unset.
        known = {"dir", "rank", "world_size", "max_in_flight", "writers", "staging_bytes",
                 "chunk_bytes", "copy_threads", "medium", "keep_every", "memory_tier"}
        for key in [k for k in kw if k not in known]:
            if kw.pop(key):
                raise CheckpointMismatchError(f"mode='multistep' does not support {key} yet")
        self.core = _ext.core().Multistep(parts=self.parts, overlap_gradients=self.overlap,
                                          block_bytes=BLOCK_BYTES, replay=(
                                              "restore" if self._cuda else "host"),
                                          mkl_vms_sqrt=_mkl_vms_sqrt(), **kw)
        self._replaying = False                 # restore's replay: the hooks stand aside
        self._last_step: Optional[int] = None  # the last step ckpt.step() saw
        self._updates = 0                       # optimizer.step() calls since then
        self._due = False                       # a checkpoint waits for the window to close
        self._outputs_set = False
        self._fresh = False                     # some state did not exist at the last refresh
        self._held: list = []                   # gradients being copied (GoCkpt-O)
        self._hooks = [self.opt.register_step_pre_hook(self._pre),
                       self.opt.register_step_post_hook(self._post)]
        self._orig_zero_grad = None
        if self.overlap:
            self._orig_zero_grad = self.opt.zero_grad
            self.opt.zero_grad = self._zero_grad  # instance attribute; removed by close()
        return self

    def _check_state(self) -> None:
        """Every optimizer state tensor is on the CPU (replay="host"), or
        beside its parameter (state created or loaded after the constructor
        is checked at each window's start). Adam's step counter may stay on
        the CPU (torch's default)."""
        for i, p in enumerate(p for g in self.opt.param_groups for p in g["params"]):
            for key, v in self.opt.state.get(p, {}).items():
                if not isinstance(v, torch.Tensor):
                    continue
                what = f"optimizer state {key!r} of parameter {i}"
                _device(v, what, self._cuda)
                if self._cuda and key != "step" and v.device != p.device:
                    raise CheckpointMismatchError(
                        f"mode='multistep': {what} is on {v.device}, its parameter on "
                        f"{p.device}")

    def _stream(self) -> int:
        """The CUDA stream the optimizer updates on: the copies wait for it."""
        if self.device.type != "cuda":
            return 0
        return torch.cuda.current_stream(self.device).cuda_stream

    # ---------------------------------------------------------------- hooks

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.session.visible_stall_s += time.perf_counter() - t0

    def _step_now(self) -> int:
        return 0 if self._last_step is None else self._last_step + 1

    def _pre(self, optimizer, args, kwargs):
        if self._replaying:
            return
        if self._cuda and (getattr(optimizer, "found_inf", None) is not None
                           or getattr(optimizer, "grad_scale", None) is not None
                           or "grad_scaler" in kwargs):
            # GradScaler steps a fused optimizer itself: the kernel unscales
            # and skips overflow steps inside, after this hook logged them.
            raise CheckpointMismatchError(
                "mode='multistep': GradScaler steps this fused optimizer itself (it unscales "
                "and skips overflow steps inside the kernel, out of the log's sight): use "
                "fused=False with GradScaler")
        self._updates += 1
        if self._updates > 1 and self.core.active:
            raise CheckpointMismatchError(
                "mode='multistep' needs one optimizer.step() per ckpt.step(); call ckpt.step(step) "
                "after every training step")
        self._release_copied()
        if not self.core.active:
            return
        grads, held = [], []
        code = _state.torch_dtype_code
        clone = self._cuda and self.overlap
        for p in self.params:
            g = p.grad
            if g is None:
                grads.append((0, 7))
                continue
            if g.is_sparse or not g.is_contiguous():
                raise CheckpointMismatchError("mode='multistep' needs dense contiguous gradients")
            if clone:
                # torch's foreach kernels may change gradients in place during
                # the update (SGD nesterov: _foreach_add_(grads, bufs)); the
                # overlapped copy reads a snapshot taken before it (on CUDA a
                # device-to-device copy on the optimizer's stream).
                g = g.detach().clone()
            grads.append((g.data_ptr(), code(g.dtype)))
            held.append(g)
        kind, index = (1, self.device.index or 0) if self.device.type == "cuda" else (0, 0)
        stream = self._stream()
        groups = [_group_hyper(g) for g in self.opt.param_groups]
        self._timed(self.core.on_update_begin, self._step_now(), groups, False, grads, kind, index,
                    stream)
        if self.overlap:
            self._held.append(held)

    def _post(self, optimizer, args, kwargs):
        if self.core.active and not self._replaying:
            refreshed = self._tensors() if self._fresh else None
            self._timed(self.core.on_update_end, self._step_now(), refreshed)

    def _zero_grad(self, set_to_none: bool = True):
        # set_to_none=True drops the optimizer's reference; ours keeps the
        # memory alive until copied, so nothing waits. Zeroing in place must
        # wait for the copies (the paper's on_backward_begin).
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
        step drives the window."""
        t0, due = time.perf_counter(), self.session.due_after(step)
        self._last_step = step
        if self._updates == 0 and self.core.active:
            # No optimizer.step() this step: GradScaler skipped it.
            self.core.on_update_begin(step, [], True, [])
            self.core.on_update_end(step, None)
        self._updates = 0
        self._due = self._due or due
        started = None
        if self._due and not self.core.active:
            self._begin(step)
            self._due = False
            started = step
        if self.core.active and not self._outputs_set and self.core.version == step:
            self._set_outputs(step)
        self._release_copied()
        self.session.visible_stall_s += time.perf_counter() - t0
        return started

    def save(self, step: int) -> None:
        """ckpt.save(step): begins a window now (or when the open one closes);
        the checkpoint is of version step + parts - 1."""
        t0 = time.perf_counter()
        if self.core.active:
            self._due = True
        else:
            self._begin(step)
            if self.core.version == step:
                self._set_outputs(step)
        self.session.visible_stall_s += time.perf_counter() - t0

    def _tensors(self) -> list:
        self._check_state()
        out, fresh = [], False
        for i, p in enumerate(self.params):
            st = self.opt.state.get(p, {})
            kind, index = _device(p, cuda=self._cuda)

            def ptr(key):
                v = st.get(key)
                return v.data_ptr() if isinstance(v, torch.Tensor) else 0
            if self.algorithm == "sgd":
                ptrs = (0, 0, 0, ptr("momentum_buffer"))
                fresh |= ptrs[3] == 0
                step = 0.0
            else:
                ptrs = (ptr("exp_avg"), ptr("exp_avg_sq"),
                        ptr("max_exp_avg_sq") if self.amsgrad else 0, 0)
                fresh |= ptrs[0] == 0
                s = st.get("step")
                step = float(s) if s is not None else 0.0  # (a CUDA counter: synchronises)
            out.append((f"param{i}", p.numel(), self._group_of[i], kind, index, p.data_ptr(),
                        *ptrs, step))
        self._fresh = fresh
        return out

    def _begin(self, step: int) -> None:
        if not self._cuda:  # flags loaded since (load_state_dict) may have left the host's path
            algorithm_of(self.opt)
        self._outputs_set = False
        self.core.begin(step, self.algorithm, self.amsgrad, self._tensors(), self._stream())
        self.session.saves += 1

    def _set_outputs(self, step: int) -> None:
        """Everything of the checkpoint at version `step`: optimizer-owned
        tensors point at the reconstructed buffers, the rest is copied now."""
        tensors: dict = {}
        meta = self.session.meta(step, tensors)  # metrics=: step(step, metrics=) of this version
        if self._cuda:  # what restore's replay must find again (replay_check)
            meta["multistep"] = {"replay": "torch", "torch": torch.__version__,
                                 "device": self.device.type,
                                 "device_name": _device_name(self.device),
                                 "optimizer": type(self.opt).__name__, "groups": _flags(self.opt)}
        owned = {}
        roles = ("momentum_buffer",) if self.algorithm == "sgd" else _ROLES_ADAM
        for i, p in enumerate(self.params):
            owned[(p.data_ptr(), p.numel())] = (i, "param")
            st = self.opt.state.get(p, {})
            for r in roles:
                v = st.get(r)
                if isinstance(v, torch.Tensor):
                    owned[(v.data_ptr(), v.numel())] = (i, r)
        outputs, keep = [], []
        code = _state.torch_dtype_code
        for name, t in tensors.items():
            hit = owned.get((t.data_ptr(), t.numel())) if (
                t.dtype == torch.float32 and t.is_contiguous() and t.numel() > 0) else None
            nbytes = t.numel() * t.element_size()
            if hit is not None:
                outputs.append((name, code(t.dtype), list(t.shape), nbytes, hit[0], hit[1], 0, 0,
                                0, 0))
                continue
            if not t.is_contiguous():
                t = t.contiguous()
                keep.append(t)
            kind, index = _device(t, f"tensor {name!r} of the state", self._cuda)
            stream = self._stream() if kind == 1 else 0
            outputs.append((name, code(t.dtype), list(t.shape), nbytes, -1, "param",
                            t.data_ptr() if nbytes else 0, kind, index, stream))
        self.core.set_outputs(outputs, _state.dumps(meta))
        self._outputs_set = True

    # ---------------------------------------------------------- restoring

    def emergency(self, step: int) -> None:
        return None  # a window cannot be cut short: what is in flight is kept

    def wait(self) -> None:
        self.session.wait(committed=True, take=False)

    def restored(self, loaded) -> None:
        if "multistep_plan" in loaded.meta:  # parts at their versions
            self.replay_restored(loaded.meta, loaded.tensors)

    def replay_restored(self, meta: dict, tensors: dict) -> None:
        """restore() loaded a checkpoint whose parts are at their own versions
        (replay="torch"; checked by replay_check first): applies C++'s plan
        (multistep_replay.cc, RestorePlan) with the training optimizer itself,
        on the device the state was restored to.

        Step N+j of the plan updates, per tensor, the prefix of its elements
        that is one step behind (parts 1..j). torch updates whole tensors, so
        the tensor gets the logged gradient on that prefix (zeros elsewhere),
        its counter the count torch held then, and everything after the prefix
        (parameter and every state) is put back after the step: the elements
        beyond are already at a later version. The optimizer's own step() runs
        with its class, flags and foreach/fused grouping; only the
        hyperparameters are set to the step's logged values, and put back."""
        plan = meta["multistep_plan"]
        opt = self.opt
        params = [p for g in opt.param_groups for p in g["params"]]
        sgd = type(opt) is torch.optim.SGD
        roles = ("momentum_buffer",) if sgd else _ROLES_ADAM
        groups = [{k: g[k] for k in _HYPER if k in g} for g in opt.param_groups]
        grads = [p.grad for p in params]
        final = {id(p): opt.state[p]["step"].clone() for p in params
                 if isinstance(opt.state.get(p, {}).get("step"), torch.Tensor)}
        self._replaying = True
        try:
            with torch.no_grad():
                for step in plan["steps"]:
                    if step["skipped"] or not step["updates"]:
                        continue
                    self._replay_step(opt, params, roles, step, tensors)
        finally:
            self._replaying = False
            for g, h in zip(opt.param_groups, groups):
                g.update(h)
            for p, g in zip(params, grads):
                p.grad = g
            for p in params:
                st = opt.state.get(p, {})
                if id(p) in final:
                    st["step"].copy_(final[id(p)])

    def _replay_step(self, opt, params, roles, step: dict, tensors: dict) -> None:
        for g, h in zip(opt.param_groups, step["groups"]):
            for k, v in h.items():
                if k not in g:
                    continue
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
            grad = torch.zeros(p.shape, dtype=logged.dtype, device=p.device)
            grad.view(-1)[:n].copy_(logged.reshape(-1))
            p.grad = grad
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

    # ------------------------------------------------- the engine's interface

    def wait_copied(self) -> None:
        pass  # nothing is read from the live tensors outside the hooks

    def wait_committed(self, counter: int = 0) -> None:
        self.core.wait()

    def latest(self):
        return self.core.latest()

    def adopt_restored(self, counter: int) -> None:
        """Checkpointer.restore() restored `counter`: the engine keeps it
        intact until a newer one commits and records a rollback in the job
        directory's lineage before anything new is written
        (Engine::AdoptRestored, through the Multistep's serialised engine)."""
        self.core.adopt_restored(counter)

    def stats(self) -> dict:
        s = self.core.stats()
        s.update(mode="multistep", parts=self.parts, overlap_gradients=self.overlap)
        return s

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._orig_zero_grad is not None:
            try:
                del self.opt.zero_grad
            except AttributeError:
                pass
            self._orig_zero_grad = None
        self._held.clear()
        self.core.close()
