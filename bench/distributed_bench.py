"""Distributed checkpoint benchmark: write bandwidth and training overhead of
nonstop at 1, 2 and 4 ranks (DDP over gloo on localhost), interleaved with
no-checkpoint runs. Prints a table and writes JSON.

    python bench/distributed_bench.py --out runs/dist_bench.json \
        [--worlds 1,2,4 --params 4000000 --steps 30 --every 5 --repeat 2 --dir /tmp/nsdb]

Each rank: a stack of Linear layers (--params parameters, fp32) with AdamW,
so the replicated state is 3 x 4 x params bytes; with replicated="shard"
each rank writes 1/world of it. Reported per run: median step time after
warm-up, visible stall per checkpoint (time the training thread spent in
nonstop), per-rank persist time and write GB/s, aggregate GB/s (state bytes /
slowest rank's persist time). torch.set_num_threads(1) in every rank.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def rank_main(a):
    import torch
    import torch.distributed as dist
    from torch import nn
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import nonstop
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    width = 1024
    layers = max(1, a.params // (width * width))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    ckpt = None
    if a.scheme == "nonstop":
        ckpt = nonstop.Checkpointer(a.dir, {"model": net, "optim": opt}, every=a.every,
                                    medium=a.medium, rng=False)
    times, stalls = [], []
    x = torch.randn(8, width)
    for s in range(a.steps):
        t0 = time.perf_counter()
        loss = net(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if ckpt is not None:
            before = ckpt.stats()["visible_stall_s"]
            if ckpt.step(s) is not None:
                stalls.append(ckpt.stats()["visible_stall_s"] - before)
        times.append(time.perf_counter() - t0)
    res = {"rank": rank, "world": world, "scheme": a.scheme,
           "step_s": statistics.median(times[3:]), "stalls": stalls[1:]}
    if ckpt is not None:
        st = ckpt.stats()
        rec = [c for c in st["recent"] if c["committed"]][1:]  # the first creates the file
        res.update(persist_s=[c["persist_s"] for c in rec], bytes=[c["bytes"] for c in rec],
                   agreed=st.get("agreed_step"), hook_stall_s=st["hook_stall_s"],
                   visible_stall_s=st["visible_stall_s"])
        ckpt.close()
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    res["state_bytes"] = state_bytes
    print("RESULT " + json.dumps(res), flush=True)
    if world > 1:
        dist.destroy_process_group()


def launch(world, a, scheme):
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    from dist_launch import run_ranks
    d = os.path.join(a.dir, f"w{world}-{scheme}")
    shutil.rmtree(d, ignore_errors=True)
    argv = [os.path.abspath(__file__), "--rank-mode", "--scheme", scheme, "--dir", d,
            "--params", str(a.params), "--steps", str(a.steps), "--every", str(a.every),
            "--medium", a.medium]
    out = []
    for rc, _, err in run_ranks(world, argv, timeout=a.timeout, env={"PYTHONUNBUFFERED": "1"}):
        line = [ln for ln in err.splitlines() if ln.startswith("RESULT ")]
        if rc != 0 and not line:
            raise RuntimeError(f"rank failed ({rc}): {err[-800:]}")
        out.append(line)
    shutil.rmtree(d, ignore_errors=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank-mode", action="store_true")
    p.add_argument("--scheme", default="nonstop")
    p.add_argument("--dir", default="/tmp/nonstop_dist_bench")
    p.add_argument("--params", type=int, default=4 << 20)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--medium", default="auto")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.rank_mode:
        # run_ranks parses JSON from stdout; results go to stderr as RESULT lines.
        sys.stdout = sys.stderr
        return rank_main(a)
    rows = []
    for rep in range(a.repeat):
        for world in [int(w) for w in a.worlds.split(",")]:
            for scheme in ("none", "nonstop"):
                ranks = [json.loads(r[0][len("RESULT "):]) for r in launch(world, a, scheme)]
                rows.append({"repeat": rep, "world": world, "scheme": scheme, "ranks": ranks})
                print(f"  done world={world} scheme={scheme} rep={rep}", file=sys.stderr)
    table = []
    for world in sorted({r["world"] for r in rows}):
        none = [max(x["step_s"] for x in r["ranks"]) for r in rows
                if r["world"] == world and r["scheme"] == "none"]
        ns = [r for r in rows if r["world"] == world and r["scheme"] == "nonstop"]
        step_ns = [max(x["step_s"] for x in r["ranks"]) for r in ns]
        stalls = [s for r in ns for x in r["ranks"] for s in x["stalls"]]
        per_rank_gbps = [b / t / 1e9 for r in ns for x in r["ranks"]
                         for b, t in zip(x["bytes"], x["persist_s"]) if t > 0]
        agg = []
        for r in ns:
            n = min(len(x["persist_s"]) for x in r["ranks"])
            for i in range(n):
                slowest = max(x["persist_s"][i] for x in r["ranks"])
                agg.append(r["ranks"][0]["state_bytes"] / slowest / 1e9)
        table.append({
            "world": world, "state_MB": ns[0]["ranks"][0]["state_bytes"] / 1e6,
            "per_rank_MB": statistics.median(b for r in ns for x in r["ranks"] for b in x["bytes"])
            / 1e6,
            "step_none_s": statistics.median(none), "step_nonstop_s": statistics.median(step_ns),
            "overhead": statistics.median(step_ns) / statistics.median(none) - 1,
            "stall_per_ckpt_ms": 1e3 * statistics.median(stalls) if stalls else 0.0,
            "per_rank_GBps": statistics.median(per_rank_gbps) if per_rank_gbps else 0.0,
            "aggregate_GBps": statistics.median(agg) if agg else 0.0})
    print(f"{'world':>5} {'state MB':>9} {'rank MB':>8} {'step none':>10} {'step ns':>9} "
          f"{'overhead':>9} {'stall/ckpt':>11} {'rank GB/s':>10} {'aggr GB/s':>10}")
    for t in table:
        print(f"{t['world']:>5} {t['state_MB']:>9.1f} {t['per_rank_MB']:>8.1f} "
              f"{t['step_none_s'] * 1e3:>8.1f}ms {t['step_nonstop_s'] * 1e3:>7.1f}ms "
              f"{100 * t['overhead']:>8.1f}% {t['stall_per_ckpt_ms']:>9.1f}ms "
              f"{t['per_rank_GBps']:>10.2f} {t['aggregate_GBps']:>10.2f}")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "table": table, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
