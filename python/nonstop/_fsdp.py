"""FSDP2 (`torch.distributed.fsdp.fully_shard`) state: DTensors (docs/DISTRIBUTED.md, "FSDP2").

FSDP2 keeps each parameter, and the optimizer keeps each of its state
tensors, as a DTensor placed `Shard(0)` on a 1-D device mesh: rank r holds
rows `[r*ceil(d0/W), (r+1)*ceil(d0/W))` of dim 0 (torch.chunk's split, so
the last ranks may hold fewer rows, or none). Such a shard is one flat
element range of the row-major global tensor, so it is recorded with the
mechanism the replicated shares use (TensorSpec.global: global shape and
flat element offset), and nothing else is invented:

* **Saving.** Each rank registers `to_local()` (a view of the shard's own
  memory, no copy) under the DTensor's name, with its place in the global
  tensor, and lists the name in `meta["dist"]["dtensor"]`
  (`name -> [global shape, dtype, placement]`). A rank whose shard is empty
  writes nothing for it. `Replicate()` DTensors are written as replicated
  tensors (1/world share per rank). Buffers of FSDP2 modules (fully_shard
  neither shards nor synchronises them) are rank-local: each rank writes
  its own, whole.
* **Restoring, same world size.** Each rank reads only its own shard from
  its own file (bitwise) and wraps it again with `DTensor.from_local` on the
  mesh of the live model (no collective).
* **Restoring, another world size.** `reshard()` reads the overlapping
  ranges of every old rank file (all must be visible in the job directory)
  and builds this rank's new shard; see read_ranges().
* **DCP export.** `_dcp.collect` reassembles these names like the
  replicated ones (the global layout is the same), so the export holds
  plain full tensors that `torch.distributed.checkpoint.load` reshards into
  any placement.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from . import _objects, _read
from ._read import RANK_FILE, read_tensors
from ._state import loads, torch_dtype
from .errors import CheckpointMismatchError, IncompatibleCheckpointError


def _dtensor_cls():
    """The DTensor class, or None while torch.distributed.tensor has not been
    imported (then no DTensor exists; importing it here would cost seconds)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None)


def is_dtensor(t) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def has_dtensors(tensors: dict) -> bool:
    cls = _dtensor_cls()
    return cls is not None and any(isinstance(t, cls) for t in tensors.values())


def data_ptr(t) -> int:
    """The address of a tensor's memory; for a DTensor, of its local shard
    (DTensor.data_ptr() is 0)."""
    if is_dtensor(t):
        return t._local_tensor.data_ptr()
    return t.data_ptr()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def rows(d0: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [begin, end) of dim 0 that rank `rank` holds under Shard(0)
    (torch.chunk's split, which FSDP2 and DTensor use)."""
    per = -(-d0 // world) if d0 else 0
    return min(rank * per, d0), min((rank + 1) * per, d0)


def _placement(t, name: str, rank: int, world: int) -> str:
    """'S0' or 'R'; anything else is refused with one line."""
    from torch.distributed.tensor import Replicate, Shard
    mesh = t.device_mesh
    ranks = mesh.mesh.flatten().tolist()
    if mesh.ndim != 1 or ranks != list(range(world)):
        raise CheckpointMismatchError(
            f"tensor {name!r} is a DTensor on mesh {mesh.mesh.tolist()}: nonstop handles "
            f"DTensors on a 1-D mesh over all {world} ranks (FSDP2 fully_shard); HSDP and "
            f"2-D meshes are not supported yet")
    (p,) = t.placements
    if isinstance(p, Shard) and p.dim == 0 and t.dim() > 0:
        return "S0"
    if isinstance(p, Replicate):
        return "R"
    raise CheckpointMismatchError(
        f"tensor {name!r} is a DTensor placed {p}: nonstop handles Shard(0) (FSDP2's "
        f"default) and Replicate() placements only")


def take(tensors: dict, rank: int, world: int) -> tuple[dict, dict, dict, dict]:
    """Splits the DTensors out of `tensors` (name -> tensor, in order).

    Returns (tensors with each Replicate() DTensor replaced by its local,
    full tensor: the caller shares those as replicated state; the Shard(0)
    local shards to register, name -> view; their layouts, name ->
    (global_shape, global_offset); the `meta["dist"]["dtensor"]` document)."""
    rest, shards, layouts, doc = {}, {}, {}, {}
    for name, t in tensors.items():
        if not is_dtensor(t):
            rest[name] = t
            continue
        kind = _placement(t, name, rank, world)
        local = t._local_tensor.detach()  # a view of the shard's memory, never a copy
        shape = [int(d) for d in t.shape]
        doc[name] = [shape, str(t.dtype).replace("torch.", ""), kind]
        if kind == "R":
            rest[name] = local
            continue
        begin, end = rows(shape[0], rank, world)
        want = [end - begin] + shape[1:]
        if list(local.shape) != want:
            raise CheckpointMismatchError(
                f"tensor {name!r}: rank {rank}'s Shard(0) piece has shape {list(local.shape)}, "
                f"not {want} (rows {begin}..{end} of {shape}): nonstop expects torch.chunk's "
                f"split of dim 0")
        if local.numel() == 0:
            continue  # nothing to write; restored as an empty shard
        shards[name] = local
        layouts[name] = (shape, begin * _numel(shape[1:]))
    return rest, shards, layouts, doc


def shard(dist, tensors: dict, state: dict) -> tuple[dict, dict, dict]:
    """Distributed.shard with FSDP2 DTensors: their Shard(0) local pieces
    are this rank's own (with their global layout), the rest (Replicate()
    DTensors' local tensors included) is shared as replicated state.
    Returns what Distributed.shard does; meta["dist"]["dtensor"] lists the
    DTensors."""
    rest, shards, fl, doc = take(tensors, dist.rank, dist.world)
    own = fsdp_buffers(state)
    out, layouts, ddoc = dist.shard({n: t for n, t in rest.items() if n not in own}, state)
    out.update((n, t) for n, t in rest.items() if n in own)
    out.update(shards)
    layouts.update(fl)
    if doc:
        ddoc["dtensor"] = doc
    return out, layouts, ddoc


def fsdp_buffers(state: dict) -> set:
    """Names of the buffers (BatchNorm running statistics, ...) of FSDP2
    modules in the state. fully_shard neither shards nor synchronises
    buffers, so each rank's are its own: each rank writes and restores its
    own, whole."""
    # Not imported: no FSDP2 module exists (and importing it costs seconds).
    FSDPModule = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if FSDPModule is None:
        return set()
    names = set()
    for key, obj in state.items():
        if isinstance(obj, torch.nn.Module) and any(
                isinstance(m, FSDPModule) for m in obj.modules()):
            names |= {f"{key}/{n}" for n, _ in obj.named_buffers()}
    return names


def localize(tensors: dict) -> tuple[dict, dict]:
    """One rank (a mesh of one): each DTensor's local tensor is the whole
    tensor. Returns (tensors, meta["dtensor"])."""
    rest, shards, _, doc = take(tensors, 0, 1)
    rest.update(shards)
    return rest, doc


def restored(ckpt, loaded) -> None:
    """Checkpointer.restore's hook: the DTensors saved by an FSDP2 job become
    DTensors again (on the live model's mesh) before load_state_dict."""
    meta = loaded.meta
    if not (meta.get("dtensor") or meta.get("dist", {}).get("dtensor")):
        return
    current: dict = {}
    _objects.flatten_state(ckpt.state, current)
    if meta.get("dtensor"):
        meta = dict(meta, dist=dict(meta.get("dist", {}), dtensor=meta["dtensor"]))
    wrap(loaded.tensors, meta, ckpt.state, current, ckpt.rank, ckpt.world_size)


# --------------------------------------------------------------- restoring


def _meshes(state: dict) -> list:
    """(device mesh, device of the local shards) of the DTensor parameters
    in the live state, one per mesh."""
    found = []
    for obj in state.values():
        params = []
        if isinstance(obj, torch.nn.Module):
            params = list(obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
        for p in params:
            if is_dtensor(p) and all(p.device_mesh is not m for m, _ in found):
                found.append((p.device_mesh, p._local_tensor.device))
    return found


def _mesh_for(name: str, current: dict, meshes: list, world: int) -> tuple:
    """(mesh, device) for the DTensor `name`: the live tensor's of that name
    (a module's parameter), else the one mesh of the live parameters (an
    optimizer's state before its first step)."""
    t = current.get(name)
    if t is not None and is_dtensor(t):
        return t.device_mesh, t._local_tensor.device
    usable = [(m, d) for m, d in meshes if m.ndim == 1 and m.size() == world]
    if usable and all(m == usable[0][0] for m, _ in usable):
        return usable[0]
    if not usable:
        raise CheckpointMismatchError(
            f"tensor {name!r} was saved as an FSDP2 DTensor, but the state to restore has no "
            f"DTensor parameters on a 1-D mesh of {world} ranks: apply fully_shard before "
            f"restore()")
    raise CheckpointMismatchError(
        f"tensor {name!r}: the state to restore has DTensors on {len(usable)} different "
        f"meshes; nonstop cannot tell which one this tensor belongs to")


def wrap(tensors: dict, meta: dict, state: dict, current: dict, rank: int, world: int) -> None:
    """Turns the restored pieces of the DTensors listed in meta["dist"]["dtensor"]
    back into DTensors (in `tensors`, in place), on the live model's mesh.

    `tensors` holds, per DTensor name, this rank's Shard(0) piece as read
    from its own file (absent when the piece is empty) or the reassembled
    full tensor of a Replicate() one. `current` is the live state, flattened
    (name -> tensor), to find each tensor's mesh."""
    doc = meta.get("dist", {}).get("dtensor") or {}
    if not doc:
        return
    from torch.distributed.tensor import DTensor, Replicate, Shard
    meshes = _meshes(state)
    for name, (shape, dtype, kind) in doc.items():
        cur = current.get(name)
        if world == 1 and not meshes and (cur is None or not is_dtensor(cur)):
            # One process without fully_shard (a resharded FSDP checkpoint
            # loaded into a plain model): the whole tensor, as is.
            if name in tensors:
                tensors[name] = tensors[name].reshape(shape)
            continue
        mesh, device = _mesh_for(name, current, meshes, world)
        dt = getattr(torch, dtype)
        if kind == "R":
            local, placement = tensors[name], Replicate()
        else:
            begin, end = rows(shape[0], rank, world)
            want = [end - begin] + list(shape[1:])
            local = tensors.get(name)
            if local is None:
                local = torch.empty(want, dtype=dt)
            local = local.reshape(want)
            placement = Shard(0)
        local = local.to(device)
        stride = torch.empty(shape, device="meta").stride()
        tensors[name] = DTensor.from_local(local, mesh, [placement], run_check=False,
                                           shape=torch.Size(shape), stride=stride)


# -------------------------------------------------------------- resharding


def read_ranges(readers: list, indices: list, wanted: dict) -> dict:
    """Assembles element ranges of global tensors from several rank files.

    readers[r] is old rank r's Reader and indices[r] the index of the
    checkpoint to read in it. `wanted` maps name -> (global_shape, dtype,
    begin, end): the flat element range [begin, end) of the global tensor.
    Every old rank's pieces of that name (TensorSpec.global: global_offset
    and piece size) that overlap the range are read, chunk crcs verified,
    and copied in. Returns name -> 1-D tensor of end - begin elements.
    Raises when some element of a range is held by no old rank."""
    out, filled = {}, {}
    for name, (shape, dtype, begin, end) in wanted.items():
        out[name] = torch.empty(end - begin, dtype=getattr(torch, dtype))
        filled[name] = 0
    for reader, idx in zip(readers, indices):
        info = reader.checkpoints[idx]
        take = {}  # name -> (lo, hi, g0, begin) of the pieces this file holds
        for spec in info["tensors"]:
            name = spec["name"]
            if name not in wanted:
                continue
            _, _, begin, end = wanted[name]
            n = _numel(spec["shape"])
            g0 = int(spec.get("global_offset", 0))
            lo, hi = max(begin, g0), min(end, g0 + n)
            if lo < hi:
                torch_dtype(spec["dtype"])  # a bad dtype code: one-line error before the read
                take[name] = (lo, hi, g0, begin)
        if not take:
            continue
        # One read of the file through the C++ restore path (every crc chunk
        # read and verified once), not one per tensor.
        got = read_tensors(reader, idx, names=take.__contains__)
        for name, (lo, hi, g0, begin) in take.items():
            piece = got[name].reshape(-1)
            out[name][lo - begin:hi - begin] = piece[lo - g0:hi - g0]
            filled[name] += hi - lo
    for name, (_, _, begin, end) in wanted.items():
        if filled[name] != end - begin:
            raise IncompatibleCheckpointError(
                f"tensor {name!r}: the old rank files hold {filled[name]} of elements "
                f"{begin}..{end}; some rank file is missing or incomplete")
    return out


def reshard(dir: str, step_key: tuple, doc: dict, rank: int, world: int,
            core, sources=None) -> dict:
    """This rank's Shard(0) pieces (name -> tensor shaped for the new world
    size) of the DTensors in `doc`, read from every old rank file of `dir`
    at checkpoint `step_key` = (step, lineage). Replicate() ones come whole.
    sources: (readers, indices) of the old rank files' checkpoints already
    chosen (the job directory's reshard choice); else `dir` is read here."""
    if sources is not None:
        readers, indices = sources
        return _pieces(readers, list(indices), doc, rank, world)
    readers = _read.readers(dir)
    indices = []
    for r, reader in enumerate(readers):
        found = None
        for i, c in enumerate(reader.checkpoints):
            meta = loads(c["meta_json"].decode("utf-8")) if c["committed"] else None
            if meta is not None and _read.step_key(meta) == tuple(step_key):
                found = i
                break
        if found is None:
            raise IncompatibleCheckpointError(
                f"old rank {r} of {dir} holds no committed checkpoint at step {step_key[0]}")
        indices.append(found)
    return _pieces(readers, indices, doc, rank, world)


def _pieces(readers: list, indices: list, doc: dict, rank: int, world: int) -> dict:
    wanted = {}
    for name, (shape, dtype, kind) in doc.items():
        if kind == "R":
            wanted[name] = (shape, dtype, 0, _numel(shape))
        else:
            b, e = rows(shape[0], rank, world)
            inner = _numel(shape[1:])
            wanted[name] = (shape, dtype, b * inner, e * inner)
    flat = read_ranges(readers, indices, wanted)
    out = {}
    for name, (shape, dtype, kind) in doc.items():
        if kind == "R":
            out[name] = flat[name].reshape(shape)
        else:
            b, e = rows(shape[0], rank, world)
            out[name] = flat[name].reshape([e - b] + list(shape[1:]))
    return out


def old_world(dir: str) -> Optional[int]:
    """The world size the rank files in `dir` were written with, or None."""
    if not os.path.isdir(dir):
        return None
    ranks = sorted(int(m.group(1)) for m in map(RANK_FILE.match, os.listdir(dir)) if m)
    return ranks[-1] + 1 if ranks else None
