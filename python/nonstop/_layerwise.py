"""mode="layerwise" (LightCheck): the optimizer runs in backward, one
parameter at a time (a one-parameter instance of the user's class); in a due
step each parameter's copy starts after its update, and its next update waits
for that copy alone. docs/LAYERWISE.md, "What the Python side does"."""
from __future__ import annotations

import inspect
import threading
import time
import warnings
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from . import _ext, _objects, _periodic, _state
from .errors import CheckpointMismatchError


def _sub_optimizer(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.optim.Optimizer:
    """A one-parameter optimizer of opt's class (the opt.defaults it takes)."""
    cls = type(opt)
    params = inspect.signature(cls.__init__).parameters
    accepts_all = any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values())
    kwargs = {k: v for k, v in opt.defaults.items() if accepts_all or k in params}
    return cls([p], **kwargs)


def _clip(params: list, max_norm: float) -> list:
    """clip_grad_norm=: the global norm of `params`' gradients clipped; those with one."""
    params = [p for p in params if p.grad is not None]
    if params:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    return params


class Layerwise(_periodic.Periodic):
    """Drives the engine layer by layer; _core.LayerwiseBook says which
    tensors (a parameter and its optimizer state) to hand over and to wait for."""

    GROUP_BYTES = 4 << 20
    defer_staging = False

    def __init__(self, session, o):
        super().__init__(session)
        self.clip = o.mode.clip_grad_norm
        if self.clip is not None and not self.clip > 0:
            raise CheckpointMismatchError(
                f"clip_grad_norm must be a positive number or None, got {self.clip!r}")
        self.next_step = 0           # the step the next backward belongs to
        self.counter: Optional[int] = None  # open layer-wise checkpoint
        self._decided = False        # whether this step's checkpoint was decided
        self._plan: Optional[tuple] = None  # the book's plan: (signature, registered refs)
        self._keep: dict = {}        # the registered tensors, kept alive while registered
        self._ptrs: dict = {}        # name -> data_ptr of the state's tensors when registered
        # DDP's callbacks run on the process group's threads, the hooks and ckpt.step() on the
        # training thread: one lock orders all access to the fields above and hooks' engine calls.
        self._lock = threading.RLock()
        self._updated: list = []     # DDP params updated by the comm hook this backward
        self._queued = False         # the end-of-backward callback is queued
        # param -> (optimizer, index of its param_group, sub-optimizer). The
        # group is looked up at each update: load_state_dict replaces the dicts.
        self._subs: dict = {}
        ddps = [d for d in session.state.values() if isinstance(d, DistributedDataParallel)]
        # ZeRO, several ranks without DDP, find_unused_parameters, DDP under
        # mode="auto" (its comm hook could not be removed again): refused (C++)
        _ext.core().check_layerwise(
            zero=any(_objects.is_zero(x) for x in session.state.values()),
            world_size=session.world_size, ddp_models=len(ddps),
            find_unused=any(getattr(d, "find_unused_parameters", False) for d in ddps),
            auto_mode=o.mode.mode == "auto")
        opts = [x for x in session.state.values() if isinstance(x, torch.optim.Optimizer)]
        for opt in opts:
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if p.requires_grad and p not in self._subs:
                        self._subs[p] = (opt, gi, _sub_optimizer(opt, p))
        if not self._subs:
            raise CheckpointMismatchError("mode='layerwise' needs a torch.optim.Optimizer in "
                                          "state whose parameters require grad")
        self._ids = {p: i for i, p in enumerate(self._subs)}  # the book's parameter numbers
        self._book = _ext.core().LayerwiseBook(self.GROUP_BYTES, [
            (p.device.index or 0) if p.device.type == "cuda" else -1 for p in self._subs])
        if self.clip is not None:  # _on_step updates them all
            self._hooks = [opt.register_step_pre_hook(self._on_step) for opt in opts]
            return
        for d in ddps:  # DDP's parameters are updated by its comm hook
            try:
                d.register_comm_hook(d.process_group, self._comm_hook)
            except RuntimeError as e:
                raise CheckpointMismatchError(
                    f"mode='layerwise' installs a DDP communication hook and DDP refused "
                    f"it ({str(e).splitlines()[0]}); register no comm hook of your own") from None
        by_ddp = {p for d in ddps for n, p in d.module.named_parameters()
                  if n not in getattr(d, "parameters_to_ignore", ()) and p.requires_grad}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in self._subs if p not in by_ddp]

    # ------------------------------------------------------------ the hooks

    def _on_grad(self, p: torch.Tensor) -> None:  # (with clip_grad_norm=: _on_step updates)
        with self._lock:
            self._update([p])

    def _on_step(self, opt, args, kwargs) -> None:
        params = _clip([p for p, (o, _, _) in self._subs.items() if o is opt], self.clip)
        with self._lock:
            for p in reversed(params):
                self._update([p])
            self._copy(self._book.flush())

    def _comm_hook(self, group, bucket):
        """DDP communication hook (training thread, inside backward): the
        bucket's all-reduce as DDP does it without a hook, then the updates
        and copies of its parameters, on the thread that completes it."""
        if not self._decided or not self._queued:
            with self._lock:
                self._maybe_begin()  # before the first all-reduce: no callback runs yet
                if not self._queued:
                    self._queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        params, grads, buf = bucket.parameters(), bucket.gradients(), bucket.buffer()
        world = group.size()
        # reducer.cpp without a comm hook: a gradient is multiplied by 1/world as it is copied into
        # the bucket (at::mul_out with a wrapped double scalar), or divided by world in place where
        # it already is a view of the bucket (gradient_as_bucket_view); then the bucket is summed.
        # A comm hook receives plain copies, so do the same here.
        views = [p.grad is not None and p.grad.data_ptr() == g.data_ptr() and g.numel() > 0
                 for p, g in zip(params, grads)]
        if not any(views):
            buf.mul_(1.0 / world)
        else:
            for v, g in zip(views, grads):
                if v:
                    g.div_(world)
                else:
                    g.mul_(1.0 / world)
        fut = torch.distributed.all_reduce(buf, group=group, async_op=True).get_future()

        def reduced(f):
            f.value()  # raises the all-reduce's error
            with self._lock:
                todo = [(p, g) for p, g in zip(params, grads) if p in self._subs]
                self._update([p for p, _ in todo], dict(todo))
                self._copy(self._book.flush())
                self._updated.extend(p for p, _ in todo)
            return buf

        return fut.then(reduced)

    def _end_backward(self) -> None:
        # Queued at the first bucket, this may run before DDP's own final callback (which writes
        # the reduced gradients into .grad): queue the clean-up once more, after it.
        torch.autograd.Variable._execution_engine.queue_callback(self._clear_grads)

    def _clear_grads(self) -> None:
        with self._lock:
            for p in self._updated:
                p.grad = None  # updated already: optimizer.step() must skip it
            self._updated = []
            self._queued = False

    def _update(self, params: list, grads: Optional[dict] = None) -> None:
        """Updates `params` (under the lock) after their copies in flight; batches
        their copies while a checkpoint is open. `grads`: DDP's reduced ones."""
        ses, engine = self.session, self.session.engine
        if engine is not None:
            if ses.copy_pending:  # a whole-model checkpoint is still copying (errors: at step())
                ses.hook_stall_s += ses.waited(engine, committed=False)
            t0 = time.perf_counter()
            self._maybe_begin()
            # Updated twice in one step: the batch is handed over first. Then LightCheck's rule:
            # their next update (about to be enqueued on the current stream) runs after their
            # copies. CUDA parameters: the stream waits on the GPU; others: the host waits.
            copy, waits = self._book.update([self._ids[p] for p in params])
            self._copy(copy)
            for device, tensors in waits:
                if device < 0:
                    engine.wait_tensors_copied(tensors)
                else:
                    engine.wait_tensors_copied_on_stream(
                        tensors, device, torch.cuda.current_stream(device).cuda_stream)
            dt = time.perf_counter() - t0
            ses.hook_stall_s += dt
            ses.visible_stall_s += dt
        for p in params:
            opt, gi, sub = self._subs[p]
            sub.param_groups[0].update(
                (k, v) for k, v in opt.param_groups[gi].items() if k != "params")
            sub.state = opt.state  # shared (load_state_dict replaces opt.state)
            if grads is None:
                sub.step()
                p.grad = None
            else:
                # The reduced gradient is a view of DDP's bucket; DDP copies
                # it into p.grad after the all-reduce's future.
                local, p.grad = p.grad, grads[p]
                try:
                    sub.step()
                finally:
                    p.grad = local
            if engine is not None:  # batched while a checkpoint is open
                nbytes = p.numel() * p.element_size() * (1 + len(opt.state.get(p, ())))
                self._copy(self._book.updated(self._ids[p], nbytes))

    def _copy(self, tensors: list) -> None:
        """Requests the copies of `tensors` (changed again after WaitTensorsCopied)."""
        if tensors:
            t0 = time.perf_counter()
            self.session.engine.copy_tensors(self.counter, tensors)
            self.session.visible_stall_s += time.perf_counter() - t0

    # --------------------------------------------------------- checkpoints

    def _signature(self) -> tuple:
        """Per parameter: (the data_ptrs of it and its state's tensors, the
        state's id). The plan holds while this is unchanged."""
        sig = []
        for p, (opt, _, _) in self._subs.items():
            st = opt.state.get(p)
            ptrs = [v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor)] if st else []
            sig.append(((p.data_ptr(), *ptrs), id(st)))
        return tuple(sig)

    def _plan_holds(self) -> bool:
        """The prepared plan is of the current registration and signature."""
        return (self._plan is not None and self.session.registered is self._plan[1]
                and self._plan[0] == self._signature())

    def _complete(self) -> bool:
        """Whether every optimized parameter has its optimizer state."""
        return all(opt.state.get(p) for p, (opt, _, _) in self._subs.items())

    def _prepare(self, tensors: Optional[dict] = None) -> None:
        """Registers the state's tensors (this rank's pieces) unless registered
        already, and plans the book's groups. `tensors`: the flattened state."""
        ses = self.session
        if tensors is None:
            tensors = {}
            _objects.flatten_state(ses.state, tensors)
        ptrs = {n: t.data_ptr() for n, t in tensors.items()}
        if not ses.snapshots and ptrs == self._ptrs and self._plan_holds():
            return  # nothing moved (the usual case): the registration and the groups hold
        ses.base_ptr = ptrs
        layouts = None
        if ses.dist is not None:  # world_size > 1: this rank's shares are registered
            tensors, layouts, _ = ses.dist.shard(tensors, ses.state)
        refs = ses.refs(tensors, ses.owned())
        ses.register(refs, layouts)
        self._keep = tensors  # registered by pointer: keep them alive
        self._ptrs = dict(ses.base_ptr)
        sig = self._signature()  # each parameter's groups: the refs of its pointers
        self._book.plan([ses.base_ptr.get(r[0], r[4]) for r in refs], [ptrs for ptrs, _ in sig])
        self._plan = (sig, ses.registered)

    def _maybe_begin(self) -> None:
        """At a step's first update (once: _decided): opens its checkpoint when
        due (with the plan the previous ckpt.step() prepared, or one made now)."""
        if self._decided:
            return
        self._decided = True
        s, ses, engine = self.next_step, self.session, self.session.engine
        if engine is None or not ses.due_after(s) or not self._complete():
            return  # not due, or no optimizer state yet: ckpt.step() saves the whole model
        if not self._plan_holds():
            self._prepare()
        self.counter = engine.begin_checkpoint(int(s))
        self._book.open()
        if ses.dist is not None:
            ses.dist.started(engine)  # the first one starts the agreement thread

    def step(self, step: int) -> Optional[int]:
        """Seals the open checkpoint, or starts a whole-model one when due and
        none is open; then prepares the next step's when that one is due."""
        ses = self.session
        with self._lock:
            counter = tensors = None
            t0 = time.perf_counter()
            if self.counter is not None:
                tensors = {}
                meta = ses.meta(step, tensors)  # metrics agreed across ranks with best=
                if ses.dist is not None:
                    meta["dist"] = ses.dist.shard(tensors, ses.state)[2]
                counter, self.counter = self.counter, None
                # Every tensor not requested yet (the last batch too) is copied
                # by the seal: wait for all of them before their next update.
                self._book.seal()
                ses.engine.end_checkpoint(counter, int(step), _state.dumps(meta))
                if {n: t.data_ptr() for n, t in tensors.items()} != self._ptrs:
                    warnings.warn("nonstop: the state's tensors changed during step "
                                  f"{step}; its layer-wise checkpoint may not restore",
                                  stacklevel=3)
                    self._plan = None
                ses.saves += 1
            elif ses.due_after(step):
                counter = self.save(step)  # whole-state; step() reports background errors
            self.next_step = step + 1
            self._decided = False
            self._queued = False  # (a backward that raised left it set)
            # The next step is due: plan now, between steps, so that backward
            # only opens the checkpoint and requests copies.
            if ses.due_after(step + 1) and self._complete():
                self._prepare(tensors)
            ses.visible_stall_s += time.perf_counter() - t0
            return counter

    def seal(self, step: int) -> Optional[int]:
        return self.step(step) if self.counter is not None else self.save(step)

    def restored(self, loaded) -> None:
        self.reset(loaded.step)

    def reset(self, step: Optional[int]) -> None:
        """The next backward is step + 1's (0's: None)."""
        with self._lock:
            self.next_step = 0 if step is None else step + 1
            self._decided = False
            self._book.reset()
            self._plan = None

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class Switching(_periodic.Periodic):
    """mode="auto": `_core.ModeChooser` decides; this reports each step's clock
    and visible stall, and swaps the hooks right after a checkpoint was started
    or sealed: nothing in flight is cut short (docs/LAYERWISE.md, "mode="auto"")."""

    def __init__(self, session, o, clock=time.perf_counter):
        super().__init__(session)
        self.o, self.clip, self.clock = o, o.mode.clip_grad_norm, clock
        self.layerwise: Optional[Layerwise] = None
        self.chooser = _ext.core().ModeChooser(rounds=2, settle=1, margin=0.05, patience=3)
        try:  # can layer-wise run on this state at all? (its checks, its hooks)
            Layerwise(session, o).detach()
        except CheckpointMismatchError as e:  # no: concurrent, pinned
            self.chooser.pin(f"layerwise cannot run here ({e}): concurrent")
        self.restart()

    def step(self, step: int) -> Optional[int]:
        got = (self.layerwise or super()).step(step)
        # a window ends with its checkpoint: the mode may change right after it
        due = self.session.due_after(step)
        if self.chooser.step(self.clock(), self.session.visible_stall_s, due) == "layerwise":
            if self.layerwise is None:
                self.layerwise = Layerwise(self.session, self.o)
                self.layerwise.reset(step)  # the next backward is step + 1's
        elif self.layerwise is not None:  # to concurrent
            self.layerwise.detach()
            self.layerwise = None
            self.session.copy_pending = True
        return got

    def seal(self, step: int) -> Optional[int]:
        return (self.layerwise or super()).seal(step)

    def before_update(self, optimizer) -> None:
        if self.clip is not None and self.layerwise is None:
            # concurrent stretches: clip_grad_norm= clips here, as layer-wise's
            # step pre-hook does (same tensors, same order)
            _clip([p for g in optimizer.param_groups for p in g["params"]], self.clip)

    def restored(self, loaded) -> None:
        if self.layerwise is not None:
            self.layerwise.restored(loaded)

    def restart(self) -> None:  # a new window starts now (construction, restore())
        self.chooser.start(self.clock(), self.session.visible_stall_s)

    def add_stats(self, s: dict) -> None:  # which mode runs, and the figures it was chosen from
        s["mode_auto"] = self.chooser.state()

    def detach(self) -> None:
        if self.layerwise is not None:
            self.layerwise.detach()
