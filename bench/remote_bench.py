"""The remote tier on a ~1 GB state against a local SeaweedFS (docs/TIERS.md).

    python bench/remote_bench.py [--gb 1.0] [--rounds 2] [--out bench/remote_bench_results.json]

Three measurements, each interleaved (A, B, A, B, ...) because the machine
is shared and noisy; compare the ratios:

1. upload throughput: nonstop's remote tier (staging copy excluded: the
   upload of the staged part, its crcs and manifest) against obstore alone
   putting the same file with the same part size and concurrency; also
   boto3 and s3fs alone when installed (how the client was chosen);
2. training stall: the visible stall per checkpoint and the step time with
   the remote tier off, on, and on as it was in session 3 ("on_legacy":
   the upload thread at normal CPU and I/O priority, `remote_options`
   nice=0, and obstore reading the part through a Python file object, which
   takes the GIL for every read: what a `bandwidth_bps` far above the link
   still does);
3. restore: from the remote (empty local directory) against from the local
   directory.

Prints a table and writes JSON.

    python bench/remote_bench.py --mode stall [--gb 0.25] [--pairs 4] \
        [--out bench/remote_stall_ab.json]

The clean stall measurement alone: pairs of runs, remote off and on, in
ABBA order (off-on, on-off, ...) against the same local SeaweedFS and the
same state, so drift in the machine's load falls on both arms alike. Each
pair gives a ratio (on / off) of the visible stall per checkpoint and of the
step time; the summary is the median ratio with the range over pairs. An
"on" run counts only if uploads ran while it trained (at least one upload
finished before close()): otherwise it did not measure what it claims and
the run is reported invalid.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
import nonstop  # noqa: E402
from nonstop import _remote  # noqa: E402
from s3_server import ACCESS_KEY, SECRET_KEY, SeaweedS3  # noqa: E402


def make_state(gb: float):
    n = int(gb * (1 << 30) / 4 / 4)
    params = [torch.nn.Parameter(torch.randn(n)) for _ in range(4)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.SGD(params, lr=0.1)
    model = torch.nn.ParameterList(params)
    return {"model": model, "optim": opt}


_PROBE = r"""
import sys, threading, time, json
lat = []
stop = threading.Event()
def run():
    while not stop.is_set():
        t = time.perf_counter(); time.sleep(0.002); lat.append(time.perf_counter() - t - 0.002)
th = threading.Thread(target=run); th.start()
sys.stdin.readline(); stop.set(); th.join()
print(json.dumps(lat))
"""


class Probes:
    """Wake-up latency of a thread that sleeps 2 ms at a time: one thread in
    this process (it needs the GIL to wake, so it waits for whatever thread
    holds it, and for a core) and one in a separate process (no shared GIL:
    it waits for a core only). The difference is the GIL's share."""

    def __init__(self):
        import subprocess
        import threading
        self.lat, self.stop = [], threading.Event()
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self):
        while not self.stop.is_set():
            t = time.perf_counter()
            time.sleep(0.002)
            self.lat.append(time.perf_counter() - t - 0.002)

    def finish(self) -> dict:
        self.stop.set()
        self.th.join()
        out, _ = self.proc.communicate("\n", timeout=60)
        other = json.loads(out)

        def summ(v):
            v = sorted(v) or [0.0]
            return {"n": len(v), "mean_ms": 1e3 * statistics.mean(v),
                    "p99_ms": 1e3 * v[int(0.99 * (len(v) - 1))]}
        return {"in_process": summ(self.lat), "other_process": summ(other)}


def train(dir, state, steps, every, step_s, remote=None, options=None, probe=False):
    ckpt = nonstop.Checkpointer(dir, state, every=every, remote=remote, remote_options=options)
    ckpt.restore()                      # as every job starts (nothing to restore here)
    probes = Probes() if probe else None
    times, saves_s, opt_s = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        time.sleep(step_s)              # the forward/backward of a real job
        t1 = time.perf_counter()
        state["optim"].step()           # touches the whole state (waits for the copy)
        t2 = time.perf_counter()
        ckpt.step(step)
        t3 = time.perf_counter()
        times.append(t3 - t0)
        opt_s.append(t2 - t1)
        saves_s.append(t3 - t2)
    st = ckpt.stats()
    probed = probes.finish() if probes else None
    ckpt.wait()
    t0 = time.perf_counter()
    ckpt.close()
    close_s = time.perf_counter() - t0
    return {"step_s_mean": statistics.mean(times[every:] or times),
            "stall_per_ckpt_s": st["visible_stall_s"] / max(1, st["saves"]),
            # the stall split: waiting in the optimizer's pre-hook for the copy
            # out of the live tensors, and inside save()/step()
            "hook_stall_per_ckpt_s": st["hook_stall_s"] / max(1, st["saves"]),
            "save_stall_per_ckpt_s": (st["visible_stall_s"] - st["hook_stall_s"])
            / max(1, st["saves"]),
            # the optimizer step itself without its wait (CPU work of the step)
            "opt_compute_s_mean": statistics.mean(opt_s[every:] or opt_s)
            - st["hook_stall_s"] / max(1, len(opt_s)),
            "saves": st["saves"], "close_s": close_s, "probe": probed,
            "remote": {k: v for k, v in (st.get("remote") or {}).items()
                       if k in ("uploads", "bytes", "upload_s", "last_GBps", "retries",
                                "uploading_step", "stage_s", "crc_s", "put_s")}}


def client_put(kind, srv, path, key, part, conc):
    if kind == "obstore":
        import obstore
        import obstore.store
        st = obstore.store.S3Store(srv.bucket, endpoint=srv.endpoint, access_key_id=ACCESS_KEY,
                                   secret_access_key=SECRET_KEY, region="us-east-1",
                                   client_options={"allow_http": True})
        with open(path, "rb") as f:
            obstore.put(st, key, f, chunk_size=part, max_concurrency=conc)
    elif kind == "boto3":
        import boto3
        from boto3.s3.transfer import TransferConfig
        c = boto3.client("s3", endpoint_url=srv.endpoint, aws_access_key_id=ACCESS_KEY,
                         aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
        c.upload_file(path, srv.bucket, key, Config=TransferConfig(
            multipart_chunksize=part, max_concurrency=conc))
    elif kind == "s3fs":
        import s3fs
        fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=srv.endpoint)
        fs.put_file(path, f"{srv.bucket}/{key}", chunksize=part)


def available(kind):
    try:
        __import__(kind)
        return True
    except ImportError:
        return False


def stall_ab(a):
    """--mode stall: ABBA pairs of remote off/on, ratios per pair."""
    root = a.root or tempfile.mkdtemp(prefix="nonstop-remote-stall-")
    srv = SeaweedS3(os.path.join(root, "seaweedfs"))
    srv.start()
    opts = dict(srv.options)
    res = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_start": os.getloadavg()},
           "args": vars(a), "runs": [], "pairs": []}
    arms_all = a.arms.split(",")
    try:
        state = make_state(a.gb)
        train(os.path.join(root, "warm"), state, a.every, a.every, 0.0)  # warm caches
        for p in range(a.pairs):
            # ABBA for two arms; with more, the order rotates each pair
            arms = (arms_all if p % 2 == 0 else arms_all[::-1]) if len(arms_all) == 2 else \
                arms_all[p % len(arms_all):] + arms_all[:p % len(arms_all)]
            got = {}
            for arm in arms:
                d = os.path.join(root, f"p{p}-{arm}")
                if arm == "off":
                    url, o = None, None
                elif arm == "path":  # the tier to a local folder: no HTTP, no server
                    url, o = os.path.join(root, f"shared-p{p}"), {}
                elif arm == "nomanifest":  # "on" without the job manifest's notes
                    url, o = srv.url(f"p{p}-nm"), dict(opts, note_manifest=False)
                else:
                    url, o = srv.url(f"p{p}"), dict(opts)
                if a.switch_interval:
                    sys.setswitchinterval(a.switch_interval)
                g = train(d, state, a.steps, a.every, a.step_s, url, o, probe=a.probe)
                sys.setswitchinterval(0.005)
                g.update(pair=p, arm=arm, load=os.getloadavg()[0])
                if arm != "off":  # the uploader worked while the job trained
                    g["valid"] = (g["remote"].get("uploads", 0) >= 1
                                  or g["remote"].get("uploading_step") is not None)
                res["runs"].append(g)
                got[arm] = g
                shutil.rmtree(d, ignore_errors=True)
                if arm == "path":
                    shutil.rmtree(url, ignore_errors=True)
                pr = g["probe"] or {}
                print(f"pair {p} {arm}: step {g['step_s_mean']:.3f} s, stall/ckpt "
                      f"{g['stall_per_ckpt_s']:.3f} s (hook {g['hook_stall_per_ckpt_s']:.3f}, "
                      f"save {g['save_stall_per_ckpt_s']:.3f}), opt {g['opt_compute_s_mean']:.3f}"
                      f" s, uploads {g['remote'].get('uploads', 0)}"
                      + (f", wake in/out {pr['in_process']['mean_ms']:.2f}/"
                         f"{pr['other_process']['mean_ms']:.2f} ms" if pr else ""), flush=True)
            pair = {"pair": p, "order": list(arms),
                    "valid": all(got[x]["valid"] for x in arms if x != "off")}
            for x in arms:
                if x == "off":
                    continue
                pair[f"stall_{x}_vs_off"] = got[x]["stall_per_ckpt_s"] / max(
                    got["off"]["stall_per_ckpt_s"], 1e-9)
                pair[f"step_{x}_vs_off"] = got[x]["step_s_mean"] / got["off"]["step_s_mean"]
            res["pairs"].append(pair)
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)
    valid = [x for x in res["pairs"] if x["valid"]]
    res["machine"]["load_end"] = os.getloadavg()

    def rng(key):
        v = [x[key] for x in valid]
        return ({"median": statistics.median(v), "min": min(v), "max": max(v)} if v
                else {"median": float("nan"), "min": float("nan"), "max": float("nan")})

    def med(arm, key):
        return statistics.median([r[key] for r in res["runs"] if r["arm"] == arm])
    keys = ("step_s_mean", "stall_per_ckpt_s", "hook_stall_per_ckpt_s", "save_stall_per_ckpt_s",
            "opt_compute_s_mean")
    sm = res["summary"] = {"valid_pairs": len(valid), "pairs": a.pairs,
                           "median": {arm: {k: med(arm, k) for k in keys} for arm in arms_all}}
    for x in arms_all:
        if x != "off":
            sm[f"stall_{x}_vs_off"] = rng(f"stall_{x}_vs_off")
            sm[f"step_{x}_vs_off"] = rng(f"step_{x}_vs_off")
    if a.probe:
        sm["wake_ms_mean"] = {arm: {w: statistics.median(
            [r["probe"][w]["mean_ms"] for r in res["runs"] if r["arm"] == arm])
            for w in ("in_process", "other_process")} for arm in arms_all}
    print()
    print(f"{a.gb} GB state, {a.pairs} pairs ({sm['valid_pairs']} valid), every {a.every} "
          f"steps of {a.step_s} s, arms {arms_all}")
    print(f"{'median':<26}" + "".join(f"{arm:>10}" for arm in arms_all))
    for k in keys:
        print(f"{k:<26}" + "".join(f"{sm['median'][arm][k]:>10.3f}" for arm in arms_all))
    if a.probe:
        for w in ("in_process", "other_process"):
            print(f"{'wake ' + w + ' (ms)':<26}" + "".join(
                f"{sm['wake_ms_mean'][arm][w]:>10.2f}" for arm in arms_all))
    for x in arms_all:
        if x != "off":
            for k in (f"step_{x}_vs_off", f"stall_{x}_vs_off"):
                r = sm[k]
                print(f"{k:<26}{r['median']:>10.3f} [{r['min']:.3f}, {r['max']:.3f}]")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", a.out)
    return 0 if valid else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("all", "stall"), default="all")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.5)
    ap.add_argument("--root", default=None)
    ap.add_argument("--arms", default="off,on",
                    help="stall mode: off, on (S3 to the local SeaweedFS), path (a local folder "
                         "as the remote: no HTTP, no server process), nomanifest (on, without "
                         "the uploader's job manifest notes)")
    ap.add_argument("--probe", action="store_true",
                    help="stall mode: measure wake-up latency in and out of the process (GIL)")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="stall mode: sys.setswitchinterval during the runs (default 5 ms)")
    ap.add_argument("--out", default=os.path.join(HERE, "remote_bench_results.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.mode == "stall":
        if a.out == os.path.join(HERE, "remote_bench_results.json"):
            a.out = os.path.join(HERE, "remote_stall_ab.json")
        sys.exit(stall_ab(a))
    root = a.root or tempfile.mkdtemp(prefix="nonstop-remote-bench-")
    srv = SeaweedS3(os.path.join(root, "seaweedfs"))
    srv.start()
    opts = dict(srv.options)
    res = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load": os.getloadavg()},
           "args": vars(a), "upload": [], "clients": [], "stall": [], "restore": []}
    try:
        state = make_state(a.gb)
        # one checkpoint to get a staged part of the real size
        d0 = os.path.join(root, "seed")
        train(d0, state, a.every, a.every, 0.0, srv.url("seed"), opts)
        staged_dir = os.path.join(d0, "remote")
        staged = os.path.join(staged_dir, os.listdir(staged_dir)[0], "rank-00000.nsck")
        size = os.path.getsize(staged)
        store = _remote.open_store(srv.url("seed"), opts)
        part, conc = store.part_bytes, store.concurrency
        clients = ["obstore"] + [k for k in ("boto3", "s3fs") if available(k)]
        for r in range(a.rounds):
            # 1. nonstop's upload path (part + crcs + manifest) vs the clients alone
            t0 = time.perf_counter()
            sd = nonstop._core.Directory(os.path.dirname(staged))
            with sd.open(os.path.basename(staged)) as f:  # as the uploader reads it
                while True:
                    buf = f.read(part)
                    if not buf:
                        break
                    zlib.crc32(buf)
            store.put_file(f"bench/nonstop-{r}.nsck", sd, os.path.basename(staged))
            store.put_bytes(f"bench/nonstop-{r}.json", b"{}")
            dt = time.perf_counter() - t0
            res["upload"].append({"round": r, "who": "nonstop", "MBps": size / dt / 1e6})
            for kind in clients:
                t0 = time.perf_counter()
                client_put(kind, srv, staged, f"seed/bench/{kind}-{r}", part, conc)
                dt = time.perf_counter() - t0
                res["clients"].append({"round": r, "who": kind, "MBps": size / dt / 1e6})
            store.delete([k for k, _ in store.list("bench")])
            print(f"round {r}: upload", res["upload"][-1], res["clients"][-len(clients):],
                  flush=True)
            # 2. stall with the remote tier off, on, and on as in session 3
            # (the order rotates each round: none of them always runs first)
            arms = ["off", "on", "on_legacy"]
            arms = arms[r % 3:] + arms[:r % 3]
            for arm in arms:
                d = os.path.join(root, f"stall-{r}-{arm}")
                o = None if arm == "off" else dict(opts) if arm == "on" else dict(
                    opts, nice=0, bandwidth_bps=1e15)
                got = train(d, state, a.steps, a.every, a.step_s,
                            None if arm == "off" else srv.url(f"stall-{r}-{arm}"), o)
                got.update(round=r, remote=arm != "off", arm=arm)
                res["stall"].append(got)
                shutil.rmtree(d)
                print(f"round {r}: stall {arm}", got, flush=True)
            # 3. restore from local vs from the remote (empty local directory)
            for src in ("local", "remote"):
                d = d0 if src == "local" else os.path.join(root, f"empty-{r}")
                ck = nonstop.Checkpointer(d, state, every=a.every,
                                          remote=srv.url("seed") if src == "remote" else None,
                                          remote_options=opts if src == "remote" else None)
                t0 = time.perf_counter()
                step = ck.restore()
                dt = time.perf_counter() - t0
                ck.close()
                if src == "remote":
                    shutil.rmtree(d)
                res["restore"].append({"round": r, "from": src, "s": dt, "step": step,
                                       "GBps": size / dt / 1e9})
                print(f"round {r}: restore from {src}: {dt:.2f} s", flush=True)
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)

    def med(rows, key, **match):
        vals = [x[key] for x in rows if all(x.get(k) == v for k, v in match.items())]
        return statistics.median(vals) if vals else float("nan")

    summary = {
        "state_bytes": size,
        "upload_MBps": {"nonstop": med(res["upload"], "MBps"),
                        **{k: med(res["clients"], "MBps", who=k) for k in clients}},
        "stall_per_ckpt_s": {arm: med(res["stall"], "stall_per_ckpt_s", arm=arm)
                             for arm in ("off", "on", "on_legacy")},
        "step_s_mean": {arm: med(res["stall"], "step_s_mean", arm=arm)
                        for arm in ("off", "on", "on_legacy")},
        "restore_s": {"local": med(res["restore"], "s", **{"from": "local"}),
                      "remote": med(res["restore"], "s", **{"from": "remote"})},
    }
    summary["ratios"] = {
        "nonstop_vs_obstore_upload": summary["upload_MBps"]["nonstop"]
        / summary["upload_MBps"]["obstore"],
        "stall_on_vs_off": summary["stall_per_ckpt_s"]["on"] / summary["stall_per_ckpt_s"]["off"],
        "step_on_vs_off": summary["step_s_mean"]["on"] / summary["step_s_mean"]["off"],
        "stall_legacy_vs_off": summary["stall_per_ckpt_s"]["on_legacy"]
        / summary["stall_per_ckpt_s"]["off"],
        "step_legacy_vs_off": summary["step_s_mean"]["on_legacy"] / summary["step_s_mean"]["off"],
        "step_on_vs_legacy": summary["step_s_mean"]["on"] / summary["step_s_mean"]["on_legacy"],
        "restore_remote_vs_local": summary["restore_s"]["remote"] / summary["restore_s"]["local"],
    }
    res["summary"] = summary
    print()
    print(f"state {size / 1e9:.2f} GB, {a.rounds} interleaved rounds, medians")
    print(f"{'upload MB/s':<28}" + "  ".join(f"{k} {v:7.1f}"
                                             for k, v in summary["upload_MBps"].items()))
    for key, label in (("stall_per_ckpt_s", "stall per checkpoint (s)"),
                       ("step_s_mean", "step time (s)")):
        print(f"{label:<28}" + "  ".join(f"{arm} {v:.3f}" for arm, v in summary[key].items()))
    print(f"{'restore (s)':<28}local {summary['restore_s']['local']:.2f}  "
          f"remote {summary['restore_s']['remote']:.2f}")
    print("ratios:", {k: round(v, 3) for k, v in summary["ratios"].items()})
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
