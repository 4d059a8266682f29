"""Issue #27: throughput of the peer tier's push and fetch over a link,
against a raw TCP copy of the same bytes over the same link (the
iperf-style probe), in one run.

A Checkpointer (tier="memory") commits a state of --gb GB; its memory
segment is the source. Each round, interleaved:
  raw    a Python socket sends the same number of bytes to a receiver
         thread that discards them (sendall of 4 MiB buffers / recv_into):
         the link's bandwidth as a plain copy sees it;
  push   _core.peer_push: the segment read (every chunk crc checked), framed,
         sent, checked again and written by the server into its memory
         directory (temp, commit, rename);
  fetch  _core.peer_fetch: the replica streamed back and written (checked)
         into a local one-slot job directory.
The directories are tmpfs (/dev/shm) unless --dir says otherwise. Target
(issue #27): a peer restart (fetch) at >= 0.8x the link's bandwidth.

On one machine the "link" is loopback, so sender and receiver share its
CPUs: this measures the protocol's and the checksums' cost against a copy,
not a network. Across hosts, run the server on the other host's address.

Besides wall seconds, each row records the CPU seconds the process spent
in it (getrusage: the server's and the client's threads are both in this
process), which a loaded machine disturbs far less than wall time: on 2
shared cores at load 15 the wall time says more about the other tenants.

The same script runs against another build of nonstop by running it with
that build's interpreter, e.g. main's, for a before/after:
    (cd /work/main && .venv/bin/python /path/to/bench/peer_bench.py --out x.json)

--only fetch times the fetch alone (one untimed push first makes the
replica; no raw, no push rows): for a profile of the fetch by itself, e.g.
    perf record -k CLOCK_MONOTONIC -F 1999 -g -o /tmp/f.data \
        .venv/bin/python bench/peer_bench.py --only fetch
(it prints each fetch's window for perf report --time A,B).

Usage: python bench/peer_bench.py [--gb 1] [--rounds 3] [--only fetch] [--out bench/peer_bench.json]
Prints a table and writes JSON.
"""
import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time


def raw_copy(nbytes, host="127.0.0.1"):
    """Seconds to send nbytes through a fresh TCP connection to a discarding receiver."""
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    got = [0]

    def sink():
        c, _ = srv.accept()
        buf = bytearray(4 << 20)
        view = memoryview(buf)
        while True:
            n = c.recv_into(view)
            if n == 0:
                break
            got[0] += n
        c.close()

    t = threading.Thread(target=sink)
    t.start()
    payload = bytes(4 << 20)
    s = socket.create_connection((host, port))
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(left, len(payload))
        s.sendall(payload[:n] if n < len(payload) else payload)
        left -= n
    s.shutdown(socket.SHUT_WR)
    t.join()
    secs = time.perf_counter() - t0
    s.close()
    srv.close()
    assert got[0] == nbytes
    return secs


WIRES = {1: "v1 (no auth)", 2: "v2 (handshake, HMAC-SHA256 per frame)",
         3: "v3 (handshake; DATA frames: GHASH on PCLMULQDQ XOR a per-frame HMAC pad, others HMAC-SHA256)"}


def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--only", choices=["fetch"], default=None,
                    help="time only this (the replica pushed once, untimed)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "peer_bench.json"))
    a = ap.parse_args()

    import torch
    import nonstop
    from nonstop import _core

    root = tempfile.mkdtemp(prefix="peer-bench-", dir=a.dir)
    disk = tempfile.mkdtemp(prefix="peer-bench-job-")  # the job directory: on disk, not tmpfs
    os.environ["NONSTOP_SHM_DIR"] = os.path.join(root, "own")
    try:
        n = int(a.gb * 1e9 / 4)
        state = {"w": torch.randn(n // 4096, 4096)}
        ck = nonstop.Checkpointer(os.path.join(disk, "job"), state, every=1, tier="memory")
        ck.step(1)
        ck.wait()
        deadline = time.time() + 120
        while ck.stats()["memory_counter"] != ck.stats()["committed"] and time.time() < deadline:
            time.sleep(0.05)
        seg = ck.stats()["memory_segment"]
        nbytes = state["w"].numel() * 4
        secret = os.urandom(32)
        # Old cores (before the handshake, wire version 1) take no secret.
        authed = "secret" in (_core.PeerServer.__init__.__doc__ or "")
        key = (secret,) if authed else ()
        srv = _core.PeerServer("bench", *key, bind_host="127.0.0.1",
                               dir=os.path.join(root, "peer"))
        ep = f"127.0.0.1:{srv.port}"
        kinds = ["fetch"] if a.only else ["raw", "push", "fetch"]
        rows = {k: [] for k in kinds}
        cpu = {k: [] for k in kinds}
        if a.only:
            assert _core.peer_push(ep, "bench", *key, seg) == "stored"
        for r in range(a.rounds):
            if not a.only:
                c0 = cpu_s()
                rows["raw"].append(raw_copy(nbytes))
                cpu["raw"].append(cpu_s() - c0)
                # A fresh replica each round: remove the held one so the push is not "already held".
                p = os.path.join(root, "peer", _core.peer_replica_name("bench", 1, 0))
                if os.path.exists(p):
                    os.unlink(p)
                t0, c0 = time.perf_counter(), cpu_s()
                out = _core.peer_push(ep, "bench", *key, seg)
                rows["push"].append(time.perf_counter() - t0)
                cpu["push"].append(cpu_s() - c0)
                assert out == "stored", out
            local = os.path.join(root, f"local-{r}")
            m0 = time.clock_gettime(time.CLOCK_MONOTONIC)
            t0, c0 = time.perf_counter(), cpu_s()
            _core.peer_fetch(ep, "bench", *key, 0, 1, local)
            rows["fetch"].append(time.perf_counter() - t0)
            if a.only:  # perf record -k CLOCK_MONOTONIC; perf report --time A,B
                print(f"fetch window (CLOCK_MONOTONIC): {m0:.6f},"
                      f"{time.clock_gettime(time.CLOCK_MONOTONIC):.6f}", flush=True)
            cpu["fetch"].append(cpu_s() - c0)
            shutil.rmtree(local)
        srv.close()
        ck.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)

    raw_gbps = nbytes / statistics.median(rows["raw"]) / 1e9 if "raw" in rows else float("nan")
    result = {"bytes": nbytes, "rounds": a.rounds, "dir": a.dir, "cpus": os.cpu_count(),
              "wire": WIRES.get(getattr(_core, "PEER_WIRE_VERSION", 2 if authed else 1)),
              "nonstop": os.path.dirname(nonstop.__file__), "load_avg": os.getloadavg(),
              "seconds": rows, "cpu_seconds": cpu, "median_GBps": {}, "vs_raw": {},
              "median_cpu_s_per_GB": {}, "only": a.only, "command": "python " + " ".join(sys.argv)}
    print(f"{'what':<8}{'median s':>10}{'GB/s':>8}{'x raw':>8}{'CPU s/GB':>10}")
    for k, v in rows.items():
        gbps = nbytes / statistics.median(v) / 1e9
        result["median_GBps"][k] = round(gbps, 3)
        result["vs_raw"][k] = round(gbps / raw_gbps, 3)
        cpg = statistics.median(cpu[k]) / (nbytes / 1e9)
        result["median_cpu_s_per_GB"][k] = round(cpg, 3)
        print(f"{k:<8}{statistics.median(v):>10.3f}{gbps:>8.2f}{gbps / raw_gbps:>8.2f}{cpg:>10.2f}")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
