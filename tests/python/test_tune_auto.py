"""every="auto" (the C++ controller, _core.Schedule.auto): the interval
follows the stall, and the visible-stall overhead stays near the target. The controller is driven by a
simulated clock here, so these tests measure the control law, not the machine."""
import statistics

import pytest

from nonstop import _ext


def AutoInterval(**kw):
    return _ext.core().Schedule.auto(**kw)


class Loop:
    """A training loop on a simulated clock: each step takes `step_s`; a
    checkpoint costs `save_s` inside save() and `wait_s` in the next step's
    wait before the optimizer update (the copy not yet done)."""

    def __init__(self, auto, step_s: float):
        self.auto, self.step_s = auto, step_s
        self.now, self.stall = 0.0, 0.0
        self.pending_wait = 0.0
        self.ckpt_steps = []
        self.steps = 0

    def run(self, steps: int, wait_s: float, save_s: float = 0.001, persist_s: float = 0.0,
            step_s=None):
        t0, s0 = self.now, self.stall
        for _ in range(steps):
            self.now += step_s or self.step_s
            # the optimizer pre-hook waits for the copy of the last checkpoint
            self.now += self.pending_wait
            self.stall += self.pending_wait
            self.pending_wait = 0.0
            self.steps += 1
            if self.auto.observe_step(self.stall, now_s=self.now):
                self.now += save_s
                self.stall += save_s
                self.auto.started(self.stall, now_s=self.now)
                if persist_s:
                    self.auto.observe_persist(persist_s, 2)
                self.pending_wait = wait_s
                self.ckpt_steps.append(self.steps)
        return (self.stall - s0) / (self.now - t0)

    def intervals_after(self, step: int) -> list:
        steps = [s for s in self.ckpt_steps if s > step]
        return [b - a for a, b in zip(steps, steps[1:])]


def test_interval_follows_the_stall_and_overhead_stays_near_target():
    auto = AutoInterval(target=0.03)
    loop = Loop(auto, step_s=0.1)
    # 31 ms of stall per checkpoint: 0.031 / (0.03 * 0.1) = 10.3 steps.
    loop.run(100, wait_s=0.030)  # settle
    ovh1 = loop.run(1000, wait_s=0.030)
    f1 = statistics.median(loop.intervals_after(200))
    mark = loop.steps
    # The medium slows down: 121 ms per checkpoint, ~40 steps.
    loop.run(200, wait_s=0.120)
    ovh2 = loop.run(2000, wait_s=0.120)
    f2 = statistics.median(loop.intervals_after(mark + 200))
    mark = loop.steps
    # And recovers: 16 ms, ~5 steps.
    loop.run(100, wait_s=0.015)
    ovh3 = loop.run(1000, wait_s=0.015)
    f3 = statistics.median(loop.intervals_after(mark + 100))
    assert 9 <= f1 <= 12, f1
    assert 36 <= f2 <= 45, f2
    assert 4 <= f3 <= 7, f3
    for ovh in (ovh1, ovh2, ovh3):
        assert 0.025 <= ovh <= 0.032, (ovh1, ovh2, ovh3)
    assert auto.state()["interval"] == pytest.approx(6, abs=1)


def test_adapts_quickly_to_a_stall_step_change():
    auto = AutoInterval(target=0.05)
    loop = Loop(auto, step_s=0.05)
    loop.run(300, wait_s=0.010)  # ~4 steps
    before = len(loop.ckpt_steps)
    loop.run(100, wait_s=0.100)  # ~40 steps: at most a few checkpoints in 100 steps
    assert len(loop.ckpt_steps) - before <= 4


def test_slower_steps_mean_more_frequent_checkpoints():
    auto = AutoInterval(target=0.03)
    loop = Loop(auto, step_s=0.05)
    loop.run(1000, wait_s=0.03)
    f_fast = statistics.median(loop.intervals_after(200))
    mark = loop.steps
    loop.run(1000, wait_s=0.03, step_s=0.2)  # 4x slower steps: the same stall is cheaper
    f_slow = statistics.median(loop.intervals_after(mark + 100))
    assert f_slow * 3 <= f_fast


def test_waits_for_the_medium_before_checkpoints_queue():
    # Stall is tiny, but persisting takes 2 s with N = 2 in flight: 1 s per
    # checkpoint = 10 steps of 0.1 s. Checkpointing more often would queue.
    auto = AutoInterval(target=0.03)
    loop = Loop(auto, step_s=0.1)
    loop.run(500, wait_s=0.0, persist_s=2.0)
    assert min(loop.intervals_after(50)) >= 10
    assert auto.state()["interval"] == 10


def test_warmup_and_bounds():
    auto = AutoInterval(target=0.5, warmup=3, min_interval=2, max_interval=5)
    loop = Loop(auto, step_s=0.1)
    loop.run(4, wait_s=0.0)
    assert loop.ckpt_steps == [4]  # after 3 warm-up steps
    loop.run(60, wait_s=0.0, save_s=0.0)
    assert set(loop.intervals_after(0)) == {2}  # free checkpoints: as often as allowed
    loop.run(60, wait_s=10.0)  # hugely expensive: capped at max_interval
    assert max(loop.intervals_after(70)) == 5


def test_observes_each_committed_checkpoint_of_the_engine_stats_once():
    # _periodic hands the engine's stats()["recent"] after each start; the
    # list repeats what it reported before.
    auto = AutoInterval(target=0.03, alpha=0.5)
    recent = [{"counter": 1, "committed": True, "persist_s": 2.0},
              {"counter": 2, "committed": False, "persist_s": 9.0}]
    auto.observe_commits(recent, 2)
    assert auto.state()["persist_s"] == 2.0
    recent += [{"counter": 3, "committed": True, "persist_s": 4.0}]
    auto.observe_commits(recent, 2)  # counter 1 again: not counted twice
    assert auto.state()["persist_s"] == 3.0
    auto.observe_commits(recent, 2)  # nothing new (counted again: 3.25)
    assert auto.state()["persist_s"] == 3.0


@pytest.mark.parametrize("kw", [{"target": 0}, {"target": 1.5}, {"min_interval": 0},
                                {"min_interval": 5, "max_interval": 2}, {"alpha": 0}])
def test_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        AutoInterval(**kw)


# ------------------------------------------------- through the Checkpointer

def _auto_phase(ck, model, opt, sched, steps, first, sleep_s=0.005, clock=None):
    import time

    import tiny
    marks = []
    for s in range(first, first + steps):
        tiny.train_step(model, opt, sched, s)
        if clock is None:
            time.sleep(sleep_s)  # the rest of a training step
        else:
            clock.t += sleep_s
        if ck.step(s) is not None:
            marks.append(s)
    return marks


def _gaps(marks):
    return [b - a for a, b in zip(marks, marks[1:])]


class _Clock:
    """A simulated perf_counter: training steps and injected stalls advance
    it by exactly their nominal time, so the test does not depend on the
    load of the machine."""

    def __init__(self):
        self.t = 1000.0

    def perf_counter(self):
        return self.t


def test_checkpointer_every_auto_follows_an_injected_stall(spy_engine, tmp_path, monkeypatch):
    """A slower medium, injected as a longer wait for the copy before the
    next update: the interval grows, and shrinks again when it recovers."""
    import nonstop
    import nonstop._periodic as periodic
    import nonstop._session as ses
    import tiny
    clock = _Clock()
    monkeypatch.setattr(periodic, "time", clock)  # the whole-state save's stall counter
    monkeypatch.setattr(ses, "time", clock)  # and its Session's (the waits)
    delay = {"s": 0.003}

    def slow_wait():
        clock.t += delay["s"]

    monkeypatch.setattr(spy_engine, "before_wait_copied", slow_wait)
    model, opt, sched = tiny.make()
    with nonstop.Checkpointer(str(tmp_path / "ck"), {"model": model, "optim": opt},
                              every="auto", max_overhead=0.1) as ck:
        # 10 ms steps, q = 10 % of wall time (stall included): 3 ms of stall
        # per checkpoint -> 3 / (10 f + 3) <= 0.1 at f = 3; 30 ms -> f = 27.
        m1 = _auto_phase(ck, model, opt, sched, 60, 0, sleep_s=0.010, clock=clock)
        delay["s"] = 0.030
        m2 = _auto_phase(ck, model, opt, sched, 240, 60, sleep_s=0.010, clock=clock)
        delay["s"] = 0.003
        m3 = _auto_phase(ck, model, opt, sched, 60, 300, sleep_s=0.010, clock=clock)
        auto = ck.stats()["auto"]
    f1 = statistics.median(_gaps(m1)[2:])
    f2 = statistics.median(_gaps([s for s in m2 if s >= 100]))
    f3 = statistics.median(_gaps([s for s in m3 if s >= 320]))
    assert (f1, f2, f3) == (3, 27, 3)
    assert auto["interval"] == 3
    # Visible stall / wall time stays at the 10 % target over the run.
    assert auto["overhead"] == pytest.approx(0.1, abs=0.01), auto
    assert auto["target"] == 0.1


def test_checkpointer_every_auto_with_the_engine(core, tmp_path):
    import nonstop
    import tiny
    model, opt, sched = tiny.make()
    d = str(tmp_path / "ck")
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}, every="auto") as ck:
        marks = _auto_phase(ck, model, opt, sched, 40, 0, sleep_s=0.002)
        ck.wait()
        st = ck.stats()
    assert marks and marks[0] == 2  # after the two warm-up steps
    assert st["auto"]["checkpoints"] == len(marks)
    model2, opt2, _ = tiny.make(seed=5)
    with nonstop.Checkpointer(d, {"model": model2, "optim": opt2}, every="auto") as ck2:
        assert ck2.restore() == marks[-1]


def test_every_auto_rejects_other_modes_and_bad_targets(core, tmp_path):
    import nonstop
    import tiny
    from nonstop.errors import CheckpointMismatchError
    model, opt, _ = tiny.make()
    with pytest.raises(CheckpointMismatchError, match="auto"):
        nonstop.Checkpointer(str(tmp_path), {"model": model}, every="often")
    with pytest.raises(ValueError, match="target"):
        nonstop.Checkpointer(str(tmp_path), {"model": model}, every="auto", max_overhead=2)
