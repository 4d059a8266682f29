"""The memory-tier tests' one wait: until a Checkpointer's segment holds its
engine's newest committed checkpoint. The restart tests kill a job only
then, so that its restart must read memory: nothing is left to luck."""
import time


def wait_mirrored(ckpt, deadline_s: float = 60.0) -> dict:
    """Waits for every checkpoint in flight to commit, then for the memory
    tier to have copied the newest one; returns ckpt.stats(). Raises
    TimeoutError (with the tier's last error) after `deadline_s`."""
    ckpt.wait()
    engine = ckpt.session.live()
    end = time.monotonic() + deadline_s
    while True:
        s = ckpt.stats()
        newest = engine.latest()
        if newest is not None and s["memory_counter"] == newest[0]:
            return s
        if time.monotonic() > end:
            raise TimeoutError(f"the memory segment holds counter {s['memory_counter']}, the "
                               f"disk's newest is {newest}: {s.get('memory_error')!r}")
        time.sleep(0.005)  # polls a condition; the deadline bounds it
