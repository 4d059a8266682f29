"""One rank of a 2-rank gloo job for test_replica.py:
python replica_train.py DIR. A DDP model (with BatchNorm: its buffers
differ between ranks at a checkpoint, and are rank 0's by design) and AdamW,
plus `extra`, a tensor that differs per rank. In DIR/mixed, `extra` is given
without local= (the first checkpoint must refuse it); in DIR/local, with
local=["extra"] (it must checkpoint, and each rank restore its own). Prints
one JSON line per mode: {"mode", "rank", "error"} or {"mode", "rank",
"restored", "extra"}."""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import nonstop
from dist_launch import end_rank
from nonstop.errors import CheckpointMismatchError


def run(d, mode, rank):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"seen": torch.full((4,), float(rank))}
    state = {"model": model, "optim": opt, "extra": extra}
    ck = nonstop.Checkpointer(d, state, every=1000, local=["extra"] if mode == "local" else (),
                              dist_timeout_s=60)
    torch.manual_seed(1 + rank)  # each rank its own batch
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out = {"mode": mode, "rank": rank}
    try:
        ck.save(1).wait()
    except CheckpointMismatchError as e:
        out["error"] = str(e)
    ck.close()
    if "error" not in out:
        extra["seen"].zero_()
        again = nonstop.Checkpointer(d, state, every=1000, local=["extra"], dist_timeout_s=60)
        out["restored"] = again.restore()
        out["extra"] = extra["seen"].tolist()
        again.close()
    print(json.dumps(out), flush=True)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    for mode in ("mixed", "local"):
        run(os.path.join(sys.argv[1], mode), mode, rank)
    end_rank()


if __name__ == "__main__":
    main()
