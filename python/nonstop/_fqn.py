"""The names torch.distributed.checkpoint.state_dict.get_state_dict gives
(each module's wrapper prefix, each optimizer parameter's FQN), recorded
with each checkpoint as the metadata's "names" so that an export needs no
model: docs/DISTRIBUTED.md "Interop with DCP" describes the record.
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
        modules[key] = "" if inner is obj else next(
            (n + "." for n, m in obj.named_modules() if m is inner), "")
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
