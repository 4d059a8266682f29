"""The names torch.distributed.checkpoint.state_dict.get_state_dict gives,
recorded with each checkpoint so that an export needs no model.

get_state_dict keys a model by its own names (wrappers such as DDP's
"module." or torch.compile's "_orig_mod." removed) and an optimizer's state
by the fully qualified name (FQN) of each parameter, the first name
named_parameters() gives it (a tied weight's state is under its first name).
A checkpoint's state keeps torch's own state_dict() form (optimizer state by
index); `describe` records, in the metadata's "names":

    {"modules": {"model": "module."},                  # the wrapper prefix
     "optimizers": {"optim": {"module": "model", "params": ["tok.weight", ...]}}}

where params[i] is the FQN of the optimizer's parameter index i. An
optimizer is named only when every parameter of it belongs to one module of
the state. A ZeroRedundancyOptimizer is named by its global parameter order
(its consolidated state_dict's indices): each rank saves its own shard, and
the export consolidates the shards first (_dcp.layout).
"""
from __future__ import annotations

import torch

from . import _unwrap


def describe(state: dict) -> dict:
    """{"modules": ..., "optimizers": ...} for `state` (see above); {} when
    it holds no module."""
    modules: dict = {}
    names: dict = {}  # state key -> {id(param): FQN}
    for key, obj in state.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        inner = _unwrap.module(obj)
        prefix = ""
        if inner is not obj:
            for n, m in obj.named_modules():
                if m is inner:
                    prefix = n + "."
                    break
        modules[key] = prefix
        names[key] = {}
        for n, p in inner.named_parameters():  # first name of a tied weight
            names[key].setdefault(id(p), n)
    if not modules:
        return {}
    optimizers: dict = {}
    for key, obj in state.items():
        opt = _unwrap.optimizer(obj)
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        params = [p for g in opt.param_groups for p in g["params"]]
        for mkey, by_id in names.items():
            if params and all(id(p) in by_id for p in params):
                optimizers[key] = {"module": mkey, "params": [by_id[id(p)] for p in params]}
                break
    return {"modules": modules, "optimizers": optimizers}
