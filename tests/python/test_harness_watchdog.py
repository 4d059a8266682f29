"""The child watchdog of the crash and integration harnesses
(crash_harness.Watchdog): a blocked child is killed within its window at
any load; a child that is slow because it gets little CPU (a framework
import on a loaded box under pytest -n 2) is left to finish; a silent child
that spins is killed by its own CPU time; dist_launch.run_ranks kills a
job's ranks by the same rule. Real children (no torch in them)."""
import sys

import pytest

from crash_harness import run_child
from dist_launch import run_ranks

# Silent for ~2.4 s of wall time (30 x (20 ms of CPU + 60 ms asleep)), busy
# a quarter of it (less on a loaded box, never ~0), then done.
SLOW = """
import time
for _ in range(30):
    t = time.process_time()
    while time.process_time() - t < 0.02:
        pass
    time.sleep(0.06)
print('{"event": "end"}', flush=True)
"""


def test_a_blocked_child_is_killed_as_hung():
    with pytest.raises(TimeoutError, match="hung"):
        run_child([sys.executable, "-c", "import time; time.sleep(120)"], timeout=2.0, cap=60)


def test_a_slow_child_that_works_is_not_killed():
    events = run_child([sys.executable, "-c", SLOW], timeout=1.5, cap=120)
    assert events == [{"event": "end"}]


def test_a_silent_spinning_child_is_killed_by_its_cpu_time():
    with pytest.raises(TimeoutError, match="spinning"):
        run_child([sys.executable, "-c", "while True: pass"], timeout=1.0, cap=120)


def test_ranks_that_block_are_killed_as_hung():
    """dist_launch.run_ranks, the same rule for a job's ranks: two ranks
    that sleep are hung after the window, however long the cap."""
    with pytest.raises(TimeoutError, match="ranks hung"):
        run_ranks(2, ["-c", "import time; time.sleep(120)"], timeout=2.0, cap=60)


def test_ranks_that_work_slowly_are_not_killed():
    got = run_ranks(2, ["-c", SLOW], timeout=1.5, cap=120)
    assert [(rc, lines) for rc, lines, _ in got] == [(0, [{"event": "end"}])] * 2
