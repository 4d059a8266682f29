"""Two builds of bench/multistep_bench.cc, interleaved (A B B A ...), on the
same arguments: stall, steps/s and host memory of each scheme, and the
ratios B/A per pair. For before/after comparisons of one change on a noisy
machine (the pairs run back to back; the medians of the per-pair ratios are
reported).

    python bench/multistep_ab.py --a OLD_BINARY --b NEW_BINARY --pairs 3 \
        --json bench/multistep_staged_ab.json -- --intervals 50 --checkpoints 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

FIELDS = ("stall_ms_mean", "steps_per_s", "rss_mib", "staging_mib", "ms_host_mib")


def run(binary: str, args: list, tag: str, workdir: str) -> dict:
    out = os.path.join(workdir, f"{tag}.json")
    t0 = time.time()
    proc = subprocess.run([binary, "--json", out, *args], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{tag}: {binary} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    with open(out) as f:
        res = json.load(f)
    res["wall_s"] = time.time() - t0
    res["stdout"] = proc.stdout
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--a", required=True, help="the 'before' binary")
    p.add_argument("--b", required=True, help="the 'after' binary")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--json", required=True)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then multistep_bench arguments")
    a = p.parse_args()
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for i in range(a.pairs):
            order = ("a", "b") if i % 2 == 0 else ("b", "a")
            pair = {}
            for which in order:
                binary = a.a if which == "a" else a.b
                pair[which] = run(binary, rest, f"{i}{which}", work)
                print(f"pair {i + 1} {which}: {pair[which]['wall_s']:.0f} s", file=sys.stderr,
                      flush=True)
            runs.append(pair)
    # Per scheme and interval: each field's value in A and B, and B/A per pair.
    keys = [(r["scheme"], r["interval"]) for r in runs[0]["a"]["rows"]]
    rows = []
    for scheme, interval in keys:
        row = {"scheme": scheme, "interval": interval}
        for f in FIELDS:
            va, vb, ratio = [], [], []
            for pair in runs:
                ra = next(r for r in pair["a"]["rows"] if (r["scheme"], r["interval"]) == (scheme, interval))
                rb = next(r for r in pair["b"]["rows"] if (r["scheme"], r["interval"]) == (scheme, interval))
                va.append(ra[f])
                vb.append(rb[f])
                if ra[f]:
                    ratio.append(rb[f] / ra[f])
            row[f] = {"a": va, "b": vb, "ratio_b_over_a": ratio,
                      "median_ratio": statistics.median(ratio) if ratio else None}
        rows.append(row)
    print(f"{'scheme':<10}{'interval':>9}  " + "  ".join(f"{f + ' B/A':>18}" for f in FIELDS))
    for row in rows:
        cells = []
        for f in FIELDS:
            m = row[f]["median_ratio"]
            cells.append(f"{'n/a' if m is None else f'{m:.3f}':>18}")
        print(f"{row['scheme']:<10}{row['interval']:>9}  " + "  ".join(cells))
    doc = {"a": a.a, "b": a.b, "pairs": a.pairs, "args": rest, "rows": rows,
           "raw": [{k: {kk: vv for kk, vv in v.items() if kk != "stdout"} for k, v in pair.items()}
                   for pair in runs],
           "tables": [{k: v["stdout"] for k, v in pair.items()} for pair in runs]}
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"json: {a.json}")


if __name__ == "__main__":
    main()
