"""nonstop for the Hugging Face Trainer: `NonstopCallback` checkpoints every
few optimizer steps without stalling; `resume_from(cb)` (or
`resume_from_checkpoint=True`) resumes exactly through a Trainer checkpoint
folder nonstop writes (docs/HF.md "How resuming works").
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import random
from typing import Optional

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes
from transformers import TrainerCallback

from . import (_checkpointer, _dcp, _distributed, _ext, _manage, _options, _rng, _state,
               _unwrap)
from .errors import CheckpointMismatchError, CheckpointNotFoundError

__all__ = ["NonstopCallback", "resume_from"]


class NonstopCallback(TrainerCallback):
    """Checkpoints the model, optimizer, scheduler, the TrainerState and the
    RNG states every `every` optimizer steps (on_step_end). Other keyword
    arguments go to nonstop.Checkpointer. `on_commit` is called with each
    checkpoint's stats once it committed or failed."""

    def __init__(self, dir: str, every: int = 10, on_commit=None, **checkpointer_kwargs):
        _options.check_positive("every", every)
        # a typo raises now, not at the first checkpoint
        _checkpointer.check_options("NonstopCallback", checkpointer_kwargs,
                                    own=("dir", "state", "every", "on_commit"))
        self.dir = os.fspath(dir)
        self.every = every
        self.on_commit = on_commit
        self.checkpointer_kwargs = checkpointer_kwargs
        self.ckpt: Optional[_checkpointer.Checkpointer] = None
        self._trainer_state: dict = {}
        self._to_load: Optional[int] = None  # the step on_train_begin restores (resume_from)
        self._resume_folder: Optional[str] = None  # what resume_from wrote, removed once read
        self.last_handle = None
        self._from_args: dict = {}  # what the TrainingArguments set (on_train_begin)
        self._after_eval: Optional[int] = None  # the step whose checkpoint waits for its metrics
        self._model = None  # the Trainer's model (on_init_end), for resume_from under torchrun
        self._load_best = False  # TrainingArguments(load_best_model_at_end=True)
        self._auto: Optional[tuple] = None  # what on_init_end prepared (_prepare_auto)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._model = model
        out = getattr(args, "output_dir", None)
        if out and model is not None:  # (model_init: no model yet, nothing prepared)
            self._auto = _prepare_auto(self, os.fspath(out), model)

    def on_train_begin(self, args, state, control, model=None, optimizer=None,
                       lr_scheduler=None, **kwargs):
        if args is not None and self.ckpt is None:  # checked before the first step
            # best=, keep=, max_to_keep= (docs/HF.md "Retention ...")
            self._load_best = bool(getattr(args, "load_best_model_at_end", False))
            saves = getattr(args, "save_strategy", "")
            self._from_args = _ext.core().trainer_options(
                getattr(args, "metric_for_best_model", None) or None,
                getattr(args, "greater_is_better", None), getattr(args, "save_total_limit", None),
                bool(getattr(args, "fsdp", None) or getattr(args, "deepspeed", None)),
                self._load_best, str(getattr(saves, "value", saves)),
                list(self.checkpointer_kwargs))
        if self._auto is not None:
            _, global_step, step = self._auto
            if (state is not None and state.global_step == global_step
                    and self._resume_folder is None and self._to_load is None):
                # train(resume_from_checkpoint=True) took the folder (the Trainer
                # read trainer_state.json, reads rng_state*.pth before the first
                # step): model, optimizer and scheduler come from nonstop now.
                self._to_load = step
            else:  # a fresh start, resume_from(cb) or a Trainer checkpoint: unused
                self._drop_auto()
        if self._resume_folder is not None:
            # The Trainer has read the weights (before on_train_begin): the
            # full copy resume_from wrote goes now, the rest once read.
            _remove(os.path.join(self._resume_folder, "model.safetensors"))
        if self._to_load is None:
            return
        step, self._to_load = self._to_load, None
        if optimizer is None:
            raise CheckpointMismatchError("resume_from: the Trainer passed no optimizer")
        # Restored in place (under torchrun the agreed step, collective); the RNG
        # states stay: the Trainer sets the saved ones from rng_state*.pth itself.
        self._open(model, optimizer, lr_scheduler)
        now = _rng.capture()
        try:
            got = self.ckpt.restore(step=step)
        finally:
            _rng.restore(now)
        if got != step:
            raise CheckpointMismatchError(f"{self.dir}: restored step {got}, the ranks agreed "
                                          f"on step {step}")

    def on_step_begin(self, args, state, control, **kwargs):
        # trainer_state.json and rng_state.pth have been read (the RNG
        # states just before the first step): resume_from's folder goes.
        self._drop_resume()

    def _drop_resume(self) -> None:
        if self._resume_folder is not None:
            folder, self._resume_folder = self._resume_folder, None
            _remove(folder)

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                    **kwargs):
        self._drop_auto()  # every rank has read it (the step's gradients were reduced)
        if self._load_best:
            # The Trainer asks for save_strategy == eval_strategy with
            # load_best_model_at_end: nonstop's checkpoints are those saves.
            control.should_save = False
        if self._from_args.get("best") is not None and control.should_evaluate:
            # metric_for_best_model: the checkpoint of an evaluated step is
            # taken once the evaluation's metrics are known (on_evaluate;
            # the Trainer's flow callback has set should_evaluate by now)
            self._after_eval = state.global_step
        elif state.global_step % self.every == 0:
            self._save(state, model, optimizer, lr_scheduler, None)

    def on_evaluate(self, args, state, control, metrics=None, model=None, optimizer=None,
                    lr_scheduler=None, **kwargs):
        if self._after_eval != state.global_step:
            return
        self._after_eval = None
        self._save(state, model, optimizer, lr_scheduler, _options.scalar_metrics(metrics or {}))
        # A checkpoint carrying best='s metric is never superseded by a newer one
        # that finishes writing first (ENGINE.md, "Ordered publish").

    def _open(self, model, optimizer, lr_scheduler) -> None:
        """The Checkpointer of this run (one per rank under torchrun: with
        torch.distributed initialised it is nonstop's distributed mode)."""
        kwargs = {"on_preempt": False, **self.checkpointer_kwargs, **self._from_args}
        st = {"model": _unwrap.module(model), "optim": optimizer,
              "trainer_state": self._trainer_state}
        if lr_scheduler is not None:
            st["sched"] = lr_scheduler
        self.ckpt = _checkpointer.Checkpointer(self.dir, st, every=self.every,
                                               on_commit=self.on_commit, **kwargs)

    def _save(self, state, model, optimizer, lr_scheduler, metrics) -> None:
        self._trainer_state.clear()
        # as TrainerState.save_to_json writes it (through JSON: plain values only)
        self._trainer_state.update(json.loads(json.dumps(dataclasses.asdict(state))))
        if self.ckpt is None:
            self._open(model, optimizer, lr_scheduler)
        self.last_handle = self.ckpt.save(state.global_step - 1, metrics=metrics)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self._load_best:
            control.should_save = False

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.close()
        self._drop_auto(barrier=True)  # resumed at max_steps: no step ran
        self._drop_resume()  # resumed at max_steps: no step began
        if self._load_best and state.best_global_step and model is not None:
            self._load_best_weights(state, model)

    def _drop_auto(self, barrier: bool = False) -> None:
        """Forgets the folder on_init_end prepared; rank 0 removes it (after `barrier`)."""
        if self._auto is not None:
            folder, self._auto = self._auto[0], None
            if barrier and _options.world()[1] > 1:
                torch.distributed.barrier()
            if _options.world()[0] == 0:
                _remove(folder)

    def _load_best_weights(self, state, model) -> None:
        """load_best_model_at_end: the weights of best_global_step (kept by best=;
        under torchrun reassembled from all rank files) into the model."""
        step = state.best_global_step - 1
        _, flat = _dcp.collect(self.dir, step)
        sd = {k[len("model/"):]: v for k, v in flat.items() if k.startswith("model/")}
        module = _unwrap.module(model)
        got = module.load_state_dict(sd, strict=False)
        live = module.state_dict()
        loaded_at = {live[k].data_ptr() for k in sd if k in live}
        missing = [k for k in got.missing_keys if live[k].data_ptr() not in loaded_at]
        if got.unexpected_keys or missing:  # a tied weight is stored once
            raise CheckpointMismatchError(
                f"load_best_model_at_end: step {step} of {self.dir} does not fit the model "
                f"(missing {missing[:3]}, unexpected {got.unexpected_keys[:3]})")
        kept = [r["path"] for r in _manage.list_checkpoints(self.dir, _options.world()[0])
                if r["step"] == step and r["where"] == "keep"]
        state.best_model_checkpoint = (os.path.join(self.dir, os.path.dirname(kept[0]))
                                       if kept else None)

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
    checkpoint yet (a fresh start), CheckpointNotFoundError when `step` is
    given and not committed (a missing directory too). `folder` defaults to
    `<callback.dir>-resume/checkpoint-<global_step>` (per rank under
    torchrun: `<callback.dir>-resume/rank-R/checkpoint-<global_step>`) and
    is rewritten. With torch.distributed initialised (the Trainer made under
    torchrun or accelerate launch) it is collective: every rank calls it."""
    d = callback.dir
    rank, world = _options.world()
    if world > 1:
        # The ranks agree on the step; each writes its own folder with the live
        # model's weights (the Trainer insists on a weights file; only restore()
        # can reassemble the saved ones), and on_train_begin restores that step.
        got = _agreed(d, step, rank, world)
        if got is None:
            return None  # a fresh start on every rank
        s, ts, meta = got
        if callback._model is None:
            raise CheckpointMismatchError("resume_from under torchrun: pass the callback to the "
                                          "Trainer (callbacks=[cb]) before calling resume_from(cb)")
        weights = _unwrap.module(callback._model).state_dict()
        sub, rng_name = f"rank-{rank}", f"rng_state_{rank}.pth"
    else:
        try:
            loaded = _checkpointer.load(d, step=step)
        except CheckpointNotFoundError:
            if step is not None:
                raise
            return None  # no checkpoint (or killed before its first commit): a fresh start
        saved = loaded.state
        for key in ("model", "optim", "trainer_state"):
            if key not in saved:
                raise CheckpointMismatchError(f"{d} step {loaded.step} has no {key!r}: "
                                              f"not written by nonstop.hf.NonstopCallback")
        s, ts, weights, meta = loaded.step, saved["trainer_state"], saved["model"], loaded.meta
        sub, rng_name = "", "rng_state.pth"
    if folder is None:
        folder = os.path.join(d.rstrip(os.sep) + "-resume", sub, f"checkpoint-{ts['global_step']}")
    _write_folder(folder, ts, weights, meta.get("rng"), rng_name)
    callback._to_load = s  # on_train_begin restores it in place (optimizer, scheduler)
    callback._resume_folder = os.path.abspath(folder)
    return folder


def _agreed(d: str, step: Optional[int], rank: int, world: int):
    """(step, trainer_state, meta) of the step to resume from in `d` (C++
    AgreeOnStep, as restore() picks it; collective when world > 1), or None
    on a fresh start on every rank."""
    s = _ext.core().dist_agree_on_step(d, rank, world, step, _comm(world).gather)
    if s is None:
        return None
    sel = _ext.core().JobDir.open_for_read(d).select(
        rank, step=s, verify_data=False, include_keep=step is not None)
    meta = _state.loads(sel.info["meta_json"])
    ts = meta.get("state", {}).get("trainer_state")
    if not isinstance(ts, dict) or "global_step" not in ts:
        raise CheckpointMismatchError(f"{d} step {s} has no 'trainer_state': not written by "
                                      f"nonstop.hf.NonstopCallback")
    return s, ts, meta


_AUTO_MARK = "nonstop-resume.json"  # names a checkpoint-N folder nonstop wrote in output_dir


def _prepare_auto(callback: NonstopCallback, out: str, model) -> Optional[tuple]:
    """on_init_end (collective): `<out>/checkpoint-<global_step>` of the agreed
    newest step, marked, for `trainer.train(resume_from_checkpoint=True)`
    (docs/HF.md). Returns (folder, global_step, step) or None."""
    rank, world = _options.world()
    if rank == 0 and os.path.isdir(out):  # leftovers of a run killed before its first step
        top = _ext.core().Directory(out)  # (through the Env seam, never following a link)
        for name, kind in top.list():
            if (kind == "dir" and name.startswith("checkpoint-")
                    and top.subdir(name).stat(_AUTO_MARK) is not None):
                top.remove_tree(name)
    got = _agreed(callback.dir, None, rank, world)
    if got is None:
        return None
    step, ts, meta = got
    folder = os.path.abspath(os.path.join(out, f"checkpoint-{ts['global_step']}"))
    # The Trainer's own checkpoint of that step (rank 0's view, on every rank)
    if _comm(world).gather(os.path.exists(folder))[0]:
        return None
    rng = meta.get("rng")
    if rank == 0:  # under torchrun each rank adds its rng_state_R.pth
        mark = json.dumps({"dir": os.path.abspath(callback.dir), "step": step}).encode()
        _write_folder(folder, ts, _unwrap.module(model).state_dict(),
                      rng if world == 1 else None, "rng_state.pth", ((_AUTO_MARK, mark),))
    if world > 1:
        torch.distributed.barrier()  # the folder exists
        if rng is not None:
            _ext.core().Directory(folder).write_atomic(f"rng_state_{rank}.pth", _rng_file(rng))
        torch.distributed.barrier()  # every rank's file is there
    return folder, int(ts["global_step"]), step


def _remove(path: str) -> None:
    """Removes the folder or file `path` through the Env seam, if there."""
    parent, name = os.path.split(path)
    try:
        _ext.core().Directory(parent).remove_tree(name)
    except CheckpointNotFoundError:
        pass


def _write_folder(folder: str, ts: dict, weights: dict, rng: Optional[dict], rng_name: str,
                  extra: tuple = ()) -> None:
    """Writes the Trainer checkpoint `folder`: `extra` [(name, bytes)], trainer_state.json,
    model.safetensors (each tensor its own copy: tied weights come back as one tensor
    under two names; the Trainer loads with strict=False), `rng` as `rng_name`."""
    files = [*extra, ("trainer_state.json", json.dumps(ts, indent=2, sort_keys=True).encode()),
             ("model.safetensors", safetensors_bytes(
                 {k: v.detach().contiguous().clone() for k, v in weights.items()
                  if isinstance(v, torch.Tensor)}))]
    if rng is not None:
        files.append((rng_name, _rng_file(rng)))
    folder = os.path.abspath(folder)
    _ext.core().Directory(os.path.dirname(folder), create=True).write_folder(
        os.path.basename(folder), files)


def _comm(world: int) -> _distributed.Comm:
    """The default process group's JSON collectives (world 1: none)."""
    return _distributed.Comm(torch.distributed.group.WORLD if world > 1 else None, world)


def _rng_file(saved: dict) -> bytes:
    """nonstop's RNG record as the Trainer's rng_state.pth (read with weights_only=True):
    put in place, read back in the Trainer's layout; the current states go back."""
    now = _rng.capture()
    try:
        _rng.restore(saved)
        out = {"python": random.getstate(), "numpy": np.random.get_state(),
               "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.random.get_rng_state_all()
    finally:
        _rng.restore(now)
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()
