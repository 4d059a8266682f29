"""One rank of a 2-rank gloo job for test_interop.py's ZeRO export test:
python zero_export_train.py DIR REF. DDP + ZeroRedundancyOptimizer(AdamW)
with a scheduler, three steps, one checkpoint (step 2, waited); then ZeRO's
own consolidated state_dict and the model's weights are written by rank 0 to
REF (safetensors: tensors only, no pickle) with the non-tensor state in
REF.json."""
import json
import sys

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import nonstop
from dist_launch import end_rank, start_rank


def main():
    d, ref = sys.argv[1], sys.argv[2]
    rank = start_rank()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ck = nonstop.Checkpointer(d, {"model": ddp, "optim": opt, "sched": sched}, every=1000,
                              dist_timeout_s=60)
    for s in range(3):
        torch.manual_seed(100 * s + rank)
        ddp(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    ck.save(2).wait()
    ck.close()
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        sd = opt.state_dict()
        flat = {f"model/{k}": v.contiguous() for k, v in model.state_dict().items()}
        for i, st in sd["state"].items():
            for k, v in st.items():
                flat[f"optim/{i}/{k}"] = v.contiguous()
        save_file(flat, ref)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        with open(ref + ".json", "w") as f:
            json.dump({"groups": groups, "sched": sched.state_dict()}, f)
    print(json.dumps({"rank": rank, "done": True}), flush=True)
    end_rank()


if __name__ == "__main__":
    main()
