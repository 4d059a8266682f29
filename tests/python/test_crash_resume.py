"""Real kill -9 of a training process at random points, including in the
middle of a checkpoint, then a restart that must finish bit-identically to an
uninterrupted run. Every subprocess has a hard timeout."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import needs_engine
from safetensors.torch import load_file

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "killable_train.py")
STEPS = 30
TIMEOUT = 120
PACE = 0.05  # seconds the child sleeps per step, so the kill lands near the step we pick


def run(args, kill_after_steps=None, kill_delay=0.0):
    """Runs killable_train.py; kills it with SIGKILL `kill_delay` seconds
    after it has reported `kill_after_steps` steps. Returns the parsed lines."""
    p = subprocess.Popen([sys.executable, SCRIPT, *map(str, args)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + TIMEOUT
    events = []
    try:
        for line in p.stdout:
            ev = json.loads(line)
            events.append(ev)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args} ran past {TIMEOUT} s")
            done = sum(e["event"] == "step" for e in events)
            if kill_after_steps is not None and ev["event"] == "step" and done == kill_after_steps:
                if kill_delay:
                    time.sleep(kill_delay)
                p.send_signal(signal.SIGKILL)
                break
        rc = p.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    if kill_after_steps is None:
        assert rc == 0, f"{args} exited with {rc}"
    else:
        assert rc == -signal.SIGKILL
    return events


def same_final(a, b):
    ta, tb = load_file(a + ".safetensors"), load_file(b + ".safetensors")
    assert set(ta) == set(tb)
    for k in ta:
        assert torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8)), k
    with open(a + ".json") as f1, open(b + ".json") as f2:
        assert f1.read() == f2.read()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    final = str(tmp_path_factory.mktemp("ref") / "final")
    run(["-", STEPS, 1, final])
    return final


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
    run([d, STEPS, every, final, PACE], kill_after_steps=kill_after + 1, kill_delay=delay)
    events = run([d, STEPS, every, final])
    restored = events[0]["restored"]
    # The child may be a step ahead of what we read when the kill lands.
    assert restored is not None and kill_after - 2 * every - 1 <= restored <= kill_after + 2
    same_final(final, reference)


@needs_engine
def test_kill_in_the_middle_of_a_checkpoint_many_times(reference, tmp_path):
    """Kill right after every step of a run that checkpoints every step, so
    kills land while checkpoints are being copied, written or committed."""
    d, final = str(tmp_path / "ck"), str(tmp_path / "final")
    rnd = random.Random(7)
    for _ in range(2):  # each run makes at least 2 steps of progress
        events = run([d, STEPS, 1, final, PACE], kill_after_steps=rnd.randrange(2, 8),
                     kill_delay=rnd.choice([0.0, 0.001]))
    events = run([d, STEPS, 1, final])
    assert events[0]["restored"] is not None
    same_final(final, reference)
