"""Overhead of checkpointing a PyTorch training loop: nonstop vs torch.save vs
torch.distributed.checkpoint.async_save (DCP), every 1 and every k steps,
relative to no checkpoints. Prints a table and writes JSON.

    .venv/bin/python bench/torch_overhead.py --models 10m 100m --repeats 2

Method (docs: DESIGN.md, "Measuring on a noisy machine"):
- one process, one model per size; the schemes run interleaved
  (none, nonstop/1, nonstop/k, torch.save/1, ..., none) and the whole round
  is repeated; the `none` runs at the start and end of each round give the
  drift, printed next to the ratios;
- each run is `--steps` training steps after `--warmup` unmeasured ones,
  continuing the same training (the state keeps changing);
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
import resource
import shutil
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import nonstop  # noqa: E402
from nonstop.demo import CONFIGS, make_training, n_params, train_step  # noqa: E402


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Scheme:
    """One way of checkpointing every `every` steps (every=0: never)."""

    def __init__(self, kind: str, every: int, out: str):
        self.kind, self.every, self.out = kind, every, out
        self.name = "none" if kind == "none" else f"{kind}/{every}"

    def run(self, train, steps: int, warmup: int, first_step: int) -> dict:
        cfg, model, opt, sched = train
        d = os.path.join(self.out, self.name.replace("/", "-"))
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d, exist_ok=True)
        ckpt, fut, stall, saves = None, None, 0.0, 0
        if self.kind == "nonstop":
            ckpt = nonstop.Checkpointer(os.path.join(d, "ckpt"), {"model": model, "optim": opt,
                                                                   "sched": sched},
                                        every=self.every)
        # One unmeasured save first: registration, slot-file creation and
        # thread start-up are one-time costs, for every scheme.
        if self.kind != "none":
            self.save_once(model, opt, sched, ckpt, d, first_step - 1, wait=True)
        t_begin = c_begin = None
        for i in range(warmup + steps):
            s = first_step + i
            if i == warmup:
                t_begin, c_begin = time.perf_counter(), cpu_s()
                stall, saves = 0.0, 0
                if ckpt is not None:
                    stall0 = ckpt.stats()["visible_stall_s"]
            train_step(cfg, model, opt, sched, s)
            if self.kind == "none" or (i + 1) % self.every:
                continue
            saves += 1
            t0 = time.perf_counter()
            fut = self.save_once(model, opt, sched, ckpt, d, s, fut=fut)
            stall += time.perf_counter() - t0
        wall = time.perf_counter() - t_begin
        cpu = cpu_s() - c_begin
        res = {"scheme": self.name, "steps": steps, "step_s": wall / steps, "cpu_per_step_s":
               cpu / steps, "saves": saves}
        t0 = time.perf_counter()
        if ckpt is not None:
            stall = ckpt.stats()["visible_stall_s"] - stall0
            ckpt.wait()
            st = ckpt.stats()
            rec = [r for r in st["recent"] if r["committed"]][-max(1, saves):]
            res.update(copy_s=statistics.mean(r["copy_s"] for r in rec),
                       persist_s=statistics.mean(r["persist_s"] for r in rec),
                       write_GBps=statistics.mean(r["write_GBps"] for r in rec),
                       ckpt_bytes=rec[-1]["bytes"], medium=st["medium"],
                       engine_stall_s=st["stall_s_total"])
            ckpt.close()
        if fut is not None:
            fut.result()
        res["drain_s"] = time.perf_counter() - t0  # after the last step; not in step_s
        res["stall_per_step_s"] = stall / steps
        res["stall_per_ckpt_s"] = stall / saves if saves else 0.0
        shutil.rmtree(d, ignore_errors=True)
        return res


    def save_once(self, model, opt, sched, ckpt, d, s, fut=None, wait=False):
        if self.kind == "nonstop":
            ckpt.save(s)
            if wait:
                ckpt.wait()
        elif self.kind == "torch.save":
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                        "sched": sched.state_dict()}, os.path.join(d, "ckpt.pt"))
        elif self.kind == "dcp":
            import torch.distributed.checkpoint as dcp
            if fut is not None:
                fut.result()  # the previous save must finish first (DCP docs)
            fut = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                 checkpoint_id=os.path.join(d, f"step{s % 2}"))
            if wait:
                fut.result()
                fut = None
        return fut


def bench_model(size: str, args) -> dict:
    torch.manual_seed(0)
    train = make_training(size, 10_000)
    params = n_params(train[1])
    schemes = [Scheme("none", 0, args.out)]
    for kind in args.schemes:
        for every in (1, args.every):
            schemes.append(Scheme(kind, every, args.out))
    steps = args.steps if size != "100m" else args.steps_100m
    print(f"\n== {size}: {params / 1e6:.1f}M parameters, {steps} measured steps per run, "
          f"{args.repeats} rounds, torch threads {args.threads}", flush=True)
    runs, step = [], 0
    for rnd in range(args.repeats):
        for sc in schemes + [schemes[0]]:
            r = sc.run(train, steps, args.warmup, step)
            step += steps + args.warmup
            r["round"] = rnd
            runs.append(r)
            print(f"  round {rnd} {r['scheme']:<14} {r['step_s']:.3f} s/step  stall "
                  f"{r['stall_per_step_s'] * 1e3:8.1f} ms/step  cpu {r['cpu_per_step_s']:.2f} "
                  f"s/step", flush=True)
    return {"size": size, "params": params, "config": CONFIGS[size], "runs": runs}


def summarize(res: dict) -> list:
    runs = res["runs"]
    none = [r["step_s"] for r in runs if r["scheme"] == "none"]
    base = statistics.median(none)
    drift = (max(none) - min(none)) / base
    rows = []
    for name in dict.fromkeys(r["scheme"] for r in runs):
        rs = [r for r in runs if r["scheme"] == name]
        st = [r["step_s"] for r in rs]
        med = statistics.median(st)
        stall = statistics.median(r["stall_per_step_s"] for r in rs)
        row = {"scheme": name, "step_s": med, "spread": (max(st) - min(st)) / med,
               "throughput_overhead": med / base - 1, "stall_per_step_s": stall,
               "stall_overhead": stall / base,
               "stall_per_ckpt_s": statistics.median(r["stall_per_ckpt_s"] for r in rs),
               "cpu_per_step_s": statistics.median(r["cpu_per_step_s"] for r in rs),
               "none_drift": drift}
        for k in ("copy_s", "persist_s", "write_GBps"):
            if k in rs[0]:
                row[k] = statistics.median(r[k] for r in rs)
        rows.append(row)
    return rows


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
        res["rows"] = summarize(res)
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
