"""Overhead of checkpointing a PyTorch training loop on a GPU: nonstop
(concurrent mode, CUDA copy engine) vs torch.save vs DCP async_save
(torch.distributed.checkpoint), every 1, 10 and 50 steps, relative to no
checkpoints. Same model, same state ({"model", "optim"}: fp32 weights and
AdamW moments, on the GPU), same run. Prints a table, writes JSON.

    PYTHONPATH=build-gpu/pkg python3 bench/gpu_overhead.py --json $OUT/gpu_overhead.json

(`make test-gpu` builds nonstop._core and assembles build-gpu/pkg.)

Method (the interleaved-rounds loop of bench/suite_rounds.py, shared with
bench/torch_overhead.py and bench/suite_torch.py; docs/DESIGN.md "Measuring
on a noisy machine"):
- one process, one model; the schemes run interleaved, grouped by interval:
  none, nonstop/1, torch.save/1, dcp/1, none, nonstop/10, ..., none; the
  whole round is repeated --repeats times; the `none` runs give the drift;
- each run continues the same training; it starts with one unmeasured step
  and save (registration, pinning, thread start-up, file creation), then `every`
  warm-up steps (at least 3) with saves at the same cadence, so the window
  starts in steady state; then the measured window of steps (a multiple of
  `every`), timed by wall clock, loss.item() every step (as a logging loop
  does; it also keeps the host from running ahead of the GPU);
- throughput overhead = median step time / median `none` step time - 1;
- visible stall = time the training thread spent blocked in checkpoint calls
  (nonstop: save() and the optimizer pre-hook's wait for the D2H copy;
  torch.save: the call; DCP: async_save (it stages GPU tensors to host
  memory inside the call) plus waiting for the previous save's future);
- after the window, each scheme waits for its last save (drain, not in the
  step time).
Durability differs: nonstop fsyncs before it commits, DCP's FileSystemWriter
fsyncs its files (sync_files=True), torch.save does not fsync.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import nonstop
    from nonstop.demo import GPT
except ImportError:  # run from the repository: python/ holds the package
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import nonstop
    from nonstop.demo import GPT
sys.path.insert(0, HERE)
from suite_rounds import run_one, run_rounds, summarize  # noqa: E402

CONFIGS = {
    # name: vocab, dim, layers, heads (GPT-2 small / medium shapes)
    "125m": dict(vocab=32768, dim=768, layers=12, heads=12),
    "350m": dict(vocab=32768, dim=1024, layers=24, heads=16),
    "tiny": dict(vocab=1024, dim=128, layers=2, heads=4),
}


class Training:
    def __init__(self, size: str, batch: int, seq: int, device: str, seed: int = 0):
        torch.manual_seed(seed)
        cfg = dict(CONFIGS[size], seq=seq)
        self.device = device
        self.model = GPT(**cfg).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                     weight_decay=0.1)
        g = torch.Generator(device=device).manual_seed(seed)
        # A small pool of batches, made on the GPU: no host-side data loading.
        self.batches = [torch.randint(0, cfg["vocab"], (batch, seq + 1), device=device,
                                      generator=g) for _ in range(8)]
        self.step_no = 0

    def step(self) -> float:
        b = self.batches[self.step_no % len(self.batches)]
        self.step_no += 1
        loss = F.cross_entropy(self.model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.item()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def state_bytes(self) -> int:
        seen, n = set(), 0
        for t in list(self.model.state_dict().values()) + [
                v for st in self.opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                n += t.numel() * t.element_size()
        return n


def print_table(rows: list) -> None:
    hdr = (f"{'scheme':<22} {'ms/step':>8} {'spread':>7} {'thru ovh':>9} {'stall/ckpt':>11} "
           f"{'stall ovh':>10} {'drain s':>8} {'copy s':>7} {'persist s':>9} {'GB/s':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        extra = (f" {r['copy_s']:7.3f} {r['persist_s']:9.3f} {r['write_GBps']:6.2f}"
                 if "copy_s" in r else "")
        print(f"{r['scheme']:<22} {r['step_s'] * 1e3:8.1f} {r['spread'] * 100:6.1f}% "
              f"{r['throughput_overhead'] * 100:8.1f}% {r['stall_per_ckpt_s'] * 1e3:9.1f}ms "
              f"{r['stall_overhead'] * 100:9.2f}% {r['drain_s']:8.2f}" + extra)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="125m", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--schemes", nargs="+", default=["nonstop", "torch.save", "dcp"],
                   choices=["nonstop", "nonstop-fullstaging", "torch.save", "dcp"],
                   help="nonstop-fullstaging: nonstop with staging_bytes >= the state")
    p.add_argument("--intervals", nargs="+", type=int, default=[1, 10, 50])
    p.add_argument("--steps", type=int, default=8, help="measured steps at interval 1")
    p.add_argument("--periods", type=int, default=3,
                   help="measured saves at intervals > 1 (window = periods * interval, "
                        "at least --min-steps)")
    p.add_argument("--min-steps", type=int, default=30)
    p.add_argument("--none-steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tf32", type=int, default=1, help="TF32 matmuls (default on)")
    p.add_argument("--out", default="/tmp/nonstop-gpu-bench")
    p.add_argument("--json", default="runs/bench/gpu_overhead.json")
    p.add_argument("--time-budget", type=float, default=0,
                   help="start no run predicted (from the earlier runs of its scheme) to "
                        "end after this many seconds (the table then holds what ran)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a check of this script, not a measurement")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 0
    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    torch.backends.cudnn.allow_tf32 = bool(args.tf32)
    warnings.filterwarnings("ignore", message=r".*(overwrit|torch\.distributed is disabled)")
    os.makedirs(args.out, exist_ok=True)
    tr = Training(args.size, args.batch, args.seq, args.device)
    dev_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    params = sum(p.numel() for p in {id(p): p for p in tr.model.parameters()}.values())
    for _ in range(3):
        tr.step()
    state = tr.state_bytes()
    print(f"{dev_name}, torch {torch.__version__}, nonstop build "
          f"{nonstop.build_info()}\nmodel {args.size}: {params / 1e6:.1f}M parameters, batch "
          f"{args.batch} x seq {args.seq}, tf32 {args.tf32}; checkpointed state "
          f"{state / 1e9:.2f} GB (fp32 weights + AdamW moments); dir {args.out}", flush=True)
    staging_full = (state + (64 << 20)) // (4 << 20) * (4 << 20)

    def window(kind: str, every: int) -> int:
        if kind == "none":
            return args.none_steps
        if every == 1:
            return args.steps
        return max(args.min_steps, args.periods * every) // every * every

    runs = []

    def dump(rows=None):
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "device": dev_name,
                       "params": params, "state_bytes": state, "runs": runs, "rows": rows,
                       "wall_s": time.perf_counter() - t_start}, f, indent=1)

    def one(kind: str, every: int) -> dict:
        # A staging pool that holds the whole state for nonstop-fullstaging:
        # the D2H copy never waits for the writers (the default is 256 MiB).
        opts = {"staging_bytes": staging_full} if kind == "nonstop-fullstaging" else {}
        r = run_one(kind, every, window(kind, every), lambda s: tr.step(),
                    {"model": tr.model, "optim": tr.opt}, args.out, tr.step_no,
                    nonstop_opts=opts, fsync=False, sync=tr.sync,
                    warmup=max(3, every) if kind != "none" else 3)
        r.pop("next_step")
        r["scheme"] = kind if kind == "none" else f"{kind}/{every}"
        runs.append(r)
        dump()  # what ran so far survives a kill
        return r

    def label(r):
        return (f"{r['scheme']:<22} {r['step_s'] * 1e3:7.1f} ms/step  stall "
                f"{r['stall_per_ckpt_s'] * 1e3:8.1f} ms/ckpt ({r['saves']} saves)  drain "
                f"{r['drain_s']:.2f} s" + (f"  persist {r['persist_s']:.2f} s" if "persist_s" in r
                                           else "")
                + (f", {r['write_GBps']:.2f} GB/s" if "write_GBps" in r else ""))

    res = run_rounds([[(k, e) for k in args.schemes] for e in args.intervals], args.repeats, one,
                     label=label, deadline=(t_start + args.time_budget if args.time_budget
                                            else None))
    if res["stopped"]:
        print(f"  --time-budget {args.time_budget:.0f} s: {res['stopped']}")
    rows = summarize(runs)[0]
    print(f"\n{args.size} ({params / 1e6:.1f}M params, {state / 1e9:.2f} GB state; 'none' drift "
          f"between its runs: {rows[0]['none_drift'] * 100:.1f}%)")
    print_table(rows)
    print("\nthru ovh: median wall time per step vs 'none'; stall ovh: time blocked in "
          "checkpoint calls per step / 'none' step time; spread: (max-min)/median over rounds; "
          "drain: wait for the last save after the window.")
    dump(rows)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
