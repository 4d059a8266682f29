"""Data loaders: is the order a restored loader yields the order the
uninterrupted run would have seen? check_loader() refuses, with one line
naming the fix, a loader that would resume in another order or shift the
global RNG: docs/EXACT_RESUME.md "Data loaders" says which and why. Only
types are looked at: nothing is iterated, nothing is imported.
"""
from __future__ import annotations

import torch.utils.data
from torch.utils.data import (RandomSampler, SequentialSampler, SubsetRandomSampler,
                              WeightedRandomSampler)

from . import _ext


def samplers(loader, depth: int = 0):
    """The samplers and batch samplers under `loader`, outermost first."""
    if depth > 4:
        return
    for attr in ("batch_sampler", "sampler"):
        s = getattr(loader, attr, None)
        if s is not None and s is not loader:
            yield s
            yield from samplers(s, depth + 1)


def _stateful(obj) -> bool:
    return (callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def _positional_only(sampler) -> bool:
    """A random sampler whose state a loader can keep only as a position."""
    return (isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler))
            and not _stateful(sampler))


def check_loader(loader, where: str) -> None:
    """Raises CheckpointMismatchError when `loader` (a stateful data loader,
    or any under a DistributedSamplerWrapper: what Lightning makes of a
    sampler other than torch's under DDP) would not resume in the exact
    order; see the module docstring."""
    found = list(samplers(loader))
    wrap = next((s for s in found if type(s).__name__ == "DistributedSamplerWrapper"), None)
    inner = getattr(getattr(wrap, "dataset", None), "_sampler", None)
    wrapped = None if wrap is None or isinstance(inner, SequentialSampler) else type(inner).__name__
    base = getattr(loader, "base_dataloader", loader)  # Accelerate's DataLoaderShard
    stateful = isinstance(base, torch.utils.data.DataLoader) and _stateful(loader)
    if not stateful and wrapped is None:
        return
    gen = getattr(loader, "generator", None)
    facts = [(f"{type(s).__module__}.{type(s).__name__}", _positional_only(s),
              gen is not None and getattr(s, "generator", None) is gen) for s in found]
    _ext.core().check_loader_order(where, type(base).__name__, stateful, facts, gen is not None,
                                   wrapped)


def check_state(state: dict) -> None:
    """check_loader on every value of a Checkpointer's state."""
    for key, obj in state.items():
        check_loader(obj, f"state[{key!r}]")
