"""One rank of a 2-rank gloo job for test_export.py: python
export_ranks_train.py DIR REF. DDP over a model with a weight big enough
to be cut into 1/world shares (replicated="shard") and small ones written
whole by one rank, AdamW, three steps, one checkpoint (step 2, waited);
rank 0 writes the unwrapped model's state_dict to REF (safetensors)."""
import json
import sys

import torch
from safetensors.torch import save_file
from torch import nn

import nonstop
from dist_launch import end_rank, start_rank


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 2))


def main():
    d, ref = sys.argv[1], sys.argv[2]
    rank = start_rank()
    m = model()
    ddp = nn.parallel.DistributedDataParallel(m)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ck = nonstop.Checkpointer(d, {"model": ddp, "optim": opt}, every=1000, dist_timeout_s=60)
    for s in range(3):
        torch.manual_seed(100 * s + rank)
        ddp(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ck.save(2).wait()
    ck.close()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in m.state_dict().items()}, ref)
    print(json.dumps({"rank": rank, "done": True}), flush=True)
    end_rank()


if __name__ == "__main__":
    main()
