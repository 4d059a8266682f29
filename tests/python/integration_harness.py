"""Runs integration_jobs.py: an uninterrupted reference, then a run SIGKILLed
after a random step and its restart through the integration; the final
weights, optimizer state and data position must match bit for bit. Every
child runs under a hard timeout (a watchdog kills it)."""
import os
import random
import subprocess
import sys
import threading

from crash_harness import assert_same_final, run_child

SCRIPT = os.path.join(os.path.dirname(__file__), "integration_jobs.py")
TIMEOUT = 90  # seconds, per child
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run(kind, ckpt_dir, steps, every, final, *, pace=0.0, kill_after_steps=None):
    """One child; with kill_after_steps, SIGKILLed right after it printed
    that many steps. Returns its JSON lines."""
    cmd = [sys.executable, SCRIPT, kind, ckpt_dir, str(steps), str(every), final,
           "--pace", str(pace)]
    return run_child(cmd, env=OFFLINE, timeout=TIMEOUT, kill_after_steps=kill_after_steps,
                     stderr=True)


def kill_resume_compare(kind, tmp_path, steps=14, every=3, pace=0.05, seed=None,
                        kill_after=None, resume_at_least=None):
    """The test: reference, kill at a random step (or after `kill_after`
    steps), resume, compare. With `resume_at_least`, the restart must have
    resumed at that step or later (from a checkpoint taken there). Returns
    (kill step, steps the restart ran)."""
    seed = random.randrange(1 << 30) if seed is None else seed
    if kill_after is None:
        kill_after = random.Random(seed).randint(every + 1, steps - 2)
    # The uninterrupted reference runs beside the run that is killed (the
    # children spend most of their time importing the framework).
    ref = str(tmp_path / "ref")
    ref_error = []

    def reference():
        try:
            run(kind, "-", steps, every, ref)
        except BaseException as e:  # raised in the test's thread below
            ref_error.append(e)

    ref_thread = threading.Thread(target=reference)
    ref_thread.start()
    try:
        ckpt = str(tmp_path / "ckpt")
        first = run(kind, ckpt, steps, every, str(tmp_path / "killed"), pace=pace,
                    kill_after_steps=kill_after)
    finally:
        ref_thread.join()
    if ref_error:
        raise ref_error[0]
    assert sum(e["event"] == "step" for e in first) == kill_after
    final = str(tmp_path / "resumed")
    second = run(kind, ckpt, steps, every, final)
    ran = [e["step"] for e in second if e["event"] == "step"]
    assert ran and ran[-1] == steps - 1, ran
    # it resumed from a checkpoint (not from scratch) whenever one was committed
    assert ran[0] <= kill_after, (seed, kill_after, ran)
    if resume_at_least is not None:
        assert ran[0] >= resume_at_least, (kill_after, ran)
    try:
        assert_same_final(ref, final)
    except AssertionError as e:
        raise AssertionError(f"{kind}: killed after {kill_after} steps (seed {seed}), "
                             f"restart ran steps {ran[0]}..{ran[-1]}: {e}") from None
    return kill_after, ran


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# 10 optimizer steps per epoch (integration_jobs: 40 samples, batches of 4):
# killed after step 17, the restart resumes from a checkpoint in epoch 2
# (steps 10..19; every=3: step 14 or 17), mid-epoch, where a loader that
# keeps only its position would replay epoch 1's order.
EPOCH2 = dict(steps=24, every=3, kill_after=18, resume_at_least=12)

