"""The peer tier of one rank for the front end: the tier is C++
(src/tier/peer*), started collectively over the Checkpointer's gloo group;
Python never touches the bytes (docs/TIERS.md "The peer tier from Python")."""
from __future__ import annotations

import os
from typing import Optional

from . import _ext


def check_options(kw: dict) -> tuple:
    """replicas=, peer_budget_bytes=, peer_every=, peer_nice=, peer_bps= of
    the Checkpointer's keywords, checked (C++, tier/peer_options.h; DistOptions' order)."""
    return tuple(_ext.core().check_peer_option(n, kw[n]) for n in _ext.core().PEER_OPTIONS)


class Peers:
    """The peer tier of one rank: its server, its replicator, the job's
    endpoints and the replicas the servers held at construction."""

    def __init__(self, dist, replicas: Optional[int], engine, budget_bytes: Optional[int] = None,
                 peer_every: int = 1, peer_nice: int = 10, peer_bps=0):
        self.rank, self.world = dist.rank, dist.world
        self.prefetched: Optional[dict] = None  # {step, counter, dir, holder} or None
        self.unused_because = ""
        self.reshard_files: list = []  # [(old world, old rank, path)] for JobDir.select_reshard
        self.reshard_missing = ""
        self.reshard_stats: dict = {}  # the last gather's peer_reshard_* (docs/TIERS.md "Stats")
        self._lease = None  # this rank's hold on its host's copies (core.PeerReshardLease)
        want = 1 if replicas is None else replicas
        segment = engine.stats().get("memory_segment", "") if want else ""
        # Collective, in C++ (tier/peer_setup.h StartPeers) over the group's
        # gathers: the attributes _core.start_peers's docstring lists (held:
        # this rank's replicas, newest first; other, local: another world
        # size's checkpoints the servers and this host's memory held).
        vars(self).update(_ext.core().start_peers(
            dist.comm().gather, dist.rank, dist.world, want, segment, os.path.abspath(dist.dir),
            budget_bytes, peer_every, peer_nice, peer_bps))

    # ------------------------------------------------------------ restart

    def prefetch(self, dir: str, own_steps: list) -> None:
        """Before the collective restore: fetches (verified) the newest
        replica of this rank's checkpoint that a partner's server held at
        construction, when this rank's own tiers hold no checkpoint of that
        step (`own_steps`). Not collective; a failure is remembered
        (unused_because) and the restore goes on without it (C++,
        tier/peer_setup.h PrefetchOwnReplica)."""
        self.prefetched, self.unused_because = _ext.core().peer_prefetch(
            self.held, self.endpoints, self.job, self._secret, self.rank, self.world, own_steps)

    def drop_reshard(self) -> None:
        """Removes the copies this rank fetched alone for a reshard and gives
        up its hold on its host's shared ones: the host's last holder removes
        those (C++ ReshardLease), never a copy another rank still reads."""
        _ext.core().peer_remove_rank_dir(self.job, "reshard", self.rank)
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()  # never raises: a failure leaves the copies to the last holder

    def gather_old_shards(self, dir: str, remote=None) -> None:
        """Before resharding a set-aside checkpoint of another world size: a
        verified copy of every old rank `dir`/world-W/ lacks, from where C++
        decides (tier/peer_gather.h; `remote`: a _remote.Tier), named in
        reshard_files for JobDir.select_reshard (else reshard_missing)."""
        core = _ext.core()
        self.drop_reshard()  # a restart before this one may have left its copies
        got = core.peer_gather_old_shards(
            os.path.abspath(dir), self.job, self._secret, self.endpoints, self.local, self.other,
            self.hosts, self.rank, None if remote is None else core.RemoteTier(remote.store),
            f"rank {self.rank} pid {os.getpid()}")
        self.reshard_files = [tuple(f) for f in got["files"]]
        self.reshard_missing, self._lease = got["missing"], got["lease"]
        self.reshard_stats = got["stats"]  # peer_reshard_* (docs/TIERS.md "Stats")

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
            _ext.core().peer_remove_rank_dir(self.job, "fetched", self.rank)
            self.prefetched = None
        if self.reshard_files or self._lease is not None:
            self.drop_reshard()
            self.reshard_files = []
