"""FSDP2 (`torch.distributed.fsdp.fully_shard`) state: DTensors placed Shard(0)
or Replicate() on a 1-D mesh, saved as each rank's rows with their global
layout (TensorSpec.global) and restored, resharded and exported as
docs/DISTRIBUTED.md "FSDP2" describes."""
from __future__ import annotations

import sys
from typing import Optional

import torch

from . import _ext, _objects
from ._state import torch_dtype_by_name
from .errors import IncompatibleCheckpointError


def _dtype(name: str):
    """The torch dtype a distributed checkpoint names (a fixed list, never torch's getattr)."""
    t = torch_dtype_by_name(name)
    if t is None:  # or one this torch lacks (uint16 before torch 2.3)
        raise IncompatibleCheckpointError(f"unknown dtype {name!r} in a distributed checkpoint")
    return t


def view(flat, off: int, n: int, dtype: str, shape):
    """Bytes [off, off + n) of `flat` as a tensor of `dtype` and `shape`."""
    return flat[off:off + n].view(_dtype(dtype)).reshape(shape)


def _dtensor_cls():
    # None until torch.distributed.tensor is imported: no DTensor exists (importing costs seconds)
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(t) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def has_dtensors(tensors: dict) -> bool:
    cls = _dtensor_cls()
    return cls is not None and any(isinstance(t, cls) for t in tensors.values())


def data_ptr(t) -> int:
    """The address of a tensor's memory (a DTensor's data_ptr() is 0: its local shard's)."""
    return t._local_tensor.data_ptr() if is_dtensor(t) else t.data_ptr()


def _placement(t, name: str, world: int) -> str:
    """'S0' or 'R'; anything else is refused with one line (C++ dist.h DTensorPlacement)."""
    from torch.distributed.tensor import Replicate, Shard
    mesh, p = t.device_mesh, t.placements[0]  # one placement: the C++ check wants a 1-D mesh
    kind = ("S0" if isinstance(p, Shard) and p.dim == 0 and t.dim() > 0
            else "R" if isinstance(p, Replicate) else str(p))
    return _ext.core().dist_placement(name, mesh.ndim, mesh.mesh.flatten().tolist(),
                                      str(mesh.mesh.tolist()), kind, world)


def take(tensors: dict, rank: int, world: int) -> tuple[dict, dict, dict, dict]:
    """Splits the DTensors out of `tensors` (name -> tensor, in order): (the
    rest, each Replicate() DTensor as its local, whole tensor, which the caller
    shares as replicated state; the Shard(0) local shards, name -> view; their
    (global_shape, global_offset); the meta["dist"]["dtensor"] document)."""
    rest, shards, layouts, doc = {}, {}, {}, {}
    for name, t in tensors.items():
        if not is_dtensor(t):
            rest[name] = t
            continue
        kind = _placement(t, name, world)
        local = t._local_tensor.detach()  # a view of the shard's memory, never a copy
        shape = [int(d) for d in t.shape]
        doc[name] = [shape, str(t.dtype).replace("torch.", ""), kind]
        if kind == "R":
            rest[name] = local
            continue
        # Its rows and offset, and the check of its shape: C++ (dist.h ShardPieceOf).
        offset, _ = _ext.core().dist_shard_piece(name, shape, rank, world, list(local.shape))
        if local.numel():  # else nothing to write: restored as an empty shard
            shards[name], layouts[name] = local, (shape, offset)
    return rest, shards, layouts, doc


def is_fsdp(module) -> bool:
    """Whether a module holds FSDP2 modules: fully_shard neither shards nor
    synchronises buffers, so each rank's buffers are its own."""
    # Not imported: no FSDP2 module exists (and importing it costs seconds).
    cls = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return cls is not None and any(isinstance(m, cls) for m in module.modules())


def localize(tensors: dict) -> tuple[dict, dict]:
    """One rank (a mesh of one): each DTensor's local tensor is the whole
    tensor. Returns (tensors, meta["dtensor"])."""
    rest, shards, _, doc = take(tensors, 0, 1)
    rest.update(shards)
    return rest, doc


def restored(ckpt, loaded) -> None:
    """Checkpointer.restore's hook: the DTensors an FSDP2 job saved
    (meta["dtensor"] with one process, else meta["dist"]["dtensor"]) become
    DTensors again, on the live model's mesh, before load_state_dict.
    loaded.tensors holds, per DTensor name, this rank's Shard(0) piece as
    read (absent when empty) or the whole tensor of a Replicate() one."""
    meta, tensors, rank, world = loaded.meta, loaded.tensors, ckpt.rank, ckpt.world_size
    doc = meta.get("dtensor") or meta.get("dist", {}).get("dtensor")
    if not doc:
        return
    from torch.distributed.tensor import DTensor, Replicate, Shard
    current: dict = {}  # the live state, flattened: each tensor's mesh
    _objects.flatten_state(ckpt.state, current)
    meshes: dict = {}  # id -> (device mesh, device of the local shards) of the DTensor parameters
    for obj in ckpt.state.values():
        params = (obj.parameters() if isinstance(obj, torch.nn.Module) else
                  [p for g in obj.param_groups for p in g["params"]]
                  if isinstance(obj, torch.optim.Optimizer) else [])
        for p in filter(is_dtensor, params):
            meshes.setdefault(id(p.device_mesh), (p.device_mesh, p._local_tensor.device))
    usable = [(m, d) for m, d in meshes.values() if m.ndim == 1 and m.size() == world]
    # Each one's mesh (the live tensor's, else the parameters' one) and piece,
    # or why none serves: C++ (dist.h PlanDTensorRestore).
    for name, plain, live, shard, shape, want in _ext.core().dist_plan_dtensor_restore(
            [(n, s, d, k) for n, (s, d, k) in doc.items()], rank, world,
            [n for n in doc if is_dtensor(current.get(n))], bool(meshes), len(usable),
            all(m == usable[0][0] for m, _ in usable)):
        if plain:  # one process, no fully_shard (a resharded job in a plain model): whole
            if name in tensors:
                tensors[name] = tensors[name].reshape(shape)
            continue
        cur = current.get(name)
        mesh, device = (cur.device_mesh, cur._local_tensor.device) if live else usable[0]
        if shard and name not in tensors:  # an empty Shard(0) piece is not saved
            tensors[name] = torch.empty(want, dtype=_dtype(doc[name][1]))
        local = tensors[name].reshape(want).to(device)
        stride = torch.empty(shape, device="meta").stride()
        tensors[name] = DTensor.from_local(local, mesh, [Shard(0) if shard else Replicate()],
                                           run_check=False, shape=torch.Size(shape),
                                           stride=stride)


def reshard(readers: list, indices: list, doc: dict, rank: int, world: int, where: str,
            step: int, preset: Optional[list] = None) -> dict:
    """This rank's pieces (name -> tensor shaped for the new world size) of the
    DTensors in `doc` (meta["dist"]["dtensor"]), from checkpoint indices[r] of old
    rank r's Reader readers[r], as C++ planned them (dist_plan_dtensor_reshard).
    `preset`: per old rank, the destinations of its other tensors (in the same
    read; every file is then read, each chunk verified)."""
    specs = [reader.checkpoints[i]["tensors"] for reader, i in zip(readers, indices)]
    layout, total, copies = _ext.core().dist_plan_dtensor_reshard(
        [(name, shape, dtype, kind) for name, (shape, dtype, kind) in doc.items()],
        [(r, i, sp["name"], int(sp.get("global_offset", 0)), int(sp["nbytes"]))
         for r, table in enumerate(specs) for i, sp in enumerate(table)], rank, world, where, step)
    flat = torch.empty(total, dtype=torch.uint8)
    for r, (reader, idx) in enumerate(zip(readers, indices)):
        dests, partial = list(preset[r]) if preset else [(0, 0)] * len(specs[r]), []
        # A piece lying whole in `flat` is read straight there, any other into a
        # buffer of its own and its overlap copied; each file read once, if needed.
        for _, i, src, dst, n in (c for c in copies if c[0] == r):
            whole = src == 0 and n == int(specs[r][i]["nbytes"])
            buf = flat[dst:dst + n] if whole else torch.empty(int(specs[r][i]["nbytes"]),
                                                              dtype=torch.uint8)
            dests[i] = (buf.data_ptr(), buf.numel())
            if not whole:
                partial.append((buf, src, dst, n))
        if preset or any(n for _, n in dests):
            reader.read_into(idx, dests)
        for buf, src, dst, n in partial:
            flat[dst:dst + n] = buf[src:src + n]
    return {name: view(flat, off, n, dtype, shape) for name, dtype, shape, off, n in layout}
