"""One rank of a Lightning DDP job (strategy="ddp", CPU, gloo) with
NonstopCheckpoint, for test_lightning_ddp.py. Started by
dist_launch.run_ranks (LOCAL_RANK, RANK, WORLD_SIZE, MASTER_ADDR/PORT set:
Lightning then creates no processes itself, as under torchrun):

    python lightning_ddp_train.py DIR STEPS OUT [--every N | --every-n-epochs E |
        --interval-s X] [--monitor] [--kill-at S]

40 samples, batch 4, 2 ranks: Lightning's DistributedSampler gives each rank
5 steps per epoch. It resumes with ckpt_path="last", so the same command is
the first run and the restart. It prints one JSON line per event and writes
OUT.rank-R.json (digests of the final weights, optimizer state, RNG, data).
--kill-at S: after optimizer step S (counted from 0) every rank waits until
its checkpoints are committed, meets the others (a barrier), and SIGKILLs
itself. --interval-s with --fake-clock: the clock of
train_time_interval is the step count (rank 0) or 0 (other ranks): only
rank 0's clock can say the interval passed, so every rank checkpointing the
same steps shows that rank 0's decision is broadcast.
"""
import argparse
import datetime
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import lightning as L  # noqa: E402
from dist_launch import finish_rank  # noqa: E402
from dist_train import digest, emit  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import RandomSampler  # noqa: E402

from nonstop.lightning import NonstopCheckpoint  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, monitor: bool):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
        self.monitor = monitor
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.extend(idx.tolist())
        if self.monitor:
            # Rank 0's score is lowest at steps 5 and 8 (of 0..14); rank 1's
            # ranks the other way (not synced: rank 0's value must rank).
            s = float(abs(self.global_step - 6.5))
            self.log("score", s if self.global_rank == 0 else -s)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Probe(L.Callback):
    def __init__(self, a, cb):
        self.a, self.cb = a, cb

    def on_train_start(self, trainer, pl_module):
        emit(event="start", rank=trainer.global_rank, restored=cb_restored(self.cb),
             global_step=trainer.global_step, epoch=trainer.current_epoch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = trainer.global_step - 1
        h = self.cb.last_handle
        emit(event="step", rank=trainer.global_rank, step=s, epoch=trainer.current_epoch,
             idx=batch[2].tolist(),
             saved=h.step if h is not None and self.cb._saved_global_step == s + 1 else None)
        if s == self.a.kill_at:
            # Every rank's checkpoints so far committed (on its own disk),
            # then the kill: the restart must pick the newest step that
            # every rank holds, whether or not its agreement round ran.
            self.cb.ckpt.wait()
            torch.distributed.barrier()
            emit(event="kill", rank=trainer.global_rank, step=s, agreed=self.cb.ckpt.latest())
            os.kill(os.getpid(), signal.SIGKILL)


def cb_restored(cb):
    return None if cb.io is None else cb.io.loaded_step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("steps", type=int)
    p.add_argument("out")
    p.add_argument("--every", type=int)
    p.add_argument("--every-n-epochs", type=int)
    p.add_argument("--interval-s", type=float)
    p.add_argument("--fake-clock", action="store_true")
    p.add_argument("--monitor", action="store_true")
    p.add_argument("--loader", choices=["shuffle", "torchdata"], default="shuffle")
    p.add_argument("--kill-at", type=int, default=-1)
    a = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    kwargs = dict(max_in_flight=2, medium="buffered", writers=1, dist_timeout_s=60,
                  on_commit=lambda st: emit(event="commit", rank=rank, step=st.get("step"),
                                            committed=st.get("committed"),
                                            error=st.get("error")))
    if a.every is not None:
        kwargs["every"] = a.every
    if a.every_n_epochs is not None:
        kwargs["every_n_epochs"] = a.every_n_epochs
    if a.interval_s is not None:
        kwargs["train_time_interval"] = datetime.timedelta(seconds=a.interval_s)
    if a.monitor:
        kwargs.update(monitor="score", mode="min", save_top_k=2)
    cb = NonstopCheckpoint(a.dir, **kwargs)
    if a.fake_clock:
        ticks = [0.0]

        def clock():  # rank 0: one second per call (one call per step); others: frozen
            ticks[0] += 1.0
            return ticks[0] if rank == 0 else 0.0
        cb._clock = clock
    torch.manual_seed(0)
    model = Model(a.monitor)
    g = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(torch.randn(40, 8, generator=g),
                                          torch.randn(40, 1, generator=g), torch.arange(40))
    # Lightning replaces torch's RandomSampler with a
    # DistributedSampler (seeded, set_epoch each epoch: its order is a
    # function of the epoch, exact after a restore). Any other sampler it
    # wraps in a DistributedSamplerWrapper, whose inner sampler's state no
    # loader saves: NonstopCheckpoint refuses that (--loader torchdata).
    if a.loader == "torchdata":  # refused: Lightning wraps it; its generator is not saved
        loader = StatefulDataLoader(data, batch_size=4, generator=torch.Generator().manual_seed(2),
                                    sampler=RandomSampler(data, generator=torch.Generator().manual_seed(1)))
    else:
        loader = StatefulDataLoader(data, batch_size=4, sampler=torch.utils.data.RandomSampler(data),
                                    generator=torch.Generator().manual_seed(2))
    trainer = L.Trainer(max_steps=a.steps, accelerator="cpu", devices=2, strategy="ddp",
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb, Probe(a, cb)], default_root_dir=a.dir)
    torch.manual_seed(100 + rank)  # dropout differs per rank; restored per rank
    trainer.fit(model, loader, ckpt_path="last")
    opt = trainer.optimizers[0]
    opt_tensors = [v for _, st in sorted(opt.state_dict()["state"].items())
                   for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    res = {"rank": rank, "restored": cb_restored(cb), "params": digest(model.parameters()),
           "optim": digest(opt_tensors), "rng": digest([torch.get_rng_state()]),
           "seen_tail": model.seen[-12:], "global_step": trainer.global_step}
    finish_rank(a.out, rank, res)


if __name__ == "__main__":
    main()
