"""A training job for the crash tests: tiny model, checkpoint every step or
few, prints one JSON line per step. Run as

    python killable_train.py DIR STEPS EVERY FINAL_PATH [delay_s]

It restores from DIR when it holds a checkpoint, so the same command is
both the first run and the restart. With FINAL_PATH it writes the final
model and optimizer tensors (safetensors) and the rest (JSON) at the end."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import nonstop  # noqa: E402
import tiny  # noqa: E402
from nonstop import _state  # noqa: E402


def main():
    torch.set_num_threads(1)
    d, steps, every, final = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    delay = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    model, opt, sched = tiny.make()
    train = {"tokens": 0}
    start = 0
    ckpt = None
    if d != "-":
        ckpt = nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": sched,
                                        "train": train}, every=every)
        r = ckpt.restore()
        start = 0 if r is None else r + 1
        print(json.dumps({"event": "start", "restored": r}), flush=True)
    for s in range(start, steps):
        loss = tiny.train_step(model, opt, sched, s)
        train["tokens"] += 32
        if ckpt is not None:
            ckpt.step(s)
        print(json.dumps({"event": "step", "step": s, "loss": loss}), flush=True)
        if delay:
            time.sleep(delay)
    if ckpt is not None:
        ckpt.close()
    tensors = {}
    tree = {"model": _state.flatten(model.state_dict(), "model", tensors),
            "optim": _state.flatten(opt.state_dict(), "optim", tensors),
            "sched": _state.flatten(sched.state_dict(), "sched", tensors), "train": train}
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, final + ".safetensors")
    with open(final + ".json", "w") as f:
        f.write(_state.dumps(tree))
    print(json.dumps({"event": "done"}), flush=True)


if __name__ == "__main__":
    main()
