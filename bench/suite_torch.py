"""Real PyTorch training loops for bench/suite.py: nonstop against the
checkpointers a PyTorch user would otherwise pick, on the GPT models of
nonstop.demo (~10M and ~100M parameters), at several checkpoint intervals.

    .venv/bin/python bench/suite_torch.py --model 10m --intervals 1 5 25 --rounds 2 \
        --json runs/suite/torch-10m.json

Schemes (each run continues the same training, so the state keeps changing):
  none              no checkpoints
  torch.save        torch.save of the state dicts to one file, then fsync: the
                    call blocks until the bytes are durable (sync)
  dcp               torch.distributed.checkpoint.async_save; the previous
                    save's future is awaited before the next (as DCP's docs say)
  torchsnapshot     torchsnapshot.Snapshot.async_take; the previous pending
                    snapshot is awaited before the next
  nonstop           nonstop.Checkpointer, mode concurrent (PCcheck)
  nonstop-layerwise mode="layerwise" (LightCheck), when the front end accepts it
  nonstop-multistep mode="multistep" (GoCkpt), when the front end accepts it

Measured per run: wall time per step, the visible stall (time the training
thread spent inside the checkpoint calls and waits), the time from a save's
start until it is durable (persist), and CPU seconds per step. Runs are
interleaved (bench/suite_rounds.py): each round runs none, every scheme at
the first interval, none, every scheme at the next, ..., none; the drift
between the `none` runs is reported. Each run first takes one unmeasured
checkpoint and waits for it. --budget-s stops before a run predicted to end
past the budget; the JSON says where ("stopped") and each row how many runs,
steps and checkpoints it comes from.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
from nonstop.demo import CONFIGS, make_training, n_params, train_step  # noqa: E402
from nonstop.errors import CheckpointMismatchError  # noqa: E402
from suite_rounds import Saver, run_one, run_rounds, summarize  # noqa: E402

ALL_SCHEMES = ["torch.save", "dcp", "torchsnapshot", "nonstop", "nonstop-layerwise",
               "nonstop-multistep"]


def log(msg: str) -> None:
    print(msg, flush=True)


def available(kind: str, train, args) -> str:
    """'' when the scheme can run here, else why not."""
    if kind == "torchsnapshot":
        try:
            import torchsnapshot  # noqa: F401
        except ImportError:
            return "torchsnapshot is not installed (pip install torchsnapshot)"
    if kind in ("nonstop-layerwise", "nonstop-multistep"):
        d = os.path.join(args.dir, "probe-" + kind)
        try:
            s = Saver(kind, state_of(train), d, 1, args.nonstop_opts)
            s.ckpt.close()
        except (CheckpointMismatchError, TypeError, ValueError) as e:
            return f"mode not accepted by this front end yet: {e}"
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return ""


def state_of(train) -> dict:
    cfg, model, opt, sched = train
    return {"model": model, "optim": opt, "sched": sched}


def steps_for(kind: str, every: int, args) -> int:
    """Measured steps of one run: --steps, at least --min-ckpts checkpoints,
    a whole number of intervals (so every run holds steps / every saves)."""
    if kind == "none":
        return args.none_steps or args.steps
    n = max(args.steps, args.min_ckpts * every)
    return -(-n // every) * every


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="10m", choices=sorted(CONFIGS))
    p.add_argument("--schemes", nargs="+", default=ALL_SCHEMES, choices=ALL_SCHEMES)
    p.add_argument("--intervals", nargs="+", type=int, default=[1, 5, 25])
    p.add_argument("--steps", type=int, default=12, help="measured steps per run, at least")
    p.add_argument("--none-steps", type=int, default=0,
                   help="measured steps of the `none` runs (default --steps)")
    p.add_argument("--min-ckpts", type=int, default=2, help="checkpoints per run, at least")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=0,
                   help="start no run predicted to end after this many seconds (0: none); "
                        "the JSON then holds the runs that fitted and says where it stopped")
    p.add_argument("--deadline", type=float, default=0,
                   help="like --budget-s, as a time.time() value (the caller's budget, "
                        "counting this process's start-up)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-in-flight", type=int, default=2)
    p.add_argument("--parts", type=int, default=0,
                   help="K of nonstop-multistep (0: the front end's default, 7)")
    p.add_argument("--config", default=None, help="nonstop tune config for the nonstop schemes")
    p.add_argument("--batch", type=int, default=None, help="override the model's batch size")
    p.add_argument("--seq", type=int, default=None, help="override the model's sequence length")
    p.add_argument("--dir", default="runs/suite/torch")
    p.add_argument("--json", default="runs/suite/torch.json")
    args = p.parse_args()
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s if args.budget_s > 0 else None
    if args.deadline > 0:
        d = t_start + (args.deadline - time.time())
        deadline = d if deadline is None else min(deadline, d)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=r".*(overwrit|torch\.distributed is disabled)")
    args.nonstop_opts = {"max_in_flight": args.max_in_flight}
    if args.config:
        args.nonstop_opts = {"config": args.config}
    os.makedirs(args.dir, exist_ok=True)
    for key in ("batch", "seq"):
        if getattr(args, key):
            CONFIGS[args.model][key] = getattr(args, key)
    train = make_training(args.model, 100_000)
    params = n_params(train[1])
    skipped = {}
    schemes = []
    for kind in args.schemes:
        why = available(kind, train, args)
        if why:
            skipped[kind] = why
            log(f"  skip {kind}: {why}")
        else:
            schemes.append(kind)
    log(f"  {args.model}: {params / 1e6:.1f}M parameters, batch {CONFIGS[args.model]['batch']} x "
        f"seq {CONFIGS[args.model]['seq']}, torch threads {args.threads}, schemes "
        f"{' '.join(schemes)}, intervals {args.intervals}, {args.rounds} rounds, steps per run "
        + ", ".join(f"f={f}: {steps_for('x', f, args)}" for f in args.intervals)
        + f", none: {steps_for('none', 0, args)} (setup {time.perf_counter() - t_start:.0f} s)")
    cfg, model, opt, sched = train
    state = state_of(train)
    pos = {"step": 0}

    def one(kind: str, every: int) -> dict:
        opts = dict(args.nonstop_opts)
        if kind == "nonstop-multistep" and args.parts:
            opts["parts"] = args.parts
        r = run_one(kind, every, steps_for(kind, every, args),
                    lambda s: train_step(cfg, model, opt, sched, s), state, args.dir,
                    pos["step"], nonstop_opts=opts)
        pos["step"] = r.pop("next_step")
        return r

    res = run_rounds([[(k, f) for k in schemes] for f in args.intervals], args.rounds, one,
                     log=log, deadline=deadline)
    runs = res["runs"]
    rows, drift, base = summarize(runs)
    out = {"model": args.model, "params": params, "config": CONFIGS[args.model],
           "torch": torch.__version__, "threads": args.threads, "cores": os.cpu_count(),
           "intervals": args.intervals, "rounds": args.rounds, "none_step_s": base,
           "none_drift": drift, "skipped": skipped, "rows": rows, "runs": runs,
           "nonstop_opts": args.nonstop_opts, "stopped": res["stopped"], "parts": args.parts,
           "budget_s": args.budget_s, "wall_s": time.perf_counter() - t_start,
           "steps_per_run": {str(f): steps_for("x", f, args) for f in args.intervals},
           "none_steps_per_run": steps_for("none", 0, args)}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
