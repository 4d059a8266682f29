"""One handle per checkpoint: when *this* checkpoint committed, or why it failed.

`Checkpointer.save()` and a due `Checkpointer.step()` return a
`CheckpointHandle`. The engine keeps a record of each finished checkpoint
(its stats: counter, step, bytes, copy and persist seconds, committed, error);
one watcher thread per Checkpointer waits on the engine for those records,
with the GIL released, and settles the handles in the background: their
`done()` becomes true, `wait()` returns, callbacks run (on the watcher
thread), and `on_commit` receives the record.

Watching does not take the error away from the training thread: a failed
checkpoint still raises from the next `save()`/`step()`/`wait()` as before.
"""
from __future__ import annotations

import threading
import time
import warnings
from typing import Callable, Optional

from .errors import CheckpointError, CheckpointIOError

_FIRST_POLL_S = 0.002
_MAX_POLL_S = 0.05


class CheckpointHandle:
    """One checkpoint started by save() or step().

    step: the training step it holds; counter: the engine's checkpoint number.
    """

    def __init__(self, step: int, counter: int):
        self.step = int(step)
        self.counter = int(counter)
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._stats: Optional[dict] = None
        self._error: Optional[BaseException] = None
        self._callbacks: list = []

    def done(self) -> bool:
        """True once the checkpoint is committed or has failed."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> dict:
        """Blocks until the checkpoint is committed and returns its stats
        (counter, step, bytes, stall_s, copy_s, persist_s, write_GBps,
        committed, error). Raises its error when it failed, TimeoutError
        when `timeout` seconds passed first."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"checkpoint of step {self.step} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return dict(self._stats)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Blocks like wait(); returns the checkpoint's error, or None when it committed."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"checkpoint of step {self.step} not finished after {timeout} s")
        return self._error

    @property
    def stats(self) -> Optional[dict]:
        """The engine's record of this checkpoint once done, else None."""
        return None if self._stats is None else dict(self._stats)

    def add_done_callback(self, fn: Callable[["CheckpointHandle"], object]) -> None:
        """Calls fn(handle) once the checkpoint is committed or has failed:
        on the watcher thread, or at once (on this thread) if it already is."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def _settle(self, stats: Optional[dict], error: Optional[BaseException]) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._stats, self._error = stats, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call(fn, self)

    def __repr__(self):
        state = ("pending" if not self.done() else
                 "committed" if self._error is None else f"failed: {self._error}")
        return f"CheckpointHandle(step={self.step}, counter={self.counter}, {state})"


def _call(fn, handle) -> None:
    try:
        fn(handle)
    except Exception as e:  # a callback's bug must not stop the watcher
        warnings.warn(f"nonstop: a checkpoint callback raised {type(e).__name__}: {e}",
                      stacklevel=2)


def _error_of(stats: dict) -> BaseException:
    msg = stats.get("error") or "failed"
    text = f"checkpoint of step {stats.get('step')} failed: {msg}"
    if "superseded" in msg or "abandoned" in msg:
        return CheckpointError(text)
    return CheckpointIOError(text)


class Watcher:
    """Settles the handles of one Checkpointer from the engine's records.

    `stats` returns the engine's stats (a dict with "recent": the records of
    the last finished checkpoints, oldest first); `agreed` (distributed
    training) returns the newest globally agreed step: there a checkpoint
    counts as committed only once every rank committed it.
    """

    def __init__(self, stats: Callable[[], dict], on_commit=None,
                 agreed: Optional[Callable[[], Optional[int]]] = None):
        self._stats = stats
        self._on_commit = on_commit
        self._agreed = agreed
        self._pending: dict[int, CheckpointHandle] = {}
        self._local: dict[int, dict] = {}  # committed here, waiting for agreement
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._tracked = False  # a handle was tracked: from then on the thread exits when idle
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Starts the thread now (the Checkpointer's constructor) rather than
        inside the first save(), which waited for it to start: 13-49 ms on
        a busy machine. Until the first handle it waits for one (close()
        stops it)."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        # is_alive(): in a forked child the parent's thread is not running
        if (self._thread is None or not self._thread.is_alive()) and not self._stop:
            self._thread = threading.Thread(target=self._run, name="nonstop-handles",
                                            daemon=True)
            self._thread.start()

    def track(self, counter, step: int):
        """A handle for checkpoint `counter` (None -> None; a handle passes through)."""
        if counter is None or isinstance(counter, CheckpointHandle):
            return counter
        h = CheckpointHandle(step, counter)
        if self._on_commit is not None:
            h.add_done_callback(self._report)
        with self._lock:
            self._pending[h.counter] = h
            self._tracked = True
            self._start_locked()
        self._wake.set()
        return h

    def _report(self, h: CheckpointHandle) -> None:
        stats = h.stats or {"counter": h.counter, "step": h.step, "committed": False,
                            "error": str(h._error)}
        self._on_commit(stats)

    def _run(self) -> None:
        delay = _FIRST_POLL_S
        while True:
            with self._lock:
                if self._stop or (not self._pending and self._tracked):
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                parked = not self._pending  # start(): waits for the first handle
            if parked:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                settled = self.poll()
            except Exception:  # the engine closed under us: close() settles the rest
                settled = 0
            delay = _FIRST_POLL_S if settled else min(delay * 1.5, _MAX_POLL_S)
            self._wake.wait(delay)
            self._wake.clear()

    def poll(self) -> int:
        """Settles every pending handle whose record is there; returns how many."""
        with self._lock:
            if not self._pending:
                return 0
        stats = self._stats()
        records = {r["counter"]: r for r in stats.get("recent", ())}
        agreed = self._agreed() if self._agreed is not None else None
        done = []
        with self._lock:
            for counter, h in list(self._pending.items()):
                rec = records.get(counter) or self._local.get(counter)
                if rec is None:
                    continue
                if rec.get("committed") and self._agreed is not None:
                    if agreed is None or agreed < h.step:
                        self._local[counter] = rec
                        continue
                self._local.pop(counter, None)
                del self._pending[counter]
                done.append((h, rec))
        for h, rec in done:
            h._settle(dict(rec), None if rec.get("committed") else _error_of(rec))
        return len(done)

    def close(self, timeout_s: float = 60.0) -> None:
        """Settles what the engine finished (call before the engine closes;
        the engine must be idle or finishing), then stops the thread. A
        handle whose record cannot be found is settled with an error that
        says so."""
        with self._lock:
            self._stop = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # its callbacks have run when close() returns
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.poll()
                stats = self._stats()
            except Exception:
                break
            if "recent" not in stats:  # an engine that keeps no records
                break
            in_flight = stats.get("in_flight", 0)
            with self._lock:
                if not self._pending:
                    break
            if in_flight == 0 or time.monotonic() > deadline:
                try:
                    self.poll()
                except Exception:
                    pass
                break
            time.sleep(_FIRST_POLL_S)
        self.abandon("its outcome is unknown: the checkpointer closed first")

    def abandon(self, why: str) -> None:
        with self._lock:
            self._stop = True
            left, self._pending = list(self._pending.values()), {}
            self._local.clear()
        self._wake.set()
        for h in left:
            h._settle(None, CheckpointError(f"checkpoint of step {h.step}: {why}"))
