"""The Checkpointer's keyword arguments, checked and grouped into a few
typed objects (every keyword of nonstop.Checkpointer is still accepted; see
docs/PYTHON.md). resolve() applies config=PATH (nonstop tune --out; its
format: docs/TUNE.md "nonstop tune"): explicit arguments override it, it
overrides the defaults."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import _data, _ext, _peer
from .errors import CheckpointMismatchError

# The keywords C++ checks as given (engine/checkpointer_args.h); every=,
# mode= and max_in_flight= after config= (mode "auto": layer-wise or
# concurrent, whichever this job measures cheaper, _layerwise.Switching).
_CHECKED = ("keep", "tier", "device_snapshot_bytes", "disk_every", "copy", "replay",
            "clip_grad_norm", "best")
# Checkpointer's defaults for the arguments a config file may set.
DEFAULTS = {"every": 10, "mode": "concurrent", "max_in_flight": 2, "writers": None,
            "staging_bytes": None, "chunk_bytes": None, "medium": "auto", "copy_threads": 1,
            "max_overhead": 0.03}


@dataclass(frozen=True)
class EngineOptions:
    """How the engine copies and writes: its constructor's arguments but
    rank and world_size (`kwargs`; C++ chose the mode's, see resolve) and
    the memory tier ("auto", "memory", "disk")."""
    kwargs: dict
    tier: str = "auto"


@dataclass(frozen=True)
class ModeOptions:
    """When a checkpoint is due and how it is taken."""
    mode: str = "concurrent"
    every: Any = 10             # an int, or "auto" (auto: the controller)
    auto: Any = None            # every="auto": its controller, a _core.Schedule
    parts: int = 7              # multistep
    overlap_gradients: bool = True
    replay: str = "auto"        # multistep: "auto", "host", "torch" (C++ ChooseMultistep checks it)
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


def load_config(path: str) -> dict:
    """Reads a config file; returns {argument: value} for the keys it sets.
    Raises a one-line CheckpointMismatchError for an unreadable file, a
    wrong type or an unknown key (checked by C++: engine/checkpointer_args.h)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise CheckpointMismatchError(f"config {path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise CheckpointMismatchError(f"config {path}: not JSON ({e})") from None
    return _ext.core().check_config(path, doc, list(DEFAULTS))


def config_settings(config: Optional[str], **explicit) -> dict:
    """The settings to use: explicit arguments (those not None), then the
    config file, then DEFAULTS."""
    settings = {**DEFAULTS, **(load_config(config) if config is not None else {})}
    settings.update({k: v for k, v in explicit.items() if v is not None})
    return settings


def resolve(state: dict, **kw) -> Options:
    """Every keyword of nonstop.Checkpointer (`kw`: all of them, as its
    signature has them), checked (one-line CheckpointMismatchError), before
    the job directory is opened."""
    remote, remote_options, remote_every = kw["remote"], kw["remote_options"], kw["remote_every"]
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
    opts = config_settings(kw["config"], **{k: kw[k] for k in DEFAULTS})
    every, mode = opts["every"], opts["mode"]
    drank, dworld = world()
    rank = drank if kw["rank"] is None else kw["rank"]
    world_size = dworld if kw["world_size"] is None else kw["world_size"]
    # Legal values and combinations of the modes, tiers and cadences: C++
    # (engine/checkpointer_args.h); disk_every "auto" comes back as 0.
    engine = _ext.core().check_checkpointer_args(
        {**{k: kw[k] for k in _CHECKED}, "every": every, "mode": mode,
         "max_in_flight": opts["max_in_flight"]}, world_size)
    engine.update(max_in_flight=opts["max_in_flight"], writers=opts["writers"] or 0,
                  staging_bytes=opts["staging_bytes"] or 0, chunk_bytes=opts["chunk_bytes"] or 0,
                  copy_threads=opts["copy_threads"], medium=opts["medium"])
    # max_to_keep= and best=("loss", "min", k): which kept copies stay
    # (checked and applied by C++ JobDir retention; docs/PYTHON.md "Managing checkpoints")
    rules = tuple(_ext.core().check_retention(kw["keep"], kw["max_to_keep"], kw["best"]))
    # every="auto": the interval adapts to keep the visible stall near
    # max_overhead (default 3 %) of wall time; see docs/TUNE.md.
    auto = _ext.core().Schedule.auto(target=opts["max_overhead"]) if every == "auto" else None
    return Options(
        engine=EngineOptions(engine, kw["tier"]),
        mode=ModeOptions(mode, every, auto, kw["parts"], kw["overlap_gradients"], kw["replay"],
                         kw["clip_grad_norm"]),
        retention=Retention(kw["keep"], kw["max_to_keep"], kw["best"], rules),
        dist=DistOptions(rank, world_size, kw["replicated"], kw["local"], kw["dist_timeout_s"],
                         *_peer.check_options(kw)),
        remote=remote, remote_options=remote_options, rng=kw["rng"], on_preempt=kw["on_preempt"],
        on_commit=kw["on_commit"])


def engine_kwargs(o: Options, distributed: bool, small_initial_staging: bool = False) -> dict:
    """The engine's constructor arguments (the multistep window's too)."""
    kw = dict(o.engine.kwargs, rank=o.dist.rank, world_size=o.dist.world_size)
    if distributed:  # rank shares, global agreement on a gloo group, a pinned slot
        kw.update(extra_slots=1, global_agreement=True)
    if small_initial_staging:
        kw["small_initial_staging"] = True
    return kw
