"""What writing a fresh tmpfs file costs per GB: pwrite from a cached buffer
against stores into a shared mapping of the file (what receiving a peer
DATA frame "in place" does), in CPU seconds of this process.

For each of --rounds rounds, in turn (interleaved), a new --gb GB file in
--dir (default /dev/shm), fallocated first (as the slot file's Resize
does), is filled from one 256 KiB buffer (the peer wire's frame size):
  pwrite     os.pwrite of the buffer at each offset
  mmap       a MAP_SHARED mapping of the file, the buffer copied into it
             (each 4 KiB page first touched takes a page fault)
  populate   the same mapping with MAP_POPULATE (the pages mapped ahead)
  popwrite   the same mapping pre-faulted for writing with
             madvise(MADV_POPULATE_WRITE) (Linux 5.14; session 16), timed
  pwritev    os.pwritev of four 256 KiB buffers per call (1 MiB: several
             frames per write; session 16)
Prints a table of the median CPU seconds per GB and writes JSON.

Usage: python bench/tmpfs_map_bench.py [--gb 1] [--rounds 5] [--ways pwrite,mmap,...]
                                      [--out bench/tmpfs_map_bench.json]
"""
import argparse
import json
import mmap
import os
import resource
import statistics
import sys
import tempfile
import time


MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python 3.11's mmap has no name for it


def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fill(path, nbytes, how, piece):
    buf = os.urandom(piece)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        c0, t0 = cpu_s(), time.perf_counter()
        if how == "pwrite":
            for off in range(0, nbytes, piece):
                os.pwrite(fd, buf, off)
        elif how == "pwritev":
            bufs = [buf] * 4
            for off in range(0, nbytes, 4 * piece):
                os.pwritev(fd, bufs if nbytes - off >= 4 * piece else bufs[:(nbytes - off) // piece], off)
        else:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if how == "populate" else 0)
            m = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if how == "popwrite":
                m.madvise(MADV_POPULATE_WRITE)
            for off in range(0, nbytes, piece):
                m[off:off + piece] = buf
            m.close()
        return cpu_s() - c0, time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--ways", default="pwrite,mmap,populate,popwrite,pwritev")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "tmpfs_map_bench.json"))
    a = ap.parse_args()
    piece = 256 << 10
    nbytes = int(a.gb * 1e9) // piece * piece
    ways = a.ways.split(",")
    rows = {k: [] for k in ways}
    d = tempfile.mkdtemp(prefix="tmpfs-map-", dir=a.dir)
    try:
        for r in range(a.rounds):
            for k in ways[r % len(ways):] + ways[:r % len(ways)]:
                rows[k].append(fill(os.path.join(d, "f"), nbytes, k, piece))
    finally:
        os.rmdir(d)
    res = {"command": "python " + " ".join(sys.argv), "bytes": nbytes, "piece": piece,
           "dir": a.dir, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
           "kernel": os.uname().release, "rounds": rows, "median_cpu_s_per_GB": {},
           "median_wall_s_per_GB": {}}
    print(f"{'way':<10}{'CPU s/GB':>10}{'wall s/GB':>11}")
    for k in ways:
        c = statistics.median(x[0] for x in rows[k]) / (nbytes / 1e9)
        w = statistics.median(x[1] for x in rows[k]) / (nbytes / 1e9)
        res["median_cpu_s_per_GB"][k] = round(c, 3)
        res["median_wall_s_per_GB"][k] = round(w, 3)
        print(f"{k:<10}{c:>10.3f}{w:>11.3f}")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
