"""A SIGTERM to the whole process group (Slurm's `scancel`, `kill -TERM
-PGID`) of a training job with DataLoader workers: with the documented
worker_init_fn the workers ignore it, the training process commits an
emergency checkpoint and exits 75, and a restart resumes from it. Real
processes, each under a hard timeout."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
import nonstop  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def start(d, stop_at):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "pgroup_train.py"), d,
                             str(stop_at)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)


def finish(p, timeout):
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise AssertionError(f"the job did not end within {timeout} s:\n{out}")
    return out


def test_process_group_sigterm_with_dataloader_workers_commits_and_resumes(tmp_path):
    d = str(tmp_path / "ck")
    p = start(d, 10 ** 6)
    seen = []
    deadline = time.monotonic() + 120
    try:
        for line in p.stdout:
            seen.append(line)
            if line.startswith("ready"):
                break
            assert time.monotonic() < deadline, "".join(seen)
        assert seen and seen[-1].startswith("ready"), "".join(seen)
        time.sleep(0.3)
        os.killpg(p.pid, signal.SIGTERM)  # the job and both workers, as Slurm does
    finally:
        out = "".join(seen) + finish(p, 120)
    assert p.returncode == nonstop.EXIT_PREEMPTED, out
    assert "killed by signal" not in out, out
    assert "committed" in out and "failed" not in out, out
    step = nonstop.load(d).step
    assert step >= 5
    assert f"emergency checkpoint of step {step} committed" in out, out

    p = start(d, step + 3)
    out = finish(p, 180)
    assert p.returncode == 0, out
    assert f"start {step}" in out and f"done {step + 3}" in out, out
