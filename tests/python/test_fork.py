"""Fork safety: a child forked from a process with a live Checkpointer (a
checkpoint in flight included) never hangs, at exit or anywhere, and using
the parent's Checkpointer there raises one clear line. Each child runs in a
separate Python process under a hard timeout."""
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

CHILD = textwrap.dedent(r"""
    import os, signal, sys, time
    import torch
    import nonstop
    torch.set_num_threads(1)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters())
    ck = nonstop.Checkpointer(sys.argv[1], {"model": model, "optim": opt}, every=1)
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    ck.step(0)                      # a checkpoint in flight while we fork
    how = sys.argv[2]
    pid = os.fork()
    if pid == 0:
        errors = []
        for call in (lambda: ck.step(1), ck.wait, ck.latest, lambda: ck.save(1), ck.restore):
            try:
                call()
            except nonstop.CheckpointError as e:
                errors.append(str(e))
        model(torch.randn(2, 512)).sum().backward()
        opt.step()                  # its pre-hook must not touch the parent's engine
        print("CHILD", len(errors), errors[0] if errors else "", flush=True)
        if how == "close":
            ck.close()              # must not wait for the parent's threads
        elif how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)   # the default meaning again in the child
            time.sleep(30)
            print("CHILD IGNORED SIGTERM", flush=True)
        sys.exit(7)                 # a normal exit: finalizers run
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("CHILD HUNG", flush=True)
        sys.exit(3)
    code = os.waitstatus_to_exitcode(status)
    ck.step(1)                      # the parent's Checkpointer is unaffected
    ck.wait()
    print("PARENT latest", ck.latest(), "child", code, flush=True)
    ck.close()
""")


@pytest.mark.parametrize("how", ["exit", "close", "sigterm"])
def test_a_forked_child_never_hangs_and_refuses_the_parents_checkpointer(tmp_path, how):
    script = tmp_path / "fork_child.py"
    script.write_text(CHILD)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), how],
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert "CHILD HUNG" not in out, out
    assert "CHILD IGNORED SIGTERM" not in out, out
    assert p.returncode == 0, out
    child = next(line for line in p.stdout.splitlines() if line.startswith("CHILD"))
    assert child.startswith("CHILD 5 "), out  # every use refused
    assert "forked child" in child, child
    expected_code = -15 if how == "sigterm" else 7
    assert f"PARENT latest 1 child {expected_code}" in p.stdout, out


MULTISTEP_CHILD = textwrap.dedent(r"""
    import os, sys
    import torch
    import nonstop
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    ck = nonstop.Checkpointer(sys.argv[1], {"model": model, "optim": opt}, mode="multistep",
                              every=4, on_preempt=False)
    pid = os.fork()
    if pid == 0:
        try:
            ck.save(1)
            print("CHILD SAVED", flush=True)
        except nonstop.CheckpointError as e:
            print("CHILD", e, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    ck.close()
""")


def test_save_in_a_forked_child_is_refused_in_mode_multistep_too(tmp_path):
    """docs/PYTHON.md "Fork": save() there raises in every mode (multistep's
    save never asks the engine itself)."""
    script = tmp_path / "fork_multistep.py"
    script.write_text(MULTISTEP_CHILD)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")],
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    child = next(line for line in p.stdout.splitlines() if line.startswith("CHILD"))
    assert "forked child" in child, out
