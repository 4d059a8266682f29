"""nonstop.Checkpointer: checkpoints a PyTorch job every few steps without
stopping it, and restores it bit-identically. Python only gathers state
(tensors registered with the C++ engine by pointer, never copied here) and
installs one optimizer step pre-hook that waits until the checkpoint in
flight has been copied; the engine copies, writes, commits and reads with
the GIL released. The facade over _session, _options, the mode drivers and
_apply: docs/ARCHITECTURE.md "The Python layers"."""
from __future__ import annotations

import inspect
import os
import time
from typing import Optional

import torch

from . import (_distributed, _ext, _layerwise, _manage, _multistep, _objects, _options, _peer,
               _periodic, _preempt, _remote, _restore, _session, _unwrap)
from ._apply import StateApplier
from ._handle import CheckpointHandle, Watcher
from ._read import check_directory
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
                 peer_every: int = 1, peer_nice=10, peer_bps=0):
        kw = dict(locals())
        del kw["self"], kw["dir"]
        o = self.options = _options.resolve(**kw)
        self.dir, self.state, self.rng, self.tier = os.fspath(dir), state, o.rng, o.engine.tier
        self.every, self.mode = o.mode.every, o.mode.mode
        self.keep, self.max_to_keep, self.best = (o.retention.keep, o.retention.max_to_keep,
                                                  o.retention.best)
        self.rank, self.world_size = o.dist.rank, o.dist.world_size
        # Rank files of another world size are set aside for resharding
        # (_distributed.py; world_size > 1: collectively, in Distributed).
        if self.world_size == 1:
            _distributed.set_aside(self.dir, 1)
        restart = check_directory(self.dir, self.rank, 1 if self.world_size == 1 else None,
                                  must_exist=False)  # True: this rank has a checkpoint there
        dist, d = None, o.dist
        if self.world_size > 1:  # the ranks' agreement (_distributed.py, docs/DISTRIBUTED.md)
            dist = _distributed.Distributed(self.dir, d.rank, d.world_size, d.replicated, d.local,
                                            d.dist_timeout_s, agree_metrics=self.best is not None)
            dist.state, dist.tier = state, self.tier  # resharding; the ranks' memory segments
            if o.retention.rules[0] or o.retention.rules[3]:  # max_to_keep/best delete kept copies
                dist.tidy_kept()  # collective: every rank holds the same kept steps first
        ses = self.session = _session.Session(self.dir, state, o, dist)
        self._hooks: list = []
        self._preempt = None
        try:
            # Wrapped optimizers (Accelerate's, Lightning's) are hooked where
            # they step: the torch optimizer inside (_unwrap.py).
            self.attach(state.values())
            # The mode: its checks and hooks (multistep: GoCkpt, docs/MULTISTEP.md;
            # layerwise: LightCheck, docs/LAYERWISE.md; auto: _layerwise.Switching).
            self.driver = _DRIVERS[self.mode](ses, o)
            # The state-sized staging is prepared in the background (below), at
            # once or, on a restart, from the end of restore(). The engine opens
            # with its smallest pool when prepare_staging follows at once
            # (bench/construct_bench.py); a restart keeps the floor.
            nbytes = _state_bytes_estimate(state) if dist is None else 0
            deferred = bool(nbytes and restart and self.driver.defer_staging)
            small = (dist is None and not o.engine.kwargs["staging_bytes"] and bool(nbytes)
                     and not deferred)
            engine = self.driver.open_engine(_options.engine_kwargs(o, dist is not None, small))
            if o.retention.rules != (0, "", False, 0):  # the multistep window: its core's
                try:
                    getattr(engine, "core", engine).set_retention(*o.retention.rules)
                except Exception:
                    engine.close()
                    raise
            ses.engine = engine
            if dist is not None:  # replicas=: the peer tier (collective; _peer.py, docs/TIERS.md)
                dist.peers = _peer.Peers(dist, d.replicas, ses.engine, d.peer_budget_bytes,
                                         d.peer_every, d.peer_nice, d.peer_bps)
        except Exception:
            self.close()
            raise
        self._applier = StateApplier(state, self.dir, self.rank, self.world_size, self.rng)
        self._applier.replay_check = self.driver.replay_check  # multistep's replay="torch"
        # Per-checkpoint handles (and on_commit) settled from the engine's
        # watch (C++) by a watcher thread; _handle.py
        ses.watcher = Watcher(ses.engine.watch() if hasattr(ses.engine, "watch") else None,
                              o.on_commit)
        ses.stage(nbytes, deferred)  # no first-checkpoint spike (Session.stage)
        # Preemption notices (SIGTERM by default): _preempt.py, docs/PREEMPTION.md
        cfg = _preempt.parse(o.on_preempt)  # None: on_preempt=False
        self._preempt = cfg and _preempt.PreemptWatch(self, cfg, _state_bytes_estimate)
        # remote=: committed checkpoints also uploaded; _remote.py, docs/TIERS.md
        if o.remote is not None:
            ses.remote = _remote.Tier(self, o.remote, o.remote_options, _ext.core,
                                      _restore.read, LoadedCheckpoint)
        ses.watcher.start()  # now, not inside the first save() (_handle.Watcher.start)

    def attach(self, objects) -> None:
        """Hooks the optimizers among `objects` not hooked yet (lightning.py:
        made before its optimizers exist): their step pre-hook waits for the
        copy in flight, and their tensors are copied after a checkpoint
        starts (Session.owned)."""
        new = [o for o in _unwrap.optimizers(objects)
               if all(o is not old for old in self.session.optimizers)]
        self.session.optimizers += new
        self._hooks += [o.register_step_pre_hook(self._before_update) for o in new]

    # ---------------------------------------------------------------- saving

    def step(self, step: int, metrics: Optional[dict] = None) -> Optional[CheckpointHandle]:
        """Call after the update of `step` (counted from 0). Starts a
        checkpoint when `step + 1` is a multiple of `every` (or when the
        every="auto" controller says so); returns the checkpoint's handle
        (nonstop.CheckpointHandle), or None when none was due. After a
        preemption notice it checkpoints `step` at once, waits until it is
        committed (on every rank), closes, and raises nonstop.Preempted (exit
        status 75 when uncaught).
        metrics={"loss": 0.31}: stored with the checkpoint when one starts
        (nonstop.list shows them; best= ranks kept copies by one)."""
        return self._start(step, metrics, boundary=True)

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
        return self._start(step, metrics, boundary=False)

    def _start(self, step: int, metrics, boundary: bool) -> Optional[CheckpointHandle]:
        """step() (`boundary`: the mode decides; multistep's are no handles) or save()."""
        ses = self.session
        ses.metrics = _ext.core().check_metrics(metrics)  # C++: name -> finite number
        try:
            if ses.forked():
                ses.live()
            ses.begin_staging()
            if boundary and self._preempt is not None:
                self._preempt.at_boundary(step)
            got = self.driver.step(step) if boundary else self.driver.save(step)
            if self.driver.handles or not boundary:
                got = ses.watcher.track(got, step)
        finally:
            ses.metrics = None
        ses.report()  # background errors since the last call, once
        return got

    def _before_update(self, optimizer, args, kwargs):  # the optimizers' step pre-hook
        self.session.before_update()
        self.driver.before_update(optimizer)

    def wait_copied(self) -> None:
        """Returns once every tensor of the checkpoints in flight has been
        copied out of its memory. Call it before changing checkpointed
        tensors by hand (outside optimizer.step())."""
        self.session.wait(committed=False)

    def wait(self) -> None:
        """Waits until every checkpoint in flight is committed. Then raises
        the errors of failed checkpoints (and keep= copies) not reported
        yet, once."""
        self.driver.wait()

    def preempt(self, reason: str = "preempt()") -> None:
        """A preemption notice from your own watcher (e.g. a thread polling
        the cloud metadata server); callable from any thread. The next step()
        handles it as it handles SIGTERM. See docs/PREEMPTION.md."""
        if self._preempt is None:
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
        ses = self.session
        if ses.engine is None and ses.closed_stats is not None and not ses.forked():
            return dict(ses.closed_stats)
        return ses.stats(self.driver)

    def close(self) -> None:
        """Waits for the checkpoints in flight, then stops the engine; raises
        the background errors not reported yet, once. Idempotent. In a forked
        child it only lets go of the parent's engine."""
        for h in self._hooks:
            h.remove()
        self._hooks, ses = [], self.session
        if ses.forked():
            self._preempt = None
            ses.let_go()
            return
        if self._preempt is not None:  # puts the signal handlers back
            self._preempt.close()
        if "driver" in self.__dict__:
            self.driver.detach()
        if ses.engine is not None:  # everything in flight, the handles, the engine
            ses.shut(self.driver)
        ses.report()

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
        _manage.delete(self.dir, step, engine.delete_kept)

    # ------------------------------------------------------------- restoring

    def restore(self, step: Optional[int] = None) -> Optional[int]:
        """Restores `state` in place from the newest valid checkpoint (or the
        one at `step`). Returns the restored step, or None when the directory
        holds no checkpoint yet (a fresh start). Everything (metadata, every
        tensor's name, shape and dtype against the live objects, the RNG
        record) is checked before any object is changed; a newest checkpoint
        that is damaged or malformed is skipped with a warning."""
        ses = self.session
        ses.live()
        t0 = time.perf_counter()
        ses.restore_stats = {}
        try:
            loaded, adopt = _restore.restore(self.dir, self.rank, self.world_size, self.tier, step,
                                             ses, self._applier)
            return None if loaded is None else _restore.install(
                loaded, adopt, ses, self._applier, self.driver)
        finally:
            self._applier.done()
            ses.restore_stats["restore_total_s"] = time.perf_counter() - t0
            self.driver.restart()
            ses.begin_staging()  # deferred while the restore read (__init__)


# The modes, each a driver behind _session.Driver's protocol.
_DRIVERS = {"concurrent": _periodic.Periodic, "layerwise": _layerwise.Layerwise,
            "auto": _layerwise.Switching, "multistep": _multistep.MultistepMode}


def check_options(who: str, options: dict, own=("dir", "state", "every")) -> None:
    """The Checkpointer keyword arguments an integration was given, checked
    when the integration is made, not at its first checkpoint: an unknown
    name (a typo) or one it sets itself, and the values checkable without a
    state (keep=, max_to_keep=, best=, tier=). One-line errors."""
    known = [n for n in inspect.signature(Checkpointer.__init__).parameters if n != "self"]
    _ext.core().check_option_names(who, list(options), known, list(own))  # the nearest, as difflib
    _ext.core().check_checkpointer_args({k: options[k] for k in ("keep", "tier") if k in options})
    _ext.core().check_retention(options.get("keep"), options.get("max_to_keep"),
                                options.get("best"))


def _state_bytes_estimate(state: dict) -> int:
    """The first checkpoint's bytes (C++ EstimateFirstCheckpointBytes, engine/
    checkpointer_args.h): a fresh optimizer's moments per parameter are two
    Adam-style (`betas` in its defaults), one with `momentum`. 0 when the
    state cannot be walked now (the first save() reports that)."""
    tensors: dict = {}
    try:
        _objects.flatten_state(state, tensors)
    except Exception:  # an optimisation only: save() walks the state and raises
        return 0
    fresh = [(2 if "betas" in o.defaults else 1 if o.defaults.get("momentum", 0) else 0,
              [p.numel() * p.element_size() for g in o.param_groups for p in g["params"]])
             for o in _unwrap.optimizers(state.values()) if not o.state]
    return _ext.core().estimate_first_checkpoint_bytes(
        [t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor)],
        fresh)
