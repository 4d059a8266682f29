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

docs/TUNE.md describes it with measurements. The class has no torch or
engine in it: Checkpointer feeds it the clock and its stall counter.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional


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
        if not 0 < target < 1:
            raise ValueError(f"the overhead target must be in (0, 1), got {target!r}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if min_interval < 1 or max_interval < min_interval:
            raise ValueError("need 1 <= min_interval <= max_interval")
        self.target = float(target)
        self.alpha = float(alpha)
        self.warmup = int(warmup)
        self.min_interval = int(min_interval)
        self.max_interval = int(max_interval)
        self._clock = clock
        self._last_time: Optional[float] = None
        self._last_stall: Optional[float] = None
        self.step_s: Optional[float] = None        # EWMA of wall time per step (stall included)
        self.ckpt_stall_s: Optional[float] = None  # EWMA of visible stall per checkpoint
        self.persist_s: Optional[float] = None     # EWMA of T_w (start -> committed)
        self.max_in_flight = 1
        self.budget_s = 0.0     # earned q x wall time minus stall paid, since the first checkpoint
        self.steps = 0
        self.since_ckpt = 0
        self.checkpoints = 0
        self.wall_s = 0.0       # since the first checkpoint started
        self.stall_s = 0.0      # visible stall since the first checkpoint started
        self._window_stall = 0.0  # stall since the newest checkpoint started
        self.history: list = []   # steps between consecutive checkpoints
        self.seen_counter = 0     # newest committed checkpoint fed to observe_persist

    # ----------------------------------------------------------- observing

    def _account(self, stall_total_s: float, now: Optional[float]) -> tuple:
        """Wall time and stall since the previous call; charges the budget."""
        now = self._clock() if now is None else now
        dt = 0.0 if self._last_time is None else max(0.0, now - self._last_time)
        ds = 0.0 if self._last_stall is None else max(0.0, stall_total_s - self._last_stall)
        self._last_time, self._last_stall = now, stall_total_s
        if self.checkpoints > 0:
            self.wall_s += dt
            self.stall_s += ds
            self._window_stall += ds
            self.budget_s = min(self.budget_s + self.target * dt - ds, self._budget_cap())
        return dt, ds

    def observe_step(self, stall_total_s: float, now: Optional[float] = None) -> bool:
        """Call once per training step, after it, with the running total of
        visible stall. Returns True when a checkpoint should start now."""
        dt, _ = self._account(stall_total_s, now)
        if dt > 0:
            self.step_s = dt if self.step_s is None else self._ewma(self.step_s, dt)
        self.steps += 1
        self.since_ckpt += 1
        return self._due()

    def observe_persist(self, persist_s: float, max_in_flight: int) -> None:
        """Feeds one committed checkpoint's persist time (engine stats)."""
        if persist_s > 0:
            self.persist_s = (persist_s if self.persist_s is None
                              else self._ewma(self.persist_s, persist_s))
        self.max_in_flight = max(1, int(max_in_flight))

    def started(self, stall_total_s: float, now: Optional[float] = None) -> None:
        """Call right after a checkpoint started (save() returned), with the
        stall total that now includes save()'s own time."""
        first = self.checkpoints == 0
        if not first:
            # The previous checkpoint's window closes: what the training thread
            # waited for since it started (the wait before the next update, and
            # any wait for a free slot) is its stall. The first window holds
            # one-time costs (registering the tensors) and is not averaged.
            if self.checkpoints > 1:
                w = self._window_stall
                self.ckpt_stall_s = (w if self.ckpt_stall_s is None
                                     else self._ewma(self.ckpt_stall_s, w))
            self.history.append(self.since_ckpt)
        self._window_stall = 0.0
        self.checkpoints += 1
        if first:
            self._last_stall = None  # stall before the first checkpoint is not counted
        self._account(stall_total_s, now)
        self.since_ckpt = 0

    # ------------------------------------------------------------ deciding

    def _ewma(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def _budget_cap(self) -> float:
        # One checkpoint's worth: a stretch with no checkpoint allowed (the
        # bounds below) does not turn into a burst of them afterwards.
        return (self.ckpt_stall_s or 0.0) + self.target * (self.step_s or 0.0)

    def _no_queue_steps(self) -> int:
        if self.persist_s is None or not self.step_s:
            return 1
        return math.ceil(self.persist_s / (self.max_in_flight * self.step_s) - 1e-9)

    def _due(self) -> bool:
        if self.checkpoints == 0:
            return self.steps > self.warmup
        if self.since_ckpt < max(self.min_interval, self._no_queue_steps()):
            return False
        if self.since_ckpt >= self.max_interval:
            return True
        # Pay-as-you-go: the stall already seen has been earned back.
        return self.budget_s >= 0.0

    # ----------------------------------------------------------- reporting

    @property
    def interval(self) -> int:
        """The interval (steps) the controller is converging to:
        ceil(stall per checkpoint / (q x step time)), within the bounds."""
        if not self.step_s or self.ckpt_stall_s is None:
            return self.history[-1] if self.history else self.min_interval
        f = math.ceil(self.ckpt_stall_s / (self.target * self.step_s) - 1e-9)
        f = max(f, self._no_queue_steps())
        return int(min(self.max_interval, max(self.min_interval, f)))

    @property
    def overhead(self) -> float:
        """Measured visible stall / wall time since the first checkpoint."""
        return self.stall_s / self.wall_s if self.wall_s > 0 else 0.0

    def state(self) -> dict:
        return {"target": self.target, "interval": self.interval, "overhead": self.overhead,
                "step_s": self.step_s, "ckpt_stall_s": self.ckpt_stall_s,
                "persist_s": self.persist_s, "budget_s": self.budget_s,
                "checkpoints": self.checkpoints, "steps": self.steps,
                "last_interval": self.history[-1] if self.history else None}


def checkpointer_step(ckpt, auto: AutoInterval, step: int) -> Optional[int]:
    """Checkpointer.step() with every="auto": asks the controller, starts a
    checkpoint when it is due, and feeds back the persist times of the
    checkpoints committed since. Returns the counter, or None."""
    if not auto.observe_step(ckpt._visible_stall_s):
        return None
    counter = ckpt._save(step)  # step() reports background errors after it
    auto.started(ckpt._visible_stall_s)
    stats = ckpt._live().stats()
    seen = auto.seen_counter
    for r in stats.get("recent", ()):
        if r.get("committed") and r.get("counter", 0) > seen:
            auto.observe_persist(r.get("persist_s", 0.0), stats.get("max_in_flight", 1))
            seen = r["counter"]
    auto.seen_counter = seen
    return counter
