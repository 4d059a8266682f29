"""Progress of the distributed agreement with a checkpoint at every step
(docs/DISTRIBUTED.md "Agreement progress"). Runs tests/python/agree_train.py
with 4 ranks on localhost (gloo) for each configuration, interleaved over
`--repeat` rounds, and prints, per configuration, the checkpoints each rank
committed (proposed) against the agreements (pins; the fewest of any rank),
the most candidates a rank dropped in a row, the longest time between two
agreements (the slowest rank's), and the step agreed at close.

    .venv/bin/python bench/agreement_progress.py [--steps 150] [--repeat 2]
                                                  [--json bench/agreement_progress.json]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
from dist_launch import run_ranks  # noqa: E402

CONFIGS = [("ddp", 0.0), ("ddp", 0.005), ("none", 0.005)]


def one(steps, sync, skew, world):
    d = tempfile.mkdtemp(prefix="nonstop-agree-")
    try:
        out = os.path.join(d, "out")
        res = run_ranks(world, [os.path.join(HERE, "..", "tests", "python", "agree_train.py"),
                                os.path.join(d, "ckpt"), str(steps), out, "--skew-s", str(skew),
                                "--sync", sync], timeout=300)
        for r, (rc, _, err) in enumerate(res):
            if rc != 0:
                raise SystemExit(f"rank {r} exited {rc}: {err[-2000:]}")
        ranks = []
        for r in range(world):
            with open(f"{out}.rank-{r}.json") as f:
                ranks.append(json.load(f))
        return {"sync": sync, "skew_s": skew, "steps": steps,
                "committed": min(x["committed"] for x in ranks),
                "agreements": min(x["agreements"] for x in ranks),
                "candidate_drops": max(x["candidate_drops"] for x in ranks),
                "max_drops_in_row": max(x["max_drops_in_row"] for x in ranks),
                "max_agree_gap_s": max(x["max_agree_gap_s"] for x in ranks),
                "rounds": min(x["rounds"] for x in ranks),
                "agreed_before_close": [x["agreed_before_close"] for x in ranks],
                "agreed": [x["agreed"] for x in ranks],
                "train_s": max(x["train_s"] for x in ranks),
                "close_s": max(x["close_s"] for x in ranks)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--json", default=os.path.join(HERE, "agreement_progress.json"))
    a = p.parse_args()
    rows = []
    for rep in range(a.repeat):
        for sync, skew in CONFIGS:
            row = one(a.steps, sync, skew, a.world)
            row["repeat"] = rep
            rows.append(row)
    print(f"{'sync':5} {'skew_ms':>7} {'committed':>9} {'agreed':>6} {'drops':>5} "
          f"{'in_row':>6} {'gap_s':>6} {'rounds':>6} {'close_s':>7}  agreed_at_close")
    for r in rows:
        print(f"{r['sync']:5} {r['skew_s'] * 1000:7.0f} {r['committed']:9d} {r['agreements']:6d} "
              f"{r['candidate_drops']:5d} {r['max_drops_in_row']:6d} {r['max_agree_gap_s']:6.2f} "
              f"{r['rounds']:6d} {r['close_s']:7.2f}  {r['agreed']}")
    with open(a.json, "w") as f:
        json.dump({"command": " ".join(["bench/agreement_progress.py"] + sys.argv[1:]),
                   "world": a.world, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
