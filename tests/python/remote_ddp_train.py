"""One rank of a 2-node DDP (gloo) job with a remote tier, for
test_remote_netns.py. Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
(and GLOO_SOCKET_IFNAME) set:

    python remote_ddp_train.py DIR REMOTE OPTIONS_JSON STEPS EVERY OUT [--step-s X]

It restores (local first, then remote) and trains to STEPS. After every
step it rewrites OUT.progress-R.json (step, restored step, remote stats); at
the end OUT.rank-R.json holds the sha256 of the final parameters, optimizer
state and blob.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import nonstop  # noqa: E402
from dist_launch import end_rank  # noqa: E402


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


T0 = time.monotonic()


def phase(what):
    """A timestamped line in the rank's log (the test prints the logs on failure)."""
    print(f"[{time.monotonic() - T0:6.1f} s] {what}", flush=True)


def main():
    phase("imported")
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("remote")
    p.add_argument("options")
    p.add_argument("steps", type=int)
    p.add_argument("every", type=int)
    p.add_argument("out")
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--blob", type=int, default=1 << 20)
    a = p.parse_args()
    torch.set_num_threads(1)
    phase("torch set up")
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    phase("process group up")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    blob = torch.zeros(a.blob)  # replicated state, written as two halves
    state = {"model": ddp, "optim": opt, "blob": blob}
    # replicas=0: this job tests the remote tier; with the peer tier node A's
    # replica of node B would be restored instead (test_peer_tier.py).
    ckpt = nonstop.Checkpointer(a.dir, state, every=a.every, remote=a.remote,
                                remote_options=json.loads(a.options), dist_timeout_s=60,
                                replicas=0)
    phase("checkpointer made")
    start = ckpt.restore()
    phase(f"restored {start}")
    first = 0 if start is None else start + 1
    prog = f"{a.out}.progress-{rank}.json"
    for step in range(first, a.steps):
        g = torch.Generator().manual_seed(10_000 * rank + step)
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        blob.add_(float(step))
        ckpt.step(step)
        write(prog, {"step": step, "restored": start, "remote": ckpt.stats()["remote"]})
        if a.step_s:
            time.sleep(a.step_s)
    restored_from = ckpt.stats()["remote"]["restored_from"]
    phase("trained; closing")
    t0 = time.monotonic()
    ckpt.close()  # waits for the newest upload
    close_s = time.monotonic() - t0
    phase("closed")
    write(f"{a.out}.rank-{rank}.json", {
        "restored": start, "restored_from": restored_from, "close_s": close_s,
        "params": digest(model.parameters()),
        "optim": digest(v for s in opt.state.values() for _, v in sorted(s.items())
                        if isinstance(v, torch.Tensor)),
        "blob": digest([blob])})
    end_rank()


if __name__ == "__main__":
    main()
