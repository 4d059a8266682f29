"""A training job for the crash tests (crash_harness.py runs it): tiny model,
checkpoint every step or few, prints one JSON line per step. Run as

    python killable_train.py DIR STEPS EVERY FINAL_PATH [PACE_S]
        [--mode M] [--copy C] [--parts K] [--medium M] [--block-bytes B]
        [--tier T] [--settle-after S] [--replay R] [--foreach 0|1] [--dim D]

It restores from DIR when it holds a checkpoint, so the same command is
both the first run and the restart; DIR "-" trains without a checkpointer
(the uninterrupted reference). It sleeps PACE_S seconds after each step.
--settle-after S: after step S it waits until the memory tier's segment
holds its newest commit, then SIGKILLs itself (a restart must read memory).
The options go to nonstop.Checkpointer (--block-bytes sets the multistep
block size). At the end it writes the final model, optimizer and scheduler
tensors (FINAL_PATH.safetensors) and the rest (FINAL_PATH.json)."""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import nonstop  # noqa: E402
import tiny  # noqa: E402
from nonstop import _state  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("steps", type=int)
    ap.add_argument("every", type=int)
    ap.add_argument("final")
    ap.add_argument("pace", type=float, nargs="?", default=0.0)
    ap.add_argument("--mode")
    ap.add_argument("--copy")
    ap.add_argument("--parts", type=int)
    ap.add_argument("--medium")
    ap.add_argument("--block-bytes", type=int)
    ap.add_argument("--tier")
    ap.add_argument("--settle-after", type=int, default=-1)
    ap.add_argument("--replay")  # multistep
    ap.add_argument("--foreach", type=int)  # the optimizer's foreach= (also without a checkpointer)
    ap.add_argument("--dim", type=int, default=16)  # the model's width (tiny.make)
    return ap.parse_args()


def main():
    torch.set_num_threads(1)
    args = parse_args()
    if args.block_bytes:
        from nonstop import _multistep
        _multistep.BLOCK_BYTES = args.block_bytes
    options = {k: v for k, v in (("mode", args.mode), ("copy", args.copy),
                                 ("parts", args.parts), ("medium", args.medium),
                                 ("tier", args.tier), ("replay", args.replay)) if v is not None}
    model, opt, sched = tiny.make(dim=args.dim)
    if args.foreach is not None:
        for g in opt.param_groups:
            g["foreach"] = bool(args.foreach)
    train = {"tokens": 0}
    start = 0
    ckpt = None
    if args.dir != "-":
        ckpt = nonstop.Checkpointer(args.dir, {"model": model, "optim": opt, "sched": sched,
                                               "train": train}, every=args.every, **options)
        r = ckpt.restore()
        start = 0 if r is None else r + 1
        print(json.dumps({"event": "start", "restored": r,
                          "restored_from": ckpt.stats().get("restored_from")}), flush=True)
    for s in range(start, args.steps):
        loss = tiny.train_step(model, opt, sched, s)
        train["tokens"] += 32
        if ckpt is not None:
            ckpt.step(s)
        print(json.dumps({"event": "step", "step": s, "loss": loss}), flush=True)
        if s == args.settle_after:
            import signal
            from memwait import wait_mirrored
            wait_mirrored(ckpt)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.pace:
            time.sleep(args.pace)
    if ckpt is not None:
        ckpt.close()
    tensors = {}
    tree = {"model": _state.flatten(model.state_dict(), "model", tensors),
            "optim": _state.flatten(opt.state_dict(), "optim", tensors),
            "sched": _state.flatten(sched.state_dict(), "sched", tensors), "train": train}
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, args.final + ".safetensors")
    with open(args.final + ".json", "w") as f:
        f.write(_state.dumps(tree))
    print(json.dumps({"event": "done"}), flush=True)


if __name__ == "__main__":
    main()
