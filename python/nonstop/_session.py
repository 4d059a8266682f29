"""The one object that owns a Checkpointer's engine and its counters: the
engine (or the multistep window driving one), the distributed agreement,
the background errors taken and not reported yet, the registered tensors
and the stall counters. The modes (_layerwise, _multistep), the preemption
handling and the remote tier use it; none of them touches a Checkpointer's
own attributes."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

from . import _fsdp, _objects, _state, _unwrap
from .errors import CheckpointError, CheckpointMismatchError


class Snapshot:
    """A contiguous copy of a non-contiguous tensor, registered in its place."""

    def __init__(self, t: torch.Tensor):
        self.buffer = torch.empty(t.shape, dtype=t.dtype, device=t.device)


class Session:
    """What the drivers (the modes, every="auto", the preemption handling,
    the remote tier) use of a Checkpointer: its engine and counters, and
    the Checkpointer's own steps handed in as callables (`save(step)`: starts
    a checkpoint, the engine's counter; `due_after(step)`: the schedule;
    `agreed_metrics()`: the metrics= of the checkpoint being started)."""

    def __init__(self, dir: str, engine, dist=None, save=None, due_after=None,
                 agreed_metrics=None):
        self.save, self.due_after, self.agreed_metrics = save, due_after, agreed_metrics
        self.dir = dir
        self.engine = engine            # None once closed
        self.dist = dist                # _distributed.Distributed with world_size > 1
        self.pid = os.getpid()
        self.errors: list = []          # background errors taken, reported at the next call
        self.metrics: Optional[dict] = None   # metrics= of the save()/step() under way
        self.registered: Optional[list] = None
        self.snapshots: dict = {}
        self.base_ptr: dict = {}        # FSDP2: each name's DTensor's data pointer
        self.copy_pending = False
        self.visible_stall_s = 0.0
        self.hook_stall_s = 0.0
        self.saves = 0
        self.registers = 0
        self.replica_checked = False    # world_size > 1: replicated tensors compared once
        self.settled = False            # settle() ran (close)
        self.remote = None              # the remote tier (_remote.Tier): told of each checkpoint

    def forked(self) -> bool:
        return self.pid != os.getpid()

    def live(self):
        """The engine; CheckpointError in a forked child or once closed."""
        if self.forked():
            raise CheckpointError(
                f"the checkpointer for {self.dir} belongs to process {self.pid}; this forked "
                f"child (pid {os.getpid()}) cannot use it: create a new Checkpointer in the "
                f"child")
        if self.engine is None:
            raise CheckpointError(f"the checkpointer for {self.dir} is closed")
        return self.engine

    def call(self, fn, *args, **kwargs):
        """fn(*args): an engine call that first answers with an error queued
        by an earlier checkpoint (and then does nothing). That error is
        taken (reported later, once) and the call made again, so one failed
        checkpoint never costs the next one. The same error twice is the
        call's own: raised."""
        taken: dict = {}
        while True:
            try:
                return fn(*args, **kwargs)
            except CheckpointError as e:
                msg = str(e)
                if msg in taken or len(taken) >= 1000:
                    if msg in taken:
                        self.errors.remove(taken[msg])
                    raise
                taken[msg] = e
                self.errors.append(e)

    def report(self) -> None:
        """Raises the background errors taken since the last report, once:
        the first with its class, the others named in its line."""
        if not self.errors:
            return
        errors, self.errors = self.errors, []
        first = errors[0]
        if len(errors) == 1:
            raise first
        more = "; ".join(str(e) for e in errors[1:])
        raise type(first)(f"{first} (and {len(errors) - 1} more: {more})") from first

    def take(self, fn, *args) -> None:
        """fn(*args) with a failure taken as a background error; then the
        rest of the queue (nothing is in flight after a wait)."""
        seen = set()
        for _ in range(1000):
            try:
                fn(*args)
                return
            except CheckpointError as e:
                if str(e) in seen:  # not a queued error: the call's own, reported once
                    return
                seen.add(str(e))
                self.errors.append(e)

    def refs(self, tensors: dict, in_optimizer: set) -> list:
        """(name, dtype, shape, nbytes, ptr, device kind, index, stream,
        copy_at_checkpoint) for each tensor, as the engine's register() takes;
        a tensor whose memory only optimizer.step() changes (`in_optimizer`)
        is copied after the checkpoint starts, the others inside it."""
        refs = []
        snapshots_used = set()
        for name, t in tensors.items():
            copy_now = self.base_ptr.get(name, t.data_ptr()) not in in_optimizer
            if not t.is_contiguous():
                snap = self.snapshots.get(name)
                if snap is None or snap.buffer.shape != t.shape or snap.buffer.dtype != t.dtype:
                    snap = self.snapshots[name] = Snapshot(t)
                if self.copy_pending:
                    self.engine.wait_copied()
                    self.copy_pending = False
                with torch.no_grad():
                    snap.buffer.copy_(t)
                t, copy_now = snap.buffer, False
                snapshots_used.add(name)
            if t.device.type == "cuda":
                dev_kind, dev_index = 1, t.device.index or 0
                stream = torch.cuda.current_stream(t.device).cuda_stream
            elif t.device.type == "cpu":
                dev_kind, dev_index, stream = 0, 0, 0
            else:
                raise CheckpointMismatchError(
                    f"tensor {name!r} is on {t.device}; nonstop checkpoints CPU and CUDA tensors")
            refs.append((name, _state.torch_dtype_code(t.dtype), list(t.shape),
                         t.numel() * t.element_size(), t.data_ptr(), dev_kind, dev_index, stream,
                         copy_now))
        for name in set(self.snapshots) - snapshots_used:
            del self.snapshots[name]
        return refs

    def register(self, refs: list, layouts: Optional[dict] = None) -> None:
        """Registers `refs` with the engine when they changed."""
        if refs == self.registered:
            return
        engine = self.live()
        if layouts is None:
            self.call(engine.register, refs)
        else:
            self.call(engine.register, refs, layouts=[layouts.get(r[0]) for r in refs])
        self.registered = refs
        self.registers += 1

    def checkpoint(self, step: int, meta: dict) -> int:
        """Starts the checkpoint of the registered tensors; the engine's counter."""
        engine = self.live()
        if self.remote is not None:  # remote_every: the selected ones copied out of the ring
            self.remote.before_save()
        counter = self.call(engine.checkpoint, int(step), _state.dumps(meta))
        if hasattr(engine, "take_error"):  # earlier failures, reported after this one started
            self.take(engine.take_error)
        if self.dist is not None:
            self.dist.started(engine)
        self.copy_pending = True
        self.saves += 1
        if self.remote is not None:  # the first starts the upload thread
            self.remote.started(counter, step)
        return counter

    def before_update(self, *hook_args) -> None:
        """The optimizer step pre-hook: waits for the copy in flight. Never
        raises: an error of a checkpoint in flight must not skip the update
        (it is reported at the next step()/save()/wait())."""
        if self.copy_pending and self.engine is not None and not self.forked():
            t0 = time.perf_counter()
            try:
                self.engine.wait_copied()
            except CheckpointError as e:
                self.errors.append(e)
            self.copy_pending = False
            dt = time.perf_counter() - t0
            self.hook_stall_s += dt
            self.visible_stall_s += dt

    def wait(self, committed: bool, take: bool = True) -> None:
        """Waits for the copies (committed=False) or the commits in flight,
        counted as visible stall; then reports the background errors."""
        t0 = time.perf_counter()
        engine = self.live()
        if not committed:
            try:
                engine.wait_copied()
            except CheckpointError as e:
                self.errors.append(e)
        elif take:
            self.take(engine.wait_committed, 0)
        else:
            engine.wait_committed(0)
        self.copy_pending = False
        self.visible_stall_s += time.perf_counter() - t0
        self.report()

    def counters(self) -> dict:
        return dict(visible_stall_s=self.visible_stall_s, hook_stall_s=self.hook_stall_s,
                    saves=self.saves, registers=self.registers)

    def settle(self) -> None:
        """Waits for everything in flight; with several ranks a last agreement
        round with every rank, then the agreement stops. Once; errors are
        taken for report()."""
        if self.engine is None or self.settled:
            return
        self.settled = True
        try:
            if self.dist is not None:
                try:
                    self.engine.wait_committed(0)
                finally:
                    self.dist.close()
            else:  # (stats() after close() counts every checkpoint)
                self.engine.wait_committed(0)
        except CheckpointError as e:
            self.errors.append(e)

    def shut(self, before_close) -> Optional[object]:
        """settle(), runs before_close(engine), closes the engine. Returns what
        before_close returned; errors are taken for report()."""
        got = None
        try:
            self.settle()
        finally:
            engine, self.engine = self.engine, None
            got = before_close(engine)
            try:
                engine.close()
            except CheckpointError as e:
                self.errors.append(e)
        return got

    def let_go(self) -> None:
        """In a forked child: the parent's engine is never closed here (the
        C++ side leaves it alone)."""
        self.engine, self.dist, self.errors, self.remote = None, None, [], None


def optimizer_owned(state: dict) -> set:
    """Data pointers of tensors that only optimizer.step() changes: the
    parameters and state of the optimizers in `state` (their step pre-hook
    waits for the copy). Everything else is copied inside save(), because
    forward passes or user code may change it sooner."""
    ptrs = set()
    for obj in _unwrap.optimizers(state.values()):
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                ptrs.update(_fsdp.data_ptr(p) for p in group["params"])
            for st in obj.state.values():
                ptrs.update(_fsdp.data_ptr(v) for v in st.values() if isinstance(v, torch.Tensor))
            ptrs.update(v.data_ptr() for v in _objects.local_optimizer_tensors(obj))
    return ptrs
