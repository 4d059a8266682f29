"""`make demo`: train, get killed with SIGKILL, resume bit-identically.

    python -m nonstop.demo [--steps 60] [--every 10] [--out runs/demo]

Four runs of a GPT-like model, each a child process (`--worker`, so all are
measured alike and the kill is a real kill -9): the reference, torch.save
every `every` steps, nonstop killed at a random step after several
checkpoints, and nonstop resumed; then the bitwise check against the
reference, the table, the plot and summary.json (docs/PYTHON.md, "The demo").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import shutil
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import nonstop

from . import _state

# ------------------------------------------------------------------ the model

CONFIGS = {
    # name: vocab, dim, layers, heads, seq, batch
    "10m": dict(vocab=8192, dim=320, layers=6, heads=8, seq=64, batch=4),
    "100m": dict(vocab=16384, dim=768, layers=12, heads=12, seq=128, batch=8),
    "tiny": dict(vocab=256, dim=64, layers=2, heads=4, seq=32, batch=4),
}


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, seq, **_):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.01)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def batch_for_step(cfg: dict, step: int, seed: int = 0):
    """Deterministic synthetic tokens for `step`: a noisy walk through a fixed
    random permutation of the first 64 token ids, so the loss falls fast."""
    words = min(64, cfg["vocab"])
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(words, generator=g)
    g.manual_seed(seed * 1_000_003 + step + 1)
    b, t = cfg["batch"], cfg["seq"] + 1
    noise = torch.rand(b, t, generator=g) < 0.1
    rnd = torch.randint(0, words, (b, t), generator=g)
    toks = torch.empty(b, t, dtype=torch.long)
    toks[:, 0] = rnd[:, 0]
    for i in range(1, t):
        toks[:, i] = torch.where(noise[:, i], rnd[:, i], perm[toks[:, i - 1]])
    return toks[:, :-1], toks[:, 1:]


def make_training(size: str = "10m", total_steps: int = 60, seed: int = 0):
    """Model, AdamW, warm-up + cosine schedule; identical for a given seed."""
    cfg = CONFIGS[size]
    torch.manual_seed(seed)
    model = GPT(**cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=3e-3,
                            betas=(0.9, 0.95))
    warmup = max(1, total_steps // 6)

    def lr_at(s):
        if s < warmup:
            return (s + 1) / warmup
        cosine = math.cos(math.pi * (s - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + cosine)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    return cfg, model, opt, sched


def train_step(cfg, model, opt, sched, step, seed=0) -> float:
    x, y = batch_for_step(cfg, step, seed)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def n_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ----------------------------------------------------------------- the worker

def emit(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def dump_final(path: str, state: dict) -> None:
    """Every tensor of `state` (safetensors) and the rest (JSON): no pickle."""
    from safetensors.torch import save_file

    tensors: dict = {}
    tree = {k: _state.flatten(v.state_dict(), k, tensors) for k, v in state.items()}
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, path + ".safetensors")
    with open(path + ".json", "w") as f:
        f.write(_state.dumps(tree))


def worker(args) -> None:
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    cfg, model, opt, sched = make_training(args.size, args.steps, args.seed)
    emit(event="ready", params=n_params(model), since_start_s=time.perf_counter() - t_start)
    ckpt, start = None, 0
    if args.mode == "nonstop":
        ckpt = nonstop.Checkpointer(os.path.join(args.out, "ckpt"),
                                    state={"model": model, "optim": opt, "sched": sched},
                                    every=args.every)
        t0 = time.perf_counter()
        restored = ckpt.restore()
        if restored is not None:
            start = restored + 1
            emit(event="restored", step=restored, restore_s=time.perf_counter() - t0,
                 since_start_s=time.perf_counter() - t_start,
                 restored_from=ckpt.stats().get("restored_from", "disk"))
    torch_path = os.path.join(args.out, "torchsave", "ckpt.pt")
    baseline = None  # the baseline's due rule: the C++ Schedule, as nonstop's every=N
    if args.mode == "torchsave":
        os.makedirs(os.path.dirname(torch_path), exist_ok=True)
        baseline = nonstop._core.Schedule.every(args.every)
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        stall_before = ckpt.stats()["visible_stall_s"] if ckpt else 0.0
        loss = train_step(cfg, model, opt, sched, step, args.seed)
        saved, stall = False, 0.0
        if ckpt is not None:
            saved = ckpt.step(step) is not None
            stall = ckpt.stats()["visible_stall_s"] - stall_before
        elif baseline is not None and baseline.due_after(step):
            ts = time.perf_counter()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                        "sched": sched.state_dict()}, torch_path)
            saved, stall = True, time.perf_counter() - ts
        emit(event="step", step=step, loss=loss, dt=time.perf_counter() - t0, saved=saved,
             stall=stall)
    if ckpt is not None:
        ckpt.close()
    dump_final(os.path.join(args.out, f"final-{args.tag}"),
               {"model": model, "optim": opt, "sched": sched})
    emit(event="done")


# ----------------------------------------------------------------- the parent

class Run:
    """One child training process, read line by line."""

    def __init__(self, args, mode: str, tag: str, label: str, kill_at: int | None = None):
        self.mode, self.tag, self.label, self.kill_at = mode, tag, label, kill_at
        self.steps: dict = {}  # step -> event
        self.events: list = []
        self.killed_after = None
        cmd = [sys.executable, "-m", "nonstop.demo", "--worker", "--mode", mode, "--tag", tag,
               "--steps", str(args.steps), "--every", str(args.every), "--out", args.out,
               "--size", args.size, "--seed", str(args.seed), "--threads", str(args.threads)]
        self.t_spawn = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.deadline = self.t_spawn + args.timeout

    def follow(self, progress) -> "Run":
        for line in self.proc.stdout:
            if time.perf_counter() > self.deadline:
                self.proc.kill()
                raise SystemExit(f"demo: {self.label} ran past --timeout; killed it")
            ev = json.loads(line)
            ev["t"] = time.perf_counter() - self.t_spawn
            self.events.append(ev)
            if ev["event"] == "step":
                self.steps[ev["step"]] = ev
                progress(self, ev)
                if self.kill_at is not None and ev["step"] == self.kill_at:
                    os.kill(self.proc.pid, signal.SIGKILL)
                    self.killed_after = ev["step"]
                    progress(self, {"event": "killed", "step": ev["step"]})
                    break
        rc = self.proc.wait(timeout=max(1, self.deadline - time.perf_counter()))
        if self.kill_at is None and rc != 0:
            raise SystemExit(f"demo: {self.label} failed with exit status {rc}")
        return self

    def event(self, name):
        return next((e for e in self.events if e["event"] == name), None)


def steps_per_s(runs) -> float:
    steps = [r.steps[s] for r in runs for s in sorted(r.steps)[2:]]  # after each run's warm-up
    return len(steps) / sum(e["dt"] for e in steps) if steps else float("nan")


def mean_stall(runs) -> float:
    stalls = [e["stall"] for r in runs for e in r.steps.values() if e["saved"]]
    return sum(stalls) / len(stalls) if stalls else float("nan")


def compare_final(out: str, a: str, b: str) -> tuple[bool, str]:
    from safetensors.torch import load_file
    ta = load_file(os.path.join(out, f"final-{a}.safetensors"))
    tb = load_file(os.path.join(out, f"final-{b}.safetensors"))
    if set(ta) != set(tb):
        return False, f"different tensors: {sorted(set(ta) ^ set(tb))[:3]}"
    for name in ta:
        x, y = ta[name], tb[name]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            diff = (x.double() - y.double()).abs().max().item() if x.shape == y.shape else "-"
            return False, f"tensor {name!r} differs (max abs diff {diff})"
    with open(os.path.join(out, f"final-{a}.json")) as f1, \
            open(os.path.join(out, f"final-{b}.json")) as f2:
        if f1.read() != f2.read():
            return False, "non-tensor state (param groups, scheduler) differs"
    nbytes = sum(t.numel() * t.element_size() for t in ta.values())
    return True, f"{len(ta)} tensors, {nbytes / 1e6:.1f} MB, bitwise identical"


def plot(path: str, ref: Run, crashed: Run, resumed: Run, restored_step: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, color, lw, ls, label in ((ref, "0.6", 3, "-", "reference (no crash)"),
                                      (crashed, "C3", 1.3, "-", "nonstop run, killed"),
                                      (resumed, "C0", 1.3, "--", "nonstop run, resumed")):
        steps = sorted(run.steps)
        ax.plot(steps, [run.steps[s]["loss"] for s in steps], color=color, lw=lw, ls=ls,
                label=label)
    killed = crashed.killed_after
    ax.axvspan(restored_step, killed, color="C3", alpha=0.08, label="steps lost, trained again")
    for x, color, dy, ha, text in ((killed, "C3", -14, "left", f"SIGKILL after step {killed}"),
                                   (restored_step, "C0", -28, "right",
                                    f"resumed from checkpoint at step {restored_step}")):
        ax.axvline(x, color=color, ls=":", lw=1)
        ax.annotate(text, (x, ax.get_ylim()[1]), textcoords="offset points",
                    xytext=(4 if ha == "left" else -4, dy), color=color, fontsize=8, ha=ha)
    saved = [s for s in sorted(crashed.steps) if crashed.steps[s]["saved"]]
    ax.plot(saved, [crashed.steps[s]["loss"] for s in saved], "o", color="C3", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("nonstop: kill -9 and bit-identical resume")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nonstop.demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--size", choices=sorted(CONFIGS), default="10m")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--kill-seed", type=int, default=None, help="seed of the random kill step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per training process")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    p.add_argument("--tag", default="x", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.steps < 4 * args.every:
        p.error("--steps must be at least 4 * --every (the kill comes after several checkpoints)")
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    rng = random.Random(args.kill_seed)
    # After at least 3 checkpoints; anywhere in a step, so sometimes while a
    # checkpoint is in flight.
    kill_at = rng.randrange(3 * args.every, args.steps - 2)
    print(f"nonstop demo: {args.size} GPT, {args.steps} steps, checkpoint every {args.every}, "
          f"torch threads {args.threads} per process; kill -9 after step {kill_at}")
    t_demo = time.perf_counter()

    tty = sys.stdout.isatty()

    def progress(run, ev):
        if ev["event"] == "killed":
            print(f"\r  {run.label:<22} step {ev['step']:>4}  -> SIGKILL" + " " * 24, flush=True)
            return
        last = ev["step"] == args.steps - 1
        if not tty and not last and (ev["step"] + 1) % args.every:
            return  # one line per checkpoint interval when not on a terminal
        mark = " ckpt" if ev["saved"] else "     "
        print(f"\r  {run.label:<22} step {ev['step']:>4}/{args.steps - 1}  loss {ev['loss']:.4f}"
              f"  {ev['dt']:.2f}s{mark}", end="" if tty and not last else "\n", flush=True)

    ref = Run(args, "none", "reference", "1/4 reference").follow(progress)
    print(f"    ({ref.event('ready')['params'] / 1e6:.1f}M parameters)")
    base = Run(args, "torchsave", "torchsave", "2/4 torch.save").follow(progress)
    crashed = Run(args, "nonstop", "crashed", "3/4 nonstop, killed", kill_at).follow(progress)
    resumed = Run(args, "nonstop", "resumed", "4/4 nonstop, resumed").follow(progress)
    restored = resumed.event("restored")
    if restored is None:
        print("FAIL: the resumed run found no checkpoint to restore")
        return 1
    ok, detail = compare_final(args.out, "reference", "resumed")
    # The ones the killed run printed after its last completed checkpoint.
    lost = crashed.killed_after - restored["step"]
    first_resumed = resumed.steps.get(restored["step"] + 1)
    rows = [
        ("steps/s, no checkpoints", f"{steps_per_s([ref]):.3f}"),
        (f"steps/s, nonstop every {args.every}", f"{steps_per_s([crashed, resumed]):.3f}"),
        (f"steps/s, torch.save every {args.every}", f"{steps_per_s([base]):.3f}"),
        ("mean stall per checkpoint, nonstop", f"{mean_stall([crashed, resumed]) * 1e3:.1f} ms"),
        ("mean stall per checkpoint, torch.save", f"{mean_stall([base]) * 1e3:.1f} ms"),
        ("killed after step", f"{crashed.killed_after}"),
        ("resumed from checkpoint at step", f"{restored['step']}"),
        ("steps lost to the crash", f"{lost}"),
        ("time to recover: restore()",
         f"{restored['restore_s']:.3f} s from {restored.get('restored_from', 'disk')}"),
        # From the resumed process's spawn (interpreter, imports and model
        # included) to the end of its first training step.
        ("time to recover: start to first step done",
         f"{first_resumed['t']:.2f} s" if first_resumed else "-"),
        ("  of which start to model built", f"{resumed.event('ready')['t']:.2f} s"),
        ("  of which Checkpointer() + restore()",
         f"{restored['t'] - resumed.event('ready')['t']:.2f} s"),
        ("final state vs reference", "IDENTICAL" if ok else "DIFFERENT"),
    ]
    w = max(len(r[0]) for r in rows)
    print()
    print(f"{'':-<{w + 16}}")
    for k, v in rows:
        print(f"{k:<{w}}  {v:>12}")
    print(f"{'':-<{w + 16}}")
    print("steps/s come from runs one after another and move with the machine's load; the "
          "stall is the\ntime the training thread was blocked in checkpoint calls, "
          "the less noisy measure (bench/torch_overhead.py\ninterleaves and repeats).")
    png = os.path.join(args.out, "loss.png")
    plot(png, ref, crashed, resumed, restored["step"])
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"args": vars(args), "kill_at": kill_at, "rows": dict(rows), "identical": ok,
                   "detail": detail,
                   "runs": {r.tag: {str(k): v for k, v in sorted(r.steps.items())}
                            for r in (ref, base, crashed, resumed)}}, f, indent=1)
    print(f"plot: {png}   summary: {os.path.join(args.out, 'summary.json')}   "
          f"({time.perf_counter() - t_demo:.0f} s)")
    if not ok:
        print(f"FAIL: resumed run differs from the reference: {detail}")
        return 1
    print(f"PASS: final weights, optimizer and scheduler state match the reference ({detail})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
