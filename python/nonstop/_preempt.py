"""Preemption notices: a committed checkpoint before the VM goes away
(docs/PREEMPTION.md). A signal (SIGTERM by default) or `ckpt.preempt()`
records the notice and prints the estimate line; the next `ckpt.step(s)`
checkpoints step `s`, waits until every rank committed it, closes the
checkpointer and raises `Preempted` (exit status 75). With several ranks the
notice flag is all-reduced (MAX) asynchronously at each step boundary, so
every rank acts at the same step, one after the first rank noticed. The
arithmetic (bandwidth, estimate) is C++: engine/preempt.h.
"""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import warnings
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import _ext
from .errors import CheckpointError

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
# Not 0 (a scheduler must not think training finished), not 1 (an error), and
# not 143 = 128 + SIGTERM, which is what a job killed by SIGTERM *without* a
# checkpoint reports: a supervisor can tell "preempted, safe to resume" apart.
EXIT_PREEMPTED = 75

class Preempted(SystemExit):
    """Raised by `ckpt.step()` once a preemption notice has been handled: a
    SystemExit with `code = exit_code` (75 by default). Attributes: step
    (resume at step + 1), notice_step, committed (on every rank), latest,
    reason ("SIGTERM", "preempt()", "rank N", ...), notice_to_safe_s,
    checkpoint (the engine's record, or None); docs/PREEMPTION.md."""

    def __init__(self, message: str, **attrs):
        super().__init__(message)  # str(): engine/preempt.h PreemptedMessage
        self.message = message
        self.__dict__.update(attrs)  # the attributes above
        self.code = self.exit_code   # the exit status when uncaught


def parse(on_preempt) -> Optional[dict]:
    """on_preempt -> its settings (signals, exit_code, grace_s, chain, group,
    timeout_s; docs/PREEMPTION.md "on_preempt"), or None when notices are
    not handled (False). Checked in C++ (engine/preempt.h ParsePreemptOptions)
    but group, a torch.distributed group."""
    if on_preempt is False:
        return None
    given = {} if on_preempt is None or on_preempt is True else on_preempt
    if isinstance(given, dict):  # (JSON has no nan, inf; group is Python's)
        given = {str(k): repr(v) if isinstance(v, float) and not math.isfinite(v) else v
                 for k, v in given.items() if k != "group"}
    cfg = _ext.core().preempt_options(json.dumps(given, default=lambda v: (  # sets: sorted lists
        sorted(v, key=str) if isinstance(v, (set, frozenset)) else repr(v))))
    cfg["group"] = on_preempt.get("group") if isinstance(on_preempt, dict) else None
    return cfg


# Every PreemptWatch alive in this process (worker_init_fn, a forked child).
_WATCHES: "weakref.WeakSet[PreemptWatch]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a forked child the preemption signals get their previous meaning
    back (docs/PYTHON.md "Fork"); the parent's collectives are not the
    child's to wait for."""
    for watch in list(_WATCHES):
        watch._work = watch._group = None
        try:
            watch.uninstall()
        except (ValueError, OSError):  # not the main thread: nothing was installed here
            watch._previous = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class PreemptWatch:
    """One Checkpointer's notice handling: the signal handlers, the flag, the
    cross-rank agreement and the emergency checkpoint. See the module doc."""

    def __init__(self, ckpt, cfg: dict, estimate):
        self.ckpt = ckpt
        self.cfg = cfg
        self._estimate = estimate  # state -> its bytes (_checkpointer._state_bytes_estimate)
        _WATCHES.add(self)
        # the first notice, the time per step and the ranks' flag (C++; thread-safe)
        self.notices = _ext.core().PreemptNotices(ckpt.rank, ckpt.world_size)
        self.signums: list[int] = []              # signals received, in order
        self._previous: dict[int, Any] = {}
        self._handling = False
        self._bytes_guess = 0
        if cfg["signals"] and threading.current_thread() is not threading.main_thread():
            warnings.warn("nonstop: Checkpointer created outside the main thread: no signal "
                          "handler installed (Python allows them only there); call "
                          "ckpt.preempt() on a notice", stacklevel=2)
        else:
            for sig in cfg["signals"]:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        self._group = self._work = None  # the side group of the flag, its all-reduce in flight
        self._flag = torch.zeros(1, dtype=torch.int32)
        if ckpt.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            warnings.warn(f"nonstop: world_size {ckpt.world_size} without an initialised "
                          f"torch.distributed: a notice is handled by the rank that gets it "
                          f"only", stacklevel=2)
        elif ckpt.world_size > 1:
            # A side group, so the flag never waits behind the training's own
            # collectives, and gloo, so it works with a CPU tensor whatever
            # the training backend (NCCL included). Collective: every rank
            # creates its Checkpointer.
            self._group = cfg["group"] if cfg["group"] is not None else dist.new_group(
                backend="gloo", timeout=timedelta(seconds=cfg["timeout_s"]))

    def uninstall(self) -> None:
        """Puts back the handlers that were there before, unless someone
        replaced ours since (then theirs stays)."""
        previous, self._previous = self._previous, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)

    def _on_signal(self, signum, frame) -> None:
        # Runs on the main thread between two bytecodes: only records the
        # notice and prints one line (_say). The same signal again means
        # "now": its previous meaning at once (docs/PREEMPTION.md "A second signal").
        if signum not in self.signums:
            self.signums.append(signum)
            self.notice(signal.Signals(signum).name)
            return
        prev = self._previous.get(signum, signal.SIG_DFL)
        _say(f"nonstop: {signal.Signals(signum).name} again: not waiting for the emergency "
             f"checkpoint")
        self.uninstall()
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL or prev is None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def notice(self, reason: str, step: Optional[int] = None) -> None:
        """Records a notice (first one wins) and prints the estimate.
        Callable from any thread and from a signal handler."""
        if not self.notices.notice(reason, step, time.monotonic()):
            return
        ses, recent, latest = self.ckpt.session, [], None
        try:
            if ses.engine is not None:
                recent, latest = ses.engine.stats().get("recent", []), ses.engine.latest()
        except Exception:  # a notice must never fail on a statistics read
            recent, latest = [], None
        nbytes = sum(r[3] for r in ses.registered) if ses.registered else self._bytes_guess
        _say(self.notices.estimate(nbytes, _ext.core().persist_bandwidth(recent),
                                   self.cfg["grace_s"], latest and latest[1])[0])

    def at_boundary(self, step: int) -> None:
        """Called by ckpt.step(step) before anything else: raises Preempted
        when a notice has to be handled at this boundary."""
        self.notices.boundary(step, time.monotonic())
        if not self._bytes_guess and not self.ckpt.session.registered:
            # before the first checkpoint registered them: once, at the first boundary
            self._bytes_guess = self._estimate(self.ckpt.state)
        due = self.notices.noticed
        if self._group is not None:
            # Multi-rank: the flag agreed at this boundary (the MAX all-reduce
            # started at the previous one); then the next one starts.
            got = 0
            if self._work is not None:
                self._work.wait()
                got = int(self._flag.item())
            self._flag.fill_(self.notices.flag())  # the MAX names the lowest noticing rank
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group,
                                         async_op=True)
            if got and not due:
                self.notice(f"rank {self.notices.first_rank(got)}", step)
            due = got > 0
        if due and not self._handling:
            self._handle(step)

    def _wait_work(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            try:
                work.wait()
            except Exception:  # a peer that already left; nothing to agree on any more
                pass

    def _handle(self, step: int) -> None:
        self._handling = True
        self.notices.handled_at(step)  # a notice before the first boundary: this step
        ckpt, error, committed, record = self.ckpt, None, False, None
        t_start = time.monotonic()
        try:  # `step`'s checkpoint, everything older in flight abandoned
            counter = ckpt.driver.emergency(step)  # None: the mode cannot cut a window short
            if counter is None:  # multistep: keep what is in flight
                ckpt.wait()
                warnings.warn("nonstop: preemption in mode 'multistep' keeps the newest "
                              "committed checkpoint only; steps after it are lost", stacklevel=4)
            else:  # its error raised when it did not commit (C++: engine/preempt.h AwaitEmergency)
                committed, record, older = ckpt.session.live().await_emergency(counter, step)
                if older is not None:  # the emergency checkpoint committed; say what failed before
                    _say(f"nonstop: an earlier checkpoint failed: {older}")
                ckpt.session.errors = []
        except Exception as e:  # still exit: the previous committed checkpoint is intact
            error = e
        if self._group is not None:  # every rank's verdict (MIN) once all have tried
            self._wait_work()
            self._flag.fill_(1 if committed else 0)
            try:
                dist.all_reduce(self._flag, op=dist.ReduceOp.MIN, group=self._group)
                committed = bool(self._flag.item())
            except Exception:
                committed = False
        try:
            latest = ckpt.latest()
        except CheckpointError:
            latest = None
        done_t, prev_handlers, signums = time.monotonic(), self._previous, list(self.signums)
        try:
            ckpt.close()  # with several ranks: a last agreement round (docs/DISTRIBUTED.md)
        except Exception as e:
            if not committed:
                error = error or e
        out = dict(reason=self.notices.reason or "?", step=step, committed=committed,
                   latest=latest, notice_to_safe_s=done_t - (self.notices.notice_s or t_start),
                   exit_code=self.cfg["exit_code"])
        line, message = _ext.core().preempt_outcome(
            **out, checkpoint_s=done_t - t_start,
            error="" if error is None else str(error) or repr(error))
        _say(line)
        if self.cfg["chain"]:
            for signum in dict.fromkeys(signums):
                prev = prev_handlers.get(signum)
                if callable(prev) and prev is not signal.default_int_handler:
                    prev(signum, None)
        raise Preempted(message, notice_step=self.notices.notice_step, checkpoint=record,
                        **out) from error

    def close(self) -> None:
        self.uninstall()
        self._wait_work()


def _say(line: str) -> None:
    """One line on stderr with os.write: safe in a signal handler (print()
    could re-enter a buffered stream the interrupted code was writing to)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def worker_init_fn(worker_id=None) -> None:
    """DataLoader(worker_init_fn=nonstop.worker_init_fn): the worker ignores
    SIGTERM (and the other signals a live Checkpointer handles), so a
    scheduler that signals the whole process group (Slurm, `kill -TERM
    -PGID`) does not kill the workers before the training process reached
    its step boundary and checkpointed; its exit then shuts them down. Call
    it first in your own worker_init_fn. docs/PREEMPTION.md."""
    sigs = {signal.SIGTERM}
    for watch in list(_WATCHES):
        sigs.update(watch.cfg["signals"])
    for sig in sorted(sigs):
        signal.signal(sig, signal.SIG_IGN)
