"""nonstop.export(dir, out, format="dcp"): a nonstop job directory as a
torch.distributed.checkpoint (DCP) checkpoint in get_state_dict's layout,
loadable under any world size (`python -m nonstop._dcp DIR OUT [--step N]`;
docs/DISTRIBUTED.md, "Interop with DCP"). One process reads every rank
file (gather), reassembles each global tensor and writes full tensors.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from typing import Optional

import torch

from . import _ext, _progress, _read, _state
from ._cli import cli_run
from ._distributed import consolidate
from ._objects import CONSOLIDATED
from .errors import CorruptCheckpointError

def gather(path: str, step: Optional[int] = None,
           progress=None) -> tuple[int, list, list, set]:
    """(step, [per rank: {name: tensor}], [per rank: metadata], names of the
    global tensors) of the newest checkpoint committed on every rank of
    `path` (or of `step`). A global tensor (replicated, or an FSDP2
    parameter or optimizer state) is reassembled whole, each piece read
    straight into its place (read_into), and every rank's dict holds that
    one tensor; `progress(done, total)` is told the bytes read after each rank."""
    readers = _read.readers(path)
    # The planner chooses (through the job directory's common selection): the
    # newest step every rank committed, of one run, that no rollback abandoned.
    sel = _ext.core().JobDir.open_for_read(path).select_common(len(readers), step=step)
    found = []  # per rank: (index, metadata)
    for r, sel_r in enumerate(sel["ranks"]):
        readers[r], idx = _read.chosen(path, sel_r, r, readers[r])
        meta = _state.loads(readers[r].checkpoints[idx]["meta_json"])
        _read.refuse_replayed(meta, f"checkpoint step {sel['step']} in {path}")
        found.append((idx, meta))
    doc = found[0][1].get("dist", {})
    shared = dict(doc.get("shared", {}))
    # FSDP2 Shard(0) DTensors: each rank wrote its rows with the same global
    # layout as a replicated share (_fsdp.py), so they reassemble the same way.
    for name, (shape, dtype, _) in doc.get("dtensor", {}).items():
        shared.setdefault(name, [shape, dtype])
    dtypes = {name: _meta_dtype(dtype, name, path) for name, (_, dtype) in shared.items()}
    specs = [reader.checkpoints[idx]["tensors"] for reader, (idx, _) in zip(readers, found)]
    # Where each rank's pieces go (C++, dist_lay_out_shared): a piece outside
    # its tensor, pieces that overlap or leave a gap, a size out of range are
    # one line before anything is allocated; each piece is read into its place.
    layout, _, copies = _ext.core().dist_lay_out_shared(
        [(n, s, d) for n, (s, d) in shared.items()],
        [(r, i, sp["name"], int(sp.get("global_offset", 0)), int(sp["nbytes"]))
         for r, table in enumerate(specs) for i, sp in enumerate(table)], True, path, sel["step"])
    whole = {name: torch.empty(shared[name][0], dtype=dtypes[name]) for name, _, _ in layout}
    base = {name: off for name, off, _ in layout}
    total = sum(sp["nbytes"] for table in specs for sp in table)
    done = 0
    tensors, metas = [], []
    for r, (reader, (idx, meta)) in enumerate(zip(readers, found)):
        got, dests = _read.destinations(
            [None if sp["name"] in shared else sp for sp in specs[r]], False, None)
        for _, i, off, n in (c for c in copies if c[0] == r):
            name = specs[r][i]["name"]
            dests[i] = (whole[name].data_ptr() + off - base[name], n)
        reader.read_into(idx, dests)
        done += sum(sp["nbytes"] for sp in specs[r])
        if progress is not None:
            progress(done, total)
        tensors.append({**whole, **got})
        metas.append(meta)
    return sel["step"], tensors, metas, set(shared)


def collect(path: str, step: Optional[int] = None) -> tuple[int, dict]:
    """(step, {name: full tensor}) of the newest checkpoint committed on
    every rank of `path` (or of `step`), by nonstop's tensor names; a
    rank-local tensor of a multi-rank job as `rank-R/NAME`."""
    got, tensors, _, shared = gather(path, step)
    out = {n: tensors[0][n] for n in shared}
    for r, mine in enumerate(tensors):
        for name, t in mine.items():
            if name not in shared:
                out[f"rank-{r}/{name}" if len(tensors) > 1 else name] = t
    return got, out


def layout(tensors: list, metas: list, shared: set) -> dict:
    """The state in get_state_dict's layout, {state key: value}; rank-local
    tensors under "rank-R" (docs/DISTRIBUTED.md, "Interop with DCP")."""
    names_json = _state.dumps(metas[0].get("names"))
    # From the file: a crafted one is a one-line error, never a raw AttributeError.
    _ext.core().check_export_names(names_json)
    names = metas[0].get("names") or {}
    zero = metas[0].get("dist", {}).get("zero", {}) if len(metas) > 1 else {}
    out: dict = {}
    # Which values are global, which each rank's (C++ DcpLayout).
    for key, r, entries, is_zero in _ext.core().dcp_layout(
            [_state.dumps(m.get("state", {})) for m in metas], sorted(shared),
            list(names.get("modules", {})), list(zero) if isinstance(zero, dict) else []):
        if is_zero:
            tree, held = _zero_consolidated(key, tensors, metas)
        else:
            tree, held = metas[max(r, 0)].get("state", {}).get(key), tensors[max(r, 0)]
            if entries is not None:
                tree = {k: tree[k] for k in entries}
        # Under get_state_dict's names (C++ DcpRename): a module's keys without
        # the wrapper prefix, an optimizer's state and param_groups by parameter FQN.
        renamed = _ext.core().dcp_rename(key, _state.dumps(tree), names_json)
        value = _state.unflatten(json.loads(renamed), held)
        if is_zero:
            value.pop(CONSOLIDATED, None)
        (out if r < 0 else out.setdefault(f"rank-{r}", {}))[key] = value
    return out


def _zero_consolidated(key: str, tensors: list, metas: list) -> tuple:
    """(tree, its tensors) of the consolidated state_dict (global parameter
    indices) of the ZeRO optimizer saved under `key`, from every rank's
    shard (_distributed.consolidate)."""
    scratch: dict = {}
    try:
        return consolidate(key, metas, tensors, scratch), scratch
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"the ZeRO optimizer state {key!r} cannot be consolidated from the ranks' records "
            f"({type(e).__name__}: {e})") from None


def named(state) -> list:
    """(path 'model/fc.weight', tensor) for every tensor of layout()'s state."""
    out: list = []

    def walk(node, name, depth):
        if depth > _state.MAX_DEPTH:
            return
        if isinstance(node, torch.Tensor):
            out.append((name, node))
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{name}/{k}" if name else str(k), depth + 1)
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{name}/{i}", depth + 1)

    walk(state, "", 0)
    return out


def export_dcp(dir: str, out: str, step: Optional[int] = None,
               progress: Optional[bool] = None) -> dict:
    """nonstop.export(format="dcp") (docs/DISTRIBUTED.md, "Interop with DCP"):
    the globally committed checkpoint (or `step`) of `dir` as a DCP directory
    `out`; progress as _progress.Progress's. Returns {'step', 'tensors', 'bytes', 'path'}."""
    import torch.distributed.checkpoint as dcp
    bar = _progress.Progress("nonstop export", progress)
    try:
        got_step, tensors, metas, shared = gather(os.fspath(dir), step, progress=bar)
    finally:
        bar.close()
    state = layout(tensors, metas, shared)
    distinct = {id(t): t for _, t in named(state)}  # each tensor object once
    count, nbytes = len(distinct), sum(t.numel() * t.element_size() for t in distinct.values())
    state["nonstop.step"] = torch.tensor(got_step, dtype=torch.int64)
    # The folder through the Env seam (made when missing, a symlink as its last
    # component refused); the files in it are written by torch's FileSystemWriter.
    _ext.core().Directory(os.path.abspath(out), create=True)
    kw = {}
    if "no_dist" in inspect.signature(dcp.save).parameters and not (
            torch.distributed.is_available() and torch.distributed.is_initialized()):
        kw["no_dist"] = True  # one process writes every tensor whole
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out), **kw)
    return {"step": got_step, "tensors": count, "bytes": nbytes, "path": out}


def _meta_dtype(name, tensor: str, path: str):
    """The torch dtype a checkpoint's metadata names, from _state's fixed list only."""
    dt = _state.torch_dtype_by_name(name)
    if dt is None:
        raise CorruptCheckpointError(
            f"{path}: the metadata of tensor {tensor!r} names dtype {str(name)[:40]!r}, which "
            f"is not one nonstop writes")
    return dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nonstop._dcp",
                                description="export a nonstop checkpoint as a DCP checkpoint")
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: on a terminal, for big exports)")
    a = p.parse_args(argv)
    return cli_run(lambda: export_dcp(a.dir, a.out, a.step, progress=a.progress))


if __name__ == "__main__":
    sys.exit(main())
