"""Overhead of checkpointing a PyTorch training loop: nonstop vs torch.save vs
torch.distributed.checkpoint.async_save (DCP), every 1 and every k steps,
relative to no checkpoints. Prints a table and writes JSON.

    .venv/bin/python bench/torch_overhead.py --models 10m 100m --repeats 2

Method (docs: DESIGN.md, "Measuring on a noisy machine"):
- one process, one model per size; the schemes run interleaved
  (none, nonstop/1, torch.save/1, dcp/1, none, nonstop/k, ..., none; the
  loop of bench/suite_rounds.py, shared with suite_torch.py and
  gpu_overhead.py) and the whole round is repeated; the `none` runs give
  the drift, printed next to the ratios;
- each run is one unmeasured warm-up step and save (waited for), `--warmup`
  unmeasured steps, then `--steps` measured training steps, continuing the
  same training (the state keeps changing); torch.save does not fsync here;
- throughput is wall time per step; the *visible stall* is the time the
  training thread spent blocked in the checkpointing calls (nonstop:
  save() and the optimizer pre-hook's wait; torch.save: the call; DCP: the
  async_save call plus waiting for the previous save's future, as its docs
  say to); CPU seconds per step (this process, all threads) show how much
  the background work competes with torch for the cores;
- torch runs with --threads threads (default 1, leaving a core for the
  checkpoint engine); say so when quoting numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
from nonstop.demo import CONFIGS, make_training, n_params, train_step  # noqa: E402
from suite_rounds import run_one, run_rounds, summarize  # noqa: E402


def bench_model(size: str, args) -> dict:
    """Interleaved rounds (bench/suite_rounds.py): none, every scheme every 1
    step, none, every scheme every k steps, none; --repeats rounds."""
    torch.manual_seed(0)
    cfg, model, opt, sched = make_training(size, 10_000)
    params = n_params(model)
    steps = args.steps if size != "100m" else args.steps_100m
    print(f"\n== {size}: {params / 1e6:.1f}M parameters, {steps} measured steps per run, "
          f"{args.repeats} rounds, torch threads {args.threads}", flush=True)
    state = {"model": model, "optim": opt, "sched": sched}
    pos = {"step": 0}

    def one(kind: str, every: int) -> dict:
        # torch.save without fsync here (what most jobs do); suite_torch.py fsyncs.
        r = run_one(kind, every, steps, lambda s: train_step(cfg, model, opt, sched, s), state,
                    args.out, pos["step"], fsync=False, warmup=args.warmup)
        pos["step"] = r.pop("next_step")
        r["scheme"] = kind if kind == "none" else f"{kind}/{every}"
        return r

    res = run_rounds([[(k, e) for k in args.schemes] for e in (1, args.every)], args.repeats,
                     one, label=lambda r: (f"{r['scheme']:<14} {r['step_s']:.3f} s/step  stall "
                                           f"{r['stall_per_step_s'] * 1e3:8.1f} ms/step  cpu "
                                           f"{r['cpu_per_step_s']:.2f} s/step"))
    return {"size": size, "params": params, "config": CONFIGS[size], "runs": res["runs"]}


def print_table(res: dict, rows: list) -> None:
    print(f"\n{res['size']} ({res['params'] / 1e6:.1f}M params; 'none' drift between its runs: "
          f"{rows[0]['none_drift'] * 100:.1f}%)")
    hdr = (f"{'scheme':<14} {'s/step':>7} {'spread':>7} {'thru ovh':>9} {'stall/ckpt':>11} "
           f"{'stall ovh':>10} {'cpu s/step':>10} {'copy s':>7} {'persist s':>9} {'GB/s':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        extra = (f" {r['copy_s']:7.3f} {r['persist_s']:9.3f} {r['write_GBps']:5.2f}"
                 if "copy_s" in r else "")
        print(f"{r['scheme']:<14} {r['step_s']:7.3f} {r['spread'] * 100:6.1f}% "
              f"{r['throughput_overhead'] * 100:8.1f}% {r['stall_per_ckpt_s'] * 1e3:9.1f}ms "
              f"{r['stall_overhead'] * 100:9.2f}% {r['cpu_per_step_s']:10.2f}" + extra)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["10m", "100m"], choices=sorted(CONFIGS))
    p.add_argument("--schemes", nargs="+", default=["nonstop", "torch.save", "dcp"],
                   choices=["nonstop", "torch.save", "dcp"])
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--steps", type=int, default=20, help="measured steps per run (10m)")
    p.add_argument("--steps-100m", type=int, default=10, help="measured steps per run (100m)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--json", default="runs/bench/torch_overhead.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # DCP's notes about running without a process group and overwriting.
    warnings.filterwarnings("ignore", message=r".*(overwrit|torch\.distributed is disabled)")
    for cfg in CONFIGS.values():
        cfg.update(batch=args.batch, seq=args.seq)
    os.makedirs(args.out, exist_ok=True)
    results = []
    for size in args.models:
        res = bench_model(size, args)
        res["rows"] = summarize(res["runs"])[0]
        results.append(res)
    for res in results:
        print_table(res, res["rows"])
    print("\nthru ovh: median wall time per step vs 'none'; stall ovh: time blocked in "
          "checkpoint calls per step / 'none' step time; spread: (max-min)/median over rounds.")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "torch": torch.__version__, "cores": os.cpu_count(),
                   "results": results}, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
