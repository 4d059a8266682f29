"""Killable training jobs for the integration crash tests, one per way of
training: a plain loop with torchdata's StatefulDataLoader, Accelerate,
Lightning and the Hugging Face Trainer. Run as

    python integration_jobs.py KIND DIR STEPS EVERY FINAL [--pace S]

KIND is plain, accelerate, lightning or hf. DIR "-" trains without nonstop
(the uninterrupted reference); otherwise the job checkpoints every EVERY
optimizer steps and resumes from DIR through the integration when it holds
a checkpoint, so the same command is the first run and the restart. It
prints one JSON line per optimizer step ({"event": "step", "step": s}) and,
at the end, writes the final weights, optimizer state and data position:
FINAL.safetensors (tensors) and FINAL.json (the rest).

The data position is checked twice: by the loader's own state where there
is one, and by `seen`, a buffer of the model that folds in the index of
every sample trained on, in order (so a skipped or repeated batch changes
it). The model has dropout (global RNG) and its loader shuffles with its
own generator.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from nonstop import _state  # noqa: E402

N, DIM, BATCH = 40, 8, 4
P = 1_000_000_007


def dataset():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, DIM, generator=g)
    y = torch.randn(N, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(DIM, 16)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(16, 1)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def fold(self, idx):
        with torch.no_grad():
            for i in idx.tolist():
                self.seen.mul_(1_000_003).add_(i + 1).remainder_(P)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def loss_of(net, batch):
    x, y, idx = batch
    net.fold(idx)
    return torch.nn.functional.mse_loss(net(x), y)


def loader_of(cls, recipe=None):
    """The loader recipe of docs/EXACT_RESUME.md: torchdata's stateful
    RandomSampler with its own generator (a restored loader draws the same
    permutation again, in any epoch), and a generator for the loader (without
    one, iter(loader) draws its base seed from the global RNG, one draw more
    after a restart, and dropout shifts). recipe="e778719" (or the
    NONSTOP_TEST_LOADER environment variable) is the recipe documented at
    e778719: torch's RandomSampler, whose restored loader keeps the position
    but draws epoch 1's permutation again; nonstop refuses it now."""
    ds = dataset()
    recipe = recipe or os.environ.get("NONSTOP_TEST_LOADER", "exact")
    if recipe == "e778719":
        sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(7))
    else:
        from torchdata.stateful_dataloader.sampler import RandomSampler
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(7))
    return cls(ds, batch_size=BATCH, sampler=sampler, generator=torch.Generator().manual_seed(8))


def emit(step):
    print(json.dumps({"event": "step", "step": int(step)}), flush=True)


def write_final(path, model, optimizer, extra=None):
    tensors = {}
    tree = {"model": _state.flatten(model.state_dict(), "model", tensors),
            "optim": _state.flatten(optimizer.state_dict(), "optim", tensors),
            "extra": _state.flatten(extra or {}, "extra", tensors)}
    from safetensors.torch import save_file
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              path + ".safetensors")
    with open(path + ".json", "w") as f:
        f.write(_state.dumps(tree))


# ------------------------------------------------------------------ plain

def plain(a):
    import nonstop
    from torchdata.stateful_dataloader import StatefulDataLoader
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
    loader = loader_of(StatefulDataLoader)
    start, ckpt = 0, None
    if a.dir != "-":
        ckpt = nonstop.Checkpointer(a.dir, {"model": model, "optim": opt, "sched": sched,
                                            "data": loader}, every=a.every)
        r = ckpt.restore()
        start = 0 if r is None else r + 1
    it = iter(loader)
    for step in range(start, a.steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
        sched.step()
        if ckpt is not None:
            ckpt.step(step)
        emit(step)
        time.sleep(a.pace)
    if ckpt is not None:
        ckpt.close()
    write_final(a.final, model, opt, {"sched": sched.state_dict(), "data": loader.state_dict()})


# ------------------------------------------------------------- accelerate

def accelerate(a):
    import nonstop
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torchdata.stateful_dataloader import StatefulDataLoader
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
    loader = loader_of(StatefulDataLoader)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    start, ckpt = 0, None
    if a.dir != "-":
        ckpt = nonstop.Checkpointer(a.dir, {"model": model, "optim": opt, "sched": sched,
                                            "data": loader}, every=a.every)
        r = ckpt.restore()
        start = 0 if r is None else r + 1
    it = iter(loader)
    for step in range(start, a.steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        opt.zero_grad()
        acc.backward(loss_of(acc.unwrap_model(model), batch))
        opt.step()
        sched.step()
        if ckpt is not None:
            ckpt.step(step)
        emit(step)
        time.sleep(a.pace)
    if ckpt is not None:
        ckpt.close()
    write_final(a.final, acc.unwrap_model(model), opt.optimizer,
                {"sched": sched.state_dict(), "data": loader.state_dict()})


# -------------------------------------------------------------- lightning

def lightning(a):
    import lightning as L
    from torchdata.stateful_dataloader import StatefulDataLoader

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            return loss_of(self.net, batch)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Steps(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            emit(trainer.global_step - 1)
            time.sleep(a.pace)

    torch.manual_seed(0)
    module = Module()
    loader = loader_of(StatefulDataLoader)
    callbacks = [Steps()]
    if a.dir != "-":
        from nonstop.lightning import NonstopCheckpoint
        callbacks.append(NonstopCheckpoint(a.dir, every=a.every))
    trainer = L.Trainer(max_steps=a.steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=a.dir != "-", enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks,
                        default_root_dir=os.path.dirname(a.final) or ".")
    trainer.fit(module, loader, ckpt_path="last" if a.dir != "-" else None)
    write_final(a.final, module.net, trainer.optimizers[0],
                {"sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                 "data": loader.state_dict(), "global_step": trainer.global_step})


# --------------------------------------------------------------------- hf

def hf(a):
    import transformers
    from transformers import Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x, y, idx):
            loss = loss_of(self.net, (x, y, idx))
            return {"loss": loss}

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y, self.idx = dataset().tensors

        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"x": self.x[i], "y": self.y[i], "idx": self.idx[i]}

    class Steps(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            emit(state.global_step - 1)
            time.sleep(a.pace)

    torch.manual_seed(0)
    model = Model()
    out = a.dir if a.dir != "-" else os.path.join(os.path.dirname(a.final) or ".", "hf-ref")
    args = TrainingArguments(output_dir=out, max_steps=a.steps, per_device_train_batch_size=BATCH,
                             learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2,
                             logging_strategy="no", save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, data_seed=7, dataloader_num_workers=0,
                             disable_tqdm=True, remove_unused_columns=False)
    callbacks = [Steps()]
    resume = None
    if a.dir != "-":
        from nonstop.hf import NonstopCallback, resume_from
        nc = NonstopCallback(os.path.join(a.dir, "nonstop"), every=a.every)
        callbacks.append(nc)
        resume = resume_from(nc)  # the newest committed checkpoint as an HF folder, or None
    trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    write_final(a.final, model.net, trainer.optimizer.optimizer
                if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer,
                {"sched": trainer.lr_scheduler.state_dict(),
                 "global_step": trainer.state.global_step})


def main():
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["plain", "accelerate", "lightning", "hf"])
    ap.add_argument("dir")
    ap.add_argument("steps", type=int)
    ap.add_argument("every", type=int)
    ap.add_argument("final")
    ap.add_argument("--pace", type=float, default=0.0)
    a = ap.parse_args()
    print(json.dumps({"event": "start"}), flush=True)
    globals()[a.kind](a)
    print(json.dumps({"event": "end"}), flush=True)


if __name__ == "__main__":
    main()
