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
from ._distributed import consolidate
from ._objects import CONSOLIDATED
from .errors import CheckpointMismatchError, CorruptCheckpointError

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
        if isinstance(meta, dict) and "multistep_plan" in meta:  # parts at their own versions
            raise CheckpointMismatchError(
                f"checkpoint step {sel['step']} in {path} was written by mode='multistep' with "
                f"replay='torch': its optimizer's tensors reach that step only when restore() "
                f"replays them; restore it and save with mode='concurrent' to export")
        found.append((idx, meta))
    specs = [reader.checkpoints[idx]["tensors"] for reader, (idx, _) in zip(readers, found)]
    # The global tensors and where each rank's pieces go in them (C++
    # DcpGatherLayout, from the "shared" and FSDP2 "dtensor" tables): bad pieces
    # or sizes are one line before anything is allocated.
    layout, copies = _ext.core().dcp_gather_layout(
        _state.dumps(found[0][1].get("dist", {})),
        [(r, i, sp["name"], int(sp.get("global_offset", 0)), int(sp["nbytes"]))
         for r, table in enumerate(specs) for i, sp in enumerate(table)], path, sel["step"])
    whole = {name: torch.empty(shape, dtype=_state.torch_dtype(code))
             for name, shape, code in layout}
    total = sum(sp["nbytes"] for table in specs for sp in table)
    done = 0
    tensors, metas = [], []
    for r, (reader, (idx, meta)) in enumerate(zip(readers, found)):
        got, dests = _read.destinations(
            [None if sp["name"] in whole else sp for sp in specs[r]], False, None)
        for _, i, off, n in (c for c in copies if c[0] == r):
            dests[i] = (whole[specs[r][i]["name"]].data_ptr() + off, n)
        reader.read_into(idx, dests)
        done += sum(sp["nbytes"] for sp in specs[r])
        if progress is not None:
            progress(done, total)
        tensors.append({**whole, **got})
        metas.append(meta)
    return sel["step"], tensors, metas, set(whole)


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
    out: dict = {}
    # Which values are global, which each rank's (C++ DcpLayout: by rank 0's
    # "names", checked first, and its ZeRO optimizers' keys, "dist" "zero").
    for key, r, entries, is_zero in _ext.core().dcp_layout(
            [_state.dumps(m.get("state", {})) for m in metas], sorted(shared), names_json,
            _state.dumps(metas[0].get("dist", {}))):
        if is_zero:  # the consolidated state_dict, from every rank's shard
            held = {}
            try:
                tree = consolidate(key, metas, tensors, held)
            except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
                raise CorruptCheckpointError(
                    f"the ZeRO optimizer state {key!r} cannot be consolidated from the ranks' "
                    f"records ({type(e).__name__}: {e})") from None
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


def named(node, name: str = "", depth: int = 0) -> list:
    """(path 'model/fc.weight', tensor) for every tensor of layout()'s state."""
    if depth > _state.MAX_DEPTH:
        return []
    if isinstance(node, torch.Tensor):
        return [(name, node)]
    kids: list = []
    if isinstance(node, dict):
        kids = [(f"{name}/{k}" if name else str(k), v) for k, v in node.items()]
    elif isinstance(node, (list, tuple)):
        kids = [(f"{name}/{i}", v) for i, v in enumerate(node)]
    return [got for n, v in kids for got in named(v, n, depth + 1)]


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


def cli_run(call) -> int:
    """A `python -m` export entry the CLI runs (this one and _export's): its
    result in one line, or its error in one line with the CLI's exit codes
    (2: the arguments, 1: anything else)."""
    try:
        r = call()
    except Exception as e:  # noqa: BLE001 -- one line, as the CLI does
        print(f"nonstop export: {e}", file=sys.stderr)
        return 2 if isinstance(e, CheckpointMismatchError) else 1
    print(f"exported step {r['step']}: {r['tensors']} tensors, {r['bytes']} bytes to {r['path']}")
    return 0


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
