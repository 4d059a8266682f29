"""Data loaders: is the order a restored loader yields the order the
uninterrupted run would have seen? (docs/EXACT_RESUME.md)

A torchdata StatefulDataLoader saves how many samples its sampler yielded in
the current epoch. When the sampler is not stateful itself (torch's
RandomSampler, SubsetRandomSampler, WeightedRandomSampler), a restored loader
draws a *fresh* permutation from the sampler's generator as it stands after
the restart (the seed it was built with: epoch 1's order) and skips that
many samples: exact in epoch 1, silently wrong in every later epoch.
torchdata's own RandomSampler saves its generator state as of the epoch
start and draws the same permutation again: exact.

check_state() refuses, with one line naming the fix, every loader in a
state whose restored order or RNG stream would differ:
- a random sampler of torch's that is not stateful;
- a sampler drawing from the loader's own generator (shuffle=True,
  generator=g: each iter(loader) draws its base seed from g before the
  sampler draws its permutation, a draw the restored state does not hold);
- a loader without generator= (each iter(loader) then draws its base seed
  from the global RNG: a restarted job calls iter() once more mid-epoch,
  and every later global-RNG draw, dropout's, shifts).

Only types are looked at: nothing is iterated, nothing is imported.
"""
from __future__ import annotations

import torch.utils.data
from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from .errors import CheckpointMismatchError

FIX_SAMPLER = ("sampler=torchdata.stateful_dataloader.sampler.RandomSampler(dataset, "
               "generator=torch.Generator().manual_seed(SEED))")
FIX_GENERATOR = "generator=torch.Generator().manual_seed(SEED2)"


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


def check_loader(loader, where: str) -> None:
    """Raises CheckpointMismatchError when `loader` (a stateful data loader)
    would not resume in the exact order; see the module docstring."""
    if not _is_loader(loader):
        return
    name = type(getattr(loader, "base_dataloader", loader)).__name__
    gen = getattr(loader, "generator", None)
    for s in samplers(loader):
        if _positional_only(s):
            raise CheckpointMismatchError(
                f"{where}: {name} restores the position of a {type(s).__module__}."
                f"{type(s).__name__}, not its permutation (a checkpoint in epoch >= 2 would "
                f"resume with epoch 1's order); use {FIX_SAMPLER} (docs/EXACT_RESUME.md)")
        sg = getattr(s, "generator", None)
        if gen is not None and sg is gen:
            raise CheckpointMismatchError(
                f"{where}: the sampler draws from the loader's own generator (shuffle=True, "
                f"generator=g), so a restored loader's next epoch has another order; give the "
                f"sampler its own: {FIX_SAMPLER} (docs/EXACT_RESUME.md)")
    if gen is None:
        raise CheckpointMismatchError(
            f"{where}: {name} has no generator=, so each iter() draws from the global RNG "
            f"(once more after a restart: dropout and every later draw shift); "
            f"give it {FIX_GENERATOR} (docs/EXACT_RESUME.md)")


def check_state(state: dict) -> None:
    """check_loader on every value of a Checkpointer's state."""
    for key, obj in state.items():
        check_loader(obj, f"state[{key!r}]")
