#!/usr/bin/env python3
"""How long `nonstop.Checkpointer(...)` takes to construct in one process.

Each round is a fresh Python process (nothing imported yet, as a training
script starts): it imports torch and nonstop, builds a small model, AdamW
and a StepLR, then times the Checkpointer constructor alone (and close()),
and reports whether torch.distributed.optim got imported on the way. Prints
a table (median, min, max over the rounds) and writes every raw result to
--out.

  .venv/bin/python bench/construct_bench.py --rounds 7 --out bench/construct_bench.json

--path DIR goes first on sys.path, before an editable install of this
tree (a directory holding another `nonstop` package, e.g. an older tree's
python/ with this build's _core copied in),
--label names the run in the table and the JSON.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time, tempfile
if os.environ.get("CONSTRUCT_BENCH_PATH"):  # another tree's package, before an editable install's
    sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    sys.path.insert(0, os.environ["CONSTRUCT_BENCH_PATH"])
t0 = time.perf_counter()
import torch
import nonstop
t1 = time.perf_counter()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
d = tempfile.mkdtemp(prefix="nonstop-construct-", dir=sys.argv[1])
t2 = time.perf_counter()
ckpt = nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": sched}, every=10)
t3 = time.perf_counter()
ckpt.close()
t4 = time.perf_counter()
print(json.dumps({"nonstop": nonstop.__file__, "import_s": t1 - t0, "construct_s": t3 - t2, "close_s": t4 - t3,
                  "imported_distributed_optim": "torch.distributed.optim" in sys.modules}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--path", default="")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    env = dict(os.environ)
    if a.path:
        env["CONSTRUCT_BENCH_PATH"] = os.path.abspath(a.path)
    runs = []
    with tempfile.TemporaryDirectory(prefix="nonstop-construct-bench-") as base:
        for _ in range(a.rounds):
            out = subprocess.run([a.python, "-c", CHILD, base], check=True, capture_output=True,
                                 text=True, timeout=300, env=env).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
    c = [r["construct_s"] for r in runs]
    summary = {"label": a.label, "rounds": a.rounds, "construct_median_s": statistics.median(c),
               "construct_min_s": min(c), "construct_max_s": max(c),
               "import_median_s": statistics.median(r["import_s"] for r in runs),
               "close_median_s": statistics.median(r["close_s"] for r in runs),
               "imported_distributed_optim": any(r["imported_distributed_optim"] for r in runs)}
    print(f"{'run':<24} {'construct median':>17} {'min':>8} {'max':>8} {'import':>8} "
          f"{'close':>8}  torch.distributed.optim imported")
    print(f"{a.label:<24} {summary['construct_median_s']:>16.3f}s "
          f"{summary['construct_min_s']:>7.3f}s {summary['construct_max_s']:>7.3f}s "
          f"{summary['import_median_s']:>7.2f}s {summary['close_median_s']:>7.3f}s  "
          f"{summary['imported_distributed_optim']}")
    with open(a.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "summary": summary, "runs": runs}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
