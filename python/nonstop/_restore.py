"""The restore path: reading one checkpoint of a rank, the newest valid one
or a given step, from the memory tier's segment or the job directory,
through the C++ restore path (nonstop.load, Checkpointer.restore); a URL
through the remote tier. What comes back is a LoadedCheckpoint."""
from __future__ import annotations

import os
import re
import time
import warnings
from typing import Optional

import torch

from . import _distributed, _ext, _progress, _remote, _state
from ._read import check_directory, decode_meta, destinations
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompatibleCheckpointError)


class LoadedCheckpoint:
    """What nonstop.load returns: one checkpoint, without a model."""

    def __init__(self, step, counter, tensors, meta, info, path):
        self.step = step            # training step
        self.counter = counter      # global checkpoint counter
        self.tensors = tensors      # name -> tensor (numpy arrays without torch)
        self.meta = meta            # the JSON document: state tree, rng, ...
        self.info = info            # the store's record: slot, commit time, sizes, ...
        self.path = path
        self.plan = None            # restore()'s checked plan (Checkpointer._prepare)

    @property
    def state(self) -> dict:
        """The saved state, rebuilt: {'model': {...}, 'optim': {...}, ...}."""
        as_numpy = not any(isinstance(t, torch.Tensor) for t in self.tensors.values())
        return _state.unflatten(self.meta.get("state", {}), self.tensors, as_numpy)

    def __repr__(self):
        return (f"LoadedCheckpoint(step={self.step}, counter={self.counter}, "
                f"tensors={len(self.tensors)}, path={self.path!r})")


def read(path: str, rank: int, step: Optional[int], world_size: Optional[int],
          as_numpy: bool, prepare=None, live: Optional[dict] = None,
          stats: Optional[dict] = None, memory: bool = False) -> Optional[LoadedCheckpoint]:
    """Reads one checkpoint of `rank` in `path`: `step`, or the newest that
    verifies (warning about each newer damaged one). None when there is none
    and `step` is None. prepare(loaded), when given, checks a checkpoint
    before it is chosen (its result becomes loaded.plan): a
    CorruptCheckpointError from it falls back to the next older one. One
    read through nonstop._core.restore, straight into `live`'s tensors where
    they fit (docs/ARCHITECTURE.md, "Restore"); `stats` gets its times and
    sizes. memory: the memory tier's segment when it verifies and the planner
    puts one of its checkpoints first, else the disk into the same tensors
    (docs/TIERS.md, "The restart tier in memory")."""
    state: dict = {"loaded": None, "after": False, "memory": False}
    warned: list = []  # counters whose failure mid-read was warned about

    def prep(info: dict):
        """Where each tensor of `info` goes, after every check; a str (the
        reason) when this checkpoint is malformed: the next older one is tried.
        prepare() runs here, before anything is written, unless the checkpoint
        is sharded: FSDP2's become DTensors in prepare(), which may copy them
        to a device, so then it runs after the read, into fresh tensors."""
        prev = state["loaded"]
        if prev is not None and prev.counter not in warned and not state["memory"]:
            # the one before failed mid-read (a memory segment's: memory_unused_because)
            warned.append(prev.counter)
            warnings.warn(f"nonstop: {prev.path}: checkpoint #{prev.counter} (step {prev.step}) "
                          f"is damaged; falling back to an older checkpoint", stacklevel=4)
        state["memory"] = info["memory"]  # the memory tier's segment
        if world_size is not None and info["world_size"] != world_size:
            raise IncompatibleCheckpointError(
                f"{path} was written by a job of world size {info['world_size']}; this job "
                f"has world size {world_size}: use the same world size or a new directory")
        where = os.path.join(path, info["where"])
        try:
            meta = decode_meta(info, where)
            sharded = bool(meta.get("dtensor") or meta.get("dist"))
            tensors, dests = destinations(info["tensors"], as_numpy,
                                          None if (sharded or as_numpy) else live)
            info = {k: v for k, v in info.items() if k != "meta_json"}
            loaded = LoadedCheckpoint(info["step"], info["counter"], tensors, meta, info, where)
            if prepare is not None and not sharded:
                loaded.plan = prepare(loaded)  # every check, before anything is written
        except CorruptCheckpointError as e:
            return str(e)
        state["loaded"], state["after"] = loaded, prepare is not None and sharded
        return dests

    exclude: list = []
    bar = _progress.Progress("nonstop restore")
    while True:
        try:
            # threads and O_DIRECT: NONSTOP_RESTORE_* (C++ RestoreOptionsFromEnv)
            got = _ext.core().restore(path, rank, prep, step=step, exclude=exclude,
                                      progress=None if bar.off else bar, memory=memory)
        except CheckpointError as e:
            if state["loaded"] is not None and "partly overwritten" not in str(e):
                raise type(e)(f"{e}; the state was partly overwritten by this restore") from None
            raise
        finally:
            bar.close()
        if got is None:
            return None
        loaded = state["loaded"]
        if state["after"]:
            try:
                loaded.plan = prepare(loaded)
            except CorruptCheckpointError as e:
                if step is not None:
                    raise
                warnings.warn(f"nonstop: {e}; falling back to an older checkpoint", stacklevel=3)
                exclude.append(int(loaded.counter))
                continue
        break
    for line in got["skipped"]:
        if any(f"checkpoint #{c} " in line for c in warned):
            continue
        warnings.warn(f"nonstop: {path}: {line}; falling back to an older checkpoint",
                      stacklevel=3)
    if stats is not None:  # the C++ restore path's RestoreStats of the read that succeeded
        st, took = got["stats"], got["restore_s"]
        stats.update(restore_read_s=st["read_s"], restore_bytes=st["data_bytes"],
                     restore_GBps=st["data_bytes"] / took / 1e9 if took > 0 else 0.0,
                     restore_step=int(got["step"]), restore_s=took,
                     restore_attempts=got["attempts"], restored_from=got["from"],
                     **{f"restore_{k}": st[k] for k in (
                         "direct_bytes", "odirect_bytes", "h2d_bytes", "h2d_wait_s")})
        if got["from"] == "disk":
            stats["memory_unused_because"] = got["memory_unused_because"] or (
                "a step was asked for" if step is not None else "tier='disk'")
    return loaded


def load(dir: str, step: Optional[int] = None, rank: int = 0,
         as_numpy: bool = False, remote_options: Optional[dict] = None) -> LoadedCheckpoint:
    """Reads a checkpoint for inspection, without a model: its tensors by
    name and its metadata. The newest valid one unless `step` is given.
    A URL ("s3://bucket/prefix"), or any path with remote_options, is read
    as a remote tier (docs/TIERS.md)."""
    path = os.fspath(dir)
    if remote_options is not None or re.match(r"^[a-z][a-z0-9+.-]*://", path):
        return _remote.load(path, step, rank, remote_options, read, as_numpy)
    check_directory(path, rank, None, must_exist=True)
    loaded = read(path, rank, step, None, as_numpy)
    if loaded is None:
        raise CheckpointNotFoundError(f"no committed checkpoint in {path}")
    return loaded


def restore(dir: str, rank: int, world_size: int, tier: str, step: Optional[int], session,
            applier):
    """Checkpointer.restore's choice of where to read: (the checkpoint read
    and checked by applier.prepare, or None for a fresh start; whether the
    engine adopts it): the remote tier when newer than every rank, the ranks'
    agreed step, a reshard to one process, the memory tier, the job directory."""
    remote, stats = session.remote, session.restore_stats
    if session.dist is not None and step is None:
        # A replaced host: the newest replica a partner holds of this rank's
        # checkpoint, fetched and verified first (the peer tier, _peer.py).
        session.dist.prefetch_peer()
    if remote is not None:
        loaded = remote.restore(step)
        if loaded is not None:  # newer than every rank's local checkpoint
            stats["restored_from"] = "remote"
            if session.dist is not None:  # every rank reads the remote copy
                stats["restored_from_per_rank"] = ["remote"] * world_size
            return loaded, True
    if session.dist is not None:  # collective: the ranks agree on the step
        return session.dist.load(session.engine, step, _ext.core, LoadedCheckpoint, lambda d: (
            check_directory(d, rank, world_size, must_exist=False)), stats=stats,
            remote=remote), False
    if world_size == 1 and _distributed.archives(dir):  # resharding to 1 process
        return _distributed.restore_single(dir, step, lambda: read(
            dir, rank, step, 1, as_numpy=False, prepare=applier.prepare),
            LoadedCheckpoint, applier.state), False
    if not check_directory(dir, rank, world_size, must_exist=step is not None):
        return None, False
    if session.copy_pending and hasattr(session.engine, "wait_copied"):
        # The tensors are read into in place: no copy of them may be in flight.
        session.take(session.engine.wait_copied)
        session.copy_pending = False
    loaded = read(dir, rank, step, world_size, as_numpy=False, prepare=applier.prepare,
                  live=applier.live_tensors(), stats=stats, memory=step is None and tier != "disk")
    return loaded, loaded is not None


def install(loaded, adopt: bool, session, applier, driver) -> int:
    """Checkpointer.restore's second half: `loaded` applied to the live
    objects, the mode told (driver.restored), the engine told (`adopt`:
    Engine::AdoptRestored keeps it intact until a newer one commits).
    Returns its step."""
    plan = loaded.plan if loaded.plan is not None else applier.prepare(loaded)
    t_apply = time.perf_counter()
    applier.apply(plan)  # into CUDA tensors: load_state_dict's H2D copies
    session.restore_stats["restore_apply_s"] = time.perf_counter() - t_apply
    driver.restored(loaded)
    if adopt and hasattr(session.engine, "adopt_restored"):
        session.engine.adopt_restored(int(loaded.counter))
    session.registered = None
    return loaded.step
