"""The peer tier in Python (docs/TIERS.md "The peer tier from Python"): what
the ranks must decide together, on the Checkpointer's own gloo group. The
tier itself is C++ (src/tier/peer*: the server that holds partners' replicas
in this host's memory directory, the replicator, the verified fetch, the
partner choice, the reshard's gather of old ranks' copies); Python never
touches the bytes.

At construction (collective, before restore() and before the agreement
thread owns the group) rank 0 makes the job's peer secret (32 random bytes;
docs/TIERS.md "Trust") and sends it in the first exchange, or every rank
takes $NONSTOP_PEER_SECRET (hex); each rank starts its PeerServer, the ranks
exchange (host id, server endpoint, what each server holds), the core picks
each rank's partners on other hosts and each rank starts a replicator to
them. At restore() a rank whose own tiers lack the newest replica of its
checkpoint fetches it (verified) into this host's memory directory
("<job key>-fetched-rank-RRRRR/peer/step-N/"), which the collective restore
reads like its own disk copy; it is removed at the next fetch and at close().
A restart of another world size gathers the old ranks' files its job
directory lacks first (gather_old_shards).
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Optional

from . import _ext, _remote
from .errors import CheckpointError, CheckpointMismatchError


IDLE_NICE = 20  # peer_nice="idle": the SCHED_IDLE class (tier::kIdleNice)
MIN_BPS = 10**6
SPREAD_S = 10.0  # peer_bps="spread": a push spread over this at least (ReplicatorOptions::spread_s)

# The peer options (docs/TIERS.md "The peer tier from Python"): the words each
# takes besides an int, the ints it takes, and what its error says it must be.
OPTIONS = {
    "replicas": ((None,), lambda v: v >= 0, "must be None or a non-negative integer"),
    "peer_budget_bytes": ((None,), lambda v: v >= 0, "must be None or a non-negative integer"),
    "peer_every": ((), lambda v: v >= 1,
                   "must be an int >= 1 (1: every checkpoint, n: every n-th)"),
    "peer_nice": (("idle",), lambda v: 0 <= v <= 19, 'must be an int from 0 to 19 or "idle"'),
    "peer_bps": (("spread",), lambda v: v == 0 or v >= MIN_BPS,
                 f'must be 0 (unpaced), "spread" or an int >= {MIN_BPS} (bytes a second)'),
}


def check_option(name: str, value):
    """Option `name` of OPTIONS checked: its value (peer_nice="idle" as
    IDLE_NICE), or a one-line CheckpointMismatchError."""
    words, ok, must = OPTIONS[name]
    if any(value is w or (isinstance(value, str) and value == w) for w in words):
        return IDLE_NICE if value == "idle" else value
    if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
        raise CheckpointMismatchError(f"{name} {must}, got {value!r}")
    return value


def check_options(kw: dict) -> tuple:
    """replicas=, peer_budget_bytes=, peer_every=, peer_nice=, peer_bps= of
    the Checkpointer's keywords, checked (DistOptions' order)."""
    return tuple(check_option(n, kw[n]) for n in OPTIONS)


SECRET_ENV = "NONSTOP_PEER_SECRET"

def env_secret() -> Optional[bytes]:
    """$NONSTOP_PEER_SECRET as bytes (hex, 16 to 64 bytes), or None when unset."""
    v = os.environ.get(SECRET_ENV, "").strip()
    if not v:
        return None
    try:
        b = bytes.fromhex(v)
    except ValueError:
        b = b""
    if not 16 <= len(b) <= 64:
        raise CheckpointMismatchError(
            f"${SECRET_ENV} must be 16 to 64 bytes written in hex (32 to 128 hex digits)")
    return b


def fingerprint(secret: bytes) -> str:
    """Names a secret without telling it: every rank's must match."""
    return hashlib.sha256(b"nonstop peer secret fingerprint\0" + secret).hexdigest()


def agree_secret(every: list, mine: Optional[bytes]) -> bytes:
    """The job's peer secret from the first exchange: every rank's
    $NONSTOP_PEER_SECRET (the same on all), else the 32 bytes rank 0 made."""
    prints = [e[4] for e in every]
    if all(prints):
        if len(set(prints)) != 1:
            raise CheckpointMismatchError(f"${SECRET_ENV} differs between ranks")
        return mine
    if any(prints):
        raise CheckpointMismatchError(
            f"${SECRET_ENV} is set on ranks {[r for r, p in enumerate(prints) if p]} only: "
            "set it on every rank or on none")
    return bytes.fromhex(every[0][5])


# The stats of the replicator and the server (docs/TIERS.md "Stats"): the
# name in Checkpointer.stats() -> (the core's name, its value without one).
REPLICATOR_STATS = {
    "peer_replicated": ("replicated", 0), "peer_bytes": ("bytes", 0),
    "peer_failures": ("failures", 0), "peer_skipped": ("skipped", 0),
    "peer_skipped_cadence": ("skipped_cadence", 0), "peer_skipped_budget": ("skipped_budget", 0),
    "peer_last_step": ("last_step", None), "peer_error": ("last_error", ""),
    "peer_lag_s": ("lag_s_last", None), "peer_lag_s_max": ("lag_s_max", None)}
SERVER_STATS = {
    "peer_held": "held", "peer_held_bytes": "held_bytes", "peer_received": "replicas_received",
    "peer_served": "fetches_served", "peer_auth_failures": "auth_failures",
    "peer_handshake_timeouts": "handshake_timeouts", "peer_budget_bytes": "budget_bytes",
    "peer_old_world_removed": "old_world_removed"}


class Peers:
    """The peer tier of one rank: its server, its replicator, the job's
    endpoints and the replicas the servers held at construction."""

    def __init__(self, dist, replicas: Optional[int], engine, budget_bytes: Optional[int] = None,
                 peer_every: int = 1, peer_nice: int = 10, peer_bps=0):
        core = _ext.core()
        self.rank, self.world = dist.rank, dist.world
        self.server = self.replicator = None
        self.partners: list = []
        self.held: dict = {}  # source rank -> [(step, counter, holder rank)], newest first
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
        self.reshard_dir = ""  # where the copies fetched for the reshard were written
        self.reshard_from: dict = {}  # old rank -> where its file came from
        self.reshard_missing = ""
        self.reshard_bytes, self.reshard_s = 0, 0.0  # fetched for the reshard, and how long
        self.reshard_shared = 0  # copies another rank of this host fetched (one fetch per host)
        self._lease = None  # this rank's hold on those copies (core.PeerReshardLease)
        comm = dist.comm()
        want = 1 if replicas is None else replicas
        have = hasattr(core, "PeerServer")
        segment = engine.stats().get("memory_segment", "") if want and have else ""
        addr = core.peer_local_address()  # $NONSTOP_PEER_ADDR, else the route to MASTER_ADDR
        mine = env_secret()
        made = os.urandom(32).hex() if dist.rank == 0 and mine is None else ""
        # Every rank must take the same branch: decided together, in one gather
        # (which also carries rank 0's secret: the group's own links).
        every = comm.gather([core.peer_host_id(addr), bool(want and have), bool(segment),
                             os.path.abspath(dist.dir), fingerprint(mine) if mine else "", made])
        self.hosts = [e[0] for e in every]
        self.replicas = 0
        if not all(e[1] for e in every):
            self.note = ("this build has no peer tier" if not have else
                         "replicas=0" if want == 0 else "replicas=0 on another rank")
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
        secret = agree_secret(every, mine)
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
            held = [h for h in listed if int(h.get("world_size", 0)) == self.world]
            other = [dict(h, kind="replica") for h in listed
                     if int(h.get("world_size", 0)) != self.world]
            other += [dict(h, kind=kind) for kind, got in (("segment", self.server.list_own()),
                                                           ("disk", self.server.list_disk()))
                      for h in got if int(h.get("world_size", 0)) != self.world]
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
        for holder, g in enumerate(got):
            self.other += [(holder, h) for h in g[3]]
            for h in g[2]:
                self.held.setdefault(int(h["source_rank"]), []).append(
                    (int(h["step"]), int(h["counter"]), holder))
        for v in self.held.values():
            v.sort(reverse=True)
        self.replicas = want
        self.partners = list(partners[self.rank])
        if self.partners:
            try:
                self.replicator = core.PeerReplicator(
                    self.job, secret, self.rank, segment,
                    [self.endpoints[p] for p in self.partners], job_dir=every[self.rank][3],
                    every=peer_every, nice=peer_nice, bps=0 if peer_bps == "spread" else peer_bps,
                    spread_s=SPREAD_S if peer_bps == "spread" else 0.0)
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
        mine = self.held.get(self.rank, [])
        if not mine:
            return
        step, counter, holder = mine[0]
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

    def _remove(self, *names: str) -> None:
        """Removes `names` from this host's memory directory (through the seam; best effort)."""
        core = _ext.core()
        for n in names:
            try:
                core.Directory(core.peer_memory_dir("")).remove_tree(n, missing_ok=True)
            except (CheckpointError, OSError):
                pass

    def _list_local(self, segs: list) -> list:
        """This host's replicas and own segments of the job of another world
        size, read from the memory directory (no server); [] when it cannot
        be read (a reshard then reads the peers and the disk)."""
        core = _ext.core()
        if not hasattr(core, "peer_list_local"):
            return []
        try:
            got = [dict(h, kind="replica") for h in core.peer_list_local(self.job, False)]
            got += [dict(h, kind="segment") for h in core.peer_list_local(self.job, True, segs)]
        except (CheckpointError, OSError):
            return []
        return [h for h in got if int(h["world_size"]) != self.world]

    def drop_reshard(self) -> None:
        """Removes the copies this rank fetched alone for a reshard, and gives
        up its hold on this host's copies fetched once per host: the last
        rank of the host to give it up removes them (C++, ReshardLease), so
        a rank done first (its reshard read them, or failed on that rank
        alone) never removes a copy another rank of its host still reads.
        Once the reshard has read them, at the next one, at close()."""
        self._remove(self._place("reshard")[1])
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                lease.release()
            except (CheckpointError, OSError):
                pass  # the copies stay for this host's last holder to remove

    def gather_old_shards(self, dir: str, remote=None) -> None:
        """Before resharding a set-aside checkpoint of another world size: a
        copy that verifies of every old rank whose file `dir`/world-W/ lacks,
        from this host's memory directory (read in place), another host's
        server (a replica, its own segment or its rank file) or the remote
        tier (`remote`, a _remote.Tier), fetched once per host; the C++
        gather decides where from (core.peer_gather_old_shards,
        tier/peer_gather.h; the planner's order). The copies are named in
        reshard_files for JobDir.select_reshard and removed once read
        (drop_reshard: those of the host by its last rank); what cannot be
        found is named in reshard_missing (the reshard then fails in one line
        when an old rank is on no disk either). Not collective."""
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
            fetch = lambda step, rank, d: _remote.fetch(remote.store, step, rank, d)  # noqa: E731
            try:
                steps = [(int(m.get("world_size", 0)), int(st), int(m.get("counter") or 0))
                         for st, m in _remote.committed_steps(remote.store)]
            except (CheckpointError, OSError) as e:
                err = f"the remote tier {url} cannot be listed: {e}"
        got = core.peer_gather_old_shards(
            os.path.abspath(dir), self.job, getattr(self, "_secret", b""),
            getattr(self, "endpoints", []), copies, steps, url, err, fetch, mem,
            os.path.join(mem, name), f"rank {self.rank} pid {os.getpid()}")
        self.reshard_files = [tuple(f) for f in got["files"]]
        self.reshard_from, self.reshard_missing = dict(got["from"]), got["missing"]
        self.reshard_bytes, self.reshard_shared = got["bytes"], got["shared"]
        self.reshard_dir, self.reshard_s = got["dir"], time.perf_counter() - t0
        self._lease = got["lease"]

    # ------------------------------------------------------------- stats

    def drain(self, timeout_s: float) -> bool:
        """Whether this rank's newest committed memory checkpoint reached its
        partners within `timeout_s` (True without a replicator)."""
        return True if self.replicator is None else bool(self.replicator.drain(timeout_s))

    def stats(self) -> dict:
        s = {"peer_replicas": self.replicas, "peer_partners": list(self.partners),
             "peer_note": self.note}
        if self.replicator is not None:
            r = self.replicator.stats()
            s.update({n: r.get(k, d) for n, (k, d) in REPLICATOR_STATS.items()})
        if self.server is not None:
            v = self.server.stats()
            s.update({n: v.get(k, 0) for n, k in SERVER_STATS.items()})
        if self.prefetched is not None:
            s["peer_fetched_dir"] = self.prefetched["dir"]
        if self.unused_because:
            s["peer_unused_because"] = self.unused_because
        if self.reshard_from or self.reshard_missing:
            s["peer_reshard_from"] = dict(self.reshard_from)
            s["peer_reshard_missing"] = self.reshard_missing
            s["peer_reshard_bytes"] = self.reshard_bytes
            s["peer_reshard_shared"] = self.reshard_shared
            s["peer_reshard_s"] = self.reshard_s
            s["peer_reshard_dir"] = self.reshard_dir
        return s

    def close(self) -> None:
        """Stops the replicator and the server; the replicas this host holds
        stay in its memory directory for a restart, a replica fetched for
        this rank's restore goes."""
        for x in (self.replicator, self.server):
            if x is not None:
                try:
                    x.close()
                except CheckpointError:
                    pass
        self.replicator = self.server = None
        if self.prefetched is not None:
            self._remove(self._place("fetched")[1])
            self.prefetched = None
        if self.reshard_files or self._lease is not None:
            self.drop_reshard()
            self.reshard_files = []
