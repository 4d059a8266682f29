"""Checkpoint management: list, delete, metrics and the retention options
(max_to_keep=, best=). The decisions (which kept copy is made or deleted,
which may never be deleted) are C++ (JobDir, src/jobdir/retention.cc); this
module checks arguments and shapes results."""
from __future__ import annotations

import math
import os
from typing import Optional

from . import _ext, _remote
from .errors import CheckpointMismatchError, CheckpointNotFoundError




def check_metrics(metrics) -> Optional[dict]:
    """metrics= of save()/step(): a dict of name -> finite number (plain
    floats are stored; a 0-d tensor or numpy scalar is converted)."""
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        raise CheckpointMismatchError(
            f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or not k:
            raise CheckpointMismatchError(f"metrics: name {k!r} is not a non-empty string")
        if hasattr(v, "item") and callable(v.item):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise CheckpointMismatchError(f"metrics[{k!r}] must be a finite number, got {v!r}")
        out[k] = float(v)
    return out


def check_retention(keep, max_to_keep, best) -> tuple:
    """(max_to_keep, metric, higher, k) for Engine.set_retention, after
    checking max_to_keep= and best=("loss", "min", 3)."""
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or isinstance(
            max_to_keep, bool) or max_to_keep < 1):
        raise CheckpointMismatchError(
            f"max_to_keep must be None or a positive integer, got {max_to_keep!r}")
    metric, higher, k = "", False, 0
    if best is not None:
        if (not isinstance(best, (tuple, list)) or len(best) != 3 or not isinstance(best[0], str)
                or not best[0] or best[1] not in ("min", "max") or not isinstance(best[2], int)
                or isinstance(best[2], bool) or best[2] < 1):
            raise CheckpointMismatchError(
                f'best must be (metric name, "min" or "max", k >= 1), e.g. ("loss", "min", 3); '
                f"got {best!r}")
        metric, higher, k = best[0], best[1] == "max", best[2]
    if max_to_keep is not None and keep is None:
        raise CheckpointMismatchError(
            "max_to_keep bounds the copies keep= makes: give keep=k as well")
    return (max_to_keep or 0, metric, higher, k)


def _row(c: dict, job: str) -> dict:
    return {"step": int(c["step"]), "counter": int(c["counter"]),
            "where": c["where"], "path": c["path"],
            "state": c["state"], "reason": c["reason"],
            "time": c["commit_unix_ns"] / 1e9 if c["commit_unix_ns"] else None,
            "bytes": int(c["bytes"]), "metrics": dict(c["metrics"]),
            "tiers": [dict(t) for t in c["tiers"]], "job": job}


def list_checkpoints(dir: str, rank: int = 0, remote_options: Optional[dict] = None) -> list:
    """Every checkpoint of `rank` in `dir`, newest first, one dict each, as
    `nonstop ls` lists them (the job view, engine/job_view.h): the ring (the
    slot file), the kept copies (keep/), the memory segment, and the steps
    the job manifest records on the remote and partners (the peer tier);
    "tiers" names every tier that holds the checkpoint. A remote (a URL, a
    path with remote_options, or a directory used as a remote) lists its
    step directories in the same rows (where="remote"; _remote.list_steps)."""
    path = os.fspath(dir)
    if _remote.is_remote(path, remote_options):
        return _remote.list_steps(path, remote_options, rank)
    view = _ext.core().job_view(path, rank)
    return [_row(c, view["job"]) for c in view["rows"]]


def not_found(path: str, rank: int, step: int) -> CheckpointNotFoundError:
    """The one-line error for a step that is not there, with the steps that
    are (C++ engine/job_view.h StepNotFound)."""
    return CheckpointNotFoundError(_ext.core().step_not_found(path, rank, step))


def check_step(step) -> int:
    """`step` as a training step (a signed 64-bit integer, as the engine
    stores it), else the one-line CheckpointMismatchError."""
    if not isinstance(step, int) or isinstance(step, bool):
        raise CheckpointMismatchError(f"step must be an integer, got {step!r}")
    if not -(1 << 63) <= step < (1 << 63):
        raise CheckpointMismatchError(
            f"step {step} is out of range: a step is a signed 64-bit integer")
    return int(step)


def delete(dir: str, step: int) -> None:
    """Deletes the kept copy of `step` in `dir` (keep/step-N/, every rank's
    file) while no job writes to `dir`."""
    path = os.fspath(dir)
    check_step(step)
    jd = _ext.core().JobDir.open_for_maintenance(path)
    try:
        delete_with(jd.delete_kept, path, step)
    finally:
        jd.close()


def delete_with(fn, path: str, step: int) -> None:
    """fn(step) (a kept copy's deletion); a step in the ring is said to be
    there, not kept (C++ engine/job_view.h NotKept)."""
    try:
        fn(int(step))
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(_ext.core().not_kept(path, int(step), str(e))) from None
