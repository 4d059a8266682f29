"""nonstop.Checkpointer: checkpoints a PyTorch job every few steps without
stopping it, and restores it bit-identically.

The Python side only gathers state: it turns each object's state_dict() into
named tensors (registered with the C++ engine by pointer, never copied here)
and JSON, and it installs one optimizer step pre-hook that waits until the
tensors of the checkpoint in flight have been copied. Copying, writing,
committing and reading are done by the engine, with the GIL released.
"""
from __future__ import annotations

import difflib
import inspect
import os
import time
import warnings
import weakref
from typing import Any, Optional

import torch

from . import (_auto, _config, _data, _distributed, _ext, _fqn, _fsdp, _layerwise, _manage,
               _multistep, _objects, _preempt, _remote, _replica, _restore, _rng, _state, _unwrap)
from ._objects import stateful
from ._read import FORMAT, check_directory
from ._restore import LoadedCheckpoint, load  # noqa: F401  nonstop.load, nonstop.LoadedCheckpoint
from ._handle import CheckpointHandle, Watcher
from .errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError

MODES = ("concurrent", "layerwise", "multistep")






def _world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Snapshot:
    """A tensor whose own memory cannot be registered (not contiguous): it
    is copied into a persistent buffer at each checkpoint instead."""

    def __init__(self, t: torch.Tensor):
        self.buffer = torch.empty(t.shape, dtype=t.dtype, device=t.device)


class Checkpointer:
    """Checkpoints `state` every `every` steps; see docs/PYTHON.md.

    state: a dict of objects with state_dict()/load_state_dict() (modules,
        optimizers, schedulers, your own), tensors, or plain data (dicts,
        lists, numbers, strings). Dicts and lists are restored in place;
        other plain values are replaced in `ckpt.state`.
    """

    def __init__(self, dir: str, state: dict, every=None, mode: Optional[str] = None,
                 max_in_flight: Optional[int] = None, writers: Optional[int] = None,
                 staging_bytes: Optional[int] = None, chunk_bytes: Optional[int] = None,
                 medium: Optional[str] = None, keep: Optional[int] = None, rng: bool = True,
                 copy_threads: Optional[int] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, parts: int = 7,
                 overlap_gradients: bool = True, config: Optional[str] = None,
                 max_overhead: Optional[float] = None, copy: str = "host",
                 clip_grad_norm: Optional[float] = None, replicated: str = "shard",
                 local=(), dist_timeout_s: float = 300.0, on_preempt=True,
                 remote=None, remote_options: Optional[dict] = None, on_commit=None,
                 tier: str = "auto", max_to_keep: Optional[int] = None, best=None,
                 remote_every: Optional[int] = None):
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise CheckpointMismatchError("state must be a dict with string keys, "
                                          "e.g. {'model': model, 'optim': optimizer}")
        if remote_every is not None:  # remote_options "every" (docs/TIERS.md), checked
            if remote is None:        # before the job directory is opened
                raise CheckpointMismatchError("remote_every= needs remote=")
            if remote_options is not None and not isinstance(remote_options, dict):
                raise CheckpointMismatchError("remote_options must be a dict")
            remote_options = {**(remote_options or {}), "every": remote_every}
        if isinstance(remote_options, dict):
            _remote.check_every(remote_options.get("every"), world_size or 1)
        # A data loader whose restored order would differ is refused (_data.py)
        _data.check_state(state)
        # config=PATH (nonstop tune --out): explicit arguments override it,
        # it overrides the defaults (every=10, max_in_flight=2, ...).
        opts = _config.resolve(config, every=every, mode=mode, max_in_flight=max_in_flight,
                               writers=writers, staging_bytes=staging_bytes,
                               chunk_bytes=chunk_bytes, medium=medium, copy_threads=copy_threads,
                               max_overhead=max_overhead)
        every, mode, max_in_flight, medium = (opts["every"], opts["mode"], opts["max_in_flight"],
                                              opts["medium"])
        writers, staging_bytes, chunk_bytes, copy_threads = (
            opts["writers"], opts["staging_bytes"], opts["chunk_bytes"], opts["copy_threads"])
        # every="auto": the interval adapts to keep the visible stall near
        # max_overhead (default 3 %) of wall time; see _auto.py, docs/TUNE.md.
        self._auto = None
        if every == "auto":
            if mode != "concurrent":
                raise CheckpointMismatchError('every="auto" works with mode="concurrent" only')
            self._auto = _auto.AutoInterval(target=opts["max_overhead"])
        if mode not in MODES:
            raise CheckpointMismatchError(
                f"mode {mode!r} is not available in this version; use one of {', '.join(MODES)}")
        if self._auto is None and (not isinstance(every, int) or every < 1):
            raise CheckpointMismatchError(
                f'every must be a positive integer or "auto", got {every!r}')
        if mode != "layerwise" and (copy != "host" or clip_grad_norm is not None):
            raise CheckpointMismatchError("copy= and clip_grad_norm= apply to mode='layerwise' only")
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise CheckpointMismatchError(f"keep must be None or a positive integer, got {keep!r}")
        # max_to_keep= and best=("loss", "min", k): which kept copies stay
        # (JobDir retention in C++; _manage.py, docs/PYTHON.md "Managing checkpoints")
        retention = _manage.check_retention(keep, max_to_keep, best)
        if best is not None and every == "auto" and (world_size or _world()[1]) > 1:
            raise CheckpointMismatchError(
                'best= with world_size > 1 needs every=N: every rank must checkpoint the same '
                'steps (their metrics are agreed at each checkpoint)')
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise CheckpointMismatchError(
                f"max_in_flight must be a positive integer, got {max_in_flight!r}")
        if tier not in ("auto", "memory", "disk"):
            raise CheckpointMismatchError(
                f'tier must be "auto", "memory" or "disk", got {tier!r}')
        drank, dworld = _world()
        self._pid = os.getpid()
        self.tier = tier
        self._errors: list = []  # background errors taken, reported at the next call
        self.dir = os.fspath(dir)
        self.state = state
        self.every = every
        # When a checkpoint is due, for every mode: the one rule, in C++
        # (src/engine/schedule.h); every="auto" feeds it the clock (_auto.py).
        self._schedule = (self._auto.schedule if self._auto is not None
                          else _ext.core().Schedule.every(every))
        self.mode = mode
        self.keep = keep
        self.max_to_keep = max_to_keep
        self.best = best
        self._metrics: Optional[dict] = None  # metrics= of the save()/step() under way
        self.rng = rng
        self.rank = drank if rank is None else rank
        self.world_size = dworld if world_size is None else world_size
        # Rank files of another world size are set aside for resharding
        # (_distributed.py; with world_size > 1 collectively, in Distributed).
        if self.world_size == 1:
            _distributed.set_aside(self.dir, 1)
        restart = check_directory(self.dir, self.rank,
                                  self.world_size if self.world_size == 1 else None,
                                  must_exist=False)
        engine_kwargs = dict(
            rank=self.rank, world_size=self.world_size, max_in_flight=max_in_flight,
            writers=writers or 0, staging_bytes=staging_bytes or 0, chunk_bytes=chunk_bytes or 0,
            copy_threads=copy_threads, medium=medium, keep_every=keep or 0)
        # world_size > 1: rank shares of replicated state, global agreement on
        # a gloo group, pinned slot (one more); _distributed.py, docs/DISTRIBUTED.md
        self._dist = None
        self._base_ptr: dict = {}
        if self.world_size > 1:
            if mode == "multistep":
                raise CheckpointMismatchError(f"mode {mode!r} is single-process only for now; "
                                              f"use mode='concurrent' with world_size > 1")
            self._dist = _distributed.Distributed(self.dir, self.rank, self.world_size,
                                                  replicated, local, dist_timeout_s,
                                                  agree_metrics=best is not None)
            self._dist.state = state  # resharding looks at the live objects
            self._dist.tier = tier  # recovery tries the ranks' memory segments (all or none)
            if retention[0] or retention[3]:  # max_to_keep/best delete kept copies
                # Every rank must hold the same kept steps before the engine
                # opens (a kill between the ranks' deletions): collective.
                self._dist.tidy_kept()
            engine_kwargs.update(extra_slots=1, global_agreement=True)
        self._multistep = None
        # The state-sized staging is prepared in the background (below), at
        # once or, on a restart, from the end of restore().
        nbytes = _state_bytes_estimate(state) if self._dist is None else 0
        deferred = bool(nbytes and restart and mode == "concurrent")
        # The memory tier: the newest committed checkpoint also in shared
        # memory for a fast restart on this node (docs/PYTHON.md, "tier").
        if tier != "auto":  # the engine's default
            engine_kwargs["memory_tier"] = tier
        if mode == "multistep":  # GoCkpt: _multistep.py, docs/MULTISTEP.md
            self._multistep = _multistep.MultistepMode(self, _ext.core(), dict(dir=self.dir, **engine_kwargs),
                                            parts, overlap_gradients)
            self._engine = self._multistep
            if retention != (0, "", False, 0):
                try:
                    self._multistep.core.set_retention(*retention)
                except Exception:
                    self._multistep.close()
                    raise
        else:
            if mode == "layerwise":  # LightCheck: _layerwise.py, docs/LAYERWISE.md
                engine_kwargs["layer_copy"] = copy
            if self._dist is None and not staging_bytes and nbytes and not deferred:
                # prepare_staging follows at once (below): the engine opens
                # with its smallest pool, not the 256 MiB floor pre-faulted
                # on this thread only to be replaced (0.3-1.5 s here;
                # bench/construct_bench.py). A restart keeps the floor: its
                # preparation waits for restore(), and its first save() must
                # not wait for it.
                engine_kwargs["small_initial_staging"] = True
            self._engine = _ext.core().Engine(self.dir, **engine_kwargs)
            if retention != (0, "", False, 0):
                try:
                    self._engine.set_retention(*retention)
                except Exception:
                    self._engine.close()
                    raise
        self._registered: Optional[list] = None
        self._snapshots: dict[str, _Snapshot] = {}
        self._copy_pending = False
        self._visible_stall_s = 0.0
        self._hook_stall_s = 0.0
        self._saves = 0
        self._registers = 0
        self._restore_stats: dict = {}  # the last restore(): restore_s, restore_GBps, ...
        # Per-checkpoint handles (and on_commit) settled from the engine's
        # records by a watcher thread; _handle.py
        self._watcher = Watcher(lambda: self._live().stats(), on_commit,
                                None if self._dist is None else self._dist.agreed_step)
        # Wrapped optimizers (Accelerate's, Lightning's) are hooked where they
        # step: the torch optimizer inside (_unwrap.py).
        self._hooks = [obj.register_step_pre_hook(self._before_update)
                       for obj in _unwrap.optimizers(state.values())]
        # No first-checkpoint spike: the engine allocates the state-sized
        # staging in the background, so the first save() does not (stats():
        # staging_alloc_waits / staging_alloc_wait_s). From now on; or, when
        # this rank has a checkpoint to restore (a restart), from the end of
        # restore() (or the first step()/save() without one), so that the
        # allocation does not compete with the restore's read.
        self._staging_deferred = 0
        if self._dist is None and hasattr(self._engine, "prepare_staging"):
            if deferred:
                self._staging_deferred = nbytes
            elif nbytes:
                self._engine.prepare_staging(nbytes)
        self._layerwise = None
        if mode == "layerwise":  # optimizer in backward, per-parameter copies
            try:
                self._layerwise = _layerwise.Layerwise(self, clip_grad_norm)
            except Exception:
                self.close()
                raise
        # Preemption notices (SIGTERM by default): at the next step() boundary,
        # a checkpoint of that step at once, then exit 75; _preempt.py, docs/PREEMPTION.md
        self._preempt = _preempt.install(self, on_preempt)
        # remote="s3://bucket/prefix" or a path: committed checkpoints are also
        # uploaded in the background, and restore() falls back to them; _remote.py, docs/TIERS.md
        self._remote = None if remote is None else _remote.Tier(
            self, remote, remote_options, _ext.core, _restore.read, LoadedCheckpoint)
        # The handles' thread starts now, not inside the first save() (no
        # first-checkpoint spike; _handle.Watcher.start).
        self._watcher.start()

    # ---------------------------------------------------------------- saving

    def step(self, step: int, metrics: Optional[dict] = None) -> Optional[CheckpointHandle]:
        """Call after the update of `step` (counted from 0). Starts a
        checkpoint when `step + 1` is a multiple of `every` (or when the
        every="auto" controller says so); returns the checkpoint's handle
        (nonstop.CheckpointHandle), or None when none was due. After a preemption notice it checkpoints
        `step` at once, waits until it is committed (on every rank), closes,
        and raises nonstop.Preempted (exit status 75 when uncaught).
        metrics={"loss": 0.31}: stored with the checkpoint when one starts
        (nonstop.list shows them; best= ranks kept copies by one)."""
        self._metrics = _manage.check_metrics(metrics)
        try:
            return self._step(step)
        finally:
            self._metrics = None

    def _step(self, step: int) -> Optional[CheckpointHandle]:
        if self._forked():
            self._live()
        self._begin_staging()
        if self._preempt is not None:
            self._preempt.at_boundary(step)
        if self._auto is not None:
            got = self._watcher.track(_auto.checkpointer_step(self, self._auto, step), step)
        elif self._multistep is not None:  # every step drives the window
            got = self._multistep.step(step, self._due_after(step))
        elif self._layerwise is not None:  # seals the checkpoint its hooks began
            got = self._watcher.track(self._layerwise.step(step), step)
        elif self._due_after(step):
            got = self._watcher.track(self._save(step), step)
        else:
            got = None
        self._report()  # background errors since the last call, once
        return got

    def _due_after(self, step: int) -> bool:
        """every=N: whether the checkpoint after the update of `step` is due."""
        return self._schedule.due_after(int(step))

    def save(self, step: int, metrics: Optional[dict] = None) -> Optional[CheckpointHandle]:
        """Starts a checkpoint of the state as it is now, labelled `step`.
        Returns at once (after small tensors not updated by the optimizer are
        copied) with the checkpoint's handle: handle.wait() blocks until it
        is committed, add_done_callback(fn) runs fn then. The next
        optimizer.step() waits until every tensor has been copied, and the
        engine writes and commits in the background. (mode="multistep":
        None; its window's checkpoint is not known yet.)

        An error of an earlier checkpoint (a failed write or keep= copy) is
        raised here after this checkpoint has started, once.
        metrics={"loss": 0.31}: stored with the checkpoint (see step())."""
        self._metrics = _manage.check_metrics(metrics)
        self._begin_staging()
        try:
            handle = self._watcher.track(self._save(step), step)
        finally:
            self._metrics = None
        self._report()
        return handle

    def _begin_staging(self) -> None:
        """Starts the staging allocation __init__ deferred for a restart."""
        nbytes, self._staging_deferred = self.__dict__.get("_staging_deferred", 0), 0
        if nbytes and not self._forked():
            self._live().prepare_staging(nbytes)

    def _save(self, step: int) -> Optional[int]:
        """save() without the handle and without reporting the background
        errors: the engine's counter."""
        if self._multistep is not None:  # the window begins; version step + parts - 1
            return self._multistep.start(step)
        t0 = time.perf_counter()
        engine = self._live()
        tensors: dict[str, torch.Tensor] = {}
        tree = _objects.flatten_state(self.state, tensors)
        meta = {"format": FORMAT, "step": int(step), "rank": self.rank,
                "world_size": self.world_size, "state": tree}
        if self.rng:
            meta["rng"] = _rng.capture()
        metrics = self._checkpoint_metrics()
        if metrics:
            meta["metrics"] = metrics
        names = _fqn.describe(self.state)  # get_state_dict's names, for export (_fqn.py)
        if names:
            meta["names"] = names
        layouts = None
        if self._dist is not None:  # FSDP2 DTensors: each rank its local shard (_fsdp.py)
            self._base_ptr = {n: _fsdp.data_ptr(t) for n, t in tensors.items()}
            full = tensors
            tensors, layouts, meta["dist"] = _fsdp.shard(self._dist, tensors, self.state)
            # Tensors treated as replicated must be equal on every rank: checked
            # at the first checkpoint, before the agreement thread shares the
            # group (_replica.py).
            if not self.__dict__.get("_replica_checked"):
                rank0, _ = _distributed.module_buffers(self.state, self._dist.local)
                _replica.check(self._dist, full,
                               sorted(n for n in meta["dist"]["shared"] if n not in rank0))
                self._replica_checked = True
        elif _fsdp.has_dtensors(tensors):  # FSDP2 on a mesh of one rank: each shard is whole
            self._base_ptr = {n: _fsdp.data_ptr(t) for n, t in tensors.items()}
            tensors, meta["dtensor"] = _fsdp.localize(tensors)
        refs = self._refs(tensors)
        if refs != self._registered:
            if layouts is None:
                self._engine_call(engine.register, refs)
            else:
                self._engine_call(engine.register, refs,
                                  layouts=[layouts.get(r[0]) for r in refs])
            self._registered = refs
            self._registers += 1
        if self._remote is not None:  # remote_every: the selected ones copied out of the ring
            self._remote.before_save()
        counter = self._engine_call(engine.checkpoint, int(step), _state.dumps(meta))
        if hasattr(engine, "take_error"):  # earlier failures, reported after this one started
            self._take(engine.take_error)
        if self._dist is not None:
            self._dist.started(engine)
        if self._remote is not None:
            self._remote.started(counter, step)
        self._copy_pending = True
        self._saves += 1
        self._visible_stall_s += time.perf_counter() - t0
        return counter

    def _checkpoint_metrics(self) -> Optional[dict]:
        """metrics= of the checkpoint being started. With world_size > 1 and
        best=: rank 0's on every rank (JSON over gloo; collective), so that
        every rank ranks its kept copies by the same numbers and keeps and
        deletes the same steps (JobDir::Retain)."""
        if self._dist is not None and self.best is not None:
            return self._dist.agree_metrics(self._metrics)
        return self._metrics

    def _engine_call(self, fn, *args, **kwargs):
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
                        self._errors.remove(taken[msg])
                    raise
                taken[msg] = e
                self._errors.append(e)

    def _report(self) -> None:
        """Raises the background errors taken since the last report, once:
        the first with its class, the others named in its line."""
        if not self._errors:
            return
        errors, self._errors = self._errors, []
        first = errors[0]
        if len(errors) == 1:
            raise first
        more = "; ".join(str(e) for e in errors[1:])
        raise type(first)(f"{first} (and {len(errors) - 1} more: {more})") from first

    def _take(self, fn, *args) -> None:
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
                self._errors.append(e)

    def _forked(self) -> bool:
        return self.__dict__.get("_pid", os.getpid()) != os.getpid()

    def _refs(self, tensors: dict) -> list:
        """(name, dtype, shape, nbytes, ptr, device kind, index, stream,
        copy_at_checkpoint) for each tensor, as the engine's register() takes."""
        in_optimizer = self._optimizer_owned()
        refs = []
        snapshots_used = set()
        for name, t in tensors.items():
            copy_now = self._base_ptr.get(name, t.data_ptr()) not in in_optimizer
            if not t.is_contiguous():
                snap = self._snapshots.get(name)
                if snap is None or snap.buffer.shape != t.shape or snap.buffer.dtype != t.dtype:
                    snap = self._snapshots[name] = _Snapshot(t)
                if self._copy_pending:
                    self._engine.wait_copied()
                    self._copy_pending = False
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
        for name in set(self._snapshots) - snapshots_used:
            del self._snapshots[name]
        return refs

    def _optimizer_owned(self) -> set:
        """Data pointers of tensors that only optimizer.step() changes: the
        parameters and state of the optimizers in `state` (their step
        pre-hook waits for the copy). Everything else is copied inside
        save(), because forward passes or user code may change it sooner."""
        ptrs = set()
        for obj in _unwrap.optimizers(self.state.values()):
            if isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    ptrs.update(_fsdp.data_ptr(p) for p in group["params"])
                for st in obj.state.values():
                    ptrs.update(_fsdp.data_ptr(v) for v in st.values()
                                if isinstance(v, torch.Tensor))
                ptrs.update(v.data_ptr() for v in _objects.local_optimizer_tensors(obj))
        return ptrs

    def _before_update(self, optimizer, args, kwargs):
        # Never raises: an error of a checkpoint in flight must not skip the
        # update. The wait has ended whatever it answers (the copies are done
        # or failed); the error is reported at the next step()/save()/wait().
        if self._copy_pending and self._engine is not None and not self._forked():
            t0 = time.perf_counter()
            try:
                self._engine.wait_copied()
            except CheckpointError as e:
                self._errors.append(e)
            self._copy_pending = False
            dt = time.perf_counter() - t0
            self._hook_stall_s += dt
            self._visible_stall_s += dt

    def wait_copied(self) -> None:
        """Returns once every tensor of the checkpoints in flight has been
        copied out of its memory. Call it before changing checkpointed
        tensors by hand (outside optimizer.step())."""
        t0 = time.perf_counter()
        engine = self._live()
        try:
            engine.wait_copied()
        except CheckpointError as e:
            self._errors.append(e)
        self._copy_pending = False
        self._visible_stall_s += time.perf_counter() - t0
        self._report()

    def wait(self) -> None:
        """Waits until every checkpoint in flight is committed. Then raises
        the errors of failed checkpoints (and keep= copies) not reported
        yet, once."""
        t0 = time.perf_counter()
        engine = self._live()
        if self._multistep is not None:
            engine.wait_committed(0)
        else:
            self._take(engine.wait_committed, 0)
        self._copy_pending = False
        self._visible_stall_s += time.perf_counter() - t0
        self._report()

    def preempt(self, reason: str = "preempt()") -> None:
        """A preemption notice from your own watcher (e.g. a thread polling
        the cloud metadata server); callable from any thread. The next step()
        handles it as it handles SIGTERM. See docs/PREEMPTION.md."""
        if getattr(self, "_preempt", None) is None:
            raise CheckpointError("preemption handling is off (on_preempt=False)")
        self._preempt.notice(reason)

    def latest(self) -> Optional[int]:
        """The step of the newest committed checkpoint, or None. With
        world_size > 1: of the newest globally agreed one."""
        if self._dist is not None:
            self._live()
            return self._dist.agreed_step()
        got = self._live().latest()
        return None if got is None else got[1]

    def stats(self) -> dict:
        """The engine's counters and per-checkpoint times (stall, copy and
        persist seconds, GB/s, in flight), plus the time the training thread
        spent inside nonstop from Python (visible_stall_s). After close():
        the last stats, taken when everything in flight had finished."""
        if self._engine is None and getattr(self, "_closed_stats", None) is not None \
                and not self._forked():
            return dict(self._closed_stats)
        return self._stats_of(self._live())

    def _stats_of(self, engine) -> dict:
        s = engine.stats()
        s.update(visible_stall_s=self._visible_stall_s, hook_stall_s=self._hook_stall_s,
                 saves=self._saves, registers=self._registers)
        s.update(self._restore_stats)
        if self._auto is not None:
            s["auto"] = self._auto.state()
        if self._dist is not None:
            s.update(self._dist.stats())
        if self._remote is not None:
            s["remote"] = self._remote.stats()
        return s

    def close(self) -> None:
        """Waits for the checkpoints in flight, then stops the engine; raises
        the background errors not reported yet, once. Idempotent. In a forked
        child it only lets go of the parent's engine."""
        if self._forked():
            for h in self.__dict__.get("_hooks", []):
                h.remove()
            self._hooks = []
            self._preempt = None
            self._layerwise = None
            self._dist = None
            self._remote = None
            self._engine = None  # the C++ side never closes a parent's engine in a child
            self._errors = []
            return
        if getattr(self, "_preempt", None) is not None:  # puts the signal handlers back
            self._preempt.close()
        if getattr(self, "_layerwise", None) is not None:
            self._layerwise.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._engine is not None and getattr(self, "_watcher", None) is not None:
            self._watcher.close()  # settles the handles of what finishes now
        if self._engine is not None:
            engine, self._engine = self._engine, None
            try:
                try:
                    if self._dist is not None:  # a last agreement round with every rank
                        try:
                            engine.wait_committed(0)
                        finally:
                            self._dist.close()
                    else:  # (stats() after close() counts every checkpoint)
                        engine.wait_committed(0)
                except CheckpointError as e:
                    self._errors.append(e)
            finally:
                if getattr(self, "_remote", None) is not None:  # the newest one uploaded
                    self._remote.close()
                try:  # what stats() returns from now on
                    self._closed_stats = self._stats_of(engine)
                except Exception:  # noqa: BLE001 -- a failed engine: stats() says closed
                    self._closed_stats = None
                try:
                    engine.close()
                except CheckpointError as e:
                    self._errors.append(e)
        self._report()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _live(self):
        if self._forked():
            raise CheckpointError(
                f"the checkpointer for {self.dir} belongs to process {self._pid}; this forked "
                f"child (pid {os.getpid()}) cannot use it: create a new Checkpointer in the "
                f"child")
        if self._engine is None:
            raise CheckpointError(f"the checkpointer for {self.dir} is closed")
        return self._engine

    # ------------------------------------------------------------ management

    def list(self) -> list:
        """Every checkpoint of this rank: the ring and the kept copies, newest
        first (see nonstop.list)."""
        self._live()
        return _manage.list_checkpoints(self.dir, self.rank)

    def delete(self, step: int) -> None:
        """Deletes the kept copy of `step` (keep/step-N/) after the checkpoints
        in flight finish. Never the newest committed checkpoint or the one a
        restore protects; a step only in the ring is not deleted (the ring
        reuses its slots itself). CheckpointNotFoundError lists the steps there are."""
        engine = self._live()
        if not hasattr(engine, "delete_kept"):
            raise CheckpointMismatchError("delete() works with mode='concurrent' or 'layerwise'")
        _manage.check_step(step)
        _manage.delete_with(engine.delete_kept, self.dir, step)

    # ------------------------------------------------------------- restoring

    def restore(self, step: Optional[int] = None) -> Optional[int]:
        """Restores `state` in place from the newest valid checkpoint (or the
        one at `step`). Returns the restored step, or None when the directory
        holds no checkpoint yet (a fresh start). Everything (metadata, every
        tensor's name, shape and dtype against the live objects, the RNG
        record) is checked before any object is changed; a newest checkpoint
        that is damaged or malformed is skipped with a warning."""
        self._live()
        t0 = time.perf_counter()
        self._restore_stats = {}
        try:
            return self._restore(step)
        finally:
            self._flat = {}
            self._restore_stats["restore_total_s"] = time.perf_counter() - t0
            self._begin_staging()  # deferred while the restore read (__init__)

    def _restore(self, step: Optional[int]) -> Optional[int]:
        adopt = False
        remote = None if self._remote is None else self._remote.restore(step)
        if remote is not None:  # newer than every rank's local checkpoint
            loaded = remote
        elif self._dist is not None:  # collective: the ranks agree on the step
            loaded = self._dist.load(self._engine, step, _ext.core, LoadedCheckpoint, lambda d: (
                check_directory(d, self.rank, self.world_size, must_exist=False)),
                stats=self._restore_stats)
        elif self.world_size == 1 and _distributed.archives(self.dir):  # resharding to 1 process
            loaded = _distributed.restore_single(self.dir, step, lambda: _restore.read(
                self.dir, self.rank, step, 1, as_numpy=False, prepare=self._prepare),
                LoadedCheckpoint, self.state)
        elif not check_directory(self.dir, self.rank, self.world_size,
                                 must_exist=step is not None):
            return None
        else:
            if self._copy_pending and hasattr(self._engine, "wait_copied"):
                # The tensors are read into in place: no copy of them may be in flight.
                self._take(self._engine.wait_copied)
                self._copy_pending = False
            t0 = time.perf_counter()
            loaded, why = None, "a step was asked for"
            if step is None and self.tier != "disk":
                # The memory tier first: used only when its segment verifies
                # and holds exactly the newest committed checkpoint on disk.
                loaded, why = _restore.read_memory(self.dir, self.rank, self.world_size, self._prepare,
                                           live=self._live_tensors(), stats=self._restore_stats)
            if loaded is not None:
                self._restore_stats.update(restored_from="memory",
                                           restore_s=time.perf_counter() - t0)
            else:
                loaded = _restore.read(self.dir, self.rank, step, self.world_size, as_numpy=False,
                               prepare=self._prepare, live=self._live_tensors(),
                               stats=self._restore_stats)
                self._restore_stats.update(restored_from="disk", memory_unused_because=why)
            adopt = loaded is not None
        if loaded is None:
            return None
        plan = loaded.plan if loaded.plan is not None else self._prepare(loaded)
        self._apply(plan)
        if (remote is not None or adopt) and hasattr(self._engine, "adopt_restored"):
            # The restored checkpoint stays intact until a newer one commits,
            # and a rollback is recorded before anything new is written
            # (DESIGN.md invariant 9; Engine::AdoptRestored).
            self._engine.adopt_restored(int(loaded.counter))
        self._registered = None
        if self._layerwise is not None:
            self._layerwise.restored(loaded.step)
        return loaded.step

    def _live_tensors(self) -> dict:
        """The live state's tensors by checkpoint name (modules, optimizers,
        other stateful objects and plain tensors): restore() reads straight
        into those that match (_destinations)."""
        current: dict = {}
        self._flat = {}  # per key, for _check_fits of this restore
        for key, obj in self.state.items():
            if stateful(obj) or isinstance(obj, torch.Tensor):
                flat: dict = {}
                _state.flatten(_objects.state_dict_of(obj) if stateful(obj) else obj, key,
                               flat)
                self._flat[key] = flat
                current.update(flat)
        return current

    def _prepare(self, loaded) -> tuple:
        """Everything restore() will do to the live objects, checked and
        decoded, with nothing changed yet: (values by key, RNG setters).
        Raises CorruptCheckpointError where the checkpoint is malformed (the
        caller falls back to an older one) and CheckpointMismatchError where
        it does not fit the live state."""
        _fsdp.restored(self, loaded)  # FSDP2: the saved shards become DTensors again
        meta = loaded.meta
        where = f"checkpoint step {loaded.step} in {self.dir}"
        saved = meta.get("state")
        if not isinstance(saved, dict):
            raise CorruptCheckpointError(f"{where}: its metadata holds no state tree")
        missing = [k for k in self.state if k not in saved]
        if missing:
            raise CheckpointMismatchError(
                f"{where} has no state {missing[0]!r} "
                f"(it has {', '.join(map(str, saved)) or 'nothing'})")
        try:
            values = {key: _state.unflatten(saved[key], loaded.tensors) for key in self.state}
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{where}: {e}") from None
        for key, obj in self.state.items():
            self._check_fits(key, obj, loaded)
            self._check_value(key, obj, values[key], where)
        setters = []
        if self.rng and "rng" in meta:
            try:
                setters = _rng.prepare(meta["rng"])
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{where}: {e}") from None
        extra = [k for k in saved if k not in self.state]
        if extra:
            warnings.warn(f"nonstop: checkpoint step {loaded.step} also holds state "
                          f"{', '.join(map(repr, extra))}, not restored", stacklevel=4)
        return values, setters

    def _check_value(self, key: str, obj: Any, value: Any, where: str) -> None:
        """The checks load_state_dict would fail only halfway through."""
        if isinstance(obj, torch.Tensor) and not isinstance(value, torch.Tensor):
            raise CorruptCheckpointError(f"{where}: state {key!r} is not a tensor")
        if stateful(obj) and not isinstance(value, dict):
            raise CorruptCheckpointError(
                f"{where}: state {key!r} is a {type(value).__name__}, not a state dict")
        if isinstance(obj, torch.optim.Optimizer) and not _objects.is_zero(obj) and (
                value.get(_objects.CONSOLIDATED) is None):
            groups = value.get("param_groups")
            if not isinstance(groups, list) or not isinstance(value.get("state"), dict) or not all(
                    isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
                raise CorruptCheckpointError(
                    f"{where}: state {key!r} is not an optimizer state dict")
            have = [len(g["params"]) for g in obj.param_groups]
            got = [len(g["params"]) for g in groups]
            if have != got:
                raise CheckpointMismatchError(
                    f"{where}: optimizer {key!r} has parameter groups of sizes {got}, the "
                    f"live optimizer {have}")

    def _apply(self, plan: tuple) -> None:
        values, setters = plan
        for key, obj in list(self.state.items()):
            value = values[key]
            if stateful(obj):
                if self._restored_in_place(key, obj, value):
                    continue  # load_state_dict would copy every tensor onto itself
                try:
                    _objects.load_state_dict_into(obj, value)
                except CheckpointError:
                    raise
                except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:
                    first = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise CheckpointMismatchError(
                        f"state {key!r}: load_state_dict failed: {first}") from e
            elif isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.copy_(value)
            elif isinstance(obj, dict) and isinstance(value, dict):
                obj.clear()
                obj.update(value)
            elif isinstance(obj, list) and isinstance(value, list):
                obj[:] = value
            else:
                self.state[key] = value
        for setter in setters:
            setter()

    def _restored_in_place(self, key: str, obj: Any, value: Any) -> bool:
        """True when load_state_dict(value) would only copy each tensor onto
        itself: `obj` is a plain nn.Module (torch's load_state_dict and
        _load_from_state_dict on every submodule, no load hooks) whose state
        dict has exactly value's keys, and each value is the live tensor of
        that key, already read in place (_destinations). Its checks (missing
        and unexpected keys, shapes) then hold by construction."""
        if not isinstance(obj, torch.nn.Module) or not isinstance(value, dict):
            return False
        if type(obj).load_state_dict is not torch.nn.Module.load_state_dict:
            return False
        flat = self.__dict__.get("_flat", {}).get(key)
        if not flat or len(flat) != len(value):
            return False
        base = torch.nn.Module._load_from_state_dict
        for m in obj.modules():
            if (type(m)._load_from_state_dict is not base or m._load_state_dict_pre_hooks
                    or m._load_state_dict_post_hooks):
                return False
        return all(isinstance(k, str) and flat.get(f"{key}/{k}") is v for k, v in value.items())

    def _check_fits(self, key: str, obj: Any, loaded) -> None:
        """Raises a one-line error naming the first tensor whose shape or
        dtype differs between the checkpoint and `obj` (and, for modules,
        a tensor the checkpoint lacks), before anything is changed."""
        if not (stateful(obj) or isinstance(obj, torch.Tensor)):
            return
        current = self.__dict__.get("_flat", {}).get(key)
        if current is None:
            current = {}
            _state.flatten(_objects.state_dict_of(obj) if stateful(obj) else obj, key,
                           current)
        for name, t in current.items():
            if name not in loaded.tensors:
                if isinstance(obj, (torch.nn.Module, torch.Tensor)):
                    raise CheckpointMismatchError(
                        f"tensor {name!r} is not in checkpoint step {loaded.step} in {self.dir}")
                continue
            got = loaded.tensors[name]
            if tuple(got.shape) != tuple(t.shape) or got.dtype != t.dtype:
                raise CheckpointMismatchError(
                    f"tensor {name!r}: checkpoint step {loaded.step} has "
                    f"{_describe(got)}, the state has {_describe(t)}")


def check_options(who: str, options: dict, own=("dir", "state", "every")) -> None:
    """The Checkpointer keyword arguments an integration was given, checked
    when the integration is made, not at its first checkpoint: an unknown
    name (a typo) or one it sets itself, and the values checkable without a
    state (keep=, max_to_keep=, best=, tier=). One-line errors."""
    known = [n for n in inspect.signature(Checkpointer.__init__).parameters if n != "self"]
    for k in options:
        if k in own:
            raise CheckpointMismatchError(f"{who} sets {k}= itself")
        if k not in known:
            near = difflib.get_close_matches(k, known, n=1)
            raise CheckpointMismatchError(
                f"{who}: unknown option {k}=" + (f" (did you mean {near[0]}=?)" if near else "")
                + "; the options are nonstop.Checkpointer's (docs/PYTHON.md)")
    _manage.check_retention(options.get("keep"), options.get("max_to_keep"), options.get("best"))
    keep = options.get("keep")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise CheckpointMismatchError(f"keep must be None or a positive integer, got {keep!r}")
    if options.get("tier", "auto") not in ("auto", "memory", "disk"):
        raise CheckpointMismatchError(
            f'tier must be "auto", "memory" or "disk", got {options["tier"]!r}')


def _state_bytes_estimate(state: dict) -> int:
    """The bytes the first checkpoint of `state` will hold, as far as they
    can be told before it: every tensor of the state as it is now, plus the
    optimizer state a torch optimizer creates at its first step (Adam-style,
    `betas` in its defaults: two tensors per parameter; `momentum`: one).
    0 when the state cannot be walked now (the first save() reports that)."""
    tensors: dict = {}
    try:
        _objects.flatten_state(state, tensors)
    except Exception:  # an optimisation only: save() walks the state and raises
        return 0
    pad = 4096  # the slot layout aligns each large tensor to 4 KiB
    nbytes = sum(t.numel() * t.element_size() + pad for t in tensors.values()
                 if isinstance(t, torch.Tensor))
    for opt in _unwrap.optimizers(state.values()):
        if opt.state:
            continue  # its state exists already and was counted
        per_param = (2 if "betas" in opt.defaults else
                     1 if opt.defaults.get("momentum", 0) else 0)
        for group in opt.param_groups:
            for p in group["params"]:
                # the moments, and a small `step` tensor (Adam)
                nbytes += per_param * (p.numel() * p.element_size() + pad) + 64
    return nbytes


def _describe(t) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


