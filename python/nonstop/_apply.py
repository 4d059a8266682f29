"""Restoring into the live objects: what restore() will do to the state,
checked and decoded before anything changes (prepare), then done (apply).
restore() reads straight into the live tensors that fit (live_tensors)."""
from __future__ import annotations

import warnings
from typing import Any

import torch

from . import _ext, _fsdp, _objects, _rng, _state
from ._objects import stateful
from .errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError


class StateApplier:
    """A Checkpointer's state (a dict of objects and values) as a restore
    target: `rank`/`world_size` place FSDP2 shards, `rng` restores the RNG."""

    def __init__(self, state: dict, dir: str, rank: int, world_size: int, rng: bool):
        self.state, self.dir, self.rng = state, dir, rng
        self.rank, self.world_size = rank, world_size
        self._flat: dict = {}  # per key: the live tensors of the restore under way
        # mode="multistep" (MultistepMode.replay_check): whether a checkpoint whose
        # parts restore() replays ("multistep_plan") can be replayed here
        self.replay_check = None

    def done(self) -> None:
        self._flat = {}

    def live_tensors(self) -> dict:
        """The live state's tensors by checkpoint name (modules, optimizers,
        other stateful objects and plain tensors): restore() reads straight
        into those that match (_read.destinations)."""
        self._flat = {key: _flat(key, obj) for key, obj in self.state.items()}  # for prepare
        return {n: t for flat in self._flat.values() for n, t in flat.items()}

    def prepare(self, loaded) -> tuple:
        """Everything restore() will do to the live objects, checked and
        decoded, with nothing changed yet: (values by key, RNG setters).
        Raises CorruptCheckpointError where the checkpoint is malformed (the
        caller falls back to an older one) and CheckpointMismatchError where
        it does not fit the live state."""
        _fsdp.restored(self, loaded)  # FSDP2: the saved shards become DTensors again
        meta = loaded.meta
        where = f"checkpoint step {loaded.step} in {self.dir}"
        saved = meta.get("state")
        # C++ (export.h CheckSavedState): the tree of every key checked once,
        # then each value of the kind load_state_dict would fail on only halfway
        # through (a tensor, a state dict, an optimizer's); its group sizes.
        groups = _ext.core().check_saved_state(
            where, _state.dumps(saved), [(key, _kind(obj)) for key, obj in self.state.items()],
            list(loaded.tensors))
        try:
            values = {key: _state.rebuild(saved[key], loaded.tensors)
                      for key in self.state if key in saved}
        except (TypeError, ValueError, OverflowError) as e:  # a numpy scalar out of its range
            raise CorruptCheckpointError(f"{where}: malformed checkpoint metadata: {e}") from None
        live = []
        for (key, obj), got in zip(self.state.items(), groups):
            flat = self._flat[key] if key in self._flat else _flat(key, obj)
            mine = [] if got is None else [len(g["params"]) for g in obj.param_groups]
            live.append((key, [_desc(n, t) for n, t in flat.items()],
                         isinstance(obj, (torch.nn.Module, torch.Tensor)), mine, got or []))
        # C++ (engine/checkpointer_args.h CheckStateFits): a key the checkpoint
        # lacks, then per key a module's tensor it lacks, a dtype or shape that
        # differs, an optimizer's parameter group sizes; one-line errors.
        _ext.core().check_state_fits(where, loaded.step, self.dir, list(saved), live,
                                     [_desc(n, t) for n, t in loaded.tensors.items()])
        if "multistep_plan" in meta:  # its parts are at their own versions
            if self.replay_check is None:
                raise CheckpointMismatchError(
                    f"{where} was written by mode='multistep' with replay='torch' and is "
                    f"replayed at restore: restore it with mode='multistep'")
            self.replay_check(meta, loaded.tensors, where)
        setters = []
        if self.rng and "rng" in meta:
            try:
                setters = _rng.prepare(meta["rng"])
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{where}: {e}") from None
        extra = [k for k in saved if k not in self.state]
        if extra:
            warnings.warn(f"nonstop: checkpoint step {loaded.step} also holds state "
                          f"{', '.join(map(repr, extra))}, not restored", stacklevel=4)
        return values, setters

    def apply(self, plan: tuple) -> None:
        values, setters = plan
        for key, obj in list(self.state.items()):
            value = values[key]
            if stateful(obj):
                if self._restored_in_place(key, obj, value):
                    continue  # load_state_dict would copy every tensor onto itself
                try:
                    _objects.load_state_dict_into(obj, value)
                except CheckpointError:
                    raise
                except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:
                    first = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise CheckpointMismatchError(
                        f"state {key!r}: load_state_dict failed: {first}") from e
            elif isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.copy_(value)
            elif isinstance(obj, dict) and isinstance(value, dict):
                obj.clear()
                obj.update(value)
            elif isinstance(obj, list) and isinstance(value, list):
                obj[:] = value
            else:
                self.state[key] = value
        for setter in setters:
            setter()

    def _restored_in_place(self, key: str, obj: Any, value: Any) -> bool:
        """True when load_state_dict(value) would only copy each tensor onto
        itself: `obj` is a plain nn.Module (torch's load_state_dict and
        _load_from_state_dict on every submodule, no load hooks) whose state
        dict has exactly value's keys, and each value is the live tensor of
        that key, already read in place (_read.destinations). Its checks (missing
        and unexpected keys, shapes) then hold by construction."""
        if (not isinstance(obj, torch.nn.Module) or not isinstance(value, dict)
                or type(obj).load_state_dict is not torch.nn.Module.load_state_dict):
            return False
        flat = self._flat.get(key)
        if not flat or len(flat) != len(value):
            return False
        base = torch.nn.Module._load_from_state_dict
        for m in obj.modules():
            if (type(m)._load_from_state_dict is not base or m._load_state_dict_pre_hooks
                    or m._load_state_dict_post_hooks):
                return False
        return all(isinstance(k, str) and flat.get(f"{key}/{k}") is v for k, v in value.items())


def _flat(key: str, obj) -> dict:
    """The tensors of state `key` by checkpoint name (none unless it is a
    stateful object or a tensor)."""
    out: dict = {}
    if stateful(obj) or isinstance(obj, torch.Tensor):
        _state.flatten(_objects.state_dict_of(obj) if stateful(obj) else obj, key, out)
    return out


def _kind(obj) -> int:
    """What restore() needs of `obj`'s value (export.h StateKind): 1 a tensor,
    3 an optimizer's state dict (not a ZeRO one's), 2 a state dict, 0 anything."""
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, torch.optim.Optimizer) and not _objects.is_zero(obj):
        return 3
    return 2 if stateful(obj) else 0


def _desc(name: str, t) -> tuple:
    """(name, dtype as "float32", shape) for check_state_fits."""
    return name, str(t.dtype).replace("torch.", ""), list(t.shape)
