"""One rank of a tiny DDP job for test_layerwise_ddp.py. Run by
dist_launch.run_ranks (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set):

    python layerwise_ddp_train.py DIR STEPS EVERY MODE OUT [--kill-at S --kill-rank R]
                                  [--copy host|direct|device] [--clip X] [--bucket-kb K]

MODE: plain (DDP + AdamW, no checkpointer: the reference), layerwise
(mode="layerwise"), concurrent. The loop is the same for every mode. It
restores from DIR when it holds a checkpoint, so the same command is both
the first run and the restart. One JSON line per event; OUT.rank-R.json
holds hashes of the final parameters, optimizer state and RNG.
"""
import argparse
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
from dist_launch import finish_rank, start_rank  # noqa: E402


def emit(**kw):
    print(json.dumps(kw), flush=True)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def snapshot(ddp, opt) -> dict:
    """The state's tensors by checkpoint name, cloned now."""
    from nonstop import _state
    tensors = {}
    _state.flatten(ddp.state_dict(), "model", tensors)
    _state.flatten(opt.state_dict(), "optim", tensors)
    return {k: v.detach().clone() for k, v in tensors.items()}


def check_pieces(d, rank, refs) -> int:
    """Every tensor piece of every checkpoint in this rank's file, and of
    every one kept (keep=1: all of them), holds its value at the
    checkpoint's step (this rank's share of it). Returns how many
    checkpoints were checked."""
    kept = os.path.join(d, "keep")
    dirs = [d] + ([os.path.join(kept, k) for k in sorted(os.listdir(kept))]
                  if os.path.isdir(kept) else [])
    checked = 0
    for where in dirs:
        checked += check_dir(where, rank, refs)
    return checked


def check_dir(d, rank, refs) -> int:
    reader = nonstop._core.Reader(d, rank=rank)
    checked = 0
    for c in reader.checkpoints:
        if not c["committed"] or c["step"] not in refs:
            continue
        loaded = nonstop.load(d, step=c["step"], rank=rank)
        ref = refs[c["step"]]
        for spec in loaded.info["tensors"]:
            name = spec["name"]
            if name not in ref:
                continue
            got = loaded.tensors[name].reshape(-1)
            off = spec.get("global_offset") or 0
            want = ref[name].reshape(-1)[off:off + got.numel()]
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), (
                f"rank {rank}: {name} of the checkpoint of step {c['step']}")
        checked += 1
    return checked


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("steps", type=int)
    p.add_argument("every", type=int)
    p.add_argument("mode", choices=["plain", "layerwise", "concurrent"])
    p.add_argument("out")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--copy", default="host")
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--bucket-kb", type=float, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--medium", default="buffered")
    p.add_argument("--keep", type=int, default=None)
    p.add_argument("--chunk-kb", type=int, default=4)
    p.add_argument("--staging-chunks", type=int, default=3)
    a = p.parse_args()
    rank, world = start_rank(), dist.get_world_size()
    d = a.dim
    # Several buckets (small bucket_cap_mb), tensors above and below the
    # engine's 64 KiB "large" threshold and the 1024-element shard threshold,
    # a BatchNorm buffer (broadcast by DDP) and dropout (per-rank RNG).
    model = nn.Sequential(nn.Linear(32, d), nn.ReLU(), nn.BatchNorm1d(d), nn.Linear(d, d),
                          nn.ReLU(), nn.Dropout(0.1), nn.Linear(d, 32))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_kb / 1024)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    torch.manual_seed(100 + rank)  # dropout differs per rank; restored per rank
    train = {"samples": 0}
    ckpt = None
    if a.mode != "plain":
        lw = dict(copy=a.copy, clip_grad_norm=a.clip) if a.mode == "layerwise" else {}
        # 4 KiB chunks, a staging pool of 3 and one writer: copies lag behind
        # training, so a missing wait before an update shows (checked: with
        # the wait removed, check_pieces finds a later step's values).
        ckpt = nonstop.Checkpointer(a.dir, {"model": ddp, "optim": opt, "sched": sched,
                                            "train": train}, every=a.every, mode=a.mode,
                                    max_in_flight=2, medium=a.medium, writers=1,
                                    staging_bytes=a.staging_chunks * a.chunk_kb * 1024,
                                    chunk_bytes=a.chunk_kb * 1024,
                                    dist_timeout_s=60, keep=a.keep, **lw)
        r = ckpt.restore()
    else:
        r = None
    emit(event="start", rank=rank, restored=r)
    refs = {}
    start = 0 if r is None else r + 1
    in_backward = 0
    for s in range(start, a.steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        before = [q.detach().clone() for q in model.parameters()]
        loss.backward()
        if a.clip is not None and a.mode != "layerwise":
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        changed = [not torch.equal(b, q) for b, q in zip(before, model.parameters())]
        in_backward += all(changed)
        if a.mode == "layerwise" and a.clip is None:
            # The comm hook updated every parameter and cleared its gradient.
            assert all(q.grad is None for q in model.parameters()), s
        opt.step()
        sched.step()
        train["samples"] += 16
        if ckpt is not None:
            ckpt.step(s)
            if a.mode == "layerwise" and (s + 1) % a.every == 0:
                refs[s] = snapshot(ddp, opt)  # what the checkpoint of step s must hold
        emit(event="step", rank=rank, step=s, loss=loss.item())
        if s == a.kill_at and rank == a.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # its checkpoint's copies are in flight
    st = None
    if ckpt is not None:
        st = ckpt.stats()
        ckpt.close()
    checked = check_pieces(a.dir, rank, refs) if refs else 0
    local = opt.state_dict()
    opt_tensors = [v for _, stt in sorted(local["state"].items()) for _, v in sorted(stt.items())
                   if isinstance(v, torch.Tensor)]
    res = {"rank": rank, "restored": r, "params": digest(model.parameters()),
           "buffers": digest(model.buffers()), "optim": digest(opt_tensors),
           "samples": train["samples"], "rng": digest([torch.get_rng_state()]),
           "lr": sched.get_last_lr(), "updated_in_backward": in_backward,
           "steps_run": a.steps - start, "checked": checked,
           "failed": None if st is None else st["failed"],
           "committed": None if st is None else st["committed"],
           "agreed": None if ckpt is None else ckpt.session.dist.agreed_step()}
    finish_rank(a.out, rank, res)


if __name__ == "__main__":
    main()
