"""Distributed checkpoints over torch.distributed (docs/DISTRIBUTED.md).

One engine per rank writes `rank-RRRRR.nsck` in the job directory. This module
adds what a rank cannot decide alone:

* **What each rank writes.** Replicated tensors (DDP parameters, buffers and
  optimizer state) are cut into `world` disjoint flat element ranges; rank r
  registers its range (a view, no copy) with its place in the global tensor
  (TensorSpec.global). `replicated="rank0"`: rank 0 writes them whole. State
  named in `local=` (ZeRO-1 optimizer shards are always local; pipeline or
  manual partitions) is written whole by its own rank.
* **Global agreement.** A background thread runs rounds on a dedicated gloo
  group (never the training group): each rank contributes its engine's
  *candidate* (the oldest committed checkpoint above the pinned one); when
  every rank holds the same step, each pins it (Engine::Pin: the slot is kept
  until a newer step is agreed) and writes `agreed-rank-RRRRR.json` durably.
  The training thread never waits for a round.
* **Recovery.** Every rank lists the steps its own file holds committed;
  the ranks pick the newest step present on all of them (with the same
  lineage), each reads and verifies its own file, and the replicated tensors
  are reassembled by an exact (uint8) all_reduce over the gloo group, so no
  rank reads another's disk. A rank that fails to verify makes all of them
  fall back to the next older common step.
"""
from __future__ import annotations

import datetime
import json
import os
import random
import threading
import time
import warnings
import zlib
from typing import Optional

import torch

from .errors import (CheckpointError, CheckpointMismatchError, CheckpointNotFoundError,
                     CorruptCheckpointError, IncompatibleCheckpointError)

REPLICATED = ("shard", "rank0")
# Tensors smaller than this (in elements) are not cut: one rank writes each whole.
MIN_SHARD_NUMEL = 1024


def is_zero(obj) -> bool:
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # torch built without distributed
        return False
    return isinstance(obj, ZeroRedundancyOptimizer)


def state_dict_of(obj):
    """The state a rank saves for `obj`: a ZeroRedundancyOptimizer saves its
    own shard (its local optimizer), never the consolidated state."""
    if is_zero(obj):
        sd = obj.optim.state_dict()
        # ZeRO copies its own param_groups into the local optimizer only at
        # the next step: a scheduler's newest lr is in ZeRO's groups.
        for local, mine in zip(sd["param_groups"], obj.param_groups):
            local.update({k: v for k, v in mine.items() if k != "params"})
        return sd
    return obj.state_dict()


def load_state_dict_into(obj, value) -> None:
    if is_zero(obj):
        obj.optim.load_state_dict(value)
        # ZeRO copies its own param_groups into the local optimizer at each
        # step: give them the restored hyperparameters (lr, betas, ...).
        for mine, local in zip(obj.param_groups, obj.optim.param_groups):
            for k, v in local.items():
                if k != "params":
                    mine[k] = v
        return
    obj.load_state_dict(value)


def local_optimizer_tensors(obj) -> list:
    """Tensors only `obj.step()` changes, beyond obj.param_groups/obj.state."""
    if not is_zero(obj):
        return []
    return [v for st in obj.optim.state.values() for v in st.values()
            if isinstance(v, torch.Tensor)]


def module_buffers(stateful_keys: dict, local) -> tuple[set, set]:
    """(names written whole by rank 0, names each rank writes for itself) of
    the module buffers (BatchNorm running statistics, ...) in the state.

    DDP broadcasts rank 0's buffers at the *start* of each forward, so when a
    checkpoint is taken the ranks' buffers differ (each updated them with its
    own batch) and rank 0's are the ones every rank will use next: rank 0
    writes them whole and every rank restores them. With
    broadcast_buffers=False each rank keeps its own buffers: rank-local."""
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except ImportError:
        DDP = ()
    rank0, own = set(), set()
    for key, obj in stateful_keys.items():
        if key in local or not isinstance(obj, torch.nn.Module):
            continue
        names = {f"{key}/{n}" for n, _ in obj.named_buffers()}
        if isinstance(obj, DDP) and not obj.broadcast_buffers:
            own |= names
        else:
            rank0 |= names
    return rank0, own


def _owner(name: str, world: int) -> int:
    return zlib.crc32(name.encode()) % world


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def agreed_path(dir: str, rank: int) -> str:
    return os.path.join(dir, f"agreed-rank-{rank:05d}.json")


def read_agreed(dir: str, rank: int) -> Optional[dict]:
    try:
        with open(agreed_path(dir, rank)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class Distributed:
    """The distributed side of one Checkpointer on one rank."""

    def __init__(self, dir: str, rank: int, world: int, replicated: str = "shard",
                 local=(), timeout_s: float = 300.0, agree_every_s: float = 0.05):
        if replicated not in REPLICATED:
            raise CheckpointMismatchError(
                f"replicated must be one of {', '.join(REPLICATED)}, got {replicated!r}")
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError(
                f"world_size={world} needs torch.distributed initialised "
                f"(torch.distributed.init_process_group, or run under torchrun)")
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise CheckpointMismatchError(
                f"rank {rank} of world size {world} given, but torch.distributed says rank "
                f"{dist.get_rank()} of {dist.get_world_size()}")
        self.dir, self.rank, self.world = dir, rank, world
        self.replicated = replicated
        self.local = set(local)
        self.agree_every_s = agree_every_s
        # A dedicated gloo group with its own timeout: agreement and recovery
        # never touch the training group (NCCL watchdogs, GIL contention).
        self.group = dist.new_group(backend="gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        # The lineage names one run of training from one restored (or fresh)
        # state: after a restore, checkpoints of the abandoned future (same
        # steps, other lineage) are never mixed with new ones.
        self.lineage = self._new_lineage()
        self.engine = None
        self.agreed: Optional[dict] = read_agreed(dir, rank)
        self.rounds = 0
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _new_lineage(self) -> int:
        t = torch.tensor([random.SystemRandom().getrandbits(62) if self.rank == 0 else 0],
                         dtype=torch.int64)
        torch.distributed.broadcast(t, src=0, group=self.group)
        return int(t.item())

    # ------------------------------------------------------------- saving

    def shard(self, tensors: dict, stateful_keys: dict) -> tuple[dict, dict, dict]:
        """Cuts this rank's share out of `tensors` (name -> tensor).

        stateful_keys maps a state key to the object under it. Returns
        (tensors to register, name -> (global_shape, global_offset), the
        meta["dist"] document)."""
        out, layouts, shared = {}, {}, {}
        rank0, own = module_buffers(stateful_keys, self.local)
        for name, t in tensors.items():
            key = name.split("/", 1)[0]
            if key in self.local or is_zero(stateful_keys.get(key)) or name in own:
                out[name] = t
                continue
            shared[name] = [list(t.shape), str(t.dtype).replace("torch.", "")]
            n = t.numel()
            if (self.replicated == "rank0" or name in rank0 or n < MIN_SHARD_NUMEL
                    or not t.is_contiguous()):
                owner = 0 if self.replicated == "rank0" or name in rank0 else _owner(
                    name, self.world)
                if owner == self.rank:
                    out[name] = t
                    layouts[name] = (list(t.shape), 0)
                continue
            per = -(-n // self.world)
            begin, end = min(self.rank * per, n), min((self.rank + 1) * per, n)
            if begin == end:
                continue
            out[name] = t.detach().reshape(-1)[begin:end]
            layouts[name] = (list(t.shape), begin)
        doc = {"world_size": self.world, "lineage": self.lineage, "replicated": self.replicated,
               "shared": shared}
        return out, layouts, doc

    def started(self, engine) -> None:
        """Called after each checkpoint is started: the first one starts the
        agreement thread (after restore(), whose collectives share the group)."""
        if self._thread is None and not self._stop.is_set():
            self.engine = engine
            self._thread = threading.Thread(target=self._loop, name="nonstop-agree",
                                            daemon=True)
            self._thread.start()

    # ---------------------------------------------------------- agreement

    def _loop(self) -> None:
        dist = torch.distributed
        try:
            while True:
                cand = self.engine.candidate()
                step = -1 if cand is None else int(cand[1])
                stopping = 1 if self._stop.is_set() else 0
                newest = self.engine.latest() if stopping else None
                mine = torch.tensor([step, stopping, -1 if newest is None else int(newest[1])],
                                    dtype=torch.int64)
                got = [torch.zeros(3, dtype=torch.int64) for _ in range(self.world)]
                dist.all_gather(got, mine, group=self.group)
                self.rounds += 1
                steps = [int(g[0]) for g in got]
                agreed_step = -1 if self.agreed is None else self.agreed["step"]
                if step >= 0 and all(s == step for s in steps):
                    if step > agreed_step or self.agreed.get("lineage") != self.lineage:
                        self._pin(cand[0], step)
                elif cand is not None and max(steps) > step:
                    # A peer holds a newer candidate: it never kept ours
                    # (superseded there), so ours can never be agreed.
                    self.engine.drop_candidate(cand[0])
                if all(int(g[1]) for g in got):
                    # Closing: nothing is in flight and nothing more will be
                    # written, so the newest checkpoint every rank committed
                    # stays intact even where its slot was not kept: agree on it.
                    last = [int(g[2]) for g in got]
                    if newest is not None and all(x == last[0] for x in last) and (
                            last[0] > (self.agreed_step() if self.agreed_step() is not None
                                       else -1)):
                        if cand is not None and cand[0] == newest[0]:
                            self.engine.pin(newest[0])
                        self._record(int(newest[0]), last[0])
                    return
                self._stop.wait(self.agree_every_s)
        except BaseException as e:  # surfaces in stats() and close()
            self.error = e

    def _pin(self, counter: int, step: int) -> None:
        self.engine.pin(counter)
        self._record(counter, step)

    def _record(self, counter: int, step: int) -> None:
        rec = {"step": step, "counter": counter, "lineage": self.lineage, "rank": self.rank,
               "world_size": self.world, "unix_s": time.time()}
        _atomic_write(agreed_path(self.dir, self.rank), json.dumps(rec))
        self.agreed = rec

    def agreed_step(self) -> Optional[int]:
        a = self.agreed
        return None if a is None or a.get("lineage") != self.lineage else a["step"]

    def close(self) -> None:
        """Stops the agreement thread once every rank is closing, after a last
        round (so a checkpoint every rank committed before close is agreed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 10)
            self._thread = None
        if self.error is not None:
            e, self.error = self.error, None
            warnings.warn(f"nonstop: rank {self.rank}: global agreement stopped: {e}",
                          stacklevel=3)

    def stats(self) -> dict:
        return {"agreed_step": self.agreed_step(), "rounds": self.rounds,
                "lineage": self.lineage, "agreement_error": repr(self.error) if self.error else None}

    # ------------------------------------------------------------ recovery

    def load(self, engine, step: Optional[int], core, loaded_cls, check_world):
        """Agrees with the peers on the checkpoint to restore, reads it and
        pins it. Returns a LoadedCheckpoint with complete tensors (the
        replicated ones reassembled), or None on a fresh start everywhere.
        Collective: every rank must call it, before its first save()."""
        if self._thread is not None:
            raise CheckpointError("restore() after save() is not supported with world_size > 1; "
                                  "restore once, before training")
        self.engine = engine
        got = self.recover(lambda d, r: core().Reader(d, rank=r, verify_data=True), step,
                           check_world)
        if got is None:
            return None
        info, tensors, meta = got
        info = dict(info)
        info.pop("meta_json", None)
        return loaded_cls(info["step"], info["counter"], tensors, meta, info,
                          os.path.join(self.dir, f"rank-{self.rank:05d}.nsck"))

    def recover(self, reader_factory, step: Optional[int], check_world) -> Optional[tuple]:
        """(info, tensors, meta) of the agreed checkpoint of this rank; see load()."""
        dist = torch.distributed
        mine = []  # (step, lineage, index) committed in this rank's file
        reader, geometry = None, None
        path = os.path.join(self.dir, f"rank-{self.rank:05d}.nsck")
        if os.path.exists(path):
            reader = reader_factory(self.dir, self.rank)
            geometry = reader.geometry
        worlds = [None] * self.world
        dist.all_gather_object(worlds, None if geometry is None else geometry["world_size"],
                               group=self.group)
        for w in worlds:
            if w is not None and w != self.world:
                raise IncompatibleCheckpointError(
                    f"{self.dir} was written by a job of world size {w}; this job has world size "
                    f"{self.world}: resharding is not supported; restart with world size {w}, or "
                    f"reshard through DCP (nonstop export --format dcp, then "
                    f"torch.distributed.checkpoint.load)")
        check_world(self.dir)
        metas = {}
        if reader is not None:
            from ._state import loads
            for i, c in enumerate(reader.checkpoints):
                if not c["committed"]:
                    continue
                try:
                    meta = loads(c["meta_json"].decode("utf-8"))
                except ValueError:
                    continue
                d = meta.get("dist", {}) if isinstance(meta, dict) else {}
                mine.append((int(c["step"]), int(d.get("lineage", 0))))
                metas[(int(c["step"]), int(d.get("lineage", 0)))] = (i, meta)
        every = [None] * self.world
        dist.all_gather_object(every, sorted(set(mine), reverse=True), group=self.group)
        common = set(every[0])
        for s in every[1:]:
            common &= set(s)
        order = sorted(common, reverse=True)
        if step is not None:
            order = [c for c in order if c[0] == step]
        if not any(every) and step is None:
            return None
        if not order:
            have = sorted({s for s, _ in mine}, reverse=True)
            raise CheckpointNotFoundError(
                f"no {'checkpoint at step ' + str(step) if step is not None else 'checkpoint'} "
                f"committed on every rank of {self.dir} (rank {self.rank} holds steps "
                f"{have or 'none'})")
        agreed = self.agreed["step"] if self.agreed else None
        for n, key in enumerate(order):
            idx, meta = metas[key]
            info = reader.checkpoints[idx]
            err = None
            tensors = {}
            try:
                for ti, spec in enumerate(info["tensors"]):
                    t = torch.empty(spec["shape"], dtype=_torch_dtype(spec["dtype"]))
                    if spec["nbytes"]:
                        reader.read_tensor(idx, ti, t.data_ptr(), spec["nbytes"])
                    tensors[spec["name"]] = t
            except (CorruptCheckpointError, OSError) as e:
                err = str(e)
            oks = [None] * self.world
            dist.all_gather_object(oks, err, group=self.group)
            bad = [(r, e) for r, e in enumerate(oks) if e is not None]
            if bad:
                where = "; ".join(f"rank {r}: {e}" for r, e in bad)
                if n + 1 == len(order):
                    raise CorruptCheckpointError(
                        f"no checkpoint every rank of {self.dir} can verify: {where}")
                warnings.warn(f"nonstop: step {key[0]} fails on {where}; all ranks fall back to "
                              f"step {order[n + 1][0]}", stacklevel=4)
                continue
            full = self._assemble(tensors, info, meta)
            if agreed is not None and key[0] < agreed:
                warnings.warn(f"nonstop: rank {self.rank} restores step {key[0]}, older than the "
                              f"agreed step {agreed}", stacklevel=4)
            counter = int(info["counter"])
            self.lineage = self._new_lineage()
            self.engine.pin(counter)
            cand = self.engine.candidate()
            if cand is not None and cand[0] != counter:
                self.engine.drop_candidate(cand[0])
            rec = {"step": key[0], "counter": counter, "lineage": self.lineage,
                   "rank": self.rank, "world_size": self.world, "unix_s": time.time()}
            _atomic_write(agreed_path(self.dir, self.rank), json.dumps(rec))
            self.agreed = rec
            return info, full, meta
        return None

    def _assemble(self, tensors: dict, info: dict, meta: dict) -> dict:
        """Reassembles every replicated tensor from the ranks' pieces with an
        all_reduce(SUM) of uint8 bytes: each byte has exactly one nonzero
        contributor, so the sum is exact."""
        shared = meta.get("dist", {}).get("shared", {})
        specs = {s["name"]: s for s in info["tensors"]}
        names = sorted(shared)
        sizes = []
        for name in names:
            shape, dtype = shared[name]
            numel = 1
            for d in shape:
                numel *= d
            sizes.append(numel * _torch_dtype_by_name(dtype).itemsize)
        flat = torch.zeros(sum(sizes), dtype=torch.uint8)
        off = 0
        for name, size in zip(names, sizes):
            if name in tensors:
                piece = tensors[name].reshape(-1)
                g_off = specs[name]["global_offset"] * piece.element_size()
                raw = piece.view(torch.uint8) if piece.numel() else piece
                flat[off + g_off:off + g_off + raw.numel()] = raw
            off += size
        if flat.numel():
            torch.distributed.all_reduce(flat, group=self.group)
        out = {k: v for k, v in tensors.items() if k not in shared}
        off = 0
        for name, size in zip(names, sizes):
            shape, dtype = shared[name]
            out[name] = flat[off:off + size].clone().view(_torch_dtype_by_name(dtype)).reshape(shape)
            off += size
        return out


def _torch_dtype(code: int):
    from ._state import torch_dtype
    return torch_dtype(code)


def _torch_dtype_by_name(name: str):
    t = getattr(torch, name, None)
    if not isinstance(t, torch.dtype):
        raise IncompatibleCheckpointError(f"unknown dtype {name!r} in a distributed checkpoint")
    return t
