"""One process of bench/peer_restart_bench.py, started inside a host (a
network namespace, tests/python/netns_hosts.py). Not a tool of its own.

    python peer_restart_worker.py serve   JSON commands on stdin, one JSON answer a line
    python peer_restart_worker.py train   one rank of the stall job (RANK, WORLD_SIZE,
                                          MASTER_ADDR, MASTER_PORT set); flags below

`serve` commands ({"cmd": ..., ...}):
  seed    (survivor host) a state of `bytes`, committed once by a memory-tier
          Checkpointer that uploads it to the remote tier (`url`, `options`);
          then two peer servers on this host's address hold its replica:
          one in the memory directory (tmpfs), one in a disk directory; and
          a raw TCP source for the link probe. Answers their endpoints.
          `lean`: the commit stages through 256 MiB (max_in_flight=1), and
          the state's tensors and the Checkpointer are dropped once
          the checkpoint is committed and uploaded, before the pushes (the
          segment is kept by a second link until both replicas are stored),
          so at most two copies of the state are in memory at once.
  drop    (survivor) closes the servers and removes what seed made.
  probe   (replacement) receives `bytes` from the raw source: seconds.
  peer    (replacement) _core.peer_fetch of the replica at `endpoint` into
          `dest` (a one-slot job directory, verified), then nonstop.load of
          it: fetch and load seconds. `lean`: instead of nonstop.load, the
          fetched copy is read once more through the same C++ restore path
          (_core.restore) with no destination for any tensor: every crc chunk
          read and verified, nothing kept (no second copy of the state).
  s3      (replacement) RemoteTier.fetch of step `step` rank 0 from `url` into
          `dest`, then nonstop.load (`lean`: verified as above): fetch and
          load seconds.
"""
import argparse
import gc
import json
import os
import shutil
import socket
import sys
import threading
import time

import torch

import nonstop
from nonstop import _core, _remote

PIECE = 4 << 20
# The job's peer secret (both workers take it from the driver's environment,
# as ranks take $NONSTOP_PEER_SECRET).
SECRET = bytes.fromhex(os.environ.get("NONSTOP_PEER_SECRET", "00" * 32))


def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


class RawSource:
    """The iperf-style probe's sender: each connection says how many bytes
    it wants (20 decimal digits) and gets that many zeros in 4 MiB sendall
    calls (plain sockets, default buffers), then the connection closes."""

    def __init__(self, host):
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind((host, 0))
        self.srv.listen(4)
        self.port = self.srv.getsockname()[1]
        self.buf = memoryview(bytes(PIECE))
        self.th = threading.Thread(target=self.run, daemon=True)
        self.th.start()

    def run(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            with c:
                head = b""
                while len(head) < 20:
                    got = c.recv(20 - len(head))
                    if not got:
                        break
                    head += got
                left = int(head or b"0")
                while left > 0:
                    n = min(left, PIECE)
                    c.sendall(self.buf[:n])
                    left -= n

    def close(self):
        self.srv.close()


def probe(addr, port, nbytes):
    buf = bytearray(PIECE)
    view = memoryview(buf)
    s = socket.create_connection((addr, port))
    t0 = time.perf_counter()
    s.sendall(b"%020d" % nbytes)
    got = 0
    while got < nbytes:
        n = s.recv_into(view)
        if n == 0:
            break
        got += n
    secs = time.perf_counter() - t0
    s.close()
    assert got == nbytes, (got, nbytes)
    return secs


def load_all(d):
    """Reads the one-slot checkpoint in `d` (rank 0) into new tensors: the
    state a restart holds."""
    loaded = nonstop.load(d)
    n = 0
    for v in loaded.tensors.values():
        n += v.numel() * v.element_size()
    return n


def verify_all(d):
    """The lean mode's stand-in for load_all: the checkpoint in `d` (rank 0)
    read through the same C++ restore path (_core.restore: the job
    directory's selection, every crc chunk read and verified once, in
    parallel), with a null destination for every tensor, so nothing is
    kept. The bytes its tensors hold; a failed check raises."""
    seen = []

    def prepare(info):
        seen.append(sum(t["nbytes"] for t in info["tensors"]))
        return [(0, t["nbytes"]) for t in info["tensors"]]

    got = _core.restore(d, 0, prepare)
    if got is None or not seen:
        raise RuntimeError(f"no committed checkpoint in {d}")
    return seen[-1]


class Survivor:
    def __init__(self, addr):
        self.addr = addr
        self.ck = self.servers = self.raw = None
        self.made = []

    def seed(self, bytes, url, options, job, disk, shm, lean=False):
        n = bytes // 4
        state = {"w": torch.randn(n // 4096, 4096)}
        seed_dir = os.path.join(disk, "seed")
        t0 = time.perf_counter()
        # lean: one snapshot in flight through a 256 MiB staging buffer, not
        # two of the state's size (the default), so the commit holds the
        # state, its segment and 256 MiB.
        small = {"max_in_flight": 1, "staging_bytes": 256 << 20} if lean else {}
        ck = nonstop.Checkpointer(seed_dir, state, every=1, tier="memory", remote=url,
                                  remote_options=options, **small)
        ck.step(1)
        ck.wait()
        deadline = time.time() + 300
        while ck.stats()["memory_counter"] != ck.stats()["committed"] and time.time() < deadline:
            time.sleep(0.05)
        seg = ck.stats()["memory_segment"]
        held = seg
        if lean:
            # The segment outlives the Checkpointer through a second link (same
            # tmpfs); the state's tensors go once committed and uploaded.
            held = os.path.join(shm, "seed-segment")
            os.link(seg, held)
            ck.close()  # waits for the upload
            del ck, state
            gc.collect()
        mem_dir, disk_dir = os.path.join(shm, "peer"), os.path.join(disk, "peer-disk")
        self.servers = [_core.PeerServer(job, SECRET, bind_host=self.addr, dir=d)
                        for d in (mem_dir, disk_dir)]
        eps = [f"{self.addr}:{s.port}" for s in self.servers]
        for ep in reversed(eps):  # the disk's first (page cache, which can be given back)
            out = _core.peer_push(ep, job, SECRET, held)
            assert out == "stored", out
        if not lean:
            ck.close()  # waits for the upload; the segment goes with it
            del state
        upload_s = time.perf_counter() - t0
        for f in {seg, held}:
            if os.path.exists(f):
                os.unlink(f)  # only the replicas stay in this host's memory
        shutil.rmtree(seed_dir, ignore_errors=True)
        self.raw = RawSource(self.addr)
        self.made = [mem_dir, disk_dir]
        return {"mem_ep": eps[0], "disk_ep": eps[1], "raw_port": self.raw.port,
                "bytes": (n // 4096) * 4096 * 4, "seed_s": upload_s}

    def drop(self):
        for s in self.servers or []:
            s.close()
        if self.raw is not None:
            self.raw.close()
        for d in self.made:
            shutil.rmtree(d, ignore_errors=True)
        self.servers = self.raw = None
        return {}


def serve():
    surv = Survivor(os.environ.get("BENCH_ADDR", "127.0.0.1"))
    say(ready=True)
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.pop("cmd")
        try:
            if cmd == "seed":
                say(**surv.seed(**req))
            elif cmd == "drop":
                say(**surv.drop())
            elif cmd == "probe":
                say(s=probe(req["addr"], req["port"], req["bytes"]))
            elif cmd in ("peer", "s3"):
                shutil.rmtree(req["dest"], ignore_errors=True)
                os.makedirs(req["dest"])
                t0 = time.perf_counter()
                if cmd == "peer":
                    d = _core.peer_fetch(req["endpoint"], req["job"], SECRET, 0, 1, req["dest"])
                else:
                    store = _remote.open_store(req["url"], req["options"])
                    d = _core.RemoteTier(store).fetch(int(req["step"]), 0, req["dest"])
                t1 = time.perf_counter()
                got = verify_all(d) if req.get("lean") else load_all(d)
                t2 = time.perf_counter()
                shutil.rmtree(req["dest"], ignore_errors=True)
                say(fetch_s=t1 - t0, load_s=t2 - t1, loaded_bytes=got)
            elif cmd == "quit":
                say()
                return
            else:
                say(error=f"unknown command {cmd}")
        except Exception as e:  # noqa: BLE001 -- reported to the driver, which stops
            say(error=f"{type(e).__name__}: {e}")


def run_delay_s():
    """This thread's time spent runnable but waiting for a CPU
    (/proc/thread-self/schedstat, field 2: the run queue's delay)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def train(a):
    if a.cpu is not None:  # this "host"'s own core (peer_stall_bench.py --pin); threads inherit it
        os.sched_setaffinity(0, {a.cpu})
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    state = {"w": torch.randn(int(a.mb * 2**20 / 4 / 4096), 4096)}
    # Each rank its own state (a sharded model): rank-local, all of it checkpointed per rank.
    ck = nonstop.Checkpointer(a.dir, state, every=a.every, tier="memory", replicas=a.replicas,
                              local=["w"], peer_every=a.peer_every,
                              **({} if a.peer_nice is None else
                                 {"peer_nice": a.peer_nice if a.peer_nice == "idle" else int(a.peer_nice)}),
                              **({} if a.peer_bps is None else
                                 {"peer_bps": a.peer_bps if a.peer_bps == "spread" else int(a.peer_bps)}))
    ck.restore()
    times, waits, cpus = [], [], []
    for step in range(a.steps):
        t0, w0, c0 = time.perf_counter(), run_delay_s(), time.process_time()
        time.sleep(a.step_s)                # the forward/backward of a real job
        state["w"].mul_(0.999)              # the optimizer: touches the whole state
        ck.step(step)
        times.append(time.perf_counter() - t0)
        waits.append(run_delay_s() - w0)
        cpus.append(time.process_time() - c0)  # every thread of this rank: training, engine, peer
    st = ck.stats()
    warm = min(len(times) - 1, 2 * a.every)
    ck.wait()
    drained = True
    peers = getattr(getattr(ck.session, "dist", None), "peers", None)
    if peers is not None:
        drained = peers.drain(60)
    after = ck.stats()
    out = {"rank": rank, "replicas": a.replicas, "step_s_mean": sum(times[warm:]) / len(times[warm:]),
           "runq_wait_s_mean": sum(waits[warm:]) / len(waits[warm:]),
           "cpu_s_per_step": sum(cpus[warm:]) / len(cpus[warm:]),
           "peer_nice": a.peer_nice, "peer_every": a.peer_every, "peer_bps": a.peer_bps,
           "peer_lag_s": st.get("peer_lag_s"), "peer_lag_s_max": st.get("peer_lag_s_max"),
           "peer_skipped": st.get("peer_skipped", 0),
           "peer_skipped_cadence": st.get("peer_skipped_cadence", 0),
           "stall_per_ckpt_s": st.get("visible_stall_s", 0.0) / max(1, st.get("saves", 1)),
           "saves": st.get("saves"), "peer_replicated": st.get("peer_replicated", 0),
           "peer_bytes": st.get("peer_bytes", 0), "peer_note": st.get("peer_note", ""),
           # during training (above) and once drained after it (below)
           "peer_last_step": st.get("peer_last_step"), "last_step": a.steps - 1,
           "peer_replicated_drained": after.get("peer_replicated", 0),
           "peer_lag_s_max_drained": after.get("peer_lag_s_max"),
           "drained": drained}
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    say(**out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["serve", "train"])
    ap.add_argument("--dir")
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--replicas", type=int, default=0)
    ap.add_argument("--peer-nice", default=None, help='0..19 or "idle"')
    ap.add_argument("--peer-bps", default=None, help='bytes a second or "spread"')
    ap.add_argument("--peer-every", type=int, default=1)
    ap.add_argument("--cpu", type=int, default=None)
    a = ap.parse_args()
    serve() if a.mode == "serve" else train(a)


if __name__ == "__main__":
    main()
