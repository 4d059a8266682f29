"""nonstop.export(dir, out, format="dcp"): a nonstop job directory as a
torch.distributed.checkpoint (DCP) checkpoint, loadable under any world size.

    python -m nonstop._dcp DIR OUT [--step N]

Reads every rank file of DIR (all of them must be reachable from this
process: copy them together first when ranks used local disks), picks the
newest step committed on every rank (the globally committed one) or `step`,
reassembles each replicated tensor and each FSDP2 (DTensor) parameter or
optimizer state from the ranks' pieces (TensorSpec.global) and writes one DCP
checkpoint of full tensors with a single process; DCP loads them into any
placement (e.g. a fully_shard model's DTensors) under any world size. Rank-local tensors
(ZeRO-1 optimizer shards, state given as local=) have no global name: they
are written as `rank-R/NAME`. The key `nonstop.step` holds the step.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Optional

import torch

from . import _state
from .errors import CheckpointNotFoundError, IncompatibleCheckpointError

_RANK_FILE = re.compile(r"^rank-(\d{5})\.nsck$")


def _readers(path: str):
    from ._checkpointer import _core
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
    ranks = sorted(int(m.group(1)) for m in map(_RANK_FILE.match, os.listdir(path)) if m)
    if not ranks:
        raise CheckpointNotFoundError(f"no nonstop checkpoint in {path}")
    readers = [_core().Reader(path, rank=r, verify_data=True) for r in ranks]
    world = readers[0].geometry["world_size"]
    if ranks != list(range(world)):
        raise IncompatibleCheckpointError(
            f"{path} holds rank files {ranks} of a job of world size {world}: every rank file "
            f"is needed (copy the ranks' local directories together)")
    return readers


def _key(meta: dict) -> tuple:
    return int(meta.get("step", -1)), int(meta.get("dist", {}).get("lineage", 0))


def collect(path: str, step: Optional[int] = None) -> tuple[int, dict]:
    """(step, {name: full tensor}) of the newest checkpoint committed on
    every rank of `path` (or of `step`)."""
    readers = _readers(path)
    per_rank = []
    for reader in readers:
        found = {}
        for i, c in enumerate(reader.checkpoints):
            if not c["committed"]:
                continue
            meta = _state.loads(c["meta_json"].decode("utf-8"))
            found.setdefault(_key(meta), (i, meta))
        per_rank.append(found)
    common = set(per_rank[0])
    for f in per_rank[1:]:
        common &= set(f)
    order = sorted((k for k in common if step is None or k[0] == step), reverse=True)
    if not order:
        raise CheckpointNotFoundError(
            f"no checkpoint {'at step ' + str(step) + ' ' if step is not None else ''}"
            f"committed on every rank of {path}")
    key = order[0]
    out: dict = {}
    doc = per_rank[0][key][1].get("dist", {})
    shared = dict(doc.get("shared", {}))
    # FSDP2 Shard(0) DTensors: each rank wrote its rows with the same global
    # layout as a replicated share (_fsdp.py), so they reassemble the same way.
    for name, (shape, dtype, _) in doc.get("dtensor", {}).items():
        shared.setdefault(name, [shape, dtype])
    for name, (shape, dtype) in shared.items():
        out[name] = torch.zeros(shape, dtype=getattr(torch, dtype))
    for r, (reader, found) in enumerate(zip(readers, per_rank)):
        idx, _ = found[key]
        info = reader.checkpoints[idx]
        for ti, spec in enumerate(info["tensors"]):
            t = torch.empty(spec["shape"], dtype=_state.torch_dtype(spec["dtype"]))
            if spec["nbytes"]:
                reader.read_tensor(idx, ti, t.data_ptr(), spec["nbytes"])
            name = spec["name"]
            if name in shared:
                flat = out[name].view(-1)
                off = spec["global_offset"]
                flat[off:off + t.numel()] = t.view(-1)
            elif len(readers) > 1:
                out[f"rank-{r}/{name}"] = t
            else:
                out[name] = t
    return key[0], out


def export_dcp(dir: str, out: str, step: Optional[int] = None) -> dict:
    """Writes the globally committed checkpoint (or `step`) of `dir` as a DCP
    checkpoint directory `out`. Returns {'step', 'tensors', 'bytes', 'path'}."""
    import torch.distributed.checkpoint as dcp
    got_step, tensors = collect(os.fspath(dir), step)
    state = dict(tensors)
    state["nonstop.step"] = torch.tensor(got_step, dtype=torch.int64)
    os.makedirs(out, exist_ok=True)
    import inspect
    kw = {}
    if "no_dist" in inspect.signature(dcp.save).parameters and not (
            torch.distributed.is_available() and torch.distributed.is_initialized()):
        kw["no_dist"] = True  # one process writes every tensor whole
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out), **kw)
    return {"step": got_step, "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "path": out}


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m nonstop._dcp",
                                description="export a nonstop checkpoint as a DCP checkpoint")
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--step", type=int, default=None)
    a = p.parse_args(argv)
    try:
        r = export_dcp(a.dir, a.out, a.step)
    except Exception as e:  # one line, as the CLI does
        print(f"nonstop export: {e}", file=sys.stderr)
        return 1
    print(f"step {r['step']}: {r['tensors']} tensors, {r['bytes']} bytes -> {r['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def export(dir: str, out: str, step: Optional[int] = None, rank: int = 0,
           include: Optional[str] = None, format: str = "safetensors") -> dict:
    """nonstop.export: format="safetensors" (one rank's tensors in one file,
    see _export.py) or format="dcp" (every rank, reassembled, as DCP)."""
    if format == "dcp":
        if include is not None or rank != 0:
            raise ValueError("format='dcp' exports every rank and tensor; drop include=/rank=")
        return export_dcp(dir, out, step)
    if format != "safetensors":
        raise ValueError(f"format must be 'safetensors' or 'dcp', got {format!r}")
    from ._export import export as export_safetensors
    return export_safetensors(dir, out, step=step, rank=rank, include=include)
