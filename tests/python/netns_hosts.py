"""Hosts made of network namespaces, for the multi-host tests
(test_remote_netns.py, test_peer_tier.py).

Each host is a network namespace with its own IP on a private /24 (a veth
pair into a bridge in the root namespace), its own disk directory and its
own memory-segment directory (the ranks started on it get NONSTOP_SHM_DIR
pointing there). Ranks are started inside a host (`ip netns exec`), each in
a process group of its own; a gloo job spans hosts with MASTER_ADDR on
host 0 and GLOO_SOCKET_IFNAME set to the hosts' one interface. Losing a
host SIGKILLs its processes and wipes its disk and memory directories; a
replacement host is the same namespace with empty directories.

An optional storage host (a namespace with an address but no ranks) holds
servers the hosts reach over the bridge (the S3 server of the remote tier's
test: why it is not in the root namespace is in test_remote_netns.py).

Needs root; `hosts()` skips a test with one line otherwise. Every command
runs under a timeout, and the namespaces, veths and bridge are removed at
the end, also on failure (`hosts()` asserts they are gone)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

import pytest

import dist_launch

IFNAME = "eth0"  # each host's one interface (GLOO_SOCKET_IFNAME)


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=check)


def free_port() -> int:
    """A TCP port for a job's rendezvous (dist_launch.free_port: below the
    ephemeral range, so none of the hosts' own connections is given it
    before rank 0 listens on it)."""
    return dist_launch.free_port()


class Host:
    """One host: its namespace, address, disk and memory directories, and
    the processes started on it."""

    def __init__(self, index: int, ns: str, addr: str, root: str):
        self.index, self.ns, self.addr = index, ns, addr
        self.disk = os.path.join(root, f"host{index}-disk")
        self.shm = os.path.join(root, f"host{index}-shm")
        self.procs: list = []
        self.lost = 0  # how many times this host was lost
        os.makedirs(self.disk, exist_ok=True)
        os.makedirs(self.shm, exist_ok=True)

    def start(self, argv: list, env: dict, log: str) -> subprocess.Popen:
        """Starts `python argv...` in this host's namespace, its output
        appended to `log`, with NONSTOP_SHM_DIR set to this host's memory
        directory (env may override it)."""
        e = dict(os.environ, NONSTOP_SHM_DIR=self.shm, GLOO_SOCKET_IFNAME=IFNAME,
                 PYTHONUNBUFFERED="1")
        e.update(env)
        with open(log, "ab") as f:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns, sys.executable, *argv],
                                 env=e, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.procs.append(p)
        return p

    def kill(self) -> None:
        """SIGKILLs every process started here (their whole process groups)
        and reaps them."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)
        self.procs.clear()

    def lose(self) -> None:
        """The host is lost: its processes SIGKILLed, its disk and memory
        gone. What starts on it next is a replacement host (empty
        directories, the same address)."""
        self.kill()
        for d in (self.disk, self.shm):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        self.lost += 1


class Hosts:
    """`n` hosts (and optionally a storage host) on one bridge."""

    def __init__(self, n: int, root: str, store: bool = False):
        tag = (os.getpid() + n * 7919 + (1 if store else 0)) % 10000
        self.net = f"10.{200 + tag % 50}.{tag % 250}"
        self.br = f"nsb{tag}"
        self.bridge_addr = f"{self.net}.1"
        self.hosts = [Host(i, f"nonstop-h{i}-{tag}", f"{self.net}.{2 + i}", root)
                      for i in range(n)]
        self.store_ns = f"nonstop-s-{tag}" if store else None
        self.store_addr = f"{self.net}.{2 + n}" if store else None
        self.made: list = []

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def namespaces(self) -> list:
        return [h.ns for h in self.hosts] + ([self.store_ns] if self.store_ns else [])

    def up(self) -> None:
        ip("link", "add", self.br, "type", "bridge")
        self.made.append(("link", self.br))
        ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.br)
        ip("link", "set", self.br, "up")
        addrs = [h.addr for h in self.hosts] + ([self.store_addr] if self.store_ns else [])
        for i, (ns, addr) in enumerate(zip(self.namespaces(), addrs)):
            ip("netns", "add", ns)
            self.made.append(("netns", ns))
            outer = f"{self.br}v{i}"
            ip("link", "add", outer, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            self.made.append(("link", outer))
            ip("link", "set", outer, "master", self.br)
            ip("link", "set", outer, "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            ip("-n", ns, "link", "set", IFNAME, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def kill_all(self) -> None:
        for h in self.hosts:
            h.kill()

    def down(self) -> None:
        self.kill_all()
        for kind, name in reversed(self.made):
            if kind == "netns":
                ip("netns", "del", name, check=False)
            else:
                ip("link", "del", name, check=False)
        self.made.clear()

    def reachable(self, addr: str, port: int, hosts: Optional[list] = None) -> None:
        """Each host (of `hosts`, default all) opens a TCP connection to
        addr:port, so that a network that cannot carry a test fails in one
        line here, and not as a rank's retry error later."""
        probe = ("import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), "
                 "timeout=5).close()")
        for h in hosts if hosts is not None else self.hosts:
            r = subprocess.run(["ip", "netns", "exec", h.ns, sys.executable, "-c", probe, addr,
                                str(port)], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, \
                f"{h.ns} cannot reach {addr}:{port}: {r.stderr.strip().splitlines()[-1:]}"


@contextlib.contextmanager
def hosts(n: int, root, store: bool = False):
    """`n` hosts under `root` (a directory: their disks and memory
    directories), torn down at the end. Skips the test (one line) without
    root or where namespaces cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    hs = Hosts(n, str(root), store=store)
    try:
        hs.up()
    except (subprocess.CalledProcessError, FileNotFoundError, OSError) as e:
        hs.down()
        msg = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"cannot make network namespaces here: {msg.strip().splitlines()[-1]}")
    try:
        yield hs
    finally:
        hs.down()
        left = ip("netns", "list").stdout
        assert not any(ns in left for ns in hs.namespaces()), left


def start_ranks(hs: Hosts, placement: list, argv, log: str, env: Optional[dict] = None,
                port: Optional[int] = None) -> list:
    """Starts one job: rank r on host placement[r] (a gloo rendezvous at
    the first rank's host), `python argv...` (argv: a list, or a function
    of the rank giving one) with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
    and MASTER_PORT set; rank r's output goes to LOG-r. Returns the
    processes in rank order."""
    port = port or free_port()
    world = len(placement)
    local = {}
    procs = []
    for rank, hi in enumerate(placement):
        lr = local[hi] = local.get(hi, -1) + 1
        e = dict(env or {}, RANK=str(rank), LOCAL_RANK=str(lr), WORLD_SIZE=str(world),
                 MASTER_ADDR=hs[placement[0]].addr, MASTER_PORT=str(port),
                 OMP_NUM_THREADS="1")
        procs.append(hs[hi].start(argv(rank) if callable(argv) else argv, e, f"{log}-{rank}"))
    return procs


def wait_ranks(procs: list, timeout: float, log: str, tail: int = 3000) -> None:
    """Waits for every rank to exit 0 within `timeout` seconds; else kills
    them all and raises with the tail of each rank's log."""
    deadline = time.monotonic() + timeout
    failed = None
    try:
        for rank, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"rank {rank} did not finish in {timeout} s"
                # Where each rank stands (a rank script that registers
                # faulthandler on SIGUSR1 prints its threads' stacks).
                for q in procs:
                    if q.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(q.pid, signal.SIGUSR1)
                time.sleep(1.0)
                break
            if rc != 0:
                failed = f"rank {rank} exited with {rc}"
                break
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    if failed:
        logs = "".join(f"--- rank {r}\n" + read_log(f"{log}-{r}")[-tail:]
                       for r in range(len(procs)))
        raise AssertionError(f"{failed}:\n{logs}")


def read_log(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def events(out: str, kind: str, n: int) -> list:
    """The JSON event lines of kind `kind` that ranks 0..n-1 logged to
    OUT.log-RANK (replica_train.py's events), by rank."""
    got = []
    for r in range(n):
        for line in read_log(f"{out}.log-{r}").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and e.get("event") == kind:
                got.append(e)
    return sorted(got, key=lambda e: e["rank"])


def finals(out: str, n: int) -> list:
    """Each rank's final state digests (OUT.rank-RANK.json), for a bitwise
    comparison of two runs."""
    got = []
    for r in range(n):
        with open(f"{out}.rank-{r}.json") as f:
            g = json.load(f)
        got.append([g[k] for k in ("params", "buffers", "optim", "rng", "samples", "lr")])
    return got
