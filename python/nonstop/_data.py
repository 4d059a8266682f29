"""Data loaders: is the order a restored loader yields the order the
uninterrupted run would have seen? check_loader() refuses, with one line
naming the fix, a loader that would resume in another order or shift the
global RNG: docs/EXACT_RESUME.md "Data loaders" says which and why. Only
types are looked at: nothing is iterated, nothing is imported.
"""
from __future__ import annotations

from typing import Optional

import torch.utils.data
from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

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


def _is_loader(obj) -> bool:
    base = getattr(obj, "base_dataloader", obj)  # Accelerate's DataLoaderShard
    return (isinstance(base, torch.utils.data.DataLoader)
            and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def _positional_only(sampler) -> bool:
    """A random sampler whose state a loader can keep only as a position."""
    if not isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)):
        return False
    return not (callable(getattr(sampler, "state_dict", None))
                and callable(getattr(sampler, "load_state_dict", None)))


def check_loader(loader, where: str, ddp_wrapped: Optional[str] = None) -> None:
    """Raises CheckpointMismatchError when `loader` (a stateful data loader)
    would not resume in the exact order; see the module docstring.
    `ddp_wrapped`: the sampler Lightning wrapped in a DistributedSamplerWrapper
    (lightning.py), refused for any loader."""
    stateful = _is_loader(loader)
    if not stateful and ddp_wrapped is None:
        return
    gen = getattr(loader, "generator", None)
    found = [(f"{type(s).__module__}.{type(s).__name__}", _positional_only(s),
              gen is not None and getattr(s, "generator", None) is gen) for s in samplers(loader)]
    _ext.core().check_loader_order(where, type(getattr(loader, "base_dataloader", loader)).__name__,
                                   stateful, found, gen is not None, ddp_wrapped)


def check_state(state: dict) -> None:
    """check_loader on every value of a Checkpointer's state."""
    for key, obj in state.items():
        check_loader(obj, f"state[{key!r}]")
