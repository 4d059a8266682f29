"""nonstop for PyTorch Lightning: checkpoint every few optimizer steps
without stalling, and resume exactly with `trainer.fit(..., ckpt_path="last")`.

    from nonstop.lightning import NonstopCheckpoint

    trainer = L.Trainer(max_steps=1000, callbacks=[NonstopCheckpoint("runs/ckpt", every=50)])
    trainer.fit(model, loader, ckpt_path="last")   # a fresh start the first time

What is saved is exactly what Lightning's own checkpoint holds (weights,
optimizer and scheduler states, loop progress, callback states, the
StatefulDataLoader's position), plus the global RNG states. The model's
parameters and the optimizer's state are registered with the engine by
pointer: they are copied out of their memory in the background, and only
the next optimizer step waits for that copy. The engine writes and commits
in the background too.

Files under `dirpath`:
- `nonstop/`: the nonstop checkpoint directory (inspect, verify, export it
  with the `nonstop` command);
- `last.ckpt`: a small JSON marker naming the newest *committed* step. It is
  written (atomically) only after that checkpoint committed, so it never
  points at a checkpoint that a crash could lose. Lightning's
  `ckpt_path="last"` finds it; `load_checkpoint` turns it back into
  Lightning's checkpoint dict (no pickle).

See docs/LIGHTNING.md.
"""
from __future__ import annotations

import json
import math
import os
import threading
from typing import Any, Optional

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError:  # the standalone package name
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[no-redef]
    from pytorch_lightning.callbacks import ModelCheckpoint  # type: ignore[no-redef]

from . import _checkpointer, _data, _ext, _rng, _unwrap
from .errors import CheckpointMismatchError

MARKER_FORMAT = "nonstop.lightning/1"
__all__ = ["NonstopCheckpoint", "NonstopCheckpointIO", "MARKER_FORMAT", "load_weights"]


class _LightningCheckpointer(_checkpointer.Checkpointer):
    """A Checkpointer of Lightning's checkpoint dict, whose tensors are the
    live module's and optimizers' own: those of the optimizers are left in
    place until their next step (zero-copy), like a plain Checkpointer's."""

    def __init__(self, dir: str, holder: dict, optimizers: list, **kwargs):
        super().__init__(dir, {"lightning": holder}, **kwargs)
        self._optimizers = _unwrap.optimizers(optimizers)
        self._hooks += [o.register_step_pre_hook(self._before_update) for o in self._optimizers]

    def _optimizer_owned(self) -> set:
        ptrs = super()._optimizer_owned()
        for opt in self._optimizers:
            for group in opt.param_groups:
                ptrs.update(p.data_ptr() for p in group["params"])
            for st in opt.state.values():
                ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        return ptrs


def read_marker(path: str) -> Optional[dict]:
    """The marker at `path` as a dict, or None when it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    if not head.lstrip().startswith(b"{"):
        return None
    try:
        marker = json.loads(head)
    except ValueError:
        return None
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        return None
    return marker


def load_weights(path, model: Optional[torch.nn.Module] = None, strict: bool = True,
                 map_location=None):
    """The weights of a NonstopCheckpoint's checkpoint, for evaluation:
    `path` is its `last.ckpt` marker (the step it names) or the `nonstop/`
    directory (the newest valid step). Returns the LightningModule's
    state_dict; with `model`, loads it there (`strict`) and returns the
    model. `Model.load_from_checkpoint("last.ckpt")` cannot read the marker
    (torch.load of a JSON file: an UnpicklingError); this reads the
    checkpoint nonstop wrote, without pickle. docs/LIGHTNING.md."""
    path = os.fspath(path)
    marker = read_marker(path)
    if marker is not None:
        d = marker["dir"]
        if not os.path.isabs(d):
            d = os.path.join(os.path.dirname(os.path.abspath(path)), d)
        loaded = _checkpointer.load(d, step=int(marker["step"]))
    elif os.path.isfile(path):
        raise CheckpointMismatchError(
            f"{path} is not a nonstop.lightning marker (last.ckpt written by NonstopCheckpoint)")
    else:
        loaded = _checkpointer.load(path)
    state = loaded.state.get("lightning")
    if not isinstance(state, dict) or not isinstance(state.get("state_dict"), dict):
        raise CheckpointMismatchError(f"{path}: step {loaded.step} holds no Lightning checkpoint")
    weights = state["state_dict"]
    if map_location is not None:
        weights = _to(weights, map_location)
    if model is None:
        return weights
    model.load_state_dict(weights, strict=strict)
    return model


def _write_atomically(path: str, text: str) -> None:
    """Through the Env seam (_core.Directory): a temp created O_EXCL|O_NOFOLLOW
    relative to the directory fd, fsynced, renamed over `path` (a symlink
    there is refused), the directory fsynced."""
    path = os.path.abspath(path)
    d = _ext.core().Directory(os.path.dirname(path))
    name = os.path.basename(path)
    tmp = f".{name}.{os.getpid()}.tmp"
    d.unlink(tmp, missing_ok=True)  # a stale temp of this pid's earlier life
    with d.create(tmp) as out:
        out.write(text.encode())
        out.commit(name)


class NonstopCheckpointIO(CheckpointIO):
    """Lightning's CheckpointIO, aware of nonstop markers: load_checkpoint
    of a marker returns the checkpoint dict read from nonstop (and keeps its
    RNG states for NonstopCheckpoint to put back). Any other path goes to
    the CheckpointIO it wraps (Lightning's default: torch.save/torch.load),
    so `trainer.save_checkpoint("x.ckpt")` works as before."""

    def __init__(self, wrapped: Optional[CheckpointIO] = None):
        super().__init__()
        self.wrapped = wrapped
        self.loaded_rng: Optional[dict] = None
        self.loaded_step: Optional[int] = None

    def _inner(self) -> CheckpointIO:
        if self.wrapped is None:
            from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
            self.wrapped = TorchCheckpointIO()
        return self.wrapped

    def save_checkpoint(self, checkpoint: dict, path, storage_options: Optional[Any] = None):
        return self._inner().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict:
        marker = read_marker(os.fspath(path))
        if marker is None:
            return self._inner().load_checkpoint(path, map_location=map_location,
                                                 weights_only=weights_only)
        d = marker["dir"]
        if not os.path.isabs(d):
            d = os.path.join(os.path.dirname(os.path.abspath(os.fspath(path))), d)
        loaded = _checkpointer.load(d, step=int(marker["step"]))
        state = loaded.state.get("lightning")
        if not isinstance(state, dict):
            raise CheckpointMismatchError(f"{d} step {loaded.step} holds no Lightning checkpoint")
        self.loaded_rng = loaded.meta.get("rng")
        self.loaded_step = loaded.step
        if map_location is not None:
            state = _to(state, map_location)
        return state

    def remove_checkpoint(self, path) -> None:
        self._inner().remove_checkpoint(path)

    def teardown(self) -> None:
        if self.wrapped is not None:
            self.wrapped.teardown()


def _to(tree, device):
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to(v, device) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_to(v, device) for v in tree)
    return tree


class NonstopCheckpoint(ModelCheckpoint):
    """Checkpoints every `every` optimizer steps with nonstop; makes
    `trainer.fit(..., ckpt_path="last")` resume from the newest committed
    checkpoint, mid-epoch data position included (with a
    torchdata StatefulDataLoader), bit for bit.

    dirpath: where the `nonstop/` directory and the `last.ckpt` marker go
        (default: Lightning's checkpoint directory).
    every: optimizer steps between checkpoints (micro-batches of gradient
        accumulation are not steps: a checkpoint is only taken right after
        an optimizer step).
    on_commit: called with each checkpoint's stats once it committed or failed.
    Other keyword arguments go to nonstop.Checkpointer (max_in_flight=,
    writers=, staging_bytes=, keep=, medium=, ...).

    It is a ModelCheckpoint (Lightning finds `last.ckpt` through it), but it
    takes no checkpoint of Lightning's kind: use it instead of, not beside, a
    ModelCheckpoint writing into the same directory.
    """

    def __init__(self, dirpath=None, every: int = 10, on_commit=None,
                 monitor: Optional[str] = None, mode: str = "min",
                 save_top_k: Optional[int] = None, **checkpointer_kwargs):
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=False)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise CheckpointMismatchError(f"every must be a positive integer, got {every!r}")
        # monitor=/mode=/save_top_k= as ModelCheckpoint's: nonstop's best=
        # (the k best kept copies by that logged metric, JobDir retention).
        if mode not in ("min", "max"):
            raise CheckpointMismatchError(
                f"mode must be 'min' or 'max' (the monitored metric's direction, as "
                f"ModelCheckpoint's), got {mode!r}; NonstopCheckpoint always checkpoints "
                f"in the Checkpointer's concurrent mode")
        if monitor is not None:
            if "best" in checkpointer_kwargs:
                raise CheckpointMismatchError("give monitor=/mode=/save_top_k= or best=, not both")
            checkpointer_kwargs["best"] = (monitor, mode, 1 if save_top_k is None else save_top_k)
        elif save_top_k is not None:
            raise CheckpointMismatchError("save_top_k= needs monitor= (the metric it ranks by)")
        # a typo raises now, not at the first checkpoint
        _checkpointer.check_options("NonstopCheckpoint", checkpointer_kwargs,
                                    own=("every", "mode", "state", "dir", "on_commit"))
        self.every = every
        self.on_commit = on_commit
        self.checkpointer_kwargs = checkpointer_kwargs
        self.ckpt: Optional[_LightningCheckpointer] = None
        self.io: Optional[NonstopCheckpointIO] = None
        self._holder: dict = {}
        self._last_global_step: Optional[int] = None
        self._marker_lock = threading.Lock()
        self._marker_step = -1
        self.last_handle = None

    @property
    def nonstop_dir(self) -> str:
        return os.path.join(os.fspath(self.dirpath), "nonstop")

    @property
    def marker_path(self) -> str:
        return os.path.join(os.fspath(self.dirpath), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(nonstop_every=self.every)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.world_size > 1:
            raise CheckpointMismatchError(
                "nonstop.lightning supports one process for now; see docs/LIGHTNING.md")
        # Installed before Lightning restores from ckpt_path (setup hooks run first).
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, NonstopCheckpointIO):
            io = NonstopCheckpointIO(io)
            trainer.strategy.checkpoint_io = io
        self.io = io

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        # A loader whose restored order would differ is refused before the
        # first step (_data.py, docs/EXACT_RESUME.md).
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        for i, loader in enumerate(getattr(combined, "flattened", None) or []):
            _data.check_loader(loader, f"train dataloader {i}")
        self._last_global_step = trainer.global_step
        # The RNG states saved with the checkpoint Lightning restored from go
        # back now, after Lightning's own restore work and before the first
        # step (Lightning does not save them).
        if self.io is not None and self.io.loaded_rng is not None:
            _rng.restore(self.io.loaded_rng)
            self._marker_step = max(self._marker_step, self.io.loaded_step or -1)
            self.io.loaded_rng = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        gs = trainer.global_step
        if gs == self._last_global_step:
            return  # no optimizer step on this batch (gradient accumulation)
        self._last_global_step = gs
        if gs % self.every == 0:
            self.save(trainer)

    def save(self, trainer):
        """Starts a checkpoint of the current state (after optimizer step
        `trainer.global_step`); returns its nonstop.CheckpointHandle."""
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if self.ckpt is None:
            kwargs = dict(self.checkpointer_kwargs)
            kwargs.setdefault("on_preempt", False)  # Lightning has its own signal handling
            self.ckpt = _LightningCheckpointer(self.nonstop_dir, self._holder, trainer.optimizers,
                                               every=self.every, on_commit=self.on_commit,
                                               **kwargs)
        self._holder.clear()
        self._holder.update(checkpoint)
        handle = self.ckpt.save(trainer.global_step - 1, metrics=self._metrics(trainer))
        handle.add_done_callback(self._committed)
        self.last_handle = handle
        return handle

    def _metrics(self, trainer) -> Optional[dict]:
        """The scalars logged so far (trainer.callback_metrics, what
        self.log() gave), stored with the checkpoint: best= ranks by them."""
        out = {}
        for k, v in trainer.callback_metrics.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[str(k)] = float(v)
        return out or None

    def _committed(self, handle) -> None:
        if handle.exception() is not None:
            return
        with self._marker_lock:
            if handle.step <= self._marker_step:
                return
            self._marker_step = handle.step
            _write_atomically(self.marker_path, json.dumps(
                {"format": MARKER_FORMAT, "dir": "nonstop", "step": handle.step,
                 "global_step": handle.step + 1}))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass  # checkpoints are taken by optimizer step only

    def on_validation_end(self, trainer, pl_module) -> None:
        pass

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.close()  # what is in flight still commits (and gets its marker)

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.close()

    def close(self) -> None:
        """Waits for the checkpoints in flight (their markers are written)
        and stops the engine. Idempotent."""
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()
