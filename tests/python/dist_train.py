"""One rank of a tiny data-parallel job for the distributed tests
(test_distributed.py). Run by the test's launcher with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set (or under torchrun):

    python dist_train.py DIR STEPS EVERY KIND OUT [--kill-at S --kill-rank R]
                         [--slow-rank R --slow-s X] [--replicated shard|rank0]
                         [--stop-rebuild-rank R]

KIND is ddp (DDP + AdamW, replicated state) or zero (DDP +
ZeroRedundancyOptimizer: each rank checkpoints its optimizer shard). It
restores from DIR when it holds a checkpoint, so the same command is both
the first run and the restart. It prints one JSON line per event and writes
OUT.rank-R.json with hashes of its final parameters and optimizer state.
"""
import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import nonstop  # noqa: E402
from nonstop import _distributed  # noqa: E402
from dist_launch import end_rank, start_rank  # noqa: E402


def emit(**kw):
    print(json.dumps(kw), flush=True)


class SlowCommits:
    """Simulates a rank that is slow to persist, as the agreement sees it:
    a committed checkpoint becomes visible to the agreement thread only
    `delay` seconds after it first appears."""

    def __init__(self, engine, delay):
        self.engine, self.delay, self.seen = engine, delay, {}

    def candidate(self):
        c = self.engine.candidate()
        if c is None:
            return None
        first = self.seen.setdefault(c[0], time.monotonic())
        return c if time.monotonic() - first >= self.delay else None

    def agree_offer(self):
        # A candidate not visible yet is a commit still to come: neither
        # it nor anything newer is reported committed.
        counter, step, committed, started = self.engine.agree_offer()
        if counter is not None and self.candidate() is None:
            return None, -1, min(committed, step - 1), started
        return counter, step, committed, started

    def __getattr__(self, name):
        return getattr(self.engine, name)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optim_by_param(opt) -> dict:
    """{global parameter index: digest of its optimizer state} for the
    parameters whose state this rank holds (all of them, or ZeRO's shard)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    state = opt.optim.state if isinstance(opt, ZeroRedundancyOptimizer) else opt.state
    out = {}
    for i, p in enumerate(params):
        st = state.get(p)
        if st:
            out[str(i)] = digest(v if v.dim() else v.reshape(1) for _, v in sorted(st.items())
                                 if isinstance(v, torch.Tensor))
    return out


def agreed_everywhere(ckpt, step: int, wait_s: float = 20.0) -> bool:
    """Whether every rank saw `step` agreed within `wait_s` (collective)."""
    end = time.monotonic() + wait_s
    while ckpt.latest() != step and time.monotonic() < end:
        time.sleep(0.05)
    ok = torch.tensor([1 if ckpt.latest() == step else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def main():
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks, on request
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("steps", type=int)
    p.add_argument("every", type=int)
    p.add_argument("kind", choices=["ddp", "zero"])
    p.add_argument("out")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-s", type=float, default=0.0)
    p.add_argument("--replicated", default="shard")
    p.add_argument("--step-s", type=float, default=0.0)
    # DDP rebuilds its gradient buckets after a process's first iteration, so
    # the first step after any restart all-reduces in another layout; with 3+
    # ranks the ring's summation order (and rounding) follows the layout.
    # "manual" all-reduces each gradient alone, the same way every step.
    # "ddp-fixed": DDP(find_unused_parameters=True), which never rebuilds its
    # buckets, so every step (the first after a restart too) uses one layout.
    p.add_argument("--grad-sync", choices=["ddp", "ddp-fixed", "manual"], default="ddp")
    # bn: a BatchNorm layer; DDP broadcasts rank 0's running statistics at the
    # start of each forward, so at a checkpoint the ranks' buffers differ.
    p.add_argument("--model", choices=["mlp", "bn"], default="mlp")
    # The memory tier (test_memory_tier_modes.py): --tier for the
    # Checkpointer; --settle-kill-at S: after step S every rank waits until
    # its segment holds its newest commit, then all ranks SIGKILL themselves.
    p.add_argument("--tier", default="auto")
    p.add_argument("--settle-kill-at", type=int, default=-1)
    # The peer tier (test_peer_tier.py): --replicas for the Checkpointer (the
    # settle then also waits until the partners hold the newest commit);
    # --remote PATH: a remote tier on a shared path (the settle waits until
    # it holds a committed step too; with --settle-remote-step, that step:
    # test_peer_reshard.py).
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--remote", default=None)
    p.add_argument("--settle-remote-step", action="store_true")
    p.add_argument("--remote-close-s", type=float, default=600.0)
    p.add_argument("--stop-rebuild-rank", type=int, default=-1)
    a = p.parse_args()
    rank, world = start_rank(), dist.get_world_size()
    if rank == a.stop_rebuild_rank:  # a bug in this rank's reshard: not a checkpoint's failure
        def broken(*args, **kw):
            raise RuntimeError("a bug in this rank's rebuild")
        _distributed._rebuild = broken
    if a.model == "bn":
        model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1),
                              nn.Linear(64, 32))
    else:
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 32))
    if a.grad_sync == "manual":
        ddp = model
    else:
        ddp = nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=a.grad_sync == "ddp-fixed")
    if a.kind == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    torch.manual_seed(100 + rank)  # dropout differs per rank; restored per rank
    train = {"samples": 0}
    ckpt = nonstop.Checkpointer(a.dir, {"model": ddp, "optim": opt, "sched": sched,
                                        "train": train}, every=a.every, max_in_flight=2,
                                medium="buffered", writers=1, replicated=a.replicated,
                                staging_bytes=4 << 20, chunk_bytes=1 << 20,
                                dist_timeout_s=60, tier=a.tier, replicas=a.replicas,
                                remote=a.remote,
                                remote_options={"close_timeout_s": a.remote_close_s,
                                                "commit_timeout_s": a.remote_close_s}
                                if a.remote else None)
    if rank == a.slow_rank:
        real = ckpt.session.dist.started
        ckpt.session.dist.started = lambda engine: real(SlowCommits(engine, a.slow_s))
    r = ckpt.restore()
    rs = ckpt.stats()
    emit(event="start", rank=rank, restored=r, restored_from=rs.get("restored_from"),
         restored_from_per_rank=rs.get("restored_from_per_rank"),
         peer={k: v for k, v in rs.items() if k.startswith("peer_")},
         remote_restored_from=(rs.get("remote") or {}).get("restored_from"),
         memory_unused_because=rs.get("memory_unused_because"), params=digest(model.parameters()),
         optim=optim_by_param(opt), last_epoch=sched.last_epoch, samples=train["samples"],
         lr=[g["lr"] for g in opt.param_groups])
    start = 0 if r is None else r + 1
    stalls = []
    settle_at = a.settle_kill_at
    for s in range(start, a.steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 32, generator=g)
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.grad_sync == "manual":
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        sched.step()
        train["samples"] += 16
        before = ckpt.stats()["visible_stall_s"]
        ckpt.step(s)
        if ckpt.stats()["saves"] > 1:  # the first save creates the slot file
            stalls.append(ckpt.stats()["visible_stall_s"] - before)
        emit(event="step", rank=rank, step=s, loss=loss.item(), agreed=ckpt.latest(),
             rounds=ckpt.session.dist.rounds, t=time.time(),
             dt=time.perf_counter() - t0)
        if s == a.kill_at and rank == a.kill_rank:
            # The restart must find a checkpoint every rank committed: a
            # loaded box can start this step's checkpoint before any earlier
            # one committed (max_in_flight=2; they were all in flight, and a
            # restart from step 0 failed test_distributed under pytest -n 2).
            # Almost always one is agreed already, and nothing waits.
            end = time.monotonic() + 60
            while ckpt.latest() is None and time.monotonic() < end:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)  # mid-checkpoint: its copy/write is in flight
        if s == settle_at:
            from memwait import wait_mirrored
            wait_mirrored(ckpt)
            if a.settle_remote_step and not agreed_everywhere(ckpt, s):
                # Under load a rank can commit step s while it holds an
                # older candidate, and s is then never agreed (plan.h
                # DecideAgreement): settle at the next checkpoint instead.
                assert s + a.every < a.steps, f"no step from {a.settle_kill_at} on was agreed"
                settle_at = s + a.every
                continue
            peers = ckpt.session.dist.peers
            if peers is not None and peers.replicator is not None:
                newest = ckpt.session.live().latest()[1]
                end = time.monotonic() + 60
                while ckpt.stats().get("peer_last_step") != newest:
                    assert time.monotonic() < end, ckpt.stats()
                    peers.drain(5.0)
                    time.sleep(0.01)
            if a.remote:  # the remote tier holds a committed step (uploads follow the agreement)
                from nonstop import _remote
                end = time.monotonic() + 60
                remote = nonstop._core.RemoteTier(_remote.open_store(a.remote, {}))
                while not [st for st, _ in remote.committed_steps()
                           if st == s or not a.settle_remote_step]:
                    st = ckpt.stats()
                    assert time.monotonic() < end, (st.get("remote"), st["agreed_step"],
                                                    st["rounds"], st["agreement_error"])
                    time.sleep(0.05)
            dist.barrier()  # every rank's segment holds its newest commit
            emit(event="settled", rank=rank, step=s)
            os.kill(os.getpid(), signal.SIGKILL)
        if a.step_s:
            time.sleep(a.step_s)
    st = ckpt.stats()
    ckpt.close()
    agreed = ckpt.session.dist.agreed_step()
    local = opt.optim.state_dict() if a.kind == "zero" else opt.state_dict()
    opt_tensors = [v for _, stt in sorted(local["state"].items()) for _, v in sorted(stt.items())
                   if isinstance(v, torch.Tensor)]
    res = {"rank": rank, "restored": r, "params": digest(model.parameters()),
           "buffers": digest(model.buffers()),
           "optim": digest(opt_tensors), "samples": train["samples"], "agreed": agreed,
           "rng": digest([torch.get_rng_state()]), "visible_stall_s": st["visible_stall_s"],
           "max_step_stall_s": max(stalls) if stalls else 0.0, "rounds": st["rounds"],
           "lr": sched.get_last_lr(), "by_param": optim_by_param(opt)}
    if os.environ.get("NONSTOP_TEST_DUMP"):
        torch.save({"model": model.state_dict(), "optim": local}, f"{a.out}.rank-{rank}.pt")
    with open(f"{a.out}.rank-{rank}.json", "w") as f:
        json.dump(res, f)
    emit(event="done", rank=rank, agreed=agreed)
    end_rank()


if __name__ == "__main__":
    main()
