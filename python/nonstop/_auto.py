"""every="auto": checkpoint as often as a stall budget allows.

The controller keeps the training thread's *visible stall* (time blocked
inside nonstop: save() and the wait before the next optimizer step) at a
target fraction q of wall time (default 3 %), and checkpoints as often as
that allows. It is a stall budget with error feedback (a token bucket),
driven by exponentially weighted averages (EWMA):

* every step earns q x (wall time of the step) of budget and pays the stall
  it actually saw, so the long-run overhead converges to q whatever the
  predictions get wrong;
* a checkpoint starts once the budget covers the predicted stall of one
  checkpoint (the EWMA of recent ones): when stalls grow (slower copies, a
  slower medium that makes checkpoints queue), checkpoints get rarer; when
  they shrink, more frequent;
* it also waits until the previous checkpoints can have been persisted,
  T_w / N (EWMA of the engine's persist times), so that a slower medium is
  noticed before checkpoints queue behind it, not only after;
* the budget is capped at one checkpoint's worth, so a quiet stretch (e.g.
  the minimum interval) does not turn into a burst later.

docs/TUNE.md describes it with measurements. The rule itself is C++
(src/engine/schedule.h, `_core.Schedule`), the one place that decides when a
checkpoint is due for every mode; this class feeds it the clock and the
Checkpointer's stall counter.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from . import _ext


class AutoInterval:
    """Decides after each training step whether a checkpoint is due.

    target: the visible-stall fraction of wall time to keep (0.03 = 3 %).
    alpha: EWMA weight of a new observation.
    warmup: steps before the first checkpoint (step times settle first).
    min_interval, max_interval: bounds on the steps between checkpoints.
    """

    def __init__(self, target: float = 0.03, alpha: float = 0.3, warmup: int = 2,
                 min_interval: int = 1, max_interval: int = 100_000,
                 clock: Callable[[], float] = time.perf_counter):
        # Bad settings raise CheckpointMismatchError (a ValueError) from C++.
        self.schedule = _ext.core().Schedule.auto(float(target), float(alpha), int(warmup),
                                               int(min_interval), int(max_interval))
        self._clock = clock
        self.seen_counter = 0     # newest committed checkpoint fed to observe_persist

    def observe_step(self, stall_total_s: float, now=None) -> bool:
        """Call once per training step, after it, with the running total of
        visible stall. Returns True when a checkpoint should start now."""
        return self.schedule.observe_step(stall_total_s, self._clock() if now is None else now)

    def observe_persist(self, persist_s: float, max_in_flight: int) -> None:
        """Feeds one committed checkpoint's persist time (engine stats)."""
        self.schedule.observe_persist(persist_s, int(max_in_flight))

    def started(self, stall_total_s: float, now=None) -> None:
        """Call right after a checkpoint started (save() returned), with the
        stall total that now includes save()'s own time."""
        self.schedule.started(stall_total_s, self._clock() if now is None else now)

    @property
    def interval(self) -> int:
        """The interval (steps) the controller is converging to:
        ceil(stall per checkpoint / (q x step time)), within the bounds."""
        return self.schedule.state()["interval"]

    @property
    def overhead(self) -> float:
        """Measured visible stall / wall time since the first checkpoint."""
        return self.schedule.state()["overhead"]

    def state(self) -> dict:
        return self.schedule.state()
