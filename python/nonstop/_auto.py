"""every="auto": checkpoint as often as a stall budget allows (a stall
budget with error feedback over EWMAs; docs/TUNE.md, 'every="auto"'). The
rule itself is C++ (src/engine/schedule.h, `_core.Schedule`), the one place
that decides when a checkpoint is due for every mode; this class feeds it
the clock and the Checkpointer's stall counter.
"""
from __future__ import annotations

import time
from typing import Callable

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
        """Once per training step, after it, with the running total of
        visible stall: True when a checkpoint should start now."""
        return self.schedule.observe_step(stall_total_s, self._clock() if now is None else now)

    def observe_persist(self, persist_s: float, max_in_flight: int) -> None:
        """One committed checkpoint's persist time (engine stats)."""
        self.schedule.observe_persist(persist_s, int(max_in_flight))

    def started(self, stall_total_s: float, now=None) -> None:
        """Right after a checkpoint started, with the stall total that now
        includes save()'s own time."""
        self.schedule.started(stall_total_s, self._clock() if now is None else now)

    @property
    def interval(self) -> int:
        """The interval (steps) the controller is converging to."""
        return self.schedule.state()["interval"]

    def state(self) -> dict:
        return self.schedule.state()
