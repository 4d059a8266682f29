"""The torch objects a state holds: which ones checkpoint through
state_dict() (stateful), and a ZeroRedundancyOptimizer, whose rank saves
its own shard (its local optimizer) and restores a consolidated state."""
from __future__ import annotations

import sys

import torch

from . import _state

# The key of a resharded ZeroRedundancyOptimizer's whole (consolidated) state.
CONSOLIDATED = "nonstop_consolidated_zero"


def stateful(obj) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict") and not isinstance(
        obj, (dict, torch.Tensor))


def is_zero(obj) -> bool:
    """True for a ZeroRedundancyOptimizer. Looked up in sys.modules, never
    imported: importing torch.distributed.optim costs ~2 s (TorchScript),
    and an object of that class exists only once its module is imported."""
    mod = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    cls = getattr(mod, "ZeroRedundancyOptimizer", None)
    return cls is not None and isinstance(obj, cls)


def state_dict_of(obj):
    """The state a rank saves for `obj`: a ZeroRedundancyOptimizer saves its
    own shard (its local optimizer), never the consolidated state."""
    if is_zero(obj):
        sd = obj.optim.state_dict()
        # ZeRO copies its own param_groups into the local optimizer only at
        # the next step: a scheduler's newest lr is in ZeRO's groups.
        for local, mine in zip(sd["param_groups"], obj.param_groups):
            local.update({k: v for k, v in mine.items() if k != "params"})
        return sd
    return obj.state_dict()


def load_state_dict_into(obj, value) -> None:
    if isinstance(value, dict) and value.get(CONSOLIDATED) is not None:
        # A resharded ZeroRedundancyOptimizer's whole state (global indices):
        # a new ZeRO partitions it over its ranks; a plain optimizer (one
        # process) takes it as is.
        obj.load_state_dict({k: v for k, v in value.items() if k != CONSOLIDATED})
        if is_zero(obj):
            # ZeRO's load leaves copies (or None) of every parameter's state in
            # its own `state`; the live state is its local optimizer's, and a
            # ZeRO never loaded holds none there.
            obj.state.clear()
        return
    if is_zero(obj):
        obj.optim.load_state_dict(value)
        # ZeRO copies its own param_groups into the local optimizer at each
        # step: give them the restored hyperparameters (lr, betas, ...).
        for mine, local in zip(obj.param_groups, obj.optim.param_groups):
            mine.update({k: v for k, v in local.items() if k != "params"})
        return
    obj.load_state_dict(value)


def local_optimizer_tensors(obj) -> list:
    """Tensors only `obj.step()` changes, beyond obj.param_groups/obj.state."""
    if not is_zero(obj):
        return []
    return [v for st in obj.optim.state.values() for v in st.values()
            if isinstance(v, torch.Tensor)]


def flatten_state(state: dict, tensors: dict) -> dict:
    """The state's JSON tree, its tensors added to `tensors` by name, as a
    checkpoint saves it (a ZeRO optimizer: its local shard); one index of
    `tensors` by memory for every key (a tensor tied across keys stored once)."""
    seen = _state.index(tensors)
    return {key: _state.flatten(state_dict_of(obj) if stateful(obj) else obj, key, tensors,
                                f"state[{key!r}]", seen)
            for key, obj in state.items()}
