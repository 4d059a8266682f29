"""Session, the one object that owns a Checkpointer's engine, agreement,
background errors, registered tensors and counters (the modes, the
preemption handling and the remote tier use it, never a Checkpointer's own
attributes); and Driver, the protocol of a mode (docs/ARCHITECTURE.md)."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

from . import _ext, _fsdp, _objects, _rng, _state, _unwrap
from ._read import FORMAT
from .errors import CheckpointError, CheckpointMismatchError


class Session:
    """A Checkpointer's state, engine, counters and schedule (module doc)."""

    def __init__(self, dir: str, state: dict, o, dist=None):
        self.dir, self.state, self.rng = dir, state, o.rng
        self.rank, self.world_size = o.dist.rank, o.dist.world_size
        self.best = o.retention.best
        # When a checkpoint is due, for every mode: the one rule, in C++
        # (src/engine/schedule.h); every="auto" feeds it the clock (_periodic.py).
        self.schedule = (o.mode.auto if o.mode.auto is not None
                         else _ext.core().Schedule.every(o.mode.every))
        self.engine = None              # set once opened; None once closed
        self.dist = dist                # _distributed.Distributed with world_size > 1
        self.optimizers: list = []      # hooked optimizers (Checkpointer.attach)
        self.staging_deferred = 0       # bytes of staging to prepare after restore()
        self.restore_stats: dict = {}   # the last restore(): restore_s, restore_GBps, ...
        self.closed_stats: Optional[dict] = None  # stats() after close()
        self.pid = os.getpid()
        self.errors: list = []          # background errors taken, reported at the next call
        self.metrics: Optional[dict] = None   # metrics= of the save()/step() under way
        self.registered: Optional[list] = None
        self.snapshots: dict = {}       # name -> a contiguous copy of a non-contiguous tensor
        self.base_ptr: dict = {}        # FSDP2: each name's DTensor's data pointer
        self.copy_pending = False
        self.visible_stall_s = 0.0
        self.hook_stall_s = 0.0
        self.saves = 0
        self.registers = 0
        self.replica_checked = False    # world_size > 1: replicated tensors compared once
        self.remote = None              # the remote tier (_remote.Tier): told of each checkpoint
        self.watcher = None             # settles the per-checkpoint handles (_handle.Watcher)

    def forked(self) -> bool:
        return self.pid != os.getpid()

    def due_after(self, step: int) -> bool:
        """Whether the checkpoint after the update of `step` is due."""
        return self.schedule.due_after(int(step))

    def meta(self, step: int, tensors: dict) -> dict:
        """A checkpoint's JSON document; the state's tensors added to `tensors`."""
        meta = {"format": FORMAT, "step": int(step), "rank": self.rank,
                "world_size": self.world_size,
                "state": _objects.flatten_state(self.state, tensors)}
        if self.rng:
            meta["rng"] = _rng.capture()
        metrics = self.metrics
        if self.dist is not None and self.best is not None:
            # rank 0's on every rank (JSON over gloo; collective), so that every
            # rank ranks its kept copies by the same numbers (JobDir::Retain)
            metrics = self.dist.agree_metrics(metrics)
        if metrics:
            meta["metrics"] = metrics
        names = _unwrap.describe(self.state)  # get_state_dict's names, for export (_unwrap.py)
        if names:
            meta["names"] = names
        return meta

    def owned(self) -> set:
        """optimizer_owned() of the state and of the hooked optimizers."""
        return optimizer_owned(self.state, self.optimizers)

    def stage(self, nbytes: int, deferred: bool) -> None:
        """No first-checkpoint spike: the engine allocates the state-sized
        staging in the background, now or (`deferred`: a restart) once
        restore() has read."""
        if self.dist is None and hasattr(self.engine, "prepare_staging"):
            self.staging_deferred = nbytes
            if not deferred:
                self.begin_staging()

    def begin_staging(self) -> None:
        """Starts the staging allocation stage() deferred (or asked for)."""
        nbytes, self.staging_deferred = self.staging_deferred, 0
        if nbytes and not self.forked():
            self.live().prepare_staging(nbytes)

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

    def take(self, fn, *args) -> None:
        """fn(*args), an engine wait or take_error, until it stops raising:
        each failure an earlier checkpoint queued (include/nonstop/engine.h
        "Errors") is taken for report(); the same line twice is the call's
        own error, taken once."""
        taken: set = set()
        while len(taken) < 1000:
            try:
                return fn(*args)
            except CheckpointError as e:
                if str(e) in taken:
                    return
                taken.add(str(e))
                self.errors.append(e)

    def report(self) -> None:
        """Raises the background errors taken since the last report, once:
        the first with its class, the others named in its line."""
        errors, self.errors = self.errors, []
        if len(errors) == 1:
            raise errors[0]
        if errors:
            first, more = errors[0], "; ".join(str(e) for e in errors[1:])
            raise type(first)(f"{first} (and {len(errors) - 1} more: {more})") from first

    def refs(self, tensors: dict, in_optimizer: set) -> list:
        """(name, dtype, shape, nbytes, ptr, device kind, index, stream,
        copy_at_checkpoint) for each tensor, as the engine's register() takes;
        a tensor whose memory only optimizer.step() changes (`in_optimizer`)
        is copied after the checkpoint starts, the others inside it."""
        refs, snapshots_used = [], set()
        for name, t in tensors.items():
            copy_now = self.base_ptr.get(name, t.data_ptr()) not in in_optimizer
            if not t.is_contiguous():
                snap = self.snapshots.get(name)  # a contiguous copy, registered in its place
                if snap is None or snap.shape != t.shape or snap.dtype != t.dtype:
                    snap = self.snapshots[name] = torch.empty(t.shape, dtype=t.dtype,
                                                              device=t.device)
                if self.copy_pending:
                    self.engine.wait_copied()
                    self.copy_pending = False
                with torch.no_grad():
                    snap.copy_(t)
                t, copy_now = snap, False
                snapshots_used.add(name)
            if t.device.type not in ("cpu", "cuda"):
                raise CheckpointMismatchError(
                    f"tensor {name!r} is on {t.device}; nonstop checkpoints CPU and CUDA tensors")
            cuda = t.device.type == "cuda"
            stream = torch.cuda.current_stream(t.device).cuda_stream if cuda else 0
            refs.append((name, _state.torch_dtype_code(t.dtype), list(t.shape),
                         t.numel() * t.element_size(), t.data_ptr(), int(cuda),
                         (t.device.index or 0) if cuda else 0, stream, copy_now))
        self.snapshots = {n: v for n, v in self.snapshots.items() if n in snapshots_used}
        return refs

    def register(self, refs: list, layouts: Optional[dict] = None) -> None:
        """Registers `refs` with the engine when they changed."""
        if refs == self.registered:
            return
        self.live().register(refs, None if layouts is None else [layouts.get(r[0]) for r in refs])
        self.registered = refs
        self.registers += 1

    def checkpoint(self, step: int, meta: dict) -> int:
        """Starts the checkpoint of the registered tensors; the engine's counter."""
        engine = self.live()
        if self.remote is not None:  # remote_every: the selected ones copied out of the ring
            self.remote.before_save()
        counter = engine.checkpoint(int(step), _state.dumps(meta))
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
            self.hook_stall_s += self.waited(self.engine, committed=False)

    def wait(self, committed: bool, take: bool = True) -> None:
        """Waits for the copies (committed=False) or the commits in flight;
        then reports the background errors."""
        self.waited(self.live(), committed, take)
        self.report()

    def waited(self, engine, committed: bool, take: bool = True) -> float:
        """engine.wait_copied() or wait_committed(), its errors taken (take=
        False: raised); the seconds, counted as visible stall."""
        t0 = time.perf_counter()
        fn = engine.wait_committed if committed else engine.wait_copied
        if take:
            self.take(fn)
        else:
            fn()
        self.copy_pending = False
        dt = time.perf_counter() - t0
        self.visible_stall_s += dt
        return dt

    def stats(self, driver, engine=None) -> dict:
        """stats(): the engine's, the session's counters, the last restore's,
        the mode's (driver.add_stats), the distributed agreement's and the
        remote tier's."""
        s = (engine or self.live()).stats()
        s.update(visible_stall_s=self.visible_stall_s, hook_stall_s=self.hook_stall_s,
                 saves=self.saves, registers=self.registers)
        s.update(self.restore_stats)
        driver.add_stats(s)
        if self.dist is not None:
            s.update(self.dist.stats())
        if self.remote is not None:
            s["remote"] = self.remote.stats()
        return s

    def shut(self, driver) -> None:
        """close(), in this order: everything in flight waited for; with
        several ranks a last agreement round, so that the handles settle
        after it (docs/PYTHON.md "Handles"); the remote tier's last upload;
        closed_stats; the engine closed. Errors are taken for report()."""
        try:
            try:
                self.engine.wait_committed(0)
            finally:
                if self.dist is not None:
                    self.dist.close()
        except CheckpointError as e:
            self.errors.append(e)
        finally:
            if self.watcher is not None:
                self.watcher.close()
            engine, self.engine = self.engine, None
            if self.remote is not None:
                self.remote.close()
            try:
                self.closed_stats = self.stats(driver, engine)
            except Exception:  # noqa: BLE001 -- a failed engine: stats() says closed
                self.closed_stats = None
            try:
                engine.close()
            except CheckpointError as e:
                self.errors.append(e)

    def let_go(self) -> None:
        """In a forked child: the parent's engine is never closed here (the
        C++ side leaves it alone)."""
        self.engine, self.dist, self.errors, self.remote = None, None, [], None


def optimizer_owned(state: dict, more=()) -> set:
    """Data pointers of tensors that only optimizer.step() changes: the
    parameters and state of the optimizers in `state` and `more` (their
    step pre-hook waits for the copy). Everything else is copied inside
    save(), because forward passes or user code may change it sooner."""
    ptrs = set()
    for obj in [*_unwrap.optimizers(state.values()), *more]:
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                ptrs.update(_fsdp.data_ptr(p) for p in group["params"])
            for st in obj.state.values():
                ptrs.update(_fsdp.data_ptr(v) for v in st.values() if isinstance(v, torch.Tensor))
            ptrs.update(v.data_ptr() for v in _objects.local_optimizer_tensors(obj))
    return ptrs


class Driver:
    """What a Checkpointer asks of its mode: _periodic.Periodic ("concurrent"),
    _layerwise.Layerwise, _layerwise.Switching ("auto"), _multistep.MultistepMode.
    The Checkpointer holds one and never asks which mode it is; a mode's
    hooks are installed when it is made and removed by detach()."""

    handles = True         # step() returns engine counters (the Checkpointer's handles)
    defer_staging = False  # on a restart, whole-state staging waits for restore()
    replay_check = None    # (meta, tensors, where): checked before a restore changes anything

    def __init__(self, session: Session):
        self.session = session

    def open_engine(self, kw: dict):  # the engine this mode drives (_options.engine_kwargs)
        return _ext.core().Engine(self.session.dir, **kw)

    def step(self, step: int) -> Optional[int]:  # Checkpointer.step: a counter or None
        return self.save(step) if self.session.due_after(step) else None

    def save(self, step: int) -> Optional[int]:  # Checkpointer.save: a counter
        raise NotImplementedError

    def seal(self, step: int) -> Optional[int]:  # `step`'s checkpoint now (the open one sealed)
        return self.save(step)

    def emergency(self, step: int) -> Optional[int]:
        """A preemption: everything in flight abandoned (it is older), then
        `step`'s checkpoint; its counter, or None when this mode cannot cut
        what is in flight short (the caller waits for it)."""
        engine = self.session.live()
        if hasattr(engine, "abandon_older_than"):
            engine.abandon_older_than()
        return self.seal(step)

    def before_update(self, optimizer) -> None:  # step pre-hook, after the copy was waited for
        pass

    def wait(self) -> None:  # Checkpointer.wait()
        self.session.wait(committed=True)

    def restored(self, loaded) -> None:  # restore() applied `loaded` to the live objects
        pass

    def restart(self) -> None:  # restore() ended (applied, a fresh start, or failed)
        pass

    def add_stats(self, s: dict) -> None:  # this mode's figures, added to stats()
        pass

    def detach(self) -> None:  # close(): removes this mode's hooks
        pass
