"""The peer tier in Python (docs/TIERS.md "Peer tier"): what the ranks must
decide together, on the Checkpointer's own gloo group. The tier itself is
C++ (src/tier/peer*: the server that holds partners' replicas in this host's
memory directory, the replicator that streams this rank's newest committed
memory checkpoint to its partners, the verified fetch, the partner choice);
Python never touches the bytes.

At construction (collective, before restore() and before the agreement
thread owns the group) rank 0 makes the job's peer secret (32 random bytes;
every connection proves it both ways, docs/TIERS.md "Trust") and sends it
in the first exchange, or every rank takes $NONSTOP_PEER_SECRET (hex);
each rank starts its PeerServer, and the ranks
exchange (host id, server endpoint, what each server holds); the core picks
each rank's partners on other hosts (choose_partners) and each rank starts
a replicator to them. At restore() a rank whose own tiers lack the newest
replica of its checkpoint fetches it (every chunk's checksum verified) into
this host's memory directory (tmpfs, beside the replicas it holds:
"<job key>-fetched-rank-RRRRR/peer/step-N/", not the job directory's disk,
whose write would bound the fetch), and the collective restore
(_distributed.recover) reads it there like its own disk copy; it is removed
at the next restart's fetch and at close().

Resharding from memory (a restart whose world size differs from the
checkpoint's): each server also serves, read-only, the memory segments its
host's job directory records (the old ranks' own checkpoints) and that job
directory's rank files (after a graceful close removed the segments), and
the construction's gather says which server holds which old rank's
checkpoint (a replica, its segment or its rank file: the three kinds); each
rank also lists its own host's memory directory directly (no server needed:
also when every rank is on one host). Before the set-aside checkpoint is
resharded, each rank finds a copy of every old rank's file its job
directory lacks (gather_old_shards): this host's memory directory read in
place, else a server's copy fetched (verified) into this host's memory
directory (tmpfs) once per host (the first rank of the host to ask fetches,
the others take its copy: core.peer_fetch_once_per_host), else the remote
tier's part; the existing reshard (_distributed.reshard, JobDir.select_
reshard in C++, given those copies as `extra`) then chooses and reads, and
the fetched copies are removed.
"""
from __future__ import annotations

import hashlib
import os
import socket
import time
from typing import Optional

from . import _ext, _remote
from .errors import CheckpointError, CheckpointMismatchError


def check_replicas(replicas) -> Optional[int]:
    """replicas=: None (1 where another host exists) or an int >= 0."""
    if replicas is None:
        return None
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise CheckpointMismatchError(
            f"replicas must be None or a non-negative integer, got {replicas!r}")
    return replicas


def check_every(every) -> int:
    """peer_every=: an int >= 1 (1: the newest memory checkpoint whenever the
    replicator is free; n: a partner takes one only n checkpoints after the
    one it holds)."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise CheckpointMismatchError(
            f"peer_every must be an int >= 1 (1: every checkpoint, n: every n-th), got {every!r}")
    return every


IDLE_NICE = 20  # peer_nice="idle": the SCHED_IDLE class (tier::kIdleNice)


def check_nice(nice) -> int:
    """peer_nice=: an int 0..19, how much lower the peer threads' CPU
    priority is than the training's (0: the same), or "idle": the SCHED_IDLE
    class (they run only on a core nothing else wants)."""
    if nice == "idle":
        return IDLE_NICE
    if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
        raise CheckpointMismatchError(
            f'peer_nice must be an int from 0 to 19 or "idle", got {nice!r}')
    return nice


MIN_BPS = 10**6
SPREAD_S = 10.0  # peer_bps="spread": a push spread over this at least (ReplicatorOptions::spread_s)


def check_bps(bps):
    """peer_bps=: the pace of a push, data bytes a second to each partner
    (an int >= 1 MB/s), 0 (default): unpaced, "spread": each push spread
    over the time between commits, 10 s at least (docs/TIERS.md "Priority
    and cadence")."""
    if bps == "spread":
        return bps
    if not isinstance(bps, int) or isinstance(bps, bool) or not (bps == 0 or bps >= MIN_BPS):
        raise CheckpointMismatchError(
            f'peer_bps must be 0 (unpaced), "spread" or an int >= {MIN_BPS} (bytes a second), '
            f"got {bps!r}")
    return bps


SECRET_ENV = "NONSTOP_PEER_SECRET"

# What a server serves of an old rank (core.peer_fetch_into's `source`), as
# the stats name it.
KINDS = {"replica": "replica", "segment": "segment", "disk": "rank file"}


def check_budget(budget) -> Optional[int]:
    """peer_budget_bytes=: None (the default share of the memory directory's
    free space) or an int >= 0 (0: no budget)."""
    if budget is None:
        return None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise CheckpointMismatchError(
            f"peer_budget_bytes must be None or a non-negative integer, got {budget!r}")
    return budget


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


def local_address() -> str:
    """This process's address on the job's network: $NONSTOP_PEER_ADDR, else
    the source address of a route to MASTER_ADDR (the interface the process
    group uses; no packet is sent), else the host name's address."""
    addr = os.environ.get("NONSTOP_PEER_ADDR")
    if addr:
        return addr
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500") or 29500)))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def host_id(addr: str) -> str:
    """The failure domain of this rank: $NONSTOP_HOST_ID (a rack, a VM), else
    the host name and the address (network namespaces share a host name)."""
    return os.environ.get("NONSTOP_HOST_ID") or f"{socket.gethostname()}@{addr}"


class Peers:
    """The peer tier of one rank: its server, its replicator, the job's
    endpoints and the replicas the servers held at construction."""

    def __init__(self, dist, replicas: Optional[int], engine, budget_bytes: Optional[int] = None,
                 peer_every: int = 1, peer_nice: int = 10, peer_bps=0):
        core = _ext.core()
        self.rank, self.world = dist.rank, dist.world
        self.every = peer_every  # the peer cadence (ReplicatorOptions::every)
        self.nice = peer_nice  # the replicator's and the push receivers' nice
        self.bps = peer_bps  # the pace of a push (ReplicatorOptions::bps; "spread": spread_s)
        self.server = self.replicator = None
        self.partners: list = []
        self.held: dict = {}  # source rank -> [(step, counter, holder rank)], newest first
        self.note = ""
        self.prefetched: Optional[dict] = None  # {step, counter, dir, holder} or None
        self.unused_because = ""
        # Checkpoints of another world size the servers held at construction
        # (replicas, own segments, rank files): [(holder rank, {source_rank,
        # world_size, step, counter, bytes, kind})], kind one of KINDS.
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
        comm = dist.comm()
        want = 1 if replicas is None else replicas
        have = hasattr(core, "PeerServer")
        segment = engine.stats().get("memory_segment", "") if want and have else ""
        addr = local_address()
        mine = env_secret()
        made = os.urandom(32).hex() if dist.rank == 0 and mine is None else ""
        # Every rank must take the same branch: decided together, in one gather
        # (which also carries rank 0's secret: the group's own links).
        every = comm.gather([host_id(addr), bool(want and have), bool(segment),
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
                nice=self.nice, job_dir=os.path.abspath(dist.dir))
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
        self.endpoint = self.endpoints[self.rank]
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
                    every=self.every, nice=self.nice,
                    bps=0 if self.bps == "spread" else self.bps,
                    spread_s=SPREAD_S if self.bps == "spread" else 0.0)
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
            mem, name = self._fetch_dir()
            self._drop_fetched()
            d = _ext.core().peer_fetch(self.endpoints[holder], self.job, self._secret,
                                       self.rank, self.world, os.path.join(mem, name), step=step)
            self.prefetched = {"step": step, "counter": counter, "dir": d, "holder": holder}
        except (CheckpointError, OSError) as e:
            self.unused_because = (f"the replica of rank {self.rank} step {step} on rank "
                                   f"{holder} ({self.endpoints[holder]}): {e}")

    def _fetch_dir(self) -> tuple:
        """(this host's memory directory, the name of this rank's fetched
        replica's one-slot job directory in it)."""
        core = _ext.core()
        return core.peer_memory_dir(""), f"{core.peer_job_key(self.job)}-fetched-rank-{self.rank:05d}"

    def _drop_fetched(self) -> None:
        """Removes this rank's fetched replica (through the seam; best effort)."""
        mem, name = self._fetch_dir()
        try:
            _ext.core().Directory(mem).remove_tree(name, missing_ok=True)
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

    def _reshard_place(self) -> tuple:
        """(this host's memory directory, the name of this rank's directory of
        copies fetched for a reshard in it)."""
        core = _ext.core()
        return core.peer_memory_dir(""), f"{core.peer_job_key(self.job)}-reshard-rank-{self.rank:05d}"

    def drop_reshard(self, shared: bool = True) -> None:
        """Removes the copies fetched for a reshard (through the seam; best
        effort): once the reshard has read them, at the next one, at close().
        With `shared`, also this host's copies fetched once per host: only
        once every rank has read them (after the reshard's collective; at the
        start of the next one another rank of this host may be fetching)."""
        core = _ext.core()
        mem, name = self._reshard_place()
        for n in (name, core.peer_shared_reshard_dir(self.job)) if shared else (name,):
            try:
                core.Directory(mem).remove_tree(n, missing_ok=True)
            except (CheckpointError, OSError):
                pass

    def gather_old_shards(self, dir: str, remote=None) -> None:
        """Before resharding a set-aside checkpoint of another world size W:
        for every old rank whose file `dir`/world-W/ lacks (this host never
        held it: a lost or new host), a copy that verifies, from (in the
        recovery planner's order, C++ core.plan: newest counter first, at
        one counter memory before the object store)
          - this host's memory directory, read in place (its own segment of
            that old rank, or the replica it holds),
          - the server of another host that held it at construction (a
            replica, its own segment or its job directory's rank file),
            fetched, verified, into this host's memory directory once per
            host (tmpfs: `<job key>-reshard-host/wW-sS-cC/`; the first rank
            of this host fetches, the others take its copy),
          - the job's remote tier (`remote`, a _remote.Tier) where it holds
            a committed step of world size W: that old rank's part, fetched
            into the same directory (_remote.fetch: size and part crcs
            checked; the reshard verifies every chunk as it reads).
        Only steps every missing old rank has a copy of are tried. The
        copies are named in reshard_files for JobDir.select_reshard (the
        reshard's one choice, C++), and removed once read (drop_reshard).
        Not collective. What cannot be found is named in reshard_missing
        (the reshard then reads what the disk holds, and fails in one line
        when an old rank is on neither)."""
        core = _ext.core()
        t0 = time.perf_counter()
        self.reshard_from, missing, self.reshard_bytes, self.reshard_files = {}, [], 0, []
        self.reshard_dir, self.reshard_shared = "", 0
        self.drop_reshard(shared=False)  # a restart before this one may have left its copies
        mem, name = self._reshard_place()
        into = os.path.join(mem, name)
        mine = self.hosts[self.rank]
        # This host's own memory directory is read in place; a server on
        # this host lists the same files.
        rows_all = [("local", h) for h in self.local] + [
            (holder, h) for holder, h in self.other if self.hosts[holder] != mine]
        worlds = {int(h["world_size"]) for _, h in rows_all}
        remote_steps, remote_err = {}, ""
        if remote is not None and worlds:
            try:
                for st, m in _remote.committed_steps(remote.store):
                    remote_steps.setdefault(int(m.get("world_size", 0)), []).append(
                        (int(st), int(m.get("counter") or 0)))
            except (CheckpointError, OSError) as e:
                remote_err = f"the remote tier {remote.store.url} cannot be listed: {e}"
        for w in sorted(worlds):
            sub = core.JobDir.world_name(w)
            need = []
            for r in range(w):
                if os.path.isfile(os.path.join(dir, sub, core.JobDir.slot_name(r))):
                    self.reshard_from[f"{w}/{r}"] = "disk"
                else:
                    need.append(r)
            if need:
                missing += self._gather_world(w, sub, need, rows_all, remote,
                                              remote_steps.get(w, []), remote_err, into)
        self.reshard_missing = "; ".join(missing)
        self.reshard_s = time.perf_counter() - t0

    def _gather_world(self, w: int, sub: str, need: list, rows_all: list, remote,
                      remote_steps: list, remote_err: str, into: str) -> list:
        """gather_old_shards for the old ranks `need` of world size `w`: the
        steps every one of them has a copy of, in the planner's order; at
        each, every old rank's copies of it in the planner's order, the first
        that verifies kept; done at the first step that every old rank got.
        Returns the lines of reshard_missing."""
        core = _ext.core()
        rows = {r: [(where, h) for where, h in rows_all
                    if int(h["world_size"]) == w and int(h["source_rank"]) == r] for r in need}
        steps = None
        for r in need:
            held = {int(h["step"]) for _, h in rows[r]} | {st for st, _ in remote_steps}
            steps = held if steps is None else steps & held
        cands = {}
        for r in need:
            cands[r] = [(where, h) for where, h in rows[r] if int(h["step"]) in steps]
            # The remote part of a step is that old rank's checkpoint of it:
            # its counter is the memory copies' where they hold the step (the
            # marker's otherwise), so at one counter memory comes first.
            at = {int(h["step"]): int(h["counter"]) for _, h in cands[r]}
            cands[r] += [("remote", {"step": st, "counter": at.get(st, c), "kind": "remote"})
                         for st, c in remote_steps if st in steps]

        def planned(cs: list) -> list:
            return core.plan([
                {"tier": "remote" if where == "remote" else
                 "disk" if h.get("kind") == "disk" else "memory",
                 "where": where if isinstance(where, str) else self.endpoints[where],
                 "step": int(h["step"]), "counter": int(h["counter"])}
                for where, h in cs])["order"] if cs else []

        every = [c for r in need for c in cands[r]]
        step_order = list(dict.fromkeys(int(every[i][1]["step"]) for i in planned(every)))
        got, errs = {}, {r: [] for r in need}
        for step in step_order:
            for r in need:
                if got.get(r) == step:
                    continue
                mine = [c for c in cands[r] if int(c[1]["step"]) == step]
                for i in planned(mine):
                    where, h = mine[i]
                    kind = KINDS.get(h.get("kind", ""), "replica")
                    fetched = where != "local"
                    try:
                        if where == "local":
                            desc = f"its {kind} in this host's memory ({h['path']})"
                            core.peer_verify_local(h["path"], r, step)
                            path, src = h["path"], f"own memory {kind} ({h['path']})"
                        elif where == "remote":
                            desc = f"the remote tier ({remote.store.url}) step {step}"
                            d = _remote.fetch(remote.store, step, r, into)
                            path = os.path.join(d, core.JobDir.slot_name(r))
                            src = f"remote ({remote.store.url})"
                        else:
                            ep = self.endpoints[where]
                            desc = f"its {kind} on rank {where} ({ep})"
                            got_copy = core.peer_fetch_once_per_host(
                                ep, self.job, self._secret, r, w, step, int(h["counter"]),
                                h["kind"], core.peer_memory_dir(""), into,
                                f"rank {self.rank} pid {os.getpid()}")
                            path, fetched = got_copy["path"], bool(got_copy["fetched"])
                            src = f"peer {kind} on rank {where} ({ep})"
                            if not fetched:  # another rank of this host fetched it
                                src += f" fetched by {got_copy['by']}"
                                self.reshard_shared += 1
                    except (CheckpointError, OSError) as e:
                        errs[r].append(f"{desc}: {e}")
                        continue
                    self.reshard_files.append((w, r, path))
                    self.reshard_from[f"{w}/{r}"] = f"{src} step {step}"
                    if where != "local":
                        self.reshard_dir = os.path.dirname(os.path.dirname(path))
                    if fetched:
                        try:
                            self.reshard_bytes += os.stat(path).st_size
                        except OSError:
                            pass
                    got[r] = step
                    break
            if all(got.get(r) == step for r in need):
                return []
        out = []
        # The old ranks with no copy at all are why; only when every one got
        # a copy (of different steps) are those named.
        lacking = [r for r in need if r not in got]
        for r in lacking or need:
            if r in got:
                why = (f"no step of which every missing old rank has a copy (this one's is of "
                       f"step {got[r]})")
            else:
                why = ("; ".join(errs[r]) if errs[r] else "on no surviving peer"
                       if not rows[r] else "no step held for every old rank")
                if remote_err and not errs[r]:
                    why += f"; {remote_err}"
            out.append(f"old rank {r} of world size {w}: {why}")
        return out

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
            s.update(peer_replicated=r.get("replicated", 0), peer_bytes=r.get("bytes", 0),
                     peer_failures=r.get("failures", 0), peer_skipped=r.get("skipped", 0),
                     peer_skipped_cadence=r.get("skipped_cadence", 0),
                     peer_skipped_budget=r.get("skipped_budget", 0),
                     peer_last_step=r.get("last_step"), peer_error=r.get("last_error", ""),
                     peer_lag_s=r.get("lag_s_last"), peer_lag_s_max=r.get("lag_s_max"))
        if self.server is not None:
            v = self.server.stats()
            s.update(peer_held=v.get("held", 0), peer_held_bytes=v.get("held_bytes", 0),
                     peer_received=v.get("replicas_received", 0),
                     peer_served=v.get("fetches_served", 0),
                     peer_auth_failures=v.get("auth_failures", 0),
                     peer_handshake_timeouts=v.get("handshake_timeouts", 0),
                     peer_budget_bytes=v.get("budget_bytes", 0))
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
            self._drop_fetched()
            self.prefetched = None
        if self.reshard_files:
            self.drop_reshard()
            self.reshard_files = []
