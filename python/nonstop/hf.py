"""nonstop for the Hugging Face Trainer: checkpoint every few optimizer steps
without stalling, and resume exactly with
`trainer.train(resume_from_checkpoint=...)`.

    from nonstop.hf import NonstopCallback, resume_from

    cb = NonstopCallback("runs/ckpt", every=50)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=resume_from(cb))   # None on a fresh start

The Trainer decides how many batches to skip, and restores its RNG states,
from files in a checkpoint folder, before any callback runs. `resume_from`
is the bridge: it reads nonstop's newest committed checkpoint and writes
the folder the Trainer expects (trainer_state.json, model.safetensors,
rng_state.pth), so the Trainer's own resume logic positions the data and the
RNG exactly as it would for its own checkpoint. The optimizer and scheduler
states are not written there: the callback loads them in place from nonstop
at on_train_begin. nonstop itself reads nothing through pickle; the
Trainer reads rng_state.pth its own way (torch.load with weights_only=True).

See docs/HF.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
from transformers import TrainerCallback

from . import _checkpointer, _unwrap
from .errors import CheckpointMismatchError

__all__ = ["NonstopCallback", "resume_from"]


class NonstopCallback(TrainerCallback):
    """Checkpoints the model, optimizer, scheduler, the TrainerState and the
    RNG states every `every` optimizer steps (on_step_end). Other keyword
    arguments go to nonstop.Checkpointer. `on_commit` is called with each
    checkpoint's stats once it committed or failed."""

    def __init__(self, dir: str, every: int = 10, on_commit=None, **checkpointer_kwargs):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise CheckpointMismatchError(f"every must be a positive integer, got {every!r}")
        self.dir = os.fspath(dir)
        self.every = every
        self.on_commit = on_commit
        self.checkpointer_kwargs = checkpointer_kwargs
        self.ckpt: Optional[_checkpointer.Checkpointer] = None
        self._trainer_state: dict = {}
        self._to_load = None  # what resume_from read, for on_train_begin
        self.last_handle = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None,
                       lr_scheduler=None, **kwargs):
        if self._to_load is None:
            return
        saved, self._to_load = self._to_load, None
        if optimizer is None:
            raise CheckpointMismatchError("resume_from: the Trainer passed no optimizer")
        _unwrap.optimizer(optimizer).load_state_dict(saved["optim"])
        if lr_scheduler is not None and "sched" in saved:
            _unwrap.scheduler(lr_scheduler).load_state_dict(saved["sched"])

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                    **kwargs):
        if state.global_step % self.every:
            return
        if args.world_size > 1:
            raise CheckpointMismatchError("nonstop.hf supports one process for now; see docs/HF.md")
        self._trainer_state.clear()
        # as TrainerState.save_to_json writes it (through JSON: plain values only)
        self._trainer_state.update(json.loads(json.dumps(dataclasses.asdict(state))))
        if self.ckpt is None:
            kwargs = dict(self.checkpointer_kwargs)
            kwargs.setdefault("on_preempt", False)
            st = {"model": _unwrap.module(model), "optim": optimizer,
                  "trainer_state": self._trainer_state}
            if lr_scheduler is not None:
                st["sched"] = lr_scheduler
            self.ckpt = _checkpointer.Checkpointer(self.dir, st, every=self.every,
                                                   on_commit=self.on_commit, **kwargs)
        self.last_handle = self.ckpt.save(state.global_step - 1)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Waits for the checkpoints in flight and stops the engine. Idempotent."""
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()


def resume_from(callback: NonstopCallback, folder: Optional[str] = None,
                step: Optional[int] = None) -> Optional[str]:
    """Turns nonstop's newest committed checkpoint (or `step`) in
    `callback.dir` into a Trainer checkpoint folder and returns its path,
    for `trainer.train(resume_from_checkpoint=...)`; None when there is no
    checkpoint yet (a fresh start). `folder` defaults to
    `<callback.dir>-resume/checkpoint-<global_step>` and is rewritten."""
    d = callback.dir
    if not _checkpointer.check_directory(d, 0, None, must_exist=False):
        return None
    loaded = _checkpointer.load(d, step=step)
    saved = loaded.state
    for key in ("model", "optim", "trainer_state"):
        if key not in saved:
            raise CheckpointMismatchError(f"{d} step {loaded.step} has no {key!r}: "
                                          f"not written by nonstop.hf.NonstopCallback")
    ts = saved["trainer_state"]
    if folder is None:
        folder = os.path.join(d.rstrip(os.sep) + "-resume", f"checkpoint-{ts['global_step']}")
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump(ts, f, indent=2, sort_keys=True)
    from safetensors.torch import save_file
    # Tied weights come back as one tensor under two names: safetensors wants
    # each name to own its memory (the Trainer loads with strict=False).
    save_file({k: v.contiguous().clone() for k, v in saved["model"].items()
               if isinstance(v, torch.Tensor)}, os.path.join(tmp, "model.safetensors"))
    rng = loaded.meta.get("rng")
    if rng is not None:
        torch.save(_hf_rng(rng), os.path.join(tmp, "rng_state.pth"))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    callback._to_load = {k: saved[k] for k in ("optim", "sched") if k in saved}
    return folder


def _hf_rng(saved: dict) -> dict:
    """nonstop's RNG record (_rng.capture) in the Trainer's rng_state.pth layout."""
    from . import _rng
    # Put the saved states in place, read them back in the Trainer's layout,
    # then put the current ones back.
    now = _rng.capture()
    try:
        _rng.restore(saved)
        out = {"python": random.getstate(), "numpy": np.random.get_state(),
               "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.random.get_rng_state_all()
    finally:
        _rng.restore(now)
    return out
