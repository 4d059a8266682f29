"""The crash tests' harness: run killable_train.py (a tiny training job that
restores from its checkpoint directory and writes its final state), SIGKILL
it after a chosen step, run it again to the end, and compare its final state
bit for bit with an uninterrupted run's. Every child runs under a
watchdog that kills it when it is stuck (silent and blocked, spinning, or
past a hard cap), never merely slow on a loaded machine."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch
from safetensors.torch import load_file

from dist_launch import HUNG_CPU_SHARE, cpu_s
from nonstop import _state

SCRIPT = os.path.join(os.path.dirname(__file__), "killable_train.py")
TIMEOUT = 120  # seconds, per child: see Watchdog


class Watchdog:
    """Kills child `p` when it is stuck, measured so that a loaded machine
    does not look like a hang: silent (no line on stdout) for `timeout` s of
    wall time while using under HUNG_CPU_SHARE of a core (blocked: a hang,
    caught in `timeout` s at any load), or silent for `timeout` s of its own
    CPU time (spinning), or alive past `cap` s in all (4 x `timeout`). A child
    that imports a framework for 45 s of wall time on a busy box (lightning
    under pytest -n 2: 7 s of CPU) is working, not hung. `seen()` on each
    line; `reason` says why it killed, None if it did not."""

    def __init__(self, p: subprocess.Popen, timeout: float, cap=None):
        self.p, self.timeout = p, timeout
        self.cap = 4 * timeout if cap is None else cap
        self.reason = None
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self.seen()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def seen(self) -> None:
        with self._lock:
            self._t0, self._cpu0 = time.monotonic(), cpu_s(self.p.pid) or 0.0

    def _run(self) -> None:
        while not self._done.wait(0.5):
            cpu = cpu_s(self.p.pid)
            if cpu is None or self.p.poll() is not None:
                return
            now = time.monotonic()
            with self._lock:
                silent, used = now - self._t0, cpu - self._cpu0
            if silent > self.timeout and used < HUNG_CPU_SHARE * silent:
                self.reason = f"silent for {silent:.0f} s using {used:.2f} s of CPU: hung"
            elif used > self.timeout:
                self.reason = f"silent for {used:.0f} s of its own CPU time: spinning"
            elif now - self._start > self.cap:
                self.reason = f"still running after {self.cap:.0f} s"
            if self.reason is not None:
                self.p.kill()
                return

    def cancel(self) -> None:
        self._done.set()
        self._thread.join()


def run_child(cmd, *, env=None, timeout=TIMEOUT, kill_after_steps=None, kill_delay=0.0,
              stderr=False, kills_itself=False, cap=None):
    """Runs `cmd` (a child printing one JSON line per event) under a
    watchdog that kills it when stuck (Watchdog: silent and blocked for
    `timeout` s, or spinning, or past `cap`: 4 x `timeout`). Lines that are not
    '{"event"...' JSON are ignored. With `kill_after_steps`, SIGKILLs it
    `kill_delay` seconds after it reported that many "step" events. Asserts
    how it ended (exit 0, or killed by us, or by itself with `kills_itself`);
    returns its events."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE if stderr else None, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    watchdog = Watchdog(p, timeout, cap)
    events = []
    err = ""
    try:
        for line in p.stdout:
            watchdog.seen()
            if not line.startswith('{"event"'):
                continue
            ev = json.loads(line)
            events.append(ev)
            done = sum(e["event"] == "step" for e in events)
            if kill_after_steps is not None and ev["event"] == "step" and done == kill_after_steps:
                if kill_delay:
                    time.sleep(kill_delay)
                p.send_signal(signal.SIGKILL)
                break
        rc = p.wait()  # the watchdog ends a child that does not exit
        if stderr:
            err = p.stderr.read()
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
    if watchdog.reason is not None:
        raise TimeoutError(f"{cmd}: {watchdog.reason} (after {len(events)} events)")
    if kill_after_steps is None and not kills_itself:
        assert rc == 0, f"{cmd} exited with {rc}:\n{err[-3000:]}"
    else:
        assert rc == -signal.SIGKILL, f"{cmd} exited with {rc} before the kill:\n{err[-3000:]}"
    return events


def run(ckpt_dir, steps, every, final, *, options=None, pace=0.0, kill_after_steps=None,
        kill_delay=0.0, env=None, kills_itself=False):
    """Runs killable_train.py (`ckpt_dir` "-": no checkpointer). `options`
    ({"mode": "layerwise", "copy": "host", ...}) become its --flags. With
    `kill_after_steps`, SIGKILLs it `kill_delay` seconds after it reported
    that many steps (see run_child)."""
    args = [ckpt_dir, steps, every, final, pace]
    for k, v in (options or {}).items():
        args += [f"--{k.replace('_', '-')}", v]
    return run_child([sys.executable, SCRIPT, *map(str, args)], env=env,
                     kill_after_steps=kill_after_steps, kill_delay=kill_delay,
                     kills_itself=kills_itself)


def kill_then_resume(ckpt_dir, steps, every, final, kill_after_steps, *, kill_delay=0.0,
                     pace=0.0, options=None):
    """Kills a run after `kill_after_steps` steps (see run()), then runs it
    again to the end; returns the step the second run restored (or None)."""
    run(ckpt_dir, steps, every, final, options=options, pace=pace,
        kill_after_steps=kill_after_steps, kill_delay=kill_delay)
    return resume(ckpt_dir, steps, every, final, options=options)


def resume(ckpt_dir, steps, every, final, *, options=None):
    """Runs to the end from what `ckpt_dir` holds; returns the restored step."""
    events = run(ckpt_dir, steps, every, final, options=options)
    assert events[0]["event"] == "start", events[0]
    return events[0]["restored"]


_references = {}


def reference(tmp_path_factory, steps):
    """The final state of an uninterrupted run of `steps` steps without a
    checkpointer, made once per session."""
    if steps not in _references:
        final = str(tmp_path_factory.mktemp(f"ref{steps}") / "final")
        run("-", steps, 1, final)
        _references[steps] = final
    return _references[steps]


def bits(t):
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t


def assert_same_final(a, b, *, ordered=True):
    """Final states `a` and `b` (paths without extension) hold the same
    tensors bit for bit and the same JSON: text-identical when `ordered`,
    else equal as values with every dict's key order ignored (layer-wise
    training creates optimizer state in backward order)."""
    ta, tb = load_file(a + ".safetensors"), load_file(b + ".safetensors")
    assert set(ta) == set(tb)
    for k in ta:
        assert torch.equal(bits(ta[k]), bits(tb[k])), k
    with open(a + ".json") as f1, open(b + ".json") as f2:
        ja, jb = f1.read(), f2.read()
    if ordered:
        assert ja == jb
    else:
        assert _unordered(_state.loads(ja)) == _unordered(_state.loads(jb))


def _unordered(tree):
    """The tree with every {"__dict__": [[key, value], ...]} sorted by key."""
    if isinstance(tree, list):
        return [_unordered(v) for v in tree]
    if isinstance(tree, dict):
        if set(tree) == {"__dict__"} and isinstance(tree["__dict__"], list):
            return {"__dict__": sorted(([repr(k), _unordered(v)] for k, v in tree["__dict__"]),
                                       key=lambda kv: kv[0])}
        return {k: _unordered(v) for k, v in tree.items()}
    return tree
