"""In distributed training, a tensor of `state` that is not rank-local
(not under `local=`, not a ZeRO shard, not an FSDP2 shard or buffer, not a
module buffer DDP takes from rank 0) is treated as replicated: each rank
writes a share of it and every rank restores the same bytes. A rank-local
tensor given without `local=` would come back as a mix of the ranks'
pieces. So the first checkpoint of a Checkpointer compares a hash of each
replicated tensor across the ranks (two all_gathers on the Checkpointer's
own gloo group, before its agreement thread uses it: the names' count and
crc, then 8 bytes per tensor) and raises a one-line
CheckpointMismatchError naming the first tensor that differs and `local=`.

The hash is zlib's crc32 of a CPU tensor's bytes (no copy) or, on a
device, a position-weighted int64 sum computed there in pieces; it is
deterministic, so equal tensors always agree.
"""
from __future__ import annotations

import zlib

import torch

from .errors import CheckpointMismatchError

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
    Collective: every rank calls it with the same names."""
    # The same names on every rank first (else the second gather could not match).
    shape = torch.tensor([len(names), zlib.crc32("\n".join(names).encode())], dtype=torch.int64)
    shapes = [torch.empty_like(shape) for _ in range(dist.world)]
    torch.distributed.all_gather(shapes, shape, group=dist.group)
    for r, other in enumerate(shapes):
        if not torch.equal(other, shape):
            raise CheckpointMismatchError(
                f"rank {dist.rank} and rank {r} hold different state: {len(names)} and "
                f"{int(other[0])} tensors treated as replicated; every rank must give the "
                f"same state (rank-local keys under local=)")
    mine = torch.tensor([digest(tensors[n]) for n in names] or [0], dtype=torch.int64)
    got = [torch.empty_like(mine) for _ in range(dist.world)]
    torch.distributed.all_gather(got, mine, group=dist.group)
    for i, name in enumerate(names):
        values = [int(g[i]) for g in got]
        if any(v != values[0] for v in values):
            other = next(r for r, v in enumerate(values) if v != values[0])
            key = name.split("/", 1)[0]
            raise CheckpointMismatchError(
                f"state[{key!r}]: tensor {name!r} is treated as replicated but differs between "
                f"rank 0 and rank {other}; if it is rank-local state, pass "
                f"local=[{key!r}] to the Checkpointer")
