"""The real object behind a framework's wrapper.

Accelerate's `prepare()` hands back an `AcceleratedOptimizer` (a
torch.optim.Optimizer subclass that never ran Optimizer.__init__, so it has
no step hooks of its own) and an `AcceleratedScheduler`; Lightning steps a
`LightningOptimizer`; DDP and torch.compile wrap the module. nonstop hooks
and registers the wrapped object; the wrapper keeps delegating to it, so
state_dict() and load_state_dict() are the same either way.

Module wrappers are not unwrapped for naming: a DDP model in `state` is
saved under its own state_dict() names ("module.x"), as before; describe()
records the names get_state_dict gives them (docs/DISTRIBUTED.md "Interop
with DCP"), so that an export needs no model.
"""
from __future__ import annotations

import torch


def optimizer(obj):
    """The torch optimizer that actually steps: follows `.optimizer` through
    wrappers that have no step hooks of their own (AcceleratedOptimizer,
    LightningOptimizer). Anything else comes back as it is."""
    seen = set()
    while id(obj) not in seen:
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(obj):
            return obj
        if isinstance(obj, (dict, list, tuple, torch.Tensor, torch.nn.Module)):
            return obj
        inner = getattr(obj, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            return obj
        obj = inner
    return obj


def optimizers(values) -> list:
    """The torch optimizers (unwrapped) among `values`, each once."""
    out, ids = [], set()
    for v in values:
        o = optimizer(v)
        if isinstance(o, torch.optim.Optimizer) and id(o) not in ids:
            ids.add(id(o))
            out.append(o)
    return out


def module(obj):
    """The module behind DDP/FSDP-style (`.module`) and torch.compile
    (`._orig_mod`) wrappers."""
    while isinstance(obj, torch.nn.Module):
        inner = obj._modules.get("module") if hasattr(obj, "_modules") else None
        if isinstance(inner, torch.nn.Module) and type(obj).__name__ in (
                "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"):
            obj = inner
            continue
        orig = getattr(obj, "_orig_mod", None)
        if isinstance(orig, torch.nn.Module):
            obj = orig
            continue
        break
    return obj


def describe(state: dict) -> dict:
    """The names torch.distributed.checkpoint.state_dict.get_state_dict gives
    `state` (each module's wrapper prefix, each optimizer parameter's FQN),
    recorded as the metadata's "names": {"modules": ..., "optimizers": ...};
    {} when it holds no module."""
    modules: dict = {}
    names: dict = {}  # state key -> {id(param): FQN}
    for key, obj in state.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        inner = module(obj)
        modules[key] = "" if inner is obj else next(
            (n + "." for n, m in obj.named_modules() if m is inner), "")
        names[key] = {}
        for n, p in inner.named_parameters():  # first name of a tied weight
            names[key].setdefault(id(p), n)
    if not modules:
        return {}
    optimizers: dict = {}
    for key, obj in state.items():
        opt = optimizer(obj)
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        params = [p for g in opt.param_groups for p in g["params"]]
        for mkey, by_id in names.items():
            if params and all(id(p) in by_id for p in params):
                optimizers[key] = {"module": mkey, "params": [by_id[id(p)] for p in params]}
                break
    return {"modules": modules, "optimizers": optimizers}
