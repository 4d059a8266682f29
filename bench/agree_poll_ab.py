"""A/B of the agreement thread's wait for its all_gather (docs/DISTRIBUTED.md
"Exit without close()"): polled (async_op=True, is_completed() with sleeps
of 0.5 -> 10 ms: the thread never waits inside torch with the GIL released,
so interpreter exit cannot abort it) against the blocking call it replaced
(dist.all_gather, waited for in torch). Runs tests/python/agree_train.py
(a tiny DDP model, a checkpoint at every step, 2 ranks on localhost) in
ABBA order, each run a fresh job, and prints per arm the median training
time, agreement rounds and pins, and polled/blocking as ratios.

    .venv/bin/python bench/agree_poll_ab.py [--steps 150] [--pairs 2]
        [--json bench/agree_poll_ab.json]

Run as a rank (internal): agree_poll_ab.py rank blocking|polled ARGS...
"""
import argparse
import json
import os
import runpy
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests", "python")
sys.path.insert(0, TESTS)
from dist_launch import run_ranks  # noqa: E402


def rank_main(arm, argv):
    if arm == "blocking":
        import torch
        from nonstop import _distributed

        def gather(self, mine):
            got = [torch.zeros(5, dtype=torch.int64) for _ in range(self.world)]
            torch.distributed.all_gather(got, torch.tensor(mine, dtype=torch.int64),
                                         group=self.group)
            return [g.tolist() for g in got]
        _distributed.Distributed._gather = gather
    sys.argv = [os.path.join(TESTS, "agree_train.py")] + argv
    runpy.run_path(sys.argv[0], run_name="__main__")


def one(arm, steps):
    d = tempfile.mkdtemp(prefix="nonstop-pollab-")
    try:
        out = os.path.join(d, "out")
        res = run_ranks(2, [os.path.abspath(__file__), "rank", arm, os.path.join(d, "ckpt"),
                            str(steps), out, "--skew-s", "0.005", "--sync", "ddp"], timeout=300)
        for r, (rc, _, err) in enumerate(res):
            if rc != 0:
                raise SystemExit(f"{arm}: rank {r} exited {rc}: {err[-2000:]}")
        ranks = []
        for r in range(2):
            with open(f"{out}.rank-{r}.json") as f:
                ranks.append(json.load(f))
        return {"arm": arm, "train_s": max(x["train_s"] for x in ranks),
                "rounds": min(x["rounds"] for x in ranks),
                "agreements": min(x["agreements"] for x in ranks),
                "agreed": [x["agreed"] for x in ranks]}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--json", default=os.path.join(HERE, "agree_poll_ab.json"))
    a = p.parse_args()
    rows = []
    for pair in range(a.pairs):
        for arm in (["polled", "blocking"] if pair % 2 == 0 else ["blocking", "polled"]):
            rows.append(dict(one(arm, a.steps), pair=pair))
            r = rows[-1]
            print(f"pair {pair} {arm:8}: train {r['train_s']:.2f} s, {r['rounds']} rounds, "
                  f"{r['agreements']} agreements, agreed {r['agreed']}", flush=True)
    med = {arm: {k: statistics.median(r[k] for r in rows if r["arm"] == arm)
                 for k in ("train_s", "rounds", "agreements")} for arm in ("polled", "blocking")}
    ratio = {k: med["polled"][k] / med["blocking"][k] if med["blocking"][k] else None
             for k in ("train_s", "rounds", "agreements")}
    print(f"{'arm':9} {'train_s':>8} {'rounds':>7} {'agreements':>10}")
    for arm in ("polled", "blocking"):
        m = med[arm]
        print(f"{arm:9} {m['train_s']:8.2f} {m['rounds']:7.0f} {m['agreements']:10.0f}")
    print("polled/blocking: " + ", ".join(f"{k} x{v:.3f}" for k, v in ratio.items() if v))
    with open(a.json, "w") as f:
        json.dump({"command": " ".join(["bench/agree_poll_ab.py"] + sys.argv[1:]),
                   "load_at_end": os.getloadavg(), "rows": rows, "median": med,
                   "polled_over_blocking": ratio}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3:])
    else:
        main()
