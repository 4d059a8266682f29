"""The one progress bar of nonstop's long reads and writes (restore(),
nonstop.export, `nonstop export --format dcp`): a tqdm bar of bytes on
stderr, when tqdm is installed. show=None: only on a terminal and from
MIN_BYTES on, unless NONSTOP_PROGRESS ("1"/"0") says otherwise; show=True:
always; show=False: never (docs/PYTHON.md)."""
from __future__ import annotations

import os
import sys
from typing import Optional

from .errors import CheckpointMismatchError


class Progress:
    """A byte counter that draws a bar once `total` is known; callable as
    the C++ restore's progress callback (done, total) -> True."""

    MIN_BYTES = 256 << 20

    def __init__(self, desc: str, show: Optional[bool] = None):
        if show is not None and not isinstance(show, bool):
            raise CheckpointMismatchError(f"progress must be None, True or False, got {show!r}")
        env = os.environ.get("NONSTOP_PROGRESS", "")
        if show is None and env in ("0", "1"):
            show = env == "1"
        self.desc = desc
        self.forced = show is True
        self.off = show is False or (
            show is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()))
        self.bar = None

    def __call__(self, done: int, total: int) -> bool:
        """The bar at `done` of `total` bytes (created at the first call)."""
        if self.off or (not self.forced and total < self.MIN_BYTES):
            return True
        if self.bar is None:
            try:
                from tqdm import tqdm
            except ImportError:
                self.off = True
                return True
            # Every call redraws: the callers report at most every 0.1 s
            # (restore) or once per 256 MiB window (export).
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=self.desc,
                            leave=False, file=sys.stderr, mininterval=0, miniters=1)
        self.bar.update(done - self.bar.n)
        return True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
