"""Compares two cold builds' CPU seconds per object, as recorded by
bench/cpu_launcher.sh: prints a table (the heaviest objects first) and
writes JSON. Only the outputs both builds finished count in the totals.

    python3 bench/cold_build_ab.py A.log B.log --labels=-g,-g1 \\
        --dirs buildA buildB --json bench/cold_build_ab.json
"""
import argparse
import json
import os


def load(path):
    got = {}
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) != 4:
                continue  # "Command terminated by signal" and the like
            try:
                got[p[3]] = (float(p[0]) + float(p[1]), float(p[2]))
            except ValueError:
                continue
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--labels", default="a,b", help="two names, comma-separated")
    ap.add_argument("--dirs", nargs=2, help="the two build directories (for the output sizes)")
    ap.add_argument("--json")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    a, b = load(args.a), load(args.b)
    both = sorted(set(a) & set(b), key=lambda k: -a[k][0])
    rows = []
    for k in both:
        row = {"output": k, "cpu_s": [round(a[k][0], 2), round(b[k][0], 2)]}
        if args.dirs:
            sizes = [os.path.getsize(os.path.join(d, k)) if os.path.exists(os.path.join(d, k))
                     else None for d in args.dirs]
            row["bytes"] = sizes
        rows.append(row)
    ta, tb = sum(a[k][0] for k in both), sum(b[k][0] for k in both)
    la, lb = args.labels.split(",")
    print(f"{'CPU s ' + la:>12} {'CPU s ' + lb:>12} {'ratio':>6}  output")
    for r in rows[:args.top]:
        print(f"{r['cpu_s'][0]:12.2f} {r['cpu_s'][1]:12.2f} {r['cpu_s'][1] / r['cpu_s'][0]:6.2f}  "
              f"{r['output']}")
    print(f"{ta:12.1f} {tb:12.1f} {tb / ta:6.3f}  all {len(both)} outputs both builds finished")
    summary = {"labels": [la, lb], "outputs": len(both), "cpu_s": [round(ta, 1), round(tb, 1)],
               "ratio": round(tb / ta, 3)}
    if args.dirs:
        sized = [r for r in rows if None not in r["bytes"]]
        sa, sb = sum(r["bytes"][0] for r in sized), sum(r["bytes"][1] for r in sized)
        summary["bytes"] = [sa, sb]
        print(f"bytes: {sa} {sb} ({sb / sa:.3f}) over {len(sized)} outputs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
