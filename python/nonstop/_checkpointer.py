"""nonstop.Checkpointer: checkpoints a PyTorch job every few steps without
stopping it, and restores it bit-identically.

The Python side only gathers state: it turns each object's state_dict() into
named tensors (registered with the C++ engine by pointer, never copied here)
and JSON, and it installs one optimizer step pre-hook that waits until the
tensors of the checkpoint in flight have been copied. Copying, writing,
committing and reading are done by the engine, with the GIL released. The
engine and its counters belong to a Session (_session.py), the keywords are
checked into typed options (_options.py), and restoring into the live
objects is _apply.py's.
"""
from __future__ import annotations

import difflib
import inspect
import os
import time
from typing import Optional

import torch

from . import (_auto, _distributed, _ext, _fqn, _fsdp, _layerwise, _manage, _multistep,
               _objects, _options, _peer, _preempt, _remote, _replica, _restore, _rng,
               _session, _unwrap)
from ._apply import StateApplier
from ._handle import CheckpointHandle, Watcher
from ._options import MODES  # noqa: F401  (nonstop._checkpointer.MODES)
from ._read import FORMAT, check_directory
from ._restore import LoadedCheckpoint, load  # noqa: F401  nonstop.load, nonstop.LoadedCheckpoint
from .errors import CheckpointError, CheckpointMismatchError


class Checkpointer:
    """Checkpoints `state` ({"model": model, "optim": optimizer, ...}) into
    `dir` every `every` steps (or every="auto"), in the background. The
    keywords are docs/PYTHON.md's; _options.py checks and groups them."""

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
                 remote_every: Optional[int] = None, replay: str = "auto",
                 device_snapshot_bytes: Optional[int] = None, disk_every=1,
                 replicas: Optional[int] = None, peer_budget_bytes: Optional[int] = None,
                 peer_every: int = 1, peer_nice: int = 10):
        kw = dict(locals())
        del kw["self"], kw["dir"]
        o = self.options = _options.resolve(**kw)
        self.dir, self.state, self.rng, self.tier = os.fspath(dir), state, o.rng, o.engine.tier
        self.every, self.mode, self._auto = o.mode.every, o.mode.mode, o.mode.auto
        self.keep, self.max_to_keep, self.best = (o.retention.keep, o.retention.max_to_keep,
                                                  o.retention.best)
        self.rank, self.world_size = o.dist.rank, o.dist.world_size
        # When a checkpoint is due, for every mode: the one rule, in C++
        # (src/engine/schedule.h); every="auto" feeds it the clock (_auto.py).
        self._schedule = (self._auto.schedule if self._auto is not None
                          else _ext.core().Schedule.every(self.every))
        restart = _open_dir(self.dir, self.rank, self.world_size)
        dist = _open_dist(o, self.dir, state) if self.world_size > 1 else None
        # The state-sized staging is prepared in the background (below), at
        # once or, on a restart, from the end of restore().
        nbytes = _state_bytes_estimate(state) if dist is None else 0
        deferred = bool(nbytes and restart and self.mode in ("concurrent", "auto"))
        self.session = _session.Session(self.dir, None, dist, self._save, self._due_after,
                                        self._checkpoint_metrics)
        self._multistep = None
        if self.mode == "multistep":  # GoCkpt: _multistep.py, docs/MULTISTEP.md
            self._multistep = _multistep.MultistepMode(
                self, _ext.core(), dict(dir=self.dir, **_engine_kwargs(o, dist)), o.mode.parts,
                o.mode.overlap_gradients, o.mode.replay)
        # The engine opens with its smallest pool when prepare_staging follows at
        # once (bench/construct_bench.py); a restart keeps the floor.
        small = dist is None and not o.engine.staging_bytes and bool(nbytes) and not deferred
        self.session.engine = _open_engine(o, self.dir, dist, self._multistep, small)
        if dist is not None:  # replicas=: the peer tier (collective; _peer.py, docs/TIERS.md)
            try:
                dist.peers = _peer.Peers(dist, o.dist.replicas, self.session.engine,
                                         o.dist.peer_budget_bytes, o.dist.peer_every,
                                         o.dist.peer_nice)
            except Exception:
                self.session.engine.close()
                raise
        self._restore_stats: dict = {}  # the last restore(): restore_s, restore_GBps, ...
        self._applier = StateApplier(state, self.dir, self.rank, self.world_size, self.rng)
        if self._multistep is not None:  # replay="torch" checkpoints: checked before reading
            self._applier.replay_check = self._multistep.replay_check
        # Per-checkpoint handles (and on_commit) settled from the engine's
        # records by a watcher thread; _handle.py
        self._watcher = Watcher(lambda: self.session.live().stats(), o.on_commit,
                                None if dist is None else dist.agreed_step)
        # Wrapped optimizers (Accelerate's, Lightning's) are hooked where they
        # step: the torch optimizer inside (_unwrap.py).
        self._hooks = [obj.register_step_pre_hook(self._before_update)
                       for obj in _unwrap.optimizers(state.values())]
        # No first-checkpoint spike: the engine allocates the state-sized
        # staging in the background (now, or after a restart's restore()).
        self._staging_deferred = 0
        if dist is None and hasattr(self.session.engine, "prepare_staging"):
            if deferred:
                self._staging_deferred = nbytes
            elif nbytes:
                self.session.engine.prepare_staging(nbytes)
        self._layerwise = self._preempt = self._remote = self._mode_auto = None
        self._clip = o.mode.clip_grad_norm
        if self.mode == "layerwise":  # LightCheck: _layerwise.py, docs/LAYERWISE.md
            try:
                self._layerwise = _layerwise.Layerwise(self, o.mode.clip_grad_norm)
            except Exception:
                self.close()
                raise
        elif self.mode == "auto":  # layer-wise or concurrent from measurement (_auto.AutoMode)
            self._mode_auto = _auto.AutoMode()
            if any(isinstance(v, torch.nn.parallel.DistributedDataParallel)
                   for v in state.values()):
                # layer-wise's DDP communication hook could not be removed again
                self._mode_auto.unavailable = "a DDP model in state"
            else:
                try:  # can layer-wise run on this state at all? (its checks, its hooks)
                    _layerwise.Layerwise(self, self._clip).close()
                except CheckpointMismatchError as e:
                    self._mode_auto.unavailable = str(e)
        # Preemption notices (SIGTERM by default): _preempt.py, docs/PREEMPTION.md
        self._preempt = _preempt.install(self, o.on_preempt)
        # remote=: committed checkpoints also uploaded; _remote.py, docs/TIERS.md
        if o.remote is not None:
            self._remote = self.session.remote = _remote.Tier(
                self, o.remote, o.remote_options, _ext.core, _restore.read, LoadedCheckpoint)
        self._watcher.start()  # now, not inside the first save() (_handle.Watcher.start)

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
        self.session.metrics = _manage.check_metrics(metrics)
        try:
            if self.session.forked():
                self.session.live()
            self._begin_staging()
            if self._preempt is not None:
                self._preempt.at_boundary(step)
            if self._auto is not None:
                got = self._watcher.track(_auto.checkpointer_step(self, self._auto, step), step)
            elif self._multistep is not None:  # every step drives the window
                got = self._multistep.step(step, self._due_after(step))
            elif self._layerwise is not None:  # seals the checkpoint its hooks began
                got = self._watcher.track(self._layerwise.step(step), step)
            else:
                got = self._watcher.track(self._save(step), step) if self._due_after(step) else None
            if self._mode_auto is not None:
                self._mode_auto.stepped()
                if self._due_after(step):  # a window ends with its checkpoint
                    self._switch_mode(self._mode_auto.window_end(self.session.visible_stall_s),
                                      step)
        finally:
            self.session.metrics = None
        self.session.report()  # background errors since the last call, once
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
        self.session.metrics = _manage.check_metrics(metrics)
        self._begin_staging()
        try:
            handle = self._watcher.track(self._save(step), step)
        finally:
            self.session.metrics = None
        self.session.report()
        return handle

    def _begin_staging(self) -> None:
        """Starts the staging allocation __init__ deferred for a restart."""
        nbytes, self._staging_deferred = self.__dict__.get("_staging_deferred", 0), 0
        if nbytes and not self.session.forked():
            self.session.live().prepare_staging(nbytes)

    def _save(self, step: int) -> Optional[int]:
        """save() without the handle and without reporting the background
        errors: the engine's counter."""
        if self._multistep is not None:  # the window begins; version step + parts - 1
            return self._multistep.start(step)
        t0, ses = time.perf_counter(), self.session
        ses.live()
        tensors: dict[str, torch.Tensor] = {}
        meta = _meta(self.state, tensors, step, self.rank, self.world_size, self.rng,
                     self._checkpoint_metrics())
        tensors, layouts = _shard(ses, self.state, tensors, meta)
        ses.register(ses.refs(tensors, self._optimizer_owned()), layouts)
        counter = ses.checkpoint(step, meta)  # and the remote tier's hooks (ses.remote)
        ses.visible_stall_s += time.perf_counter() - t0
        return counter

    def _switch_mode(self, mode: str, step: int) -> None:
        """mode="auto": the hooks of `mode` from the next step on, right
        after step `step`'s checkpoint was started (concurrent) or sealed
        (layer-wise). Nothing in flight is cut short: to layer-wise, the
        first hook waits for the whole-model copy in flight
        (session.copy_pending); to concurrent, the next optimizer.step()
        waits for every copy in flight, the sealed layer-wise checkpoint's
        too (copy_pending set). The arithmetic is the same either way (the
        optimizer's own, per tensor on CPU: docs/LAYERWISE.md)."""
        if mode == "layerwise" and self._layerwise is None:
            self._layerwise = _layerwise.Layerwise(self, self._clip)
            self._layerwise.restored(step)  # the next backward is step + 1's
        elif mode == "concurrent" and self._layerwise is not None:
            self._layerwise.close()
            self._layerwise = None
            self.session.copy_pending = True

    def _optimizer_owned(self) -> set:  # a subclass adds its own optimizers' (lightning.py)
        return _session.optimizer_owned(self.state)

    def _before_update(self, optimizer, args, kwargs):  # the optimizers' step pre-hook
        self.session.before_update()
        if self._clip is not None and self._mode_auto is not None and self._layerwise is None:
            # mode="auto" in its concurrent stretches: clip_grad_norm= clips
            # here, as layer-wise's step pre-hook does (same tensors, same order)
            params = [p for g in optimizer.param_groups for p in g["params"]
                      if p.grad is not None]
            if params:
                torch.nn.utils.clip_grad_norm_(params, self._clip)

    def _checkpoint_metrics(self) -> Optional[dict]:
        """metrics= of the checkpoint being started. With world_size > 1 and
        best=: rank 0's on every rank (JSON over gloo; collective), so that
        every rank ranks its kept copies by the same numbers (JobDir::Retain)."""
        if self.session.dist is not None and self.best is not None:
            return self.session.dist.agree_metrics(self.session.metrics)
        return self.session.metrics

    def wait_copied(self) -> None:
        """Returns once every tensor of the checkpoints in flight has been
        copied out of its memory. Call it before changing checkpointed
        tensors by hand (outside optimizer.step())."""
        self.session.wait(committed=False)

    def wait(self) -> None:
        """Waits until every checkpoint in flight is committed. Then raises
        the errors of failed checkpoints (and keep= copies) not reported
        yet, once."""
        self.session.wait(committed=True, take=self._multistep is None)

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
        engine = self.session.live()
        if self.session.dist is not None:
            return self.session.dist.agreed_step()
        got = engine.latest()
        return None if got is None else got[1]

    def stats(self) -> dict:
        """The engine's counters and per-checkpoint times (stall, copy and
        persist seconds, GB/s, in flight), plus the time the training thread
        spent inside nonstop from Python (visible_stall_s). After close():
        the last stats, taken when everything in flight had finished."""
        if self.session.engine is None and getattr(self, "_closed_stats", None) is not None \
                and not self.session.forked():
            return dict(self._closed_stats)
        return _stats(self.session.live(), self.session, self._restore_stats, self._auto,
                      self._remote, self._mode_auto)

    def close(self) -> None:
        """Waits for the checkpoints in flight, then stops the engine; raises
        the background errors not reported yet, once. Idempotent. In a forked
        child it only lets go of the parent's engine."""
        for h in self.__dict__.get("_hooks", []):
            h.remove()
        self._hooks = []
        if self.session.forked():
            self._preempt = self._layerwise = self._remote = None
            self.session.let_go()
            return
        if getattr(self, "_preempt", None) is not None:  # puts the signal handlers back
            self._preempt.close()
        if getattr(self, "_layerwise", None) is not None:
            self._layerwise.close()
        if self.session.engine is not None:
            if self.session.dist is not None:
                # A last agreement round with every rank first: the newest
                # checkpoint every rank committed is agreed then, so its
                # handle settles as committed (not as unknown) below.
                self.session.settle()
            if getattr(self, "_watcher", None) is not None:
                self._watcher.close()  # settles the handles of what finishes now
            self._closed_stats = self.session.shut(lambda engine: _closing(
                engine, self.session, self._restore_stats, self._auto, self._remote,
                self.__dict__.get("_mode_auto")))
        self.session.report()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ management

    def list(self) -> list:
        """Every checkpoint of this rank: the ring and the kept copies, newest
        first (see nonstop.list)."""
        self.session.live()
        return _manage.list_checkpoints(self.dir, self.rank)

    def delete(self, step: int) -> None:
        """Deletes the kept copy of `step` (keep/step-N/) after the checkpoints
        in flight finish. Never the newest committed checkpoint or the one a
        restore protects; a step only in the ring is not deleted (the ring
        reuses its slots itself). CheckpointNotFoundError lists the steps there are."""
        engine = self.session.live()
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
        self.session.live()
        t0 = time.perf_counter()
        self._restore_stats = {}
        try:
            loaded, adopt = _restore.restore(self.dir, self.rank, self.world_size, self.tier, step,
                                             self.session, self._applier, self._remote,
                                             self._restore_stats)
            return None if loaded is None else _restore.install(
                loaded, adopt, self.session, self._applier, self._restore_stats,
                self._multistep, self._layerwise)
        finally:
            self._applier.done()
            self._restore_stats["restore_total_s"] = time.perf_counter() - t0
            if self._mode_auto is not None:  # the restore is no window's cost
                self._mode_auto.restart(self.session.visible_stall_s)
            self._begin_staging()  # deferred while the restore read (__init__)


def _open_dir(dir: str, rank: int, world_size: int) -> bool:
    """Checks the job directory; True when this rank has a checkpoint there
    (a restart). Rank files of another world size are set aside for
    resharding (_distributed.py; world_size > 1: collectively, in Distributed)."""
    if world_size == 1:
        _distributed.set_aside(dir, 1)
    return check_directory(dir, rank, world_size if world_size == 1 else None, must_exist=False)


def _open_dist(o, dir: str, state: dict):
    """world_size > 1: the ranks' agreement (_distributed.py, docs/DISTRIBUTED.md)."""
    d = o.dist
    dist = _distributed.Distributed(dir, d.rank, d.world_size, d.replicated, d.local,
                                    d.dist_timeout_s, agree_metrics=o.retention.best is not None)
    dist.state, dist.tier = state, o.engine.tier  # resharding; the ranks' memory segments
    if o.retention.rules[0] or o.retention.rules[3]:  # max_to_keep/best delete kept copies
        dist.tidy_kept()  # collective: every rank holds the same kept steps first
    return dist


def _meta(state: dict, tensors: dict, step: int, rank: int, world_size: int, rng: bool,
          metrics: Optional[dict]) -> dict:
    """A checkpoint's JSON document; the state's tensors added to `tensors`."""
    meta = {"format": FORMAT, "step": int(step), "rank": rank, "world_size": world_size,
            "state": _objects.flatten_state(state, tensors)}
    if rng:
        meta["rng"] = _rng.capture()
    if metrics:
        meta["metrics"] = metrics
    names = _fqn.describe(state)  # get_state_dict's names, for export (_fqn.py)
    if names:
        meta["names"] = names
    return meta


def _shard(ses, state: dict, tensors: dict, meta: dict) -> tuple:
    """FSDP2 DTensors: each rank its local shard (_fsdp.py); (tensors, layouts)."""
    if ses.dist is None and not _fsdp.has_dtensors(tensors):
        return tensors, None
    ses.base_ptr = {n: _fsdp.data_ptr(t) for n, t in tensors.items()}
    if ses.dist is None:  # FSDP2 on a mesh of one rank: each shard is whole
        tensors, meta["dtensor"] = _fsdp.localize(tensors)
        return tensors, None
    full = tensors
    tensors, layouts, meta["dist"] = _fsdp.shard(ses.dist, tensors, state)
    # Tensors treated as replicated must be equal on every rank: checked at the
    # first checkpoint, before the agreement thread shares the group (_replica.py).
    if not ses.replica_checked:
        rank0, _ = _distributed.module_buffers(state, ses.dist.local)
        _replica.check(ses.dist, full, sorted(n for n in meta["dist"]["shared"] if n not in rank0))
        ses.replica_checked = True
    return tensors, layouts


def _stats(engine, ses, restore_stats: dict, auto, remote, mode_auto=None) -> dict:
    """stats(): the engine's, the session's counters, the last restore's,
    every="auto"'s, mode="auto"'s, the distributed agreement's and the
    remote tier's."""
    s = engine.stats()
    s.update(ses.counters())
    s.update(restore_stats)
    if auto is not None:
        s["auto"] = auto.state()
    if mode_auto is not None:  # which mode runs, and the figures it was chosen from
        s["mode_auto"] = mode_auto.state()
    if ses.dist is not None:
        s.update(ses.dist.stats())
    if remote is not None:
        s["remote"] = remote.stats()
    return s


def _closing(engine, ses, restore_stats: dict, auto, remote, mode_auto=None) -> Optional[dict]:
    """At close(), once everything in flight finished: the newest checkpoint
    uploaded, and what stats() returns from now on."""
    if remote is not None:
        remote.close()
    try:
        return _stats(engine, ses, restore_stats, auto, remote, mode_auto)
    except Exception:  # noqa: BLE001 -- a failed engine: stats() says closed
        return None


def _engine_kwargs(o, dist) -> dict:
    e = o.engine
    kw = dict(rank=o.dist.rank, world_size=o.dist.world_size, max_in_flight=e.max_in_flight,
              writers=e.writers, staging_bytes=e.staging_bytes, chunk_bytes=e.chunk_bytes,
              copy_threads=e.copy_threads, medium=e.medium, keep_every=o.retention.keep or 0)
    if dist is not None:  # rank shares, global agreement on a gloo group, a pinned slot
        kw.update(extra_slots=1, global_agreement=True)
    if e.tier != "auto":  # the memory tier (docs/PYTHON.md, "tier"); auto: the engine's default
        kw["memory_tier"] = e.tier
    # Device snapshots (docs/CUDA.md): whole checkpoints of the concurrent
    # mode only; the other modes never take them, so they hold no device memory.
    if o.mode.mode not in ("concurrent", "auto"):
        kw["device_snapshot_bytes"] = 0
    elif e.device_snapshot_bytes is not None:
        kw["device_snapshot_bytes"] = e.device_snapshot_bytes
    if e.disk_every != 1:  # the tiered cadence (docs/PYTHON.md, "disk_every")
        kw["disk_every"] = e.disk_every
    return kw


def _open_engine(o, dir: str, dist, multistep, small_initial_staging: bool):
    """The engine (or the multistep window driving one), with its retention set."""
    if multistep is not None:
        engine, core = multistep, multistep.core
    else:
        kw = _engine_kwargs(o, dist)
        if o.mode.mode in ("layerwise", "auto"):
            kw["layer_copy"] = o.mode.copy
        if small_initial_staging:
            kw["small_initial_staging"] = True
        engine = core = _ext.core().Engine(dir, **kw)
    if o.retention.rules != (0, "", False, 0):
        try:
            core.set_retention(*o.retention.rules)
        except Exception:
            engine.close()
            raise
    return engine


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
    _options.check_keep(options.get("keep"))
    _options.check_tier(options.get("tier", "auto"))


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
