"""One handle per checkpoint: when *this* checkpoint committed, or why it
failed; settled by one watcher thread per Checkpointer from the engine's watch
(C++, src/engine/commit_watch.h), docs/PYTHON.md "Handles"."""
from __future__ import annotations

import atexit
import threading
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # not TimeoutError before 3.11
from typing import Callable, Optional

from .errors import CheckpointError, CheckpointIOError


class CheckpointHandle(Future):
    """One checkpoint started by save() or step(): a concurrent.futures.Future
    of its stats that the watcher settles (cancel() does nothing).

    step: the training step it holds; counter: the engine's checkpoint number.
    """

    def __init__(self, step: int, counter: int):
        super().__init__()
        self.step = int(step)
        self.counter = int(counter)
        self._stats: Optional[dict] = None

    def wait(self, timeout: Optional[float] = None) -> dict:
        """Blocks until the checkpoint is committed and returns its stats
        (counter, step, bytes, stall_s, copy_s, persist_s, write_GBps,
        committed, error). Raises its error when it failed, TimeoutError
        when `timeout` seconds passed first."""
        self.exception(timeout)
        return dict(self.result())  # raises its error

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Blocks like wait(); returns the checkpoint's error, or None when it committed."""
        try:
            return super().exception(timeout)
        except (TimeoutError, FutureTimeout):
            raise TimeoutError(f"checkpoint of step {self.step} not finished after {timeout} s"
                               ) from None

    @property
    def stats(self) -> Optional[dict]:
        """The engine's record of this checkpoint once done, else None."""
        return None if self._stats is None else dict(self._stats)

    def add_done_callback(self, fn: Callable[["CheckpointHandle"], object]) -> None:
        """Calls fn(handle) once the checkpoint is committed or has failed:
        on the watcher thread, or at once (on this thread) if it already is."""
        super().add_done_callback(lambda h: _call(fn, h))

    def cancel(self) -> bool:  # the engine finishes what it started
        return False

    def _settle(self, stats: Optional[dict], error: Optional[BaseException]) -> None:
        self._stats = stats
        if error is None:
            self.set_result(stats)
        else:
            self.set_exception(error)

    def __repr__(self):
        state = ("pending" if not self.done() else
                 "committed" if self.exception() is None else f"failed: {self.exception()}")
        return f"CheckpointHandle(step={self.step}, counter={self.counter}, {state})"


def _call(fn, handle) -> None:
    try:
        fn(handle)
    except Exception as e:  # a callback's bug must not stop the watcher
        warnings.warn(f"nonstop: a checkpoint callback raised {type(e).__name__}: {e}",
                      stacklevel=2)


class Watcher:
    """Settles the handles of one Checkpointer from its engine's watch
    (`watch`: the engine's CommitWatch; None for an engine without one,
    whose mode returns no handles)."""

    def __init__(self, watch, on_commit=None):
        self._watch = watch
        self._on_commit = on_commit
        self._pending: dict[int, CheckpointHandle] = {}
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Starts the thread now (the Checkpointer's constructor) rather than
        inside the first save(), which waited for it to start: 13-49 ms on
        a busy machine. It waits in the watch until close()."""
        if self._watch is None:
            return
        self._thread = threading.Thread(target=self._run, name="nonstop-handles", daemon=True)
        self._thread.start()
        # Never closed: the thread leaves the watch at interpreter exit while
        # the interpreter still runs it. (A daemon thread that returns from a
        # call that released the GIL after finalizing began is ended inside
        # pybind11's gil_scoped_release destructor: std::terminate.)
        atexit.register(self._stop_thread, 10.0)

    def track(self, counter, step: int):
        """A handle for checkpoint `counter` (None -> None)."""
        if counter is None:
            return None
        h = CheckpointHandle(step, counter)
        if self._on_commit is not None:
            h.add_done_callback(self._report)
        with self._lock:
            self._pending[h.counter] = h
        self._watch.track(h.counter, h.step)
        return h

    def _report(self, h: CheckpointHandle) -> None:
        self._on_commit(h.stats or {"counter": h.counter, "step": h.step, "committed": False,
                                    "error": str(h.exception())})

    def _run(self) -> None:
        while (settled := self._watch.next()) is not None:  # GIL released while it waits
            self._settle(settled)

    def _settle(self, settled: list) -> None:
        """(counter, record, error line, cancelled) of each settled checkpoint:
        a superseded, abandoned or unknown one is a CheckpointError, a failed
        one a CheckpointIOError (the watch's decision)."""
        for counter, record, error, cancelled in settled:
            with self._lock:
                h = self._pending.pop(counter, None)
            if h is not None:
                kind = CheckpointError if cancelled else CheckpointIOError
                h._settle(record, None if error is None else kind(error))

    def _stop_thread(self, timeout_s: Optional[float] = None) -> None:
        thread = self._thread
        if thread is None or not thread.is_alive():  # (in a forked child it never is)
            return
        self._watch.stop()  # the thread settles what is settled, then returns
        if thread is not threading.current_thread():
            thread.join(timeout_s)  # its callbacks have run when close() returns

    def close(self) -> None:
        """Settles the handles of what the engine finished (call once nothing
        is in flight: Session.shut), then stops the thread. A handle whose
        outcome is not known then (with several ranks: committed here, not
        agreed on) is settled with an error that says so."""
        if self._watch is None:
            return
        atexit.unregister(self._stop_thread)
        self._stop_thread()
        self._settle(self._watch.abandon("its outcome is unknown: the checkpointer closed first"))
