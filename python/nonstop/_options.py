"""The Checkpointer's keyword arguments, checked and grouped into a few
typed objects (every keyword of nonstop.Checkpointer is still accepted; see
docs/PYTHON.md). resolve() applies config=PATH (nonstop tune --out):
explicit arguments override it, it overrides the defaults."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import _auto, _config, _data, _ext, _peer, _remote
from .errors import CheckpointMismatchError

# "auto": layer-wise or concurrent, whichever this job measures cheaper (_auto.AutoMode)
MODES = ("concurrent", "layerwise", "multistep", "auto")
TIERS = ("auto", "memory", "disk")


@dataclass(frozen=True)
class EngineOptions:
    """How the engine copies and writes (its constructor's arguments)."""
    max_in_flight: int = 2
    writers: int = 0
    staging_bytes: int = 0
    chunk_bytes: int = 0
    copy_threads: int = 1
    medium: str = "auto"
    tier: str = "auto"          # the memory tier: "auto", "memory", "disk"
    # concurrent mode: device memory for device snapshots (docs/CUDA.md);
    # None: the engine's default (a quarter of free device memory), 0: off
    device_snapshot_bytes: Optional[int] = None
    disk_every: int = 1         # the tiered cadence: 1 every checkpoint on disk, N every N-th, 0 auto


@dataclass(frozen=True)
class ModeOptions:
    """When a checkpoint is due and how it is taken."""
    mode: str = "concurrent"
    every: Any = 10             # an int, or "auto" (auto: the controller)
    auto: Optional[_auto.AutoInterval] = None
    parts: int = 7              # multistep
    overlap_gradients: bool = True
    replay: str = "auto"        # multistep: "auto", "host", "torch" (_multistep.REPLAYS)
    copy: str = "host"          # layerwise
    clip_grad_norm: Optional[float] = None


@dataclass(frozen=True)
class Retention:
    """Which copies stay: keep= every n-th kept, max_to_keep=, best=."""
    keep: Optional[int] = None
    max_to_keep: Optional[int] = None
    best: Any = None
    rules: tuple = (0, "", False, 0)   # _core.check_retention: JobDir's arguments


@dataclass(frozen=True)
class DistOptions:
    """world_size > 1 (docs/DISTRIBUTED.md)."""
    rank: int = 0
    world_size: int = 1
    replicated: str = "shard"
    local: tuple = ()
    dist_timeout_s: float = 300.0
    replicas: Optional[int] = None  # the peer tier: None = 1 where another host exists
    peer_budget_bytes: Optional[int] = None  # None: a share of the memory dir's free space
    peer_every: int = 1  # the peer cadence: a replica every n-th memory checkpoint at most
    peer_nice: int = 10  # the peer threads' CPU nice increment (0: training's priority)
    peer_bps: Any = 0  # a push's pace, bytes/s (0: unpaced; "spread": over the commit interval)


@dataclass(frozen=True)
class Options:
    engine: EngineOptions
    mode: ModeOptions
    retention: Retention
    dist: DistOptions
    remote: Any = None                 # a URL or path, or None
    remote_options: Optional[dict] = None
    rng: bool = True
    on_preempt: Any = True
    on_commit: Any = None


def world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_positive(name: str, v) -> int:
    """`v`, a positive integer (not a bool), or a one-line CheckpointMismatchError."""
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise CheckpointMismatchError(f"{name} must be a positive integer, got {v!r}")
    return v


def scalar_metrics(values: dict) -> Optional[dict]:
    """metrics= from what a framework logged (the Trainer's evaluation,
    Lightning's callback_metrics): the finite numbers, one-element tensors
    read out, as name -> float; None when there is none."""
    out = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[str(k)] = float(v)
    return out or None


def check_keep(keep) -> None:
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise CheckpointMismatchError(f"keep must be None or a positive integer, got {keep!r}")


def check_device_snapshot_bytes(n, mode: str) -> None:
    if n is None:
        return
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise CheckpointMismatchError(
            f"device_snapshot_bytes must be None or a non-negative integer, got {n!r}")
    if n > 0 and mode not in ("concurrent", "auto"):
        raise CheckpointMismatchError(
            "device_snapshot_bytes= applies to mode='auto' or mode='concurrent' only")


def check_tier(tier) -> None:
    if tier not in TIERS:
        raise CheckpointMismatchError(f'tier must be "auto", "memory" or "disk", got {tier!r}')


def check_disk_every(disk_every, tier: str, mode: str, world_size: int) -> int:
    """disk_every= (the tiered cadence, docs/PYTHON.md): 1, an int N > 1,
    or "auto" (0); anything but 1 needs the memory tier and one process."""
    if disk_every == "auto":
        disk_every = 0
    if not isinstance(disk_every, int) or isinstance(disk_every, bool) or disk_every < 0:
        raise CheckpointMismatchError(
            f'disk_every must be a positive integer or "auto", got {disk_every!r}')
    if disk_every != 1 and (tier == "disk" or mode == "multistep" or world_size > 1):
        raise CheckpointMismatchError(
            "disk_every != 1 needs the memory tier (tier='auto' or 'memory'), "
            "mode='concurrent', 'layerwise' or 'auto', and world_size 1")
    return disk_every


def resolve(state: dict, **kw) -> Options:
    """Every keyword of nonstop.Checkpointer (`kw`: all of them, as its
    signature has them), checked (one-line CheckpointMismatchError), before
    the job directory is opened."""
    remote, remote_options, remote_every = kw["remote"], kw["remote_options"], kw["remote_every"]
    keep, max_to_keep, best, tier = kw["keep"], kw["max_to_keep"], kw["best"], kw["tier"]
    copy, clip_grad_norm = kw["copy"], kw["clip_grad_norm"]
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointMismatchError("state must be a dict with string keys, "
                                      "e.g. {'model': model, 'optim': optimizer}")
    if remote_every is not None:  # remote_options "every" (docs/TIERS.md)
        if remote is None:
            raise CheckpointMismatchError("remote_every= needs remote=")
        if remote_options is not None and not isinstance(remote_options, dict):
            raise CheckpointMismatchError("remote_options must be a dict")
        remote_options = {**(remote_options or {}), "every": remote_every}
    if isinstance(remote_options, dict):
        _ext.core().check_remote_every(remote_options.get("every"), kw["world_size"] or 1)
    # A data loader whose restored order would differ is refused (_data.py)
    _data.check_state(state)
    opts = _config.resolve(kw["config"], **{k: kw[k] for k in _config.DEFAULTS})
    every, mode = opts["every"], opts["mode"]
    # every="auto": the interval adapts to keep the visible stall near
    # max_overhead (default 3 %) of wall time; see _auto.py, docs/TUNE.md.
    auto = None
    if every == "auto":
        if mode != "concurrent":
            raise CheckpointMismatchError('every="auto" works with mode="concurrent" only '
                                          '(mode="auto" compares the modes over fixed windows: '
                                          'every=N)')
        auto = _auto.AutoInterval(target=opts["max_overhead"])
    if mode not in MODES:
        raise CheckpointMismatchError(
            f"mode {mode!r} is not available in this version; use one of {', '.join(MODES)}")
    if auto is None and (not isinstance(every, int) or every < 1):
        raise CheckpointMismatchError(f'every must be a positive integer or "auto", got {every!r}')
    if mode not in ("layerwise", "auto") and (copy != "host" or clip_grad_norm is not None):
        raise CheckpointMismatchError(
            "copy= and clip_grad_norm= apply to mode='layerwise' (or 'auto') only")
    if mode != "multistep" and kw["replay"] != "auto":
        raise CheckpointMismatchError("replay= applies to mode='multistep' only")
    check_keep(keep)
    # max_to_keep= and best=("loss", "min", k): which kept copies stay
    # (checked and applied by C++ JobDir retention; docs/PYTHON.md "Managing checkpoints")
    rules = tuple(_ext.core().check_retention(keep, max_to_keep, best))
    drank, dworld = world()
    rank = drank if kw["rank"] is None else kw["rank"]
    world_size = dworld if kw["world_size"] is None else kw["world_size"]
    if best is not None and every == "auto" and world_size > 1:
        raise CheckpointMismatchError(
            'best= with world_size > 1 needs every=N: every rank must checkpoint the same '
            'steps (their metrics are agreed at each checkpoint)')
    max_in_flight = check_positive("max_in_flight", opts["max_in_flight"])
    check_tier(tier)
    check_device_snapshot_bytes(kw["device_snapshot_bytes"], mode)
    if world_size > 1 and mode == "auto":
        # Under DDP layer-wise installs a communication hook, which DDP cannot
        # remove again; each rank would also measure (and pick) on its own.
        raise CheckpointMismatchError("mode='auto' is single-process only for now; with "
                                      "world_size > 1 choose mode='concurrent' or 'layerwise'")
    if world_size > 1 and mode == "multistep":
        raise CheckpointMismatchError(f"mode {mode!r} is single-process only for now; "
                                      f"use mode='concurrent' with world_size > 1")
    return Options(
        engine=EngineOptions(max_in_flight, opts["writers"] or 0, opts["staging_bytes"] or 0,
                             opts["chunk_bytes"] or 0, opts["copy_threads"], opts["medium"], tier,
                             kw["device_snapshot_bytes"],
                             check_disk_every(kw["disk_every"], tier, mode, world_size)),
        mode=ModeOptions(mode, every, auto, kw["parts"], kw["overlap_gradients"], kw["replay"],
                         copy, clip_grad_norm),
        retention=Retention(keep, max_to_keep, best, rules),
        dist=DistOptions(rank, world_size, kw["replicated"], kw["local"], kw["dist_timeout_s"],
                         *_peer.check_options(kw)),
        remote=remote, remote_options=remote_options, rng=kw["rng"], on_preempt=kw["on_preempt"],
        on_commit=kw["on_commit"])


def engine_kwargs(o: Options, distributed: bool, small_initial_staging: bool = False) -> dict:
    """The engine's constructor arguments (the multistep window's too)."""
    e = o.engine
    kw = dict(rank=o.dist.rank, world_size=o.dist.world_size, max_in_flight=e.max_in_flight,
              writers=e.writers, staging_bytes=e.staging_bytes, chunk_bytes=e.chunk_bytes,
              copy_threads=e.copy_threads, medium=e.medium, keep_every=o.retention.keep or 0)
    if distributed:  # rank shares, global agreement on a gloo group, a pinned slot
        kw.update(extra_slots=1, global_agreement=True)
    if e.tier != "auto":  # the memory tier (docs/PYTHON.md, "tier"); auto: the engine's default
        kw["memory_tier"] = e.tier
    # Device snapshots (docs/CUDA.md): whole checkpoints of the concurrent
    # mode only; the other modes never take them, so they hold no device memory.
    if o.mode.mode not in ("concurrent", "auto"):
        kw["device_snapshot_bytes"] = 0
    elif e.device_snapshot_bytes is not None:
        kw["device_snapshot_bytes"] = e.device_snapshot_bytes
    if e.disk_every != 1:  # the tiered cadence (docs/PYTHON.md, "disk_every")
        kw["disk_every"] = e.disk_every
    if o.mode.mode in ("layerwise", "auto"):
        kw["layer_copy"] = o.mode.copy
    if small_initial_staging:
        kw["small_initial_staging"] = True
    return kw
