"""Layer-wise checkpoints (LightCheck) against concurrent (PCcheck) and a
whole-model-then-wait scheme (CheckFreq-PM in LightCheck's paper), at
checkpoint intervals 1, 2, 5, 10: throughput relative to no checkpoints and
the visible stall per checkpoint. Prints tables and writes JSON.

    .venv/bin/python bench/layerwise_bench.py --json runs/layerwise_bench.json

Two loops:

* synthetic: L layer tensors (--state-mib in all); a step is a "forward"
  (sleep, standing in for device compute), then a "backward" that visits the
  layers in reverse, sleeping its share of --step-ms per layer and then
  updating that layer's tensor in place (an add over every element, on this
  thread). Driven through the engine directly.
* torch: a small GPT (nonstop.demo's model; --torch-size) trained with AdamW
  through nonstop.Checkpointer, the loop unchanged between schemes.

Schemes:
  none        no checkpoints
  layerwise   mode="layerwise": a layer's copy starts right after its update;
              its next update waits for that copy alone
  concurrent  mode="concurrent": the checkpoint starts after the step; the
              next step's first update waits until every tensor is copied
  wholewait   like concurrent, but the training thread waits right after
              starting the checkpoint until the whole model is copied
              (CheckFreq-PM: snapshot the whole model, then persist in the
              background)
  layerwise_prev  (torch loop, with --compare-layerwise FILE) mode="layerwise"
              driven by another version of python/nonstop/_layerwise.py, e.g.
              `git show REV:python/nonstop/_layerwise.py > /tmp/lw_prev.py`:
              before/after comparisons in one interleaved run

Method (DESIGN.md, "Measuring on a noisy machine"): schemes interleaved in
every round, `none` at the start and end of each round (its drift printed),
medians over rounds; the visible stall is the time the training thread spent
inside nonstop calls and hooks. torch runs with one thread (leaving a core
for the engine).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import nonstop  # noqa: E402

SCHEMES = ["layerwise", "concurrent", "wholewait"]
_PREV = None  # the Layerwise class of --compare-layerwise


def load_prev_layerwise(path: str):
    """Layerwise from another version of _layerwise.py, as a module of the package."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("nonstop._layerwise_prev", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.Layerwise


# ------------------------------------------------------------------ synthetic

def synthetic_run(args, kind: str, every: int, tensors, d: str) -> dict:
    """One run of the synthetic loop; returns wall time and stall."""
    eng = None
    n = len(tensors)
    fwd_s = args.step_ms / 1000 / 3
    bwd_s = args.step_ms / 1000 * 2 / 3 / n
    if kind != "none":
        shutil.rmtree(d, ignore_errors=True)
        eng = nonstop._core.Engine(d, max_in_flight=args.max_in_flight, medium=args.medium,
                                   layer_copy=args.copy, writers=args.writers)
        eng.register([(f"layer{i}", 7, list(t.shape), t.numel() * 4, t.data_ptr(), 0, 0, 0,
                       False) for i, t in enumerate(tensors)])
    stall = 0.0
    ckpts = 0
    pending = [False] * n
    whole_pending = False
    t_start = time.perf_counter()
    for s in range(args.steps):
        due = kind != "none" and (s + 1) % every == 0
        time.sleep(fwd_s)  # forward
        counter = None
        if due and kind == "layerwise":
            t0 = time.perf_counter()
            counter = eng.begin_checkpoint(s)
            stall += time.perf_counter() - t0
        for i in reversed(range(n)):  # backward, layer by layer
            time.sleep(bwd_s)
            t0 = time.perf_counter()
            if kind == "layerwise" and pending[i]:
                eng.wait_tensors_copied([i])
                pending[i] = False
            elif whole_pending:
                eng.wait_copied()
                whole_pending = False
            stall += time.perf_counter() - t0
            tensors[i].add_(1.0)  # the update of layer i
            if counter is not None:
                t0 = time.perf_counter()
                eng.copy_tensors(counter, [i])
                pending[i] = True
                stall += time.perf_counter() - t0
        if due:
            t0 = time.perf_counter()
            if kind == "layerwise":
                eng.end_checkpoint(counter, s, "{}")
            else:
                eng.checkpoint(s, "{}")
                if kind == "wholewait":
                    eng.wait_copied()
                else:
                    whole_pending = True
            stall += time.perf_counter() - t0
            ckpts += 1
    wall = time.perf_counter() - t_start
    if eng is not None:
        eng.wait_committed(0)
        st = eng.stats()
        eng.close()
        shutil.rmtree(d, ignore_errors=True)
        assert st["failed"] == 0, st
    return {"wall_s": wall, "stall_s": stall, "checkpoints": ckpts}


# ---------------------------------------------------------------------- torch

def make_torch(size: str):
    from nonstop.demo import GPT
    cfgs = {"5m": dict(vocab=4096, dim=256, layers=4, heads=8, seq=64, batch=4),
            "10m": dict(vocab=8192, dim=320, layers=6, heads=8, seq=64, batch=4)}
    cfg = cfgs[size]
    torch.manual_seed(0)
    model = GPT(**cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    return cfg, model, opt


def torch_step(cfg, model, opt, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def torch_run(args, kind: str, every: int, train, d: str, first: int) -> dict:
    cfg, model, opt = train
    ck = None
    if kind != "none":
        shutil.rmtree(d, ignore_errors=True)
        lw = dict(mode="layerwise", copy=args.copy) if kind.startswith("layerwise") else {}
        # The Checkpointer picks its mode's driver from _checkpointer._DRIVERS:
        # layerwise_prev swaps the layer-wise one there (a _layerwise.py from
        # before the drivers, without the Driver protocol, fails loudly).
        import nonstop._checkpointer as current
        cls = current._DRIVERS["layerwise"]
        if kind == "layerwise_prev":
            current._DRIVERS["layerwise"] = _PREV
        try:
            ck = nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=every,
                                      max_in_flight=args.max_in_flight, medium=args.medium,
                                      writers=args.writers, rng=False, **lw)
        finally:
            current._DRIVERS["layerwise"] = cls
    # Warm-up: caches, and the first checkpoint (registration, slot file) at
    # checkpoint step -1, so that every measured run starts alike; measured
    # steps are numbered 0.. so each interval checkpoints steps/every times.
    for i in range(-args.warmup, 0):
        torch_step(cfg, model, opt, first + args.warmup + i)
        if ck is not None:
            ck.step(i)
    if ck is not None:
        ck.wait()
    base = ck.stats()["visible_stall_s"] if ck is not None else 0.0
    saves0 = ck.stats()["saves"] if ck is not None else 0
    t_start = time.perf_counter()
    for i in range(args.torch_steps):
        torch_step(cfg, model, opt, first + args.warmup + i)
        if ck is not None:
            c = ck.step(i)
            if c is not None and kind == "wholewait":
                ck.wait_copied()  # counted in visible_stall_s
    wall = time.perf_counter() - t_start
    stall, ckpts = 0.0, 0
    if ck is not None:
        st = ck.stats()
        stall = st["visible_stall_s"] - base
        ckpts = st["saves"] - saves0
        ck.close()
        shutil.rmtree(d, ignore_errors=True)
        assert st["failed"] == 0, st
    return {"wall_s": wall, "stall_s": stall, "checkpoints": ckpts}


# ---------------------------------------------------------------------- table

def summarize(name: str, runs: dict, steps: int, intervals, schemes=SCHEMES) -> list:
    nones = runs["none"]
    none_med = statistics.median(r["wall_s"] for r in nones)
    drift = [abs(nones[i + 1]["wall_s"] - nones[i]["wall_s"]) / nones[i]["wall_s"]
             for i in range(0, len(nones) - 1, 2)]
    rows = []
    print(f"\n== {name}: {steps} steps per run, median of {len(nones) // 2} rounds; "
          f"none = {none_med / steps * 1000:.1f} ms/step, none drift within a round "
          f"{100 * max(drift):.1f} % max")
    print(f"{'scheme':<12}{'every':>6}{'throughput':>12}{'overhead':>10}"
          f"{'stall/ckpt ms':>15}{'spread ms':>11}")
    for every in intervals:
        for kind in schemes:
            rs = runs[(kind, every)]
            wall = statistics.median(r["wall_s"] for r in rs)
            per = [r["stall_s"] / max(1, r["checkpoints"]) * 1000 for r in rs]
            rel = none_med / wall
            row = {"loop": name, "scheme": kind, "every": every, "throughput_rel": rel,
                   "overhead_pct": (1 / rel - 1) * 100,
                   "stall_per_ckpt_ms": statistics.median(per),
                   "stall_per_ckpt_ms_min": min(per), "stall_per_ckpt_ms_max": max(per),
                   "wall_s": [r["wall_s"] for r in rs]}
            rows.append(row)
            print(f"{kind:<12}{every:>6}{rel:>12.3f}{row['overhead_pct']:>9.1f}%"
                  f"{row['stall_per_ckpt_ms']:>15.2f}{min(per):>6.1f}-{max(per):<5.1f}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/dev/shm/nonstop_layerwise_bench")
    p.add_argument("--medium", default="pmem")
    p.add_argument("--copy", default="host", choices=["host", "direct", "device"])
    p.add_argument("--max-in-flight", type=int, default=2)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--intervals", default="1,2,5,10")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loops", default="synthetic,torch")
    p.add_argument("--state-mib", type=int, default=64, help="synthetic: state size")
    p.add_argument("--layers", type=int, default=16, help="synthetic: layer tensors")
    p.add_argument("--step-ms", type=float, default=100, help="synthetic: compute per step")
    p.add_argument("--steps", type=int, default=20, help="synthetic: steps per run")
    p.add_argument("--torch-size", default="5m", choices=["5m", "10m"])
    p.add_argument("--torch-steps", type=int, default=10, help="torch: measured steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compare-layerwise", default=None, metavar="FILE",
                   help="torch: also run scheme layerwise_prev with this _layerwise.py")
    p.add_argument("--schemes", default=None, help="torch: comma-separated subset of schemes")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    intervals = [int(x) for x in args.intervals.split(",")]
    loops = args.loops.split(",")
    out = {"args": vars(args), "rows": [], "threads": 1, "load_before": os.getloadavg()}
    if "synthetic" in loops:
        per = args.state_mib * (1 << 20) // 4 // args.layers
        tensors = [torch.zeros(per) for _ in range(args.layers)]
        runs = {"none": []}
        for r in range(args.rounds):
            runs["none"].append(synthetic_run(args, "none", 0, tensors, ""))
            for every in intervals:
                for kind in SCHEMES:
                    res = synthetic_run(args, kind, every, tensors,
                                        os.path.join(args.dir, f"syn-{kind}-{every}"))
                    runs.setdefault((kind, every), []).append(res)
            runs["none"].append(synthetic_run(args, "none", 0, tensors, ""))
        out["rows"] += summarize(f"synthetic ({args.state_mib} MiB in {args.layers} layers, "
                                 f"{args.step_ms:g} ms compute/step, medium {args.medium}, "
                                 f"copy {args.copy})", runs, args.steps, intervals)
    if "torch" in loops:
        global _PREV
        schemes = list(SCHEMES)
        if args.compare_layerwise:
            _PREV = load_prev_layerwise(args.compare_layerwise)
            schemes.insert(1, "layerwise_prev")
        if args.schemes:
            schemes = [k for k in schemes if k in args.schemes.split(",")]
        train = make_torch(args.torch_size)
        nparams = sum(p.numel() for p in train[1].parameters())
        runs = {"none": []}
        first = 0
        per_run = args.warmup + args.torch_steps
        for r in range(args.rounds):
            runs["none"].append(torch_run(args, "none", 0, train, "", first))
            first += per_run
            for every in intervals:
                for kind in schemes:
                    res = torch_run(args, kind, every, train,
                                    os.path.join(args.dir, f"torch-{kind}-{every}"), first)
                    first += per_run
                    runs.setdefault((kind, every), []).append(res)
            runs["none"].append(torch_run(args, "none", 0, train, "", first))
            first += per_run
        out["rows"] += summarize(f"torch GPT {nparams / 1e6:.1f}M params, AdamW, 1 thread, "
                                 f"medium {args.medium}, copy {args.copy}", runs,
                                 args.torch_steps, intervals, schemes)
    out["load_after"] = os.getloadavg()
    print(f"load average before {out['load_before'][0]:.2f}, after {out['load_after'][0]:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
