"""One rank of the agreement-progress job (test_distributed.py
test_agreement_progress_*; docs/DISTRIBUTED.md "Global agreement"). Run by
dist_launch.run_ranks with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set:

    python agree_train.py DIR STEPS OUT [--skew-s X] [--sync ddp|none]
                          [--remote PATH]

A tiny model, a checkpoint at every step (every=1). Rank r sleeps r*X
seconds before each save(): with --sync ddp (DistributedDataParallel) the
ranks stay in lockstep and only their commits are out of phase; with
--sync none (no collective in training) the ranks also drift apart in
steps. At the end each rank writes OUT.rank-R.json with its agreement
counters (agreements, candidate_drops, max_drops_in_row, rounds), the
number of checkpoints it committed, the agreed step, and, for measuring
only, the longest time between two agreements.
"""
import argparse
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import nonstop  # noqa: E402
from dist_launch import finish_rank, start_rank  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("steps", type=int)
    p.add_argument("out")
    p.add_argument("--skew-s", type=float, default=0.005)
    p.add_argument("--sync", choices=["ddp", "none"], default="ddp")
    p.add_argument("--remote", default=None)
    a = p.parse_args()
    rank = start_rank()
    world = torch.distributed.get_world_size()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    net = nn.parallel.DistributedDataParallel(model) if a.sync == "ddp" else model
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    ckpt = nonstop.Checkpointer(a.dir, {"model": net, "optim": opt}, every=1, max_in_flight=2,
                                medium="buffered", writers=1, staging_bytes=4 << 20,
                                chunk_bytes=1 << 20, dist_timeout_s=60, tier="disk",
                                local=() if a.sync == "ddp" else ("model", "optim"),
                                remote=a.remote,
                                remote_options={"close_timeout_s": 30, "commit_timeout_s": 30}
                                if a.remote else None)
    ckpt.restore()
    t_start = time.monotonic()
    for s in range(a.steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        time.sleep(rank * a.skew_s)
        ckpt.step(s)
    train_s = time.monotonic() - t_start
    st = ckpt.stats()
    agreed_before_close = st["agreed_step"]
    t0 = time.monotonic()
    ckpt.close()
    close_s = time.monotonic() - t0
    d = ckpt.session.dist
    res = {"rank": rank, "world": world, "steps": a.steps, "committed": st["committed"],
           "agreements": st["agreements"], "candidate_drops": st["candidate_drops"],
           "max_drops_in_row": st["max_drops_in_row"], "retargets": st.get("retargets"),
           "rounds": st["rounds"], "agreed_before_close": agreed_before_close,
           "agreed": d.agreed_step(), "max_agree_gap_s": st["max_agree_gap_s"],
           "train_s": train_s, "close_s": close_s, "agreement_error": st["agreement_error"]}
    finish_rank(a.out, rank, res)


if __name__ == "__main__":
    main()
