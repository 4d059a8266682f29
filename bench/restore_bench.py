"""Restore bandwidth: nonstop's restore() against fio, torch.load and DCP load.

For each state size (default 1 GB and 4 GB) one state is saved by nonstop,
by torch.save and by torch.distributed.checkpoint (DCP) into one directory,
and fio lays out a file of the same size beside them. Then, in one
interleaved run, each method restores into an existing model (what a job
does after a restart), with a COLD page cache (fsync, then
posix_fadvise(DONTNEED) on every file first) and with a WARM one (every
file read once through the page cache first):

  nonstop     Checkpointer(dir, {"model": model}).restore(), open included
              (close() is timed apart: close_s in the JSON), with the O_DIRECT
              queue of reads (the default; NONSTOP_RESTORE_DIRECT=1)
  nonstop-buffered  the same with buffered reads only (NONSTOP_RESTORE_DIRECT=0)
  nonstop-qd1 the same with one O_DIRECT read in flight per reader thread
              (NONSTOP_RESTORE_QUEUE=4: the path before the io_uring queue)
  fio         fio --rw=read --direct=1 --ioengine=libaio --iodepth=16 --bs=4M
              (the file system's O_DIRECT sequential read; no page cache)
  torch.load  torch.load(f, mmap=False, weights_only=True) + load_state_dict
  dcp         torch.distributed.checkpoint.load(model.state_dict(), ...)

plus the restore of 10,000 small tensors. Prints a table and writes JSON
(bench/restore_bench_results.json by default).

    python bench/restore_bench.py                      # 1 GB and 4 GB
    python bench/restore_bench.py --sizes-gb 0.1,0.4   # a quick run
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import nonstop  # noqa: E402

warnings.filterwarnings("ignore")
GB = 1e9
TENSOR_ELEMS = 2048 * 4096  # 32 MiB float32 tensors make up the state


class Model(torch.nn.Module):
    """`nbytes` of float32 parameters: big matrices plus 64 LayerNorm-sized ones."""

    def __init__(self, nbytes: int):
        super().__init__()
        n = max(1, int(nbytes // (TENSOR_ELEMS * 4)))
        self.big = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(2048, 4096))
                                          for _ in range(n))
        self.small = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(1024))
                                            for _ in range(64))


class Small(torch.nn.Module):
    def __init__(self, count: int, elems: int):
        super().__init__()
        self.p = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(elems))
                                        for _ in range(count))


def state_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def files_under(path: str) -> list:
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _, names in os.walk(path):
        out += [os.path.join(root, n) for n in names]
    return out


def drop_cache(paths: list) -> None:
    """fsync, then posix_fadvise(DONTNEED), on every file under `paths`."""
    for p in paths:
        for f in files_under(p):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm_files(path: str) -> None:
    """Reads every file under `path` once through the page cache (the warm
    rows; nonstop's own cold reads use O_DIRECT and leave no copy there)."""
    for f in files_under(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(8 << 20):
                pass


def fresh_model(cls, *args):
    torch.manual_seed(123)
    m = cls(*args)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()  # faulted in: the restore measures the read, not page faults
    return m


def run_nonstop(d, model, direct=True, queue=None):
    """Checkpointer() + restore(): until the state is restored and training
    can go on. close() (which waits for the background staging allocation
    the restore started, then frees it) is timed apart, as close_s."""
    old = os.environ.get("NONSTOP_RESTORE_DIRECT")
    old_q = os.environ.pop("NONSTOP_RESTORE_QUEUE", None)
    os.environ["NONSTOP_RESTORE_DIRECT"] = "1" if direct else "0"
    if queue is not None:
        os.environ["NONSTOP_RESTORE_QUEUE"] = str(queue)
    try:
        t0 = time.perf_counter()
        ck = nonstop.Checkpointer(d, {"model": model}, rng=False)
        try:
            t1 = time.perf_counter()
            step = ck.restore()
            t2 = time.perf_counter()
            st = ck.stats()
        finally:
            ck.close()
        t3 = time.perf_counter()
    finally:
        if old is None:
            os.environ.pop("NONSTOP_RESTORE_DIRECT", None)
        else:
            os.environ["NONSTOP_RESTORE_DIRECT"] = old
        os.environ.pop("NONSTOP_RESTORE_QUEUE", None)
        if old_q is not None:
            os.environ["NONSTOP_RESTORE_QUEUE"] = old_q
    assert step == 0, step
    return {"s": t2 - t0, "restore_s": t2 - t1, "open_s": t1 - t0, "close_s": t3 - t2,
            "restore_GBps_stats": st.get("restore_GBps"), "read_s": st.get("restore_read_s"),
            "odirect_bytes": st.get("restore_odirect_bytes")}


def run_nonstop_buffered(d, model):
    return run_nonstop(d, model, direct=False)


def run_nonstop_qd1(d, model):
    return run_nonstop(d, model, queue=4)  # 4 reader threads, one read each


def run_torch(f, model):
    t0 = time.perf_counter()
    sd = torch.load(f, mmap=False, weights_only=True)
    model.load_state_dict(sd)
    del sd
    return {"s": time.perf_counter() - t0}


def run_dcp(d, model):
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=d)
    model.load_state_dict(sd)
    return {"s": time.perf_counter() - t0}


def run_fio(f, nbytes):
    out = subprocess.run(
        ["fio", "--name=restore_ref", f"--filename={f}", "--rw=read", "--bs=4M", "--direct=1",
         "--ioengine=libaio", "--iodepth=16", f"--size={nbytes}", "--output-format=json"],
        check=True, capture_output=True, text=True, timeout=600).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return {"s": job["io_bytes"] / job["bw_bytes"] if job["bw_bytes"] else float("nan"),
            "fio_GBps": job["bw_bytes"] / GB}


METHODS = ("nonstop", "fio", "torch.load", "dcp", "nonstop-buffered", "nonstop-qd1")
RUN = {"nonstop": run_nonstop, "torch.load": run_torch, "dcp": run_dcp,
       "nonstop-buffered": run_nonstop_buffered, "nonstop-qd1": run_nonstop_qd1}


def fingerprint(model) -> list:
    """Per tensor: float64 sum and the first and last elements (the reference
    model is dropped so that a 4 GB run needs one model in memory, not two)."""
    return [(float(t.sum(dtype=torch.float64)), float(t.flatten()[0]), float(t.flatten()[-1]))
            for t in model.state_dict().values()]


def same(model, ref) -> bool:
    return fingerprint(model) == ref


def bench_size(root: str, gb: float, rounds: int) -> dict:
    nbytes = int(gb * GB)
    d = os.path.join(root, f"s{gb:g}")
    os.makedirs(d)
    paths = {"nonstop": os.path.join(d, "nonstop"), "torch.load": os.path.join(d, "state.pt"),
             "dcp": os.path.join(d, "dcp"), "fio": os.path.join(d, "fio.dat")}
    paths["nonstop-buffered"] = paths["nonstop"]  # the same files, buffered reads only
    paths["nonstop-qd1"] = paths["nonstop"]
    torch.manual_seed(0)
    ref = Model(nbytes)
    size = state_bytes(ref)
    with nonstop.Checkpointer(paths["nonstop"], {"model": ref}, every=1, rng=False) as ck:
        ck.step(0)
        ck.wait()
    torch.save(ref.state_dict(), paths["torch.load"])
    import torch.distributed.checkpoint as dcp
    dcp.save(ref.state_dict(), checkpoint_id=paths["dcp"])
    subprocess.run(["fio", "--name=layout", f"--filename={paths['fio']}", "--rw=write",
                    "--bs=4M", "--direct=1", f"--size={size}", "--output-format=json"],
                   check=True, capture_output=True, timeout=600)
    all_paths = sorted(set(paths.values()))
    n_tensors = len(ref.state_dict())
    ref = fingerprint(ref)
    gc.collect()
    model = fresh_model(Model, nbytes)
    runs = {m: {"cold": [], "warm": []} for m in paths}
    for _ in range(rounds):
        for cache in ("cold", "warm"):
            for method in METHODS:
                if cache == "cold":
                    drop_cache(all_paths)
                elif method == "fio":
                    run_fio(paths["fio"], size)
                else:  # every file read once, buffered: in the page cache
                    warm_files(paths[method])
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
                gc.collect()
                if method == "fio":
                    r = run_fio(paths["fio"], size)
                else:
                    r = RUN[method](paths[method], model)
                    assert same(model, ref), f"{method} restored other values"
                r["GBps"] = size / r["s"] / GB
                runs[method][cache].append(r)
                print(f"  {gb:g} GB {cache:4s} {method:10s} {r['s']:7.3f} s {r['GBps']:6.2f} GB/s",
                      flush=True)
    shutil.rmtree(d)
    out = {"size_bytes": size, "tensors": n_tensors, "runs": runs}
    for cache in ("cold", "warm"):
        best = {m: max(r["GBps"] for r in runs[m][cache]) for m in runs}
        out[cache] = {
            "GBps": best,
            "nonstop_restore_only_GBps": max(size / r["restore_s"] / GB
                                             for r in runs["nonstop"][cache]),
            "nonstop_over_fio": best["nonstop"] / best["fio"],
            "nonstop_over_torch_load": best["nonstop"] / best["torch.load"],
            "nonstop_over_dcp": best["nonstop"] / best["dcp"],
            "odirect_over_buffered": best["nonstop"] / best["nonstop-buffered"],
            "nonstop_over_qd1": best["nonstop"] / best["nonstop-qd1"],
            # restore() alone (the Checkpointer's open apart) over fio
            "nonstop_restore_only_over_fio": max(size / r["restore_s"] / GB
                                                 for r in runs["nonstop"][cache]) / best["fio"],
            # The same ratios round by round (each round runs every method
            # back to back), median over the rounds: less exposed to drift.
            "per_round_median": {
                f"nonstop_over_{m}": statistics.median(
                    a["GBps"] / b["GBps"] for a, b in zip(runs["nonstop"][cache], runs[m][cache]))
                for m in METHODS if m != "nonstop"},
        }
    return out


def bench_small(root: str, count: int, rounds: int) -> dict:
    d = os.path.join(root, "small")
    torch.manual_seed(0)
    ref = Small(count, 64)
    t0 = time.perf_counter()
    with nonstop.Checkpointer(d, {"model": ref}, every=1, rng=False) as ck:
        ck.step(0)
        ck.wait()
    save_s = time.perf_counter() - t0
    ref = fingerprint(ref)
    model = fresh_model(Small, count, 64)
    res = {"cold": [], "warm": []}
    for _ in range(rounds):
        for cache in ("cold", "warm"):
            if cache == "cold":
                drop_cache([d])
            else:
                warm_files(d)
            r = run_nonstop(d, model)
            assert same(model, ref)
            res[cache].append(r)
            print(f"  {count} small tensors {cache:4s} restore() {r['restore_s']:.3f} s "
                  f"(open+restore {r['s']:.3f} s, close {r['close_s']:.3f} s)", flush=True)
    shutil.rmtree(d)
    return {"tensors": count, "elems": 64, "save_s": save_s, "runs": res,
            "cold_restore_s": min(r["restore_s"] for r in res["cold"]),
            "warm_restore_s": min(r["restore_s"] for r in res["warm"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gb", default="1,4", help="state sizes in GB (default 1,4)")
    ap.add_argument("--small", type=int, default=10000, help="small tensors (default 10000)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per row (best is reported)")
    ap.add_argument("--dir", default=None,
                    help="where the files go (default: a new directory under bench/)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "restore_bench_results.json"))
    args = ap.parse_args()
    if shutil.which("fio") is None:
        sys.exit("restore_bench: fio is not installed")
    base = args.dir or os.path.dirname(os.path.abspath(__file__))
    root = tempfile.mkdtemp(prefix=".restore_bench-", dir=base)
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "loadavg_start": os.getloadavg(),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "torch": torch.__version__,
                           "filesystem_dir": os.path.abspath(base)},
               "started_unix": time.time(), "sizes": {}}
    try:
        for gb in [float(x) for x in args.sizes_gb.split(",") if x]:
            print(f"state of {gb:g} GB:", flush=True)
            results["sizes"][f"{gb:g}GB"] = bench_size(root, gb, args.rounds)
        print(f"{args.small} small tensors:", flush=True)
        results["small"] = bench_small(root, args.small, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print()
    print(f"{'state':>7} {'cache':5} {'nonstop':>9} {'buffered':>9} {'qd1':>6} {'fio':>9} {'torch.load':>10} "
          f"{'dcp':>9} {'/fio':>6} {'/torch':>7} {'/dcp':>6}   (best GB/s; ratios: nonstop over "
          f"each)")
    for name, r in results["sizes"].items():
        for cache in ("cold", "warm"):
            c = r[cache]
            g = c["GBps"]
            print(f"{name:>7} {cache:5} {g['nonstop']:9.2f} {g['nonstop-buffered']:9.2f} {g['nonstop-qd1']:6.2f} "
                  f"{g['fio']:9.2f} {g['torch.load']:10.2f} {g['dcp']:9.2f} "
                  f"{c['nonstop_over_fio']:6.2f} {c['nonstop_over_torch_load']:7.2f} "
                  f"{c['nonstop_over_dcp']:6.2f}")
        print(f"{'':>7} cold per-round medians: "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["cold"]["per_round_median"].items())
              + f"; restore() alone / fio {r['cold']['nonstop_restore_only_over_fio']:.2f}")
    s = results["small"]
    print(f"{s['tensors']} small tensors: restore() {s['cold_restore_s']:.3f} s cold, "
          f"{s['warm_restore_s']:.3f} s warm (target <= 0.5 s)")
    print(f"targets: nonstop >= 0.9x fio, >= 5x torch.load, >= 2x dcp; JSON: {args.out}")


if __name__ == "__main__":
    main()
