"""Real kill -9 of a training process at random points, including in the
middle of a checkpoint, then a restart that must finish bit-identically to an
uninterrupted run. Every subprocess has a hard timeout (crash_harness.py)."""
import random

import pytest
from conftest import needs_engine

import crash_harness as ch

STEPS = 30
PACE = 0.05  # seconds the child sleeps per step, so the kill lands near the step we pick


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return ch.reference(tmp_path_factory, STEPS)


@needs_engine
@pytest.mark.parametrize("seed", range(3))
def test_kill_at_random_step_then_resume_bit_identically(reference, tmp_path, seed):
    rnd = random.Random(seed)
    every = rnd.choice([1, 3])
    kill_after = rnd.randrange(every, STEPS - 2)
    # 0 s: right after ckpt.step() started a checkpoint (often still in
    # flight); otherwise somewhere in the next step.
    delay = rnd.choice([0.0, 0.0, 0.003, 0.02])
    d, final = str(tmp_path / "ck"), str(tmp_path / "final")
    restored = ch.kill_then_resume(d, STEPS, every, final, kill_after + 1, kill_delay=delay,
                                   pace=PACE)
    # The child may be a step ahead of what we read when the kill lands.
    assert restored is not None and kill_after - 2 * every - 1 <= restored <= kill_after + 2
    ch.assert_same_final(final, reference)


@needs_engine
def test_kill_in_the_middle_of_a_checkpoint_many_times(reference, tmp_path):
    """Kill right after every step of a run that checkpoints every step, so
    kills land while checkpoints are being copied, written or committed."""
    d, final = str(tmp_path / "ck"), str(tmp_path / "final")
    rnd = random.Random(7)
    for _ in range(2):  # each run makes at least 2 steps of progress
        ch.run(d, STEPS, 1, final, pace=PACE, kill_after_steps=rnd.randrange(2, 8),
               kill_delay=rnd.choice([0.0, 0.001]))
    assert ch.resume(d, STEPS, 1, final) is not None
    ch.assert_same_final(final, reference)
