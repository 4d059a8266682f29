"""Checkpoint management: list and delete. The decisions (which kept copy
is made or deleted, which may never be deleted) are C++ (JobDir,
src/jobdir/retention.cc), and so are the checks of metrics= and of the
retention options max_to_keep=/best= (_core.check_metrics,
_core.check_retention, called directly) and the rows of a listing
(_core.job_view, RemoteTier.rows); this module checks arguments."""
from __future__ import annotations

import os
from typing import Optional

from . import _ext, _remote
from .errors import CheckpointMismatchError, CheckpointNotFoundError


def list_checkpoints(dir: str, rank: int = 0, remote_options: Optional[dict] = None) -> list:
    """nonstop.list(): the job view of `rank` (engine/job_view.h), as `nonstop
    ls` lists it, or a remote's steps in the same rows (docs/PYTHON.md)."""
    path = os.fspath(dir)
    if _remote.is_remote(path, remote_options):
        return _ext.core().RemoteTier(_remote.open_store(path, remote_options)).rows(rank)
    return _ext.core().job_view(path, rank)["rows"]


def delete(dir: str, step: int, delete_kept=None) -> None:
    """Deletes the kept copy of `step` in `dir` (keep/step-N/, every rank's
    file): through `delete_kept` (a Checkpointer's engine's), else while no
    job writes to `dir`. A step in the ring is said to be there, not kept
    (C++ engine/job_view.h NotKept)."""
    path = os.fspath(dir)
    if not isinstance(step, int) or isinstance(step, bool):
        raise CheckpointMismatchError(f"step must be an integer, got {step!r}")
    if not -(1 << 63) <= step < (1 << 63):  # as the engine stores it
        raise CheckpointMismatchError(
            f"step {step} is out of range: a step is a signed 64-bit integer")
    jd = None if delete_kept else _ext.core().JobDir.open_for_maintenance(path)
    try:
        (delete_kept or jd.delete_kept)(int(step))
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(_ext.core().not_kept(path, int(step), str(e))) from None
    finally:
        if jd is not None:
            jd.close()
