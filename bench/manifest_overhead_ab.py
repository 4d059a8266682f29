"""The commit path before and after the job manifest (docs/FORMAT.md "The job
manifest"): `nonstop bench overhead` of two builds, interleaved A, B, B, A, ...
on the same machine, compared as ratios per round (the machine is shared and
noisy).

    python bench/manifest_overhead_ab.py --before /work/main/.venv/bin/nonstop \
        --after .venv/bin/nonstop [--rounds 4] [--out bench/manifest_overhead_ab.json]

The manifest is written by the remote uploader's and the peer replicator's
threads, never by the engine's commit path, so the two builds run the same
commit code: this checks that nothing on that path changed. Prints a table
and writes JSON.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cli, d, a):
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    out = subprocess.run([cli, "bench", "overhead", "--dir", d, "--state", a.state,
                          "--interval", "1", "--schemes", "concurrent", "--max-in-flight", "2",
                          "--steps", str(a.steps), "--repeat", "1", "--json"],
                         capture_output=True, text=True, timeout=600, check=True)
    shutil.rmtree(d, ignore_errors=True)
    return json.loads(out.stdout)


def rows_of(j):
    """"scheme k=.. N=.. metric" -> value, from the bench's JSON rows: the
    visible stall per step (ms) and the throughput relative to no
    checkpointing in the same run."""
    out = {}
    for r in j["rows"]:
        if r["scheme"] == "none":
            continue
        key = f"{r['scheme']} k={r['interval']} N={r['max_in_flight']}"
        out[key + " stall ms"] = float(r["stall_ms_mean"])
        out[key + " relative"] = float(r["relative"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--state", default="64M")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(HERE, "manifest_overhead_ab.json"))
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="nonstop-manifest-ab-")
    res = {"args": vars(a), "machine": {"cpus": os.cpu_count(),
                                        "python": platform.python_version(),
                                        "load_start": os.getloadavg()}, "rounds": []}
    try:
        for i in range(a.rounds):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            got = {}
            for arm in order:
                got[arm] = run(getattr(a, arm), os.path.join(root, arm), a)
            res["rounds"].append({"order": order, **got})
            print(f"round {i}: {order}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["machine"]["load_end"] = os.getloadavg()
    keys = sorted(set(rows_of(res["rounds"][0]["before"])) & set(rows_of(res["rounds"][0]["after"])))
    summary = {}
    print(f"{'row':<32}{'before':>12}{'after':>12}{'after/before':>14}  [min, max] of rounds")
    for k in keys:
        b = [rows_of(r["before"])[k] for r in res["rounds"]]
        f = [rows_of(r["after"])[k] for r in res["rounds"]]
        ratios = [y / x for x, y in zip(b, f) if x > 0]
        summary[k] = {"before": statistics.median(b), "after": statistics.median(f),
                      "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                      "ratio_max": max(ratios)}
        s = summary[k]
        print(f"{k:<32}{s['before']:>12.3f}{s['after']:>12.3f}{s['ratio_median']:>14.3f}"
              f"  [{s['ratio_min']:.3f}, {s['ratio_max']:.3f}]")
    res["summary"] = summary
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
