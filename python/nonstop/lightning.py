"""nonstop for PyTorch Lightning: `NonstopCheckpoint` checkpoints every few
optimizer steps without stalling, and `trainer.fit(..., ckpt_path="last")`
resumes exactly from `last.ckpt`, a JSON marker written once its step
committed, which `NonstopCheckpointIO` reads without pickle (docs/LIGHTNING.md).
"""
from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any, Optional

import torch

try:
    import lightning.fabric as fabric
    import lightning.pytorch as pl
except ImportError:  # the standalone package names
    import lightning_fabric as fabric  # type: ignore[no-redef]
    import pytorch_lightning as pl  # type: ignore[no-redef]

from . import _checkpointer, _data, _ext, _options, _rng
from .errors import CheckpointMismatchError, CheckpointNotFoundError

MARKER_FORMAT = "nonstop.lightning/1"
__all__ = ["NonstopCheckpoint", "NonstopCheckpointIO", "MARKER_FORMAT", "load_weights"]


def read_marker(path: str) -> Optional[dict]:
    """The marker at `path` as a dict (format, dir, nonstop_dir: the directory it names,
    step, global_step), or None when it is none (C++ ReadLightningMarker: through the
    Env seam, a link refused; a torch file is bigger than a marker or not JSON)."""
    return _ext.core().read_lightning_marker(os.path.abspath(path))


def load_weights(path, model: Optional[torch.nn.Module] = None, strict: bool = True,
                 map_location=None):
    """The weights of a NonstopCheckpoint's checkpoint, for evaluation: `path` is its
    `last.ckpt` marker or the `nonstop/` directory: the newest valid step (at or after
    the one the marker names). Returns the LightningModule's state_dict; with `model`,
    loads it there (`strict`) and returns the model. Model.load_from_checkpoint cannot
    read the marker (torch.load of a JSON file: an UnpicklingError); this reads the
    checkpoint nonstop wrote, without pickle. docs/LIGHTNING.md."""
    path = os.fspath(path)
    d = (read_marker(path) or {}).get("nonstop_dir")
    if d is None and os.path.isfile(path):
        raise CheckpointMismatchError(
            f"{path} is not a nonstop.lightning marker (last.ckpt written by NonstopCheckpoint)")
    weights = _load(d or path, path)[1]["state_dict"]
    if map_location is not None:
        weights = fabric.utilities.move_data_to_device(weights, map_location)
    if model is not None:
        model.load_state_dict(weights, strict=strict)
    return weights if model is None else model


def _load(d: str, where: str) -> tuple:
    """(Loaded, Lightning's checkpoint dict) of the newest valid checkpoint in `d`.
    Not the marker's step itself: the marker is written a little after its
    commit, and by then the ring may have reused the slot of the step it names."""
    loaded = _checkpointer.load(d)
    state = loaded.state.get("lightning")
    if not isinstance(state, dict) or not isinstance(state.get("state_dict"), dict):
        raise CheckpointMismatchError(f"{where}: step {loaded.step} holds no Lightning checkpoint")
    return loaded, state


def _write_atomically(path: str, text: str) -> None:
    """Through the Env seam (temp, fsync, rename over `path`, never following a link)."""
    parent, name = os.path.split(os.path.abspath(path))
    _ext.core().Directory(parent).write_atomic(name, text.encode())


class NonstopCheckpointIO(fabric.plugins.CheckpointIO):
    """Lightning's CheckpointIO, aware of nonstop markers: load_checkpoint of a
    marker returns the checkpoint dict read from nonstop (and keeps its RNG states
    for NonstopCheckpoint to put back). Any other path goes to the CheckpointIO it
    wraps (Lightning's default), so `trainer.save_checkpoint("x.ckpt")` works as before."""

    def __init__(self, wrapped: Optional[fabric.plugins.CheckpointIO] = None):
        super().__init__()
        self.wrapped = wrapped if wrapped is not None else fabric.plugins.TorchCheckpointIO()
        self.loaded_rng: Optional[dict] = None
        self.loaded_step: Optional[int] = None
        self.loaded_loops: Optional[dict] = None  # the fit loop's state (_reiterate)
        self.callback: Optional["NonstopCheckpoint"] = None  # under DDP it restores, collectively

    def save_checkpoint(self, checkpoint: dict, path, storage_options: Optional[Any] = None):
        return self.wrapped.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict:
        d, cb = (read_marker(os.fspath(path)) or {}).get("nonstop_dir"), self.callback
        ddp = cb is not None and _options.world()[1] > 1
        if d is None and ddp and (os.path.dirname(os.path.abspath(os.fspath(path)))
                                  == os.path.abspath(cb.nonstop_dir)):
            d = cb.nonstop_dir  # no marker yet (_find_last_checkpoints)
        if d is None:
            return self.wrapped.load_checkpoint(path, map_location=map_location,
                                                 weights_only=weights_only)
        if ddp:
            # Every rank restores (collectively) its own file of the newest step
            # all ranks committed (replicated tensors reassembled from their shares).
            if os.path.abspath(d) != os.path.abspath(cb.nonstop_dir):
                raise CheckpointMismatchError(
                    f"the marker names {d}, this NonstopCheckpoint writes {cb.nonstop_dir}")
            step = cb._open([]).restore()
            if step is None:
                raise CheckpointNotFoundError(
                    f"{d}: no step that every rank committed (a kill during the first "
                    f"checkpoint); remove the directory to start afresh")
            state, self.loaded_step = dict(cb._holder), step
            self.loaded_rng = _rng.capture()  # as restored; put back in on_train_start
        else:
            loaded, state = _load(d, d)
            self.loaded_rng, self.loaded_step = loaded.meta.get("rng"), loaded.step
        loops = state.get("loops")
        fit = loops.get("fit_loop") if isinstance(loops, dict) else None
        self.loaded_loops = fit if isinstance(fit, dict) else None
        if map_location is None:
            return state
        return fabric.utilities.move_data_to_device(state, map_location)

    def remove_checkpoint(self, path) -> None:
        self.wrapped.remove_checkpoint(path)

    def teardown(self) -> None:
        self.wrapped.teardown()


def _reiterate(trainer, fit_state: dict) -> None:
    """Puts the restored loaders where the uninterrupted run's would be,
    before the first batch (docs/LIGHTNING.md "What it does": set_epoch,
    the loader's state again, a new iterator; Lightning's is dropped unread)."""
    loop = trainer.fit_loop
    combined = getattr(loop, "_combined_loader", None)
    fetcher = getattr(loop, "_data_fetcher", None)
    states = (fit_state.get("state_dict") or {}).get("combined_loader")
    if combined is None or fetcher is None or not isinstance(states, list):
        return
    epoch = loop.epoch_progress.current.processed  # after Lightning's restart bookkeeping
    last = bool((fit_state.get("epoch_loop.batch_progress") or {}).get("is_last_batch"))
    again = last
    for dl, st in zip(combined.flattened, states):
        by_epoch = [s for s in _data.samplers(dl) if callable(getattr(s, "set_epoch", None))]
        for s in by_epoch:
            s.set_epoch(epoch)
        if (not last and by_epoch and isinstance(st, dict)
                and callable(getattr(dl, "load_state_dict", None))):
            dl.load_state_dict(st)
            again = True
    if again:
        iter(fetcher)


class NonstopCheckpoint(pl.callbacks.ModelCheckpoint):
    """Checkpoints with nonstop every `every` (every_n_train_steps=) optimizer steps
    (default 10), or after the last optimizer step of every `every_n_epochs`-th
    epoch, or after the first optimizer step `train_time_interval` (a timedelta;
    under DDP rank 0's clock) after the previous checkpoint: one of the three, as
    in ModelCheckpoint. Makes `trainer.fit(..., ckpt_path="last")` resume bit for
    bit from the newest committed checkpoint (mid-epoch data position included
    with a torchdata StatefulDataLoader). One process or strategy="ddp". monitor=,
    mode=, save_top_k=: nonstop's best= (under DDP rank 0's metric). on_commit:
    called with each checkpoint's stats. Other keyword arguments go to
    nonstop.Checkpointer. Use it instead of, not beside, a ModelCheckpoint writing
    into the same directory. docs/LIGHTNING.md."""

    def __init__(self, dirpath=None, every: Optional[int] = None, on_commit=None,
                 monitor: Optional[str] = None, mode: str = "min",
                 save_top_k: Optional[int] = None, every_n_train_steps: Optional[int] = None,
                 every_n_epochs: Optional[int] = None,
                 train_time_interval: Optional[datetime.timedelta] = None,
                 **checkpointer_kwargs):
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=False)
        # one cadence at most; monitor=/mode=/save_top_k= become best= (C++)
        td = train_time_interval
        every, every_n_epochs, best = _ext.core().lightning_cadence(
            every, every_n_train_steps, every_n_epochs, td,
            td.total_seconds() if isinstance(td, datetime.timedelta) else None, mode, monitor,
            save_top_k, "best" in checkpointer_kwargs)
        if best is not None:
            checkpointer_kwargs["best"] = best
        # a typo raises now, not at the first checkpoint
        _checkpointer.check_options("NonstopCheckpoint", checkpointer_kwargs,
                                    own=("every", "mode", "state", "dir", "on_commit"))
        self.every = every
        # (ModelCheckpoint's every_n_epochs is a read-only property of its own)
        self.epochs = every_n_epochs
        self.interval = train_time_interval
        self.on_commit = on_commit
        self.checkpointer_kwargs = checkpointer_kwargs
        self.ckpt: Optional[_checkpointer.Checkpointer] = None
        self.io: Optional[NonstopCheckpointIO] = None
        self._holder: dict = {}
        self._last_global_step: Optional[int] = None
        self._saved_global_step: Optional[int] = None
        self._last_time: Optional[float] = None
        self._marker_lock = threading.Lock()
        self._marker_step = -1
        self._writes_marker = True
        self.last_handle = None

    # The clock of train_time_interval (seconds; tests replace it).
    _clock = staticmethod(time.monotonic)

    @property
    def nonstop_dir(self) -> str:
        return os.path.join(os.fspath(self.dirpath), "nonstop")

    @property
    def marker_path(self) -> str:
        name = self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION
        return os.path.join(os.fspath(self.dirpath), name)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(nonstop_every=self.every,
                                        nonstop_every_n_epochs=self.epochs,
                                        nonstop_train_time_interval=self.interval)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        strategy = trainer.strategy
        if isinstance(strategy, pl.strategies.DeepSpeedStrategy) or not isinstance(
                strategy, (pl.strategies.SingleDeviceStrategy, pl.strategies.DDPStrategy)):
            # FSDPStrategy saves and loads its checkpoints itself (state dicts
            # gathered or sharded through DCP, not through CheckpointIO), and
            # Lightning refuses it on CPU; DeepSpeed likewise.
            raise CheckpointMismatchError(
                f"NonstopCheckpoint works with one process or strategy='ddp', not "
                f"{type(strategy).__name__} (it loads and saves checkpoints itself, not "
                f"through CheckpointIO); see docs/LIGHTNING.md")
        self._writes_marker = trainer.is_global_zero
        # Installed before Lightning restores from ckpt_path (setup hooks run first).
        if not isinstance(strategy.checkpoint_io, NonstopCheckpointIO):
            strategy.checkpoint_io = NonstopCheckpointIO(strategy.checkpoint_io)
        self.io = strategy.checkpoint_io
        self.io.callback = self

    def _find_last_checkpoints(self, trainer) -> set:
        """Lightning's ckpt_path="last": `last.ckpt`; under DDP, before rank 0
        wrote its first marker, rank 0's file in `nonstop/` (the same on every
        rank: every rank restores, collectively, or none; docs/LIGHTNING.md "DDP")."""
        found = super()._find_last_checkpoints(trainer)
        if (not found and trainer.num_devices * trainer.num_nodes > 1
                and _checkpointer.check_directory(self.nonstop_dir, 0, None, must_exist=False)):
            found = {os.path.normpath(os.path.join(self.nonstop_dir, "rank-00000.nsck"))}
        return found

    def _open(self, optimizers: list) -> _checkpointer.Checkpointer:
        """The Checkpointer (made at the first save or DDP restore), the
        optimizers attached (hooked: their tensors stay zero-copy)."""
        if self.ckpt is None:
            kwargs = {"on_preempt": False, **self.checkpointer_kwargs}  # Lightning handles signals
            self.ckpt = _checkpointer.Checkpointer(
                self.nonstop_dir, {"lightning": self._holder}, every=self.every or 1,
                on_commit=self.on_commit, **kwargs)
        self.ckpt.attach(optimizers)
        return self.ckpt

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        # A loader whose restored order would differ is refused before the
        # first step (_data.py, docs/EXACT_RESUME.md).
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        for i, loader in enumerate(getattr(combined, "flattened", None) or []):
            _data.check_loader(loader, f"train dataloader {i}")
        self._last_global_step = trainer.global_step
        self._last_time = self._clock()
        if self.io is not None and self.io.loaded_loops is not None:
            _reiterate(trainer, self.io.loaded_loops)
            self.io.loaded_loops = None
        # The RNG states saved with the restored checkpoint (Lightning saves
        # none) go back after Lightning's own restore work, before the first step.
        if self.io is not None and self.io.loaded_rng is not None:
            _rng.restore(self.io.loaded_rng)
            self._marker_step = max(self._marker_step, self.io.loaded_step or -1)
            self.io.loaded_rng = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        gs = trainer.global_step
        if gs == self._last_global_step:
            return  # no optimizer step on this batch (gradient accumulation)
        self._last_global_step = gs
        # every_n_epochs: after the epoch's last optimizer step, not in
        # on_train_epoch_end: a loader saved after its epoch ended resumes with
        # that epoch's order again (a torchdata sampler keeps its generator as
        # of the epoch's start); one saved at its last batch resumes exactly.
        if ((self.every is not None and gs % self.every == 0)
                or (self.epochs is not None and (trainer.current_epoch + 1) % self.epochs == 0
                    and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
                or (self.interval is not None and self._time_is_up(trainer))):
            self.save(trainer)

    def _time_is_up(self, trainer) -> bool:
        """Whether train_time_interval has passed since the last checkpoint (or
        the start); under DDP rank 0's answer, broadcast (checkpoints are collective)."""
        now = self._clock()
        due = now - self._last_time >= self.interval.total_seconds()
        if trainer.world_size > 1:
            flag = torch.tensor([1 if due else 0], dtype=torch.int32,
                                device=trainer.strategy.root_device)
            torch.distributed.broadcast(flag, src=0)
            due = bool(flag.item())
        if due:
            self._last_time = now
        return due

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass  # every_n_epochs saves after the epoch's last step (on_train_batch_end)

    def save(self, trainer):
        """Starts a checkpoint of the current state (after optimizer step
        `trainer.global_step`); returns its nonstop.CheckpointHandle (None
        when this step was checkpointed already). Under DDP every rank must
        call it at the same step."""
        if trainer.global_step == 0 or trainer.global_step == self._saved_global_step:
            return None
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        ckpt = self._open(trainer.optimizers)
        self._holder.clear()
        self._holder.update(checkpoint)
        self._saved_global_step = trainer.global_step
        # the scalars logged so far (what self.log() gave): best= ranks by
        # them (under DDP by rank 0's, which the Checkpointer gives every rank)
        handle = ckpt.save(trainer.global_step - 1,
                           metrics=_options.scalar_metrics(trainer.callback_metrics))
        handle.add_done_callback(self._committed)
        self.last_handle = handle
        return handle

    def _committed(self, handle) -> None:
        # Under DDP a handle is done once every rank committed the step (the
        # global agreement); global rank 0 writes the marker.
        if handle.exception() is not None or not self._writes_marker:
            return
        with self._marker_lock:
            if handle.step <= self._marker_step:
                return
            self._marker_step = handle.step
            _write_atomically(self.marker_path, _ext.core().lightning_marker_json(handle.step))

    def on_validation_end(self, trainer, pl_module) -> None:
        pass  # checkpoints are taken after optimizer steps and at epoch ends only

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
