"""The peer tier in Python (docs/TIERS.md "The peer tier from Python"): what
the ranks must decide together, on the Checkpointer's own gloo group. The
tier itself is C++ (src/tier/peer*: the server that holds partners' replicas
in this host's memory directory, the replicator, the verified fetch, the
partner choice, the reshard's gather of old ranks' copies); Python never
touches the bytes.

At construction (collective, before restore() and before the agreement
thread owns the group) the ranks agree on the secret, start their servers,
exchange (host id, endpoint, what each server holds) and start replicators
to the partners the core picks; restore() may first fetch this rank's
replica (prefetch) or, at another world size, the old ranks' files
(gather_old_shards). docs/TIERS.md says where each lives and when it goes.
"""
from __future__ import annotations

import os
import time
from typing import Optional

from . import _ext
from .errors import CheckpointError


def check_options(kw: dict) -> tuple:
    """replicas=, peer_budget_bytes=, peer_every=, peer_nice=, peer_bps= of
    the Checkpointer's keywords, checked (C++, tier/peer_options.h; DistOptions' order)."""
    return tuple(_ext.core().check_peer_option(n, kw[n]) for n in _ext.core().PEER_OPTIONS)


class Peers:
    """The peer tier of one rank: its server, its replicator, the job's
    endpoints and the replicas the servers held at construction."""

    def __init__(self, dist, replicas: Optional[int], engine, budget_bytes: Optional[int] = None,
                 peer_every: int = 1, peer_nice: int = 10, peer_bps=0):
        core = _ext.core()
        self.rank, self.world = dist.rank, dist.world
        self.server = self.replicator = None
        self.partners: list = []
        self.held: list = []  # this rank's replicas: [(step, counter, holder rank)], newest first
        self.note = ""
        self.prefetched: Optional[dict] = None  # {step, counter, dir, holder} or None
        self.unused_because = ""
        # Checkpoints of another world size the servers held at construction
        # (replicas, own segments, rank files): [(holder rank, {source_rank,
        # world_size, step, counter, bytes, kind})], kind: replica, segment or disk.
        self.other: list = []
        # The same of this host's memory directory, read without a server
        # (also where every rank sits on one host and no server starts):
        # [{source_rank, world_size, step, counter, bytes, path, kind}].
        self.local: list = []
        self.reshard_any = False  # any rank's server or host holds another world's checkpoint
        self.reshard_files: list = []  # [(old world, old rank, path)] for JobDir.select_reshard
        self.reshard_missing = ""
        self.reshard_stats: dict = {}  # the last gather's peer_reshard_* (docs/TIERS.md "Stats")
        self._lease = None  # this rank's hold on its host's copies (core.PeerReshardLease)
        comm = dist.comm()
        want = 1 if replicas is None else replicas
        segment = engine.stats().get("memory_segment", "") if want else ""
        addr = core.peer_local_address()  # $NONSTOP_PEER_ADDR, else the route to MASTER_ADDR
        mine = core.peer_env_secret()
        made = os.urandom(32).hex() if dist.rank == 0 and mine is None else ""
        # Every rank must take the same branch: decided together, in one gather
        # (which also carries rank 0's secret: the group's own links).
        every = comm.gather([core.peer_host_id(addr), bool(want), bool(segment),
                             os.path.abspath(dist.dir),
                             core.peer_secret_fingerprint(mine) if mine else "", made])
        self.hosts = [e[0] for e in every]
        self.replicas = 0
        if not all(e[1] for e in every):
            self.note = "replicas=0" if want == 0 else "replicas=0 on another rank"
            return
        if not all(e[2] for e in every):
            self.note = 'no memory segment to replicate (tier="disk")'
            return
        partners = core.choose_partners(self.hosts, want)
        self.job = every[0][3]  # rank 0's job directory names the job on every rank
        # This host's own segments of the job (any world size): served
        # read-only, and read directly for a reshard on this host.
        try:
            segs = [name for _, name in core.memory_segments(os.path.abspath(dist.dir))]
        except (CheckpointError, OSError):
            segs = []
        self.local = self._list_local(segs)
        if not any(partners):
            self.note = "every rank is on one host: no partner in another failure domain"
            # No server: a reshard still reads this host's memory directory.
            self.reshard_any = any(comm.gather(bool(self.local)))
            return
        secret = core.peer_agree_secret([e[4] for e in every], every[0][5], mine or b"")
        err, held, other = "", [], []
        try:
            # The budget: peer_budget_bytes, else a share of the memory
            # directory's free space split among this host's ranks (C++).
            share = sum(1 for h in self.hosts if h == self.hosts[self.rank])
            self.server = core.PeerServer(
                self.job, secret, bind_host=addr, port=0,
                budget_bytes=budget_bytes or 0,
                budget_share=0 if budget_bytes is not None else share, segments=segs,
                nice=peer_nice, job_dir=os.path.abspath(dist.dir), world_size=self.world)
            listed = self.server.list()
            held = [h for h in listed if h["world_size"] == self.world]
            other = [dict(h, kind=kind) for kind, got in (("replica", listed),
                                                          ("segment", self.server.list_own()),
                                                          ("disk", self.server.list_disk()))
                     for h in got if h["world_size"] != self.world]
        except CheckpointError as e:
            err = f"rank {self.rank}: the peer server cannot start on {addr}: {e}"
        got = comm.gather([err, f"{addr}:{self.server.port}" if not err else "", held, other,
                           bool(self.local)])
        self.reshard_any = any(g[3] or g[4] for g in got)
        errs = [g[0] for g in got if g[0]]
        if errs:  # the job runs on without the tier, and says why
            self.close()
            self.note = errs[0]
            return
        self.endpoints = [g[1] for g in got]
        self._secret = secret
        self.other = [(holder, h) for holder, g in enumerate(got) for h in g[3]]
        self.held = sorted(((int(h["step"]), int(h["counter"]), holder)
                            for holder, g in enumerate(got) for h in g[2]
                            if int(h["source_rank"]) == self.rank), reverse=True)
        self.replicas = want
        self.partners = list(partners[self.rank])
        if self.partners:
            try:
                self.replicator = core.PeerReplicator(
                    self.job, secret, self.rank, segment,
                    [self.endpoints[p] for p in self.partners], job_dir=every[self.rank][3],
                    every=peer_every, nice=peer_nice, bps=0 if peer_bps == "spread" else peer_bps,
                    spread_s=core.PEER_SPREAD_S if peer_bps == "spread" else 0.0)
            except CheckpointError as e:  # this rank's copies are not replicated: said
                self.note = f"the replicator cannot start: {e}"

    # ------------------------------------------------------------ restart

    def prefetch(self, dir: str, own_steps: list) -> None:
        """Before the collective restore: fetches (verified) the newest
        replica of this rank's checkpoint that a partner's server held at
        construction, when this rank's own tiers hold no checkpoint of that
        step (`own_steps`). Not collective; a failure is remembered
        (unused_because) and the restore goes on without it."""
        self.prefetched, self.unused_because = None, ""
        if not self.held:
            return
        step, counter, holder = self.held[0]
        if step in own_steps:
            return
        try:
            mem, name = self._place("fetched")
            self._remove(name)
            d = _ext.core().peer_fetch(self.endpoints[holder], self.job, self._secret,
                                       self.rank, self.world, os.path.join(mem, name), step=step)
            self.prefetched = {"step": step, "counter": counter, "dir": d, "holder": holder}
        except (CheckpointError, OSError) as e:
            self.unused_because = (f"the replica of rank {self.rank} step {step} on rank "
                                   f"{holder} ({self.endpoints[holder]}): {e}")

    def _place(self, what: str) -> tuple:
        """(this host's memory directory, the name of this rank's directory in
        it: "fetched" its replica fetched for its restore, "reshard" the
        copies it fetched alone for a reshard)."""
        core = _ext.core()
        return core.peer_memory_dir(""), f"{core.peer_job_key(self.job)}-{what}-rank-{self.rank:05d}"

    def _remove(self, name: str) -> None:
        """Removes `name` from this host's memory directory (through the seam; best effort)."""
        core = _ext.core()
        try:
            core.Directory(core.peer_memory_dir("")).remove_tree(name, missing_ok=True)
        except (CheckpointError, OSError):
            pass

    def _list_local(self, segs: list) -> list:
        """This host's replicas and own segments of the job of another world
        size, read from the memory directory (no server); [] when it cannot
        be read (a reshard then reads the peers and the disk)."""
        try:
            return [dict(h, kind=kind) for kind, own in (("replica", False), ("segment", True))
                    for h in _ext.core().peer_list_local(self.job, own, segs)
                    if int(h["world_size"]) != self.world]
        except (CheckpointError, OSError):
            return []

    def drop_reshard(self) -> None:
        """Removes the copies this rank fetched alone for a reshard and gives
        up its hold on its host's shared ones: the host's last holder removes
        those (C++ ReshardLease), never a copy another rank still reads."""
        self._remove(self._place("reshard")[1])
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                lease.release()
            except (CheckpointError, OSError):
                pass  # the copies stay for this host's last holder to remove

    def gather_old_shards(self, dir: str, remote=None) -> None:
        """Before resharding a set-aside checkpoint of another world size: a
        verified copy of every old rank whose file `dir`/world-W/ lacks, from
        this host's memory directory, another host's server or the remote
        tier (`remote`, a _remote.Tier); where from is C++'s
        (tier/peer_gather.h). The copies are named in reshard_files for
        JobDir.select_reshard, what cannot be found in reshard_missing.
        Not collective."""
        core = _ext.core()
        t0 = time.perf_counter()
        self.drop_reshard()  # a restart before this one may have left its copies
        mem, name = self._place("reshard")
        # This host's own memory directory is read in place; a server on
        # this host lists the same files.
        copies = [dict(h, holder=-1) for h in self.local] + [
            dict(h, holder=holder) for holder, h in self.other
            if self.hosts[holder] != self.hosts[self.rank]]
        steps, err, url, fetch = [], "", "", None
        if remote is not None and copies:
            url = remote.store.url
            fetch = lambda st, r, d: core.RemoteTier(remote.store).fetch(st, r, d)  # noqa: E731
            try:
                steps = [(int(m.get("world_size", 0)), int(st), int(m.get("counter") or 0))
                         for st, m in core.RemoteTier(remote.store).committed_steps()]
            except (CheckpointError, OSError) as e:
                err = f"the remote tier {url} cannot be listed: {e}"
        got = core.peer_gather_old_shards(
            os.path.abspath(dir), self.job, getattr(self, "_secret", b""),
            getattr(self, "endpoints", []), copies, steps, url, err, fetch, mem,
            os.path.join(mem, name), f"rank {self.rank} pid {os.getpid()}")
        self.reshard_files = [tuple(f) for f in got["files"]]
        self.reshard_missing, self._lease = got["missing"], got["lease"]
        self.reshard_stats = {} if not (got["from"] or got["missing"]) else {
            "peer_reshard_from": dict(got["from"]), "peer_reshard_missing": got["missing"],
            "peer_reshard_bytes": got["bytes"], "peer_reshard_shared": got["shared"],
            "peer_reshard_s": time.perf_counter() - t0, "peer_reshard_dir": got["dir"]}

    # ------------------------------------------------------------- stats

    def drain(self, timeout_s: float) -> bool:
        """Whether this rank's newest committed memory checkpoint reached its
        partners within `timeout_s` (True without a replicator)."""
        return True if self.replicator is None else bool(self.replicator.drain(timeout_s))

    def stats(self) -> dict:
        s = {"peer_replicas": self.replicas, "peer_partners": list(self.partners),
             "peer_note": self.note}
        s.update(_ext.core().peer_tier_stats(self.replicator, self.server))
        if self.prefetched is not None:
            s["peer_fetched_dir"] = self.prefetched["dir"]
        if self.unused_because:
            s["peer_unused_because"] = self.unused_because
        s.update(self.reshard_stats)
        return s

    def close(self) -> None:
        """Stops the replicator and the server; the replicas this host holds
        stay in its memory directory for a restart, a replica fetched for
        this rank's restore goes."""
        for x in (self.replicator, self.server):
            if x is not None:
                x.close()  # never raises (C++ Close)
        self.replicator = self.server = None
        if self.prefetched is not None:
            self._remove(self._place("fetched")[1])
            self.prefetched = None
        if self.reshard_files or self._lease is not None:
            self.drop_reshard()
            self.reshard_files = []
