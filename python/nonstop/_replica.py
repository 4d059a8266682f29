"""Replicated means equal: the first checkpoint of a Checkpointer compares
a hash of each tensor treated as replicated across the ranks and names the
first that differs, and local= (docs/DISTRIBUTED.md "Replicated means equal").
"""
from __future__ import annotations

import zlib

import torch

from . import _ext

_PIECE = 1 << 22  # elements per piece of a device tensor's hash


def digest(t: torch.Tensor) -> int:
    """A hash of the bytes of `t` (a DTensor: of its local tensor), in int64."""
    t = getattr(t, "_local_tensor", t).detach()
    if t.numel() == 0:
        return 0
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return zlib.crc32(flat.numpy())
    words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for i in range(0, words.numel(), _PIECE):
        piece = words[i:i + _PIECE].to(torch.int64)
        pos = torch.arange(i + 1, i + 1 + piece.numel(), dtype=torch.int64, device=flat.device)
        total = total * 1000003 + (piece * pos).sum()
    return int(total.item()) & 0x7FFFFFFFFFFFFFFF


def check(dist, tensors: dict, names: list) -> None:
    """Raises CheckpointMismatchError on every rank when one of `names`
    (tensors treated as replicated; `tensors`: this rank's full tensors by
    name) differs between the ranks of `dist` (a _distributed.Distributed).
    Collective: every rank calls it with the same names. Decided in C++
    (plan/replica_check.h)."""
    # One JSON gather (Distributed.comm): the names' count and hash, then the
    # digests; ranks that hold different names are told so first.
    mine = [len(names), zlib.crc32("\n".join(names).encode())] + [digest(tensors[n]) for n in names]
    every = dist.comm().gather(mine)
    _ext.core().check_replica_names(dist.rank, [e[:2] for e in every])
    _ext.core().check_replica_digests(names, [e[2:] for e in every])
