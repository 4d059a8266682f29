"""mode="layerwise": LightCheck's layer-wise asynchronous checkpoints for
PyTorch (docs/LAYERWISE.md).

The optimizer runs in backward: a `register_post_accumulate_grad_hook` on
every parameter updates that parameter as soon as its gradient is final,
with a one-parameter instance of the user's optimizer class that shares the
optimizer's `state` and copies its param_group's hyperparameters before
each update, so the arithmetic is the optimizer's own (same kernels, same
order of operations, per tensor). Then, in a step that is due for a
checkpoint, the copy of that parameter and its optimizer state starts at
once on the engine's threads (CopyTensors). Before the parameter's next
update the hook waits for that parameter's copy alone (WaitTensorsCopied).

The user's loop does not change:

* The hook sets `p.grad = None` after the update, so the user's
  `optimizer.step()` finds no gradient and applies nothing a second time
  (it still runs its hooks, so LR schedulers see it called). A parameter
  whose gradient was set outside backward (no hook fired) is still updated
  by `optimizer.step()`.
* `ckpt.step(s)` seals the checkpoint of step s: non-tensor state, RNG and
  tensors not driven by the optimizer (BatchNorm buffers, ...) are captured
  then, exactly as `save()` does in concurrent mode.
* Gradient clipping needs the global norm before any update. With
  `clip_grad_norm=max_norm` the hooks only mark gradients ready; the
  updates (and copies) run in the optimizer's step pre-hook, after
  `torch.nn.utils.clip_grad_norm_` over its parameters, one parameter after
  another in reverse registration order (about backward order). Do not clip
  by hand in layerwise mode: the gradients are gone by then.

A checkpoint needs every optimized parameter to have its optimizer state;
Adam creates it at the first update, so a checkpoint due in the very first
step falls back to a whole-model (concurrent) checkpoint at `ckpt.step()`.
"""
from __future__ import annotations

import inspect
import time
import warnings
from typing import Optional

import torch

from . import _rng, _state
from .errors import CheckpointMismatchError


def _sub_optimizer(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.optim.Optimizer:
    """A one-parameter optimizer of opt's class, built from opt.defaults
    (only the arguments its constructor takes)."""
    cls = type(opt)
    params = inspect.signature(cls.__init__).parameters
    accepts_all = any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values())
    kwargs = {k: v for k, v in opt.defaults.items() if accepts_all or k in params}
    return cls([p], **kwargs)


class Layerwise:
    """Drives one Checkpointer's engine layer by layer. A parameter and its
    optimizer state form one group; consecutive updated groups are handed
    to the engine together once they hold GROUP_BYTES (about a layer), so a
    model with many small tensors does not pay one engine call (and one
    wake-up of the copy thread) per bias vector."""

    GROUP_BYTES = 4 << 20

    def __init__(self, ckpt, clip_grad_norm: Optional[float] = None):
        if ckpt.world_size > 1:
            # Under DDP the hook would see the local, not yet all-reduced
            # gradient; the update has to run in a DDP comm hook instead
            # (docs/LAYERWISE.md), which is not wired up yet.
            raise CheckpointMismatchError(
                "mode='layerwise' runs the optimizer in backward, which needs a DDP comm hook "
                "with more than one rank (not implemented yet): use mode='concurrent'")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise CheckpointMismatchError(
                f"clip_grad_norm must be a positive number or None, got {clip_grad_norm!r}")
        self.ckpt = ckpt
        self.clip = clip_grad_norm
        self.next_step = 0           # the step the next backward belongs to
        self.counter: Optional[int] = None  # open layer-wise checkpoint
        self._decided = False        # whether this step's checkpoint was decided
        self._groups: dict = {}      # param -> engine tensor indices (current registration)
        self._pending: set = set()   # params with copies requested and not waited for
        self._batch: list = []       # updated params whose copies are not requested yet
        self._batched: set = set()   # the same, for membership (tensors compare by value)
        self._batch_bytes = 0
        # param -> (optimizer, index of its param_group, sub-optimizer). The
        # group is looked up at each update: load_state_dict replaces the dicts.
        self._subs: dict = {}
        self._hooks = []
        for opt in ckpt.state.values():
            if not isinstance(opt, torch.optim.Optimizer):
                continue
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if not p.requires_grad or p in self._subs:
                        continue
                    self._subs[p] = (opt, gi, _sub_optimizer(opt, p))
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
            if self.clip is not None:
                self._hooks.append(opt.register_step_pre_hook(self._on_step))
        if not self._subs:
            raise CheckpointMismatchError("mode='layerwise' needs a torch.optim.Optimizer in state whose "
                             "parameters require grad")

    # ------------------------------------------------------------ the hooks

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.clip is None:
            self._update(p)

    def _on_step(self, opt, args, kwargs) -> None:
        params = [p for p, (o, _, _) in self._subs.items() if o is opt and p.grad is not None]
        if not params:
            return
        torch.nn.utils.clip_grad_norm_(params, self.clip)
        for p in reversed(params):
            self._update(p)

    def _update(self, p: torch.Tensor) -> None:
        ck = self.ckpt
        engine = ck._engine
        if engine is not None:
            t0 = time.perf_counter()
            if not self._decided:
                self._decided = True
                self._maybe_begin(engine)
            if ck._copy_pending:  # a whole-model checkpoint is still copying
                engine.wait_copied()
                ck._copy_pending = False
            if p in self._pending:
                engine.wait_tensors_copied(self._groups[p])
                self._pending.discard(p)
            elif p in self._batched:  # updated twice in one step: request its copy first
                self._flush(engine)
                engine.wait_tensors_copied(self._groups[p])
                self._pending.discard(p)
            dt = time.perf_counter() - t0
            ck._hook_stall_s += dt
            ck._visible_stall_s += dt
        opt, gi, sub = self._subs[p]
        sg = sub.param_groups[0]
        for k, v in opt.param_groups[gi].items():
            if k != "params":
                sg[k] = v
        sub.state = opt.state  # shared (load_state_dict replaces opt.state)
        sub.step()
        p.grad = None
        if self.counter is not None and engine is not None and self._groups.get(p):
            self._batch.append(p)
            self._batched.add(p)
            self._batch_bytes += p.numel() * p.element_size() * (1 + len(opt.state[p]))
            if self._batch_bytes >= self.GROUP_BYTES:
                self._flush(engine)

    def _flush(self, engine) -> None:
        """Requests the copies of the batched groups (they may change again
        only after WaitTensorsCopied)."""
        if not self._batch:
            return
        t0 = time.perf_counter()
        engine.copy_tensors(self.counter, [i for p in self._batch for i in self._groups[p]])
        self._pending.update(self._batch)
        self._batch, self._batched, self._batch_bytes = [], set(), 0
        self.ckpt._visible_stall_s += time.perf_counter() - t0

    # --------------------------------------------------------- checkpoints

    def _maybe_begin(self, engine) -> None:
        ck = self.ckpt
        s = self.next_step
        if (s + 1) % ck.every != 0:
            return
        for p, (opt, _, _) in self._subs.items():
            if not opt.state.get(p):
                return  # no optimizer state yet: ckpt.step() saves the whole model
        tensors: dict = {}
        for key, obj in ck.state.items():
            _state.flatten(obj.state_dict() if _stateful(obj) else obj, key, tensors,
                           f"state[{key!r}]")
        refs = ck._refs(tensors)
        if refs != ck._registered:
            engine.register(refs)
            ck._registered = refs
            ck._registers += 1
        index = {}
        for i, r in enumerate(refs):
            index.setdefault(r[4], i)
        groups = {}
        for p, (opt, _, _) in self._subs.items():
            ts = [p] + [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
            groups[p] = [index[t.data_ptr()] for t in ts if t.data_ptr() in index]
        self._groups = groups
        self.counter = engine.begin_checkpoint(int(s))

    def step(self, step: int) -> Optional[int]:
        """ckpt.step(step) in layerwise mode: seals the open checkpoint, or
        starts a whole-model one when due and none is open."""
        ck = self.ckpt
        counter = None
        if self.counter is not None:
            t0 = time.perf_counter()
            from ._checkpointer import FORMAT
            tensors: dict = {}
            tree = {key: _state.flatten(obj.state_dict() if _stateful(obj) else obj, key, tensors,
                                        f"state[{key!r}]")
                    for key, obj in ck.state.items()}
            registered = {r[0] for r in ck._registered or []}
            if set(tensors) != registered:
                warnings.warn("nonstop: the set of tensors changed during step "
                              f"{step}; its layer-wise checkpoint may not restore", stacklevel=3)
            meta = {"format": FORMAT, "step": int(step), "rank": ck.rank,
                    "world_size": ck.world_size, "state": tree}
            if ck.rng:
                meta["rng"] = _rng.capture()
            counter, self.counter = self.counter, None
            # Every tensor not requested yet (the last batch too) is copied
            # by the seal: wait for all of them before their next update.
            self._pending = set(self._groups)
            self._batch, self._batched, self._batch_bytes = [], set(), 0
            ck._engine.end_checkpoint(counter, int(step), _state.dumps(meta))
            ck._saves += 1
            ck._visible_stall_s += time.perf_counter() - t0
        elif (step + 1) % ck.every == 0:
            counter = ck.save(step)
        self.next_step = step + 1
        self._decided = False
        return counter

    def restored(self, step: Optional[int]) -> None:
        self.next_step = 0 if step is None else step + 1
        self._decided = False
        self._pending.clear()
        self._batch, self._batched, self._batch_bytes = [], set(), 0
        self._groups = {}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _stateful(obj) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict") and not isinstance(
        obj, (dict, torch.Tensor))
