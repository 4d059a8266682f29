#!/usr/bin/env python3
"""First vs second checkpoint stall, two builds interleaved (A/B).

Runs bench/memtier_bench.py's "first" child (a 1.32 GB state, staging
prepared in the background, three save()s with training between them) with
an old and a new build of nonstop in turns: old, new, old, new, ... so both
see the same machine load. Prints a table of the stalls and writes every raw
result to --out.

  python3 bench/first_checkpoint_ab.py \\
      --old-python /path/old/venv/bin/python --old-path OLD/python \\
      --new-python .venv/bin/python --rounds 4 --out bench/first_checkpoint_ab.json

--old-path/--new-path go first on PYTHONPATH (a source tree whose
python/nonstop holds its own _core); leave them out to use what the
interpreter imports.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(python, path, d, gb, gap):
    shutil.rmtree(d, ignore_errors=True)
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path
    else:
        env.pop("PYTHONPATH", None)
    out = subprocess.run([python, os.path.join(HERE, "memtier_bench.py"), "--child", "first",
                          "--scheme", "prepared", "--dir", d, "--gb", str(gb), "--gap", str(gap)],
                         check=True, capture_output=True, text=True, timeout=600, env=env).stdout
    shutil.rmtree(d, ignore_errors=True)
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-python", required=True)
    ap.add_argument("--old-path", default="")
    ap.add_argument("--new-python", required=True)
    ap.add_argument("--new-path", default="")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--gb", type=float, default=1.32)
    ap.add_argument("--gap", type=float, default=1.5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="nonstop-first-ab-", dir="/tmp")
    raw = {"old": [], "new": []}
    try:
        for r in range(a.rounds):
            for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
                got = run(getattr(a, which + "_python"), getattr(a, which + "_path"),
                          os.path.join(base, which), a.gb, a.gap)
                raw[which].append(got)
                s = got["stalls"]
                print(f"round {r + 1} {which}: first {s[0] * 1e3:7.1f} ms  second "
                      f"{s[1] * 1e3:7.1f} ms  third {s[2] * 1e3:7.1f} ms", file=sys.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {w: {k: statistics.median(x["stalls"][i] for x in raw[w]) * 1e3
               for i, k in enumerate(("first_ms", "second_ms", "third_ms"))} for w in raw}
    print("| build | first ms | second ms | third ms | first/second |")
    print("|---|---|---|---|---|")
    for w in ("old", "new"):
        m = med[w]
        print(f"| {w} | {m['first_ms']:.1f} | {m['second_ms']:.1f} | {m['third_ms']:.1f} | "
              f"{m['first_ms'] / max(m['second_ms'], 1e-9):.2f} |")
    print(f"new/old first: {med['new']['first_ms'] / med['old']['first_ms']:.2f}")
    with open(a.out, "w") as f:
        json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                   "load_end": os.getloadavg(), "medians": med, "raw": raw}, f, indent=1)


if __name__ == "__main__":
    main()
