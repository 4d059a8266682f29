"""One rank of a 2-rank gloo job for test_manage_dist.py:
python retention_ddp_train.py DIR PHASE. Retention in distributed training:
keep=1, max_to_keep=2, best=("loss", "min", 2). Each rank passes its *own*
loss, ranked in opposite orders (rank 1 passes 1 - rank 0's), so the ranks
keep the same steps only when rank 0's metrics are agreed over gloo.

PHASE train: steps 0..7, one checkpoint each (waited); prints
{"rank", "step", "w"} per step (the model's weights, exactly), then, once
both ranks have committed step 7, rank 0 SIGKILLs itself (the launcher
kills rank 1): nothing is closed.
PHASE resume: a new Checkpointer (it tidies steps kept on some ranks only),
prints {"rank", "at_open": kept steps}, restores the newest step, trains
steps 8..11 and prints {"rank", "at_close": kept steps}; then a third
Checkpointer restores step 3 (a kept copy that left the ring) and prints
{"rank", "restored", "w"}."""
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

import nonstop
from dist_launch import end_rank, start_rank

LOSS = [0.9, 0.3, 0.8, 0.2, 0.7, 0.6, 0.5, 0.95, 0.85, 0.1, 0.75, 0.65]


def kept(d, rank):
    """Steps whose kept copy holds this rank's file."""
    k = os.path.join(d, "keep")
    name = nonstop._core.JobDir.slot_name(rank)
    if not os.path.isdir(k):
        return []
    return sorted(int(n.split("-")[1]) for n in os.listdir(k)
                  if n.startswith("step-") and os.path.isfile(os.path.join(k, n, name)))


def checkpointer(d, state):
    return nonstop.Checkpointer(d, state, every=1, keep=1, max_to_keep=2,
                                best=("loss", "min", 2), rng=False, dist_timeout_s=60)


def train(ck, model, opt, rank, steps):
    for s in steps:
        torch.manual_seed(100 * s + rank)  # each rank its own batch
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        loss = LOSS[s] if rank == 0 else 1.0 - LOSS[s]
        h = ck.step(s, metrics={"loss": loss})
        h.wait()
        print(json.dumps({"rank": rank, "step": s,
                          "w": model.module.weight.flatten().tolist()}), flush=True)


def main():
    d, phase = sys.argv[1], sys.argv[2]
    rank = start_rank()
    model = nn.parallel.DistributedDataParallel(nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    if phase == "train":
        ck = checkpointer(d, state)
        train(ck, model, opt, rank, range(8))
        dist.barrier()  # both ranks committed (and retained) step 7
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # never returns: the launcher kills this rank
        return
    ck = checkpointer(d, state)
    print(json.dumps({"rank": rank, "at_open": kept(d, rank)}), flush=True)
    assert ck.restore() == 7
    train(ck, model, opt, rank, range(8, 12))
    ck.close()
    print(json.dumps({"rank": rank, "at_close": kept(d, rank)}), flush=True)
    with nonstop.Checkpointer(d, state, every=1, rng=False, dist_timeout_s=60) as again:
        got = again.restore(step=3)
        print(json.dumps({"rank": rank, "restored": got,
                          "w": model.module.weight.flatten().tolist()}), flush=True)
    end_rank()


if __name__ == "__main__":
    main()
