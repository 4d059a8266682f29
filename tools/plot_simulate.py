#!/usr/bin/env python3
"""Plot `nonstop simulate --json` output: goodput against checkpoint interval.

    nonstop simulate --trace tests/data/gcp_a100_spot_trace.csv --json > sim.json
    python3 tools/plot_simulate.py sim.json goodput.png

`nonstop simulate --plot out.png` runs the same plot itself when matplotlib is
installed; this script is for a JSON file saved earlier or on another machine.
"""
import json
import sys


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: plot_simulate.py SIMULATE.json OUT.png")
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_simulate.py: matplotlib is not installed (pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(argv[1]) as f:
        doc = json.load(f)
    by_scheme = {}
    for row in doc["rows"]:
        by_scheme.setdefault(row["scheme"], []).append(
            (row["interval"], row["goodput_steps_per_s"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in by_scheme.items():
        points.sort()
        xs, ys = zip(*points)
        # Ideal is the reference line, as in PCcheck's Fig. 9.
        style = dict(linestyle="--", color="grey") if name == "ideal" else dict(marker="o")
        ax.plot(xs, ys, label=name, **style)
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (steps)")
    ax.set_ylabel("goodput (useful steps / s)")
    ax.set_title("goodput on " + doc.get("source", ""), fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(argv[2], dpi=150)
    print("wrote", argv[2])


if __name__ == "__main__":
    main(sys.argv)
