"""Issue #27: time to restart one rank after a node loss, from the peer
tier against the object store and the survivors' disk, with the link's
own bandwidth measured in the same run; and the training stall with
replication on against off.

    sudo .venv/bin/python bench/peer_restart_bench.py [--gb 1] [--gb 4] [--rounds 3]
        [--stall-pairs 3] [--lean | --no-lean] [--link-gbit 10 [--link-gbit 25]]
        [--ways link,peer] [--out bench/peer_restart_bench.json]

Needs root (network namespaces, as tests/python/test_peer_tier.py).

Hosts (tests/python/netns_hosts.py): host 0 is the survivor, host 1 the
replacement of the lost host, a third namespace holds the S3 server
(SeaweedFS, tests/python/s3_server.py); all on one bridge, each behind its
own veth, so every path below crosses the same kind of link (veth, bridge,
veth). Each host has its own disk directory and its own memory directory
(tmpfs, /dev/shm).

Set up per size (not timed): on the survivor a memory-tier Checkpointer
commits a state of --gb GB (one float32 tensor) and uploads it to the
remote tier; two peer servers on the survivor hold its replica (pushed
over the peer wire): one in the host's memory directory (the peer tier),
one in a disk directory (see "survivors' disk"). The replacement host then
restores that rank's checkpoint, per round, each way once, in an order
that rotates every round (interleaved, so the noise of this shared
2-core box falls on all of them):

  link     the iperf-style probe: raw TCP from the survivor to the
           replacement (sendall of 4 MiB buffers, recv_into, discarded),
           default socket options: what the link carries as a plain copy
  peer     _core.peer_fetch from the survivor's memory into the
           replacement's memory directory (tmpfs: where a restart fetches
           it, _peer.Peers.prefetch), every chunk's crc checked, then
           renamed; then nonstop.load of it (the state as tensors)
  peer_to_disk  the same fetch into the replacement's job directory on
           disk (where a restart fetched it before: fsync at the disk's
           write speed)
  s3       _core.RemoteTier.fetch of the step from the object store (SeaweedFS in its
           own namespace) into the job directory (disk, as the remote
           tier's restore does), every part's crc checked; then nonstop.load
  disk     the survivors' disk: a nonstop job keeps no copy of one rank's
           checkpoint on another host's disk (a rank's disk copies die with
           its host); the nearest real thing is the same replica held on
           the survivor's disk instead of its memory, served over the same
           link into the replacement's memory directory, so this is a peer
           fetch from a disk directory (read from the page cache here: the
           file was just written and this shared box's caches are not
           dropped, so it is a lower bound of a cold disk's time)

The peer tier's target: the peer fetch at >= 0.8x the link's bandwidth.

The link (--link-gbit N, repeatable). Unshaped, the veth "link" is a
memcpy by the kernel on the same 2 cores that run both ends: it carries
as much as those cores can copy, which no checksummed, authenticated
transfer written to tmpfs can match. With --link-gbit, the replacement's
side of its veth (the bridge's port towards host 1: everything it
receives, from the survivor and from the S3 namespace alike) is shaped by
a token bucket (tc qdisc tbf, rate N Gbit/s, a burst of 4 ms at that rate)
like a real NIC of N Gbit/s, and every round runs every way unshaped and
then at each rate (the order of the ways rotating per round): the probe
and the fetches of one rate are interleaved, and each way's "x link" is
against the probe at the same rate. --ways restricts which ways run
(default all; the probe "link" always runs).

Lean (--lean; the default when a --gb is 2 or more): at most two copies of
the state in memory at once, so a 4 GB state fits a 24 GiB machine (the
full mode holds up to five). The survivor drops its tensors and its
Checkpointer once the checkpoint is committed and uploaded, before the
pushes (peer_restart_worker.py seed); after each fetch, instead of
nonstop.load, the fetched copy is read through the same C++ restore path
with no destination for any tensor: every crc chunk read and verified once,
nothing kept ("load s" is then that verification; the fetch, the arms and
the link probe are the same as in the full mode). Each arm's files are
removed before the next, and the sizes run one after another. Either mode
first refuses, in one line, when /proc/meminfo's MemAvailable or /dev/shm's
free space is below what the largest size needs (need_bytes). The JSON
records the lowest MemAvailable and the highest Shmem seen during the run.

Stall (--stall-pairs, 0: skip): a 2-rank job, one rank per host (gloo
across the veths), a --stall-mb MB state per rank, tier="memory",
every=--stall-every, a sleep of --stall-step-s per step for the
forward/backward and an in-place update of the whole state; run with
replicas=0 and replicas=1 in ABBA order (pairs), each run a fresh job.
Each pair gives on/off ratios of the mean step time (warm-up excluded)
and of the visible stall per checkpoint; the summary is their median.

Prints a table and writes JSON.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
import netns_hosts  # noqa: E402
import peer_stall_job  # noqa: E402
from s3_server import SeaweedS3  # noqa: E402

WORKER = peer_stall_job.WORKER
SECRET = os.urandom(32).hex()  # the survivor's servers and the replacement's fetches share it


class Worker:
    """A long-lived peer_restart_worker.py serve in a host's namespace."""

    def __init__(self, host, log):
        e = dict(os.environ, NONSTOP_SHM_DIR=host.shm, BENCH_ADDR=host.addr, PYTHONUNBUFFERED="1",
                 OMP_NUM_THREADS="1", NONSTOP_PEER_SECRET=SECRET)
        self.log = open(log, "ab")
        self.p = subprocess.Popen(["ip", "netns", "exec", host.ns, sys.executable, WORKER, "serve"],
                                  env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True, start_new_session=True)
        assert json.loads(self.p.stdout.readline()).get("ready"), "worker did not start"

    def __call__(self, cmd, **kw):
        self.p.stdin.write(json.dumps(dict(kw, cmd=cmd)) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.p.poll()}); see {self.log.name}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"{cmd}: {out['error']}")
        return out

    def close(self):
        if self.p.poll() is None:
            try:
                self("quit")
                self.p.wait(timeout=30)
            except Exception:  # noqa: BLE001 -- killed below
                pass
        if self.p.poll() is None:
            os.killpg(self.p.pid, 9)
            self.p.wait(timeout=30)
        self.log.close()


# Copies of the state one size holds in memory at most (state, memory-tier
# segment, replicas, fetched copy, loaded tensors), and what the processes
# (SeaweedFS, torch in each worker, the stall job) need beside them.
COPIES = {True: 2, False: 5}
SHM_COPIES = {True: 2, False: 3}
OVERHEAD = 4 << 30  # the 4 GB lean run peaked 11.8 GiB below its start (Shmem 7.5)


def need_bytes(gb, lean):
    """(memory, /dev/shm space) a run of the largest of `gb` needs."""
    n = int(max(gb) * 1e9)
    return COPIES[lean] * n + OVERHEAD, SHM_COPIES[lean] * n


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class MemWatch:
    """The lowest MemAvailable and the highest Shmem (/proc/meminfo) seen
    while the run goes, sampled every 0.5 s: what the run took at its peak
    (with whatever else the machine ran meanwhile)."""

    def __init__(self):
        self.low_avail, self.high_shmem, self.stop = None, 0, threading.Event()
        self.th = threading.Thread(target=self.run, daemon=True)
        self.th.start()

    def run(self):
        while True:
            with open("/proc/meminfo") as f:
                m = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
            a = m.get("MemAvailable", 0)
            self.low_avail = a if self.low_avail is None else min(self.low_avail, a)
            self.high_shmem = max(self.high_shmem, m.get("Shmem", 0))
            if self.stop.wait(0.5):
                return

    def done(self):
        self.stop.set()
        self.th.join()
        return {"mem_available_low_GiB": round(self.low_avail / 2**30, 2),
                "shmem_high_GiB": round(self.high_shmem / 2**30, 2)}


def check_memory(gb, lean):
    """One line (the reason to refuse) when this machine cannot hold the
    run now, else ""."""
    mem, shm = need_bytes(gb, lean)
    have = mem_available()
    st = os.statvfs("/dev/shm")
    shm_free = st.f_bavail * st.f_frsize
    mode = "lean" if lean else "full (try --lean)"
    if have < mem:
        return (f"peer_restart_bench: {max(gb):g} GB per rank, {mode}, needs {mem / 2**30:.1f} GiB "
                f"of memory; MemAvailable is {have / 2**30:.1f} GiB")
    if shm_free < shm:
        return (f"peer_restart_bench: {max(gb):g} GB per rank, {mode}, needs {shm / 2**30:.1f} GiB "
                f"free in /dev/shm; it has {shm_free / 2**30:.1f} GiB")
    return ""


def restart_rounds(a, hs, s3, surv, repl, gb, root, res):
    nbytes = int(gb * 1e9)
    job = f"/bench/job-{gb}"
    url = s3.url(f"peer-restart-{gb}")
    t0 = time.perf_counter()
    seeded = surv("seed", bytes=nbytes, url=url, options=s3.options, job=job,
                  disk=hs[0].disk, shm=hs[0].shm, lean=a.lean)
    print(f"{gb} GB: seeded in {time.perf_counter() - t0:.1f} s (commit + upload)", flush=True)
    nbytes = seeded["bytes"]
    a0 = hs[0].addr
    ways = {
        "link": lambda: repl("probe", addr=a0, port=seeded["raw_port"], bytes=nbytes),
        "peer": lambda: repl("peer", endpoint=seeded["mem_ep"], job=job,
                             dest=os.path.join(hs[1].shm, "fetched"), lean=a.lean),
        "peer_to_disk": lambda: repl("peer", endpoint=seeded["mem_ep"], job=job,
                                     dest=os.path.join(hs[1].disk, "job"), lean=a.lean),
        "s3": lambda: repl("s3", url=url, options=s3.options, step=1,
                           dest=os.path.join(hs[1].disk, "job"), lean=a.lean),
        "disk": lambda: repl("peer", endpoint=seeded["disk_ep"], job=job,
                             dest=os.path.join(hs[1].shm, "fetched"), lean=a.lean),
    }
    names = [k for k in ways if k == "link" or a.ways is None or k in a.ways]
    shapes = [0.0] + list(a.link_gbit or [])
    rows = {g: {k: [] for k in names} for g in shapes}
    try:
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for g in shapes:
                shape_link(hs, g)
                for k in order:
                    got = ways[k]()
                    if k == "link":
                        got = {"fetch_s": got["s"], "load_s": 0.0}
                    else:
                        assert got["loaded_bytes"] == nbytes, got
                    rows[g][k].append(got)
                    print(f"  round {r} {link_name(g):<9} {k:<12} fetch {got['fetch_s']:.2f} s  "
                          f"load {got['load_s']:.2f} s", flush=True)
    finally:
        shape_link(hs, 0.0)
        surv("drop")
    out = {"bytes": nbytes, "lean": a.lean, "load": "verify" if a.lean else "nonstop.load"}
    for g in shapes:
        link = statistics.median(x["fetch_s"] for x in rows[g]["link"])
        part = {"rounds": rows[g], "summary": {}}
        for k in names:
            f = statistics.median(x["fetch_s"] for x in rows[g][k])
            t = statistics.median(x["fetch_s"] + x["load_s"] for x in rows[g][k])
            part["summary"][k] = {"fetch_s": round(f, 3), "restored_s": round(t, 3),
                                  "fetch_GBps": round(nbytes / f / 1e9, 3),
                                  "fetch_vs_link": round(link / f, 3)}
        if g == 0:
            out.update(part)  # unshaped: where it always was
        else:
            out.setdefault("shaped", {})[link_name(g)] = dict(part, gbit=g)
    res["sizes"][str(gb)] = out


def link_name(gbit):
    return "unshaped" if not gbit else f"{gbit:g}gbit"


def shape_link(hs, gbit):
    """Shapes what host 1 (the replacement) receives to `gbit` Gbit/s with a
    token bucket on the bridge's veth port towards it; 0: unshaped."""
    dev = f"{hs.br}v1"
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=20)
    if not gbit:
        return
    rate = int(gbit * 1e9)  # bit/s
    burst = max(rate // 8 // 250, 256 << 10)  # 4 ms at the rate, in bytes
    subprocess.run(["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
                    "burst", str(burst), "latency", "50ms"], check=True, capture_output=True,
                   timeout=20)


def stall_pairs(a, hs, root, res):
    runs = []
    for pair in range(a.stall_pairs):
        arms = [0, 1] if pair % 2 == 0 else [1, 0]
        got = {}
        for reps in arms:
            job = f"stall-{pair}-{reps}"
            ranks = peer_stall_job.run_job(
                hs, job, os.path.join(root, f"{job}.log"),
                peer_stall_job.train_argv(hs, job, a.stall_mb, a.stall_every, a.stall_steps,
                                          a.stall_step_s, lambda r: ["--replicas", str(reps)]),
                replicating=bool(reps))
            got[reps] = {"step_s_mean": statistics.mean(x["step_s_mean"] for x in ranks),
                         "stall_per_ckpt_s": statistics.mean(x["stall_per_ckpt_s"] for x in ranks),
                         "peer_replicated": sum(x["peer_replicated"] for x in ranks),
                         "ranks": ranks}
            print(f"  stall pair {pair} replicas={reps}: step {got[reps]['step_s_mean'] * 1e3:.1f} ms,"
                  f" stall/ckpt {got[reps]['stall_per_ckpt_s'] * 1e3:.1f} ms,"
                  f" replicated {got[reps]['peer_replicated']}", flush=True)
        runs.append({"pair": pair, "off": got[0], "on": got[1],
                     "step_ratio": got[1]["step_s_mean"] / got[0]["step_s_mean"],
                     "stall_ratio": (got[1]["stall_per_ckpt_s"] / got[0]["stall_per_ckpt_s"]
                                     if got[0]["stall_per_ckpt_s"] > 0 else None)})
    steps = [x["step_ratio"] for x in runs]
    stalls = [x["stall_ratio"] for x in runs if x["stall_ratio"] is not None]
    res["stall"] = {"mb": a.stall_mb, "every": a.stall_every, "steps": a.stall_steps,
                    "step_s": a.stall_step_s, "pairs": runs,
                    "step_ratio_median": statistics.median(steps),
                    "step_ratio_range": [min(steps), max(steps)],
                    "stall_ratio_median": statistics.median(stalls) if stalls else None,
                    "stall_ratio_range": [min(stalls), max(stalls)] if stalls else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, action="append",
                    help="per-rank state in GB (repeat for several; default 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stall-pairs", type=int, default=3)
    ap.add_argument("--stall-mb", type=float, default=64)
    ap.add_argument("--stall-every", type=int, default=1)
    ap.add_argument("--stall-steps", type=int, default=30)
    ap.add_argument("--stall-step-s", type=float, default=0.1)
    ap.add_argument("--lean", action=argparse.BooleanOptionalAction, default=None,
                    help="at most two copies of the state in memory (module doc); "
                         "default: on when a --gb is 2 or more")
    ap.add_argument("--link-gbit", type=float, action="append",
                    help="also shape the replacement's link to N Gbit/s (tc tbf) and run every way "
                         "over it, interleaved with the unshaped link (repeat for several)")
    ap.add_argument("--ways", type=lambda v: v.split(","), default=None,
                    help="comma-separated ways to run besides the probe (default: all)")
    ap.add_argument("--out", default=os.path.join(HERE, "peer_restart_bench.json"))
    a = ap.parse_args()
    a.gb = a.gb or [1.0]
    if a.lean is None:
        a.lean = max(a.gb) >= 2
    if os.geteuid() != 0:
        sys.exit("peer_restart_bench: network namespaces need root")
    if a.rounds > 0:
        why = check_memory(a.gb, a.lean)
        if why:
            sys.exit(why)

    root = tempfile.mkdtemp(prefix="peer-restart-", dir="/var/tmp")
    shm = tempfile.mkdtemp(prefix="peer-restart-", dir="/dev/shm")
    res = {"command": "python " + " ".join(sys.argv), "cpus": os.cpu_count(),
           "machine": platform.machine(), "lean": a.lean, "sizes": {}, "stall": None,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    res["mem_available_before_GiB"] = round(mem_available() / 2**30, 2)
    watch = MemWatch()
    hs = netns_hosts.Hosts(2, root, store=True)
    workers, s3 = [], None
    try:
        hs.up()
        for h in hs:
            h.shm = os.path.join(shm, f"host{h.index}")
            os.makedirs(h.shm)
        s3 = SeaweedS3(os.path.join(root, "s3"), host=hs.store_addr, netns=hs.store_ns)
        s3.start()
        if a.rounds > 0:
            surv = Worker(hs[0], os.path.join(root, "survivor.log"))
            workers.append(surv)
            repl = Worker(hs[1], os.path.join(root, "replacement.log"))
            workers.append(repl)
            for gb in a.gb:
                restart_rounds(a, hs, s3, surv, repl, gb, root, res)
            for w in workers:
                w.close()
            workers.clear()
        if a.stall_pairs > 0:
            stall_pairs(a, hs, root, res)
    finally:
        for w in workers:
            w.close()
        if s3 is not None:
            s3.stop()
        hs.down()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        res.update(watch.done())

    print(f"\nMemAvailable {res['mem_available_before_GiB']} GiB before, lowest "
          f"{res['mem_available_low_GiB']} GiB; Shmem highest {res['shmem_high_GiB']} GiB"
          f" ({'lean' if a.lean else 'full'} mode)")
    print(f"\n{'GB':>5} {'way':<22}{'fetch s':>9}{'restored s':>12}{'GB/s':>8}{'x link':>8}")
    for gb, out in res["sizes"].items():
        parts = [("", out)] + [(f" @{n}", p) for n, p in out.get("shaped", {}).items()]
        for tag, part in parts:
            for k, v in part["summary"].items():
                print(f"{gb:>5} {(k + tag):<22}{v['fetch_s']:>9.2f}{v['restored_s']:>12.2f}"
                      f"{v['fetch_GBps']:>8.2f}{v['fetch_vs_link']:>8.2f}")
    if res["stall"]:
        s = res["stall"]
        print(f"stall, replicas=1 vs 0 ({s['mb']} MB/rank, every={s['every']}): step time "
              f"x{s['step_ratio_median']:.3f} (range {s['step_ratio_range'][0]:.3f}-"
              f"{s['step_ratio_range'][1]:.3f}), visible stall per checkpoint "
              f"x{s['stall_ratio_median'] or float('nan'):.3f}")
    peer_stall_job.write_json(a.out, res)


if __name__ == "__main__":
    main()
