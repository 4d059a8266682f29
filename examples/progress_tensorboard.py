"""Training with a tqdm progress bar and each checkpoint's stats logged.

    python examples/progress_tensorboard.py --dir runs/ckpt --steps 200 \
        [--tensorboard runs/tb] [--log stats.jsonl]

A small model trains on random batches; nonstop checkpoints every `--every`
steps in the background. `on_commit` receives each checkpoint's stats
(step, bytes, stall_s, copy_s, persist_s, write_GBps, committed, error) on
nonstop's watcher thread once the checkpoint is on disk (or has failed):

- the tqdm bar shows the loss and the last committed step and its size;
- with --tensorboard DIR, the stats go to TensorBoard
  (torch.utils.tensorboard.SummaryWriter; needs `pip install tensorboard`);
- with --log FILE, one JSON line per checkpoint.

Run it again with the same --dir and it resumes after the newest committed
checkpoint (a SIGKILL at any point included).
"""
import argparse
import json
import threading

import torch
from tqdm import tqdm

import nonstop


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--tensorboard", default=None, help="a TensorBoard log directory")
    p.add_argument("--log", default=None, help="a JSON-lines file of checkpoint stats")
    a = p.parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    writer = None
    if a.tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(a.tensorboard)
    log = open(a.log, "a") if a.log else None
    lock = threading.Lock()  # on_commit runs on nonstop's watcher thread
    last = {}

    def on_commit(stats):
        with lock:
            if stats["committed"]:
                last.update(step=stats["step"], mb=stats["bytes"] / 2**20)
            if writer is not None:
                for k in ("stall_s", "copy_s", "persist_s", "write_GBps", "bytes"):
                    if stats.get(k) is not None:
                        writer.add_scalar(f"checkpoint/{k}", stats[k], stats["step"])
            if log is not None:
                log.write(json.dumps({k: stats.get(k) for k in (
                    "step", "bytes", "stall_s", "copy_s", "persist_s", "committed",
                    "error")}) + "\n")
                log.flush()

    ckpt = nonstop.Checkpointer(a.dir, state={"model": model, "optim": opt}, every=a.every,
                                on_commit=on_commit)
    restored = ckpt.restore()  # shows its own tqdm bar for large restores
    start = 0 if restored is None else restored + 1
    g = torch.Generator().manual_seed(start)
    bar = tqdm(range(start, a.steps), initial=start, total=a.steps, desc="train")
    for step in bar:
        x = torch.randn(32, 64, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(step)
        with lock:
            post = {"loss": f"{loss.item():.3f}"}
            if last:
                post["ckpt"] = f"step {last['step']} ({last['mb']:.1f} MiB)"
        bar.set_postfix(post, refresh=False)
    ckpt.close()  # waits for the last checkpoint; on_commit has run for each
    if writer is not None:
        writer.close()
    if log is not None:
        log.close()
    print(f"trained steps {start}..{a.steps - 1}; newest checkpoint: step {last.get('step')}")


if __name__ == "__main__":
    main()
