"""The training job of the preemption tests (test_preempt.py): a tiny model,
checkpointed by nonstop with on_preempt, one or more ranks on gloo.

`run(cfg, events)` is the job; the tests start it through a multiprocessing
forkserver that has imported torch and nonstop once (a fresh interpreter
costs seconds on a loaded 2-core machine; a fork costs milliseconds). It
reports {"event": ...} dicts on `events` and ends the way a real job would:
status 0 when training finished, status 75 (nonstop.Preempted, uncaught)
after a preemption notice.

cfg: dir, steps, every, final (path prefix for the final state, or None),
pace_s (sleep per step, so signals land inside steps), rank, world_size,
port (for world_size > 1), grace_s, max_in_flight, stderr (a file that
takes the process's stderr: nonstop's notice lines).
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import nonstop  # noqa: E402
import tiny  # noqa: E402
from nonstop import _checkpointer, _state  # noqa: E402,F401  (preloaded by the forkserver)


def train_step(model, opt, sched, step, rank, world_size):
    g = torch.Generator().manual_seed(1000 + step * world_size + rank)
    x = torch.randint(0, 32, (8, 4), generator=g)
    y = torch.randint(0, 32, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if world_size > 1:  # data parallel by hand: the same averaged gradient on every rank
        import torch.distributed as dist
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
    opt.step()
    sched.step()
    if world_size > 1:
        # Buffers (BatchNorm statistics) from rank 0 at the end of the step, so
        # the whole model is the same on every rank when it is checkpointed:
        # nonstop stores replicated state once, shared among the ranks
        # (replicated="shard"). DDP broadcasts them at the start of the next
        # forward instead, when they already differ at the checkpoint.
        for b in model.buffers():
            dist.broadcast(b, src=0)
    return loss.item()


def save_final(final, model, opt, sched, train):
    tensors = {}
    tree = {"model": _state.flatten(model.state_dict(), "model", tensors),
            "optim": _state.flatten(opt.state_dict(), "optim", tensors),
            "sched": _state.flatten(sched.state_dict(), "sched", tensors), "train": train}
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, final + ".safetensors")
    with open(final + ".json", "w") as f:
        f.write(_state.dumps(tree))


def run(cfg: dict, events=None) -> None:
    def emit(**ev):
        ev.setdefault("rank", cfg.get("rank", 0))
        if events is not None:
            events.put(ev)
        else:
            print(json.dumps(ev), flush=True)

    if cfg.get("stderr"):  # a file for the test to read nonstop's lines from
        fd = os.open(cfg["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
    torch.set_num_threads(1)
    rank, world = cfg.get("rank", 0), cfg.get("world_size", 1)
    if world > 1:
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt, sched = tiny.make()
    train = {"tokens": 0}
    ckpt = None
    start = 0
    if cfg["dir"] is not None:
        on_preempt = {"grace_s": cfg["grace_s"]} if cfg.get("grace_s") else True
        ckpt = nonstop.Checkpointer(cfg["dir"], {"model": model, "optim": opt, "sched": sched,
                                                 "train": train}, every=cfg["every"],
                                    max_in_flight=cfg.get("max_in_flight", 2),
                                    staging_bytes=8 << 20, chunk_bytes=1 << 20, writers=2,
                                    on_preempt=on_preempt)
        r = ckpt.restore()
        start = 0 if r is None else r + 1
        emit(event="start", restored=r)
    try:
        for s in range(start, cfg["steps"]):
            loss = train_step(model, opt, sched, s, rank, world)
            train["tokens"] += 32
            if cfg.get("pace_s"):
                time.sleep(cfg["pace_s"])
            if ckpt is not None:
                ckpt.step(s)
            emit(event="step", step=s, loss=loss)
    except nonstop.Preempted as p:
        emit(event="preempted", step=p.step, notice_step=p.notice_step, committed=p.committed,
             latest=p.latest, reason=p.reason, notice_to_safe_s=p.notice_to_safe_s)
        raise  # uncaught: the process exits with p.code (75)
    if ckpt is not None:
        ckpt.close()
    if cfg.get("final"):
        save_final(f"{cfg['final']}.r{rank}", model, opt, sched, train)
    emit(event="done")


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
