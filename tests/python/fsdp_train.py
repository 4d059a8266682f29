"""One rank of a tiny FSDP2 (fully_shard) job for test_fsdp.py, gloo on CPU.
Run by dist_launch.run_ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set) or torchrun:

    python fsdp_train.py DIR STEPS EVERY OUT [--kill-at S --kill-rank R]   (any world size)

The layers have 67, 31 and 1 output rows (and a BatchNorm of 67, whose
running statistics FSDP2 keeps per rank, unsynchronised), so with 2 ranks the
Shard(0) pieces are uneven (34 + 33 rows, 16 + 15 rows) and rank 1 holds no
row of the last layer. It restores from DIR when it holds
a checkpoint, so the same command is both the first run and the restart. It
prints one JSON line per event and writes OUT.rank-R.json with hashes of its
final local shards (parameters and optimizer state), RNG and lr.
--load-dcp EXPORT_DIR: after training, a fresh sharded model is loaded from a
`nonstop export --format dcp` directory with torch.distributed.checkpoint.load
and its parameters' digest is added to OUT.rank-R.json.
"""
import argparse
import datetime
import hashlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import nonstop  # noqa: E402
from dist_launch import end_rank  # noqa: E402


def emit(**kw):
    print(json.dumps(kw), flush=True)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(local(t).detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def full(ts) -> str:
    """Digest of the global tensors (an all-gather of each DTensor)."""
    return digest([t.full_tensor() if hasattr(t, "full_tensor") else t for t in ts])


def optim_tensors(opt):
    osd = opt.state_dict()
    return [v for _, st in sorted(osd["state"].items()) for _, v in sorted(st.items())
            if isinstance(v, torch.Tensor)]


def build(mesh):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 67), nn.BatchNorm1d(67), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(67, 31), nn.ReLU(), nn.Linear(31, 1))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("steps", type=int)
    p.add_argument("every", type=int)
    p.add_argument("out")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--load-dcp", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    model = build(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    torch.manual_seed(100 + rank)  # dropout differs per rank; restored per rank
    train = {"samples": 0}
    ckpt = nonstop.Checkpointer(a.dir, {"model": model, "optim": opt, "sched": sched,
                                        "train": train}, every=a.every, max_in_flight=2,
                                medium="buffered", writers=1, staging_bytes=4 << 20,
                                chunk_bytes=1 << 20, dist_timeout_s=60)
    r = ckpt.restore()
    emit(event="start", rank=rank, restored=r,
         kinds=sorted({type(q).__name__ for q in model.parameters()}),
         full_params=full(model.parameters()), full_optim=full(optim_tensors(opt)),
         samples=train["samples"], lr=sched.get_last_lr())
    for s in range(0 if r is None else r + 1, a.steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        train["samples"] += 16
        ckpt.step(s)
        emit(event="step", rank=rank, step=s, loss=loss.item())
        if s == a.kill_at and rank == a.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-checkpoint: its copy/write is in flight
    if ckpt.session.dist is None:  # one rank
        ckpt.wait()
        agreed = ckpt.latest()
    ckpt.close()
    if ckpt.session.dist is not None:
        agreed = ckpt.session.dist.agreed_step()
    opt_tensors = optim_tensors(opt)
    res = {"rank": rank, "restored": r, "params": digest(model.parameters()),
           "buffers": digest(model.buffers()), "optim": digest(opt_tensors), "samples": train["samples"], "agreed": agreed,
           "rng": digest([torch.get_rng_state()]), "lr": sched.get_last_lr(),
           "optim_kinds": sorted({type(v).__name__ for v in opt_tensors}),
           "shapes": [list(local(q).shape) for q in model.parameters()],
           "full_params": full(model.parameters()), "full_optim": full(opt_tensors)}
    if a.load_dcp:  # a fresh sharded model, loaded from the DCP export
        import torch.distributed.checkpoint as dcp
        fresh = build(mesh)
        # The parameters, in get_state_dict's layout (the BatchNorm buffers
        # are rank-local: under "rank-R" in the export).
        sd = {"model": dict(fresh.named_parameters()), "nonstop.step": torch.tensor(-1)}
        dcp.load(sd, checkpoint_id=a.load_dcp)
        fresh.load_state_dict(sd["model"], strict=False)
        res["dcp"] = {"step": int(sd["nonstop.step"]), "params": digest(fresh.parameters()),
                      "kinds": sorted({type(q).__name__ for q in fresh.parameters()})}
    with open(f"{a.out}.rank-{rank}.json", "w") as f:
        json.dump(res, f)
    emit(event="done", rank=rank, agreed=agreed)
    end_rank()


if __name__ == "__main__":
    main()
