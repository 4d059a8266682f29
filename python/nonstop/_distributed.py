"""Distributed checkpoints over torch.distributed (docs/DISTRIBUTED.md): the
torch side of what the ranks decide together. Every decision is C++'s
(nonstop/dist.h, plan.h, JobDir): Python gathers what each rank found over a
dedicated gloo group (JSON, never pickle), hands the lists to C++, and moves
the tensors."""
from __future__ import annotations

import atexit
import datetime
import json
import os
import random
import threading
import time
import warnings
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from . import _ext, _fsdp, _state
from ._objects import is_zero
from ._read import destinations, read_tensors
from ._state import loads
from .errors import (CheckpointError, CheckpointIOError, CheckpointNotFoundError,
                     CorruptCheckpointError)


def module_buffers(stateful_keys: dict, local) -> tuple[set, set]:
    """(names written whole by rank 0, names each rank writes for itself) of the
    module buffers in the state (DDP without broadcast_buffers, FSDP2: its own)."""
    rank0, own = set(), set()
    for key, obj in stateful_keys.items():
        if key not in local and isinstance(obj, torch.nn.Module):
            (own if isinstance(obj, DDP) and not obj.broadcast_buffers or _fsdp.is_fsdp(obj)
             else rank0).update(f"{key}/{n}" for n, _ in obj.named_buffers())
    return rank0, own


def zero_layout(obj) -> dict:
    """A ZeroRedundancyOptimizer's layout for resharding: the global index (its
    consolidated state_dict's) of each local parameter in order; each group's size."""
    index = {id(p): i for i, p in enumerate(p for g in obj.param_groups for p in g["params"])}
    return {"index": [index[id(p)] for g in obj.optim.param_groups for p in g["params"]],
            "groups": [len(g["params"]) for g in obj.param_groups]}


def _open_read(dir: str):
    """The job directory opened for reading (JobDir, no lock), or None when absent."""
    try:
        return _ext.core().JobDir.open_for_read(dir)
    except CheckpointNotFoundError:
        return None


class Distributed:
    """The distributed side of one Checkpointer on one rank."""

    def __init__(self, dir: str, rank: int, world: int, replicated: str = "shard",
                 local=(), timeout_s: float = 300.0, agree_every_s: float = 0.05,
                 agree_metrics: bool = False):
        dist = torch.distributed
        up = dist.is_available() and dist.is_initialized()
        _ext.core().dist_check_world(replicated, rank, world, up, dist.get_rank() if up else -1,
                                     dist.get_world_size() if up else -1)
        self.dir, self.rank, self.world, self.replicated = dir, rank, world, replicated
        self.local, self.agree_every_s = set(local), agree_every_s
        # A dedicated gloo group with its own timeout: agreement and recovery
        # never touch the training group (NCCL watchdogs, GIL contention).
        timeout, self.timeout_s = datetime.timedelta(seconds=timeout_s), timeout_s
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        # best= ranks kept copies by a metric: every rank must use rank 0's,
        # exchanged at each checkpoint on a group of its own (the agreement
        # thread owns self.group once training runs).
        self.metrics_group = (dist.new_group(backend="gloo", timeout=timeout)
                              if agree_metrics else None)
        set_aside(dir, world, rank, self.comm())  # rank files of another world size
        # The lineage names one run of training from one restored (or fresh)
        # state: after a restore, checkpoints of the abandoned future (same
        # steps, other lineage) are never mixed with new ones.
        self.lineage = self.new_lineage()
        self.engine = None
        self.peers = None  # the peer tier (_peer.Peers), started once the engine is open
        self.state: Optional[dict] = None  # the Checkpointer's state (resharding)
        # This rank's agreed record; None when missing or unreadable (it only
        # dates the agreed step: recovery never depends on it).
        jd, self.agreed = _open_read(dir), None
        try:
            self.agreed = None if jd is None else jd.read_agreed(rank)
        except CheckpointError:
            pass
        self._rounds = _ext.core().AgreementRounds()  # the rounds' decisions and stats()
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # Interpreter exit with this rank never closed (_at_exit).
        self._exiting, self._parked = threading.Event(), threading.Event()

    def new_lineage(self) -> int:
        t = torch.tensor([random.SystemRandom().getrandbits(62) if self.rank == 0 else 0],
                         dtype=torch.int64)
        torch.distributed.broadcast(t, src=0, group=self.group)
        return int(t.item())

    def shard(self, tensors: dict, stateful_keys: dict) -> tuple[dict, dict, dict]:
        """This rank's share of `tensors` (stateful_keys: state key -> object):
        (tensors to register, name -> (global_shape, global_offset), the
        meta["dist"] document); FSDP2 DTensors: _fsdp.take."""
        tensors, pieces, piece_layouts, dtensors = _fsdp.take(tensors, self.rank, self.world)
        out, layouts, shared, cut = {}, {}, {}, []
        rank0, own = module_buffers(stateful_keys, self.local)
        for name, t in tensors.items():
            key = name.split("/", 1)[0]
            if key in self.local or is_zero(stateful_keys.get(key)) or name in own:
                out[name] = t
                continue
            shared[name] = [list(t.shape), str(t.dtype).replace("torch.", "")]
            cut.append((name, t.numel(), self.replicated == "rank0" or name in rank0,
                        t.is_contiguous()))
        # Which piece each rank writes: C++ (dist.h Shard).
        for name, begin, end, whole in _ext.core().dist_shard(cut, self.rank, self.world):
            t = tensors[name]
            out[name] = t if whole else t.detach().reshape(-1)[begin:end]
            layouts[name] = (list(t.shape), begin)
        doc = {"world_size": self.world, "lineage": self.lineage, "replicated": self.replicated,
               "shared": shared, "local": sorted(self.local), "own": sorted(own),
               "ddp": sorted(k for k, o in stateful_keys.items() if isinstance(o, DDP)),
               "zero": {k: zero_layout(o) for k, o in stateful_keys.items() if is_zero(o)}}
        if dtensors:
            doc["dtensor"] = dtensors
        return {**out, **pieces}, {**layouts, **piece_layouts}, doc

    def agree_metrics(self, metrics: Optional[dict]) -> Optional[dict]:
        """Rank 0's metrics= (name -> float, or None) on every rank; collective:
        every rank calls it for each checkpoint it starts."""
        got = Comm(self.metrics_group, self.world).gather(metrics)[0]
        return got if isinstance(got, dict) else None

    def tidy_kept(self) -> list:
        """Collective, before the engine opens: deletes the kept steps some rank lacks (a
        kill between deletions; planned_steps.h TidyKeptTogether); returns those it deleted."""
        return _ext.core().dist_tidy_kept(self.dir, self.rank, self.world, self.comm().gather)

    def started(self, engine) -> None:
        """Called after each checkpoint is started: the first one starts the
        agreement thread (after restore(), whose collectives share the group)."""
        if self._thread is None and not self._stop.is_set():
            self.engine = engine
            self._thread = threading.Thread(target=self._loop, name="nonstop-agree",
                                            daemon=True)
            self._thread.start()
            atexit.register(self._at_exit)

    def _loop(self) -> None:
        """The agreement's rounds (C++: dist.h AgreementRounds::Round)."""
        try:
            while not self._rounds.round(self.engine, self._gather, self._record,
                                         self._stop.is_set(), self.agreed_step()):
                self._stop.wait(self.agree_every_s)
                if self._exiting.is_set():
                    self._park()
        except BaseException as e:  # surfaces in stats() and close()
            self.error = e

    def _gather(self, mine: list) -> list:
        """Every rank's offer (five int64s): an all_gather polled, not waited for
        in torch: a daemon thread returning from a call that released the GIL
        (Work.wait) once the interpreter finalizes is ended from a destructor:
        std::terminate ("terminate called without an active exception"). Polled,
        it waits in Python (a sleep it is ended in quietly), and parks at exit."""
        got = [torch.zeros(5, dtype=torch.int64) for _ in range(self.world)]
        work = torch.distributed.all_gather(got, torch.tensor(mine, dtype=torch.int64),
                                            group=self.group, async_op=True)
        delay = 0.0005
        while not work.is_completed():
            if self._exiting.wait(delay):
                self._park()
            delay = min(delay * 2, 0.01)
        work.wait()  # the collective's error, if any
        return [g.tolist() for g in got]

    def _park(self) -> None:
        """Stops the thread for good at interpreter exit, inside the round: the
        round's tensors (gloo may still hold them) are then never freed by
        gloo's thread, which would need a finalized interpreter's GIL."""
        self._parked.set()
        threading.Event().wait()

    def _at_exit(self) -> None:
        """atexit, for a rank never closed (an exception left the training loop):
        the agreement thread parks before the interpreter finalizes (no last
        round, which would wait for the other ranks). Bounded: a round's calls
        into the engine are short."""
        thread = self._thread
        if thread is None:
            return
        self._exiting.set()
        deadline = time.monotonic() + 10.0
        while thread.is_alive() and time.monotonic() <= deadline and not self._parked.wait(0.01):
            pass

    def _record(self, counter: int, step: int, resharded_from=None) -> None:
        """This rank's agreed record, written durably by the engine (its writer lock)."""
        rec = {"step": step, "counter": counter, "lineage": self.lineage, "rank": self.rank,
               "world_size": self.world, "unix_s": time.time()}
        if resharded_from is not None:
            rec["resharded_from"] = resharded_from
        self.engine.write_agreed(rec)
        self.agreed = rec

    def comm(self) -> "Comm":
        """The few collectives (JSON over the gloo group, never pickle)."""
        return Comm(self.group, self.world)

    def agreed_step(self) -> Optional[int]:
        a = self.agreed
        return None if a is None or a.get("lineage") != self.lineage else a["step"]

    def close(self) -> None:
        """Stops the agreement thread once every rank is closing, after a last
        round (so a checkpoint every rank committed before close is agreed)."""
        self._stop.set()
        atexit.unregister(self._at_exit)
        if self._thread is not None:
            # Bounded: every round's all_gather ends within the group's timeout.
            wait_s = self.timeout_s + 10
            self._thread.join(wait_s)
            if self._thread.is_alive() and self.error is None:
                self.error = CheckpointError(f"the agreement thread did not stop within "
                                             f"{wait_s:.0f} s (dist_timeout_s + 10); left behind")
            self._thread = None
        if self.peers is not None:
            self.peers.close()
        if self.error is not None:
            e, self.error = self.error, None
            warnings.warn(f"nonstop: rank {self.rank}: global agreement stopped: {e}", stacklevel=3)

    @property
    def rounds(self) -> int:
        return self._rounds.rounds

    def stats(self) -> dict:
        # The gap still open counts too (no agreement since) while the thread runs.
        s = dict(self._rounds.stats(self._thread is not None), agreed_step=self.agreed_step(),
                 lineage=self.lineage, agreement_error=repr(self.error) if self.error else None)
        if self.peers is not None:
            s.update(self.peers.stats())
        return s

    def prefetch_peer(self) -> None:
        """restore() without a step, not collective: the newest replica a partner holds
        of a checkpoint this rank's job directory lacks, fetched and verified (_peer.py)."""
        if self.peers is None or not self.peers.replicas and not self.peers.held:
            return
        # An unreadable job directory holds none: the collective restore reports it.
        own = _ext.core().dist_local_steps(self.dir, self.rank, self.world)[1]
        self.peers.prefetch(self.dir, own)

    def load(self, engine, step: Optional[int], core, loaded_cls, check_world,
             stats: Optional[dict] = None, remote=None):
        """The checkpoint the ranks agree on, read (replicated tensors
        reassembled) and pinned, or None on a fresh start everywhere;
        collective, before the first save() (docs/DISTRIBUTED.md "Recovery";
        the rounds: dist.h Recover). `stats` gets restored_from,
        memory_unused_because and restore_s; `remote`: _reshard's."""
        if self._thread is not None:
            raise CheckpointError("restore() after save() is not supported with world_size > 1; "
                                  "restore once, before training")
        self.engine = engine
        core = core()  # `core`: _ext.core
        # A replica a partner held, fetched and verified (prefetch_peer).
        pf = self.peers.prefetched if self.peers is not None else None
        stats = {} if stats is None else stats
        cur = {}  # the step being read: its selection, metadata and tensors

        def open_step(s: int, peer: bool) -> int:
            cur.update(t0=time.perf_counter(), where=pf["dir"] if peer else self.dir, peer=peer)
            # Chunk crcs are verified as the tensors are read.
            src = _open_read(cur["where"])
            if src is None:
                raise CheckpointNotFoundError(f"{cur['where']} is gone")
            cur["sel"] = src.select(self.rank, step=s, verify_data=False,
                                    include_keep=step is not None)
            cur["meta"] = _meta(cur["sel"], s)
            return int(cur["meta"].get("dist", {}).get("lineage", 0))

        def probe_memory(s: int) -> str:  # the memory tier (memory_tier.h) on a restart
            if getattr(self, "tier", "auto") == "disk":
                return 'tier="disk"'
            cur["reader"], why = core.open_memory_segment(self.dir, self.rank, step=s)
            return why

        def read(s: int, memory: bool) -> None:
            if not memory:  # the one verified read path: every crc chunk read and checked once
                cur["tensors"] = read_tensors(cur["sel"], 0)  # a selection reads like a Reader
                return
            r = cur["reader"]
            try:
                cur["tensors"] = read_tensors(r, r.newest_valid, stats=stats)
            except (CheckpointError, OSError) as e:
                raise CheckpointIOError(f"{r.path}: {e}") from None

        def reshard() -> bool:  # no step every rank holds: a set-aside checkpoint?
            cur["resharded"] = self._reshard(step, loaded_cls, remote)
            return cur["resharded"] is not None

        kind, s, source, per_rank, unused = core.dist_recover(
            self.dir, self.rank, self.world, step, None if pf is None else pf["step"],
            self.agreed["step"] if self.agreed else None, self.comm().gather,
            lambda: check_world(self.dir), reshard, open_step, probe_memory, read)
        if unused:
            stats["memory_unused_because"] = unused
        if kind != "restored":
            return cur.get("resharded")
        sel, meta, info = cur["sel"], cur["meta"], cur["sel"].info
        full = self.assemble(cur["tensors"], info, meta)
        stats.update(restored_from=source, restore_s=time.perf_counter() - cur["t0"],
                     restored_from_per_rank=per_rank)
        counter = int(info["counter"])
        self.lineage = self.new_lineage()
        if not cur["peer"] and not sel.where.startswith("keep/"):  # no slot of the ring holds it
            self.engine.pin(counter)
        cand = self.engine.candidate()
        if cand is not None and cand[0] != counter:
            self.engine.drop_candidate(cand[0])
        # A rollback is final (DESIGN.md invariant 9): the engine records in this rank's
        # lineage record, before it writes anything new, that the counters above are abandoned.
        self.engine.adopt_restored(counter)
        self._record(counter, s)
        info = {k: v for k, v in info.items() if k != "meta_json"}
        return loaded_cls(s, counter, full, meta, info, os.path.join(cur["where"], sel.where))

    def _reshard(self, step: Optional[int], loaded_cls, remote=None):
        """A set-aside checkpoint resharded, or None. From peers' memory when any rank's
        host held one (known at construction, so every rank alike): each old rank's
        file this host lacks fetched, verified, from another host or `remote` (_peer.py)."""
        peers = self.peers if self.peers is not None and self.peers.reshard_any else None
        if peers is not None:
            peers.gather_old_shards(self.dir, remote)
        try:
            got = reshard(self.dir, self.rank, self.world, step, self.comm(), self.state or {},
                          loaded_cls, self.dir, extra=list(peers.reshard_files) if peers else [],
                          missing=peers.reshard_missing if peers else None)
        finally:
            if peers is not None:
                peers.drop_reshard()  # read (or failed): the copies go
                peers.reshard_files = []
        if got is None:
            return None
        self.lineage = self.new_lineage()
        cand = self.engine.candidate()
        if cand is not None:  # a newer checkpoint of this world size, not on every rank
            self.engine.drop_candidate(cand[0])
        old = got.info["resharded_from"]
        self._record(-1, got.step, (os.path.basename(old["dir"]), old["world_size"]))
        return got

    def assemble(self, tensors: dict, info: dict, meta: dict) -> dict:
        """Reassembles every replicated tensor from the ranks' pieces (placed
        by C++, dist_lay_out_shared) with an all_reduce(SUM) of uint8 bytes:
        each byte has exactly one nonzero contributor, so the sum is exact."""
        shared = meta.get("dist", {}).get("shared", {})
        pieces = [(self.rank, i, s["name"], int(s["global_offset"]), int(s["nbytes"]))
                  for i, s in enumerate(info["tensors"]) if s["name"] in shared]
        layout, total, copies = _ext.core().dist_lay_out_shared(
            [(n, s, d) for n, (s, d) in shared.items()], pieces, False, self.dir, info["step"])
        flat = torch.zeros(total, dtype=torch.uint8)
        for (_, _, name, _, _), (_, _, off, n) in zip(pieces, copies):
            if n and name in tensors:
                flat[off:off + n] = tensors[name].reshape(-1).view(torch.uint8)
        if total:
            torch.distributed.all_reduce(flat, group=self.group)
        views = {name: _fsdp.view(flat, off, n, shared[name][1], shared[name][0]).clone()
                 for name, off, n in layout}
        return {**{k: v for k, v in tensors.items() if k not in shared}, **views}


def set_aside(dir: str, world: int, rank: int = 0, comm: Optional["Comm"] = None) -> list:
    """Collective over `comm`: the rank files of another world size in `dir` moved
    to `dir`/world-W/ with a warning (planned_steps.h SetAsideTogether); returns
    the directories this rank moved files into."""
    return _ext.core().dist_set_aside(dir, rank, world, (comm or Comm()).gather)


def archives(dir: str) -> list:
    """The old world sizes of the set-aside checkpoints in `dir`."""
    jd = _open_read(dir)
    return [] if jd is None else jd.set_aside_worlds()


class Comm:
    """The few collectives resharding needs; world 1 without a process group."""

    def __init__(self, group=None, world: int = 1):
        self.group, self.world = group, world

    def gather(self, obj) -> list:
        """Every rank's `obj` (JSON: None, bool, numbers, strings, lists;
        tuples come back as lists). Bytes over two all_gathers, never pickle
        (all_gather_object unpickles what the peers send)."""
        if self.group is None:
            return [obj]
        dist, data = torch.distributed, json.dumps(obj).encode("utf-8")
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        n = [int(t.item()) for t in sizes]
        got = [torch.zeros(max(n), dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(got, torch.frombuffer(bytearray(data.ljust(max(n), b"\0")),
                                              dtype=torch.uint8), group=self.group)
        return [json.loads(bytes(g[:k].numpy()).decode("utf-8")) for g, k in zip(got, n)]


def _meta(sel, step: int) -> dict:
    """The metadata of a selected checkpoint (a dict, or a one-line error)."""
    meta = loads(sel.info["meta_json"])
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{sel.where}: step {step}: malformed metadata")
    return meta


def reshard(dir: str, rank: int, world: int, step: Optional[int], comm: "Comm", state: dict,
            loaded_cls, into: Optional[str] = None, extra=(), missing: Optional[str] = None):
    """Rank `rank`'s state rebuilt from a set-aside checkpoint of another world
    size in `dir` (docs/DISTRIBUTED.md "Restoring with another world size"), a
    `loaded_cls` (its path: the rank's slot in `into`, else in the old files'
    directory), or None (the rounds: dist.h ReshardTogether; `missing`: the old
    files no surviving peer held)."""
    got = []

    def pick(max_step: Optional[int]):  # JobDir.select_reshard's choice, or None: nothing set aside
        jd = _open_read(dir)
        return None if jd is None else jd.select_reshard(world, step=step, max_step=max_step,
                                                         extra=list(extra))

    # rebuild: a CorruptCheckpointError or OSError is damage, every rank falls back.
    key = _ext.core().dist_reshard(dir, world, comm.gather, pick, lambda p, archive: got.append(
        _rebuild(p, archive, rank, world, state, loaded_cls, into)), missing)
    return None if key is None else got[-1]


def _rebuild(p: dict, archive: str, rank: int, world: int, state: dict, loaded_cls, into):
    """New rank `rank`'s `loaded_cls` of the old files' step JobDir.select_reshard
    picked (`p`): each old file read once, crcs verified, its replicated pieces
    straight where C++ placed them (dist_lay_out_shared)."""
    old_world, step, readers = int(p["old_world"]), int(p["step"]), p["ranks"]
    src = rank % old_world  # whose per-rank state (RNG, own buffers, plain values) we take
    metas = [_meta(sel, step) for sel in readers]
    core, doc = _ext.core(), metas[0].get("dist", {})
    zero_keys = set(doc.get("zero", {}))
    core.dist_check_reshardable(archive, old_world, world, list(doc.get("local", [])),
                                sorted(zero_keys), [k for k, o in state.items() if is_zero(o)])
    shared = dict(doc.get("shared", {}))
    specs = [r.checkpoints[0]["tensors"] for r in readers]
    layout, total, copies = core.dist_lay_out_shared(
        [(n, s, d) for n, (s, d) in shared.items()],
        [(r, i, sp["name"], int(sp.get("global_offset", 0)), int(sp["nbytes"]))
         for r, table in enumerate(specs) for i, sp in enumerate(table)], True, archive, step)
    flat = torch.empty(total, dtype=torch.uint8)
    place = {(r, i): (flat.data_ptr() + off, n) for r, i, off, n in copies}
    dt = {n: v for n, v in doc.get("dtensor", {}).items() if v[2] != "R"}
    own, dests = [], []  # per old rank: what it gives whole (old rank src's own tensors, ZeRO's)
    for r, table in enumerate(specs):
        got, d = destinations([None if sp["name"] in shared or sp["name"] in dt or not (
            r == src or sp["name"].split("/", 1)[0] in zero_keys) else sp for sp in table],
            False, None)
        own.append(got)
        dests.append([place.get((r, i), x) for i, x in enumerate(d)])
    # One read of each old file, with the FSDP2 Shard(0) DTensors' rows for this rank.
    pieces = _fsdp.reshard(readers, [0] * old_world, dt, rank, world, archive, step, dests)
    zero_parts = [{n: t for n, t in g.items() if n.split("/", 1)[0] in zero_keys} for g in own]
    tensors = {n: t for n, t in own[src].items() if n not in zero_parts[src]}
    for name, off, n in layout:  # every layout offset is aligned for any dtype
        shape, dtype = shared[name]
        tensors[name] = _fsdp.view(flat, off, n, dtype, shape)
    # Copies: its state's trees are replaced below (the old ones are never changed).
    meta = dict(metas[src], state=dict(metas[src].get("state", {})))
    for zk in sorted(zero_keys):
        meta["state"][zk] = consolidate(zk, metas, zero_parts, tensors)
    tensors.update(pieces)
    # A module saved under DDP restored without it, or back (state_tree.h RenameModuleKeys).
    saved_ddp = set(doc.get("ddp", []))
    for k, obj in state.items():
        ddp = isinstance(obj, DDP)
        if k in meta["state"] and isinstance(obj, torch.nn.Module) and (k in saved_ddp) != ddp:
            tree, renames = core.dist_rename_module_keys(k, _state.dumps(meta["state"][k]), ddp,
                                                         list(tensors))
            meta["state"][k] = json.loads(tree)
            for _, old, new in renames:
                tensors[new] = tensors.pop(old)
    info = {k: v for k, v in readers[src].info.items() if k != "meta_json"}
    info["resharded_from"] = {"dir": archive, "world_size": old_world}
    return loaded_cls(step, int(info["counter"]), tensors, meta, info, os.path.join(
        archive if into is None else into, core.JobDir.slot_name(rank)))


def consolidate(key: str, metas: list, zero_parts: list, tensors: dict):
    """The consolidated state_dict tree of the ZeroRedundancyOptimizer under
    `key` (state_tree.h ConsolidateZero); its tensors added to `tensors`."""
    tree, renames = _ext.core().dist_consolidate_zero(
        key, [_state.dumps(m["state"][key]) for m in metas],
        [_state.dumps(m["dist"]["zero"][key]) for m in metas], [list(p) for p in zero_parts])
    for r, old, new in renames:
        tensors[new] = zero_parts[r][old]
    return json.loads(tree)


def restore_single(dir: str, step: Optional[int], read_own, loaded_cls, state: dict):
    """Checkpointer.restore with world size 1 beside set-aside checkpoints:
    its own file's checkpoint (JobDir.single_source), else one resharded."""
    jd = _open_read(dir)
    source = "reshard" if jd is None else jd.single_source(step)  # C++ (planned_steps.h)
    got = None if source == "own" else reshard(dir, 0, 1, step, Comm(), state, loaded_cls)
    return read_own() if got is None and source != "reshard" else got
