"""A training job with a 2-worker DataLoader, for test_preempt_pgroup.py:
python pgroup_train.py DIR STOP_AT. Prints 'start S' after restore and
'ready' once a few steps ran; exits 0 after step STOP_AT, 75 when preempted."""
import sys
import time

import torch

import nonstop

torch.set_num_threads(1)


class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 10 ** 6

    def __getitem__(self, i):
        time.sleep(0.002)  # a loader the main process waits for, as real ones are
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g)


def main():
    d, stop_at = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=1000)
    start = ckpt.restore()
    first = 0 if start is None else start + 1
    print("start", start, flush=True)
    # The recipe of docs/PREEMPTION.md: workers ignore the preemption signal,
    # so a SIGTERM to the whole process group reaches the training process
    # only, which checkpoints and then shuts the workers down itself.
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(Batches(), range(first * 8, 10 ** 6)), batch_size=8,
        num_workers=2, worker_init_fn=nonstop.worker_init_fn)
    step = first
    for x in loader:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(step)
        if step == first + 5:
            print("ready", flush=True)
        if step == stop_at:
            break
        step += 1
    ckpt.close()
    print("done", step, flush=True)


if __name__ == "__main__":
    main()
