#!/usr/bin/env python3
"""Before/after `nonstop bench overhead`, interleaved: runs the old and the
new `nonstop` binary in turns (old, new, old, new, ...), each with
--repeat 1, so both see the same machine load; prints a table of the mean
stall per checkpoint and steps/s relative to `none`, and new/old ratios, and
writes every raw JSON result to --out.

Usage:
  python3 bench/engine_env_ab.py --old OLD/nonstop --new build/tools/nonstop \
      --dir /tmp/ab --rounds 3 --out bench/engine_env_overhead.json
  # one binary, the memory tier off ("old") against on ("new"):
  python3 bench/engine_env_ab.py --old build/tools/nonstop --old-env NONSTOP_SHM_DIR=/proc/none \
      --new build/tools/nonstop --dir /tmp/ab --rounds 3 --out bench/memtier_ab.json
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys


def run(binary, args, d, env_items=()):
    shutil.rmtree(d, ignore_errors=True)
    cmd = [binary, "bench", "overhead", "--dir", d, "--repeat", "1", "--json"] + args
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in env_items)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600,
                         env=env).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--old-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of the old arm only (e.g. NONSTOP_SHM_DIR=/proc/none: "
                         "the same binary with the memory tier off)")
    ap.add_argument("--new-env", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("bench_args", nargs="*",
                    default=["--state", "134217728", "--interval", "1", "5", "--max-in-flight",
                             "2", "--schemes", "sync", "concurrent", "--steps", "30"])
    a = ap.parse_args()
    results = {"old": [], "new": []}
    for r in range(a.rounds):
        for which in ("old", "new"):
            res = run(getattr(a, which), a.bench_args, f"{a.dir}/{which}",
                      getattr(a, which + "_env"))
            results[which].append(res)
            print(f"round {r + 1} {which}: done", file=sys.stderr)

    def key(row):
        return (row["scheme"], row["interval"], row["max_in_flight"])

    table = {}
    for which in ("old", "new"):
        for res in results[which]:
            for row in res["rows"]:
                if row["scheme"] == "none":
                    continue
                t = table.setdefault(key(row), {"old": {"stall": [], "rel": []},
                                                "new": {"stall": [], "rel": []}})
                t[which]["stall"].append(row["stall_ms_mean"])
                t[which]["rel"].append(row["relative"])
    rows = []
    print("| scheme | interval | N | stall ms old | stall ms new | new/old stall "
          "| steps/s vs none old | new | new/old |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (scheme, interval, n), t in sorted(table.items()):
        so, sn = statistics.median(t["old"]["stall"]), statistics.median(t["new"]["stall"])
        ro, rn = statistics.median(t["old"]["rel"]), statistics.median(t["new"]["rel"])
        rows.append(dict(scheme=scheme, interval=interval, max_in_flight=n,
                         stall_ms_old=so, stall_ms_new=sn, relative_old=ro, relative_new=rn,
                         stall_ms_old_all=t["old"]["stall"], stall_ms_new_all=t["new"]["stall"],
                         relative_old_all=t["old"]["rel"], relative_new_all=t["new"]["rel"]))
        print(f"| {scheme} | {interval} | {n} | {so:.1f} | {sn:.1f} | {sn / so if so else 0:.2f} "
              f"| {ro:.3f} | {rn:.3f} | {rn / ro if ro else 0:.3f} |")
    with open(a.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "rounds": a.rounds, "bench_args": a.bench_args,
                   "medians": rows, "raw": results}, f, indent=1)


if __name__ == "__main__":
    main()
