"""mode="concurrent": whole-state checkpoints (the other modes' too), every N
steps or as often as a stall budget allows (every="auto": _core.Schedule, fed
the clock and the stall here; docs/TUNE.md). The state's tensors are copied in
the background; the step pre-hook (Session.before_update) waits for the copy."""
from __future__ import annotations

import time
from typing import Optional

from . import _distributed, _fsdp, _replica
from ._session import Driver


class Periodic(Driver):
    """The concurrent mode's driver; `interval`: every="auto"'s controller."""

    defer_staging = True

    def __init__(self, session, o=None):
        super().__init__(session)
        self.interval = None if o is None else o.mode.auto

    def step(self, step: int) -> Optional[int]:
        if self.interval is None:
            return super().step(step)
        # every="auto": ask the controller; feed it the checkpoints' persist times
        ses, auto = self.session, self.interval
        if not auto.observe_step(ses.visible_stall_s, time.perf_counter()):
            return None
        counter = self.save(step)  # step() reports background errors after it
        auto.started(ses.visible_stall_s, time.perf_counter())
        stats = ses.live().stats()  # each newly committed checkpoint's persist time
        auto.observe_commits(stats.get("recent", []), stats.get("max_in_flight", 1))
        return counter

    def save(self, step: int) -> int:
        """A whole-state checkpoint of `step`: the engine's counter."""
        t0, ses = time.perf_counter(), self.session
        ses.live()
        tensors: dict = {}
        meta = ses.meta(step, tensors)
        tensors, layouts = _shard(ses, tensors, meta)
        ses.register(ses.refs(tensors, ses.owned()), layouts)
        counter = ses.checkpoint(step, meta)  # and the remote tier's hooks (ses.remote)
        ses.visible_stall_s += time.perf_counter() - t0
        return counter

    def add_stats(self, s: dict) -> None:
        if self.interval is not None:
            s["auto"] = self.interval.state()


def _shard(ses, tensors: dict, meta: dict) -> tuple:
    """FSDP2 DTensors: each rank its local shard (_fsdp.py); (tensors, layouts)."""
    if ses.dist is None and not _fsdp.has_dtensors(tensors):
        return tensors, None
    ses.base_ptr = {n: _fsdp.data_ptr(t) for n, t in tensors.items()}
    if ses.dist is None:  # FSDP2 on a mesh of one rank: each shard is whole
        tensors, meta["dtensor"] = _fsdp.localize(tensors)
        return tensors, None
    full = tensors
    tensors, layouts, meta["dist"] = ses.dist.shard(tensors, ses.state)
    # Tensors treated as replicated must be equal on every rank: checked at the
    # first checkpoint, before the agreement thread shares the group (_replica.py).
    if not ses.replica_checked:
        rank0, _ = _distributed.module_buffers(ses.state, ses.dist.local)
        _replica.check(ses.dist, full, sorted(n for n in meta["dist"]["shared"] if n not in rank0))
        ses.replica_checked = True
    return tensors, layouts
